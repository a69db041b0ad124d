"""Atomic checkpoint directories: safetensors for tensors, JSON for everything else.

A checkpoint directory holds exactly two files:
    tensors.safetensors   flat tensors
    state.json            {"format": ..., "version": ..., "sha256": <of tensors file>, "meta": {...}}

Writes go to a temporary sibling directory that is fsynced and renamed into
place, so a reader sees either the previous complete checkpoint or the new
complete one.  Reads verify the format name, version, the tensor file's
checksum and the presence of every expected key, and raise
:class:`~hdreplay.errors.CheckpointError` saying what is wrong.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
import uuid
from pathlib import Path
from typing import Any, Mapping

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from .errors import CheckpointError

TENSORS_FILE = "tensors.safetensors"
STATE_FILE = "state.json"


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _fsync_file(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:  # pragma: no cover - platforms without directory fds
        return
    try:
        os.fsync(fd)
    except OSError:  # pragma: no cover
        pass
    finally:
        os.close(fd)


def write_checkpoint_dir(
    directory: str | os.PathLike,
    *,
    format_name: str,
    version: int,
    tensors: Mapping[str, torch.Tensor],
    meta: Mapping[str, Any],
) -> Path:
    """Atomically write ``tensors`` and JSON-able ``meta`` into ``directory`` (replacing it)."""
    directory = Path(directory)
    parent = directory.parent
    parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{directory.name}.tmp-", dir=parent))
    try:
        tpath = tmp / TENSORS_FILE
        save_file({k: v.detach().cpu().contiguous() for k, v in tensors.items()}, str(tpath))
        _fsync_file(tpath)
        state = {"format": format_name, "version": version, "sha256": _sha256(tpath), "meta": meta}
        spath = tmp / STATE_FILE
        with open(spath, "w") as f:
            json.dump(state, f, allow_nan=True)
            f.flush()
            os.fsync(f.fileno())
        _fsync_dir(tmp)
        if directory.exists():
            old = parent / f".{directory.name}.old-{uuid.uuid4().hex[:8]}"
            os.rename(directory, old)
            os.rename(tmp, directory)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.rename(tmp, directory)
        _fsync_dir(parent)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return directory


def read_checkpoint_dir(
    directory: str | os.PathLike, *, format_name: str, versions: tuple[int, ...]
) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """Read and verify a directory written by :func:`write_checkpoint_dir`."""
    directory = Path(directory)
    if not directory.is_dir():
        raise CheckpointError(f"{directory}: not a directory; expected an hdreplay checkpoint ({format_name})")
    spath, tpath = directory / STATE_FILE, directory / TENSORS_FILE
    for p in (spath, tpath):
        if not p.is_file():
            raise CheckpointError(
                f"{directory}: missing {p.name}; this is not a complete hdreplay checkpoint "
                f"(expected {STATE_FILE} and {TENSORS_FILE})"
            )
    try:
        with open(spath) as f:
            state = json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{spath}: unreadable JSON ({e}); the checkpoint is truncated or corrupted") from e
    if not isinstance(state, dict) or state.get("format") != format_name:
        found = state.get("format") if isinstance(state, dict) else type(state).__name__
        raise CheckpointError(f"{directory}: holds format {found!r}, expected {format_name!r}; wrong directory?")
    if state.get("version") not in versions:
        raise CheckpointError(
            f"{directory}: {format_name} version {state.get('version')!r} is not supported (supported: {list(versions)})"
        )
    digest = _sha256(tpath)
    if digest != state.get("sha256"):
        raise CheckpointError(
            f"{tpath}: checksum mismatch (file {digest[:12]}..., recorded {str(state.get('sha256'))[:12]}...); "
            "the tensor file is truncated or was modified"
        )
    try:
        tensors = load_file(str(tpath))
    except (SafetensorError, OSError, ValueError) as e:  # pragma: no cover - checksum catches most
        raise CheckpointError(f"{tpath}: cannot read tensors ({e})") from e
    meta = state.get("meta")
    if not isinstance(meta, dict):
        raise CheckpointError(f"{spath}: missing 'meta' section")
    return tensors, meta


def require_keys(where: str, mapping: Mapping[str, Any], keys: tuple[str, ...]) -> None:
    missing = [k for k in keys if k not in mapping]
    if missing:
        raise CheckpointError(f"{where}: missing entries {missing}; the checkpoint is incomplete or foreign")
