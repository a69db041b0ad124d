"""TRL step-time benchmark: on-policy vs replay configurations, interleaved in one process.

    python benchmarks/trl_step.py            # full run (a few minutes)
    python benchmarks/trl_step.py --quick    # under 60 s
    python benchmarks/trl_step.py --gate     # the full scan vs exact early rejection at a rejecting tau

Workload shaped like LLM RL: long sampled completions (min/max new tokens, default 96/96), so
generation is at least half of the on-policy step (reported as ``generation_fraction``).  Equal
completion lengths keep the training cost of the replayed rows equal across the replay
configurations, so step differences isolate what replay selection costs.

Rollout cost model.  A tiny model decoding on 2 CPU cores is bound by per-step overhead: sampling 96
rows costs about what 64 rows cost (measured: 0.58 s vs 0.56 s for 96 tokens), so "1.5x fresh
rollouts" would be almost free here, unlike an LLM serving engine (or an agentic environment), whose
cost grows with the number of sequences.  ``--rollout-ms-per-token`` (default 0.1 ms) adds a
modelled, throughput-bound cost per generated token to TRL's ``_generate`` (a sleep, so nothing else
is slowed); ``--rollout-ms-per-token 0`` measures the tiny model's own decoding only.  Both settings
are reported by ``make bench``; the JSON records which one produced it.  The four
configurations train side by side in rounds (each round runs every trainer for a few steps; the
first round only fills the buffers), and each optimizer step is timed and split into phases by
wrapping the trainer's own methods:

    generation     TRL's ``_generate`` (sampling + decoding)
    rescoring      the replay scan's forward passes (``_replay_scorer``)
    bookkeeping    everything replay adds outside model forward/backward: selection, row building,
                   gathering, ingress records, commit (after the optimizer step)
    train          forward + backward of the loss (``training_step`` minus input preparation)

Writes benchmarks/results/trl_step.json with
    step_s                    median seconds per optimizer step per configuration
                              (onpolicy_b, onpolicy_1.5b, recency_b_r, hdr_b_r; r = b / 2)
    generation_fraction       generation / step of onpolicy_b
    scanned_per_step          mean groups scanned per HDR step;  budget_fill: mean accepted / K_rep
    hdr_over_recency          (paper: 1.077)
    hdr_over_onpolicy_larger  target < 1.0 (paper: 166.3 s / 197.2 s = 0.843)
    rescoring_vs_ideal        (HDR step - recency step) / one batched no-grad forward over the scanned rows,
                              measured in the same run; target <= 1.25.  Each step's own sampling time is
                              subtracted before differencing: completion lengths, hence sampling time,
                              vary between the two runs independently of replay (``_raw`` keeps it).
    bookkeeping_fraction      HDR replay bookkeeping / HDR step; target <= 0.02 (includes the selection digest of the
                              rank-agreement check, computed in every step; its collective is a no-op on one process)
    rank_agreement            ``--only rank_agreement`` (updates this entry of an existing --out file): the check's
                              cost per update -- digest of a K_rep = 64 selection (us), one all-gather of one int64
                              on 2 CPU processes over gloo (us) -- and its fraction of the measured HDR step;
                              ``bookkeeping_fraction_with_check`` adds the collective to bookkeeping_fraction
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
from collections import defaultdict
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

import torch  # noqa: E402
from datasets import Dataset  # noqa: E402
from transformers import TrainerCallback  # noqa: E402

from hdreplay.integrations.trl import HDRGRPOConfig, HDRGRPOTrainer  # noqa: E402
from hdreplay.store.padding import pad_groups  # noqa: E402
from hdreplay_lab.sandbox.model import build_tiny_model, load_model  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"


class Clock:
    def __init__(self):
        self.t = defaultdict(float)
        self.depth = 0


class TimedTrainer(HDRGRPOTrainer):
    """Times the phases of each optimizer step by wrapping the trainer's own methods."""

    def __init__(self, *a, **k):
        super().__init__(*a, **k)
        self.clock = Clock()
        self.steps: list[dict] = []

    def _timed(self, name, fn, *a, **k):
        t0 = time.perf_counter()
        try:
            return fn(*a, **k)
        finally:
            self.clock.t[name] += time.perf_counter() - t0

    rollout_s_per_token = 0.0

    def _generate(self, prompts):
        def gen():
            out = super(TimedTrainer, self)._generate(prompts)
            if self.rollout_s_per_token:  # modelled throughput-bound rollout cost (see module docstring)
                time.sleep(self.rollout_s_per_token * sum(len(c) for c in out[1]))
            return out
        return self._timed("generation", gen)

    def _calculate_rewards(self, *a, **k):
        return self._timed("rewards", super()._calculate_rewards, *a, **k)

    def _replay_scorer(self, groups):
        return self._timed("rescoring", super()._replay_scorer, groups)

    def _select(self, step):
        return self._timed("with_replay", super()._select, step)

    def _commit_step(self):
        return self._timed("commit", super()._commit_step)

    def _prepare_inputs(self, batch):
        return self._timed("prepare", super()._prepare_inputs, batch)

    def _generate_and_score_completions(self, inputs):
        return self._timed("gen_and_score", super()._generate_and_score_completions, inputs)

    def training_step(self, *a, **k):
        return self._timed("training_step", super().training_step, *a, **k)


