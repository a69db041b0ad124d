"""The paper's tau calibration (Appendix G.2): diagnose short runs at decade-spaced tau, flag "starved" and "too
loose" gates, recommend the remaining regime, compare adaptive tau (pure: step frames in, dataclasses out); drive a
sweep through a caller's training function and write calibration.md / .json / .png (``hdreplay calibrate``).

Criteria (thirds = early / middle / final equal-count thirds of the updates, i.e. steps whose pre-step buffer was
non-empty; acceptance = the per-step gate acceptance rate, averaged):

    starved    final-third mean acceptance < ``starved_accept`` (0.10), or it fell below (1 - ``starved_drop``)
               = 25 % of the first-third mean.  The paper's tight gate: 6.4 % mean acceptance, replay vanishing.
    too loose  replay KL's final-third mean > ``loose_kl_ratio`` (2.0) x its early-third mean while the mean
               acceptance > ``loose_accept`` (0.75): the gate admits nearly everything and the admitted replay keeps
               moving away from the policy (paper: 94.4 %, 0.0045 -> 0.017).
    inactive   (a note, not a flag) mean acceptance > ``inactive_accept`` (0.90): tau filters little.
    viable     neither starved nor too loose (and there was scan data).

Recommendation among fixed-tau runs: the viable run, preferring a selective gate (not inactive) even over an
inactive one that fills more, then a run that fills the replay budget (mean fill within ``fill_tolerance`` = 5
points of the best fill among the runs still in contention; a run filling less ranks by its fill), then the smaller
tau.  Once the budget fills, a looser tau buys nothing but staler, higher-KL replay (docs/results/calibrate: tau 1e-1
filled 99.7 % against 97.7 % at 1e-2, with 6x the replay KL).  Fill is compared only when every viable run recorded
it.  With no viable run: all starved -> try 10x the largest tau; all too loose -> a tenth of the smallest; starved
below and too loose above -> the geometric mean of the bracketing taus.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

import pandas as pd

from hdreplay.checkpoint.atomic import atomic_write_text

from ..progress import progress
from .gate import acceptance, col, rejections, replay_kl, updates
from .load import AnalysisInputError, load_run
from .markdown import fmt, table
from .report import mismatches, run_info
from .stats import INTERVALS, check_settings, interval_means, running_mean, sanitize
from .training import log_series


@dataclass(frozen=True)
class CalibrationCriteria:
    """Thresholds of the calibration flags (see the module docstring for the exact rules)."""

    starved_accept: float = 0.10
    """starved if the final-third acceptance is below this"""
    starved_drop: float = 0.75
    """starved if acceptance fell by more than this fraction from the first third"""
    loose_kl_ratio: float = 2.0
    ("too loose if replay KL rose more than this factor (early -> final third) while the mean acceptance is above "
     "--loose-accept")
    loose_accept: float = 0.75
    """see --loose-kl-ratio"""
    inactive_accept: float = 0.90
    """the gate filters little (a note) above this mean acceptance"""
    fill_tolerance: float = 0.05
    """budget fills within this of the best (0.05 = 5 points) count as full; the smaller tau wins among them"""
    kl_window: int = 15
    """running-mean window of the calibration figure, in steps"""

    def __post_init__(self) -> None:
        check_settings(self, fractions=("starved_accept", "starved_drop", "loose_accept", "inactive_accept",
                                        "fill_tolerance"), finite=("loose_kl_ratio",), counts=("kl_window",))
        if self.loose_kl_ratio <= 1:
            raise AnalysisInputError(f"loose_kl_ratio (--loose-kl-ratio) must be a rise factor > 1, got "
                                     f"{self.loose_kl_ratio!r}")


@dataclass
class RunDiagnostics:
    """Gate diagnostics and flags of one calibration run (``series`` are per-step trajectories)."""

    label: str
    tau: float | None
    adaptive: bool
    selector: str | None
    n_updates: int
    mean_accept: float | None
    accept_by_interval: dict[str, float | None]
    mean_rejections: float | None
    rejections_by_interval: dict[str, float | None]
    mean_budget_fill: float | None
    replay_kl_by_interval: dict[str, float | None]
    kl_final_over_early: float | None
    score_by_interval: dict[str, float | None] = field(default_factory=dict)
    entropy_by_interval: dict[str, float | None] = field(default_factory=dict)
    tau_trajectory: dict[str, Any] | None = None
    starved: bool = False
    too_loose: bool = False
    gate_inactive: bool = False
    status: str = "viable"  # "viable" | "starved" | "too_loose" | "no_data"
    reasons: list[str] = field(default_factory=list)
    series: dict[str, Any] = field(default_factory=dict)


@dataclass
class Recommendation:
    """The decision.  status: "selected" (label/tau of a tested run), "extend_up" / "extend_down" / "bracket" (tau =
    the next value to try, label None), or "none".  For "selected": ``viable`` lists the viable runs,
    ``fill_compared`` says whether budget fill entered the ranking (every viable run recorded it), ``unfilled``
    that the chosen run leaves budget unfilled against the best viable fill, ``inactive`` that its gate filters
    little.  ``ruled_out`` maps each non-viable fixed run to its status."""

    status: str
    label: str | None
    tau: float | None
    reason: str
    viable: list[str] = field(default_factory=list)
    ruled_out: dict[str, str] = field(default_factory=dict)
    fill_compared: bool = False
    unfilled: bool = False
    inactive: bool = False


@dataclass
class CalibrationSummary:
    runs: dict[str, RunDiagnostics]
    recommendation: Recommendation
    adaptive: list[dict[str, Any]]
    warnings: list[str]
    criteria: CalibrationCriteria
    paths: dict[str, Any] = field(default_factory=dict)  # files written by write_calibration (not in to_dict)

    def to_dict(self) -> dict[str, Any]:
        return sanitize({"format": "hdreplay.calibration", "version": 1, "criteria": asdict(self.criteria),
                         "runs": {k: asdict(v) for k, v in self.runs.items()},
                         "recommendation": asdict(self.recommendation), "adaptive": self.adaptive,
                         "warnings": self.warnings})


def tau_trajectory(steps: pd.DataFrame) -> dict[str, Any] | None:
    """start / final / min / max tau and the number of loosen / tighten actions, or None if tau was never
    recorded.  final = the last ``tau_next`` (adaptive) or the last ``tau``."""
    taus, nxt = col(steps, "tau").dropna(), col(steps, "tau_next").dropna()
    if not len(taus):
        return None
    both = pd.concat([taus, nxt])
    acts = steps["tau_action"].value_counts()
    return {"start": float(taus.iloc[0]), "final": float((nxt if len(nxt) else taus).iloc[-1]),
            "min": float(both.min()), "max": float(both.max()),
            "n_loosen": int(acts.get("loosen", 0)), "n_tighten": int(acts.get("tighten", 0))}


def diagnose(steps: pd.DataFrame, *, label: str, tau: float | None, adaptive: bool,
             criteria: CalibrationCriteria = CalibrationCriteria(), score: Sequence[float] = (),
             entropy: Sequence[float] = ()) -> RunDiagnostics:
    """Diagnostics and flags of one run from its :func:`~.load.step_frame` (and optional score / entropy series)."""
    c = criteria
    acc = acceptance(steps) if len(steps) else {}
    kl = replay_kl(steps, window=c.kl_window) if len(steps) else {}
    by = acc.get("by_interval", {})
    d = RunDiagnostics(
        label=label, tau=tau, adaptive=adaptive, selector=steps["selector"].iloc[0] if len(steps) else None,
        n_updates=len(updates(steps)), mean_accept=acc.get("mean_accept_rate"),
        accept_by_interval=by.get("accept_rate", {}), mean_rejections=acc.get("mean_rejections"),
        rejections_by_interval=by.get("rejections", {}), mean_budget_fill=acc.get("mean_budget_fill"),
        replay_kl_by_interval=kl.get("by_interval", {}), kl_final_over_early=kl.get("final_over_early"),
        score_by_interval=interval_means(score) if len(score) else {},
        entropy_by_interval=interval_means(entropy) if len(entropy) else {}, tau_trajectory=tau_trajectory(steps))
    x = steps["step"]
    d.series = sanitize({"step": x, "accept_rate": col(steps, "accept_rate"), "rejections": rejections(steps),
                         "replay_kl": col(steps, "replay_kl"), "tau": col(steps, "tau"),
                         "accept_running": running_mean(x, col(steps, "accept_rate"), c.kl_window),
                         "replay_kl_running": running_mean(x, col(steps, "replay_kl"), c.kl_window)})
    _flag(d, c)
    return d


def _flag(d: RunDiagnostics, c: CalibrationCriteria) -> None:
    first, final = d.accept_by_interval.get("early"), d.accept_by_interval.get("final")
    if d.mean_accept is None or final is None:
        d.status = "no_data"
        d.reasons.append("no gate acceptance recorded (no replay diagnostics, or the buffer was never scanned)")
        return
    if final < c.starved_accept:
        d.starved = True
        d.reasons.append(f"starved: final-third acceptance {final:.1%} < {c.starved_accept:.0%}")
    elif first is not None and first > 0 and final < (1 - c.starved_drop) * first:
        d.starved = True
        d.reasons.append(f"starved: acceptance collapsed from {first:.1%} (first third) to {final:.1%} (final "
                         f"third), a fall of more than {c.starved_drop:.0%}")
    r = d.kl_final_over_early
    if r is not None and r > c.loose_kl_ratio and d.mean_accept > c.loose_accept:
        d.too_loose = True
        d.reasons.append(f"too loose: replay KL rose {r:.2f}x from the early to the final third (> "
                         f"{c.loose_kl_ratio:g}x) with mean acceptance {d.mean_accept:.1%} > {c.loose_accept:.0%}")
    d.gate_inactive = d.mean_accept > c.inactive_accept
    if d.gate_inactive:
        d.reasons.append(f"note: mean acceptance {d.mean_accept:.1%} > {c.inactive_accept:.0%}: "
                         "the gate filters little")
    d.status = "starved" if d.starved else "too_loose" if d.too_loose else "viable"


def recommend(diags: Sequence[RunDiagnostics], criteria: CalibrationCriteria | None = None) -> Recommendation:
    """The recommended tau among the fixed-tau runs (see the module docstring)."""
    tol = (criteria or CalibrationCriteria()).fill_tolerance
    fixed = [d for d in diags if not d.adaptive and d.tau is not None]
    if not fixed:
        return Recommendation("none", None, None, "no fixed-tau run with a known tau (label runs 'tau=<value>' or "
                              "keep their run.json / steps.jsonl tau)")
    viable = [d for d in fixed if d.status == "viable"]
    ruled_out = {d.label: d.status for d in fixed if d.status != "viable"}
    ruled = ("; ruled out: " + ", ".join(f"{k} ({v.replace('_', ' ')})" for k, v in ruled_out.items())
             if ruled_out else "")
    if viable:
        pool = [d for d in viable if not d.gate_inactive] or viable
        fills_known = all(d.mean_budget_fill is not None for d in viable)

        def short_of(d: RunDiagnostics, runs: list[RunDiagnostics]) -> bool:
            # 1e-9: fills are float means, and "within 5 points" includes exactly 5 points
            return fills_known and d.mean_budget_fill < max(r.mean_budget_fill for r in runs) - tol - 1e-9

        def preference(d: RunDiagnostics) -> tuple:  # runs that fill the budget tie on fill; shorter ones by fill
            short = short_of(d, pool)
            return d.gate_inactive, short, -d.mean_budget_fill if short else 0.0, d.tau

        best = min(viable, key=preference)
        rec = Recommendation("selected", best.label, best.tau, "", [d.label for d in viable], ruled_out, fills_known,
                             short_of(best, viable), best.gate_inactive)
        kl, fill = best.kl_final_over_early, "n/a" if best.mean_budget_fill is None else f"{best.mean_budget_fill:.1%}"
        name = f"tau={best.tau:g}" + ("" if best.label == f"tau={best.tau:g}" else f" ({best.label})")
        rec.reason = (f"{name} admits replay (mean acceptance {best.mean_accept:.1%}, budget fill {fill}) and keeps "
                      f"replay KL stable (final/early {'n/a' if kl is None else f'{kl:.2f}x'}){ruled}")
        if len(viable) > 1:
            order = (f"a full budget (fill within {tol * 100:g} points of the best), then " if fills_known
                     else "(budget fill not recorded for every run, so not compared) ")
            rec.reason += (f"; also viable: {', '.join(d.label for d in viable if d is not best)} (order of "
                           f"preference: a selective gate, then {order}the smaller tau)")
        if rec.unfilled:
            rec.reason += (f"; note: it leaves replay budget unfilled ({fill}, against "
                           f"{max(d.mean_budget_fill for d in viable):.1%} at a tau whose gate filters little); a "
                           "larger buffer gives the gate more to choose from")
        if rec.inactive:
            rec.reason += "; caveat: the gate filters little at this tau, a smaller tau may be as good"
        return rec
    starved = sorted(d.tau for d in fixed if d.status == "starved")
    loose = sorted(d.tau for d in fixed if d.status == "too_loose")
    if starved and loose:
        lo = max((t for t in starved if t < loose[0]), default=None)
        if lo is None:
            return Recommendation("none", None, None, f"inconsistent sweep: a smaller tau is too loose while a larger "
                                  f"one starves{ruled}; check that everything but tau was held fixed", [], ruled_out)
        hi = min(t for t in loose if t > lo)
        t = math.sqrt(lo * hi)
        return Recommendation("bracket", None, t, f"no tested tau is viable: tau <= {lo:g} starves replay and tau >= "
                              f"{hi:g} is too loose; try tau ~ {t:.3g} (between them){ruled}", [], ruled_out)
    if starved:
        return Recommendation("extend_up", None, 10 * starved[-1], f"every tested tau starves replay; loosen the "
                              f"gate: try tau = {10 * starved[-1]:g}{ruled}", [], ruled_out)
    if loose:
        return Recommendation("extend_down", None, loose[0] / 10, f"every tested tau is too loose; tighten the gate: "
                              f"try tau = {loose[0] / 10:g}{ruled}", [], ruled_out)
    return Recommendation("none", None, None, f"no run has gate diagnostics{ruled}", [], ruled_out)


def compare_adaptive(diags: Sequence[RunDiagnostics], rec: Recommendation) -> list[dict[str, Any]]:
    """One entry per adaptive run: its tau path, flags and the differences to the recommended fixed run."""
    ref = next((d for d in diags if d.label == rec.label), None)
    pct = lambda v: "n/a" if v is None else f"{v:.1%}"  # noqa: E731
    g = lambda v: "n/a" if v is None else f"{v:.3g}"  # noqa: E731
    out = []
    for d in (d for d in diags if d.adaptive):
        tr = d.tau_trajectory or {}
        e = {"label": d.label, "status": d.status, "tau_trajectory": tr, "mean_accept": d.mean_accept,
             "replay_kl_final": d.replay_kl_by_interval.get("final"), "mean_budget_fill": d.mean_budget_fill,
             "reference": ref.label if ref else None}
        text = (f"{d.label}: tau {tr.get('start', float('nan')):.3g} -> {tr.get('final', float('nan')):.3g} "
                f"({tr.get('n_loosen', 0)} loosen, {tr.get('n_tighten', 0)} tighten), status {d.status}, mean "
                f"acceptance {pct(d.mean_accept)}, final-third replay KL {g(e['replay_kl_final'])}")
        if ref is not None:
            text += (f"; fixed {ref.label}: acceptance {pct(ref.mean_accept)}, final-third replay KL "
                     f"{g(ref.replay_kl_by_interval.get('final'))}, budget fill {pct(ref.mean_budget_fill)} vs "
                     f"{pct(d.mean_budget_fill)}")
            fs, rs = d.score_by_interval.get("final"), ref.score_by_interval.get("final")
            if fs is not None and rs is not None:
                text += f"; final-third score {fs:.4g} vs {rs:.4g}"
        out.append({**e, "text": text})
    return out


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
    with progress(plan, desc="calibration runs", unit="run", enabled=show_progress) as bar:
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


def write_calibration(summary: CalibrationSummary, out_dir: str | os.PathLike, *,
                      figures: bool = True) -> dict[str, Path]:
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
