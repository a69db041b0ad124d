"""The v1 recipe driven through verl's real v1 ``PPOTrainer.fit()`` (sync trainer) on CPU.

Real pieces: the trainer (``HDRPPOTrainerSync`` = verl's ``PPOTrainerSync`` + the seam) built through its
``__init__`` with verl's rollout ``ReplayBuffer``; TransferQueue storage; verl's ``_balance_batch``,
``_compute_old_log_prob``, ``_compute_ref_log_prob``, ``_compute_advantage``, ``_update_actor``, checkpointing
and metrics; a CPU worker group (dp = 2, gloo) computing teacher-forced log-probs of a tiny Qwen2 and
training through verl's ``make_iterator`` / ``prepare_micro_batches`` / ``ppo_loss``.  Stubs: the agent loop
(writes trajectories into TransferQueue as verl's does) and the weight-sync engine.  Runs shared by the tests:

Both use ``rollout.temperature=0.7``, so Drift 0 at unchanged weights also shows that re-scoring uses the
temperature the fresh rows' old log-probs were computed at.

* ``frozen``: lr = 0 (Drift exactly 0), KL loss on, k_rep = 3 groups (not a multiple of the mini-batch of 2
  groups: the v0 recipe would replay 2), checkpoints every 2 steps keeping 1.
* ``moving``: SGD lr = 0.1, tau between the Drift values seen, 4 steps with a checkpoint at step 2, then the
  same run resumed from step 2.
"""

import os

import pytest

pytestmark = pytest.mark.verl
pytest.importorskip("verl", minversion="0.9.1")
pytest.importorskip("transfer_queue")

import numpy as np  # noqa: E402
import torch  # noqa: E402

from hdreplay import ReplayController  # noqa: E402
from hdreplay.integrations.verl import STATE_DIR, HDRPPOTrainerSync  # noqa: E402
from verl_helpers import assert_sliced_scan_decides_as_whole_groups, local_teacher_forcing  # noqa: E402
from verl_v1_harness import run_v1  # noqa: E402

N, MB_ROWS, DP = 4, 8, 2  # rollout.n, ppo_mini_batch_size * n, data-parallel ranks
T = "actor_rollout_ref.rollout.temperature=0.7"  # fresh old log-probs, scoring and the update all use it
TAU = 0.08  # between the Drift values this run sees (~0.04 - 0.16)
MOVING = ("hdr.k_rep=4", f"hdr.tau={TAU}", "actor_rollout_ref.actor.use_kl_loss=false", T)


@pytest.fixture(scope="module")
def frozen(worker_group, transfer_queue, tokenizer, tiny_model_dir, tmp_path_factory):
    ckpt = tmp_path_factory.mktemp("v1_frozen")
    run = run_v1(HDRPPOTrainerSync, worker_group, tokenizer, tiny_model_dir, ckpt, "hdr.k_rep=3", T,
                 "actor_rollout_ref.actor.use_kl_loss=true", "trainer.save_freq=2", "trainer.max_actor_ckpt_to_keep=1",
                 lr=0.0, steps=3)
    return run, ckpt


@pytest.fixture(scope="module")
def moving(worker_group, transfer_queue, tokenizer, tiny_model_dir, tmp_path_factory):
    ckpt = tmp_path_factory.mktemp("v1_moving")
    first = run_v1(HDRPPOTrainerSync, worker_group, tokenizer, tiny_model_dir, ckpt, *MOVING, "trainer.save_freq=2",
                   lr=0.1, steps=4)
    first_weights = worker_group.state_dict()[0]
    resumed = run_v1(HDRPPOTrainerSync, worker_group, tokenizer, tiny_model_dir, ckpt, *MOVING,
                     "trainer.resume_mode=resume_path", f"trainer.resume_from_path={ckpt}/global_step_2", lr=0.1,
                     steps=4)
    return first, first_weights, resumed, worker_group.state_dict()[0]


# ---------------------------------------------------------------------------------------------------------- frozen
def test_replay_happens_and_is_not_truncated_to_whole_minibatches(frozen):
    run, _ = frozen
    steps = run.trainer.steps
    assert [s["step"] for s in steps] == [1, 2, 3]
    assert steps[0]["num_replay_rows"] == 0  # empty buffer at step 1
    for s in steps[1:]:
        sel = s["selection"]
        assert len(sel.accepted) == 3 and len(sel.truncated) == 0  # 3 % ppo_mini_batch_size (2) != 0: u = 1
        assert s["num_replay_rows"] == 3 * N and s["num_padding_rows"] == -(3 * N + 4 * N) % MB_ROWS == 4
    for logged in run.trainer.logged[1:]:  # what reached verl's logger for the step
        assert logged["replay/accepted"] == logged["replay/accepted_gate"] == 3
        assert logged["replay/rows"] == 12 and logged["replay/padding_rows"] == 4 and "actor/pg_loss" in logged


