"""``hdreplay report RUN_DIR [RUN_DIR ...]``: every analysis section for one or more runs, written as
markdown + PNG figures + the numbers as JSON.

Output layout (``--out``, default ``RUN_DIR/report`` for one run, ``./hdreplay-report`` for several)::

    report.md      the report (runs side by side), links the figures
    report.json    {"format": "hdreplay.report", "version": 1, "settings", "runs": {label: analysis},
                    "comparison": {"labels", "mismatches"}, "figures": {name: file}}
    figures/*.png  acceptance, replay_kl, scan, age, headroom_deciles, multiplicity, counterfactual,
                   entropy_timing, phases (a figure is omitted when no run has its data)

An analysis (one run) has the keys: info, problems, training, final_metrics, entropy_timing,
acceptance, replay_kl, scan, age_gate, staleness, mixing, headroom_deciles, multiplicity,
counterfactual, phases.  A section a run cannot provide is {"available": false, "reason": ...}.
"""

from __future__ import annotations

from hdreplay.atomic import atomic_write_text

import argparse
import json
import os
import sys
from contextlib import closing
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Sequence

from .age import age_gate, mixing, phase_mixture, staleness
from .run_info import mismatches, run_info
from .counterfactual import counterfactual
from .entropy import EntropyThresholds, collapse_timing
from .gate import acceptance, replay_kl, scan
from .lifetime import headroom_deciles, multiplicity
from .load import ON_BAD_LINE, AnalysisInputError, RunData, load_run, unique_labels
from .progress import progress
from .stats import sanitize, unavailable
from .training import final_metrics, log_series, training

REPORT_FORMAT = "hdreplay.report"
REPORT_VERSION = 1
REPLAY_SECTIONS = ("acceptance", "replay_kl", "scan", "age_gate", "staleness", "mixing",
                   "headroom_deciles", "multiplicity", "counterfactual", "phases")


@dataclass(frozen=True)
class ReportSettings:
    """Knobs of the report.

    kl_window:    running-average window (steps) of the replay-KL curve (paper: 15)
    n_phases:     equal-count training phases of the phase-wise replay mixture
    phase_bounds: explicit phase boundaries in steps (overrides n_phases), increasing
    deciles:      bins of initial stored Headroom
    score_key / entropy_key: train_log.jsonl keys of the training score S and policy entropy H
    entropy:      s0, H_L, H_U and hold lengths of the entropy-collapse timing
    """

    kl_window: int = 15
    n_phases: int = 4
    phase_bounds: tuple[int, ...] | None = None
    deciles: int = 10
    score_key: str = "reward"
    entropy_key: str = "entropy"
    entropy: EntropyThresholds = field(default_factory=EntropyThresholds)

    def __post_init__(self) -> None:
        for name in ("kl_window", "n_phases", "deciles"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise AnalysisInputError(f"{name} must be an int >= 1, got {v!r}")
        b = self.phase_bounds
        if b is not None and (not b or any(y <= x for x, y in zip(b, b[1:]))):
            raise AnalysisInputError(f"phase bounds must be a non-empty increasing list of steps, got {b}")

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def analyze_run(run: RunData, settings: ReportSettings = ReportSettings()) -> dict[str, Any]:
    """Every section for one loaded run (pure: no I/O).  See the module docstring for the keys."""
    info = run_info(run)
    out: dict[str, Any] = {"info": info, "problems": list(run.problems)}
    out["training"] = training(run.train_log, score_key=settings.score_key, entropy_key=settings.entropy_key)
    out["final_metrics"] = final_metrics(run.metrics)
    if run.train_log:
        out["entropy_timing"] = {"available": True, **collapse_timing(
            log_series(run.train_log, settings.score_key), log_series(run.train_log, settings.entropy_key),
            settings.entropy)}
    else:
        out["entropy_timing"] = unavailable("no train_log.jsonl")
    if not run.has_replay:
        why = ("run without replay diagnostics (no replay/steps.jsonl"
               + (f"; method={info['method']!r}" if info["method"] else "") + ")")
        if run.replay_dir is not None:
            why = f"{run.replay_dir / 'steps.jsonl'} has no usable step records"
        out.update({k: unavailable(why) for k in REPLAY_SECTIONS})
        return out
    steps, groups = run.steps, run.groups
    out["acceptance"] = acceptance(steps)
    out["replay_kl"] = replay_kl(steps, window=settings.kl_window)
    out["scan"] = scan(steps)
    out["age_gate"] = age_gate(steps)
    out["staleness"] = staleness(steps, groups)
    out["mixing"] = {"available": True, **mixing(steps)}
    out["headroom_deciles"] = headroom_deciles(groups, n_bins=settings.deciles)
    out["multiplicity"] = multiplicity(groups)
    out["counterfactual"] = counterfactual(steps)
    out["phases"] = phase_mixture(steps, n_phases=settings.n_phases, bounds=settings.phase_bounds)
    return out


def build_report(runs: Sequence[RunData], settings: ReportSettings = ReportSettings(), *,
                 show_progress: bool = False) -> dict[str, Any]:
    """The report dict for several loaded runs (labels must be unique)."""
    labels = [r.label for r in runs]
    if len(set(labels)) != len(labels):
        raise AnalysisInputError(f"run labels must be unique, got {labels}")
    with closing(progress(runs, desc="analysing runs", enabled=show_progress)) as it:
        analyses = {r.label: analyze_run(r, settings) for r in it}
    return sanitize({
        "format": REPORT_FORMAT,
        "version": REPORT_VERSION,
        "settings": settings.to_dict(),
        "runs": analyses,
        "comparison": {"labels": labels, "mismatches": mismatches([a["info"] for a in analyses.values()])},
        "figures": {},
    })


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


def _parse_bounds(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"--phase-bounds takes comma-separated steps, e.g. 100,200; got {text!r}")


def report_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="hdreplay report", description="Replay analytics report for one or more runs.")
    ap.add_argument("runs", nargs="+", metavar="RUN_DIR", help="run directories (compared side by side)")
    ap.add_argument("--out", help="output directory (default: RUN_DIR/report for one run, ./hdreplay-report)")
    ap.add_argument("--label", action="append", default=None,
                    help="label of each run, in order (default: the directory names)")
    ap.add_argument("--on-bad-line", choices=ON_BAD_LINE, default="skip",
                    help="malformed JSONL line: skip it with a warning naming file:line (default) or stop")
    ap.add_argument("--score-key", default="reward", help="train_log key of the training score S")
    ap.add_argument("--entropy-key", default="entropy", help="train_log key of the policy entropy H")
    ap.add_argument("--score-anchor", type=float, default=0.40, help="score anchor s0 (paper: 0.40)")
    ap.add_argument("--entropy-low", type=float, default=0.03, help="low-entropy threshold H_L (paper: 0.03)")
    ap.add_argument("--entropy-high", type=float, default=0.04, help="rebound threshold H_U (paper: 0.04)")
    ap.add_argument("--kl-window", type=int, default=15, help="running-average window of replay KL")
    ap.add_argument("--phases", type=int, default=4, help="number of equal-count training phases")
    ap.add_argument("--phase-bounds", type=_parse_bounds, default=None, help="explicit phase bounds, e.g. 100,200")
    ap.add_argument("--no-figures", action="store_true", help="write markdown and JSON only")
    ap.add_argument("--no-progress", action="store_true", help="no progress bars")
    return ap


