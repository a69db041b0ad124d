"""The schema of buffer and controller checkpoints, validated in full before anything is assigned.

:func:`parse_buffer_state` and :func:`parse_controller_state` turn the ``(tensors, meta)`` read
from a checkpoint into plain, checked values (types, lengths, uniqueness, ranges, cross-field
consistency); the buffer and the controller install them only after every check passed, so a
refused load changes nothing.

Resuming under a different configuration (the decision this module encodes):

* refused (:class:`~hdreplay.errors.CheckpointError`): ``capacity``; ``group_size`` when a stored
  group does not have that many responses (otherwise warned); ``headroom_weighting`` (the stored cached and
  reference Headroom are in the saved weighting's units, and mixing units would silently reorder
  the buffer);
* allowed with a :class:`~hdreplay.errors.ReplayResumeWarning` that names every change:
  ``selector``, ``k_rep``, ``tau``, ``drift_norm``, ``ingress``, ``answer_threshold``,
  ``truncate_multiple``, ``max_scan``, ``acceptance_ema`` and the rest of the scan's and the peers' settings
  (the stored groups and their priorities stay valid under these, but the resumed run no longer reproduces the
  uninterrupted one).  The observers' states (:mod:`hdreplay.diagnostics`) are handed to the observers, which
  check them (an adaptive-tau state outside the new bounds is clamped into them).
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any, Mapping

import numpy as np
import torch

from .errors import CheckpointError
from .multimodal import Schema, schema_from_json
from .sampling import rng_from_state
from .storage import PAYLOAD_DTYPES, SLOT_FIELDS, Block, bulk
from .tensorfile import FileTensor
from .validate import MAX_COUNT, MAX_STEP, is_int, is_real

#: configuration fields whose change at resume is refused / reported with a warning
CONFIG_REFUSED = ("capacity", "headroom_weighting")
CONFIG_WARNED = ("selector", "k_rep", "tau", "drift_norm", "ingress", "answer_threshold", "truncate_multiple",
                 "max_scan", "acceptance_ema", "group_size", "seed", "priority_alpha", "age_decay",
                 "is_beta", "max_age", "scan_refresh", "skip_rejected")
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


@dataclass
class ControllerState:
    buffer: BufferState
    acceptance_rate: float
    last_step: int | None
    observers: dict[str, Any]  # name -> saved state of an observer (hdreplay.diagnostics)
    starved_steps: int
    changes: list[str]  # "name: saved -> configured" for every warned configuration change
    rng_state: dict | None = None  # the random orders' generator (None: saved before it existed)


def _int(x: Any, lo: int, hi: int) -> bool:
    return is_int(x) and lo <= x <= hi


def parse_buffer_state(tensors: Any, meta: Any, *, capacity: int, group_size: int | None,
                       slot_fields: Mapping[str, type], where: str) -> BufferState:
    """Validate a buffer's ``(tensors, meta)`` for a buffer of ``capacity`` / ``group_size`` (tensors: torch tensors,
    or the :class:`~hdreplay.tensorfile.FileTensor` of a checkpoint being loaded, its bulk read block by block)."""
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


def parse_controller_state(tensors: Any, meta: Any, *, config: Any, where: str = "controller state"
                           ) -> ControllerState:
    """Validate a controller's ``(tensors, meta)`` for a controller configured with ``config``."""
    def bad(msg: str) -> CheckpointError:
        return CheckpointError(f"{where}: {msg}")

    if not isinstance(meta, Mapping):
        raise bad(f"meta must be a mapping, got {type(meta).__name__}")
    missing = [k for k in ("buffer", "acceptance_rate", "last_step", "config") if k not in meta]
    if missing:
        raise bad(f"missing entries {missing}; the checkpoint is incomplete or foreign")
    saved, now = meta["config"], config.to_dict()
    if not isinstance(saved, Mapping):
        raise bad("config must be a mapping")
    for name in CONFIG_REFUSED:
        if saved.get(name) != now[name]:
            raise bad(f"saved with {name} {saved.get(name)!r}, configured {now[name]!r}; resume with the same "
                      f"{name} (the stored buffer depends on it) or start a new run")
    rate, last = meta["acceptance_rate"], meta["last_step"]
    if not is_real(rate) or not 0.0 <= rate <= 1.0:
        raise bad(f"acceptance_rate {rate!r} is not a number in [0, 1]")
    if last is not None and not _int(last, 0, MAX_STEP - 1):
        raise bad(f"last_step {last!r} is not None or a step in [0, 2**53)")
    starved = meta.get("starved_steps", 0)
    if not _int(starved, 0, MAX_STEP - 1):
        raise bad(f"starved_steps {starved!r} is not an int >= 0")
    buf = parse_buffer_state(tensors, meta["buffer"], capacity=config.unit_capacity,
                             group_size=1 if config.unit == "rollout" else config.group_size,
                             slot_fields=SLOT_FIELDS, where=f"{where} (buffer)")
    if buf.size and (last is None or buf.slots["birth_step"].max() > last or buf.slots["refresh_step"].max() > last):
        raise bad(f"stored groups were born or refreshed after last_step {last!r}")
    observers = meta.get("observers", {})
    if not isinstance(observers, Mapping) or not all(isinstance(k, str) for k in observers):
        raise bad("observers must map observer names to their states")
    observers = dict(observers)
    if meta.get("tau_state") is not None and "adaptive_tau" not in observers:  # written before observers existed
        observers["adaptive_tau"] = meta["tau_state"]
    rng = meta.get("sampler_state")
    if rng is not None:
        rng_from_state(rng, where=f"{where}: sampler_state")  # raises CheckpointError if malformed
    defaults = {f.name: f.default for f in fields(type(config))}  # settings added after a checkpoint was written
    changes = [f"{k}: {saved.get(k, defaults[k])!r} -> {now[k]!r}" for k in CONFIG_WARNED
               if saved.get(k, defaults[k]) != now[k]]
    return ControllerState(buf, float(rate), last, observers, starved, changes, rng)
