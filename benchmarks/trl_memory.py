"""Activation memory of a TRL micro-step with and without replay, at the same per_device_train_batch_size, on one
process and under DeepSpeed ZeRO-2, ZeRO-3 and FSDP2 on 2 CPU processes.

    python benchmarks/trl_memory.py                      # every setup; a few minutes on 2 CPU cores
    python benchmarks/trl_memory.py --setups single      # one process only (about a minute)
    python benchmarks/trl_memory.py --quick

What is measured: the bytes of the tensors autograd saves for backward during a micro-step's forward passes
(``torch.autograd.graph.saved_tensors_hooks``; every storage counted once; parameters excluded -- also the full
weights ZeRO-3 and FSDP2 gather for a forward, which are parameters, not activations).  That is the activation memory
a micro-step holds at its peak -- on a GPU the part that grows with rows.  With ``replay_micro_step="chunk"`` a
micro-step runs TRL's loss on the fresh micro-batch and on each replay chunk, each backward right after its forward,
so its peak is the largest part; with ``"grow"`` it is the merged batch.  (CPU allocator peaks are not observable
here; the saved-tensor count is exact and device independent.  docs/results/README.md has peak GPU memory from an
H200.)  Prompts vary in length so that every micro-batch is padded: an unpadded batch takes SDPA's mask-free path and
saves ~7 % less, which would otherwise show up as a difference between batches, not between replay and no replay.

Configurations, same workload per process (Qwen2-shaped random model, completions of a fixed length so every row
costs the same; per_device_train_batch_size 8, GA 2, groups of 4, 16 replay rows per process and update: replay_k_rep
4 on one process, 8 on two):
    no_replay   replay_selector none
    chunk       recency replay, replay_micro_step chunk (the default)
    grow        recency replay, replay_micro_step grow

Setups: ``single`` (one process), ``zero2`` / ``zero3`` (DeepSpeed 0.19 with DS_ACCELERATOR=cpu, torchrun, gloo),
``fsdp2`` (FSDP2 FULL_SHARD; accelerate 1.15 does not engage FSDP without an accelerator device, so its state is set
to FSDP after the Trainer builds its Accelerator: tests/support/fsdp_cpu.py).  A sharded setup reports the larger of
its two processes' peaks.  ZeRO-3 under the measuring hook: see :func:`zero3_hook_compatible` (measurement only).

Writes benchmarks/results/trl_memory.json: per setup ``peak_saved_mb`` (max over replay micro-steps), ``ratio_chunk``
= chunk / no_replay (target <= 1.05), ``ratio_grow`` = grow / no_replay (the memory cost grow states), and the most
rows one forward held.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "tests" / "support"))  # fsdp_cpu: the FSDP-on-CPU substitute

import torch  # noqa: E402
from datasets import Dataset  # noqa: E402

from hdreplay.integrations.trl import HDRGRPOConfig, HDRGRPOTrainer  # noqa: E402
from hdreplay_lab.sandbox.model import build_tiny_model, load_model  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
SETUPS = ("single", "zero2", "zero3", "fsdp2")
CONFIGS = (("no_replay", "none", "chunk"), ("chunk", "recency", "chunk"), ("grow", "recency", "grow"))
DS = {"train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto", "train_batch_size": "auto",
      "gradient_clipping": "auto", "zero_allow_untested_optimizer": True, "bf16": {"enabled": False}}


def param_storages(model) -> set[int]:
    """Storages of the parameters as they are now: inside a ZeRO-3 / FSDP2 forward, the gathered full weights."""
    out = set()
    for p in model.parameters():
        for t in (p, p.data):
            try:
                out.add(t.untyped_storage().data_ptr())
            except (RuntimeError, NotImplementedError):  # a sharded DTensor outside its forward
                pass
    return out


def zero3_hook_compatible() -> None:
    """Under the saved-tensor hook autograd hands a saved parameter back as a plain alias, so the backward of TRL's
    fused LM head cannot see that the weight is a ZeRO-3 parameter to gather (``ds_status``).  The alias still holds
    the weight gathered in the forward: use it as it is (a weight, excluded from the count either way)."""
    import contextlib

    import trl.trainer.utils as trl_utils

    real = trl_utils.maybe_gather_lm_head_ctx

    def gather(*params):
        if any(p is not None and not hasattr(p, "ds_status") for p in params):
            return contextlib.nullcontext()
        return real(*params)

    trl_utils.maybe_gather_lm_head_ctx = gather


class MemoryTrainer(HDRGRPOTrainer):
    """Counts the bytes saved for backward in every loss call; groups them by micro-step."""

    def __init__(self, *a, **k):
        super().__init__(*a, **k)
        self.parts: list[tuple[int, int, int, int, bool]] = []  # (global_step, micro-step, bytes, rows, replay)

    def _compute_loss(self, model, inputs):
        seen, total = set(), [0]

        def pack(t):
            s = t.untyped_storage()
            ptr = s.data_ptr()
            if ptr not in seen and ptr not in param_storages(self.model):
                seen.add(ptr)
                total[0] += s.nbytes()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            loss = super()._compute_loss(model, inputs)
        rows = inputs["prompt_ids"].shape[0]
        replay = bool((inputs["hdr_row"] < 0).any()) if "hdr_row" in inputs else False
        self.parts.append((self.state.global_step, self._step, total[0], rows, replay))
        return loss


def reward(completions, **kw):
    return [float(sum(ch.isdigit() for ch in c) > len(c) / 4) for c in completions]


def backend_args(setup: str) -> dict:
    if setup in ("zero2", "zero3"):
        return {"deepspeed": {**DS, "zero_optimization": {"stage": int(setup[-1])}}}
    if setup == "fsdp2":
        return {"fsdp": "full_shard",
                "fsdp_config": {"version": 2, "transformer_layer_cls_to_wrap": ["Qwen2DecoderLayer"]}}
    return {}


def run(name, model_dir, *, selector, mode, steps, length, setup, world):
    model, tok = load_model(model_dir)  # before the args: ZeRO-3 partitions it at deepspeed.initialize
    # prompts of 4-8 tokens: micro-batches are padded, as real ones are (an unpadded batch takes SDPA's
    # mask-free path, which saves less for backward; mixing the two would measure padding, not replay)
    ds = Dataset.from_dict({"prompt": [f"{i}+{j}=" for i in range(0, 2000, 7) for j in range(0, 300, 11)]})
    args = HDRGRPOConfig(
        output_dir=tempfile.mkdtemp(prefix=f"mem-{name}-"), use_cpu=True, bf16=False, report_to="none",
        activation_checkpointing=False, logging_steps=10**6, save_strategy="no", max_steps=steps,
        per_device_train_batch_size=8, gradient_accumulation_steps=2, num_generations=4,
        max_completion_length=length, generation_kwargs={"min_new_tokens": length}, learning_rate=1e-5,
        loss_type="grpo", seed=0, disable_tqdm=True, disable_dropout=True, replay_selector=selector,
        replay_k_rep=4 * world, replay_tau=1e9, replay_diagnostics_dir="", replay_micro_step=mode,
        **backend_args(setup))
    tr = MemoryTrainer(model=model, reward_funcs=reward, args=args, train_dataset=ds, processing_class=tok)
    t0 = time.perf_counter()
    tr.train()
    micro: dict[int, dict] = {}
    for step, m, nbytes, rows, replay in tr.parts:
        if step == 0:  # the first update has an empty buffer
            continue
        d = micro.setdefault(m, {"peak": 0, "rows": 0, "replay": False, "forwards": 0})
        d["peak"] = max(d["peak"], nbytes)
        d["rows"] = max(d["rows"], rows)
        d["replay"] |= replay
        d["forwards"] += 1
    return {"peak_saved_mb": max(d["peak"] for d in micro.values()) / 2**20,
            "median_saved_mb": statistics.median(d["peak"] for d in micro.values()) / 2**20,
            "max_rows_per_forward": max(d["rows"] for d in micro.values()),
            "forwards_per_micro_step": statistics.mean(d["forwards"] for d in micro.values()),
            "micro_steps_with_replay": sum(d["replay"] for d in micro.values()), "micro_steps": len(micro),
            "wall_s": time.perf_counter() - t0, "distributed_type": str(tr.accelerator.distributed_type)}


def measure(setup: str, model_dir: Path, *, steps: int, length: int, world: int) -> dict:
    res = {name: run(name, model_dir, selector=sel, mode=mode, steps=steps, length=length, setup=setup, world=world)
           for name, sel, mode in CONFIGS}
    base = res["no_replay"]["peak_saved_mb"]
    return {"configs": res, "ratio_chunk": res["chunk"]["peak_saved_mb"] / base,
            "ratio_grow": res["grow"]["peak_saved_mb"] / base, "processes": world}


def worker(setup: str, model_dir: Path, out: Path, steps: int, length: int) -> None:
    """One process of a sharded setup (under torchrun): measures and writes ``out/rank<r>.json``."""
    if setup == "fsdp2":
        from fsdp_cpu import engage_fsdp_on_cpu

        engage_fsdp_on_cpu()
    if setup == "zero3":
        zero3_hook_compatible()
    rec = measure(setup, model_dir, steps=steps, length=length, world=int(os.environ["WORLD_SIZE"]))
    (out / f"rank{os.environ['RANK']}.json").write_text(json.dumps(rec))
    sys.stdout.flush()
    os._exit(0)  # gloo's destructor may deadlock at interpreter teardown (tests/support/dist_trl_run.py)


def launch(setup: str, model_dir: Path, *, steps: int, length: int) -> dict:
    """A sharded setup on 2 processes; per config the larger of the two processes' peaks."""
    out = Path(tempfile.mkdtemp(prefix=f"mem-{setup}-"))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = dict(os.environ, DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_addr", "127.0.0.1",
           "--master_port", str(port), __file__, "--worker", setup, "--model-dir", str(model_dir),
           "--worker-out", str(out), "--steps", str(steps), "--length", str(length)]
    p = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if p.returncode != 0:
        raise RuntimeError(f"{setup} failed:\n{p.stderr[-4000:]}")
    ranks = [json.loads((out / f"rank{r}.json").read_text()) for r in (0, 1)]
    res = {}
    for name, *_ in CONFIGS:
        a, b = (r["configs"][name] for r in ranks)
        res[name] = {**max(a, b, key=lambda d: d["peak_saved_mb"]),
                     "peak_saved_mb_per_process": [a["peak_saved_mb"], b["peak_saved_mb"]]}
    base = res["no_replay"]["peak_saved_mb"]
    return {"configs": res, "ratio_chunk": res["chunk"]["peak_saved_mb"] / base,
            "ratio_grow": res["grow"]["peak_saved_mb"] / base, "processes": 2}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--setups", default=",".join(SETUPS), help=f"comma-separated subset of {SETUPS}")
    ap.add_argument("--out", default=str(RESULTS / "trl_memory.json"))
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--worker-out", help=argparse.SUPPRESS)
    ap.add_argument("--model-dir", help=argparse.SUPPRESS)
    ap.add_argument("--steps", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--length", type=int, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        return worker(args.worker, Path(args.model_dir), Path(args.worker_out), args.steps, args.length)
    steps, length = (3, 32) if args.quick else (4, 64)
    setups = [s for s in args.setups.split(",") if s]
    bad = sorted(set(setups) - set(SETUPS))
    if bad:
        ap.error(f"--setups: unknown {bad}; choose from {SETUPS}")
    model_dir = Path(tempfile.mkdtemp(prefix="mem-model-")) / "m"
    build_tiny_model(model_dir, hidden=128, layers=4, max_positions=512)
    t0 = time.perf_counter()
    results = {}
    for setup in setups:
        t = time.perf_counter()
        results[setup] = (measure(setup, model_dir, steps=steps, length=length, world=1) if setup == "single"
                          else launch(setup, model_dir, steps=steps, length=length))
        results[setup]["wall_s"] = time.perf_counter() - t
        print(f"{setup}: chunk {results[setup]['ratio_chunk']:.3f}  grow {results[setup]['ratio_grow']:.3f}",
              flush=True)
    out = {
        "setups": results,
        "target": {"ratio_chunk": "<= 1.05"},
        "measured": "bytes of tensors saved for backward per micro-step (unique storages, parameters and gathered "
                    "full weights excluded); peak = the largest forward of the micro-step (chunk mode "
                    "backpropagates each part before the next); sharded setups: the larger process",
        "workload": {"per_device_train_batch_size": 8, "gradient_accumulation_steps": 2, "num_generations": 4,
                     "replay_rows_per_process_and_update": 16, "completion_tokens": length,
                     "model": "Qwen2 hidden 128, 4 layers (random)", "loss_type": "grpo", "steps": steps},
        "command": "python benchmarks/trl_memory.py" + (" --quick" if args.quick else "")
                   + ("" if setups == list(SETUPS) else f" --setups {args.setups}"),
        "wall_s": time.perf_counter() - t0,
        "quick": args.quick, "torch": torch.__version__, "machine": platform.machine(),
    }
    try:
        import deepspeed

        out["deepspeed"] = deepspeed.__version__
    except ImportError:
        pass
    path = Path(args.out)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(out, indent=2) + "\n")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
