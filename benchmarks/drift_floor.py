"""The Drift noise floor: Drift of groups re-scored at UNCHANGED weights under another batch layout than at birth.

Used by ``benchmarks/bf16_floor.py`` (CPU, bf16 autocast) and ``benchmarks/gpu_check.py`` (one CUDA GPU).

A group's generation-time log-probs are computed in one layout (its n rows alone, left-padded to its own longest
prompt, one batch of n rows); the gate later re-scores it in another: mixed with other groups' rows (longer padding,
other batch shapes), with extra left padding, or in smaller chunks.  In exact arithmetic every layout gives the same
log-probs (generation-style position ids make left padding a no-op, hdreplay's position hook supplies them); in
low precision each layout runs other kernels and reductions and the log-probs differ by rounding.  That difference,
squared and averaged over the group's tokens, is the Drift the gate sees before the policy has moved at all: the
floor.  If it is near tau, the gate admits and rejects on noise.

Layouts (``SETTINGS``):
    batch      the group's rows shuffled among other groups' rows, batches of ``batch_rows`` rows, each padded to
               its own longest prompt (another composition and padding than at birth)
    padding    the group alone with ``extra_pad`` more left-pad tokens
    chunking   the group's rows one at a time (no padding, batch shape 1)
"""

from __future__ import annotations

import contextlib
import math

import torch

SETTINGS = ("batch", "padding", "chunking")
PERCENTILES = (50, 90, 99, 100)


def precision_context(mode: str, device: torch.device):
    """``fp32`` / ``bf16_weights`` (no autocast: the weights are bf16) -> nullcontext; ``bf16_autocast`` -> autocast."""
    if mode == "bf16_autocast":
        return torch.autocast(device_type=device.type, dtype=torch.bfloat16)
    return contextlib.nullcontext()


@torch.no_grad()
def completion_logps(model, prompts: list[torch.Tensor], completions: torch.Tensor, *, pad_token_id: int,
                     extra_pad: int = 0, batch_rows: int, mode: str) -> torch.Tensor:
    """Per-token log-probs of ``completions: (R, C)`` after ``prompts`` (R 1-D tensors of varied length), rows
    left-padded to the longest prompt of their batch (+ ``extra_pad``), ``batch_rows`` rows per forward, with
    generation-style position ids (``cumsum(mask) - 1``).  Returns (R, C) float32 on the CPU."""
    dev = next(model.parameters()).device
    R, C = completions.shape
    out = []
    for s in range(0, R, batch_rows):
        ps, cs = prompts[s:s + batch_rows], completions[s:s + batch_rows].to(dev)
        P = max(len(p) for p in ps) + extra_pad
        ids = torch.full((len(ps), P), pad_token_id, dtype=torch.long, device=dev)
        mask = torch.zeros((len(ps), P), dtype=torch.long, device=dev)
        for i, p in enumerate(ps):
            ids[i, P - len(p):] = p.to(dev)
            mask[i, P - len(p):] = 1
        ids = torch.cat([ids, cs], 1)
        mask = torch.cat([mask, torch.ones_like(cs)], 1)
        pos = (mask.cumsum(-1) - 1).clamp(min=0)
        with precision_context(mode, dev):
            logits = model(input_ids=ids, attention_mask=mask, position_ids=pos, logits_to_keep=C + 1).logits
        logits = logits[:, :-1].float()
        out.append(logits.log_softmax(-1).gather(-1, cs.unsqueeze(-1)).squeeze(-1).cpu())
        del logits
    return torch.cat(out)


