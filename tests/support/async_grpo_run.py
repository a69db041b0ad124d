"""One HDRAsyncGRPOTrainer run on CPU (1 process, or each rank of ``torchrun --nproc_per_node 2``).

    torchrun --nproc_per_node 2 tests/support/async_grpo_run.py OUT_DIR MODEL_DIR [max_steps]
    torchrun ... async_grpo_run.py OUT_DIR MODEL_DIR 7 --lockstep --save-steps 5 --stop 5 --tag .cut   # interrupted
    torchrun ... async_grpo_run.py OUT_DIR MODEL_DIR 7 --lockstep --save-steps 5 --resume --tag .resumed

writes what each rank saw to ``OUT_DIR/rank<r><tag>.json`` (:func:`summary`).  The worker (rank 0) generates
``fresh_per_version`` groups' worth of samples ahead and, per version, one slow group released 3 versions later:
with ``max_staleness=1`` every slow group arrives stale and is diverted.  ``--lockstep``: the deterministic, resumable
worker of :mod:`async_grpo_lockstep` (two slow groups per version, 2 versions late, ``replay_k_rep=3``: the settings
of tests/trl/asynchronous/test_trl_async_resume.py), its state saved beside each checkpoint; ``--resume``: from the
newest checkpoint, the worker restored from it.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys

sys.path.insert(0, os.path.dirname(__file__))
os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")

import async_grpo_cpu as cpu  # noqa: E402

cpu.install()

from datasets import Dataset  # noqa: E402

from hdreplay.integrations.trl.asynchronous.config import HDRAsyncGRPOConfig  # noqa: E402
from hdreplay.integrations.trl.asynchronous.trainer import HDRAsyncGRPOTrainer  # noqa: E402
from hdreplay_lab.sandbox.model import load_model  # noqa: E402
from trl_fixtures import weights_digest  # noqa: E402

PROMPTS = [f"{i}+{i * 7 % 10}=" for i in range(40)]
ANSWERS = [str(i + i * 7 % 10) for i in range(40)]


def digit_reward(text: str, answer: str) -> float:
    """1 if a digit appears in the first 3 characters: mixed outcomes under a random tiny model."""
    return float(any(c.isdigit() for c in text[:3]))


def make_trainer(out_dir, model_dir, *, worker_kw=None, worker_cls=None, worker_state=None, **over):
    """(trainer, worker); rank 0 owns the worker, the other ranks pass None.  ``worker_cls``: the worker's class
    (default ``CPURolloutWorker``); ``worker_state``: what to restore it from (a resumed lock-step worker)."""
    # the launcher's RANK: the process group does not exist yet here (the trainer's arguments create it), so asking
    # torch.distributed said "rank 0" on every rank, and rank 1's never-used worker wrote its empty state into the
    # checkpoint beside rank 0's (issue 43)
    rank0 = int(os.environ.get("RANK", "0")) == 0
    model, tok = load_model(model_dir)
    worker = (worker_cls or cpu.CPURolloutWorker)(
        model, tok, PROMPTS, ANSWERS, n=4, max_new_tokens=5, reward=digit_reward,
        **{"fresh_per_version": 4, "slow_per_version": 1, "slow_lag": 3, **(worker_kw or {})}) if rank0 else None
    if worker is not None and worker_state is not None:
        worker.restore(worker_state)
    kw = dict(output_dir=str(out_dir), use_cpu=True, report_to="none", max_steps=6, per_device_train_batch_size=8,
              gradient_accumulation_steps=2, num_generations=4, max_completion_length=5, learning_rate=1e-3,
              logging_steps=1, save_strategy="no", bf16=False, token_budget=0, max_staleness=1, disable_tqdm=True,
              replay_k_rep=1, replay_capacity=16, replay_tau=1.0, seed=0)
    kw.update(over)
    kw.update(json.loads(os.environ.get("HDR_TEST_ARGS", "{}")))  # this process's own settings (a node's)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1:  # the same 16 samples per step: 8 per micro-batch, split over the ranks
        kw["per_device_train_batch_size"] = kw["per_device_train_batch_size"] // world
    args = HDRAsyncGRPOConfig(**kw)
    tr = HDRAsyncGRPOTrainer(model=str(model_dir), reward_funcs=[], args=args,
                             train_dataset=Dataset.from_dict({"prompt": PROMPTS}), processing_class=tok,
                             rollout_worker=worker, weight_transfer=cpu.CopyWeights(worker) if rank0 else None)
    return tr, worker




def summary(tr, worker) -> dict:
    """What the tests read: per update the routing, selections, landings; the ledger; the buffer's digest."""
    buf = tr.areplay.controller.buffer
    ids = buf.insertion_ids()
    digest = hashlib.sha256(json.dumps([buf.group_ids(ids), buf.slot_values("cached_headroom", ids).round(6).tolist()],
                                       default=str).encode()).hexdigest()
    return {
        "world": tr.accelerator.num_processes,
        "steps": [{"step": r["step"], "routed": r["routed"], "selected": r["selected"], "delays": r["delays"],
                   "landed": {str(k): v for k, v in r["landed"].items()},
                   "metrics": {k: v for k, v in r["metrics"].items() if v == v}} for r in tr.replay_log],
        "log_history": tr.state.log_history,
        "totals": tr.areplay.ledger.totals,
        "buffer_digest": digest,
        "worker_log": None if worker is None else worker.log,
        "worker_samples": None if worker is None else {str(g): s for g, s in worker.samples_by_group.items()},
        "weights_digest": weights_digest(tr.model),
        "resume_selection": getattr(tr, "resume_selection", None),
    }


