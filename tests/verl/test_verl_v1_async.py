"""hdreplay's async sampler (HDRReplayBufferAsync) and bypass mode through verl's v1 colocate_async trainer on CPU.

Same harness as the other v1 tests (real v1 trainer, verl's ReplayBufferAsync subclassed through
``trainer.v1.sampler.custom_sampler``, TransferQueue, CPU worker group; stub agent loop and weight sync), with the
stub's rows sampled by a perturbed copy of the policy (tests/support/verl_async_sampler.py): real
``rollout_log_probs`` that differ from the trainer's.  ``max_off_policy_threshold=1``: verl's warm-up batch makes
the previous step's leftover prompts stale every step, so verl evicts them -- and the sampler diverts them.
"""

import json
from pathlib import Path

import numpy as np
import pytest

pytestmark = pytest.mark.verl
pytest.importorskip("verl", minversion="0.9.1")
pytest.importorskip("transfer_queue")

import torch  # noqa: E402

from hdreplay.errors import ReplayConfigError  # noqa: E402
from hdreplay.integrations.verl import HDRPPOTrainerColocateAsync  # noqa: E402
from hdreplay.integrations.verl.settings import validate_verl_config  # noqa: E402
from verl_async_sampler import PerturbedSampler  # noqa: E402
from verl_helpers import flat_every_4th  # noqa: E402
from verl_v1_harness import compose_v1_config, run_v1  # noqa: E402

ASYNC = ("trainer.v1.trainer_mode=colocate_async",
         "trainer.v1.sampler.custom_sampler.path=pkg://hdreplay.integrations.verl.v1_sampler",
         "trainer.v1.sampler.custom_sampler.name=HDRReplayBufferAsync",
         "trainer.v1.sampler.max_off_policy_threshold=1", "actor_rollout_ref.rollout.calculate_log_probs=true",
         "hdr.k_rep=8", "hdr.tau=10.0")  # k_rep >= the buffer: every diverted group is scanned and replayed
BYPASS = "algorithm.rollout_correction.bypass_mode=true"


def _run(worker_group, tokenizer, tiny_model_dir, tmp, *extra, steps=3):
    sampler = PerturbedSampler(tiny_model_dir, noise=0.05)
    run = run_v1(HDRPPOTrainerColocateAsync, worker_group, tokenizer, tiny_model_dir, tmp, *ASYNC, *extra,
                 lr=0.05, steps=steps, flat=flat_every_4th, trajectory=sampler)
    return run, sampler


@pytest.fixture(scope="module")
def decoupled(worker_group, transfer_queue, tokenizer, tiny_model_dir, tmp_path_factory):
    return _run(worker_group, tokenizer, tiny_model_dir, tmp_path_factory.mktemp("v1_async"))


@pytest.fixture(scope="module")
def bypass(worker_group, transfer_queue, tokenizer, tiny_model_dir, tmp_path_factory):
    return _run(worker_group, tokenizer, tiny_model_dir, tmp_path_factory.mktemp("v1_bypass"), BYPASS)


@pytest.fixture(scope="module")
def resumed(worker_group, transfer_queue, tokenizer, tiny_model_dir, tmp_path_factory):
    """4 updates with a checkpoint after update 2, then the same run resumed from it (verl restores TransferQueue and
    its dataloader; hdreplay the buffer and the staleness rule's state)."""
    ckpt = tmp_path_factory.mktemp("v1_async_resume")
    diag = f"hdr.diagnostics_dir={ckpt}/diagnostics"
    first, _ = _run(worker_group, tokenizer, tiny_model_dir, ckpt, diag, "trainer.save_freq=2", steps=4)
    ledger = (ckpt / "diagnostics" / "async.jsonl").read_text()
    again, _ = _run(worker_group, tokenizer, tiny_model_dir, ckpt, diag, "trainer.resume_mode=resume_path",
                    f"trainer.resume_from_path={ckpt}/global_step_2", steps=4)
    return first, ledger, again, ckpt


