"""HDRRayPPOTrainer driven through verl's real ``RayPPOTrainer.fit`` with a CPU Ray worker group (dp=2).

The worker group computes real teacher-forced log-probs of a tiny Qwen2 (``verl_cpu_worker``) and
trains with verl's own mini-batch iterator and ``ppo_loss``; only the rollout and the weight-sync
engine are stubs.  Two runs are shared by the tests of this module:

* ``frozen``: lr = 0, KL loss on, tau = 1e-3, checkpoints every 2 steps, then a resumed run.  With
  unchanged weights every re-scored Drift must be exactly 0, so everything scanned is accepted.
* ``moving``: SGD lr = 0.5, KL loss off, tau = 1e-9: weights move, every scanned group drifts past
  tau and is rejected, and the actor batch is fresh-only.
"""

import os
import re
import shutil
from pathlib import Path

import pytest

pytestmark = pytest.mark.verl
pytest.importorskip("verl", minversion="0.9.1")

import numpy as np  # noqa: E402
import torch  # noqa: E402

from hdreplay import ReplayController  # noqa: E402
from hdreplay.errors import CheckpointError  # noqa: E402
from hdreplay.integrations.verl import STATE_DIR, HDRRayPPOTrainer  # noqa: E402
from verl_helpers import (  # noqa: E402
    assert_sliced_scan_decides_as_whole_groups,
    compose_config,
    local_teacher_forcing,
    make_trainer,
)

N, MB_ROWS, DP = 4, 8, 2  # rollout.n, ppo_mini_batch_size * n, data-parallel ranks


class RecordingTrainer(HDRRayPPOTrainer):
    """Keeps what each step's ``_update_actor`` returned and the controller state right after a resume."""

    def __init__(self, *a, **k):
        super().__init__(*a, **k)
        self.step_metrics, self.steps, self.resumed_state = [], [], None

    def _update_actor(self, batch):
        out = super()._update_actor(batch)
        self.step_metrics.append(dict(out.meta_info["metrics"]))
        self.steps.append(self.last_replay)
        return out

    def _load_checkpoint(self):
        result = super()._load_checkpoint()
        self.resumed_state = (self.global_steps, self.replay.state_dict())
        return result


def _run(worker_group, ckpt_dir, *overrides, lr, kl, steps=3):
    cfg = compose_config(*overrides, f"trainer.total_training_steps={steps}",
                         f"actor_rollout_ref.actor.use_kl_loss={str(kl).lower()}", ckpt_dir=str(ckpt_dir))
    worker_group.reset(lr=lr, actor_config=cfg.actor_rollout_ref.actor)
    trainer = make_trainer(RecordingTrainer, cfg, worker_group)
    trainer.fit()
    return trainer, worker_group.get_records()


@pytest.fixture(scope="module")
def frozen(worker_group, tmp_path_factory):
    ckpt = tmp_path_factory.mktemp("frozen_ckpt")
    trainer, records = _run(worker_group, ckpt, "trainer.save_freq=2", "trainer.max_actor_ckpt_to_keep=1",
                            lr=0.0, kl=True)
    return trainer, records, ckpt


@pytest.fixture(scope="module")
def moving(worker_group, tmp_path_factory):
    """(Also run B of the identity tests: its step-3 checkpoint, another run's, with the same data order as
    frozen's.)"""
    trainer, records = _run(worker_group, tmp_path_factory.mktemp("moving_ckpt"), "hdr.tau=1e-9", "trainer.save_freq=3",
                            lr=0.5, kl=False)
    return trainer, records


def _replay_steps(trainer):
    return [(i, s) for i, s in enumerate(trainer.steps) if s["num_replay_rows"]]


