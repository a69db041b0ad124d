"""tau calibration, I/O side: summarise labelled run directories, drive a sweep through a caller's
training function, render markdown + PNG + JSON, and the ``hdreplay calibrate`` summary entry point.

Output layout (``out_dir``)::

    calibration.md     per-run table, flags with reasons, recommendation, adaptive-vs-fixed comparison
    calibration.json   CalibrationSummary.to_dict(): {"format": "hdreplay.calibration", "version": 1,
                       "criteria", "runs": {label: RunDiagnostics}, "recommendation", "adaptive", "warnings"}
    calibration.png    acceptance, gate rejections, replay KL (running means) and tau over steps
"""

from __future__ import annotations

from hdreplay.atomic import atomic_write_text

import argparse
import json
import math
import os
import sys
from contextlib import closing
from pathlib import Path
from typing import Callable, Mapping, Sequence

from .calibration import CalibrationCriteria, CalibrationSummary, RunDiagnostics, compare_adaptive, diagnose, recommend
from .run_info import mismatches, run_info
from .load import ON_BAD_LINE, AnalysisInputError, load_run
from .markdown import fmt, table
from .progress import progress
from .stats import INTERVALS
from .training import log_series

TrainFn = Callable[[str, float, bool, Path], Path]
DEFAULT_TAUS = (1e-3, 1e-2, 1e-1)


def summarize_calibration(
    runs: Mapping[str, str | os.PathLike],
    *,
    out_dir: str | os.PathLike | None = None,
    criteria: CalibrationCriteria = CalibrationCriteria(),
    on_bad_line: str = "skip",
    figures: bool = True,
    show_progress: bool = False,
    score_key: str = "reward",
    entropy_key: str = "entropy",
    adaptive_labels: Sequence[str] = (),
) -> CalibrationSummary:
    """Diagnose labelled runs (e.g. {"tau=0.001": dir, ..., "adaptive": dir}), flag, recommend.

    tau of a run: its first step record, else run.json's replay.tau, else the label ("tau=1e-3").
    A run is adaptive if its label is in ``adaptive_labels``, run.json has replay.adaptive_tau, or its
    step records carry tau_action.
    Writes calibration.md / .json / .png under ``out_dir`` when given (paths in ``summary.paths``).
    """
    if not runs:
        raise AnalysisInputError("no calibration runs given; pass LABEL=RUN_DIR pairs or run directories")
    with closing(progress(list(runs.items()), desc="loading runs", enabled=show_progress)) as it:
        loaded = [load_run(Path(p), label=lab, on_bad_line=on_bad_line, warn=False) for lab, p in it]
    diags: dict[str, RunDiagnostics] = {}
    infos = []
    warnings: list[str] = [p for r in loaded for p in r.problems]
    for r in loaded:
        info = run_info(r)
        infos.append(info)
        adaptive = info["adaptive"] or r.label in adaptive_labels
        d = diagnose(r.steps, label=r.label, tau=info["tau"], adaptive=adaptive, criteria=criteria,
                     score=log_series(r.train_log, score_key)[1], entropy=log_series(r.train_log, entropy_key)[1])
        if not r.has_replay:
            d.reasons.insert(0, f"{r.path}: no replay diagnostics (replay/steps.jsonl)")
        diags[r.label] = d
    warnings += mismatches(infos, ignore=("tau",))
    rec = recommend(list(diags.values()), criteria)
    summary = CalibrationSummary(diags, rec, compare_adaptive(list(diags.values()), rec), warnings, criteria)
    summary.paths = write_calibration(summary, out_dir, figures=figures) if out_dir is not None else {}
    return summary


