"""Group records: the unit of storage and replay.

Shape glossary (used in every docstring of the package)
-------------------------------------------------------
n      responses in a group (the GRPO group size, ``num_generations``)
P      prompt tokens of a group (unpadded)
L_i    completion tokens of response i (unpadded: up to and including EOS)
T      total completion tokens of a group, ``sum_i L_i``
G      groups in a batch
R      rows (responses) in a padded batch, ``sum_g n_g``

A group stores its n completions *concatenated* into one flat ``(T,)`` sequence,
with ``response_lengths: (n,)`` telling where each response ends.  The
``loss_mask: (T,)`` marks the positions the policy generated (T(g) in the
paper); tool / environment tokens inside a response have loss mask 0 and never
enter Drift, Headroom, replay KL or the loss.

Log-probs at loss-mask positions are validated (finite, <= 0); at mask-0
positions they carry no meaning and are stored as 0.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping, Sequence

import torch

from ..errors import ReplayInputError
from ..validate import MAX_TOKEN_ID, check_step
from .multimodal import check_mm_inputs

#: log-probs may exceed 0 by this much through float round-off of log_softmax.
LOGPROB_POSITIVE_TOLERANCE = 1e-4

_INT_DTYPES = (torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8)


def _tensor(name: str, value, gid) -> torch.Tensor:
    """``value`` as a tensor (tensors, NumPy arrays and nested lists of numbers are accepted)."""
    if isinstance(value, (str, bytes, Mapping)) or value is None:
        raise ReplayInputError(f"group {gid!r}: `{name}` must be a tensor or a sequence of numbers, "
                               f"got {type(value).__name__}")
    try:
        t = torch.as_tensor(value)
    except (TypeError, ValueError, RuntimeError, OverflowError) as e:
        raise ReplayInputError(f"group {gid!r}: `{name}` is not a tensor of numbers ({e})") from None
    if t.is_complex():
        raise ReplayInputError(f"group {gid!r}: `{name}` must be real, got dtype {t.dtype}")
    return t


def _seq(name: str, value, gid) -> list:
    if not isinstance(value, (list, tuple)):
        raise ReplayInputError(f"group {gid!r}: `{name}` must be a list of per-response tensors, "
                               f"got {type(value).__name__}")
    return list(value)


def _as_1d(name: str, value, dtype: torch.dtype, gid) -> torch.Tensor:
    t = _tensor(name, value, gid)
    if t.dim() != 1:
        raise ReplayInputError(f"group {gid!r}: `{name}` must be 1-D, got shape {tuple(t.shape)}")
    if dtype in _INT_DTYPES and t.numel():
        if t.is_floating_point() or t.dtype == torch.bool:
            raise ReplayInputError(f"group {gid!r}: `{name}` must hold integers, got dtype {t.dtype}")
        lo, hi = int(t.min()), int(t.max())
        if dtype == torch.int32 and (lo < 0 or hi >= MAX_TOKEN_ID):
            raise ReplayInputError(f"group {gid!r}: `{name}` holds token id {lo if lo < 0 else hi}; token ids "
                                   f"must lie in [0, 2**31) (they are stored as int32)")
    return t.detach().to("cpu", dtype).contiguous()


def _as_mask(name: str, value, gid) -> torch.Tensor:
    """A 0/1 mask (bool, or numbers that are exactly 0 or 1) as a bool tensor."""
    t = _tensor(name, value, gid)
    if t.dtype != torch.bool and t.numel() and not bool(((t == 0) | (t == 1)).all()):
        raise ReplayInputError(f"group {gid!r}: `{name}` must hold only 0/1 (or bools), got {t.unique().tolist()}")
    return t.detach().to("cpu").bool().contiguous()


def check_logprobs(name: str, logprobs: torch.Tensor, mask: torch.Tensor, where: str) -> None:
    """Raise if ``logprobs`` has a NaN/inf or a positive value at a ``mask`` position."""
    sel = logprobs[mask]
    if sel.numel() == 0:
        return
    bad = ~torch.isfinite(sel)
    if bool(bad.any()):
        raise ReplayInputError(
            f"{where}: `{name}` has {int(bad.sum())} non-finite value(s) at loss-mask positions; "
            "log-probs must be finite (check the model's dtype / logits for overflow)"
        )
    top = float(sel.max())
    if top > LOGPROB_POSITIVE_TOLERANCE:
        raise ReplayInputError(
            f"{where}: `{name}` has a positive value {top:.4g}; log-probs must be <= 0. "
            "Pass log-probabilities, not probabilities or logits."
        )


@dataclass(frozen=True, eq=False)
class GroupRecord:
    """One prompt with its n sampled responses and their immutable generation-time state.

    Fields (shapes in the module glossary):
        group_id:          stable identifier (str or int), unique within a run.
        prompt_ids:        (P,) int32 prompt token ids, unpadded.
        completion_ids:    (T,) int32, the n completions concatenated.
        response_lengths:  (n,) int64, L_i, each >= 1; ``sum == T``.
        loss_mask:         (T,) bool, 1 where the policy generated the token and the loss counts it (T(g));
                           a response may have none (e.g. a truncated completion masked out of the
                           loss: it still counts for the group's outcome and advantages), but the
                           group needs at least one.
        logprobs:          (T,) float32 generation-time log pi_gen(a|s).
        advantages:        (n,) float32 response advantages A_i (finite).
        rewards:           (n,) float32 response rewards (finite).
        birth_step:        training step t0 at which the group was generated.
        extras:            name -> (T,) float32 token-level extras (e.g. ``ref_logprobs``).
        mm_inputs:         name -> tensor: the prompt's multimodal inputs (``pixel_values``, ``image_grid_thw``,
                           ...) as the processor produced them for ONE sample, stored once for the n
                           responses, dtype kept; leading axis free, trailing axes fixed per buffer
                           (see :mod:`hdreplay.store.multimodal`).  Empty for text groups.

    Construct with :meth:`from_responses` (lists of per-response tensors) or
    :meth:`from_padded` (right-padded ``(n, L)`` tensors); both validate and raise
    :class:`~hdreplay.errors.ReplayInputError` naming the field on bad input.
    """

    group_id: str | int
    prompt_ids: torch.Tensor
    completion_ids: torch.Tensor
    response_lengths: torch.Tensor
    loss_mask: torch.Tensor
    logprobs: torch.Tensor
    advantages: torch.Tensor
    rewards: torch.Tensor
    birth_step: int
    extras: Mapping[str, torch.Tensor] = field(default_factory=dict)
    mm_inputs: Mapping[str, torch.Tensor] = field(default_factory=dict)

    def __post_init__(self) -> None:
        gid = self.group_id
        if not isinstance(gid, (str, int)) or isinstance(gid, bool):
            raise ReplayInputError(f"group_id must be a str or int, got {type(gid).__name__}")
        set_ = object.__setattr__
        set_(self, "prompt_ids", _as_1d("prompt_ids", self.prompt_ids, torch.int32, gid))
        set_(self, "completion_ids", _as_1d("completion_ids", self.completion_ids, torch.int32, gid))
        set_(self, "response_lengths", _as_1d("response_lengths", self.response_lengths, torch.int64, gid))
        lm = _as_mask("loss_mask", self.loss_mask, gid)
        if lm.dim() != 1:
            raise ReplayInputError(f"group {gid!r}: `loss_mask` must be 1-D, got shape {tuple(lm.shape)}")
        set_(self, "loss_mask", lm)
        set_(self, "logprobs", _as_1d("logprobs", self.logprobs, torch.float32, gid))
        set_(self, "advantages", _as_1d("advantages", self.advantages, torch.float32, gid))
        set_(self, "rewards", _as_1d("rewards", self.rewards, torch.float32, gid))
        set_(self, "birth_step", check_step(f"group {gid!r}: birth_step", self.birth_step))
        if not isinstance(self.extras, Mapping):
            raise ReplayInputError(f"group {gid!r}: `extras` must be a mapping name -> (T,) tensor, "
                                   f"got {type(self.extras).__name__}")
        n = self.response_lengths.numel()
        T = self.completion_ids.numel()
        if n == 0:
            raise ReplayInputError(f"group {gid!r}: empty group (no responses); a group needs n >= 1 responses")
        if self.prompt_ids.numel() == 0:
            raise ReplayInputError(f"group {gid!r}: `prompt_ids` is empty; a group needs its prompt tokens")
        if bool((self.response_lengths < 1).any()):
            raise ReplayInputError(
                f"group {gid!r}: every response needs >= 1 completion token, got lengths "
                f"{self.response_lengths.tolist()}"
            )
        if int(self.response_lengths.sum()) != T:
            raise ReplayInputError(
                f"group {gid!r}: `response_lengths` sum to {int(self.response_lengths.sum())} but "
                f"`completion_ids` has {T} tokens; they must match"
            )
        for name in ("loss_mask", "logprobs"):
            if getattr(self, name).numel() != T:
                raise ReplayInputError(
                    f"group {gid!r}: `{name}` has {getattr(self, name).numel()} entries but "
                    f"`completion_ids` has {T}; one entry per completion token is required"
                )
        for name in ("advantages", "rewards"):
            v = getattr(self, name)
            if v.numel() != n:
                raise ReplayInputError(
                    f"group {gid!r}: `{name}` has {v.numel()} entries for {n} responses; one per response"
                )
            if not bool(torch.isfinite(v).all()):
                raise ReplayInputError(f"group {gid!r}: `{name}` has non-finite values {v.tolist()}")
        if not bool(self.loss_mask.any()):
            raise ReplayInputError(
                f"group {gid!r}: the loss mask is all zero, so T(g) is empty and Drift / Headroom are undefined; "
                "a group needs at least one generated (loss-mask) token. Skip such groups before ingress."
            )
        check_logprobs("logprobs", self.logprobs, self.loss_mask, f"group {gid!r}")
        set_(self, "logprobs", self.logprobs.masked_fill(~self.loss_mask, 0.0))
        extras = {}
        for key, val in dict(self.extras).items():
            if not isinstance(key, str):
                raise ReplayInputError(f"group {gid!r}: extras keys must be str, got {key!r}")
            t = _as_1d(f"extras[{key!r}]", val, torch.float32, gid)
            if t.numel() != T:
                raise ReplayInputError(
                    f"group {gid!r}: `extras[{key!r}]` has {t.numel()} entries; expected one per completion token ({T})"
                )
            if not bool(torch.isfinite(t[self.loss_mask]).all()):
                raise ReplayInputError(f"group {gid!r}: `extras[{key!r}]` is non-finite at loss-mask positions")
            extras[key] = t.masked_fill(~self.loss_mask, 0.0)
        set_(self, "extras", extras)
        set_(self, "mm_inputs", check_mm_inputs(self.mm_inputs, gid))

    # ------------------------------------------------------------------ construction
    @classmethod
    def from_responses(
        cls,
        *,
        group_id: str | int,
        prompt_ids,
        completion_ids: Sequence,
        logprobs: Sequence,
        advantages,
        rewards,
        birth_step: int,
        loss_masks: Sequence | None = None,
        extras: Mapping[str, Sequence] | None = None,
        mm_inputs: Mapping[str, torch.Tensor] | None = None,
    ) -> "GroupRecord":
        """Build from per-response sequences: ``completion_ids[i]: (L_i,)``, ``logprobs[i]: (L_i,)``,
        optional ``loss_masks[i]: (L_i,)`` (default all ones), ``extras[name][i]: (L_i,)``, and the
        prompt's ``mm_inputs`` (one sample, see the class docstring)."""
        gid = group_id
        comps = [_tensor(f"completion_ids[{i}]", c, gid).flatten()
                 for i, c in enumerate(_seq("completion_ids", completion_ids, gid))]
        lps = [_tensor(f"logprobs[{i}]", x, gid).flatten() for i, x in enumerate(_seq("logprobs", logprobs, gid))]
        if len(comps) == 0:
            raise ReplayInputError(f"group {gid!r}: empty group (no responses)")
        if len(lps) != len(comps):
            raise ReplayInputError(f"group {gid!r}: {len(lps)} log-prob sequences for {len(comps)} responses")
        for i, (c, lp) in enumerate(zip(comps, lps)):
            if lp.numel() != c.numel():
                raise ReplayInputError(
                    f"group {gid!r}: response {i} has {c.numel()} tokens but {lp.numel()} log-probs; they must match"
                )
        if loss_masks is None:
            masks = [torch.ones(c.numel(), dtype=torch.bool) for c in comps]
        else:
            masks = [_as_mask(f"loss_masks[{i}]", m, gid).flatten()
                     for i, m in enumerate(_seq("loss_masks", loss_masks, gid))]
            if len(masks) != len(comps):
                raise ReplayInputError(f"group {gid!r}: {len(masks)} loss masks for {len(comps)} responses")
            for i, (c, m) in enumerate(zip(comps, masks)):
                if m.numel() != c.numel():
                    raise ReplayInputError(
                        f"group {gid!r}: response {i} has {c.numel()} tokens but a loss mask of {m.numel()}"
                    )
        if extras is not None and not isinstance(extras, Mapping):
            raise ReplayInputError(f"group {gid!r}: `extras` must be a mapping name -> per-response sequences")
        ex = {k: torch.cat([_tensor(f"extras[{k!r}]", x, gid).flatten() for x in _seq(f"extras[{k!r}]", v, gid)])
              for k, v in (extras or {}).items()}
        return cls(
            group_id=gid,
            prompt_ids=prompt_ids,
            completion_ids=torch.cat(comps),  # no dtype cast here: float "ids" must reach the check
            response_lengths=torch.tensor([c.numel() for c in comps], dtype=torch.int64),
            loss_mask=torch.cat(masks),
            logprobs=torch.cat(lps),
            advantages=advantages,
            rewards=rewards,
            birth_step=birth_step,
            extras=ex,
            mm_inputs={} if mm_inputs is None else mm_inputs,
        )

    @classmethod
    def from_padded(
        cls,
        *,
        group_id: str | int,
        prompt_ids,
        completion_ids: torch.Tensor,
        completion_mask: torch.Tensor,
        logprobs: torch.Tensor,
        advantages,
        rewards,
        birth_step: int,
        loss_mask: torch.Tensor | None = None,
        extras: Mapping[str, torch.Tensor] | None = None,
        mm_inputs: Mapping[str, torch.Tensor] | None = None,
    ) -> "GroupRecord":
        """Build from right-padded tensors.

        Args:
            completion_ids:  (n, L) token ids, right-padded.
            completion_mask: (n, L) 1 for real tokens (a contiguous prefix of each row).
            logprobs:        (n, L) generation-time token log-probs.
            loss_mask:       optional (n, L) 1 where the policy generated the token
                             (completion_mask x tool_mask); defaults to ``completion_mask``.
            extras:          name -> (n, L) float tensors.
            mm_inputs:       the prompt's multimodal inputs, one sample (see the class docstring).
        """
        gid = group_id
        ids = _tensor("completion_ids", completion_ids, gid)
        if ids.dim() != 2:
            raise ReplayInputError(f"group {gid!r}: `completion_ids` must be (n, L), got {tuple(ids.shape)}")
        if extras is not None and not isinstance(extras, Mapping):
            raise ReplayInputError(f"group {gid!r}: `extras` must be a mapping name -> (n, L) tensor")
        shape = tuple(ids.shape)
        tensors = {"completion_mask": _as_mask("completion_mask", completion_mask, gid),
                   "logprobs": _tensor("logprobs", logprobs, gid)}
        if loss_mask is not None:
            tensors["loss_mask"] = _as_mask("loss_mask", loss_mask, gid)
        for k, v in (extras or {}).items():
            tensors[f"extras[{k!r}]"] = _tensor(f"extras[{k!r}]", v, gid)
        for name, t in tensors.items():
            if tuple(t.shape) != shape:
                raise ReplayInputError(
                    f"group {gid!r}: `{name}` has shape {tuple(t.shape)}, expected {shape} like `completion_ids`"
                )
        cmb = tensors["completion_mask"]
        lengths = cmb.sum(dim=1)
        ar = torch.arange(shape[1], device=cmb.device).unsqueeze(0)
        if not bool((cmb == (ar < lengths.unsqueeze(1))).all()):
            raise ReplayInputError(
                f"group {gid!r}: `completion_mask` must be a contiguous prefix of ones per row "
                "(right padding); got holes inside a row — put tool-token masking in `loss_mask`"
            )
        lm = cmb if loss_mask is None else (tensors["loss_mask"] & cmb)
        return cls(
            group_id=gid,
            prompt_ids=prompt_ids,
            completion_ids=ids[cmb],
            response_lengths=lengths.cpu(),
            loss_mask=lm[cmb],
            logprobs=tensors["logprobs"][cmb],
            advantages=advantages,
            rewards=rewards,
            birth_step=birth_step,
            extras={k: tensors[f"extras[{k!r}]"][cmb] for k in (extras or {})},
            mm_inputs={} if mm_inputs is None else mm_inputs,
        )

    def clone(self) -> "GroupRecord":
        """A record owning copies of every tensor (no re-validation: this one was validated)."""
        rec = object.__new__(GroupRecord)
        for f in ("prompt_ids", "completion_ids", "response_lengths", "loss_mask", "logprobs", "advantages",
                  "rewards"):
            object.__setattr__(rec, f, getattr(self, f).clone())
        object.__setattr__(rec, "group_id", self.group_id)
        object.__setattr__(rec, "birth_step", self.birth_step)
        object.__setattr__(rec, "extras", {k: v.clone() for k, v in self.extras.items()})
        object.__setattr__(rec, "mm_inputs", {k: v.clone() for k, v in self.mm_inputs.items()})
        return rec

    # ------------------------------------------------------------------ views
    @property
    def num_responses(self) -> int:
        return self.response_lengths.numel()

    @property
    def num_tokens(self) -> int:
        """T: completion tokens, loss-mask or not."""
        return self.completion_ids.numel()

    @property
    def mm_nbytes(self) -> int:
        """Bytes of the stored multimodal inputs (one copy for the group)."""
        return sum(t.numel() * t.element_size() for t in self.mm_inputs.values())

    @property
    def num_loss_tokens(self) -> int:
        """|T(g)|: loss-mask tokens."""
        return int(self.loss_mask.sum())

    def response_index(self) -> torch.Tensor:
        """(T,) int64: which response each completion token belongs to."""
        return torch.repeat_interleave(torch.arange(self.num_responses), self.response_lengths)

    def token_advantages(self) -> torch.Tensor:
        """(T,) float32: A_i broadcast to the tokens of response i."""
        return self.advantages[self.response_index()]

    def responses(self) -> list[torch.Tensor]:
        """The n completions as a list of ``(L_i,)`` int32 tensors."""
        return list(torch.split(self.completion_ids, self.response_lengths.tolist()))

    def split(self, flat: torch.Tensor) -> list[torch.Tensor]:
        """Split a ``(T,)`` tensor aligned with ``completion_ids`` into n ``(L_i,)`` pieces."""
        return list(torch.split(flat, self.response_lengths.tolist()))

    def age(self, step: int) -> int:
        """age_t(g) = t - t0(g)."""
        return step - self.birth_step

    def __repr__(self) -> str:  # short: tensors are big
        return (
            f"GroupRecord(group_id={self.group_id!r}, n={self.num_responses}, P={self.prompt_ids.numel()}, "
            f"T={self.num_tokens}, |T(g)|={self.num_loss_tokens}, birth_step={self.birth_step}"
            + (f", mm_inputs={sorted(self.mm_inputs)}" if self.mm_inputs else "") + ")"
        )

