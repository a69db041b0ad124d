"""The case table of the API fuzz (tests/support/core_fuzz.py): for every public call, a valid call and
the invalid values each argument must refuse, plus corrupted state dicts for the loaders."""

from __future__ import annotations

import copy
import zlib
from typing import Callable

import numpy as np
import torch

import hdreplay as H
import hdreplay.diagnostics as D
from hdreplay.integrations import layout as L
from hdreplay_lab.synthetic import TablePolicy, make_group
from protocol import policy_at

NAN, INF = float("nan"), float("inf")
POL = TablePolicy()
#: values no int argument (step, count, id, limit) accepts
BAD_INT = [-1, 2**63, 1.5, True, "1", None, NAN, [1], np.float64(2.0), torch.tensor(1)]
BAD_STEP = BAD_INT + [2**53]
BAD_REAL = [NAN, INF, -INF, "0.5", True, None, [0.5], 1j]
BAD_NAME = ["nope", None, 1, ["sign"], b"sign"]
BAD_IDS = [[10**6], [-5], [1.5], [True], "0", None, 3, np.array([0.0]), np.array([[0]]), [0, 0]]


def group(gid, step=0, n=4, **kw):
    seed = zlib.crc32(str(gid).encode()) % 1000  # not hash(): it is salted per process
    return make_group(gid, policy=POL, step=step, n=n, seed=seed, **kw)


def record_kwargs(**over) -> dict:
    kw = dict(group_id="g", prompt_ids=[1, 2], completion_ids=[3, 4, 5, 6, 7], response_lengths=[2, 3],
              loss_mask=[1, 1, 1, 0, 1], logprobs=[-0.1, -0.2, -0.3, -0.4, -0.5], advantages=[1.0, -1.0],
              rewards=[1.0, 0.0], birth_step=0)
    kw.update(over)
    return kw


# ---------------------------------------------------------------------------------------------- cases
def _over(fn: Callable, valid: dict, bad: dict[str, list]) -> list[tuple[str, Callable, bool]]:
    """The valid call plus one case per (argument, bad value)."""
    out = [(f"{fn.__qualname__}(valid)", lambda fx, kw=valid: fn(**kw), True)]
    for arg, values in bad.items():
        for v in values:
            out.append((f"{fn.__qualname__}({arg}={v!r:.60})", lambda fx, kw={**valid, arg: v}: fn(**kw), False))
    return out


