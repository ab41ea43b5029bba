"""Task tables: [task] (union on `type`) and the [[adapters]] entries of a fleet."""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal, Union

from pydantic import AfterValidator, ConfigDict, Field, field_serializer, field_validator, model_validator
from pydantic_core.core_schema import SerializationInfo

from .games import OPPONENTS_TEXT, LeagueConfig, check_opponent
from .sections import AdapterConfig, LoraConfig, SamplingConfig, Section


SPEC_RE = r"[A-Za-z_][\w.]*:[A-Za-z_][\w.]*"  # module.path:object (the object may be dotted)
AUTO_WORKERS_CAP = 64  # the default pool of a reward or tool: the calls in flight, up to this many


def auto_workers(configured: int | None, in_flight: int) -> int:
    """Calls at once of a reward function or a tool: as configured, else one per completion or
    episode in flight (processes start on demand, so this is a cap, not a cost)."""
    return configured if configured is not None else max(1, min(AUTO_WORKERS_CAP, in_flight))


class ArithmeticTask(Section):
    type: Literal["arithmetic"] = Field("arithmetic", description="'arithmetic': generated a op b problems.")
    digits: int = Field(1, ge=1, le=9, description="Digits per operand.")
    ops: list[Literal["+", "-", "*"]] = Field(["+"], min_length=1, description="Operations to draw from.")
    heldout: int = Field(200, ge=0, le=100_000, description="Held-out problems (never trained on).")
    template: str = Field("What is {a} {op} {b}?", description="Prompt template with {a}, {op}, {b}.")
    system_prompt: str | None = Field(None, description="System message (None = the model's default).")


MAIN_SPEC_TEXT = ("a function in __main__ (a notebook cell, or the script itself) cannot be imported by the worker "
                  "processes: put it in a .py file beside the notebook and name it 'file:function'")


def check_reward_spec(value: str) -> str:
    """One reward: 'exact', 'numeric', 'code_tests', 'regex:<pattern>' or 'module:function'."""
    if value.startswith("__main__:"):
        raise ValueError(MAIN_SPEC_TEXT)
    if value in ("exact", "numeric", "code_tests"):
        return value
    if value.startswith("regex:"):
        try:
            re.compile(value[len("regex:"):])
        except re.error as exc:
            raise ValueError(f"bad regex: {exc}") from exc
        return value
    if re.fullmatch(SPEC_RE, value):
        return value
    raise ValueError(f"{value!r} must be 'exact', 'numeric', 'code_tests', 'regex:<pattern>' or 'module:function'")


def check_user_spec(value: str) -> str:
    if value.startswith("__main__:"):
        raise ValueError(MAIN_SPEC_TEXT)
    if not re.fullmatch(SPEC_RE, value):
        raise ValueError(f"{value!r} must be 'module:function'")
    return value


RewardSpec = Annotated[str, AfterValidator(check_reward_spec)]
UserSpec = Annotated[str, AfterValidator(check_user_spec)]


class RewardFields(Section):
    """What every task with user rewards shares: one or several functions, their weights, how
    many calls run at once, and the per-call limit."""

    reward_weights: list[float] | None = Field(
        None, description="One weight per reward function; the sample's reward is the weighted sum "
                          "(None = all 1.0).")
    reward_timeout_s: float = Field(5.0, gt=0, le=3600, description="Per-call limit for user rewards.")
    reward_workers: int | None = Field(
        None, ge=1, le=1024, description="Reward calls at once per function: worker processes of a plain "
                                         "function, concurrent calls of an async one (None = the completions "
                                         f"in flight, at most {AUTO_WORKERS_CAP}).")
    sandbox: Literal["namespaces", "process"] = Field(
        "namespaces", description="How model-written code runs (code tools, the code_tests reward): 'namespaces' "
                                  "(bwrap: new user, PID, network, IPC, UTS and cgroup namespaces, a read-only view of "
                                  "the interpreter only) or 'process' (rlimits and an audit hook only: weaker; for "
                                  "hosts that refuse namespaces).")

    def sandbox_env(self) -> dict[str, str]:
        """The environment that carries `sandbox` into the tool and reward workers."""
        from ..sandbox.runner import ISOLATION_ENV

        return {ISOLATION_ENV: self.sandbox}

    def reward_list(self) -> list[str]:
        reward: Any = getattr(self, "reward", None)
        if reward is None:
            return []
        return [reward] if isinstance(reward, str) else list(reward)

    @model_validator(mode="after")
    def _weights_match(self) -> "RewardFields":
        if self.reward_weights is not None and len(self.reward_weights) != len(self.reward_list()):
            raise ValueError(f"reward_weights has {len(self.reward_weights)} weights for "
                             f"{len(self.reward_list())} reward functions; give one weight per function")
        return self


