"""The gate's cost model: one scan of a full buffer, per K_rep and acceptance rate, against a fresh forward.

    python benchmarks/gpu_gate.py            # a ~0.5B Qwen2-shaped random-init model in bf16 on CUDA (~3 min)
    python benchmarks/gpu_gate.py --tiny     # the CPU proxy: the same sweep on a tiny model (what CI can hold)

Needs only torch, transformers and hdreplay's core.  A buffer of C groups (prompt P tokens, n responses of L tokens,
random tokens) is stored with log-probs = the model's own + Gaussian noise whose scale sets each group's Drift: a
share ``accept`` of the groups (drawn at random, so unrelated to the Headroom order) at 0.3 tau, the rest spread
log-uniformly over [2, 50] tau.  At unchanged weights the buffer then selects K_rep groups with each scan:

* ``paper``   -- ``ReplayConfig.paper()``: every scanned group forwarded whole;
* ``sliced``  -- exact early rejection as before issue 37 (4 slices per group, windows sized by the groups needed);
* ``default`` -- the default with the scorer's token budget (``scan_tokens`` = rows_per_forward x (P + L)): windows
  filled to whole forwards, further groups scored speculatively in the room left, groups sliced only where the
  running acceptance rate says that saves a forward.

The scorer is a plain teacher-forced forward with a full-vocabulary fp32 log-softmax, ``rows_per_forward`` rows per
forward; the fresh batch's forward (the trainer's old-log-prob forward: ``fresh_rows`` rows through the same
function) is timed beside it.  Per scan: rows and tokens forwarded (and against the paper scan's), scorer calls and
rows per call, seconds (median over repeats, alternating scans; a costly scan runs fewer times: ``--budget-s``), the
gate's tokens/s against the fresh forward's, seconds per *needed* token (tokens of the groups it scanned --
speculative extras count as cost, not as tokens) over the fresh forward's, and the bf16 bound 2 x params x tokens /
peak, and the oracle bound (the fewest tokens any exact early rejection forwards: each rejected group up to the
shortest prefix of its responses that proves Drift > tau).  Decisions are checked identical across the scans.  Writes
benchmarks/results/gpu_gate_sweep[_tiny].json and .md (the pre-issue-37 benchmark's results are gpu_gate*.json).
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import time
from pathlib import Path

import torch

from hdreplay import GroupRecord, ReplayConfig, ReplayController, select_replay

RESULTS = Path(__file__).resolve().parent / "results"
PEAK_BF16 = 790e12  # FLOP/s: the H200's measured bf16 matrix rate (docs: device KINDS)
SCANS = ("paper", "sliced", "default")


def build(tiny: bool, device: str, dtype):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    if tiny:
        cfg = Qwen2Config(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024)
    else:  # Qwen2.5-0.5B's shape
        cfg = Qwen2Config(vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                          num_attention_heads=14, num_key_value_heads=2, max_position_embeddings=4096,
                          tie_word_embeddings=True)
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(cfg).to(device=device, dtype=dtype).eval()
    return model, cfg.vocab_size, sum(p.numel() for p in model.parameters())


@torch.no_grad()
def logps(model, prompts: torch.Tensor, completions: torch.Tensor, rows: int, device: str) -> torch.Tensor:
    """(R, L) log-probs of ``completions`` (R, L) after ``prompts`` (R, P), ``rows`` rows per forward, one host
    transfer at the end (every prompt has P tokens and every response L here, so no padding)."""
    out, P = [], prompts.shape[1]
    for i in range(0, completions.shape[0], rows):
        c = completions[i:i + rows].to(device)
        ids = torch.cat([prompts[i:i + rows].to(device), c], dim=1)
        logits = model(input_ids=ids).logits[:, P - 1:-1].float()
        out.append(torch.log_softmax(logits, -1).gather(-1, c.unsqueeze(-1)).squeeze(-1))
    return torch.cat(out).cpu()


def make_groups(model, vocab, a, device) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """C groups of random tokens: (prompt (P,), completions (n, L), the model's own log-probs (n, L))."""
    g = torch.Generator().manual_seed(1)
    out = []
    for _ in range(a.capacity):
        prompt = torch.randint(0, vocab, (a.prompt,), generator=g)
        comps = torch.randint(0, vocab, (a.n, a.completion), generator=g)
        out.append((prompt, comps, logps(model, prompt.expand(a.n, -1), comps, a.rows_per_forward, device)))
    return out


def make_buffer(groups, a, accept: float) -> ReplayController:
    """The groups stored with log-probs = the model's own + noise: ``accept`` of them (at random) at Drift ~0.3 tau,
    the rest log-uniform in [2, 50] tau."""
    g = torch.Generator().manual_seed(round(accept * 1e6))
    passing = set(torch.randperm(len(groups), generator=g)[:round(accept * len(groups))].tolist())
    records = []
    for i, (prompt, comps, birth) in enumerate(groups):
        drift = 0.3 if i in passing else math.exp(
            torch.empty(1).uniform_(math.log(2), math.log(50), generator=g).item())
        stored = (birth + math.sqrt(drift * a.tau) * torch.randn(birth.shape, generator=g)).clamp(max=0.0)
        adv = [1.0 if j % 2 == 0 else -1.0 for j in range(a.n)]
        records.append(GroupRecord.from_responses(group_id=f"g{i}", prompt_ids=prompt, completion_ids=list(comps),
                                                  logprobs=list(stored), advantages=adv,
                                                  rewards=[1.0 if x > 0 else 0.0 for x in adv], birth_step=0))
    ctrl = ReplayController(ReplayConfig(k_rep=1, tau=a.tau, capacity=a.capacity))
    ctrl.stage(records, step=0)
    ctrl.commit()
    return ctrl


def oracle_tokens(sel, current: dict, tau: float) -> int:
    """The fewest tokens any exact early rejection forwards for this scan: each passing group whole, each rejected one
    up to the shortest prefix of its responses whose Drift terms already prove Drift > tau (an oracle that knows the
    current log-probs in advance; prompts counted per row, as the scorer forwards them)."""
    from hdreplay.rescore import sub_group
    from hdreplay.scores import drift_rejects, drift_term_sums

    total = 0
    for g, ok in zip(sel.scan, sel.scanned_pass.tolist()):
        grp, P, lens = g.group, g.group.prompt_ids.numel(), g.group.response_lengths.tolist()
        k = len(lens)
        if not ok:
            lp, acc, starts = current[grp.group_id], 0.0, [0]
            for L in lens:
                starts.append(starts[-1] + L)
            for k in range(1, len(lens) + 1):
                acc += drift_term_sums([sub_group(grp, [k - 1])], [lp[starts[k - 1]:starts[k]]], drift_norm="l2")[0]
                if k < len(lens) and drift_rejects(acc, grp.num_loss_tokens, g.tau):
                    break
        total += sum(P + L for L in lens[:k])
    return total


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tiny", action="store_true", help="the CPU proxy: a tiny model, prompt 16, completion 24")
    ap.add_argument("--capacity", type=int, default=512)
    ap.add_argument("--n", type=int, default=8)
    ap.add_argument("--prompt", type=int, default=256)
    ap.add_argument("--completion", type=int, default=512)
    ap.add_argument("--k-reps", default="2,8,64")
    ap.add_argument("--accepts", default="0.01,0.05,0.5")
    ap.add_argument("--tau", type=float, default=1e-3)
    ap.add_argument("--rows-per-forward", type=int, default=16)
    ap.add_argument("--fresh-rows", type=int, default=64, help="rows of the fresh batch's forward")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--budget-s", type=float, default=8.0, help="repeat a scan while its runs took less than this")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    if a.tiny:
        a.prompt, a.completion = min(a.prompt, 16), min(a.completion, 24)
    device = "cuda" if torch.cuda.is_available() and not a.tiny else "cpu"
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    t_all = time.perf_counter()
    model, vocab, params = build(a.tiny, device, dtype)
    row_tokens = a.prompt + a.completion
    budget = a.rows_per_forward * row_tokens

    # the fresh batch's forward: the trainer's old-log-prob forward over fresh_rows rows, same function and batching
    g = torch.Generator().manual_seed(2)
    fp, fc = torch.randint(0, vocab, (a.fresh_rows, a.prompt), generator=g), \
        torch.randint(0, vocab, (a.fresh_rows, a.completion), generator=g)
    logps(model, fp, fc, a.rows_per_forward, device)  # warm-up
    fresh = []
    for _ in range(max(a.repeats, 3)):
        sync()
        t = time.perf_counter()
        logps(model, fp, fc, a.rows_per_forward, device)
        sync()
        fresh.append(time.perf_counter() - t)
    fresh_s = statistics.median(fresh)
    fresh_tokens = a.fresh_rows * row_tokens
    fresh_tps = fresh_tokens / fresh_s
    print(f"[gpu_gate] fresh forward: {a.fresh_rows} rows in {fresh_s:.3f} s ({fresh_tps:,.0f} tokens/s)", flush=True)

    calls = {"n": 0, "rows": [], "keep": None}

    def scorer(gs):  # all the groups' rows (slices included) through one logps call
        comps = [torch.stack(list(grp.split(grp.completion_ids))) for grp in gs]  # (n_g, L) each
        prompts = torch.cat([grp.prompt_ids.expand(c.shape[0], -1) for grp, c in zip(gs, comps)])
        flat = logps(model, prompts, torch.cat(comps), a.rows_per_forward, device)
        calls["n"] += 1
        calls["rows"].append(flat.shape[0])
        out = [x.reshape(-1) for x in flat.split([c.shape[0] for c in comps])]
        if calls["keep"] is not None:  # the paper scan's whole groups, for the oracle bound
            calls["keep"].update({grp.group_id: lp for grp, lp in zip(gs, out)})
        return out

    configs = {"paper": lambda k: ReplayConfig.paper(k_rep=k, tau=a.tau, capacity=a.capacity),
               "sliced": lambda k: ReplayConfig(k_rep=k, tau=a.tau, capacity=a.capacity),
               "default": lambda k: ReplayConfig(k_rep=k, tau=a.tau, capacity=a.capacity, scan_tokens=budget)}
    cells, stored = [], make_groups(model, vocab, a, device)
    print(f"[gpu_gate] {a.capacity} groups scored at {time.perf_counter() - t_all:.0f} s", flush=True)
    stem = a.out or str(RESULTS / ("gpu_gate_sweep_tiny" if a.tiny else "gpu_gate_sweep"))
    Path(stem).parent.mkdir(parents=True, exist_ok=True)
    for accept in [float(x) for x in a.accepts.split(",")]:
        ctrl = make_buffer(stored, a, accept)
        print(f"[gpu_gate] buffer of {a.capacity} groups at {accept:.0%} passing built at "
              f"{time.perf_counter() - t_all:.0f} s", flush=True)
        for k in [int(x) for x in a.k_reps.split(",")]:
            cell = {"k_rep": k, "accept": accept, "scans": {}}
            decisions = {}
            order = list(SCANS)
            for rep in range(a.repeats):
                spent = {}
                for name in order:
                    r = cell["scans"].setdefault(name, {"seconds": []})
                    if rep and sum(r["seconds"]) >= a.budget_s:
                        continue
                    calls.update(n=0, rows=[], keep={} if name == "paper" and rep == 0 else None)
                    sync()
                    t = time.perf_counter()
                    sel = select_replay(ctrl.buffer, configs[name](k), scorer, step=1, acceptance_rate=accept)
                    sync()
                    r["seconds"].append(time.perf_counter() - t)
                    c = sel.cost
                    r.update(scanned=len(sel.scanned), accepted=len(sel.accepted),
                             early_rejected=int((~sel.scanned_exact).sum()), scorer_calls=calls["n"],
                             rows=sum(calls["rows"]), rows_per_call=statistics.mean(calls["rows"]),
                             forward_tokens=c.forward_tokens, needed_tokens=c.forward_tokens - c.unused_forward_tokens,
                             unused_groups=c.unused, sliced=c.sliced)
                    decisions[name] = (sel.accepted.tolist(), sel.scanned.tolist(), sel.scanned_pass.tolist())
                    if calls["keep"] is not None:
                        cell["oracle_tokens"] = oracle_tokens(sel, calls["keep"], a.tau)
                    spent[name] = r["seconds"][-1]
                order.reverse()  # alternate which scan runs first
            paper = cell["scans"]["paper"]
            for name, r in cell["scans"].items():
                r["median_s"] = statistics.median(r["seconds"])
                r["time_vs_paper"] = r["median_s"] / paper["median_s"]
                r["tokens_vs_paper"] = r["forward_tokens"] / paper["forward_tokens"]
                r["tokens_per_s"] = r["forward_tokens"] / r["median_s"]
                r["tokens_per_s_vs_fresh"] = r["tokens_per_s"] / fresh_tps
                r["s_per_needed_token_vs_fresh"] = (r["median_s"] / r["needed_tokens"]) / (fresh_s / fresh_tokens)
                r["x_fresh_forward"] = r["median_s"] / fresh_s
                r["bf16_bound_s"] = 2 * params * r["forward_tokens"] / PEAK_BF16
                r["tokens_vs_oracle"] = r["forward_tokens"] / cell["oracle_tokens"]
            cell["identical_decisions"] = len({json.dumps(d) for d in decisions.values()}) == 1
            cells.append(cell)
            Path(f"{stem}.partial.json").write_text(json.dumps(cells, indent=1) + "\n")
            d = cell["scans"]["default"]
            print(f"[gpu_gate] K_rep {k:3d} at {accept:4.0%}: paper {paper['median_s']:.3f} s, default "
                  f"{d['median_s']:.3f} s ({d['time_vs_paper']:.2f}x), identical {cell['identical_decisions']}",
                  flush=True)
    out = {"device": torch.cuda.get_device_name(0) if device == "cuda" else "cpu", "dtype": str(dtype),
           "params": params, "torch": torch.__version__,
           "workload": {k: getattr(a, k) for k in ("capacity", "n", "prompt", "completion", "tau", "rows_per_forward",
                                                   "fresh_rows", "repeats", "budget_s", "tiny")},
           "scan_tokens": budget, "fresh_forward": {"rows": a.fresh_rows, "tokens": fresh_tokens, "seconds": fresh,
                                                     "median_s": fresh_s, "tokens_per_s": fresh_tps},
           "cells": cells, "all_identical": all(c["identical_decisions"] for c in cells),
           "wall_s": time.perf_counter() - t_all}
    Path(f"{stem}.json").write_text(json.dumps(out, indent=1) + "\n")
    Path(f"{stem}.partial.json").unlink(missing_ok=True)
    Path(f"{stem}.md").write_text(markdown(out))
    print(markdown(out))


def markdown(res: dict) -> str:
    w = res["workload"]
    lines = [f"# The gate's cost on {res['device']} ({res['dtype']}, {res['params'] / 1e6:.1f}M parameters)", "",
             f"C {w['capacity']}, n {w['n']}, prompt {w['prompt']}, completion {w['completion']}, tau {w['tau']:g}; "
             f"scorer: {w['rows_per_forward']} rows per forward (scan_tokens {res['scan_tokens']}); fresh forward "
             f"{res['fresh_forward']['rows']} rows in {res['fresh_forward']['median_s']:.3f} s "
             f"({res['fresh_forward']['tokens_per_s']:,.0f} tokens/s). Decisions identical in every cell: "
             f"{res['all_identical']}. Command: `python benchmarks/gpu_gate.py{' --tiny' if w['tiny'] else ''}`.", "",
             "| K_rep | passing | scan | scanned | rows | rows/call | tokens vs paper | tokens vs oracle | seconds | "
             "vs paper | x fresh forward | tokens/s vs fresh | s/needed token vs fresh | bf16 bound s |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for c in res["cells"]:
        for name in SCANS:
            r = c["scans"][name]
            lines.append(f"| {c['k_rep']} | {c['accept']:.0%} | {name} | {r['scanned']} | {r['rows']} | "
                         f"{r['rows_per_call']:.0f} | {r['tokens_vs_paper']:.2f} | {r['tokens_vs_oracle']:.2f} | "
                         f"{r['median_s']:.3f} | "
                         f"{r['time_vs_paper']:.2f} | {r['x_fresh_forward']:.1f} | {r['tokens_per_s_vs_fresh']:.2f} | "
                         f"{r['s_per_needed_token_vs_fresh']:.2f} | {r['bf16_bound_s']:.3f} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