def pure_cases() -> list[tuple[str, Callable, bool]]:
    cases = []
    cases += _over(H.ReplayConfig, {}, {
        "selector": BAD_NAME, "k_rep": [-1, 2**24 + 1, 2.0, True, "64", None, NAN],
        "tau": [-1e-3, NAN, INF, "0.1", True, None, [0.1]],
        "capacity": [0, -1, 10**11, 1e11, 2**24 + 1, True, "512", None, 512.0],
        "drift_norm": BAD_NAME, "headroom_weighting": BAD_NAME, "ingress": ["positive", None, 3, ["mixed"]],
        "answer_threshold": ["0.9", NAN, INF, True, [0.9]], "truncate_multiple": [0, -1, 2.0, True, "2", 2**24 + 1],
        "scan_chunk": [0, -1, 2.0, True, "8"], "max_scan_chunk": [0, None, 1.5, True],
        "scan_tokens": [0, -1, 2.0, True, "4096", 2**40 + 1],
        "max_scan": [0, -1, 2**24 + 1, 2.0, "8"], "acceptance_ema": [0, 0.0, -0.1, 1.5, NAN, INF, True, "0.5", None],
        "group_size": [0, -1, 2.0, True, "8"],
    })
    cases += _over(D.DiagnosticsConfig, {}, {"diagnose_ungated": [1, 0, "True", None],
                                             "counterfactual": [1, "False", None],
                                             "adaptive_tau": ["x", 1, True, "{bad json", {"warmup": NAN}, {"nope": 1}]})
    cases.append(("ReplayConfig(ingress=answer, no threshold)", lambda fx: H.ReplayConfig(ingress="answer"), False))
    cases.append(("observers(tau outside adaptive bounds)",
                  lambda fx: D.observers(D.DiagnosticsConfig(adaptive_tau=D.AdaptiveTau()), H.ReplayConfig(tau=1.0)),
                  False))
    cases += _over(H.ReplayConfig.from_flat, {"values": {"tau": 0.01}}, {"values": [
        {"tau": "0.1"}, {"unknown": 1}, [("tau", 1)], None, {"adaptive_tau": {"tau_min": 1e-4}}, {"k_rep": True},
        {1: 2}]})
    cases += _over(D.AdaptiveTau, {}, {
        "tau_min": [0.0, -1.0, NAN, "1e-4", True, None], "tau_max": [INF, NAN, 1e-5],
        "factor": [1.0, 0.5, NAN, "2"], "accept_low": [1.0, -0.1, NAN], "kl_rise": [0.0, -1, INF],
        "fast": [0.01, 1.5, NAN], "slow": [0.0, 0.5], "patience": [-1, 1.5, NAN, True, 2**53],
        "warmup": [-1, 2.5, NAN, INF, "5", None]})
    st, at = D.TauState(tau=1e-3), D.AdaptiveTau()
    cases += _over(D.update_tau, {"state": st, "record": {"accept_rate": 0.5}, "cfg": at}, {
        "state": [None, {"tau": 1e-3}], "cfg": [None, {"tau_min": 1}],
        "record": [None, 3, {"accept_rate": NAN}, {"accept_rate": 2.0}, {"replay_kl": -1.0}, {"replay_kl": "x"},
                   {"budget_fill": INF}]})
    # a fixed tau may be 0 (TauState holds it); the multiplicative schedule is what refuses to move it
    cases += _over(D.advance_tau, {"state": st, "cfg": at, "accept_rate": 0.5, "budget_fill": 0.5, "replay_kl": None},
                   {"state": [D.TauState(tau=0.0)]})
    cases += _over(D.TauState, {"tau": 1e-3}, {"tau": [-1.0, -1e-300, NAN, INF, "x", None], "steps": [-1, 1.5, True],
                                                "last_action": ["jump", None], "accept_ema": [NAN, -0.5]})
    cases += _over(H.AnswerBased, {"threshold": 0.9}, {"threshold": ["0.9", NAN, None, True, INF]})
    cases += _over(H.make_ingress_rule, {"rule": "mixed"}, {"rule": [3, None, "x", ["mixed"]]})
    cases.append(("make_ingress_rule(answer, threshold='0.9')",
                  lambda fx: H.make_ingress_rule("answer", answer_threshold="0.9"), False))
    for rule in (H.MixedOutcome(), H.AnswerBased(0.5)):
        for v in (None, {}, torch.tensor([1.0, 0.0])):
            cases.append((f"{type(rule).__name__}()({v!r:.30})", lambda fx, r=rule, v=v: r(v), False))
    cases += _over(H.GroupRecord, record_kwargs(), {
        "group_id": [1.5, None, True, np.int64(1), b"g", ("g",)],
        "prompt_ids": [[], [-1], [2**31], [2**33 + 7], [1.5], "ab", None, [[1, 2]], [2**70], [True, False]],
        "completion_ids": [[3, 4, 5, 6, -7], [3, 4, 5, 6, 2**33 + 7], [3.0, 4, 5, 6, 7], [3, 4, 5, 6]],
        "response_lengths": [[0, 5], [2, 2], [-1, 6], [2.0, 3.0], None, [[2, 3]]],
        "loss_mask": [[2, 1, 1, 1, 1], [0.5] * 5, [0] * 5, [1, 1, 1], "11111"],
        "logprobs": [[-0.1, NAN, -0.3, -0.4, -0.5], [-0.1, 0.5, -0.3, -0.4, -0.5], [-INF] * 5, "x", [-0.1] * 4],
        "advantages": [[NAN, 0.0], [1.0], "x", [INF, 0.0]], "rewards": [[NAN, 0.0], [1.0, 0.0, 1.0], None],
        "birth_step": [-1, 2**53, 1.0, True, "0", None],
        "extras": [{"k": [NAN] * 5}, {1: [0.0] * 5}, {"k": [0.0] * 4}, [("k", [0.0] * 5)], "x"],
    })
    fr = dict(group_id="x", prompt_ids=[1], completion_ids=[[1], [2, 3]], logprobs=[[-0.1], [-0.2, -0.3]],
              advantages=[1, -1], rewards=[1, 0], birth_step=0)
    cases += _over(H.GroupRecord.from_responses, fr, {
        "completion_ids": [None, "ab", [[1.5], [2, 3]], [[-1], [2, 3]]],
        "logprobs": [[[-0.1]], None, [[0.5], [-1, -1]]],
        "loss_masks": [[[1]], [[2], [1, 1]], "x"], "extras": [{"k": [[NAN], [0, 0]]}, [1]]})
    fp = dict(group_id=1, prompt_ids=[1], completion_ids=torch.tensor([[3, 4, 5]]), completion_mask=torch.ones(1, 3),
              logprobs=-torch.ones(1, 3), advantages=[0.0], rewards=[0.0], birth_step=0)
    cases += _over(H.GroupRecord.from_padded, fp, {
        "completion_ids": [torch.tensor([3, 4, 5]), None, torch.tensor([[3.5, 4, 5]])],
        "completion_mask": [torch.tensor([[1, 0, 1]]), torch.full((1, 3), 0.5), None],
        "logprobs": [-torch.ones(1, 2), None], "loss_mask": [torch.full((1, 3), 3)], "extras": [[1], {"k": None}]})
    lp, mask = -torch.rand(2, 3) - 0.1, torch.ones(2, 3)
    bad_lp = [lp.numpy(), lp.tolist(), lp[0], torch.zeros(2, 3, dtype=torch.long), lp.masked_fill(mask.bool(), NAN),
              lp + 2.0, torch.full((2, 3), -INF), None]
    bad_mask = [mask.numpy(), torch.full((2, 3), 0.5), torch.ones(2, 2), torch.tensor([[1, 1, 1], [0, 0, 0]]), None]
    for fn, other in ((H.drift, "ref_logprobs"), (H.replay_kl, "ref_logprobs"), (H.replay_kl_per_group, "ref_logprobs"),
                      (H.headroom, "advantages")):
        kw = {"logprobs": lp, other: lp if other == "ref_logprobs" else torch.randn(2, 3), "mask": mask}
        bad = {"logprobs": bad_lp, "mask": bad_mask,
               other: (bad_lp if other == "ref_logprobs" else
                       [torch.randn(2, 3).numpy(), torch.full((2, 3), NAN), torch.randn(2, 2), None])}
        if fn is H.drift:
            bad["norm"] = BAD_NAME
        if fn is H.headroom:
            bad["weighting"] = BAD_NAME
        cases += _over(fn, kw, bad)
    cases += _over(H.scores.token_headroom, {"logprobs": lp, "advantages": torch.randn(2, 3)},
                   {"logprobs": bad_lp, "advantages": [torch.randn(2, 3).numpy(), torch.randn(3), None],
                    "weighting": BAD_NAME})
    gs = [group("a"), group("b")]
    cur = [g.logprobs.clone() for g in gs]
    cases += _over(H.group_scores, {"groups": gs, "current_logprobs": cur}, {
        "groups": [None, "x", [1], gs[:1]], "current_logprobs": [[c.numpy() for c in cur], None, cur[:1],
                                                                  [c.long() for c in cur], [c[:-1] for c in cur],
                                                                  [c.fill_(NAN) for c in [x.clone() for x in cur]]],
        "drift_norm": BAD_NAME, "headroom_weighting": BAD_NAME})
    cases += _over(H.reference_headroom, {"groups": gs}, {"groups": [None, "x", [1]], "weighting": BAD_NAME})
    cases += _over(H.pad_groups, {"groups": gs, "pad_token_id": 0}, {
        "groups": [[], None, [1], "ab", [gs[0], group("c", extras=True)]],
        "pad_token_id": [-1, 2**31, 1.5, True, None]})
    pg = H.pad_groups(gs, pad_token_id=0)
    cases += _over(pg.split_by_group, {"values": torch.zeros(pg.num_rows, 20)}, {
        "values": [np.zeros((pg.num_rows, 20)), torch.zeros(pg.num_rows), torch.zeros(pg.num_rows, 1), None]})
    cases += _over(L.truncate_to_multiple, {"items": [1, 2, 3], "u": 2}, {"items": ["abc", None, 5],
                                                                           "u": [0, -1, 2.0, True, "2", None]})
    cases += _over(L.balanced_partition, {"lengths": [3, 1, 2, 2], "parts": 2}, {
        "lengths": [[1.5, 2], [-1, 2], ["3", 1], [True, 1], None, "ab"], "parts": [0, 10**6, 2.0, True, None]})
    cases += _over(L.minibatch_layout, {"replay_lengths": [1, 2], "fresh_lengths": [3, 4], "num_minibatches": 2,
                                        "parts": 1},
                   {"replay_lengths": [None, [1.5, 2]], "num_minibatches": [0, 2.0, 3, None], "parts": [0, 2**20]})
    cases += _over(H.ReplayBuffer, {"capacity": 8}, {"capacity": [0, 10**11, 1e11, True, None, "8"],
                                                     "group_size": [0, 1.5, True, "4"]})
    cases += _over(H.metrics_from_record, {"rec": {"accepted": 1}}, {"rec": [None, 3, {"accepted": "x"}],
                                                                     "prefix": [None, 1]})
    return cases


