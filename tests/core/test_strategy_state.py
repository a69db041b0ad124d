"""The strategy stores' checkpoints (RePO, ExGRPO, BAPO) are checked like the core controller's: every malformed
field of a state.json that passes its checksum (a re-signed manifest) is refused with a
CheckpointError naming it, and the refused load changes nothing; options changed at resume are refused when the
stored state cannot hold under them and warned otherwise; BAPO keeps a group's images; a text buffer emptied by
max-age eviction stays text-only across a resume."""

import copy
import warnings
from collections import Counter

import pytest
import torch

from hdreplay import CheckpointError, ReplayConfig, ReplayController, ReplayInputError, ReplayResumeWarning
from hdreplay.baselines.bapo import BapoController, BapoOptions
from hdreplay.baselines.exgrpo import ExgrpoController, ExgrpoOptions
from hdreplay.baselines.repo import RepoController, RepoOptions
from hdreplay_lab.synthetic import TablePolicy, make_group
from strategy_states import BUILD, N, bad_metas, bapo, read_state, repo, resign, snapshot, to_layout1

KINDS = ("repo", "exgrpo", "bapo")


def _twin(kind):
    """A controller of the same options holding a different state (a refused load must leave it exactly so)."""
    return BUILD[kind](steps=1)


@pytest.mark.parametrize("kind", KINDS)
def test_every_malformed_field_is_refused_and_a_refused_load_changes_nothing(tmp_path, kind):
    src = tmp_path / "src"
    BUILD[kind]().save(src)
    meta = read_state(src)[0]["meta"]
    outcome, examples = Counter(), []
    twin = _twin(kind)
    before = snapshot(twin)
    for label, bad in bad_metas(kind, meta):
        d = src
        resign(d, bad)
        target = copy.deepcopy(twin)
        try:
            target.load(d)
            outcome["accepted"] += 1
            examples.append(f"accepted {label}")
        except CheckpointError:
            outcome["refused" if snapshot(target) == before else "refused but changed"] += 1
            if snapshot(target) != before:
                examples.append(f"changed {label}")
        except Exception as e:  # noqa: BLE001 - a raw exception is the failure this test counts
            outcome["raw exception"] += 1
            examples.append(f"{type(e).__name__} {label}: {e}"[:160])
    assert set(outcome) == {"refused"}, (outcome, examples[:12])
    assert outcome["refused"] > 40
    resign(src, meta)
    again = _twin(kind)
    again.load(src)  # the unedited state still loads
    assert snapshot(again) == snapshot(BUILD[kind]())


def test_an_edited_birth_step_is_refused_not_accepted_silently(tmp_path):
    for kind in KINDS:
        d = tmp_path / kind
        BUILD[kind]().save(d)
        meta = read_state(d)[0]["meta"]
        meta["records"]["birth_steps"][0] = meta["last_step"] + 5  # born after the last step it was saved at
        resign(d, meta)
        with pytest.raises(CheckpointError, match="birth"):
            _twin(kind).load(d)


@pytest.mark.parametrize("kind, saved, refused, warned, field", [
    ("repo", RepoOptions(num_replays=2, min_cache=2, max_cache=3), RepoOptions(num_replays=2, min_cache=2, max_cache=2),
     RepoOptions(num_replays=1, min_cache=2, max_cache=3, retrieval="recent"), "max_cache"),
    ("exgrpo", ExgrpoOptions(start_solved=0.0), ExgrpoOptions(start_solved=0.0, correct=0.5),
     ExgrpoOptions(start_solved=0.0, ratio=0.25, gamma=0.2), "correct"),
    ("bapo", BapoOptions(seed=1), BapoOptions(seed=1, max_uids=2, max_target=2), BapoOptions(seed=1, bad_thr=0.2),
     "max_uids"),
])
def test_options_changed_at_resume_are_refused_or_warned_like_the_core(tmp_path, kind, saved, refused, warned, field):
    BUILD[kind](saved).save(tmp_path / "ck")
    build = {"repo": RepoController, "exgrpo": lambda o: ExgrpoController(o, n=N),
             "bapo": BapoController}[kind]
    c = build(refused)
    before = snapshot(c)
    with pytest.raises(CheckpointError, match=field):
        c.load(tmp_path / "ck")
    assert snapshot(c) == before
    c = build(warned)
    with pytest.warns(ReplayResumeWarning) as rec:
        c.load(tmp_path / "ck")
    changed = [f.name for f in type(saved).__dataclass_fields__.values()
               if getattr(saved, f.name) != getattr(warned, f.name)]
    msg = str(rec[0].message)
    assert changed and all(f"{name}:" in msg for name in changed), msg
    assert c.options == warned  # the configured options govern the resumed run
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the same options: no warning
        build(saved).load(tmp_path / "ck")