def run_calibration(
    train_fn: TrainFn,
    taus: Sequence[float] = DEFAULT_TAUS,
    adaptive: bool = True,
    out_dir: str | os.PathLike = "hdreplay-calibration",
    *,
    adaptive_start: float | None = None,
    show_progress: bool = True,
    **summary_kwargs,
) -> CalibrationSummary:
    """The paper's sweep: one short run per tau (everything else fixed) plus, with ``adaptive``, one
    adaptive-tau run starting at ``adaptive_start`` (default: the middle tested tau); then
    :func:`summarize_calibration` into ``out_dir``.

    ``train_fn(label, tau, adaptive, run_dir) -> run directory`` trains one run; ``run_dir`` is a
    suggestion (``out_dir/runs/<label>``).  Labels are ``"tau=<tau:g>"`` and ``"adaptive"``.
    """
    taus = [float(t) for t in taus]
    if not taus or any(not math.isfinite(t) or t <= 0 for t in taus) or len(set(taus)) != len(taus):
        raise AnalysisInputError(f"taus must be distinct positive numbers, got {taus}")
    out = Path(out_dir)
    plan = [(f"tau={t:g}", t, False) for t in sorted(taus)]
    if adaptive:
        start = sorted(taus)[len(taus) // 2] if adaptive_start is None else float(adaptive_start)
        plan.append(("adaptive", start, True))
    runs: dict[str, Path] = {}
    with closing(progress(plan, desc="calibration runs", enabled=show_progress)) as it:
        for label, tau, ad in it:
            got = train_fn(label, tau, ad, out / "runs" / label)
            if got is None or not Path(got).is_dir():
                raise AnalysisInputError(f"train_fn({label!r}, tau={tau:g}, adaptive={ad}) returned {got!r}, "
                                         "not an existing run directory")
            runs[label] = Path(got)
    return summarize_calibration(runs, out_dir=out, show_progress=show_progress,
                                 adaptive_labels=[lab for lab, _, ad in plan if ad], **summary_kwargs)


def render_calibration(summary: CalibrationSummary) -> str:
    """calibration.md."""
    c = summary.criteria
    s = ["# tau calibration\n\n",
         f"Criteria: **starved** if final-third mean acceptance < {c.starved_accept:.0%} or it fell by more "
         f"than {c.starved_drop:.0%} from the first third; **too loose** if replay KL final-third mean > "
         f"{c.loose_kl_ratio:g}x its early-third mean while mean acceptance > {c.loose_accept:.0%}; gate "
         f"**inactive** (note) if mean acceptance > {c.inactive_accept:.0%}. Recommended: a viable selective "
         f"gate that fills the replay budget (within {c.fill_tolerance * 100:g} points of the best fill), "
         "smallest tau first. Thirds are over updates (steps with a non-empty pre-step buffer).\n\n"]
    rows = []
    for lab, d in summary.runs.items():
        kl = d.replay_kl_by_interval
        rows.append([lab, fmt(d.tau), "yes" if d.adaptive else "no", str(d.n_updates), fmt(d.mean_accept, "pct"),
                     fmt(d.accept_by_interval.get("early"), "pct"), fmt(d.accept_by_interval.get("final"), "pct"),
                     fmt(d.mean_rejections), fmt(d.mean_budget_fill, "pct"),
                     " / ".join(fmt(kl.get(i)) for i in INTERVALS), fmt(d.kl_final_over_early),
                     fmt(d.score_by_interval.get("final")), fmt(d.entropy_by_interval.get("final")),
                     f"**{d.status.replace('_', ' ')}**"])
    s.append(table(["run", "tau", "adaptive", "updates", "mean acceptance", "acceptance (early)",
                    "acceptance (final)", "rejections / update", "budget fill", "replay KL early / middle / final",
                    "KL final/early", "score (final)", "entropy (final)", "status"], rows))
    notes = [f"- {lab}: {r}" for lab, d in summary.runs.items() for r in d.reasons]
    if notes:
        s.append("\n" + "\n".join(notes) + "\n")
    r = summary.recommendation
    s.append(f"\n## Recommendation\n\n**{r.status}**" + (f": tau = {r.tau:g}" if r.tau is not None else "")
             + f"\n\n{r.reason}\n")
    if summary.adaptive:
        s.append("\n## Adaptive tau vs fixed tau\n\n" + "\n".join(f"- {a['text']}" for a in summary.adaptive) + "\n")
    if summary.warnings:
        s.append("\n## Warnings\n\n" + "\n".join(f"- {w}" for w in summary.warnings) + "\n")
    if "figure" in summary.paths:
        s.append("\n![calibration](calibration.png)\n")
    return "".join(s)


def summary_has_figure(summary: CalibrationSummary) -> bool:
    return any(d.series.get("step") for d in summary.runs.values())


def fig_calibration(summary: CalibrationSummary):
    """2x2: acceptance (running mean), gate rejections per step, replay KL (running mean), tau."""
    from .figures import new_figure, run_color

    fig, ax = new_figure(2, 2, (12, 7))
    for i, (lab, d) in enumerate(summary.runs.items()):
        s = d.series
        if not s.get("step"):
            continue
        kw = {"color": run_color(i), "label": f"{lab} ({d.status.replace('_', ' ')})"}
        ax[0, 0].plot(s["accept_running"]["step"], s["accept_running"]["value"], **kw)
        ax[0, 1].plot(s["step"], s["rejections"], **kw)
        ax[1, 0].plot(s["replay_kl_running"]["step"], s["replay_kl_running"]["value"], **kw)
        pts = [(x, t) for x, t in zip(s["step"], s["tau"]) if t is not None]
        if pts:
            ax[1, 1].plot(*zip(*pts), **kw)
    w = summary.criteria.kl_window
    ax[0, 0].set(ylabel=f"acceptance rate (running mean, {w})", title="Gate acceptance")
    ax[0, 1].set(ylabel="gate rejections per step", title="Rejections per update")
    ax[1, 0].set(xlabel="step", ylabel=f"replay KL (running mean, {w})", title="Replay KL")
    ax[1, 1].set(xlabel="step", ylabel="tau", yscale="log", title="tau used at each step")
    ax[0, 0].legend(fontsize=7)
    return fig


def write_calibration(summary: CalibrationSummary, out_dir: str | os.PathLike, *, figures: bool = True) -> dict[str, Path]:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths: dict[str, Path] = {}
    if figures and summary_has_figure(summary):
        fig = fig_calibration(summary)
        fig.savefig(out / "calibration.png", dpi=110)
        paths["figure"] = out / "calibration.png"
    summary.paths = paths
    for name, text in (("json", json.dumps(summary.to_dict(), indent=1, allow_nan=False) + "\n"),
                       ("markdown", render_calibration(summary))):
        p = out / ("calibration.json" if name == "json" else "calibration.md")
        paths[name] = atomic_write_text(p, text)
    return paths


def calibrate_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="hdreplay calibrate", description="Summarise a tau calibration sweep.")
    ap.add_argument("runs", nargs="*", metavar="RUN_DIR", help="run directories, labelled by directory name")
    ap.add_argument("--run", nargs=2, action="append", default=[], metavar=("LABEL", "RUN_DIR"),
                    help="a labelled run (repeatable), e.g. --run tau=1e-3 runs/a")
    ap.add_argument("--out", default="hdreplay-calibration", help="output directory")
    ap.add_argument("--on-bad-line", choices=ON_BAD_LINE, default="skip")
    ap.add_argument("--starved-accept", type=float, default=CalibrationCriteria.starved_accept)
    ap.add_argument("--starved-drop", type=float, default=CalibrationCriteria.starved_drop)
    ap.add_argument("--loose-kl-ratio", type=float, default=CalibrationCriteria.loose_kl_ratio)
    ap.add_argument("--loose-accept", type=float, default=CalibrationCriteria.loose_accept)
    ap.add_argument("--fill-tolerance", type=float, default=CalibrationCriteria.fill_tolerance,
                    help="budget fills within this of the best count as full; the smaller tau wins among them")
    ap.add_argument("--score-key", default="reward")
    ap.add_argument("--entropy-key", default="entropy")
    ap.add_argument("--no-figures", action="store_true")
    ap.add_argument("--no-progress", action="store_true")
    return ap


