"""Crash-safe checkpoint directories: safetensors for tensors, JSON for everything else.

Layout (layout 2) of a checkpoint directory ``D``::

    D/manifest.json                    which version is current + size and sha256 of every file
    D/v-<16 hex>/state.json            {"format": ..., "version": ..., "meta": {...}}
    D/v-<16 hex>/tensors.safetensors   flat tensors

``manifest.json`` is ``{"format", "layout": 2, "dir": "v-...", "files": {name: {"bytes", "sha256"}},
"sha256"}`` where the last entry is the sha256 of the canonical JSON of the others: every file of
a checkpoint, the manifest itself and ``state.json`` included, is covered by a checksum.

Save (:func:`write_checkpoint_dir`), a crash at any file-system call included:

1. serialise the JSON part in memory and lay out the tensor file's header (a failure here writes nothing);
2. take the directory's lock ``D/.hdreplay.lock`` (:mod:`hdreplay.checkpoint.dirlock`: one writer per directory; a
   second writer is refused with :class:`~hdreplay.errors.CheckpointLockedError` naming the first);
3. write both files into a new hidden directory ``D/.tmp-v-...`` -- the tensors streamed block by block from
   the caller's storage (:mod:`hdreplay.checkpoint.tensorfile`: no copy of the whole state is ever built) -- fsync each
   and the directory, and rename it to ``D/v-...`` (not referenced by the manifest yet: invisible to a load);
4. write the new manifest to a hidden temporary file named with the lock's token, fsync it, check the lock is still
   this save's, and rename the manifest over ``D/manifest.json`` -- the single commit point (``rename`` replaces
   atomically) -- then fsync ``D``.  A writer that breaks a stale lock first deletes the broken save's staged
   manifest (:mod:`hdreplay.checkpoint.dirlock`), so a save that stalled past the lock's age limit after its check
   cannot commit: it fails with :class:`~hdreplay.errors.CheckpointLockedError`;
5. delete what the new manifest does not reference among the entries that were there when the lock was taken: the
   previous version and leftovers of crashed saves (hidden temporaries, unreferenced versions) -- never what another
   writer made since, nor the directory the manifest names at that moment; release the lock.

Before the commit point the manifest names the previous complete version, which steps 1-4 never
touch; after it, it names the new complete one.  So after a crash anywhere, a load yields exactly
the previous state or exactly the new one, and the next save removes the leftovers (a crashed save's
lock is stale: its process is gone).  A disk-full or permission error before the commit point raises
:class:`~hdreplay.errors.CheckpointError` naming the path and leaves the previous checkpoint intact.  A load
that runs while a save deletes the previous version may fail with ``CheckpointError`` (retry it).

Load (:func:`open_checkpoint_dir`) follows the manifest only, verifies its own checksum, opens each file (only a
regular file, never waited on), checks its size and streams its sha256 before parsing it; the tensors are then read
from that same open file on demand (:class:`~hdreplay.checkpoint.tensorfile.FileTensor`), so a buffer is built block by
block, with little memory beyond the state it builds.  Any mismatch raises ``CheckpointError`` saying what is wrong.

Layout 1 (``D/state.json`` and ``D/tensors.safetensors``, no manifest: the unreleased hdreplay 0.1) is not read; a
load names it.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import stat
import uuid
from pathlib import Path
from typing import Any, BinaryIO, Iterable, Iterator, Mapping

import torch

from ..errors import CheckpointError, CheckpointLockedError, CheckpointMismatchError
from . import dirlock, tensorfile
from .dirlock import DirLock

TENSORS_FILE = "tensors.safetensors"
STATE_FILE = "state.json"
MANIFEST_FILE = "manifest.json"
LAYOUT = 2
_VERSION_DIR = re.compile(r"v-[0-9a-f]{16}")
_OURS = re.compile(r"v-[0-9a-f]{16}|\.tmp-v-[0-9a-f]{16}|\.manifest\.json\.tmp-[0-9a-f]{16}"
                   r"|\.hdreplay\.lock\.(tmp|stale)-[0-9a-f]{16}")
_MAX_MANIFEST_BYTES = 1 << 20


class _FS:
    """Every file-system call :func:`write_checkpoint_dir` makes, in one place (tests replace
    :data:`FS` to inject a crash or an error at each of them)."""

    makedirs = staticmethod(lambda p: os.makedirs(p, exist_ok=True))
    mkdir = staticmethod(os.mkdir)
    open = staticmethod(os.open)
    write = staticmethod(os.write)
    fsync = staticmethod(os.fsync)
    close = staticmethod(os.close)
    rename = staticmethod(os.rename)
    replace = staticmethod(os.replace)
    link = staticmethod(os.link)
    listdir = staticmethod(os.listdir)
    unlink = staticmethod(os.unlink)
    rmdir = staticmethod(os.rmdir)
    is_dir = staticmethod(lambda p: os.path.isdir(p) and not os.path.islink(p))

    @staticmethod
    def read_bytes(path: Path, limit: int = 1 << 62) -> bytes:
        with _open(path) as f:
            if os.fstat(f.fileno()).st_size > limit:
                raise CheckpointError(f"{path}: larger than {limit} bytes, far too large for a {path.name}; corrupted")
            return f.read()


FS = _FS()


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _manifest_digest(manifest: Mapping[str, Any]) -> str:
    body = {k: v for k, v in manifest.items() if k != "sha256"}
    return _sha256(json.dumps(body, sort_keys=True, separators=(",", ":")).encode())


def _write_file(path: Path, chunks: Iterable[bytes | memoryview], beat=lambda: None) -> dict[str, Any]:
    """Write ``chunks`` to a new file, fsync it; returns its manifest entry ``{"bytes", "sha256"}``."""
    h, n = hashlib.sha256(), 0
    fd = FS.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        for data in chunks:
            view, done = memoryview(data), 0
            h.update(view)
            while done < len(view):
                done += FS.write(fd, view[done:])
            n += done
            beat()
        FS.fsync(fd)
    finally:
        FS.close(fd)
    return {"bytes": n, "sha256": h.hexdigest()}


def _fsync_dir(path: Path) -> None:
    fd = FS.open(path, os.O_RDONLY)
    try:
        FS.fsync(fd)
    finally:
        FS.close(fd)


def _remove(path: Path) -> None:
    """Delete a file or a directory tree (through :data:`FS`)."""
    if FS.is_dir(path):
        for entry in FS.listdir(path):
            _remove(path / entry)
        FS.rmdir(path)
    else:
        FS.unlink(path)


def _remove_quietly(*paths: Path) -> None:
    for p in paths:
        try:
            _remove(p)
        except OSError:
            pass


def _describe(e: OSError) -> str:
    return f"{e.strerror or e}" + (f": {e.filename}" if e.filename else "")


def write_checkpoint_dir(
    directory: str | os.PathLike,
    *,
    format_name: str,
    version: int,
    tensors: Mapping[str, "torch.Tensor | tensorfile.Streamed"],
    meta: Mapping[str, Any],
) -> Path:
    """Write ``tensors`` and JSON-able ``meta`` as the new current version of ``directory`` (see module doc).

    ``tensors`` may hold :class:`~hdreplay.checkpoint.tensorfile.Streamed` entries, written piece by piece (no copy).
    Raises CheckpointLockedError if another writer holds the directory, CheckpointError otherwise."""
    d = Path(directory)
    try:
        specs = tensorfile.specs(tensors)
        prefix, _ = tensorfile.header(specs)
        sbytes = json.dumps({"format": format_name, "version": version, "meta": meta}, allow_nan=False).encode()
    except (TypeError, ValueError) as e:
        raise CheckpointError(f"{d}: cannot serialise the state ({e}); nothing was written") from e
    name = f"v-{uuid.uuid4().hex[:16]}"
    tmp, final = d / f".tmp-{name}", d / name
    committed, lock, mtmp = False, None, None
    try:
        FS.makedirs(d)
        lock = DirLock(d, FS, fence=lambda token: _fence(d, token))
        mtmp = _staged_manifest(d, lock.token)
        lock.acquire()
        before = set(FS.listdir(d))  # what cleanup may delete: nothing another writer creates from now on
        FS.mkdir(tmp)
        files = {STATE_FILE: _write_file(tmp / STATE_FILE, [sbytes]),
                 TENSORS_FILE: _write_file(tmp / TENSORS_FILE, tensorfile.chunks(specs, prefix), lock.heartbeat)}
        _fsync_dir(tmp)
        FS.rename(tmp, final)
        _fsync_dir(d)
        manifest: dict[str, Any] = {"format": format_name, "layout": LAYOUT, "dir": name, "files": files}
        manifest["sha256"] = _manifest_digest(manifest)
        _write_file(mtmp, [json.dumps(manifest, sort_keys=True).encode()])
        lock.verify()
        FS.replace(mtmp, d / MANIFEST_FILE)  # the commit point
        committed = True
        _fsync_dir(d)
    except CheckpointError:  # the lock is held by another writer, or its name is not a lock file
        _abandon(lock, tmp, final, mtmp)
        raise
    except (ValueError, TypeError) as e:  # a streamed tensor whose pieces do not match its declaration
        _abandon(lock, tmp, final, mtmp)
        raise CheckpointError(f"{d}: cannot serialise the state ({e}); the previous checkpoint at this path, if "
                              "any, is intact") from e
    except OSError as e:
        if committed:
            _release(lock)
            raise CheckpointError(f"{d}: the new checkpoint is in place but its directory could not be synced "
                                  f"({_describe(e)})") from e
        if isinstance(e, FileNotFoundError) and lock is not None and lock.held and lock.lost():
            _abandon(lock, tmp, final, mtmp)
            raise CheckpointLockedError(
                f"{d}: this save stalled past the lock's age limit ({dirlock.STALE_AFTER_S:.0f} s untouched) and another "  # noqa: E501
                f"writer broke its lock and fenced it off ({_describe(e)}); nothing was committed: the directory "
                "holds the other writer's checkpoint. Two jobs must not write the same checkpoint directory") from e
        _abandon(lock, tmp, final, mtmp)
        raise CheckpointError(f"{d}: cannot write the checkpoint ({_describe(e)}); the previous checkpoint at "
                              "this path, if any, is intact") from e
    except BaseException:  # interrupted (or a simulated crash): the lock is left to be found stale
        if lock is not None:
            lock._forget()
        raise
    try:
        if lock.holds():  # (a save whose lock was broken after its commit leaves the cleanup to the next one)
            _clean(d, keep={MANIFEST_FILE, name}, only=before)
    finally:
        lock._forget()  # (a crash during the cleanup leaves a lock the next save finds stale)
    _release(lock)
    return d


def _abandon(lock: DirLock | None, *paths: Path) -> None:
    """Undo an uncommitted save: remove its files (only while holding the lock) and release the lock."""
    if lock is not None and lock.held:
        _remove_quietly(*paths)
    _release(lock)


def _release(lock: DirLock | None) -> None:
    if lock is None:
        return
    try:
        lock.release()
    except OSError:
        pass


def _staged_manifest(d: Path, token: str) -> Path:
    """Where the save holding the lock with ``token`` stages its manifest (a breaker of that lock deletes it)."""
    return d / f".{MANIFEST_FILE}.tmp-{token}"


def _fence(d: Path, token: str) -> None:
    """Delete the staged manifest of the save holding the lock with ``token``, whose lock is being broken: its commit
    (a rename of that file) can then no longer land.  CheckpointError if it cannot be deleted."""
    path = _staged_manifest(d, token)
    if not _OURS.fullmatch(path.name):  # (tokens are 16 hex digits: dirlock.parse)
        raise CheckpointError(f"{d}: a lock token {token!r} that names no staged manifest; the lock file is not ours")
    try:
        FS.unlink(path)
    except FileNotFoundError:
        return
    except OSError as e:
        raise CheckpointError(f"{path}: cannot delete the staged manifest of the save whose lock was broken "
                              f"({_describe(e)}), so a stalled writer could still commit; remove {path}") from e


def _named_dir(d: Path) -> str | None:
    """The version directory the manifest names now (None if unreadable)."""
    try:
        man = json.loads(FS.read_bytes(d / MANIFEST_FILE, _MAX_MANIFEST_BYTES))
        return man.get("dir") if isinstance(man, dict) and isinstance(man.get("dir"), str) else None
    except (OSError, CheckpointError, ValueError, UnicodeDecodeError, RecursionError):
        return None


def _clean(d: Path, keep: set[str], only: set[str]) -> None:
    """Remove what the current manifest does not reference among ``only`` (the entries there before this save took
    its lock: never what another writer made after breaking it) and never the directory the manifest names at this
    moment (best effort: the next save retries)."""
    keep = keep | {_named_dir(d)}
    for entry in sorted(only):
        if entry not in keep and _OURS.fullmatch(entry):
            _remove_quietly(d / entry)


@contextlib.contextmanager
def open_checkpoint_dir(
    directory: str | os.PathLike, *, format_name: str, versions: tuple[int, ...]
) -> Iterator[tuple[dict[str, tensorfile.FileTensor], dict[str, Any]]]:
    """Verify the current version of a directory written by :func:`write_checkpoint_dir` and yield ``(tensors,
    meta)``: the tensors as :class:`~hdreplay.checkpoint.tensorfile.FileTensor` of the verified file, read on demand
    inside the ``with`` block (an OSError there becomes CheckpointError)."""
    d = Path(directory)
    try:
        if not d.is_dir():
            raise CheckpointError(f"{d}: not a directory; expected an hdreplay checkpoint ({format_name})")
        if os.path.lexists(d / MANIFEST_FILE):
            state, f, where = _read_manifest_layout(d, format_name)
        elif os.path.lexists(d / STATE_FILE):
            raise CheckpointError(f"{d}: a layout-1 checkpoint ({STATE_FILE} without {MANIFEST_FILE}) "
                                  "of the unreleased hdreplay 0.1, which this version does not read; start a new run")
        else:
            leftovers = sorted(e for e in os.listdir(d) if _OURS.fullmatch(e))
            hint = f" (leftovers of an interrupted first save: {leftovers})" if leftovers else ""
            raise CheckpointError(f"{d}: holds no complete hdreplay checkpoint{hint}; expected {MANIFEST_FILE}")
    except OSError as e:
        raise CheckpointError(f"{d}: cannot read the checkpoint ({_describe(e)})") from e
    with f:
        if state.get("version") not in versions:
            raise CheckpointError(f"{where}: {format_name} version {state.get('version')!r} is not supported "
                                  f"(supported: {list(versions)})")
        meta = state.get("meta")
        if not isinstance(meta, dict):
            raise CheckpointError(f"{where}: missing 'meta' section")
        try:
            tensors = tensorfile.index(f, os.fstat(f.fileno()).st_size)
        except (ValueError, OSError) as e:
            raise CheckpointError(f"{d}: cannot read tensors ({e})") from None
        try:
            yield tensors, meta
        except OSError as e:
            raise CheckpointError(f"{d}: cannot read the checkpoint ({_describe(e)})") from e


def read_checkpoint_dir(
    directory: str | os.PathLike, *, format_name: str, versions: tuple[int, ...]
) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """:func:`open_checkpoint_dir`'s ``(tensors, meta)`` with every tensor read into memory it owns."""
    with open_checkpoint_dir(directory, format_name=format_name, versions=versions) as (tensors, meta):
        return {k: v.read() for k, v in tensors.items()}, meta


