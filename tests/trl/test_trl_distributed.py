"""HDRGRPOTrainer on 2 CPU processes (torchrun, gloo), through trainer.train()."""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import subprocess
import sys

import pytest

from paths import SUPPORT

pytest.importorskip("trl")
pytestmark = [pytest.mark.trl, pytest.mark.multiprocess]

HERE = SUPPORT


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def torchrun(*args, timeout=300, env_extra=None, ok=True):
    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_HUB_DISABLE_TELEMETRY="1", OMP_NUM_THREADS="1", **(env_extra or {}))
    # an explicit free port per launch: concurrent launches never share a rendezvous store
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc_per_node", "2",
           "--master_addr", "127.0.0.1", "--master_port", str(free_port()),
           str(HERE / "dist_trl_run.py"), *map(str, args)]
    p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    if ok:
        assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-6000:]
    return p


@pytest.fixture(scope="module")
def dist_root(tmp_path_factory):
    from hdreplay_lab.sandbox.model import build_tiny_model

    root = tmp_path_factory.mktemp("dist")
    build_tiny_model(root / "model")
    return root


@pytest.fixture(scope="module")
def runs(dist_root):
    root = dist_root
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
    assert r0["forward_calls"] == r1["forward_calls"] > 0  # sharded re-scoring: same number of forward calls
    assert sum(len(s["groups"]) for s in r0["selections"]) > 0
    scanned_more = [h for h in r0["accepted"] if h is not None]
    assert scanned_more, "the run must log replay/accepted"


def test_replay_chunks_follow_the_fresh_micro_batch_and_tokens_are_global(runs):
    (r0, r1), _ = runs
    assert [(m["micro"], len(m["is_replay"])) for m in r0["micro"]] == [(m["micro"], len(m["is_replay"]))
                                                                         for m in r1["micro"]]
    for a, b in zip(r0["micro"], r1["micro"]):
        assert a["nib"] == b["nib"]
    # each micro-step: plain TRL's fresh micro-batch (2 rows per rank), then replay chunks of <= 2 rows
    for rank in (r0, r1):
        by_micro = {}
        for m in rank["micro"]:
            by_micro.setdefault(m["micro"], []).append(m["is_replay"])
        for parts in by_micro.values():
            assert parts[0] == [False, False]
            assert all(p and all(p) and len(p) <= 2 for p in parts[1:])
    # num_items_in_batch = loss tokens of both ranks' rows of the generation (2 micro-steps), replay included
    gens = {}
    for r in (r0, r1):
        for m in r["micro"]:
            gens.setdefault(m["micro"] // 2, []).append(m)
    for parts in gens.values():
        assert all(m["nib"] == sum(x["mask_sum"] for x in parts) for m in parts)


def test_groups_are_never_replayed_in_their_birth_step_and_ratios_move(runs):
    (r0, _), _ = runs
    for s in r0["selections"]:
        assert all(b < s["step"] for b in s["births"])
    devs = [m["replay_ratio_dev"] for m in r0["micro"] if m["replay_ratio_dev"] is not None]
    assert devs and max(devs) > 1e-3


def test_sliced_prompt_shared_rescoring_makes_the_same_forward_calls_on_every_rank(runs, dist_root, tmp_path):
    """Exact early rejection forwards response slices of different sizes: both re-scoring paths still run the same
    number of model forward calls on both ranks (a ZeRO-3 / FSDP forward gathers parameters: a rank running one
    call more would hang), and the ranks agree on every decision."""
    (f0, _), _ = runs
    assert any(x for x in f0["early_rejected"] if x)  # the chunked run above rejected groups early
    torchrun(tmp_path / "shared", dist_root / "model", 4, env_extra={"HDR_TEST_SHARE": "1"})
    r0, r1 = [json.loads((tmp_path / "shared" / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert r0["shared_calls"] > 0 and r0["shared_calls"] == r1["shared_calls"]
    assert r0["forward_calls"] == r1["forward_calls"] > 0
    assert r0["selections"] == r1["selections"] and r0["buffer_hashes"] == r1["buffer_hashes"]


def test_resume_on_two_processes_equals_the_uninterrupted_run(runs):
    (f0, f1), (s0, s1) = runs
    assert s0["selections"] == f0["selections"][2:] == s1["selections"]
    assert s0["buffer_hashes"] == f0["buffer_hashes"][2:] == s1["buffer_hashes"]


@pytest.mark.multimodal
def test_a_vlm_on_two_processes_holds_the_same_image_groups_on_every_rank(tmp_path):
    """A tiny Qwen2-VL on the geo task's images: groups span both ranks, their images are gathered (TRL's flat
    pixel tensors differ per rank), and both ranks store and replay the same groups, images included."""
    from hdreplay_lab.sandbox.geo import GeoTask
    from hdreplay_lab.sandbox.vlm import build_tiny_vlm

    build_tiny_vlm(tmp_path / "vlm", arch="qwen2vl", chars=GeoTask().vocab, hidden=32)
    torchrun(tmp_path / "run", tmp_path / "vlm", 4)
    r0, r1 = [json.loads((tmp_path / "run" / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert r0["world"] == r1["world"] == 2
    assert len(r0["buffer_hashes"]) == 4 and r0["buffer_hashes"] == r1["buffer_hashes"]
    assert r0["selections"] == r1["selections"] and sum(len(s["groups"]) for s in r0["selections"]) > 0
    assert r0["forward_calls"] == r1["forward_calls"]
    replayed = [m for r in (r0, r1) for m in r["micro"] if any(m["is_replay"])]
    assert replayed and all(m["images"] == [1] * len(m["is_replay"]) for m in replayed)


def test_ranks_that_select_differently_stop_with_the_step_and_both_digests_instead_of_hanging(runs, dist_root,
                                                                                               tmp_path):
    """Rank 1 drops a group from its first non-empty selection (an injected divergence): both ranks stop at that
    step with RankMismatchError naming it and both digests, well within the timeout (a hang would hit it)."""
    p = torchrun(tmp_path / "out", dist_root / "model", 6, env_extra={"HDR_DIVERGE_RANK1": "1"}, timeout=240, ok=False)
    assert p.returncode != 0
    errors = [(tmp_path / "out" / f"rank{r}_error.txt").read_text() for r in (0, 1)]
    assert errors[0] == errors[1], errors  # the same verdict on every rank
    m = re.match(r"RankMismatchError: .* at step (\d+) \(rank 0: ([0-9a-f]{16}), rank 1: ([0-9a-f]{16})\)", errors[0])
    assert m and m.group(2) != m.group(3), errors[0]
    (r0, _), _ = runs
    first = next(s["step"] for s in r0["selections"] if s["groups"])
    assert int(m.group(1)) == first  # the first step whose selection rank 1 changed
