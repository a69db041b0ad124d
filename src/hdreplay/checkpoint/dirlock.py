"""One writer per checkpoint directory: a lock file taken for the length of a save.

``D/.hdreplay.lock`` holds the writer's identity as JSON: ``{"host", "boot_id", "pid_ns", "pid", "pid_start",
"started", "token"}`` (``token``: unique per save, checked before its commit point).  It is created atomically and
complete: the content is written and fsynced into a unique temporary file ``D/.hdreplay.lock.tmp-<token>`` first,
which is then hard-linked to the lock name.  ``link`` fails if the name exists, on local disks and on NFS and Lustre
alike (the ``O_EXCL`` + link count recipe of ``open(2)``: when a reply is lost, the temporary file's link count says
whether the link happened); a file system without hard links falls back to ``O_CREAT | O_EXCL``.

A second writer finds the lock and is refused (:class:`~hdreplay.errors.CheckpointLockedError` naming the holder and
the fix) unless the lock is *stale*:

* same host, boot and pid namespace (hostname, boot id, ``/proc/self/ns/pid``): the holder's pid is gone, or is a
  different process now (its start time in ``/proc`` differs), or is this very process but no save of it holds that
  token (an abandoned save).  A live pid whose start time is unknown falls under the age rule;
* anything else -- another host, another container's pid namespace (two containers' writers may both be pid 1), a
  lock file that is not a valid lock: the lock was not touched for :data:`STALE_AFTER_S` seconds (a save refreshes its
  lock's mtime at least every :data:`HEARTBEAT_S` seconds while it writes, so only a dead writer's lock ages).  The
  age is the file system's "now" -- the mtime of the temporary file the contender has just written -- minus the
  lock's mtime: where the file server stamps mtimes (NFS), this host's clock does not enter; where each host stamps
  its own (client-side timestamps), the hosts' clocks must agree to well within :data:`STALE_AFTER_S`.  A lock
  stamped more than :data:`CLOCK_SKEW_S` in that future is refused with the skew named (the fix: sync the clocks),
  never broken nor taken for fresh in silence.

Something other than a regular file at the lock's name (a FIFO, a directory, a symbolic link) is refused with
:class:`~hdreplay.errors.CheckpointError` naming it; it is never opened in blocking mode, nor read past
:data:`MAX_LOCK_BYTES`.  A stale lock is renamed to a unique name (``rename`` is atomic: of two writers breaking it at
once, one wins), checked to be the lock judged stale, and deleted.  Before its commit point a save checks that the
lock still holds its token (:meth:`DirLock.verify`), so a writer whose lock was broken under it fails instead of
committing.

That check and the commit are two steps, and a writer may stall between them longer than the age limit (a paused VM,
another host's writer judged by age).  So a broken save is also *fenced* off: the breaker, right after setting the
stale lock aside and before deleting it, calls ``fence(token)`` (the checkpoint module deletes that save's staged
manifest, whose name carries the token), and every writer, right after taking the lock, fences the tokens of any
lock still set aside (a breaker that died or stalled before its fence leaves one).  The stalled writer's commit is a
rename of that staged manifest, so it lands before the next writer holds the lock -- an ordinary earlier save --
or not at all.
"""

from __future__ import annotations

import errno
import json
import math
import os
import re
import socket
import stat
import sys
import threading
import time
import uuid
from pathlib import Path
from typing import Any, Callable

from ..errors import CheckpointError, CheckpointLockedError

LOCK_FILE = ".hdreplay.lock"
#: a lock whose writer cannot be checked from here (or an invalid one) not touched for this long is stale
STALE_AFTER_S = 600.0
#: a save refreshes its lock's mtime at least this often while it writes
HEARTBEAT_S = 10.0
#: a lock stamped further in the future than this (clock skew between hosts) is refused by name, not judged by age
CLOCK_SKEW_S = 30.0
#: a lock file is read up to this size (a larger one is invalid)
MAX_LOCK_BYTES = 4096

_HELD: set[str] = set()  # tokens of the locks this process holds now
_HELD_LOCK = threading.Lock()
_NO_LINK = {errno.EPERM, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EXDEV, errno.ENOSYS, errno.EMLINK}
_KINDS = ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO"), (stat.S_ISSOCK, "a socket"),
          (stat.S_ISLNK, "a symbolic link"), (lambda m: True, "a device or other special file"))
#: field -> (check, what it must be)
_SCHEMA = {
    "host": (lambda v: isinstance(v, str), "a string"), "boot_id": (lambda v: isinstance(v, str), "a string"),
    "pid_ns": (lambda v: v is None or isinstance(v, str), "a string (or absent)"),
    "pid": (lambda v: type(v) is int and 0 < v < 1 << 31, "a pid (an int >= 1)"),
    "pid_start": (lambda v: v is None or type(v) is int and v >= 0, "null or clock ticks (an int >= 0)"),
    "started": (lambda v: type(v) in (int, float) and math.isfinite(v) and 0 <= v < 1e11, "a time in s since 1970"),
    "token": (lambda v: isinstance(v, str) and re.fullmatch(r"[0-9a-f]{16}", v) is not None, "16 hex digits"),
}


