"""FIFO group store with compact ragged storage and cached Headroom priorities.

The buffer *stores*: it never decides what to replay (see :mod:`hdreplay.selection`).

Storage.  Groups live in ragged blocks (:mod:`hdreplay.store.blocks`); what the buffer hands out
(:meth:`ReplayBuffer.get`, :meth:`ReplayBuffer.state_dict`) are copies, so nothing a caller does to
them changes the stored state.

Per-group mutable state lives in slot arrays indexed by ``insertion_id % L``
(:data:`hdreplay.store.blocks.SLOT_FIELDS`): cached Headroom, reference Headroom, last refresh step, birth
step, lifetime replay count N_rep, exposure W, the loss-token count, the consecutive gate rejections
and the first step the scan may consider the group again.  Insertion ids are consecutive,
so the live ids ``[next_id - size, next_id)`` (oldest first) map to distinct slots whenever
``L >= size``; ``L`` grows geometrically up to the capacity as the buffer fills, so a large capacity
costs nothing until it is used.

Every public method checks all of its arguments before it changes anything: a refused call leaves
the buffer exactly as it was.
"""

from __future__ import annotations

import bisect
import os
from typing import Any, Sequence

import numpy as np
import torch

from ..checkpoint.files import open_checkpoint_dir, write_checkpoint_dir
from ..checkpoint.tensorfile import Streamed
from ..errors import CheckpointError, ReplayConfigError, ReplayInputError
from ..validate import (
    MAX_CAPACITY,
    MAX_COUNT,
    MAX_STEP,
    check_ids,
    check_int,
    check_path,
    check_real,
    check_reals,
    check_sequence,
    check_step,
    check_str,
)
from .blocks import BLOCK_GROUPS, SLOT_FIELDS, Block, checkpoint_tensors, copy_groups, materialize
from .multimodal import Schema, schema_difference, schema_of, schema_to_json
from .record import GroupRecord
from .state import BufferState, parse_buffer_state

BUFFER_FORMAT = "hdreplay.buffer"
#: 2: the manifest layout (see :mod:`hdreplay.checkpoint.files`); 1, the unreleased 0.1's layout, is not read
BUFFER_VERSION = 2
BUFFER_VERSIONS = (2,)
#: slot arrays start this small and double as the buffer fills
INITIAL_SLOTS = 64


