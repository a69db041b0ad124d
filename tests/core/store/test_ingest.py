"""hdreplay.store.ingest: the one rows -> groups function every trainer calls (each row of its check table)."""

import pytest
import torch

from hdreplay import GroupRecord
from hdreplay.errors import IngestError
from hdreplay.store.ingest import Rows, groups_from_rows, one_group, rows_from_responses

N, C = 4, 3


def rows(n_groups=2, n=N, **over):
    g = torch.Generator().manual_seed(0)
    R = n_groups * n
    prompts = torch.tensor([[0, 7 + k % 2, 8] for k in range(n_groups) for _ in range(n)])
    lengths = torch.randint(1, C + 1, (R,), generator=g)
    cm = (torch.arange(C)[None, :] < lengths[:, None]).long()
    kw = dict(prompt_ids=prompts, prompt_mask=(prompts != 0).long(),
              completion_ids=torch.randint(1, 9, (R, C), generator=g) * cm, completion_mask=cm,
              logprobs=-torch.rand(R, C, generator=g), advantages=torch.randn(R, generator=g),
              rewards=torch.randint(0, 2, (R,), generator=g).float(), loss_mask=cm.clone(),
              extras={"ref_logprobs": -torch.rand(R, C, generator=g)})
    kw.update(over)
    return Rows(**kw)


def test_consecutive_blocks_build_what_from_padded_builds():
    r = rows()
    out = groups_from_rows(r, step=5, group_size=N, group_id=lambda k: f"s5g{k}")
    assert out.num_groups == 2 and not out.problems and not out.empty
    for k, g in enumerate(out.groups):
        sl = slice(k * N, (k + 1) * N)
        ref = GroupRecord.from_padded(group_id=f"s5g{k}", prompt_ids=r.prompt_ids[sl][0][1:],
                                      completion_ids=r.completion_ids[sl], completion_mask=r.completion_mask[sl],
                                      logprobs=r.logprobs[sl], loss_mask=r.loss_mask[sl],
                                      advantages=r.advantages[sl], rewards=r.rewards[sl], birth_step=5,
                                      extras={"ref_logprobs": r.extras["ref_logprobs"][sl]})
        for f in ("prompt_ids", "completion_ids", "response_lengths", "loss_mask", "logprobs", "advantages", "rewards"):
            assert torch.equal(getattr(g, f), getattr(ref, f)), f
        assert torch.equal(g.extras["ref_logprobs"], ref.extras["ref_logprobs"]) and g.birth_step == 5


def test_keys_group_scattered_rows_and_a_group_missing_rows_is_a_problem():
    keys = ["a", "b", "c"] * N  # rows of a group interleaved (verl's balanced order)
    r = rows(n_groups=3, prompt_ids=torch.tensor([[0, 7 + (i % 3) % 2, 8] for i in range(3 * N)]))
    out = groups_from_rows(r, step=1, group_size=N, keys=keys, only=[i for i in range(3 * N) if i != 2],
                           group_id=lambda u: f"1:{u}", key_name="uid", size_name="rollout.n")
    assert [g.group_id for g in out.groups] == ["1:a", "1:b"] and out.num_groups == 3
    assert out.problems == [f"uid 'c': {N - 1} rows, expected rollout.n={N}"]


@pytest.mark.parametrize("fault", ["prompt", "blocks", "shape", "advantage"])
def test_a_batch_that_cannot_be_read_raises_an_ingest_error(fault):
    r, n, match = rows(), N, None
    if fault == "prompt":  # one row of the first group with another prompt
        p = r.prompt_ids.clone()
        p[1, 1] = 3
        r, match = rows(prompt_ids=p), "do not share one prompt"
    elif fault == "blocks":
        n, match = 3, "8 rows do not form groups of group_size=3"
    elif fault == "shape":
        with pytest.raises(IngestError, match=r"rows.logprobs: shape \(8, 2\), expected \(8, 3\)"):
            rows(logprobs=torch.zeros(2 * N, C - 1))
        return
    else:  # token-level advantages that vary inside a response (GAE)
        adv = r.advantages[:, None].expand(-1, C).clone()
        adv[0, 0] += 1.0
        r, match = rows(advantages=adv, completion_mask=torch.ones(2 * N, C), loss_mask=torch.ones(2 * N, C)), \
            "row 0 .* under algorithm.adv_estimator=gae"
    with pytest.raises(RuntimeError, match=match) as e:  # a RuntimeError, as the integrations raised before
        groups_from_rows(r, step=0, group_size=n, hint="algorithm.adv_estimator=gae")
    assert isinstance(e.value, IngestError)


def test_token_level_advantages_constant_over_the_loss_tokens_are_one_per_response():
    r = rows()
    tok = r.advantages[:, None] * r.loss_mask  # verl's A_i * response_mask
    out = groups_from_rows(rows(advantages=tok), step=0, group_size=N)
    assert torch.equal(torch.cat([g.advantages for g in out.groups]), r.advantages.float())


