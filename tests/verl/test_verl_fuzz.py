"""The API fuzz extended to the verl recipe's settings: every ``hdr`` knob, the adaptive-tau section and every verl
key the recipe reads, each given values of the wrong type (and out of range) in a config built by hand, must be a
ReplayConfigError naming the key -- never a raw TypeError / ValueError / OmegaConf error, never accepted."""

import pytest

pytestmark = pytest.mark.verl
pytest.importorskip("verl", minversion="0.9.1")

from omegaconf import OmegaConf  # noqa: E402

from hdreplay.config import knobs  # noqa: E402
from hdreplay.errors import ReplayConfigError, ReplayError  # noqa: E402
from hdreplay.integrations.common import INTEGRATION_KNOBS  # noqa: E402
from hdreplay.integrations.verl import validate_verl_config  # noqa: E402
from hdreplay.integrations.verl.settings import TYPED_KEYS  # noqa: E402
from verl_helpers import compose_config  # noqa: E402

NAN = float("nan")
#: wrong for every scalar setting
ANY_BAD = [[1], {"a": 1}]
BY_TYPE = {int: ["abc", 1.5, True], float: ["abc", True], bool: [2, 0, "maybe", 1.0], str: []}
#: out of range for the replay knobs (ReplayConfig refuses them)
RANGE = {"k_rep": [-1], "capacity": [0, -5], "tau": [-1.0], "acceptance_ema": [0.0, 1.5], "scan_chunk": [0],
         "max_scan": [0], "truncate_multiple": [0], "selector": ["nope"], "drift_norm": ["l3"], "ingress": ["x"],
         "headroom_weighting": ["x"], "max_age": [0, -1], "seed": [-1], "priority_alpha": [-1.0]}


def _cases():
    for k in (*knobs(), *INTEGRATION_KNOBS):
        if k.flat == "json":
            yield "hdr.adaptive_tau", "x"
            yield "hdr.adaptive_tau", [1]
            yield "hdr.adaptive_tau.enabled", 2
            for name, v in (("tau_min", -1.0), ("tau_min", "abc"), ("patience", 1.5), ("patience", True),
                            ("factor", [1]), ("warmup", -1)):
                yield f"hdr.adaptive_tau.{name}", v
            continue
        for v in ANY_BAD + BY_TYPE.get(k.flat, []) + RANGE.get(k.name, []):
            yield f"hdr.{k.name}", v
    for key, typ in TYPED_KEYS.items():
        for v in ANY_BAD + (["abc", 0, -2, 1.5, True] if typ is int else [2, "maybe"]):
            yield key, v
    for v in ([1, 2], "headroom_drift", 3, True):
        yield "hdr", v


def _with(raw, dotted, value):
    import copy

    raw = copy.deepcopy(raw)
    *path, last = dotted.split(".")
    cur = raw
    for p in path:
        cur = cur[p]
    if last == "enabled" or path[-1:] == ["adaptive_tau"]:  # adaptive-tau fields count only when it is on
        cur["enabled"] = True
    cur[last] = value
    return raw


#: the parts of the composed config the recipe's checks read (the rest of verl's config makes each case slow)
READ = ("hdr", "trainer.use_v1", "trainer.v1", "trainer.default_local_dir", "actor_rollout_ref.rollout.n",
        "actor_rollout_ref.actor", "algorithm", "critic.enable", "distillation", "data.train_batch_size")


def _slim(cfg) -> dict:
    out = {}
    for dotted in READ:
        node = OmegaConf.select(cfg, dotted)
        if node is None:
            continue
        *path, last = dotted.split(".")
        cur = out
        for p in path:
            cur = cur.setdefault(p, {})
        cur[last] = OmegaConf.to_container(node, resolve=True) if OmegaConf.is_config(node) else node
    return out


def test_every_setting_given_a_wrong_value_is_a_config_error_naming_it():
    raw = _slim(compose_config())
    assert validate_verl_config(OmegaConf.create(raw)) is not None  # the unedited config is valid
    outcome, examples = {"refused": 0}, []
    for key, value in _cases():
        label = f"{key}={value!r}"
        try:
            cfg = OmegaConf.create(_with(raw, key, value))
        except Exception:  # noqa: BLE001 - OmegaConf itself cannot hold it: not a case
            continue
        try:
            validate_verl_config(cfg)
            examples.append(f"accepted {label}")
        except ReplayConfigError as e:
            outcome["refused"] += 1
            if (key.split(".")[-1] not in str(e)
                    and not (key == "hdr.adaptive_tau.enabled" and "adaptive_tau" in str(e))):
                examples.append(f"does not name the key: {label}: {e}")
        except ReplayError as e:
            examples.append(f"{type(e).__name__} (not a config error) {label}: {e}")
        except Exception as e:  # noqa: BLE001 - a raw exception is what this test counts
            examples.append(f"raw {type(e).__name__} {label}: {e}"[:200])
    assert not examples, examples[:15]
    assert outcome["refused"] > 120
