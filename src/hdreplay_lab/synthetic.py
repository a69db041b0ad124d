"""A model-free synthetic policy and group generator (for the scripted demo, tests and benchmarks).

``TablePolicy`` gives token a at response position j the log-prob ``log_softmax(W[j % P])[a]``;
``step()`` moves W by a small random step, so older groups drift further from the
current policy, the way a trained model's do.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterable, Iterator

import torch

from hdreplay.selection import SELECTORS, Selection
from hdreplay.store.record import GroupRecord


class TablePolicy:
    def __init__(self, vocab: int = 11, positions: int = 7, seed: int = 0, scale: float = 1.0):
        g = torch.Generator().manual_seed(seed)
        self.W = torch.randn(positions, vocab, generator=g, dtype=torch.float64) * scale
        self.vocab, self.positions = vocab, positions
        self.calls: list[int] = []  # number of groups per scorer call

    def token_logprobs(self, ids: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        """(T,) log-probs of concatenated responses ``ids`` with ``lengths`` (n,)."""
        lp = torch.log_softmax(self.W, dim=-1)
        pos = torch.cat([torch.arange(int(n)) for n in lengths]) % self.positions
        return lp[pos, ids.long()].float()

    def perturbed(self, scale: float, seed: int) -> "TablePolicy":
        p = TablePolicy(self.vocab, self.positions)
        g = torch.Generator().manual_seed(seed)
        p.W = self.W + scale * torch.randn(self.W.shape, generator=g, dtype=torch.float64)
        return p

    def scorer(self, groups):
        """A :data:`hdreplay.Scorer`: current log-probs of every stored completion token."""
        self.calls.append(len(groups))
        return [self.token_logprobs(g.completion_ids, g.response_lengths) for g in groups]


def make_group(
    gid, *, policy: TablePolicy, step: int, n: int = 4, seed: int = 0, rewards=None, max_len: int = 9,
    tool_every: int = 0, prompt_len: int | None = None, extras: bool = False,
) -> GroupRecord:
    """A group whose responses are random tokens scored by ``policy`` (its generation-time policy).

    ``tool_every=k`` masks every k-th completion token as a tool token (each response keeps its first token)."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, max_len + 1, (n,), generator=g)
    ids = torch.randint(0, policy.vocab, (int(lengths.sum()),), generator=g)
    lp = policy.token_logprobs(ids, lengths)
    mask = torch.ones(ids.numel(), dtype=torch.bool)
    if tool_every:
        mask[1::tool_every] = False
        mask[torch.cumsum(lengths, 0) - lengths] = True
    if rewards is None:
        rewards = (torch.rand(n, generator=g) > 0.5).float()
        rewards[0], rewards[-1] = 1.0, 0.0
    rewards = torch.as_tensor(rewards, dtype=torch.float32)
    P = prompt_len or int(torch.randint(1, 6, (1,), generator=g))
    ex = {"ref_logprobs": lp - 0.01} if extras else {}
    return GroupRecord(group_id=gid, prompt_ids=torch.randint(0, policy.vocab, (P,), generator=g),
                       completion_ids=ids, response_lengths=lengths, loss_mask=mask, logprobs=lp,
                       advantages=rewards - rewards.mean(), rewards=rewards, birth_step=step, extras=ex)


def policy_walk(t: int, *, seed: int = 1, step_size: float = 0.05, walk_seed: int = 1000) -> TablePolicy:
    """The policy after ``t`` training steps of a random walk in table space (older groups drift further)."""
    pol = TablePolicy(seed=seed)
    for s in range(1, t + 1):
        pol = pol.perturbed(step_size, seed=walk_seed + s)
    return pol


def fresh_groups(t: int, policy: TablePolicy, *, per_step: int = 5, seed: int = 0, **kw) -> list[GroupRecord]:
    """This step's groups, sampled under ``policy``: ids ``"t-i"``, every third response with tool tokens."""
    return [make_group(f"{t}-{i}", policy=policy, step=t, seed=seed * 997 + t * 31 + i, tool_every=i % 3, **kw)
            for i in range(per_step)]


@dataclass
class DrivenStep:
    """What one step of :func:`drive` did."""

    step: int
    policy: TablePolicy
    selection: Selection
    fresh: list[GroupRecord]
    admitted: list[bool]
    metrics: dict[str, float]


def drive(
    ctrl,
    steps: Iterable[int],
    *,
    policy_at: Callable[[int], TablePolicy] = policy_walk,
    fresh: Callable[[int, TablePolicy], list[GroupRecord]] = fresh_groups,
    select_first: bool = True,
) -> Iterator[DrivenStep]:
    """The select -> stage -> commit loop on synthetic groups (the one copy every test and tool uses).

    Each step: the policy of step t scores the pre-existing buffer (``select``), the fresh groups it
    generated are offered for ingress (``stage``), and the step is committed.  ``select_first=False``
    stages before selecting (the protocol allows either order).  Yields one :class:`DrivenStep` per step.
    """
    for t in steps:
        pol = policy_at(t)
        groups = fresh(t, pol)
        if select_first:
            sel = ctrl.select(step=t, scorer=pol.scorer)
            admitted = ctrl.stage(groups, step=t)
        else:
            admitted = ctrl.stage(groups, step=t)
            sel = ctrl.select(step=t, scorer=pol.scorer)
        yield DrivenStep(t, pol, sel, groups, admitted, ctrl.commit())


