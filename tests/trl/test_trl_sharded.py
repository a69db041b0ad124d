"""Replay chunks under DeepSpeed ZeRO-2, ZeRO-3 and FSDP2 on 2 CPU processes (torchrun, gloo), through train().

One run per backend (tests/support/dist_trl_sharded.py: 4 updates, then a resume from checkpoint-2 in the same
processes) against one single-process run of the same data (deterministic completions through TRL's
``rollout_func``): every micro-step's loss equals a hand recomputation from the stored generation log-probs, the
stored advantages and the current log-probs; the optimizer steps once per update and gradients are reduced only
at the update's last backward; the gate decides exactly as on one process; the resumed run equals the
uninterrupted one.  FSDP2 on CPU: accelerate's state is set to FSDP after the Trainer builds its Accelerator
(accelerate 1.15 never selects FSDP without an accelerator device); everything after is accelerate's and torch's.
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import socket
import subprocess
import sys

import pytest

from paths import SUPPORT

pytest.importorskip("trl")
pytestmark = [pytest.mark.trl, pytest.mark.multiprocess]
if importlib.util.find_spec("deepspeed") is None:  # (not imported here: only the torchrun workers use it)
    pytest.skip("deepspeed is not installed (pip install -e '.[dev]')", allow_module_level=True)

HERE = SUPPORT
BACKENDS = ("zero2", "zero3", "fsdp2")
EPS = 0.2  # TRL's default epsilon (low and high)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def torchrun(out, model_dir, backend, timeout=420):
    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_HUB_DISABLE_TELEMETRY="1", OMP_NUM_THREADS="1",
               DS_ACCELERATOR="cpu", TRL_EXPERIMENTAL_SILENCE="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc_per_node", "2",
           "--master_addr", "127.0.0.1", "--master_port", str(free_port()),
           str(HERE / "dist_trl_sharded.py"), str(out), str(model_dir), backend]
    p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-6000:]
    return [json.loads((out / f"rank{r}.json").read_text()) for r in (0, 1)]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from hdreplay_lab.sandbox.model import build_tiny_model

    root = tmp_path_factory.mktemp("sharded_model")
    build_tiny_model(root / "model")
    return root / "model"


@pytest.fixture(scope="module")
def single(model_dir, tmp_path_factory, monkeypatch_module):
    import dist_trl_sharded as D

    monkeypatch_module.setenv("TRL_EXPERIMENTAL_SILENCE", "1")
    return D.record(D.train(str(tmp_path_factory.mktemp("one")), str(model_dir), "one"))


@pytest.fixture(scope="module")
def monkeypatch_module():
    mp = pytest.MonkeyPatch()
    yield mp
    mp.undo()


@pytest.fixture(scope="module", params=BACKENDS)
def sharded(request, model_dir, tmp_path_factory):
    return request.param, torchrun(tmp_path_factory.mktemp(request.param), model_dir, request.param)


def hand_loss(parts: list[dict], *, world: int, ga: int = 2, spg: int = 2) -> float:
    """dapo (TRL's default) on the micro-step's parts: sum over their loss tokens of -min(r A, clip(r) A) over the
    generation's loss tokens / W x GA / spg, r = exp(current - generation log-prob) (1 for fresh rows: TRL uses
    their current log-probs as the old ones)."""
    total = 0.0
    for p in parts:
        norm = p["nib"] / world * ga / spg
        for now, old, adv, mask in zip(p["now"], p["old"] or p["now"], p["advantages"], p["mask"]):
            for x, o, m in zip(now, old, mask):
                if m:
                    r = math.exp(x - o)
                    total += -min(r * adv, min(max(r, 1 - EPS), 1 + EPS) * adv) / norm
    return total


def by_micro(rec: dict) -> dict:
    out = {}
    for p in rec["parts"]:
        out.setdefault((p["global_step"], p["micro"]), []).append(p)
    return out


def test_every_micro_step_loss_equals_the_hand_recomputation(sharded):
    backend, ranks = sharded
    for rank in ranks:
        rec = rank["full"]
        assert rec["world"] == 2 and rec["distributed_type"] == ("DistributedType.FSDP" if backend == "fsdp2"
                                                                else "DistributedType.DEEPSPEED")
        parts = by_micro(rec)
        assert len(rec["micro_losses"]) == len(parts) == 8
        assert sum(any(x) for p in rec["parts"] for x in [p["is_replay"]]) >= 4  # replay chunks were trained
        for m in rec["micro_losses"]:
            assert m["loss"] == pytest.approx(hand_loss(parts[(m["global_step"], m["micro"])], world=2),
                                              rel=1e-5, abs=1e-6), (backend, m)


def test_replay_rows_carry_the_stored_log_probs_and_advantages(sharded):
    """Rank r trains rows [r R/W, (r + 1) R/W) of the step's replayed groups, in order, spread over its
    micro-steps: their ratio denominators and advantages are the buffer's, bit for bit."""
    backend, ranks = sharded
    for r, rank in enumerate(ranks):
        rec = rank["full"]
        for s in rec["selections"]:
            if not s["groups"]:
                continue
            stored = []
            for logps, lengths, adv in zip(s["stored_logps"], s["lengths"], s["advantages"]):
                start = 0
                for n, a in zip(lengths, adv):
                    stored.append((logps[start:start + n], a))
                    start += n
            per = len(stored) // 2
            mine = stored[r * per:(r + 1) * per]
            trained = [(old, adv) for p in rec["parts"] if p["global_step"] == s["step"]
                       for old, adv, rep in zip(p["old"] or [], p["advantages"], p["is_replay"]) if rep]
            assert len(trained) == len(mine) > 0
            for (old, adv), (logps, a) in zip(trained, mine):
                assert old[:len(logps)] == logps and adv == a


