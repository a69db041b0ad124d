"""tau calibration, I/O side: summarise labelled run directories, drive a sweep through a caller's training
function, and write markdown + PNG + JSON (``hdreplay calibrate run`` / ``hdreplay calibrate summarize``).

Output layout (``out_dir``)::

    calibration.md     per-run table, flags with reasons, recommendation, adaptive-vs-fixed comparison
    calibration.json   CalibrationSummary.to_dict(): {"format": "hdreplay.calibration", "version": 1, "criteria",
                       "runs": {label: RunDiagnostics}, "recommendation", "adaptive", "warnings"}
    calibration.png    acceptance, gate rejections, replay KL (running means) and tau over steps
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Callable, Mapping, Sequence

from tqdm import tqdm

from hdreplay.atomic import atomic_write_text

from .calibration import CalibrationCriteria, CalibrationSummary, compare_adaptive, diagnose, recommend
from .load import AnalysisInputError, load_run
from .markdown import fmt, table
from .report import mismatches, run_info
from .stats import INTERVALS
from .training import log_series

TrainFn = Callable[[str, float, bool, Path], Path]
DEFAULT_TAUS = (1e-3, 1e-2, 1e-1)


def summarize_calibration(runs: Mapping[str, str | os.PathLike], *, out_dir: str | os.PathLike | None = None,
                          criteria: CalibrationCriteria = CalibrationCriteria(), on_bad_line: str = "skip",
                          figures: bool = True, show_progress: bool = False, score_key: str = "reward",
                          entropy_key: str = "entropy", adaptive_labels: Sequence[str] = ()) -> CalibrationSummary:
    """Diagnose labelled runs (e.g. {"tau=0.001": dir, ..., "adaptive": dir}), flag them, recommend a tau.

    tau of a run: its first step record, else run.json's replay.tau, else the label ("tau=1e-3").  A run is
    adaptive if its label is in ``adaptive_labels``, run.json has replay.adaptive_tau, or its step records carry
    tau_action.  Writes calibration.md / .json / .png under ``out_dir`` when given (paths in ``summary.paths``).
    """
    if not runs:
        raise AnalysisInputError("no calibration runs given; pass run directories")
    loaded = [load_run(Path(p), label=lab, on_bad_line=on_bad_line, warn=False) for lab, p in runs.items()]
    infos = [run_info(r) for r in loaded]
    diags = {}
    for r, info in zip(loaded, infos):
        d = diagnose(r.steps, label=r.label, tau=info["tau"], adaptive=info["adaptive"] or r.label in adaptive_labels,
                     criteria=criteria, score=log_series(r.log, score_key), entropy=log_series(r.log, entropy_key))
        if not r.has_replay:
            d.reasons.insert(0, f"{r.path}: no replay diagnostics (replay/steps.jsonl)")
        diags[r.label] = d
    rec = recommend(list(diags.values()), criteria)
    warnings = [p for r in loaded for p in r.problems] + mismatches(infos, ignore=("tau",))
    summary = CalibrationSummary(diags, rec, compare_adaptive(list(diags.values()), rec), warnings, criteria)
    summary.paths = write_calibration(summary, out_dir, figures=figures) if out_dir is not None else {}
    return summary


def run_calibration(train_fn: TrainFn, taus: Sequence[float] = DEFAULT_TAUS, adaptive: bool = True,
                    out_dir: str | os.PathLike = "hdreplay-calibration", *, adaptive_start: float | None = None,
                    show_progress: bool = True, **summary_kwargs) -> CalibrationSummary:
    """The paper's sweep: one short run per tau (everything else fixed) plus, with ``adaptive``, one adaptive-tau
    run starting at ``adaptive_start`` (default: the middle tested tau); then :func:`summarize_calibration`.

    ``train_fn(label, tau, adaptive, run_dir) -> run directory`` trains one run; ``run_dir`` is a suggestion
    (``out_dir/runs/<label>``).  Labels are ``"tau=<tau:g>"`` and ``"adaptive"``.
    """
    taus = sorted(float(t) for t in taus)
    if not taus or any(not math.isfinite(t) or t <= 0 for t in taus) or len(set(taus)) != len(taus):
        raise AnalysisInputError(f"taus must be distinct positive numbers, got {taus}")
    out = Path(out_dir)
    plan = [(f"tau={t:g}", t, False) for t in taus]
    if adaptive:
        plan.append(("adaptive", taus[len(taus) // 2] if adaptive_start is None else float(adaptive_start), True))
    runs: dict[str, Path] = {}
    with tqdm(plan, desc="calibration runs", disable=not show_progress) as bar:
        for label, tau, ad in bar:
            got = train_fn(label, tau, ad, out / "runs" / label)
            if got is None or not Path(got).is_dir():
                raise AnalysisInputError(f"train_fn({label!r}, tau={tau:g}, adaptive={ad}) returned {got!r}, not an "
                                         "existing run directory")
            runs[label] = Path(got)
    return summarize_calibration(runs, out_dir=out, show_progress=show_progress,
                                 adaptive_labels=[lab for lab, _, ad in plan if ad], **summary_kwargs)


def render_calibration(summary: CalibrationSummary) -> str:
    """calibration.md."""
    c, r = summary.criteria, summary.recommendation
    rows = [[lab, fmt(d.tau), "yes" if d.adaptive else "no", str(d.n_updates), fmt(d.mean_accept, "pct"),
             fmt(d.accept_by_interval.get("early"), "pct"), fmt(d.accept_by_interval.get("final"), "pct"),
             fmt(d.mean_rejections), fmt(d.mean_budget_fill, "pct"),
             " / ".join(fmt(d.replay_kl_by_interval.get(i)) for i in INTERVALS), fmt(d.kl_final_over_early),
             fmt(d.score_by_interval.get("final")), fmt(d.entropy_by_interval.get("final")),
             f"**{d.status.replace('_', ' ')}**"] for lab, d in summary.runs.items()]
    notes = [f"- {lab}: {why}" for lab, d in summary.runs.items() for why in d.reasons]
    return "".join([
        "# tau calibration\n\n",
        f"Criteria: **starved** if final-third mean acceptance < {c.starved_accept:.0%} or it fell by more than "
        f"{c.starved_drop:.0%} from the first third; **too loose** if replay KL final-third mean > "
        f"{c.loose_kl_ratio:g}x its early-third mean while mean acceptance > {c.loose_accept:.0%}; gate **inactive** "
        f"(note) if mean acceptance > {c.inactive_accept:.0%}. Recommended: a viable selective gate that fills the "
        f"replay budget (within {c.fill_tolerance * 100:g} points of the best fill), smallest tau first. Thirds are "
        "over updates (steps with a non-empty pre-step buffer).\n\n",
        table(["run", "tau", "adaptive", "updates", "mean acceptance", "acceptance (early)", "acceptance (final)",
               "rejections / update", "budget fill", "replay KL early / middle / final", "KL final/early",
               "score (final)", "entropy (final)", "status"], rows),
        "\n" + "\n".join(notes) + "\n" if notes else "",
        f"\n## Recommendation\n\n**{r.status}**" + (f": tau = {r.tau:g}" if r.tau is not None else "")
        + f"\n\n{r.reason}\n",
        "\n## Adaptive tau vs fixed tau\n\n" + "\n".join(f"- {a['text']}" for a in summary.adaptive) + "\n"
        if summary.adaptive else "",
        "\n## Warnings\n\n" + "\n".join(f"- {w}" for w in summary.warnings) + "\n" if summary.warnings else "",
        "\n![calibration](calibration.png)\n" if "figure" in summary.paths else "",
    ])


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
    """Write calibration.md / .json (and .png when a run has step records) under ``out_dir``."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    summary.paths = {}
    if figures and any(d.series.get("step") for d in summary.runs.values()):
        fig_calibration(summary).savefig(out / "calibration.png", dpi=110)
        summary.paths["figure"] = out / "calibration.png"
    summary.paths["json"] = atomic_write_text(out / "calibration.json",
                                              json.dumps(summary.to_dict(), indent=1, allow_nan=False) + "\n")
    summary.paths["markdown"] = atomic_write_text(out / "calibration.md", render_calibration(summary))
    return summary.paths