class ReplayBuffer:
    """FIFO buffer of at most ``capacity`` groups.

    Args:
        capacity:   C in [1, 2**24], the maximum number of groups held.
        group_size: if set, every appended group must have exactly this many responses.

    >>> from hdreplay import GroupRecord
    >>> def group(i):
    ...     return GroupRecord.from_responses(group_id=f"g{i}", prompt_ids=[5, 6], completion_ids=[[1, 2], [3]],
    ...                                       logprobs=[[-0.1, -0.2], [-0.3]], advantages=[1.0, -1.0],
    ...                                       rewards=[1.0, 0.0], birth_step=i)
    >>> buf = ReplayBuffer(capacity=2)
    >>> buf.append([group(0), group(1)], ref_headroom=[0.2, 0.7], step=1)
    []
    >>> buf.group_ids(buf.order_by_cached_headroom(2))  # the highest cached Headroom first
    ['g1', 'g0']
    >>> [r["group_id"] for r in buf.append([group(2)], ref_headroom=[0.5], step=2)]  # FIFO: the oldest leaves
    ['g0']
    """

    _SLOT_FIELDS = SLOT_FIELDS  # (the name before the slot fields moved to :mod:`hdreplay.store.blocks`)

    def __init__(self, capacity: int, *, group_size: int | None = None) -> None:
        self.capacity = check_int("capacity", capacity, lo=1, hi=MAX_CAPACITY, err=ReplayConfigError)
        self.group_size = None if group_size is None else check_int(
            "group_size", group_size, lo=1, hi=MAX_COUNT, err=ReplayConfigError)
        self._install([], self._new_slots(min(self.capacity, INITIAL_SLOTS)), 0, 0, None, None)

    def _install(self, blocks: list[Block], slots: dict[str, np.ndarray], next_id: int, size: int,
                 extras_keys: tuple[str, ...] | None, mm_schema: Schema | None) -> None:
        """Replace the whole state at once (construction and loads)."""
        self._blocks = blocks
        self._block_first = [b.first_id for b in blocks]
        self._slots = slots
        self._next_id, self._size, self._extras_keys = next_id, size, extras_keys
        self._mm_schema = mm_schema
        self._id_of_group = {g: b.first_id + j for b in blocks for j, g in enumerate(b.group_ids)}

    @classmethod
    def _new_slots(cls, n: int) -> dict[str, np.ndarray]:
        slots = {k: np.zeros(n, dtype=dt) for k, dt in cls._SLOT_FIELDS.items()}
        slots["insertion_id"][:] = -1
        return slots

    def _grow(self, needed: int) -> None:
        """Make the slot arrays hold at least ``needed`` live groups (re-placing the live ones)."""
        L = len(self._slots["insertion_id"])
        if needed <= L:
            return
        new_len = min(self.capacity, max(needed, 2 * L))
        new = self._new_slots(new_len)
        ids = self.insertion_ids()
        for k, a in self._slots.items():
            new[k][ids % new_len] = a[ids % L]
        self._slots = new

    # ------------------------------------------------------------------ basic views
    def __len__(self) -> int:
        return self._size

    @property
    def next_insertion_id(self) -> int:
        return self._next_id

    def insertion_ids(self) -> np.ndarray:
        """(size,) int64 live insertion ids, oldest first."""
        return np.arange(self._next_id - self._size, self._next_id, dtype=np.int64)

    def _slot(self, ids: np.ndarray) -> np.ndarray:
        lo = self._next_id - self._size
        if ids.size and (ids.min() < lo or ids.max() >= self._next_id):
            raise ReplayInputError(
                f"insertion ids must be live ([{lo}, {self._next_id})), got range [{ids.min()}, {ids.max()}]"
            )
        return ids % len(self._slots["insertion_id"])

    def slot_values(self, name: str, ids) -> np.ndarray:
        """Per-group state for ``ids`` (a copy): one of insertion_id, birth_step, cached_headroom,
        ref_headroom, refresh_step, replay_count, exposure, num_loss_tokens."""
        name = check_str("name", name, self._SLOT_FIELDS)
        return self._slots[name][self._slot(check_ids("ids", ids, unique=False))].copy()

    def group_id(self, insertion_id: int):
        """The caller's group id of a live insertion id."""
        i = check_int("insertion_id", insertion_id, hi=MAX_STEP)
        self._slot(np.asarray([i]))
        blk, j = self._locate(i)
        return blk.group_ids[j]

    def group_ids(self, ids) -> list:
        """The caller's group ids of live insertion ids (in the order given)."""
        arr = check_ids("ids", ids, unique=False)
        self._slot(arr)
        return [blk.group_ids[j] for blk, j in map(self._locate, arr.tolist())]

    def _locate(self, insertion_id: int) -> tuple[Block, int]:
        b = bisect.bisect_right(self._block_first, insertion_id) - 1
        blk = self._blocks[b]
        return blk, insertion_id - blk.first_id

    def get(self, ids) -> list[GroupRecord]:
        """Live groups as :class:`GroupRecord` copies (editing them never changes the buffer)."""
        arr = check_ids("ids", ids, unique=False)
        self._slot(arr)
        return copy_groups([self._locate(i) for i in arr.tolist()])

    def forward_tokens(self, ids) -> np.ndarray:
        """(len(ids),) tokens a full-row forward of each live group runs: n x prompt + completion tokens."""
        arr = check_ids("ids", ids, unique=False)
        self._slot(arr)
        out = np.zeros(len(arr), dtype=np.int64)
        for k, (blk, j) in enumerate(map(self._locate, arr.tolist())):
            t0, t1, r0, r1, p0, p1 = blk.spans(j)
            out[k] = (r1 - r0) * (p1 - p0) + t1 - t0
        return out

    def nbytes(self) -> int:
        """Bytes held: block tensors plus per-slot state arrays."""
        return sum(b.nbytes for b in self._blocks) + sum(a.nbytes for a in self._slots.values())

    def mm_nbytes(self) -> int:
        """Bytes of the stored multimodal inputs (one copy per group), offsets included."""
        return sum(b.mm.nbytes for b in self._blocks)

    @property
    def mm_schema(self) -> Schema | None:
        """``name -> (dtype, trailing shape)`` every group's ``mm_inputs`` must have (None until the first append;
        ``{}`` for a text buffer)."""
        return None if self._mm_schema is None else dict(self._mm_schema)

    def stored_response_tokens(self) -> int:
        return sum(b.tokens.numel() for b in self._blocks)

    # ------------------------------------------------------------------ ordering
    def order_by_cached_headroom(self, limit: int) -> np.ndarray:
        """The first ``limit`` live ids by cached Headroom, descending; ties: older (smaller id) first.

        Cost O(C + m log m) for m = limit (a partial selection, not a full sort)."""
        m = min(check_int("limit", limit, hi=MAX_STEP), self._size)
        if m <= 0:
            return np.zeros(0, dtype=np.int64)
        ids = self.insertion_ids()
        key = self._slots["cached_headroom"][self._slot(ids)]
        if m < self._size:
            kth = np.partition(key, self._size - m)[self._size - m]
            cand = np.flatnonzero(key >= kth)
        else:
            cand = np.arange(self._size)
        order = np.lexsort((ids[cand], -key[cand]))[:m]
        return ids[cand[order]]

    def order_by_recency(self, limit: int) -> np.ndarray:
        """The newest ``limit`` live ids, newest first."""
        m = min(check_int("limit", limit, hi=MAX_STEP), self._size)
        return np.arange(self._next_id - 1, self._next_id - 1 - m, -1, dtype=np.int64)

    def group_means(self, field: str, *, absolute: bool = True) -> np.ndarray:
        """(size,) float64, oldest first: per live group the mean over its responses of ``field`` ("rewards" or
        "advantages"), of absolute values when ``absolute`` (read from the flat storage, no copies of groups)."""
        field = check_str("field", field, ("rewards", "advantages"))
        out = []
        for b in self._blocks:
            v = getattr(b, field).double().numpy()
            v = np.abs(v) if absolute else v
            n = np.diff(b.resp_off)
            out.append(np.add.reduceat(v, b.resp_off[:-1]) / n if b.count else np.zeros(0))
        return np.concatenate(out) if out else np.zeros(0)

    # ------------------------------------------------------------------ mutation
    def validate(self, records: Sequence[GroupRecord]) -> None:
        """Raise if ``records`` cannot be appended; the buffer is not modified."""
        seen = set()
        keys = self._extras_keys
        mm = self._mm_schema
        for r in check_sequence("records", records):
            if not isinstance(r, GroupRecord):
                raise ReplayInputError(f"records: expected GroupRecord, got {type(r).__name__}")
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
            rs = schema_of(r.mm_inputs)
            if mm is None:
                mm = rs
            elif (why := schema_difference(rs, mm)) is not None:
                raise ReplayInputError(
                    f"group {r.group_id!r}: multimodal inputs differ from the buffer's: {why}; every group must "
                    "come from the same processor and settings (a text group cannot join an image buffer either)"
                )

    def append(self, records: Sequence[GroupRecord], *, ref_headroom, step: int) -> list[dict[str, Any]]:
        """Append groups (oldest first) with their reference Headroom; evict beyond capacity (FIFO).

        Args:
            records:      groups to store (a list), in the order they should age; they are copied.
            ref_headroom: (k,) H_ref(g) = Headroom(g; pi_gen), the initial cached priority (finite).
            step:         the step the append happens at (recorded as the refresh step).
        Returns:
            lifetime records of the evicted groups (see :meth:`lifetime_record`).
        """
        records = check_sequence("records", records)
        ref = check_reals("ref_headroom", ref_headroom, len(records))
        step = check_step("step", step)
        self.validate(records)
        if not records:
            return []
        if len(records) > self.capacity:  # only the newest C can survive
            records, ref = records[-self.capacity:], ref[-self.capacity:]
        first = self._next_id
        blocks = [Block.build(first + i, records[i:i + BLOCK_GROUPS])  # the copies; nothing has changed yet
                  for i in range(0, len(records), BLOCK_GROUPS)]
        self._grow(min(self.capacity, self._size + len(records)))
        evicted = self._evict(self._size + len(records) - self.capacity, step)
        self._blocks.extend(blocks)
        self._block_first.extend(b.first_id for b in blocks)
        ids = np.arange(first, first + len(records), dtype=np.int64)
        sl = ids % len(self._slots["insertion_id"])
        s = self._slots
        s["insertion_id"][sl] = ids
        s["birth_step"][sl] = [r.birth_step for r in records]
        s["cached_headroom"][sl] = ref
        s["ref_headroom"][sl] = ref
        s["refresh_step"][sl] = step
        s["replay_count"][sl] = 0
        s["exposure"][sl] = 0.0
        s["num_loss_tokens"][sl] = [r.num_loss_tokens for r in records]
        s["reject_streak"][sl] = 0
        s["skip_until"][sl] = 0
        for r, i in zip(records, ids.tolist()):
            self._id_of_group[r.group_id] = i
        if self._extras_keys is None:
            self._extras_keys = tuple(sorted(records[0].extras))
        if self._mm_schema is None:
            self._mm_schema = schema_of(records[0].mm_inputs)
        self._next_id += len(records)
        self._size += len(records)
        return evicted

    def _evict(self, k: int, step: int) -> list[dict[str, Any]]:
        if k <= 0:
            return []
        ids = self.insertion_ids()[:k]
        out = [self._lifetime(int(i), step) for i in ids]
        for rec in out:
            del self._id_of_group[rec["group_id"]]
        self._slots["insertion_id"][self._slot(ids)] = -1
        self._size -= k
        lo = self._next_id - self._size
        while self._blocks and self._blocks[0].first_id + self._blocks[0].count <= lo:
            self._blocks.pop(0)
            self._block_first.pop(0)
        if self._blocks and self._blocks[0].first_id < lo:
            self._blocks[0] = self._blocks[0].tail(lo - self._blocks[0].first_id)
            self._block_first[0] = lo
        return out

    def evict_older_than(self, max_age: int, *, step: int) -> list[dict[str, Any]]:
        """Evict the oldest groups while their age ``step - birth_step`` is >= ``max_age`` (a prefix in insertion
        order; groups are appended in birth order).  Returns their lifetime records."""
        max_age = check_int("max_age", max_age, hi=MAX_STEP)
        step = check_step("step", step)
        births = self._slots["birth_step"][self._slot(self.insertion_ids())]
        old = step - births >= max_age
        k = int(np.argmin(old)) if not old.all() else self._size
        return self._evict(k, step)

    def refresh(self, ids, values, *, step: int) -> None:
        """Set the cached Headroom of ``ids`` (distinct, live) to ``values`` (runtime Headroom at ``step``)."""
        arr = check_ids("ids", ids)
        sl = self._slot(arr)
        v = check_reals("values", values, arr.size)
        step = check_step("step", step)
        self._slots["cached_headroom"][sl] = v
        self._slots["refresh_step"][sl] = step

    def record_scan(self, ids, passed, skip_until) -> None:
        """After a scan: ``passed`` (bool per id) resets the reject streak or adds one; ``skip_until`` (a step per
        id, >= 0) is the first step the scan may consider the group again (ids distinct, live)."""
        arr = check_ids("ids", ids)
        sl = self._slot(arr)
        ok = np.asarray(passed, dtype=bool).reshape(-1)
        until = np.asarray(skip_until, dtype=np.int64).reshape(-1)
        if ok.size != arr.size or until.size != arr.size or (until < 0).any() or (until > MAX_STEP).any():
            raise ReplayInputError(f"record_scan: passed and skip_until need {arr.size} entries (steps >= 0)")
        self._slots["reject_streak"][sl] = np.where(ok, 0, self._slots["reject_streak"][sl] + 1)
        self._slots["skip_until"][sl] = until

    def record_use(self, ids, *, weight: float) -> None:
        """Count one replay of each id (N_rep += 1) and add ``weight`` = 1/|A_t| in (0, 1] to its exposure."""
        sl = self._slot(check_ids("ids", ids))
        weight = check_real("weight", weight, lo=0.0, lo_open=True, hi=1.0)
        self._slots["replay_count"][sl] += 1
        self._slots["exposure"][sl] += weight

    def add_exposure(self, ids, weight: float) -> None:
        """Add ``weight`` in (0, 1] to the exposure W of ``ids`` (distinct, live)."""
        sl = self._slot(check_ids("ids", ids))
        weight = check_real("weight", weight, lo=0.0, lo_open=True, hi=1.0)
        self._slots["exposure"][sl] += weight

    def lifetime_record(self, insertion_id: int, *, evicted_step: int | None = None) -> dict[str, Any]:
        """Per-group lifetime record: birth step, H_ref, N_rep, exposure W, last cached Headroom."""
        i = check_int("insertion_id", insertion_id, hi=MAX_STEP)
        self._slot(np.asarray([i]))
        return self._lifetime(i, None if evicted_step is None else check_step("evicted_step", evicted_step))

    def _lifetime(self, insertion_id: int, evicted_step: int | None) -> dict[str, Any]:
        sl = int(self._slot(np.asarray([insertion_id]))[0])
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
        """(tensors, meta): new tensors (copies) plus a JSON-able dict; exact (cached values in float64)."""
        tensors, meta = self.checkpoint_state()
        return materialize(tensors), meta

    def checkpoint_state(self) -> tuple[dict[str, "torch.Tensor | Streamed"], dict[str, Any]]:
        """What :meth:`state_dict` returns, with the group payload as :class:`~hdreplay.checkpoint.tensorfile.Streamed`
        views of the storage instead of copies (what :meth:`save` writes; valid until the buffer next changes)."""
        ids = self.insertion_ids()
        sl = self._slot(ids)
        tensors: dict[str, Any] = {f"slot.{k}": torch.from_numpy(a[sl]) for k, a in self._slots.items()}  # (fancy
        tensors.update(checkpoint_tensors(self._blocks))                     # indexing copies: small per-group arrays)
        meta = {
            "capacity": self.capacity,
            "group_size": self.group_size,
            "next_id": self._next_id,
            "size": self._size,
            "group_ids": [g for b in self._blocks for g in b.group_ids],
            "birth_steps": [s for b in self._blocks for s in b.birth_steps],
            "extras_keys": None if self._extras_keys is None else list(self._extras_keys),
        }
        # multimodal buffers always; a text buffer only while empty (its groups say it is text-only otherwise, and
        # text checkpoints keep their exact form): an emptied text buffer stays text-only across a resume
        if self._mm_schema or (self._mm_schema is not None and not self._size):
            meta["mm_schema"] = schema_to_json(self._mm_schema)
        return tensors, meta

    def load_state_dict(self, tensors: dict[str, torch.Tensor], meta: dict[str, Any]) -> None:
        """Restore exactly; every field is validated first and a refused load leaves the buffer unchanged.

        The saved groups must fit this buffer: same capacity, and ``group_size`` responses each if set.
        Raises:
            CheckpointError naming what is inconsistent.
        """
        self._apply(parse_buffer_state(tensors, meta, capacity=self.capacity, group_size=self.group_size,
                                       slot_fields=self._SLOT_FIELDS, where="buffer state"))

    def _apply(self, state: BufferState) -> None:
        """Install a validated state (its blocks own their memory)."""
        L = min(self.capacity, max(INITIAL_SLOTS, state.size))
        slots = self._new_slots(L)
        ids = np.arange(state.next_id - state.size, state.next_id, dtype=np.int64)
        for k, a in state.slots.items():
            slots[k][ids % L] = a
        self._install(state.blocks, slots, state.next_id, state.size, state.extras_keys, state.mm_schema)

    def save(self, directory: str | os.PathLike) -> None:
        """Write the buffer to ``directory`` crash-safely (see :mod:`hdreplay.checkpoint.files`)."""
        check_path("save", directory)
        tensors, meta = self.checkpoint_state()
        write_checkpoint_dir(directory, format_name=BUFFER_FORMAT, version=BUFFER_VERSION,
                             tensors=tensors, meta=meta)

    @classmethod
    def load(cls, directory: str | os.PathLike) -> "ReplayBuffer":
        """A buffer restored from ``directory`` (with the saved capacity and group size)."""
        check_path("load", directory)
        with open_checkpoint_dir(directory, format_name=BUFFER_FORMAT, versions=BUFFER_VERSIONS) as (tensors, meta):
            try:
                buf = cls(meta.get("capacity"), group_size=meta.get("group_size"))
            except ReplayConfigError as e:
                raise CheckpointError(f"{directory}: buffer state holds an invalid {e.field}: {e.message}") from None
            buf.load_state_dict(tensors, meta)  # (the groups are read block by block)
        return buf
