"""Strategy controllers (RePO, ExGRPO, BAPO) driven into a non-trivial state, a snapshot of everything they hold,
the way a checkpoint's ``state.json`` can be edited without a checksum refusing it (a manifest re-signed after the
edit), and hdreplay 0.1's layout 1 (no manifest), which is no longer read.

Used by tests/core/test_strategy_state.py and the strategy cases of the API fuzz (core_fuzz_strategies.py)."""

from __future__ import annotations

import copy
import hashlib
import json
import zlib
from pathlib import Path

import torch

from hdreplay.baselines.bapo import BapoController, BapoOptions, Fresh
from hdreplay.baselines.exgrpo import ExgrpoController, ExgrpoOptions
from hdreplay.baselines.repo import RepoController, RepoOptions, key_of
from hdreplay.checkpoint.files import MANIFEST_FILE, STATE_FILE, TENSORS_FILE, _manifest_digest
from hdreplay.store.record import GroupRecord
from hdreplay_lab.synthetic import TablePolicy, make_group

FORMATS = {"repo": "hdreplay.repo", "exgrpo": "hdreplay.exgrpo", "bapo": "hdreplay.bapo"}
N = 4
POL = TablePolicy(vocab=8)


def _group(gid, step, rewards, prompt, mm=False):
    g = make_group(gid, policy=POL, step=step, n=len(rewards), seed=zlib.crc32(gid.encode()) % 997, rewards=rewards)
    img = {"pixel_values": torch.full((2 + len(prompt), 3), 0.5 + step), "image_grid_thw": torch.tensor([[1, 2, 2]])}
    return GroupRecord.from_responses(
        group_id=gid, prompt_ids=torch.tensor(prompt), completion_ids=g.responses(), logprobs=g.split(g.logprobs),
        advantages=g.advantages, rewards=g.rewards, birth_step=step, mm_inputs=img if mm else None)


def _prompts(groups):
    ids = torch.stack([g.prompt_ids for g in groups for _ in range(N)])
    return ids, torch.ones_like(ids)


def repo(options: RepoOptions | None = None, steps: int = 3) -> RepoController:
    c = RepoController(options or RepoOptions(num_replays=2, min_cache=2, max_cache=3))
    for t in range(steps):
        gs = [_group(f"r{t}.{i}", t, [1, 0, 1, 0] if i else [1, 1, 0, 0], [1 + i, 2]) for i in range(2)]
        c.observe_batch(*_prompts(gs))
        c.select(step=t)
        c.stage(gs, step=t)
        c.commit()
    return c


def exgrpo(options: ExgrpoOptions | None = None, steps: int = 3) -> ExgrpoController:
    c = ExgrpoController(options or ExgrpoOptions(start_solved=0.0), n=N, seed=0)
    for t in range(steps):
        gs = [_group(f"e{t}.{i}", t, [1.0] * (1 + i) + [0.0] * (N - 1 - i), [3 + i, t % 2]) for i in range(3)]
        gs.append(_group(f"e{t}.all", t, [1.0] * N, [9, 9]))  # all correct: retired
        for g in gs:
            c.remember(key_of(g.prompt_ids), {"prompt": str(g.prompt_ids.tolist())})
        c.stage(gs, step=t)
        c.commit()
    return c


def bapo(options: BapoOptions | None = None, steps: int = 3, mm: bool = False) -> BapoController:
    c = BapoController(options or BapoOptions(seed=1))
    for t in range(steps):
        rewards = [[1, 0, 0, 0], [0, 0, 0, 0], [1, 1, 0, 0], [1, 1, 1, 1]]
        kept = [0, 2]
        fresh = [Fresh(f"u{t}.{g}", {"prompt": f"p{t}.{g}"}, r, kept.index(g) if g in kept else None)
                 for g, r in enumerate(rewards)]
        c.plan(fresh, budget=1, counters={})
        c.select(step=t)
        c.stage([_group(f"s{t}.0g{i}", t, rewards[g], [5, g], mm=mm) for i, g in enumerate(kept)], step=t)
        c.commit()
    return c


