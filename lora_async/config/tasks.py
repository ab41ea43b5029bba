"""Task tables: [task] (union on `type`) and the [[adapters]] entries of a fleet."""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal, Union

from pydantic import Field, field_serializer, field_validator, model_validator
from pydantic_core.core_schema import SerializationInfo

from .sections import AdapterConfig, LoraConfig, SamplingConfig, Section


SPEC_RE = r"[A-Za-z_][\w.]*:[A-Za-z_][\w.]*"  # module.path:object (the object may be dotted)


class ArithmeticTask(Section):
    type: Literal["arithmetic"] = Field("arithmetic", description="'arithmetic': generated a op b problems.")
    digits: int = Field(1, ge=1, le=9, description="Digits per operand.")
    ops: list[Literal["+", "-", "*"]] = Field(["+"], min_length=1, description="Operations to draw from.")
    heldout: int = Field(200, ge=0, le=100_000, description="Held-out problems (never trained on).")
    template: str = Field("What is {a} {op} {b}?", description="Prompt template with {a}, {op}, {b}.")
    system_prompt: str | None = Field(None, description="System message (None = the model's default).")


class JsonlTask(Section):
    type: Literal["jsonl"] = Field("jsonl", description="'jsonl': prompts and answers from a JSONL file.")
    path: str = Field(..., description="JSONL file with one record per line (relative to the config file).")
    prompt_field: str = Field("prompt", description="Record field holding the prompt text.")
    answer_field: str = Field("answer", description="Record field holding the reference answer.")
    reward: str = Field(
        "exact", description="'exact', 'numeric', 'regex:<pattern>' or a user 'module:function'."
    )
    reward_timeout_s: float = Field(5.0, gt=0, le=3600, description="Per-call limit for user rewards.")
    heldout: int = Field(0, ge=0, description="Records at the end of the file held out for eval.")
    system_prompt: str | None = Field(None, description="System message (None = the model's default).")

    @field_validator("reward")
    @classmethod
    def _reward(cls, value: str) -> str:
        if value in ("exact", "numeric"):
            return value
        if value.startswith("regex:"):
            try:
                re.compile(value[len("regex:"):])
            except re.error as exc:
                raise ValueError(f"bad regex: {exc}") from exc
            return value
        if re.fullmatch(SPEC_RE, value):
            return value
        raise ValueError("must be 'exact', 'numeric', 'regex:<pattern>' or 'module:function'")


class EnvTask(Section):
    type: Literal["env"] = Field("env", description="'env': multi-turn episodes of a user or builtin environment.")
    env: str = Field(..., pattern=SPEC_RE,
                     description="'module:factory' called as factory(index, split) -> environment.")
    max_turns: int = Field(8, ge=1, le=1000, description="Model replies per episode at most (then it ends, reward 0).")
    heldout: int = Field(64, ge=0, le=100_000, description="Held-out episodes for evaluation (split 'eval').")
    reward: str | None = Field(None, pattern=SPEC_RE,
                               description="Optional 'module:function' scoring a finished episode by keywords "
                                           "(instead of the environment's reward).")
    reward_timeout_s: float = Field(5.0, gt=0, le=3600, description="Per-call limit for the user reward.")
    tool_timeout_s: float = Field(10.0, gt=0, le=3600, description="A tool call running longer is cut off.")
    env_timeout_s: float = Field(30.0, gt=0, le=3600, description="An environment reset or step running longer "
                                                                   "ends its episode.")
    tool_workers: int = Field(2, ge=1, le=64, description="Guarded processes running tool calls.")
    system_prompt: str | None = Field(None, description="System message (None = the model's default; a system "
                                                        "message from the environment wins).")


TaskConfig = Annotated[Union[ArithmeticTask, JsonlTask, EnvTask], Field(discriminator="type")]


def default_types(data: Any, **tags: str) -> Any:
    """Fill in a left-out `type` of the named tables (`task="arithmetic"`): a documented default,
    not a rewrite. Returns a copy; the caller's dict is left as it was."""
    if not isinstance(data, dict):
        return data
    missing = {key: tag for key, tag in tags.items()
               if isinstance(data.get(key), dict) and "type" not in data[key]}
    if not missing:
        return data
    return {**data, **{key: {"type": tag, **data[key]} for key, tag in missing.items()}}


class FleetAdapter(AdapterConfig):
    """One adapter of a fleet: its own task, reward, LoRA shape, learning rate, share and sampling."""

    task: TaskConfig = Field(..., description="This adapter's task and reward (type left out = arithmetic).")
    lora: LoraConfig | None = Field(None, description="LoRA shape (unset: the top-level [lora]).")
    lr: float | None = Field(None, gt=0.0, le=1.0, description="Learning rate (unset: learner.lr).")
    weight: float = Field(1.0, gt=0.0, le=1000.0, description="Share of generation capacity.")
    sampling: SamplingConfig = Field(
        default_factory=SamplingConfig,
        description="Sampling overrides: only the fields set here replace the top-level [sampling].",
    )

    @model_validator(mode="before")
    @classmethod
    def _default_task_type(cls, data: Any) -> Any:
        return default_types(data, task="arithmetic")

    @field_serializer("sampling")
    def _only_set_sampling(self, value: SamplingConfig, info: SerializationInfo) -> dict[str, Any]:
        # A dump must load back to the same run: fields the entry left out stay out.
        return value.model_dump(mode=info.mode, include=value.model_fields_set)