def test_one_optimizer_step_and_one_gradient_reduction_per_update(sharded):
    """Every part of a micro-step but the update's very last backward runs with sync_gradients off: DeepSpeed's
    boundary flag is False and its optimizer has not stepped; FSDP2's reduce flag is off (the Trainer's outer
    no_sync of a non-final micro-step stays in force through its replay chunks)."""
    backend, ranks = sharded
    for rank in ranks:
        syncs = rank["full"]["syncs"]
        for step in range(4):
            events = [e for e in syncs if e["global_step"] == step]
            assert len(events) >= 2 and [e["sync"] for e in events] == [False] * (len(events) - 1) + [True]
            if backend == "fsdp2":
                assert [e["reduce"] for e in events] == [False] * (len(events) - 1) + [True], events
            else:
                assert [e["boundary"] for e in events] == [False] * (len(events) - 1) + [True], events
                assert [e["optimizer_steps"] for e in events] == [step] * (len(events) - 1) + [step + 1], events
        assert sum(len([e for e in syncs if e["global_step"] == s]) > 2 for s in range(4)) >= 2  # replay parts


def test_gate_decisions_equal_the_single_process_run(sharded, single):
    """Same rows, same weights up to float round-off: the same groups scanned, the same Drift (1e-4 relative), the
    same gate decisions and replayed groups as one process training 4 rows per micro-step."""
    backend, ranks = sharded
    assert single["world"] == 1
    for rank in ranks:
        rec = rank["full"]
        assert len(rec["selections"]) == len(single["selections"]) == 4
        for a, b in zip(rec["selections"], single["selections"]):
            assert (a["step"], a["scanned"], a["passed"], a["groups"]) == (b["step"], b["scanned"], b["passed"],
                                                                          b["groups"])
            assert a["drift"] == pytest.approx(b["drift"], rel=1e-4), (backend, a["step"])
        assert any(any(s["passed"]) for s in rec["selections"]) and any(
            not all(s["passed"]) for s in rec["selections"] if s["passed"])  # the gate both passed and rejected


def test_resume_on_two_processes_equals_the_uninterrupted_run(sharded):
    backend, (r0, r1) = sharded
    for rank in (r0, r1):
        full, resumed = rank["full"], rank["resumed"]
        assert resumed["buffer_hashes"] == full["buffer_hashes"][2:], backend
        assert resumed["selections"] == full["selections"][2:], backend
        losses = lambda rec: [(m["global_step"], m["loss"]) for m in rec["micro_losses"]]  # noqa: E731
        assert losses(resumed) == [x for x in losses(full) if x[0] >= 2]  # (TRL's micro-step counter restarts)
    assert r0["full"]["buffer_hashes"] == r1["full"]["buffer_hashes"]  # every rank holds the same buffer