BUILD = {"repo": repo, "exgrpo": exgrpo, "bapo": bapo}


def _records(rs):
    return [(r.group_id, r.birth_step, r.prompt_ids.tolist(), r.completion_ids.tolist(), r.logprobs.tolist(),
             r.loss_mask.tolist(), r.advantages.tolist(), r.rewards.tolist(),
             sorted((k, v.tolist()) for k, v in r.extras.items()),
             sorted((k, v.tolist()) for k, v in r.mm_inputs.items()))
            for r in rs]


def snapshot(c) -> str:
    """A digest of everything the controller holds (its attributes, every stored record in full)."""
    if isinstance(c, RepoController):
        s = (c.options, c.last_step, {k: _records(v) for k, v in c.store.cache.items()})
    elif isinstance(c, ExgrpoController):
        s = (c.options, c.n, c.last_step, {k: _records(v) for k, v in c.pool.items()}, c.bucket, c.rows,
             sorted(c.retired), c.started, c.rng.bit_generator.state)
    else:
        s = (c.options, c.last_step, [(u, e.alpha, e.current, e.last_step, e.row, _records([e.record] if e.record
                                                                                            else []))
                                      for u, e in c.store.items()], c.rng.bit_generator.state)
    return hashlib.sha256(repr(s).encode()).hexdigest()


# ------------------------------------------------------------------------------------------ editing checkpoints
def read_state(d: Path) -> tuple[dict, Path]:
    """(state.json of the current version, its path)."""
    man = json.loads((d / MANIFEST_FILE).read_text())
    p = d / man["dir"] / STATE_FILE
    return json.loads(p.read_text()), p


