"""HDRGRPOConfig's replay fields, declared literally, are one-to-one with ReplayConfig and DiagnosticsConfig: every
setting settable, parsed, validated once."""

import dataclasses
import json

import pytest

pytest.importorskip("trl")
pytestmark = pytest.mark.trl

from hdreplay import ReplayConfig, ReplayConfigError  # noqa: E402
from hdreplay.config import knobs  # noqa: E402
from hdreplay.integrations.trl import HDRGRPOConfig  # noqa: E402
from hdreplay.integrations.trl.config import REPLAY_FIELDS  # noqa: E402

BASE = dict(output_dir="/tmp/hdr_cfg", use_cpu=True, bf16=False, report_to="none", per_device_train_batch_size=8,
            num_generations=4)
#: a non-default value for every core knob (the test fails if ReplayConfig gains a knob not listed here)
VALUES = dict(selector="freshper", k_rep=6, tau=0.02, capacity=20, drift_norm="l1", headroom_weighting="advantage",
              ingress="answer", answer_threshold=0.9, truncate_multiple=3, scan_chunk=5, scan_tokens=100_000,
              max_scan_chunk=50, acceptance_ema=0.25, max_scan=30, seed=5, max_age=3,
              priority_alpha=0.7, age_decay=3.5, is_beta=0.3,  # these three need a proportional selector
              scan_passes=2, scan_refresh="finish", skip_rejected=3)
#: the same for every diagnostic (hdreplay.diagnostics.DiagnosticsConfig)
DIAG = dict(diagnose_ungated=True, counterfactual=True,
            adaptive_tau='{"tau_min": 0.001, "tau_max": 0.1, "patience": 2}')


def test_every_replay_field_is_declared_one_to_one_with_the_core_and_the_diagnostics():
    """The literal replay_* fields: one per ReplayConfig field (same default -- k_rep's unset default is TRL's own --
    and the core's help), one per DiagnosticsConfig field (same default and help), the peers' strategies and the
    trainer's settings; nothing else."""
    from hdreplay.diagnostics import DiagnosticsConfig

    exposed = {f.name for f in dataclasses.fields(ReplayConfig)} - {"group_size"}  # derived: num_generations
    assert {k.name for k in knobs()} == exposed
    assert set(VALUES) == exposed and set(DIAG) == set(DiagnosticsConfig.field_names())
    fields = {f.name: f for f in dataclasses.fields(HDRGRPOConfig)}
    for f in dataclasses.fields(ReplayConfig):
        if f.name == "group_size":
            assert "replay_group_size" not in fields
            continue
        mine = fields[f"replay_{f.name}"]
        assert mine.metadata["help"].startswith(f.metadata["help"]), f.name
        assert mine.default == (None if f.name == "k_rep" else f.default), f.name
    for f in dataclasses.fields(DiagnosticsConfig):
        mine = fields[f"replay_{f.name}"]
        assert (mine.default, mine.metadata["help"]) == (f.default, f.metadata["help"]), f.name
    own = {"replay_repo", "replay_exgrpo", "replay_bapo", "replay_popo", "replay_dynamic_sampling",
           "replay_dynamic_sampling_max_batches", "replay_score_batch_size", "replay_train_scope", "replay_micro_step",
           "replay_diagnostics_dir", "replay_resume_without_state"}
    assert set(REPLAY_FIELDS) == {f"replay_{n}" for n in (*exposed, *DIAG)} | own
    import typing

    import hdreplay.baselines  # noqa: F401  (the peers' selectors)
    from hdreplay import SELECTORS

    hint = typing.get_type_hints(HDRGRPOConfig)["replay_selector"]
    assert set(typing.get_args(hint)) == set(SELECTORS)  # the literal choices are the registry's


def test_every_replay_knob_reaches_the_core_config():
    args = HDRGRPOConfig(**BASE, **{f"replay_{k}": v for k, v in {**VALUES, **DIAG}.items()})
    rc = args.to_replay_config()
    d = args.diagnostics_config()
    assert d.diagnose_ungated and d.counterfactual
    assert (d.adaptive_tau.tau_min, d.adaptive_tau.tau_max, d.adaptive_tau.patience) == (1e-3, 0.1, 2)
    for f in dataclasses.fields(ReplayConfig):
        if f.name == "group_size":
            assert rc.group_size == 4
        else:
            assert getattr(rc, f.name) == VALUES[f.name], f.name


