"""Checkpoint compatibility and load semantics: a checkpoint of an older build (the unreleased 0.1's state, in the
manifest layout) loads, its layout 1 is refused by name, schema checks behind
valid checksums, resuming under a changed configuration, no memory maps, flat commit cost after a load."""

import hashlib
import json
import shutil
import warnings
from pathlib import Path

import pytest
import torch

from hdreplay import CheckpointError, ReplayBuffer, ReplayConfig, ReplayController, ReplayResumeWarning
from hdreplay.checkpoint import files as checkpoint
from hdreplay.diagnostics import AdaptiveTau, AdaptiveTauObserver
from hdreplay.store.blocks import BLOCK_GROUPS
from hdreplay.store.state import SLOT_DEFAULTS
from paths import CORE_DATA
from protocol import run_steps, state_hash

#: state written by hdreplay 0.1 (unreleased, commit b0218cc), rewritten in layout 2 when layout 1 stopped being read
LEGACY = CORE_DATA / "build_b0218cc"
#: the configuration the legacy fixture was written with (tests/core/data/build_b0218cc/expected.json)
LEGACY_CFG = ReplayConfig(k_rep=3, tau=5e-3, capacity=12, group_size=4)
LEGACY_TAU = AdaptiveTau(tau_min=1e-4, tau_max=0.05, warmup=1, patience=0)  # its adaptive_tau (now an observer)


def legacy(cfg=LEGACY_CFG, schedule=LEGACY_TAU) -> ReplayController:
    return ReplayController(cfg, observers=[AdaptiveTauObserver(schedule)])


def sha(t):
    return hashlib.sha256(t.contiguous().numpy().tobytes()).hexdigest()


def test_a_checkpoint_of_an_older_build_loads_exactly_and_the_next_save_writes_the_current_state(tmp_path):
    expected = json.loads((LEGACY / "expected.json").read_text())
    ctrl = legacy()
    ctrl.load(LEGACY / "controller")
    tensors, meta = ctrl.state_dict()
    # slots added after 0.1 (reject streak, skip step) come back at their defaults
    new_slots = {f"slot.{k}": v for k, v in SLOT_DEFAULTS.items()}
    assert set(tensors) - set(expected["tensors"]) == set(new_slots)
    assert all(bool((tensors[k] == v).all()) for k, v in new_slots.items())
    assert {k: sha(v) for k, v in tensors.items() if k not in new_slots} == expected["tensors"]
    # settings and state added after 0.1 (the random orders' seed and generator, ...) come back at their defaults
    added = set(meta["config"]) - set(expected["meta"]["config"])
    assert added and all(meta["config"][k] == getattr(ReplayConfig(), k) for k in added)
    assert meta["sampler_state"] == ReplayController(LEGACY_CFG).rng_state
    # settings that left the method's config (adaptive_tau, diagnose_ungated, counterfactual: hdreplay.diagnostics)
    gone = {"adaptive_tau", "diagnose_ungated", "counterfactual"} & set(expected["meta"]["config"])
    want = {**expected["meta"], "config": {k: v for k, v in expected["meta"]["config"].items() if k not in gone}}
    # the adaptive schedule's state now lives with its observer; the controller keeps the tau it gates with
    assert meta["observers"] == {"adaptive_tau": want.pop("tau_state")} and meta["tau"] == ctrl.tau
    old = {k: v for k, v in meta.items() if k not in ("starved_steps", "sampler_state", "observers", "tau")}
    assert {**old, "config": {k: v for k, v in old["config"].items() if k not in added}} == want
    buf = ReplayBuffer.load(LEGACY / "buffer")
    assert buf.insertion_ids().tolist() == ctrl.buffer.insertion_ids().tolist()
    d = tmp_path / "ck"
    shutil.copytree(LEGACY / "controller", d)
    ctrl.save(d)  # in place: the older version replaced by the current schema
    assert sorted(p.name for p in d.iterdir())[0] == "manifest.json" and len(list(d.iterdir())) == 2
    again = legacy()
    again.load(d)
    assert state_hash(again) == state_hash(ctrl)
    log_a, log_b = [], []
    run_steps(ctrl, range(6, 10), k=4, log=log_a)
    run_steps(again, range(6, 10), k=4, log=log_b)
    assert log_a == log_b and log_a[0][1]  # both continue identically (and the continuation scans)


