"""The ingress analysis (report section 10): rules and classes by hand, and the buffer reconstruction checked
against a real ReplayController fed the same multi-part rewards."""

import json

import numpy as np
import pandas as pd
import pytest

from hdreplay import ReplayConfig, ReplayController
from hdreplay_lab.analysis import build_report, load_run, write_report
from hdreplay_lab.analysis.ingress import classify, fifo_buffer, ingress
from hdreplay_lab.analysis.load import AnalysisInputError, step_frame
from hdreplay_lab.sandbox.rewardlog import FILE, GroupRewardLog
from hdreplay_lab.synthetic import TablePolicy, make_group


def test_classes_and_rules_by_hand():
    r = np.array([[0.0, 0.1, 0.1, 0.0],   # format-only, no correct answer: mixed yes, answer no, positive yes
                  [0.1, 1.0, 0.1, 0.9],   # answer-mixed, every wrong answer has the format: positive says "all success"
                  [1.0, 0.9, 1.0, 1.0],   # all correct, format varies: mixed yes, answer no, positive no
                  [0.1, 0.1, 0.1, 0.1],   # uniform
                  [0.0, 1.0, 0.0, 0.0]])  # answer-mixed
    c = classify(r, 0.9)
    assert c["S"].tolist() == [0, 2, 4, 0, 1]
    assert c["answer_mixed"].tolist() == [False, True, False, False, True]
    assert c["format_only"].tolist() == [True, False, True, False, False]
    assert c["uniform"].tolist() == [False, False, False, True, False]
    assert c["mixed"].tolist() == [True, True, True, False, True]
    assert c["answer"].tolist() == [False, True, False, False, True]
    assert c["positive"].tolist() == [True, False, False, False, True]


def test_fifo_buffer_share_by_hand():
    # admitted groups in ingress order: steps 0,0,1,2,2,2 with format-only flags 1,0,0,1,1,0; capacity 3
    steps = np.array([0, 0, 1, 2, 2, 2])
    flags = np.array([1, 0, 0, 1, 1, 0], dtype=bool)
    assert fifo_buffer(steps, flags, [0, 1, 2, 3], 3) == [0.5, 1 / 3, 2 / 3, 2 / 3]
    assert fifo_buffer(steps[:0], flags[:0], [0], 3) == [None]


def test_reward_log_groups_rows_and_keeps_the_name(tmp_path):
    class State:
        global_step = 7

    def geo_reward(completions, **kw):
        return [float(c) for c in completions]

    log = GroupRewardLog(geo_reward, tmp_path / FILE, n=2)
    assert log.__name__ == "geo_reward"
    assert log(completions=["0.1", "1", "0", "0.9"], trainer_state=State()) == [0.1, 1.0, 0.0, 0.9]
    assert json.loads((tmp_path / FILE).read_text()) == {"step": 7, "n": 2, "rewards": [[0.1, 1.0], [0.0, 0.9]]}
    with pytest.raises(ValueError, match="groups of 2"):
        log(completions=["1"], trainer_state=State())


REWARDS = np.array([0.0, 0.1, 0.9, 1.0])


def _multi_reward_run(root, rule: str, *, steps=25, per_step=6, n=4, seed=0, gid="s{t}g{k}"):
    """A real controller run whose groups carry Geo3K-style rewards, plus the fresh log the sandbox would write.
    ``gid``: the group-id format (HDRGRPOTrainer writes ``s<step>.<generation>g<k>``)."""
    cfg = ReplayConfig(k_rep=3, tau=5e-3, capacity=10, ingress=rule, answer_threshold=0.9)
    run = root / rule
    run.mkdir()
    ctrl = ReplayController(cfg, diagnostics_dir=run / "replay")
    pol, rng = TablePolicy(seed=seed), np.random.default_rng(seed)
    fresh, buffered = [], []
    for t in range(steps):
        if t:
            pol = pol.perturbed(0.05, seed=1000 + t)
        ctrl.select(step=t, scorer=pol.scorer)
        p = np.array([0.45, 0.35, 0.1, 0.1]) if t < steps // 2 else np.array([0.05, 0.45, 0.2, 0.3])
        rw = rng.choice(REWARDS, size=(per_step, n), p=p)
        fresh.append({"step": t, "n": n, "rewards": rw.tolist()})
        ctrl.stage([make_group(gid.format(t=t, k=k), policy=pol, step=t, n=n, seed=97 * t + k, rewards=rw[k].tolist())
                    for k in range(per_step)], step=t)
        ctrl.commit()
        buffered.append([ctrl.buffer.group_id(int(i)) for i in ctrl.buffer.insertion_ids()])
    ctrl.close()
    (run / "run.json").write_text(json.dumps({"method": "headroom_drift", "seed": seed, "task": "geo",
                                              "replay": cfg.to_dict()}))
    (run / FILE).write_text("".join(json.dumps(r) + "\n" for r in fresh))
    return run, fresh, buffered