def test_trl_parser_parses_every_knob_from_the_command_line():
    """``--replay_<knob>=value`` through TrlParser (what `trl grpo` and scripts use) for every knob ReplayConfig
    declares: each parsed value is the HDRGRPOConfig field and the core config's (a knob missing from VALUES is a
    KeyError here, so a new knob cannot go untested)."""
    from trl import TrlParser

    from hdreplay.diagnostics.adaptive_tau import adaptive_tau_from

    argv = ["--output_dir=/tmp/hdr_cfg", "--use_cpu", "--bf16=false", "--num_generations=4",
            "--per_device_train_batch_size=8"]
    argv += [f"--replay_{k}={str(v).lower() if isinstance(v, bool) else v}" for k, v in {**VALUES, **DIAG}.items()]
    (args,) = TrlParser((HDRGRPOConfig,)).parse_args_and_config(argv)
    rc = args.to_replay_config()
    for k in knobs():
        want, field, core = VALUES[k.name], getattr(args, f"replay_{k.name}"), getattr(rc, k.name)
        assert field == want and core == want and type(core) is type(want), (k.name, field, core, want)
    assert rc.group_size == 4
    d = args.diagnostics_config()
    assert d.diagnose_ungated is True and d.counterfactual is True
    assert d.adaptive_tau == adaptive_tau_from(json.loads(DIAG["adaptive_tau"]))


@pytest.mark.parametrize("over,needle", [
    (dict(replay_tau=-1.0), "replay_tau"), (dict(replay_k_rep=-2), "replay_k_rep"),
    (dict(replay_selector="bogus"), "replay_selector"),
    (dict(replay_ingress="answer"), "replay_answer_threshold"),
    (dict(replay_counterfactual="yes"), "replay_counterfactual"),
    (dict(replay_adaptive_tau='{"tau_min": 1'), "replay_adaptive_tau"),
    (dict(replay_adaptive_tau={"taumin": 1e-3}), "replay_adaptive_tau"),
    (dict(replay_acceptance_ema=0.0), "replay_acceptance_ema"), (dict(replay_capacity=0), "replay_capacity"),
])
def test_bad_values_are_refused_naming_the_trl_field(over, needle):
    with pytest.raises(ReplayConfigError, match=needle) as e:
        HDRGRPOConfig(**BASE, **over)
    assert e.value.field == needle


def test_the_replay_settings_are_built_once_per_run_and_follow_a_changed_field(monkeypatch, tmp_path):
    """One ReplayConfig and one plan per run: built with the HDRGRPOConfig, then handed to the trainer (and to
    everything that asks the config again) instead of being rebuilt; a field changed afterwards is honoured."""
    import hdreplay.integrations.trl.config as trl_config
    from hdreplay.integrations.trl import HDRGRPOTrainer
    from trl_fixtures import make_args, prompts, reward_digit, tiny_model

    plans, builds = [], []
    real_plan, real_init = trl_config.plan_replay, ReplayConfig.__post_init__
    monkeypatch.setattr(trl_config, "plan_replay", lambda **kw: plans.append(kw) or real_plan(**kw))
    monkeypatch.setattr(ReplayConfig, "__post_init__", lambda self: builds.append(self) or real_init(self))
    args = make_args(tmp_path, replay_k_rep=None)  # the default K_rep: the plan sets it (F // 2 = 2)
    assert len(plans) == 1 and builds[-1].k_rep == 2
    done = len(builds)
    model, tok = tiny_model(tmp_path)
    tr = HDRGRPOTrainer(model=model, reward_funcs=reward_digit, args=args, train_dataset=prompts(),
                        processing_class=tok)
    assert len(plans) == 1 and len(builds) == done  # the trainer took the config's settings
    assert tr.replay_config is args.to_replay_config() is tr.replay.config and tr.replay_plan is args.replay_plan()
    assert tr.replay.tau == args.replay_tau
    args.replay_tau = 0.5  # a field changed after construction is not served stale
    assert args.to_replay_config().tau == 0.5 and len(plans) == 2
