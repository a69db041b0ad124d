"""The select -> stage -> commit loop of the core tests, on top of the one driver (hdreplay_lab.synthetic.drive)."""

from __future__ import annotations

import hashlib
import json
from functools import partial

import numpy as np
import torch

from hdreplay import ReplayController, group_scores
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


def buffer_hash(buf) -> str:
    """sha256 of everything a ReplayBuffer holds (its exact state_dict)."""
    tensors, meta = buf.state_dict()
    return _digest(tensors, meta)


def state_hash(ctrl) -> str:
    """sha256 of everything a ReplayController holds: the committed state and the open step's protocol state."""
    tensors, meta = ctrl.state_dict(allow_open_step=True)
    staged = [(g.group_id, g.completion_ids.tolist(), g.logprobs.tolist(), g.advantages.tolist())
              for g in ctrl._staged]
    sel = ctrl._selection
    proto = (ctrl._open_step, None if sel is None else (sel.accepted.tolist(), sel.scanned.tolist()), staged,
             ctrl._staged_ref, ctrl._candidates, ctrl._starved_steps, ctrl.tau)
    return _digest(tensors, meta, proto)


def _digest(tensors, meta, extra=None) -> str:
    h = hashlib.sha256(json.dumps(meta, sort_keys=True, default=repr).encode())
    for k in sorted(tensors):
        h.update(f"{k}:{tensors[k].dtype}:{tuple(tensors[k].shape)}".encode())
        t = tensors[k].contiguous()
        h.update((t.view(torch.int16) if t.dtype == torch.bfloat16 else t).numpy().tobytes())  # numpy has no bf16
    h.update(repr(extra).encode())
    return h.hexdigest()


def reference_scan(ctrl, policy, K, tau, gate=True, order="headroom", norm="l2"):
    """The paper's loop, one group at a time, each forwarded whole, over the full buffer order: (accepted ids,
    scanned ids, {id: (drift, headroom)})."""
    buf = ctrl.buffer
    ids = buf.insertion_ids()
    if order == "headroom":
        key = buf.slot_values("cached_headroom", ids)
        ordered = ids[np.lexsort((ids, -key))]
    else:
        ordered = ids[::-1]
    accepted, scanned, scores = [], [], {}
    for i in ordered.tolist():
        if len(accepted) >= K:
            break
        g = buf.get([i])[0]
        sc = group_scores([g], [policy.token_logprobs(g.completion_ids, g.response_lengths)], drift_norm=norm)
        d = float(sc.drift[0])
        scanned.append(i)
        scores[i] = (d, float(sc.headroom[0]))
        if not gate or d <= tau:
            accepted.append(i)
    return accepted, scanned, scores


def untimed(records):
    """Step records (dicts, as steps.jsonl holds them) without their wall-clock fields: what a rerun reproduces."""
    from hdreplay.records import TIMING_FIELDS

    return [{k: v for k, v in r.items() if k not in TIMING_FIELDS} for r in records]


def log_lines(path):
    """A diagnostics log (steps.jsonl, async.jsonl, groups.jsonl) as its records, wall-clock seconds left out."""
    import json

    return untimed(json.loads(line) for line in open(path))