def main_report(argv: list[str] | None = None) -> int:
    """Entry point of ``hdreplay report``; prints the output paths.  Returns 0, or 2 (message on
    stderr) for bad input: missing / empty / non-run directories, a bad line with --on-bad-line stop,
    invalid settings, matplotlib missing, an unwritable output directory."""
    args = report_parser().parse_args(argv)
    show = not args.no_progress
    try:
        settings = ReportSettings(
            kl_window=args.kl_window, n_phases=args.phases, phase_bounds=args.phase_bounds,
            score_key=args.score_key, entropy_key=args.entropy_key,
            entropy=EntropyThresholds(score_anchor=args.score_anchor, entropy_low=args.entropy_low,
                                      entropy_high=args.entropy_high))
        labels = args.label or [Path(p).resolve().name or str(p) for p in args.runs]
        if len(labels) != len(args.runs):
            raise AnalysisInputError(f"{len(labels)} --label values for {len(args.runs)} run directories; "
                                     "give one label per run or none")
        labels = unique_labels(labels)
        with closing(progress(list(zip(args.runs, labels)), desc="loading runs", enabled=show)) as it:
            runs = [load_run(p, label=lab, on_bad_line=args.on_bad_line, warn=False) for p, lab in it]
        for r in runs:
            for msg in r.problems:
                print(f"warning: {msg}", file=sys.stderr)
        report = build_report(runs, settings, show_progress=show)
        out = Path(args.out) if args.out else (Path(args.runs[0]) / "report" if len(runs) == 1
                                                else Path("hdreplay-report"))
        paths = write_report(report, out, figures=not args.no_figures, show_progress=show)
    except (AnalysisInputError, OSError) as e:
        print(f"hdreplay report: error: {e}", file=sys.stderr)
        return 2
    for msg in report["comparison"]["mismatches"]:
        print(f"note: {msg}", file=sys.stderr)
    print(f"report: {paths['markdown']}")
    print(f"json:   {paths['json']}")
    for name, p in paths.items():
        if name.startswith("figure:"):
            print(f"figure: {p}")
    return 0