@pytest.mark.parametrize("rule,gid", [("mixed", "s{t}g{k}"), ("answer", "s{t}g{k}"), ("mixed", "s{t}.0g{k}")])
def test_section_matches_the_controller_that_ran(tmp_path, rule, gid):
    run, fresh, buffered = _multi_reward_run(tmp_path, rule, gid=gid)
    data = load_run(run)
    sec = ingress(data.fresh, data.steps, data.groups, data.replay_config, threshold=None)
    assert sec["available"] and sec["rule"] == rule and sec["threshold"] == 0.9
    # the reconstructed ingress equals what the core admitted, step by step
    assert sec["buffer"]["checked_against_log"] and sec["buffer"]["admitted_mismatch_steps"] == []
    # admitted shares recomputed independently from the raw rewards
    all_r = np.array([g for rec in fresh for g in rec["rewards"]])
    varies = np.array([len(set(g)) > 1 for g in all_r])
    S = (all_r >= 0.9).sum(1)
    assert sec["rules"]["mixed"]["admit_share"] == pytest.approx(varies.mean())
    assert sec["rules"]["answer"]["admit_share"] == pytest.approx(((S >= 1) & (S <= 3)).mean())
    # after every step, the buffer share equals the format-only share of the groups the controller really held
    cls = {gid.format(t=rec["step"], k=k): (len(set(g)) > 1 and (sum(v >= 0.9 for v in g) in (0, len(g))))
           for rec in fresh for k, g in enumerate(rec["rewards"])}
    held = [np.mean([cls[g] for g in ids]) if ids else None for ids in buffered]
    assert sec["series"]["buffer_format_only"] == pytest.approx(held)
    if rule == "answer":
        assert sec["buffer"]["format_only_mean"] == 0.0 and sec["rules"]["answer"]["format_only_share"] == 0.0
    else:
        assert sec["buffer"]["format_only_mean"] > 0.0
    # replay events on format-only groups, from the lifetime records' replay counts
    groups = pd.read_json(run / "replay" / "groups.jsonl", lines=True)
    ev = groups["replay_count"].sum()
    fo = sum(c for g, c in zip(groups["group_id"], groups["replay_count"]) if cls[g])
    assert sec["replay"]["replay_events"] == ev and sec["replay"]["format_only_replay_share"] == pytest.approx(fo / ev)


def test_mismatch_with_the_log_is_reported(tmp_path):
    run, _, _ = _multi_reward_run(tmp_path, "mixed", steps=6)
    data = load_run(run)
    steps = data.steps.copy()
    steps.loc[steps["step"] == 3, "ingress_admitted"] += 1
    sec = ingress(data.fresh, step_frame(steps), data.groups, data.replay_config, threshold=None)
    assert sec["buffer"]["admitted_mismatch_steps"] == [3]