# ---------------------------------------------------------------------------------------------------------- frozen
def test_ingress_is_the_mixed_groups_of_each_step(frozen):
    trainer, _, _ = frozen
    prompts = trainer.async_rollout_manager.prompts  # prompt indices per step; p % 4 == 0 -> all-equal rewards
    assert len(prompts) == 3
    for metrics, idx in zip(trainer.step_metrics, prompts):
        assert metrics["replay/ingress_admitted"] == sum(p % 4 != 0 for p in idx)
    buf = trainer.replay.buffer
    groups = buf.get(buf.insertion_ids().tolist())
    assert groups and all(bool((g.rewards != g.rewards[0]).any()) for g in groups)
    assert all(g.birth_step in (1, 2, 3) and g.num_responses == N for g in groups)


def test_unchanged_weights_give_zero_drift_and_full_acceptance(frozen):
    trainer, _, _ = frozen
    steps = _replay_steps(trainer)
    assert steps, "the frozen run must replay"
    for _, s in steps:
        sel = s["selection"]
        assert len(sel.scanned) and np.abs(sel.scanned_drift).max() < 1e-10
        assert sel.scanned_pass.all() and len(sel.accepted) <= trainer.replay.config.k_rep
        assert (sel.scanned_age >= 1).all()  # never replayed in the step it was generated


def test_replay_is_truncated_to_whole_minibatches(frozen):
    trainer, _, _ = frozen
    for s, m in zip(trainer.steps, trainer.step_metrics):
        assert s["num_replay_rows"] % MB_ROWS == 0
        sel = s["selection"]
        assert len(sel.accepted) % trainer.hdr.replay_config.truncate_multiple == 0
        assert m["replay/truncated"] == len(sel.truncated) and m["replay/rows"] == s["num_replay_rows"]


def test_worker_trains_replay_in_the_first_minibatches_of_every_rank(frozen):
    trainer, records, _ = frozen
    assert [len(r["history"]) for r in records] == [3, 3]
    for step, s in _replay_steps(trainer):
        k_rep = s["num_replay_rows"] // MB_ROWS
        per_rank = [r["history"][step] for r in records]  # [rank][k] mini-batch records (verl's iterator)
        assert all(len(mbs) == len(s["layout"]) for mbs in per_rank)
        for k in range(len(s["layout"])):
            flags = [bool(f) for rank in per_rank for f in rank[k]["replay"]]
            assert all(flags) if k < k_rep else not any(flags)
            loads = [sum(rank[k]["tokens"]) for rank in per_rank]
            assert max(loads) - min(loads) <= max(t for rank in per_rank for t in rank[k]["tokens"])
        assert trainer.step_metrics[step]["replay/minibatches_with_replay"] == k_rep


def test_worker_sees_exactly_the_planned_layout(frozen):
    """Row j of rank r's k-th mini-batch in verl's iterator is row layout[k][r][j] of [replay ; fresh]."""
    trainer, records, _ = frozen
    for step, s in enumerate(trainer.steps):
        for r, rank in enumerate(records):
            got = [mb["tokens"] for mb in rank["history"][step]]
            assert got == [[s["lengths"][i] for i in mb[r]] for mb in s["layout"]]


def test_replay_rows_carry_stored_logprobs_advantages_ref_and_loss_mask(frozen):
    trainer, records, _ = frozen
    step, s = _replay_steps(trainer)[-1]
    stored = {}
    for g in s["selection"].groups:
        for j, resp in enumerate(g.responses()):
            lm = g.split(g.loss_mask)[j]
            stored[(g.group_id, tuple(resp.tolist()))] = (
                float(g.split(g.logprobs)[j][lm].sum()), float(g.advantages[j]),
                float(g.split(g.extras["ref_logprobs"])[j][lm].sum()), int(lm.sum()))
    seen = 0
    for rank in records:
        for mb in rank["history"][step]:
            for i, is_rep in enumerate(mb["replay"]):
                if not is_rep:
                    continue
                lp, adv, ref, ntok = stored[(mb["uid"][i], tuple(mb["responses"][i]))]
                assert mb["old_lp_sum"][i] == pytest.approx(lp, abs=1e-5)
                assert mb["adv_first"][i] == pytest.approx(adv, abs=1e-6)
                assert mb["ref_lp_sum"][i] == pytest.approx(ref, abs=1e-5)
                assert mb["loss_tokens"][i] == ntok  # tool tokens are not in the loss
                seen += 1
    assert seen == s["num_replay_rows"]


