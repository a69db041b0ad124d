"""The ``hdreplay`` command: one dataclass per subcommand; tyro makes its fields the options and their docstrings
the help (the CleanRL pattern, ``tyro.cli``).

    hdreplay demo                  reduced comparison on CPU (what `make demo` runs), < 10 minutes on 2 cores
    hdreplay compare               the paper's role-aligned comparison in the CPU sandbox
    hdreplay compare-async         the policy-lag sandbox: stale groups under age-drop, wait, keep-all, Drift-gated
    hdreplay report RUN_DIR...     replay analytics (markdown + PNG + JSON) of run directories, TRL output dirs too
    hdreplay calibrate run         the tau sweep (decade-spaced taus + adaptive tau) and its recommendation
    hdreplay calibrate summarize RUN_DIR...   the same summary for finished runs
    hdreplay explain               the replay primitive on synthetic groups, every decision printed (no model)

Every replay knob of :class:`hdreplay.ReplayConfig` is an option ``--replay.<name>`` of ``demo``, ``compare`` and
``calibrate run`` (flags.py).  Bad input is one line on stderr (a run directory that cannot be read: one line per
problem) and exit status 2, before anything is written or trained.
A help longer than a line is written as adjacent string literals under its field (one string to tyro's docstring
reader; a triple-quoted docstring's line breaks would show in ``--help``).
"""

from __future__ import annotations

import json
import math
import sys
import warnings
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Annotated, Literal, Union

import tyro
from tyro.conf import Positional, Suppress, UseAppendAction, arg, subcommand

from hdreplay.selection import SELECTORS

from .analysis.calibration import CalibrationCriteria
from .analysis.report import ReportSettings
from .flags import CommaFloat, replay_options
from .sandbox.compare import CompareConfig, Methods
from .sandbox.lag.compare import AsyncCompareArgs
from .sandbox.methods import DEMO_METHODS

#: input errors: one line and exit status 2 when raised while parsing or checking a command
INPUT_ERRORS = (ValueError, OSError)


@dataclass
class CompareArgs:
    """The paper's role-aligned comparison in the CPU sandbox: every method x seed, held-out Best@n / Mean@n,
    training curves and step times."""

    config: Annotated[CompareConfig, arg(name="")]
    out: Path = Path("hdreplay_runs/compare")
    """output directory (a new one, or one this command wrote)"""
    overwrite: bool = False
    """replace an output directory holding a different comparison"""
    progress: bool = True
    """show progress (a bar on a terminal, else a line every 5 % of the steps)"""
    model_dir: Suppress[Path | None] = field(default=None, init=False, repr=False)  # set by check()

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
class DemoConfig(CompareConfig):
    """The comparison's settings with the demo's defaults: the three demo methods, one seed, no signature runs."""

    methods: Methods = DEMO_METHODS
    seeds: int = 1
    signatures: bool = False


@dataclass
class DemoArgs(CompareArgs):
    """Reduced comparison on CPU (what `make demo` runs): on-policy, recency replay and Headroom-Drift, one seed."""

    config: Annotated[DemoConfig, arg(name="")]
    out: Path = Path("hdreplay_runs/demo")

    def run(self) -> int:
        rc = super().run()
        print("\nOne seed shows what the gate does, not which method wins; `hdreplay compare` runs the paired "
              "several-seed comparison with bootstrap intervals.")
        return rc


