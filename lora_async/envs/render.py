"""Chat rendering as token deltas: the opening prompt, then what each environment answer adds.

Generation is token-in, token-out. The context of the next turn is the context so far, plus the
reply's token ids exactly as sampled, plus a *delta*: the end of the assistant message (what the
chat template writes after the reply, less the end-of-turn token if the model sampled it), the
environment's messages, and the next assistant header. Nothing already in the context is
re-tokenised, so the trained tokens are exactly the ones vLLM sampled.

The delta is found by rendering a fixed two-message conversation with and without the new
messages and keeping what the template adds; templates that render earlier turns differently
once later turns exist (some drop old reasoning) do not matter, since old turns are never
rendered again.

Tools reach the model through the template's own `tools=` support. Where the template has none
(the embedded SmolLM2's), the fallback is documented in `tools.fallback_tool_prompt`: the tool
descriptions go into the system message, and calls are written as
`<tool_call>{"name": ..., "arguments": ...}</tool_call>`. Tool results are `tool` messages; a
template that refuses that role gets them as user messages in `<tool_response>` tags.
"""

from __future__ import annotations

from ..tokenizer import Tokenizer, chat_text, text_of
from .base import Message

ANCHOR = [{"role": "user", "content": "ping"}, {"role": "assistant", "content": "PONG"}]
REPLY_MARK = "PONG"  # the anchor reply: what follows it in the rendering ends an assistant message
PLAIN_HEADER = "assistant: "  # tokenizers without a chat template: "role: content" lines


class ChatRenderer:
    """Renders one task's conversations for one tokenizer (shared by all its episodes)."""

    def __init__(self, tokenizer: Tokenizer, tool_schemas: list[dict], system_prompt: str | None) -> None:
        from .tools import fallback_tool_prompt, template_supports_tools

        self.tokenizer = tokenizer
        self.templated = bool(getattr(tokenizer, "chat_template", None))
        self.schemas = tool_schemas
        self.native_tools = bool(tool_schemas) and self.templated and template_supports_tools(tokenizer, tool_schemas)
        self.tool_prompt = fallback_tool_prompt(tool_schemas) if tool_schemas and not self.native_tools else None
        self.system_prompt = system_prompt
        self.tool_role = self._accepts_tool_role()
        self.eos_ids = self._eos_ids()
        base = self._text(ANCHOR, generation_prompt=False)
        self._anchor_len = len(base)
        self.reply_suffix = base[base.rindex(REPLY_MARK) + len(REPLY_MARK):] if self.templated else "\n"

    # ---------------------------------------------------------------- what episodes call
    def opening(self, messages: list[Message]) -> list[int]:
        """Token ids of the opening messages, ending where the first reply starts."""
        return self._ids(self._text(self.with_system(messages), generation_prompt=True))

    def delta(self, messages: list[Message], reply_ids: list[int]) -> list[int]:
        """Token ids that follow a reply (`reply_ids`, as sampled): the end of the assistant
        message, `messages`, and the next assistant header."""
        full = self._text(ANCHOR + [self.as_sent(m) for m in messages], generation_prompt=True)
        added = full[self._anchor_len:]
        closing = self.reply_suffix
        if reply_ids and reply_ids[-1] in self.eos_ids:  # the model wrote the end-of-turn token itself
            eos_text = text_of(self.tokenizer.decode([reply_ids[-1]], skip_special_tokens=False))
            if closing.startswith(eos_text):
                closing = closing[len(eos_text):]
        return self._ids(closing + added)

    def with_system(self, messages: list[Message]) -> list[Message]:
        """The opening with the system message in place: the environment's own, else the task's;
        the fallback tool descriptions are added to it."""
        messages = [dict(m) for m in messages]
        has_system = bool(messages) and messages[0].get("role") == "system"
        if not has_system and (self.system_prompt is not None or self.tool_prompt is not None):
            messages.insert(0, {"role": "system", "content": self.system_prompt or ""})
            has_system = True
        if self.tool_prompt is not None and has_system:
            text = messages[0].get("content") or ""
            messages[0]["content"] = f"{text}\n\n{self.tool_prompt}".strip()
        return messages

    def as_sent(self, message: Message) -> Message:
        """A tool result as this template takes it (a user message if it has no tool role)."""
        if message.get("role") == "tool" and not self.tool_role:
            return {"role": "user", "content": f"<tool_response>\n{message.get('content', '')}\n</tool_response>"}
        return message

    # ---------------------------------------------------------------- plumbing
    def _text(self, messages: list[Message], generation_prompt: bool) -> str:
        if not self.templated:
            lines = "".join(f"{m['role']}: {m.get('content', '')}\n" for m in messages)
            return lines + (PLAIN_HEADER if generation_prompt else "")
        extra = {"tools": self.schemas} if self.native_tools else {}
        return chat_text(self.tokenizer, messages, generation_prompt, **extra)

    def _ids(self, text: str) -> list[int]:
        if self.templated:
            return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])
        return list(self.tokenizer(text)["input_ids"])

    def _accepts_tool_role(self) -> bool:
        if not self.templated:
            return True
        try:
            self._text(ANCHOR + [{"role": "tool", "content": "1"}], generation_prompt=True)
        except Exception:
            return False
        return True

    def _eos_ids(self) -> set[int]:
        ids = {getattr(self.tokenizer, "eos_token_id", None)}
        return {i for i in ids if isinstance(i, int)}
