"""Two hosts over one checkpoint directory, simulated on one machine (issue 43, item 3).

Each "host" is a long-lived agent process in its own UTS and pid namespace, with its own hostname::

    unshare --uts --pid --fork --kill-child --mount-proc sh -c 'hostname "$0" && exec "$@"' host-1 \\
        python tests/support/two_hosts.py STALE_AFTER_S HEARTBEAT_S CLOCK_OFFSET_S

so a lock one agent writes names a host (and a pid 1) the other cannot check: it is judged by its age, as between two
machines sharing an NFS directory.  Both agents see the same directory, and (one kernel) every mtime is stamped by
one clock, as an NFS server stamps them with its own; ``CLOCK_OFFSET_S`` shifts the agent's ``time.time`` (a host
whose clock is off).  ``STALE_AFTER_S`` and ``HEARTBEAT_S`` are set on :mod:`hdreplay.checkpoint.dirlock` at start (the
module constants the lock reads at each use), so a test waits seconds, not ten minutes.

An agent reads one JSON command per line and answers with JSON lines: ``{"event": ...}`` while the command runs, then
one ``{"done": ...}``.  Commands (``steps``: the controller state to save, ``run_steps`` of that many steps):

* ``hashes {steps: [..]}``: the state hash of each;
* ``save {dir, steps, slow_s, stall, go}``: one save; event ``holding`` once it holds the lock; ``slow_s``: a sleep per
  64-byte chunk of the tensor file (the save heartbeats its lock between chunks, as a long save of a large state does);
  ``stall`` ("verify" | "commit"): at that point -- before checking its lock, or after the check just before the
  commit rename -- event ``stalled``, then wait (no heartbeat) until the file ``go`` exists;
* ``attempts {dir, steps, stop, every_s, deadline_s}``: saves every ``every_s`` until one saves, the file ``stop``
  exists or the deadline passes; each attempt's (start, end, outcome), and every verdict this host's lock gave on a
  lock it found (its holder's host, the age it judged, stale or not);
* ``fork_saves {dir, steps: [..], slow_s}``: fork a child that saves the states in turn for ever; done once it holds a
  lock;  ``kill``: SIGKILL that child (a writer dead in the middle of its save);
* ``save_loop {dir, steps: [..], n, stop}``: n saves in turn, then create ``stop``;
* ``load {dir}`` / ``load_loop {dir, stop}``: load once / until ``stop`` exists: each load's state hash, or the error.

:class:`Host` starts and drives an agent from the test or benchmark process.
"""

from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from pathlib import Path

HERE = Path(__file__).resolve().parent
NAMESPACES = ["unshare", "--uts", "--pid", "--fork", "--kill-child", "--mount-proc"]
_wall = time.time  # the real clock: timestamps of the records (CLOCK_OFFSET_S moves the lock's clock only)


