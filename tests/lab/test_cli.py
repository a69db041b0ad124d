"""The ``hdreplay`` command line: bad flags and paths are one line on stderr with exit status 2 before anything is
written or trained, and every ReplayConfig knob reaches the run's HDRGRPOConfig."""

import dataclasses
import json

import pytest

from hdreplay import ReplayConfig
from hdreplay.diagnostics import AdaptiveTau
from hdreplay.diagnostics.adaptive_tau import adaptive_tau_from
from hdreplay_lab.cli import CalibrateArgs, CompareArgs, DemoArgs, main, parse
from hdreplay_lab.sandbox.methods import COMPARE_METHODS, DEMO_METHODS, METHODS


def refused(argv, capsys, needle):
    assert main(argv) == 2, argv
    out = capsys.readouterr()
    err = [x for x in out.err.splitlines() if x.strip()]
    assert len(err) == 1 and err[0].startswith(f"hdreplay {argv[0]}") and needle in err[0], (argv, out.err)
    assert "Traceback" not in out.err and "Usage" not in out.err


@pytest.mark.parametrize("args, needle", [
    (["--lr", "nan"], "--lr must be a finite number > 0"), (["--lr", "0"], "--lr"), (["--lr", "-1"], "--lr"),
    (["--lr", "abc"], "--lr"), (["--tau", "inf"], "--replay.tau must be a finite number >= 0"),
    (["--tau", "-0.1"], "--replay.tau"), (["--ingress", "answer", "--answer-threshold", "nan"], "answer_threshold"),
    (["--methods", ","], "--methods names no method"), (["--methods", "onpolicy_matched,per"], "valid"),
    (["--task", "search", "--latency-ms", "inf"], "--latency-ms"), (["--latency-ms", "-5"], "--latency-ms"),
    (["--task", "search", "--latency-ms", "-1"], "--latency-ms must be a finite number >= 0"),
    (["--task", "search", "--latency-ms", "nan"], "--latency-ms must be a finite number >= 0"),
    (["--task", "search", "--latencies-ms", "0,-50"], "--latencies-ms must be a finite number >= 0, got -50"),
    (["--task", "search", "--latencies-ms", "50,inf"], "--latencies-ms must be a finite number >= 0, got inf"),
    (["--task", "search", "--latencies-ms", "nan"], "--latencies-ms must be a finite number >= 0, got nan"),
    (["--task", "search", "--latencies-ms", "0,fast"], "--latencies-ms"),
    (["--latency-ms", "5"], "--latency-ms: task mix calls no tools"),
    (["--task", "geo", "--latencies-ms", "0,50"], "--latencies-ms: task geo calls no tools"),
    (["--task", "add", "--tool-concurrency", "sequential"], "--tool-concurrency: task add calls no tools"),
    (["--task", "search", "--tool-concurrency", "parallel"], "--tool-concurrency"),
    (["--seeds", "0"], "--seeds"), (["--steps", "-3"], "--steps"), (["--generations", "1"], "--generations"),
    (["--prompts-per-step", "5"], "even"), (["--task", "algebra"], "valid: ['mix'"),
    (["--replay.capacity", "0"], "--replay.capacity"), (["--replay.k_rep", "-1"], "--replay.k_rep"),
    (["--replay.acceptance_ema", "0"], "--replay.acceptance_ema"), (["--replay.drift_norm", "l3"], "l1"),
    (["--replay.adaptive_tau", "{oops"], "--replay.adaptive_tau"),
    (["--replay.adaptive_tau", '{"tau_min": 0.5, "tau_max": 1}'], "within adaptive_tau's bounds"),
    (["--replay.selector", "recency"], "--methods"), (["--no-such-flag"], "--no-such-flag"),
])
def test_compare_refuses_bad_flags_before_writing(tmp_path, capsys, args, needle):
    refused(["compare", "--out", str(tmp_path / "x"), *args], capsys, needle)
    assert not (tmp_path / "x").exists()


