"""HDRGRPOTrainer in chunk mode under DeepSpeed ZeRO-2 / ZeRO-3 or FSDP2 on 2 CPU processes, through train().

    torchrun --nproc_per_node 2 tests/support/dist_trl_sharded.py OUT MODEL_DIR BACKEND

BACKEND: zero2 | zero3 | fsdp2 (``one`` = the same run on a single process, called in-process by the test).
Trains 4 updates (checkpoints at 2 and 4), then resumes a new trainer from checkpoint-2 in the same process and
trains to 4 again, then 3 updates with ``replay_micro_step="grow"``, then builds a trainer with a setting replay
refuses (:func:`refusal`); writes what rank r saw to ``OUT/rank<r>.json``: every part's rows and current log-probs,
every micro-step's loss, every backward call's sync state, the selections with their Drift values, buffer hashes.

Same data on 1 and 2 processes: completions come from TRL's ``rollout_func`` hook as a fixed function of (the
optimizer step, the row's index in the global generation batch) -- rank r holds global rows [r B, (r + 1) B)
-- so both layouts train on identical rows and their gate decisions can be compared.  SGD, so a gradient scaled
wrongly anywhere shows in the weights.

FSDP2: accelerate 1.15 drops the FSDP plugin on a machine without an accelerator device (its state reports
MULTI_CPU); :mod:`fsdp_cpu` sets the state's distributed type and plugin to FSDP right after the Trainer builds its
Accelerator (the only substitute); ``prepare`` then shards the model with torch's ``fully_shard`` on gloo.
"""

from __future__ import annotations

import json
import os
import sys

sys.path.insert(0, os.path.dirname(__file__))

import torch  # noqa: E402

from fsdp_cpu import engage_fsdp_on_cpu  # noqa: E402
from hdreplay_lab.sandbox.model import load_model  # noqa: E402
from trl_fixtures import RecordingTrainer, make_args, prompts, reward_digit  # noqa: E402

CHARS = "0123456789abcdefghijklmnopqrstuvwxyz+="
DS = {"train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto", "train_batch_size": "auto",
      "gradient_clipping": "auto", "zero_allow_untested_optimizer": True, "bf16": {"enabled": False}}


def table_rollout(prompts_batch, trainer):
    """Completions as a fixed function of (optimizer step, global row): 2-6 characters, EOS when shorter than the
    maximum -- identical whatever the number of processes, and after a resume."""
    tok = trainer.processing_class
    calls = trainer.state.global_step + 1  # one generation per update here (steps_per_generation = GA)
    start = trainer.accelerator.process_index * len(prompts_batch)
    out = {"prompt_ids": [], "completion_ids": [], "logprobs": None}
    for i, p in enumerate(prompts_batch):
        g = torch.Generator().manual_seed(100_003 * calls + start + i)
        L = int(torch.randint(2, 7, (1,), generator=g))
        text = "".join(CHARS[int(j)] for j in torch.randint(0, len(CHARS), (L,), generator=g))
        comp = tok(text, add_special_tokens=False)["input_ids"]
        out["prompt_ids"].append(tok(p, add_special_tokens=False)["input_ids"])
        out["completion_ids"].append(comp + ([tok.eos_token_id] if L < trainer.args.max_completion_length else []))
    return out


def backend_args(backend: str) -> dict:
    if backend in ("zero2", "zero3"):
        return {"deepspeed": {**DS, "zero_optimization": {"stage": int(backend[-1])}}}
    if backend == "fsdp2":
        return {"fsdp": "full_shard", "fsdp_config": {"version": 2, "state_dict_type": "SHARDED_STATE_DICT",
                                                      "transformer_layer_cls_to_wrap": ["Qwen2DecoderLayer"]}}
    return {}


def run_args(out, backend: str, **over):
    # pd 2 per process (4 on one process: the same 8-row generation), GA 2, groups of 4, 2 replayed groups a step
    pd = 4 if backend == "one" else 2
    kw = dict(max_steps=4, per_device_train_batch_size=pd, gradient_accumulation_steps=2, num_generations=4,
              replay_k_rep=2, replay_tau=0.05, learning_rate=0.1, optim="sgd", lr_scheduler_type="constant",
              save_strategy="steps", save_steps=2, max_completion_length=6, replay_scan_chunk=4,
              replay_score_batch_size=8,
              **backend_args(backend))
    kw.update(over)
    return make_args(out, **kw)


