"""Driving verl 0.9.1's v1 ``PPOTrainer.fit()`` on CPU: config, stub agent loop, and ``attach``.

Everything that is not a stub is verl's: the trainer is built through its real ``__init__`` (verl's v1
rollout ``ReplayBuffer`` / ``ReplayBufferAsync``, DAPO settings) and driven through ``PPOTrainer.fit``
(``step`` -> ``_step_once`` -> sample, ``_balance_batch``, ``_compute_old_log_prob``, ref,
``_compute_advantage``, ``_update_actor``; checkpoints, metrics, TransferQueue cleanup), with real
TransferQueue storage and the CPU worker group of ``verl_cpu_worker`` (real teacher-forced log-probs).
Stubs stand in for what needs GPUs: the agent loop (vLLM/SGLang servers; :class:`StubAgentLoopManagerTQ`
writes what ``AgentLoopWorkerTQ._agent_loop_postprocess`` writes) and the weight-sync engine.
:func:`attach` does the non-GPU part of ``PPOTrainer._setup()`` (which builds FSDP workers, LLM servers,
the reward loop and the checkpoint engine).
"""

from __future__ import annotations

import types

import torch
from omegaconf import open_dict

from verl_helpers import VOCAB, StubCheckpointEngine, StubPromptDataset, compose_config, flat_every_4th

V1_BASE = ("transfer_queue.backend.SimpleStorage.num_data_storage_units=1",
           "actor_rollout_ref.actor.optim.lr_warmup_steps=0")


def compose_v1_config(*overrides: str, ckpt_dir: str, model_dir: str):
    """hdreplay's hdr_trainer.yaml for the v1 recipe with the small CPU settings of ``compose_config``."""
    return compose_config(*V1_BASE, f"actor_rollout_ref.model.path={model_dir}", *overrides, ckpt_dir=ckpt_dir,
                          v1=True)


def stub_trajectory(p: int, j: int, *, step: int, flat) -> dict:
    """Response j of prompt p generated at ``step``: deterministic in (p, j, step) so a resumed run sees the
    same rollouts.  Prompt length 3 + p % 5, response length in [2, 10], odd responses of length >= 6
    carry 2 tool tokens (response_mask 0); ``flat(p)`` prompts get reward 1 on every response (not mixed),
    the others reward 1 on even responses."""
    g = torch.Generator().manual_seed(100_003 * step + 101 * p + j)
    plen = 3 + p % 5
    prompts = 3 + (torch.arange(plen) * 7 + p) % (VOCAB - 3)
    rlen = int(torch.randint(2, 11, (1,), generator=g))
    responses = torch.randint(3, VOCAB, (rlen,), generator=g)
    mask = torch.ones(rlen, dtype=torch.int64)
    if j % 2 == 1 and rlen >= 6:
        mask[2:4] = 0
    reward = 1.0 if flat(p) else float(j % 2 == 0)
    scores = torch.zeros(rlen)
    scores[-1] = reward
    ids = torch.cat([prompts, responses])
    return {"prompts": prompts, "responses": responses, "response_mask": mask, "loss_mask": mask, "input_ids": ids,
            "attention_mask": torch.ones_like(ids), "position_ids": torch.arange(ids.numel()), "rm_scores": scores,
            "rollout_log_probs": -torch.rand(rlen, generator=g), "num_turns": 2}


