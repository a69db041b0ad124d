"""One writer per checkpoint directory: two processes saving into one directory at the same moment, the lock file
(host, pid, start time), and stale locks (a dead process, an abandoned save of this process, another host's lock
untouched for too long)."""

import json
import multiprocessing as mp
import os
import socket
import subprocess
import sys
import time
from collections import Counter

import pytest

from hdreplay import CheckpointError, ReplayConfig, ReplayController, checkpoint, dirlock
from hdreplay.errors import CheckpointLockedError
from protocol import run_steps, state_hash

CFG = ReplayConfig(k_rep=3, tau=5e-3, capacity=12, group_size=4)
LOCK = checkpoint.LOCK_FILE


def controller(steps):
    return run_steps(ReplayController(CFG), range(steps), k=4)


def loaded_hash(path):
    ctrl = ReplayController(CFG)
    try:
        ctrl.load(path)
    except CheckpointError:
        return None
    return state_hash(ctrl)


def _writer(which, ctrl, d, rounds, barrier, results):
    """One of the two writers: ``rounds`` saves, each started together with the other writer's; writer 0 loads the
    directory after both saves of a round returned."""
    out = Counter()
    for _ in range(rounds):
        barrier.wait()
        try:
            ctrl.save(d)
            out["saved"] += 1
        except CheckpointLockedError as e:
            out["refused"] += 1
            out["refusal names the other pid"] += f"pid {os.getppid()}" not in str(e) and "pid " in str(e)
        except CheckpointError as e:  # anything else is a failure of the test
            out[f"other error: {e}"] += 1
        barrier.wait()
        if which == 0:
            out[loaded_hash(d) or "unloadable"] += 1
        barrier.wait()
    results.put((which, dict(out)))


def test_two_processes_saving_into_one_directory_never_leave_it_unloadable(tmp_path):
    """Before the lock, 2 writers started together left the directory unloadable in most rounds (the manifest named a
    version directory the other writer's cleanup had deleted).  Now the second writer is refused, naming the first,
    and every round loads one of the two states."""
    a, b = controller(3), controller(5)
    expected = {state_hash(a), state_hash(b)}
    d, rounds = tmp_path / "ck", 60
    ctx = mp.get_context("fork")
    barrier, results = ctx.Barrier(2, timeout=60), ctx.Queue()
    procs = [ctx.Process(target=_writer, args=(i, c, d, rounds, barrier, results)) for i, c in enumerate((a, b))]
    for p in procs:
        p.start()
    got = dict(results.get(timeout=120) for _ in procs)
    for p in procs:
        p.join(timeout=30)
    total = Counter(got[0]) + Counter(got[1])
    loads = {k: v for k, v in got[0].items() if k in expected or k == "unloadable"}
    assert "unloadable" not in loads, total
    assert sum(loads.values()) == rounds, total
    assert not [k for k in total if str(k).startswith("other error")], total
    assert total["refused"] > 0 and total["saved"] >= rounds, total  # they did collide, and each round saved
    assert total["refusal names the other pid"] == total["refused"], total
    assert not (d / LOCK).exists()  # released after the last save


def _lock(d, **over):
    d.mkdir(parents=True, exist_ok=True)
    holder = {"host": socket.gethostname(), "boot_id": dirlock.boot_id(), "pid": os.getpid(),
              "pid_start": None, "started": time.time(), "token": "0123456789abcdef", **over}
    (d / LOCK).write_text(json.dumps(holder))
    return holder


def test_a_live_writer_holding_the_lock_is_named_and_nothing_is_written(tmp_path):
    old, new = controller(3), controller(5)
    d = tmp_path / "ck"
    old.save(d)
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        _lock(d, pid=sleeper.pid, host=socket.gethostname())
        before = sorted(p.name for p in d.iterdir())
        with pytest.raises(CheckpointLockedError, match=rf"host '{socket.gethostname()}', pid {sleeper.pid}"
                                                        rf".*{LOCK}") as e:
            new.save(d)
        assert "started" in str(e.value) and "delete" in str(e.value)  # when, and the fix
        assert sorted(p.name for p in d.iterdir()) == before
        assert loaded_hash(d) == state_hash(old)
    finally:
        sleeper.kill()
        sleeper.wait()
    new.save(d)  # the holder is gone: its lock is stale and is broken
    assert loaded_hash(d) == state_hash(new) and not (d / LOCK).exists()


def test_a_lock_of_another_host_is_honoured_until_it_is_stale(tmp_path, monkeypatch):
    old, new = controller(3), controller(5)
    d = tmp_path / "ck"
    old.save(d)
    _lock(d, host="node-elsewhere", boot_id="x", pid=1)
    with pytest.raises(CheckpointLockedError, match="node-elsewhere"):
        new.save(d)
    assert loaded_hash(d) == state_hash(old)
    past = time.time() - dirlock.STALE_AFTER_S - 5  # untouched for longer than a save heartbeats
    os.utime(d / LOCK, (past, past))
    new.save(d)
    assert loaded_hash(d) == state_hash(new)


def test_a_lock_left_by_an_abandoned_save_of_this_process_is_stale(tmp_path):
    old = controller(3)
    d = tmp_path / "ck"
    _lock(d, token="feedfacefeedface")  # this pid, but no save of this process holds that token
    old.save(d)
    assert loaded_hash(d) == state_hash(old) and not (d / LOCK).exists()


def test_a_malformed_lock_file_is_refused_naming_the_file(tmp_path):
    d = tmp_path / "ck"
    d.mkdir()
    (d / LOCK).write_text("{not json")
    with pytest.raises(CheckpointLockedError, match=f"{LOCK}.*delete"):
        controller(3).save(d)
