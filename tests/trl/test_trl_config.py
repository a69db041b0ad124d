"""HDRGRPOConfig's replay fields are generated from ReplayConfig: every knob settable, parsed, validated once."""

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
              ingress="answer", answer_threshold=0.9, truncate_multiple=3, scan_chunk=5, max_scan_chunk=50,
              acceptance_ema=0.25, diagnose_ungated=True, counterfactual=True, max_scan=30,
              adaptive_tau='{"tau_min": 0.001, "tau_max": 0.1, "patience": 2}', seed=5, max_age=3,
              priority_alpha=0.7, age_decay=3.5, is_beta=0.3,  # these three need a proportional selector
              scan_passes=2, scan_refresh="keep", skip_rejected=3)


def test_every_replay_knob_is_a_field_with_the_core_help():
    exposed = {f.name for f in dataclasses.fields(ReplayConfig)} - {"group_size"}  # derived: num_generations
    assert {k.name for k in knobs()} == exposed
    assert set(VALUES) == exposed
    fields = {f.name: f for f in dataclasses.fields(HDRGRPOConfig)}
    for k in knobs():
        assert f"replay_{k.name}" in REPLAY_FIELDS
        assert fields[f"replay_{k.name}"].metadata["help"].startswith(k.help)


def test_every_replay_knob_reaches_the_core_config():
    args = HDRGRPOConfig(**BASE, **{f"replay_{k}": v for k, v in VALUES.items()})
    rc = args.to_replay_config()
    for f in dataclasses.fields(ReplayConfig):
        if f.name == "adaptive_tau":
            assert (rc.adaptive_tau.tau_min, rc.adaptive_tau.tau_max, rc.adaptive_tau.patience) == (1e-3, 0.1, 2)
        elif f.name == "group_size":
            assert rc.group_size == 4
        else:
            assert getattr(rc, f.name) == VALUES[f.name], f.name


def test_trl_parser_parses_every_knob_from_the_command_line():
    """``--replay_<knob>=value`` through TrlParser (what `trl grpo` and scripts use) for every knob ReplayConfig
    declares: each parsed value is the HDRGRPOConfig field and the core config's (a knob missing from VALUES is a
    KeyError here, so a new knob cannot go untested)."""
    from trl import TrlParser

    from hdreplay.config import adaptive_tau_from

    argv = ["--output_dir=/tmp/hdr_cfg", "--use_cpu", "--bf16=false", "--num_generations=4",
            "--per_device_train_batch_size=8"]
    argv += [f"--replay_{k.name}={str(VALUES[k.name]).lower() if isinstance(VALUES[k.name], bool) else VALUES[k.name]}"
             for k in knobs()]
    (args,) = TrlParser((HDRGRPOConfig,)).parse_args_and_config(argv)
    rc = args.to_replay_config()
    for k in knobs():
        want, field, core = VALUES[k.name], getattr(args, f"replay_{k.name}"), getattr(rc, k.name)
        if k.name == "adaptive_tau":
            want, field = adaptive_tau_from(json.loads(want)), adaptive_tau_from(field)
        assert field == want and core == want and type(core) is type(want), (k.name, field, core, want)
    assert rc.group_size == 4


@pytest.mark.parametrize("over,needle", [
    (dict(replay_tau=-1.0), "replay_tau"), (dict(replay_k_rep=-2), "replay_k_rep"), (dict(replay_selector="bogus"), "replay_selector"),
    (dict(replay_ingress="answer"), "replay_answer_threshold"), (dict(replay_counterfactual="yes"), "replay_counterfactual"),
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
    from trl_fixtures import make_args, prompts, reward_digit, tiny_model

    from hdreplay.integrations.trl import HDRGRPOTrainer

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
