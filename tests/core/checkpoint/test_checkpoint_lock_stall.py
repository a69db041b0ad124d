"""A writer that stalls past the lock's age limit must never publish over another writer's save (issue 39, item 3).

Writer A holds the lock as a process of another pid namespace or host would (judged by age only), stalls at its
commit point (just before or just after the manifest rename) while its lock file's mtime is aged past
``dirlock.STALE_AFTER_S``; writer B breaks the aged lock and saves; A resumes while B is paused just before or just
after B's own commit; then B finishes.  Before the fence, A's commit and both cleanups interleaved so that the manifest
named a version directory the other writer had deleted: both saves returned normally and nothing loaded.  Now a stalled
A that had not committed fails with CheckpointLockedError (its staged manifest was deleted by the breaker), a stalled
A that had committed cleans only what was there before it took the lock, and B's checkpoint loads.

Deterministic: two threads of this process, paused and resumed at the checkpoint module's file-system calls."""

import os
import threading
import time

import pytest

from hdreplay.checkpoint import dirlock
from hdreplay.checkpoint import files as checkpoint
from hdreplay.errors import CheckpointLockedError
from lock_states import controller, loaded_hash
from protocol import state_hash

FOREIGN_NS = "pid:[4026599999]"  # writer A's pid namespace: not this one, so A's lock is judged by its age


class Gate:
    """Pause thread ``who`` at ``where`` ('before_commit' | 'after_commit': around the manifest rename)."""

    def __init__(self, who, where):
        self.who, self.where = who, where
        self.reached, self.go = threading.Event(), threading.Event()

    def hit(self, where):
        if threading.current_thread().name == self.who and where == self.where and not self.reached.is_set():
            self.reached.set()
            assert self.go.wait(60), f"{self.who} was never resumed"


class PausingFS:
    """hdreplay.checkpoint.files.FS calling the gates around the commit rename (``replace``, the only one a save makes),
    after a lock is set aside by its breaker, and when a cleanup reads the manifest."""

    def __init__(self, real, gates):
        self.real, self.gates = real, gates

    def __getattr__(self, name):
        return getattr(self.real, name)

    def _hit(self, where):
        for g in self.gates:
            g.hit(where)

    def replace(self, src, dst):
        self._hit("before_commit")
        out = self.real.replace(src, dst)
        self._hit("after_commit")
        return out

    def rename(self, src, dst):
        out = self.real.rename(src, dst)
        if os.path.basename(src) == dirlock.LOCK_FILE:
            self._hit("after_break_rename")
        return out

    def read_bytes(self, path, *a):
        out = self.real.read_bytes(path, *a)
        if os.path.basename(path) == checkpoint.MANIFEST_FILE:
            self._hit("cleanup_read")
        return out


def _run(name, ctrl, d, results):
    def body():
        try:
            ctrl.save(d)
            results[name] = "saved"
        except CheckpointLockedError as e:
            results[name] = e
        except Exception as e:  # noqa: BLE001 - reported by the test
            results[name] = f"other error: {type(e).__name__}: {e}"
    t = threading.Thread(target=body, name=name)
    t.start()
    return t


@pytest.mark.parametrize("b_at", ["before_commit", "after_commit"])
@pytest.mark.parametrize("a_at", ["before_commit", "after_commit"])
def test_a_writer_stalled_past_the_lock_age_never_publishes_over_the_next_writers_save(tmp_path, monkeypatch, a_at,
                                                                                      b_at):
    old, a_state, b_state = controller(2), controller(3), controller(5)
    d = tmp_path / "ck"
    old.save(d)
    identity = dirlock.DirLock._identity

    def foreign_for_a(self):
        me = identity(self)
        return {**me, "pid_ns": FOREIGN_NS} if threading.current_thread().name == "A" else me

    monkeypatch.setattr(dirlock.DirLock, "_identity", foreign_for_a)
    ga, gb = Gate("A", a_at), Gate("B", b_at)
    monkeypatch.setattr(checkpoint, "FS", PausingFS(checkpoint.FS, [ga, gb]))
    results = {}
    ta = _run("A", a_state, d, results)
    assert ga.reached.wait(60)
    if a_at == "before_commit":  # A holds its lock and has checked it: only a stall separates it from its commit
        assert (d / dirlock.LOCK_FILE).exists()
        past = time.time() - dirlock.STALE_AFTER_S - 5
        os.utime(d / dirlock.LOCK_FILE, (past, past))
    else:  # A committed and stalls before its cleanup; its lock is still there, aged
        assert loaded_hash(d) == state_hash(a_state)
        past = time.time() - dirlock.STALE_AFTER_S - 5
        os.utime(d / dirlock.LOCK_FILE, (past, past))
    tb = _run("B", b_state, d, results)
    assert gb.reached.wait(60), results  # B broke A's aged lock and reached its own commit point
    ga.go.set()  # A resumes while B is paused there
    ta.join(60)
    gb.go.set()
    tb.join(60)
    assert not ta.is_alive() and not tb.is_alive()
    assert results["B"] == "saved", results
    if a_at == "before_commit":  # A never committed: a named error, and it says what happened
        assert isinstance(results["A"], CheckpointLockedError), results
        assert "stalled" in str(results["A"]) and "nothing was committed" in str(results["A"])
    else:  # A committed before its lock was broken: an ordinary earlier save
        assert results["A"] == "saved", results
    assert loaded_hash(d) == state_hash(b_state), sorted(p.name for p in d.iterdir())
    assert not (d / dirlock.LOCK_FILE).exists()
    monkeypatch.setattr(checkpoint, "FS", checkpoint.FS.real)
    old.save(d)  # the next save cleans whatever is left and loads
    assert loaded_hash(d) == state_hash(old)
    assert sorted(p.name for p in d.iterdir() if p.name != checkpoint.MANIFEST_FILE)[0].startswith("v-")
    assert len(list(d.iterdir())) == 2


