"""``hdreplay report RUN_DIR [RUN_DIR ...]``: every analysis section for one or more runs, as markdown + PNG
figures + the numbers as JSON.

Output layout (default ``RUN_DIR/report`` for one run, ``./hdreplay-report`` for several)::

    report.md      the report (runs side by side), links the figures
    report.json    {"format": "hdreplay.report", "version": 1, "settings", "runs": {label: analysis},
                    "comparison": {"labels", "mismatches"}, "figures": {name: file}}
    figures/*.png  acceptance, replay_kl, scan, age, headroom_deciles, multiplicity, counterfactual,
                   entropy_timing, phases, ingress (a figure is omitted when no run has its data)

An analysis (one run) has the keys: info, problems, training, final_metrics, ingress, entropy_timing, acceptance,
replay_kl, scan, age_gate, staleness, mixing, headroom_deciles, multiplicity, counterfactual, phases, waste,
async_ledger (asynchronous runs: :mod:`.ledger`).  A section
a run cannot provide is {"available": false, "reason": ...}.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Annotated, Any, Sequence

from tyro.conf import arg

from hdreplay.checkpoint.atomic import atomic_write_text

from ..flags import CommaInt
from ..progress import progress
from .age import age_gate, mixing, phase_mixture, staleness
from .gate import acceptance, col, replay_kl, scan
from .ingress import ingress
from .ledger import async_ledger
from .lifetime import counterfactual, headroom_deciles, multiplicity
from .load import AnalysisInputError, RunData
from .stats import check_settings, num, sanitize, unavailable
from .training import EntropyThresholds, collapse_timing, final_metrics, log_series, training
from .waste import gate_waste

REPORT_FORMAT, REPORT_VERSION = "hdreplay.report", 1
REPLAY_SECTIONS = ("acceptance", "replay_kl", "scan", "age_gate", "staleness", "mixing", "headroom_deciles",
                   "multiplicity", "counterfactual", "phases", "waste")


@dataclass(frozen=True)
class ReportSettings:
    """Knobs of the report (each field's docstring is also its ``hdreplay report`` option's help)."""

    kl_window: int = 15
    """running-average window of the replay-KL curve, in steps (paper: 15)"""
    n_phases: Annotated[int, arg(name="phases")] = 4
    """equal-count training phases of the phase-wise replay mixture"""
    phase_bounds: CommaInt = None
    """explicit increasing phase bounds in steps, e.g. 100,200 (overrides --phases)"""
    deciles: int = 10
    """bins of initial stored Headroom"""
    score_key: str = "reward"
    """trainer-log key of the training score S"""
    entropy_key: str = "entropy"
    """trainer-log key of the policy entropy H"""
    entropy: Annotated[EntropyThresholds, arg(name="")] = field(default_factory=EntropyThresholds)
    answer_threshold: float | None = None
    ("ingress analysis: a_i = 1[r_i >= threshold] marks a correct answer (unset: the run's answer_threshold, else 0.9 "
     "as in Geo3K)")

    def __post_init__(self) -> None:
        check_settings(self, counts=("kl_window", "n_phases", "deciles"), flags={"n_phases": "--phases"},
                       finite=("answer_threshold",) if self.answer_threshold is not None else ())
        b = self.phase_bounds
        if b is not None and (not b or any(y <= x for x, y in zip(b, b[1:]))):
            raise AnalysisInputError(f"phase bounds (--phase-bounds) must be a non-empty increasing list of steps, "
                                     f"got {list(b)}")


def check_settings_for(runs: Sequence[RunData], settings: ReportSettings) -> list[str]:
    """Why ``settings`` cannot apply to ``runs`` (one line each, naming the option and the fix): more phases
    (--phases) than a run has replay step records; a --score-key / --entropy-key set to a key no entry of a run's
    trainer log holds a number under.  Only values set away from their defaults are refused (with the default 4
    phases a shorter run's last phases are empty; a log without the default keys has those curves n/a)."""
    out, default = [], {f.name: f.default for f in fields(settings)}
    for r in runs:
        if (r.has_replay and settings.phase_bounds is None and settings.n_phases != default["n_phases"]
                and settings.n_phases > len(r.steps)):
            out.append(f"--phases {settings.n_phases}: run {r.label!r} has {len(r.steps)} replay step records "
                       f"({r.replay_dir}), fewer than the phases; give --phases {len(r.steps)} or fewer, or "
                       "--phase-bounds")
        for name in ("score_key", "entropy_key"):
            key = getattr(settings, name)
            if key != default[name] and len(r.log) and not len(log_series(r.log, key)):
                keys = [k for k in r.log.columns if k != "step" and len(log_series(r.log, k))]
                out.append(f"--{name.replace('_', '-')} {key}: no entry of {r.log_source} holds a number under "
                           f"{key!r}; give one of its keys: {', '.join(map(repr, keys)) or 'none'}")
    return out


def tau_from_label(label: str) -> float | None:
    """The tau written in a label such as ``"tau=1e-3"``, or None."""
    m = re.search(r"tau\s*=\s*([0-9.]+(?:[eE][-+]?[0-9]+)?)", label)
    return num(float(m.group(1))) if m else None


def run_info(run: RunData) -> dict[str, Any]:
    """What a run is: label, path, method, seed, task (run.json), has_replay, selector, k_rep, tau, capacity,
    adaptive, counterfactual (first step record, else run.json's replay, else the label for tau), replay_steps
    and log_steps ([first, last] or None), log_source, rewound (side files of records a resume set aside)."""
    rc, steps = run.replay_config, run.steps
    first = sanitize(steps.iloc[0].to_dict()) if run.has_replay else {}
    tau = next((t for t in (num(first.get("tau")), num(rc.get("tau")), tau_from_label(run.label)) if t is not None),
               None)
    log_steps = col(run.log, "step").dropna()
    return sanitize({
        "label": run.label, "path": str(run.path), "method": run.meta.get("method"), "seed": run.meta.get("seed"),
        "task": run.meta.get("task"), "has_replay": run.has_replay,
        "selector": first.get("selector") or rc.get("selector") or (None if run.has_replay else "none"),
        "k_rep": first["k_rep"] if num(first.get("k_rep")) is not None else rc.get("k_rep"), "tau": tau,
        "capacity": rc.get("capacity"),
        "adaptive": rc.get("adaptive_tau") is not None or bool(steps["tau_action"].notna().any()),
        "counterfactual": bool(col(steps, "cf_size").notna().any()) or bool(rc.get("counterfactual")),
        "replay_steps": [steps["step"].iloc[0], steps["step"].iloc[-1]] if run.has_replay else None,
        "log_steps": [int(log_steps.min()), int(log_steps.max())] if len(log_steps) else None,
        "log_source": run.log_source, "rewound": list(run.rewound),
    })


def mismatches(infos: Sequence[dict], *, ignore: Sequence[str] = ()) -> list[str]:
    """Differences that limit a side-by-side comparison (empty for one run); keys in ``ignore`` (e.g. "tau" in a
    tau sweep) are expected to differ and are not reported."""
    if len(infos) < 2:
        return []
    out = []
    rep = [i for i in infos if i["has_replay"]]
    if rep and len(rep) < len(infos):
        out.append(f"runs without replay diagnostics ({', '.join(i['label'] for i in infos if not i['has_replay'])}):"
                   f" replay sections compare only {', '.join(i['label'] for i in rep)}; training curves and entropy "
                   "timing compare all runs")

    def differ(pool: Sequence[dict], key: str) -> dict[str, Any]:
        known = {i["label"]: i[key] for i in pool if i.get(key) is not None}
        return known if len({repr(v) for v in known.values()}) > 1 else {}

    for key, what in (("task", "task"), ("selector", "selector"), ("k_rep", "replay budget k_rep"),
                      ("capacity", "buffer capacity"), ("tau", "initial tau")):
        d = {} if key in ignore else differ(rep if key in ("k_rep", "capacity", "tau") else infos, key)
        if d:
            out.append(f"{what} differs ({', '.join(f'{k}={v}' for k, v in d.items())})"
                       + (": the runs train on different tasks, compare with care" if key == "task" else ""))
    for key, what in (("replay_steps", "replay step range"), ("log_steps", "trainer-log step range")):
        d = differ(infos, key)
        if d:
            out.append(f"{what} differs ({', '.join(f'{k}={v[0]}..{v[1]}' for k, v in d.items())}): early/middle/"
                       "final intervals and phases cover different spans; compare per-step curves on their common "
                       "steps")
    if rep and any(i["counterfactual"] for i in rep) and not all(i["counterfactual"] for i in rep):
        out.append("only some runs logged the same-buffer counterfactual (counterfactual=True)")
    return out


def analyze_run(run: RunData, settings: ReportSettings = ReportSettings()) -> dict[str, Any]:
    """Every section for one loaded run (pure: no I/O).  See the module docstring for the keys."""
    info = run_info(run)
    out: dict[str, Any] = {"info": info, "problems": list(run.problems),
                           "training": training(run.log, score_key=settings.score_key,
                                                entropy_key=settings.entropy_key),
                           "final_metrics": final_metrics(run.metrics), "async_ledger": async_ledger(run)}
    out["ingress"] = ingress(run.fresh, run.steps, run.groups, run.replay_config,
                             threshold=settings.answer_threshold)
    out["entropy_timing"] = ({"available": True, **collapse_timing(
        log_series(run.log, settings.score_key), log_series(run.log, settings.entropy_key), settings.entropy)}
        if len(run.log) else unavailable("no trainer log"))
    if not run.has_replay:
        why = ("run without replay diagnostics (no replay/steps.jsonl"
               + (f"; method={info['method']!r}" if info["method"] else "") + ")")
        if run.replay_dir is not None:
            why = f"{run.replay_dir / 'steps.jsonl'} has no usable step records"
        return {**out, **{k: unavailable(why) for k in REPLAY_SECTIONS}}
    steps, groups = run.steps, run.groups
    return {**out, "acceptance": acceptance(steps), "replay_kl": replay_kl(steps, window=settings.kl_window),
            "scan": scan(steps), "age_gate": age_gate(steps), "staleness": staleness(steps, groups),
            "mixing": {"available": True, **mixing(steps)},
            "headroom_deciles": headroom_deciles(groups, n_bins=settings.deciles),
            "multiplicity": multiplicity(groups), "counterfactual": counterfactual(steps),
            "phases": phase_mixture(steps, n_phases=settings.n_phases, bounds=settings.phase_bounds),
            "waste": gate_waste(steps)}


def build_report(runs: Sequence[RunData], settings: ReportSettings = ReportSettings(), *,
                 show_progress: bool = False) -> dict[str, Any]:
    """The report dict for several loaded runs (labels must be unique; :func:`check_settings_for` refusals raise
    AnalysisInputError, one message each)."""
    labels = [r.label for r in runs]
    if len(set(labels)) != len(labels):
        raise AnalysisInputError(f"run labels must be unique, got {labels}")
    refused = check_settings_for(runs, settings)
    if refused:
        raise AnalysisInputError(messages=refused)
    with progress(runs, desc="analysing runs", enabled=show_progress, lines=0, leave=False) as bar:
        analyses = {r.label: analyze_run(r, settings) for r in bar}
    return sanitize({"format": REPORT_FORMAT, "version": REPORT_VERSION, "settings": asdict(settings),
                     "runs": analyses, "figures": {},
                     "comparison": {"labels": labels,
                                    "mismatches": mismatches([a["info"] for a in analyses.values()])}})


def write_report(report: dict[str, Any], out_dir: str | os.PathLike, *, figures: bool = True,
                 show_progress: bool = False) -> dict[str, Path]:
    """Write report.md, report.json and figures/*.png under ``out_dir``; returns {name: path}."""
    from .markdown import render_report

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths: dict[str, Path] = {}
    if figures:
        from .figures import render_figures

        figs = render_figures(report, out / "figures", show_progress=show_progress)
        report["figures"] = {k: f"figures/{p.name}" for k, p in figs.items()}
        paths.update({f"figure:{k}": p for k, p in figs.items()})
    paths["json"] = atomic_write_text(out / "report.json", json.dumps(report, indent=1, allow_nan=False) + "\n")
    paths["markdown"] = atomic_write_text(out / "report.md", render_report(report))
    return paths
