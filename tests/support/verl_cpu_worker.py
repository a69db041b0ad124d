"""A CPU verl Worker for the recipe tests: real teacher-forced log-probs of a tiny local Qwen2.

verl's own ActorRolloutRefWorker / FSDP engine need CUDA (NCCL process group, device ids), so
this worker implements the worker-side contract the v0 ``RayPPOTrainer`` and the v1 ``PPOTrainer``
call (v1: every ``@register`` method is wrapped by verl's ``tqbridge``, so a ``KVBatchMeta`` argument
arrives as a TensorDict read from TransferQueue, and a TensorDict output is written back), re-using
verl's own pieces wherever they are device-agnostic:

* ``compute_log_prob`` / ``compute_ref_log_prob`` (nd-dispatch on meshes "actor" / "ref"): the
  no-padding layout ``left_right_2_no_padding`` produced, value at position t = log p(x_{t+1} | x_{<=t}).
* ``update_actor`` mirrors ``TrainingWorker.train_mini_batch`` (engine_workers.py:243-339): pops the
  same keys, iterates with verl's ``tu.make_iterator`` (seed + dp rank, ``dataloader_kwargs``), computes
  ``batch_num_tokens`` / ``dp_size`` like the FSDP engine, micro-batches with verl's
  ``prepare_micro_batches``, and takes the loss from verl's own ``ppo_loss`` (so it reads exactly
  the keys verl's loss reads).  Gradients are averaged over ranks with gloo (like FSDP).
* ``save_model_to_cpu`` / ``restore_model_from_cpu`` / ``clear_cpu_model``: what ``separate_async``
  calls on verl's ``DetachActorWorker`` for its pi_old log-probs.
* It records, per update and mini-batch, what each rank trained (uid, replay flag, tokens, stored
  log-prob / advantage / reference sums) so tests can check the layout through this real path, and per
  micro-batch the loss ``ppo_loss`` returned with the padded tensors it computed it from (``micro``), so tests
  can recompute the loss by hand.
"""

from __future__ import annotations

import copy
import os

import torch
from tensordict import TensorDict
from verl.single_controller.base import Worker
from verl.single_controller.base.decorator import Dispatch, make_nd_compute_dataproto_dispatch_fn, register
from verl.utils import tensordict_utils as tu
from verl.utils.config import omega_conf_to_dataclass
from verl.utils.model import extract_multi_modal_inputs
from verl.workers.engine.utils import prepare_micro_batches
from verl.workers.utils.losses import ppo_loss
from verl.workers.utils.padding import no_padding_2_padding

from hdreplay_lab.sandbox.model import load_model
from hdreplay_lab.sandbox.vlm import is_vlm_dir, load_vlm


def teacher_forced(model, input_ids, position_ids, *, temperature: float = 1.0, grad: bool = False,
                   batched: bool = False, mm_rows=None):
    """Per-sequence log-probs and entropies of nested (jagged) sequences; value t scores token t+1.

    ``batched``: one forward over the right-padded micro-batch (causal attention: a row's values do not
    depend on the pad tokens after it; equal to the per-sequence path up to float rounding) - for benchmarks.
    ``mm_rows``: the rows' ``multi_modal_inputs`` dicts (a vision-language model): each row's images go through
    verl's ``extract_multi_modal_inputs``, its ``(K, L)`` positions as the ``(K, 1, L)`` the model takes."""
    if batched:
        return _teacher_forced_batched(model, input_ids, position_ids, temperature=temperature, grad=grad)
    lps, ents = [], []
    with torch.enable_grad() if grad else torch.no_grad():
        mm_rows = mm_rows if mm_rows is not None else [None] * input_ids.shape[0]
        for ids, pos, mm in zip(input_ids.unbind(0), position_ids.unbind(0), mm_rows, strict=True):
            images = {k: v for k, v in extract_multi_modal_inputs([mm]).items() if k != "images_seqlens"} if mm else {}
            pos = pos[:, None, :] if pos.dim() == 2 else pos[None]
            logits = model(input_ids=ids[None], position_ids=pos, **images).logits[0].float() / temperature
            logp = torch.log_softmax(logits, dim=-1)
            nxt = torch.roll(ids, shifts=-1)
            lp = logp.gather(-1, nxt[:, None]).squeeze(-1)
            lps.append(torch.cat([lp[:-1], lp.new_zeros(1)]))
            ents.append(-(logp.exp() * logp).sum(-1))
    nest = lambda xs: torch.nested.as_nested_tensor(xs, layout=torch.jagged)  # noqa: E731
    return nest(lps), nest(ents)