def test_unchanged_weights_give_zero_drift_through_the_worker_groups_log_prob_path(frozen):
    run, _ = frozen
    for s in run.trainer.steps[1:]:
        sel = s["selection"]
        assert len(sel.scanned) and np.abs(sel.scanned_drift).max() < 1e-10 and sel.scanned_pass.all()
        assert (sel.scanned_age >= 1).all()  # never replayed in the step it was generated


def test_ingress_is_the_mixed_groups_of_each_step(frozen):
    run, _ = frozen
    for logged, idx in zip(run.trainer.logged, run.agent.prompts):  # p % 4 == 0: all rewards equal
        assert logged["replay/ingress_admitted"] == sum(p % 4 != 0 for p in idx)
    buf = run.trainer.replay.buffer
    assert all(bool((g.rewards != g.rewards[0]).any()) for g in buf.get(buf.insertion_ids().tolist()))


def test_worker_trains_replay_first_then_fresh_then_padding_through_verls_minibatch_iteration(frozen):
    """Row j of rank r's k-th mini-batch in verl's iterator is row layout[k][r][j] of [replay ; fresh ; pad]:
    replay fills the first mini-batches on every rank, padding sits only in the last one."""
    run, _ = frozen
    for i, s in enumerate(run.trainer.steps):
        kind = run.kind_of(i)
        for r, rank in enumerate(run.records):
            got = rank["history"][i]
            assert [mb["tokens"] for mb in got] == [[s["lengths"][j] for j in mb[r]] for mb in s["layout"]]
        for k, mb in enumerate(s["layout"]):  # global mini-batch k = k-th slice of [replay ; fresh ; pad]
            assert sorted(j for part in mb for j in part) == list(range(k * MB_ROWS, (k + 1) * MB_ROWS))
        assert run.trained_kinds(i) == run.planned_kinds(i)
        if s["num_replay_rows"]:  # 12 replay + 16 fresh + 4 padding rows in mini-batches of 8
            want = [["replay"] * 8, ["replay"] * 4 + ["fresh"] * 4, ["fresh"] * 8, ["fresh"] * 4 + ["pad"] * 4]
            assert [sorted(mb) for mb in run.trained_kinds(i)] == [sorted(mb) for mb in want]
        pads = [mb["loss_tokens"][j] for rank in run.records for mb in rank["history"][i]
                for j, u in enumerate(mb["uid"]) if kind(u) == "pad"]
        assert len(pads) == s["num_padding_rows"] and not any(pads)  # zero-loss rows


def test_replay_rows_carry_stored_logprobs_advantages_ref_and_loss_mask(frozen):
    run, _ = frozen
    s = run.trainer.steps[-1]
    stored = {}
    for g in s["selection"].groups:
        for j, resp in enumerate(g.responses()):
            lm = g.split(g.loss_mask)[j]
            stored[(str(g.group_id), tuple(resp.tolist()))] = (
                float(g.split(g.logprobs)[j][lm].sum()), float(g.advantages[j]),
                float(g.split(g.extras["ref_logprobs"])[j][lm].sum()), int(lm.sum()))
    seen = 0
    for rank in run.records:
        for mb in rank["history"][-1]:
            for i, uid in enumerate(mb["uid"]):
                if (uid, tuple(mb["responses"][i])) not in stored:
                    continue
                lp, adv, ref, ntok = stored[(uid, tuple(mb["responses"][i]))]
                assert mb["old_lp_sum"][i] == pytest.approx(lp, abs=1e-5)
                assert mb["adv_first"][i] == pytest.approx(adv, abs=1e-6)
                assert mb["ref_lp_sum"][i] == pytest.approx(ref, abs=1e-5)
                assert mb["loss_tokens"][i] == ntok  # tool tokens stay out of the loss
                seen += 1
    assert seen == s["num_replay_rows"] == 12


def test_buffer_is_checkpointed_in_verls_step_folder_before_the_marker_and_pruned(frozen):
    run, ckpt = frozen
    for r in run.records:  # seen from the worker, i.e. inside verl's _save_checkpoint
        assert [c["step"] for c in r["ckpt_log"]] == [2, 3]
        assert all(c["hdreplay_present"] and c["marker"] != str(c["step"]) for c in r["ckpt_log"])
    assert open(os.path.join(ckpt, "latest_checkpointed_iteration.txt")).read() == "3"
    # a complete, checksummed replay checkpoint (manifest + its version folder), not just a folder
    assert ReplayController.verify(os.path.join(ckpt, "global_step_3", STATE_DIR)) is not None
    assert os.path.isfile(os.path.join(ckpt, "global_step_3", "data.pt"))  # verl's own files beside it
    assert not os.path.exists(os.path.join(ckpt, "global_step_2", STATE_DIR))  # max_actor_ckpt_to_keep=1


