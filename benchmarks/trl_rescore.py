"""Re-scoring cost with one prompt pass per group vs TRL's full-row forward, on long prompts.

    python benchmarks/trl_rescore.py            # about a minute on 2 CPU cores
    python benchmarks/trl_rescore.py --quick

Workload: G groups of n responses, prompts of ~P tokens (>= 4x the completion length C), a Qwen2-shaped random
model through HDRGRPOTrainer's own scoring paths (``_row_logps`` / ``_shared_logps``: the same fused LM head,
temperature and position ids as training).  ``full`` re-scores every row as prompt + completion (what the trainer did
before); ``shared`` encodes each prompt once and expands its KV cache to the group's n rows.

Writes benchmarks/results/trl_rescore.json:
    rescore_tokens_ratio   token positions shared / full  (G (P - 1) + R (1 + C)) / (R (P + C))
    rescore_time_ratio     median seconds shared / full, per rows-per-call setting
    max_abs_logp_diff      shared vs full log-probs (fp32)
    max_abs_drift_diff     Drift of every group from the shared vs the full re-score (gate decisions identical)
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

from hdreplay import GroupRecord, group_scores, pad_groups  # noqa: E402
from hdreplay.integrations.trl import HDRGRPOConfig, HDRGRPOTrainer  # noqa: E402
from hdreplay.integrations.trl.rescore import rescore_token_counts, share_pays  # noqa: E402
from hdreplay_lab.sandbox.model import build_tiny_model, load_model  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"


def make_groups(tr, *, G, n, P, C, seed=0):
    """G groups with random prompts (P +- 10% tokens) and completions (C tokens); stored log-probs = the full
    forward's, so their Drift under the current weights is 0 up to float round-off."""
    g = torch.Generator().manual_seed(seed)
    V = tr.accelerator.unwrap_model(tr.model).config.vocab_size
    groups = []
    for k in range(G):
        p = int(P * (0.9 + 0.2 * torch.rand(1, generator=g)))
        prompt = torch.randint(3, V, (p,), generator=g)
        comps = [torch.randint(3, V, (C,), generator=g) for _ in range(n)]
        groups.append(GroupRecord.from_responses(group_id=k, prompt_ids=prompt, completion_ids=comps,
                                                 logprobs=[torch.zeros(C)] * n, advantages=torch.zeros(n),
                                                 rewards=torch.zeros(n), birth_step=0))
    pg = pad_groups(groups, pad_token_id=tr._tokenizer.pad_token_id)
    lps = pg.split_by_group(tr._row_logps(groups, list(range(pg.num_rows))))
    return [GroupRecord(group_id=x.group_id, prompt_ids=x.prompt_ids, completion_ids=x.completion_ids,
                        response_lengths=x.response_lengths, loss_mask=x.loss_mask, logprobs=lp.clamp(max=0),
                        advantages=x.advantages, rewards=x.rewards, birth_step=0) for x, lp in zip(groups, lps)]


def timed(fn, repeats):
    ts = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        out = fn()
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts), out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--groups", type=int, default=8)
    ap.add_argument("--generations", type=int, default=8)
    ap.add_argument("--prompt", type=int, default=256)
    ap.add_argument("--completion", type=int, default=48)
    ap.add_argument("--out", default=str(RESULTS / "trl_rescore.json"))
    args = ap.parse_args()
    if args.prompt < 4 * args.completion:
        raise SystemExit("--prompt must be >= 4 x --completion (the workload this benchmark is about)")
    repeats = 3 if args.quick else 7
    G = 4 if args.quick else args.groups
    model_dir = Path(tempfile.mkdtemp(prefix="rescore-model-")) / "m"
    build_tiny_model(model_dir, hidden=128, layers=4, max_positions=1024)
    model, tok = load_model(model_dir)
    cfg = HDRGRPOConfig(output_dir=tempfile.mkdtemp(prefix="rescore-"), use_cpu=True, bf16=False, report_to="none",
                        per_device_train_batch_size=args.generations, num_generations=args.generations,
                        disable_dropout=True, replay_k_rep=1, replay_diagnostics_dir="")
    tr = HDRGRPOTrainer(model=model, reward_funcs=lambda completions, **kw: [0.0] * len(completions), args=cfg,
                        train_dataset=Dataset.from_dict({"prompt": ["1+1="] * 8}), processing_class=tok)
    groups = make_groups(tr, G=G, n=args.generations, P=args.prompt, C=args.completion)
    shared_tokens, full_tokens = rescore_token_counts(groups)
    assert share_pays(groups), "the trainer would not share the prompt pass on this workload"
    res = {}
    pg = pad_groups(groups, pad_token_id=tok.pad_token_id)
    for rows_per_call in (args.generations, G * args.generations):
        tr.args.replay_score_batch_size = rows_per_call
        t_full, full = timed(lambda: tr._row_logps(groups, list(range(pg.num_rows))), repeats)
        t_shared, shared = timed(lambda: tr._shared_logps(groups, 0), repeats)
        res[f"rows_per_call_{rows_per_call}"] = {"full_s": t_full, "shared_s": t_shared,
                                                 "rescore_time_ratio": t_shared / t_full}
    pg = pad_groups(groups, pad_token_id=tok.pad_token_id)
    m = pg.completion_mask.bool()
    d_full = group_scores(groups, pg.split_by_group(full)).drift
    d_shared = group_scores(groups, pg.split_by_group(shared)).drift
    out = {
        "rescore_tokens_ratio": shared_tokens / full_tokens,
        "rescore_time_ratio": res[f"rows_per_call_{args.generations}"]["rescore_time_ratio"],
        "by_rows_per_call": res,
        "max_abs_logp_diff": float((shared[m] - full[m]).abs().max()),
        "max_abs_drift_diff": float((d_shared - d_full).abs().max()),
        "max_drift_full": float(d_full.max()), "max_drift_shared": float(d_shared.max()),
        "tokens": {"shared": shared_tokens, "full": full_tokens},
        "workload": {"groups": G, "n": args.generations, "prompt_tokens": args.prompt,
                     "completion_tokens": args.completion, "model": "Qwen2 hidden 128, 4 layers (random init)",
                     "repeats": repeats},
        "quick": args.quick, "torch": torch.__version__, "threads": torch.get_num_threads(),
        "machine": platform.machine(),
    }
    path = Path(args.out)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(out, indent=2) + "\n")
    print(json.dumps({k: out[k] for k in ("rescore_tokens_ratio", "rescore_time_ratio", "by_rows_per_call",
                                          "max_abs_logp_diff", "max_abs_drift_diff")}, indent=2))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
