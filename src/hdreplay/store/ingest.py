"""Rows -> groups: the one function every trainer calls to turn its fresh rows into GroupRecords.

A trainer hands over its batch as :class:`Rows` (N trajectories, padded; shape glossary of
:mod:`hdreplay.store.record`; C = padded completion width):

    prompt_ids       (N, P)   prompt token ids, padded on either side
    prompt_mask      (N, P)   1 on real prompt tokens
    completion_ids   (N, C)   response token ids, right-padded (tool / observation tokens included)
    completion_mask  (N, C)   1 on real response tokens (a prefix of each row)
    loss_mask        (N, C)   1 where the policy generated the token (tool tokens 0); default completion_mask
    logprobs         (N, C)   generation-time log-probs log pi_gen
    advantages       (N,)     A_i, or (N, C) token-level values that must be constant over the row's loss tokens
    rewards          (N,)     total reward of each row
    extras           name -> (N, C) token-level values stored with the group (e.g. ``ref_logprobs``)

and :func:`groups_from_rows` groups them (rows with one key, e.g. verl's ``uid``, or consecutive blocks of
``group_size`` rows, TRL's order) and builds the records.  Every check of a fresh batch is here, in this order:

=============================  ====================================================  ==========================
check                          on failure                                            reported as
=============================  ====================================================  ==========================
row shapes agree               the batch cannot be read                              :class:`IngestError`
advantages one per response    a token-level estimator (GAE) cannot be stored        :class:`IngestError`
whole groups (no keys)         N is not a multiple of group_size                     :class:`IngestError`
rows per key == group_size     a group lost rows (filtered, truncated batch)         ``problems`` (skipped)
one prompt per group           rows of one group disagree on their prompt            :class:`IngestError`
a loss token in the group      T(g) empty (e.g. every response truncated)            ``empty`` (skipped)
multimodal inputs              the caller's ``mm_inputs`` hook gives a reason        ``problems`` (skipped)
the GroupRecord checks         token ids, log-probs, finiteness (:mod:`.record`)     ``problems`` (skipped)
the buffer's multimodal schema a text prompt in an image buffer, another processor   ``problems`` (skipped)
=============================  ====================================================  ==========================

Which stored groups may enter the buffer is the ingress rule's decision (:mod:`hdreplay.ingress`), applied by
:meth:`ReplayController.stage <hdreplay.controller.ReplayController.stage>`: ingest builds, the rule admits.

>>> import torch
>>> rows = Rows(prompt_ids=torch.tensor([[5, 6]] * 4), prompt_mask=torch.ones(4, 2),
...             completion_ids=torch.tensor([[1, 2, 0], [3, 0, 0], [4, 4, 4], [2, 0, 0]]),
...             completion_mask=torch.tensor([[1, 1, 0], [1, 0, 0], [1, 1, 1], [1, 0, 0]]),
...             logprobs=torch.full((4, 3), -0.5), advantages=torch.tensor([1.0, -1.0, 0.5, -0.5]),
...             rewards=torch.tensor([1.0, 0.0, 1.0, 0.0]))
>>> out = groups_from_rows(rows, step=3, group_size=2, group_id=lambda k: f"s3g{k}")
>>> [g.group_id for g in out.groups], [g.num_tokens for g in out.groups], out.num_groups
(['s3g0', 's3g1'], [3, 4], 2)
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Hashable, Mapping, Sequence

import torch

from ..errors import IngestError, ReplayInputError
from ..validate import MAX_COUNT, check_int, check_step
from .multimodal import Schema, schema_difference, schema_of
from .record import GroupRecord

#: relative tolerance of the one-advantage-per-response check (token-level advantages written in float32)
ADVANTAGE_TOLERANCE = 1e-5

MmHook = Callable[[list[int]], "tuple[dict[str, torch.Tensor], str | None]"]
"""Takes the row indices of one group; returns the group's multimodal inputs (one sample) and None, or
``({}, reason)`` when the group cannot be stored (e.g. its rows disagree on their images)."""


def _as(name: str, value: Any, dim: tuple[int, ...]) -> torch.Tensor:
    if not isinstance(value, torch.Tensor):
        raise IngestError(f"rows.{name}: must be a torch.Tensor, got {type(value).__name__}")
    if value.dim() not in dim:
        raise IngestError(f"rows.{name}: must be {' or '.join(f'{d}-D' for d in dim)}, got shape {tuple(value.shape)}")
    return value.detach().cpu()


@dataclass(frozen=True)
class Rows:
    """N trajectories of a trainer's batch in the canonical padded layout (module table); shapes are checked at
    construction and the tensors moved to the CPU (detached)."""

    prompt_ids: torch.Tensor
    prompt_mask: torch.Tensor
    completion_ids: torch.Tensor
    completion_mask: torch.Tensor
    logprobs: torch.Tensor
    advantages: torch.Tensor
    rewards: torch.Tensor
    loss_mask: torch.Tensor | None = None
    extras: Mapping[str, torch.Tensor] = field(default_factory=dict)

    def __post_init__(self) -> None:
        set_ = object.__setattr__
        for name in ("prompt_ids", "prompt_mask", "completion_ids", "completion_mask", "logprobs"):
            set_(self, name, _as(name, getattr(self, name), (2,)))
        set_(self, "advantages", _as("advantages", self.advantages, (1, 2)))
        set_(self, "rewards", _as("rewards", self.rewards, (1,)))
        if self.loss_mask is not None:
            set_(self, "loss_mask", _as("loss_mask", self.loss_mask, (2,)))
        if not isinstance(self.extras, Mapping):
            raise IngestError(f"rows.extras: must be a mapping name -> (N, C) tensor, got {type(self.extras).__name__}")
        set_(self, "extras", {k: _as(f"extras[{k!r}]", v, (2,)) for k, v in self.extras.items()})
        N, C = self.completion_ids.shape
        want = {"prompt_mask": tuple(self.prompt_ids.shape), "completion_mask": (N, C), "logprobs": (N, C),
                "rewards": (N,), "advantages": (N, C) if self.advantages.dim() == 2 else (N,)}
        if self.loss_mask is not None:
            want["loss_mask"] = (N, C)
        want.update({f"extras[{k!r}]": (N, C) for k in self.extras})
        if self.prompt_ids.shape[0] != N:
            raise IngestError(f"rows.prompt_ids: {self.prompt_ids.shape[0]} rows, completion_ids has {N}")
        for name, shape in want.items():
            t = self.extras[name[8:-2]] if name.startswith("extras[") else getattr(self, name)
            if tuple(t.shape) != shape:
                raise IngestError(f"rows.{name}: shape {tuple(t.shape)}, expected {shape} (N rows = {N}, "
                                  f"completion width C = {C})")

    @property
    def num_rows(self) -> int:
        return self.completion_ids.shape[0]

    def token_mask(self) -> torch.Tensor:
        """(N, C) bool: the tokens the loss counts (loss mask within the real completion)."""
        cm = self.completion_mask.bool()
        return cm if self.loss_mask is None else cm & self.loss_mask.bool()


@dataclass
class Ingest:
    """What :func:`groups_from_rows` made of a batch.

    groups:     the stored-ready GroupRecords, in first-appearance order of their key
    problems:   one message per group that cannot be stored (rows missing, multimodal inputs, record checks,
                schema), which the trainer reports and skips
    empty:      one message per group skipped because no response has a loss token (T(g) empty)
    num_groups: groups in the batch, stored or not (|G_on|)
    """

    groups: list[GroupRecord]
    problems: list[str]
    empty: list[str]
    num_groups: int


def response_advantages(advantages: torch.Tensor, mask: torch.Tensor, *, hint: str = "") -> torch.Tensor:
    """(N,) one advantage per row from token-level ``advantages`` / ``mask`` (N, C), checked to be constant over
    the row's mask tokens (0 for a row without any); raises :class:`IngestError` naming the row (``hint``: the
    trainer setting that produced them, e.g. ``"algorithm.adv_estimator=gae"``)."""
    adv = advantages.float().cpu()
    mask = mask.bool().cpu()
    first = torch.where(mask.any(dim=1), mask.float().argmax(dim=1), torch.zeros(len(adv), dtype=torch.long))
    value = adv.gather(1, first[:, None]).squeeze(1) * mask.any(dim=1)
    dev = ((adv - value[:, None]).abs() * mask).amax(dim=1) if adv.numel() else adv.new_zeros(len(adv))
    bad = dev > ADVANTAGE_TOLERANCE * (1 + value.abs())
    if bool(bad.any()):
        r = int(bad.nonzero()[0])
        raise IngestError(
            f"advantages vary within response row {r} (max deviation {float(dev[r]):.3g})"
            f"{' under ' + hint if hint else ''}: hdreplay stores one advantage per response (GRPO-style outcome "
            "estimators such as grpo, rloo, grpo_passk, gpg, opo)")
    return value


def split_by_schema(groups: list[GroupRecord], schema: Schema | None) -> tuple[list[GroupRecord], list[str]]:
    """Groups whose multimodal inputs fit ``schema`` (the buffer's; None = the first group's), and one message
    per group that does not (e.g. a text-only prompt in a vision-language run): those are skipped at ingress
    instead of failing the step, since the buffer would refuse them."""
    ok, problems = [], []
    for g in groups:
        have = schema_of(g.mm_inputs)
        schema = have if schema is None else schema
        why = schema_difference(have, schema)
        if why is None:
            ok.append(g)
        else:
            problems.append(f"group {g.group_id!r} not stored: its multimodal inputs differ from the buffer's ({why})")
    return ok, problems


def _group_rows(n_rows: int, keys: Sequence[Hashable] | None, only: Sequence[int] | None, size: int,
                size_name: str) -> dict[Hashable, list[int]]:
    """key -> its row indices (first-appearance order); without keys: consecutive blocks of ``size``."""
    index = list(range(n_rows)) if only is None else [int(i) for i in only]
    if keys is None:
        if len(index) % size:
            raise IngestError(f"{len(index)} rows do not form groups of {size_name}={size}")
        return {k: index[k * size:(k + 1) * size] for k in range(len(index) // size)}
    if len(keys) != n_rows:
        raise IngestError(f"keys: {len(keys)} group keys for {n_rows} rows; one per row")
    out: dict[Hashable, list[int]] = {}
    for i in index:
        out.setdefault(keys[i], []).append(i)
    return out


def rows_from_responses(prompt_ids: torch.Tensor, completion_ids: Sequence[torch.Tensor],
                        logprobs: Sequence[torch.Tensor], *, advantages: Sequence[float] | torch.Tensor,
                        rewards: Sequence[float] | torch.Tensor, loss_masks: Sequence[torch.Tensor] | None = None,
                        extras: Mapping[str, Sequence[torch.Tensor]] | None = None) -> Rows:
    """One group kept as its prompt and n unpadded responses (what an asynchronous sampler hands over: TRL async
    GRPO's samples, verl's stale groups) as :class:`Rows` for :func:`groups_from_rows`.

    Shapes: ``prompt_ids`` (P,); ``completion_ids`` / ``logprobs`` / ``loss_masks`` / each ``extras`` list: n
    tensors (L_i,); ``advantages``, ``rewards``: (n,).  Responses are right-padded to the longest; every real token
    is a completion token (``completion_mask``), ``loss_masks`` (default: all 1) says which the policy generated.
    """
    prompt_ids = torch.as_tensor(prompt_ids)
    if prompt_ids.dim() != 1 or prompt_ids.is_floating_point():
        raise IngestError(f"prompt_ids: must be 1-D integer token ids, got shape {tuple(prompt_ids.shape)} "
                          f"{prompt_ids.dtype}")
    n = len(completion_ids)
    if n == 0 or len(logprobs) != n or (loss_masks is not None and len(loss_masks) != n):
        raise IngestError(f"completion_ids ({n}), logprobs ({len(logprobs)}) and loss_masks must list the same "
                          "responses, at least one")
    lens = [int(torch.as_tensor(c).numel()) for c in completion_ids]
    C = max(lens)
    for name, parts in (("extras[" + repr(k) + "]", v) for k, v in (extras or {}).items()):
        if len(parts) != n:
            raise IngestError(f"{name}: {len(parts)} responses, completion_ids has {n}")

    def pad(parts, dtype, name):
        out = torch.zeros(n, C, dtype=dtype)
        for i, x in enumerate(parts):
            x = torch.as_tensor(x).reshape(-1)
            if x.numel() != lens[i]:
                raise IngestError(f"{name}: response {i}: {x.numel()} values for {lens[i]} completion tokens")
            if name == "loss_masks":  # 0/1 in any dtype (a float mask of 0.0 / 1.0 is fine)
                if not bool(((x == 0) | (x == 1)).all()):
                    raise IngestError(f"loss_masks: response {i}: values must be 0 or 1")
            elif dtype == torch.int64 and (x.is_floating_point() or x.is_complex()):
                raise IngestError(f"{name}: response {i}: integer values expected, got {x.dtype}")
            out[i, :lens[i]] = x.to(dtype)
        return out

    mask = torch.zeros(n, C, dtype=torch.int64)
    for i, L in enumerate(lens):
        mask[i, :L] = 1
    return Rows(prompt_ids=prompt_ids.reshape(1, -1).expand(n, -1).clone(),
                prompt_mask=torch.ones(n, prompt_ids.numel(), dtype=torch.int64),
                completion_ids=pad(completion_ids, torch.int64, "completion_ids"), completion_mask=mask,
                loss_mask=None if loss_masks is None else pad(loss_masks, torch.int64, "loss_masks"),
                logprobs=pad(logprobs, torch.float32, "logprobs"),
                advantages=torch.as_tensor(advantages, dtype=torch.float32),
                rewards=torch.as_tensor(rewards, dtype=torch.float32),
                extras={k: pad(v, torch.float32, f"extras[{k!r}]") for k, v in (extras or {}).items()})


def one_group(rows: Rows, *, step: int, group_id: str | int) -> GroupRecord:
    """The single group of ``rows`` (all of them one group) through :func:`groups_from_rows`; raises
    :class:`IngestError` naming what kept it out (a group an asynchronous sampler hands over is stored whole or not
    at all)."""
    out = groups_from_rows(rows, step=step, group_size=rows.num_rows, group_id=lambda _: group_id)
    if not out.groups:
        raise IngestError("; ".join(out.problems + out.empty))
    return out.groups[0]


def groups_from_rows(
    rows: Rows,
    *,
    step: int,
    group_size: int,
    keys: Sequence[Hashable] | None = None,
    only: Sequence[int] | None = None,
    group_id: Callable[[Hashable], str | int] = lambda key: key,
    mm_inputs: MmHook | None = None,
    schema: Schema | None = None,
    key_name: str = "group",
    size_name: str = "group_size",
    hint: str = "",
) -> Ingest:
    """Build the GroupRecords of a fresh batch, every check in one place (module table).

    Args:
        rows: the batch (:class:`Rows`).
        step: the step the rows were generated at (the groups' birth step).
        group_size: n, responses per group.
        keys: (N,) the group key of each row (verl's ``uid``); None = groups are consecutive blocks of
            ``group_size`` rows, keyed 0, 1, ... (TRL's sampler order).
        only: the row indices that are trajectories (others, e.g. a framework's padding rows, are ignored);
            None = all rows.
        group_id: the stored group id of a key (unique within the run).
        mm_inputs: a vision-language batch's hook (:data:`MmHook`); None = text rows.
        schema: the buffer's multimodal schema (``ReplayBuffer.mm_schema``); None = the first stored group's.
        key_name, size_name, hint: how the trainer spells a group key (``"uid"``), the group size setting
            (``"rollout.n"``) and the setting that produced the advantages, for the messages.
    Returns:
        an :class:`Ingest`.
    Raises:
        IngestError for a batch that cannot be read at all (see the module table).
    """
    if not isinstance(rows, Rows):
        raise ReplayInputError(f"rows: must be hdreplay.store.ingest.Rows, got {type(rows).__name__}")
    step = check_step("step", step)
    n = check_int("group_size", group_size, lo=1, hi=MAX_COUNT)
    if not callable(group_id) or (mm_inputs is not None and not callable(mm_inputs)):
        raise ReplayInputError("group_id and mm_inputs must be callables (mm_inputs may be None)")
    lm = rows.token_mask()
    adv = (response_advantages(rows.advantages, rows.loss_mask if rows.loss_mask is not None
                               else rows.completion_mask, hint=hint)
           if rows.advantages.dim() == 2 else rows.advantages.float())
    rewards = rows.rewards.float()
    pm = rows.prompt_mask.bool()
    of = _group_rows(rows.num_rows, keys, only, n, size_name)
    groups, problems, empty = [], [], []
    for key, idx in of.items():
        gid = group_id(key)
        label = f"{key_name} {key!r}" if keys is not None else f"group {gid!r}"
        if len(idx) != n:
            problems.append(f"{label}: {len(idx)} rows, expected {size_name}={n}")
            continue
        prompt = rows.prompt_ids[idx[0]][pm[idx[0]]]
        for i in idx[1:]:
            if not torch.equal(rows.prompt_ids[i][pm[i]], prompt):
                raise IngestError(f"rows {idx} of {label} do not share one prompt; the rows of a GRPO group must "
                                  "share their prompt (the sampler yields each prompt group_size times)")
        t = torch.tensor(idx)
        if not bool(lm[t].any()):
            empty.append(f"group {gid!r}: the loss mask is all zero, so T(g) is empty (e.g. every response "
                         "truncated under mask_truncated_completions); not stored")
            continue
        inputs, why = mm_inputs(idx) if mm_inputs is not None else ({}, None)
        if why is not None:
            problems.append(f"{label}: {why}")
            continue
        try:
            groups.append(GroupRecord.from_padded(
                group_id=gid, prompt_ids=prompt, completion_ids=rows.completion_ids[t],
                completion_mask=rows.completion_mask[t], logprobs=rows.logprobs[t], loss_mask=lm[t],
                advantages=adv[t], rewards=rewards[t], birth_step=step,
                extras={k: v[t] for k, v in rows.extras.items()}, mm_inputs=inputs,
            ))
        except ReplayInputError as e:
            problems.append(str(e))
    groups, unfit = split_by_schema(groups, schema)
    return Ingest(groups, problems + unfit, empty, len(of))