def state_cases(fx, tmp) -> list[tuple[str, str, Callable, bool]]:
    """(fixture kind, label, call, valid) for calls on a buffer or controller."""
    out = []

    def add(kind, fn_name, valid_kw, bad):
        def call(obj, kw, name=fn_name):
            return getattr(obj, name)(**kw)
        out.append((kind, f"{fn_name}(valid)", lambda o, kw=valid_kw: call(o, kw), True))
        for arg, values in bad.items():
            for v in values:
                out.append((kind, f"{kind}.{fn_name}({arg}={v!r:.60})",
                            lambda o, kw={**valid_kw, arg: v}: call(o, kw), False))

    live = fx.buf.insertion_ids()
    i0 = int(live[0])
    add("buf", "append", {"records": [group("n1", step=5)], "ref_headroom": [0.5], "step": 5}, {
        "records": [None, "x", [1], [group("n2", 5), group("n2", 5)], [group("n3", 5, n=3)],
                    [group("n4", 5, extras=True)], [fx.buf.get([i0])[0]], group("n5", 5)],
        "ref_headroom": [[NAN], ["a"], [0.1, 0.2], None, np.array(["a"]), [INF]], "step": BAD_STEP})
    add("buf", "refresh", {"ids": [i0], "values": [0.5], "step": 5},
        {"ids": BAD_IDS, "values": [[NAN], [0.1, 0.2], "x", None], "step": BAD_STEP})
    add("buf", "record_use", {"ids": [i0], "weight": 0.5}, {"ids": BAD_IDS, "weight": [0, -0.5, 1.5] + BAD_REAL})
    add("buf", "add_exposure", {"ids": [i0], "weight": 0.5}, {"ids": BAD_IDS, "weight": [0, 2.0] + BAD_REAL})
    add("buf", "slot_values", {"name": "exposure", "ids": [i0]}, {"name": BAD_NAME, "ids": BAD_IDS[:-1]})
    add("buf", "get", {"ids": [i0]}, {"ids": BAD_IDS[:-1]})
    add("buf", "group_id", {"insertion_id": i0}, {"insertion_id": [10**6, -1, 1.5, True, None, "0"]})
    add("buf", "order_by_cached_headroom", {"limit": 3}, {"limit": [-1, 1.5, True, None, "3"]})
    add("buf", "order_by_recency", {"limit": 3}, {"limit": [-1, 1.5, True, None, "3"]})
    add("buf", "lifetime_record", {"insertion_id": i0}, {"insertion_id": [10**6, -1, 1.5, None],
                                                         "evicted_step": [v for v in BAD_STEP if v is not None]})
    add("buf", "save", {"directory": tmp / "buf_ok"}, {"directory": [None, 1, tmp / "afile" / "x"]})
    tensors, meta = fx.buf.state_dict()
    add("buf", "load_state_dict", {"tensors": tensors, "meta": meta},
        {"meta": _bad_buffer_metas(meta), "tensors": _bad_tensors(tensors)})
    sc = policy_at(4).scorer
    bad_scorers = [1, "x", lambda gs: None, lambda gs: [g.logprobs.numpy() for g in gs],
                   lambda gs: [g.logprobs.long() for g in gs], lambda gs: [g.logprobs[:-1] for g in gs],
                   lambda gs: [g.logprobs.abs() + 0.5 for g in gs], lambda gs: [g.logprobs * NAN for g in gs],
                   lambda gs: sc(gs)[:-1], lambda gs: torch.stack([x[:1] for x in sc(gs)])]
    add("ctrl", "select", {"step": 4, "scorer": sc}, {"step": BAD_STEP + [3], "scorer": bad_scorers})
    fresh4 = [group("s1", 4), group("s2", 4)]
    add("ctrl", "stage", {"groups": fresh4, "step": 4}, {
        "groups": [None, "x", [1], [group("s3", 3)], [group("s4", 4), group("s4", 4)], [group("s5", 4, n=3)],
                   tuple([group("s6", 4, extras=True)]), fresh4[0]], "step": BAD_STEP + [3]})
    add("open", "stage", {"groups": [group("o1", 4)], "step": 4}, {"step": [5, 3] + BAD_STEP,
                                                                   "groups": [[group("o2", 5)], None]})
    for st in (4, 5):  # a second selection in the open step, or a selection for another step
        out.append(("open", f"open.select(step={st})", lambda o, st=st: o.select(step=st, scorer=sc), False))
    add("open", "commit", {"num_fresh_groups": 3}, {"num_fresh_groups": [v for v in BAD_INT if v is not None]})
    add("ctrl", "state_dict", {"allow_open_step": False}, {"allow_open_step": ["yes", 1, None]})
    add("open", "state_dict", {"allow_open_step": True}, {"allow_open_step": [False]})
    add("ctrl", "save", {"directory": tmp / "ctrl_ok"}, {"directory": [None, 1, tmp / "afile" / "x"],
                                                         "allow_open_step": ["no"]})
    fx.ctrl.save(tmp / "ctrl_ok")
    fx.buf.save(tmp / "buf_only")
    add("ctrl", "load", {"directory": tmp / "ctrl_ok"}, {"directory": [None, tmp / "missing", tmp / "afile",
                                                                       tmp / "buf_only", tmp]})
    out.append(("open", "open.load(while a step is open)", lambda o: o.load(tmp / "ctrl_ok"), False))
    out.append(("ctrl", "ctrl.commit(without an open step)", lambda o: o.commit(), False))
    ct, cm = fx.state
    add("ctrl", "load_state_dict", {"tensors": ct, "meta": cm},
        {"meta": _bad_controller_metas(cm), "tensors": _bad_tensors(ct)})
    return out


