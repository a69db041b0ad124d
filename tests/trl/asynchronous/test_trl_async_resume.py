"""HDRAsyncGRPOTrainer checkpoints: the replay state (buffer, staleness floor, ledger, routing) is saved with TRL's
checkpoint crash-safely, and a run interrupted after its checkpoint and resumed equals the uninterrupted run.

TRL's own rollout worker cannot be resumed (what it had queued and in flight is lost; hdreplay.integrations.trl.
async_resume), so these runs use the lock-step worker of tests/support/async_grpo_lockstep.py: the same CPU sampling
as the other async tests, generating on the trainer's thread at each new policy version, its state saved beside each
checkpoint.  With it the whole stream is a function of the weights, and the comparison is exact: every routing and
selection, the buffer, the ledger, the diagnostics files, the losses and the final weights.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from paths import SUPPORT
from protocol import log_lines

pytest.importorskip("trl")
pytestmark = [pytest.mark.trl, pytest.mark.filterwarnings("ignore:hdreplay async:UserWarning")]

# two slow groups per version, 2 versions late: diverted from update 3 on.  replay_k_rep=3: 12 replay samples, 8 fit
# after TRL's prefetched micro-batch, so replay also lands in the prefetch (which the checkpoint after update 5 holds)
KW = dict(max_steps=7, save_strategy="steps", save_steps=5, replay_k_rep=3, replay_capacity=16,
          worker_kw={"slow_per_version": 2, "slow_lag": 2})
CUT = 5


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from hdreplay_lab.sandbox.model import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("async_resume") / "model", hidden=32, layers=2)


def train(out, model_dir, *, stop=None, resume=None, worker_state=None, **over):
    from async_grpo_lockstep import LockstepWorker, SaveWorker, StopAt
    from async_grpo_run import make_trainer

    kw = {**KW, **over}
    tr, worker = make_trainer(out, model_dir, worker_cls=LockstepWorker, worker_state=worker_state, **kw)
    tr.add_callback(SaveWorker(worker))
    if stop is not None:
        tr.add_callback(StopAt(stop))
    tr.train(resume_from_checkpoint=resume)
    return tr


@pytest.fixture(scope="module")
def runs(model_dir, tmp_path_factory):
    from async_grpo_lockstep import load_worker_state

    root = tmp_path_factory.mktemp("runs")
    whole = train(root / "whole", model_dir)
    first = train(root / "cut", model_dir, stop=CUT)
    resumed = train(root / "cut", model_dir, resume=True,
                    worker_state=load_worker_state(root / "cut" / f"checkpoint-{CUT}"))
    return whole, first, resumed, root


def _log(tr):
    return [{**{k: r[k] for k in ("step", "routed", "selected", "delays", "landed")},
             "metrics": {k: v for k, v in r["metrics"].items() if v == v}} for r in tr.replay_log]  # NaN: undefined


def _losses(tr):
    return [(h["step"], h["loss"]) for h in tr.state.log_history if "loss" in h]


def test_interrupted_and_resumed_run_equals_the_uninterrupted_one(runs):
    whole, first, resumed, root = runs
    assert ([r["step"] for r in first.replay_log] == [1, 2, 3, 4, 5]
            and [r["step"] for r in resumed.replay_log] == [6, 7])
    assert _log(first) == _log(whole)[:CUT]  # the lock-step stream is deterministic
    assert len(whole.replay_log[CUT - 1]["selected"]) == 3  # update 6's replay, selected before the checkpoint ...
    assert resumed.resume_selection == whole.replay_log[CUT - 1]["selected"]  # ... and re-made by the resumed run
    assert _log(resumed) == _log(whole)[CUT:]  # routing, selections, landings, replay/* and async/* metrics
    assert sum(route == "divert" for r in whole.replay_log[:CUT] for _, route, _ in r["routed"]) >= 4
    replayed = [kind for r in whole.replay_log[CUT:] for marks in r["landed"].values() for kind, _ in marks]
    assert replayed.count("replay") >= 16  # replay trained after the resume
    assert _losses(resumed) == _losses(whole)
    ta, ma = whole.areplay.controller.state_dict(allow_open_step=True)
    tb, mb = resumed.areplay.controller.state_dict(allow_open_step=True)
    assert ma == mb and ta.keys() == tb.keys() and all(torch.equal(ta[k], tb[k]) for k in ta)  # buffer + staleness
    assert whole.areplay.ledger.totals == resumed.areplay.ledger.totals
    assert (whole.areplay.floor.estimate, whole.areplay.floor.groups) == (resumed.areplay.floor.estimate,
                                                                           resumed.areplay.floor.groups)
    wa, wb = whole.model.state_dict(), resumed.model.state_dict()
    assert all(torch.equal(wa[k], wb[k]) for k in wa)
    for name in ("steps.jsonl", "async.jsonl", "groups.jsonl"):  # rewound to the checkpoint, then continued
        assert log_lines(root / "whole" / "hdreplay" / name) == log_lines(root / "cut" / "hdreplay" / name), name


def test_checkpoint_holds_the_replay_state_as_of_the_update(runs):
    from hdreplay import ReplayController
    from hdreplay.integrations.trl.checkpoints import checkpoint_problem

    whole, first, _, root = runs
    ckpt = root / "cut" / f"checkpoint-{CUT}"
    assert checkpoint_problem(ckpt, replay=True) is None
    assert ReplayController.verify(ckpt / "hdreplay") == CUT - 1  # committed through update 5 (controller step 4)
    state = json.loads((ckpt / "hdreplay" / json.loads((ckpt / "hdreplay" / "manifest.json").read_text())["dir"]
                        / "state.json").read_text())["meta"]["observers"]["staleness"]
    assert state["step"] == CUT - 1 and state["totals"]["diverted_groups"] >= 4 and state["floor"]["groups"] > 0
    assert len(state["tracked"]) == state["totals"]["diverted_groups"] - state["totals"]["evicted_unused_groups"]
    routing = state["routing"]
    assert routing["step"] == CUT and len(routing["sent"]) == 8  # TRL's prefetched micro-batch of update 6
    spill = 4 * len(whole.replay_log[CUT - 2]["selected"]) - 8  # update 5's replay beyond its second micro-batch
    assert spill > 0 and [kind for kind, _, _ in routing["sent"]].count("replay") == spill
    assert routing["selected"] == whole.replay_log[CUT - 1]["selected"]


def test_resume_without_replay_state_is_refused_unless_allowed(runs, model_dir, tmp_path):
    from async_grpo_lockstep import load_worker_state
    from hdreplay import CheckpointError

    *_, root = runs
    ckpt = tmp_path / f"checkpoint-{CUT}"
    shutil.copytree(root / "cut" / ckpt.name, ckpt)
    shutil.rmtree(ckpt / "hdreplay")
    with pytest.raises(CheckpointError, match=r"no hdreplay/ replay state.*set replay_resume_without_state=True"):
        train(tmp_path, model_dir, resume=str(ckpt), worker_state=load_worker_state(ckpt), max_steps=CUT + 1)
    with pytest.warns(UserWarning, match=r"resuming with an empty buffer \(replay_resume_without_state=True\)"):
        tr = train(tmp_path, model_dir, resume=str(ckpt), worker_state=load_worker_state(ckpt), max_steps=CUT + 1,
                   replay_resume_without_state=True)
    assert tr.state.global_step == CUT + 1 and tr.areplay.controller.last_step == CUT
    marks = [st for r in tr.replay_log for ms in r["landed"].values() for _, st in ms]
    # without a routing state the landings still count from TRL's step (+ 1: the prefetch for the next update)
    assert marks and min(marks) == CUT + 1 and max(marks) <= CUT + 2


def test_a_worker_that_restarts_its_group_ids_gets_new_ids_after_the_resume(runs, model_dir, tmp_path):
    """TRL's own rollout worker restarts its group ids at 0 in a resumed process and loses what it had queued: the
    resumed run renumbers its groups past every id the restored state holds instead of colliding with them (a
    duplicate in the buffer, two groups merged)."""
    from async_grpo_lockstep import load_worker_state

    whole, *_, root = runs
    ckpt = tmp_path / f"checkpoint-{CUT}"
    shutil.copytree(root / "cut" / ckpt.name, ckpt)
    ws = load_worker_state(ckpt)
    ws["next"], ws["queue"], ws["pending"] = (0, ws["next"][1]), [], []  # ids from 0 again, its queue lost
    known = {gid for r in whole.replay_log[:CUT] for gid, _, _ in r["routed"]}
    tr = train(tmp_path, model_dir, resume=str(ckpt), worker_state=ws)
    assert tr.state.global_step == KW["max_steps"]
    new = [gid for r in tr.replay_log for gid, _, _ in r["routed"]]
    assert new and len(set(new)) == len(new) and min(new) > max(known)
    buffered = tr.areplay.controller.buffer
    ids = buffered.group_ids(buffered.insertion_ids())
    assert len(set(ids)) == len(ids)


def test_a_crash_while_saving_the_replay_state_leaves_the_previous_checkpoint(model_dir, tmp_path, monkeypatch):
    from hdreplay import ReplayController
    from hdreplay.integrations.trl.checkpoints import PENDING, resume_target

    save = ReplayController.save

    def crash(self, directory, **kw):
        if Path(directory).parent.name == "checkpoint-2":
            raise KeyboardInterrupt("killed while writing the replay state")
        return save(self, directory, **kw)

    monkeypatch.setattr(ReplayController, "save", crash)
    with pytest.raises(KeyboardInterrupt):
        train(tmp_path, model_dir, max_steps=2, save_steps=1, save_total_limit=1)
    new, old = tmp_path / "checkpoint-2", tmp_path / "checkpoint-1"
    assert (new / PENDING).exists() and (new / "trainer_state.json").exists()
    assert (old / "hdreplay").is_dir() and not (old / PENDING).exists()  # the rotation waited for checkpoint-2
    with pytest.warns(UserWarning, match="skipping an incomplete checkpoint: .*checkpoint-2"):
        assert resume_target(tmp_path) == old


def _areplay(tr):
    """A fresh AsyncReplay set up as ``tr``'s (no diagnostics files), parsing the routing state as ``tr`` does."""
    from functools import partial

    from hdreplay import ReplayController
    from hdreplay.integrations.trl.asynchronous.resume import parse_routing
    from hdreplay.staleness import AsyncReplay

    ar = AsyncReplay(ReplayController(tr.args.to_replay_config()), tr.args.to_staleness_config(),
                     resume_option="replay_resume_without_state")
    ar.routing_parser = partial(parse_routing, samples_per_step=tr.samples_per_step)
    return ar


