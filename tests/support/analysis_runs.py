"""Records and run directories for the analysis tests.

Step records are built from the one schema, :class:`hdreplay.records.StepRecord` (``step_rec``); real run
directories are written by the core ReplayController driven by the model-free TablePolicy (no trainer), plus
hand-written trainer logs (run.json, train_log.jsonl, metrics.json)."""

from __future__ import annotations

import json
from pathlib import Path

from hdreplay import ReplayConfig, ReplayController
from hdreplay.diagnostics import DiagnosticsConfig, observers
from hdreplay.records import EXTRA_STEP_FIELDS, StepRecord
from hdreplay_lab.analysis.load import group_frame, step_frame
from hdreplay_lab.synthetic import TablePolicy, make_group


def step_rec(step: int, *, selector: str = "headroom_drift", k_rep: int = 2, tau: float | None = 0.01,
             **fields) -> StepRecord:
    """A StepRecord (unknown field names are a TypeError, so a renamed field breaks the tests that use it); what
    diagnostics add (``cf_*``, ``tau_next``, ...) goes to its extras, as the observers put it."""
    extras = {k: fields.pop(k) for k in list(fields) if k in EXTRA_STEP_FIELDS}
    return StepRecord(step=step, selector=selector, k_rep=k_rep, tau=tau, extras=extras, **fields)


def steps_frame(*records: StepRecord):
    """The analysis frame of StepRecords, through their JSON form (what steps.jsonl holds)."""
    return step_frame([r.to_json() for r in records])


def life(*, birth_step: int, evicted_step: int | None, ref_headroom: float = 0.5, replay_count: int = 0,
         exposure: float = 0.0, insertion_id: int = 0) -> dict:
    """A groups.jsonl lifetime record with every key the buffer writes (ReplayBuffer.lifetime_record)."""
    return {"group_id": f"g{insertion_id}", "insertion_id": insertion_id, "birth_step": birth_step,
            "ref_headroom": ref_headroom, "cached_headroom": ref_headroom, "replay_count": replay_count,
            "exposure": exposure, "evicted_step": evicted_step}


def groups_frame(*records: dict):
    return group_frame(list(records))

#: hand-written trainer log used by the real-run fixture: 30 log points at steps 0, 2, 4, ...
LOG_STEPS = [2 * i for i in range(30)]
LOG_SCORE = [0.05 * i for i in range(30)]                      # first >= 0.40 at i = 8 -> step 16
LOG_ENTROPY = [0.5] * 12 + [0.02] * 10 + [0.05] * 8             # entry i = 12 -> step 24, rebound i = 22 -> 44


def write_train_log(path: Path, steps=LOG_STEPS, score=LOG_SCORE, entropy=LOG_ENTROPY) -> None:
    with open(path, "w") as f:
        for s, r, h in zip(steps, score, entropy):
            f.write(json.dumps({"step": s, "loss": 0.1, "reward": r, "entropy": h, "step_time": 0.1}) + "\n")
        f.write(json.dumps({"step": steps[-1], "train_runtime": 12.5}) + "\n")  # TRL's closing entry


def make_real_run(root: Path, name: str, *, steps: int = 30, per_step: int = 5, seed: int = 1,
                  train_log: bool = True, **config) -> Path:
    """RUN_DIR with run.json, train_log.jsonl and replay/{steps,groups}.jsonl from a real controller."""
    run = root / name
    run.mkdir(parents=True)
    diag = {k: config.pop(k) for k in list(config) if k in DiagnosticsConfig.field_names()}
    cfg = ReplayConfig(**{"k_rep": 3, "tau": 5e-3, "capacity": 12, **config})
    ctrl = ReplayController(cfg, diagnostics_dir=run / "replay",
                            observers=observers(DiagnosticsConfig(**{"counterfactual": True, **diag}), cfg))
    pol = TablePolicy(seed=seed)
    for t in range(steps):
        if t:
            pol = pol.perturbed(0.05, seed=1000 * seed + t)
        ctrl.select(step=t, scorer=pol.scorer)
        ctrl.stage([make_group(f"{t}-{i}", policy=pol, step=t, seed=97 * t + i + seed) for i in range(per_step)],
                   step=t)
        ctrl.commit()
    ctrl.close()
    meta = {"method": cfg.selector, "seed": seed, "task": "synthetic", "replay": cfg.to_dict()}
    (run / "run.json").write_text(json.dumps(meta))
    if train_log:
        write_train_log(run / "train_log.jsonl")
    return run


def make_plain_run(root: Path, name: str) -> Path:
    """An on-policy run: run.json with replay null and a trainer log, no replay/ directory."""
    run = root / name
    run.mkdir(parents=True)
    (run / "run.json").write_text(json.dumps({"method": "grpo", "seed": 0, "task": "synthetic", "replay": None}))
    write_train_log(run / "train_log.jsonl")
    (run / "metrics.json").write_text(json.dumps({"mean@8": 0.42, "note": "text values are ignored"}))
    return run


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()]