def boot_id() -> str:
    """This machine's boot id (Linux), '' elsewhere: a pid is only meaningful within one boot."""
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:  # pragma: no cover - not Linux
        return ""


def pid_ns() -> str:
    """This process's pid namespace (Linux, e.g. ``pid:[4026531836]``), '' elsewhere: a pid is only meaningful
    within its namespace."""
    try:
        return os.readlink("/proc/self/ns/pid")
    except OSError:  # pragma: no cover - not Linux
        return ""


def pid_start(pid: int) -> int | None:
    """The start time of process ``pid`` in clock ticks since boot (Linux), None if unknown or gone (or if the
    ``/proc`` mounted here is not this pid namespace's)."""
    try:
        if os.readlink("/proc/self") != str(os.getpid()):
            return None
        stat_ = Path(f"/proc/{pid}/stat").read_text()
        return int(stat_[stat_.rindex(")") + 2:].split()[19])
    except (OSError, ValueError, IndexError):
        return None


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except PermissionError:  # another user's process
        return True
    except (ProcessLookupError, OverflowError, ValueError):
        return False
    return True


def parse(raw: bytes) -> tuple[dict | None, str]:
    """(holder, '') for a valid lock file's content, (None, what is wrong) otherwise."""
    if len(raw) > MAX_LOCK_BYTES:
        return None, f"more than {MAX_LOCK_BYTES} bytes, far more than a lock holds"
    try:
        holder = json.loads(raw)
    except RecursionError:
        return None, "JSON nested too deeply"
    except (ValueError, UnicodeDecodeError):
        return None, "not JSON"
    if not isinstance(holder, dict):
        return None, "not a JSON object"
    for k, (ok, what) in _SCHEMA.items():
        if not ok(holder.get(k)) or (k != "pid_ns" and k not in holder):
            return None, f"field {k!r} is {str(holder.get(k, 'missing'))[:40]}, expected {what}"
    return holder, ""


def describe(holder: dict) -> str:
    """A valid holder (see :func:`parse`) in words."""
    when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(holder["started"]))
    return f"host {holder['host']!r}, pid {holder['pid']}, started {when}"


def _judge(holder: dict | None, age: float) -> tuple[bool | None, str]:
    """(stale?, why) of a lock with ``holder`` (None: invalid) untouched for ``age`` seconds (stale? None: stamped
    too far in the future to tell)."""
    ns = pid_ns()
    if holder is not None and (holder["host"], holder["boot_id"], holder.get("pid_ns")) == (
            socket.gethostname(), boot_id(), ns) and (ns or not sys.platform.startswith("linux")):
        pid, start = holder["pid"], holder["pid_start"]
        if pid == os.getpid():
            with _HELD_LOCK:
                held = holder["token"] in _HELD
            return (False, "a save of this process holds it") if held else (True, "left by an abandoned save")
        if not _alive(pid):
            return True, f"pid {pid} is gone"
        now = pid_start(pid)
        if start is not None and now is not None:
            return (False, f"pid {pid} is alive") if now == start else (True, f"pid {pid} is another process now")
    if age < -CLOCK_SKEW_S:  # no age can be told: neither stale nor fresh (see DirLock._skewed)
        return None, f"stamped {-age:.0f} s in the future"
    if age > STALE_AFTER_S:
        return True, f"untouched for {age:.0f} s"
    return False, f"last touched {max(age, 0):.0f} s ago; broken automatically once untouched for {STALE_AFTER_S:.0f} s"


def _read(path: Path, fs: Any) -> tuple[bytes, float] | None:
    """(content, mtime) of the lock file ``path`` (at most MAX_LOCK_BYTES + 1 bytes), None if there is none;
    CheckpointError if something other than a regular file is there."""
    try:
        st = os.lstat(path)
        if stat.S_ISREG(st.st_mode):
            fd = fs.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_NOFOLLOW", 0))
            try:
                st = os.fstat(fd)  # (what was opened: it may have been replaced since the lstat)
                if stat.S_ISREG(st.st_mode):
                    return os.read(fd, MAX_LOCK_BYTES + 1), st.st_mtime
            finally:
                fs.close(fd)
    except FileNotFoundError:
        return None
    kind = next(what for test, what in _KINDS if test(st.st_mode))
    raise CheckpointError(f"{path} is {kind}, not an hdreplay lock file (a save writes a regular file there); "
                          f"remove {path} to save into {path.parent}")