def test_bapo_keeps_a_groups_images_across_a_checkpoint(tmp_path):
    c = bapo(mm=True)
    recs = [e.record for e in c.store.values() if e.record is not None]
    assert recs and all(r.mm_inputs for r in recs)
    c.save(tmp_path / "ck")
    d = BapoController(c.options)
    d.load(tmp_path / "ck")
    got = [e.record for e in d.store.values() if e.record is not None]
    assert [sorted(r.mm_inputs) for r in got] == [sorted(r.mm_inputs) for r in recs]
    assert all(torch.equal(a.mm_inputs[k], b.mm_inputs[k]) and a.mm_inputs[k].dtype == b.mm_inputs[k].dtype
               for a, b in zip(got, recs) for k in a.mm_inputs)
    assert snapshot(d) == snapshot(c)


def _image_group(gid, step):
    g = make_group(gid, policy=TablePolicy(), step=step, n=4, seed=3)
    return g.__class__.from_responses(group_id=gid, prompt_ids=g.prompt_ids, completion_ids=g.responses(),
                                      logprobs=g.split(g.logprobs), advantages=g.advantages, rewards=g.rewards,
                                      birth_step=step, mm_inputs={"pixel_values": torch.ones(4, 3)})


def test_a_text_buffer_emptied_by_max_age_stays_text_only_across_a_resume(tmp_path):
    cfg = ReplayConfig(selector="recency", k_rep=2, capacity=8, group_size=4, max_age=1)

    def run(ctrl, steps, groups):
        for t in steps:
            ctrl.select(step=t)
            ctrl.stage(groups(t), step=t)
            ctrl.commit()
        return ctrl

    text = lambda t: [make_group(f"t{t}", policy=TablePolicy(), step=t, n=4, seed=t)]  # noqa: E731
    ctrl = run(ReplayController(cfg), range(2), text)
    run(ctrl, [3], lambda t: [])  # every group is older than max_age: the buffer is empty, still a text buffer
    assert len(ctrl.buffer) == 0 and ctrl.buffer.mm_schema == {}
    ctrl.save(tmp_path / "ck")
    resumed = ReplayController(cfg)
    resumed.load(tmp_path / "ck")
    assert resumed.buffer.mm_schema == {}
    for c in (ctrl, resumed):  # the uninterrupted run and the resumed one refuse the same image group
        with pytest.raises(ReplayInputError, match="multimodal"):
            c.stage([_image_group("img", 4)], step=4)


def test_repo_options_refusal_names_the_stored_state(tmp_path):
    repo(RepoOptions(num_replays=2, min_cache=2, max_cache=3)).save(tmp_path / "ck")
    with pytest.raises(CheckpointError, match="3 responses.*max_cache=2"):
        RepoController(RepoOptions(num_replays=2, min_cache=2, max_cache=2)).load(tmp_path / "ck")


def test_layout_1_strategy_checkpoints_of_hdreplay_0_1_are_refused_by_name(tmp_path):
    for kind in KINDS:
        BUILD[kind]().save(tmp_path / kind)
        to_layout1(tmp_path / kind, tmp_path / f"{kind}-l1")
        d = _twin(kind)
        before = snapshot(d)
        with pytest.raises(CheckpointError, match="layout-1 checkpoint .*unreleased hdreplay 0.1"):
            d.load(tmp_path / f"{kind}-l1")
        assert snapshot(d) == before
