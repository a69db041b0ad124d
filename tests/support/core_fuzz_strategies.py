"""The API fuzz extended to the strategy stores (RePO, ExGRPO, BAPO): every public call with each argument replaced by
an invalid value, and every load with each field of a saved state made invalid (tests/support/strategy_states.py).
Classification as in core_fuzz.py: refused (a ReplayError, the controller's snapshot unchanged), changed, unexpected
(any other exception), silent (an invalid input accepted), valid_failed (a valid call raised)."""

from __future__ import annotations

import copy
from typing import Callable

import torch

from core_fuzz import Counts
from hdreplay.baselines import bapo as B
from hdreplay.baselines import exgrpo as E
from hdreplay.baselines import repo as R
from hdreplay.errors import ReplayError
from strategy_states import BUILD, _group, bad_metas, snapshot

NAN, INF = float("nan"), float("inf")
BAD_INT = [-1, 1.5, True, "1", None, NAN, [1], 2**63]
BAD_STEP = BAD_INT + [2**53]


def classify(counts: Counts, label: str, obj, call: Callable, *, valid: bool) -> None:
    before = snapshot(obj) if obj is not None else None
    counts.calls += 1
    try:
        call(obj)
    except ReplayError as e:
        counts.types[type(e).__name__] += 1
        if valid:
            counts.note("valid_failed", f"{label}: {e}")
        elif obj is not None and snapshot(obj) != before:
            counts.note("changed", label)
        else:
            counts.refused += 1
        return
    except Exception as e:  # noqa: BLE001 - counting these is the point
        counts.types[type(e).__name__] += 1
        counts.note("valid_failed" if valid else "unexpected", f"{label}: {type(e).__name__}: {e}"[:200])
        return
    if not valid:
        counts.note("silent", label)


def _over(name: str, fn: Callable, valid: dict, bad: dict[str, list]) -> list[tuple[str, Callable, bool]]:
    out = [(f"{name}(valid)", lambda o, kw=valid: fn(o, **kw), True)]
    for arg, values in bad.items():
        for v in values:
            out.append((f"{name}({arg}={v!r:.50})", lambda o, kw={**valid, arg: v}: fn(o, **kw), False))
    return out


