import pytest
from hypothesis import given
from hypothesis import strategies as st

from hdreplay import ReplayInputError, balanced_partition, minibatch_layout, truncate_to_multiple


@given(lengths=st.lists(st.integers(1, 500), min_size=1, max_size=64), parts=st.integers(1, 8))
def test_balanced_partition_equal_counts_and_no_worse_than_sequential(lengths, parts):
    n = (len(lengths) // parts) * parts
    if n == 0:
        return
    lengths = lengths[:n]
    out = balanced_partition(lengths, parts)
    assert sorted(i for p in out for i in p) == list(range(n))
    assert all(len(p) == n // parts for p in out)
    assert all(p == sorted(p) for p in out)
    loads = [sum(lengths[i] for i in p) for p in out]
    size = n // parts
    seq = [sum(lengths[k * size:(k + 1) * size]) for k in range(parts)]
    assert max(loads) <= max(seq)
    assert max(loads) - min(loads) <= max(lengths)  # greedy LPT bound with equal counts


def test_balancing_beats_sequential_on_a_skewed_batch():
    lengths = [1000] * 4 + [10] * 12  # long replay rows first, as in [replay ; fresh]
    out = balanced_partition(lengths, 4)
    loads = sorted(sum(lengths[i] for i in p) for p in out)
    assert loads == [1030, 1030, 1030, 1030]


def test_minibatch_layout_keeps_replay_first():
    replay, fresh = [50] * 8, [10] * 16
    layout = minibatch_layout(replay, fresh, num_minibatches=3, parts=2)
    assert len(layout) == 3
    first = sorted(i for part in layout[0] for i in part)
    assert first == list(range(8))  # mini-batch 0 is exactly the replay rows
    assert all(len(part) == 4 for mb in layout for part in mb)
    with pytest.raises(ReplayInputError, match="equal mini-batches"):
        minibatch_layout([1] * 3, [1] * 4, num_minibatches=2, parts=1)
    with pytest.raises(ReplayInputError, match="equal-count parts"):
        balanced_partition([1, 2, 3], 2)


def test_truncate_to_multiple_is_deprecated_and_still_works():
    """Nothing in the library calls it (select_replay cuts the replay list; test_selection checks that cut)."""
    with pytest.warns(DeprecationWarning, match="truncate_multiple"):
        assert truncate_to_multiple([5, 4, 3, 2, 1], 2) == [5, 4, 3, 2]


def test_empty_and_oversized_partitions_are_defined_or_refused():
    assert balanced_partition([], 4) == [[], [], [], []]
    with pytest.raises(ReplayInputError, match="parts"):
        balanced_partition([], 10**6)  # more ranks than any cluster: refused before allocating them
    for bad in ([1.5, 2], [-1, 2], ["3", 1], [True, 1]):
        with pytest.raises(ReplayInputError, match="lengths"):
            balanced_partition(bad, 2)
    with pytest.raises(ReplayInputError, match="num_minibatches"):
        minibatch_layout([1], [1], num_minibatches=2.0, parts=1)