def resign(d: Path, meta: dict) -> None:
    """Replace the meta of layout-2 checkpoint ``d`` and re-sign its manifest (the checksums then pass)."""
    state, p = read_state(d)
    data = json.dumps({**state, "meta": meta}).encode()
    p.write_bytes(data)
    man = json.loads((d / MANIFEST_FILE).read_text())
    man["files"][STATE_FILE] = {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    man["sha256"] = _manifest_digest(man)
    (d / MANIFEST_FILE).write_text(json.dumps(man, sort_keys=True))


def to_layout1(src: Path, dst: Path, meta: dict | None = None) -> None:
    """Write checkpoint ``src`` (layout 2) as a layout-1 directory ``dst`` (the unreleased hdreplay 0.1's form, no
    longer read), meta replaced."""
    state, p = read_state(src)
    blob = (p.parent / TENSORS_FILE).read_bytes()
    dst.mkdir(parents=True)
    (dst / TENSORS_FILE).write_bytes(blob)
    (dst / STATE_FILE).write_text(json.dumps({"format": state["format"], "version": 1,
                                              "sha256": hashlib.sha256(blob).hexdigest(),
                                              "meta": state["meta"] if meta is None else meta}))


def edit(meta: dict, path: tuple, value) -> dict:
    """A deep copy of ``meta`` with ``meta[path[0]][path[1]]... = value`` (DELETE removes the entry)."""
    out = copy.deepcopy(meta)
    cur = out
    for k in path[:-1]:
        cur = cur[k]
    if value is DELETE:
        del cur[path[-1]]
    else:
        cur[path[-1]] = value
    return out


DELETE = object()


def bad_record_metas(rec: dict) -> list[tuple[tuple, object]]:
    """Edits of a packed record list's meta (``pack``'s ``{"count", "group_ids", "birth_steps", ...}``)."""
    n = rec["count"]
    return [(("count",), n + 1), (("count",), "2"), (("count",), True), (("count",), -1), (("count",), None),
            (("group_ids",), rec["group_ids"][:-1]), (("group_ids",), [1.5] * n), (("group_ids",), [None] * n),
            (("birth_steps",), [-1] * n), (("birth_steps",), ["0"] * n),
            (("birth_steps",), [1.5] * n), (("birth_steps",), [2**60] * n), (("birth_steps",), rec["birth_steps"][:-1]),
            (("birth_steps",), [99] * n), (("extras_keys",), "x"), (("extras_keys",), [1]), (("extras_keys",), ["z"]),
            (("extras_keys",), None), (("mm_schema",), "x"), (("mm_schema",), {"pixel_values": {"dtype": "nope"}}),
            (("group_ids",), DELETE), (("birth_steps",), DELETE), (("count",), DELETE)]


def bad_metas(kind: str, meta: dict) -> list[tuple[str, dict]]:
    """(label, edited meta) pairs that a load must refuse, for a strategy of ``kind`` saved as ``meta``."""
    edits: list[tuple[tuple, object]] = [((k,), DELETE) for k in meta if k not in ("rng",)]
    edits += [(("records", *p), v) for p, v in bad_record_metas(meta["records"])]
    edits += [(("last_step",), v) for v in ("3", -1, 1.5, True, 2**60, 0)]
    edits += [(("options",), v) for v in ("x", [1], None)]
    edits += [(("options", "nope"), 1)]
    if kind == "repo":
        k = meta["keys"]
        edits += [(("keys",), v) for v in (k[:-1], [1] * len(k), "k", None, ["9,9"] * len(k), k[::-1])]
        edits += [(("options", "num_replays"), v) for v in (0, "2", 1.5, True)]
    elif kind == "exgrpo":
        k = meta["keys"]
        edits += [(("keys",), v) for v in (k[:-1], [1] * len(k), "k", ["9,9"] * len(k))]
        first = next(iter(meta["bucket"]))
        edits += [(("bucket", first), v) for v in ("2", 1.5, 0, N, True, None)]
        edits += [(("bucket",), v) for v in ([], "b", {})]
        edits += [(("retired",), v) for v in ("x", [1], [meta["keys"][0]], meta["retired"] * 2)]
        edits += [(("rows",), v) for v in ([], "r", 3)]
        edits += [(("started",), v) for v in ("yes", 1, None, False)]
        edits += [(("n",), v) for v in (N + 1, "4", None)]
        edits += [(("rng",), v) for v in ("x", {"bit_generator": "PCG64"}, None)]
        edits += [(("options", "correct"), 5.0), (("options", "gamma"), -1)]
    else:
        e0 = meta["entries"][0]
        edits += [(("entries", 0, k), DELETE) for k in e0]
        edits += [(("entries", 0, "uid"), v) for v in (1, None, meta["entries"][1]["uid"])]
        edits += [(("entries", 0, "alpha"), v) for v in ("x", [], ["1"], [float("nan")], [1e300] * 40, None)]
        edits += [(("entries", 0, "current"), v) for v in ("x", [None], [0.0] * 40)]
        edits += [(("entries", 0, "last_step"), v) for v in ("1", -1, 1.5, 99, None)]
        edits += [(("entries", 0, "row"), v) for v in ("x", [1], None)]
        edits += [(("entries", 0, "record"), v) for v in ("yes", 1, None, not e0["record"])]
        edits += [(("entries", 0, "extra"), 1)]
        edits += [(("entries",), v) for v in ("x", [1], None, meta["entries"] * 2)]
        edits += [(("rng",), v) for v in ("x", None)]
        edits += [(("options", "target_range"), v) for v in ([0.5, 0.1], "x")]
    out = []
    for p, v in edits:
        try:
            m = edit(meta, p, v)
        except (KeyError, IndexError, TypeError):
            continue
        if m != meta:  # an edit that changes nothing is no case
            out.append((f"{p}={'<deleted>' if v is DELETE else repr(v)[:40]}", m))
    return out
