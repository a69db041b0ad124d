"""Both verl recipes on a two-node Ray cluster (issue 43): placement, a resume on a fresh cluster, a driver without
the replay state.

``tests/support/verl_two_nodes.py`` runs in a subprocess (the session's one-node ``ray.init`` of conftest.py is never
touched; its Ray files live in a private ``RAY_TMPDIR``): a head and a second raylet on 127.0.0.1, one logical GPU
each, so verl's own ``ResourcePoolManager({"global_pool": [1, 1]})`` (``trainer.nnodes=2 trainer.n_gpus_per_node=1``)
puts one CPU worker (dp = 2, gloo) on each node.  The trainer runs in an actor pinned to a node, as verl's
``TaskRunner`` does: on the head for the first run (v0 and v1, 4 steps, checkpoints at 2 and 4, SGD lr 0.1, tau
between the Drifts seen), on the second node of a fresh cluster for the resumes from ``global_step_2``.
"""

import os
import signal
import subprocess
import sys

import pytest

pytestmark = pytest.mark.verl
pytest.importorskip("verl", minversion="0.9.1")
pytest.importorskip("transfer_queue")

import numpy as np  # noqa: E402
import torch  # noqa: E402

SCRIPT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "support", "verl_two_nodes.py")
TIMEOUT_S = 1500  # ~2-4 min on 2 idle cores; the bound only keeps a hung cluster from hanging the suite


@pytest.fixture(scope="module")
def two_nodes(tiny_model_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("verl_two_nodes")
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "RAY_TMPDIR")}
    with open(out / "log.txt", "w+") as log:
        proc = subprocess.Popen([sys.executable, "-u", SCRIPT, tiny_model_dir, str(out)], stdout=log,
                                stderr=subprocess.STDOUT, env=env, start_new_session=True)
        try:
            rc = proc.wait(timeout=TIMEOUT_S)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)  # the script and the Ray processes it started
            proc.wait()
            rc = "timeout"
        log.seek(0)
        assert rc == 0, f"two-node run failed ({rc}):\n{log.read()[-6000:]}"
    return torch.load(out / "results.pt", weights_only=False)


def test_workers_are_placed_one_per_node_and_the_driver_where_it_was_pinned(two_nodes):
    first, resumed = two_nodes["first"], two_nodes["resumed"]
    for run, driver_at in ((first, 0), (resumed, 1)):
        workers = run["placement"]["workers"]  # each worker's own ray.get_runtime_context().get_node_id()
        assert len(set(run["nodes"])) == 2 and sorted(workers) == sorted(run["nodes"])
        assert run["placement"]["driver"] == run["nodes"][driver_at]
    assert two_nodes["torn_down"]  # every process of the first cluster's two nodes had exited
    assert not set(first["nodes"]) & set(resumed["nodes"])  # the resume ran on a new cluster


def _assert_same_run(a: dict, b: dict):
    """Run ``b`` (resumed at step 3) did what ``a``'s steps 3-4 did: same groups scanned and replayed (by content), same
    gate outcomes, Drifts, batch lengths, metrics and losses, the same rows trained by each rank, equal replay state
    and weights."""
    sa, sb = a["steps"][2:], b["steps"]
    assert [s["step"] for s in sb] == [3, 4]
    for x, y in zip(sa, sb):
        assert x["scanned"] == y["scanned"] and x["passed"] == y["passed"] and x["replayed"] == y["replayed"]
        np.testing.assert_allclose(y["drift"], x["drift"], rtol=1e-6, atol=1e-9)
        assert x["lengths"] == y["lengths"] and x["replay_rows"] == y["replay_rows"]
    for x, y in zip(a["metrics"][2:], b["metrics"]):
        assert x.keys() == y.keys() and "actor/pg_loss" in y
        assert all(y[k] == pytest.approx(x[k], rel=1e-6, abs=1e-9) for k in x), [k for k in x if x[k] != y[k]]
    assert len(b["trained"]) == 2  # ranks
    for ra, rb in zip(a["trained"], b["trained"]):  # each rank's updates 3-4, mini-batch by mini-batch
        assert len(rb) == 2 and [[mb["responses"] for mb in u] for u in ra[2:]] == [[mb["responses"] for mb in u]
                                                                                   for u in rb]
        for ua, ub in zip(ra[2:], rb):
            for ma, mb in zip(ua, ub):
                np.testing.assert_allclose(mb["old_lp_sum"], ma["old_lp_sum"], rtol=1e-6, atol=1e-6)
                np.testing.assert_allclose(mb["adv_first"], ma["adv_first"], rtol=1e-6, atol=1e-6)
                np.testing.assert_allclose(mb["loss"], ma["loss"], rtol=1e-6, atol=1e-8)
    (ta, meta_a), (tb, meta_b) = a["state"], b["state"]
    assert meta_a == meta_b and ta.keys() == tb.keys()  # group ids compared by (birth step, prompt)
    for k in ta:
        assert torch.allclose(ta[k].float(), tb[k].float(), atol=1e-6), k
    assert len(a["weights"]) == len(b["weights"]) == 2
    for wa, wb in zip(a["weights"], b["weights"]):  # both ranks
        assert all(torch.allclose(wa[k], wb[k], atol=1e-6) for k in wa)


@pytest.mark.parametrize("recipe", ["v0", "v1"])
def test_a_run_resumed_on_a_fresh_cluster_with_the_driver_on_the_other_node_equals_the_uninterrupted_run(
        two_nodes, recipe):
    a, b = two_nodes["first"][recipe], two_nodes["resumed"][recipe]
    # the comparison has something to compare: steps 3-4 scanned and replayed, and the gate both passed and refused
    assert all(s["scanned"] for s in a["steps"][2:]) and any(s["replay_rows"] for s in a["steps"][2:])
    outcomes = [p for s in a["steps"] for p in s["passed"]]
    assert any(outcomes) and not all(outcomes)
    _assert_same_run(a, b)


@pytest.mark.parametrize("case", ["v0_node_local", "v0_absent", "v1_node_local"])
def test_a_driver_that_cannot_read_the_replay_state_is_refused_by_name_before_anything_changes(two_nodes, case):
    """The driver on the second node resumes from ``global_step_2`` as a node-local disk there holds it (verl's
    ``actor/`` written by that node's worker, none of the driver's files), or from a folder absent on its node.
    Before the fix verl loaded the workers' weights (or a worker failed on the missing folder) first."""
    got = two_nodes["refused"][case]
    assert got["error"] is not None, got
    assert got["weights_unchanged"] and got["files_unchanged"], got
    if got["global_steps"] is not None:  # v0: the trainer object survives the refusal
        assert got["global_steps"] == 0 and got["buffer"] == 0, got
    kind, message = got["error"]
    assert kind == "CheckpointError" and "global_step_2" in message and "hdr.resume_without_state" in message
    assert "trainer.default_local_dir" in message  # says what a node-local checkpoint directory means here