def test_output_paths_and_models_are_checked_before_writing(tmp_path, capsys):
    (tmp_path / "file").write_text("keep")
    for cmd in (["compare"], ["demo"], ["calibrate", "run"]):
        refused([*cmd, "--out", str(tmp_path / "file")], capsys, "is a file")
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "precious.txt").write_text("keep")
    refused(["compare", "--out", str(tmp_path / "other")], capsys, "--overwrite")
    (tmp_path / "notamodel").mkdir()
    (tmp_path / "notamodel" / "config.json").write_text(json.dumps({"model_type": "bert",
                                                                    "architectures": ["BertModel"]}))
    refused(["compare", "--model", str(tmp_path / "notamodel"), "--out", str(tmp_path / "o")], capsys, "causal LM")
    refused(["calibrate", "run", "--model", str(tmp_path / "missing"), "--out", str(tmp_path / "c")], capsys,
            "config.json")
    assert (tmp_path / "file").read_text() == "keep" and (tmp_path / "other" / "precious.txt").read_text() == "keep"
    assert not (tmp_path / "o").exists() and not (tmp_path / "c").exists()


@pytest.mark.parametrize("args, needle", [
    (["--taus", "1e-2,abc"], "--taus"), (["--taus", "-1e-2"], "distinct positive finite"),
    (["--taus", "1e-2,1e-2"], "distinct positive finite"), (["--taus", "nan"], "distinct positive finite"),
    (["--taus", ","], "distinct positive finite"),
    (["--tau", "0.1"], "unrecognized argument(s): --tau"),  # tau is swept by --taus
    (["--replay.selector", "recency"], "headroom_drift"), (["--lr", "inf"], "--lr"),
])
def test_calibrate_run_refuses_bad_flags_before_training(tmp_path, capsys, args, needle):
    refused(["calibrate", "run", "--out", str(tmp_path / "cal"), *args], capsys, needle)
    assert not (tmp_path / "cal").exists()


def test_subcommands_and_their_defaults():
    demo = parse(["demo"])
    assert isinstance(demo, DemoArgs) and demo.config.methods == DEMO_METHODS
    assert (demo.config.seeds, demo.config.steps, str(demo.out)) == (1, 120, "hdreplay_runs/demo")
    assert not demo.config.signatures and parse(["compare"]).config.signatures
    cmp_ = parse(["compare", "--seeds", "2", "--no-progress", "--methods", "dapo,headroom_drift"])
    assert type(cmp_) is CompareArgs and cmp_.config.methods == ("dapo", "headroom_drift") and not cmp_.progress
    assert parse(["compare"]).config.methods == COMPARE_METHODS
    assert parse(["compare", "--task", "search"]).config.methods == (
        "onpolicy_matched", "onpolicy_larger", "recency_matched", "dapo", "headroom_drift")
    cal = parse(["calibrate", "run", "--taus", "1e-3,1e-1", "--no-adaptive", "--replay.selector", "drift_only"])
    assert isinstance(cal, CalibrateArgs) and cal.taus == (1e-3, 1e-1) and not cal.adaptive
    assert (cal.config.methods == ("drift_only",)
            and (cal.config.steps, cal.config.eval_n, cal.config.seeds) == (100, 4, 1))
    assert parse(["--help"]) == 0


#: a valid non-default value of every ReplayConfig knob (a new knob without one fails the test below)
KNOB_VALUES = {
    "selector": "drift_only", "k_rep": 3, "tau": 0.05, "capacity": 40, "drift_norm": "l1",
    "headroom_weighting": "advantage", "ingress": "answer", "answer_threshold": 0.5, "truncate_multiple": 2,
    "scan_chunk": 7, "scan_tokens": 12345,
    "max_scan_chunk": 99, "max_scan": 11, "acceptance_ema": 0.25, "diagnose_ungated": True,
    "counterfactual": True, "adaptive_tau": {"tau_min": 0.01, "tau_max": 0.2}, "seed": 5, "max_age": 3,
    "priority_alpha": 0.7, "age_decay": 3.5, "is_beta": 0.3, "scan_passes": 2, "scan_refresh": "finish",
    "skip_rejected": 3,
}
#: knobs that apply to the proportional selectors only: checked on freshper (the user's value overrides the method's)
PROPORTIONAL_KNOBS = ("priority_alpha", "age_decay", "is_beta")


