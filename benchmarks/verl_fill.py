"""verl replay fill: replayed / accepted groups per step, v1 recipe vs v0 recipe, at the paper's math shape.

    .venv-verl/bin/python benchmarks/verl_fill.py            # b 256 x n 4, K_rep 128, mini-batch 64
    .venv-verl/bin/python benchmarks/verl_fill.py --quick    # b 64 x n 4, K_rep 32, mini-batch 16

The paper's math run (Appendix F): 256 fresh groups per step, K_rep = 128, buffer 512, mini-batches of 64 groups.
verl trains whole mini-batches only.  The v0 recipe therefore cuts the gate-accepted replay list to a multiple
of 64 groups (0, 64 or 128); the v1 recipe completes the last mini-batch with zero-loss rows and replays every
accepted group (unit 1 group).  Both recipes run here through verl's real ``fit()`` (v1: ``PPOTrainerSync`` +
TransferQueue; v0: ``RayPPOTrainer``) with the test suite's CPU worker group (dp = 2, teacher-forced
log-probs of a tiny random Qwen2, SGD) and stub rollouts: the model is scaled down, the batch shape in groups
is not.  n = 4 responses per prompt instead of the paper's 16 (``--n``): the truncation arithmetic counts
groups, and on 2 CPU cores TransferQueue's per-row Python overhead makes a 4096-row step take minutes.
13 of every 32 prompts get mixed rewards, i.e. 104 mixed groups per step (the paper's late-phase fill is
~104 accepted groups); ``--lr`` moves the weights so that the Drift gate (``--tau``) rejects older groups.

Writes benchmarks/results/verl_fill.json: per recipe the per-step ``accepted`` (gate), ``replayed``, and
``mean_replayed_over_accepted`` over the steps with accepted > 0 (target for v1: >= 0.95), plus seconds per step.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import tempfile
import time
import warnings
from pathlib import Path

HERE = Path(__file__).resolve().parent
SUPPORT = HERE.parent / "tests" / "support"
sys.path.insert(0, str(SUPPORT))  # the test suite's CPU worker group and v1 harness
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
warnings.filterwarnings("ignore")
logging.getLogger("transfer_queue").setLevel(logging.ERROR)  # warns on every call that it uses 2 threads here


def mixed_13_of_32(p: int) -> bool:
    """``flat`` rule of the stub rollouts: True (all rewards equal) for 19 of every 32 prompts."""
    return p % 32 >= 13


def parse():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="b 64 x n 4, K_rep 32, mini-batch 16, 4 steps")
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--n", type=int, default=4, help="responses per prompt (rollout.n; the paper: 16)")
    ap.add_argument("--lr", type=float, default=0.05, help="SGD learning rate of the tiny model")
    ap.add_argument("--tau", type=float, default=2.5e-5,
                    help="Drift threshold (this model at --lr: median Drift ~1.8e-5 at age 1, ~3.3e-5 at age 2)")
    ap.add_argument("--recipes", default="v1,v0")
    ap.add_argument("--capacity", type=int, default=None, help="buffer capacity (default: the paper's 512)")
    ap.add_argument("--out", default=str(HERE / "results" / "verl_fill.json"))
    a = ap.parse_args()
    a.b, a.k_rep, a.mbs, capacity = (64, 32, 16, 128) if a.quick else (256, 128, 64, 512)
    a.capacity = a.capacity or capacity
    if a.quick:
        a.steps = min(a.steps, 4)
    return a


def overrides(a, *, diag: str) -> list[str]:
    return [f"data.train_batch_size={a.b}", f"actor_rollout_ref.rollout.n={a.n}",
            f"actor_rollout_ref.actor.ppo_mini_batch_size={a.mbs}",
            "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=16",
            "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=16",
            "actor_rollout_ref.actor.use_kl_loss=false",
            f"hdr.k_rep={a.k_rep}", f"hdr.capacity={a.capacity}", f"hdr.tau={a.tau}", f"hdr.diagnostics_dir={diag}"]


def summarize(records, seconds) -> dict:
    accepted = [int(r.accepted_gate) for r in records]
    replayed = [int(r.accepted) for r in records]
    ratios = [p / g for p, g in zip(replayed, accepted) if g > 0]
    by_age: dict[int, list[float]] = {}
    for r in records:
        for age, d in zip(r.scan_age, r.scan_drift):
            by_age.setdefault(int(age), []).append(d)
    drift = {str(a): sorted(v)[len(v) // 2] for a, v in sorted(by_age.items())}
    return {"accepted": accepted, "replayed": replayed, "buffer_size": [int(r.buffer_size) for r in records],
            "median_drift_by_age": drift,
            "ingress_admitted": [int(r.ingress_admitted) for r in records],
            "mean_replayed_over_accepted": sum(ratios) / len(ratios) if ratios else None,
            "replayed_over_accepted_total": sum(replayed) / max(sum(accepted), 1),
            "seconds_per_step": seconds / max(len(records), 1)}


def main() -> None:
    a = parse()
    import ray
    import torch
    from verl.single_controller.ray import RayClassWithInitArgs, RayResourcePool, RayWorkerGroup

    import verl_cpu_worker
    from hdreplay_lab.sandbox.model import build_tiny_model, build_tokenizer
    from verl_helpers import compose_config, make_trainer
    from verl_v1_harness import compose_v1_config, run_v1

    torch.set_num_threads(1)
    work = Path(tempfile.mkdtemp(prefix="hdr_verl_fill_"))
    model_dir = str(build_tiny_model(work / "tiny", hidden=32, layers=2, seed=0))
    env = {"PYTHONPATH": os.pathsep.join([str(SUPPORT), os.environ.get("PYTHONPATH", "")]), "OMP_NUM_THREADS": "1",
           "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    ray.init(num_cpus=5, include_dashboard=False, log_to_driver=False, runtime_env={"env_vars": env})
    base = compose_v1_config(*overrides(a, diag=""), ckpt_dir=str(work), model_dir=model_dir)
    import transfer_queue as tq

    tq.init(base.transfer_queue)
    pool = RayResourcePool([2], use_gpu=False, max_colocate_count=1)
    wg = RayWorkerGroup(resource_pool=pool, device_name="cpu", ray_cls_with_init=RayClassWithInitArgs(
        cls=ray.remote(verl_cpu_worker.CPUActorWorker), model_dir=model_dir, actor_config=base.actor_rollout_ref.actor,
        infer_micro_batch=16, batched=True))
    wg.init_model()
    tok = build_tokenizer()
    result = {"shape": {"b": a.b, "n": a.n, "k_rep": a.k_rep, "ppo_mini_batch_size": a.mbs, "capacity": a.capacity,
                        "tau": a.tau, "lr": a.lr, "steps": a.steps, "dp": 2, "model": "Qwen2 hidden 32, 2 layers"},
              "mixed_groups_per_step": sum(not mixed_13_of_32(p) for p in range(a.b))}
    for recipe in a.recipes.split(","):
        t0 = time.time()
        diag = str(work / f"diag_{recipe}")
        if recipe == "v1":
            from hdreplay.integrations.verl import HDRPPOTrainerSync

            run = run_v1(HDRPPOTrainerSync, wg, tok, model_dir, work / "ckpt_v1", *overrides(a, diag=diag), lr=a.lr,
                         steps=a.steps, flat=mixed_13_of_32, dataset_size=a.b * (a.steps + 1))
            records = run.trainer.step_records
        else:
            from hdreplay.integrations.verl import HDRRayPPOTrainer

            class Recording(HDRRayPPOTrainer):
                def _update_actor(self, batch):
                    out = super()._update_actor(batch)
                    self.step_records.append(self.replay.last_record)
                    return out

            cfg = compose_config(*overrides(a, diag=diag), f"trainer.total_training_steps={a.steps}",
                                 "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=16",
                                 ckpt_dir=str(work / "ckpt_v0"))
            wg.reset(lr=a.lr, actor_config=cfg.actor_rollout_ref.actor)
            trainer = make_trainer(Recording, cfg, wg, n=a.n, dataset_size=a.b * (a.steps + 1), flat=mixed_13_of_32)
            trainer.step_records = []
            trainer.fit()
            records = trainer.step_records
        result[recipe] = summarize(records, time.time() - t0)
        print(recipe, json.dumps(result[recipe]), flush=True)
    tq.close()
    ray.shutdown()
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(result, indent=1) + "\n")
    print("wrote", a.out)


if __name__ == "__main__":
    main()
