"""The ``hdreplay`` command.

    hdreplay demo        reduced comparison on CPU (what `make demo` runs), < 10 minutes on 2 cores
    hdreplay compare     the paper's role-aligned comparison in the CPU sandbox
    hdreplay report      replay analytics (markdown + PNG + JSON) of run directories
    hdreplay calibrate   the tau sweep (decade-spaced taus + adaptive) and its recommendation
    hdreplay explain     the replay primitive on synthetic groups, every decision printed (no model)
"""

from __future__ import annotations

import argparse
import math
import sys
import warnings
from dataclasses import fields
from pathlib import Path

from hdreplay.selection import SELECTORS

#: subcommands that parse their own arguments (everything after the name is handed over)
DELEGATED = {
    "report": ("hdreplay_lab.analysis", "main_report", "replay analytics report for run directories"),
}


#: demo defaults: one seed of the three methods that show what the gate does, under 10 minutes on 2 cores
DEMO_DEFAULTS = {"seeds": 1, "steps": 120, "eval_every": 20, "curve_prompts": 30, "signatures": False}


def _compare_args(p: argparse.ArgumentParser, *, demo: bool) -> None:
    from .sandbox.compare import CompareConfig
    from .sandbox.methods import COMPARE_METHODS, DEMO_METHODS, METHODS, SEARCH_METHODS
    from .sandbox.tasks import TASKS

    d = {f.name: f.default for f in fields(CompareConfig)}
    if demo:
        d.update(DEMO_DEFAULTS)
    p.add_argument("--task", default=d["task"], help=f"one of {sorted(TASKS)} (default: %(default)s)")
    p.add_argument("--methods", default=None,
                   help=f"comma-separated, from {list(METHODS)} (default: {','.join(DEMO_METHODS if demo else COMPARE_METHODS)}"
                        f"; with --task search: {','.join(SEARCH_METHODS)})")
    p.add_argument("--seeds", type=int, default=d["seeds"], help="seeds per method (default: %(default)s)")
    p.add_argument("--steps", type=int, default=d["steps"], help="optimizer steps per run (default: %(default)s)")
    p.add_argument("--prompts-per-step", type=int, default=d["prompts_per_step"], help="b: fresh groups per step (even)")
    p.add_argument("--generations", type=int, default=d["generations"], help="n: responses per group")
    p.add_argument("--lr", type=float, default=d["lr"])
    p.add_argument("--tau", type=float, default=d["tau"], help="Drift threshold of the gated methods")
    p.add_argument("--capacity", type=int, default=None,
                   help="replay buffer capacity in groups (default: a few steps of admitted groups, 2 x "
                        "prompts-per-step on the mix task, 4 x elsewhere)")
    p.add_argument("--eval-n", type=int, default=d["eval_n"], help="samples per held-out prompt (Mean@n / Best@n)")
    p.add_argument("--ingress", default="mixed", choices=["mixed", "answer"])
    p.add_argument("--answer-threshold", type=float, default=None)
    p.add_argument("--model", default=None, help="local causal-LM checkpoint instead of the warm-started tiny model")
    p.add_argument("--latency-ms", type=float, default=None,
                   help="search task: environment latency per tool call (default 5 ms)")
    p.add_argument("--rollout-ms-per-token", type=float, default=d["rollout_ms_per_token"],
                   help="modelled rollout cost slept per generated token while training (default: %(default)s)")
    p.add_argument("--modelled-ms-per-token", type=float, default=d["modelled_ms_per_token"],
                   help="per-token cost (ms) of the summary's modelled wall-clock column (default: the smallest cost "
                        "that makes generation 2/3 of on-policy b's measured step)")
    p.add_argument("--eval-every", type=int, default=d["eval_every"],
                   help="held-out curve every k steps, 0 = off (default: %(default)s)")
    p.add_argument("--curve-prompts", type=int, default=d["curve_prompts"],
                   help="held-out prompts per benchmark for the curve (default: %(default)s)")
    p.add_argument("--curve-n", type=int, default=d["curve_n"], help="samples per prompt for the curve")
    p.add_argument("--target", type=float, default=None,
                   help="accuracy for the cost-to-reach columns (default: on-policy b's final curve value)")
    p.add_argument("--workers", type=int, default=None,
                   help="runs in parallel, one process and one torch thread each (default: 2 on >= 2 cores)")
    p.add_argument("--signatures", action=argparse.BooleanOptionalAction, default=d["signatures"],
                   help="also run the mechanism-signature runs and write signatures.md (default: %(default)s)")
    p.add_argument("--out", default="hdreplay_runs/demo" if demo else "hdreplay_runs/compare")
    p.add_argument("--overwrite", action="store_true", help="replace an output directory holding a different run")
    p.add_argument("--no-progress", action="store_true")


