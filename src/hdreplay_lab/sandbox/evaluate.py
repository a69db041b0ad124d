"""Mean@n / Best@n evaluation (the paper's metric definitions, Appendix B.1).

    Best@n      per input the max score over its n samples, averaged over inputs
    Mean@n      per input the mean score over its n samples, averaged over inputs
    Macro Avg   unweighted mean of benchmark-level values
    Weighted    benchmark-level values weighted by benchmark size
"""

from __future__ import annotations

from typing import Mapping, Sequence

import numpy as np
import torch


def mean_at_n(scores) -> float:
    """scores: (inputs, n) in [0, 1]."""
    s = np.asarray(scores, dtype=np.float64)
    if s.ndim != 2 or s.size == 0:
        raise ValueError(f"scores must be a non-empty (inputs, n) array, got shape {s.shape}")
    return float(s.mean(axis=1).mean())


def best_at_n(scores) -> float:
    s = np.asarray(scores, dtype=np.float64)
    if s.ndim != 2 or s.size == 0:
        raise ValueError(f"scores must be a non-empty (inputs, n) array, got shape {s.shape}")
    return float(s.max(axis=1).mean())


def macro_average(values: Mapping[str, float]) -> float:
    return float(np.mean(list(values.values())))


def weighted_average(values: Mapping[str, float], sizes: Mapping[str, int]) -> float:
    w = np.asarray([sizes[k] for k in values], dtype=np.float64)
    return float((np.asarray(list(values.values())) * w).sum() / w.sum())


@torch.no_grad()
def sample_completions(model, tok, prompts: Sequence[str], *, n: int, max_new_tokens: int,
                       temperature: float = 1.0, batch_prompts: int = 128, seed: int = 0) -> list[list[str]]:
    """n sampled completions per prompt (left-padded batches, the RL sampling temperature)."""
    was_training = model.training
    model.eval()
    gen = torch.Generator().manual_seed(seed)
    state = torch.get_rng_state()
    torch.manual_seed(int(torch.randint(0, 2**31 - 1, (1,), generator=gen)))
    out: list[list[str]] = []
    try:
        for i in range(0, len(prompts), batch_prompts):
            chunk = list(prompts[i:i + batch_prompts])
            enc = tok(chunk, return_tensors="pt", padding=True, add_special_tokens=False)
            ids = model.generate(**enc, do_sample=True, temperature=temperature, top_k=0, top_p=1.0,
                                 max_new_tokens=max_new_tokens, num_return_sequences=n,
                                 pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id)
            texts = tok.batch_decode(ids[:, enc["input_ids"].shape[1]:], skip_special_tokens=True)
            out.extend(texts[j * n:(j + 1) * n] for j in range(len(chunk)))
    finally:
        torch.set_rng_state(state)
        model.train(was_training)
    return out


def evaluate(model, tok, task, *, n: int = 8, seed: int = 0, benchmarks: Sequence[str] | None = None,
             prompts_per_benchmark: int | None = None, per_prompt: bool = False) -> dict:
    """Per-benchmark Mean@n / Best@n plus macro and size-weighted averages.

    ``prompts_per_benchmark`` evaluates the first k prompts of each benchmark (the cheap subset of the
    training curves); ``per_prompt`` adds each prompt's mean score (``prompt_mean``, in benchmark order),
    the data of the paired bootstrap.
    """
    per, sizes = {}, {}
    for b in task.benchmarks:
        if benchmarks is not None and b.name not in benchmarks:
            continue
        probs = task.benchmark_problems(b)[:prompts_per_benchmark]
        if getattr(task, "is_multiturn", False):
            from .search import rollout

            torch.manual_seed(seed)
            comps = rollout(model, tok, probs, n=n, max_tool_calls=task.max_tool_calls)
        elif getattr(task, "is_multimodal", False):  # tok is the VLM's processor
            from .vlm import sample_vlm

            comps = sample_vlm(model, tok, [p.prompt for p in probs], [p.image() for p in probs], n=n,
                               max_new_tokens=task.completion_width(probs), seed=seed)
        else:
            width = max(len(p.answer) for p in probs) + 2
            comps = sample_completions(model, tok, [p.prompt for p in probs], n=n, max_new_tokens=width, seed=seed)
        scores = [[task.score(c, p.answer) for c in cs] for cs, p in zip(comps, probs)]
        per[b.name] = {"mean_at_n": mean_at_n(scores), "best_at_n": best_at_n(scores), "size": len(probs)}
        if per_prompt:
            per[b.name]["prompt_mean"] = [float(np.mean(s)) for s in scores]
        sizes[b.name] = len(probs)
    means = {k: v["mean_at_n"] for k, v in per.items()}
    bests = {k: v["best_at_n"] for k, v in per.items()}
    return {
        "n": n,
        "benchmarks": per,
        "macro_mean_at_n": macro_average(means),
        "macro_best_at_n": macro_average(bests),
        "weighted_mean_at_n": weighted_average(means, sizes),
        "weighted_best_at_n": weighted_average(bests, sizes),
    }
