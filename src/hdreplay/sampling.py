"""The seeded generator of the random selectors, as plain JSON state.

A selector whose order is random (the peers' uniform and proportional orders, :mod:`hdreplay.baselines.orders`)
draws from the controller's generator; its state is plain JSON (:func:`rng_state` / :func:`rng_from_state`), so a
controller checkpoints it with the buffer and a resumed run draws exactly what the uninterrupted run draws.  The
orders themselves (uniform, proportional, PER weights, ExGRPO's buckets) live in :mod:`hdreplay.baselines.sampling`;
their old names here still resolve, with a DeprecationWarning (:mod:`hdreplay.baselines.moved`).

>>> rng = new_rng(7)
>>> state = rng_state(rng)
>>> int(rng.integers(1000)) == int(rng_from_state(state).integers(1000))  # the same draw after a round trip
True
"""

from __future__ import annotations

from typing import Any, Mapping

import numpy as np

from .errors import CheckpointError
from .validate import check_int

BIT_GENERATOR = "PCG64"


def new_rng(seed: int) -> np.random.Generator:
    """A PCG64 generator seeded with ``seed`` (an int >= 0)."""
    return np.random.Generator(np.random.PCG64(check_int("seed", seed, hi=(1 << 63) - 1)))


def rng_state(rng: np.random.Generator) -> dict[str, Any]:
    """The generator's state as a JSON-able dict (ints only)."""
    s = rng.bit_generator.state
    return {"bit_generator": s["bit_generator"], "state": {k: int(v) for k, v in s["state"].items()},
            "has_uint32": int(s["has_uint32"]), "uinteger": int(s["uinteger"])}


def rng_from_state(state: Any, *, where: str = "sampler state") -> np.random.Generator:
    """A generator restored from :func:`rng_state`; CheckpointError naming ``where`` if it is malformed."""
    if not isinstance(state, Mapping) or state.get("bit_generator") != BIT_GENERATOR:
        raise CheckpointError(f"{where}: expected a {BIT_GENERATOR} state mapping, got {state!r:.80}")
    inner = state.get("state")
    ok = (isinstance(inner, Mapping) and set(inner) == {"state", "inc"}
          and all(type(v) is int and 0 <= v < 1 << 128 for v in inner.values())
          and state.get("has_uint32") in (0, 1) and type(state.get("uinteger")) is int
          and 0 <= state["uinteger"] < 1 << 32)
    if not ok:
        raise CheckpointError(f"{where}: malformed {BIT_GENERATOR} state {state!r:.80}")
    bg = np.random.PCG64()
    bg.state = {"bit_generator": BIT_GENERATOR, "state": dict(inner), "has_uint32": state["has_uint32"],
                "uinteger": state["uinteger"]}
    return np.random.Generator(bg)


