import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from hdreplay import ReplayInputError, drift, headroom, replay_kl, replay_kl_per_group


def test_paper_worked_example_l1_vs_l2():
    # Appendix G.1: (0.02, 0.02, 0.02, 0.02) vs (0.08, 0, 0, 0)
    ref = torch.full((2, 4), -1.0)
    cur = ref + torch.tensor([[0.02, 0.02, 0.02, 0.02], [0.08, 0.0, 0.0, 0.0]])
    mask = torch.ones(2, 4)
    l1 = drift(logprobs=cur, ref_logprobs=ref, mask=mask, norm="l1")
    l2 = drift(logprobs=cur, ref_logprobs=ref, mask=mask, norm="l2")
    assert l1.dtype == l2.dtype == torch.float64  # Drift is computed in float64
    assert torch.allclose(l1, torch.tensor([0.02, 0.02], dtype=torch.float64), atol=1e-6)
    assert torch.allclose(l2, torch.tensor([0.0004, 0.0016], dtype=torch.float64), atol=1e-7)


def test_headroom_sign_hand_computed():
    p = torch.tensor([[0.25, 0.5, 0.9, 0.3, 0.7]])
    adv = torch.tensor([[1.0, 1.0, -0.5, 0.0, 2.0]])
    mask = torch.tensor([[1, 1, 1, 1, 0]])  # last token masked out (tool token)
    h = headroom(logprobs=p.log(), advantages=adv, mask=mask)
    # 0.75 + 0.5 + 0.9 + 0 over 4 tokens
    assert h.item() == pytest.approx((0.75 + 0.5 + 0.9 + 0.0) / 4, abs=1e-6)


def test_headroom_advantage_weighted_hand_computed():
    p = torch.tensor([[0.25, 0.5, 0.9, 0.3]])
    adv = torch.tensor([[1.0, 1.0, -0.5, 0.0]])
    mask = torch.ones(1, 4)
    h = headroom(logprobs=p.log(), advantages=adv, mask=mask, weighting="advantage")
    assert h.item() == pytest.approx((0.75 * 1 + 0.5 * 1 + 0.9 * 0.5) / 2.5, abs=1e-6)
    zero = headroom(logprobs=p.log(), advantages=torch.zeros(1, 4), mask=mask, weighting="advantage")
    assert zero.item() == 0.0


def test_replay_kl_k3_hand_computed_and_zero_at_equal():
    ref = torch.tensor([[-1.0, -2.0, -0.5]])
    d = torch.tensor([[0.1, -0.2, 0.3]])
    mask = torch.tensor([[1, 1, 0]])
    expected = ((math.exp(0.1) - 1 - 0.1) + (math.exp(-0.2) - 1 + 0.2)) / 2
    assert replay_kl(logprobs=ref + d, ref_logprobs=ref, mask=mask).item() == pytest.approx(expected, rel=1e-5)
    assert replay_kl_per_group(logprobs=ref, ref_logprobs=ref, mask=mask).item() == 0.0


def test_masked_positions_never_matter():
    g = torch.Generator().manual_seed(0)
    lp = -torch.rand(3, 6, generator=g)
    ref = -torch.rand(3, 6, generator=g)
    adv = torch.randn(3, 6, generator=g)
    mask = torch.rand(3, 6, generator=g) > 0.4
    mask[:, 0] = True
    lp2 = lp.masked_fill(~mask, -50.0)
    for norm in ("l1", "l2"):
        assert torch.equal(drift(logprobs=lp, ref_logprobs=ref, mask=mask, norm=norm),
                           drift(logprobs=lp2, ref_logprobs=ref, mask=mask, norm=norm))
    assert torch.equal(headroom(logprobs=lp, advantages=adv, mask=mask),
                       headroom(logprobs=lp2, advantages=adv, mask=mask))


@pytest.mark.parametrize("bad", ["shape", "empty_row", "norm", "weighting", "int_logprobs", "numpy", "nan", "inf",
                                 "positive", "ref_positive", "half_mask", "adv_nan", "list"])
