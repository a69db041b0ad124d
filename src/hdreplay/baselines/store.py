"""What the prompt-keyed strategies (RePO, ExGRPO, BAPO) share: records kept per prompt key, and their checkpoint.

A prompt key is a string naming one prompt (the integration derives it from the dataset row, e.g. the JSON of its
prompt).  The stores hold :class:`~hdreplay.store.record.GroupRecord` s -- single responses (n = 1) or whole groups --
with their generation-time log-probs, plus the dataset row that regenerates the prompt (ExGRPO substitutes stored
prompts into a batch, BAPO re-evaluates them).  Rows must be JSON-able to be checkpointed.

Checkpoints reuse the buffer's ragged storage (:class:`~hdreplay.store.blocks.Block`) and crash-safe directory layout
(:mod:`hdreplay.checkpoint.files`, layout 2).  A load is validated like the core controller's
(:mod:`hdreplay.store.state`, :mod:`hdreplay.controller_state`): :func:`unpack` and the helpers below check every
field's type, range and length, each strategy checks its cross-field consistency, and only then is anything assigned --
a refused load (:class:`~hdreplay.errors.CheckpointError` naming the field) changes nothing.  Options changed at resume
are compared like the core's: what the stored state cannot hold under is refused, the rest is listed in one
:class:`~hdreplay.errors.ReplayResumeWarning`.
"""

from __future__ import annotations

import json
import math
import os
import warnings
from dataclasses import fields
from typing import Any, Callable, Mapping, Sequence

import torch

from ..checkpoint.files import check_identity, identity_of, read_checkpoint_dir, write_checkpoint_dir
from ..errors import CheckpointError, ReplayConfigError, ReplayInputError, ReplayResumeWarning
from ..store.blocks import PAYLOAD_DTYPES, Block
from ..store.multimodal import schema_from_json, schema_of, schema_to_json
from ..store.record import GroupRecord
from ..validate import MAX_COUNT, MAX_STEP, check_int, check_sequence, is_int, is_real

STORE_VERSION = 1
RECORD_META = ("count", "group_ids", "birth_steps", "extras_keys")


def prompt_key(prompt: Any) -> str:
    """A stable key for a prompt (a string, or a chat conversation: its canonical JSON)."""
    return prompt if isinstance(prompt, str) else json.dumps(prompt, sort_keys=True, separators=(",", ":"))


def pack(records: Sequence[GroupRecord], prefix: str) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """Flat tensors (names prefixed ``prefix.``) and JSON meta of ``records`` (an empty list gives no tensors); the
    records' multimodal inputs (one schema for all) are kept."""
    if not records:
        return {}, {"count": 0}
    schema = schema_of(records[0].mm_inputs)
    if any(schema_of(r.mm_inputs) != schema for r in records):
        raise CheckpointError(f"{prefix}: the stored groups hold multimodal inputs of different schemas; they cannot "
                              "be checkpointed together")
    blk = Block.build(0, list(records))
    tensors = {f"{prefix}.{k}": v for k, v in blk.to_tensors().items()}
    meta = {"count": len(records), "group_ids": [r.group_id for r in records],
            "birth_steps": [r.birth_step for r in records], "extras_keys": sorted(records[0].extras)}
    if schema:
        meta["mm_schema"] = schema_to_json(schema)
    return tensors, meta