def knob_argv(name, value):
    if isinstance(value, bool):
        return [f"--replay.{name}" if value else f"--replay.no-{name}"]
    return [f"--replay.{name}", json.dumps(value) if isinstance(value, dict) else str(value)]


@pytest.mark.trl
def test_every_replay_knob_reaches_the_runs_trainer_config(tmp_path):
    from hdreplay_lab.sandbox.runner import trainer_args
    from hdreplay_lab.sandbox.tasks import get_task

    names = [f.name for f in dataclasses.fields(ReplayConfig)]
    derived = [f.name for f in dataclasses.fields(ReplayConfig) if f.metadata.get("derived")]
    from hdreplay.diagnostics import DiagnosticsConfig

    diag = list(DiagnosticsConfig.field_names())
    assert derived == ["group_size"] and set(KNOB_VALUES) == set(names) - set(derived) | set(diag)
    base = ["--prompts-per-step", "4", "--generations", "3", "--out", str(tmp_path / "o")]
    for name, value in KNOB_VALUES.items():
        if name == "selector":  # each comparison method sets its own; `calibrate run` picks the gated one
            cmd = parse(["calibrate", "run", *base, *knob_argv(name, value)])
            method = value
        else:  # answer-based ingress on the task whose rewards need it (its threshold is the task's 0.9)
            task = ["--task", "multi_reward"] if name == "ingress" else []
            method = "freshper" if name in PROPORTIONAL_KNOBS else "headroom_drift"
            cmd = parse(["compare", *base, *task, "--methods", method, *knob_argv(name, value)])
        cfg = cmd.config
        args = trainer_args(cfg.spec(method, 0), METHODS[method], get_task(cfg.task), tmp_path / "run")
        want = AdaptiveTau(**value) if name == "adaptive_tau" else value
        got = getattr(args, f"replay_{name}")  # the HDRGRPOConfig field ...
        assert (adaptive_tau_from(got) if name == "adaptive_tau" else got) == want, name
        core = args.to_replay_config()  # ... and the core config the trainer builds from it
        if name in diag:  # (a diagnostic: the trainer's DiagnosticsConfig)
            assert getattr(args.diagnostics_config(), name) == want, name
            continue
        assert getattr(core, name) == want, name
        assert core.group_size == 3  # derived from --generations
    # untouched knobs keep the sandbox defaults: r = b/2 replay groups, tau 1e-2, capacity 2b on the mix task (4b on
    # the others)
    for task, capacity in (("mix", 8), ("add", 16)):
        cfg = parse(["compare", *base, "--methods", "headroom_drift", "--task", task]).config
        core = trainer_args(cfg.spec("headroom_drift", 0), METHODS["headroom_drift"], get_task(task),
                            tmp_path / "r").to_replay_config()
        assert (core.k_rep, core.tau, core.capacity, core.selector) == (2, 1e-2, capacity, "headroom_drift")


def test_calibrate_run_configs_fixed_runs_and_the_adaptive_run(capsys, tmp_path):
    cmd = parse(["calibrate", "run", "--taus", "1e-3,1e-2,1e-1", "--replay.adaptive_tau", '{"patience": 2}',
                 "--replay.capacity", "48"])
    fixed = cmd.run_config(1e-3, adaptive=False).spec("headroom_drift", 0).replay
    assert (fixed["tau"], fixed["adaptive_tau"], fixed["capacity"]) == (1e-3, None, 48)
    ad = cmd.run_config(1e-2, adaptive=True).spec("headroom_drift", 0).replay["adaptive_tau"]
    assert (ad["tau_min"], ad["tau_max"], ad["patience"]) == (1e-3, 1e-1, 2)
    # an adaptive range that excludes the adaptive run's start (the middle tau) is refused before training
    refused(["calibrate", "run", "--out", str(tmp_path / "c"), "--replay.adaptive_tau",
             '{"tau_min": 0.5, "tau_max": 1}'], capsys, "adaptive_tau's bounds")
