"""The schema of a buffer's checkpoint, validated in full before anything is assigned.

:func:`parse_buffer_state` turns the ``(tensors, meta)`` read from a checkpoint into plain, checked values (types,
lengths, uniqueness, ranges, cross-field consistency: :class:`BufferState`); the buffer installs them only after every
check passed, so a refused load changes nothing.  The controller's checkpoint wraps it
(:mod:`hdreplay.controller_state`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

import numpy as np
import torch

from ..checkpoint.tensorfile import FileTensor
from ..errors import CheckpointError
from ..validate import MAX_COUNT, MAX_STEP, is_int
from .blocks import PAYLOAD_DTYPES, Block, bulk
from .multimodal import Schema, schema_from_json

#: slots added after checkpoints were first written, and the value an older checkpoint's groups get
SLOT_DEFAULTS = {"reject_streak": 0, "skip_until": 0}
BUFFER_META_KEYS = ("capacity", "group_size", "next_id", "size", "group_ids", "birth_steps", "extras_keys")
_TORCH = {np.int64: torch.int64, np.float64: torch.float64}



@dataclass
class BufferState:
    blocks: list[Block]  # all live groups, in blocks of at most BLOCK_GROUPS that own their memory
    slots: dict[str, np.ndarray]  # name -> (size,) values, oldest first
    next_id: int
    size: int
    extras_keys: tuple[str, ...] | None
    mm_schema: Schema | None = None


def _int(x: Any, lo: int, hi: int) -> bool:
    return is_int(x) and lo <= x <= hi


def parse_buffer_state(tensors: Any, meta: Any, *, capacity: int, group_size: int | None,
                       slot_fields: Mapping[str, type], where: str) -> BufferState:
    """Validate a buffer's ``(tensors, meta)`` for a buffer of ``capacity`` / ``group_size`` (tensors: torch tensors,
    or the :class:`~hdreplay.checkpoint.tensorfile.FileTensor` of a checkpoint being loaded, its bulk read block by block)."""  # noqa: E501
    def bad(msg: str) -> CheckpointError:
        return CheckpointError(f"{where}: {msg}")

    if not isinstance(tensors, Mapping) or not all(isinstance(k, str) and isinstance(v, (torch.Tensor, FileTensor))
                                                   for k, v in tensors.items()):
        raise bad("tensors must be a mapping name -> torch.Tensor")
    if not isinstance(meta, Mapping):
        raise bad(f"meta must be a mapping, got {type(meta).__name__}")
    missing = [k for k in BUFFER_META_KEYS if k not in meta]
    if missing:
        raise bad(f"missing entries {missing}; the checkpoint is incomplete or foreign")
    if meta["capacity"] != capacity or not is_int(meta["capacity"]):
        raise bad(f"saved with capacity {meta['capacity']!r}, this buffer has capacity {capacity}; "
                  "construct the buffer with the saved capacity")
    saved_gs, size, nid = meta["group_size"], meta["size"], meta["next_id"]
    if saved_gs is not None and not _int(saved_gs, 1, MAX_COUNT):
        raise bad(f"group_size {saved_gs!r} is not None or an int >= 1")
    if not _int(size, 0, capacity) or not _int(nid, size, 1 << 62):
        raise bad(f"inconsistent sizes (size={size!r}, next_id={nid!r}, capacity={capacity})")
    gids, births, ek = meta["group_ids"], meta["birth_steps"], meta["extras_keys"]
    if not isinstance(gids, list) or len(gids) != size or not all(
            isinstance(g, (str, int)) and not isinstance(g, bool) for g in gids):
        raise bad(f"group_ids must be a list of {size} str/int ids")
    if len(set(gids)) != size:
        raise bad("group_ids are not unique")
    if not isinstance(births, list) or len(births) != size or not all(_int(b, 0, MAX_STEP - 1) for b in births):
        raise bad(f"birth_steps must be a list of {size} steps in [0, 2**53)")
    if ek is not None and (not isinstance(ek, list) or not all(isinstance(e, str) for e in ek)
                           or ek != sorted(set(ek))):
        raise bad(f"extras_keys must be None or a sorted list of distinct names, got {ek!r}")
    if size and ek is None:
        raise bad("extras_keys is None but groups are stored")
    mm = schema_from_json(meta.get("mm_schema"), bad)  # absent for text buffers (and in older checkpoints)
    if mm is None and size:
        mm = {}  # stored text groups: an image group may not join them
    allowed = {f"slot.{k}" for k in slot_fields}
    if size:
        allowed |= set(PAYLOAD_DTYPES) | {f"extra.{e}" for e in ek}
        allowed |= {f"{p}.{k}" for k in (mm or {}) for p in ("mm", "mm_off")}
    unexpected = sorted(set(tensors) - allowed)
    if unexpected:
        raise bad(f"unexpected tensors {unexpected[:5]}")
    tensors = {k: v.detach().cpu() if isinstance(v, torch.Tensor) else v if bulk(k) else v.read()  # (a programmatic
               for k, v in tensors.items()}                                        # state may need grad / a GPU)
    slots = {}
    for k, dt in slot_fields.items():
        t = tensors.get(f"slot.{k}")
        if t is None and k in SLOT_DEFAULTS:  # written before the slot existed
            slots[k] = np.full(size, SLOT_DEFAULTS[k], dtype=dt)
            continue
        if t is None or t.dim() != 1 or t.numel() != size or t.dtype != _TORCH[dt]:
            raise bad(f"slot.{k} must be a 1-D {_TORCH[dt]} tensor of {size} entries")
        slots[k] = t.numpy().astype(dt)  # a copy
    ids = np.arange(nid - size, nid, dtype=np.int64)
    if not np.array_equal(slots["insertion_id"], ids):
        raise bad("insertion ids are not the consecutive range ending at next_id")
    if not np.array_equal(slots["birth_step"], np.asarray(births, dtype=np.int64)):
        raise bad("slot birth steps differ from birth_steps")
    for k in ("cached_headroom", "ref_headroom", "exposure"):
        if not np.isfinite(slots[k]).all():
            raise bad(f"slot.{k} holds non-finite values")
    if (slots["exposure"] < 0).any() or (slots["replay_count"] < 0).any():
        raise bad("negative replay counts or exposure")
    if ((slots["refresh_step"] < 0) | (slots["refresh_step"] >= MAX_STEP)).any():
        raise bad("refresh steps out of range")
    if (slots["reject_streak"] < 0).any() or ((slots["skip_until"] < 0) | (slots["skip_until"] > MAX_STEP)).any():
        raise bad("negative reject streaks or skip steps out of range")
    blocks = []
    if size:
        blocks = Block.from_tensors(tensors, first_id=int(ids[0]), group_ids=gids, birth_steps=births,
                                    extras_keys=ek, where=where, mm_schema=mm)
        if not np.array_equal(np.concatenate([b.loss_tokens() for b in blocks]), slots["num_loss_tokens"]):
            raise bad("slot.num_loss_tokens differs from the stored loss masks")
        n = np.concatenate([np.diff(b.resp_off) for b in blocks])
        for label, gs in (("saved", saved_gs), ("configured", group_size)):
            if gs is not None and (n != gs).any():
                raise bad(f"stored groups have {sorted(set(n.tolist()))} responses but the {label} group_size "
                          f"is {gs}; resume with the saved group size")
    return BufferState(blocks, slots, nid, size, None if ek is None else tuple(ek), mm)