class StepClock(TrainerCallback):
    def __init__(self, trainer):
        self.tr = trainer

    def on_step_begin(self, args, state, control, **kw):
        self.tr.clock = Clock()
        self.t0 = time.perf_counter()

    def on_step_end(self, args, state, control, **kw):
        c = self.tr.clock.t
        total = time.perf_counter() - self.t0
        rep_inner = c["with_replay"] - c["rescoring"]
        self.tr.steps.append({
            "step": total, "generation": c["generation"], "rescoring": c["rescoring"],
            # replay bookkeeping: replay code outside model forward/backward
            "bookkeeping": rep_inner + c["commit"] + max(0.0, c["prepare"] - c["gen_and_score"]),
            "train": c["training_step"] - c["prepare"],
            "scanned": getattr(self.tr.replay.last_record, "scanned", 0) if self.tr.replay_active else 0,
            "accepted": getattr(self.tr.replay.last_record, "accepted", 0) if self.tr.replay_active else 0,
            **({k: getattr(self.tr.replay.last_record, k, 0) for k in (
                "rescored_rows", "rescored_tokens", "replayed_rows", "replayed_tokens", "scored_unused", "scan_drift")}
               if self.tr.replay_active and self.tr.replay.last_record is not None else {}),
        })


def reward_digits(completions, **kw):
    return [float(sum(ch.isdigit() for ch in c) > len(c) / 4) for c in completions]


def make(name, *, model_dir, b, n, r, selector, min_new, max_new, seed, steps, rollout_ms, tau=1e9, passes=None):
    model, tok = load_model(model_dir)
    prompts = [f"{i}+{j}=" for i in range(200) for j in range(7)]
    ds = Dataset.from_dict({"prompt": prompts})
    args = HDRGRPOConfig(
        output_dir=tempfile.mkdtemp(prefix=f"bench-{name}-"), use_cpu=True, bf16=False, report_to="none",
        activation_checkpointing=False, logging_steps=10**6, save_strategy="no", max_steps=steps,
        per_device_train_batch_size=b * n, num_generations=n, max_completion_length=max_new,
        generation_kwargs={"min_new_tokens": min_new}, learning_rate=1e-5, lr_scheduler_type="constant",
        loss_type="grpo", seed=seed, disable_tqdm=True, disable_dropout=True,
        replay_selector=selector, replay_k_rep=r, replay_tau=tau, replay_capacity=512, replay_diagnostics_dir="",
        replay_score_batch_size=4096, **({} if passes is None else {"replay_scan_passes": passes}),
    )
    tr = TimedTrainer(model=model, reward_funcs=reward_digits, args=args, train_dataset=ds, processing_class=tok)
    tr.rollout_s_per_token = rollout_ms / 1000.0
    tr.add_callback(StepClock(tr))
    return tr


def ideal_forward(tr, groups, repeats):
    """One batched no-grad forward over the rows of ``groups`` (median seconds)."""
    pg = pad_groups(groups, pad_token_id=tr._tokenizer.pad_token_id)
    ids = torch.cat([pg.prompt_ids, pg.completion_ids], 1)
    mask = torch.cat([pg.prompt_mask, pg.completion_mask], 1)
    ts = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        tr._logps(ids, mask, pg.completion_ids.shape[1])
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts)


