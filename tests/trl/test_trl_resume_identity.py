"""A resume refuses a replay state that is not its checkpoint's (issue 39, item 1; issue 44): HDRGRPOTrainer and
HDRAsyncGRPOTrainer.

Every replay state carries the run id (made at the run's start, written into ``trainer_state.json`` by the Trainer
through the ``HDReplayRun`` callback) and the global step; the asynchronous trainer's routing state carries its step
too.  A resume compares them with ``trainer_state.json`` before it touches anything.  Before: ``checkpoint-3`` holding
``checkpoint-1``'s ``hdreplay/`` resumed silently and deleted steps 1-2 from the logs; a newer step's state failed with
a raw ReplayProtocolError; another run's state of the same step resumed silently.  Issue 44: the state also carries
a digest of the checkpoint's ``trainer_state.json``; a checkpoint whose run id was removed or is not a string, and a
state that records no identity, are refused by name; ``replay_resume_without_state`` sets the logs back to the
checkpoint (the later records moved to side files) so that no step is written twice.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

pytest.importorskip("trl")
pytestmark = [pytest.mark.trl, pytest.mark.filterwarnings("ignore:hdreplay async:UserWarning")]

from hdreplay import CheckpointError, CheckpointMismatchError, ReplayResumeWarning  # noqa: E402
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
    from hdreplay.integrations.trl.checkpoints import trainer_state_digest

    for n in (1, 2, 3):
        meta = read_state(root / "a" / f"checkpoint-{n}" / "hdreplay")[0]["meta"]
        assert meta["identity"] == {"run_id": run_id, "global_step": n,
                                    "trainer_state": trainer_state_digest(root / "a" / f"checkpoint-{n}")}


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
    assert {k: meta["identity"][k] for k in ("run_id", "global_step")} == {"run_id": _run_id(out / "checkpoint-3"),
                                                                          "global_step": 4}


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


def _edit_run_id(ckpt: Path, how: str) -> None:
    """Remove the checkpoint's run id from its trainer_state.json, or replace it with the integer 5."""
    ts = json.loads((ckpt / "trainer_state.json").read_text())
    if how == "removed":
        del ts["stateful_callbacks"]["HDReplayRun"]
    else:
        ts["stateful_callbacks"]["HDReplayRun"]["args"]["run_id"] = 5
    (ckpt / "trainer_state.json").write_text(json.dumps(ts, indent=2, sort_keys=True) + "\n")


RUN_ID = {"removed": r"run_id: the replay state holds '[0-9a-f]{32}', the checkpoint records none",
          "the integer 5": r"run_id: the replay state holds '[0-9a-f]{32}', the checkpoint 5 \(an int, not a str\)"}


@pytest.mark.parametrize("how", list(RUN_ID))
def test_a_checkpoint_whose_run_id_is_removed_or_not_a_string_refuses_another_runs_state(runs, tmp_path, how):
    """Issue 44, item 2: before, checkpoint-3 without its run id (or with 5) resumed run B's replay state silently."""
    root, model_dir = runs
    out, target = _attack(root, "another run's state", tmp_path)
    _edit_run_id(target, how)
    before = _files(out)
    tr = _trainer(model_dir, out)
    with pytest.raises(CheckpointMismatchError, match=RUN_ID[how]) as e:
        tr.train(resume_from_checkpoint=str(target))
    assert "trainer_state: the replay state holds '" in str(e.value)  # the file TRL wrote differs too
    assert "replay_resume_without_state=True" in str(e.value)
    assert _files(out) == before and len(tr.replay.buffer) == 0