class ProblemRewards(RewardFields):
    """A problem set scored against its reference answers: the rewards and the system prompt."""

    reward: Union[RewardSpec, list[RewardSpec]] = Field(
        "exact", description="'exact', 'numeric', 'code_tests' (the completion's last Python block against the "
                             "record's `tests`), 'regex:<pattern>' or a user 'module:function', or a list of them "
                             "(combined by reward_weights).")
    system_prompt: str | None = Field(None, description="System message (None = the model's default; a chat "
                                                        "prompt's own system message wins).")

    @field_validator("reward")
    @classmethod
    def _not_empty(cls, value: Any) -> Any:
        if isinstance(value, list) and not value:
            raise ValueError("give at least one reward function")
        return value


class JsonlTask(ProblemRewards):
    type: Literal["jsonl"] = Field("jsonl", description="'jsonl': prompts and answers from a JSONL file.")
    path: str = Field(..., description="JSONL file with one record per line (relative to the config file).")
    prompt_field: str = Field("prompt", description="Record field holding the prompt: text, or a list of chat "
                                                    "messages ({'role', 'content'}).")
    answer_field: str = Field("answer", description="Record field holding the reference answer.")
    heldout: int = Field(0, ge=0, description="Records at the end of the file held out for eval.")


class DatasetTask(ProblemRewards):
    """A Hugging Face dataset, read with the `datasets` library (the `tasks` extra)."""

    type: Literal["dataset"] = Field("dataset", description="'dataset': a Hugging Face dataset (the `datasets` "
                                                            "library; install lora-async[tasks]).")
    path: str = Field(..., description="A local parquet, JSON/JSONL or CSV file, a directory written by "
                                       "save_to_disk, or a hub id such as 'openai/gsm8k' (relative paths: to "
                                       "the config file).")
    name: str | None = Field(None, description="The dataset's configuration (a hub dataset's subset, e.g. 'main').")
    split: str = Field("train", description="The split to train on.")
    prompt_column: str = Field("prompt", description="Column holding the prompt: text, or a list of chat messages "
                                                     "({'role', 'content'}).")
    answer_column: str = Field("answer", description="Column holding the reference answer.")
    heldout_split: str | None = Field(None, description="A split to evaluate on (e.g. 'test'); never trained on.")
    heldout_share: float = Field(0.0, ge=0.0, lt=1.0, description="Share of the training split held out for "
                                                                  "evaluation instead (drawn by heldout_seed).")
    heldout_limit: int = Field(256, ge=1, le=1_000_000, description="Evaluate on at most this many held-out rows "
                                                                    "(the first ones).")
    heldout_seed: int = Field(0, ge=0, le=2**31 - 1, description="Seed of the held-out share's draw (kept apart "
                                                                 "from run.seed, so every seed evaluates alike).")

    @model_validator(mode="after")
    def _one_heldout(self) -> "DatasetTask":
        if self.heldout_split is not None and self.heldout_share > 0:
            raise ValueError("heldout_split and heldout_share: give one of them, not both")
        if self.heldout_split is not None and self.heldout_split == self.split:
            raise ValueError(f"heldout_split: {self.heldout_split!r} is the training split; use heldout_share "
                             "to hold out part of it")
        return self


class ReasoningGymDataset(Section):
    """One reasoning-gym dataset: its share of training problems, and its own settings."""

    model_config = ConfigDict(extra="allow", validate_assignment=True)  # the dataset's settings, as it names them

    weight: float = Field(1.0, gt=0.0, le=1000.0, description="Share of training problems (relative to the others).")

    @property
    def settings(self) -> dict[str, Any]:
        """The keys other than `weight`: passed to the dataset's config as they are."""
        return dict(self.model_extra or {})


