"""One-command GPU check: hdreplay on a ~0.5B-parameter Qwen2-shaped model in bf16 through ``HDRGRPOTrainer``.

    python benchmarks/gpu_check.py           # one CUDA GPU, under 8 minutes (needs torch, transformers,
                                             # accelerate, trl, datasets; nothing is downloaded)
    python benchmarks/gpu_check.py --tiny    # the same code on a tiny model on the CPU (the test suite runs it)

What it builds and runs (random-init weights, built locally and reloaded with ``from_pretrained``; a word-level
tokenizer over the whole vocabulary; rewards are the parity of a completion's token ids, so groups are mixed):

* model: Qwen2.5-0.5B's shape (hidden 896, 24 layers, 14 heads / 2 KV heads, MLP 4864, vocab 151,936, tied
  embeddings: 494M parameters), bf16 weights (what TRL loads with ``dtype="auto"``); prompts up to 256 tokens (3/4 to
  all of it), completions exactly 512 tokens, n = 8, 4 fresh groups per update (per-device batch 8, GA 4),
  K_rep = 2, transformers generation (no vLLM).
* **Drift floor** (:mod:`hdreplay_lab.drift_floor`): Drift of groups re-scored at unchanged weights under another batch
  composition, padding and chunking than at birth, for bf16 weights and fp32 weights + bf16 autocast;
  percentiles against the default tau (1e-3) and the calibrated range (1e-3 .. 1e-1).
* **One step split** (replay_micro_step chunk, after the first update filled the buffer): generation /
  old-log-prob forward / gate re-score / update (forward + backward of every micro-step + optimizer step) /
  bookkeeping (selection outside the forward, row building, commit) / other (TRL's rewards, advantages, logging).
  With transformers generation and aligned steps TRL computes no old log-probs; the old-log-prob forward is run
  here once per step through TRL's own ``_get_per_token_logps_and_entropies`` over the fresh batch -- what TRL runs
  with vLLM importance sampling or misaligned steps, and what verl always runs -- so that the gate's re-score can be
  stated as a fraction of it.
* **Peak GPU memory** (``torch.cuda.max_memory_allocated`` over the replay steps) for no replay / chunk / grow at
  the same per-device batch.  On the CPU (``--tiny``) peak memory is not observable and is reported as null.
* The gate's own Drift of the groups it scanned in the trainer (TRL's training-forward log-probs at birth vs the
  gate's no-grad re-score one update later, lr 1e-6 in bf16) beside the floor.

Writes ``docs/results/gpu_check.json`` and ``docs/results/gpu_check.md`` (``--out-dir`` to change; ``--tiny`` writes
``gpu_check_tiny.*``).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "src"))
sys.path.insert(0, str(HERE))

import torch  # noqa: E402

from hdreplay_lab import drift_floor  # noqa: E402

FULL = dict(hidden=896, layers=24, heads=14, kv_heads=2, mlp=4864, vocab=151936, prompt=256, completion=512, n=8,
            batch=8, ga=4, k_rep=2, floor_groups=16, steps=3)
TINY = dict(hidden=64, layers=2, heads=4, kv_heads=2, mlp=128, vocab=512, prompt=16, completion=16, n=4,
            batch=4, ga=2, k_rep=1, floor_groups=6, steps=3)
TAU_DEFAULT, TAU_RANGE = 1e-3, (1e-3, 1e-1)


# ----------------------------------------------------------------------------------------------- model and data
def build(directory: Path, s: dict, *, seed: int, device: torch.device) -> int:
    """A random-init Qwen2-shaped model (bf16) + a word-level tokenizer over its vocabulary, saved under ``directory``;
    returns the number of parameters."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

    vocab = {"<pad>": 0, "<eos>": 1, **{f"w{i}": i for i in range(2, s["vocab"])}}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>",
                                        padding_side="left")
    cfg = Qwen2Config(vocab_size=s["vocab"], hidden_size=s["hidden"], intermediate_size=s["mlp"],
                      num_hidden_layers=s["layers"], num_attention_heads=s["heads"], num_key_value_heads=s["kv_heads"],
                      max_position_embeddings=4096, tie_word_embeddings=True, pad_token_id=0, eos_token_id=1,
                      bos_token_id=None)
    torch.manual_seed(seed)
    with torch.device(device):
        model = Qwen2ForCausalLM(cfg)
    model.generation_config.eos_token_id, model.generation_config.pad_token_id = 1, 0
    model.to(torch.bfloat16).save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    params = sum(p.numel() for p in model.parameters())
    del model
    return params