def test_the_replay_state_is_bound_to_the_trainer_state_json_the_trainer_wrote_for_its_checkpoint(runs, tmp_path):
    """Issue 44, item 1: checkpoint-N/hdreplay carries the digest of checkpoint-N/trainer_state.json (written by the
    Trainer just before it); a trainer_state.json of another step of the same run (its run id equal) is refused."""
    root, model_dir = runs
    out = tmp_path / "a"
    shutil.copytree(root / "a", out)
    from hdreplay.integrations.trl.checkpoints import trainer_state_digest

    for n in (1, 2, 3):
        ident = read_state(out / f"checkpoint-{n}" / "hdreplay")[0]["meta"]["identity"]
        assert ident["trainer_state"] == trainer_state_digest(out / f"checkpoint-{n}")
    ts = json.loads((out / "checkpoint-3" / "trainer_state.json").read_text())
    ts["log_history"] = json.loads((out / "checkpoint-2" / "trainer_state.json").read_text())["log_history"]
    (out / "checkpoint-3" / "trainer_state.json").write_text(json.dumps(ts, indent=2, sort_keys=True) + "\n")
    before = _files(out)
    with pytest.raises(CheckpointMismatchError, match=r"trainer_state: the replay state holds '[0-9a-f]{64}', the "
                                                      r"checkpoint '[0-9a-f]{64}'"):
        _trainer(model_dir, out).train(resume_from_checkpoint=str(out / "checkpoint-3"))
    assert _files(out) == before


def test_the_trainer_state_digest_is_the_same_on_every_nodes_copy(runs, tmp_path):
    """Each node's first process writes its own trainer_state.json with save_on_each_node: they differ in the two
    per-process flags and in each rank's own step_time, which the digest leaves out; any other entry counts."""
    from hdreplay.integrations.trl.checkpoints import trainer_state_digest

    root, _ = runs
    ts = json.loads((root / "a" / "checkpoint-3" / "trainer_state.json").read_text())
    assert all("step_time" in e for e in ts["log_history"])
    other = {**ts, "is_local_process_zero": False, "is_world_process_zero": False,
             "log_history": [{**e, "step_time": e["step_time"] + 1.0} for e in ts["log_history"]]}
    edited = {**ts, "log_history": [{**e, "loss": 0.5} for e in ts["log_history"]]}
    digests = []
    for i, body in enumerate((ts, other, edited)):
        (tmp_path / str(i)).mkdir()
        (tmp_path / str(i) / "trainer_state.json").write_text(json.dumps(body))
        digests.append(trainer_state_digest(tmp_path / str(i)))
    assert digests[0] == digests[1] != digests[2]


def _pre_identity(hdreplay_dir: Path) -> None:
    """Rewrite a replay state as hdreplay wrote it before issue 39 (no identity)."""
    st = read_state(hdreplay_dir)[0]
    del st["meta"]["identity"]
    resign(hdreplay_dir, st["meta"])


def test_a_pre_identity_state_is_refused_by_name_and_no_record_is_deleted(runs, tmp_path):
    """Issue 44, item 3 (the policy: the project is unreleased, so a state that records no identity is not resumed):
    run A's checkpoint-1 state in pre-identity form put into checkpoint-3 is refused, every file byte-identical
    (before: it resumed, and the rewind cut steps.jsonl from [0, 1, 2] to [0])."""
    root, model_dir = runs
    out, target = _attack(root, "an older step's state", tmp_path)
    _pre_identity(target / "hdreplay")
    before = _files(out)
    with pytest.raises(CheckpointMismatchError, match=r"records no identity .*Set replay_resume_without_state=True "
                                                      "to resume from this checkpoint with an empty replay state"):
        _trainer(model_dir, out).train(resume_from_checkpoint=str(target))
    assert _files(out) == before


def _steps_once(out: Path) -> list[int]:
    steps = [json.loads(x)["step"] for x in (out / "replay" / "steps.jsonl").read_text().splitlines()]
    assert len(steps) == len(set(steps)), steps
    return steps


