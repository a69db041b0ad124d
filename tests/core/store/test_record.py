import pytest
import torch

from hdreplay import GroupRecord, ReplayInputError


def base(**over):
    kw = dict(group_id="g", prompt_ids=[1, 2], completion_ids=[3, 4, 5, 6, 7], response_lengths=[2, 3],
              loss_mask=[1, 1, 1, 0, 1], logprobs=[-0.1, -0.2, -0.3, -0.4, -0.5], advantages=[1.0, -1.0],
              rewards=[1.0, 0.0], birth_step=0)
    kw.update(over)
    return kw


def test_valid_record_views():
    g = GroupRecord(**base())
    assert g.num_responses == 2 and g.num_tokens == 5 and g.num_loss_tokens == 4
    assert g.completion_ids.dtype == torch.int32 and g.logprobs.dtype == torch.float32
    assert [r.tolist() for r in g.responses()] == [[3, 4], [5, 6, 7]]
    assert g.token_advantages().tolist() == [1.0, 1.0, -1.0, -1.0, -1.0]
    assert g.logprobs[3].item() == 0.0  # masked (tool) position carries no meaning
    assert g.age(5) == 5


@pytest.mark.parametrize("over, needle", [
    (dict(logprobs=[-0.1] * 4), "`logprobs` has 4 entries"),
    (dict(loss_mask=[1, 1, 1]), "`loss_mask` has 3 entries"),
    (dict(response_lengths=[2, 2]), "sum to 4"),
    (dict(response_lengths=[5, 0]), ">= 1 completion token"),
    (dict(advantages=[1.0]), "`advantages` has 1 entries for 2 responses"),
    (dict(rewards=[1.0, float("nan")]), "`rewards` has non-finite"),
    (dict(advantages=[float("inf"), 0.0]), "`advantages` has non-finite"),
    (dict(logprobs=[-0.1, float("nan"), -0.3, -0.4, -0.5]), "non-finite value"),
    (dict(logprobs=[-0.1, float("-inf"), -0.3, -0.4, -0.5]), "non-finite value"),
    (dict(logprobs=[-0.1, 0.5, -0.3, -0.4, -0.5]), "positive value"),
    (dict(loss_mask=[0, 0, 0, 0, 0]), "the loss mask is all zero"),
    (dict(completion_ids=[], response_lengths=[], loss_mask=[], logprobs=[], advantages=[], rewards=[]),
     "empty group"),
    (dict(prompt_ids=[]), "`prompt_ids` is empty"),
    (dict(completion_ids=[3.5, 4, 5, 6, 7]), "must hold integers"),
    (dict(birth_step=-1), "birth_step"),
    (dict(completion_ids=[[3, 4, 5, 6, 7]]), "must be 1-D"),
    (dict(group_id=1.5), "group_id must be a str or int"),
    (dict(completion_ids=[3, 4, 5, 6, 2**33 + 7]), "token id 8589934599"),  # was stored as 7 (int32 wrap)
    (dict(completion_ids=[3, 4, -5, 6, 7]), "token id -5"),
    (dict(prompt_ids=[2**31]), "token id 2147483648"),
    (dict(prompt_ids=[2**70]), "not a tensor of numbers"),
    (dict(loss_mask=[2, 1, 1, 0, 1]), "only 0/1"),
    (dict(loss_mask=[0.5] * 5), "only 0/1"),
    (dict(response_lengths=[True, True]), "must hold integers"),
    (dict(birth_step=2**53), "birth_step"),
    (dict(birth_step=2.0), "birth_step"),
    (dict(extras=[("k", [0.0] * 5)]), "`extras` must be a mapping"),
])
def test_bad_records_name_the_field(over, needle):
    with pytest.raises(ReplayInputError) as e:
        GroupRecord(**base(**over))
    assert needle in str(e.value)


def test_a_response_masked_out_of_the_loss_stays_in_its_group():
    """A truncated completion under mask_truncated_completions: no loss tokens, but its reward and advantage count."""
    g = GroupRecord(**base(loss_mask=[0, 0, 1, 1, 1]))
    assert g.num_responses == 2 and g.num_loss_tokens == 3
    assert g.logprobs[:2].tolist() == [0.0, 0.0]  # nothing stored where the loss does not look
    from hdreplay import group_scores

    sc = group_scores([g], [torch.tensor([-5.0, -5.0, -0.3, -0.4, -0.5])])
    assert float(sc.drift[0]) == 0.0  # the masked response does not enter Drift


def test_nan_logprob_at_masked_tool_position_is_tolerated_and_zeroed():
    g = GroupRecord(**base(logprobs=[-0.1, -0.2, -0.3, float("nan"), -0.5]))
    assert g.logprobs[3].item() == 0.0


def test_from_padded_strips_right_padding_and_keeps_tool_mask():
    ids = torch.tensor([[3, 4, 0, 0], [5, 6, 7, 0]])
    cm = torch.tensor([[1, 1, 0, 0], [1, 1, 1, 0]])
    tool = torch.tensor([[1, 1, 1, 1], [1, 0, 1, 1]])
    lp = torch.tensor([[-0.1, -0.2, 9.0, 9.0], [-0.3, -0.4, -0.5, 9.0]])  # garbage on padding
    g = GroupRecord.from_padded(group_id=7, prompt_ids=[1, 2], completion_ids=ids, completion_mask=cm,
                                logprobs=lp, advantages=[1.0, -1.0], rewards=[1, 0], birth_step=3,
                                loss_mask=cm * tool, extras={"ref_logprobs": lp - 1})
    assert g.completion_ids.tolist() == [3, 4, 5, 6, 7]
    assert g.response_lengths.tolist() == [2, 3]
    assert g.loss_mask.tolist() == [True, True, True, False, True]
    assert torch.allclose(g.extras["ref_logprobs"], torch.tensor([-1.1, -1.2, -1.3, 0.0, -1.5]))


def test_from_padded_rejects_holes_and_shape_mismatch():
    ids = torch.tensor([[3, 4, 5]])
    with pytest.raises(ReplayInputError, match="contiguous prefix"):
        GroupRecord.from_padded(group_id=1, prompt_ids=[1], completion_ids=ids,
                                completion_mask=torch.tensor([[1, 0, 1]]),
                                logprobs=-torch.ones(1, 3), advantages=[0.0], rewards=[0.0], birth_step=0)
    with pytest.raises(ReplayInputError, match="`logprobs` has shape"):
        GroupRecord.from_padded(group_id=1, prompt_ids=[1], completion_ids=ids, completion_mask=torch.ones(1, 3),
                                logprobs=-torch.ones(1, 2), advantages=[0.0], rewards=[0.0], birth_step=0)


def test_from_responses_checks_each_response():
    with pytest.raises(ReplayInputError, match="response 1 has 2 tokens but 1 log-probs"):
        GroupRecord.from_responses(group_id="x", prompt_ids=[1], completion_ids=[[1], [2, 3]],
                                   logprobs=[[-0.1], [-0.2]], advantages=[1, -1], rewards=[1, 0], birth_step=0)
    g = GroupRecord.from_responses(group_id="x", prompt_ids=[1], completion_ids=[[1], [2, 3]],
                                   logprobs=[[-0.1], [-0.2, -0.3]], advantages=[1, -1], rewards=[1, 0],
                                   birth_step=0, loss_masks=[[1], [1, 0]])
    assert g.loss_mask.tolist() == [True, True, False]
