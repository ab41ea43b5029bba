"""The adapter store: versioned PEFT directories under `OUT/adapters/<name>/v<k>/`."""

from .store import AdapterStore, load_peft_dir, save_peft_dir

__all__ = ["AdapterStore", "load_peft_dir", "save_peft_dir"]
