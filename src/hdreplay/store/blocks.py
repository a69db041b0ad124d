"""Ragged block storage: how :class:`~hdreplay.store.buffer.ReplayBuffer` keeps groups, and their checkpoint form.

Groups appended in one call form blocks (of at most :data:`BLOCK_GROUPS` groups) of flat tensors
with no padding: int32 token ids, float32 log-probs, a bool loss mask (omitted when it is all ones,
the single-turn case), int64 response lengths, float32 advantages and rewards, with int64 offsets
telling where each group's slice starts.  Because eviction is FIFO, blocks leave from the front; a
partly evicted front block is replaced by a compacted copy (:meth:`Block.tail`), so stored bytes
track the live groups and an eviction copies at most one small block.

Nothing handed out aliases the storage: :func:`copy_groups` returns copies, so a caller that edits
a replayed group in place (normalising advantages, a scorer that writes into its input) cannot
change what is stored.

Checkpoint form (one flat tensor per field over all live groups, see :meth:`Block.to_tensors`) is
written straight from the blocks (:func:`checkpoint_tensors`: pieces streamed to disk, no copy of the state)
and validated field by field when read back (:meth:`Block.from_tensors`): dtypes, lengths, offsets,
token-id range, mask values, finiteness, the sign of log-probs, one loss token per group at least.  The
buffer's per-group slot arrays (cached Headroom, counters) are named in :data:`SLOT_FIELDS`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Mapping, Sequence

import numpy as np
import torch

from ..checkpoint.tensorfile import FileTensor, Streamed, rows
from ..errors import CheckpointError
from .multimodal import Ragged, Schema
from .record import LOGPROB_POSITIVE_TOLERANCE, GroupRecord

#: checkpoint tensors of the group payload and their dtypes (``extra.<name>``: float32 each)
PAYLOAD_DTYPES = {
    "prompt": torch.int32, "prompt_off": torch.int64, "tokens": torch.int32, "logprobs": torch.float32,
    "tok_off": torch.int64, "resp_len": torch.int64, "advantages": torch.float32, "rewards": torch.float32,
    "resp_off": torch.int64, "loss_mask": torch.uint8,
}
#: groups per block at most: appends and loads are cut into blocks of this size, so evicting from the
#: front copies at most one small block and the commit cost stays flat (after a load, too)
BLOCK_GROUPS = 64
#: per-group mutable state the buffer keeps beside the blocks, one array per name indexed by slot
#: (``insertion_id % L``), and the checkpoint tensor ``slot.<name>`` of each
SLOT_FIELDS: dict[str, type] = {
    "insertion_id": np.int64, "birth_step": np.int64, "cached_headroom": np.float64,
    "ref_headroom": np.float64, "refresh_step": np.int64, "replay_count": np.int64,
    "exposure": np.float64, "num_loss_tokens": np.int64,
    # consecutive scans that rejected the group; the first step the scan may consider it again (skip_rejected)
    "reject_streak": np.int64, "skip_until": np.int64,
}


def bulk(name: str) -> bool:
    """Whether checkpoint tensor ``name`` is the size of the tokens or images (read one block at a time on load)."""
    return name in ("prompt", "tokens", "logprobs", "loss_mask") or name.startswith(("extra.", "mm."))


def _record(group_id, birth_step, prompt, tokens, resp_len, mask, logprobs, advantages, rewards,
            extras, mm_inputs) -> GroupRecord:
    rec = object.__new__(GroupRecord)  # the stored data was validated on the way in
    for k, v in dict(group_id=group_id, prompt_ids=prompt, completion_ids=tokens, response_lengths=resp_len,
                     loss_mask=mask, logprobs=logprobs, advantages=advantages, rewards=rewards,
                     birth_step=birth_step, extras=extras, mm_inputs=mm_inputs).items():
        object.__setattr__(rec, k, v)
    return rec


def copy_groups(items: Sequence[tuple["Block", int]]) -> list[GroupRecord]:
    """Copies of groups ``(block, j)``: one new tensor per field holds all of them (one ``cat`` each), and
    each returned record views its slice of those new tensors, never the blocks' storage."""
    if not items:
        return []
    spans = [blk.spans(j) for blk, j in items]
    ntok = [t1 - t0 for t0, t1, *_ in spans]
    nresp = [r1 - r0 for _, _, r0, r1, _, _ in spans]
    nprompt = [p1 - p0 for *_, p0, p1 in spans]

    def gather(name: str, lo: int, hi: int, sizes: list[int]) -> tuple[torch.Tensor, ...]:
        return torch.cat([getattr(blk, name)[sp[lo]:sp[hi]] for (blk, _), sp in zip(items, spans)]).split(sizes)

    masks = torch.cat([torch.ones(n, dtype=torch.bool) if blk.loss_mask is None else blk.loss_mask[sp[0]:sp[1]]
                       for (blk, _), sp, n in zip(items, spans, ntok)]).split(ntok)
    tokens, logprobs = gather("tokens", 0, 1, ntok), gather("logprobs", 0, 1, ntok)
    resp_len, adv, rew = gather("resp_len", 2, 3, nresp), gather("advantages", 2, 3, nresp), \
        gather("rewards", 2, 3, nresp)
    prompt = gather("prompt", 4, 5, nprompt)
    keys = list(items[0][0].extras)
    extras = {k: torch.cat([blk.extras[k][sp[0]:sp[1]] for (blk, _), sp in zip(items, spans)]).split(ntok)
              for k in keys}
    mm = [blk.mm.gather([j])[0] for blk, j in items]  # copies (one per group: image tensors are large anyway)
    return [_record(blk.group_ids[j], blk.birth_steps[j], prompt[i], tokens[i], resp_len[i], masks[i],
                    logprobs[i], adv[i], rew[i], {k: extras[k][i] for k in keys}, mm[i])
            for i, (blk, j) in enumerate(items)]