def _json(data: bytes, where: Path) -> Any:
    try:
        return json.loads(data)
    except (ValueError, UnicodeDecodeError, RecursionError) as e:
        raise CheckpointError(f"{where}: unreadable JSON ({e}); the checkpoint is truncated or corrupted") from None


def _check_format(found: Any, format_name: str, d: Path) -> None:
    if found != format_name:
        raise CheckpointError(f"{d}: holds format {found!r}, expected {format_name!r}; wrong directory?")


def _open(path: Path) -> BinaryIO:
    """``path`` opened for reading; CheckpointError unless it is a regular file (a FIFO is never waited on)."""
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise CheckpointError(f"{path}: not a regular file; the checkpoint directory was modified")
    return open(fd, "rb", buffering=0)


def _verified(path: Path, entry: dict, why: str) -> BinaryIO:
    """``path`` opened, after checking its size and sha256 against ``entry``."""
    f = _open(path)
    h, n, buf, size = hashlib.sha256(), 0, bytearray(tensorfile.CHUNK_BYTES), os.fstat(f.fileno()).st_size
    if entry.get("bytes") == size:
        while k := f.readinto(buf):
            h.update(memoryview(buf)[:k])
            n += k
    if entry.get("bytes") != n or n != size or h.hexdigest() != entry.get("sha256"):
        f.close()
        raise CheckpointError(f"{path}: checksum mismatch ({why}); the file is truncated or was modified")
    f.seek(0)
    return f