def _run_compare(args, *, demo: bool) -> int:
    from .sandbox.compare import CompareConfig, run_compare
    from .sandbox.methods import COMPARE_METHODS, DEMO_METHODS, SEARCH_METHODS

    if args.methods is None:
        args.methods = ",".join(SEARCH_METHODS if args.task == "search" and not demo else
                                DEMO_METHODS if demo else COMPARE_METHODS)
    try:
        cfg = CompareConfig(task=args.task, methods=tuple(m.strip() for m in args.methods.split(",") if m.strip()),
                            seeds=args.seeds, steps=args.steps, prompts_per_step=args.prompts_per_step,
                            generations=args.generations, lr=args.lr, tau=args.tau, capacity=args.capacity,
                            eval_n=args.eval_n, ingress=args.ingress, answer_threshold=args.answer_threshold,
                            model=args.model, latency_ms=args.latency_ms,
                            rollout_ms_per_token=args.rollout_ms_per_token,
                            modelled_ms_per_token=args.modelled_ms_per_token, eval_every=args.eval_every,
                            curve_prompts=args.curve_prompts, curve_n=args.curve_n, target=args.target,
                            workers=args.workers, signatures=args.signatures)
        summary = run_compare(cfg, Path(args.out), overwrite=args.overwrite, progress=not args.no_progress,
                              demo=demo)
    except (ValueError, FileExistsError) as e:
        print(f"hdreplay {'demo' if demo else 'compare'}: {e}", file=sys.stderr)
        return 2
    out = Path(args.out)
    print()
    print((out / "summary.md").read_text())
    print(f"summary: {out / 'summary.md'}  {out / 'summary.json'}")
    for p in summary["plots"]:
        print(f"plot:    {out / p}")
    print(f"runs:    {out / 'runs'} (train_log.jsonl, replay/ diagnostics, metrics.json; "
          f"`hdreplay report {out / 'runs' / 'headroom_drift' / 'seed0'}` for the replay analytics)")
    if demo:
        print("\nOne seed shows what the gate does, not which method wins; `hdreplay compare` runs the paired, "
              "several-seed comparison with bootstrap intervals.")
    return 0


def _calibrate(args) -> int:
    from .analysis import run_calibration
    from .sandbox.compare import CompareConfig, check_model
    from .sandbox.methods import METHODS
    from .sandbox.runner import run_one
    from .sandbox.tasks import get_task
    from .sandbox.warmstart import warm_start

    try:
        try:
            taus = tuple(float(x) for x in args.taus.split(","))
        except ValueError:
            raise ValueError(f"--taus {args.taus!r}: expected comma-separated numbers such as 1e-3,1e-2,1e-1")
        if not all(math.isfinite(t) and t > 0 for t in taus) or len(set(taus)) != len(taus):
            raise ValueError(f"--taus {args.taus!r}: each tau must be a distinct positive finite number "
                             "(Drift is a mean squared log-prob change)")
        cfg = CompareConfig(task=args.task, methods=("headroom_drift",), seeds=1, steps=args.steps,
                            prompts_per_step=args.prompts_per_step, lr=args.lr, eval_n=args.eval_n)
        if args.model:
            check_model(Path(args.model))  # before anything is written under --out
    except ValueError as e:
        print(f"hdreplay calibrate: {e}", file=sys.stderr)
        return 2
    task = get_task(cfg.task)
    out = Path(args.out)
    model_dir = Path(args.model) if args.model else warm_start(task)  # the shared cache

    def train_fn(label, tau, adaptive, run_dir):
        spec = cfg.spec("headroom_drift", 0)
        spec.tau = tau
        if adaptive:
            spec.adaptive_tau = {"tau_min": min(taus), "tau_max": max(taus)}
        run_one(spec, METHODS["headroom_drift"], task, model_dir, Path(run_dir))
        return Path(run_dir)

    summary = run_calibration(train_fn, taus=taus, adaptive=not args.no_adaptive, out_dir=out)
    print(f"calibration: {out}")
    rec = getattr(summary, "recommendation", None)
    if rec is not None:
        print(f"recommendation: {rec}")
    return 0


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} must be at least 1")
    return value