@pytest.mark.parametrize("case", ["an older step's state", "a pre-identity state", "no replay state"])
def test_resume_without_state_sets_the_logs_back_to_the_checkpoint_and_writes_no_step_twice(runs, tmp_path, case):
    """Issue 44, item 4: with replay_resume_without_state the replay starts empty and the logs are set back to the
    checkpoint's step, the later records moved aside (before: steps.jsonl [0, 1, 2, 2, 3], groups.jsonl's lifetime
    records of run A's buffer twice)."""
    root, model_dir = runs
    out = tmp_path / "a"
    shutil.copytree(root / "a", out)
    target = out / "checkpoint-2"
    shutil.rmtree(target / "hdreplay")
    if case != "no replay state":
        shutil.copytree(out / "checkpoint-1" / "hdreplay", target / "hdreplay")
        if case == "a pre-identity state":
            _pre_identity(target / "hdreplay")
    steps, groups = [(out / "replay" / f).read_text().splitlines() for f in ("steps.jsonl", "groups.jsonl")]
    assert [json.loads(x)["step"] for x in steps] == [0, 1, 2]
    tr = _trainer(model_dir, out, replay_resume_without_state=True, max_steps=4)
    with pytest.warns(ReplayResumeWarning, match=r"resumed after step 1: the records of later steps were moved"):
        tr.train(resume_from_checkpoint=str(target))
    assert tr.state.global_step == 4 and tr.selections[0]["step"] == 2 and not tr.selections[0]["groups"]
    assert _steps_once(out) == [0, 1, 2, 3]
    (side,) = (out / "replay").glob("steps.rewound-from-step-2.*.jsonl")
    assert side.read_text().splitlines() == steps[2:]  # run A's step 2: set aside, not deleted
    (gside,) = (out / "replay").glob("groups.rewound-from-step-2.*.jsonl")
    kept = (out / "replay" / "groups.jsonl").read_text().splitlines()
    assert sorted(gside.read_text().splitlines() + [x for x in kept if x in groups]) == sorted(groups)
    ids = [json.loads(x)["group_id"] for x in kept]
    assert len(ids) == len(set(ids))  # no group's lifetime twice


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


ASYNC_CASES = {**CASES,
               "routing step re-signed": r"routing: it was taken after update 2, the checkpoint after update 3",
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


@pytest.mark.parametrize("how", list(RUN_ID))
def test_async_a_checkpoint_whose_run_id_is_removed_or_not_a_string_refuses_another_runs_state(async_runs, tmp_path,
                                                                                                how):
    root, model_dir = async_runs
    out, target = _async_attack(root, "another run's state", tmp_path)
    _edit_run_id(target, how)
    before = _files(out)
    with pytest.raises(CheckpointMismatchError, match=RUN_ID[how]):
        _async_train(out, model_dir, resume=target, max_steps=4)
    assert _files(out) == before  # steps.jsonl and async.jsonl keep every line


def test_async_a_pre_identity_state_is_refused_by_name_and_no_record_is_deleted(async_runs, tmp_path):
    root, model_dir = async_runs
    out, target = _async_attack(root, "an older step's state", tmp_path)
    _pre_identity(target / "hdreplay")
    before = _files(out)
    with pytest.raises(CheckpointMismatchError, match="records no identity"):
        _async_train(out, model_dir, resume=target, max_steps=4)
    assert _files(out) == before


def test_async_resume_without_state_after_a_mismatch_writes_no_step_twice(async_runs, tmp_path):
    """Issue 44, item 4, asynchronous: checkpoint-2 holding checkpoint-1's state, resumed with
    replay_resume_without_state: steps.jsonl and async.jsonl set back to the checkpoint (before: step 2 twice)."""
    root, model_dir = async_runs
    out = tmp_path / "a"
    shutil.copytree(root / "a", out)
    target = out / "checkpoint-2"
    shutil.rmtree(target / "hdreplay")
    shutil.copytree(out / "checkpoint-1" / "hdreplay", target / "hdreplay")
    logs = {f: (out / "hdreplay" / f).read_text().splitlines() for f in ("steps.jsonl", "async.jsonl")}
    assert [json.loads(x)["step"] for x in logs["steps.jsonl"]] == [0, 1, 2]
    with pytest.warns(ReplayResumeWarning, match="resumed after step 1"):
        _async_train(out, model_dir, resume=target, max_steps=4, replay_resume_without_state=True)
    for f, lines in logs.items():
        steps = [json.loads(x)["step"] for x in (out / "hdreplay" / f).read_text().splitlines()]
        assert steps == [0, 1, 2, 3], (f, steps)
        (side,) = (out / "hdreplay").glob(f"{f.split('.')[0]}.rewound-from-step-2.*.jsonl")
        assert side.read_text().splitlines() == [x for x in lines if json.loads(x)["step"] >= 2]
