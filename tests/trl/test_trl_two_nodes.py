"""HDRGRPOTrainer and HDRAsyncGRPOTrainer on two nodes: ``torchrun --nnodes 2 --nproc_per_node 1`` on 127.0.0.1
(gloo), one launcher per node, each node with its own LOCAL_RANK 0 (tests/support/two_nodes.py).

One layout per trainer here (the sync trainer on node-local disks with ``save_on_each_node=True``, the async one on a
shared output directory); every layout and both launchers: ``python benchmarks/two_nodes.py``
(docs/results/multinode/).  Every launch is bounded by a timeout: a hang fails the test.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import pytest

from paths import SUPPORT

pytest.importorskip("trl")
pytestmark = [pytest.mark.trl, pytest.mark.multiprocess]

STEPS = 4  # checkpoints at 2 and 4
LOCAL = {"save_on_each_node": True}


def _launch(script, args, env=None, timeout=300):
    from two_nodes import launch

    return launch(SUPPORT / script, args, env=env, timeout=timeout)


def _ok(nodes):
    assert all(n.returncode == 0 for n in nodes), "\n\n".join(f"node {n.rank} rc {n.returncode}:\n{n.output[-4000:]}"
                                                               for n in nodes)


def _refused(nodes, dirs, tag=""):
    """Both nodes exited with an error file (no hang, no bare collective error): their messages."""
    assert all(n.returncode not in (0, None) for n in nodes), [n.returncode for n in nodes]
    msgs = [(Path(d) / f"rank{r}{tag}_error.txt").read_text() for r, d in enumerate(dirs)]
    assert not any("Connection closed by peer" in m or "gloo" in m.lower() for m in msgs), msgs
    return msgs


def _digest(root: Path) -> dict:
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}


def _record(d, rank, tag=""):
    return json.loads((Path(d) / f"rank{rank}{tag}.json").read_text())


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from hdreplay_lab.sandbox.model import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("two_nodes") / "model")


@pytest.fixture(scope="module")
def local_run(model_dir, tmp_path_factory):
    """The uninterrupted sync run on node-local disks (save_on_each_node=True): node k writes into nodek/."""
    root = tmp_path_factory.mktemp("local")
    dirs = [root / "node0", root / "node1"]
    _ok(_launch("dist_trl_run.py", [[d, model_dir, STEPS] for d in dirs],
                env=[{"HDR_TEST_ARGS": json.dumps(LOCAL)}] * 2))
    return root, dirs


def _resumable_copy(local_run, tmp_path):
    """Both nodes' disks as they were at checkpoint 2 (the later checkpoint and the run's records removed)."""
    root, dirs = local_run
    out = [tmp_path / d.name for d in dirs]
    for src, dst in zip(dirs, out):
        shutil.copytree(src, dst, ignore=shutil.ignore_patterns("rank*.json", f"checkpoint-{STEPS}"))
    return out


def test_each_node_writes_its_own_replay_state_with_save_on_each_node(local_run):
    """Before: only the global main process wrote hdreplay/, so node 1's checkpoints had none and could not resume."""
    _, dirs = local_run
    for step in (2, STEPS):
        states = [d / f"checkpoint-{step}" / "hdreplay" for d in dirs]
        assert all(s.is_dir() for s in states)
        assert not any((d / f"checkpoint-{step}" / "hdreplay.pending").exists() for d in dirs)
        # the same replay state on both nodes' disks, each bound to its own node's trainer_state.json
        tensors = [hashlib.sha256(next(x.glob("v-*/tensors.safetensors")).read_bytes()).digest() for x in states]
        meta = [json.loads(next(x.glob("v-*/state.json")).read_text())["meta"] for x in states]
        ids = [m.pop("identity") for m in meta]
        assert tensors[0] == tensors[1] and meta[0] == meta[1]
        assert ids[0]["run_id"] == ids[1]["run_id"] and ids[0]["global_step"] == ids[1]["global_step"] == step
    a, b = (_record(d, r) for r, d in enumerate(dirs))
    assert a["world"] == b["world"] == 2 and a["buffer_hashes"] == b["buffer_hashes"]