def test_bad_input_is_named(bad):
    lp = -torch.rand(2, 3)
    mask = torch.ones(2, 3)
    with pytest.raises(ReplayInputError) as e:
        if bad == "shape":
            drift(logprobs=lp, ref_logprobs=lp[:, :2], mask=mask)
        elif bad == "empty_row":
            drift(logprobs=lp, ref_logprobs=lp, mask=torch.tensor([[1, 1, 1], [0, 0, 0]]))
        elif bad == "norm":
            drift(logprobs=lp, ref_logprobs=lp, mask=mask, norm="l3")
        elif bad == "weighting":
            headroom(logprobs=lp, advantages=lp, mask=mask, weighting="magnitude")
        elif bad == "int_logprobs":
            drift(logprobs=torch.zeros(2, 3, dtype=torch.long), ref_logprobs=lp, mask=mask)
        elif bad == "numpy":
            headroom(logprobs=lp.numpy(), advantages=lp, mask=mask)
        elif bad == "nan":
            replay_kl(logprobs=lp.masked_fill(torch.eye(2, 3, dtype=torch.bool), float("nan")), ref_logprobs=lp,
                      mask=mask)
        elif bad == "inf":
            headroom(logprobs=torch.full((2, 3), float("-inf")), advantages=lp, mask=mask)
        elif bad == "positive":
            headroom(logprobs=lp + 1.0, advantages=lp, mask=mask)  # would give Headroom outside [0, 1]
        elif bad == "ref_positive":
            drift(logprobs=lp, ref_logprobs=lp.abs(), mask=mask)
        elif bad == "half_mask":
            drift(logprobs=lp, ref_logprobs=lp, mask=torch.full((2, 3), 0.5))
        elif bad == "adv_nan":
            headroom(logprobs=lp, advantages=torch.full((2, 3), float("nan")), mask=mask)
        else:
            replay_kl_per_group(logprobs=lp.tolist(), ref_logprobs=lp, mask=mask)
    msg = str(e.value)
    assert {"shape": "ref_logprobs", "empty_row": "all-zero mask", "norm": "l3", "weighting": "magnitude",
            "int_logprobs": "floating point", "numpy": "torch.Tensor, got ndarray", "nan": "non-finite",
            "inf": "non-finite", "positive": "positive value", "ref_positive": "`ref_logprobs` has a positive",
            "half_mask": "only 0/1", "adv_nan": "`advantages` must hold finite", "list": "got list"}[bad] in msg


def test_headroom_stays_in_unit_interval_with_round_off_above_zero():
    lp = torch.tensor([[5e-5, -0.5], [0.0, -2.0]])  # 5e-5: log_softmax round-off, within tolerance
    adv = torch.tensor([[1.0, 1.0], [-1.0, -1.0]])
    h = headroom(logprobs=lp, advantages=adv, mask=torch.ones(2, 2))
    assert bool(((h >= 0) & (h <= 1)).all())
    assert h[0].item() == pytest.approx((0.0 + 1 - math.exp(-0.5)) / 2)


@given(
    seed=st.integers(0, 10_000),
    scale=st.floats(0.0, 3.0),
    G=st.integers(1, 5),
    T=st.integers(1, 12),
)
def test_proposition2_headroom_mismatch_bounded_by_sqrt_drift(seed, scale, G, T):
    """|H_cur - H_ref| <= sqrt(Drift) for any pair of policies (Proposition 2)."""
    g = torch.Generator().manual_seed(seed)
    ref = torch.log_softmax(torch.randn(G, T, 5, generator=g, dtype=torch.float64), -1)[..., 0]
    cur = torch.log_softmax(torch.randn(G, T, 5, generator=g, dtype=torch.float64) * scale, -1)[..., 0]
    cur = torch.where(torch.rand(G, T, generator=g) < 0.3, ref, cur)  # some unchanged tokens
    adv = torch.randn(G, 1, generator=g, dtype=torch.float64).expand(G, T) * (torch.rand(G, T, generator=g) > 0.2)
    mask = torch.rand(G, T, generator=g) > 0.3
    mask[:, 0] = True
    h_cur = headroom(logprobs=cur, advantages=adv, mask=mask)
    h_ref = headroom(logprobs=ref, advantages=adv, mask=mask)
    d = drift(logprobs=cur, ref_logprobs=ref, mask=mask)
    assert bool(((h_cur - h_ref).abs() <= d.sqrt() + 1e-6).all())


@given(seed=st.integers(0, 10_000), T=st.integers(1, 16))
def test_l2_is_mean_squared_plus_variance_of_abs(seed, T):
    """Drift_L2 = mu^2 + v with mu = mean |Delta|, v = Var |Delta| (Appendix G.1)."""
    g = torch.Generator().manual_seed(seed)
    delta = torch.randn(1, T, generator=g, dtype=torch.float64) * 0.1
    ref = -torch.rand(1, T, generator=g, dtype=torch.float64) - 0.5
    mask = torch.ones(1, T)
    l1 = drift(logprobs=ref + delta, ref_logprobs=ref, mask=mask, norm="l1")
    l2 = drift(logprobs=ref + delta, ref_logprobs=ref, mask=mask, norm="l2")
    var = delta.abs().var(unbiased=False)
    assert l2.item() == pytest.approx(l1.item() ** 2 + var.item(), rel=1e-4, abs=1e-9)