def main_calibrate_summary(argv: list[str] | None = None) -> int:
    """Entry point of the ``hdreplay calibrate`` summary; prints the output paths and the recommendation.
    Returns 0, or 2 with the message on stderr for bad input."""
    args = calibrate_parser().parse_args(argv)
    try:
        pairs = [(Path(p).resolve().name or p, p) for p in args.runs] + [(lab, p) for lab, p in args.run]
        if not pairs:
            raise AnalysisInputError("no runs given; pass RUN_DIRs or --run LABEL RUN_DIR")
        labels = [lab for lab, _ in pairs]
        if len(set(labels)) != len(labels):
            raise AnalysisInputError(f"run labels must be unique, got {labels}; use --run LABEL RUN_DIR")
        crit = CalibrationCriteria(starved_accept=args.starved_accept, starved_drop=args.starved_drop,
                                   loose_kl_ratio=args.loose_kl_ratio, loose_accept=args.loose_accept,
                                   fill_tolerance=args.fill_tolerance)
        summary = summarize_calibration(dict(pairs), out_dir=args.out, criteria=crit, on_bad_line=args.on_bad_line,
                                        figures=not args.no_figures, show_progress=not args.no_progress,
                                        score_key=args.score_key, entropy_key=args.entropy_key)
    except (AnalysisInputError, OSError) as e:
        print(f"hdreplay calibrate: error: {e}", file=sys.stderr)
        return 2
    for w in summary.warnings:
        print(f"warning: {w}", file=sys.stderr)
    for name, p in summary.paths.items():
        print(f"{name}: {p}")
    r = summary.recommendation
    print(f"recommendation: {r.status}" + (f" tau={r.tau:g}" if r.tau is not None else "") + f" -- {r.reason}")
    return 0