def _vanilla_loss(mb: dict, actor) -> float:
    """verl's vanilla PPO loss (dual clip, token-mean over the global mini-batch) recomputed from the rows."""
    lo = actor.clip_ratio_low if actor.clip_ratio_low is not None else actor.clip_ratio
    hi = actor.clip_ratio_high if actor.clip_ratio_high is not None else actor.clip_ratio
    total = 0.0
    for lp, old, adv, mask in zip(mb["lp"], mb["old"], mb["adv"], mb["mask"]):
        lp, old, a, m = (torch.tensor(x, dtype=torch.float64) for x in (lp, old, adv, mask))
        ratio = torch.exp(torch.clamp(lp - old, -20, 20))
        c1 = torch.maximum(-a * ratio, -a * torch.clamp(ratio, 1 - lo, 1 + hi))
        pg = torch.where(a < 0, torch.minimum(-a * actor.clip_ratio_c, c1), c1)
        total += float((pg * m).sum())
    return total / mb["batch_num_tokens"] * mb["dp_size"]


def _replayed_diverted_rows(run):
    """Per trained row of a replayed diverted group: (micro-batch record, row index, group, response indices whose
    tokens the row carries) -- rows are balanced over ranks and micro-batches, so they are matched by tokens."""
    out = []
    for i, step in enumerate(run.trainer.steps):
        groups = {str(g.group_id): g for g in step["selection"].groups if str(g.group_id).startswith("stale")}
        for rank in run.records:
            for mb in rank["history"][i]:
                for micro in mb.get("micro_terms", []):
                    for r, uid in enumerate(micro["uid"]):
                        if uid in groups:
                            g = groups[uid]
                            idx = [j for j, c in enumerate(g.responses()) if c.tolist() == micro["responses"][r]]
                            assert idx, "a replayed row carries a response its group does not have"
                            out.append((micro, r, g, idx))
    return out


@pytest.mark.parametrize("mode", ["decoupled", "bypass"])
def test_stale_groups_are_diverted_not_lost_and_train_later(mode, request):
    run, _ = request.getfixturevalue(mode)
    seam = run.trainer.async_seam
    t = seam.areplay.ledger.totals
    assert t["diverted_groups"] > 0 and t["admitted_groups"] > 0, t
    assert not seam.sampler.problems and not seam.sampler.diverted  # every group read was handed to the trainer
    assert seam.sampler.captured == t["diverted_groups"] + t["dropped_groups"]  # and reached the rule
    evicted = [v for m in run.trainer.logged for k, v in m.items() if k.endswith("off_policy/evicted_samples")]
    assert evicted and sum(evicted) > 0  # verl itself evicted stale groups (the ones read before their eviction)
    flat_dropped = [gid for gid in seam.areplay.tracked]  # tracked = diverted and still buffered
    assert all(str(g).startswith("stale") for g in flat_dropped)
    for step in run.trainer.steps:  # a diverted group is never replayed before an update since its birth
        for g in step["selection"].groups:
            assert g.birth_step < step["step"]
    rows = _replayed_diverted_rows(run)
    assert rows, "a diverted group must have been trained"
    logged = [m for m in run.trainer.logged if "async/diverted_groups" in m]
    assert logged and all("async/floor" in m for m in logged)


@pytest.mark.parametrize("mode", ["decoupled", "bypass"])
def test_replayed_rows_loss_equals_a_hand_recomputation(mode, request):
    run, sampler = request.getfixturevalue(mode)
    actor = run.trainer.config.actor_rollout_ref.actor
    by_tokens = {(tuple(r["prompts"].tolist()), tuple(r["responses"].tolist())): r for r in sampler.rows.values()}
    rows = _replayed_diverted_rows(run)
    for micro, r, g, idx in rows:
        src = by_tokens[(tuple(g.prompt_ids.tolist()), tuple(micro["responses"][r]))]  # what the sampler produced
        np.testing.assert_allclose(micro["old"][r], src["rollout_log_probs"].numpy(), rtol=0, atol=1e-6)
        rewards = g.rewards.double()
        adv = (rewards - rewards.mean()) / (rewards.std() + 1e-6)  # verl's GRPO advantage of the group alone
        assert any(micro["adv"][r][0] == pytest.approx(float(adv[i]), abs=1e-5) for i in idx)
    micros = {id(m): m for m, *_ in rows}
    assert micros
    for mb in micros.values():
        assert mb["loss"] == pytest.approx(_vanilla_loss(mb, actor), rel=1e-5, abs=1e-7)