def test_transfer_queue_holds_no_replay_scoring_or_padding_rows_after_a_step(frozen):
    run, _ = frozen
    for snapshot in run.trainer.tq_at_save:  # what verl's checkpoint (async modes: tq.save_checkpoint) would see
        assert not [k for keys in snapshot.values() for k in keys if k.startswith("hdr")]
    left = run.tq_left
    assert not left.get("hdr_score") and not [k for k in left.get("train", {}) if k.startswith("hdr")]


# ---------------------------------------------------------------------------------------------------------- moving
def test_gate_accepts_and_rejects_by_drift_and_rejected_groups_are_not_trained(moving):
    first, *_ = moving
    outcomes = np.concatenate([s["selection"].scanned_pass for s in first.trainer.steps])
    drifts = np.concatenate([s["selection"].scanned_drift for s in first.trainer.steps])
    assert outcomes.any() and not outcomes.all(), f"tau must split the scanned groups' Drift {np.sort(drifts)}"
    for i, s in enumerate(first.trainer.steps):
        sel = s["selection"]
        assert (sel.scanned_drift[sel.scanned_pass] <= TAU).all() and (sel.scanned_drift[~sel.scanned_pass] > TAU).all()
        trained = {u for rank in first.records for mb in rank["history"][i] for u in mb["uid"]}
        rejected = {str(gid) for gid, ok in zip(sel.scanned_group_ids, sel.scanned_pass) if not ok}
        assert trained.isdisjoint(rejected) and {str(g.group_id) for g in sel.groups} <= trained


def test_scorer_equals_teacher_forcing_with_the_current_weights(moving, tiny_model_dir):
    *_, resumed, weights = moving
    trainer = resumed.trainer
    buf = trainer.replay.buffer
    groups = buf.get(buf.insertion_ids().tolist()[:3])
    got = trainer._replay_scorer(groups)
    want = local_teacher_forcing(tiny_model_dir, weights, groups,
                                 temperature=trainer.config.actor_rollout_ref.rollout.temperature)
    assert all(torch.allclose(a, b, atol=1e-5) for a, b in zip(got, want))
    assert max(float((lp - g.logprobs)[g.loss_mask].abs().max()) for g, lp in zip(groups, got)) > 1e-4  # moved


def test_resumed_run_makes_exactly_the_selections_of_the_uninterrupted_run(moving):
    first, first_weights, resumed, resumed_weights = moving
    assert resumed.trainer.resumed_at == 2 and [s["step"] for s in resumed.trainer.steps] == [3, 4]
    prompt_of = {**first.agent.prompt_of, **resumed.agent.prompt_of}  # uids are fresh uuids in every run

    def by_content(group_ids):  # (birth step, prompt index) of each "<step>:<uid>"
        return [(int(g.split(":", 1)[0]), prompt_of[g.split(":", 1)[1]]) for g in map(str, group_ids)]

    for a, b in zip(first.trainer.steps[2:], resumed.trainer.steps):
        sa, sb = a["selection"], b["selection"]
        assert len(sa.scanned) and by_content(sa.scanned_group_ids) == by_content(sb.scanned_group_ids)
        assert np.array_equal(sa.scanned_pass, sb.scanned_pass) and len(sa.accepted) == len(sb.accepted)
        np.testing.assert_allclose(sa.scanned_drift, sb.scanned_drift, rtol=1e-6, atol=1e-9)
        assert a["lengths"] == b["lengths"] and a["num_replay_rows"] == b["num_replay_rows"]
    ta, ma = first.trainer.replay.state_dict()
    tb, mb = resumed.trainer.replay.state_dict()
    assert ma["last_step"] == mb["last_step"] == 4 and ta.keys() == tb.keys()
    for k in ta:
        assert torch.allclose(ta[k].float(), tb[k].float(), atol=1e-6), k
    assert all(torch.allclose(first_weights[k], resumed_weights[k], atol=1e-6) for k in first_weights)


def test_sliced_scan_through_the_workers_makes_the_full_scans_decisions(moving):
    """Exact early rejection on this trainer's re-scoring path (response slices as DataProto / TransferQueue rows):
    the same decisions as whole groups, fewer rows forwarded, and the run itself rejected groups early."""
    *_, resumed, _ = moving
    trainer = resumed.trainer
    assert_sliced_scan_decides_as_whole_groups(trainer)