def _parser() -> tuple[argparse.ArgumentParser, set[str]]:
    """The CLI parser and the option strings that configure a calibration sweep (not its summary)."""
    ap = argparse.ArgumentParser(prog="hdreplay", description="Headroom-Drift Replay for GRPO")
    sub = ap.add_subparsers(dest="command", required=True)
    _compare_args(sub.add_parser("demo", help="reduced comparison on CPU (make demo)"), demo=True)
    _compare_args(sub.add_parser("compare", help="the paper's role-aligned comparison in the CPU sandbox"), demo=False)
    for name, (_, _, help_) in DELEGATED.items():
        sub.add_parser(name, help=f"{help_} (see `hdreplay {name} --help`)", add_help=False)
    # no abbreviations: "--summ" must not silently start a training sweep instead of a summary
    cal = sub.add_parser("calibrate", help="tau sweep at decade-spaced values plus adaptive tau", allow_abbrev=False)
    sweep = [
        cal.add_argument("--task", default="mix", help="sandbox task (default: %(default)s)"),
        cal.add_argument("--taus", default="1e-3,1e-2,1e-1",
                         help="comma-separated Drift thresholds, one Headroom-Drift run each (default: %(default)s)"),
        cal.add_argument("--no-adaptive", action="store_true",
                         help="skip the extra run with adaptive tau between the smallest and largest value"),
        cal.add_argument("--steps", type=int, default=100, help="training steps per run (default: %(default)s)"),
        cal.add_argument("--prompts-per-step", type=int, default=16,
                         help="fresh groups per step b (default: %(default)s)"),
        cal.add_argument("--lr", type=float, default=1e-4, help="learning rate (default: %(default)s)"),
        cal.add_argument("--eval-n", type=int, default=4, help="samples per held-out prompt (default: %(default)s)"),
        cal.add_argument("--model", default=None,
                         help="local causal-LM checkpoint to start from (default: the sandbox warm start, cached)"),
    ]
    cal.add_argument("--out", default="hdreplay_runs/calibrate", help="output directory (default: %(default)s)")
    cal.add_argument("--summarize", action="store_true",
                     help="only summarize existing runs: `hdreplay calibrate --summarize RUN_DIR... | --run LABEL "
                          "RUN_DIR ... [--out DIR] [criteria]` (see `hdreplay calibrate --summarize --help`)")
    ex = sub.add_parser("explain", help="the replay primitive on synthetic groups (no model)")
    ex.add_argument("--steps", type=_positive_int, default=6, help="steps to walk through (default: %(default)s)")
    ex.add_argument("--selector", default="headroom_drift",
                    help=f"selector name: {', '.join(SELECTORS)} (default: %(default)s)")
    return ap, {o for action in sweep for o in action.option_strings}


def main(argv: list[str] | None = None) -> int:
    from .env import offline_env

    offline_env()
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in DELEGATED:
        import importlib

        module, func, _ = DELEGATED[argv[0]]
        return getattr(importlib.import_module(module), func)(argv[1:])
    ap, sweep_flags = _parser()
    if argv[:1] == ["calibrate"] and "--summarize" in argv:
        # summarizing finished runs has its own arguments (run dirs, labels, criteria): hand them over whole
        from .analysis import main_calibrate_summary

        rest = [a for a in argv[1:] if a != "--summarize"]
        sweep_only = sorted({a.split("=", 1)[0] for a in rest} & sweep_flags)
        if sweep_only:
            print(f"hdreplay calibrate: {', '.join(sweep_only)} configure a new sweep and cannot be combined with "
                  "--summarize, which only reads finished runs; drop them, or drop --summarize to train",
                  file=sys.stderr)
            return 2
        return main_calibrate_summary(rest)
    args = ap.parse_args(argv)
    # TRL 1.16 itself calls the name transformers 5.2x deprecated; nothing a user of this CLI can act on
    warnings.filterwarnings("ignore", message=r".*is_gradient_checkpointing.*", category=FutureWarning)
    if args.command in ("demo", "compare"):
        return _run_compare(args, demo=args.command == "demo")
    if args.command == "calibrate":
        return _calibrate(args)
    if args.command == "explain":
        from .synthetic import walkthrough

        try:
            walkthrough(steps=args.steps, selector=args.selector)
        except ValueError as e:
            print(f"hdreplay explain: {e}", file=sys.stderr)
            return 2
        return 0
    return 2


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
