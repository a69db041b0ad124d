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

from hdreplay import CheckpointError
from hdreplay.checkpoint import dirlock
from hdreplay.errors import CheckpointLockedError
from lock_states import controller, loaded_hash
from paths import SUPPORT as SUPPORT_DIR
from protocol import state_hash

LOCK = dirlock.LOCK_FILE


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
    holder = {"host": socket.gethostname(), "boot_id": dirlock.boot_id(), "pid_ns": _pid_ns(), "pid": os.getpid(),
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


# ---------------------------------------------------------------- malformed lock files, liveness beyond the pid
def _pid_ns():
    try:
        return os.readlink("/proc/self/ns/pid")
    except OSError:
        return ""


def _aged(d, seconds=dirlock.STALE_AFTER_S + 5):
    past = time.time() - seconds
    os.utime(d / LOCK, (past, past), follow_symlinks=False)


def _refused_then_broken_when_aged(d, match):
    """A save refuses the lock at ``d`` with a CheckpointLockedError matching ``match`` that says how to clear it, and
    breaks it once it is untouched for longer than STALE_AFTER_S; the previous checkpoint stays loadable."""
    old, new = controller(3), controller(5)
    with pytest.raises(CheckpointLockedError, match=match) as e:
        new.save(d)
    assert f"delete {d / LOCK}" in str(e.value) and "untouched" in str(e.value), str(e.value)
    _aged(d)
    new.save(d)
    assert loaded_hash(d) == state_hash(new) and not (d / LOCK).exists()
    del old


BAD_LOCKS = {  # name -> (lock file content, what the refusal must name)
    "deeply nested JSON": ("[" * 3000, "nested"),
    "started 1e308": (dict(host="node-elsewhere", started=1e308), "'started'"),
    "started NaN (this host)": (dict(started=float("nan")), "'started'"),
    "started NaN (another host)": (dict(host="node-elsewhere", started=float("nan")), "'started'"),
    "pid a string": (dict(pid="12"), "'pid'"),
    "pid a bool": (dict(pid=True), "'pid'"),
    "host a number": (dict(host=5), "'host'"),
    "token missing": (dict(token=None), "'token'"),
    "pid_start a float": (dict(pid_start=1.5), "'pid_start'"),
    "a list": ([1, 2], "not a JSON object"),
    "not JSON": ("{not json", "not JSON"),
    "binary": (b"\xff\xfe\x00", "not JSON"),
    "too large": ("{" + " " * 200_000 + "}", "bytes"),
}


@pytest.mark.parametrize("case", sorted(BAD_LOCKS))
def test_a_malformed_lock_file_is_a_named_refusal_that_ages_away(tmp_path, case):
    """Before: a RecursionError (nesting), an OverflowError (1e308), "cannot serialise the state" (NaN), a refusal
    that did not say what was wrong (wrong types), and no way ever to break the nested one."""
    content, match = BAD_LOCKS[case]
    d = tmp_path / "ck"
    controller(3).save(d)
    if isinstance(content, dict):
        holder = _lock(d)
        holder.update(content)
        holder = {k: v for k, v in holder.items() if v is not None or k == "pid_start"}
        content = json.dumps(holder)  # (NaN as the JSON extension Python writes)
    (d / LOCK).write_bytes(content if isinstance(content, bytes) else
                           (content if isinstance(content, str) else json.dumps(content)).encode())
    _refused_then_broken_when_aged(d, rf"{LOCK}.*{match}")


def _fifo_watchdog(path, after_s):
    """Unblock a reader stuck on the FIFO ``path`` every ``after_s`` (so that the old code fails instead of hanging)."""
    import threading
    done = threading.Event()

    def run():
        while not done.wait(after_s):
            try:
                os.close(os.open(path, os.O_WRONLY | os.O_NONBLOCK))  # succeeds only while a reader waits
            except OSError:
                pass
    threading.Thread(target=run, daemon=True).start()
    return done


@pytest.mark.parametrize("kind", ["fifo", "dangling symlink", "symlink to a lock", "directory"])
def test_a_lock_name_that_is_not_a_regular_file_is_named_and_nothing_hangs(tmp_path, kind):
    """Before: a FIFO hung save() (for ever), a dangling symlink said "other writers keep taking it", a directory
    "cannot write the checkpoint (Is a directory)"."""
    old, new = controller(3), controller(5)
    d = tmp_path / "ck"
    old.save(d)
    p = d / LOCK
    if kind == "fifo":
        os.mkfifo(p)
    elif kind == "directory":
        p.mkdir()
    else:
        target = tmp_path / "real.lock"
        if kind == "symlink to a lock":
            target.write_text(json.dumps({"host": "x", "boot_id": "", "pid": 1, "pid_start": None,
                                          "started": time.time(), "token": "0" * 16}))
        os.symlink(target, p)
    done = _fifo_watchdog(p, 10) if kind == "fifo" else None
    t0 = time.monotonic()
    try:
        with pytest.raises(CheckpointError) as e:
            new.save(d)
    finally:
        if done is not None:
            done.set()
    assert time.monotonic() - t0 < 5
    word = {"fifo": "FIFO", "directory": "directory"}.get(kind, "symbolic link")
    msg = str(e.value)
    assert word in msg and f"remove {p}" in msg and "not an hdreplay lock" in msg, msg
    assert loaded_hash(d) == state_hash(old)
    (p.rmdir() if kind == "directory" else p.unlink())
    new.save(d)
    assert loaded_hash(d) == state_hash(new)


def test_a_live_pid_with_an_unknown_start_time_is_honoured_until_its_lock_ages(tmp_path):
    """Before: a lock of this host whose pid is alive but whose start time is missing was refused for ever (locks
    written where /proc is not readable have none)."""
    old, new = controller(3), controller(5)
    d = tmp_path / "ck"
    old.save(d)
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        _lock(d, pid=sleeper.pid, pid_start=None)
        with pytest.raises(CheckpointLockedError, match=rf"pid {sleeper.pid}"):
            new.save(d)
        _aged(d, dirlock.STALE_AFTER_S / 2)
        with pytest.raises(CheckpointLockedError):
            new.save(d)
        _aged(d)  # alive, but no save has touched its lock for longer than a save heartbeats
        new.save(d)
        assert loaded_hash(d) == state_hash(new)
    finally:
        sleeper.kill()
        sleeper.wait()


def test_a_live_writer_is_never_broken_however_old_its_lock(tmp_path):
    old, new = controller(3), controller(5)
    d = tmp_path / "ck"
    old.save(d)
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        _lock(d, pid=sleeper.pid, pid_start=dirlock.pid_start(sleeper.pid))
        _aged(d, 10 * dirlock.STALE_AFTER_S)
        with pytest.raises(CheckpointLockedError, match=rf"pid {sleeper.pid}"):
            new.save(d)
        assert loaded_hash(d) == state_hash(old)
    finally:
        sleeper.kill()
        sleeper.wait()


@pytest.mark.parametrize("pid", ["mine", "absent"])
def test_a_lock_from_another_pid_namespace_is_judged_by_age_not_by_its_pid(tmp_path, pid):
    """Two containers on one host share hostname and boot id, not pids: their writer may be pid 1 in each, or a pid
    that does not exist here.  Before: judged stale at once ("abandoned save of this process" / "pid gone") and
    broken under the live writer."""
    old, new = controller(3), controller(5)
    d = tmp_path / "ck"
    old.save(d)
    _lock(d, pid=os.getpid() if pid == "mine" else 2**22 + 7, pid_ns="pid:[1]", pid_start=None)
    with pytest.raises(CheckpointLockedError):
        new.save(d)
    assert loaded_hash(d) == state_hash(old)
    _aged(d)  # a writer there heartbeats its lock while it saves: an untouched one is dead
    new.save(d)
    assert loaded_hash(d) == state_hash(new)


SUPPORT = str(SUPPORT_DIR / "foreign_lock.py")
NEW_PID_NS = ["unshare", "--pid", "--fork", "--mount-proc"]


def _can_unshare():
    try:
        return subprocess.run([*NEW_PID_NS, "true"], capture_output=True, timeout=30).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


@pytest.mark.skipif(not sys.platform.startswith("linux") or not _can_unshare(),
                    reason="needs unshare --pid (root or user namespaces)")
@pytest.mark.parametrize("second", ["pid 1 of another namespace", "this namespace"])
def test_two_writers_in_different_pid_namespaces_never_break_a_live_lock(tmp_path, second):
    """The container case run for real: writer A is pid 1 of its own pid namespace and holds the lock just before
    its commit point; writer B (pid 1 of another namespace, or a process of the host's) saves into the same
    directory.  B must be refused and A must commit.  Before: B judged A's live lock stale (pid 1 = B itself with
    an unknown token: "abandoned"; or A's pid absent from B's namespace: "gone"), broke it, and A's save failed."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    outcome = Counter()
    for r in range(2):
        d, go = tmp_path / f"ck{r}", tmp_path / f"go{r}"
        a = subprocess.Popen([*NEW_PID_NS, sys.executable, SUPPORT, "hold", str(d), str(go), "5"], env=env,
                             stdout=subprocess.PIPE, text=True)
        try:
            assert a.stdout.readline().strip() == "holding pid 1"
            holder = json.loads((d / LOCK).read_text())
            assert holder["pid"] == 1 and holder.get("pid_ns") != _pid_ns()
            if second == "this namespace":
                try:
                    controller(3).save(d)
                    b = "saved"
                except CheckpointLockedError as e:
                    b = f"refused: CheckpointLockedError: {e}"
            else:
                b = subprocess.run([*NEW_PID_NS, sys.executable, SUPPORT, "save", str(d), "3"], env=env,
                                   capture_output=True, text=True, timeout=120).stdout.strip()
            go.touch()
            out_a = a.stdout.read().strip()
            assert a.wait(timeout=60) == 0
        finally:
            a.kill()
            a.wait()
        outcome["B refused" if b.startswith("refused: CheckpointLockedError") else f"B: {b}"] += 1
        outcome["A saved" if out_a == "saved" else f"A: {out_a}"] += 1
        outcome["A's state loads"] += loaded_hash(d) == state_hash(controller(5))
    assert outcome == {"B refused": 2, "A saved": 2, "A's state loads": 2}, outcome
