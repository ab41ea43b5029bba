"""The TRL run of the peer benchmark: Hugging Face TRL's `GRPOTrainer` with a peft LoRA on
lora-async's task, started by run.py (one process per generation mode it tries).

    python bench/peers/trl_child.py --run-dir DIR --config CONFIG --budget S --mode MODE

Same base model, LoRA shape, training problems (system prompt via the chat template, checked
token for token against lora-async's rendering), reward, prompts per step, samples per prompt,
completion length, temperature, top_p and lr as the lora-async config; every other setting is
TRL's default unless `--trl-arg KEY=VALUE` overrides it. Writes into DIR:

- `metrics.jsonl`: one lora-async-format step row per optimizer step (wall_s excludes saves);
- `adapters/step-NNNNN/` and `snapshots.jsonl`: the adapter every `--save-every` steps, stamped
  with the training wall-clock (eval_child.py scores them afterwards);
- `trl_log.jsonl` (TRL's own per-step logs), `trl_config.json` (the settings that ran);
- `FIRST_BATCH`, once the first batch is generated and scored: run.py's sign that the mode works.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, TextIO

MODES = ("colocate", "server", "transformers")  # TRL's vLLM modes, then plain `generate`
ADAPTER = "main"  # the adapter name in metrics rows: lora-async's name for a single adapter
FIRST_BATCH = "first_batch_scored"
DATASET_SIZE = 4096  # training problems listed up front: more than a 300 s budget reaches
KEPT_EXAMPLES = 2  # completions kept per step row, for reading the log


@dataclass
class BatchTally:
    """What the reward function saw since the last optimizer step."""

    rewards: list[float] = field(default_factory=list)
    tokens: int = 0
    examples: list[tuple[str, str]] = field(default_factory=list)
    scored_at: float | None = None  # when the step's batch was first scored (generation ended)

    def clear(self) -> None:
        self.rewards, self.tokens, self.examples, self.scored_at = [], 0, [], None


class StepRecorder:
    """TrainerCallback hooks: stop at the budget, write lora-async step rows, save the adapter.

    Mixed into TRL's `TrainerCallback` by `recorder_callback` (transformers is imported lazily)."""

    def __init__(self, run_dir: Path, budget_s: float, save_every: int, mode: str, tally: BatchTally,
                 metrics: TextIO, snapshots: TextIO, trl_log: TextIO) -> None:
        self.run_dir, self.budget_s, self.save_every, self.mode = run_dir, budget_s, save_every, mode
        self.tally = tally
        self.metrics, self.snapshots, self.trl_log = metrics, snapshots, trl_log
        self.t0 = 0.0
        self.step_began = 0.0
        self.paused = 0.0  # seconds spent saving adapters: not training time
        self.tokens_total = 0
        self.last_saved = -1

    def wall(self) -> float:
        return time.perf_counter() - self.t0 - self.paused

    def save(self, model: Any, step: int, when: str) -> None:
        began = time.perf_counter()
        wall = self.wall()
        path = self.run_dir / "adapters" / f"step-{step:05d}"
        model.save_pretrained(str(path))
        self.snapshots.write(json.dumps({"step": step, "wall_s": round(wall, 3), "when": when,
                                         "path": str(path.resolve())}) + "\n")
        self.last_saved = step
        self.paused += time.perf_counter() - began

    def on_train_begin(self, args: Any, state: Any, control: Any, model: Any = None, **kw: Any) -> None:
        import psutil

        # What a user waited for before training began (imports, model load), as lora-async records it.
        startup_s = round(time.time() - psutil.Process().create_time(), 2)
        self.metrics.write(json.dumps({"kind": "start", "startup_s": startup_s, "resumed": False}) + "\n")
        self.t0 = time.perf_counter()
        self.save(model, 0, "start")

    def on_step_begin(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
        self.step_began = time.perf_counter()

    def on_step_end(self, args: Any, state: Any, control: Any, model: Any = None, **kw: Any) -> None:
        now, wall, tally = time.perf_counter(), self.wall(), self.tally
        self.tokens_total += tally.tokens
        # generation (+ scoring) = step start -> rewards computed; the rest is TRL's training step
        gen_s = tally.scored_at - self.step_began if tally.scored_at is not None else None
        learn_s = now - tally.scored_at if tally.scored_at is not None else None
        rewards = tally.rewards
        row = {"step": state.global_step, "global_step": state.global_step, "adapter": ADAPTER,
               "version": state.global_step, "wall_s": round(wall, 3),
               "reward_mean": statistics.fmean(rewards) if rewards else None,
               "reward_std": statistics.pstdev(rewards) if len(rewards) > 1 else 0.0,
               "samples": len(rewards), "tokens_generated": tally.tokens,
               "tokens_generated_total": self.tokens_total, "examples": tally.examples,
               "gen_s": gen_s, "learner_s": learn_s, "trl_mode": self.mode}
        self.metrics.write(json.dumps(row) + "\n")
        print(f"step {state.global_step:>4}  reward {row['reward_mean'] or 0:.3f}  wall {wall:.1f}s  "
              f"{self.tokens_total / max(wall, 1e-9):.0f} tok/s  generation {gen_s or 0:.1f}s  "
              f"training {learn_s or 0:.1f}s", flush=True)
        tally.clear()
        out_of_time = wall >= self.budget_s
        if out_of_time:
            control.should_training_stop = True
        if out_of_time or state.global_step % self.save_every == 0:
            self.save(model, state.global_step, "end" if out_of_time else "periodic")

    def on_log(self, args: Any, state: Any, control: Any, logs: Any = None, **kw: Any) -> None:
        self.trl_log.write(json.dumps({"step": state.global_step, **(logs or {})}, default=str) + "\n")

    def on_train_end(self, args: Any, state: Any, control: Any, model: Any = None, **kw: Any) -> None:
        if self.last_saved != state.global_step:
            self.save(model, state.global_step, "end")


def recorder_callback(*args: Any) -> Any:
    """A `StepRecorder` that is a transformers `TrainerCallback` (which the Trainer requires)."""
    from transformers import TrainerCallback

    return type("BudgetAndSnapshots", (StepRecorder, TrainerCallback), {})(*args)


def messages(task: Any, text: str) -> list[dict[str, str]]:
    """A problem as a TRL conversational prompt (the chat template adds the system prompt)."""
    msgs = [{"role": "user", "content": text}]
    if task.system_prompt is not None:
        msgs.insert(0, {"role": "system", "content": task.system_prompt})
    return msgs


def make_reward(task: Any, tally: BatchTally, first_batch: Path) -> Callable[..., list[float]]:
    """lora-async's reward (`task.rewards`) as a TRL reward function; it also tallies the batch.

    The batch's completions are scored at once, one group per problem and the groups
    concurrently, as lora-async scores a step's groups: what a TRL user with a slow reward (a
    sandbox, a judge) writes, an async batched function that gathers its calls. A step then
    waits for its slowest call, not for the sum of them."""
    from lora_async.tasks import Problem

    async def score(texts: list[str], answers: list[str]) -> list[float]:
        groups: dict[str, list[int]] = {}
        for i, want in enumerate(answers):
            groups.setdefault(want, []).append(i)
        scored = await asyncio.gather(*(task.rewards.score(Problem(-1, "", want).batch([texts[i] for i in where]))
                                        for want, where in groups.items()))
        out = [0.0] * len(texts)
        for where, scores in zip(groups.values(), scored):
            for i, value in zip(where, scores.rewards):
                out[i] = value
        return out

    # TRL names the reward in its logs after the function: `arithmetic`, as before the split.
    def arithmetic(prompts: list, completions: list, completion_ids: list, answer: list, **_: Any) -> list[float]:
        texts = [c[-1]["content"] if isinstance(c, list) else c for c in completions]
        out = asyncio.run(score(texts, list(answer)))
        for text, want in list(zip(texts, answer))[:max(0, KEPT_EXAMPLES - len(tally.examples))]:
            tally.examples.append((text, want))
        tally.rewards.extend(out)
        tally.tokens += sum(len(ids) for ids in completion_ids)
        if tally.scored_at is None:
            tally.scored_at = time.perf_counter()
        if not first_batch.exists():  # the parent's probe: this generation mode produced a batch
            first_batch.write_text(f"{time.time()}\n")
        return out

    return arithmetic


def parse_value(raw: str) -> Any:
    """A `--trl-arg` value: JSON if it parses, else the string itself."""
    try:
        return json.loads(raw)
    except json.JSONDecodeError:
        return raw


def grpo_settings(cfg: Any, a: argparse.Namespace) -> dict[str, Any]:
    """GRPOConfig fields: the lora-async config's batch shape and sampling, TRL's defaults else."""
    import torch

    from lora_async.dtypes import resolve_dtype

    sampling = cfg.sampling
    prompts_per_step = cfg.learner.groups_per_step
    settings: dict[str, Any] = dict(
        output_dir=str(a.run_dir / "trainer"),
        learning_rate=cfg.learner.lr,
        num_generations=sampling.samples_per_prompt,
        per_device_train_batch_size=prompts_per_step * sampling.samples_per_prompt,  # completions per step
        gradient_accumulation_steps=1,  # one optimizer step per generation batch, like lora-async
        max_completion_length=sampling.max_new_tokens,
        temperature=sampling.temperature,
        top_p=sampling.top_p,
        max_steps=1_000_000,  # the wall-clock budget stops it (linear lr decay over 1e6 steps: ~constant)
        save_strategy="no",  # adapters are saved by StepRecorder
        report_to="none",
        logging_steps=1,  # logging only: TRL's per-step figures (incl. its timings) go to trl_log.jsonl
    )
    if not torch.cuda.is_available():
        settings["use_cpu"] = True  # TRL's default bf16=True needs it on CPU (transformers' check)
        # Matched precision: lora-async's learner computes in bf16 only where the CPU has it natively
        # (emulated bf16 is ~4x slower); TRL's default bf16 autocast would pay the emulation.
        settings["bf16"] = resolve_dtype(cfg.learner.dtype, "cpu") == "bfloat16"
    settings["seed"] = cfg.run.seed  # a matched setting: the benchmark repeats each system over seeds
    if a.mode in ("colocate", "server"):
        settings.update(use_vllm=True, vllm_mode=a.mode)
    for item in a.trl_arg:
        key, raw = item.split("=", 1)
        settings[key] = parse_value(raw)
    return settings


def peft_lora(cfg: Any) -> Any:
    """A peft LoraConfig of the lora-async config's shape."""
    from peft import LoraConfig

    lora = cfg.lora
    targets = lora.target_modules if isinstance(lora.target_modules, list) else "all-linear"
    return LoraConfig(r=lora.rank, lora_alpha=lora.alpha, target_modules=targets, lora_dropout=lora.dropout,
                      bias="none", task_type="CAUSAL_LM")


def check_prompt_tokens(tokenizer: Any, task: Any, problem: Any) -> list[int]:
    """TRL renders conversational prompts with the same chat template call as lora-async: check
    it token for token on one problem; returns the tokens."""
    from lora_async.tasks import render_prompt

    trl_ids = list(tokenizer.apply_chat_template(conversation=[messages(task, problem.prompt)],
                                                 add_generation_prompt=True, tokenize=True,
                                                 return_dict=True)["input_ids"][0])
    ours = render_prompt(tokenizer, problem.prompt, task.system_prompt)
    if trl_ids != ours:
        raise SystemExit(f"error: TRL's prompt tokens differ from lora-async's: {trl_ids} vs {ours}")
    return ours


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--run-dir", type=Path, required=True)
    p.add_argument("--config", required=True, help="the lora-async config the benchmark runs")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="lora-async config override")
    p.add_argument("--budget", type=float, default=300.0, help="training wall-clock seconds")
    p.add_argument("--mode", choices=MODES, default="transformers", help="TRL's generation mode")
    p.add_argument("--save-every", type=int, default=1, help="save the adapter every N steps")
    p.add_argument("--trl-arg", action="append", default=[], metavar="KEY=VALUE",
                   help="GRPOConfig override (value parsed as JSON)")
    p.add_argument("--dataset-size", type=int, default=DATASET_SIZE)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    a = parse_args(argv)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    from lora_async.config import load_config
    from lora_async.models import resolve_model
    from lora_async.tasks import make_task

    cfg = load_config(a.config, a.set)
    if cfg.adapters is not None:
        raise SystemExit("error: the peer benchmark takes a single-adapter config (no [[adapters]])")
    run_dir: Path = a.run_dir
    model_dir = resolve_model(cfg.model.name)
    # a step's completions scored at once, as lora-async's pool scores a step's groups
    task = make_task(cfg.task, cfg.run.seed, in_flight=cfg.learner.groups_per_step * cfg.sampling.samples_per_prompt)
    # lora-async's training stream: train_problem(0), train_problem(1), ... (held-out never drawn).
    problems = [task.train_problem(i) for i in range(a.dataset_size)]
    dataset = Dataset.from_list([{"prompt": messages(task, p.prompt), "answer": p.answer} for p in problems])
    tally = BatchTally()
    peft_config = peft_lora(cfg)
    args = GRPOConfig(**grpo_settings(cfg, a))
    with open(run_dir / "metrics.jsonl", "a", buffering=1) as metrics, \
            open(run_dir / "snapshots.jsonl", "a", buffering=1) as snapshots, \
            open(run_dir / "trl_log.jsonl", "a", buffering=1) as trl_log:
        recorder = recorder_callback(run_dir, a.budget, a.save_every, a.mode, tally, metrics, snapshots, trl_log)
        trainer = GRPOTrainer(model=str(model_dir), reward_funcs=make_reward(task, tally, run_dir / FIRST_BATCH),
                              args=args, train_dataset=dataset, peft_config=peft_config, callbacks=[recorder])
        ours = check_prompt_tokens(trainer.processing_class, task, problems[0])
        (run_dir / "trl_config.json").write_text(json.dumps(
            {"mode": a.mode, "model": str(model_dir), "peft": peft_config.to_dict(), "prompt_ids_match": True,
             "prompt_example": trainer.processing_class.decode(ours), "grpo": args.to_dict()},
            indent=2, default=str))
        trainer.train()


if __name__ == "__main__":  # TRL's vLLM modes spawn processes that re-import this module
    main()
