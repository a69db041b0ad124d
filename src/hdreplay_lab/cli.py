"""The ``hdreplay`` command: one dataclass per subcommand (its fields are the options, see ``options.py``).

    hdreplay demo                  reduced comparison on CPU (what `make demo` runs), < 10 minutes on 2 cores
    hdreplay compare               the paper's role-aligned comparison in the CPU sandbox
    hdreplay compare-async         the policy-lag sandbox: stale groups under age-drop, wait, keep-all, Drift-gated
    hdreplay report RUN_DIR...     replay analytics (markdown + PNG + JSON) of run directories, TRL output dirs too
    hdreplay calibrate run         the tau sweep (decade-spaced taus + adaptive tau) and its recommendation
    hdreplay calibrate summarize RUN_DIR...   the same summary for finished runs
    hdreplay explain               the replay primitive on synthetic groups, every decision printed (no model)

Every replay knob of :class:`hdreplay.ReplayConfig` is an option ``--replay.<name>`` of ``demo``, ``compare`` and
``calibrate run``.  Bad input is one line on stderr and exit status 2, before anything is written or trained.
"""

from __future__ import annotations

import json
import math
import sys
import warnings
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Literal

from hdreplay.selection import SELECTORS

from .analysis.calibration import CalibrationCriteria
from .analysis.report import ReportSettings
from .options import add_command, arg
from .sandbox.compare import CompareConfig
from .sandbox.methods import DEMO_METHODS

#: input errors: one line and exit status 2 when raised while parsing or checking a command
INPUT_ERRORS = (ValueError, OSError)


@dataclass
class CompareArgs:
    """The paper's role-aligned comparison in the CPU sandbox: every method x seed, held-out Best@n / Mean@n,
    training curves and step times."""

    config: CompareConfig
    out: Path = arg(Path("hdreplay_runs/compare"), "output directory (a new one, or one this command wrote)")
    overwrite: bool = arg(False, "replace an output directory holding a different comparison")
    progress: bool = arg(True, "show a progress bar")
    model_dir: Path | None = field(default=None, init=False, repr=False)  # set by check()

    def check(self) -> None:
        from .sandbox.compare import check_compare

        self.model_dir = check_compare(self.config, self.out, self.overwrite)

    def run(self) -> int:
        from .sandbox.compare import run_compare

        summary = run_compare(self.config, self.out, overwrite=self.overwrite, progress=self.progress,
                              model_dir=self.model_dir, demo=isinstance(self, DemoArgs))
        out = self.out
        print(f"\n{(out / 'summary.md').read_text()}\nsummary: {out / 'summary.md'}  {out / 'summary.json'}")
        for p in summary["plots"]:
            print(f"plot:    {out / p}")
        print(f"runs:    {out / 'runs'} (train_log.jsonl, replay/ diagnostics, metrics.json; "
              f"`hdreplay report {out / 'runs' / 'headroom_drift' / 'seed0'}` for the replay analytics)")
        return 0


@dataclass
class DemoArgs(CompareArgs):
    """Reduced comparison on CPU (what `make demo` runs): on-policy, recency replay and Headroom-Drift, one seed."""

    def run(self) -> int:
        rc = super().run()
        print("\nOne seed shows what the gate does, not which method wins; `hdreplay compare` runs the paired "
              "several-seed comparison with bootstrap intervals.")
        return rc


@dataclass
class RunsArgs:
    """What the analysis commands share: run directories, their labels and the output."""

    runs: list[Path] = arg(help="run directories", positional=True)
    label: list[str] = arg(default_factory=list, help="label of each run, in order (repeat; unset: directory names)")
    on_bad_line: Literal["skip", "stop"] = arg("skip", "a malformed JSONL line: skip it with a warning naming "
                                                       "file:line, or stop")
    figures: bool = arg(True, "write the PNG figures")
    progress: bool = arg(True, "show progress bars")

    def __post_init__(self) -> None:
        from .analysis.load import unique_labels

        if self.label and len(self.label) != len(self.runs):
            raise ValueError(f"{len(self.label)} --label values for {len(self.runs)} run directories; give one label "
                             "per run or none")
        self.labels = self.label or unique_labels([p.resolve().name or str(p) for p in self.runs])

    def check(self) -> None:
        if self.out is not None:
            _out_dir(self.out)


