"""The Drift noise floor: Drift of groups re-scored at UNCHANGED weights under another batch layout than at birth.

Used by ``benchmarks/bf16_floor.py`` (CPU, bf16 autocast and bf16 weights), ``benchmarks/gpu_check.py`` (one CUDA
GPU) and ``hdreplay calibrate run`` (a quick measurement on the model being calibrated, :func:`measure`).

A group's generation-time log-probs are computed in one layout (its n rows alone, left-padded to its own longest
prompt, one batch of n rows); the gate later re-scores it in another: mixed with other groups' rows (longer padding,
other batch shapes), with extra left padding, or in smaller chunks.  In exact arithmetic every layout gives the same
log-probs (generation-style position ids make left padding a no-op, hdreplay's position hook supplies them); in
low precision each layout runs other kernels and reductions and the log-probs differ by rounding.  That difference,
squared and averaged over the group's tokens, is the Drift the gate sees before the policy has moved at all: the
floor.  If it is near tau, the gate admits and rejects on noise.

Layouts (``SETTINGS``, plus ``SHARED`` on request):
    batch          the group's rows shuffled among other groups' rows, batches of ``batch_rows`` rows, each padded to
                   its own longest prompt (another composition and padding than at birth)
    padding        the group alone with ``extra_pad`` more left-pad tokens
    chunking       the group's rows one at a time (no padding, batch shape 1)
    shared_prompt  hdreplay's prompt-shared re-score (:func:`hdreplay.integrations.trl.rescore.shared_prompt_logps`:
                   one prompt pass per group, its KV cache repeated for the n rows, ``batch_rows`` rows per call),
                   against a birth computed as TRL computes it (the group alone, TRL's fused LM head)
"""

from __future__ import annotations

import contextlib
import math
from pathlib import Path

import torch

SETTINGS = ("batch", "padding", "chunking")
SHARED = "shared_prompt"
NORMS = ("l2", "l1")
#: fp32; fp32 weights under bf16 autocast; the same with the LM head in fp32 outside autocast (TRL's
#: ``cast_lm_head_to_fp32=True``: the logits are not rounded to bf16); bf16 weights
MODES = ("fp32", "bf16_autocast", "bf16_autocast_fp32_head", "bf16_weights")
PERCENTILES = (50, 90, 99, 100)


def precision_context(mode: str, device: torch.device):
    """``fp32`` / ``bf16_weights`` (no autocast: the weights are bf16) -> nullcontext; ``bf16_autocast*`` ->
    autocast."""
    if mode not in MODES:
        raise ValueError(f"precision mode {mode!r}; valid: {list(MODES)}")
    if mode.startswith("bf16_autocast"):
        return torch.autocast(device_type=device.type, dtype=torch.bfloat16)
    return contextlib.nullcontext()


def prepare(model, mode: str, *, fused: bool = False):
    """``model`` ready for ``mode``: ``bf16_autocast_fp32_head`` runs its LM head in fp32 outside autocast; ``fused``
    adds TRL's fused LM head (needed by the ``shared_prompt`` layout), cast to fp32 in that mode as well."""
    if mode == "bf16_autocast_fp32_head":
        head = model.get_output_embeddings()

        def forward(x, head=head):
            with torch.autocast(device_type=x.device.type, enabled=False):
                return torch.nn.functional.linear(x.float(), head.weight.float(),
                                                  None if head.bias is None else head.bias.float())

        head.forward = forward
    if fused:
        from trl.trainer.utils import add_fused_lm_head

        add_fused_lm_head(model, cast_lm_head_to_fp32=mode == "bf16_autocast_fp32_head")
    return model


def completion_mask(completions: torch.Tensor, eos_token_id: int | None) -> torch.Tensor:
    """(R, C) 1 up to and including each row's first ``eos_token_id`` (all ones when None or absent)."""
    if eos_token_id is None:
        return torch.ones_like(completions)
    eos = (completions == eos_token_id).long()
    before = eos.cumsum(1) - eos  # EOS tokens strictly before each position
    return (before == 0).long()