def test_floor_measured_and_gate_floor_corrected(decoupled, bypass):
    for run, _ in (decoupled, bypass):
        ar = run.trainer.async_seam.areplay
        assert ar.floor.groups > 0 and ar.floor.value > 0  # the perturbed sampler's mismatch
        tau = run.trainer.replay.tau  # a sampler-referenced group is gated on tau + the floor
        floors = [s["selection"].scanned_tau - tau for s in run.trainer.steps]
        assert any(len(f) and f.max() > 0 for f in floors)
    dec = decoupled[0].trainer.async_seam.areplay
    assert all(str(g).startswith("stale") for g in dec.sampler_ref)  # decoupled: fresh groups keep trainer log-probs
    byp = bypass[0].trainer.async_seam.areplay
    assert any(not str(g).startswith("stale") for g in byp.sampler_ref)  # bypass: every group is sampler-referenced


def test_bypass_fresh_rows_train_on_rollout_logprobs(bypass):
    run, sampler = bypass
    by_tokens = {tuple(r["responses"].tolist()): r for r in sampler.rows.values()}
    checked = 0
    for i, step in enumerate(run.trainer.steps):
        kind = run.kind_of(i)
        for rank in run.records:
            for mb in rank["history"][i]:
                for micro in mb.get("micro_terms", []):
                    for r, uid in enumerate(micro["uid"]):
                        if kind(uid) == "fresh" and sum(micro["mask"][r]):
                            resp_len = len(micro["mask"][r])
                            cands = [v for k, v in by_tokens.items() if len(k) == resp_len]
                            match = [v for v in cands if np.allclose(v["rollout_log_probs"].numpy(), micro["old"][r])]
                            assert match, "a fresh row's old_log_probs are not the sampler's"
                            checked += 1
    assert checked


@pytest.mark.parametrize("extra,match", [
    (("actor_rollout_ref.rollout.calculate_log_probs=false",), "calculate_log_probs=false: the sampler gives no"),
    ((BYPASS, "actor_rollout_ref.actor.policy_loss.loss_mode=gpg"), "loss_mode=gpg: that loss never reads"),
    (("trainer.v1.trainer_mode=sync",), "with trainer.v1.trainer_mode=sync"),
    (("algorithm.adv_estimator=reinforce_plus_plus_baseline",), "supported: \\['grpo', 'rloo'\\]"),
    (("actor_rollout_ref.actor.use_kl_loss=true",), "use_kl_loss=true: diverted groups have no reference"),
    (("trainer.v1.sampler.max_off_policy_strategy=wait",), "with 'wait' verl never evicts"),
    (("hdr.capacity=3",), r"hdr.capacity=3 cannot hold one step's groups \(data.train_batch_size=4\)"),
    # decoupled rollout_is: fresh groups would store birth weights, diverted ones none (one buffer, one kind of group)
    (("algorithm.rollout_correction.rollout_is=token",), "rollout_is=token with HDRReplayBufferAsync in decoupled"),
])
def test_bad_async_settings_are_refused_with_the_key(tiny_model_dir, extra, match):
    cfg = compose_v1_config(*ASYNC, *extra, ckpt_dir="/tmp/unused", model_dir=tiny_model_dir)
    with pytest.raises(ReplayConfigError, match=match):
        validate_verl_config(cfg)


