"""HDRAsyncGRPOTrainer (TRL 1.16 async GRPO + Drift-gated staleness) through trainer.train() on CPU.

Stand-ins (tests/support/async_grpo_cpu.py): the flash-attention varlen call, the peak-FLOPs query, the vLLM
client; the rollout worker and the weight transfer come in through TRL's public ``rollout_worker=`` /
``weight_transfer=``.  The worker releases one slow group per version 3 versions late, so with max_staleness=1
every slow group arrives stale.
"""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from paths import SUPPORT

pytest.importorskip("trl")
pytestmark = [pytest.mark.trl]

HERE = SUPPORT


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from hdreplay_lab.sandbox.model import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("async") / "model", hidden=32, layers=2)


@pytest.fixture(scope="module")
def run(model_dir, tmp_path_factory):
    """One 6-update run; every sample TRL's dataset pulled from the proxy is recorded."""
    from async_grpo_run import make_trainer, summary

    tr, worker = make_trainer(tmp_path_factory.mktemp("run1"), model_dir)
    pulled = []
    get = tr.rollout_queue.get

    def recording_get(timeout=None):
        s = get(timeout)
        pulled.append(s)
        return s

    tr.rollout_queue.get = recording_get
    tr.train()
    return summary(tr, worker), pulled, tr


def _routes(s):
    return [(gid, route, k, r["step"]) for r in s["steps"] for gid, route, k in r["routed"]]


def test_diverted_groups_train_later_with_their_sampler_logprobs(run):
    s, pulled, tr = run
    diverted = {gid: step for gid, route, k, step in _routes(s) if route == "divert"}
    assert diverted, "the slow groups must arrive beyond max_staleness"
    landed = {}
    for r in s["steps"]:
        for gid, marks in r["landed"].items():
            landed.setdefault(int(gid), []).extend(marks)
    trained_later = {g: [st for kind, st in landed.get(g, []) if kind == "replay"] for g in diverted}
    assert any(trained_later.values()), trained_later
    for g, steps in trained_later.items():
        assert all(st > diverted[g] for st in steps)  # never in the update that diverted it
    # what TRL trained for a replayed group is the worker's group: tokens, loss mask, sampler log-probs, advantage
    by_gid = {}
    for smp in pulled:
        by_gid.setdefault(smp.group_id, []).append(smp)
    for g in (g for g, st in trained_later.items() if st):
        def key(ids, m, lp, a):
            return tuple(ids), tuple(m), tuple(np.round(np.asarray(lp, dtype=np.float32), 6)), a

        got = [key(smp.input_ids.tolist(), smp.completion_mask.tolist(), smp.old_log_probs, smp.advantage)
               for smp in by_gid[g]]
        want = sorted(key(*x) for x in s["worker_samples"][str(g)])
        assert len(got) % len(want) == 0  # the whole group, once per replay
        for k in range(0, len(got), len(want)):
            assert sorted(got[k:k + len(want)]) == want
    # the loss itself saw them: per-sample Drift of replayed rows was logged in the update they landed in
    replay_steps = {st for steps in trained_later.values() for st in steps}
    logged = {h["step"] for h in s["log_history"] if "async/sample_drift_replay_mean" in h}
    assert replay_steps <= logged
    assert all(d == 0 for r in s["steps"] for d in r["delays"])  # GA = 2: replay lands in the update selected for


def test_nothing_the_rule_keeps_is_dropped(run):
    s, pulled, _ = run
    rewards = {g["group_id"]: g["rewards"] for g in s["worker_log"]}
    for gid, route, k, _ in _routes(s):
        mixed = len(set(rewards[gid])) > 1
        assert route == ("fresh" if k <= 1 else "divert" if mixed else "drop"), (gid, route, k, mixed)
    # TRL's own per-sample staleness drop never fired: the proxy handed it only fresh or admitted samples
    assert not any(h.get("sample/dropped_stale_total") for h in s["log_history"])
    # every sample of a group TRL received is the whole group: no half groups
    counts = {}
    for smp in pulled:
        counts[smp.group_id] = counts.get(smp.group_id, 0) + 1
    assert all(c % 4 == 0 for c in counts.values())  # whole groups of n = 4 only (a replayed group: once per replay)
    t = s["totals"]
    assert t["generated_groups"] == t["fresh_groups"] + t["diverted_groups"] + t["dropped_groups"]
    assert t["admitted_groups"] >= 1 and t["dropped_groups"] == sum(1 for _, r, _, _ in _routes(s) if r == "drop")


def test_ledger_and_floor_in_the_logged_metrics(run):
    s, _, tr = run
    hist = [h for h in s["log_history"] if "loss" in h]
    assert len(hist) == 6
    for key in ("async/generated_groups", "async/fresh_groups", "async/diverted_groups", "async/floor",
                "replay/buffer_size", "async/useful_group_share_cum"):
        assert all(key in h for h in hist), key
    floors = [h["async/floor"] for h in hist]
    assert floors[-1] > 0 and tr.areplay.floor.ready  # the bf16 sampler: a real, measured floor
    assert any("async/sample_drift_fresh0_mean" in h for h in hist)
    ledger = [json.loads(x) for x in open(Path(tr.args.output_dir) / "hdreplay" / "async.jsonl")]
    assert [r["step"] for r in ledger] == list(range(6))  # update at global step u is controller step u - 1
    assert sum(r["diverted_groups"] for r in ledger) == s["totals"]["diverted_groups"]