def pure_cases() -> list[tuple[str, Callable, bool]]:
    cases = []
    cases += _over("RepoOptions", lambda o, **kw: R.RepoOptions(**kw), {}, {
        "retrieval": ["random", None, 1], "num_replays": BAD_INT[:-1] + [0], "min_cache": [0, "2", 1.5],
        "max_cache": [0, None, True], "off_coef": [-1.0, NAN, INF, "1", True]})
    cases.append(("RepoOptions(min_cache > max_cache)", lambda o: R.RepoOptions(min_cache=5, max_cache=4), False))
    cases += _over("ExgrpoOptions", lambda o, **kw: E.ExgrpoOptions(**kw), {}, {
        "ratio": [0.0, 1.5, NAN, "0.5", True], "start_solved": [-0.1, 2.0, None], "gamma": [0.0, -1.0, INF],
        "sigma": [0, NAN], "correct": [NAN, "1", None], "lbound": [-1, 1.5, None], "rbound": [0, 1.5, "3"],
        "seed": [-1, 1.5, "0", True]})
    cases += _over("BapoOptions", lambda o, **kw: B.BapoOptions(**kw), {}, {
        "bad_thr": [-0.1, 1.5, "0.1", None, True], "target_range": [(0.5, 0.1), (0, 2), "x", (0.1,), None],
        "train_range": [(1, 0), [None, 1]], "reeval_every": [0, 1.5, "2"], "max_reeval": [-1, None],
        "max_uids": [0, 2.0], "max_target": [-1, 10**6], "stale_steps": [-1, "3"], "seed": [-1, None, 1.5]})
    cases += _over("retrieve", lambda o, **kw: R.retrieve(**kw),
                   {"rewards": [1.0, 0.0, 1.0], "rule": "highest", "k": 2},
                   {"rewards": [None, "ab", [NAN, 0.0], [[1.0]], 3], "rule": ["x", None, 1],
                    "k": [-1, 1.5, "2", None, True]})
    cases += _over("max_variance_subset", lambda o, **kw: R.max_variance_subset(**kw), {"rewards": [1, 0, 1], "k": 2},
                   {"rewards": [None, "ab", [NAN, 1]], "k": [-1, 4, 1.5, None]})
    cases += _over("split_advantages", lambda o, **kw: R.split_advantages(**kw), {"rewards": torch.tensor([1.0, 0.0])},
                   {"rewards": [None, [1.0, 0.0], torch.tensor([NAN, 1.0]), torch.zeros(2, 2), torch.zeros(0)]})
    lp = -torch.rand(2, 3)
    cases += _over("shaped_token_loss", lambda o, **kw: E.shaped_token_loss(**kw),
                   {"logps": lp, "stored_logps": lp, "advantages": torch.ones(2), "gamma": 0.1},
                   {"logps": [lp[0], None, lp.numpy()], "stored_logps": [lp[:, :2]], "advantages": [torch.ones(3)],
                    "gamma": [0.0, -1.0, NAN, "0.1", None]})
    cases += _over("mean_entropies", lambda o, **kw: E.mean_entropies(**kw),
                   {"entropies": torch.rand(2, 3), "mask": torch.ones(2, 3)},
                   {"entropies": [None, torch.rand(3), torch.rand(2, 3).numpy()], "mask": [torch.ones(2, 2), None]})
    cases += _over("pick", lambda o, **kw: E.ExgrpoController.pick(**kw), {"entropies": [0.3, 0.1]},
                   {"entropies": [[], None, "ab", [[1.0]], [NAN]]})
    cases += _over("ExgrpoController", lambda o, **kw: E.ExgrpoController(**kw),
                   {"options": E.ExgrpoOptions(), "n": 4, "seed": 0},
                   {"options": [None, {}, R.RepoOptions()], "n": [1, 1.5, "4", None], "seed": [-1, "0", None]})
    cases.append(("ExgrpoController(rbound > n)", lambda o: E.ExgrpoController(E.ExgrpoOptions(rbound=9), n=4), False))
    cases += _over("RepoController", lambda o, **kw: R.RepoController(**kw), {"options": R.RepoOptions()},
                   {"options": [None, {}, B.BapoOptions()]})
    cases += _over("BapoController", lambda o, **kw: B.BapoController(**kw), {"options": B.BapoOptions()},
                   {"options": [None, {"seed": 1}]})
    return cases


def _groups(step):
    """Two fresh groups of ``step`` (n = N), ids as the TRL integration names them."""
    return [_group(f"s{step}.0g{i}", step, [1, 0, 1, 0], [1 + i, 2]) for i in range(2)]