def test_replay_metrics_are_merged_into_the_step_metrics(frozen):
    trainer, _, _ = frozen
    for m in trainer.step_metrics:
        keys = {k for k in m if k.startswith("replay/")}
        assert {"replay/buffer_size", "replay/accepted", "replay/ingress_admitted", "replay/rows",
                "replay/layout_token_gap"} <= keys
        assert all(np.isfinite(m[k]) for k in keys) and "actor/pg_loss" in m


def test_buffer_is_saved_in_the_step_folder_before_the_latest_marker(frozen):
    trainer, records, ckpt = frozen
    for r in records:
        assert [c["step"] for c in r["ckpt_log"]] == [2, 3]
        for c in r["ckpt_log"]:  # seen from the worker, i.e. inside super()._save_checkpoint()
            assert c["hdreplay_present"] and c["marker"] != str(c["step"])
    assert open(os.path.join(ckpt, "latest_checkpointed_iteration.txt")).read() == "3"
    assert ReplayController.verify(os.path.join(ckpt, "global_step_3", STATE_DIR)) is not None
    assert not os.path.exists(os.path.join(ckpt, "global_step_2", STATE_DIR))  # pruned: max_actor_ckpt_to_keep=1


def test_a_step_folder_whose_replay_state_another_process_writes_is_refused_before_verl_saves(frozen):
    """The verl checkpoint path inherits the checkpoint lock: refused naming the other writer, and verl's latest
    marker is not moved (the replay state is written first)."""
    from foreign_lock import held_by_another_process
    from hdreplay.errors import CheckpointLockedError
    from hdreplay.integrations.verl.checkpoints import step_dir

    trainer, _, ckpt = frozen
    marker = os.path.join(ckpt, "latest_checkpointed_iteration.txt")
    before = open(marker).read()
    folder = step_dir(trainer.config.trainer, trainer.global_steps)
    try:
        with held_by_another_process(os.path.join(folder, STATE_DIR)) as pid:
            with pytest.raises(CheckpointLockedError, match=rf"pid {pid}, started"):
                trainer._save_checkpoint()
        assert open(marker).read() == before
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def test_resume_restores_the_buffer_and_continues(frozen, worker_group):
    trainer, _, ckpt = frozen
    saved_tensors, saved_meta = trainer.replay.state_dict()
    cfg = compose_config("trainer.save_freq=-1", "trainer.total_training_steps=4",
                         "actor_rollout_ref.actor.use_kl_loss=true", ckpt_dir=str(ckpt))
    worker_group.reset(lr=0.0, actor_config=cfg.actor_rollout_ref.actor)
    resumed = make_trainer(RecordingTrainer, cfg, worker_group)
    resumed.fit()
    step, (tensors, meta) = resumed.resumed_state
    assert step == 3 and meta == saved_meta
    assert tensors.keys() == saved_tensors.keys()
    assert all(torch.equal(tensors[k], saved_tensors[k]) for k in tensors)
    assert len(resumed.steps) == 1 and resumed.steps[0]["step"] == 4
    assert resumed.replay.last_step == 4


def test_resume_without_replay_state_fails_unless_allowed(frozen, worker_group, tmp_path):
    _, _, ckpt = frozen
    copy = tmp_path / "ckpt"
    shutil.copytree(ckpt, copy)
    shutil.rmtree(copy / "global_step_3" / STATE_DIR)
    trainer = make_trainer(HDRRayPPOTrainer, compose_config(ckpt_dir=str(copy)), worker_group)
    with pytest.raises(CheckpointError, match="resume_without_state"):
        trainer._load_checkpoint()
    trainer = make_trainer(HDRRayPPOTrainer, compose_config("hdr.resume_without_state=true", ckpt_dir=str(copy)),
                           worker_group)
    with pytest.warns(UserWarning, match="empty buffer"):
        trainer._load_checkpoint()
    assert trainer.global_steps == 3 and len(trainer.replay.buffer) == 0