class StubAgentLoopManagerTQ:
    """Stands in for ``AgentLoopManagerTQ``: puts n trajectories per prompt into TransferQueue partition
    "train" (keys ``{uid}_{j}_0``, the fields and tags verl's agent loop writes), then marks the prompt
    finished.  ``prompts`` records the prompt indices of each call."""

    def __init__(self, n: int, *, flat=flat_every_4th):
        self.n, self.flat, self.prompts = n, flat, []
        self.prompt_of: dict[str, int] = {}  # uid (a fresh uuid per run) -> prompt index

    @classmethod
    def create(cls, config, llm_client=None, teacher_client=None, reward_loop_worker_handles=None):
        return cls(n=config.actor_rollout_ref.rollout.n)

    def generate_sequences(self, batch):
        import transfer_queue as tq
        from verl.utils.tensordict_utils import list_of_dict_to_tensordict

        idx, uids = [int(x) for x in batch["index"]], [str(u) for u in batch["uid"]]
        gsteps = batch["global_steps"]
        step = int(gsteps if not hasattr(gsteps, "data") else gsteps.data)
        self.prompts.append(idx)
        self.prompt_of.update(zip(uids, idx))
        for p, uid in zip(idx, uids):
            keys, fields, tags = [], [], []
            for j in range(self.n):
                row = stub_trajectory(p, j, step=step, flat=self.flat)
                row.update(uid=uid, session_id=j, raw_prompt=[{"role": "user", "content": f"q{p}"}],
                           extra_fields={"min_global_steps": step - 1, "max_global_steps": step - 1,
                                         "reward_extra_info": {"acc": float(row["rm_scores"].sum())}})
                keys.append(f"{uid}_{j}_0")
                fields.append(row)
                n_p, n_r = row["prompts"].numel(), row["responses"].numel()
                tags.append({"status": "success", "prompt_len": n_p, "response_len": n_r, "seq_len": n_p + n_r,
                             "global_steps": step, "min_global_steps": step - 1, "max_global_steps": step - 1})
            tq.kv_batch_put(keys=keys, fields=list_of_dict_to_tensordict(fields), tags=tags, partition_id="train")
            tq.kv_put(key=uid, partition_id="train", tag={"status": "finished"})


class StubCheckpointEngineV1(StubCheckpointEngine):
    """Also the calls the async v1 trainers make."""

    def update_weights(self, global_steps=None):
        return {}

    def abort_replicas(self):
        pass

    def resume_generation_replicas(self):
        pass


def attach(trainer, wg, tokenizer, *, dataset_size: int = 64):
    """What ``PPOTrainer._setup()`` does, minus GPU workers / LLM servers / reward loop; then
    ``_load_checkpoint()`` and ``on_init_end()`` like ``PPOTrainer.init()``."""
    from torchdata.stateful_dataloader import StatefulDataLoader
    from verl.utils.dataset.rl_dataset import collate_fn

    cfg = trainer.config
    trainer.tokenizer, trainer.processor = tokenizer, None
    trainer.train_dataset = StubPromptDataset(dataset_size)
    fg = cfg.algorithm.get("filter_groups", None)
    if trainer.trainer_mode != "sync" or (fg is not None and fg.get("enable", False)):
        with open_dict(cfg):  # what _init_dataloader does for DAPO and the async modes
            cfg.data.gen_batch_size = 1
    gen_bs = cfg.data.get("gen_batch_size", None) or cfg.data.train_batch_size
    trainer.train_dataloader = StatefulDataLoader(trainer.train_dataset, batch_size=gen_bs, num_workers=0,
                                                  drop_last=True, collate_fn=collate_fn, shuffle=False)
    trainer.train_dataloader_it = None
    trainer.steps_per_epoch = len(trainer.train_dataset) // cfg.data.train_batch_size
    trainer.total_training_steps = cfg.trainer.total_training_steps
    trainer._init_dump_executor()
    trainer.resource_pool_manager = types.SimpleNamespace(get_n_gpus=lambda: 2)
    trainer.ref_in_actor = False
    trainer.actor_rollout_wg = trainer.ref_policy_wg = wg
    trainer.reward_loop_manager = types.SimpleNamespace(reward_loop_worker_handles=["stub"])  # rewards come in TQ
    trainer.teacher_model_manager, trainer.distillation_config = None, None
    trainer.checkpoint_manager = StubCheckpointEngineV1()
    if trainer.trainer_mode == "separate_async":
        from verl.trainer.ppo.v1.trainer_separate_async import HybridEngineMode

        trainer.standalone_checkpoint_manager = StubCheckpointEngineV1()
        trainer.current_mode = HybridEngineMode.TRAINER
    trainer._load_checkpoint()
    trainer.on_init_end()
    return trainer


def make_v1_trainer(cls, cfg, wg, tokenizer, *, dataset_size: int = 64):
    """Build ``cls`` (a v1 PPOTrainer subclass) through its real ``__init__`` and attach the CPU pieces."""
    return attach(cls(config=cfg), wg, tokenizer, dataset_size=dataset_size)