@dataclass
class RunsArgs:
    """What the analysis commands share: run directories, their labels and the output."""

    runs: Annotated[Positional[list[Path]], arg(metavar="RUN_DIR", help_behavior_hint="(one or more)")]
    """run directories"""
    label: UseAppendAction[list[str]] = field(default_factory=list)
    """label of each run, in order (repeat; unset: directory names)"""
    on_bad_line: Literal["skip", "stop"] = "skip"
    ("a JSONL line cut short (what a crash mid-write leaves): skip it with a warning naming file:line, or stop; "
     "anything else that cannot be read as a run is an error either way")
    figures: bool = True
    """write the PNG figures"""
    progress: bool = True
    """show progress bars (on a terminal only)"""

    def __post_init__(self) -> None:
        from .analysis.load import unique_labels

        if not self.runs:
            raise ValueError("give one or more run directories")
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

    out: Path | None = None
    """output directory (unset: RUN_DIR/report for one run, ./hdreplay-report for several)"""
    settings: Annotated[ReportSettings, arg(name="")] = field(default_factory=ReportSettings)

    def run(self) -> int:
        from .analysis import AnalysisInputError, build_report, load_run, write_report

        runs, refused = [], []
        for p, lab in zip(self.runs, self.labels):  # every run is read, so every problem of every run is listed
            try:
                runs.append(load_run(p, label=lab, on_bad_line=self.on_bad_line, warn=False))
            except AnalysisInputError as e:
                refused.append(str(e))
        if refused:
            raise AnalysisInputError(messages=refused)
        for msg in (m for r in runs for m in r.problems):
            print(f"warning: {msg}", file=sys.stderr)
        report = build_report(runs, self.settings, show_progress=self.progress)
        for msg in (m for r in runs for m in r.notes):  # what a run lacks or what was left out of it
            print(f"note: {msg}", file=sys.stderr)
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

    out: Path = Path("hdreplay-calibration")
    """output directory"""
    score_key: str = "reward"
    """trainer-log key of the training score"""
    entropy_key: str = "entropy"
    """trainer-log key of the policy entropy"""
    criteria: Annotated[CalibrationCriteria, arg(name="")] = field(default_factory=CalibrationCriteria)

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
class CalibrateConfig(CompareConfig):
    """The comparison's settings a tau sweep uses: one seed of one gated method, shorter runs, no held-out curve."""

    methods: Suppress[Methods] = None
    seeds: Suppress[int] = 1
    steps: int = 100
    eval_n: int = 4
    latency_ms: Suppress[float | None] = None
    latencies_ms: Suppress[CommaFloat] = None
    tool_concurrency: Suppress[Literal["per_turn", "sequential"]] = "per_turn"
    modelled_ms_per_token: Suppress[float | None] = None
    eval_every: int = 0
    curve_prompts: Suppress[int] = 30
    curve_n: Suppress[int] = 4
    target: Suppress[float | None] = None
    workers: Suppress[int | None] = None
    signatures: Suppress[bool] = False
    replay: replay_options(exclude=("selector", "tau")) = field(default_factory=dict)  # type: ignore[valid-type]
    """replay settings of every sweep run (tau is swept by --taus, the selector is --replay.selector)"""


@dataclass
class CalibrateArgs:
    """The paper's tau calibration in the sandbox: one short run per tau (everything else fixed) plus one run with
    adaptive tau between the smallest and largest, then the summary (see `hdreplay calibrate summarize`)."""

    config: Annotated[CalibrateConfig, arg(name="")]
    taus: CommaFloat = (1e-3, 1e-2, 1e-1)
    """Drift thresholds, one run each (distinct, positive, finite)"""
    adaptive: bool = True
    """also one run with adaptive tau between the smallest and largest tau"""
    selector: Annotated[Literal["headroom_drift", "drift_only"], arg(name="replay.selector", prefix_name=False)] = (
        "headroom_drift")
    """the gated method whose tau is calibrated"""
    out: Path = Path("hdreplay_runs/calibrate")
    """output directory (runs/ and the summary)"""
    progress: bool = True
    """show progress (a bar on a terminal, else a line per run)"""
    model_dir: Suppress[Path | None] = field(default=None, init=False, repr=False)  # set by check()

    def __post_init__(self) -> None:
        if (not self.taus or not all(math.isfinite(t) and t > 0 for t in self.taus)
                or len(set(self.taus)) != len(self.taus)):
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
        from .drift_floor import calibration_floor  # the gate's bf16 noise floor on this model

        for line in calibration_floor(model_dir, task=task, taus=self.taus, out_dir=self.out):
            print(f"drift floor: {line}")
        return 0


@dataclass
class ExplainArgs:
    """The replay primitive on synthetic groups (no model): every scan, gate decision, replay and ingress printed."""

    steps: int = 6
    """steps to walk through (>= 1)"""
    selector: Literal[tuple(SELECTORS)] = "headroom_drift"  # type: ignore[valid-type]
    """replay rule"""

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


@dataclass
class Calibrate:
    """tau calibration: `run` a sweep in the sandbox, or `summarize` finished runs."""

    command: Annotated[Union[Annotated[CalibrateArgs, subcommand("run")],
                             Annotated[SummarizeArgs, subcommand("summarize")]], arg(name="")]


#: the ``hdreplay`` command line: one subcommand per dataclass
Command = Union[Annotated[DemoArgs, subcommand("demo")], Annotated[CompareArgs, subcommand("compare")],
                Annotated[AsyncCompareArgs, subcommand("compare-async")],
                Annotated[ReportArgs, subcommand("report")], Annotated[Calibrate, subcommand("calibrate")],
                Annotated[ExplainArgs, subcommand("explain")]]


