"""HDRGRPOTrainer on 2 CPU processes (torchrun, gloo), through trainer.train()."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("trl")
pytestmark = [pytest.mark.trl, pytest.mark.multiprocess]

HERE = Path(__file__).resolve().parent.parent / "support"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def torchrun(*args, timeout=300):
    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_HUB_DISABLE_TELEMETRY="1", OMP_NUM_THREADS="1")
    # an explicit free port per launch: concurrent launches never share a rendezvous store
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc_per_node", "2",
           "--master_addr", "127.0.0.1", "--master_port", str(free_port()),
           str(HERE / "dist_trl_run.py"), *map(str, args)]
    p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-6000:]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    from hdreplay_lab.sandbox.model import build_tiny_model

    root = tmp_path_factory.mktemp("dist")
    build_tiny_model(root / "model")
    torchrun(root / "full", root / "model", 6)
    # resume a copy of the run from its step-2 checkpoint
    shutil.copytree(root / "full", root / "resumed", ignore=shutil.ignore_patterns("rank*.json"))
    for p in (root / "resumed").glob("checkpoint-[46]"):
        shutil.rmtree(p)
    torchrun(root / "resumed", root / "model", 6, root / "resumed" / "checkpoint-2")
    load = lambda d: [json.loads((root / d / f"rank{r}.json").read_text()) for r in (0, 1)]  # noqa: E731
    return load("full"), load("resumed")


def test_every_rank_holds_the_same_buffer_and_decisions(runs):
    (r0, r1), _ = runs
    assert r0["world"] == r1["world"] == 2
    assert len(r0["buffer_hashes"]) == 6 and r0["buffer_hashes"] == r1["buffer_hashes"]
    assert r0["selections"] == r1["selections"]
    assert r0["forward_calls"] == r1["forward_calls"]  # sharded re-scoring: same number of forward calls
    assert sum(len(s["groups"]) for s in r0["selections"]) > 0
    scanned_more = [h for h in r0["accepted"] if h is not None]
    assert scanned_more, "the run must log replay/accepted"


def test_replay_rows_first_on_every_rank_and_global_token_count(runs):
    (r0, r1), _ = runs
    for a, b in zip(r0["micro"], r1["micro"]):
        assert a["nib"] == b["nib"]
    # per generation cycle (2 micro-steps): replay rows precede fresh rows on each rank
    for rank in (r0, r1):
        for i in range(0, len(rank["micro"]), 2):
            flags = rank["micro"][i]["is_replay"] + rank["micro"][i + 1]["is_replay"]
            k = sum(flags)
            assert flags == [True] * k + [False] * (len(flags) - k)
    # num_items_in_batch = loss tokens of both ranks' rows, replay included
    for i in range(0, len(r0["micro"]), 2):
        total = sum(r["micro"][j]["mask_sum"] for r in (r0, r1) for j in (i, i + 1))
        assert r0["micro"][i]["nib"] == total


def test_groups_are_never_replayed_in_their_birth_step_and_ratios_move(runs):
    (r0, _), _ = runs
    for s in r0["selections"]:
        assert all(b < s["step"] for b in s["births"])
    devs = [m["replay_ratio_dev"] for m in r0["micro"] if m["replay_ratio_dev"] is not None]
    assert devs and max(devs) > 1e-3


def test_resume_on_two_processes_equals_the_uninterrupted_run(runs):
    (f0, f1), (s0, s1) = runs
    assert s0["selections"] == f0["selections"][2:] == s1["selections"]
    assert s0["buffer_hashes"] == f0["buffer_hashes"][2:] == s1["buffer_hashes"]