class ShardedRecorder(RecordingTrainer):
    """RecordingTrainer + every micro-step's total loss, every backward's sync state, every re-scoring forward."""

    def __init__(self, *a, **k):
        super().__init__(*a, **k)
        self.micro_losses: list[dict] = []
        self.syncs: list[dict] = []
        # per scorer call: [groups this rank's rows span, forward calls, prompt shared, rows of the call on all ranks]
        self.scan_forwards: list[list] = []
        self._in_scan = False
        self.accelerator.unwrap_model(self.model).register_forward_pre_hook(self._count_forward)
        orig = self.accelerator.backward

        def backward(loss, **kw):
            orig(loss, **kw)
            self.syncs.append(self.sync_state())
        self.accelerator.backward = backward

    def sync_state(self) -> dict:
        from hdreplay.integrations.trl.sharded import fsdp2_param_groups

        d = {"global_step": self.state.global_step, "micro": self._step, "sync": self.accelerator.sync_gradients}
        if self.is_deepspeed_enabled:
            d["boundary"] = bool(self.model_wrapped.is_gradient_accumulation_boundary())
            d["optimizer_steps"] = int(self.model_wrapped.global_steps)
        groups = fsdp2_param_groups(self.model)
        if groups:
            d["reduce"] = all(g.reduce_grads for g in groups)
        return d

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        loss = super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
        self.micro_losses.append({"global_step": self.state.global_step, "micro": self._step, "loss": float(loss)})
        return loss

    def _count_forward(self, module, args):
        if self._in_scan:
            self.scan_forwards[-1][1] += 1

    def _row_logps(self, groups, rows, pg=None):  # full-row path: this rank's rows of the call
        if self._in_scan:
            spanned = len(set(pg.row_group[torch.as_tensor(rows)].tolist())) if pg is not None else len(groups)
            self.scan_forwards[-1][:1] = [spanned]
            self.scan_forwards[-1][2] = False
        return super()._row_logps(groups, rows, pg)

    def _shared_logps(self, groups, min_batches):  # prompt-shared path: this rank's groups of the call
        if self._in_scan:
            self.scan_forwards[-1][0] = len({id(g) for g in groups})
            self.scan_forwards[-1][2] = True
        return super()._shared_logps(groups, min_batches)

    def _replay_scorer(self, groups):
        self.scan_forwards.append([0, 0, None, sum(g.num_responses for g in groups)])
        self._in_scan = True
        try:
            return super()._replay_scorer(groups)
        finally:
            self._in_scan = False


def record(tr) -> dict:
    return {
        "world": tr.accelerator.num_processes,
        "distributed_type": str(tr.accelerator.distributed_type),
        "buffer_hashes": tr.buffer_hashes,
        "selections": [{"step": s["step"], "groups": s["groups"], "births": s["births"],
                        "stored_logps": [x.tolist() for x in s["stored_logps"]], "lengths": s["lengths"],
                        "advantages": s["advantages"],
                        "scanned": s["scanned"], "drift": s["drift"], "passed": s["passed"]} for s in tr.selections],
        "parts": [{"global_step": x["global_step"], "micro": x["micro"], "is_replay": x["is_replay"].tolist(),
                   "now": x["now"].tolist(),  # the old log-probs the loss used (grow fills fresh rows' in its forward)
                   "old": None if x["old_after"] is None else x["old_after"].tolist(),
                   "advantages": x["advantages"].tolist(), "mask": x["mask"].tolist(), "nib": x["nib"],
                   "completion_ids": x["completion_ids"].tolist()} for x in tr.records],
        "micro_losses": tr.micro_losses,
        "syncs": tr.syncs,
        "scan_forwards": tr.scan_forwards,
        "share_prompt": bool(tr._share_prompt),  # the prompt-shared path is available (chosen per call by share_pays)
        "scorer_calls": [h.get("replay/scorer_calls") for h in tr.state.log_history if "loss" in h],
    }


class SelectionRecorder(ShardedRecorder):
    def _select(self, step):
        super()._select(step)
        sel = step.selection
        self.selections[-1].update(scanned=list(sel.scanned_group_ids), drift=sel.scanned_drift.tolist(),
                                   passed=sel.scanned_pass.tolist(),
                                   advantages=[g.advantages.tolist() for g in sel.groups])


def train(out: str, model_dir: str, backend: str, resume: str | None = None, **over):
    model, tok = load_model(model_dir)  # before the args: ZeRO-3 partitions it at deepspeed.initialize, not at load
    args = run_args(out, backend, **over)
    tr = SelectionRecorder(model=model, reward_funcs=reward_digit, args=args, train_dataset=prompts(),
                           processing_class=tok, rollout_func=table_rollout)
    tr.train(resume_from_checkpoint=resume)
    return tr


def refusal(out: str, model_dir: str, backend: str) -> str | None:
    """The error a DeepSpeed config whose accumulation disagrees with TRL's gets at construction.  (FSDP1, refused
    too, cannot be built on CPU at all: accelerate's FSDP1 plugin needs a device; tests/trl/test_trl_sharded.py
    checks that refusal on the plugin's settings.)"""
    if not backend.startswith("zero"):
        return None
    over = {"deepspeed": {**DS, "zero_optimization": {"stage": int(backend[-1])}, "gradient_accumulation_steps": 4}}
    model, tok = load_model(model_dir)
    try:
        SelectionRecorder(model=model, reward_funcs=reward_digit, args=run_args(out, backend, **over),
                          train_dataset=prompts(), processing_class=tok, rollout_func=table_rollout)
    except ValueError as e:
        return str(e)
    return None


def main() -> None:
    out, model_dir, backend = sys.argv[1:4]
    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
    if backend == "fsdp2":
        engage_fsdp_on_cpu()
    full = train(out, model_dir, backend)
    r = full.accelerator.process_index
    resumed = train(os.path.join(out, "resumed"), model_dir, backend, resume=os.path.join(out, "checkpoint-2"))
    grow = train(os.path.join(out, "grow"), model_dir, backend, max_steps=3, replay_micro_step="grow",
                 save_strategy="no")
    rec = {"full": record(full), "resumed": record(resumed), "grow": record(grow),
           "refusal": refusal(os.path.join(out, "refused"), model_dir, backend)}
    with open(os.path.join(out, f"rank{r}.json"), "w") as f:
        json.dump(rec, f)
    import torch.distributed as dist

    if dist.is_initialized():
        dist.barrier()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # see dist_trl_run.py: gloo's destructor may deadlock at interpreter teardown


if __name__ == "__main__":
    main()
