"""Construction-time replay arithmetic: settings that could never replay are refused naming the field, settings
that replay something else than their numbers suggest are warned about with the numbers."""

from __future__ import annotations

import warnings

import pytest

pytest.importorskip("trl")
pytestmark = pytest.mark.trl

from hdreplay import ReplayConfigError  # noqa: E402
from hdreplay.integrations.trl import HDRGRPOConfig  # noqa: E402
from hdreplay.integrations.trl.plan import ReplaySettingWarning, plan_replay  # noqa: E402

BASE = dict(output_dir="/tmp/hdr_plan", use_cpu=True, bf16=False, report_to="none")


def plan(**kw):
    args = dict(world=1, per_device=8, ga=1, spg=1, iterations=1, n=4, k_rep=None, capacity=512, max_scan=None,
                selector="headroom_drift")
    args.update(kw)
    return plan_replay(**args)


@pytest.mark.parametrize("kw, fresh, k", [
    (dict(), 2, 1),                                   # one generation per update: b = 8 rows / 4 = 2 groups
    (dict(ga=2, spg=2), 4, 2),                        # TRL's default spg = GA
    (dict(ga=2, spg=4), 8, 4),                        # a generation spans two updates: one replay step
    (dict(ga=4, spg=1), 8, 4),                        # four generations per update
    (dict(ga=4, spg=1, iterations=2), 4, 2),          # two generations (each iterated twice) per update
    (dict(world=8, per_device=2, n=2, ga=8, spg=8), 64, 32),
])
def test_fresh_groups_per_step_and_the_default_budget(kw, fresh, k):
    p = plan(**kw)
    assert (p.fresh_groups, p.k_rep) == (fresh, k)
    assert p.alpha == pytest.approx(fresh / (fresh + k))


def test_the_issue_example_below_the_truncation_unit_is_refused_with_the_numbers():
    # per_device=2, n=2 on 8 processes: replay rows split over 8 ranks -> groups cut to multiples of 4
    with pytest.raises(ReplayConfigError) as e:
        plan(world=8, per_device=2, n=2, ga=8, spg=8, k_rep=3)
    assert e.value.field == "replay_k_rep" and "truncation unit 4" in e.value.message
    assert plan(world=8, per_device=2, n=2, ga=8, spg=8, k_rep=4).k_rep == 4
    with pytest.warns(ReplaySettingWarning, match="at most 4 groups"):
        p = plan(world=8, per_device=2, n=2, ga=8, spg=8, k_rep=6)
        p.warn()
    assert p.k_rep == 4


def test_a_default_budget_of_zero_is_refused():
    with pytest.raises(ReplayConfigError) as e:
        plan(per_device=4, n=4)  # one fresh group per update: half of it is 0
    assert e.value.field == "replay_k_rep"
    assert plan(per_device=4, n=4, selector="none").k_rep == 0  # replay off: nothing to refuse


def test_budget_above_capacity_is_refused_through_the_config():
    with pytest.raises(ReplayConfigError) as e:
        HDRGRPOConfig(**BASE, per_device_train_batch_size=8, num_generations=4, replay_k_rep=64, replay_capacity=32)
    assert e.value.field == "replay_capacity"
    with pytest.raises(ReplayConfigError) as e:  # (TRL itself already refuses num_generations=1)
        plan(n=1, k_rep=1)
    assert e.value.field == "replay_selector"


def test_readme_style_settings_warn_with_the_replay_ratio():
    """per_device_train_batch_size=128, num_generations=8, replay_k_rep=64 is b + b/2 only on 8 processes; on one
    it replays 4x the 16 fresh groups."""
    with pytest.warns(ReplaySettingWarning) as rec:
        args = HDRGRPOConfig(**BASE, per_device_train_batch_size=128, num_generations=8, replay_k_rep=64)
    p = args.replay_plan()
    assert (p.fresh_groups, p.k_rep, p.ratio) == (16, 64, 4.0)
    assert any("4.00x" in str(w.message) for w in rec)
    assert plan(world=8, per_device=128, n=8, k_rep=64).notes == ()  # on 8 processes it is the paper's ratio


def test_scan_budget_below_the_replay_budget_and_uneven_layouts_warn():
    assert any("replay_max_scan=2" in t for t in plan(ga=2, spg=2, k_rep=3, max_scan=2).notes)
    p = plan(ga=3, spg=2)
    assert p.uneven and any("vary" in t for t in p.notes)
    assert any("replay_tau=0" in t for t in plan(tau=0.0, k_rep=1).notes)
    assert not plan(tau=0.0, k_rep=1, selector="recency").notes
    assert not plan(ga=2, spg=2).notes


def test_a_sane_config_builds_without_warnings():
    with warnings.catch_warnings():
        warnings.simplefilter("error", ReplaySettingWarning)
        args = HDRGRPOConfig(**BASE, per_device_train_batch_size=8, num_generations=4, gradient_accumulation_steps=2)
    assert args.to_replay_config().k_rep == 2
