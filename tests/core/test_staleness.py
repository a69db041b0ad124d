"""The staleness rule (hdreplay.staleness): routing, diversion into the buffer, the floor-corrected gate, the ledger."""

import json
import warnings

import numpy as np
import pytest

from hdreplay import GroupRecord, ReplayConfig, ReplayController, ReplayInputError, ReplayProtocolError
from hdreplay.errors import CheckpointError, ReplayConfigError
from hdreplay.selection import select_replay
from hdreplay.staleness import AsyncReplay, DriftFloor, FloorWarning, StalenessConfig, plan_problems, route

pytestmark = pytest.mark.filterwarnings("ignore::hdreplay.staleness.FloorWarning")


def group(gid, birth, *, mixed=True, n=4, length=3, lp=-1.0):
    rewards = [float(i % 2) for i in range(n)] if mixed else [1.0] * n
    adv = [r - float(np.mean(rewards)) for r in rewards]
    return GroupRecord.from_responses(
        group_id=gid, prompt_ids=[5, 6, 7], completion_ids=[[3 + (i + j) % 5 for j in range(length + i % 2)]
                                                            for i in range(n)],
        logprobs=[[lp] * (length + i % 2) for i in range(n)], advantages=adv, rewards=rewards, birth_step=birth)


def shifted_scorer(delta: dict):
    """Current log-probs = stored + delta[group_id] on every token: Drift (l2) = delta^2 exactly."""
    def scorer(groups):
        return [g.logprobs + delta.get(g.group_id, 0.0) * g.loss_mask.float() for g in groups]
    return scorer


def areplay(k_rep=2, capacity=16, tau=1e-2, scan_passes=4, **cfg):
    ctrl = ReplayController(ReplayConfig(k_rep=k_rep, capacity=capacity, tau=tau, scan_passes=scan_passes))
    return AsyncReplay(ctrl, StalenessConfig(**cfg))


@pytest.mark.parametrize("k,mixed,expected", [(0, True, "fresh"), (1, False, "fresh"), (2, True, "divert"),
                                              (2, False, "drop"), (5, True, "drop")])
def test_route(k, mixed, expected):
    assert route(staleness=k, fresh_bound=1, mixed=mixed, max_divert_age=4) == expected


def test_diverted_groups_enter_the_buffer_stamped_with_their_generation_step_and_train_later():
    ar = areplay(fresh_bound=1)
    routes = [ar.offer(group("a", 5), step=5), ar.offer(group("b", 2), step=5),
              ar.offer(group("c", 1, mixed=False), step=5), ar.offer(group("d", 4, mixed=False), step=5)]
    assert routes == ["fresh", "divert", "drop", "fresh"]
    sel = ar.select(step=5, scorer=shifted_scorer({}))
    assert not sel.groups  # nothing enters before commit: no same-step replay
    m = ar.commit()
    buf = ar.controller.buffer
    assert buf.group_ids(buf.insertion_ids()) == ["b"]
    assert buf.slot_values("birth_step", buf.insertion_ids()).tolist() == [2]
    assert (m["async/generated_groups"], m["async/fresh_groups"], m["async/diverted_groups"],
            m["async/dropped_groups"], m["async/fresh_mixed_groups"]) == (4, 2, 1, 1, 1)
    assert m["async/age_diverted_mean"] == 3 and m["async/age_generated_max"] == 4
    sel = ar.select(step=6, scorer=shifted_scorer({"b": 0.05}))  # Drift 2.5e-3 <= tau
    assert [g.group_id for g in sel.groups] == ["b"] and sel.groups[0].birth_step == 2
    m = ar.commit()
    assert m["async/admitted_groups"] == 1 and m["async/age_admitted_mean"] == 4
    assert m["async/drift_divert_mean"] == pytest.approx(0.0025) == m["async/drift_admit_mean"]
    assert m["async/useful_group_share_cum"] == pytest.approx(2 / 4)  # fresh mixed "a" + admitted "b"


