"""One writer per checkpoint directory: a lock file taken for the length of a save.

``D/.hdreplay.lock`` holds the writer's identity as JSON: ``{"host", "boot_id", "pid", "pid_start", "started",
"token"}``.  It is created atomically and complete: the content is written and fsynced into a unique temporary
file ``D/.hdreplay.lock.tmp-<token>`` first, which is then hard-linked to the lock name.  ``link`` fails if the
name exists, on local disks and on NFS and Lustre alike (the ``O_EXCL`` + link count recipe of ``open(2)``: when a
reply is lost, the temporary file's link count says whether the link happened); a file system without hard links
falls back to ``O_CREAT | O_EXCL``.

A second writer finds the lock and is refused (:class:`~hdreplay.errors.CheckpointLockedError` naming the holder's
host, pid and start time) unless the lock is *stale*:

* same host (hostname and boot id): the holder's pid is gone, or is a different process now (its start time in
  ``/proc`` differs), or it is this very process but no save of it holds that token (an abandoned save);
* another host, or an unreadable lock: the lock file was not touched for :data:`STALE_AFTER_S` seconds (a save
  refreshes its lock's mtime at least every :data:`HEARTBEAT_S` seconds while it writes, so only a dead writer's
  lock ages; clocks of the hosts are assumed to agree to well within that).

A stale lock is renamed to a unique name (``rename`` is atomic: of two writers breaking it at once, one wins),
checked to be the lock judged stale, and deleted.  Before its commit point a save checks that the lock still holds
its token (:meth:`DirLock.verify`), so a writer whose lock was broken under it fails instead of committing.
"""

from __future__ import annotations

import errno
import json
import os
import socket
import threading
import time
import uuid
from pathlib import Path
from typing import Any, Callable

from .errors import CheckpointLockedError

LOCK_FILE = ".hdreplay.lock"
#: a lock of another host (or an unreadable one) not touched for this long is stale
STALE_AFTER_S = 600.0
#: a save refreshes its lock's mtime at least this often while it writes
HEARTBEAT_S = 10.0

_HELD: set[str] = set()  # tokens of the locks this process holds now
_HELD_LOCK = threading.Lock()
_NO_LINK = {errno.EPERM, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EXDEV, errno.ENOSYS, errno.EMLINK}


def boot_id() -> str:
    """This machine's boot id (Linux), '' elsewhere: a pid is only meaningful within one boot."""
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:  # pragma: no cover - not Linux
        return ""