def main() -> None:
    import argparse

    import torch.distributed as dist

    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("model_dir")
    ap.add_argument("steps", nargs="?", type=int, default=6)
    ap.add_argument("--lockstep", action="store_true")
    ap.add_argument("--save-steps", type=int, default=None)
    ap.add_argument("--stop", type=int, default=None)
    ap.add_argument("--resume", action="store_true")
    ap.add_argument("--tag", default="")
    ap.add_argument("--main-saves-first", action="store_true",
                    help="every other rank's on_save runs after rank 0 wrote the lock-step worker's state")
    a = ap.parse_args()
    over = {}
    if a.save_steps:
        over.update(save_strategy="steps", save_steps=a.save_steps)
    if a.lockstep:
        from async_grpo_lockstep import LockstepWorker, load_worker_state
        from hdreplay.integrations.trl.checkpoints import resume_target  # the checkpoint train(True) resumes

        state = load_worker_state(resume_target(a.out)) if a.resume and int(os.environ.get("RANK", "0")) == 0 \
            else None
        over.update(worker_cls=LockstepWorker, worker_state=state, replay_k_rep=3,
                    worker_kw={"slow_per_version": 2, "slow_lag": 2})
    tr, worker = make_trainer(a.out, a.model_dir, max_steps=a.steps, **over)
    if a.lockstep:
        from async_grpo_lockstep import MainSavesFirst, SaveWorker

        rank0 = int(os.environ.get("RANK", "0")) == 0
        if a.main_saves_first and not rank0:
            tr.add_callback(MainSavesFirst())
        if worker is not None:
            tr.add_callback(SaveWorker(worker))
        if a.main_saves_first and rank0:
            tr.add_callback(MainSavesFirst())
    if a.stop is not None:
        from async_grpo_lockstep import StopAt

        tr.add_callback(StopAt(a.stop))
    rank = dist.get_rank() if dist.is_initialized() else 0
    try:
        tr.train(resume_from_checkpoint=True if a.resume else None)
    except Exception as e:  # each rank says what it saw (test_trl_two_nodes.py reads it)
        os.makedirs(a.out, exist_ok=True)  # (a node that failed before writing anything)
        with open(os.path.join(a.out, f"rank{rank}{a.tag}_error.txt"), "w") as f:
            f.write(f"{type(e).__name__}: {e}")
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(3)
    with open(os.path.join(a.out, f"rank{rank}{a.tag}.json"), "w") as f:
        json.dump(summary(tr, worker), f, default=str)
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
