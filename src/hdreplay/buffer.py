"""FIFO group store with compact ragged storage and cached Headroom priorities.

The buffer *stores*: it never decides what to replay (see :mod:`hdreplay.selection`).

Storage.  Groups appended in one call form a *block* of flat tensors with no
padding: int32 token ids, float32 log-probs, a bool loss mask (omitted when it is
all ones, the single-turn case), int32 response lengths, float32 advantages and
rewards.  Because eviction is FIFO, blocks leave from the front; a partly evicted
front block is compacted, so stored bytes track the live groups exactly.

Per-group mutable state lives in slot arrays indexed by ``insertion_id % capacity``:
cached Headroom, reference Headroom, last refresh step, birth step, lifetime
replay count N_rep and exposure W.  Insertion ids are consecutive; the live ids
are always ``[next_id - size, next_id)``, oldest first.
"""

from __future__ import annotations

import bisect
import os
from dataclasses import dataclass
from typing import Any, Iterable, Sequence

import numpy as np
import torch

from .checkpoint import read_checkpoint_dir, require_keys, write_checkpoint_dir
from .errors import CheckpointError, ReplayConfigError, ReplayInputError
from .record import GroupRecord

BUFFER_FORMAT = "hdreplay.buffer"
BUFFER_VERSION = 1


@dataclass
class _Block:
    """Flat storage of groups with consecutive insertion ids ``first_id .. first_id + k - 1``."""

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

    @property
    def count(self) -> int:
        return len(self.group_ids)

    @property
    def nbytes(self) -> int:
        ts = [self.prompt, self.tokens, self.logprobs, self.resp_len, self.advantages, self.rewards,
              *self.extras.values()]
        if self.loss_mask is not None:
            ts.append(self.loss_mask)
        offsets = self.prompt_off.nbytes + self.tok_off.nbytes + self.resp_off.nbytes
        return sum(t.numel() * t.element_size() for t in ts) + offsets

    @classmethod
    def build(cls, first_id: int, records: Sequence[GroupRecord]) -> "_Block":
        def off(lengths: Iterable[int]) -> np.ndarray:
            return np.concatenate([[0], np.cumsum(list(lengths), dtype=np.int64)]).astype(np.int64)

        masks = [r.loss_mask for r in records]
        all_ones = all(bool(m.all()) for m in masks)
        keys = sorted(records[0].extras) if records else []
        return cls(
            first_id=first_id,
            group_ids=[r.group_id for r in records],
            birth_steps=[r.birth_step for r in records],
            prompt=torch.cat([r.prompt_ids for r in records]),
            prompt_off=off(r.prompt_ids.numel() for r in records),
            tokens=torch.cat([r.completion_ids for r in records]),
            logprobs=torch.cat([r.logprobs for r in records]),
            loss_mask=None if all_ones else torch.cat(masks),
            tok_off=off(r.num_tokens for r in records),
            resp_len=torch.cat([r.response_lengths for r in records]),
            advantages=torch.cat([r.advantages for r in records]),
            rewards=torch.cat([r.rewards for r in records]),
            resp_off=off(r.num_responses for r in records),
            extras={k: torch.cat([r.extras[k] for r in records]) for k in keys},
        )

    def record(self, j: int) -> GroupRecord:
        """Materialise group j as a GroupRecord (views into this block's tensors; no validation)."""
        t0, t1 = int(self.tok_off[j]), int(self.tok_off[j + 1])
        r0, r1 = int(self.resp_off[j]), int(self.resp_off[j + 1])
        p0, p1 = int(self.prompt_off[j]), int(self.prompt_off[j + 1])
        mask = _ones(t1 - t0) if self.loss_mask is None else self.loss_mask[t0:t1]
        rec = object.__new__(GroupRecord)
        fields = dict(
            group_id=self.group_ids[j],
            prompt_ids=self.prompt[p0:p1],
            completion_ids=self.tokens[t0:t1],
            response_lengths=self.resp_len[r0:r1],
            loss_mask=mask,
            logprobs=self.logprobs[t0:t1],
            advantages=self.advantages[r0:r1],
            rewards=self.rewards[r0:r1],
            birth_step=self.birth_steps[j],
            extras={k: v[t0:t1] for k, v in self.extras.items()},
        )
        for k, v in fields.items():
            object.__setattr__(rec, k, v)
        return rec

    def tail(self, start: int) -> "_Block":
        """A compacted copy holding groups ``start..count-1`` (the front ones evicted)."""
        t0, r0, p0 = int(self.tok_off[start]), int(self.resp_off[start]), int(self.prompt_off[start])
        return _Block(
            first_id=self.first_id + start,
            group_ids=self.group_ids[start:],
            birth_steps=self.birth_steps[start:],
            prompt=self.prompt[p0:].clone(),
            prompt_off=self.prompt_off[start:] - p0,
            tokens=self.tokens[t0:].clone(),
            logprobs=self.logprobs[t0:].clone(),
            loss_mask=None if self.loss_mask is None else self.loss_mask[t0:].clone(),
            tok_off=self.tok_off[start:] - t0,
            resp_len=self.resp_len[r0:].clone(),
            advantages=self.advantages[r0:].clone(),
            rewards=self.rewards[r0:].clone(),
            resp_off=self.resp_off[start:] - r0,
            extras={k: v[t0:].clone() for k, v in self.extras.items()},
        )