def _snapshot(ar):
    routing, ar.routing = ar.routing, None  # (parsed: it holds RolloutSamples)
    try:
        t, meta = ar.controller.state_dict(allow_open_step=True)
    finally:
        ar.routing = routing
    return {k: v.clone() for k, v in t.items()}, json.loads(json.dumps(meta)), routing


def _same(a, b):
    return a[1] == b[1] and a[0].keys() == b[0].keys() and all(torch.equal(a[0][k], b[0][k]) for k in a[0]) \
        and (a[2] is None) == (b[2] is None)


def _break_routing(r, how):
    if how == "batch":  # written with other batch settings
        r["samples_per_step"] += 1
    elif how == "count":  # the prefetched samples do not end the checkpoint's update
        r["sent"].pop()
    elif how == "kind":
        r["sent"][0][0] = "stale"
    elif how == "dtype":
        r["sent"][0][2]["input_ids"][0] = "float16"
    elif how == "lengths":
        r["sent"][0][2]["old_log_probs"][1].pop()
    elif how == "number":
        r["sent"][0][2]["advantage"] = "high"
    elif how == "field":
        r["sent"][0][2]["extra"] = 1
    elif how == "format":
        r["format"] = 99
    elif how == "kind_of":
        r["kind_of"].append(["g", "fresh", "three"])
    elif how == "type":
        r.clear()
        r["sent"] = "all of them"


