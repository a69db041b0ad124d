"""A resume refuses a replay state that is not its checkpoint's (issue 39, item 1): HDRGRPOTrainer and
HDRAsyncGRPOTrainer.

Every replay state carries the run id (made at the run's start, written into ``trainer_state.json`` by the Trainer
through the ``HDReplayRun`` callback) and the global step; the asynchronous trainer's routing state carries its step
too.  A resume compares them with ``trainer_state.json`` before it touches anything.  Before: ``checkpoint-3`` holding
``checkpoint-1``'s ``hdreplay/`` resumed silently and deleted steps 1-2 from the logs; a newer step's state failed with
a raw ReplayProtocolError; another run's state of the same step resumed silently.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

pytest.importorskip("trl")
pytestmark = [pytest.mark.trl, pytest.mark.filterwarnings("ignore:hdreplay async:UserWarning")]

from hdreplay import CheckpointError, CheckpointMismatchError, ReplayResumeWarning  # noqa: E402
from hdreplay.integrations.trl import HDRGRPOTrainer  # noqa: E402
from strategy_states import read_state, resign  # noqa: E402
from trl_fixtures import RecordingTrainer, make_args, prompts, reward_digit, tiny_model  # noqa: E402

OVER = dict(max_steps=3, save_strategy="steps", save_steps=1, replay_tau=0.05, replay_k_rep=3)


def _files(root: Path) -> dict:
    return {p: p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def _trainer(model_dir, out, cls=RecordingTrainer, **over):
    model, tok = tiny_model(model_dir)
    return cls(model=model, reward_funcs=reward_digit, args=make_args(out, **{**OVER, **over}),
               train_dataset=prompts(), processing_class=tok)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Two runs of 3 steps, a checkpoint after each (run B: another seed)."""
    root = tmp_path_factory.mktemp("identity")
    model_dir = root / "models"
    a = _trainer(model_dir, root / "a")
    a.train()
    b = _trainer(model_dir, root / "b", seed=1)
    b.train()
    return root, model_dir


def _run_id(ckpt: Path) -> str:
    return json.loads((ckpt / "trainer_state.json").read_text())["stateful_callbacks"]["HDReplayRun"]["args"]["run_id"]


def test_each_checkpoint_records_its_run_and_step_in_both_places(runs):
    root, _ = runs
    ids = {_run_id(root / "a" / f"checkpoint-{n}") for n in (1, 2, 3)}
    assert len(ids) == 1 and ids != {_run_id(root / "b" / "checkpoint-3")}
    (run_id,) = ids
    for n in (1, 2, 3):
        meta = read_state(root / "a" / f"checkpoint-{n}" / "hdreplay")[0]["meta"]
        assert meta["identity"] == {"run_id": run_id, "global_step": n}


def _attack(root, case, tmp_path):
    """A copy of run A with one checkpoint's replay state replaced as an attacker or a careless copy would."""
    out = tmp_path / "a"
    shutil.copytree(root / "a", out)
    if case == "an older step's state":  # checkpoint-3 holding checkpoint-1's hdreplay/
        target, src = out / "checkpoint-3", out / "checkpoint-1"
    elif case == "a newer step's state":
        target, src = out / "checkpoint-1", out / "checkpoint-3"
    else:  # another run's state of the same step
        target, src = out / "checkpoint-3", root / "b" / "checkpoint-3"
    shutil.rmtree(target / "hdreplay")
    shutil.copytree(src / "hdreplay", target / "hdreplay")
    return out, target


CASES = {"an older step's state": r"global_step: the replay state holds 1, the checkpoint 3",
         "a newer step's state": r"global_step: the replay state holds 3, the checkpoint 1",
         "another run's state": r"run_id: the replay state holds '[0-9a-f]+', the checkpoint '[0-9a-f]+'"}


@pytest.mark.parametrize("case", list(CASES))
def test_a_replay_state_of_another_step_or_run_is_refused_by_name_and_nothing_changes(runs, tmp_path, case):
    root, model_dir = runs
    out, target = _attack(root, case, tmp_path)
    before = _files(out)
    tr = _trainer(model_dir, out)
    with pytest.raises(CheckpointMismatchError, match=CASES[case]) as e:
        tr.train(resume_from_checkpoint=str(target))
    assert "replay_resume_without_state=True" in str(e.value) and "Resume from the checkpoint" in str(e.value)
    assert _files(out) == before  # every file byte-identical: no log line lost
    assert len(tr.replay.buffer) == 0 and tr.replay.last_step is None


def test_with_resume_without_state_a_mismatched_state_is_left_and_replay_starts_empty(runs, tmp_path):
    root, model_dir = runs
    out, target = _attack(root, "an older step's state", tmp_path)
    tr = _trainer(model_dir, out, replay_resume_without_state=True, max_steps=4)
    with pytest.warns(ReplayResumeWarning, match="resuming with an empty replay state"):
        tr.train(resume_from_checkpoint=str(target))
    assert tr.state.global_step == 4 and tr.selections[0]["step"] == 3 and not tr.selections[0]["groups"]


def test_an_intact_resume_goes_on_under_the_checkpoints_run_id(runs, tmp_path):
    root, model_dir = runs
    out = tmp_path / "a"
    shutil.copytree(root / "a", out)
    tr = _trainer(model_dir, out, max_steps=4)
    tr.train(resume_from_checkpoint=str(out / "checkpoint-3"))
    assert _run_id(out / "checkpoint-4") == _run_id(out / "checkpoint-3")
    meta = read_state(out / "checkpoint-4" / "hdreplay")[0]["meta"]
    assert meta["identity"] == {"run_id": _run_id(out / "checkpoint-3"), "global_step": 4}