def test_worker_that_runs_dry_raises_instead_of_hanging(model_dir, tmp_path):
    import threading

    from async_grpo_run import make_trainer
    from hdreplay.integrations.trl.asynchronous.routing import RolloutSupplyError

    tr, worker = make_trainer(tmp_path, model_dir, worker_kw={"hold_version": 2, "slow_per_version": 0},
                              replay_supply_timeout_s=3.0, replay_supply_warn_s=1.0)
    raised = []

    def train():
        try:
            tr.train()
        except BaseException as e:  # noqa: BLE001
            raised.append(e)

    t = threading.Thread(target=train, daemon=True)  # a hang must fail the test, not stall the suite
    t.start()
    t.join(timeout=120)
    assert not t.is_alive(), "train() hung on a worker that ran dry"
    assert len(raised) == 1 and isinstance(raised[0], RolloutSupplyError), raised
    assert re.search(r"the current step still needs \d+ of its 16 samples", str(raised[0]))


def test_sampler_without_logprobs_is_refused(model_dir, tmp_path):
    import async_grpo_cpu as cpu
    from async_grpo_run import make_trainer
    from hdreplay.errors import ReplayInputError

    tr, worker = make_trainer(tmp_path, model_dir, worker_kw={"slow_per_version": 0})
    put = worker._put

    def no_logprobs(samples):
        for smp in samples:
            smp.old_log_probs = np.zeros_like(smp.old_log_probs)
        put(samples)

    worker._put = no_logprobs
    with pytest.raises(ReplayInputError, match=r"all \d+ completion log-probs are exactly 0"):
        tr.train()
    assert cpu  # the stand-ins are installed by async_grpo_run


@pytest.mark.parametrize("over,match", [
    ({"token_budget": None}, "token_budget=None"),
    ({"weight_sync_steps": 2}, "weight_sync_steps=2"),
    ({"replay_capacity": 2}, r"replay_capacity=2 cannot hold one update's groups \(4\)"),
    ({"max_inflight_tasks": 8}, r"can supply 2 groups \(max_inflight_tasks / num_generations\) but one update takes 4"),
    ({"replay_drift_norm": "l1", "replay_tau": 0.1}, "replay_drift_norm='l1'"),
    ({"per_device_train_batch_size": 5}, "10 samples per step is not a multiple of num_generations=4"),
])
def test_bad_config_refused_before_training(model_dir, tmp_path, over, match):
    from async_grpo_run import make_trainer
    from hdreplay.errors import ReplayConfigError

    with pytest.raises(ReplayConfigError, match=match):
        make_trainer(tmp_path, model_dir, **over)


def test_warnings_with_numbers(model_dir, tmp_path):
    from async_grpo_run import make_trainer

    with pytest.warns(UserWarning, match=r"replay_k_rep=3 groups = 12 samples, but .* only 8 of the step.s 16") as w:
        make_trainer(tmp_path, model_dir, replay_k_rep=3, gradient_accumulation_steps=2, per_device_train_batch_size=8,
                     replay_capacity=16, max_staleness=1)
    assert any("staleness_floor_initial=0" in str(x.message) for x in w)


def _free_port() -> int:
    with socket.socket() as sk:
        sk.bind(("127.0.0.1", 0))
        return sk.getsockname()[1]


@pytest.mark.multiprocess
def test_two_processes_agree_and_train_diverted_groups(model_dir, tmp_path):
    env = dict(os.environ, HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1", TRL_EXPERIMENTAL_SILENCE="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc_per_node", "2", "--master_addr",
           "127.0.0.1", "--master_port", str(_free_port()), str(HERE / "async_grpo_run.py"), str(tmp_path),
           str(model_dir), "6"]
    p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-6000:]
    r0, r1 = (json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1))
    assert r0["world"] == r1["world"] == 2
    # every rank applied the same routing to its replica of the controller and selected the same groups
    assert [x["selected"] for x in r0["steps"]] == [x["selected"] for x in r1["steps"]]
    assert [x["routed"] for x in r0["steps"]] == [x["routed"] for x in r1["steps"]]
    assert r0["buffer_digest"] == r1["buffer_digest"] and r0["totals"] == r1["totals"]
    diverted = {gid for x in r0["steps"] for gid, route, _ in x["routed"] if route == "divert"}
    replayed = {int(g) for x in r0["steps"] for g, marks in x["landed"].items() if any(k == "replay" for k, _ in marks)}
    assert diverted and replayed and replayed <= diverted
    assert not any(h.get("sample/dropped_stale_total") for h in r0["log_history"])
