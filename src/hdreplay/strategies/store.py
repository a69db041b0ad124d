"""What the prompt-keyed strategies (RePO, ExGRPO, BAPO) share: records kept per prompt key, and their checkpoint.

A prompt key is a string naming one prompt (the integration derives it from the dataset row, e.g. the JSON of its
prompt).  The stores hold :class:`~hdreplay.record.GroupRecord` s -- single responses (n = 1) or whole groups -- with
their generation-time log-probs, plus the dataset row that regenerates the prompt (ExGRPO substitutes stored prompts
into a batch, BAPO re-evaluates them).  Rows must be JSON-able to be checkpointed.

Checkpoints reuse the buffer's ragged storage (:class:`~hdreplay.storage.Block`) and crash-safe directory layout
(:mod:`hdreplay.checkpoint`): :func:`pack` / :func:`unpack` turn a list of records into flat tensors and back, with
every field validated on the way in.
"""

from __future__ import annotations

import json
import os
from typing import Any, Mapping, Sequence

import torch

from ..checkpoint import read_checkpoint_dir, write_checkpoint_dir
from ..errors import CheckpointError
from ..record import GroupRecord
from ..storage import Block

STORE_VERSION = 1


def prompt_key(prompt: Any) -> str:
    """A stable key for a prompt (a string, or a chat conversation: its canonical JSON)."""
    return prompt if isinstance(prompt, str) else json.dumps(prompt, sort_keys=True, separators=(",", ":"))


def pack(records: Sequence[GroupRecord], prefix: str) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """Flat tensors (names prefixed ``prefix.``) and JSON meta of ``records`` (an empty list gives no tensors)."""
    if not records:
        return {}, {"count": 0}
    blk = Block.build(0, list(records))
    tensors = {f"{prefix}.{k}": v for k, v in blk.to_tensors().items()}
    return tensors, {"count": len(records), "group_ids": [r.group_id for r in records],
                     "birth_steps": [r.birth_step for r in records], "extras_keys": sorted(records[0].extras)}


def unpack(tensors: Mapping[str, torch.Tensor], meta: Any, prefix: str, where: str) -> list[GroupRecord]:
    """The records :func:`pack` wrote (copies that own their memory); CheckpointError naming ``where`` if malformed."""
    if not isinstance(meta, Mapping) or not isinstance(meta.get("count"), int):
        raise CheckpointError(f"{where}: malformed record meta {meta!r:.80}")
    if meta["count"] == 0:
        return []
    ids, births, keys = meta.get("group_ids"), meta.get("birth_steps"), meta.get("extras_keys")
    if not (isinstance(ids, list) and isinstance(births, list) and isinstance(keys, list)
            and len(ids) == len(births) == meta["count"]):
        raise CheckpointError(f"{where}: record meta does not describe {meta['count']} records")
    own = {k[len(prefix) + 1:]: v for k, v in tensors.items() if k.startswith(prefix + ".")}
    blk = Block.from_tensors(own, first_id=0, group_ids=ids, birth_steps=births, extras_keys=keys, where=where)
    return [blk.view(j).clone() for j in range(blk.count)]


def save_state(directory: str | os.PathLike, format_name: str, tensors: Mapping[str, torch.Tensor],
               meta: Mapping[str, Any]) -> None:
    """Write a strategy's state crash-safely (CheckpointError if ``meta`` is not JSON-able, e.g. a dataset row
    holding images)."""
    write_checkpoint_dir(directory, format_name=format_name, version=STORE_VERSION, tensors=tensors, meta=meta)


def load_state(directory: str | os.PathLike, format_name: str) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    return read_checkpoint_dir(directory, format_name=format_name, versions=(STORE_VERSION,))


def keyed(records: Sequence[GroupRecord], keys: Sequence[str]) -> dict[str, list[GroupRecord]]:
    """Records grouped by key, in order (the inverse of flattening a keyed store for :func:`pack`)."""
    out: dict[str, list[GroupRecord]] = {}
    for k, r in zip(keys, records):
        out.setdefault(k, []).append(r)
    return out