@pytest.mark.parametrize("how", ["batch", "count", "kind", "dtype", "lengths", "number", "field", "format", "kind_of",
                                 "type"])
def test_malformed_routing_state_is_refused_and_changes_nothing(runs, tmp_path, how):
    """A routing state that parses as JSON and passes the checksums but is malformed: a CheckpointError naming the
    routing state; the controller (buffer, staleness state) and the routing stay as they were."""
    from hdreplay import CheckpointError

    whole, _, _, root = runs
    good = root / "cut" / f"checkpoint-{CUT}" / "hdreplay"
    writer = _areplay(whole)
    writer.controller.load(good)
    assert writer.routing is not None and len(writer.controller.buffer) > 0
    bad = _raw_routing(good)
    _break_routing(bad, how)
    writer.routing = bad
    writer.controller.save(tmp_path / "bad", allow_open_step=True)  # intact files, malformed content

    reader = _areplay(whole)
    reader.controller.load(good)
    before = _snapshot(reader)
    with pytest.raises(CheckpointError, match="staleness state: routing: "):
        reader.controller.load(tmp_path / "bad")
    assert _snapshot(reader)[2] is before[2] and _same(_snapshot(reader), before)
    reader.controller.load(good)  # the good checkpoint still loads
    assert _same(_snapshot(reader), before)


