"""One checkpoint directory, two hosts (issue 43, item 3): writers in separate UTS + pid namespaces with different
hostnames (tests/support/two_hosts.py) over one directory, so that each judges the other's lock by its age only.

A few trials each, both orders (host-1 writes and host-2 comes second, and the reverse); the lock's age limit is 2 s
here (``dirlock.STALE_AFTER_S``, set in the agents), the heartbeat 0.4 s.  benchmarks/two_hosts_lock.py runs the
same trials many times and records the figures (docs/multinode.md)."""

import time

import pytest

from hdreplay.checkpoint import dirlock
from two_hosts import Host, can_run

STALE_S, HEARTBEAT_S = 2.0, 0.4
WHY_NOT = can_run()
pytestmark = pytest.mark.skipif(bool(WHY_NOT), reason=f"needs unshare --uts --pid: {WHY_NOT}")
ORDERS = {"host-1 writes, host-2 second": ("host-1", "host-2"), "host-2 writes, host-1 second": ("host-2", "host-1")}


@pytest.fixture(scope="module")
def hosts():
    hs = {}
    try:
        for name in ("host-1", "host-2"):
            hs[name] = Host(name, STALE_S, HEARTBEAT_S)
        yield hs
    finally:
        for h in hs.values():
            h.close()


@pytest.fixture(scope="module")
def hashes(hosts):
    """The hashes of the states the tests save (each agent builds them once, here: a state built in the middle of a
    trial would delay that agent's first attempt by seconds)."""
    return [h.call("hashes", steps=[2, 3, 5, 7]) for h in hosts.values()][0]


def lock_age(d):
    try:
        return time.time() - (d / dirlock.LOCK_FILE).stat().st_mtime
    except FileNotFoundError:
        return None


def test_the_agents_are_two_hosts(hosts):
    one, two = hosts["host-1"].hello, hosts["host-2"].hello
    assert (one["host"], two["host"]) == ("host-1", "host-2") and one["pid"] == two["pid"] == 1
    assert one["pid_ns"] != two["pid_ns"] != dirlock.pid_ns()


@pytest.mark.parametrize("order", sorted(ORDERS))
def test_a_live_writer_on_the_other_host_is_never_broken_while_it_heartbeats(tmp_path, hosts, hashes, order):
    """A's save lasts ~1.5x the age limit (a slow write, heartbeating its lock between chunks); B tries to save every
    50 ms meanwhile.  Every attempt before A's save returned is refused naming A's host, B never judges A's lock
    stale, and A's save completes."""
    a, b = (hosts[n] for n in ORDERS[order])
    d, stop = tmp_path / "ck", tmp_path / "stop"
    assert a.call("save", dir=str(d), steps=2)["result"] == "saved"
    a.send("save", dir=str(d), steps=5, slow_s=0.08)  # 38 chunks: ~3 s
    a.wait_event("holding")
    b.send("attempts", dir=str(d), steps=7, stop=str(stop), every_s=0.05)
    got_a = a.done()
    stop.touch()
    got_b = b.done()
    assert got_a["result"] == "saved", got_a
    assert got_a["t1"] - got_a["t0"] > 1.2 * STALE_S, got_a  # longer than the age limit: only heartbeats keep it
    during = [t for t in got_b["attempts"] if t[1] < got_a["t1"]]
    late = [t for t in during if t[0] - got_a["t0"] > STALE_S]
    assert late and all(t[2] == "CheckpointLockedError" and a.name in t[3] for t in during), got_b["attempts"]
    on_a = [v for v in got_b["verdicts"] if v["host"] == a.name]
    assert on_a and not any(v["stale"] for v in on_a), on_a  # (its heartbeats were seen across hosts)
    assert b.call("load", dir=str(d))["loaded"] in {hashes["5"], hashes["7"]}