def unpack(tensors: Mapping[str, torch.Tensor], meta: Any, prefix: str, where: str, *, single: bool = False,
           last_step: int | None = None) -> list[GroupRecord]:
    """The records :func:`pack` wrote (copies that own their memory), every field checked: CheckpointError naming
    ``where`` if malformed.  ``single``: each must hold one response; ``last_step``: none may be born after it."""
    def bad(msg: str) -> CheckpointError:
        return CheckpointError(f"{where}: {msg}")

    if not isinstance(meta, Mapping):
        raise bad(f"the record list must be a mapping, got {type(meta).__name__}")
    own = {k[len(prefix) + 1:]: v for k, v in tensors.items() if k.startswith(prefix + ".")}
    count = meta.get("count")
    if not is_int(count) or not 0 <= count <= MAX_COUNT:
        raise bad(f"records.count {count!r} is not an int >= 0")
    if count == 0:
        if own:
            raise bad(f"no records, but tensors {sorted(own)[:3]} are stored")
        return []
    missing = [k for k in RECORD_META if k not in meta]
    if missing:
        raise bad(f"records: missing entries {missing}")
    ids, births, keys = meta["group_ids"], meta["birth_steps"], meta["extras_keys"]
    if not isinstance(ids, list) or len(ids) != count or not all(
            isinstance(g, (str, int)) and not isinstance(g, bool) for g in ids):
        raise bad(f"records.group_ids must be a list of {count} str/int ids")
    if not isinstance(births, list) or len(births) != count or not all(
            is_int(b) and 0 <= b < MAX_STEP for b in births):
        raise bad(f"records.birth_steps must be a list of {count} steps in [0, 2**53)")
    if last_step is not None and max(births) > last_step:
        raise bad(f"records.birth_steps: a record born at step {max(births)}, after the last step {last_step}")
    if not isinstance(keys, list) or not all(isinstance(e, str) for e in keys) or keys != sorted(set(keys)):
        raise bad(f"records.extras_keys must be a sorted list of distinct names, got {keys!r:.60}")
    mm = schema_from_json(meta.get("mm_schema"), bad)
    allowed = set(PAYLOAD_DTYPES) | {f"extra.{e}" for e in keys} | {f"{p}.{k}" for k in mm or {}
                                                                      for p in ("mm", "mm_off")}
    if set(own) - allowed:
        raise bad(f"unexpected tensors {sorted(set(own) - allowed)[:3]}")
    out = [b.view(j).clone() for b in Block.from_tensors(own, first_id=0, group_ids=ids, birth_steps=births,
                                                          extras_keys=keys, where=where, mm_schema=mm)
           for j in range(b.count)]
    if single and any(r.num_responses != 1 for r in out):
        raise bad("a stored record holds more than one response; this store keeps single responses")
    return out


# ------------------------------------------------------------------------------------------ protocol arguments
def check_groups(what: str, groups: Any, *, n: int | None = None) -> list[GroupRecord]:
    """``groups`` as a list of GroupRecords (of ``n`` responses each if given); ReplayInputError otherwise."""
    out = check_sequence(f"{what}: groups", groups)
    for g in out:
        if not isinstance(g, GroupRecord):
            raise ReplayInputError(f"{what}: groups must be GroupRecords, got {type(g).__name__}")
        if n is not None and g.num_responses != n:
            raise ReplayInputError(f"{what}: group {g.group_id!r} has {g.num_responses} responses, expected {n}")
    return out


def check_options(what: str, options: Any, cls: type) -> Any:
    if not isinstance(options, cls):
        raise ReplayConfigError(f"{what}: options must be a {cls.__name__}, got {type(options).__name__}",
                                field="options")
    return options


def check_commit(num_fresh_groups: Any, counters: Any) -> None:
    if num_fresh_groups is not None:
        check_int("commit: num_fresh_groups", num_fresh_groups)
    if counters is not None and not isinstance(counters, Mapping):
        raise ReplayInputError(f"commit: counters must be a mapping or None, got {type(counters).__name__}")


# ------------------------------------------------------------------------------------------ shared field checks
def checked_meta(meta: Any, keys: Sequence[str], where: str) -> Mapping[str, Any]:
    if not isinstance(meta, Mapping):
        raise CheckpointError(f"{where}: meta must be a mapping, got {type(meta).__name__}")
    missing = [k for k in keys if k not in meta]
    if missing:
        raise CheckpointError(f"{where}: missing entries {missing}; the checkpoint is incomplete or foreign")
    return meta


def only_tensors(tensors: Any, prefix: str, where: str) -> Mapping[str, torch.Tensor]:
    """``tensors`` as a name -> tensor mapping whose names all start with ``prefix.``."""
    if not isinstance(tensors, Mapping) or not all(isinstance(k, str) and isinstance(v, torch.Tensor)
                                                   for k, v in tensors.items()):
        raise CheckpointError(f"{where}: tensors must be a mapping name -> torch.Tensor")
    other = sorted(k for k in tensors if not k.startswith(prefix + "."))
    if other:
        raise CheckpointError(f"{where}: unexpected tensors {other[:3]}")
    return {k: v.detach().cpu() for k, v in tensors.items()}


def step_or_none(value: Any, name: str, where: str) -> int | None:
    if value is not None and not (is_int(value) and 0 <= value < MAX_STEP):
        raise CheckpointError(f"{where}: {name} {value!r} is not None or a step in [0, 2**53)")
    return None if value is None else int(value)


def real_list(value: Any, name: str, where: str, *, lo: int, hi: int) -> list[float]:
    """A list of ``lo``..``hi`` finite numbers, as floats."""
    if not isinstance(value, list) or not lo <= len(value) <= hi or not all(
            is_real(v) and math.isfinite(v) for v in value):
        raise CheckpointError(f"{where}: {name} must be a list of {lo} to {hi} finite numbers, got {value!r:.60}")
    return [float(v) for v in value]