def _raw_meta(ckpt):
    manifest = json.loads((ckpt / "manifest.json").read_text())
    return json.loads((ckpt / manifest["dir"] / "state.json").read_text())["meta"]


def _raw_routing(ckpt):
    return _raw_meta(ckpt)["observers"]["staleness"]["routing"]


def test_malformed_routing_state_refuses_the_resume(runs, model_dir, tmp_path):
    """Through ``train(resume_from_checkpoint=...)``: refused before the first update, naming what is wrong."""
    from async_grpo_lockstep import load_worker_state
    from hdreplay import CheckpointError

    whole, _, _, root = runs
    src = root / "cut" / f"checkpoint-{CUT}"
    ckpt = tmp_path / src.name
    shutil.copytree(src, ckpt)
    ar = _areplay(whole)
    ar.controller.load(ckpt / "hdreplay")
    bad = _raw_routing(ckpt / "hdreplay")
    _break_routing(bad, "batch")
    ar.routing = bad
    ar.controller.save(ckpt / "hdreplay", allow_open_step=True, identity=_raw_meta(ckpt / "hdreplay")["identity"])
    with pytest.raises(CheckpointError, match=r"routing: it was written with 17 samples per optimizer step, this run "
                                              r"takes 16"):
        train(tmp_path, model_dir, resume=str(ckpt), worker_state=load_worker_state(ckpt), max_steps=CUT + 1)


def test_replay_state_without_the_staleness_state_is_refused_naming_the_option(runs, model_dir, tmp_path):
    """checkpoint-N/hdreplay holds the buffer but not the staleness state (the synchronous trainer's, or an older
    hdreplay's): refused naming replay_resume_without_state, before anything trains."""
    from async_grpo_lockstep import load_worker_state
    from hdreplay import CheckpointError
    from hdreplay.checkpoint.files import open_checkpoint_dir, write_checkpoint_dir
    from hdreplay.controller import CONTROLLER_FORMAT, CONTROLLER_VERSION, CONTROLLER_VERSIONS

    *_, root = runs
    ckpt = tmp_path / f"checkpoint-{CUT}"
    shutil.copytree(root / "cut" / ckpt.name, ckpt)
    with open_checkpoint_dir(ckpt / "hdreplay", format_name=CONTROLLER_FORMAT, versions=CONTROLLER_VERSIONS) as (t, m):
        tensors, meta = {k: v.read().clone() for k, v in t.items()}, json.loads(json.dumps(m))
    del meta["observers"]["staleness"]
    write_checkpoint_dir(ckpt / "hdreplay", format_name=CONTROLLER_FORMAT, version=CONTROLLER_VERSION,
                         tensors=tensors, meta=meta)
    with pytest.raises(CheckpointError, match=r"no staleness state.*set replay_resume_without_state=True"):
        train(tmp_path, model_dir, resume=str(ckpt), worker_state=load_worker_state(ckpt), max_steps=CUT + 1)