def test_report_renders_the_ingress_section_and_figure(tmp_path):
    runs = [load_run(_multi_reward_run(tmp_path, rule)[0]) for rule in ("mixed", "answer")]
    report = build_report(runs)
    paths = write_report(report, tmp_path / "rep")
    md = paths["markdown"].read_text()
    assert "## 10. Replay ingress under a multi-part reward" in md and "figure:ingress" in paths
    # both runs saw the same fresh rewards (same seed): every rule admits the same share in both, whatever the
    # run's own rule; the buffers differ
    a, b = (report["runs"][k]["ingress"] for k in ("mixed", "answer"))
    assert all(a["rules"][r]["admit_share"] == b["rules"][r]["admit_share"] for r in ("mixed", "answer", "positive"))
    assert a["buffer"]["format_only_mean"] > b["buffer"]["format_only_mean"] == 0.0
    # a run without a fresh log says why
    (runs[0].path / FILE).unlink()
    sec = build_report([load_run(runs[0].path)])["runs"]["mixed"]["ingress"]
    assert sec["available"] is False and "fresh_groups.jsonl" in sec["reason"]


def test_malformed_fresh_lines_are_refused_with_file_and_line(tmp_path):
    """Records of the wrong type are not what a crash leaves: the load refuses the run and names each line."""
    run, _, _ = _multi_reward_run(tmp_path, "answer", steps=4)
    with open(run / FILE, "a") as f:
        f.write('{"step": 9, "rewards": [[0.1, "x"]]}\n{"step": -1, "rewards": [[0.1]]}\n{"step": 10, "rewards": 3}\n')
    with pytest.raises(AnalysisInputError, match="3 malformed record") as err:
        load_run(run, warn=False)
    lines = [ln for ln in str(err.value).splitlines() if FILE in ln]
    assert [ln.split(FILE + ":")[1].split(":")[0] for ln in lines] == ["5", "6", "7"]
    assert "'rewards' must hold numbers" in str(err.value) and "'step' must be an int >= 0" in str(err.value)


def test_a_truncated_fresh_line_is_skipped_with_file_and_line(tmp_path):
    """A half-written last line (what a crash leaves) is skipped with its file and line; the rest loads."""
    run, _, _ = _multi_reward_run(tmp_path, "answer", steps=4)
    with open(run / FILE, "a") as f:
        f.write('{"step": 9, "rewards": [[0.1')
    data = load_run(run, warn=False)
    assert any(FILE + ":5" in p for p in data.problems)
    assert sorted(data.fresh["step"]) == [0, 1, 2, 3]


@pytest.mark.trl
def test_sandbox_run_logs_fresh_groups_that_match_the_trainers_ingress(tmp_path):
    """A real sandbox run (HDRGRPOTrainer on the text multi_reward task, the same 0/0.1/0.9/1 reward): the reward
    log's steps and groups are the ones the trainer's replay controller admitted, step for step."""
    pytest.importorskip("trl")
    from hdreplay_lab.sandbox.compare import CompareConfig
    from hdreplay_lab.sandbox.methods import METHODS
    from hdreplay_lab.sandbox.runner import run_one
    from hdreplay_lab.sandbox.tasks import get_task
    from hdreplay_lab.sandbox.warmstart import WarmStartConfig, warm_start

    task = get_task("multi_reward")
    model = warm_start(task, tmp_path / "ws", WarmStartConfig(hidden=32, layers=1, max_steps=60, eval_every=60,
                                                               eval_prompts=2, eval_n=1, lr=3e-3, target=2.0),
                       log=lambda *_: None)
    cfg = CompareConfig(task="multi_reward", methods=("headroom_drift",), seeds=1, steps=6, prompts_per_step=4,
                        generations=4, eval_n=1, replay={"ingress": "mixed", "tau": 10.0})
    run = tmp_path / "run"
    run_one(cfg.spec("headroom_drift", 0), METHODS["headroom_drift"], task, model, run)
    data = load_run(run)
    assert sorted(data.fresh["step"]) == list(range(6)) == sorted(data.steps["step"])
    assert all(len(r) == 4 and all(len(g) == 4 for g in r) for r in data.fresh["rewards"])
    sec = ingress(data.fresh, data.steps, data.groups, data.replay_config, threshold=None)
    assert sec["rule"] == "mixed" and sec["buffer"]["checked_against_log"]
    assert sec["buffer"]["admitted_mismatch_steps"] == []
    assert sec["rules"]["mixed"]["admitted_per_step"] * 6 == data.steps["ingress_admitted"].sum() > 0