def _edit(d: dict, path: tuple, value) -> dict:
    d = copy.deepcopy(d)
    target = d
    for k in path[:-1]:
        target = target[k]
    if value is _DELETE:
        del target[path[-1]]
    else:
        target[path[-1]] = value
    return d


_DELETE = object()


def _bad_buffer_metas(meta: dict) -> list[dict]:
    size = meta["size"]
    edits = [
        (("capacity",), 13), (("capacity",), True), (("size",), size + 1), (("size",), -1), (("size",), "3"),
        (("next_id",), size - 1), (("next_id",), "abc"), (("group_ids",), meta["group_ids"][:-1]),
        (("group_ids",), [meta["group_ids"][0]] * size), (("group_ids",), [True] * size),
        (("group_ids",), [1.5] * size), (("birth_steps",), meta["birth_steps"][:-1]),
        (("birth_steps",), [-1] * size), (("birth_steps",), ["0"] * size), (("extras_keys",), None),
        (("extras_keys",), ["b", "a"]), (("extras_keys",), "ref"), (("group_size",), 3), (("group_size",), 0),
        (("birth_steps", 0), meta["birth_steps"][0] + 1), (("next_id",), meta["next_id"] + 1),
    ] + [((k,), _DELETE) for k in meta]
    return [_edit(meta, p, v) for p, v in edits] + [None, [], "meta"]