def _torchrun(*args, timeout=300):
    import os
    import socket
    import subprocess
    import sys

    with socket.socket() as sk:
        sk.bind(("127.0.0.1", 0))
        port = sk.getsockname()[1]
    env = dict(os.environ, HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1", TRL_EXPERIMENTAL_SILENCE="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc_per_node", "2", "--master_addr",
           "127.0.0.1", "--master_port", str(port), str(SUPPORT / "async_grpo_run.py"), *map(str, args)]
    p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-6000:]


@pytest.mark.multiprocess
def test_two_processes_interrupted_and_resumed_equal_the_uninterrupted_run(model_dir, tmp_path):
    """The same comparison on 2 processes (each rank holds a replica of the controller; rank 0 routes)."""
    from async_grpo_lockstep import load_worker_state

    # --main-saves-first: the other rank's on_save runs after rank 0 wrote the worker's state (issue 43: a second
    # writer of that file, last one in, made the resume another run one time in three to six; now forced every time)
    common = [7, "--lockstep", "--save-steps", CUT, "--main-saves-first"]
    _torchrun(tmp_path / "whole", model_dir, *common)
    _torchrun(tmp_path / "cut", model_dir, *common, "--stop", CUT, "--tag", ".first")
    first0, first1 = (json.loads((tmp_path / "cut" / f"rank{r}.first.json").read_text()) for r in (0, 1))
    saved = load_worker_state(tmp_path / "cut" / f"checkpoint-{CUT}")
    assert saved["version"] == CUT + 1 and saved["log"] == first0["worker_log"], \
        (f"checkpoint-{CUT}'s worker state is not rank 0's worker "
         f"(version {saved['version']}, {len(saved['log'])} groups)")
    assert first1["worker_log"] is None  # only rank 0 holds a rollout worker (TRL hands the others None)
    _torchrun(tmp_path / "cut", model_dir, *common, "--resume", "--tag", ".resumed")
    for rank in (0, 1):
        whole, first, resumed = (json.loads((tmp_path / d / f"rank{rank}{t}.json").read_text())
                                 for d, t in (("whole", ""), ("cut", ".first"), ("cut", ".resumed")))
        assert whole["world"] == resumed["world"] == 2
        assert ([s["step"] for s in first["steps"]] == [1, 2, 3, 4, 5]
                and [s["step"] for s in resumed["steps"]] == [6, 7])
        assert first["steps"] == whole["steps"][:CUT]  # the lock-step stream is deterministic on 2 processes too
        assert (resumed["resume_selection"] == whole["steps"][CUT - 1]["selected"]
                and whole["steps"][CUT - 1]["selected"])
        assert resumed["steps"] == whole["steps"][CUT:]  # routing, selections, landings, replay/* and async/* metrics
        assert resumed["totals"] == whole["totals"] and resumed["buffer_digest"] == whole["buffer_digest"]
        losses = [[(h["step"], h["loss"]) for h in r["log_history"] if "loss" in h] for r in (whole, resumed)]
        assert losses[0] == losses[1] and len(losses[0]) == 7
        assert resumed["weights_digest"] == whole["weights_digest"]
    replayed = [k for s in whole["steps"][CUT:] for marks in s["landed"].values() for k, _ in marks]
    assert replayed.count("replay") > 0  # replay trained after the resume
    assert sum(route == "divert" for s in whole["steps"][:CUT] for _, route, _ in s["routed"]) >= 4
