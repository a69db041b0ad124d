"""Activation memory of a TRL micro-step with and without replay, at the same per_device_train_batch_size.

    python benchmarks/trl_memory.py            # about a minute on 2 CPU cores
    python benchmarks/trl_memory.py --quick

What is measured: the bytes of the tensors autograd saves for backward during a micro-step's forward passes
(``torch.autograd.graph.saved_tensors_hooks``; every storage counted once, model parameters excluded).  That is
the activation memory a micro-step holds at its peak -- on a GPU the part that grows with rows.  With
``replay_micro_step="chunk"`` a micro-step runs TRL's loss on the fresh micro-batch and on each replay chunk,
each backward right after its forward, so its peak is the largest part; with ``"grow"`` it is the merged batch.
(CPU allocator peaks are not observable here; the saved-tensor count is exact and device independent.)  Prompts
vary in length so that every micro-batch is padded: an unpadded batch takes SDPA's mask-free path and saves ~7 %
less, which would otherwise show up as a difference between batches, not between replay and no replay.

Configurations, same workload (Qwen2-shaped random model, completions of a fixed length so every row costs the
same; per_device_train_batch_size 8, GA 2, groups of 4, replay_k_rep 4 = 16 replay rows per step, the issue's
example):
    no_replay   replay_selector none
    chunk       recency replay, replay_micro_step chunk (the default)
    grow        recency replay, replay_micro_step grow

Writes benchmarks/results/trl_memory.json: ``peak_saved_mb`` (max over replay micro-steps), ``ratio_chunk`` =
chunk / no_replay (target <= 1.1), ``ratio_grow`` = grow / no_replay (the memory cost grow states), and the most
rows one forward held.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

import torch  # noqa: E402
from datasets import Dataset  # noqa: E402

from hdreplay.integrations.trl import HDRGRPOConfig, HDRGRPOTrainer  # noqa: E402
from hdreplay_lab.sandbox.model import build_tiny_model, load_model  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"


class MemoryTrainer(HDRGRPOTrainer):
    """Counts the bytes saved for backward in every loss call; groups them by micro-step."""

    def __init__(self, *a, **k):
        super().__init__(*a, **k)
        self.params = {p.untyped_storage().data_ptr() for p in self.model.parameters()}
        self.parts: list[tuple[int, int, int, bool]] = []  # (global_step, micro-step, bytes, has replay rows)

    def _compute_loss(self, model, inputs):
        seen, total = set(), [0]

        def pack(t):
            s = t.untyped_storage()
            ptr = s.data_ptr()
            if ptr not in seen and ptr not in self.params:
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


def run(name, model_dir, *, selector, mode, steps, length):
    model, tok = load_model(model_dir)
    # prompts of 4-8 tokens: micro-batches are padded, as real ones are (an unpadded batch takes SDPA's
    # mask-free path, which saves less for backward; mixing the two would measure padding, not replay)
    ds = Dataset.from_dict({"prompt": [f"{i}+{j}=" for i in range(0, 2000, 7) for j in range(0, 300, 11)]})
    args = HDRGRPOConfig(
        output_dir=tempfile.mkdtemp(prefix=f"mem-{name}-"), use_cpu=True, bf16=False, report_to="none",
        activation_checkpointing=False, logging_steps=10**6, save_strategy="no", max_steps=steps,
        per_device_train_batch_size=8, gradient_accumulation_steps=2, num_generations=4,
        max_completion_length=length, generation_kwargs={"min_new_tokens": length}, learning_rate=1e-5,
        loss_type="grpo", seed=0, disable_tqdm=True, disable_dropout=True, replay_selector=selector,
        replay_k_rep=4, replay_tau=1e9, replay_diagnostics_dir="", replay_micro_step=mode,
    )
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
            "wall_s": time.perf_counter() - t0}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--out", default=str(RESULTS / "trl_memory.json"))
    args = ap.parse_args()
    steps, length = (3, 32) if args.quick else (4, 64)
    model_dir = Path(tempfile.mkdtemp(prefix="mem-model-")) / "m"
    build_tiny_model(model_dir, hidden=128, layers=4, max_positions=512)
    res = {name: run(name, model_dir, selector=sel, mode=mode, steps=steps, length=length)
           for name, sel, mode in (("no_replay", "none", "chunk"), ("chunk", "recency", "chunk"),
                                   ("grow", "recency", "grow"))}
    base = res["no_replay"]["peak_saved_mb"]
    out = {
        "configs": res,
        "ratio_chunk": res["chunk"]["peak_saved_mb"] / base,
        "ratio_grow": res["grow"]["peak_saved_mb"] / base,
        "target": {"ratio_chunk": "<= 1.1"},
        "measured": "bytes of tensors saved for backward per micro-step (unique storages, parameters excluded); "
                    "peak = the largest forward of the micro-step (chunk mode backpropagates each part before the next)",
        "workload": {"per_device_train_batch_size": 8, "gradient_accumulation_steps": 2, "num_generations": 4,
                     "replay_k_rep": 4, "completion_tokens": length, "model": "Qwen2 hidden 128, 4 layers (random)",
                     "loss_type": "grpo", "steps": steps},
        "quick": args.quick, "torch": torch.__version__, "machine": platform.machine(),
    }
    path = Path(args.out)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(out, indent=2) + "\n")
    print(json.dumps({k: out[k] for k in ("ratio_chunk", "ratio_grow")} |
                     {k: {f: round(v[f], 3) for f in ("peak_saved_mb", "max_rows_per_forward", "forwards_per_micro_step")}
                      for k, v in res.items()}, indent=2))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
