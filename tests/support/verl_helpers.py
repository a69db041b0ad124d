"""Shared pieces of the verl recipe tests: config composition, verl-shaped batches, fit() stubs.

Everything that is not a stub is verl's: the config is hdreplay's packaged ``hdr_trainer.yaml``
composed over verl's ``ppo_trainer.yaml``; batches go through verl's ``compute_advantage``; the
trainer is built through ``RayPPOTrainer.__init__`` and driven through ``RayPPOTrainer.fit``.
Stubs stand in for what needs GPUs or a network: the rollout (vLLM/SGLang agent loop) and the
checkpoint engine that pushes weights to it.
"""

from __future__ import annotations

import math
import uuid

import numpy as np
import torch
from hydra import compose, initialize_config_module
from verl import DataProto
from verl.trainer.ppo.ray_trainer import compute_advantage
from verl.utils.model import compute_position_id_with_mask

from hdreplay.integrations.verl.schema import register_hdr_schema

P_WIDTH, R_WIDTH = 8, 10  # padded prompt / response widths of the stub rollout
VOCAB = 54  # hdreplay_lab.sandbox char tokenizer; ids 0..2 are pad / eos / unk


def compose_config(*overrides: str, ckpt_dir: str = "/tmp/hdr_verl_ckpt", v1: bool = False):
    """hdreplay's hdr_trainer.yaml with small CPU settings (dp=2, n=4, 4 prompts/step, mini-batch 2 prompts);
    ``v1=False`` selects the v0 recipe (``trainer.use_v1=false``)."""
    base = [f"trainer.use_v1={str(v1).lower()}",
        "trainer.device=cpu", "trainer.n_gpus_per_node=2", "trainer.nnodes=1", "trainer.logger=[console]",
        "trainer.val_before_train=false", "trainer.test_freq=-1", "trainer.save_freq=-1",
        "trainer.total_epochs=1", "trainer.total_training_steps=3", f"trainer.default_local_dir={ckpt_dir}",
        "data.train_batch_size=4", "data.dataloader_num_workers=0", "actor_rollout_ref.rollout.n=4",
        "actor_rollout_ref.actor.ppo_mini_batch_size=2", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2",
        "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=4", "hdr.k_rep=4", "hdr.capacity=16",
        "hdr.diagnostics_dir=null",
    ]
    register_hdr_schema()
    with initialize_config_module("hdreplay.integrations.verl.config", version_base=None):
        return compose(config_name="hdr_trainer", overrides=[*base, *overrides])


def flat_every_4th(p: int) -> bool:
    """Default reward rule of the stubs: prompts p % 4 == 0 get all-equal rewards (not mixed)."""
    return p % 4 == 0


def never_flat(p: int) -> bool:
    """A reward rule with every prompt mixed (for runs whose assertions must not depend on which prompts come)."""
    return False


def rollout_logps(shape, generator) -> torch.Tensor:
    """Stand-in inference-engine log-probs near the tiny random model's own (about -log VOCAB), off by N(0, 0.4^2)
    per token: rollout importance weights pi_old / pi_rollout around 1, some beyond a truncation at 2."""
    return -math.log(VOCAB) + 0.4 * torch.randn(shape, generator=generator)