@pytest.mark.parametrize("passes", [1, 4])
def test_the_gate_still_decides_a_drifted_diverted_group_waits_and_is_evicted_unused(passes):
    """With exact early rejection (passes 4) the rejected group's scan Drift is a lower bound: the ledger records
    Drift at divert only from an exact scan, so it reports no value rather than a biased one."""
    ar = areplay(capacity=4, fresh_bound=0, scan_passes=passes)
    ar.offer(group("old", 0), step=3)
    ar.commit()
    sel = ar.select(step=4, scorer=shifted_scorer({"old": 0.5}))  # Drift 0.25 > tau
    assert not sel.groups and sel.scanned_group_ids == ["old"]
    for i in range(4):  # four more diverted groups push "old" out of the FIFO
        ar.offer(group(f"g{i}", 1), step=4)
    m = ar.commit()
    assert m["async/evicted_unused_groups"] == 1 and m["async/evicted_unused_tokens"] == group("old", 0).num_tokens
    if passes == 1:
        assert m["async/drift_divert_mean"] == pytest.approx(0.25)
    else:
        assert sel.scanned_exact.tolist() == [False] and sel.scanned_drift[0] < 0.25
        assert "async/drift_divert_mean" not in m and m["async/evicted_unused_groups"] == 1
    assert "old" not in ar.tracked and m["async/buffered_diverted"] == 4
    assert m["async/discarded_group_share_cum"] == pytest.approx(1 / 5)


def test_floor_is_subtracted_for_sampler_referenced_groups_only():
    ar = areplay(k_rep=4, tau=1e-3, fresh_bound=0, floor_min_groups=2, floor_ema=1.0)
    ar.offer(group("s", 0), step=2, sampler_reference=True)
    ar.offer(group("t", 0), step=2, sampler_reference=False)
    ar.commit()
    scorer = shifted_scorer({"s": 0.05, "t": 0.05})  # raw Drift 2.5e-3 > tau for both
    with pytest.warns(FloorWarning, match="0 of 2 staleness-0 groups"):
        sel = ar.select(step=3, scorer=scorer)
    assert not sel.groups and sel.scanned_tau.tolist() == [1e-3, 1e-3]  # floor not measured: the stricter gate
    ar.observe_floor([0.002, 0.002], tokens=[10, 10])
    ar.commit()
    assert ar.floor.ready and ar.floor.value == pytest.approx(0.002)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # warned once only
        sel = ar.select(step=4, scorer=scorer)
    assert [g.group_id for g in sel.groups] == ["s"]  # 2.5e-3 - 2e-3 <= 1e-3; "t" (trainer reference) is not helped
    # the gate: Drift <= tau + floor for the sampler-referenced group, Drift <= tau for the other
    assert dict(zip(sel.scanned_group_ids, sel.scanned_tau.tolist())) == {"s": pytest.approx(0.003), "t": 1e-3}
    assert dict(zip(sel.scanned_group_ids, sel.scanned_drift.tolist()))["s"] == pytest.approx(0.0025, rel=1e-4)
    m = ar.commit()
    assert m["async/floor"] == pytest.approx(0.002) and m["async/floor_ready"] == 1.0


def test_drift_floor_running_mean_and_bad_input():
    f = DriftFloor(initial=0.01, ema=0.5, min_groups=3)
    f.observe([0.1, 0.3], tokens=[1, 3])
    assert not f.ready and f.value == 0.01 and f.last_step_mean == pytest.approx(0.25)
    f.observe([0.05])
    assert f.ready and f.value == pytest.approx(0.5 * 0.25 + 0.5 * 0.05)
    with pytest.raises(ReplayInputError, match="finite numbers >= 0"):
        f.observe([-1.0])
    with pytest.raises(ReplayInputError, match="tau"):
        select_replay(ReplayController(ReplayConfig()).buffer, ReplayConfig(), None, step=0, tau="3")


def test_a_negative_or_missing_per_group_threshold_is_refused_by_the_selection():
    ar = areplay(fresh_bound=0)
    ar.offer(group("a", 0), step=1)
    ar.commit()
    for bad in (lambda gs: [-0.1] * len(gs), lambda gs: [], lambda gs: [float("nan")] * len(gs)):
        with pytest.raises(ReplayInputError, match="per-group threshold must return"):
            ar.controller.select(step=2, scorer=shifted_scorer({}), tau=bad)
        assert ar.controller._open_step is None  # refused before the step opened
    with pytest.raises(ReplayInputError, match="per-group callable"):
        ar.controller.select(step=2, scorer=shifted_scorer({}), tau=0.5)