def test_node_local_resume_refuses_on_every_rank_what_transformers_did_not_write_then_resumes_exactly(
        local_run, model_dir, tmp_path):
    """transformers 5.23 writes the model's config and weights from global rank 0 only, even with
    save_on_each_node=True: node 1's checkpoint cannot be resumed as written.  Before: node 1 raised and node 0 died
    with gloo's "Connection closed by peer".  Now both refuse by name, nothing changed; with the weights copied
    across, the resumed run equals the uninterrupted one on both ranks."""
    root, full = local_run
    dirs = _resumable_copy(local_run, tmp_path)
    before = [_digest(d) for d in dirs]
    args = [[d, model_dir, STEPS, "true"] for d in dirs]
    env = [{"HDR_TEST_ARGS": json.dumps(LOCAL)}] * 2
    msgs = _refused(_launch("dist_trl_run.py", args, env=env), dirs)
    for m in msgs:
        assert m.startswith("CheckpointError: hdreplay: the ranks cannot resume checkpoint-2 together")
        assert "rank 1 (host" in m and "its copy lacks config.json, model.safetensors (rank 0's has them" in m
    for d, b in zip(dirs, before):
        (d / "rank0_error.txt").unlink(missing_ok=True)
        (d / "rank1_error.txt").unlink(missing_ok=True)
        assert _digest(d) == b  # nothing loaded, nothing written (diagnostics logs included)
    for name in ("config.json", "model.safetensors"):  # what the message says to do
        shutil.copy(dirs[0] / "checkpoint-2" / name, dirs[1] / "checkpoint-2" / name)
    _ok(_launch("dist_trl_run.py", args, env=env))
    for r in (0, 1):
        whole, resumed = _record(full[r], r), _record(dirs[r], r)
        assert resumed["selections"] == whole["selections"][2:] and resumed["selections"]
        assert resumed["losses"] == whole["losses"] and len(whole["losses"]) == STEPS
        assert resumed["buffer_hashes"][-1] == whole["buffer_hashes"][-1]
        assert resumed["weights_digest"] == whole["weights_digest"]


def test_a_node_without_the_checkpoint_refuses_on_every_rank(local_run, model_dir, tmp_path):
    """Node-local disks with save_on_each_node=False: node 1's checkpoint-2 holds only its own RNG state (what the
    Trainer writes there).  Both ranks refuse by name, for a path and for resume_from_checkpoint=True."""
    dirs = _resumable_copy(local_run, tmp_path)
    for p in (dirs[1] / "checkpoint-2").iterdir():
        if p.name != "rng_state_1.pth":
            shutil.rmtree(p) if p.is_dir() else p.unlink()
    before = [_digest(d) for d in dirs]
    for how in ("path", "true"):
        args = [[d, model_dir, STEPS, d / "checkpoint-2" if how == "path" else "true"] for d in dirs]
        msgs = _refused(_launch("dist_trl_run.py", args), dirs)
        assert msgs[0] == msgs[1] and "cannot resume" in msgs[0], msgs
        if how == "path":  # only node 1 lacks it
            assert "rank 1 (host" in msgs[0] and "has no trainer_state.json" in msgs[0]
            assert "rank 0 (host" not in msgs[0]
        else:  # node 1 has no complete checkpoint (and says why)
            assert ("rank 1 (host" in msgs[0] and "no complete checkpoint in" in msgs[0]
                    and "trainer_state.json" in msgs[0])
        for r, d in enumerate(dirs):
            (d / f"rank{r}_error.txt").unlink()
    assert [_digest(d) for d in dirs] == before


def test_nodes_launched_with_other_replay_settings_or_version_are_refused_on_every_rank(model_dir, tmp_path):
    dirs = [tmp_path / "node0", tmp_path / "node1"]
    env = [{}, {"HDR_TEST_ARGS": json.dumps({"replay_tau": 0.2, "replay_capacity": 32}),
                "HDR_TEST_VERSION": "0.1.9"}]
    msgs = _refused(_launch("dist_trl_run.py", [[d, model_dir, STEPS] for d in dirs], env=env, timeout=200), dirs)
    for m in msgs:
        assert m.startswith("RankMismatchError: hdreplay: the ranks were launched with different replay settings")
        for want in ("hdreplay version: rank 0 (host", "'0.2.0.dev0', rank 1", "'0.1.9'", "replay_tau:",
                     "0.1, rank 1", "replay_capacity:"):
            assert want in m, m
    assert not any(d.joinpath("checkpoint-2").exists() for d in dirs)  # refused before the first step


# ---------------------------------------------------------------------------------------------------------- async
def test_async_trainer_on_two_nodes_resumes_a_shared_checkpoint_exactly(tmp_path_factory):
    """HDRAsyncGRPOTrainer (lock-step worker on rank 0), one output directory both nodes share: interrupted after
    checkpoint 5 and resumed, every rank's routing, selections, losses, ledger, buffer and weights equal the
    uninterrupted run's."""
    from hdreplay_lab.sandbox.model import build_tiny_model

    root = tmp_path_factory.mktemp("async_two_nodes")
    model = build_tiny_model(root / "model", hidden=32, layers=2)
    common = [7, "--lockstep", "--save-steps", 5]

    def run(d, *extra):
        _ok(_launch("async_grpo_run.py", [[d, model, *common, *extra]] * 2, timeout=400))

    run(root / "whole")
    run(root / "cut", "--stop", 5, "--tag", ".first")
    run(root / "cut", "--resume", "--tag", ".resumed")
    for r in (0, 1):
        whole, resumed = _record(root / "whole", r), _record(root / "cut", r, ".resumed")
        assert whole["world"] == resumed["world"] == 2
        assert [s["step"] for s in resumed["steps"]] == [6, 7] and resumed["steps"] == whole["steps"][5:]
        assert resumed["totals"] == whole["totals"] and resumed["buffer_digest"] == whole["buffer_digest"]
        losses = [[(h["step"], h["loss"]) for h in x["log_history"] if "loss" in h] for x in (whole, resumed)]
        assert losses[0] == losses[1] and len(losses[0]) == 7
        assert resumed["weights_digest"] == whole["weights_digest"]