def test_rollout_is_with_the_sampler_in_bypass_mode_is_accepted(tiny_model_dir):
    cfg = compose_v1_config(*ASYNC, BYPASS, "algorithm.rollout_correction.rollout_is=token", ckpt_dir="/tmp/unused",
                            model_dir=tiny_model_dir)
    assert validate_verl_config(cfg).active


def test_bypass_alone_is_accepted(tiny_model_dir):
    cfg = compose_v1_config(BYPASS, "actor_rollout_ref.rollout.calculate_log_probs=true", ckpt_dir="/tmp/unused",
                            model_dir=tiny_model_dir)
    assert validate_verl_config(cfg).active


def test_resumed_async_run_restores_the_staleness_state_and_selects_as_the_uninterrupted_run(resumed):
    """verl restores its own side (TransferQueue, dataloader), but in this harness the resumed run trains other fresh
    prompts from update 3 on than the uninterrupted one (verl's restored sampler order), so what is compared is the
    first resumed selection (update 3: the restored buffer, floor and tracking, the restored weights) and the state's
    continuity (ledger totals, async.jsonl), not updates after it."""
    first, ledger, again, _ = resumed
    assert again.trainer.resumed_at == 2 and [s["step"] for s in again.trainer.steps] == [3, 4]
    prompt_of = {**first.agent.prompt_of, **again.agent.prompt_of}  # uids are fresh uuids in every run

    def content(group_ids):  # (birth tag, prompt index) of each "<step>:<uid>" / "stale<birth>:<uid>"
        return [(tag, prompt_of[uid]) for tag, uid in (str(g).split(":", 1) for g in group_ids)]

    sa, sb = first.trainer.steps[2]["selection"], again.trainer.steps[0]["selection"]
    assert len(sa.scanned) >= 4 and content(sa.scanned_group_ids) == content(sb.scanned_group_ids)
    assert any(g.startswith("stale") for g, _ in content(sa.scanned_group_ids))  # diverted before the checkpoint
    assert np.array_equal(sa.scanned_pass, sb.scanned_pass)
    assert content(g.group_id for g in sa.groups) == content(g.group_id for g in sb.groups)
    np.testing.assert_allclose(sa.scanned_drift, sb.scanned_drift, rtol=1e-6, atol=1e-9)
    tau = first.trainer.replay.tau
    assert (sa.scanned_tau > tau).any()  # sampler-referenced groups gated with the measured floor ...
    np.testing.assert_allclose(sb.scanned_tau, sa.scanned_tau, rtol=1e-9)  # ... restored, not re-measured from 0
    recs = lambda text: [json.loads(x) for x in text.splitlines()]  # noqa: E731
    la, lb = recs(ledger), recs((Path(again.trainer.hdr.diagnostics_dir) / "async.jsonl").read_text())
    assert [r["step"] for r in la] == [r["step"] for r in lb] == [1, 2, 3, 4]  # rewound to the checkpoint, continued
    assert la[:2] == lb[:2] and la[1]["totals"]["diverted_groups"] > 0
    counts = [k for k in la[1]["totals"]]
    for r in lb[2:]:  # the resumed ledger counts on from the checkpoint's totals
        prev = lb[lb.index(r) - 1]["totals"]
        assert all(r["totals"][k] == prev[k] + r[k] for k in counts)
    fb = again.trainer.async_seam.areplay
    assert fb.ledger.totals == lb[-1]["totals"]
    assert [r["floor_groups"] for r in lb] == sorted(r["floor_groups"] for r in lb)  # the floor's count goes on
    t = fb.ledger.totals  # every group the sampler captured, before and after the resume, reached the rule
    captured = again.trainer.async_seam.sampler.captured
    assert captured == t["diverted_groups"] + t["dropped_groups"] > la[1]["totals"]["diverted_groups"]


