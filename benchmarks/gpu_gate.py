"""The Drift gate's scan on one GPU: the full scan (``scan_passes=1``) against exact early rejection (the default 4).

    python benchmarks/gpu_gate.py                 # a ~0.5B Qwen2-shaped random-init model in bf16 on CUDA
    python benchmarks/gpu_gate.py --tiny          # the same on CPU with a tiny model (a smoke run)

Needs only torch, transformers and hdreplay's core.  G groups (prompt P tokens, n responses of L tokens, random
tokens) are stored with log-probs = the model's own + Gaussian noise of a per-group scale, so their Drift spreads
around tau (about half pass); the buffer then selects K_rep groups at unchanged weights with each scan, re-scoring
through a plain teacher-forced forward (``rows_per_forward`` rows per call).  Timed with CUDA synchronisation,
``--repeats`` times each, alternating.  Writes benchmarks/results/gpu_gate.json: per scan the median seconds, rows
and tokens forwarded, scorer calls, and whether the decisions are identical.
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
    return Qwen2ForCausalLM(cfg).to(device=device, dtype=dtype).eval(), cfg.vocab_size


@torch.no_grad()
def logps(model, prompts: torch.Tensor, completions: torch.Tensor, rows_per_forward: int, device: str) -> torch.Tensor:
    """(R, L) log-probs of ``completions`` (R, L) after their ``prompts`` (R, P), ``rows_per_forward`` rows per call
    (rows of several groups share a call: every prompt has P tokens and every response L here)."""
    out = []
    P = prompts.shape[1]
    for i in range(0, completions.shape[0], rows_per_forward):
        c = completions[i:i + rows_per_forward].to(device)
        ids = torch.cat([prompts[i:i + rows_per_forward].to(device), c], dim=1)
        logits = model(input_ids=ids).logits[:, P - 1:-1].float()
        out.append(torch.log_softmax(logits, -1).gather(-1, c.unsqueeze(-1)).squeeze(-1).cpu())
    return torch.cat(out)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tiny", action="store_true")
    ap.add_argument("--groups", type=int, default=32)
    ap.add_argument("--n", type=int, default=8)
    ap.add_argument("--prompt", type=int, default=256)
    ap.add_argument("--completion", type=int, default=512)
    ap.add_argument("--k-rep", type=int, default=8)
    ap.add_argument("--tau", type=float, default=1e-3)
    ap.add_argument("--rows-per-forward", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default=str(RESULTS / "gpu_gate.json"))
    a = ap.parse_args()
    if a.tiny:
        a.groups, a.prompt, a.completion = min(a.groups, 12), min(a.prompt, 16), min(a.completion, 24)
    device = "cuda" if torch.cuda.is_available() and not a.tiny else "cpu"
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    t0 = time.perf_counter()
    model, vocab = build(a.tiny, device, dtype)
    g = torch.Generator().manual_seed(1)
    groups = []
    for i in range(a.groups):
        prompt = torch.randint(0, vocab, (a.prompt,), generator=g)
        comps = torch.randint(0, vocab, (a.n, a.completion), generator=g)
        birth = logps(model, prompt.expand(a.n, -1), comps, a.rows_per_forward, device)
        sigma = math.sqrt(a.tau) * math.exp(torch.empty(1).uniform_(math.log(0.3), math.log(3.0), generator=g).item())
        stored = birth + sigma * torch.randn(birth.shape, generator=g)
        adv = [1.0 if j % 2 == 0 else -1.0 for j in range(a.n)]
        groups.append(GroupRecord.from_responses(group_id=f"g{i}", prompt_ids=prompt, completion_ids=list(comps),
                                                 logprobs=list(stored), advantages=adv,
                                                 rewards=[1.0 if x > 0 else 0.0 for x in adv], birth_step=0))
    built_s = time.perf_counter() - t0
    cfg = ReplayConfig(k_rep=a.k_rep, tau=a.tau, capacity=max(64, a.groups), scan_passes=1)
    ctrl = ReplayController(cfg)
    ctrl.stage(groups, step=0)
    ctrl.commit()
    calls = {"n": 0, "rows": 0, "tokens": 0}

    def scorer(gs):  # one batch of all the groups' rows (slices included), rows_per_forward rows per call
        calls["n"] += 1
        comps = [torch.stack(list(grp.split(grp.completion_ids))) for grp in gs]  # (n_g, L) each
        prompts = torch.cat([grp.prompt_ids.expand(c.shape[0], -1) for grp, c in zip(gs, comps)])
        flat = logps(model, prompts, torch.cat(comps), a.rows_per_forward, device)
        calls["rows"] += flat.shape[0]
        calls["tokens"] += flat.numel()
        return [x.reshape(-1) for x in flat.split([c.shape[0] for c in comps])]

    res = {}
    sels = {}
    for rep in range(a.repeats):
        for name, passes in (("full", 1), ("sliced", 4)) if rep % 2 == 0 else (("sliced", 4), ("full", 1)):
            calls.update(n=0, rows=0, tokens=0)
            if device == "cuda":
                torch.cuda.synchronize()
            t = time.perf_counter()
            sel = select_replay(ctrl.buffer, ReplayConfig(k_rep=a.k_rep, tau=a.tau, capacity=max(64, a.groups),
                                                          scan_passes=passes), scorer, step=1)
            if device == "cuda":
                torch.cuda.synchronize()
            dt = time.perf_counter() - t
            r = res.setdefault(name, {"seconds": []})
            r["seconds"].append(dt)
            r.update(rows=calls["rows"], tokens=calls["tokens"], scorer_calls=calls["n"],
                     scanned=int(len(sel.scanned)), accepted=int(len(sel.accepted)),
                     early_rejected=int((~sel.scanned_exact).sum()))
            sels[name] = (sel.accepted.tolist(), sel.scanned.tolist(), sel.scanned_pass.tolist())
    for r in res.values():
        r["median_s"] = statistics.median(r["seconds"])
    out = {"device": torch.cuda.get_device_name(0) if device == "cuda" else "cpu", "dtype": str(dtype),
           "workload": {k: getattr(a, k) for k in ("groups", "n", "prompt", "completion", "k_rep", "tau",
                                                   "rows_per_forward", "repeats", "tiny")},
           "scans": res, "identical_decisions": sels["full"] == sels["sliced"],
           "time_ratio": res["sliced"]["median_s"] / res["full"]["median_s"],
           "rows_ratio": res["sliced"]["rows"] / max(res["full"]["rows"], 1),
           "build_s": built_s, "torch": torch.__version__, "wall_s": time.perf_counter() - t0}
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(out, indent=2) + "\n")
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