def _teacher_forced_batched(model, input_ids, position_ids, *, temperature: float, grad: bool):
    lens = input_ids.offsets().diff().tolist()
    ids = input_ids.to_padded_tensor(0)
    pos = position_ids.to_padded_tensor(0)
    mask = (torch.arange(ids.shape[1])[None] < torch.tensor(lens)[:, None]).long()
    with torch.enable_grad() if grad else torch.no_grad():
        logp = torch.log_softmax(model(input_ids=ids, attention_mask=mask, position_ids=pos).logits.float()
                                 / temperature, dim=-1)
        lp = logp.gather(-1, torch.roll(ids, shifts=-1, dims=1)[..., None]).squeeze(-1)
        ent = -(logp.exp() * logp).sum(-1)
    rows = [torch.cat([lp[i, : n - 1], lp.new_zeros(1)]) for i, n in enumerate(lens)]
    nest = lambda xs: torch.nested.as_nested_tensor(xs, layout=torch.jagged)  # noqa: E731
    return nest(rows), nest([ent[i, :n] for i, n in enumerate(lens)])


def _non_tensor_list(td: TensorDict, key: str):
    if key not in td.keys():
        return None
    v = tu.get(td, key)
    return list(v) if not isinstance(v, list) else v


class CPUActorWorker(Worker):
    def __init__(self, model_dir: str, actor_config, lr: float = 0.0, infer_micro_batch: int = 1,
                 batched: bool = False):
        super().__init__()  # WORLD_SIZE / RANK / MASTER_* come from RayWorkerGroup
        torch.set_num_threads(1)
        self.batched = batched  # one forward per micro-batch (benchmarks) instead of one per sequence
        self.infer_micro_batch = infer_micro_batch  # rollout.log_prob_micro_batch_size_per_gpu
        self.model_dir, self.lr = model_dir, lr
        self.actor_config = omega_conf_to_dataclass(actor_config)
        for mesh in ("actor", "ref"):
            self._register_dispatch_collect_info(mesh_name=mesh, dp_rank=self.rank, is_collect=True)
        self.history: list = []
        self.ckpt_log: list = []

    # ------------------------------------------------------------------ lifecycle
    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def init_model(self):
        if self.world_size > 1 and not torch.distributed.is_initialized():
            torch.distributed.init_process_group(backend="gloo", rank=self.rank, world_size=self.world_size)
        self.reset(self.lr)
        return self.rank

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def reset(self, lr: float = 0.0, actor_config=None, model_dir: str | None = None):
        """Reload the saved tiny model (from_pretrained), fresh optimizer, empty records; optionally a new
        actor config (e.g. with use_kl_loss) for verl's ppo_loss, and another model for this run only
        (``model_dir``: e.g. a tiny VLM; the next reset without it loads the worker's own model again)."""
        if actor_config is not None:
            self.actor_config = omega_conf_to_dataclass(actor_config)
        path = model_dir or self.model_dir
        self.model, _ = load_vlm(path) if is_vlm_dir(path) else load_model(path)
        self.model.eval()
        self.ref_model = copy.deepcopy(self.model)
        self.lr = lr
        self.optim = torch.optim.SGD(self.model.parameters(), lr=lr)
        self.history, self.ckpt_log, self._cpu_models = [], [], {}

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def get_records(self):
        return {"history": self.history, "ckpt_log": self.ckpt_log}

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def node_id(self):
        """The Ray node this worker runs on (the two-node tests check the placement from inside the worker)."""
        import ray

        return ray.get_runtime_context().get_node_id()

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def state_dict(self):
        return {k: v.detach().clone() for k, v in self.model.state_dict().items()}

    # ------------------------------------------------------------------ log-probs
    def _log_probs(self, model, data: TensorDict) -> TensorDict:
        """Like TrainingWorker.infer_batch: verl's micro-batching (asserts whole micro-batches of
        rollout.log_prob_micro_batch_size_per_gpu), then per-sequence teacher forcing."""
        temperature = tu.get(data, "temperature", default=1.0)
        tu.assign_non_tensor(data, use_dynamic_bsz=False, micro_batch_size_per_gpu=self.infer_micro_batch)
        micro_batches, _ = prepare_micro_batches(data=data, dp_group=None, same_micro_num_in_dp=True)
        lps, ents = [], []
        for micro in micro_batches:
            lp, ent = teacher_forced(model, micro["input_ids"], micro["position_ids"], temperature=temperature,
                                     batched=self.batched, mm_rows=_non_tensor_list(micro, "multi_modal_inputs"))
            lps.extend(lp.unbind(0))
            ents.extend(ent.unbind(0))
        nest = lambda xs: torch.nested.as_nested_tensor(xs, layout=torch.jagged)  # noqa: E731
        return tu.get_tensordict({"log_probs": nest(lps), "entropy": nest(ents)},
                                 non_tensor_dict={"metrics": {"mfu": 0.0}})

    @register(dispatch_mode=make_nd_compute_dataproto_dispatch_fn(mesh_name="actor"))
    def compute_log_prob(self, data: TensorDict) -> TensorDict:
        return self._log_probs(self.model, data)

    @register(dispatch_mode=make_nd_compute_dataproto_dispatch_fn(mesh_name="ref"))
    def compute_ref_log_prob(self, data: TensorDict) -> TensorDict:
        return self._log_probs(self.ref_model, data)

    # ------------------------------------------------------------------ update
    def _record(self, mb: TensorDict) -> dict:
        """What this rank trains in one mini-batch, per row.  v0 sends padded prompts / responses / masks,
        v1 (TransferQueue) sends every token field as a jagged nested tensor; both unbind into rows."""
        rows = lambda t: list(t.unbind(0))  # noqa: E731
        masks = [m.float() for m in rows(mb["response_mask"])]
        if mb["responses"].is_nested:
            responses = [r.tolist() for r in rows(mb["responses"])]
        else:
            widths = mb["attention_mask"][:, mb["prompts"].shape[1]:].sum(-1).tolist()
            responses = [r[: int(w)].tolist() for r, w in zip(rows(mb["responses"]), widths)]
        rec = {
            "uid": _non_tensor_list(mb, "uid"),
            "replay": _non_tensor_list(mb, "hdr_replay"),  # v0 only (v1 rows are told apart by uid)
            "tokens": mb["input_ids"].offsets().diff().tolist(),
            "old_lp_sum": [float((lp * m).sum()) for lp, m in zip(rows(mb["old_log_probs"]), masks)],
            "adv_first": [float(a[m.bool()][0]) if m.any() else 0.0 for a, m in zip(rows(mb["advantages"]), masks)],
            "loss_tokens": [float(m.sum()) for m in masks],
            "responses": responses,
            "images": [len(d.get("image_grid_thw", [])) if d else 0
                       for d in (_non_tensor_list(mb, "multi_modal_inputs") or [None] * len(masks))],
        }
        if "ref_log_prob" in mb.keys():
            rec["ref_lp_sum"] = [float((r * m).sum()) for r, m in zip(rows(mb["ref_log_prob"]), masks)]
        return rec

    def _record_loss(self, micro: TensorDict, lp, loss, num_tokens) -> dict:
        """One micro-batch's loss and the (rows, response width) padded tensors ppo_loss computed it from: the
        current log-probs ``lp`` as ``no_padding_2_padding`` gives them to the loss, and the stored fields."""
        keys = [k for k in ("response_mask", "old_log_probs", "advantages", "rollout_is_weights") if k in micro.keys()]
        padded = micro.select(*keys).to_padded_tensor()
        rec = {k: padded[k].detach().float().clone() for k in keys}
        rec.update(lp=no_padding_2_padding(lp.detach(), micro).float().clone(), loss=float(loss.detach()),
                   batch_num_tokens=float(num_tokens), dp_size=self.world_size, **{
                       k: v for k, v in self._record(micro).items() if k in ("uid", "responses", "replay")})
        return rec

    @staticmethod
    def _loss_terms(micro: TensorDict, lp, loss) -> dict:
        """What one micro-batch's loss was computed from, per row (response positions), and the loss itself: enough
        to recompute verl's policy loss by hand (value t of ``lp`` scores token t + 1)."""
        rows = lambda t: list(t.unbind(0))  # noqa: E731
        plens = [int(x.numel()) for x in rows(micro["prompts"])]
        cur = [row[p - 1:p - 1 + int(m.numel())].tolist() for row, p, m in zip(rows(lp.detach()), plens,
                                                                                 rows(micro["response_mask"]))]
        return {"uid": _non_tensor_list(micro, "uid"), "lp": cur,
                "responses": [r.tolist() for r in rows(micro["responses"])],
                "old": [r.tolist() for r in rows(micro["old_log_probs"])],
                "adv": [r.tolist() for r in rows(micro["advantages"])],
                "mask": [r.tolist() for r in rows(micro["response_mask"])],
                "batch_num_tokens": float(tu.get(micro, "batch_num_tokens")), "dp_size": int(tu.get(micro, "dp_size")),
                "loss": float(loss.detach())}

    @register(dispatch_mode=make_nd_compute_dataproto_dispatch_fn(mesh_name="actor"))
    def update_actor(self, data: TensorDict) -> TensorDict:
        mini_batch_size = tu.pop(data, key="mini_batch_size", default=None)
        epochs = tu.pop(data, key="epochs", default=1)
        seed = tu.pop(data, key="seed", default=42)
        dataloader_kwargs = tu.pop(data, key="dataloader_kwargs", default={})
        assert mini_batch_size % self.world_size == 0, (mini_batch_size, self.world_size)
        dataloader = tu.make_iterator(data, mini_batch_size=mini_batch_size // self.world_size, epochs=epochs,
                                      seed=seed + self.rank, dataloader_kwargs=dataloader_kwargs)
        cfg = self.actor_config
        records, losses = [], []
        self.model.train()
        for mb in dataloader:
            records.append(self._record(mb))
            loss_mask = mb["loss_mask"]
            num_tokens = (loss_mask.values() if loss_mask.is_nested else loss_mask).sum().float()
            if self.world_size > 1:
                torch.distributed.all_reduce(num_tokens)
            tu.assign_non_tensor(mb, batch_num_tokens=num_tokens.item(), dp_size=self.world_size,
                                 use_dynamic_bsz=False, micro_batch_size_per_gpu=cfg.ppo_micro_batch_size_per_gpu)
            micro_batches, _ = prepare_micro_batches(data=mb, dp_group=None, same_micro_num_in_dp=True)
            self.optim.zero_grad()
            total = 0.0
            for micro in micro_batches:
                lp, _ = teacher_forced(self.model, micro["input_ids"], micro["position_ids"],
                                       temperature=tu.get(micro, "temperature", default=1.0), grad=True,
                                       batched=self.batched, mm_rows=_non_tensor_list(micro, "multi_modal_inputs"))
                loss, _metrics = ppo_loss(cfg, {"log_probs": lp}, micro)
                loss.backward()
                total += loss.detach().item()
                records[-1].setdefault("micro", []).append(self._record_loss(micro, lp, loss, num_tokens))
                if micro["prompts"].is_nested:  # v1 (TransferQueue) rows
                    records[-1].setdefault("micro_terms", []).append(self._loss_terms(micro, lp, loss))
            if self.world_size > 1:
                for p in self.model.parameters():
                    if p.grad is not None:
                        torch.distributed.all_reduce(p.grad, op=torch.distributed.ReduceOp.AVG)
            self.optim.step()
            losses.append(total)
        self.model.eval()
        self.history.append(records)
        return tu.get_tensordict({}, non_tensor_dict={"metrics": {"pg_loss": losses, "mfu": 0.0}})

    # ------------------------------------------------------------------ separate_async (DetachActorWorker contract)
    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def save_model_to_cpu(self, n):
        self._cpu_models[n] = {k: v.detach().clone() for k, v in self.model.state_dict().items()}

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def restore_model_from_cpu(self, n):
        self.model.load_state_dict(self._cpu_models[n])

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def clear_cpu_model(self, n):
        self._cpu_models.pop(n, None)

    # ------------------------------------------------------------------ checkpoints (trainer contract, v0 and v1)
    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def save_checkpoint(self, local_path, hdfs_path=None, global_step=0, max_ckpt_to_keep=None):
        step_dir = os.path.dirname(local_path.rstrip("/"))
        root = os.path.dirname(step_dir)
        marker = os.path.join(root, "latest_checkpointed_iteration.txt")
        self.ckpt_log.append({
            "step": global_step,
            "hdreplay_present": os.path.isfile(os.path.join(step_dir, "hdreplay", "manifest.json")),  # its commit point
            "marker": open(marker).read() if os.path.exists(marker) else None,
        })
        if self.rank == 0:
            os.makedirs(local_path, exist_ok=True)
            torch.save({"model": self.model.state_dict(), "optim": self.optim.state_dict()},
                       os.path.join(local_path, "model_optim.pt"))

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def load_checkpoint(self, local_path, hdfs_path=None, del_local_after_load=False):
        state = torch.load(os.path.join(local_path, "model_optim.pt"), weights_only=False)
        self.model.load_state_dict(state["model"])
        self.optim.load_state_dict(state["optim"])