def random_groups(*, num_groups: int, n: int, prompt_len: int, completion_len: int, vocab: int, seed: int,
                  low_id: int = 2) -> tuple[list[torch.Tensor], torch.Tensor]:
    """``num_groups`` groups of ``n`` rows: one prompt per group (length uniform in [prompt_len/2, prompt_len]),
    repeated n times, and (num_groups * n, completion_len) completion tokens; ids in [low_id, vocab)."""
    g = torch.Generator().manual_seed(seed)
    prompts, comps = [], torch.randint(low_id, vocab, (num_groups * n, completion_len), generator=g)
    for _ in range(num_groups):
        L = int(torch.randint(max(1, prompt_len // 2), prompt_len + 1, (1,), generator=g))
        p = torch.randint(low_id, vocab, (L,), generator=g)
        prompts += [p] * n
    return prompts, comps


def sampled_groups(model, *, num_groups: int, n: int, prompt_len: int, completion_len: int, vocab: int, seed: int,
                   pad_token_id: int, mode: str, low_id: int = 2) -> tuple[list[torch.Tensor], torch.Tensor]:
    """Like :func:`random_groups`, but each group's n completions are sampled from ``model`` (temperature 1,
    exactly ``completion_len`` tokens, all groups in one left-padded ``generate`` call), so the tokens are the kind
    the model itself puts in the buffer."""
    prompts, _ = random_groups(num_groups=num_groups, n=n, prompt_len=prompt_len, completion_len=1, vocab=vocab,
                               seed=seed, low_id=low_id)
    dev = next(model.parameters()).device
    P = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), P), pad_token_id, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):
        ids[i, P - len(p):], mask[i, P - len(p):] = p, 1
    torch.manual_seed(seed)
    with torch.no_grad(), precision_context(mode, dev):
        out = model.generate(input_ids=ids.to(dev), attention_mask=mask.to(dev), do_sample=True, temperature=1.0,
                             top_k=0, top_p=1.0, max_new_tokens=completion_len, min_new_tokens=completion_len,
                             pad_token_id=pad_token_id)
    return prompts, out[:, P:].cpu()


def floor(model, prompts: list[torch.Tensor], completions: torch.Tensor, *, n: int, pad_token_id: int, mode: str,
          batch_rows: int, extra_pad: int, seed: int = 0) -> dict[str, list[float]]:
    """Per-group Drift (l2: mean over the group's completion tokens of (log p_layout - log p_birth)^2) for each of
    :data:`SETTINGS`, the birth layout being each group's n rows alone in one batch."""
    R = completions.shape[0]
    G = R // n
    birth = completion_logps(model, prompts, completions, pad_token_id=pad_token_id, batch_rows=n, mode=mode)
    perm = torch.randperm(R, generator=torch.Generator().manual_seed(seed))
    inv = torch.empty_like(perm)
    inv[perm] = torch.arange(R)
    mixed = completion_logps(model, [prompts[int(i)] for i in perm], completions[perm], pad_token_id=pad_token_id,
                             batch_rows=batch_rows, mode=mode)[inv]
    padded = completion_logps(model, prompts, completions, pad_token_id=pad_token_id, batch_rows=n,
                              extra_pad=extra_pad, mode=mode)
    single = completion_logps(model, prompts, completions, pad_token_id=pad_token_id, batch_rows=1, mode=mode)

    def per_group(lp):
        d = (lp - birth).pow(2).reshape(G, -1)
        return d.mean(1).tolist()

    return {"batch": per_group(mixed), "padding": per_group(padded), "chunking": per_group(single)}


def percentiles(values: list[float]) -> dict[str, float]:
    """{"p50", "p90", "p99", "max"} of ``values`` (linear interpolation)."""
    t = torch.tensor(values, dtype=torch.float64)
    out = {}
    for q in PERCENTILES:
        out["max" if q == 100 else f"p{q}"] = float(torch.quantile(t, q / 100.0))
    return out


def summarize(drifts: dict[str, list[float]], *, tau: float, tau_range: tuple[float, float]) -> dict:
    """Percentiles per setting and over all settings, their ratio to ``tau``, and whether the 99th percentile of any
    setting reaches tau/10 (the level at which the gate's decisions start to depend on rounding)."""
    rows = {k: percentiles(v) for k, v in drifts.items()}
    rows["all"] = percentiles([x for v in drifts.values() for x in v])
    worst = max(r["p99"] for r in rows.values())
    return {
        "settings": rows,
        "tau_default": tau,
        "tau_range": list(tau_range),
        "p99_over_tau": worst / tau if tau > 0 else math.inf,
        "p99_over_tau_min": worst / tau_range[0],
        "reaches_tau_over_10": worst >= tau / 10,
        "groups": len(next(iter(drifts.values()))),
    }


def markdown_rows(label: str, summary: dict) -> list[str]:
    """Table rows ``| label | setting | p50 | p90 | p99 | max | p99 / tau |`` for :func:`summarize`'s output."""
    tau = summary["tau_default"]
    out = []
    for k, r in summary["settings"].items():
        out.append(f"| {label} | {k} | {r['p50']:.2e} | {r['p90']:.2e} | {r['p99']:.2e} | {r['max']:.2e} | "
                   f"{r['p99'] / tau:.3f} |")
    return out
