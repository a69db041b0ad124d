"""``hdreplay explain``: the primitive on synthetic groups, every decision printed, and its bad input."""

import re
import subprocess
import sys

import pytest


def cli(*args):
    return subprocess.run([sys.executable, "-m", "hdreplay_lab.cli", *map(str, args)], capture_output=True, text=True,
                          timeout=300)


def test_explain_prints_decisions_that_obey_the_gate():
    p = cli("explain", "--steps", "5")
    assert p.returncode == 0, p.stderr[-3000:]
    tau = float(re.search(r"tau=([0-9.e-]+)", p.stdout).group(1))
    k_rep = int(re.search(r"K_rep=(\d+)", p.stdout).group(1))
    scans = re.findall(r"Drift ([0-9.e-]+)\s+(ACCEPT|reject)", p.stdout)
    assert scans and {d for _, d in scans} == {"ACCEPT", "reject"}, "the walkthrough shows both decisions"
    for drift, decision in scans:
        if abs(float(drift) - tau) > 1e-5:  # the printout rounds Drift to 5 decimals
            assert (float(drift) <= tau) == (decision == "ACCEPT")
    for line in re.findall(r"replayed \[(.*?)\]", p.stdout):
        assert len([g for g in line.split(",") if g.strip()]) <= k_rep
    # no same-step replay: a group replayed at step t was born before t
    for step, body in re.findall(r"step (\d+):(.*?)(?=\nstep \d+:|\Z)", p.stdout, flags=re.S):
        replayed = re.search(r"replayed \[(.*?)\]", body)
        for gid in re.findall(r"'(\d+)-\d+'", replayed.group(1) if replayed else ""):
            assert int(gid) < int(step)


@pytest.mark.parametrize("args, needle", [
    (["--selector", "bogus"], "valid: ['drift_only', 'headroom_drift'"),
    (["--steps", "0"], "--steps: 0 must be at least 1"),
    (["--steps", "two"], "'two' is not an integer"),
])
def test_explain_bad_input(args, needle):
    p = cli("explain", *args)
    assert p.returncode == 2 and needle in p.stderr and "Traceback" not in p.stderr