def test_a_layout_1_checkpoint_of_hdreplay_0_1_is_refused_by_name_and_changes_nothing(tmp_path):
    version = LEGACY / "controller" / json.loads((LEGACY / "controller" / "manifest.json").read_text())["dir"]
    d = tmp_path / "ck"  # 0.1's layout: state.json (with the tensors' sha256) beside tensors.safetensors, no manifest
    d.mkdir()
    blob = (version / "tensors.safetensors").read_bytes()
    (d / "tensors.safetensors").write_bytes(blob)
    state = {**json.loads((version / "state.json").read_text()), "version": 1,
             "sha256": hashlib.sha256(blob).hexdigest()}
    (d / "state.json").write_text(json.dumps(state))
    ctrl = run_steps(legacy(), range(3), k=4)
    before = state_hash(ctrl)
    for call in (ctrl.load, ReplayController.verify, lambda p: ReplayBuffer.load(p)):
        with pytest.raises(CheckpointError, match=r"layout-1 checkpoint .*unreleased hdreplay 0\.1.*start a new run"):
            call(d)
    assert state_hash(ctrl) == before


def _rewrite_state(d: Path, edit) -> None:
    """Edit state.json and re-checksum it: a hand edit that the checksums cannot catch."""
    man = json.loads((d / "manifest.json").read_text())
    s = d / man["dir"] / "state.json"
    state = json.loads(s.read_text())
    edit(state["meta"])
    data = json.dumps(state).encode()
    s.write_bytes(data)
    man["files"]["state.json"] = {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    man["sha256"] = checkpoint._manifest_digest(man)
    (d / "manifest.json").write_text(json.dumps(man))


@pytest.mark.parametrize("edit", [
    lambda m: m.update(last_step="abc"),
    lambda m: m["buffer"].update(group_ids=[m["buffer"]["group_ids"][0]] * len(m["buffer"]["group_ids"])),
    lambda m: m["buffer"].update(birth_steps=m["buffer"]["birth_steps"][:-1]),
    lambda m: m.update(acceptance_rate=float("inf")),
    lambda m: m["observers"]["adaptive_tau"].update(tau="big"),
    lambda m: m.update(observers=[1]),
    lambda m: m["buffer"].update(next_id=10**30),
    lambda m: m.update(last_step=2),  # groups born later than the last step
])
def test_edited_state_is_refused_by_the_schema_and_a_refused_load_changes_nothing(tmp_path, edit):
    src = legacy()
    src.load(LEGACY / "controller")
    src.save(tmp_path / "ck")
    _rewrite_state(tmp_path / "ck", edit)
    target = run_steps(legacy(), range(3), k=4)
    before = state_hash(target)
    with pytest.raises(CheckpointError):
        target.load(tmp_path / "ck")
    assert state_hash(target) == before
    run_steps(target, range(3, 5), k=4)  # and it keeps working


def test_resuming_under_a_changed_configuration_refuses_or_warns(tmp_path):
    src = run_steps(ReplayController(ReplayConfig(k_rep=3, tau=5e-3, capacity=12)), range(4))
    src.save(tmp_path / "ck")
    for change in (dict(headroom_weighting="advantage"), dict(capacity=13), dict(group_size=3)):
        other = ReplayController(ReplayConfig(**{**dict(k_rep=3, tau=5e-3, capacity=12), **change}))
        with pytest.raises(CheckpointError, match=next(iter(change))):
            other.load(tmp_path / "ck")
        assert len(other.buffer) == 0 and other.last_step is None
    moved = ReplayController(ReplayConfig(selector="drift_only", k_rep=5, tau=1e-2, drift_norm="l1", capacity=12))
    with pytest.warns(ReplayResumeWarning) as rec:
        moved.load(tmp_path / "ck")
    text = str(rec[0].message)
    for piece in ("selector: 'headroom_drift' -> 'drift_only'", "k_rep: 3 -> 5", "tau: 0.005 -> 0.01",
                  "drift_norm: 'l2' -> 'l1'"):
        assert piece in text
    assert moved.last_step == 3 and len(moved.buffer) == len(src.buffer)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the same configuration: no warning at all
        ReplayController(src.config).load(tmp_path / "ck")


def test_an_adaptive_tau_outside_new_bounds_is_clamped(tmp_path):
    ctrl = legacy()
    ctrl.load(LEGACY / "controller")
    assert ctrl.tau == pytest.approx(0.005)
    tight = ReplayConfig(k_rep=3, tau=1e-3, capacity=12, group_size=4)
    other = legacy(tight, AdaptiveTau(tau_min=1e-4, tau_max=2e-3, warmup=1, patience=0))
    with pytest.warns(ReplayResumeWarning, match="tau"):
        other.load(LEGACY / "controller")
    assert other.tau == 2e-3 and other.observers[0].state.steps == ctrl.observers[0].state.steps


def test_a_loaded_buffer_maps_no_file_and_is_cut_into_small_blocks_that_own_their_memory(tmp_path):
    cfg = ReplayConfig(k_rep=3, tau=5e-2, capacity=300)
    src = run_steps(ReplayController(cfg), range(60), k=5)
    src.save(tmp_path / "ck")
    ctrl = ReplayController(cfg)
    ctrl.load(tmp_path / "ck")
    maps = Path("/proc/self/maps")
    if maps.exists():
        assert str(tmp_path / "ck") not in maps.read_text()
    blocks = ctrl.buffer._blocks
    assert len(ctrl.buffer) == 300 and sum(b.count for b in blocks) == 300
    assert max(b.count for b in blocks) <= BLOCK_GROUPS and len(blocks) == -(-300 // BLOCK_GROUPS)
    for b in blocks:  # each block owns exactly its bytes: evicting from the front copies one small block
        assert b.tokens.untyped_storage().nbytes() == b.tokens.numel() * 4
    log_a, log_b = [], []
    run_steps(src, range(60, 64), k=5, log=log_a)
    run_steps(ctrl, range(60, 64), k=5, log=log_b)
    assert log_a == log_b


def test_verify_reports_the_last_step_of_a_complete_checkpoint_and_refuses_others(tmp_path):
    ctrl = run_steps(ReplayController(ReplayConfig(capacity=12)), range(4))
    ctrl.save(tmp_path / "ck")
    assert ReplayController.verify(tmp_path / "ck") == 3
    assert ReplayController.verify(LEGACY / "controller") == 5
    (tmp_path / "partial").mkdir()
    (tmp_path / "partial" / ".tmp-v-0123456789abcdef").mkdir()  # a first save that died
    with pytest.raises(CheckpointError, match="leftovers of an interrupted first save"):
        ReplayController.verify(tmp_path / "partial")
    man = tmp_path / "ck" / "manifest.json"
    man.write_text(man.read_text().replace('"layout": 2', '"layout": 3'))
    with pytest.raises(CheckpointError, match="checksum mismatch"):
        ReplayController.verify(tmp_path / "ck")


def test_a_state_dict_whose_tensors_need_grad_loads():
    src = run_steps(ReplayController(ReplayConfig(capacity=12)), range(3))
    tensors, meta = src.state_dict()
    tensors = {k: v.requires_grad_() if v.is_floating_point() else v for k, v in tensors.items()}
    ctrl = ReplayController(ReplayConfig(capacity=12))
    ctrl.load_state_dict(tensors, meta)
    assert state_hash(ctrl) == state_hash(src)


def test_state_dict_tensors_are_copies(tmp_path):
    ctrl = run_steps(ReplayController(ReplayConfig(capacity=12)), range(3))
    before = state_hash(ctrl)
    tensors, meta = ctrl.state_dict()
    for t in tensors.values():
        t.zero_() if t.dtype != torch.bool else t.fill_(False)
    meta["buffer"]["group_ids"].clear()
    assert state_hash(ctrl) == before