def _gather_worker(rank: int, port: int, calls: int, out) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    x, got = torch.tensor([rank], dtype=torch.int64), [torch.zeros(1, dtype=torch.int64) for _ in range(2)]
    for _ in range(100):
        dist.all_gather(got, x)
    times = []
    for _ in range(calls):
        t0 = time.perf_counter()
        dist.all_gather(got, x)
        times.append(time.perf_counter() - t0)
    if rank == 0:
        out.put(statistics.median(times))
    dist.barrier()
    dist.destroy_process_group()


def rank_agreement_cost(step_s: float, bookkeeping_fraction: float, calls: int = 2000) -> dict:
    """The rank-agreement check per update: the digest (here) and the 2-process all-gather (gloo), vs the HDR step."""
    import socket

    import numpy as np
    import torch.multiprocessing as mp

    from hdreplay.integrations.trl.agreement import selection_digest
    from hdreplay.selection import empty_selection
    from hdreplay_lab.synthetic import TablePolicy, make_group

    groups = [make_group(f"s9.0g{i}", policy=TablePolicy(), step=9, n=8, seed=i) for i in range(64)]
    from dataclasses import replace
    sel = replace(empty_selection(10, "headroom_drift", 512, 1e-3), groups=groups,
                  accepted=np.arange(64, dtype=np.int64))

    class Ctl:
        class buffer:
            next_insertion_id = 4096
    times = []
    for _ in range(calls):
        t0 = time.perf_counter()
        selection_digest(10, sel, Ctl)
        times.append(time.perf_counter() - t0)
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=_gather_worker, args=(r, port, calls, q)) for r in range(2)]
    for p in procs:
        p.start()
    gather_s = q.get(timeout=300)
    for p in procs:
        p.join(timeout=60)
    digest_s = statistics.median(times)
    frac = (digest_s + gather_s) / step_s
    return {"digest_us": digest_s * 1e6, "all_gather_2proc_gloo_us": gather_s * 1e6, "hdr_step_s": step_s,
            "fraction_of_hdr_step": frac, "bookkeeping_fraction": bookkeeping_fraction,
            "bookkeeping_fraction_with_check": bookkeeping_fraction + gather_s / step_s,
            "note": "digest of 64 replayed groups + one all_gather of one int64 per rank (torch.distributed, gloo, "
                    "2 processes on this machine); step and bookkeeping fraction: this file's hdr_b_r"}