def test_a_group_without_loss_tokens_is_empty_not_a_problem_and_a_masked_response_stays():
    lm = rows().loss_mask.clone()
    lm[:N] = 0  # group 0: nothing generated (every response truncated)
    lm[N] = 0  # group 1: its first response masked out; the group keeps it (its outcome counts)
    out = groups_from_rows(rows(loss_mask=lm), step=0, group_size=N)
    assert [g.group_id for g in out.groups] == [1] and not out.problems
    assert len(out.empty) == 1 and "loss mask is all zero" in out.empty[0]
    assert out.groups[0].num_responses == N and not out.groups[0].split(out.groups[0].loss_mask)[0].any()


def test_multimodal_hook_reasons_record_checks_and_the_buffer_schema_skip_single_groups():
    lp = rows().logprobs.clone()
    lp[0, 0] = float("nan")  # group 0 fails the GroupRecord check
    image = {"pixel_values": torch.zeros(2, 3)}
    hook = lambda idx: ({}, "rows disagree on their images") if idx[0] == N else (dict(image), None)  # noqa: E731
    out = groups_from_rows(rows(n_groups=3, logprobs=torch.cat([lp, lp[N:]])), step=0, group_size=N, mm_inputs=hook)
    assert [g.group_id for g in out.groups] == [2] and len(out.problems) == 2
    assert "non-finite" in out.problems[0] and out.problems[1] == "group 1: rows disagree on their images"
    text = groups_from_rows(rows(), step=0, group_size=N, schema={"pixel_values": (torch.float32, (3,))})
    assert text.groups == [] and all("multimodal inputs differ" in p for p in text.problems)


def test_a_group_kept_as_unpadded_responses_builds_what_from_responses_builds():
    """The asynchronous samplers' way in (TRL async samples, verl's stale groups): one group's prompt and n unpadded
    responses, padded into Rows and built by groups_from_rows, equal GroupRecord.from_responses field for field."""
    prompt = torch.tensor([7, 8, 9])
    comps = [torch.tensor([1, 2, 3]), torch.tensor([4]), torch.tensor([5, 6])]
    lps = [torch.tensor([-0.1, -0.2, -0.3]), torch.tensor([-0.4]), torch.tensor([-0.5, -0.6])]
    masks = [torch.tensor([1, 0, 1]), torch.tensor([1]), torch.tensor([1, 1])]  # a tool token in response 0
    extra = [x * 2 for x in lps]
    got = one_group(rows_from_responses(prompt, comps, lps, loss_masks=masks, advantages=[1.0, -1.0, 0.5],
                                        rewards=[1.0, 0.0, 1.0], extras={"rollout_logprobs": extra}),
                    step=4, group_id="s4g0")
    want = GroupRecord.from_responses(group_id="s4g0", prompt_ids=prompt, completion_ids=comps, logprobs=lps,
                                      loss_masks=masks, advantages=[1.0, -1.0, 0.5], rewards=[1.0, 0.0, 1.0],
                                      birth_step=4, extras={"rollout_logprobs": extra})
    for name in ("group_id", "birth_step", "num_responses", "num_tokens"):
        assert getattr(got, name) == getattr(want, name), name
    for name in ("prompt_ids", "completion_ids", "logprobs", "loss_mask", "response_lengths", "advantages", "rewards"):
        assert torch.equal(getattr(got, name), getattr(want, name)), name
    assert torch.equal(got.extras["rollout_logprobs"], want.extras["rollout_logprobs"])


def test_an_unpadded_group_that_cannot_be_stored_is_refused_naming_why():
    prompt, comps = torch.tensor([7, 8]), [torch.tensor([1, 2]), torch.tensor([3])]
    with pytest.raises(IngestError, match="logprobs: response 1: 2 values for 1 completion tokens"):
        rows_from_responses(prompt, comps, [torch.tensor([-0.1, -0.2]), torch.tensor([-0.3, -0.4])],
                            advantages=[1.0, -1.0], rewards=[1.0, 0.0])
    rows = rows_from_responses(prompt, comps, [torch.tensor([-0.1, -0.2]), torch.tensor([-0.3])],
                               loss_masks=[torch.tensor([0, 0]), torch.tensor([0])], advantages=[1.0, -1.0],
                               rewards=[1.0, 0.0])
    with pytest.raises(IngestError, match="group 'g': the loss mask is all zero, so T\\(g\\) is empty"):
        one_group(rows, step=0, group_id="g")
    lp = [torch.tensor([-0.1, -0.2]), torch.tensor([-0.3])]
    for kw, msg in ((dict(completion_ids=[torch.tensor([1.7, 2.0]), torch.tensor([3.0])]),
                     "completion_ids: response 0: integer values expected"),
                    (dict(loss_masks=[torch.tensor([0.5, 1.0]), torch.tensor([1])]), "loss_masks: response 0: values "
                     "must be 0 or 1"),
                    (dict(extras={"x": [torch.tensor([0.0, 0.0])]}),
                     r"extras\['x'\]: 1 responses, completion_ids has 2")):
        args = dict(completion_ids=comps, logprobs=lp, advantages=[1.0, -1.0], rewards=[1.0, 0.0]) | kw
        with pytest.raises(IngestError, match=msg):
            rows_from_responses(prompt, args.pop("completion_ids"), args.pop("logprobs"), **args)