def _bad_tensors(tensors: dict) -> list[dict]:
    t = {k: v.clone() for k, v in tensors.items()}
    out = []

    def mut(key, fn):
        d = {k: v.clone() for k, v in t.items()}
        d[key] = fn(d[key])
        out.append(d)

    mut("tokens", lambda x: x.to(torch.int64))
    mut("tokens", lambda x: x.index_fill(0, torch.tensor([0]), -1))
    mut("prompt", lambda x: x[:-1])
    mut("loss_mask", lambda x: x.index_fill(0, torch.tensor([0]), 2))
    mut("loss_mask", lambda x: torch.zeros_like(x))
    mut("logprobs", lambda x: x.index_fill(0, torch.tensor([0]), 0.5))
    mut("logprobs", lambda x: x.index_fill(0, torch.tensor([0]), NAN))
    mut("advantages", lambda x: x.index_fill(0, torch.tensor([0]), INF))
    mut("rewards", lambda x: x[:-1])
    mut("resp_len", lambda x: x.index_fill(0, torch.tensor([0]), 0))
    mut("tok_off", lambda x: x.flip(0))
    mut("prompt_off", lambda x: x + 1)
    mut("resp_off", lambda x: x.to(torch.int32))
    mut("slot.cached_headroom", lambda x: x.index_fill(0, torch.tensor([0]), NAN))
    mut("slot.insertion_id", lambda x: x + 1)
    mut("slot.num_loss_tokens", lambda x: x + 1)
    mut("slot.exposure", lambda x: -x - 1)
    mut("slot.replay_count", lambda x: x[:-1])
    mut("slot.birth_step", lambda x: x.float())
    mut("tokens", lambda x: x.reshape(1, -1))
    out.append({k: v for k, v in t.items() if k != "logprobs"})
    out.append({**t, "surprise": torch.zeros(1)})
    out.append({**t, "tokens": t["tokens"].numpy()})
    out.append(None)
    return out


def _bad_controller_metas(meta: dict) -> list[dict]:
    edits = [
        (("last_step",), "abc"), (("last_step",), -1), (("last_step",), 2**53), (("last_step",), None),
        (("last_step",), 1), (("acceptance_rate",), NAN), (("acceptance_rate",), 2.0), (("acceptance_rate",), "1"),
        (("config", "capacity"), 13), (("config", "headroom_weighting"), "advantage"), (("config",), "cfg"),
        (("observers",), [1]), (("observers",), {1: {}}), (("starved_steps",), -1),
        (("starved_steps",), 1.5),
    ] + [((k,), _DELETE) for k in ("buffer", "acceptance_rate", "last_step", "config")]
    out = [_edit(meta, p, v) for p, v in edits]
    out += [{**meta, "buffer": b} for b in _bad_buffer_metas(meta["buffer"])]
    return out + [None, "meta"]
