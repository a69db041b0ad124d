"""The paired bootstrap of the comparison summary, on constructed data whose answer is known."""

import numpy as np
import pytest

from hdreplay_lab.sandbox.stats import components, paired_bootstrap, paired_differences, seed_bootstrap, seeds_needed


def test_constant_difference_has_a_zero_width_interval_at_the_difference():
    a = {"x": np.full((5, 40), 0.3), "y": np.full((5, 10), 0.6)}
    b = {"x": np.full((5, 40), 0.32), "y": np.full((5, 10), 0.61)}
    r = paired_bootstrap(paired_differences(a, b), reps=500)
    assert r["diff"] == pytest.approx((0.02 + 0.01) / 2)  # macro: each benchmark counts once
    assert r["lo"] == pytest.approx(r["diff"]) and r["hi"] == pytest.approx(r["diff"])
    assert r["excludes_zero"] and r["seeds"] == 5 and r["prompts"] == {"x": 40, "y": 10}


def test_macro_point_estimate_by_hand():
    d = {"x": np.array([[0.0, 0.2], [0.1, 0.1]]), "y": np.array([[0.3], [-0.1]])}
    # seed 0: macro (0.1 + 0.3)/2 = 0.2; seed 1: (0.1 - 0.1)/2 = 0; mean 0.1
    assert paired_bootstrap(d, reps=200)["diff"] == pytest.approx(0.1)


def test_half_width_matches_the_crossed_variance():
    """d[s, i] = mu + seed effect (sd 0.03) + prompt effect (sd 0.2, shared by all seeds) + noise (sd 0.1):
    the statistic's variance is 0.03^2/S + 0.2^2/P + 0.1^2/(S P)."""
    rng = np.random.default_rng(1)
    S, P, mu = 60, 400, 0.015
    d = mu + rng.normal(0, 0.03, (S, 1)) + rng.normal(0, 0.2, (1, P)) + rng.normal(0, 0.1, (S, P))
    r = paired_bootstrap({"k": d}, reps=4000, seed=3)
    expect = 1.96 * np.sqrt(0.03 ** 2 / S + 0.2 ** 2 / P + 0.1 ** 2 / (S * P))
    assert r["half_width"] == pytest.approx(expect, rel=0.2)
    assert r["lo"] < d.mean() < r["hi"]
    comp = components({"k": d}, reps=4000, seed=3)
    assert comp["seed_half_width"] == pytest.approx(1.96 * np.sqrt(0.03 ** 2 / S + 0.1 ** 2 / (S * P)), rel=0.2)
    assert comp["prompt_half_width"] == pytest.approx(1.96 * np.sqrt(0.2 ** 2 / P + 0.1 ** 2 / (S * P)), rel=0.2)


def test_interval_covers_the_truth_at_about_the_nominal_rate():
    rng = np.random.default_rng(7)
    hits = 0
    for t in range(100):
        d = 0.01 + rng.normal(0, 0.02, (8, 1)) + rng.normal(0, 0.1, (8, 50))
        r = paired_bootstrap({"k": d}, reps=400, seed=t)
        hits += r["lo"] <= 0.01 <= r["hi"]
    assert 80 <= hits <= 100  # percentile intervals with 8 seeds run a little narrow


def test_an_effect_far_larger_than_the_noise_excludes_zero_and_a_null_effect_does_not():
    rng = np.random.default_rng(2)
    noise = rng.normal(0, 0.01, (6, 100))
    assert paired_bootstrap({"k": 0.05 + noise})["excludes_zero"]
    assert not paired_bootstrap({"k": noise - noise.mean()})["excludes_zero"]


