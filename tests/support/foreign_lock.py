"""A checkpoint directory whose lock is held by another live process (a second writer), for the integration tests
that show the TRL and verl checkpoint paths inherit the lock."""

from __future__ import annotations

import contextlib
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

from hdreplay.checkpoint import dirlock


@contextlib.contextmanager
def held_by_another_process(directory: str | os.PathLike):
    """Yield the pid of a live process that holds ``directory``'s checkpoint lock (the directory is created)."""
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    try:
        (d / dirlock.LOCK_FILE).write_text(json.dumps({
            "host": socket.gethostname(), "boot_id": dirlock.boot_id(), "pid": other.pid,
            "pid_ns": dirlock.pid_ns(), "pid_start": dirlock.pid_start(other.pid), "started": time.time(),
            "token": "00000000feedbeef"}))
        yield other.pid
    finally:
        other.kill()
        other.wait()
        with contextlib.suppress(FileNotFoundError):
            (d / dirlock.LOCK_FILE).unlink()


def _main(argv: list[str]) -> None:
    """``hold DIR GO STEPS``: save a controller of STEPS steps into DIR, printing "holding" once the lock is taken and
    waiting for the file GO before the commit point, then "saved" or "refused: ..."; ``save DIR STEPS``: one save,
    printing "saved" or "refused: ...".  Run under ``unshare --pid --fork --mount-proc`` to be pid 1 of a new pid
    namespace (a container's writer)."""
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from hdreplay import CheckpointError, ReplayConfig, ReplayController
    from protocol import run_steps

    mode, d = argv[0], argv[1]
    ctrl = run_steps(ReplayController(ReplayConfig(k_rep=3, tau=5e-3, capacity=12, group_size=4)),
                     range(int(argv[-1])), k=4)
    if mode == "hold":
        go, verify = Path(argv[2]), dirlock.DirLock.verify

        def wait_then_verify(lock):
            print(f"holding pid {os.getpid()}", flush=True)
            deadline = time.monotonic() + 120
            while not go.exists() and time.monotonic() < deadline:
                time.sleep(0.05)
            verify(lock)
        dirlock.DirLock.verify = wait_then_verify
    try:
        ctrl.save(d)
        print("saved", flush=True)
    except CheckpointError as e:
        print(f"refused: {type(e).__name__}: {e}", flush=True)


if __name__ == "__main__":
    _main(sys.argv[1:])