@pytest.mark.parametrize("order", sorted(ORDERS))
def test_a_dead_writers_lock_is_broken_only_after_the_age_limit(tmp_path, hosts, hashes, order):
    """A's writer is SIGKILLed in the middle of a save; B tries every 100 ms: refused while the lock is younger than
    the age limit, and the lock broken only once it is older (judged age and wall clock), then B's state loads."""
    a, b = (hosts[n] for n in ORDERS[order])
    d = tmp_path / "ck"
    a.call("fork_saves", dir=str(d), steps=[3, 5], slow_s=0.03)
    a.call("kill")
    mtime = (d / dirlock.LOCK_FILE).stat().st_mtime
    got = b.call("attempts", dir=str(d), steps=7, stop=str(tmp_path / "never"), every_s=0.1, deadline_s=STALE_S + 60)
    tries = got["attempts"]
    assert tries[-1][2] == "saved" and tries[0][2] == "CheckpointLockedError", tries
    assert all(t[2] == "CheckpointLockedError" for t in tries[:-1]), tries
    assert tries[-1][1] - mtime > STALE_S, (tries[-1], mtime)  # never before the age limit
    broke = [v for v in got["verdicts"] if v["stale"]]
    assert len(broke) == 1 and broke[0]["host"] == a.name and broke[0]["age"] > STALE_S, got["verdicts"]
    assert a.call("load", dir=str(d))["loaded"] == hashes["7"]


@pytest.mark.parametrize("where", ["verify", "commit"])
@pytest.mark.parametrize("order", sorted(ORDERS))
def test_a_writer_that_stalls_past_the_age_limit_is_fenced_off_across_hosts(tmp_path, hosts, hashes, order, where):
    """A stalls (no heartbeat) before checking its lock, or after the check just before its commit rename, until its
    lock is older than the limit; B breaks it and saves; A then resumes and fails by name (taken over / fenced), and
    B's state loads on A's host: nothing of A's save is mixed in."""
    a, b = (hosts[n] for n in ORDERS[order])
    d, go = tmp_path / "ck", tmp_path / "go"
    assert a.call("save", dir=str(d), steps=2)["result"] == "saved"
    a.send("save", dir=str(d), steps=3, stall=where, go=str(go))
    a.wait_event("holding")
    a.wait_event("stalled")
    deadline = time.monotonic() + 60
    while (lock_age(d) or 0) <= STALE_S + 0.2 and time.monotonic() < deadline:
        time.sleep(0.05)
    got_b = b.call("save", dir=str(d), steps=5)
    go.touch()
    got_a = a.done()
    assert got_b["result"] == "saved", got_b
    assert got_a["result"] == "CheckpointLockedError", got_a
    assert ("taken over" if where == "verify" else "stalled past the lock's age limit") in got_a["msg"], got_a
    assert a.call("load", dir=str(d))["loaded"] == hashes["5"]
    assert not (d / dirlock.LOCK_FILE).exists()


@pytest.mark.parametrize("order", sorted(ORDERS))
def test_a_reader_on_the_other_host_never_loads_a_half_written_state(tmp_path, hosts, hashes, order):
    """The writer saves three states in turn, 30 times; the reader on the other host loads in a loop meanwhile.  Each
    load is one of the complete states, or the named CheckpointError of a load that raced a cleanup."""
    writer, reader = (hosts[n] for n in ORDERS[order])
    d, stop = tmp_path / "ck", tmp_path / "stop"
    assert writer.call("save", dir=str(d), steps=2)["result"] == "saved"
    reader.send("load_loop", dir=str(d), stop=str(stop))
    assert writer.call("save_loop", dir=str(d), steps=[3, 5, 7], n=30, stop=str(stop)) == {"saved": 30}
    loads = reader.done()["loads"]
    known = {hashes[s]: s for s in ("2", "3", "5", "7")}
    odd = {k: v for k, v in loads.items() if k not in known and not k.startswith("CheckpointError: ")}
    assert not odd, odd
    assert len({known[k] for k in loads if k in known}) >= 2, loads  # the reads did overlap the writes