def recording(cls):
    """``cls`` that keeps, per actor update, ``last_replay`` (``steps``) and the controller's step record
    (``step_records``), the metrics that reached verl's logger (``logged``), the TransferQueue keys at each
    checkpoint (``tq_at_save``) and the resumed step."""
    import transfer_queue as tq

    class Recording(cls):
        def __init__(self, config):
            super().__init__(config)
            self.steps, self.step_records, self.logged, self.tq_at_save, self.resumed_at = [], [], [], [], None

        def _update_actor(self, batch, metrics):
            out = super()._update_actor(batch, metrics)
            self.steps.append(self.last_replay)
            self.step_records.append(self.replay.last_record)
            return out

        def step(self, metrics, timing_raw):
            out = super().step(metrics, timing_raw)
            self.logged.append(dict(metrics))  # after verl's MetricsAggregator: what fit() logs
            return out

        def _save_checkpoint(self):
            self.tq_at_save.append({pid: list(keys) for pid, keys in (tq.kv_list() or {}).items()})
            super()._save_checkpoint()

        def _load_checkpoint(self):
            out = super()._load_checkpoint()
            self.resumed_at = self.global_steps
            return out

    Recording.__name__ = f"Recording{cls.__name__}"
    return Recording


class Run:
    """One ``fit()``: the trainer, the stub agent loop, the workers' records, TransferQueue afterwards."""

    def __init__(self, trainer, agent, records, tq_left):
        self.trainer, self.agent, self.records, self.tq_left = trainer, agent, records, tq_left

    def kind_of(self, update: int):
        """uid -> "replay" / "fresh" / "pad" for the actor batch of the ``update``-th actor update."""
        replayed = {str(g.group_id) for g in self.trainer.steps[update]["selection"].groups}
        return lambda uid: "replay" if uid in replayed else ("pad" if uid.startswith("hdrpad") else "fresh")

    def trained_kinds(self, update: int) -> list[list[str]]:
        """[k]: kinds of the rows of global mini-batch k as the workers trained them (all ranks)."""
        kind = self.kind_of(update)
        per_rank = [rank["history"][update] for rank in self.records]
        return [[kind(u) for rank in per_rank for u in rank[k]["uid"]] for k in range(len(per_rank[0]))]

    def planned_kinds(self, update: int) -> list[list[str]]:
        """[k]: kinds of global mini-batch k's rows in the recipe's layout of [replay ; fresh ; padding]."""
        s = self.trainer.steps[update]
        R, P, total = s["num_replay_rows"], s["num_padding_rows"], len(s["lengths"])
        kind = lambda j: "replay" if j < R else ("pad" if j >= total - P else "fresh")  # noqa: E731
        return [[kind(j) for part in mb for j in part] for mb in s["layout"]]


def run_v1(cls, wg, tokenizer, model_dir, ckpt_dir, *overrides, lr: float, steps: int, flat=flat_every_4th,
           dataset_size: int = 64):
    """Reset the workers (fresh tiny model, SGD at ``lr``), build ``recording(cls)`` and run ``fit()``."""
    import transfer_queue as tq

    cfg = compose_v1_config(*overrides, f"trainer.total_training_steps={steps}", ckpt_dir=str(ckpt_dir),
                            model_dir=model_dir)
    stale = list((tq.kv_list("train") or {}).get("train", {}))
    if stale:  # a run leaves prompts it generated but never trained (DAPO surplus, async prefetch)
        tq.kv_clear(keys=stale, partition_id="train")  # verl's TaskRunner starts every run on a fresh one
    wg.reset(lr=lr, actor_config=cfg.actor_rollout_ref.actor)
    trainer = make_v1_trainer(recording(cls), cfg, wg, tokenizer, dataset_size=dataset_size)
    agent = StubAgentLoopManagerTQ(n=cfg.actor_rollout_ref.rollout.n, flat=flat)
    trainer.fit(agent)
    left = {pid: dict(v) for pid, v in (tq.kv_list() or {}).items()}
    return Run(trainer, agent, wg.get_records(), left)
