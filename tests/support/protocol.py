"""The select -> stage -> commit loop of the core tests, on top of the one driver (hdreplay_lab.synthetic.drive)."""

from __future__ import annotations

from functools import partial

from hdreplay import ReplayController
from hdreplay_lab.synthetic import drive, fresh_groups, policy_walk

#: the moving table policy of every core test: a random walk from TablePolicy(seed=1)
policy_at = policy_walk


def fresh(t, k=5, seed=0, **kw):
    """The fresh groups step t generates (``"t-i"``), under the policy of step t."""
    return fresh_groups(t, policy_at(t), per_step=k, seed=seed, **kw)


def run_steps(ctrl, steps, k=5, log=None, seed=0):
    """Drive ``ctrl`` over ``steps``; with ``log``, append (replayed ids, scanned ids, metrics) per step."""
    for st in drive(ctrl, steps, fresh=partial(fresh_groups, per_step=k, seed=seed)):
        if log is not None:  # NaN -> None so that logs compare with ==
            log.append(([g.group_id for g in st.selection.groups], st.selection.scanned.tolist(),
                        {key: (None if v != v else v) for key, v in st.metrics.items()}))
    return ctrl


def build(config, steps=6, per_step=5, seed=0):
    """A controller driven for ``steps`` steps and the policy of the next step."""
    return run_steps(ReplayController(config), range(steps), k=per_step, seed=seed), policy_at(steps)