def test_a_re_signed_edit_of_the_replay_states_step_is_refused(runs, tmp_path):
    root, model_dir = runs
    out = tmp_path / "a"
    shutil.copytree(root / "a", out)
    st = read_state(out / "checkpoint-3" / "hdreplay")[0]
    st["meta"]["identity"]["global_step"] = 2
    resign(out / "checkpoint-3" / "hdreplay", st["meta"])
    before = _files(out)
    with pytest.raises(CheckpointError, match="global_step: the replay state holds 2, the checkpoint 3"):
        _trainer(model_dir, out).train(resume_from_checkpoint=str(out / "checkpoint-3"))
    assert _files(out) == before


def test_a_checkpoint_written_before_the_run_id_resumes(runs, tmp_path):
    """Checkpoints of the previous release carry no identity: they are not compared (and still resume)."""
    root, model_dir = runs
    out = tmp_path / "a"
    shutil.copytree(root / "a", out)
    ck = out / "checkpoint-3"
    st = read_state(ck / "hdreplay")[0]
    del st["meta"]["identity"]
    resign(ck / "hdreplay", st["meta"])
    ts = json.loads((ck / "trainer_state.json").read_text())
    del ts["stateful_callbacks"]["HDReplayRun"]
    (ck / "trainer_state.json").write_text(json.dumps(ts))
    tr = _trainer(model_dir, out, cls=HDRGRPOTrainer, max_steps=4)
    tr.train(resume_from_checkpoint=str(ck))
    assert tr.state.global_step == 4 and (out / "checkpoint-4" / "hdreplay").is_dir()


# ------------------------------------------------------------------ HDRAsyncGRPOTrainer
ASYNC = dict(max_steps=3, save_strategy="steps", save_steps=1, replay_k_rep=3, replay_capacity=16,
             worker_kw={"slow_per_version": 2, "slow_lag": 2})


def _async_train(out, model_dir, *, resume=None, **over):
    from async_grpo_lockstep import LockstepWorker, SaveWorker, load_worker_state
    from async_grpo_run import make_trainer

    state = load_worker_state(resume) if resume is not None else None
    tr, worker = make_trainer(out, model_dir, worker_cls=LockstepWorker, worker_state=state, **{**ASYNC, **over})
    tr.add_callback(SaveWorker(worker))
    tr.train(resume_from_checkpoint=None if resume is None else str(resume))
    return tr


@pytest.fixture(scope="module")
def async_runs(tmp_path_factory):
    from hdreplay_lab.sandbox.model import build_tiny_model

    root = tmp_path_factory.mktemp("async_identity")
    model_dir = build_tiny_model(root / "model", hidden=32, layers=2)
    _async_train(root / "a", model_dir)
    _async_train(root / "b", model_dir, seed=1)
    return root, model_dir


def _async_attack(root, case, tmp_path):
    out = tmp_path / "a"
    shutil.copytree(root / "a", out)
    if case in CASES:
        target = out / ("checkpoint-1" if case == "a newer step's state" else "checkpoint-3")
        src = {"an older step's state": out / "checkpoint-1", "a newer step's state": out / "checkpoint-3"}.get(
            case, root / "b" / "checkpoint-3")
        shutil.rmtree(target / "hdreplay")
        shutil.copytree(src / "hdreplay", target / "hdreplay")
        return out, target
    target = out / "checkpoint-3"
    st = read_state(target / "hdreplay")[0]
    obs = st["meta"]["observers"]["staleness"]
    if case == "routing step re-signed":
        obs["routing"]["step"] = 2
    else:  # the staleness rule's step re-signed
        obs["step"] -= 1
    resign(target / "hdreplay", st["meta"])
    return out, target


ASYNC_CASES = {**CASES, "routing step re-signed": r"routing: it was taken after update 2, the checkpoint after update 3",
               "staleness step re-signed": r"staleness state: step \d+ differs from the controller's last committed"}


@pytest.mark.parametrize("case", list(ASYNC_CASES))
def test_async_a_replay_state_of_another_step_or_run_is_refused_by_name_and_nothing_changes(async_runs, tmp_path,
                                                                                           case):
    root, model_dir = async_runs
    out, target = _async_attack(root, case, tmp_path)
    before = _files(out)
    assert (out / "hdreplay" / "async.jsonl").is_file() and (out / "hdreplay" / "steps.jsonl").is_file()
    with pytest.raises(CheckpointError, match=ASYNC_CASES[case]):
        _async_train(out, model_dir, resume=target, max_steps=4)
    assert _files(out) == before  # steps.jsonl and async.jsonl keep every line


def test_async_an_intact_resume_goes_on_under_the_checkpoints_run_id(async_runs, tmp_path):
    root, model_dir = async_runs
    out = tmp_path / "a"
    shutil.copytree(root / "a", out)
    _async_train(out, model_dir, resume=out / "checkpoint-3", max_steps=4)
    assert _run_id(out / "checkpoint-4") == _run_id(out / "checkpoint-3")
    assert read_state(out / "checkpoint-4" / "hdreplay")[0]["meta"]["identity"]["global_step"] == 4
