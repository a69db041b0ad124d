"""The v1 recipe with verl's own pieces around it: DAPO dynamic sampling, and the two async trainers.

Same CPU setup as ``test_verl_v1_trainer`` (real v1 trainers, TransferQueue, CPU worker group; stub agent
loop and weight sync).  What the async trainers add that the sync one does not, and what is checked here:

* ``colocate_async``: verl's ``ReplayBufferAsync`` with warm-up batches and partial rollout; its checkpoint
  also saves TransferQueue, which must not hold replay / scoring rows then.
* ``separate_async``: ``parameter_sync_step`` local updates per step, each of one fresh mini-batch, with pi_old
  weights restored for the fresh rows' old log-probs; replay counts actor updates and scores with the
  *current* weights.
"""

import os

import pytest

pytestmark = pytest.mark.verl
pytest.importorskip("verl", minversion="0.9.1")
pytest.importorskip("transfer_queue")

import numpy as np  # noqa: E402

from hdreplay.integrations.verl import (  # noqa: E402
    HDRPPOTrainerColocateAsync,
    HDRPPOTrainerSeparateAsync,
    HDRPPOTrainerSync,
)
from verl_helpers import never_flat  # noqa: E402
from verl_v1_harness import run_v1  # noqa: E402

N = 4
SEPARATE = ("trainer.v1.trainer_mode=separate_async", "actor_rollout_ref.hybrid_engine=false",
            "actor_rollout_ref.rollout.nnodes=1", "actor_rollout_ref.rollout.n_gpus_per_node=1",
            "actor_rollout_ref.rollout.checkpoint_engine.backend=nccl",
            "trainer.v1.separate_async.parameter_sync_step=2")


@pytest.fixture(scope="module")
def dapo(worker_group, transfer_queue, tokenizer, tiny_model_dir, tmp_path_factory):
    return run_v1(HDRPPOTrainerSync, worker_group, tokenizer, tiny_model_dir, tmp_path_factory.mktemp("v1_dapo"),
                  "algorithm.filter_groups.enable=true", "hdr.k_rep=3", lr=0.0, steps=3, flat=lambda p: p % 3 == 0)


@pytest.fixture(scope="module")
def colocate(worker_group, transfer_queue, tokenizer, tiny_model_dir, tmp_path_factory):
    ckpt = tmp_path_factory.mktemp("v1_colocate")
    # every prompt mixed: the async sampler's prefetch order varies from run to run, and which prompts a batch
    # holds must not change how many groups enter the buffer
    run = run_v1(HDRPPOTrainerColocateAsync, worker_group, tokenizer, tiny_model_dir, ckpt,
                 "trainer.v1.trainer_mode=colocate_async", "hdr.k_rep=3", "trainer.save_freq=2", lr=0.0, steps=3,
                 flat=lambda p: False)
    return run, ckpt


@pytest.fixture(scope="module")
def separate(worker_group, transfer_queue, tokenizer, tiny_model_dir, tmp_path_factory):
    return run_v1(HDRPPOTrainerSeparateAsync, worker_group, tokenizer, tiny_model_dir,
                  tmp_path_factory.mktemp("v1_separate"), *SEPARATE, "hdr.k_rep=3", "hdr.tau=1.0", lr=0.1, steps=2,
                  flat=never_flat)  # which prompts make up an update's 2 groups depends on arrival order in async
                                    # mode: with flat prompts both can be all-equal (no mixed group to replay)


# ------------------------------------------------------------------------------------------------------- DAPO
def test_dapo_fills_the_fresh_batch_with_mixed_groups_and_replay_adds_k_rep(dapo):
    recs = dapo.trainer.step_records
    assert [r.num_fresh_groups for r in recs] == [4, 4, 4]  # data.train_batch_size, after DAPO's filtering
    assert [r.ingress_admitted for r in recs] == [4, 4, 4]  # every fresh group is mixed
    assert [r.accepted for r in recs] == [0, 3, 3] and [r.actor_groups for r in recs] == [4, 7, 7]
    for i, s in enumerate(dapo.trainer.steps):  # the groups trained: none of the all-equal-reward prompts
        fresh = {u for rank in dapo.records for mb in rank["history"][i] for u in mb["uid"]
                 if dapo.kind_of(i)(u) == "fresh"}
        assert len(fresh) == 4 and all(dapo.agent.prompt_of[u] % 3 for u in fresh)
    generated = [p for call in dapo.agent.prompts for p in call]
    assert any(p % 3 == 0 for p in generated)  # DAPO filtered some and generated more than 3 x 4 prompts
    evicted = [v for m in dapo.trainer.logged for k, v in m.items() if k.endswith("filter_groups/evicted_samples")]
    assert evicted and sum(evicted) > 0


def test_dapo_run_trains_replay_first(dapo):
    for i in (1, 2):  # 3 replayed groups = 12 rows: the first mini-batch (8 rows) is all replay
        assert dapo.trained_kinds(i) == dapo.planned_kinds(i) and set(dapo.trained_kinds(i)[0]) == {"replay"}


# ------------------------------------------------------------------------------------------------------- colocate_async
def test_colocate_async_replays_with_verls_async_sampler_and_checkpoints_a_clean_transfer_queue(colocate):
    run, ckpt = colocate
    recs = run.trainer.step_records
    assert [r.step for r in recs] == [1, 2, 3] and recs[1].buffer_size >= 3
    assert [r.accepted for r in recs] == [0, 3, 3] and all(r.accept_rate == 1.0 for r in recs[1:])  # lr 0: Drift 0
    assert os.path.isdir(os.path.join(ckpt, "global_step_2", "transfer_queue"))  # verl saved TransferQueue...
    assert os.path.isdir(os.path.join(ckpt, "global_step_2", "hdreplay"))
    for snapshot in run.trainer.tq_at_save:  # ...when it held no replay, padding or scoring rows
        assert not [k for keys in snapshot.values() for k in keys if k.startswith("hdr")]
    for i in (1, 2):
        assert run.trained_kinds(i) == run.planned_kinds(i) and set(run.trained_kinds(i)[0]) == {"replay"}


# ------------------------------------------------------------------------------------------------------- separate_async
def test_separate_async_counts_actor_updates_and_scores_with_the_current_weights(separate):
    recs = separate.trainer.step_records
    assert [r.step for r in recs] == [2, 3, 4, 5]  # global_steps * parameter_sync_step + local_trigger_step
    assert [r.num_fresh_groups for r in recs] == [2, 2, 2, 2]  # one mini-batch of fresh groups per update
    first = separate.trainer.steps[1]["selection"]  # update 3 (local step 1): the groups of update 2
    assert len(first.accepted) == recs[0].ingress_admitted > 0 and (first.scanned_age == 1).all()
    # update 2 trained with lr > 0, so the current weights differ from those that produced the stored
    # log-probs; pi_old (what separate_async restores for fresh rows) is exactly those weights (Drift 0)
    assert (first.scanned_drift > 1e-6).all()
    for i in range(1, 4):
        assert separate.trained_kinds(i) == separate.planned_kinds(i)
        assert "replay" in separate.trained_kinds(i)[0]  # replay fills the first mini-batch
    ages = np.concatenate([s["selection"].scanned_age for s in separate.trainer.steps])
    assert len(ages) and (ages >= 1).all()