def test_a_broken_lock_is_fenced_even_when_the_breaker_finished_long_before(tmp_path, monkeypatch):
    """A stalls before its commit rename; B breaks the lock and completes its save (and its cleanup) entirely; A's
    commit then fails by name, not with a bare file-not-found, and B's checkpoint loads."""
    old, a_state, b_state = controller(2), controller(3), controller(5)
    d = tmp_path / "ck"
    old.save(d)
    identity = dirlock.DirLock._identity
    monkeypatch.setattr(dirlock.DirLock, "_identity", lambda self: {
        **identity(self), **({"pid_ns": FOREIGN_NS} if threading.current_thread().name == "A" else {})})
    ga = Gate("A", "before_commit")
    monkeypatch.setattr(checkpoint, "FS", PausingFS(checkpoint.FS, [ga]))
    results = {}
    ta = _run("A", a_state, d, results)
    assert ga.reached.wait(60)
    past = time.time() - dirlock.STALE_AFTER_S - 5
    os.utime(d / dirlock.LOCK_FILE, (past, past))
    b_state.save(d)
    ga.go.set()
    ta.join(60)
    assert isinstance(results["A"], CheckpointLockedError) and "stalled" in str(results["A"]), results
    assert loaded_hash(d) == state_hash(b_state)


@pytest.mark.parametrize("c_at", ["after_commit", "cleanup_read"])
def test_a_breaker_that_stalls_before_fencing_leaves_the_fence_to_the_next_writer(tmp_path, monkeypatch, c_at):
    """Review finding: B sets A's aged lock aside and stalls before fencing A; C finds no lock, takes it and saves; A
    wakes while C is paused at or after its commit.  Before: nobody fenced A, A committed over C's save (C's save lost)
    or into C's cleanup (unloadable).  Now C fences the set-aside lock's save as soon as it holds the lock."""
    old, a_state, b_state, c_state = controller(2), controller(3), controller(5), controller(7)
    d = tmp_path / "ck"
    old.save(d)
    identity = dirlock.DirLock._identity
    monkeypatch.setattr(dirlock.DirLock, "_identity", lambda self: {
        **identity(self), **({"pid_ns": FOREIGN_NS} if threading.current_thread().name == "A" else {})})
    ga, gb, gc = Gate("A", "before_commit"), Gate("B", "after_break_rename"), Gate("C", c_at)
    monkeypatch.setattr(checkpoint, "FS", PausingFS(checkpoint.FS, [ga, gb, gc]))
    results = {}
    ta = _run("A", a_state, d, results)
    assert ga.reached.wait(60)
    past = time.time() - dirlock.STALE_AFTER_S - 5
    os.utime(d / dirlock.LOCK_FILE, (past, past))
    tb = _run("B", b_state, d, results)
    assert gb.reached.wait(60)  # B set A's lock aside, and stalls before fencing A
    tc = _run("C", c_state, d, results)
    assert gc.reached.wait(60), results  # C took the free lock and committed
    ga.go.set()
    ta.join(60)
    gb.go.set()
    tb.join(60)
    gc.go.set()
    tc.join(60)
    assert isinstance(results["A"], CheckpointLockedError) and "stalled" in str(results["A"]), results
    assert results["C"] == "saved", results
    assert isinstance(results["B"], CheckpointLockedError) or results["B"] == "saved", results
    want = state_hash(b_state) if results["B"] == "saved" else state_hash(c_state)
    assert loaded_hash(d) == want, sorted(p.name for p in d.iterdir())


def test_a_lock_token_is_never_followed_as_a_path(tmp_path):
    """Review finding: the fence deletes the broken save's staged manifest, named with the lock's token; a token such
    as 'x/../../victim' made the next save delete a directory outside the checkpoint.  Tokens are 16 hex digits:
    anything else is an invalid lock (aged away like one), and nothing outside the directory is touched."""
    old = controller(3)
    d, victim = tmp_path / "ck", tmp_path / "victim"
    old.save(d)
    victim.mkdir()
    (victim / "keep.txt").write_text("x")
    (d / ".manifest.json.tmp-x").mkdir()
    holder = {"host": "elsewhere", "boot_id": "b", "pid_ns": None, "pid": 7, "pid_start": None, "started": 1.0,
              "token": "x/../../victim"}
    (d / dirlock.LOCK_FILE).write_text(__import__("json").dumps(holder))
    assert dirlock.parse((d / dirlock.LOCK_FILE).read_bytes())[0] is None
    past = time.time() - dirlock.STALE_AFTER_S - 5
    os.utime(d / dirlock.LOCK_FILE, (past, past))
    controller(5).save(d)
    assert (victim / "keep.txt").read_text() == "x" and loaded_hash(d) == state_hash(controller(5))
