"""The lock and clocks that disagree (issue 43, "Bad input": a node whose clock is far off).

A lock of another host is judged by its age: the file system's "now" (the mtime of the temporary file the contender
just wrote) minus the lock's mtime.  A lock stamped further in the future than ``dirlock.CLOCK_SKEW_S`` is refused
with the skew named, never broken early and never taken for fresh in silence; a host whose own clock is off no longer
moves the ages it judges (the file system stamps both mtimes)."""

import json
import os
import time

import pytest

from hdreplay.checkpoint import dirlock
from hdreplay.errors import CheckpointLockedError
from lock_states import controller, loaded_hash
from protocol import state_hash

LOCK = dirlock.LOCK_FILE


def other_hosts_lock(d, stamped_at):
    """A lock of a writer on host 'node-ahead', its mtime set to ``stamped_at`` (as that host's clock would)."""
    holder = {"host": "node-ahead", "boot_id": "b", "pid_ns": "pid:[1]", "pid": 4242, "pid_start": None,
              "started": stamped_at, "token": "00000000c10cc0de"}
    (d / LOCK).write_text(json.dumps(holder))
    os.utime(d / LOCK, (stamped_at, stamped_at))


def test_a_lock_stamped_far_in_the_future_is_a_named_error_never_broken_early(tmp_path):
    """Before: the age of a lock stamped an hour ahead counted as 0 for an hour, then aged normally: refused as "last
    touched 0 s ago" with no word of the clocks, and a dead writer's lock kept for 70 minutes."""
    old, new = controller(3), controller(5)
    d = tmp_path / "ck"
    old.save(d)
    other_hosts_lock(d, time.time() + 3600)
    before = sorted(p.name for p in d.iterdir())
    with pytest.raises(CheckpointLockedError) as e:
        new.save(d)
    msg = str(e.value)
    assert str(d / LOCK) in msg and "'node-ahead'" in msg, msg  # the lock and the holder's host
    skew = float(msg.split("stamped ")[1].split(" s ")[0])
    assert 3590 < skew < 3610, msg  # the skew in seconds
    assert "NTP" in msg and f"delete {d / LOCK}" in msg, msg  # the fix
    assert sorted(p.name for p in d.iterdir()) == before and loaded_hash(d) == state_hash(old)
    # within the tolerance: an ordinary refusal (a fresh lock), then broken once it is older than the age limit
    other_hosts_lock(d, time.time() + dirlock.CLOCK_SKEW_S / 2)
    with pytest.raises(CheckpointLockedError, match="another save is writing") as e:
        new.save(d)
    assert "in the future" not in str(e.value)
    past = time.time() - dirlock.STALE_AFTER_S - 5
    os.utime(d / LOCK, (past, past))
    new.save(d)
    assert loaded_hash(d) == state_hash(new)


@pytest.mark.parametrize("offset", [3600.0, -3600.0])
def test_a_host_whose_own_clock_is_off_judges_ages_by_the_file_systems_clock(tmp_path, monkeypatch, offset):
    """This host's clock an hour ahead: before, every lock of another host looked an hour old and a live writer's
    lock was broken at once.  An hour behind: a fresh lock looked an hour in the future.  Now the age is measured
    between two mtimes the file system stamped (here one kernel's clock, as an NFS server stamps both with its own):
    a fresh lock is refused as fresh, an aged one is broken."""
    old, new = controller(3), controller(5)
    d = tmp_path / "ck"
    old.save(d)
    other_hosts_lock(d, time.time())  # fresh: its writer heartbeats
    real = time.time
    monkeypatch.setattr(time, "time", lambda: real() + offset)
    with pytest.raises(CheckpointLockedError, match="another save is writing") as e:
        new.save(d)
    assert "last touched 0 s ago" in str(e.value), str(e.value)
    assert loaded_hash(d) == state_hash(old)
    past = real() - dirlock.STALE_AFTER_S - 5
    os.utime(d / LOCK, (past, past))
    new.save(d)
    assert loaded_hash(d) == state_hash(new)