def test_seeds_needed():
    assert seeds_needed(0.02, 0.0, 5, 0.01) == 20  # 4x the variance -> 4x the seeds
    assert seeds_needed(0.005, 0.0, 5, 0.01) == 2  # already there: 5 * 0.25 = 1.25, and never below 2
    assert seeds_needed(0.0065, 0.0035, 19, 0.01) == 10  # 19 * 4.2e-5 / 8.8e-5 = 9.1 (docs/results/fidelity)
    assert seeds_needed(0.02, 0.012, 5, 0.01) is None  # the prompt part alone is too wide
    assert seeds_needed(0.02, 0.006, 5, 0.01) == 32  # 5 * 4e-4 / (1e-4 - 3.6e-5) = 31.25
    with pytest.raises(ValueError, match="seeds"):
        seeds_needed(0.02, 0.006, 0, 0.01)


def test_seed_bootstrap_is_the_paired_mean():
    r = seed_bootstrap([0.5, 0.6, 0.7], [0.55, 0.66, 0.77], reps=500)
    assert r["diff"] == pytest.approx(0.06)
    assert 0.05 - 1e-9 <= r["lo"] <= r["hi"] <= 0.07 + 1e-9


@pytest.mark.parametrize("bad, match", [
    ({}, "no benchmarks"),
    ({"k": np.zeros(5)}, "seeds, prompts"),
    ({"k": np.zeros((3, 4)), "j": np.zeros((2, 4))}, "same number of seeds"),
    ({"k": np.full((2, 2), np.nan)}, "finite"),
])
def test_bad_input_is_refused(bad, match):
    with pytest.raises(ValueError, match=match):
        paired_bootstrap(bad)


def test_further_levels_come_from_the_same_replicates_as_separate_calls():
    d = {"k": np.random.default_rng(5).normal(0.01, 0.05, size=(6, 40))}
    both = paired_bootstrap(d, reps=1000, also=(0.99, 0.5))
    assert "also" not in paired_bootstrap(d, reps=1000)
    for extra in both["also"]:
        alone = paired_bootstrap(d, reps=1000, level=extra["level"])
        assert (extra["lo"], extra["hi"], extra["excludes_zero"]) == (alone["lo"], alone["hi"], alone["excludes_zero"])
    wide, narrow = both["also"]
    assert wide["lo"] < both["lo"] < narrow["lo"] <= narrow["hi"] < both["hi"] < wide["hi"]
    with pytest.raises(ValueError, match="level must be in"):
        paired_bootstrap(d, also=(0.95, 1.0))


def test_unpaired_shapes_are_refused():
    with pytest.raises(ValueError, match="not paired"):
        paired_differences({"k": np.zeros((3, 4))}, {"k": np.zeros((3, 5))})


def test_the_summary_corrects_its_intervals_for_the_number_of_comparisons():
    from hdreplay_lab.sandbox.summary import _paired

    rng = np.random.default_rng(3)
    base = rng.uniform(0.2, 0.8, size=(8, 60))

    def runs(shift):
        return [{"benchmarks": {"b": {"prompt_mean": list(base[s] + shift + 0.01 * rng.standard_normal(60))}}}
                for s in range(8)]

    ref = runs(0.0)
    small = runs(0.002)  # an effect of 0.002 over 8 seeds: 95 % interval [+0.0003, ...], Bonferroni(6) from -0.0004
    one, six = _paired(ref, small, reps=2000), _paired(ref, small, reps=2000, family=6)
    assert one["corrected"]["level"] == pytest.approx(0.95) and six["corrected"]["level"] == pytest.approx(1 - 0.05 / 6)
    assert (one["corrected"]["lo"], one["corrected"]["hi"]) == (one["lo"], one["hi"])
    c = six["corrected"]
    assert c["comparisons"] == 6 and c["lo"] < six["lo"] <= six["hi"] < c["hi"]  # wider, around the same replicates
    assert six["excludes_zero"] and not c["excludes_zero"]  # separated at 95 %, not with six comparisons at once
    big = _paired(ref, runs(0.006), reps=2000, family=6)
    assert big["excludes_zero"] and big["corrected"]["excludes_zero"]