def pid_start(pid: int) -> int | None:
    """The start time of process ``pid`` in clock ticks since boot (Linux), None if unknown or gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        return int(stat[stat.rindex(")") + 2:].split()[19])
    except (OSError, ValueError, IndexError):
        return None


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    except (OverflowError, ValueError):
        return False
    return True


def describe(holder: dict) -> str:
    started = holder.get("started")
    when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(started)) if isinstance(started, (int, float)) else "?"
    return f"host {holder.get('host')!r}, pid {holder.get('pid')}, started {when}"


class DirLock:
    """The lock of checkpoint directory ``directory`` (which must exist); ``fs`` is the checkpoint module's file-system
    shim (so crash and error injection reach the lock too)."""

    def __init__(self, directory: Path, fs: Any) -> None:
        self.dir, self.fs = Path(directory), fs
        self.path = self.dir / LOCK_FILE
        self.token = uuid.uuid4().hex[:16]
        self.held = False
        self._beat = 0.0

    def _identity(self) -> dict:
        pid = os.getpid()
        return {"host": socket.gethostname(), "boot_id": boot_id(), "pid": pid, "pid_start": pid_start(pid),
                "started": time.time(), "token": self.token}

    # ------------------------------------------------------------------ acquire / release
    def acquire(self) -> None:
        """Take the lock or raise CheckpointLockedError naming its holder (OSError: the file system refused)."""
        data = json.dumps(self._identity()).encode()
        with _HELD_LOCK:
            _HELD.add(self.token)
        try:
            for _ in range(8):
                if self._create(data):
                    self._beat, self.held = time.monotonic(), True
                    return
                self._break_if_stale()
            raise CheckpointLockedError(f"{self.dir}: could not take the checkpoint lock {self.path}: other writers "
                                        "keep taking it; two jobs write to this directory")
        except BaseException:
            self._forget()
            raise

    def _create(self, data: bytes) -> bool:
        tmp = self.dir / f"{LOCK_FILE}.tmp-{self.token}"
        fd = self.fs.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        try:
            try:
                self.fs.write(fd, data)
                self.fs.fsync(fd)
            finally:
                self.fs.close(fd)
            try:
                self.fs.link(tmp, self.path)
                return True
            except (FileExistsError, FileNotFoundError):  # taken (or our temporary cleaned by the holder's save)
                return False
            except OSError as e:
                if e.errno in _NO_LINK:  # no hard links here: exclusive create
                    return self._create_excl(data)
                if _links(tmp) == 2:  # a lost reply: the link happened
                    return True
                raise
        finally:
            try:
                self.fs.unlink(tmp)
            except OSError:
                pass

    def _create_excl(self, data: bytes) -> bool:
        try:
            fd = self.fs.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        except FileExistsError:
            return False
        try:
            self.fs.write(fd, data)
            self.fs.fsync(fd)
        finally:
            self.fs.close(fd)
        return True

    def _read(self) -> tuple[dict | None, float] | None:
        """(holder or None if unreadable, mtime), or None when there is no lock file."""
        try:
            mtime = os.stat(self.path).st_mtime
            raw = self.fs.read_bytes(self.path)
        except FileNotFoundError:
            return None
        try:
            holder = json.loads(raw)
        except (ValueError, UnicodeDecodeError):
            return None, mtime
        return (holder if isinstance(holder, dict) else None), mtime

    def _break_if_stale(self) -> None:
        found = self._read()
        if found is None:  # released meanwhile
            return
        holder, mtime = found
        why = stale_reason(holder, mtime)
        if why is None:
            raise CheckpointLockedError(self._refusal(holder, mtime))
        aside = self.dir / f"{LOCK_FILE}.stale-{self.token}"
        try:
            self.fs.rename(self.path, aside)
        except FileNotFoundError:  # another writer broke it first
            return
        moved = self._read_file(aside)
        if holder is not None and moved != holder:  # a live lock taken meanwhile: put it back
            try:
                self.fs.link(aside, self.path)
            except OSError:
                pass  # its holder finds its token gone and fails before committing
        self.fs.unlink(aside)

    def _read_file(self, path: Path) -> dict | None:
        try:
            holder = json.loads(self.fs.read_bytes(path))
        except (OSError, ValueError, UnicodeDecodeError):
            return None
        return holder if isinstance(holder, dict) else None

    def _refusal(self, holder: dict | None, mtime: float) -> str:
        age = max(0.0, time.time() - mtime)
        who = describe(holder) if holder is not None else "an unreadable lock file"
        return (f"{self.dir}: another save is writing this checkpoint directory ({who}; lock file {self.path}, last "
                f"touched {age:.0f} s ago). Two jobs (or a restarted job while the old one still runs) must not write "
                f"the same checkpoint: give each its own output directory, or stop the other writer. If you are sure "
                f"no other process writes here, delete {self.path}")

    def verify(self) -> None:
        """Raise CheckpointLockedError unless the lock file still holds this save's token (called before committing)."""
        holder = self._read_file(self.path)
        if holder is None or holder.get("token") != self.token:
            raise CheckpointLockedError(
                f"{self.dir}: this save's lock {self.path} was taken over by another writer "
                f"({describe(holder) if holder else 'no lock file'}); nothing was committed")

    def heartbeat(self) -> None:
        """Refresh the lock's mtime (at most every HEARTBEAT_S / 2 seconds; best effort)."""
        now = time.monotonic()
        if now - self._beat >= HEARTBEAT_S / 2:
            self._beat = now
            try:
                os.utime(self.path)
            except OSError:
                pass

    def release(self) -> None:
        """Remove the lock if it is still this save's (best effort; a leftover of this process is stale)."""
        self._forget()
        holder = self._read_file(self.path)
        if holder is not None and holder.get("token") == self.token:
            self.fs.unlink(self.path)

    def _forget(self) -> None:
        self.held = False
        with _HELD_LOCK:
            _HELD.discard(self.token)


def _links(path: Path) -> int:
    try:
        return os.stat(path).st_nlink
    except OSError:
        return 0


def stale_reason(holder: dict | None, mtime: float, *, now: Callable[[], float] = time.time) -> str | None:
    """Why a lock with ``holder`` (None: unreadable) and ``mtime`` is stale, or None if it may be live."""
    age = now() - mtime
    if holder is None:
        return f"unreadable and untouched for {age:.0f} s" if age > STALE_AFTER_S else None
    pid = holder.get("pid")
    same_host = holder.get("host") == socket.gethostname() and holder.get("boot_id") == boot_id()
    if same_host and isinstance(pid, int) and not isinstance(pid, bool) and pid > 0:
        if pid == os.getpid():
            with _HELD_LOCK:
                held = holder.get("token") in _HELD
            return None if held else "left by an abandoned save of this process"
        if not _alive(pid):
            return f"pid {pid} is gone"
        start = holder.get("pid_start")
        if start is not None and pid_start(pid) not in (None, start):
            return f"pid {pid} is another process now"
        return None
    return f"untouched for {age:.0f} s" if age > STALE_AFTER_S else None