@dataclass
class ReportArgs(RunsArgs):
    """Replay analytics of run directories (side by side): markdown + PNG figures + JSON.  A run directory is what
    the sandbox or HDRLogCallback writes, a plain TRL output directory (trainer_state.json / TensorBoard events),
    or a bare replay diagnostics directory."""

    out: Path | None = arg(None, "output directory (unset: RUN_DIR/report for one run, ./hdreplay-report for several)")
    settings: ReportSettings = field(default_factory=ReportSettings)

    def run(self) -> int:
        from .analysis import build_report, load_run, write_report

        runs = [load_run(p, label=lab, on_bad_line=self.on_bad_line, warn=False) for p, lab in zip(self.runs, self.labels)]
        for msg in (m for r in runs for m in r.problems):
            print(f"warning: {msg}", file=sys.stderr)
        report = build_report(runs, self.settings, show_progress=self.progress)
        out = self.out or (self.runs[0] / "report" if len(runs) == 1 else Path("hdreplay-report"))
        paths = write_report(report, out, figures=self.figures, show_progress=self.progress)
        for msg in report["comparison"]["mismatches"]:
            print(f"note: {msg}", file=sys.stderr)
        print(f"report: {paths['markdown']}\njson:   {paths['json']}")
        for name, p in paths.items():
            if name.startswith("figure:"):
                print(f"figure: {p}")
        return 0


@dataclass
class SummarizeArgs(RunsArgs):
    """Summarise finished calibration runs: per-run gate diagnostics, starved / too-loose flags, the recommended tau
    and adaptive tau against it (calibration.md / .json / .png).  'tau=1e-3' labels give the tau of runs that do not
    log it."""

    out: Path = arg(Path("hdreplay-calibration"), "output directory")
    score_key: str = arg("reward", "trainer-log key of the training score")
    entropy_key: str = arg("entropy", "trainer-log key of the policy entropy")
    criteria: CalibrationCriteria = field(default_factory=CalibrationCriteria)

    def __post_init__(self) -> None:
        super().__post_init__()
        if len(set(self.labels)) != len(self.labels):
            raise ValueError(f"run labels must be unique, got {self.labels}; give --label for each run")

    def run(self) -> int:
        from .analysis import summarize_calibration

        summary = summarize_calibration(dict(zip(self.labels, self.runs)), out_dir=self.out, criteria=self.criteria,
                                        on_bad_line=self.on_bad_line, figures=self.figures,
                                        show_progress=self.progress, score_key=self.score_key,
                                        entropy_key=self.entropy_key)
        _print_summary(summary)
        return 0