def keys_of(value: Any, records: Sequence[GroupRecord], where: str, key: Callable[[GroupRecord], str] | None
            ) -> list[str]:
    """The per-record prompt keys: one str per record, each key's records stored together (as the stores flatten
    them), and -- with ``key`` -- equal to the key of the record's prompt."""
    if not isinstance(value, list) or len(value) != len(records) or not all(isinstance(k, str) for k in value):
        raise CheckpointError(f"{where}: keys must be a list of {len(records)} prompt keys (str)")
    runs = [k for i, k in enumerate(value) if i == 0 or value[i - 1] != k]
    if len(runs) != len(set(runs)):
        raise CheckpointError(f"{where}: keys: a prompt's records are not stored together")
    if key is not None:
        wrong = next((k for k, r in zip(value, records) if key(r) != k), None)
        if wrong is not None:
            raise CheckpointError(f"{where}: keys: {wrong!r} is not the key of its record's prompt")
    return value


def options_changes(cls: type, saved: Any, now: Any, where: str) -> tuple[Any, list[str]]:
    """(the saved options as a ``cls``, ``"name: saved -> configured"`` for every changed field)."""
    if not isinstance(saved, Mapping) or not all(isinstance(k, str) for k in saved):
        raise CheckpointError(f"{where}: options must be a mapping, got {type(saved).__name__}")
    try:
        old = cls(**saved)
    except (TypeError, ReplayConfigError) as e:
        raise CheckpointError(f"{where}: the saved options are invalid ({e})") from None
    return old, [f"{f.name}: {getattr(old, f.name)!r} -> {getattr(now, f.name)!r}" for f in fields(cls)
                 if getattr(old, f.name) != getattr(now, f.name)]


def refuse_option(where: str, name: str, saved: Any, now: Any, why: str) -> CheckpointError:
    return CheckpointError(f"{where}: saved with {name}={saved!r}, configured {name}={now!r}: {why}; resume with "
                           f"{name}={saved!r} or start a new run")


def warn_changes(name: str, changes: Sequence[str]) -> None:
    if changes:
        warnings.warn(f"hdreplay: {name} resumed under changed options (" + "; ".join(changes) + "); the resumed run "
                      "will not reproduce the uninterrupted one", ReplayResumeWarning, stacklevel=3)


def save_state(directory: str | os.PathLike, format_name: str, tensors: Mapping[str, torch.Tensor],
               meta: Mapping[str, Any]) -> None:
    """Write a strategy's state crash-safely (CheckpointError if ``meta`` is not JSON-able, e.g. a dataset row
    holding images)."""
    write_checkpoint_dir(directory, format_name=format_name, version=STORE_VERSION, tensors=tensors, meta=meta)


def load_state(directory: str | os.PathLike, format_name: str) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    return read_checkpoint_dir(directory, format_name=format_name, versions=(STORE_VERSION,))


class StoredState:
    """``save`` / ``load`` / ``close`` of a peer controller whose state is ``state_dict()`` -> (tensors, meta) and
    ``load_state_dict(tensors, meta)``, written crash-safely under the class's ``FORMAT``."""

    FORMAT: str

    def save(self, directory, *, allow_open_step: bool = False, identity: dict | None = None) -> None:
        """``identity``: what the state belongs to (see :meth:`hdreplay.ReplayController.save`)."""
        identity = identity_of("identity", identity, ReplayInputError)
        tensors, meta = self.state_dict()
        save_state(directory, self.FORMAT, tensors, {**meta, "identity": identity} if identity else meta)

    def load(self, directory, *, expect: dict | None = None) -> None:
        """Restore from :meth:`save`'s directory (CheckpointError naming the field if malformed; nothing changes);
        ``expect``: see :meth:`hdreplay.ReplayController.load`."""
        expect = identity_of("expect", expect, ReplayInputError)
        tensors, meta = load_state(directory, self.FORMAT)
        check_identity(meta, expect, directory)
        meta = {k: v for k, v in meta.items() if k != "identity"}
        try:
            self.load_state_dict(tensors, meta)
        except CheckpointError as e:
            raise CheckpointError(f"{directory}: {e}") from None

    def close(self) -> None:
        pass


def keyed(records: Sequence[GroupRecord], keys: Sequence[str]) -> dict[str, list[GroupRecord]]:
    """Records grouped by key, in order (the inverse of flattening a keyed store for :func:`pack`)."""
    out: dict[str, list[GroupRecord]] = {}
    for k, r in zip(keys, records):
        out.setdefault(k, []).append(r)
    return out