def _read_manifest_layout(d: Path, format_name: str) -> tuple[dict, BinaryIO, Path]:
    mpath = d / MANIFEST_FILE
    man = _json(FS.read_bytes(mpath, _MAX_MANIFEST_BYTES), mpath)
    if not isinstance(man, dict) or set(man) != {"format", "layout", "dir", "files", "sha256"}:
        raise CheckpointError(f"{mpath}: not an hdreplay manifest (entries {sorted(man) if isinstance(man, dict) else type(man).__name__})")  # noqa: E501
    if man["sha256"] != _manifest_digest(man):
        raise CheckpointError(f"{mpath}: checksum mismatch; the manifest is corrupted")
    _check_format(man["format"], format_name, d)
    files = man["files"]
    if man["layout"] != LAYOUT or not isinstance(man["dir"], str) or not _VERSION_DIR.fullmatch(man["dir"]) \
            or not isinstance(files, dict) or set(files) != {STATE_FILE, TENSORS_FILE} \
            or not all(isinstance(e, dict) for e in files.values()):
        raise CheckpointError(f"{mpath}: unsupported manifest (layout {man['layout']!r}); written by a newer hdreplay?")
    paths, why = {name: d / man["dir"] / name for name in files}, f"size or sha256 differ from {MANIFEST_FILE}"
    for path in paths.values():
        if not path.is_file():
            raise CheckpointError(f"{path}: missing; the checkpoint directory was modified")
    with _verified(paths[STATE_FILE], files[STATE_FILE], why) as f:
        state = _json(f.read(), paths[STATE_FILE])
    if not isinstance(state, dict):
        raise CheckpointError(f"{d}: state.json is not an object")
    _check_format(state.get("format"), format_name, d)
    return state, _verified(paths[TENSORS_FILE], files[TENSORS_FILE], why), paths[STATE_FILE]