def can_run() -> str:
    """'' if agents can start here, else why not (unshare refused: neither root nor user namespaces)."""
    try:
        p = subprocess.run([*NAMESPACES, "sh", "-c", "hostname probe-host && hostname"], capture_output=True,
                           text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"unshare unavailable: {e}"
    return "" if p.returncode == 0 and p.stdout.strip() == "probe-host" else f"unshare refused: {p.stderr.strip()}"


class Host:
    """An agent on simulated host ``name`` (see the module doc)."""

    def __init__(self, name: str, stale_s: float, heartbeat_s: float, clock_offset_s: float = 0.0) -> None:
        self.name = name
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(HERE), *sys.path]))
        self.proc = subprocess.Popen(
            [*NAMESPACES, "sh", "-c", 'hostname "$0" && exec "$@"', name, sys.executable, str(Path(__file__)),
             str(stale_s), str(heartbeat_s), str(clock_offset_s)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
        self.lines: queue.Queue = queue.Queue()
        threading.Thread(target=self._pump, daemon=True).start()
        self.hello = self.call("hello", timeout=180)

    def _pump(self) -> None:
        for line in self.proc.stdout:
            self.lines.put(json.loads(line))
        self.lines.put({"done": {"exit": "agent ended"}})

    def send(self, op: str, **args) -> None:
        self.proc.stdin.write(json.dumps({"op": op, **args}) + "\n")
        self.proc.stdin.flush()

    def next(self, timeout: float = 120) -> dict:
        """The next line: ``{"event": ...}`` or ``{"done": ...}``."""
        try:
            return self.lines.get(timeout=timeout)
        except queue.Empty:
            raise TimeoutError(f"{self.name}: no answer within {timeout} s") from None

    def wait_event(self, event: str, timeout: float = 120) -> None:
        line = self.next(timeout)
        if line.get("event") != event:
            raise AssertionError(f"{self.name}: expected event {event!r}, got {line}")

    def done(self, timeout: float = 120) -> dict:
        while "done" not in (line := self.next(timeout)):
            pass
        return line["done"]

    def call(self, op: str, timeout: float = 120, **args) -> dict:
        self.send(op, **args)
        return self.done(timeout)

    def close(self) -> None:
        """End the agent: SIGKILL to ``unshare``, whose --kill-child takes the namespace's pid 1, and so every process
        of that namespace, with it."""
        self.proc.kill()
        self.proc.wait()


# ---------------------------------------------------------------------------------------------------- the agent
def _agent(stale_s: float, heartbeat_s: float, clock_offset_s: float) -> None:
    sys.path.insert(0, str(HERE))
    from hdreplay import CheckpointError, ReplayConfig, ReplayController
    from hdreplay.checkpoint import dirlock, tensorfile
    from hdreplay.checkpoint import files as checkpoint
    from protocol import run_steps, state_hash

    dirlock.STALE_AFTER_S, dirlock.HEARTBEAT_S = stale_s, heartbeat_s
    if clock_offset_s:
        time.time = lambda: _wall() + clock_offset_s
    cfg = ReplayConfig(k_rep=3, tau=5e-3, capacity=12, group_size=4)
    states: dict[int, ReplayController] = {}
    opts = {"slow_s": 0.0, "stall": None, "go": None, "on_hold": None}
    verdicts: list = []

    def state(steps):
        if steps not in states:
            states[steps] = run_steps(ReplayController(cfg), range(steps), k=4)
        return states[steps]

    def emit(**line):
        sys.stdout.write(json.dumps(line) + "\n")
        sys.stdout.flush()

    def wait_go(where):
        if opts["stall"] == where:
            emit(event="stalled")
            deadline = time.monotonic() + 300
            while not os.path.exists(opts["go"]) and time.monotonic() < deadline:
                time.sleep(0.01)

    real_chunks, real_judge = tensorfile.chunks, dirlock._judge
    acquire, verify = dirlock.DirLock.acquire, dirlock.DirLock.verify

    def slow_chunks(specs, prefix):
        for c in real_chunks(specs, prefix, chunk=64 if opts["slow_s"] else tensorfile.CHUNK_BYTES):
            time.sleep(opts["slow_s"])
            yield c

    def judge(holder, age):
        out = real_judge(holder, age)
        verdicts.append({"host": holder and holder["host"], "age": age, "stale": out[0], "why": out[1]})
        return out

    def acquire_and_say(lock):
        acquire(lock)
        if opts["on_hold"]:
            opts["on_hold"]()

    def verify_after_stall(lock):
        wait_go("verify")
        verify(lock)

    class StallingFS:
        def __getattr__(self, name):
            return getattr(real_fs, name)

        def replace(self, src, dst):
            wait_go("commit")
            return real_fs.replace(src, dst)

    real_fs = checkpoint.FS
    tensorfile.chunks, dirlock._judge, checkpoint.FS = slow_chunks, judge, StallingFS()
    dirlock.DirLock.acquire, dirlock.DirLock.verify = acquire_and_say, verify_after_stall

    def save(d, steps):
        ctrl, t0 = state(steps), _wall()
        try:
            ctrl.save(d)
            return [t0, _wall(), "saved", ""]
        except CheckpointError as e:
            return [t0, _wall(), type(e).__name__, str(e)[:300]]

    def load(d):
        ctrl = ReplayController(cfg)
        try:
            ctrl.load(d)
        except CheckpointError as e:
            return f"{type(e).__name__}: {str(e)[:200]}"
        except Exception as e:  # noqa: BLE001 - anything but the named error is a finding
            return f"unexpected {type(e).__name__}: {e}"
        return state_hash(ctrl)

    child = None
    for line in sys.stdin:
        cmd = json.loads(line)
        op = cmd.pop("op")
        opts.update(slow_s=cmd.get("slow_s", 0.0), stall=cmd.get("stall"), go=cmd.get("go"),
                    on_hold=lambda: emit(event="holding"))
        if op == "hello":
            out = {"host": os.uname().nodename, "pid": os.getpid(), "pid_ns": dirlock.pid_ns()}
        elif op == "hashes":
            out = {str(s): state_hash(state(s)) for s in cmd["steps"]}
        elif op == "save":
            out = dict(zip(("t0", "t1", "result", "msg"), save(cmd["dir"], cmd["steps"])))
        elif op == "attempts":
            opts["on_hold"], verdicts[:] = None, []
            state(cmd["steps"])  # (built before the first attempt: the attempts start at once)
            tries, deadline = [], time.monotonic() + cmd.get("deadline_s", 120)
            while not os.path.exists(cmd["stop"]) and time.monotonic() < deadline:
                tries.append(save(cmd["dir"], cmd["steps"]))
                if tries[-1][2] == "saved":
                    break
                time.sleep(cmd.get("every_s", 0.05))
            out = {"attempts": tries, "verdicts": list(verdicts)}
        elif op == "fork_saves":
            for s in cmd["steps"]:
                state(s)
            r, w = os.pipe()
            child = os.fork()
            if child == 0:  # the writer: save in turn for ever, saying when it first holds a lock
                os.close(r)
                def said_once():
                    opts["on_hold"] = None
                    os.write(w, b"h")
                    os.close(w)
                opts["on_hold"] = said_once
                try:
                    while True:
                        for s in cmd["steps"]:
                            state(s).save(cmd["dir"])
                finally:
                    os._exit(1)
            os.close(w)
            os.read(r, 1)
            os.close(r)
            out = {"child": child}
        elif op == "kill":
            os.kill(child, signal.SIGKILL)
            os.waitpid(child, 0)
            out, child = {"killed_at": _wall()}, None
        elif op == "save_loop":
            opts["on_hold"], results = None, Counter()
            for i in range(cmd["n"]):
                results[save(cmd["dir"], cmd["steps"][i % len(cmd["steps"])])[2]] += 1
            Path(cmd["stop"]).touch()
            out = dict(results)
        elif op == "load":
            out = {"loaded": load(cmd["dir"])}
        elif op == "load_loop":
            loads, deadline = Counter(), time.monotonic() + cmd.get("deadline_s", 300)
            while not os.path.exists(cmd["stop"]) and time.monotonic() < deadline:
                loads[load(cmd["dir"])] += 1
            out = {"loads": dict(loads)}
        else:
            out = {"error": f"unknown op {op!r}"}
        emit(done=out)


if __name__ == "__main__":
    _agent(*(float(a) for a in sys.argv[1:4]))