def test_resume_without_the_replay_state_is_refused_unless_allowed(resumed, worker_group, tokenizer, tiny_model_dir,
                                                                   tmp_path):
    """A verl checkpoint without hdreplay/ (the buffer and the staleness rule's state): refused naming
    hdr.resume_without_state; with it set, the run resumes with everything empty."""
    import shutil

    from hdreplay import CheckpointError

    *_, ckpt = resumed
    copy, resume = _checkpoint_copy(ckpt, tmp_path)
    shutil.rmtree(copy / "global_step_2" / "hdreplay")
    run = _refused_then_resumed(CheckpointError, r"set hdr\.resume_without_state=True",
                                r"empty buffer \(hdr\.resume_without_state=True\)",
                                worker_group, tokenizer, tiny_model_dir, copy, *resume)
    assert run.trainer.resumed_at == 2 and [s["step"] for s in run.trainer.steps] == [3]
    [rec] = [json.loads(x) for x in (tmp_path / "diagnostics" / "async.jsonl").read_text().splitlines()]
    assert rec["step"] == 3 and all(rec["totals"][k] == rec[k] for k in rec["totals"])  # the ledger started empty


def _refused_then_resumed(error, refusal: str, warning: str, worker_group, tokenizer, model_dir, copy, *resume):
    """The resume of ``copy`` refused (``error`` matching ``refusal``), then run with hdr.resume_without_state=true
    for one update (a UserWarning matching ``warning``); returns that run."""
    with pytest.raises(error, match=refusal):
        _run(worker_group, tokenizer, model_dir, copy, *resume, steps=3)
    with pytest.warns(UserWarning, match=warning):
        run, _ = _run(worker_group, tokenizer, model_dir, copy, *resume, "hdr.resume_without_state=true", steps=3)
    return run


def _checkpoint_copy(ckpt: Path, tmp_path: Path) -> tuple[Path, tuple[str, ...]]:
    """A copy of ``ckpt``'s global_step_2 (and its directory's run record) as the latest checkpoint under tmp_path, and
    the overrides resuming it."""
    import shutil

    from hdreplay.integrations.verl.checkpoints import RUN_FILE

    copy = tmp_path / "ckpt"
    shutil.copytree(ckpt / "global_step_2", copy / "global_step_2")
    shutil.copy(ckpt / RUN_FILE, copy / RUN_FILE)  # the run record of the checkpoint directory (issue 44)
    (copy / "latest_checkpointed_iteration.txt").write_text("2")
    return copy, ("trainer.resume_mode=resume_path", f"trainer.resume_from_path={copy}/global_step_2",
                  f"hdr.diagnostics_dir={tmp_path}/diagnostics")


def _strip_staleness_state(folder: Path) -> None:
    """Rewrite the controller checkpoint in ``folder`` without the staleness rule's state (what the synchronous
    trainer, or an hdreplay that did not save it, writes)."""
    from hdreplay.checkpoint.files import open_checkpoint_dir, write_checkpoint_dir
    from hdreplay.controller import CONTROLLER_FORMAT, CONTROLLER_VERSION, CONTROLLER_VERSIONS

    with open_checkpoint_dir(folder, format_name=CONTROLLER_FORMAT, versions=CONTROLLER_VERSIONS) as (t, meta):
        tensors, meta = {k: v.read().clone() for k, v in t.items()}, json.loads(json.dumps(meta))
    assert meta["observers"].pop("staleness")["totals"]["diverted_groups"] > 0
    write_checkpoint_dir(folder, format_name=CONTROLLER_FORMAT, version=CONTROLLER_VERSION, tensors=tensors,
                         meta=meta)