def _offsets(lengths: Iterable[int]) -> np.ndarray:
    return np.concatenate([[0], np.cumsum(list(lengths), dtype=np.int64)]).astype(np.int64)


@dataclass
class Block:
    """Flat storage of groups with consecutive insertion ids ``first_id .. first_id + count - 1``."""

    first_id: int
    group_ids: list
    birth_steps: list[int]
    prompt: torch.Tensor  # (sum P,) int32
    prompt_off: np.ndarray  # (k+1,) int64
    tokens: torch.Tensor  # (sum T,) int32
    logprobs: torch.Tensor  # (sum T,) float32
    loss_mask: torch.Tensor | None  # (sum T,) bool, None == all ones
    tok_off: np.ndarray  # (k+1,) int64
    resp_len: torch.Tensor  # (sum n,) int64
    advantages: torch.Tensor  # (sum n,) float32
    rewards: torch.Tensor  # (sum n,) float32
    resp_off: np.ndarray  # (k+1,) int64
    extras: dict[str, torch.Tensor]  # name -> (sum T,) float32
    mm: Ragged  # multimodal prompt inputs, one copy per group (empty for text groups)

    @property
    def count(self) -> int:
        return len(self.group_ids)

    def _tensors(self) -> list[torch.Tensor]:
        ts = [self.prompt, self.tokens, self.logprobs, self.resp_len, self.advantages, self.rewards,
              *self.extras.values()]
        return ts if self.loss_mask is None else [*ts, self.loss_mask]

    @property
    def nbytes(self) -> int:
        offsets = self.prompt_off.nbytes + self.tok_off.nbytes + self.resp_off.nbytes
        return sum(t.numel() * t.element_size() for t in self._tensors()) + offsets + self.mm.nbytes

    @classmethod
    def build(cls, first_id: int, records: Sequence[GroupRecord]) -> "Block":
        """Copy validated records into one block (the records share no memory with it afterwards)."""
        masks = [r.loss_mask for r in records]
        all_ones = all(bool(m.all()) for m in masks)
        keys = sorted(records[0].extras) if records else []
        return cls(
            first_id=first_id,
            group_ids=[r.group_id for r in records],
            birth_steps=[r.birth_step for r in records],
            prompt=torch.cat([r.prompt_ids for r in records]),
            prompt_off=_offsets(r.prompt_ids.numel() for r in records),
            tokens=torch.cat([r.completion_ids for r in records]),
            logprobs=torch.cat([r.logprobs for r in records]),
            loss_mask=None if all_ones else torch.cat(masks),
            tok_off=_offsets(r.num_tokens for r in records),
            resp_len=torch.cat([r.response_lengths for r in records]),
            advantages=torch.cat([r.advantages for r in records]),
            rewards=torch.cat([r.rewards for r in records]),
            resp_off=_offsets(r.num_responses for r in records),
            extras={k: torch.cat([r.extras[k] for r in records]) for k in keys},
            mm=Ragged.build([r.mm_inputs for r in records]),
        )

    def spans(self, j: int) -> tuple[int, int, int, int, int, int]:
        """(t0, t1, r0, r1, p0, p1): group j's token, response and prompt ranges."""
        return (int(self.tok_off[j]), int(self.tok_off[j + 1]), int(self.resp_off[j]), int(self.resp_off[j + 1]),
                int(self.prompt_off[j]), int(self.prompt_off[j + 1]))

    def view(self, j: int) -> GroupRecord:
        """Group j as views of this block's storage: internal use only (never handed out; see
        :func:`copy_groups`).  The benchmark compares its cost with the copies."""
        t0, t1, r0, r1, p0, p1 = self.spans(j)
        mask = torch.ones(t1 - t0, dtype=torch.bool) if self.loss_mask is None else self.loss_mask[t0:t1]
        return _record(self.group_ids[j], self.birth_steps[j], self.prompt[p0:p1], self.tokens[t0:t1],
                       self.resp_len[r0:r1], mask, self.logprobs[t0:t1], self.advantages[r0:r1],
                       self.rewards[r0:r1], {k: v[t0:t1] for k, v in self.extras.items()}, self.mm.view(j))

    def slice(self, start: int, stop: int) -> "Block":
        """A block owning copies of groups ``start..stop-1``."""
        t0, t1 = int(self.tok_off[start]), int(self.tok_off[stop])
        r0, r1 = int(self.resp_off[start]), int(self.resp_off[stop])
        p0, p1 = int(self.prompt_off[start]), int(self.prompt_off[stop])
        return Block(
            first_id=self.first_id + start,
            group_ids=self.group_ids[start:stop],
            birth_steps=self.birth_steps[start:stop],
            prompt=rows(self.prompt, p0, p1),
            prompt_off=self.prompt_off[start:stop + 1] - p0,
            tokens=rows(self.tokens, t0, t1),
            logprobs=rows(self.logprobs, t0, t1),
            loss_mask=None if self.loss_mask is None else rows(self.loss_mask, t0, t1),
            tok_off=self.tok_off[start:stop + 1] - t0,
            resp_len=rows(self.resp_len, r0, r1),
            advantages=rows(self.advantages, r0, r1),
            rewards=rows(self.rewards, r0, r1),
            resp_off=self.resp_off[start:stop + 1] - r0,
            extras={k: rows(v, t0, t1) for k, v in self.extras.items()},
            mm=self.mm.slice(start, stop),
        )

    def tail(self, start: int) -> "Block":
        """A compacted copy holding groups ``start..count-1`` (the front ones evicted)."""
        return self.slice(start, self.count)

    # ------------------------------------------------------------------ checkpoint form
    def to_tensors(self) -> dict[str, torch.Tensor]:
        """The checkpoint tensors (see :data:`PAYLOAD_DTYPES`)."""
        mask = torch.ones(self.tokens.numel(), dtype=torch.bool) if self.loss_mask is None else self.loss_mask
        out = {
            "prompt": self.prompt, "prompt_off": torch.from_numpy(self.prompt_off), "tokens": self.tokens,
            "logprobs": self.logprobs, "tok_off": torch.from_numpy(self.tok_off), "resp_len": self.resp_len,
            "advantages": self.advantages, "rewards": self.rewards, "resp_off": torch.from_numpy(self.resp_off),
            "loss_mask": mask.to(torch.uint8),
        }
        out.update({f"extra.{k}": v for k, v in self.extras.items()})
        out.update(self.mm.to_tensors())
        return out

    def loss_tokens(self) -> np.ndarray:
        """(count,) int64 loss-mask tokens per group."""
        if self.loss_mask is None:
            return np.diff(self.tok_off)
        return np.add.reduceat(self.loss_mask.numpy(), self.tok_off[:-1], dtype=np.int64)  # (>= 1 token per group)

    @classmethod
    def from_tensors(cls, tensors: Mapping[str, "torch.Tensor | FileTensor"], *, first_id: int, group_ids: list,
                     birth_steps: list, extras_keys: Sequence[str], where: str, mm_schema: Schema | None = None,
                     size: int = BLOCK_GROUPS) -> list["Block"]:
        """Validate checkpoint tensors of ``len(group_ids) >= 1`` groups (multimodal ones against ``mm_schema``), cut
        into blocks of at most ``size`` groups that own their memory.  The :func:`bulk` tensors may be
        :class:`~hdreplay.checkpoint.tensorfile.FileTensor`: they are read (and checked) one block at a time."""
        k = len(group_ids)

        def bad(msg: str) -> CheckpointError:
            return CheckpointError(f"{where}: {msg}; the checkpoint is corrupted or was edited")

        want = dict(PAYLOAD_DTYPES, **{f"extra.{e}": torch.float32 for e in extras_keys})
        t = {}
        for name, dtype in want.items():
            v = tensors.get(name)
            if not isinstance(v, (torch.Tensor, FileTensor)):
                raise bad(f"missing tensor {name!r}")
            if v.dtype != dtype or v.dim() != 1:
                raise bad(f"tensor {name!r} is {v.dtype} of shape {tuple(v.shape)}, expected a 1-D {dtype}")
            t[name] = v
        off = {}
        for name, data, what in (("prompt_off", "prompt", "prompt token"), ("tok_off", "tokens", "completion token"),
                                 ("resp_off", "resp_len", "response")):
            o = t[name].numpy()
            if o.size != k + 1 or o[0] != 0 or o[-1] != t[data].numel() or (np.diff(o) < 1).any():
                raise bad(f"offsets {name!r} do not describe {k} groups of >= 1 {what} each")
            off[name] = o
        if (t["resp_len"] < 1).any():
            raise bad("a response has length < 1")
        ends = np.concatenate([[0], np.cumsum(t["resp_len"].numpy(), dtype=np.int64)])[off["resp_off"]]
        if not np.array_equal(ends, off["tok_off"]):
            raise bad("response lengths do not add up to each group's completion tokens")
        for name in ("logprobs", "loss_mask", *(f"extra.{e}" for e in extras_keys)):
            if t[name].numel() != t["tokens"].numel():
                raise bad(f"{name!r} has {t[name].numel()} entries for {t['tokens'].numel()} completion tokens "
                          "(log-probs / loss mask must match the completion tokens)")
        for name in ("advantages", "rewards"):
            if t[name].numel() != t["resp_len"].numel() or not bool(torch.isfinite(t[name]).all()):
                raise bad(f"{name!r} has the wrong length or non-finite values")
        whole = cls(first_id=first_id, group_ids=list(group_ids), birth_steps=list(birth_steps), prompt=t["prompt"],
                    prompt_off=off["prompt_off"], tokens=t["tokens"], logprobs=t["logprobs"], loss_mask=t["loss_mask"],
                    tok_off=off["tok_off"], resp_len=t["resp_len"], advantages=t["advantages"], rewards=t["rewards"],
                    resp_off=off["resp_off"], extras={e: t[f"extra.{e}"] for e in extras_keys},
                    mm=Ragged.from_tensors(tensors, mm_schema, k, bad))  # (a view, its loss mask uint8)
        return [whole.slice(s, min(s + size, k))._checked(bad) for s in range(0, k, size)]

    def _checked(self, bad) -> "Block":
        """This block read from a checkpoint (its loss mask uint8), its values checked and its mask made bool."""
        for name in ("prompt", "tokens"):
            if getattr(self, name).numel() and int(getattr(self, name).min()) < 0:
                raise bad(f"{name!r} holds a negative token id")
        m, lp = self.loss_mask, self.logprobs
        if m.numel() and int(m.max()) > 1:
            raise bad("'loss_mask' holds values other than 0/1")
        mask = m.view(torch.bool)  # (0/1 bytes: a view)
        for a in range(0, lp.numel(), 1 << 16):  # (in pieces: small temporaries do not fragment the heap)
            k, x = ~mask[a:a + (1 << 16)], lp[a:a + (1 << 16)]
            if not bool((torch.isfinite(x) & (x <= LOGPROB_POSITIVE_TOLERANCE) | k).all()):
                raise bad("'logprobs' holds a non-finite or positive value at a loss-mask position")
            if bool(((x != 0) & k).any()):
                raise bad("'logprobs' is not 0 off the loss mask")
            for e, v in self.extras.items():
                x = v[a:a + (1 << 16)]
                if not bool((torch.isfinite(x) | k).all()) or bool(((x != 0) & k).any()):
                    raise bad(f"extra {e!r} holds non-finite values, or values off the loss mask")
        for k, x in self.mm.data.items():
            if x.is_floating_point() and x.numel() and not bool(torch.isfinite(x).all()):
                raise bad(f"'mm.{k}' holds non-finite values")
        self.loss_mask = None if bool(mask.all()) else mask
        if (self.loss_tokens() < 1).any():
            raise bad("a group has no loss-mask token")
        return self


