"""What a replay state belongs to (issue 39, item 1), at the core: ``save(identity=)`` writes it, ``load(expect=)``
compares it before anything changes, for the controller and the peers' stores alike; bad identities are named.
Issue 44: a state without an identity, a value recorded on one side only or of another type, is refused by name."""

import pytest

from hdreplay import CheckpointMismatchError, ReplayConfig, ReplayController, ReplayInputError
from protocol import run_steps, state_hash
from strategy_states import BUILD, read_state, snapshot

CFG = ReplayConfig(k_rep=3, tau=5e-3, capacity=12, group_size=4)
ME = {"run_id": "a" * 32, "global_step": 5}


def _files(d):
    return {p: p.read_bytes() for p in sorted(d.rglob("*")) if p.is_file()}


def test_the_controller_state_carries_its_identity_and_a_load_compares_it(tmp_path):
    ctrl = run_steps(ReplayController(CFG), range(4), k=4)
    ctrl.save(tmp_path / "ck", identity=ME)
    assert read_state(tmp_path / "ck")[0]["meta"]["identity"] == ME
    other = run_steps(ReplayController(CFG, diagnostics_dir=tmp_path / "diag"), range(6), k=4)
    before, files = state_hash(other), _files(tmp_path / "diag")
    for expect, named in (({**ME, "global_step": 7}, "global_step: the replay state holds 5, the checkpoint 7"),
                          ({**ME, "run_id": "b" * 32}, f"run_id: the replay state holds '{'a' * 32}'")):
        with pytest.raises(CheckpointMismatchError, match=named):
            other.load(tmp_path / "ck", expect=expect)
        assert state_hash(other) == before and _files(tmp_path / "diag") == files  # nothing changed
    other.load(tmp_path / "ck", expect={**ME, "extra": None})  # recorded on neither side: equal
    assert state_hash(other) == state_hash(ctrl)
    plain = ReplayController(CFG)
    plain.load(tmp_path / "ck")  # no expectation: nothing compared


def test_a_state_saved_without_an_identity_is_refused_when_one_is_expected(tmp_path):
    """Issue 44: a pre-identity state (every state before issue 39) belongs to nothing known, so a resume that expects
    an identity refuses it by name, leaving the controller and its logs as they were (before: it loaded anywhere)."""
    ctrl = run_steps(ReplayController(CFG), range(4), k=4)
    ctrl.save(tmp_path / "ck")  # as hdreplay before issue 39 wrote it
    assert "identity" not in read_state(tmp_path / "ck")[0]["meta"]
    other = run_steps(ReplayController(CFG, diagnostics_dir=tmp_path / "diag"), range(6), k=4)
    before, files = state_hash(other), _files(tmp_path / "diag")
    with pytest.raises(CheckpointMismatchError, match=r"records no identity .* \(run_id='a{32}', global_step=5\)"):
        other.load(tmp_path / "ck", expect=ME)
    assert state_hash(other) == before and _files(tmp_path / "diag") == files
    plain = ReplayController(CFG)
    plain.load(tmp_path / "ck")  # nothing expected (a library load): nothing compared
    assert state_hash(plain) == state_hash(ctrl)


@pytest.mark.parametrize("saved, expect, named", [
    (ME, {**ME, "run_id": None}, r"run_id: the replay state holds 'a{32}', the checkpoint records none"),
    ({"global_step": 5}, ME, r"run_id: the replay state records none, the checkpoint 'a{32}'"),
    (ME, {**ME, "run_id": 5}, r"run_id: the replay state holds 'a{32}', the checkpoint 5 \(an int, not a str\)"),
    (ME, {**ME, "global_step": "5"},
     r"global_step: the replay state holds 5, the checkpoint '5' \(a str, not an int\)"),
    (ME, {**ME, "digest": "d" * 64}, r"digest: the replay state records none, the checkpoint 'd{64}'"),
])
def test_a_value_recorded_on_one_side_only_or_of_another_type_is_refused_by_name(tmp_path, saved, expect, named):
    """Issue 44: not recorded is no wildcard, and 5 is not '5' (before: a None or a non-string on either side was not
    compared, and another run's state loaded)."""
    run_steps(ReplayController(CFG), range(4), k=4).save(tmp_path / "ck", identity=saved)
    other = run_steps(ReplayController(CFG, diagnostics_dir=tmp_path / "diag"), range(6), k=4)
    before, files = state_hash(other), _files(tmp_path / "diag")
    with pytest.raises(CheckpointMismatchError, match=named):
        other.load(tmp_path / "ck", expect=expect)
    assert state_hash(other) == before and _files(tmp_path / "diag") == files


@pytest.mark.parametrize("bad", [["run", 1], {"run_id": ["x"]}, {1: "x"}, {"run_id": "x" * 300},
                                 {f"k{i}": i for i in range(17)}])
def test_a_bad_identity_is_named_and_nothing_is_written(tmp_path, bad):
    ctrl = run_steps(ReplayController(CFG), range(2), k=4)
    with pytest.raises(ReplayInputError, match="identity: must map names to JSON scalars"):
        ctrl.save(tmp_path / "ck", identity=bad)
    assert not (tmp_path / "ck").exists()
    ctrl.save(tmp_path / "ck")
    with pytest.raises(ReplayInputError, match="expect: must map names to JSON scalars"):
        ReplayController(CFG).load(tmp_path / "ck", expect=bad)


@pytest.mark.parametrize("name", sorted(BUILD))
def test_the_peers_stores_carry_and_compare_the_identity_too(tmp_path, name):
    saved = BUILD[name]()
    saved.save(tmp_path / "ck", identity=ME)
    other = BUILD[name](steps=1)
    before = snapshot(other)
    with pytest.raises(CheckpointMismatchError, match="global_step: the replay state holds 5, the checkpoint 6"):
        other.load(tmp_path / "ck", expect={**ME, "global_step": 6})
    assert snapshot(other) == before
    other.load(tmp_path / "ck", expect=ME)
    assert snapshot(other) == snapshot(saved)
    saved.save(tmp_path / "old")  # without an identity (issue 44: refused when one is expected)
    with pytest.raises(CheckpointMismatchError, match="records no identity"):
        other.load(tmp_path / "old", expect=ME)
    assert snapshot(other) == snapshot(saved)  # (unchanged since the load above)
