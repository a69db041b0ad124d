"""SIGKILL at several moments of training (a subprocess per kill): the newest complete checkpoint is always on disk
with its replay state, an incomplete one is reported as such, and ``resume_from_checkpoint=True`` resumes the newest
complete one and reproduces the uninterrupted run.  Checkpoints every step with ``save_total_limit=1``, so the
Trainer's rotation would delete the previous checkpoint as early as it can."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from paths import SUPPORT

pytest.importorskip("trl")
pytestmark = pytest.mark.trl

from hdreplay.integrations.trl.checkpoints import PENDING, checkpoint_problem, checkpoints  # noqa: E402

SCRIPT = SUPPORT / "trl_kill_run.py"
STEPS, AT = 4, 2
#: kill point -> the checkpoint a resume must use (the newest complete one)
KILLS = {"model": 1, "before_replay": 1, "replay_rename": 1, "rotate": 2, "train": 2}


def launch(out, model, kill_at="none", resume=0, expect=0):
    env = dict(os.environ, HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join(sys.path))
    p = subprocess.run([sys.executable, str(SCRIPT), str(out), str(model), str(STEPS), kill_at, str(AT), str(resume)],
                       env=env, capture_output=True, text=True, timeout=600)
    assert p.returncode == expect, p.stdout[-2000:] + p.stderr[-4000:]
    return p


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    from hdreplay_lab.sandbox.model import build_tiny_model

    root = tmp_path_factory.mktemp("kill")
    build_tiny_model(root / "model")
    launch(root / "reference", root / "model")
    return root, json.loads((root / "reference" / "result.json").read_text())


@pytest.mark.parametrize("kill_at", sorted(KILLS))
def test_a_sigkill_leaves_a_resumable_newest_complete_checkpoint(setup, kill_at):
    root, ref = setup
    out = root / kill_at
    launch(out, root / "model", kill_at=kill_at, expect=-9)
    ckpts = checkpoints(out)
    complete = [c for c in ckpts if checkpoint_problem(c, replay=True) is None]
    assert complete and complete[0].name == f"checkpoint-{KILLS[kill_at]}", [c.name for c in ckpts]
    assert (complete[0] / "hdreplay").is_dir()  # loaded by the resume below (its selections prove it)
    for c in ckpts:
        if c not in complete:  # an incomplete checkpoint says it was killed while being written
            assert "killed" in checkpoint_problem(c, replay=True) and (c / PENDING).exists()
    launch(out, root / "model", resume=1)
    res = json.loads((out / "result_resumed.json").read_text())
    assert res["resumed_from"] == complete[0].name and res["steps"] == STEPS
    start = KILLS[kill_at]
    assert res["selections"] == [s for s in ref["selections"] if s["step"] >= start]
    assert res["final_hash"] == ref["final_hash"]



def test_resuming_the_killed_checkpoint_itself_is_refused_naming_the_complete_one(setup):
    from hdreplay import CheckpointError
    from hdreplay_lab.sandbox.model import load_model
    from trl_fixtures import RecordingTrainer, make_args, prompts, reward_digit

    root, _ = setup
    out = root / "explicit"
    launch(out, root / "model", kill_at="before_replay", expect=-9)
    model, tok = load_model(root / "model")
    tr = RecordingTrainer(model=model, reward_funcs=reward_digit, train_dataset=prompts(), processing_class=tok,
                          args=make_args(out, max_steps=STEPS, save_strategy="steps", save_steps=1,
                                         save_total_limit=1, replay_tau=0.05, replay_k_rep=2))
    with pytest.raises(CheckpointError) as e:
        tr.train(resume_from_checkpoint=str(out / f"checkpoint-{AT}"))
    assert "killed" in str(e.value) and str(out / "checkpoint-1") in str(e.value)