@dataclass
class CalibrateArgs:
    """The paper's tau calibration in the sandbox: one short run per tau (everything else fixed) plus one run with
    adaptive tau between the smallest and largest, then the summary (see `hdreplay calibrate summarize`)."""

    config: CompareConfig
    taus: tuple[float, ...] = arg((1e-3, 1e-2, 1e-1), "Drift thresholds, one run each (distinct, positive, finite)")
    adaptive: bool = arg(True, "also one run with adaptive tau between the smallest and largest tau")
    selector: Literal["headroom_drift", "drift_only"] = arg("headroom_drift", "the gated method whose tau is "
                                                                              "calibrated", flag="--replay.selector")
    out: Path = arg(Path("hdreplay_runs/calibrate"), "output directory (runs/ and the summary)")
    progress: bool = arg(True, "show a progress bar")
    model_dir: Path | None = field(default=None, init=False, repr=False)  # set by check()

    def __post_init__(self) -> None:
        if not self.taus or not all(math.isfinite(t) and t > 0 for t in self.taus) or len(set(self.taus)) != len(self.taus):
            raise ValueError(f"--taus {','.join(map(str, self.taus))}: each tau must be a distinct positive finite "
                             "number (Drift is a mean squared log-prob change)")
        self.config = replace(self.config, methods=(self.selector,), seeds=1)
        for t in self.taus:  # every run's replay settings are valid (refusals name the option)
            self.run_config(t, adaptive=False)
        if self.adaptive:
            self.run_config(sorted(self.taus)[len(self.taus) // 2], adaptive=True)

    def run_config(self, tau: float, adaptive: bool) -> CompareConfig:
        """The comparison config of one sweep run: fixed runs drop adaptive_tau; the adaptive run moves tau between
        the smallest and largest tested tau unless --replay.adaptive_tau sets its own fields."""
        replay = {k: v for k, v in self.config.replay.items() if k != "adaptive_tau"}
        if adaptive:
            own = self.config.replay.get("adaptive_tau") or {}
            own = json.loads(own) if isinstance(own, str) else own
            replay["adaptive_tau"] = {"tau_min": min(self.taus), "tau_max": max(self.taus), **own}
        return replace(self.config, replay={**replay, "tau": tau})

    def check(self) -> None:
        from .sandbox.compare import check_model

        _out_dir(self.out)
        self.model_dir = None if self.config.model is None else check_model(Path(self.config.model))

    def run(self) -> int:
        from .analysis import run_calibration
        from .sandbox.methods import METHODS
        from .sandbox.runner import run_one
        from .sandbox.tasks import get_task
        from .sandbox.warmstart import warm_start

        task = get_task(self.config.task)
        model_dir = self.model_dir or warm_start(task)  # the shared cache (warmstart.default_cache_dir)

        def train(label: str, tau: float, adaptive: bool, run_dir: Path) -> Path:
            spec = self.run_config(tau, adaptive).spec(self.selector, 0)
            run_one(spec, METHODS[self.selector], task, model_dir, run_dir)
            return run_dir

        _print_summary(run_calibration(train, taus=self.taus, adaptive=self.adaptive, out_dir=self.out,
                                       show_progress=self.progress))
        return 0


@dataclass
class ExplainArgs:
    """The replay primitive on synthetic groups (no model): every scan, gate decision, replay and ingress printed."""

    steps: int = arg(6, "steps to walk through (>= 1)")
    selector: Literal[tuple(SELECTORS)] = arg("headroom_drift", "replay rule")  # type: ignore[valid-type]

    def __post_init__(self) -> None:
        if self.steps < 1:
            raise ValueError(f"--steps must be >= 1, got {self.steps}")

    def check(self) -> None:
        pass

    def run(self) -> int:
        from .synthetic import walkthrough

        walkthrough(steps=self.steps, selector=self.selector)
        return 0


def _out_dir(out: Path) -> None:
    if out.exists() and not out.is_dir():
        raise FileExistsError(f"--out {out} is a file; --out takes a directory")


def _print_summary(summary) -> None:
    for w in summary.warnings:
        print(f"warning: {w}", file=sys.stderr)
    for name, p in summary.paths.items():
        print(f"{name}: {p}")
    r = summary.recommendation
    print(f"recommendation: {r.status}" + (f" tau={r.tau:g}" if r.tau is not None else "") + f" -- {r.reason}")


def app():
    """The Typer application (commands return their dataclass; :func:`main` runs it)."""
    import typer

    root = typer.Typer(name="hdreplay", help="Headroom-Drift Replay for GRPO: sandbox, analytics, calibration.",
                       add_completion=False, no_args_is_help=True)
    add_command(root, "demo", DemoArgs, seeds=1, steps=120, methods=DEMO_METHODS, eval_every=20, curve_prompts=30,
                signatures=False, out=Path("hdreplay_runs/demo"))
    add_command(root, "compare", CompareArgs)
    from .sandbox.lag.compare import AsyncCompareArgs

    add_command(root, "compare-async", AsyncCompareArgs)
    add_command(root, "report", ReportArgs)
    calibrate = typer.Typer(help="tau calibration: `run` a sweep in the sandbox, or `summarize` finished runs.",
                            no_args_is_help=True)
    add_command(calibrate, "run", CalibrateArgs, steps=100, eval_n=4, eval_every=0,
                hide=("methods", "seeds", "latency_ms", "replay.selector", "replay.tau", "workers", "signatures",
                      "target", "modelled_ms_per_token", "curve_prompts", "curve_n"))
    add_command(calibrate, "summarize", SummarizeArgs)
    root.add_typer(calibrate, name="calibrate")
    add_command(root, "explain", ExplainArgs)
    return root


def parse(argv: list[str]):
    """The command dataclass ``argv`` describes (validated), or an exit status when --help was printed.  Raises
    typer's usage errors and the dataclasses' ValueErrors."""
    import typer

    return typer.main.get_command(app()).main(list(argv), prog_name="hdreplay", standalone_mode=False)


def main(argv: list[str] | None = None) -> int:
    from typer.exceptions import TyperException

    from .analysis import AnalysisInputError
    from .env import offline_env

    offline_env()
    argv = list(sys.argv[1:] if argv is None else argv)
    name = " ".join(["hdreplay", *argv[:2 if argv[:1] == ["calibrate"] else 1]])
    try:
        cmd = parse(argv)
        if isinstance(cmd, int) or cmd is None:
            return cmd or 0
        cmd.check()
    except TyperException as e:  # a usage error: the message alone, no usage block (help was printed for no args)
        ctx, msg = getattr(e, "ctx", None), e.format_message().replace("Value error, ", "")
        if msg:
            print(f"{ctx.command_path if ctx else 'hdreplay'}: error: {msg} (see --help)", file=sys.stderr)
        return 2
    except INPUT_ERRORS as e:
        print(f"{name}: error: {e}", file=sys.stderr)
        return 2
    # TRL 1.16 itself calls the name transformers 5.2x deprecated; nothing a user of this CLI can act on
    warnings.filterwarnings("ignore", message=r".*is_gradient_checkpointing.*", category=FutureWarning)
    try:
        return cmd.run()
    except (AnalysisInputError, OSError) as e:  # the analyses' bad input (bad lines with --on-bad-line stop, ...)
        print(f"{name}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