def _left_pad(prompts: list[torch.Tensor], width: int, pad_token_id: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.full((len(prompts), width), pad_token_id, dtype=torch.long, device=device)
    mask = torch.zeros((len(prompts), width), dtype=torch.long, device=device)
    for i, p in enumerate(prompts):
        ids[i, width - len(p):] = p.to(device)
        mask[i, width - len(p):] = 1
    return ids, mask


@torch.no_grad()
def completion_logps(model, prompts: list[torch.Tensor], completions: torch.Tensor, *, pad_token_id: int,
                     extra_pad: int = 0, batch_rows: int, mode: str, fused: bool = False,
                     completion_mask: torch.Tensor | None = None) -> torch.Tensor:
    """Per-token log-probs of ``completions: (R, C)`` after ``prompts`` (R 1-D tensors of varied length), rows
    left-padded to the longest prompt of their batch (+ ``extra_pad``), ``batch_rows`` rows per forward, with
    generation-style position ids (``cumsum(mask) - 1``); ``completion_mask: (R, C)`` marks real completion tokens
    (right padding after them, default all real).  ``fused``: through TRL's fused LM head (the model must carry it,
    :func:`prepare`), as TRL's own log-prob forward runs.  Returns (R, C) float32 on the CPU (junk on padding)."""
    dev = next(model.parameters()).device
    R, C = completions.shape
    cmask = torch.ones_like(completions) if completion_mask is None else completion_mask
    out = []
    for s in range(0, R, batch_rows):
        ps, cs = prompts[s:s + batch_rows], completions[s:s + batch_rows].to(dev)
        ids, mask = _left_pad(ps, max(len(p) for p in ps) + extra_pad, pad_token_id, dev)
        ids = torch.cat([ids, cs], 1)
        mask = torch.cat([mask, cmask[s:s + batch_rows].to(dev).long()], 1)
        pos = (mask.cumsum(-1) - 1).clamp(min=0)
        with precision_context(mode, dev):
            if fused:
                labels = ids.masked_fill(mask == 0, -100)
                labels[:, :-C] = -100
                lp = model(input_ids=ids, attention_mask=mask, position_ids=pos, labels=labels,
                           fused_lm_head=True).log_probs[:, -C:]
                out.append(lp.float().cpu())
                continue
            logits = model(input_ids=ids, attention_mask=mask, position_ids=pos, logits_to_keep=C + 1).logits
        logits = logits[:, :-1].float()
        out.append(logits.log_softmax(-1).gather(-1, cs.unsqueeze(-1)).squeeze(-1).cpu())
        del logits
    return torch.cat(out)


def shared_logps(model, prompts: list[torch.Tensor], completions: torch.Tensor, *, n: int, pad_token_id: int,
                 batch_rows: int, mode: str, completion_mask: torch.Tensor | None = None) -> torch.Tensor:
    """(R, C) log-probs of ``completions`` through hdreplay's prompt-shared re-score
    (:func:`hdreplay.integrations.trl.rescore.shared_prompt_logps`), groups of ``n`` consecutive rows sharing one
    prompt, at most ``batch_rows`` rows per call.  The model must carry TRL's fused LM head (:func:`prepare`)."""
    from hdreplay import GroupRecord
    from hdreplay.integrations.trl.rescore import shared_prompt_logps

    R, C = completions.shape
    cmask = torch.ones_like(completions) if completion_mask is None else completion_mask
    groups = [GroupRecord.from_padded(group_id=g, prompt_ids=prompts[g * n],
                                      completion_ids=completions[g * n:(g + 1) * n],
                                      completion_mask=cmask[g * n:(g + 1) * n], logprobs=torch.zeros((n, C)),
                                      advantages=torch.zeros(n), rewards=torch.zeros(n), birth_step=0)
              for g in range(R // n)]
    dev = next(model.parameters()).device
    lp = shared_prompt_logps(model, groups, pad_token_id=pad_token_id, device=dev, max_rows=batch_rows,
                             autocast=lambda: precision_context(mode, dev))
    out = torch.zeros((R, C))
    out[:, :lp.shape[1]] = lp
    return out


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


@torch.no_grad()
def sample_completions(model, prompts: list[torch.Tensor], *, completion_len: int, pad_token_id: int, mode: str,
                       seed: int, batch_rows: int | None = None, eos_token_id: int | None = None) -> torch.Tensor:
    """(R, completion_len) completions sampled from ``model`` after the R ``prompts`` (temperature 1, left-padded
    ``generate`` calls of ``batch_rows`` rows, all at once when None): exactly ``completion_len`` tokens, or with
    ``eos_token_id`` up to the first EOS (then ``pad_token_id``; :func:`completion_mask` marks the real tokens)."""
    dev = next(model.parameters()).device
    torch.manual_seed(seed)
    step = batch_rows or len(prompts)
    out = []
    for s in range(0, len(prompts), step):
        ps = prompts[s:s + step]
        P = max(len(p) for p in ps)
        ids, mask = _left_pad(ps, P, pad_token_id, dev)
        with precision_context(mode, dev):
            stop = ({"min_new_tokens": completion_len} if eos_token_id is None else {"eos_token_id": eos_token_id})
            gen = model.generate(input_ids=ids, attention_mask=mask, do_sample=True, temperature=1.0, top_k=0,
                                 top_p=1.0, max_new_tokens=completion_len, pad_token_id=pad_token_id, **stop)
        gen = gen[:, P:].cpu()
        pad = torch.full((gen.shape[0], completion_len - gen.shape[1]), pad_token_id, dtype=gen.dtype)
        out.append(torch.cat([gen, pad], 1))
    return torch.cat(out)


def sampled_groups(model, *, num_groups: int, n: int, prompt_len: int, completion_len: int, vocab: int, seed: int,
                   pad_token_id: int, mode: str, low_id: int = 2) -> tuple[list[torch.Tensor], torch.Tensor]:
    """Like :func:`random_groups`, but each group's n completions are sampled from ``model`` (temperature 1,
    exactly ``completion_len`` tokens, all groups in one left-padded ``generate`` call), so the tokens are the kind
    the model itself puts in the buffer."""
    prompts, _ = random_groups(num_groups=num_groups, n=n, prompt_len=prompt_len, completion_len=1, vocab=vocab,
                               seed=seed, low_id=low_id)
    return prompts, sample_completions(model, prompts, completion_len=completion_len, pad_token_id=pad_token_id,
                                       mode=mode, seed=seed)


def layout_logps(model, prompts: list[torch.Tensor], completions: torch.Tensor, *, n: int, pad_token_id: int,
                 mode: str, batch_rows: int, extra_pad: int, seed: int = 0, shared: bool = False,
                 completion_mask: torch.Tensor | None = None) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """layout -> (birth, re-scored) (R, C) log-probs for each of :data:`SETTINGS` (and :data:`SHARED` when
    ``shared``: the model must carry TRL's fused LM head), the birth layout being each group's n rows alone in one
    batch; ``completion_mask: (R, C)`` marks real completion tokens (default all)."""
    R = completions.shape[0]
    if R % n:
        raise ValueError(f"{R} rows are not whole groups of n={n}")
    cm = torch.ones_like(completions) if completion_mask is None else completion_mask
    kw = dict(pad_token_id=pad_token_id, mode=mode)
    birth = completion_logps(model, prompts, completions, batch_rows=n, completion_mask=cm, **kw)
    perm = torch.randperm(R, generator=torch.Generator().manual_seed(seed))
    inv = torch.empty_like(perm)
    inv[perm] = torch.arange(R)
    out = {
        "batch": (birth, completion_logps(model, [prompts[int(i)] for i in perm], completions[perm],
                                          batch_rows=batch_rows, completion_mask=cm[perm], **kw)[inv]),
        "padding": (birth, completion_logps(model, prompts, completions, batch_rows=n, extra_pad=extra_pad,
                                            completion_mask=cm, **kw)),
        "chunking": (birth, completion_logps(model, prompts, completions, batch_rows=1, completion_mask=cm, **kw)),
    }
    if shared:
        out[SHARED] = (completion_logps(model, prompts, completions, batch_rows=n, fused=True,
                                        completion_mask=cm, **kw),
                       shared_logps(model, prompts, completions, n=n, batch_rows=batch_rows, completion_mask=cm, **kw))
    return out


def group_drift(logps: torch.Tensor, birth: torch.Tensor, *, n: int, norm: str = "l2",
                completion_mask: torch.Tensor | None = None) -> list[float]:
    """Per-group Drift of (R, C) ``logps`` against ``birth``: mean over the group's real completion tokens
    (``completion_mask``, default all n x C) of the squared (``l2``) or absolute (``l1``) difference; groups are ``n``
    consecutive rows."""
    if norm not in NORMS:
        raise ValueError(f"norm {norm!r}; valid: {list(NORMS)}")
    m = torch.ones_like(logps, dtype=torch.float64) if completion_mask is None else completion_mask.double()
    d = logps.double() - birth.double()
    d = (d.pow(2) if norm == "l2" else d.abs()) * m
    G = logps.shape[0] // n
    return (d.reshape(G, -1).sum(1) / m.reshape(G, -1).sum(1)).tolist()


def floor(model, prompts: list[torch.Tensor], completions: torch.Tensor, *, n: int, pad_token_id: int, mode: str,
          batch_rows: int, extra_pad: int, seed: int = 0, shared: bool = False, norm: str = "l2",
          completion_mask: torch.Tensor | None = None) -> dict[str, list[float]]:
    """Per-group Drift (``norm``, default l2: mean over the group's completion tokens of (log p_layout -
    log p_birth)^2) for each of :data:`SETTINGS` (and :data:`SHARED` when ``shared``), see :func:`layout_logps`."""
    lps = layout_logps(model, prompts, completions, n=n, pad_token_id=pad_token_id, mode=mode, batch_rows=batch_rows,
                       extra_pad=extra_pad, seed=seed, shared=shared, completion_mask=completion_mask)
    return {k: group_drift(lp, birth, n=n, norm=norm, completion_mask=completion_mask)
            for k, (birth, lp) in lps.items()}


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


def measure(model_dir: str | Path, *, modes: tuple[str, ...] = ("bf16_autocast", "bf16_weights"), num_groups: int = 8,
            n: int = 4, prompt_len: int = 16, completion_len: int = 16, batch_rows: int = 16, extra_pad: int = 8,
            seed: int = 0, prompts: list[torch.Tensor] | None = None, shared: bool = True) -> dict:
    """A quick floor of the model saved in ``model_dir`` (on the CPU): ``num_groups`` groups of ``n`` completions
    sampled once from the model in fp32 after ``prompts`` (one per group; random token ids when None), each ending at
    the tokenizer's EOS or after ``completion_len`` tokens, re-scored in each precision of ``modes`` ->
    {norm -> {layout -> per-group Drift}}.  ``hdreplay calibrate run`` reports it."""
    from .sandbox.model import load_model

    model, tok = load_model(model_dir)
    vocab = int(model.config.get_text_config().vocab_size)
    if prompts is None:
        specials = [i for i in tok.all_special_ids if i < vocab // 2]
        ps, _ = random_groups(num_groups=num_groups, n=n, prompt_len=prompt_len, completion_len=1, vocab=vocab,
                              seed=seed, low_id=max(specials, default=1) + 1)
    else:
        if len(prompts) != num_groups:
            raise ValueError(f"{len(prompts)} prompts for num_groups={num_groups}")
        ps = [torch.as_tensor(p).long() for p in prompts for _ in range(n)]
    comps = sample_completions(model.eval(), ps, completion_len=completion_len, pad_token_id=tok.pad_token_id,
                               mode="fp32", seed=seed, eos_token_id=tok.eos_token_id)
    cm = completion_mask(comps, tok.eos_token_id)
    out = {}
    for mode in modes:
        model, _ = load_model(model_dir, dtype=torch.bfloat16 if mode == "bf16_weights" else torch.float32)
        prepare(model.eval(), mode, fused=shared)
        lps = layout_logps(model, ps, comps, n=n, pad_token_id=tok.pad_token_id, mode=mode, batch_rows=batch_rows,
                           extra_pad=extra_pad, seed=seed, shared=shared, completion_mask=cm)
        out[mode] = {norm: {k: group_drift(lp, b, n=n, norm=norm, completion_mask=cm) for k, (b, lp) in lps.items()}
                     for norm in NORMS}
        del model
    return out


def floor_report(measured: dict, *, taus: tuple[float, ...]) -> list[str]:
    """One line per precision of :func:`measure`'s result: the l2 floor's p99 / max and its ratio to the smallest
    of ``taus``, flagged where it reaches tau/10."""
    lo = min(taus)
    lines = []
    for mode, by_norm in measured.items():
        vals = [x for v in by_norm["l2"].values() for x in v]
        p = percentiles(vals)
        flag = "  REACHES tau/10: the gate decides on rounding noise at this tau" if p["p99"] >= lo / 10 else ""
        lines.append(f"{mode}: Drift floor (l2, unchanged weights, other layouts) p99 {p['p99']:.2e} = "
                     f"{p['p99'] / lo:.3g} x tau {lo:g}, max {p['max']:.2e}{flag}")
    return lines


def calibration_floor(model_dir: str | Path, *, task, taus: tuple[float, ...], out_dir: str | Path | None = None,
                      num_groups: int = 8, n: int = 4) -> list[str]:
    """What ``hdreplay calibrate run`` reports: a quick floor of the calibrated model (``num_groups`` groups of the
    task's training prompts, or random tokens for a multi-turn task, in bf16 autocast and bf16 weights on the CPU),
    one line per precision against the smallest swept tau (:func:`floor_report`), written with the per-group values
    to ``out_dir/drift_floor.json``.  A vision-language model is not measured (one line says so)."""
    import json

    from .sandbox.model import load_model
    from .sandbox.vlm import is_vlm_dir

    if is_vlm_dir(model_dir):
        return ["not measured for a vision-language model (benchmarks/bf16_floor.py measures text models)"]
    prompts = None
    if not getattr(task, "is_multiturn", False):
        _, tok = load_model(model_dir)
        prompts = [tok(p.prompt, add_special_tokens=False)["input_ids"]
                   for p in task.train_problems(num_groups, seed=0)]
    measured = measure(model_dir, num_groups=num_groups, n=n, prompts=prompts)
    lines = floor_report(measured, taus=taus)
    if out_dir is not None:
        path = Path(out_dir) / "drift_floor.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps({"model": str(model_dir), "groups": num_groups, "n": n, "taus": list(taus),
                                    "report": lines, "drift": measured}, indent=1) + "\n")
    return lines