def identity_of(name: str, d: Any, err: type, where: str = "") -> dict[str, Any]:
    """``d`` (None: {}) checked to be what a state may say it belongs to: a few names mapped to JSON scalars."""
    if d is None:
        return {}
    ok = isinstance(d, dict) and len(d) <= 16 and all(
        isinstance(k, str) and (v is None or isinstance(v, (str, int, float, bool))) and len(str(v)) <= 256
        for k, v in d.items())
    if not ok:
        raise err(f"{where}{name}: must map names to JSON scalars (e.g. {{'run_id': str, 'global_step': int}}), "
                  f"got {d!r:.120}")
    return dict(d)


def _shown(v: Any) -> str:
    return "records none" if v is None else repr(v)


def _a(v: Any) -> str:
    name = type(v).__name__
    return f"{'an' if name[0] in 'aeiou' else 'a'} {name}"


def check_identity(meta: Mapping[str, Any], expect: Mapping[str, Any], directory: Any) -> None:
    """CheckpointMismatchError naming both values unless the state's saved ``identity`` holds every value ``expect``
    names, equal and of the same type (None: not recorded, on either side).  A state that records no identity at all
    (written before hdreplay recorded one) is refused whenever something is expected: what it belongs to is unknown.
    Nothing expected (``expect`` empty): nothing compared."""
    if not expect:
        return
    saved = meta.get("identity")
    if saved is None:
        err = CheckpointMismatchError(
            f"{directory}: this replay state records no identity (it was written by an hdreplay before states recorded "
            "what they belong to, which this version does not resume), so it cannot be matched to the checkpoint ("
            + ", ".join(f"{k}={v!r}" for k, v in expect.items()) + ")")
        err.unrecorded = True  # (the way out differs: no checkpoint of its own can be found)
        raise err
    saved = identity_of("identity", saved, CheckpointError, where=f"{directory}: ")
    differ = []
    for k, v in expect.items():
        s = saved.get(k)
        if type(s) is not type(v) or s != v:
            kinds = f" ({_a(v)}, not {_a(s)})" if None not in (s, v) and type(s) is not type(v) else ""
            differ.append(f"{k}: the replay state {'holds ' * (s is not None)}{_shown(s)}, the checkpoint "
                          f"{_shown(v)}{kinds}")
    if differ:
        raise CheckpointMismatchError(f"{directory}: this replay state belongs to another run or step than the "
                                      "checkpoint it is resumed with (" + "; ".join(differ) + ")")