class ReasoningGymTask(Section):
    """Procedural problems from reasoning-gym (the `tasks` extra), scored by its own scorers."""

    type: Literal["reasoning-gym"] = Field("reasoning-gym", description="'reasoning-gym': generated problems of "
                                                                        "reasoning-gym datasets (lora-async[tasks]).")
    datasets: dict[str, ReasoningGymDataset] = Field(
        ..., min_length=1, description="Dataset name -> {weight, and the dataset's own settings}, e.g. "
                                       "[task.datasets.chain_sum] weight = 1, min_terms = 2.")
    heldout: int = Field(200, ge=0, le=100_000, description="Held-out problems, drawn with their own seed.")
    heldout_seed: int = Field(1_000_003, ge=0, le=2**31 - 1,
                              description="Seed of the held-out problems (training problems use run.seed).")
    extract: Literal["last_line", "tag", "full"] = Field(
        "last_line", description="What the scorer reads: the completion's last non-empty line (a labelled line, "
                                 "'The answer is 7.', gives what follows the label, without the final period), the "
                                 "text inside the last <tag>...</tag>, or the whole completion.")
    tag: str = Field("answer", pattern=r"^[A-Za-z][\w-]*$", description="The tag extract='tag' reads.")
    system_prompt: str | None = Field(None, description="System message (None = one that asks for the answer in "
                                                        "the form `extract` reads).")
    reward_timeout_s: float = Field(5.0, gt=0, le=3600, description="Per-call limit of a scorer.")


class ToolLatency(Section):
    """A simulated remote tool: each call waits a lognormal delay before it runs (benchmarks only)."""

    median_s: float = Field(..., ge=0, le=3600, description="Median delay per tool call, in seconds.")
    sigma: float = Field(1.0, ge=0, le=5, description="Spread of the lognormal (0 = always the median).")
    seed: int = Field(0, ge=0, le=2**31 - 1, description="Seed of the delays (each call draws the next one).")


class EnvTask(RewardFields):
    type: Literal["env"] = Field("env", description="'env': multi-turn episodes of a user or builtin environment.")
    env: UserSpec = Field(..., description="'module:factory' called as factory(index, split) -> environment.")
    max_turns: int = Field(8, ge=1, le=1000, description="Model replies per episode at most (then it ends, reward 0).")
    heldout: int = Field(64, ge=0, le=100_000, description="Held-out episodes for evaluation (split 'eval').")
    reward: Union[UserSpec, list[UserSpec], None] = Field(
        None, description="Optional 'module:function' (or a list, combined by reward_weights) scoring a finished "
                          "episode by keywords (instead of the environment's reward).")
    tool_timeout_s: float = Field(10.0, gt=0, le=3600, description="A tool call running longer is cut off.")
    env_timeout_s: float = Field(30.0, gt=0, le=3600, description="An environment reset or step running longer "
                                                                   "ends its episode.")
    tool_workers: int | None = Field(
        None, ge=1, le=1024, description="Calls at once per tool: worker processes of a plain tool, concurrent "
                                         f"calls of an async one (None = the episodes in flight, at most "
                                         f"{AUTO_WORKERS_CAP}).")
    system_prompt: str | None = Field(None, description="System message (None = the model's default; a system "
                                                        "message from the environment wins).")
    tool_latency: ToolLatency | None = Field(
        None, description="SIMULATION for benchmarks: add a lognormal delay to every tool call, as a remote sandbox "
                          "or web API would ({median_s, sigma}); off by default.")
    seat: str = Field("alternate", pattern=r"^[A-Za-z0-9_-]{1,64}$",
                      description="A game's seat this adapter plays: a seat's name, or 'alternate' (game i plays "
                                  "seat i mod the seats; a group's games share one).")
    opponents: Annotated[str, AfterValidator(check_opponent)] = Field(
        "self", description=f"Who plays a game's other seats: {OPPONENTS_TEXT}.")
    eval_opponents: list[Annotated[str, AfterValidator(check_opponent)]] | None = Field(
        None, min_length=1, max_length=16,
        description="A game's held-out opponents: win, draw and loss rates against each; accuracy is the win rate "
                    "against the first (None: 'self@v0', then every scripted player of the game).")
    league: LeagueConfig = Field(default_factory=LeagueConfig,
                                 description="opponents = 'league': the pool of this adapter's past versions.")

    @property
    def kept_versions(self) -> int:
        """Frozen versions this task keeps registered in the engine at most if it is a game (LoRA
        slots beyond the staleness window): the league's pool and its anchor, and each pinned
        `<adapter>@v<k>` (the default held-out opponent `self@v0` counts one). Whether it is a
        game is known once its factory runs: `envs.games.kept_versions`."""
        league = self.league.size + 1 if self.opponents == "league" else 0
        named = [self.opponents, *(self.eval_opponents or ["self@v0"])]
        pinned = {o for o in named if "@v" in o} - ({"self@v0"} if league else set())
        return league + len(pinned)


TaskConfig = Annotated[Union[ArithmeticTask, JsonlTask, DatasetTask, ReasoningGymTask, EnvTask],
                       Field(discriminator="type")]
ProblemTask = Union[ArithmeticTask, JsonlTask, DatasetTask, ReasoningGymTask]  # the single-turn ones


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