def stub_rows(prompt_ids: list[int], n: int, *, seed: int, tool_tokens: bool = True,
              flat=flat_every_4th, rollout_lp: bool = False) -> dict[str, torch.Tensor]:
    """verl rollout output for prompts (each repeated n times, interleaved) with deterministic tokens.

    Prompt p has length 3 + p % 5; response lengths vary in [2, R_WIDTH]; odd responses of length >= 6
    carry 2 tool tokens (response_mask 0, attention 1) at positions 2-3; prompts with ``flat(p)`` (default
    p % 4 == 0) get all-equal rewards (not mixed), others reward 1 on even responses; ``rollout_lp`` adds the
    inference engine's ``rollout_log_probs`` (:func:`rollout_logps`).
    """
    g = torch.Generator().manual_seed(seed)
    B = len(prompt_ids) * n
    prompts = torch.zeros(B, P_WIDTH, dtype=torch.long)
    responses = torch.zeros(B, R_WIDTH, dtype=torch.long)
    pmask = torch.zeros(B, P_WIDTH, dtype=torch.long)
    rmask = torch.zeros(B, R_WIDTH, dtype=torch.long)
    resp_mask = torch.zeros(B, R_WIDTH, dtype=torch.long)
    scores = torch.zeros(B, R_WIDTH)
    for gi, p in enumerate(prompt_ids):
        plen = 3 + p % 5
        ptoks = 3 + (torch.arange(plen) * 7 + p) % (VOCAB - 3)
        for j in range(n):
            i = gi * n + j
            prompts[i, P_WIDTH - plen:] = ptoks
            pmask[i, P_WIDTH - plen:] = 1
            rlen = int(torch.randint(2, R_WIDTH + 1, (1,), generator=g))
            responses[i, :rlen] = torch.randint(3, VOCAB, (rlen,), generator=g)
            rmask[i, :rlen] = 1
            resp_mask[i, :rlen] = 1
            if tool_tokens and j % 2 == 1 and rlen >= 6:
                resp_mask[i, 2:4] = 0
            reward = 1.0 if flat(p) else float(j % 2 == 0)
            scores[i, rlen - 1] = reward
    attn = torch.cat([pmask, rmask], dim=1)
    out = {
        "prompts": prompts, "responses": responses, "response_mask": resp_mask,
        "input_ids": torch.cat([prompts, responses], dim=1), "attention_mask": attn,
        "position_ids": compute_position_id_with_mask(attn), "rm_scores": scores,
    }
    if rollout_lp:  # what the agent loop returns with rollout.calculate_log_probs=true
        out["rollout_log_probs"] = rollout_logps((B, R_WIDTH), g) * rmask
    return out


def fresh_batch(prompt_ids=(1, 2, 3, 4), n=4, *, seed=0, ref=False, shuffle=True, config=None) -> DataProto:
    """A batch shaped like the one ``_update_actor`` receives: rollout rows + old/ref log-probs (random,
    negative), rewards, uid and GRPO advantages from verl's ``compute_advantage``; rows shuffled like
    ``_balance_batch`` does."""
    t = stub_rows(list(prompt_ids), n, seed=seed)
    B = t["prompts"].shape[0]
    g = torch.Generator().manual_seed(seed + 1)
    t["old_log_probs"] = -torch.rand(B, R_WIDTH, generator=g) * 3
    if ref:
        t["ref_log_prob"] = -torch.rand(B, R_WIDTH, generator=g) * 3
    t["token_level_scores"] = t["rm_scores"].clone()
    t["token_level_rewards"] = t["rm_scores"].clone()
    t["dummy_tensor"] = torch.zeros(B, 1, dtype=torch.uint8)
    uid = np.repeat(np.array([str(uuid.UUID(int=p)) for p in prompt_ids], dtype=object), n)
    non = {"uid": uid, "data_source": np.array(["stub"] * B, dtype=object),
           "multi_modal_inputs": np.array([{} for _ in range(B)], dtype=object),
           "__num_turns__": np.full(B, 2, dtype=np.int32)}
    batch = DataProto.from_dict(tensors=t, non_tensors=non, meta_info={"temperature": 1.0})
    algo = (config or compose_config()).algorithm
    batch = compute_advantage(batch, adv_estimator=algo.adv_estimator, num_repeat=n, config=algo)
    if shuffle:
        batch.reorder(torch.randperm(B, generator=g))
    return batch


class StubPromptDataset(torch.utils.data.Dataset):
    """Items shaped like RLHFDataset.__getitem__ (raw_prompt + dummy_tensor + reward metadata)."""

    def __init__(self, size: int = 16):
        self.size = size

    def __len__(self):
        return self.size

    def __getitem__(self, i):
        return {"raw_prompt": [{"role": "user", "content": f"q{i}"}],
                "dummy_tensor": torch.tensor([0], dtype=torch.uint8), "data_source": "stub",
                "reward_model": {"ground_truth": str(i)}, "extra_info": {"index": i}, "index": i}


