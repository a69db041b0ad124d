"""One checkpoint directory, two hosts: the writer lock over many trials (issue 43, item 3; docs/multinode.md).

    .venv/bin/python benchmarks/two_hosts_lock.py             # ~9 min, 2 busy cores: docs/results/two_hosts_lock.json
    .venv/bin/python benchmarks/two_hosts_lock.py --trials 3  # a quick look

Each host is an agent in its own UTS + pid namespace with its own hostname (tests/support/two_hosts.py; needs root or
user namespaces for ``unshare``), all over one directory; the lock's age limit is ``--stale`` seconds (set on
``hdreplay.checkpoint.dirlock`` in the agents, 600 s in a real run) and the heartbeat ``--heartbeat``.  Every scenario
runs in both orders (host-1 writes and host-2 comes second, and the reverse):

* live: A's save lasts ~1.5x the age limit (slowed writes, heartbeating between chunks); B tries to save every 50 ms.
  Broken = A's save failed, or B judged A's lock stale.  Also with B's clock an hour ahead (host-3);
* dead: A's writer is SIGKILLed at a random moment of a save; B tries every 100 ms until it saves.  Early = B broke
  the lock before it was older than the limit (judged age, or B's save ended less than the limit after the lock's
  last mtime).  Also with B's clock an hour behind (host-4): the lock must still be broken once aged;
* stall: A stalls (no heartbeat) before checking its lock or after the check just before its commit rename, until its
  lock is older than the limit; B breaks it and saves; A resumes after B's save, or while B writes.  Fenced = A's
  save failed with CheckpointLockedError; mixed = the directory, loaded on A's host, is not B's state;
* reader: the writer saves three states in turn; the reader on the other host loads in a loop.  Each load is a known
  complete state, a named CheckpointError (a load that raced a cleanup), or half-written/mixed (anything else).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "src"), str(ROOT / "tests" / "support")]

from hdreplay.checkpoint import dirlock  # noqa: E402
from two_hosts import Host, can_run  # noqa: E402

CHUNKS = 38  # 64-byte chunks of the saved state's tensor file (two_hosts.py slows each)


def summary(xs: list[float]) -> dict:
    return {"n": len(xs), "min": min(xs), "median": statistics.median(xs), "max": max(xs)} if xs else {"n": 0}


def live(a: Host, b: Host, d: Path, stale: float) -> dict:
    stop = d.parent / f"{d.name}.stop"
    a.call("save", dir=str(d), steps=2)
    a.send("save", dir=str(d), steps=5, slow_s=1.5 * stale / CHUNKS)
    a.wait_event("holding")
    b.send("attempts", dir=str(d), steps=7, stop=str(stop), every_s=0.05)
    got_a = a.done(300)
    stop.touch()
    got_b = b.done(300)
    during = [t for t in got_b["attempts"] if t[1] < got_a["t1"]]
    ages = [v["age"] for v in got_b["verdicts"] if v["host"] == a.name]
    return {"broken": got_a["result"] != "saved" or any(v["stale"] for v in got_b["verdicts"] if v["host"] == a.name),
            "save_s": got_a["t1"] - got_a["t0"], "attempts_during": len(during),
            "attempts_past_limit": sum(t[0] - got_a["t0"] > stale for t in during),
            "refusals_not_locked": sum(t[2] != "CheckpointLockedError" for t in during),
            "max_age_seen": max(ages, default=None)}


def dead(a: Host, b: Host, d: Path, stale: float, rng: random.Random) -> dict:
    a.call("fork_saves", dir=str(d), steps=[3, 5], slow_s=0.03)
    time.sleep(rng.uniform(0, 0.03 * CHUNKS))
    a.call("kill")
    try:
        mtime = (d / dirlock.LOCK_FILE).stat().st_mtime
    except FileNotFoundError:  # killed between two saves: no lock left
        mtime = None
    got = b.call("attempts", dir=str(d), steps=7, stop=str(d.parent / "never"), every_s=0.1,
                 deadline_s=stale + 120, timeout=stale + 180)
    tries, broke = got["attempts"], [v for v in got["verdicts"] if v["stale"]]
    out = {"lock_left": mtime is not None, "saved": tries[-1][2] == "saved",
           "refused_first": sum(t[2] == "CheckpointLockedError" for t in tries[:-1]),
           "other_outcomes": sum(t[2] not in ("saved", "CheckpointLockedError") for t in tries),
           "loads_b": a.call("load", dir=str(d))["loaded"]}
    if mtime is not None:
        out |= {"judged_age": broke[-1]["age"] if broke else None, "wall_age_at_save": tries[-1][1] - mtime,
                "late_s": tries[-1][0] - (mtime + stale)}
        out["early"] = out["saved"] and (not broke or broke[-1]["age"] <= stale or tries[-1][1] - mtime <= stale)
    return out


def stall(a: Host, b: Host, d: Path, stale: float, where: str, resume: str) -> dict:
    go = d.parent / f"{d.name}.go"
    a.call("save", dir=str(d), steps=2)
    a.send("save", dir=str(d), steps=3, stall=where, go=str(go))
    a.wait_event("holding")
    a.wait_event("stalled")
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        try:
            if time.time() - (d / dirlock.LOCK_FILE).stat().st_mtime > stale + 0.2:
                break
        except FileNotFoundError:
            break
        time.sleep(0.05)
    if resume == "after B's save":
        got_b = b.call("save", dir=str(d), steps=5)
        go.touch()
        got_a = a.done()
    else:  # while B writes: B's save is slowed, A resumes once B holds the lock
        b.send("save", dir=str(d), steps=5, slow_s=0.02)
        b.wait_event("holding")
        go.touch()
        got_a = a.done()
        got_b = b.done()
    how = ("its lock check: taken over" if "was taken over" in got_a["msg"] else "its commit: fenced (stalled past "
           "the limit)" if "stalled past the lock's age limit" in got_a["msg"] else got_a["msg"][:120])
    return {"fenced": got_a["result"] == "CheckpointLockedError", "a_failed_at": how,
            "b_saved": got_b["result"] == "saved", "loads_b": a.call("load", dir=str(d))["loaded"]}


def reader(writer: Host, rd: Host, d: Path, saves: int) -> dict:
    stop = d.parent / f"{d.name}.stop"
    writer.call("save", dir=str(d), steps=2)
    rd.send("load_loop", dir=str(d), stop=str(stop))
    saved = writer.call("save_loop", dir=str(d), steps=[3, 5, 7], n=saves, stop=str(stop), timeout=1200)
    return {"saves": saved, "loads": rd.done(300)["loads"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--trials", type=int, default=20, help="live and dead trials per order (stall: a quarter per case)")
    ap.add_argument("--saves", type=int, default=200, help="saves per order of the reader scenario")
    ap.add_argument("--stale", type=float, default=2.0, help="the lock's age limit in the agents (s)")
    ap.add_argument("--heartbeat", type=float, default=0.4, help="the save heartbeat in the agents (s)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=str(ROOT / "docs" / "results" / "two_hosts_lock.json"))
    args = ap.parse_args()
    if why := can_run():
        sys.exit(f"cannot simulate two hosts here: {why}")
    rng, t_start = random.Random(args.seed), time.perf_counter()
    hosts = {n: Host(n, args.stale, args.heartbeat, off) for n, off in
             (("host-1", 0), ("host-2", 0), ("host-3", 3600), ("host-4", -3600))}
    for h in hosts.values():  # (each agent builds the states it saves once, here)
        known = {v: k for k, v in h.call("hashes", steps=[2, 3, 5, 7], timeout=300).items()}
    orders = [("host-1", "host-2"), ("host-2", "host-1")]
    rows: dict[str, list] = {k: [] for k in ("live", "live, B's clock +1 h", "dead", "dead, B's clock -1 h",
                                             "stall", "reader")}
    with tempfile.TemporaryDirectory() as tmp:
        def fresh(tag=[0]):
            tag[0] += 1
            return Path(tmp) / f"ck{tag[0]}"
        for i in range(args.trials):
            for an, bn in orders:
                rows["live"].append({"order": f"{an} writes", **live(hosts[an], hosts[bn], fresh(), args.stale)})
                rows["dead"].append({"order": f"{an} writes", **dead(hosts[an], hosts[bn], fresh(), args.stale, rng)})
            if i % 2 == 0:
                an = orders[i // 2 % 2][0]
                rows["live, B's clock +1 h"].append(
                    {"order": f"{an} writes", **live(hosts[an], hosts["host-3"], fresh(), args.stale)})
                rows["dead, B's clock -1 h"].append(
                    {"order": f"{an} writes", **dead(hosts[an], hosts["host-4"], fresh(), args.stale, rng)})
            if i % 4 == 0:
                for an, bn in orders:
                    for where in ("verify", "commit"):
                        for resume in ("after B's save", "while B writes"):
                            rows["stall"].append({"order": f"{an} writes", "stall": where, "resume": resume,
                                                  **stall(hosts[an], hosts[bn], fresh(), args.stale, where, resume)})
            print(f"round {i + 1}/{args.trials}: {time.perf_counter() - t_start:.0f} s", flush=True)
        for an, bn in orders:
            rows["reader"].append({"order": f"{an} writes", **reader(hosts[an], hosts[bn], fresh(), args.saves)})
    for h in hosts.values():
        h.close()
    result = {"command": f"python benchmarks/two_hosts_lock.py --trials {args.trials} --saves {args.saves} "
                         f"--stale {args.stale} --heartbeat {args.heartbeat} --seed {args.seed}",
              "stale_after_s": args.stale, "heartbeat_s": args.heartbeat, "clock_skew_s": dirlock.CLOCK_SKEW_S,
              "wall_s": time.perf_counter() - t_start}
    for name in ("live", "live, B's clock +1 h"):
        rs = rows[name]
        result[name] = {"trials": len(rs), "orders": dict(Counter(r["order"] for r in rs)),
                        "broken": sum(r["broken"] for r in rs),
                        "attempts_during_saves": sum(r["attempts_during"] for r in rs),
                        "attempts_past_the_limit": sum(r["attempts_past_limit"] for r in rs),
                        "refusals_not_CheckpointLockedError": sum(r["refusals_not_locked"] for r in rs),
                        "save_s": summary([r["save_s"] for r in rs]),
                        "max_lock_age_seen_s": summary([r["max_age_seen"] for r in rs
                                                        if r["max_age_seen"] is not None])}
    for name in ("dead", "dead, B's clock -1 h"):
        rs, left = rows[name], [r for r in rows[name] if r["lock_left"]]
        result[name] = {"trials": len(rs), "orders": dict(Counter(r["order"] for r in rs)),
                        "lock_left_by_the_kill": len(left), "broken_early": sum(r["early"] for r in left),
                        "never_broken": sum(not r["saved"] for r in rs),
                        "refused_before_the_break": summary([r["refused_first"] for r in left]),
                        "judged_age_at_break_s": summary([r["judged_age"] for r in left if r["judged_age"]]),
                        "broken_after_the_limit_by_s": summary([r["late_s"] for r in left]),
                        "other_outcomes": sum(r["other_outcomes"] for r in rs),
                        "then_loads_B": sum(known.get(r["loads_b"]) == "7" for r in rs)}
    rs = rows["stall"]
    result["stall"] = {"trials": len(rs), "cases": dict(Counter(f"{r['order']}, stall before {r['stall']}, A resumes "
                                                              f"{r['resume']}" for r in rs)),
                       "fenced": sum(r["fenced"] for r in rs), "b_saved": sum(r["b_saved"] for r in rs),
                       "loads_b": sum(known.get(r["loads_b"]) == "5" for r in rs),
                       "mixed_or_unloadable": sum(known.get(r["loads_b"]) != "5" for r in rs),
                       "a_failed_at": dict(Counter(f"stall before {r['stall']}: {r['a_failed_at']}" for r in rs))}
    loads = Counter()
    for r in rows["reader"]:
        for k, v in r["loads"].items():
            loads["state " + known[k] if k in known else "CheckpointError (named)"
                  if k.startswith("CheckpointError: ") else "half-written or mixed: " + k[:80]] += v
    result["reader"] = {"orders": [r["order"] for r in rows["reader"]], "saves": sum(sum(r["saves"].values())
                                                                                   for r in rows["reader"]),
                        "loads": sum(loads.values()), "by_outcome": dict(sorted(loads.items())),
                        "half_written_or_mixed": sum(v for k, v in loads.items() if k.startswith("half"))}
    result["ok"] = (result["live"]["broken"] == result["live, B's clock +1 h"]["broken"] == 0
                    and result["dead"]["broken_early"] == result["dead, B's clock -1 h"]["broken_early"] == 0
                    and result["dead"]["never_broken"] == result["dead, B's clock -1 h"]["never_broken"] == 0
                    and result["stall"]["fenced"] == result["stall"]["trials"] == result["stall"]["loads_b"]
                    and result["reader"]["half_written_or_mixed"] == 0)
    out = Path(args.out)
    out.write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result, indent=1))
    sys.exit(0 if result["ok"] else 1)


if __name__ == "__main__":
    main()