_ONES = torch.ones(0, dtype=torch.bool)


def _ones(n: int) -> torch.Tensor:
    """A read-only-by-convention all-True mask of length n (a view of one shared tensor)."""
    global _ONES
    if _ONES.numel() < n:
        _ONES = torch.ones(max(n, 2 * _ONES.numel(), 4096), dtype=torch.bool)
    return _ONES[:n]


class ReplayBuffer:
    """FIFO buffer of at most ``capacity`` groups.

    Args:
        capacity:   C >= 1, the maximum number of groups held.
        group_size: if set, every appended group must have exactly this many responses.
    """

    _SLOT_FIELDS = {
        "insertion_id": np.int64, "birth_step": np.int64, "cached_headroom": np.float64,
        "ref_headroom": np.float64, "refresh_step": np.int64, "replay_count": np.int64,
        "exposure": np.float64, "num_loss_tokens": np.int64,
    }

    def __init__(self, capacity: int, *, group_size: int | None = None) -> None:
        if isinstance(capacity, bool) or not isinstance(capacity, int) or capacity < 1:
            raise ReplayConfigError(f"capacity must be an int >= 1 (groups), got {capacity!r}")
        if group_size is not None and (not isinstance(group_size, int) or group_size < 1):
            raise ReplayConfigError(f"group_size must be None or an int >= 1, got {group_size!r}")
        self.capacity = capacity
        self.group_size = group_size
        self._reset()

    def _reset(self) -> None:
        C = self.capacity
        self._slots = {k: np.zeros(C, dtype=dt) for k, dt in self._SLOT_FIELDS.items()}
        self._slots["insertion_id"][:] = -1
        self._blocks: list[_Block] = []
        self._block_first: list[int] = []
        self._next_id = 0
        self._size = 0
        self._extras_keys: tuple[str, ...] | None = None
        self._id_of_group: dict[Any, int] = {}

    # ------------------------------------------------------------------ basic views
    def __len__(self) -> int:
        return self._size

    @property
    def next_insertion_id(self) -> int:
        return self._next_id

    def insertion_ids(self) -> np.ndarray:
        """(size,) int64 live insertion ids, oldest first."""
        return np.arange(self._next_id - self._size, self._next_id, dtype=np.int64)

    def _slot(self, ids) -> np.ndarray:
        ids = np.asarray(ids, dtype=np.int64)
        lo = self._next_id - self._size
        if ids.size and (ids.min() < lo or ids.max() >= self._next_id):
            raise ReplayInputError(
                f"insertion ids must be live ([{lo}, {self._next_id})), got range [{ids.min()}, {ids.max()}]"
            )
        return ids % self.capacity

    def slot_values(self, name: str, ids) -> np.ndarray:
        """Per-group state for ``ids``: one of insertion_id, birth_step, cached_headroom,
        ref_headroom, refresh_step, replay_count, exposure, num_loss_tokens."""
        if name not in self._slots:
            raise ReplayInputError(f"unknown slot field {name!r}; valid: {sorted(self._slots)}")
        return self._slots[name][self._slot(ids)].copy()

    def group_id(self, insertion_id: int):
        """The caller's group id of a live insertion id."""
        self._slot([insertion_id])
        blk, j = self._locate(int(insertion_id))
        return blk.group_ids[j]

    def _locate(self, insertion_id: int) -> tuple[_Block, int]:
        b = bisect.bisect_right(self._block_first, insertion_id) - 1
        blk = self._blocks[b]
        return blk, insertion_id - blk.first_id

    def get(self, ids: Sequence[int]) -> list[GroupRecord]:
        """Materialise live groups as read-only :class:`GroupRecord` views."""
        self._slot(ids)  # range check
        out = []
        for i in ids:
            blk, j = self._locate(int(i))
            out.append(blk.record(j))
        return out

    def nbytes(self) -> int:
        """Bytes held: block tensors plus per-slot state arrays."""
        return sum(b.nbytes for b in self._blocks) + sum(a.nbytes for a in self._slots.values())

    def stored_response_tokens(self) -> int:
        return sum(b.tokens.numel() for b in self._blocks)

    # ------------------------------------------------------------------ ordering
    def order_by_cached_headroom(self, limit: int) -> np.ndarray:
        """The first ``limit`` live ids by cached Headroom, descending; ties: older (smaller id) first.

        Cost O(C + m log m) for m = limit (a partial selection, not a full sort)."""
        m = min(int(limit), self._size)
        if m <= 0:
            return np.zeros(0, dtype=np.int64)
        ids = self.insertion_ids()
        key = self._slots["cached_headroom"][ids % self.capacity]
        if m < self._size:
            kth = np.partition(key, self._size - m)[self._size - m]
            cand = np.flatnonzero(key >= kth)
        else:
            cand = np.arange(self._size)
        order = np.lexsort((ids[cand], -key[cand]))[:m]
        return ids[cand[order]]

    def order_by_recency(self, limit: int) -> np.ndarray:
        """The newest ``limit`` live ids, newest first."""
        m = min(int(limit), self._size)
        return np.arange(self._next_id - 1, self._next_id - 1 - m, -1, dtype=np.int64)

    # ------------------------------------------------------------------ mutation
    def validate(self, records: Sequence[GroupRecord]) -> None:
        """Raise if ``records`` cannot be appended; the buffer is not modified."""
        seen = set()
        keys = self._extras_keys
        for r in records:
            if not isinstance(r, GroupRecord):
                raise ReplayInputError(f"expected GroupRecord, got {type(r).__name__}")
            if self.group_size is not None and r.num_responses != self.group_size:
                raise ReplayInputError(
                    f"group {r.group_id!r} has {r.num_responses} responses; this buffer holds groups of "
                    f"group_size={self.group_size}"
                )
            if r.group_id in self._id_of_group or r.group_id in seen:
                raise ReplayInputError(f"duplicate group_id {r.group_id!r}; group ids must be unique in a run")
            seen.add(r.group_id)
            rk = tuple(sorted(r.extras))
            if keys is None:
                keys = rk
            elif rk != keys:
                raise ReplayInputError(
                    f"group {r.group_id!r} carries extras {list(rk)} but the buffer holds {list(keys)}; "
                    "every group must carry the same extras"
                )

    def append(
        self, records: Sequence[GroupRecord], *, ref_headroom: Sequence[float], step: int
    ) -> list[dict[str, Any]]:
        """Append groups (oldest first) with their reference Headroom; evict beyond capacity (FIFO).

        Args:
            records:      groups to store, in the order they should age.
            ref_headroom: (k,) H_ref(g) = Headroom(g; pi_gen), the initial cached priority.
            step:         the step the append happens at (recorded as the refresh step).
        Returns:
            lifetime records of the evicted groups (see :meth:`lifetime_record`).
        """
        records = list(records)
        ref = np.asarray(ref_headroom, dtype=np.float64).reshape(-1)
        if ref.size != len(records):
            raise ReplayInputError(f"{len(records)} groups but {ref.size} ref_headroom values")
        if ref.size and not np.isfinite(ref).all():
            raise ReplayInputError("ref_headroom has non-finite values")
        self.validate(records)
        if not records:
            return []
        if len(records) > self.capacity:  # only the newest C can survive
            records, ref = records[-self.capacity:], ref[-self.capacity:]
        evicted = self._evict(self._size + len(records) - self.capacity, step)
        first = self._next_id
        blk = _Block.build(first, records)
        self._blocks.append(blk)
        self._block_first.append(first)
        ids = np.arange(first, first + len(records), dtype=np.int64)
        sl = ids % self.capacity
        s = self._slots
        s["insertion_id"][sl] = ids
        s["birth_step"][sl] = [r.birth_step for r in records]
        s["cached_headroom"][sl] = ref
        s["ref_headroom"][sl] = ref
        s["refresh_step"][sl] = step
        s["replay_count"][sl] = 0
        s["exposure"][sl] = 0.0
        s["num_loss_tokens"][sl] = [r.num_loss_tokens for r in records]
        for r, i in zip(records, ids.tolist()):
            self._id_of_group[r.group_id] = i
        if self._extras_keys is None:
            self._extras_keys = tuple(sorted(records[0].extras))
        self._next_id += len(records)
        self._size += len(records)
        return evicted

    def _evict(self, k: int, step: int) -> list[dict[str, Any]]:
        if k <= 0:
            return []
        ids = self.insertion_ids()[:k]
        out = [self.lifetime_record(int(i), evicted_step=step) for i in ids]
        for rec in out:
            del self._id_of_group[rec["group_id"]]
        self._slots["insertion_id"][ids % self.capacity] = -1
        self._size -= k
        lo = self._next_id - self._size
        while self._blocks and self._blocks[0].first_id + self._blocks[0].count <= lo:
            self._blocks.pop(0)
            self._block_first.pop(0)
        if self._blocks and self._blocks[0].first_id < lo:
            self._blocks[0] = self._blocks[0].tail(lo - self._blocks[0].first_id)
            self._block_first[0] = lo
        return out

    def refresh(self, ids: Sequence[int], values: Sequence[float], *, step: int) -> None:
        """Set the cached Headroom of ``ids`` to ``values`` (runtime Headroom at ``step``)."""
        sl = self._slot(ids)
        v = np.asarray(values, dtype=np.float64).reshape(-1)
        if v.size != sl.size or (v.size and not np.isfinite(v).all()):
            raise ReplayInputError(f"refresh needs {sl.size} finite values, got {v.tolist()}")
        self._slots["cached_headroom"][sl] = v
        self._slots["refresh_step"][sl] = step

    def record_use(self, ids: Sequence[int], *, weight: float) -> None:
        """Count one replay of each id (N_rep += 1) and add ``weight`` = 1/|A_t| to its exposure."""
        sl = self._slot(ids)
        self._slots["replay_count"][sl] += 1
        self._slots["exposure"][sl] += weight

    def add_exposure(self, ids: Sequence[int], weight: float) -> None:
        self._slots["exposure"][self._slot(ids)] += weight

    def lifetime_record(self, insertion_id: int, *, evicted_step: int | None = None) -> dict[str, Any]:
        """Per-group lifetime record: birth step, H_ref, N_rep, exposure W, last cached Headroom."""
        sl = int(self._slot([insertion_id])[0])
        s = self._slots
        blk, j = self._locate(insertion_id)
        return {
            "group_id": blk.group_ids[j],
            "insertion_id": int(insertion_id),
            "birth_step": int(s["birth_step"][sl]),
            "ref_headroom": float(s["ref_headroom"][sl]),
            "cached_headroom": float(s["cached_headroom"][sl]),
            "replay_count": int(s["replay_count"][sl]),
            "exposure": float(s["exposure"][sl]),
            "evicted_step": evicted_step,
        }

    # ------------------------------------------------------------------ checkpointing
    def state_dict(self) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        """(tensors, meta): plain tensors plus a JSON-able dict; exact (cached values in float64)."""
        ids = self.insertion_ids()
        recs = self.get(ids.tolist()) if len(ids) else []
        blk = _Block.build(int(ids[0]) if len(ids) else self._next_id, recs) if recs else None
        sl = ids % self.capacity
        tensors = {f"slot.{k}": torch.from_numpy(a[sl].copy()) for k, a in self._slots.items()}
        if blk is not None:
            tensors.update({
                "prompt": blk.prompt, "prompt_off": torch.from_numpy(blk.prompt_off), "tokens": blk.tokens,
                "logprobs": blk.logprobs, "tok_off": torch.from_numpy(blk.tok_off), "resp_len": blk.resp_len,
                "advantages": blk.advantages, "rewards": blk.rewards, "resp_off": torch.from_numpy(blk.resp_off),
            })
            tensors["loss_mask"] = (torch.ones(blk.tokens.numel(), dtype=torch.bool)
                                    if blk.loss_mask is None else blk.loss_mask).to(torch.uint8)
            tensors.update({f"extra.{k}": v for k, v in blk.extras.items()})
        meta = {
            "capacity": self.capacity,
            "group_size": self.group_size,
            "next_id": self._next_id,
            "size": self._size,
            "group_ids": [] if blk is None else blk.group_ids,
            "birth_steps": [] if blk is None else blk.birth_steps,
            "extras_keys": None if self._extras_keys is None else list(self._extras_keys),
        }
        return tensors, meta

    def load_state_dict(self, tensors: dict[str, torch.Tensor], meta: dict[str, Any]) -> None:
        """Restore exactly; raises CheckpointError (buffer unchanged) on inconsistent input."""
        where = "buffer state"
        require_keys(where, meta, ("capacity", "group_size", "next_id", "size", "group_ids", "birth_steps",
                                   "extras_keys"))
        if meta["capacity"] != self.capacity:
            raise CheckpointError(
                f"{where}: saved with capacity {meta['capacity']}, this buffer has capacity {self.capacity}; "
                "construct the buffer with the saved capacity"
            )
        size, nid = int(meta["size"]), int(meta["next_id"])
        require_keys(where, tensors, tuple(f"slot.{k}" for k in self._SLOT_FIELDS))
        for k in self._SLOT_FIELDS:
            if tensors[f"slot.{k}"].numel() != size:
                raise CheckpointError(f"{where}: slot.{k} has {tensors[f'slot.{k}'].numel()} entries, expected {size}")
        if len(meta["group_ids"]) != size or not (0 <= size <= self.capacity) or nid < size:
            raise CheckpointError(f"{where}: inconsistent sizes (size={size}, next_id={nid}, "
                                  f"{len(meta['group_ids'])} group ids)")
        ids = np.arange(nid - size, nid, dtype=np.int64)
        if size and not np.array_equal(tensors["slot.insertion_id"].numpy(), ids):
            raise CheckpointError(f"{where}: insertion ids are not the consecutive range ending at next_id")
        blk = None
        if size:
            keys = ("prompt", "prompt_off", "tokens", "logprobs", "tok_off", "resp_len", "advantages",
                    "rewards", "resp_off", "loss_mask")
            require_keys(where, tensors, keys)
            ek = meta["extras_keys"] or []
            require_keys(where, tensors, tuple(f"extra.{k}" for k in ek))
            lm = tensors["loss_mask"].bool()
            blk = _Block(
                first_id=int(ids[0]), group_ids=list(meta["group_ids"]), birth_steps=list(meta["birth_steps"]),
                prompt=tensors["prompt"], prompt_off=tensors["prompt_off"].numpy(), tokens=tensors["tokens"],
                logprobs=tensors["logprobs"], loss_mask=None if bool(lm.all()) else lm,
                tok_off=tensors["tok_off"].numpy(), resp_len=tensors["resp_len"].to(torch.int64),
                advantages=tensors["advantages"], rewards=tensors["rewards"], resp_off=tensors["resp_off"].numpy(),
                extras={k: tensors[f"extra.{k}"] for k in ek},
            )
            ok = (blk.tok_off.size == size + 1 and blk.resp_off.size == size + 1
                  and blk.prompt_off.size == size + 1 and int(blk.tok_off[-1]) == blk.tokens.numel()
                  and blk.logprobs.numel() == blk.tokens.numel() and lm.numel() == blk.tokens.numel()
                  and int(blk.resp_off[-1]) == blk.resp_len.numel() == blk.advantages.numel()
                  and int(blk.prompt_off[-1]) == blk.prompt.numel())
            if not ok:
                raise CheckpointError(f"{where}: tensor sizes do not match their offsets; checkpoint is corrupted")
        # all checks passed: mutate
        self.group_size = meta["group_size"]
        self._reset()
        sl = ids % self.capacity
        for k, dt in self._SLOT_FIELDS.items():
            self._slots[k][sl] = tensors[f"slot.{k}"].numpy().astype(dt)
        if blk is not None:
            self._blocks, self._block_first = [blk], [blk.first_id]
            self._id_of_group = {g: int(i) for g, i in zip(blk.group_ids, ids.tolist())}
        self._next_id, self._size = nid, size
        self._extras_keys = None if meta["extras_keys"] is None else tuple(meta["extras_keys"])

    def save(self, directory: str | os.PathLike) -> None:
        """Atomically write the buffer to ``directory`` (safetensors + JSON)."""
        tensors, meta = self.state_dict()
        write_checkpoint_dir(directory, format_name=BUFFER_FORMAT, version=BUFFER_VERSION,
                             tensors=tensors, meta=meta)

    @classmethod
    def load(cls, directory: str | os.PathLike) -> "ReplayBuffer":
        tensors, meta = read_checkpoint_dir(directory, format_name=BUFFER_FORMAT, versions=(BUFFER_VERSION,))
        require_keys(str(directory), meta, ("capacity",))
        buf = cls(int(meta["capacity"]), group_size=meta.get("group_size"))
        buf.load_state_dict(tensors, meta)
        return buf

