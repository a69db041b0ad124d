"""HDRLogCallback: write, for any TRL / transformers run, what ``hdreplay report`` reads.

    from hdreplay.integrations.trl.callback import HDRLogCallback
    trainer = GRPOTrainer(..., callbacks=[HDRLogCallback()])   # or HDRGRPOTrainer
    trainer.train()
    # then: hdreplay report <output_dir>

Files, under ``log_dir`` (default: ``args.output_dir``):

    train_log.jsonl  one JSON object per log event of the trainer: ``step`` (optimizer step), every numeric value
                     it logged (reward, entropy, loss, replay/* ...; non-finite as null), ``wall_s`` (seconds of
                     training so far) and ``step_s`` (duration of the last optimizer step).  The trainer's closing
                     summary (``train_runtime``) is left out.
    run.json         {"model", "model_class", "seed", "replay": the ReplayConfig of an HDRGRPOConfig, else null};
                     keys already in an existing run.json are kept.

HDRGRPOTrainer writes its replay diagnostics to ``<output_dir>/replay`` by default, so the output directory is a
complete run directory.  Only the main process writes.  On resume, entries after the resumed step are dropped and
the wall clock continues from the last kept entry.  A plain output directory without this callback is read too
(``trainer_state.json``'s log_history), with less: no wall clock, and only what the trainer checkpointed.
"""

from __future__ import annotations

import json
import math
import os
import time
from pathlib import Path
from typing import Any, Callable

from transformers import TrainerCallback

from ...checkpoint.atomic import atomic_write_text

LOG_FILE, RUN_FILE = "train_log.jsonl", "run.json"


def _clean(v: Any) -> Any:
    return v if not isinstance(v, float) or math.isfinite(v) else None


class HDRLogCallback(TrainerCallback):
    """Writes ``train_log.jsonl`` and ``run.json`` (see the module docstring).

    Args:
        log_dir: where to write; default ``args.output_dir``.
        on_step: called with 1 after every optimizer step (e.g. a progress bar's ``update``).
    Attributes:
        step_times: seconds of each optimizer step of this process's run, in order.
    """

    def __init__(self, log_dir: str | os.PathLike | None = None, *, on_step: Callable[[int], Any] | None = None):
        self.log_dir = None if log_dir is None else Path(log_dir)
        self.on_step = on_step
        self.step_times: list[float] = []
        self._t0 = self._t_step = None
        self._path: Path | None = None

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        self._t0 = time.perf_counter()
        if not state.is_world_process_zero:
            return
        root = self.log_dir or Path(args.output_dir)
        root.mkdir(parents=True, exist_ok=True)
        self._path = root / LOG_FILE
        kept: list[str] = []
        if self._path.exists():  # a resumed run keeps what it logged up to the checkpoint
            for line in self._path.read_text().splitlines():
                try:
                    rec = json.loads(line)
                except json.JSONDecodeError:
                    continue  # a torn last line from a crash
                if isinstance(rec, dict) and isinstance(rec.get("step"), int) and rec["step"] <= state.global_step:
                    kept.append(line + "\n")
        atomic_write_text(self._path, "".join(kept))
        if kept:
            self._t0 -= json.loads(kept[-1]).get("wall_s") or 0.0
        run = {"model": getattr(getattr(model, "config", None), "name_or_path", None),
               "model_class": type(model).__name__ if model is not None else None, "seed": args.seed,
               "replay": args.to_replay_config().to_dict() if hasattr(args, "to_replay_config") else None}
        if (root / RUN_FILE).is_file():
            try:
                run.update(json.loads((root / RUN_FILE).read_text()))
            except json.JSONDecodeError:
                pass  # replaced below
        atomic_write_text(root / RUN_FILE, json.dumps(run, indent=2, default=str) + "\n")

    def on_step_begin(self, args, state, control, **kwargs):
        self._t_step = time.perf_counter()

    def on_step_end(self, args, state, control, **kwargs):
        if self._t_step is not None:
            self.step_times.append(time.perf_counter() - self._t_step)
        if self.on_step is not None:
            self.on_step(1)

    def on_log(self, args, state, control, logs=None, **kwargs):
        if self._path is None or not logs or "train_runtime" in logs:
            return
        rec = {"step": state.global_step, **{k: _clean(v) for k, v in logs.items()
                                             if isinstance(v, (int, float)) and not isinstance(v, bool)},
               "wall_s": time.perf_counter() - self._t0, "step_s": self.step_times[-1] if self.step_times else None}
        with open(self._path, "a") as f:
            f.write(json.dumps(rec, allow_nan=False) + "\n")