def test_resume_without_the_staleness_state_is_refused_naming_verls_option(resumed, worker_group, tokenizer,
                                                                          tiny_model_dir, tmp_path):
    """hdreplay/ holds the buffer but not the staleness rule's state: refused naming hdr.resume_without_state (not
    another front end's spelling); with it set, the buffer is restored and the rule starts empty."""
    from hdreplay import CheckpointError

    *_, ckpt = resumed
    copy, resume = _checkpoint_copy(ckpt, tmp_path)
    _strip_staleness_state(copy / "global_step_2" / "hdreplay")
    run = _refused_then_resumed(CheckpointError, r"no staleness state.*set hdr\.resume_without_state=True",
                                r"start empty \(hdr\.resume_without_state=True\)",
                                worker_group, tokenizer, tiny_model_dir, copy, *resume)
    assert run.trainer.resumed_at == 2 and [s["step"] for s in run.trainer.steps] == [3]
    assert len(run.trainer.steps[0]["selection"].scanned) > 0  # the buffer was restored
    [rec] = [json.loads(x) for x in (tmp_path / "diagnostics" / "async.jsonl").read_text().splitlines()]
    assert all(rec["totals"][k] == rec[k] for k in rec["totals"])  # the ledger started empty


@pytest.mark.parametrize("case", ["another run's state", "staleness step re-signed"])
def test_resume_refuses_a_replay_state_that_is_not_this_checkpoints_and_changes_no_file(resumed, worker_group,
                                                                                       tokenizer, tiny_model_dir,
                                                                                       tmp_path, case):
    """Issue 39, 44: the replay state carries the run id (the checkpoint directory's hdreplay_run.json records it) and
    step of its folder, and the staleness state is checked against the controller it is saved with; a mismatch is
    refused before any file changes (the diagnostics logs of the run included); with hdr.resume_without_state the
    replay starts empty and the logs are set back to the checkpoint (the later records moved aside)."""
    from hdreplay import CheckpointError, CheckpointMismatchError
    from hdreplay.integrations.verl.checkpoints import RUN_FILE
    from strategy_states import read_state, resign

    *_, ckpt = resumed
    copy, resume = _checkpoint_copy(ckpt, tmp_path)
    folder = copy / "global_step_2"
    run = json.loads((copy / RUN_FILE).read_text())
    if case == "another run's state":  # the directory's record names another run than the state's
        (copy / RUN_FILE).write_text(json.dumps({**run, "run_id": "0" * 32}))
        error, refusal = (CheckpointMismatchError,
                          rf"run_id: the replay state holds '{run['run_id']}', the checkpoint '0+'")
        warning = r"empty replay state \(hdr\.resume_without_state=True\)"
    else:
        st = read_state(folder / "hdreplay")[0]
        st["meta"]["observers"]["staleness"]["step"] = 0
        resign(folder / "hdreplay", st["meta"])
        error, refusal, warning = CheckpointError, r"staleness state: step 0 differs from the controller's", None
    diag = tmp_path / "diagnostics"
    diag.mkdir()
    (diag / "async.jsonl").write_text('{"step": 0}\n{"step": 1}\n{"step": 2}\n{"step": 3}\n')
    before = {p: p.read_bytes() for p in sorted(tmp_path.rglob("*")) if p.is_file()}
    with pytest.raises(error, match=refusal):
        _run(worker_group, tokenizer, tiny_model_dir, copy, *resume, steps=3)
    assert {p: p.read_bytes() for p in sorted(tmp_path.rglob("*")) if p.is_file()} == before  # no log line lost
    if warning is None:  # a malformed state is not "another run's": resume_without_state does not take it
        return
    with pytest.warns(UserWarning, match=warning):
        again, _ = _run(worker_group, tokenizer, tiny_model_dir, copy, *resume, "hdr.resume_without_state=true",
                        steps=3)
    assert again.trainer.resumed_at == 2 and [s["step"] for s in again.trainer.steps] == [3]
    recs = [json.loads(x) for x in (diag / "async.jsonl").read_text().splitlines()]
    assert [r["step"] for r in recs] == [0, 1, 2, 3]  # set back to the checkpoint's step, 2: no step twice
    assert all(recs[-1]["totals"][k] == recs[-1][k] for k in recs[-1]["totals"])  # the ledger started empty
    (side,) = diag.glob("async.rewound-from-step-3.*.jsonl")
    assert side.read_text() == '{"step": 3}\n'  # set aside, not deleted