COMMANDS = ("demo", "compare", "compare-async", "report", "calibrate", "explain")


class UsageError(ValueError):
    """A flag or value tyro could not parse, as one line (``prog`` names the (sub)command)."""

    def __init__(self, prog: str, message: str) -> None:
        super().__init__(message)
        self.prog = prog


def _usage_error(event) -> None:
    """tyro's parse-error hook: raise the error as one line instead of tyro's multi-line box."""
    from tyro import _errors as te

    arg_ = getattr(event, "argument", None)
    flag = arg_.display_name() if arg_ is not None else None
    if isinstance(event, te.UnrecognizedArgs):
        msg = f"unrecognized argument(s): {' '.join(event.tokens)}"
    elif isinstance(event, te.InvalidChoice):
        msg = f"{flag}: invalid choice {event.value!r}; valid: {list(event.choices)}"
    elif isinstance(event, te.InstantiationFailure):  # after parsing: its prog is the root's, main() names the command
        first = event.message.strip().splitlines()[0]  # (an Optional field's message adds a "Got errors:" list)
        raise ValueError(f"{flag}: {first}" if flag else first)
    elif isinstance(event, te.MissingArgs):
        msg = f"missing {', '.join(a.arg.display_name() for a in event.missing_arguments)}"
    elif isinstance(event, te.MissingSubcommand):
        names = list(event.subcommand_spec.parser_from_name)
        msg = (f"unknown command {event.found_token!r}; " if event.found_token else "") + f"choose one of {names}"
    else:
        msg = te._render(event)[0] + (f" ({flag})" if flag else "")
    raise UsageError(event.prog, msg)


def parse(argv: list[str]):
    """The command dataclass ``argv`` describes (validated), or an exit status when --help was printed.  Raises
    UsageError for what tyro cannot parse and the dataclasses' ValueErrors."""
    from tyro import _errors  # private, hence the exact pin of tyro: the hook that makes an error one line

    try:
        with _errors.on_parse_error(_usage_error):
            cmd = tyro.cli(Command, args=list(argv), prog="hdreplay", config=(tyro.conf.OmitSubcommandPrefixes,),
                           description="Headroom-Drift Replay for GRPO: sandbox, analytics, calibration.")
    except SystemExit as e:  # --help
        return e.code or 0
    return cmd.command if isinstance(cmd, Calibrate) else cmd


def main(argv: list[str] | None = None) -> int:
    from hdreplay.errors import ReplayError

    from .analysis import AnalysisInputError
    from .env import offline_env

    offline_env()
    argv = list(sys.argv[1:] if argv is None else argv)
    sub = argv[:1] == ["calibrate"] and argv[1:2] in (["run"], ["summarize"])
    name = " ".join(["hdreplay", *argv[:2 if sub else 1]])
    if argv in ([], ["calibrate"]):  # no command: the help, as a usage error, and what to type on stderr
        parse([*argv, "--help"])
        choices = ("run", "summarize") if argv else COMMANDS
        print(f"{name}: error: no {'subcommand' if argv else 'command'} given; choose one of {', '.join(choices)} "
              f"(e.g. `{name} {choices[0]} --help`)", file=sys.stderr)
        return 2
    try:
        cmd = parse(argv)
        if isinstance(cmd, int):
            return cmd
        cmd.check()
    except UsageError as e:  # tyro names the root for errors found after the subcommand's own parse
        prog = name if e.prog == "hdreplay" and argv[:1] and argv[0] in COMMANDS else e.prog
        print(f"{prog}: error: {e} (see --help)", file=sys.stderr)
        return 2
    except INPUT_ERRORS as e:
        print(f"{name}: error: {e}", file=sys.stderr)
        return 2
    # TRL 1.16 itself calls the name transformers 5.2x deprecated; nothing a user of this CLI can act on
    warnings.filterwarnings("ignore", message=r".*is_gradient_checkpointing.*", category=FutureWarning)
    try:
        return cmd.run()
    except (AnalysisInputError, ReplayError, OSError) as e:  # the analyses' bad input (bad lines with --on-bad-line
        # stop, malformed records, ...) and any replay setting refused once the command runs: one line per problem
        for msg in getattr(e, "messages", None) or [e]:  # (several runs refused: each run's problems)
            print(f"{name}: error: {msg}", file=sys.stderr)
        return 2


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
