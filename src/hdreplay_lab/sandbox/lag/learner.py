"""Sampling, losses and re-scoring of the policy-lag sandbox (one tiny causal LM, CPU).

The sampler is the trainer's model at the version a group is dispatched with; it samples in fp32 (HF
``generate``) and reports each sampled token's log-prob from bfloat16-rounded logits, the way an inference
engine's log-probs differ from an fp32 trainer's (``tests/support/vllm_standin.py`` does the same).  So the
stored behaviour log-probs differ from the trainer's even at staleness 0: the Drift floor is real here.

Losses over a batch of groups (token mean over all loss tokens, like TRL's async GRPO):

* ``clip``: ``-min(r A, clip(r, 1 - eps, 1 + eps) A)`` with ``r = pi_theta / pi_sampler`` (TRL async GRPO,
  verl's bypass mode);
* ``tis``: decoupled PPO (AReaL): ``r = pi_theta / pi_prox`` with ``pi_prox`` the policy before this update,
  times the truncated behaviour weight ``min(pi_prox / pi_sampler, cap)``.
"""

from __future__ import annotations

from typing import Sequence

import torch

from hdreplay import GroupRecord, pad_groups

EPS_CLIP = 0.2


class Sampler:
    """Draws groups for dispatch: a pool of ``pool`` prompts x n samples generated at once with the current
    weights, refilled when empty or when the version changed (an unused pool is discarded, uncounted)."""

    def __init__(self, model, tok, task, problems, *, n: int, width: int, pool: int, seed: int) -> None:
        self.model, self.tok, self.task, self.problems = model, tok, task, problems
        self.n, self.width, self.pool_size, self.seed = n, width, pool, seed
        self._pool: list[tuple[GroupRecord, int]] = []
        self._version: int | None = None
        self._next_prompt = 0
        self._calls = 0
        self.next_id = 0

    def next_group(self, version: int) -> tuple[GroupRecord, int]:
        """(group born at ``version``, its longest completion in tokens)."""
        if not self._pool or self._version != version:
            self._pool, self._version = self._sample(version), version
        return self._pool.pop(0)

    @torch.no_grad()
    def _sample(self, version: int) -> list[tuple[GroupRecord, int]]:
        probs = [self.problems[(self._next_prompt + i) % len(self.problems)] for i in range(self.pool_size)]
        self._next_prompt += self.pool_size
        self._calls += 1
        tok, n = self.tok, self.n
        enc = tok([p.prompt for p in probs], return_tensors="pt", padding=True, add_special_tokens=False)
        state = torch.get_rng_state()
        torch.manual_seed(1_000_003 * self.seed + self._calls)
        try:
            out = self.model.generate(**enc, do_sample=True, temperature=1.0, top_k=0, top_p=1.0,
                                      max_new_tokens=self.width, num_return_sequences=n, output_logits=True,
                                      return_dict_in_generate=True, pad_token_id=tok.pad_token_id,
                                      eos_token_id=tok.eos_token_id)
        finally:
            torch.set_rng_state(state)
        seqs = out.sequences[:, enc["input_ids"].shape[1]:]
        logits = torch.stack(out.logits, dim=1)[:, :seqs.shape[1]]
        behaviour = torch.log_softmax(logits.to(torch.bfloat16).float(), dim=-1).gather(-1, seqs[..., None])[..., 0]
        groups = []
        for i, p in enumerate(probs):
            comps, lps, rewards = [], [], []
            for r in range(i * n, (i + 1) * n):
                row = seqs[r].tolist()
                end = row.index(tok.eos_token_id) + 1 if tok.eos_token_id in row else len(row)
                comps.append(seqs[r, :end])
                lps.append(behaviour[r, :end])
                rewards.append(self.task.score(tok.decode(row[:end], skip_special_tokens=True), p.answer))
            rw = torch.tensor(rewards)
            adv = (rw - rw.mean()) / (rw.std() + 1e-4)
            prompt = tok(p.prompt, add_special_tokens=False)["input_ids"]
            g = GroupRecord.from_responses(group_id=self.next_id, prompt_ids=prompt, completion_ids=comps,
                                           logprobs=lps, advantages=adv, rewards=rw, birth_step=version)
            self.next_id += 1
            groups.append((g, max(c.numel() for c in comps)))
        return groups


def row_logprobs(model, pg) -> torch.Tensor:
    """(R, L) log-probs of the padded completions under ``model`` (gradients flow if enabled)."""
    ids = torch.cat([pg.prompt_ids, pg.completion_ids], 1)
    mask = torch.cat([pg.prompt_mask, pg.completion_mask], 1)
    pos = (mask.cumsum(1) - 1).clamp(min=0)
    P, L = pg.prompt_ids.shape[1], pg.completion_ids.shape[1]
    logits = model(input_ids=ids, attention_mask=mask, position_ids=pos).logits[:, P - 1:P + L - 1].float()
    return torch.log_softmax(logits, dim=-1).gather(-1, pg.completion_ids[..., None])[..., 0]


def scorer(model, pad_token_id: int):
    """hdreplay's Scorer: current log-probs of stored groups, flat ``(T_g,)`` per group."""
    @torch.no_grad()
    def score(groups: Sequence[GroupRecord]) -> list[torch.Tensor]:
        pg = pad_groups(groups, pad_token_id=pad_token_id)
        return pg.split_by_group(row_logprobs(model, pg))
    return score


def policy_loss(model, groups: Sequence[GroupRecord], *, kind: str, pad_token_id: int, is_cap: float = 2.0
                ) -> tuple[torch.Tensor, list[float], list[int]]:
    """(loss, per-group Drift of the trainer's log-probs against the stored sampler log-probs, loss tokens)."""
    pg = pad_groups(groups, pad_token_id=pad_token_id)
    lp = row_logprobs(model, pg)
    mask = pg.loss_mask.bool()
    adv = pg.advantages[:, None]
    if kind == "clip":
        ratio, weight = torch.exp(lp - pg.logprobs), 1.0
    elif kind == "tis":
        prox = lp.detach()
        ratio, weight = torch.exp(lp - prox), torch.exp(prox - pg.logprobs).clamp(max=is_cap)
    else:
        raise ValueError(f"unknown loss {kind!r}")
    per = -torch.min(ratio * adv, ratio.clamp(1 - EPS_CLIP, 1 + EPS_CLIP) * adv) * weight
    loss = (per * mask).sum() / mask.sum().clamp(min=1)
    sq = ((lp.detach() - pg.logprobs) ** 2 * mask).sum(1)
    rows_of = pg.row_group
    g_sq = torch.zeros(len(groups)).index_add_(0, rows_of, sq)
    g_tok = torch.zeros(len(groups)).index_add_(0, rows_of, mask.sum(1).float())
    return loss, (g_sq / g_tok.clamp(min=1)).tolist(), g_tok.long().tolist()