def test_rescoring_runs_one_forward_per_score_batch_not_per_group(sharded, single):
    """Each scan call (whole groups or response slices of them, exact early rejection) shards its rows over the
    ranks, ceil(R / W) rows each, and runs one forward per replay_score_batch_size (8) rows: under ZeRO-3 and FSDP2
    one parameter gathering per forward call, with rows of several groups in one call.  Where parameters are
    replicated (ZeRO-2, one process) the prompt-shared path may encode each group's prompt once instead; it is
    chosen per call from all ranks' groups, so every rank takes the same path (the gate decided the same either
    way: test above)."""
    backend, ranks = sharded
    W = 2
    calls = [tuple(c) for c in ranks[0]["full"]["scan_forwards"]]
    other = [tuple(c) for c in ranks[1]["full"]["scan_forwards"]]
    assert calls and [c[1:] for c in calls] == [c[1:] for c in other]  # the same forward calls, path, rows on each rank
    # the prompt-shared path is available where parameters are replicated (ZeRO-2, one process), off under ZeRO-3 /
    # FSDP2; whether a call takes it is share_pays' token-ratio rule (these short prompts: never)
    assert all(r["full"]["share_prompt"] == (backend == "zero2") for r in ranks) and single["share_prompt"]
    assert not any(share for _, _, share, _ in calls)
    assert all(forwards == -(-(-(-rows // W)) // 8) for _, forwards, _, rows in calls)
    assert any(spanned > forwards for spanned, forwards, _, _ in calls), calls  # groups batched in one forward


def test_a_deepspeed_config_disagreeing_with_trls_accumulation_is_refused_at_construction(sharded):
    backend, ranks = sharded
    for rank in ranks:
        msg = rank["refusal"]
        if backend == "fsdp2":
            assert msg is None
            continue
        assert msg is not None and "gradient_accumulation_steps=4" in msg and "gradient_accumulation_steps=2" in msg
        assert '"auto"' in msg


def test_fsdp1_is_refused_naming_the_version():
    """accelerate cannot build an FSDP1 plugin without a device, so the check reads a plugin's settings here."""
    from types import SimpleNamespace

    from hdreplay.integrations.trl.checks import check_sharding

    args = SimpleNamespace(gradient_accumulation_steps=2, per_device_train_batch_size=2)
    acc = lambda **state: SimpleNamespace(state=SimpleNamespace(**state))  # noqa: E731
    with pytest.raises(ValueError, match="FSDP2 only.*'version': 2"):
        check_sharding(args, acc(fsdp_plugin=SimpleNamespace(fsdp_version=1)))
    check_sharding(args, acc(fsdp_plugin=SimpleNamespace(fsdp_version=2)))
    ds = lambda **conf: SimpleNamespace(deepspeed_config=conf)  # noqa: E731
    check_sharding(args, acc(deepspeed_plugin=ds(gradient_accumulation_steps="auto", train_micro_batch_size_per_gpu=2)))
    with pytest.raises(ValueError, match="train_micro_batch_size_per_gpu=4 but per_device_train_batch_size=2"):
        check_sharding(args, acc(deepspeed_plugin=ds(train_micro_batch_size_per_gpu=4)))


def test_grow_runs_under_every_backend_and_decides_as_chunk(sharded):
    """replay_micro_step="grow" (one merged pass per micro-step) under the same backend and data: its losses are
    the hand recomputation's too, and its gate decisions those of chunk mode (both are the merged batch's)."""
    backend, ranks = sharded
    for rank in ranks:
        grow, chunk = rank["grow"], rank["full"]
        parts = by_micro(grow)
        assert len(grow["micro_losses"]) == 6 and all(len(p) == 1 for p in parts.values())
        for m in grow["micro_losses"]:
            assert m["loss"] == pytest.approx(hand_loss(parts[(m["global_step"], m["micro"])], world=2),
                                              rel=1e-5, abs=1e-6), (backend, m)
        for a, b in zip(grow["selections"], chunk["selections"][:3]):
            assert (a["scanned"], a["passed"], a["groups"]) == (b["scanned"], b["passed"], b["groups"])
            assert a["drift"] == pytest.approx(b["drift"], rel=1e-4)
