"""The gate's re-score through ``HDRGRPOTrainer`` against TRL's own old-log-prob forward, per token (issue 37).

    python benchmarks/gate_trainer.py          # one CUDA GPU: the ~0.5B Qwen2 shape of gpu_check.py, bf16 (~2-3 min)
    python benchmarks/gate_trainer.py --tiny   # the same code on a tiny model on the CPU (the test suite runs it)

Model, prompts, rewards and batch as in ``benchmarks/gpu_check.py`` (prompt 192-256 tokens, completion 512, n 8, 4
fresh groups per update, tau 0.05: nearly every scanned group passes, the regime where the early-rejection slices of
the old default cost most).  Generation is the one part substituted: TRL's ``_generate_single_turn`` returns random
completions of exactly ``completion`` tokens at once (a stand-in for the engine: what is measured -- the gate's
forward and TRL's old-log-prob forward -- never reads how the tokens were sampled, and HF ``generate`` would take
~15 s of a lent GPU per step).  Everything else is the trainer's own path.

Configurations, each a fresh trainer from the same saved model, per K_rep:
``default`` (the gate's token budget taken from TRL's forward batch), ``passes1`` (``replay_scan_passes=1``, every
group whole) and, at K_rep 2, ``legacy`` (the default before issue 37: 4 slices, windows sized by the groups needed).
Per replay step: the gate's seconds (CUDA-synchronised, around ``_replay_scorer``), its forwarded and *needed* tokens
(rows of the groups it scanned: speculative extras count as cost, not as tokens), scorer calls and rows per call, and
TRL's old-log-prob forward over the fresh batch (its seconds and unpadded tokens), run where TRL runs it (after
scoring, right before the gate).  Headline per configuration: the
gate's seconds per needed token over the old-log-prob forward's seconds per token (median over the replay steps).
Writes benchmarks/results/gate_trainer[_tiny].json and .md.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import gpu_check  # noqa: E402  (the model, data, reward and timed trainer of the GPU check)
import torch  # noqa: E402

FULL = dict(gpu_check.FULL, steps=6)
TINY = dict(gpu_check.TINY, steps=5, k_rep=1)
CONFIGS = (("default", 2), ("passes1", 2), ("legacy", 2), ("default", 8), ("passes1", 8))


def make_trainer_class(s: dict, legacy: bool, latency_bound: bool | None = None):
    from trl import GRPOTrainer

    Timed = gpu_check.make_trainer_class()

    class OldLogprobForward(GRPOTrainer):
        """TRL's generation and scoring, then the old-log-prob forward over the fresh batch, timed: placed between
        HDRGRPOTrainer and GRPOTrainer in the MRO, so it runs where TRL computes old log-probs (vLLM importance
        sampling, misaligned steps) -- right before the gate, as in a real run."""

        def _generate_and_score_completions(self, inputs):
            out = super()._generate_and_score_completions(inputs)
            if self.model.training:
                ids = torch.cat([out["prompt_ids"], out["completion_ids"]], 1)
                mask = torch.cat([out["prompt_mask"], out["completion_mask"]], 1)
                t0 = self.t["old_logprob"]
                self._timed("old_logprob", self._logps, ids, mask, out["completion_ids"].shape[1])
                self.fresh.append({"seconds": self.t["old_logprob"] - t0, "tokens": int(mask.sum()),
                                   "rows": int(ids.shape[0])})
            return out

    class GateTrainer(Timed, OldLogprobForward):
        """The GPU check's timed trainer; generation stood in by random completions; the gate's cost recorded."""

        def __init__(self, *a, **k):
            super().__init__(*a, **k)
            self.gate, self.fresh = [], []
            self._gen = torch.Generator().manual_seed(0)

        def _generate_single_turn(self, prompt_ids, images, multimodal_fields, num_generations):
            ids = torch.randint(2, s["vocab"], (len(prompt_ids), s["completion"]), generator=self._gen)
            return ids.tolist(), None

        def _scan_budget(self):
            out = {} if legacy else super()._scan_budget()
            if out and latency_bound is not None:  # --latency-bound: the GPU's walk on the CPU (the test's proxy)
                out["latency_bound"] = latency_bound
            return out

        def _select(self, step):
            t0 = self.t["rescore"]
            out = super()._select(step)
            sel = step.selection
            if sel is not None and sel.cost is not None:
                c = sel.cost
                self.gate.append({"seconds": self.t["rescore"] - t0, "forward_tokens": c.forward_tokens,
                                  "needed_tokens": c.forward_tokens - c.unused_forward_tokens, "calls": c.calls,
                                  "rows": c.rows, "scanned": len(sel.scanned), "accepted": len(sel.accepted),
                                  "sliced": c.sliced, "unused": c.unused, "step": step.index})
            return out

    return GateTrainer


def run(name: str, k_rep: int, model_dir: Path, s: dict, *, device, out_dir: Path, tau: float,
        warmup_s: float = 0.0, latency_bound: bool | None = None) -> dict:
    from hdreplay.integrations.trl import HDRGRPOConfig

    model, tok = gpu_check.load(model_dir, device)
    cpu = device.type == "cpu"
    args = HDRGRPOConfig(
        output_dir=str(out_dir / f"{name}_{k_rep}"), per_device_train_batch_size=s["batch"],
        gradient_accumulation_steps=s["ga"], num_generations=s["n"], max_completion_length=s["completion"],
        max_steps=s["steps"], learning_rate=1e-6, bf16=not cpu, use_cpu=cpu, report_to="none", logging_steps=1,
        save_strategy="no", seed=0, disable_dropout=True, replay_selector="headroom_drift", replay_k_rep=k_rep,
        replay_tau=tau, replay_capacity=64, replay_scan_passes=1 if name == "passes1" else 4,
        dataloader_num_workers=0, gradient_checkpointing=True)
    tr = make_trainer_class(s, legacy=name == "legacy", latency_bound=latency_bound)(
        model=model, reward_funcs=gpu_check.parity_reward, args=args, processing_class=tok,
        train_dataset=gpu_check.dataset(s, rows=s["n"] * s["steps"] * 8, seed=0))
    tr.measure_old_logprob = False  # measured before the gate instead (OldLogprobForward)
    warm = torch.randint(2, s["vocab"], (s["batch"], s["prompt"] + s["completion"]), device=device)
    t0 = time.perf_counter()
    while True:  # warm-up: kernels, allocator and clocks, so that the first steps measure the same device
        tr._logps(warm, torch.ones_like(warm), s["completion"])
        if time.perf_counter() - t0 >= warmup_s:
            break
    t0 = time.perf_counter()
    tr.train()
    wall = time.perf_counter() - t0
    fresh_spt = statistics.median(f["seconds"] / f["tokens"] for f in tr.fresh[1:] or tr.fresh)  # first: warm-up
    steps = [g for g in tr.gate if g["scanned"] >= k_rep]  # the buffer held K_rep groups: a full selection
    ratios = [(g["seconds"] / g["needed_tokens"]) / fresh_spt for g in steps]
    gate_spt = statistics.median(g["seconds"] / g["needed_tokens"] for g in steps) if steps else None
    out = {"name": name, "k_rep": k_rep, "wall_s": wall, "gate_steps": tr.gate, "fresh": tr.fresh,
           "fresh_s_per_token": fresh_spt, "measured_steps": len(steps),
           "gate_s_per_needed_token_vs_fresh": statistics.median(ratios) if ratios else None,
           "median_gate_over_median_fresh": gate_spt / fresh_spt if steps else None,
           "ratios": ratios,
           "rows_per_call": statistics.mean(g["rows"] / g["calls"] for g in steps) if steps else None,
           "fresh_rows_per_call": s["batch"]}
    del tr, model
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return out


def markdown(res: dict) -> str:
    s = res["settings"]
    lines = [f"# The gate through HDRGRPOTrainer on {res['device']}", "",
             f"{res['params_m']:.0f}M-parameter Qwen2 shape, prompt <= {s['prompt']}, completion {s['completion']}, "
             f"n {s['n']}, per-device batch {s['batch']} x GA {s['ga']}, tau {res['tau']:g}, {s['steps']} steps per "
             f"configuration (generation stood in by random completions). Command: `{res['command']}`.", "",
             "| configuration | K_rep | replay steps measured | gate s / needed token over old-log-prob s / token "
             "(median of per-step ratios; per step) | median over median | rows per gate call | needed / forwarded "
             "tokens | sliced |", "|---|---|---|---|---|---|---|---|"]
    for r in res["runs"]:
        st = [g for g in r["gate_steps"] if g["scanned"] >= r["k_rep"]]
        ratio = r["gate_s_per_needed_token_vs_fresh"]
        lines.append(f"| {r['name']} | {r['k_rep']} | {r['measured_steps']} | "
                     f"{'n/a' if ratio is None else f'{ratio:.2f}'} ({', '.join(f'{x:.2f}' for x in r['ratios'])}) | "
                     f"{r['median_gate_over_median_fresh'] or float('nan'):.2f} | "
                     f"{r['rows_per_call'] or 0:.1f} (TRL's forward: {r['fresh_rows_per_call']}) | "
                     f"{sum(g['needed_tokens'] for g in st)} / {sum(g['forward_tokens'] for g in st)} | "
                     f"{sorted({g['sliced'] for g in st})} |")
    return "\n".join(lines) + "\n"


def pool(paths: list[str]) -> str:
    """One table from several runs' JSON (a lent GPU's timings vary run to run): per configuration, the median gate
    seconds per needed token over the median old-log-prob seconds per token, pooled over the runs' steps.  The first
    configuration of each process is left out (its forwards ran up to 10x slower on the H200: device warm-up), and
    each configuration's first old-log-prob forward."""
    gate, fresh, n = {}, [], 0
    for path in paths:
        res = json.loads(Path(path).read_text())
        n += 1
        for r in res["runs"][1:]:
            fresh += [f["seconds"] / f["tokens"] for f in r["fresh"][1:]]
            gate.setdefault((r["name"], r["k_rep"]), []).extend(
                g["seconds"] / g["needed_tokens"] for g in r["gate_steps"] if g["scanned"] >= r["k_rep"])
    f = statistics.median(fresh)
    lines = [f"Pooled over {n} runs ({len(fresh)} old-log-prob forwards, median {f * 1e6:.2f} us per token):", "",
             "| configuration | K_rep | gate steps "
             "| gate s / needed token over old-log-prob s / token: median [q25, q75] |",
             "|---|---|---|---|"]
    for (name, k), v in sorted(gate.items(), key=lambda kv: (kv[0][1], kv[0][0])):
        q = statistics.quantiles(v, n=4) if len(v) > 1 else [v[0]] * 3
        lines.append(f"| {name} | {k} | {len(v)} | {statistics.median(v) / f:.2f} [{q[0] / f:.2f}, {q[2] / f:.2f}] |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tiny", action="store_true")
    ap.add_argument("--tau", type=float, default=0.05)
    ap.add_argument("--out-dir", default=str(HERE / "results"))
    ap.add_argument("--steps", type=int, default=None, help="optimizer steps per configuration")
    ap.add_argument("--warmup-s", type=float, default=None, help="seconds of forwards before each configuration "
                                                                  "(default 8 on a GPU, 0 on the CPU)")
    ap.add_argument("--pool", nargs="+", metavar="JSON", help="print one table pooled over these runs' results")
    ap.add_argument("--latency-bound", action="store_true", help="walk as on a GPU (whole groups at high acceptance, "
                                                                  "speculative scoring) whatever the device")
    a = ap.parse_args(argv)
    if a.pool:
        print(pool(a.pool))
        return {}
    import transformers
    import trl

    if not a.tiny and not torch.cuda.is_available():
        ap.error("no CUDA GPU: run with --tiny on a CPU")
    s = dict(TINY if a.tiny else FULL)
    s["steps"] = a.steps or s["steps"]
    warmup = a.warmup_s if a.warmup_s is not None else (0.0 if a.tiny else 8.0)
    stem = Path(a.out_dir) / ("gate_trainer_tiny" if a.tiny else "gate_trainer")
    stem.parent.mkdir(parents=True, exist_ok=True)
    device = torch.device("cpu" if a.tiny else "cuda")
    t_all = time.perf_counter()
    runs = []
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = Path(tmp) / "model"
        params = gpu_check.build(model_dir, s, seed=0, device=device) / 1e6
        for name, k in CONFIGS:
            k = {2: 1, 8: 2}[k] if a.tiny else k  # the tiny run's 2 fresh groups per update fill a smaller buffer
            try:
                runs.append(run(name, k, model_dir, s, device=device, out_dir=Path(tmp), tau=a.tau, warmup_s=warmup,
                                latency_bound=True if a.latency_bound else None))
                Path(f"{stem}.partial.json").write_text(json.dumps(runs, indent=1) + "\n")
            except Exception as e:  # noqa: BLE001  (one configuration's failure is reported, the others still run)
                print(f"[gate_trainer] {name} K_rep {k} failed: {type(e).__name__}: {e}", flush=True)
                continue
            r = runs[-1]
            print(f"[gate_trainer] {name} K_rep {k}: {r['wall_s']:.0f} s, gate/fresh per token "
                  f"{r['gate_s_per_needed_token_vs_fresh']}", flush=True)
    res = {"device": torch.cuda.get_device_name(0) if device.type == "cuda" else "cpu", "tiny": a.tiny, "settings": s,
           "latency_bound_forced": a.latency_bound,
           "tau": a.tau, "params_m": params, "runs": runs,
           "versions": {"torch": torch.__version__, "transformers": transformers.__version__, "trl": trl.__version__},
           "command": "python benchmarks/gate_trainer.py " + " ".join(sys.argv[1:] if argv is None else argv),
           "wall_s": time.perf_counter() - t_all}
    Path(f"{stem}.json").write_text(json.dumps(res, indent=1) + "\n")
    Path(f"{stem}.partial.json").unlink(missing_ok=True)
    Path(f"{stem}.md").write_text(markdown(res))
    print(markdown(res))
    return res


if __name__ == "__main__":
    main()