def gate_pair(args, b, n, r, rounds, per_round) -> None:
    """``--gate``: the full scan against exact early rejection (``replay_scan_passes`` 1 vs the default), the same
    workload at a tau that rejects: the first round runs both at tau = 1e9 and the scanned groups' Drift sets tau
    to its ``--gate-quantile`` quantile.  Writes trl_step_gate.json: per configuration the median step and
    re-scoring seconds, rows / tokens re-scored per admitted row / token, scanned groups per step."""
    t_start = time.perf_counter()
    model_dir = Path(tempfile.mkdtemp(prefix="bench-model-")) / "m"
    build_tiny_model(model_dir, hidden=128, layers=4, max_positions=512)
    common = dict(model_dir=model_dir, n=n, min_new=args.min_new, max_new=args.max_new, seed=0, steps=per_round,
                  rollout_ms=args.rollout_ms_per_token, b=b, r=r, selector="headroom_drift")
    probe = make("probe", **common)
    for _ in range(2):
        probe.train()
    drifts = sorted(d for st in probe.steps for d in st.get("scan_drift", []) if d is not None)
    tau = float(drifts[int(args.gate_quantile * (len(drifts) - 1))])
    trainers = {name: make(name, tau=tau, passes=p, **common) for name, p in (("hdr_full", 1), ("hdr_sliced", None))}
    for rnd in range(rounds):
        for tr in trainers.values():
            before = len(tr.steps)
            tr.train()
            if rnd == 0:
                tr.steps.clear()
            else:
                del tr.steps[before]
        print(f"round {rnd + 1}/{rounds} done ({time.perf_counter() - t_start:.0f} s)", flush=True)
    res = {}
    for name, tr in trainers.items():
        st = tr.steps
        tot = {k: sum(s[k] for s in st) for k in ("rescored_rows", "rescored_tokens", "replayed_rows",
                                                  "replayed_tokens", "scanned", "accepted", "scored_unused")}
        res[name] = {"step_s": statistics.median(s["step"] for s in st),
                     "rescoring_s": statistics.median(s["rescoring"] for s in st),
                     "rescoring_s_total": sum(s["rescoring"] for s in st),
                     "rows_per_admitted_row": tot["rescored_rows"] / max(tot["replayed_rows"], 1),
                     "tokens_per_admitted_token": tot["rescored_tokens"] / max(tot["replayed_tokens"], 1),
                     "groups_touched_per_admitted": (tot["scanned"] + tot["scored_unused"]) / max(tot["accepted"], 1),
                     "scanned_per_step": tot["scanned"] / len(st), "budget_fill": tot["accepted"] / (r * len(st)),
                     "timed_steps": len(st), "totals": tot}
    result = {"tau": tau, "tau_quantile": args.gate_quantile, "configs": res,
              "rescoring_ratio": res["hdr_sliced"]["rescoring_s_total"] / max(res["hdr_full"]["rescoring_s_total"],
                                                                           1e-12),
              "workload": {"b": b, "r": r, "n": n, "min_new_tokens": args.min_new, "max_new_tokens": args.max_new,
                           "rounds": rounds, "steps_per_round": per_round, "lr": 1e-5,
                           "rollout_ms_per_token": args.rollout_ms_per_token},
              "torch": torch.__version__, "threads": torch.get_num_threads(), "loadavg_end": list(os.getloadavg()),
              "wall_s": time.perf_counter() - t_start}
    out = Path(args.out if args.out != str(RESULTS / "trl_step.json") else RESULTS / "trl_step_gate.json")
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--gate", action="store_true", help="the full scan against exact early rejection at a tau that "
                                                        "rejects (writes trl_step_gate.json; see gate_pair)")
    ap.add_argument("--gate-quantile", type=float, default=0.35,
                    help="--gate: tau = this quantile of the probe's scanned Drift (about the acceptance rate)")
    ap.add_argument("--prompts", type=int, default=8, help="b: fresh groups per step")
    ap.add_argument("--generations", type=int, default=8)
    ap.add_argument("--min-new", type=int, default=96)
    ap.add_argument("--max-new", type=int, default=96)
    ap.add_argument("--rollout-ms-per-token", type=float, default=0.1,
                    help="modelled rollout cost per generated token (0 = the tiny model's own decoding only)")
    ap.add_argument("--rounds", type=int, default=None)
    ap.add_argument("--steps-per-round", type=int, default=None)
    ap.add_argument("--out", default=str(RESULTS / "trl_step.json"))
    ap.add_argument("--only", choices=("rank_agreement",), default=None,
                    help="measure one section and update its entry in an existing --out file")
    args = ap.parse_args()
    if args.only == "rank_agreement":
        out = Path(args.out)
        result = json.loads(out.read_text())
        result["rank_agreement"] = rank_agreement_cost(result["step_s"]["hdr_b_r"], result["bookkeeping_fraction"])
        out.write_text(json.dumps(result, indent=2) + "\n")
        print(json.dumps(result["rank_agreement"], indent=2))
        return
    rounds = args.rounds or (3 if args.quick else 6)
    per_round = args.steps_per_round or (3 if args.quick else 5)
    b, n = args.prompts, args.generations
    if b % 2:
        raise SystemExit("--prompts must be even (r = b/2, 1.5b)")
    r = b // 2
    if args.gate:
        return gate_pair(args, b, n, r, rounds, per_round)
    t_start = time.perf_counter()
    model_dir = Path(tempfile.mkdtemp(prefix="bench-model-")) / "m"
    build_tiny_model(model_dir, hidden=128, layers=4, max_positions=512)
    configs = {
        "onpolicy_b": dict(b=b, r=0, selector="none"),
        "onpolicy_1.5b": dict(b=b + r, r=0, selector="none"),
        "recency_b_r": dict(b=b, r=r, selector="recency"),
        "hdr_b_r": dict(b=b, r=r, selector="headroom_drift"),
    }
    trainers = {k: make(k, model_dir=model_dir, n=n, min_new=args.min_new, max_new=args.max_new, seed=0,
                        steps=per_round, rollout_ms=args.rollout_ms_per_token, **v) for k, v in configs.items()}
    ideal = []
    for rnd in range(rounds):
        for name, tr in trainers.items():
            tr.steps.clear() if rnd == 0 else None
            before = len(tr.steps)
            tr.train()
            if rnd == 0:  # warm-up round: fills the buffers
                tr.steps.clear()
            else:  # the first step of each train() call carries optimizer set-up
                del tr.steps[before]
        if rnd > 0:
            hdr = trainers["hdr_b_r"]
            ids = hdr.replay.buffer.insertion_ids()
            scanned = max(1, round(statistics.mean(s["scanned"] for s in hdr.steps)))
            ideal.append(ideal_forward(hdr, hdr.replay.buffer.get(ids[-scanned:].tolist()), 5))
        print(f"round {rnd + 1}/{rounds} done ({time.perf_counter() - t_start:.0f} s)", flush=True)

    med = {k: {f: statistics.median(s[f] for s in tr.steps) for f in ("step", "generation", "rescoring",
                                                                       "bookkeeping", "train")}
           for k, tr in trainers.items()}
    hdr_steps = trainers["hdr_b_r"].steps
    t_ideal = statistics.median(ideal)
    result = {
        "step_s": {k: v["step"] for k, v in med.items()},
        "phases_s": med,
        "generation_fraction": med["onpolicy_b"]["generation"] / med["onpolicy_b"]["step"],
        "scanned_per_step": statistics.mean(s["scanned"] for s in hdr_steps),
        "budget_fill": statistics.mean(s["accepted"] for s in hdr_steps) / r,
        "hdr_over_recency": med["hdr_b_r"]["step"] / med["recency_b_r"]["step"],
        "hdr_over_recency_paper": 166.3 / 154.4,
        "hdr_over_onpolicy_larger": med["hdr_b_r"]["step"] / med["onpolicy_1.5b"]["step"],
        "hdr_over_onpolicy_larger_paper": 166.3 / 197.2,
        "ideal_forward_s": t_ideal,
        "rescoring_vs_ideal": (statistics.median(s["step"] - s["generation"] for s in hdr_steps)
                               - statistics.median(s["step"] - s["generation"]
                                                   for s in trainers["recency_b_r"].steps)) / t_ideal,
        "rescoring_vs_ideal_raw": (med["hdr_b_r"]["step"] - med["recency_b_r"]["step"]) / t_ideal,
        "rescoring_forward_vs_ideal": med["hdr_b_r"]["rescoring"] / t_ideal,
        "gate_cost_vs_ideal": (med["hdr_b_r"]["rescoring"] + med["hdr_b_r"]["bookkeeping"]
                               - med["recency_b_r"]["bookkeeping"]) / t_ideal,
        "bookkeeping_fraction": statistics.median(s["bookkeeping"] / s["step"] for s in hdr_steps),
        "targets": {"hdr_over_onpolicy_larger": "< 1.0", "rescoring_vs_ideal": "<= 1.25",
                    "bookkeeping_fraction": "<= 0.02", "generation_fraction": ">= 0.5"},
        "workload": {"b": b, "r": r, "n": n, "min_new_tokens": args.min_new, "max_new_tokens": args.max_new,
                     "model": "Qwen2 hidden 128, 4 layers (random init)", "tau": "1e9 (budget fills)",
                     "rollout_ms_per_token": args.rollout_ms_per_token,
                     "rounds": rounds, "steps_per_round": per_round, "timed_steps_per_config": len(hdr_steps)},
        "quick": args.quick,
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "machine": platform.machine(),
        "wall_s": time.perf_counter() - t_start,
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    keys = ("step_s", "generation_fraction", "scanned_per_step", "budget_fill", "hdr_over_recency",
            "hdr_over_onpolicy_larger", "rescoring_vs_ideal", "bookkeeping_fraction")
    print(json.dumps({k: result[k] for k in keys}, indent=2))
    print(f"wrote {out} in {result['wall_s']:.0f} s")


if __name__ == "__main__":
    main()