def run(ctrl, steps: Iterable[int], **kw) -> list[DrivenStep]:
    """:func:`drive` to the end; returns every step's record."""
    return list(drive(ctrl, steps, **kw))


def walkthrough(steps: int = 6, *, k_rep: int = 3, tau: float = 5e-3, capacity: int = 12, per_step: int = 4,
                selector: str = "headroom_drift", out=print) -> list[DrivenStep]:
    """Run the select -> stage -> commit protocol on synthetic groups and print every decision; returns the steps."""
    from hdreplay.config import ReplayConfig
    from hdreplay.controller import ReplayController

    n = 4  # responses per synthetic group (make_group's default); a rollout-unit selector needs the group size
    cfg = ReplayConfig(selector=selector, k_rep=k_rep, tau=tau, capacity=capacity, group_size=n)
    ctrl = ReplayController(cfg)
    rows = cfg.rows_per_unit  # 1, or n: a buffer of single rollouts counts its budgets in groups' worth of them
    out(f"Headroom-Drift Replay on synthetic groups: selector={selector}, K_rep={k_rep}, tau={tau}, C={capacity}")
    if rows > 1:
        out(f"  {selector} stores single rollouts, not groups: each response of an admitted group whose advantage is "
            f"not 0 is one unit ('<group>/<i>'); K_rep and C count groups' worth ({cfg.unit_budget} and "
            f"{cfg.unit_capacity} rollouts, {n} per group)")
    if not SELECTORS[selector].gate and SELECTORS[selector].order is not None:
        out(f"  {selector} has no Drift gate: tau is not used")
    draw = SELECTORS[selector].order
    if draw == "uniform":
        out(f"  {selector} draws its replay at random: uniformly, without replacement (seed {cfg.seed})")
    elif draw == "proportional":
        adv = SELECTORS[selector].priority == "advantage"
        out(f"  {selector} draws its replay at random, without replacement, each unit with probability proportional "
            f"to {'|A|' if adv else '(mean |r| + eps)'}^{cfg.priority_alpha:g} (priority_alpha"
            f"{': |A| is the rollout advantage' if adv else ''}): a higher priority is drawn more often, not always "
            f"first; the replayed list below is the draw, in order" + (", with each rollout's |A|" if adv else ""))

    def units(k: int, what: str = "") -> str:
        return f"{k} groups" if rows == 1 else f"{k} {what}rollouts ({k / rows:g} groups' worth)"

    def fresh(t, policy):
        return [make_group(f"{t}-{i}", policy=policy, step=t, seed=31 * t + i, n=n,
                           rewards=[1.0, 1.0, 1.0, 1.0] if i == 0 else None) for i in range(per_step)]

    done = []
    for st in drive(ctrl, range(steps), policy_at=lambda t: policy_walk(t, seed=1), fresh=fresh,
                    select_first=True):
        done.append(st)
        sel = st.selection
        out(f"\nstep {st.step}: buffer holds {units(sel.buffer_size)}")
        for i in range(len(sel.scanned)):
            verdict = "ACCEPT" if sel.scanned_pass[i] else f"reject (Drift > tau={tau:g})"
            out(f"  scan #{i + 1}: group {sel.scanned_group_ids[i]!r:8} age {int(sel.scanned_age[i])}  "
                f"cached H {sel.scanned_cached[i]:.3f} -> runtime H {sel.scanned_headroom[i]:.3f}  "
                f"Drift {sel.scanned_drift[i]:.5f}  {verdict}")
        if len(sel.scanned) == 0 and len(sel.accepted):
            out(f"  no scan (selector {selector} needs no scoring)")
        replay = [g.group_id for g in sel.groups]
        batch = f"{len(replay)} replay" if rows == 1 else units(len(replay), "replayed ")
        shown = replay
        if draw == "proportional" and SELECTORS[selector].priority == "advantage":
            shown = [f"{g.group_id} |A|={float(g.advantages.abs().mean()):.2f}" for g in sel.groups]
        out(f"  replayed {shown or 'nothing'}; actor batch = {batch} + {len(st.fresh)} fresh groups")
        out(f"  ingress: {sum(st.admitted)}/{len(st.fresh)} fresh groups admitted "
            f"(rejected {[g.group_id for g, a in zip(st.fresh, st.admitted) if not a]}: rewards all equal); "
            f"evicted {int(st.metrics['replay/evicted'])}" + (" rollouts" if rows > 1 else ""))
    return done