def load(directory: Path, device: torch.device, dtype=torch.bfloat16):
    from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast

    model = AutoModelForCausalLM.from_pretrained(directory, dtype=dtype).to(device)
    return model, PreTrainedTokenizerFast.from_pretrained(directory)


def dataset(s: dict, *, rows: int, seed: int):
    from datasets import Dataset

    g = torch.Generator().manual_seed(seed)
    prompts = []
    for _ in range(rows):
        L = int(torch.randint(3 * s["prompt"] // 4, s["prompt"] + 1, (1,), generator=g))
        prompts.append(" ".join(f"w{int(i)}" for i in torch.randint(2, s["vocab"], (L,), generator=g)))
    return Dataset.from_dict({"prompt": prompts})


def parity_reward(completions, completion_ids=None, **kw):
    """1 when a completion's token ids sum to an even number: a coin flip per response, so groups are mixed."""
    return [float(sum(ids) % 2 == 0) for ids in completion_ids]


# ----------------------------------------------------------------------------------------------- timed trainer
def make_trainer_class():
    from transformers import TrainerCallback

    from hdreplay.integrations.trl import HDRGRPOTrainer

    def sync():
        if torch.cuda.is_available():
            torch.cuda.synchronize()

    class TimedTrainer(HDRGRPOTrainer):
        """Times the phases of each optimizer step by wrapping the trainer's own methods (CUDA-synchronised)."""

        measure_old_logprob = False

        def __init__(self, *a, **k):
            super().__init__(*a, **k)
            self.t = defaultdict(float)
            self.steps: list[dict] = []
            self.scan_drift: list[float] = []
            self.add_callback(StepClock(self))

        def _timed(self, name, fn, *a, **k):
            sync()
            t0 = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                sync()
                self.t[name] += time.perf_counter() - t0

        def _generate(self, prompts):
            return self._timed("generation", super()._generate, prompts)

        def _replay_scorer(self, groups):
            return self._timed("rescore", super()._replay_scorer, groups)

        def _select(self, step):
            return self._timed("select", super()._select, step)

        def _commit_step(self):
            rec_before = self.replay.last_record if self.replay_active else None
            out = self._timed("commit", super()._commit_step)
            rec = self.replay.last_record if self.replay_active else None
            if rec is not None and rec is not rec_before:
                self.scan_drift += [d for d in rec.scan_drift if d is not None]
            return out

        def _prepare_inputs(self, batch):
            return self._timed("prepare", super()._prepare_inputs, batch)

        def _generate_and_score_completions(self, inputs):
            out = self._timed("gen_and_score", super()._generate_and_score_completions, inputs)
            if self.measure_old_logprob and self.model.training:
                ids = torch.cat([out["prompt_ids"], out["completion_ids"]], 1)
                mask = torch.cat([out["prompt_mask"], out["completion_mask"]], 1)
                self._timed("old_logprob", self._logps, ids, mask, out["completion_ids"].shape[1])
            return out

        def training_step(self, *a, **k):
            return self._timed("training_step", super().training_step, *a, **k)

    class StepClock(TrainerCallback):
        def __init__(self, tr):
            self.tr = tr

        def on_step_begin(self, args, state, control, **kw):
            self.tr.t = defaultdict(float)
            if torch.cuda.is_available():
                torch.cuda.reset_peak_memory_stats()
            sync()
            self.t0 = time.perf_counter()

        def on_pre_optimizer_step(self, args, state, control, **kw):
            sync()
            self.o0 = time.perf_counter()

        def on_optimizer_step(self, args, state, control, **kw):
            sync()
            self.tr.t["optimizer"] += time.perf_counter() - self.o0

        def on_step_end(self, args, state, control, **kw):
            sync()
            c, total = self.tr.t, time.perf_counter() - self.t0
            rec = self.tr.replay.last_record if self.tr.replay_active else None
            phases = {
                "generation": c["generation"],
                "old_logprob": c["old_logprob"],
                "rescore": c["rescore"],
                "update": c["training_step"] - c["prepare"] + c["optimizer"],
                "bookkeeping": (c["select"] - c["rescore"]) + c["commit"]
                + max(0.0, c["prepare"] - c["gen_and_score"] - c["old_logprob"]),
            }
            phases["other"] = total - sum(phases.values())
            self.tr.steps.append({
                "step": state.global_step, "total": total, **phases,
                "peak_mem_gib": torch.cuda.max_memory_allocated() / 2**30 if torch.cuda.is_available() else None,
                "scanned": rec.scanned if rec else 0, "accepted": rec.accepted if rec else 0,
                "rescored_rows": rec.rescored_rows if rec else 0,
            })

    return TimedTrainer


def run_config(name: str, model_dir: Path, s: dict, *, device: torch.device, out_dir: Path, seed: int,
               tau: float, checkpointing: bool = True) -> dict:
    from hdreplay.integrations.trl import HDRGRPOConfig

    TimedTrainer = make_trainer_class()
    model, tok = load(model_dir, device)
    cpu = device.type == "cpu"
    selector = "none" if name == "no_replay" else "headroom_drift"
    args = HDRGRPOConfig(
        output_dir=str(out_dir / name), per_device_train_batch_size=s["batch"], gradient_accumulation_steps=s["ga"],
        num_generations=s["n"], max_completion_length=s["completion"], max_steps=s["steps"], learning_rate=1e-6,
        bf16=not cpu, use_cpu=cpu, report_to="none", logging_steps=1, save_strategy="no", seed=seed,
        disable_dropout=True, temperature=1.0, generation_kwargs={"min_new_tokens": s["completion"]},
        replay_selector=selector, replay_k_rep=s["k_rep"], replay_tau=tau, replay_capacity=64,
        replay_micro_step="grow" if name == "grow" else "chunk", dataloader_num_workers=0,
        gradient_checkpointing=checkpointing,
    )
    tr = TimedTrainer(model=model, reward_funcs=parity_reward, args=args, processing_class=tok,
                      train_dataset=dataset(s, rows=s["n"] * s["steps"] * 8, seed=seed))
    tr.measure_old_logprob = True  # the same extra forward in every configuration, so step totals compare
    t0 = time.perf_counter()
    tr.train()
    wall = time.perf_counter() - t0
    replay_steps = [st for st in tr.steps if st["step"] >= 2]  # step 1 only filled the buffer
    share = bool(getattr(tr, "_share_prompt", False))
    out = {"wall_s": wall, "steps": tr.steps, "scan_drift": tr.scan_drift, "prompt_shared_rescore_enabled": share,
           "peak_mem_gib": max((st["peak_mem_gib"] for st in replay_steps), default=None) if not cpu else None,
           "replayed_rows": sum(st["accepted"] for st in replay_steps) * s["n"]}
    del tr, model
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return out


# ----------------------------------------------------------------------------------------------- the check
def measure_floor(model_dir: Path, s: dict, *, device: torch.device, seed: int) -> dict:
    out = {}
    for mode in ("bf16_weights", "bf16_autocast"):
        model, tok = load(model_dir, device, dtype=torch.bfloat16 if mode == "bf16_weights" else torch.float32)
        model.eval()
        prompts, comps = drift_floor.sampled_groups(
            model, num_groups=s["floor_groups"], n=s["n"], prompt_len=s["prompt"], completion_len=s["completion"],
            vocab=s["vocab"], seed=seed, pad_token_id=tok.pad_token_id, mode=mode)
        d = drift_floor.floor(model, prompts, comps, n=s["n"], pad_token_id=tok.pad_token_id, mode=mode,
                              batch_rows=s["batch"], extra_pad=s["prompt"] // 4, seed=seed)
        out[mode] = {"summary": drift_floor.summarize(d, tau=TAU_DEFAULT, tau_range=TAU_RANGE), "per_group": d}
        del model
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    return out


def phase_table(steps: list[dict]) -> dict:
    keys = ("total", "generation", "old_logprob", "rescore", "update", "bookkeeping", "other")
    replay = [st for st in steps if st["step"] >= 2] or steps
    return {k: statistics.median(st[k] for st in replay) for k in keys}


def write_markdown(path: Path, res: dict) -> None:
    s, ph, mem = res["settings"], res["step_phases_s"], res["peak_mem_gib"]
    lines = [
        "# GPU check" + (" (--tiny, CPU)" if res["tiny"] else ""), "",
        f"Device: **{res['device']}**; torch {res['versions']['torch']}, "
        f"transformers {res['versions']['transformers']}, "
        f"trl {res['versions']['trl']}; {res['params_m']:.1f}M-parameter random-init Qwen2-shaped model, bf16 weights; "
        f"prompt <= {s['prompt']}, completion {s['completion']}, n = {s['n']}, {s['batch'] * s['ga'] // s['n']} fresh "
        f"groups per update, K_rep = {s['k_rep']}, tau = {res['tau']:g} in the trainer runs. "
        f"Wall: {res['wall_s']:.0f} s. "
        f"Activation checkpointing {'on' if res['gradient_checkpointing'] else 'off'}; configurations ran in the order "
        f"{', '.join(res['order'])}. Command: `{res['command']}`.", "",
        "## Drift floor (unchanged weights, another layout than at birth)", "",
        "| precision | layout | p50 | p90 | p99 | max | p99 / tau (1e-3) |", "|---|---|---|---|---|---|---|",
    ]
    for mode, f in res["floor"].items():
        lines += drift_floor.markdown_rows(mode, f)
    if not res["floor"]:
        lines.append("| (not measured in this run: --skip-floor) | | | | | | |")
    lines += ["", f"Trainer path (TRL's training-forward log-probs at birth vs the gate's re-score one update later at "
                  f"lr 1e-6, bf16 weights): {res['trainer_scan_drift']}", "",
              "## One step (chunk mode, median over the replay steps)", "",
              "| phase | seconds | share |", "|---|---|---|"]
    for k in ("generation", "old_logprob", "rescore", "update", "bookkeeping", "other"):
        lines.append(f"| {k} | {ph[k]:.3f} | {ph[k] / ph['total']:.1%} |")
    lines += [f"| **step** | {ph['total']:.3f} | |", "",
              "Per configuration (median seconds over the replay steps; the old-log-prob forward runs in each):", "",
              "| configuration | step | generation | old-log-prob | re-score | update | bookkeeping |",
              "|---|---|---|---|---|---|---|"]
    for k, p in res["step_phases_s_by_config"].items():
        lines.append(f"| {k} | {p['total']:.3f} | {p['generation']:.3f} | {p['old_logprob']:.3f} "
                     f"| {p['rescore']:.3f} | {p['update']:.3f} | {p['bookkeeping']:.3f} |")
    lines += ["", f"Prompt-shared re-scoring enabled: {res['prompt_shared_rescore_enabled']}.", "",
              f"Gate re-score / old-log-prob forward: **{res['rescore_over_old_logprob']:.2f}** "
              f"(re-scored rows per step {res['rescored_rows_per_step']:.0f} "
              f"vs {res['fresh_rows_per_step']} fresh rows).", "",
              "## Peak GPU memory (GiB, max over the replay steps)", "",
              "| no replay | chunk | grow | chunk / no replay | grow / no replay |",
              "|---|---|---|---|---|"]

    def fmt(v):
        return "n/a" if v is None else f"{v:.2f}"

    r = res["peak_mem_ratio"]
    lines.append(f"| {fmt(mem['no_replay'])} | {fmt(mem['chunk'])} | {fmt(mem['grow'])} "
                 f"| {fmt(r['chunk'])} | {fmt(r['grow'])} |")
    path.write_text("\n".join(lines) + "\n")


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tiny", action="store_true", help="tiny model on the CPU (the test suite's run)")
    ap.add_argument("--out-dir", default=str(HERE.parent / "docs" / "results"))
    ap.add_argument("--tau", type=float, default=0.05,
                    help="tau of the trainer runs (loose enough that replay rows train, so chunk/grow memory and the "
                         "update time include them; the floor is reported against the default 1e-3)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--skip-floor", action="store_true")
    ap.add_argument("--no-gradient-checkpointing", action="store_true",
                    help="train without activation checkpointing (activation memory dominates the peak)")
    ap.add_argument("--steps", type=int, default=None,
                    help="optimizer steps per configuration (the first fills the buffer)")
    ap.add_argument("--order", default="no_replay,chunk,grow", help="configurations, in the order they run")
    ap.add_argument("--tag", default="", help="suffix of the output files (gpu_check<tag>.json)")
    a = ap.parse_args(argv)
    import transformers
    import trl

    s = dict(TINY if a.tiny else FULL)
    if a.steps is not None:
        if a.steps < 2:
            ap.error(f"--steps must be >= 2 (the first step only fills the buffer), got {a.steps}")
        s["steps"] = a.steps
    order = [c.strip() for c in a.order.split(",") if c.strip()]
    if sorted(order) != ["chunk", "grow", "no_replay"]:
        ap.error(f"--order must name no_replay, chunk and grow once each, got {a.order!r}")
    if not a.tiny and not torch.cuda.is_available():
        ap.error("no CUDA GPU: run with --tiny on a CPU")
    device = torch.device("cpu" if a.tiny else "cuda")
    out_dir = Path(a.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    t_all = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        model_dir = tmp / "model"
        params = build(model_dir, s, seed=a.seed, device=device) / 1e6
        print(f"[gpu_check] model built ({params:.0f}M parameters) in {time.perf_counter() - t_all:.0f} s", flush=True)
        floor = {} if a.skip_floor else measure_floor(model_dir, s, device=device, seed=a.seed)
        print(f"[gpu_check] floor done at {time.perf_counter() - t_all:.0f} s", flush=True)
        stem = ("gpu_check_tiny" if a.tiny else "gpu_check") + a.tag
        partial = out_dir / f"{stem}.partial.json"
        partial.write_text(json.dumps({"floor": {k: v["summary"] for k, v in floor.items()}}, indent=1))
        runs = {}
        for name in order:
            runs[name] = run_config(name, model_dir, s, device=device, out_dir=tmp, seed=a.seed, tau=a.tau,
                                    checkpointing=not a.no_gradient_checkpointing)
            print(f"[gpu_check] {name}: {runs[name]['wall_s']:.0f} s, peak {runs[name]['peak_mem_gib']} GiB, "
                  f"replayed rows {runs[name]['replayed_rows']}", flush=True)
            partial.write_text(json.dumps({"floor": {k: v["summary"] for k, v in floor.items()},
                                           "runs": {k: {kk: vv for kk, vv in r.items() if kk != "scan_drift"}
                                                    for k, r in runs.items()}}, indent=1))
    ph = phase_table(runs["chunk"]["steps"])
    replay_steps = [st for st in runs["chunk"]["steps"] if st["step"] >= 2]
    mem = {k: runs[k]["peak_mem_gib"] for k in runs}
    sd = runs["chunk"]["scan_drift"]
    res = {
        "device": (torch.cuda.get_device_name(0) if device.type == "cuda"
                   else f"CPU ({platform.processor() or platform.machine()})"),
        "tiny": a.tiny, "settings": s, "tau": a.tau, "params_m": params, "order": order,
        "gradient_checkpointing": not a.no_gradient_checkpointing,
        "prompt_shared_rescore_enabled": runs["chunk"]["prompt_shared_rescore_enabled"],
        "step_phases_s_by_config": {k: phase_table(runs[k]["steps"]) for k in runs},
        "versions": {"torch": torch.__version__, "transformers": transformers.__version__, "trl": trl.__version__,
                     "python": platform.python_version()},
        "floor": {k: v["summary"] for k, v in floor.items()},
        "trainer_scan_drift": drift_floor.percentiles(sd) if sd else None,
        "step_phases_s": ph,
        "rescore_over_old_logprob": ph["rescore"] / ph["old_logprob"] if ph["old_logprob"] else None,
        "rescored_rows_per_step": statistics.mean(st["rescored_rows"] for st in replay_steps) if replay_steps else 0.0,
        "fresh_rows_per_step": s["batch"] * s["ga"],
        "replayed_rows": {k: runs[k]["replayed_rows"] for k in runs},
        "peak_mem_gib": mem,
        "peak_mem_ratio": {k: (mem[k] / mem["no_replay"] if mem[k] is not None and mem["no_replay"] else None)
                           for k in ("chunk", "grow")},
        "steps": {k: runs[k]["steps"] for k in runs},
        "command": "python benchmarks/gpu_check.py " + " ".join(sys.argv[1:] if argv is None else argv),
        "wall_s": time.perf_counter() - t_all,
    }
    (out_dir / f"{stem}.json").write_text(json.dumps(res, indent=1) + "\n")
    write_markdown(out_dir / f"{stem}.md", res)
    partial.unlink(missing_ok=True)
    print((out_dir / f"{stem}.md").read_text())
    return res


if __name__ == "__main__":
    main()
