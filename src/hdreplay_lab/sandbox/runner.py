"""One training run of one method and seed through the TRL trainer, into a run directory.

Run directory layout (what ``hdreplay report`` and the comparison summary read):
    run.json          method, seed, task and every setting (incl. the modelled rollout cost, torch threads)
    train_log.jsonl   TRL's log entries, one per step (reward, entropy, loss, replay/* ...), written by
                      hdreplay's HDRLogCallback (wall_s, step_s), plus the per-step measurements of
                      instrument.py (train_s, generation seconds and tokens, zero-variance share)
    prompts.jsonl     the fresh prompts of each step in the sampler's order (instrument.py)
    curve.jsonl       held-out macro Mean@n on a prompt subset every ``eval_every`` steps (and step 0)
    replay/           steps.jsonl, groups.jsonl (replay methods only)
    fresh_groups.jsonl  per step, the rewards of every fresh group (ingress analysis; see rewardlog.py)
    trl/runs/         TensorBoard event files written through TRL's report_to
    metrics.json      held-out Mean@n / Best@n per benchmark (and per prompt), macro and weighted
                      averages, mean step time and the run's costs: fresh responses generated (dynamic
                      sampling's discarded ones included), rows re-scored under the current policy to select,
                      rows and groups replayed (sums over the steps of train_log.jsonl); written last, atomically

Same prompt order: the training prompts of a run depend only on (task, seed, dataset size), and TRL's
``RepeatSampler`` shuffles them with a generator seeded by the run's seed, so every method of a seed
reads the same permutation.  A method with b' fresh groups per step reads positions [t b', (t+1) b') of it
at step t; the dataset holds 3 x steps x b prompts for every method (one epoch for up to 3 b per step), or
``--train-pool`` distinct prompts that every method cycles through in epochs (RePO replays only prompts it
has seen twice before).
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable

from hdreplay.checkpoint.atomic import atomic_write_text

from ..env import configure_threads, offline_env
from .instrument import Instrument, StepStats, sandbox_trainer_class
from .methods import Method
from .tasks import Task

METRICS_FORMAT = "hdreplay.sandbox.metrics/2"


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
    #: modelled rollout cost, milliseconds per generated token (instrument.py); 0 = native CPU sampling
    rollout_ms_per_token: float = 0.0
    #: held-out curve every ``eval_every`` steps (0 = off) on the first ``curve_prompts`` prompts of each
    #: benchmark, ``curve_n`` samples each
    eval_every: int = 0
    curve_prompts: int = 50
    curve_n: int = 4
    #: training prompts in the dataset; None = 3 x steps x prompts_per_step, the same for every method
    dataset_prompts: int | None = None
    extra: dict = field(default_factory=dict)

    def num_dataset_prompts(self) -> int:
        pool = self.extra.get("train_pool")
        return pool if pool is not None else self.dataset_prompts or max(3 * self.steps * self.prompts_per_step, 256)


def _train_problems(spec: RunSpec, task: Task):
    return task.train_problems(spec.num_dataset_prompts(), seed=spec.seed)


def trainer_args(spec: RunSpec, method: Method, task: Task, run_dir: Path):
    """The run's HDRGRPOConfig: the sandbox's TRL settings plus one ``replay_<knob>`` per entry of ``spec.replay``."""
    offline_env()
    from hdreplay.config import knobs
    from hdreplay.diagnostics import DiagnosticsConfig
    from hdreplay.integrations.trl import HDRGRPOConfig

    b, n = method.fresh_groups(spec.prompts_per_step), spec.generations
    if getattr(task, "is_multiturn", False):
        width = 56 * task.max_tool_calls + 16
    elif hasattr(task, "completion_width"):  # geo: "[" answer "]" EOS
        width = task.completion_width(_train_problems(spec, task))
    else:
        width = max(len(p.answer) for p in _train_problems(spec, task)) + 2
    names = [k.name for k in knobs()] + list(DiagnosticsConfig.field_names())
    replay = {f"replay_{k}": spec.replay[k] for k in names if k in spec.replay}
    return HDRGRPOConfig(
        output_dir=str(run_dir / "trl"), use_cpu=True, bf16=False, activation_checkpointing=False,
        report_to=["tensorboard"], logging_steps=1, save_strategy="no", max_steps=spec.steps,
        per_device_train_batch_size=b * n, gradient_accumulation_steps=1, num_generations=n,
        max_completion_length=width, temperature=1.0, learning_rate=spec.lr, lr_scheduler_type="constant",
        warmup_steps=0, loss_type=method.loss_type, epsilon_high=method.epsilon_high, beta=0.0, seed=spec.seed,
        disable_tqdm=True, disable_dropout=True, dataloader_num_workers=0,
        **{"replay_diagnose_ungated": False, **replay}, replay_diagnostics_dir=str(run_dir / "replay"),
        replay_dynamic_sampling=method.dynamic_sampling, replay_repo=dict(method.repo) if method.repo else None,
        replay_bapo=None if method.bapo is None else {"seed": spec.seed, **dict(method.bapo)},
        max_tool_calling_iterations=getattr(task, "max_tool_calls", None), **dict(method.trl),
    )


def build_trainer(spec: RunSpec, method: Method, task: Task, model_dir: Path, run_dir: Path, callbacks=(),
                  stats: StepStats | None = None):
    """The sandbox trainer of one run (``HDRGRPOTrainer`` with the measuring seams of instrument.py)."""
    offline_env()
    from datasets import Dataset

    from .model import load_model

    model, tok = load_model(model_dir)
    problems = _train_problems(spec, task)
    if getattr(task, "is_multimodal", False):  # conversational prompts + an image column, as TRL's VLM path reads
        ds = task.dataset(problems)
    else:
        ds = Dataset.from_dict({"prompt": [p.prompt for p in problems], "answer": [p.answer for p in problems]})
    env_kwargs = {}
    if getattr(task, "is_multiturn", False):  # TRL's own environment mechanism drives the tool calls
        from .search import SearchEnv, install_chat_format

        install_chat_format(tok)
        latency = float(spec.extra.get("latency_s", 0.0))
        per_turn = spec.extra.get("tool_concurrency", "per_turn") == "per_turn"  # envcost.py: the two models
        SearchEnv.latency_s = 0.0 if per_turn else latency  # sequential: each call sleeps, as TRL runs sync tools
        env_kwargs = {"environment_factory": SearchEnv, "tool_calls": lambda: SearchEnv.calls,
                      "turn_latency_s": latency if per_turn else 0.0}
        ds = ds.add_column("question", [p.question for p in problems])
    from .rewardlog import FILE, GroupRewardLog

    reward = GroupRewardLog(task.reward_func(), run_dir / FILE, spec.generations)  # for the ingress analysis
    trainer = sandbox_trainer_class()(
        model=model, reward_funcs=reward, args=trainer_args(spec, method, task, run_dir), train_dataset=ds,
        processing_class=tok, callbacks=list(callbacks), stats=stats if stats is not None else StepStats(),
        rollout_ms_per_token=spec.rollout_ms_per_token, **env_kwargs)
    # the comparison shows one progress bar; the per-step log dicts go to train_log.jsonl and TensorBoard
    from transformers.trainer_callback import PrinterCallback

    trainer.remove_callback(PrinterCallback)
    return trainer


def run_one(spec: RunSpec, method: Method, task: Task, model_dir: Path, run_dir: Path,
            on_step: Callable[[int], None] | None = None) -> dict:
    """Train, evaluate, and write the run directory; returns metrics.json's content.

    metrics.json is written last and atomically: its presence marks a finished run (a comparison
    resumes by skipping exactly those, :func:`is_finished`).
    """
    import torch

    from hdreplay.integrations.trl.callback import HDRLogCallback

    from .evaluate import evaluate

    threads = configure_threads()
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "fresh_groups.jsonl").unlink(missing_ok=True)  # a re-run starts its reward log afresh
    atomic_write_text(run_dir / "run.json", json.dumps(
        {**asdict(spec), "label": method.label, "model": str(model_dir), "loss_type": method.loss_type,
         "torch_threads": threads, "dataset_prompts": spec.num_dataset_prompts()}, indent=2))
    torch.manual_seed(spec.seed)
    stats = StepStats()
    b = method.fresh_groups(spec.prompts_per_step)
    holder: dict = {}

    def curve_fn() -> dict:
        tr = holder["trainer"]
        ev = evaluate(tr.accelerator.unwrap_model(tr.model), tr.processing_class, task, n=spec.curve_n,
                      seed=20_000 + spec.seed, prompts_per_benchmark=spec.curve_prompts)
        return {"macro_mean_at_n": ev["macro_mean_at_n"],
                "benchmarks": {k: v["mean_at_n"] for k, v in ev["benchmarks"].items()}}

    inst = Instrument(run_dir, stats, curve_fn=curve_fn if spec.eval_every else None, eval_every=spec.eval_every,
                      generations=spec.generations)
    rec = HDRLogCallback(run_dir, on_step=on_step)  # after inst: it writes the step's log with inst's additions
    trainer = holder["trainer"] = build_trainer(spec, method, task, model_dir, run_dir, callbacks=[inst, rec],
                                                stats=stats)
    t0 = time.perf_counter()
    try:
        trainer.train()
    finally:
        inst.close()
    wall = time.perf_counter() - t0 - inst.eval_s
    model = trainer.accelerator.unwrap_model(trainer.model)
    ev = evaluate(model, trainer.processing_class, task, n=spec.eval_n, seed=10_000 + spec.seed, per_prompt=True)
    times = rec.step_times[1:] or rec.step_times  # the first step carries one-off set-up
    metrics = {
        **ev,
        "format": METRICS_FORMAT,
        "method": method.name,
        "seed": spec.seed,
        "steps": spec.steps,
        **costs(run_dir / "train_log.jsonl", planned=spec.steps * b * spec.generations, n=spec.generations),
        "mean_step_s": sum(times) / len(times),
        "train_wall_s": wall,
        "rollout_ms_per_token": spec.rollout_ms_per_token,
        "final_train_reward": _last(run_dir / "train_log.jsonl", "reward"),
        **env_costs(run_dir / "train_log.jsonl", steps=spec.steps),
        "env_latency_ms": 1000.0 * float(spec.extra.get("latency_s", 0.0)),
        "tool_concurrency": spec.extra.get("tool_concurrency", "per_turn") if getattr(task, "is_multiturn", False)
        else None,
        "torch_threads": threads,
    }
    atomic_write_text(run_dir / "metrics.json", json.dumps(metrics, indent=2))
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


def env_costs(path: Path, *, steps: int) -> dict:
    """Per-step means over a run's train_log.jsonl: ``env_calls_per_step`` and ``tool_turns_per_step`` (training
    rollouts only: the counts of instrument.py; None without tools), ``policy_tokens_per_step`` and ``cpu_s_per_step``
    (process CPU seconds, the first step's one-off set-up left out like mean_step_s)."""
    recs = [json.loads(line) for line in open(path)]
    calls = [r["tool_calls"] for r in recs if "tool_calls" in r]
    turns = [r["tool_turns"] for r in recs if "tool_turns" in r]
    cpu = [r["cpu_s"] for r in recs if r.get("cpu_s") is not None]
    cpu = cpu[1:] or cpu
    return {"env_calls_per_step": sum(calls) / steps if calls else None,
            "tool_turns_per_step": sum(turns) / steps if turns else None,
            "policy_tokens_per_step": sum(r.get("policy_tokens", 0) for r in recs) / steps,
            "cpu_s_per_step": sum(cpu) / len(cpu) if cpu else None}


def is_finished(run_dir: Path) -> bool:
    """A run is finished when its metrics.json is complete (written atomically, so never torn)."""
    try:
        return json.loads((Path(run_dir) / "metrics.json").read_text()).get("format") == METRICS_FORMAT
    except (OSError, ValueError, AttributeError):
        return False


def _last(path: Path, key: str):
    val = None
    for line in open(path):
        v = json.loads(line).get(key)
        val = v if v is not None else val
    return val