class DirLock:
    """The lock of checkpoint directory ``directory`` (which must exist); ``fs`` is the checkpoint module's file-system
    shim (so crash and error injection reach the lock too)."""

    def __init__(self, directory: Path, fs: Any, fence: Callable[[str], None] = lambda token: None) -> None:
        self.dir, self.fs, self.fence = Path(directory), fs, fence
        self.path = self.dir / LOCK_FILE
        self.token = uuid.uuid4().hex[:16]
        self.held = False
        self._beat = 0.0
        self._now = time.time()  # the file system's clock: the mtime of this writer's last temporary file

    def _identity(self) -> dict:
        pid = os.getpid()
        return {"host": socket.gethostname(), "boot_id": boot_id(), "pid_ns": pid_ns(), "pid": pid,
                "pid_start": pid_start(pid), "started": time.time(), "token": self.token}

    # ------------------------------------------------------------------ acquire / release
    def acquire(self) -> None:
        """Take the lock or raise CheckpointLockedError naming its holder (CheckpointError: something other than a
        regular file at the lock's name; OSError: the file system refused)."""
        data = json.dumps(self._identity()).encode()
        with _HELD_LOCK:
            _HELD.add(self.token)
        try:
            for _ in range(8):
                if self._create(data):
                    self._beat, self.held = time.monotonic(), True
                    self._sweep()
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
                self._now = os.fstat(fd).st_mtime
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

    def _break_if_stale(self) -> None:
        found = _read(self.path, self.fs)
        if found is None:  # released meanwhile
            return
        raw, mtime = found
        holder, problem = parse(raw)
        stale, why = _judge(holder, self._now - mtime)
        if stale is None:
            raise CheckpointLockedError(self._skewed(holder, why))
        if not stale:
            raise CheckpointLockedError(self._refusal(holder, problem, why))
        aside = self.dir / f"{LOCK_FILE}.stale-{self.token}"
        try:
            self.fs.rename(self.path, aside)
        except FileNotFoundError:  # another writer broke it first
            return
        moved = _read(aside, self.fs)
        if moved is not None and moved[0] != raw:  # a live lock taken meanwhile: put it back
            try:
                self.fs.link(aside, self.path)
            except OSError:
                pass  # its holder finds its token gone and fails before committing
        else:  # fence the broken save off before the last trace of its lock goes (a crash here: see _sweep)
            self._fence(raw)
        _unlink_quietly(self.fs, aside)

    def _fence(self, raw: bytes) -> None:
        holder = parse(raw)[0]
        if holder is not None:
            self.fence(holder["token"])

    def _sweep(self) -> None:
        """Just after taking the lock: fence off the saves of locks other writers broke and may not have fenced yet
        (set aside under ``.stale-`` names; a breaker that died or stalled before its fence leaves one), so that no
        save whose lock was broken can commit from now on."""
        for name in self.fs.listdir(self.dir):
            if name.startswith(f"{LOCK_FILE}.stale-"):
                found = _read(self.dir / name, self.fs)
                if found is not None:
                    self._fence(found[0])
                _unlink_quietly(self.fs, self.dir / name)

    def _refusal(self, holder: dict | None, problem: str, why: str) -> str:
        if holder is None:
            return (f"{self.dir}: the checkpoint lock {self.path} is not a valid hdreplay lock ({problem}; {why}). If "
                    f"no other process writes here, delete {self.path}")
        return (f"{self.dir}: another save is writing this checkpoint directory ({describe(holder)}; lock file "
                f"{self.path}, {why}). Two jobs (or a restarted job while the old one still runs) must not write the "
                f"same checkpoint: give each its own output directory, or stop the other writer. If you are sure no "
                f"other process writes here, delete {self.path}")

    def _skewed(self, holder: dict | None, why: str) -> str:
        who = f"host {holder['host']!r} (pid {holder['pid']})" if holder else "an unknown writer (an invalid lock)"
        return (f"{self.dir}: the checkpoint lock {self.path} of {who} is {why} (its mtime against a file this host "
                f"just wrote there): the clocks of the hosts writing here (or of this host and the file server) "
                f"disagree by more than {CLOCK_SKEW_S:.0f} s, so its age cannot be told; it is neither broken nor "
                f"taken for fresh. Sync the clocks of every host (NTP, chrony); if that writer is known dead, delete "
                f"{self.path}")

    def _holder(self) -> dict | None:
        try:
            found = _read(self.path, self.fs)
        except (OSError, CheckpointError):
            return None
        return None if found is None else parse(found[0])[0]

    def verify(self) -> None:
        """Raise CheckpointLockedError unless the lock file still holds this save's token (called before committing)."""
        if not self.holds():
            holder = self._holder()
            raise CheckpointLockedError(
                f"{self.dir}: this save's lock {self.path} was taken over by another writer "
                f"({describe(holder) if holder else 'no valid lock file'}); nothing was committed")

    def holds(self) -> bool:
        """Whether the lock file holds this save's token now."""
        holder = self._holder()
        return holder is not None and holder["token"] == self.token

    def lost(self) -> bool:
        """Whether the lock file is readable and is no longer this save's (gone, or another's): taken over."""
        try:
            found = _read(self.path, self.fs)
        except (OSError, CheckpointError):
            return False
        return found is None or (holder := parse(found[0])[0]) is None or holder["token"] != self.token

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
        holder = self._holder()
        if holder is not None and holder["token"] == self.token:
            self.fs.unlink(self.path)

    def _forget(self) -> None:
        self.held = False
        with _HELD_LOCK:
            _HELD.discard(self.token)


def _unlink_quietly(fs: Any, path: Path) -> None:
    try:
        fs.unlink(path)
    except FileNotFoundError:  # another writer's sweep removed it first
        pass


def _links(path: Path) -> int:
    try:
        return os.stat(path).st_nlink
    except OSError:
        return 0