def state_cases(kind: str, tmp) -> list[tuple[str, Callable, bool]]:
    """Calls on a driven controller of ``kind`` (each case runs on a copy)."""
    cases = []
    bad_groups = [None, "x", [1], [None], _groups(9)[0]]
    step = 3  # the next step of the driven controllers (steps 0..2)

    def m(name):
        return lambda o, **kw: getattr(o, name)(**kw)

    cases += _over(f"{kind}.select", m("select"), {"step": step}, {"step": BAD_STEP})
    cases += _over(f"{kind}.commit", m("commit"), {}, {"num_fresh_groups": [-1, 1.5, "2", True],
                                                      "counters": ["x", [1]]})
    if kind == "repo":
        ids = torch.tensor([[1, 2], [1, 2]])
        cases += _over("repo.observe_batch", m("observe_batch"),
                       {"prompt_ids": ids, "prompt_mask": torch.ones_like(ids)},
                       {"prompt_ids": [None, ids[0], ids.numpy()], "prompt_mask": [None, torch.ones(3, 2)]})
        cases += _over("repo.stage", m("stage"), {"groups": _groups(step), "step": step},
                       {"groups": bad_groups, "step": BAD_STEP})
        cases += _over("repo.store.add", lambda o, **kw: o.store.add(**kw),
                       {"key": "1,2", "responses": []}, {"key": [None, 1], "responses": [None, _groups(9)]})
        cases += _over("repo.store.retrieve", lambda o, **kw: o.store.retrieve(**kw), {"key": "1,2"},
                       {"key": [None, 1, ["1,2"]]})
    if kind == "exgrpo":
        cases += _over("exgrpo.stage", m("stage"), {"groups": _groups(step), "step": step},
                       {"groups": bad_groups + [[_group("s3.0g0", step, [1, 0], [1, 2])]], "step": BAD_STEP + [1]})
        cases += _over("exgrpo.plan", m("plan"), {"prompts": 4}, {"prompts": BAD_INT})
        cases += [(f"exgrpo.candidates({k!r})", lambda o, k=k: o.candidates(k), False) for k in (None, "nope", 1)]
        cases += _over("exgrpo.remember", m("remember"), {"key": "9,9", "row": {"prompt": "p"}}, {"key": [None, 1]})
        cases += _over("exgrpo.note_injected", m("note_injected"), {"rows": 1, "rescored": 0},
                       {"rows": BAD_INT, "rescored": [-1, None]})
    if kind == "bapo":
        fresh = [B.Fresh("u9.0", {"prompt": "p"}, [1, 0, 0, 0], 0)]
        cases += _over("bapo.plan", m("plan"), {"fresh": fresh, "budget": 1, "counters": {}},
                       {"fresh": [None, [1], "x"], "budget": BAD_INT, "counters": [None, {"a": "x"}, [1]]})
        cases += _over("bapo.stage", m("stage"), {"groups": _groups(step), "step": step},
                       {"groups": bad_groups + [[_group("nopos", step, [1, 0, 0, 0], [1])]], "step": BAD_STEP + [1]})
        cases += _over("bapo.reeval_candidates", m("reeval_candidates"), {"step": 3}, {"step": BAD_STEP})
        cases += [(f"bapo.record_reeval({u!r}, {r!r:.30})", lambda o, u=u, r=r: o.record_reeval(u, r), False)
                  for u, r in (("nope", [1, 0]), (None, [1]), ("u2.1", None), ("u2.1", []), ("u2.1", [NAN]),
                               ("u2.1", "ab"), ("u2.1", [[1]]))]
        cases += _over("bapo.pick", m("pick"), {"items": [1, 2, 3], "k": 2}, {"items": [None, 3], "k": BAD_INT})
    cases += _over(f"{kind}.save", m("save"), {"directory": tmp / f"{kind}_ok"},
                   {"directory": [tmp / "afile" / "x", tmp / "afile"]})
    (tmp / "ck_ok").mkdir(exist_ok=True)
    BUILD[kind]().save(tmp / "ck_ok" / kind)
    other = {"repo": "exgrpo", "exgrpo": "bapo", "bapo": "repo"}[kind]
    BUILD[other]().save(tmp / "ck_ok" / other)
    cases += _over(f"{kind}.load", m("load"), {"directory": tmp / "ck_ok" / kind},
                   {"directory": [tmp / "missing", tmp / "afile", tmp / "ck_ok" / other, tmp]})
    tensors, meta = BUILD[kind]().state_dict()
    cases += [(f"{kind}.load_state_dict({label})", lambda o, m_=bad: o.load_state_dict(tensors, m_), False)
              for label, bad in bad_metas(kind, meta)]
    cases += [(f"{kind}.load_state_dict(tensors={i})", lambda o, t=t: o.load_state_dict(t, meta), False)
              for i, t in enumerate(_bad_tensors(tensors))]
    cases.append((f"{kind}.load_state_dict(valid)", lambda o: o.load_state_dict(tensors, meta), True))
    return cases


def _bad_tensors(tensors: dict) -> list:
    out = [None, "t", {1: torch.zeros(1)}, {**tensors, "surprise.x": torch.zeros(1)}]
    for k in sorted(tensors)[:12]:
        t = tensors[k]
        out.append({**tensors, k: t[:-1] if t.numel() > 1 else t.float()})
        out.append({**tensors, k: t.numpy()})
        if t.is_floating_point():
            out.append({**tensors, k: t.masked_fill(torch.ones_like(t, dtype=torch.bool), NAN)})
    return out


def run_strategy_cases(tmp) -> Counts:
    counts = Counts()
    (tmp / "afile").write_text("not a directory")
    for label, call, valid in pure_cases():
        classify(counts, label, None, call, valid=valid)
    for kind in BUILD:
        base = BUILD[kind]()
        for label, call, valid in state_cases(kind, tmp):
            classify(counts, label, copy.deepcopy(base), call, valid=valid)
    return counts

