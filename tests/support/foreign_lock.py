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

from hdreplay import dirlock


@contextlib.contextmanager
def held_by_another_process(directory: str | os.PathLike):
    """Yield the pid of a live process that holds ``directory``'s checkpoint lock (the directory is created)."""
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    try:
        (d / dirlock.LOCK_FILE).write_text(json.dumps({
            "host": socket.gethostname(), "boot_id": dirlock.boot_id(), "pid": other.pid,
            "pid_start": dirlock.pid_start(other.pid), "started": time.time(), "token": "00000000feedbeef"}))
        yield other.pid
    finally:
        other.kill()
        other.wait()
        with contextlib.suppress(FileNotFoundError):
            (d / dirlock.LOCK_FILE).unlink()