class StubRollout:
    """Stands in for the agent-loop manager: returns the keys AgentLoop._postprocess produces."""

    def __init__(self, n: int, seed: int = 0, flat=flat_every_4th, rollout_lp: bool = False):
        self.n, self.seed, self.calls, self.flat, self.rollout_lp = n, seed, 0, flat, rollout_lp
        self.prompts: list[list[int]] = []  # prompt indices of each call (one call per step)

    def generate_sequences(self, gen_batch: DataProto) -> DataProto:
        self.calls += 1
        idx = [int(x) for x in gen_batch.non_tensor_batch["index"][:: self.n]]
        self.prompts.append(idx)
        t = stub_rows(idx, self.n, seed=self.seed * 1000 + self.calls, flat=self.flat, rollout_lp=self.rollout_lp)
        B = len(gen_batch)
        return DataProto.from_dict(
            tensors=t,
            non_tensors={"__num_turns__": np.full(B, 2, dtype=np.int32),
                         "multi_modal_inputs": np.array([{} for _ in range(B)], dtype=object)},
            meta_info={"timing": {}, "reward_extra_keys": []},
        )


class StubCheckpointEngine:
    """Stands in for the checkpoint engine that syncs weights to rollout replicas (GPU-only)."""

    def update_weights(self, global_steps=None):
        pass

    def sleep_replicas(self):
        pass


def make_trainer(cls, cfg, wg, *, n: int = 4, seed: int = 0, dataset_size: int = 16, flat=flat_every_4th,
                 rollout_lp: bool = False):
    """Build ``cls`` (a RayPPOTrainer subclass) through its real __init__, attach a CPU worker group (and a stub
    rollout that returns ``rollout_log_probs`` when ``rollout_lp``)."""
    import ray
    from verl.single_controller.ray.base import ResourcePoolManager
    from verl.trainer.ppo.utils import Role
    from verl.utils.dataset.rl_dataset import collate_fn

    role = Role.ActorRollout
    rpm = ResourcePoolManager(resource_pool_spec={"global_pool": [2]}, mapping={role: "global_pool"})
    trainer = cls(config=cfg, tokenizer=None, role_worker_mapping={role: ray.remote(object)}, resource_pool_manager=rpm,
                  train_dataset=StubPromptDataset(dataset_size), val_dataset=StubPromptDataset(), collate_fn=collate_fn,
                  device_name="cpu")
    trainer.actor_rollout_wg = wg
    trainer.ref_policy_wg = wg
    trainer.distillation_config = None
    trainer.teacher_model_manager = None
    trainer.async_rollout_manager = StubRollout(n, seed=seed, flat=flat, rollout_lp=rollout_lp)
    trainer.checkpoint_manager = StubCheckpointEngine()
    return trainer


def local_teacher_forcing(model_dir: str, weights: dict, groups, *, temperature: float) -> list[torch.Tensor]:
    """Independent reference for a recipe's scorer: the tiny model loaded with ``from_pretrained`` and set to
    ``weights``, one forward per response; per group the ``(T_g,)`` log-probs of its completion tokens."""
    from hdreplay_lab.sandbox.model import load_model

    model, _ = load_model(model_dir)
    model.load_state_dict(weights)
    model.eval()
    out = []
    with torch.no_grad():
        for g in groups:
            per_response = []
            for resp in g.responses():
                ids = torch.cat([g.prompt_ids.long(), resp.long()])[None]
                logp = torch.log_softmax(model(input_ids=ids).logits[0].float() / temperature, dim=-1)
                per_response.append(logp[g.prompt_ids.numel() - 1:-1].gather(-1, resp.long()[:, None]).squeeze(-1))
            out.append(torch.cat(per_response))
    return out


def assert_sliced_scan_decides_as_whole_groups(trainer) -> None:
    """On ``trainer``'s re-scoring path (its buffer, scorer and tau after a run): the run's sliced scan rejected groups
    early at least once, and one more selection sliced makes the whole-group scan's decisions with fewer rows."""
    import dataclasses

    from hdreplay import select_replay

    cfg = trainer.replay.config
    assert cfg.scan_passes > 1 and any(s["selection"].scanned_exact.size and not s["selection"].scanned_exact.all()
                                       for s in trainer.steps)
    step = trainer.replay.last_step + 1
    whole = select_replay(trainer.replay.buffer, dataclasses.replace(cfg, scan_passes=1), trainer._replay_scorer,
                          step=step, tau=trainer.replay.tau)
    sliced = select_replay(trainer.replay.buffer, cfg, trainer._replay_scorer, step=step, tau=trainer.replay.tau)
    assert len(whole.scanned) and sliced.scanned.tolist() == whole.scanned.tolist()
    assert sliced.scanned_pass.tolist() == whole.scanned_pass.tolist()
    assert sliced.accepted.tolist() == whole.accepted.tolist()
    assert sliced.rescored_rows < whole.rescored_rows