def test_ingest_fresh_stores_fresh_mixed_groups_too():
    ar = areplay(fresh_bound=2, ingest_fresh=True)
    ar.offer(group("f", 3), step=3)
    ar.offer(group("z", 3, mixed=False), step=3)
    ar.commit()
    assert ar.controller.buffer.group_ids(ar.controller.buffer.insertion_ids()) == ["f"]
    assert "f" not in ar.tracked  # not diverted: the ledger does not count it as admitted later
    sel = ar.select(step=4, scorer=shifted_scorer({}))
    m = ar.commit()
    assert [g.group_id for g in sel.groups] == ["f"] and m["async/replayed_groups"] == 1
    assert m["async/admitted_groups"] == 0


def test_protocol_and_input_checks_change_nothing():
    ar = areplay()
    with pytest.raises(ReplayInputError, match="birth_step 7 is after step 5"):
        ar.offer(group("x", 7), step=5)
    ar.offer(group("a", 0), step=5)
    with pytest.raises(ReplayInputError, match="duplicate group_id"):
        ar.offer(group("a", 0), step=5)
    with pytest.raises(ReplayProtocolError, match="step 5 is open"):
        ar.offer(group("b", 0), step=6)
    assert ar.ledger.counts["generated_groups"] == 1
    ar.commit()
    with pytest.raises(ReplayProtocolError, match="already committed"):
        ar.offer(group("c", 0), step=5)
    with pytest.raises(ReplayInputError, match="after step 8"):
        ar.controller.stage([group("late", 9)], step=8, born_earlier=True)
    with pytest.raises(ReplayConfigError, match="max_divert_age"):
        StalenessConfig(fresh_bound=2, max_divert_age=2)
    import hdreplay.baselines  # noqa: F401  (registers adv_priority; the test must not rely on another having run)

    with pytest.raises(ReplayConfigError, match="single rollouts"):
        AsyncReplay(ReplayController(ReplayConfig(selector="adv_priority", group_size=4)), StalenessConfig())


def test_plan_problems_name_the_setting_and_the_numbers():
    errors, warns = plan_problems(capacity=8, k_rep=4, groups_per_step=12, supply_groups=10, fresh_bound=1,
                                  drift_norm="l1", sampler_reference=True, floor_initial=0.0,
                                  names={"capacity": "replay_capacity", "supply": "max_inflight_tasks"})
    assert any("replay_capacity=8 cannot hold one update's groups (12)" in e for e in errors)
    assert any("can supply 10 groups (max_inflight_tasks) but one update takes 12" in e for e in errors)
    assert any("drift_norm='l1'" in e for e in errors)
    assert any("floor_initial=0" in w for w in warns)
    errors, warns = plan_problems(capacity=20, k_rep=4, groups_per_step=12, supply_groups=None, fresh_bound=1,
                                  drift_norm="l2", sampler_reference=False, floor_initial=0.0)
    assert not errors and any("capacity=20 holds fewer groups than the 2 updates" in w for w in warns)


def test_state_dict_round_trip_and_ledger_file(tmp_path):
    ctrl = ReplayController(ReplayConfig(k_rep=2, capacity=16, tau=1e-2))
    ar = AsyncReplay(ctrl, StalenessConfig(fresh_bound=0), diagnostics_dir=tmp_path)
    ar.offer(group(1, 0), step=2)
    ar.observe_floor([0.001])
    ar.commit()
    state = json.loads(json.dumps(ar.state_dict()))
    other = AsyncReplay(ReplayController(ctrl.config), StalenessConfig(fresh_bound=0))
    other.load_state_dict(state)
    assert other.tracked == ar.tracked and other.floor.state_dict() == ar.floor.state_dict()
    assert other.ledger.totals == ar.ledger.totals and other.sampler_ref == {1}
    with pytest.raises(CheckpointError, match="floor must hold estimate"):
        other.load_state_dict({**state, "floor": {"estimate": -1, "groups": 1, "last_step_mean": None}})
    assert other.floor.state_dict() == ar.floor.state_dict()  # a refused load changed nothing
    rec = json.loads((tmp_path / "async.jsonl").read_text().splitlines()[0])
    assert rec["step"] == 2 and rec["diverted_groups"] == 1 and rec["ages"]["diverted"] == {"2": 1}
    assert rec["lengths"]["discarded"] == {} and rec["totals"]["generated_tokens"] == group(1, 0).num_tokens
