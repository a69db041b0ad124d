"""One training run of one method and seed through the TRL trainer, into a run directory.

Run directory layout (what ``hdreplay report`` and the comparison summary read):
    run.json          method, seed, task and every setting
    train_log.jsonl   TRL's log entries, one per step (reward, entropy, loss, replay/* ...)
                      plus ``wall_s`` (seconds since training started) and ``step_s``
    replay/           steps.jsonl, groups.jsonl (replay methods only)
    fresh_groups.jsonl  per step, the rewards of every fresh group (ingress analysis; see rewardlog.py)
    trl/runs/         TensorBoard event files written through TRL's report_to
    metrics.json      held-out Mean@n / Best@n per benchmark, macro and weighted averages,
                      mean step time and the run's costs: fresh responses generated (dynamic sampling's
                      discarded ones included), rows re-scored under the current policy to select, rows and
                      groups replayed (sums over the steps of train_log.jsonl)
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable

from ..env import offline_env
from .methods import Method
from .tasks import Task


@dataclass
class RunSpec:
    """Every setting of one run (also written to run.json)."""

    task: str
    method: str
    seed: int
    steps: int = 200
    prompts_per_step: int = 16  # b
    generations: int = 8  # n
    lr: float = 1e-4
    eval_n: int = 8
    #: every ReplayConfig knob of the run (selector and k_rep included), as CompareConfig.replay_config gives them
    replay: dict = field(default_factory=dict)
    extra: dict = field(default_factory=dict)


def _train_problems(spec: RunSpec, method: Method, task: Task):
    """Twice the prompts the run visits (no prompt repeats), or ``extra["train_pool"]`` distinct problems that TRL's
    sampler cycles through in epochs (RePO replays only prompts it has seen twice before)."""
    pool = spec.extra.get("train_pool")
    if pool is not None:
        return task.train_problems(pool, seed=spec.seed)
    return task.train_problems(max(spec.steps * method.fresh_groups(spec.prompts_per_step) * 2, 256), seed=spec.seed)


def trainer_args(spec: RunSpec, method: Method, task: Task, run_dir: Path):
    """The run's HDRGRPOConfig: the sandbox's TRL settings plus one ``replay_<knob>`` per entry of ``spec.replay``."""
    offline_env()
    from hdreplay.config import knobs
    from hdreplay.integrations.trl import HDRGRPOConfig

    b, n = method.fresh_groups(spec.prompts_per_step), spec.generations
    if getattr(task, "is_multiturn", False):
        width = 56 * task.max_tool_calls + 16
    elif hasattr(task, "completion_width"):  # geo: "[" answer "]" EOS
        width = task.completion_width(_train_problems(spec, method, task))
    else:
        width = max(len(p.answer) for p in _train_problems(spec, method, task)) + 2
    replay = {f"replay_{k.name}": spec.replay[k.name] for k in knobs() if k.name in spec.replay}
    return HDRGRPOConfig(
        output_dir=str(run_dir / "trl"), use_cpu=True, bf16=False, activation_checkpointing=False,
        report_to=["tensorboard"], logging_steps=1, save_strategy="no", max_steps=spec.steps,
        per_device_train_batch_size=b * n, gradient_accumulation_steps=1, num_generations=n,
        max_completion_length=width, temperature=1.0, learning_rate=spec.lr, lr_scheduler_type="constant",
        warmup_steps=0, loss_type=method.loss_type, epsilon_high=method.epsilon_high, beta=0.0, seed=spec.seed,
        disable_tqdm=True, disable_dropout=True, dataloader_num_workers=0,
        **{"replay_diagnose_ungated": False, **replay}, replay_diagnostics_dir=str(run_dir / "replay"),
        replay_dynamic_sampling=method.dynamic_sampling, replay_repo=dict(method.repo) if method.repo else None,
        max_tool_calling_iterations=getattr(task, "max_tool_calls", None),
    )


def build_trainer(spec: RunSpec, method: Method, task: Task, model_dir: Path, run_dir: Path, callbacks=()):
    offline_env()
    from datasets import Dataset

    from hdreplay.integrations.trl import HDRGRPOTrainer
    from .model import load_model

    model, tok = load_model(model_dir)
    problems = _train_problems(spec, method, task)
    if getattr(task, "is_multimodal", False):  # conversational prompts + an image column, as TRL's VLM path reads
        ds = task.dataset(problems)
    else:
        ds = Dataset.from_dict({"prompt": [p.prompt for p in problems], "answer": [p.answer for p in problems]})
    env_kwargs = {}
    if getattr(task, "is_multiturn", False):  # TRL's own environment mechanism drives the tool calls
        from .search import SearchEnv, install_chat_format

        install_chat_format(tok)
        SearchEnv.latency_s = float(spec.extra.get("latency_s", 0.0))
        env_kwargs = {"environment_factory": SearchEnv}
        ds = ds.add_column("question", [p.question for p in problems])
    from .rewardlog import FILE, GroupRewardLog

    reward = GroupRewardLog(task.reward_func(), run_dir / FILE, spec.generations)  # for the ingress analysis
    trainer = HDRGRPOTrainer(model=model, reward_funcs=reward, args=trainer_args(spec, method, task, run_dir),
                             train_dataset=ds, processing_class=tok, callbacks=list(callbacks), **env_kwargs)
    # the comparison shows one progress bar; the per-step log dicts go to train_log.jsonl and TensorBoard
    from transformers.trainer_callback import PrinterCallback

    trainer.remove_callback(PrinterCallback)
    return trainer


def run_one(spec: RunSpec, method: Method, task: Task, model_dir: Path, run_dir: Path,
            on_step: Callable[[int], None] | None = None) -> dict:
    """Train, evaluate, and write the run directory; returns metrics.json's content."""
    import torch

    from hdreplay.integrations.trl.callback import HDRLogCallback

    from .evaluate import evaluate

    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "fresh_groups.jsonl").unlink(missing_ok=True)  # a re-run starts its reward log afresh
    (run_dir / "run.json").write_text(json.dumps({**asdict(spec), "label": method.label, "model": str(model_dir),
                                                  "loss_type": method.loss_type}, indent=2))
    torch.manual_seed(spec.seed)
    rec = HDRLogCallback(run_dir, on_step=on_step)
    trainer = build_trainer(spec, method, task, model_dir, run_dir, callbacks=[rec])
    calls0 = _env_calls()
    t0 = time.perf_counter()
    trainer.train()
    wall = time.perf_counter() - t0
    env_calls = _env_calls() - calls0
    model = trainer.accelerator.unwrap_model(trainer.model)
    ev = evaluate(model, trainer.processing_class, task, n=spec.eval_n, seed=10_000 + spec.seed)
    b = method.fresh_groups(spec.prompts_per_step)
    times = rec.step_times[1:] or rec.step_times  # the first step carries one-off set-up
    metrics = {
        **ev,
        "method": method.name,
        "seed": spec.seed,
        "steps": spec.steps,
        **costs(run_dir / "train_log.jsonl", planned=spec.steps * b * spec.generations, n=spec.generations),
        "mean_step_s": sum(times) / len(times),
        "train_wall_s": wall,
        "final_train_reward": _last(run_dir / "train_log.jsonl", "reward"),
        "env_calls_per_step": env_calls / spec.steps,
        "env_latency_ms": 1000.0 * float(spec.extra.get("latency_s", 0.0)),
    }
    (run_dir / "metrics.json").write_text(json.dumps(metrics, indent=2))
    return metrics


def costs(path: Path, *, planned: int, n: int) -> dict:
    """A run's costs summed over its steps in train_log.jsonl: ``fresh_responses`` (generated; the planned
    steps x b x n unless dynamic sampling logged more), ``rescored_rows`` (stored responses forwarded under the
    current policy to select), ``replayed_rows`` and ``replayed_groups`` (replayed rows / n: groups' worth, also
    for single-rollout replay)."""
    gen = rescored = replayed = 0.0
    dynamic = False
    for line in open(path):
        rec = json.loads(line)
        if "dynamic/generated_rows" in rec:
            dynamic = True
            gen += rec["dynamic/generated_rows"]
        rescored += rec.get("replay/rescored_rows") or 0.0
        replayed += rec.get("replay/replayed_rows") or 0.0
    return {"fresh_responses": int(round(gen)) if dynamic else planned, "rescored_rows": int(round(rescored)),
            "replayed_rows": int(round(replayed)), "replayed_groups": replayed / n}


def _env_calls() -> int:
    from .search import SearchEnv

    return SearchEnv.calls


def _last(path: Path, key: str):
    val = None
    for line in open(path):
        v = json.loads(line).get(key)
        val = v if v is not None else val
    return val
