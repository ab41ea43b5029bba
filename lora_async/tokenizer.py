"""`Tokenizer`: what lora-async asks of a tokenizer, typed as transformers types it.

A Hugging Face tokenizer (`PreTrainedTokenizerBase`, vLLM's own wrapper of one) satisfies it, and
so does a test's fake. transformers types the answers of `decode` and `apply_chat_template` for
every form they take (a batch, a `BatchEncoding`); `text_of`, `chat_text` and `token_ids` take the
one form a single sequence gives, and say so if a tokenizer gave another.
"""

from __future__ import annotations

from typing import Any, Mapping, Protocol

Encoded = str | list[int] | list[str] | list[list[int]] | Mapping[str, list[int]]  # what a chat template gives


class Tokenizer(Protocol):
    def __call__(self, text: str, *, add_special_tokens: bool = ...) -> Mapping[str, list[int]]: ...

    def apply_chat_template(self, conversation: list[dict[str, Any]], *, add_generation_prompt: bool = ...,
                            tokenize: bool = ..., **kwargs: Any) -> Encoded: ...

    def decode(self, token_ids: list[int], skip_special_tokens: bool = ...) -> str | list[str]: ...

    def batch_decode(self, sequences: list[list[int]], skip_special_tokens: bool = ...) -> list[str]: ...


def text_of(decoded: str | list[str] | Encoded) -> str:
    """The text of one sequence, as `decode` or `apply_chat_template(tokenize=False)` gives it."""
    if not isinstance(decoded, str):
        raise TypeError(f"the tokenizer gave {type(decoded).__name__} for one sequence, not its text")
    return decoded


def chat_text(tokenizer: Tokenizer, messages: list[dict[str, Any]], generation_prompt: bool, **kwargs: Any) -> str:
    """The chat template's text of `messages` (`kwargs`: the template's other inputs, e.g. `tools`)."""
    return text_of(tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt,
                                                 **kwargs))


def token_ids(encoded: Encoded) -> list[int]:
    """The token ids of one sequence: the list itself, or a `BatchEncoding`'s `input_ids`."""
    ids = encoded["input_ids"] if isinstance(encoded, Mapping) else encoded
    checked = [i for i in ids if isinstance(i, int)]
    if isinstance(ids, str) or len(checked) != len(ids):
        raise TypeError(f"the tokenizer gave {type(ids).__name__} for one sequence, not its token ids")
    return checked
