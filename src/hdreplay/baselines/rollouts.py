"""A group as single-response records: what the rollout-level peers store (``adv_priority``, RePO, ExGRPO)."""

from __future__ import annotations

from ..store.record import GroupRecord


def split_rollouts(group: GroupRecord, *, keep_zero_advantage: bool = False) -> list[GroupRecord]:
    """A group as single-response records (ids ``"<group_id>/<i>"``), each keeping its response's stored advantage
    (computed in its birth group); responses with no loss token are left out, and unless ``keep_zero_advantage``
    (RePO and ExGRPO store every response) so are those with A_i = 0 (no gradient, no priority).

    >>> g = GroupRecord.from_responses(group_id="g", prompt_ids=[5], completion_ids=[[1, 2], [3], [4]],
    ...                                logprobs=[[-0.1, -0.2], [-0.3], [-0.4]], advantages=[1.0, 0.0, -1.0],
    ...                                rewards=[1.0, 0.5, 0.0], birth_step=2)
    >>> [(r.group_id, r.advantages.tolist()) for r in split_rollouts(g)]
    [('g/0', [1.0]), ('g/2', [-1.0])]
    """
    out = []
    toks, lps, masks = group.responses(), group.split(group.logprobs), group.split(group.loss_mask)
    extras = {k: group.split(v) for k, v in group.extras.items()}
    for i in range(group.num_responses):
        if (float(group.advantages[i]) == 0.0 and not keep_zero_advantage) or not bool(masks[i].any()):
            continue
        out.append(GroupRecord.from_responses(
            group_id=f"{group.group_id}/{i}", prompt_ids=group.prompt_ids, completion_ids=[toks[i]],
            logprobs=[lps[i]], loss_masks=[masks[i]], advantages=group.advantages[i:i + 1],
            rewards=group.rewards[i:i + 1], birth_step=group.birth_step,
            extras={k: [v[i]] for k, v in extras.items()}))
    return out
