"""Child process that runs a user reward function: JSON lines in, JSON lines out.

Kept free of torch/vLLM imports so it starts in well under a second.
"""

from __future__ import annotations

import importlib
import json
import sys
import traceback


def main(spec: str) -> None:
    out = sys.stdout
    try:
        module_name, func_name = spec.split(":", 1)
        fn = getattr(importlib.import_module(module_name), func_name)
        if not callable(fn):
            raise TypeError(f"{spec} is not callable")
    except Exception as exc:
        out.write(json.dumps({"ready": False, "error": f"{type(exc).__name__}: {exc}"}) + "\n")
        out.flush()
        return
    out.write(json.dumps({"ready": True}) + "\n")
    out.flush()
    for line in sys.stdin:
        job = json.loads(line)
        try:
            reply = {"r": float(fn(job["p"], job["c"], job["a"]))}
        except Exception as exc:
            last = traceback.extract_tb(exc.__traceback__)[-1]
            reply = {"error": f"{type(exc).__name__}: {exc} ({last.filename}:{last.lineno})"}
        out.write(json.dumps(reply) + "\n")
        out.flush()


if __name__ == "__main__":
    main(sys.argv[1])