def checkpoint_tensors(blocks: Sequence[Block]) -> dict[str, Streamed]:
    """The checkpoint tensors of consecutive ``blocks`` -- what :meth:`Block.to_tensors` gives for one block holding
    all their groups -- as :class:`~hdreplay.checkpoint.tensorfile.Streamed` pieces: views of the blocks' own tensors,
    plus small per-block pieces (shifted offsets, an all-ones mask where a block stores none).  Nothing the size of the
    state is allocated, so a save streams it to disk (:func:`materialize` builds the tensors, for ``state_dict``)."""
    if not blocks:
        return {}

    def cat(get) -> Streamed:
        ts = [get(b) for b in blocks]
        return Streamed(ts[0].dtype, (sum(t.shape[0] for t in ts), *ts[0].shape[1:]), lambda: ts)

    def offsets(get_off, get_len) -> Streamed:
        def parts():
            shift = 0
            for b in blocks:
                yield torch.from_numpy(get_off(b)[:-1] + shift)
                shift += get_len(b)
            yield torch.tensor([shift], dtype=torch.int64)
        return Streamed(torch.int64, (sum(len(get_off(b)) - 1 for b in blocks) + 1,), parts)

    def mask_parts():
        for b in blocks:  # bool and uint8 share their bytes: a view, no copy
            yield torch.ones(b.tokens.numel(), dtype=torch.uint8) if b.loss_mask is None else b.loss_mask.view(torch.uint8)  # noqa: E501

    out = {name: cat(lambda b, n=name: getattr(b, n))
           for name in ("prompt", "tokens", "logprobs", "resp_len", "advantages", "rewards")}
    for name, data in (("prompt_off", "prompt"), ("tok_off", "tokens"), ("resp_off", "resp_len")):
        out[name] = offsets(lambda b, n=name: getattr(b, n), lambda b, d=data: getattr(b, d).numel())
    out["loss_mask"] = Streamed(torch.uint8, (sum(b.tokens.numel() for b in blocks),), mask_parts)
    for k in blocks[0].extras:
        out[f"extra.{k}"] = cat(lambda b, k=k: b.extras[k])
    for k in blocks[0].mm.data:
        out[f"mm.{k}"] = cat(lambda b, k=k: b.mm.data[k])
        out[f"mm_off.{k}"] = offsets(lambda b, k=k: b.mm.off[k], lambda b, k=k: b.mm.data[k].shape[0])
    return out


def materialize(tensors: Mapping[str, "torch.Tensor | Streamed"]) -> dict[str, torch.Tensor]:
    """Whole tensors (new memory) of a mapping that may hold :class:`~hdreplay.checkpoint.tensorfile.Streamed` entries."""  # noqa: E501
    return {k: v if isinstance(v, torch.Tensor) else torch.cat([p.reshape(-1, *v.shape[1:]) for p in v.parts()])
            for k, v in tensors.items()}
