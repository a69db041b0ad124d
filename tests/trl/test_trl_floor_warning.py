"""HDRGRPOTrainer warns at start when the measured Drift floor of its precision (hdreplay.noise_floor) reaches tau/10,
quoting the numbers; a tau at 10x the floor, fp32, or a selector without a gate gets no warning."""

import warnings

import pytest

pytest.importorskip("trl")
pytestmark = pytest.mark.trl

import torch  # noqa: E402

from hdreplay.diagnostics.noise_floor import DriftFloorWarning, worst_floor  # noqa: E402
from trl_fixtures import HDRGRPOTrainer, build_tiny_model, load_model, make_args, prompts, reward_digit  # noqa: E402


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("floor_warn"), hidden=32, layers=1)


def _build(model_dir, tmp_path, *, dtype=torch.float32, **over):
    model, tok = load_model(model_dir, dtype=dtype)
    return HDRGRPOTrainer(model=model, reward_funcs=reward_digit, train_dataset=prompts(8), processing_class=tok,
                          args=make_args(tmp_path / "o", **over))


def _quiet(model_dir, tmp_path, **kw):
    with warnings.catch_warnings():
        warnings.simplefilter("error", DriftFloorWarning)
        _build(model_dir, tmp_path, **kw)


@pytest.mark.parametrize("precision,kw", [("bf16_weights", dict(dtype=torch.bfloat16)),
                                          ("bf16_autocast", dict(bf16=True)),
                                          ("bf16_autocast_fp32_head", dict(bf16=True, cast_lm_head_to_fp32=True))])
def test_warns_with_the_numbers_below_ten_times_the_floor_and_not_above(model_dir, tmp_path, precision, kw):
    floor = worst_floor(precision).l2_p99
    tau = 5 * floor  # the floor is 0.2 tau
    with pytest.warns(DriftFloorWarning) as rec:
        _build(model_dir, tmp_path, replay_tau=tau, **kw)
    msg = str(rec[0].message)
    assert f"tau={tau:g}" in msg and f"in {precision}:" in msg and f"p99 {floor:.2g} = 0.20 x tau" in msg
    _quiet(model_dir, tmp_path, replay_tau=11 * floor, **kw)  # tau above 10x the floor
    # adaptive tau: the warning quotes the lowest tau the gate can take
    with pytest.warns(DriftFloorWarning, match="adaptive_tau.tau_min"):
        _build(model_dir, tmp_path, replay_tau=11 * floor,
               replay_adaptive_tau={"tau_min": 2 * floor, "tau_max": 100 * floor}, **kw)


def test_no_warning_in_fp32_or_without_a_gate(model_dir, tmp_path):
    _quiet(model_dir, tmp_path, replay_tau=1e-9)  # fp32: no floor to speak of
    _quiet(model_dir, tmp_path, replay_tau=1e-9, replay_selector="recency", dtype=torch.bfloat16)  # no gate