def _files(root):
    return {p: p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


# ---------------------------------------------------------------------------------------------------------- moving
def test_drifted_groups_are_rejected_and_not_trained(moving):
    trainer, records = moving
    scanned = [s for s in trainer.steps if len(s["selection"].scanned)]
    assert scanned
    for s in scanned:
        sel = s["selection"]
        assert (sel.scanned_drift > trainer.replay.tau).all() and len(sel.accepted) == 0
        assert s["num_replay_rows"] == 0
    for rank in records:
        assert not any(f for upd in rank["history"] for mb in upd for f in mb["replay"])
    assert trainer.step_metrics[-1]["replay/accept_rate"] == 0.0


def test_scorer_equals_teacher_forcing_with_the_current_weights(moving, worker_group, tiny_model_dir):
    trainer, _ = moving
    buf = trainer.replay.buffer
    groups = buf.get(buf.insertion_ids().tolist()[:3])
    got = trainer._replay_scorer(groups)
    want = local_teacher_forcing(tiny_model_dir, worker_group.state_dict()[0], groups,
                                 temperature=trainer.config.actor_rollout_ref.rollout.temperature)
    assert all(torch.allclose(a, b, atol=1e-5) for a, b in zip(got, want))
    # and the weights did move: stored generation log-probs differ from the current ones
    assert max(float((lp - g.logprobs)[g.loss_mask].abs().max()) for g, lp in zip(groups, got)) > 1e-4


def test_sliced_scan_through_the_workers_makes_the_full_scans_decisions(moving):
    """Exact early rejection on this trainer's re-scoring path (response slices as DataProto / TransferQueue rows):
    the same decisions as whole groups, fewer rows forwarded, and the run itself rejected groups early."""
    trainer, _ = moving
    assert_sliced_scan_decides_as_whole_groups(trainer)


# ---------------------------------------------------------------------------------------------------------- identity
# (last: a resume loads the checkpoint's weights into the shared worker group, which the moving tests read)
IDENTITY_CASES = {
    "another step's folder": r"global_step: the replay state holds 3, the checkpoint 5",
    "another run's state with its run record": r"run_id: the replay state holds '(?P<b>[0-9a-f]{32})', the checkpoint "
                                               r"'(?P<a>[0-9a-f]{32})'",
    "another run's state, the run record deleted": r"run_id: the replay state holds '[0-9a-f]{32}', the checkpoint "
                                                   r"records none.*hdreplay_run.json \(the run record of this "
                                                   r"checkpoint directory\) is missing",
    "another step's data.pt": r"dataloader: the replay state holds '[0-9a-f]{64}', the checkpoint '[0-9a-f]{64}'",
    "a pre-identity state": r"records no identity",
}


@pytest.mark.parametrize("case", list(IDENTITY_CASES))
def test_resume_refuses_a_replay_state_of_another_step_or_run_before_touching_anything(frozen, moving, worker_group,
                                                                                      tmp_path, case):
    """Issue 39, 44: global_step_N/hdreplay carries the run id, step N and a digest of the dataloader state verl saves
    as global_step_N/data.pt; the run id is read from <default_local_dir>/hdreplay_run.json, which does not travel
    with a step folder.  Before: run B's hdreplay/ copied in with its hdreplay_run.json (then in the step folder)
    resumed silently, and so did any state once that file was deleted."""
    import json

    from hdreplay import CheckpointMismatchError
    from hdreplay.integrations.verl.checkpoints import RUN_FILE
    from strategy_states import read_state, resign

    _, _, ckpt = frozen
    other = Path(moving[0].config.trainer.default_local_dir)  # run B
    # B's run record: its checkpoint directory's (or, as hdreplay wrote it before issue 44, its step folder's)
    b_record = next(r for r in (other / "global_step_3" / RUN_FILE, other / RUN_FILE) if r.exists())
    copy = tmp_path / "ckpt"
    shutil.copytree(ckpt, copy)
    step3 = copy / "global_step_3"
    if case == "another step's folder":  # this run's global_step_5 holding step 3's replay state
        shutil.copytree(step3, copy / "global_step_5")
        (copy / "latest_checkpointed_iteration.txt").write_text("5")
    elif case.startswith("another run's state"):  # the pair as it traveled: hdreplay/ and its run record
        shutil.rmtree(step3 / STATE_DIR)
        shutil.copytree(other / "global_step_3" / STATE_DIR, step3 / STATE_DIR)
        shutil.copy(b_record, step3 / RUN_FILE)
        if "deleted" in case:  # no run record left, wherever hdreplay keeps it
            for record in (step3 / RUN_FILE, copy / RUN_FILE):
                record.unlink(missing_ok=True)
    elif case == "another step's data.pt":
        shutil.copy(copy / "global_step_2" / "data.pt", step3 / "data.pt")
    else:  # written before hdreplay recorded what a state belongs to
        st = read_state(step3 / STATE_DIR)[0]
        del st["meta"]["identity"]
        resign(step3 / STATE_DIR, st["meta"])
    diag = copy / "diagnostics"  # the run's log, with records of steps after the checkpoint (4, 5)
    diag.mkdir()
    (diag / "steps.jsonl").write_text("".join(json.dumps({"step": s}) + "\n" for s in range(1, 6)))
    logs = f"hdr.diagnostics_dir={diag}"
    before, weights = _files(copy), worker_group.state_dict()
    trainer = make_trainer(HDRRayPPOTrainer, compose_config(logs, ckpt_dir=str(copy)), worker_group)
    with pytest.raises(CheckpointMismatchError, match=IDENTITY_CASES[case]) as e:
        trainer._load_checkpoint()
    assert "hdr.resume_without_state=True" in str(e.value)
    assert _files(copy) == before and len(trainer.replay.buffer) == 0 and not hasattr(trainer, "global_steps")
    assert all(torch.equal(a[k], b[k]) for a, b in zip(worker_group.state_dict(), weights) for k in a)  # not loaded
    if case == "another run's state with its run record":
        m = re.search(IDENTITY_CASES[case], str(e.value))
        assert m["b"] == json.loads(b_record.read_text())["run_id"] != m["a"]
    trainer = make_trainer(HDRRayPPOTrainer, compose_config("hdr.resume_without_state=true", logs,
                                                            ckpt_dir=str(copy)), worker_group)
    with pytest.warns(UserWarning, match="empty replay state"):
        trainer._load_checkpoint()
    assert len(trainer.replay.buffer) == 0
    if case != "another step's folder":  # item 4: the logs set back to the checkpoint's step, 3; nothing deleted
        steps = [json.loads(x)["step"] for x in (diag / "steps.jsonl").read_text().splitlines()]
        (side,) = diag.glob("steps.rewound-from-step-4.*.jsonl")
        assert steps == [1, 2, 3] and [json.loads(x)["step"] for x in side.read_text().splitlines()] == [4, 5]


def test_the_run_record_lives_beside_verls_marker_and_the_state_binds_verls_data_pt(frozen):
    """Issue 44: what global_step_3/hdreplay belongs to, as saved: the directory's run record (nothing of hdreplay's
    in the step folder but hdreplay/), the step, and the digest of the data.pt verl saved after it."""
    import json

    from hdreplay.integrations.verl.checkpoints import RUN_FILE, dataloader_digest, folder_identity
    from strategy_states import read_state

    trainer, _, ckpt = frozen
    run_id = json.loads((ckpt / RUN_FILE).read_text())["run_id"]
    assert run_id == trainer.replay_run_id and not (ckpt / "global_step_3" / RUN_FILE).exists()
    ident = read_state(ckpt / "global_step_3" / STATE_DIR)[0]["meta"]["identity"]
    data = torch.load(ckpt / "global_step_3" / "data.pt", weights_only=False)
    assert ident == {"run_id": run_id, "global_step": 3, "dataloader": dataloader_digest(data)}
    assert ident["dataloader"] is not None and folder_identity(str(ckpt / "global_step_3")) == ident
    assert folder_identity(str(ckpt / "global_step_3")).resumes_at == 4
