"""``hdreplay explain``: the primitive on synthetic groups.  Its decisions are checked against Drift and ingress
recomputed from the groups and the step's policy (not against its own printout); bad input is one line, exit 2."""

import subprocess
import sys

import pytest

from hdreplay_lab.cli import main
from hdreplay_lab.synthetic import walkthrough

K_REP, TAU = 3, 5e-3


def test_explain_decisions_are_the_gate_rule_applied_to_recomputed_drift():
    printed: list[str] = []
    steps = walkthrough(steps=6, k_rep=K_REP, tau=TAU, out=printed.append)
    groups = {g.group_id: g for st in steps for g in st.fresh}
    decisions = []
    for st in steps:
        sel = st.selection
        for gid, passed in zip(sel.scanned_group_ids, sel.scanned_pass.tolist()):
            g = groups[gid]
            now = st.policy.token_logprobs(g.completion_ids, g.response_lengths).double()
            drift = float((now - g.logprobs.double())[g.loss_mask].square().mean())  # Drift, l2 (the default)
            assert g.birth_step < st.step  # a group is never scanned in the step that produced it
            if abs(drift - TAU) > 1e-7:
                assert passed == (drift <= TAU), (st.step, gid, drift)
            decisions.append(passed)
        replayed = [g.group_id for g in sel.groups]
        assert len(replayed) <= K_REP and all(groups[r].birth_step < st.step for r in replayed)
        # replayed = the first K_REP gate passes in scan order (headroom_drift: cached-Headroom order)
        passes = [gid for gid, ok in zip(sel.scanned_group_ids, sel.scanned_pass.tolist()) if ok]
        assert replayed == passes[:K_REP]
        # ingress: mixed outcome, i.e. rewards not all equal
        assert st.admitted == [bool(g.rewards.max() > g.rewards.min()) for g in st.fresh]
    assert True in decisions and False in decisions, "the walkthrough must show both gate decisions"
    # the printout has one line per scanned group, with its decision
    verdicts = [line.rsplit("  ", 1)[-1].split()[0] for line in printed if line.lstrip().startswith("scan #")]
    assert verdicts == ["ACCEPT" if d else "reject" for d in decisions]


def test_explain_command_runs():
    p = subprocess.run([sys.executable, "-m", "hdreplay_lab.cli", "explain", "--steps", "3",
                        "--selector", "drift_only"],
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 0 and "selector=drift_only" in p.stdout and p.stdout.count("\nstep ") == 3, p.stderr[-2000:]


@pytest.mark.parametrize("args, needle", [
    (["--selector", "bogus"], "'headroom_drift', 'headroom_only'"),
    (["--steps", "0"], "--steps must be >= 1"),
    (["--steps", "two"], "--steps"),
])
def test_explain_bad_input(args, needle, capsys):
    assert main(["explain", *args]) == 2
    out = capsys.readouterr()
    err = [x for x in out.err.splitlines() if x.strip()]
    assert len(err) == 1 and err[0].startswith("hdreplay explain: error:") and needle in err[0] and not out.out


@pytest.mark.parametrize("selector", sorted(__import__("hdreplay").SELECTORS))
def test_every_listed_selector_walks_through(selector, capsys):
    """Every --selector choice runs (adv_priority, which stores single rollouts, needs the group size: it ended in a
    traceback with exit 1)."""
    assert main(["explain", "--selector", selector, "--steps", "3"]) == 0
    out = capsys.readouterr()
    assert "Traceback" not in out.err and f"selector={selector}" in out.out
    assert [line.split(":")[0] for line in out.out.splitlines() if line.startswith("step ")] == \
        ["step 0", "step 1", "step 2"]
