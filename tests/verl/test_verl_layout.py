"""Replay-prefix layout invariants through verl's own dispatch chunking and mini-batch iterator (no Ray).

verl 0.9.1 splits the actor batch over dp ranks with ``tu.chunk_tensordict`` (nd-dispatch) and each
rank iterates its slice with ``tu.make_iterator`` (``TrainingWorker.train_mini_batch``).  These tests
run those two functions on the batch ``build_actor_batch`` produces; the Ray test repeats the check on
the real worker path.
"""

import pytest

pytestmark = pytest.mark.verl
pytest.importorskip("verl", minversion="0.9.1")

import numpy as np  # noqa: E402
import torch  # noqa: E402
from hypothesis import given  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from tensordict import TensorDict  # noqa: E402
from verl.utils import tensordict_utils as tu  # noqa: E402
from verl.workers.utils.padding import left_right_2_no_padding  # noqa: E402

from hdreplay.integrations.verl.actor_batch import build_actor_batch  # noqa: E402
from hdreplay.integrations.verl.dataproto import REPLAY_FLAG, groups_from_batch  # noqa: E402
from hdreplay.integrations.verl.minibatches import actor_order, padding_needed, rank_minibatches  # noqa: E402
from verl_helpers import fresh_batch  # noqa: E402


def verl_minibatches(td: TensorDict, *, dp: int, minibatch_rows: int, seed: int = 42) -> list[list[TensorDict]]:
    """[k][r]: rank r's k-th mini-batch, produced by verl's own chunking + iterator (shuffle=False)."""
    per_rank = tu.chunk_tensordict(td, dp)
    out = [list(tu.make_iterator(chunk, mini_batch_size=minibatch_rows // dp, epochs=1, seed=seed + r,
                                 dataloader_kwargs={"shuffle": False})) for r, chunk in enumerate(per_rank)]
    return [[out[r][k] for r in range(dp)] for k in range(len(out[0]))]


@given(
    dp=st.sampled_from([1, 2, 4]),
    mb_per_rank=st.integers(1, 3),
    replay_mbs=st.integers(0, 3),
    fresh_mbs=st.integers(1, 3),
    data=st.data(),
)
def test_rank_r_trains_layout_k_r_in_every_global_minibatch(dp, mb_per_rank, replay_mbs, fresh_mbs, data):
    m = dp * mb_per_rank
    lengths = data.draw(st.lists(st.integers(1, 500), min_size=(replay_mbs + fresh_mbs) * m,
                                 max_size=(replay_mbs + fresh_mbs) * m))
    n_rep = replay_mbs * m
    order, layout = actor_order(lengths[:n_rep], lengths[n_rep:], minibatch_rows=m, dp=dp)
    assert sorted(order.tolist()) == list(range(len(lengths)))
    td = TensorDict({"row": torch.from_numpy(order), "len": torch.tensor(lengths)[order]}, batch_size=[len(order)])
    mbs = verl_minibatches(td, dp=dp, minibatch_rows=m)
    assert len(mbs) == replay_mbs + fresh_mbs
    assert rank_minibatches(order, minibatch_rows=m, dp=dp) == [[x["row"].tolist() for x in mb] for mb in mbs]
    for k, mb in enumerate(mbs):
        rows = [x["row"].tolist() for x in mb]
        assert rows == layout[k]  # exactly the planned (k, r) assignment
        flat = sorted(i for part in rows for i in part)
        assert flat == list(range(k * m, (k + 1) * m))  # global mini-batch k = k-th slice of [replay ; fresh]
        is_rep = [i < n_rep for i in flat]
        assert all(is_rep) if k < replay_mbs else not any(is_rep)  # replay fills the first mini-batches
        loads = [int(x["len"].sum()) for x in mb]
        assert max(loads) - min(loads) <= max(lengths[i] for i in flat)  # balanced per mini-batch


@given(
    dp=st.sampled_from([1, 2, 4]),
    mb_per_rank=st.integers(1, 4),
    num_replay=st.integers(0, 30),
    num_fresh=st.integers(1, 30),
    data=st.data(),
)
def test_v1_padding_completes_only_the_last_minibatch_and_replay_stays_first(dp, mb_per_rank, num_replay, num_fresh,
                                                                            data):
    """The v1 recipe: any number of replay rows (unit 1 group) + fresh rows + padding rows to whole mini-batches,
    through verl's own chunking and iterator."""
    m = dp * mb_per_rank
    n_pad = padding_needed(num_replay + num_fresh, minibatch_rows=m)
    assert 0 <= n_pad < m and (num_replay + num_fresh + n_pad) % m == 0
    real = data.draw(st.lists(st.integers(3, 500), min_size=num_replay + num_fresh, max_size=num_replay + num_fresh))
    lengths = real + [2] * n_pad  # padding rows: 1 prompt + 1 response token
    order, layout = actor_order(lengths[:num_replay], lengths[num_replay:], minibatch_rows=m, dp=dp)
    td = TensorDict({"row": torch.from_numpy(order)}, batch_size=[len(order)])
    mbs = verl_minibatches(td, dp=dp, minibatch_rows=m)
    first_pad = num_replay + num_fresh
    for k, mb in enumerate(mbs):
        rows = [x["row"].tolist() for x in mb]
        assert rows == layout[k] and all(len(part) == m // dp for part in rows)
        flat = sorted(i for part in rows for i in part)
        assert flat == list(range(k * m, (k + 1) * m))  # replay rows (lowest indices) are consumed first
        assert k == len(mbs) - 1 or max(flat) < first_pad  # padding only in the last mini-batch


def test_actor_batch_through_verls_update_conversion_and_iterator():
    """The DataProto -> TensorDict -> no-padding conversion of ``_update_actor``, then dispatch + iterator."""
    dp, n = 2, 4
    m = 2 * n  # ppo_mini_batch_size=2 prompts
    batch = fresh_batch((1, 2, 3, 5, 6, 7), n, seed=11, ref=True)  # 24 fresh rows = 3 mini-batches
    groups, _, _ = groups_from_batch(fresh_batch((9, 10, 11, 13), n, seed=12, ref=True), step=0, group_size=n)
    actor, info = build_actor_batch(groups, batch, minibatch_rows=m, dp=dp, pad_token_id=0)
    td = left_right_2_no_padding(actor.to_tensordict())
    mbs = verl_minibatches(td, dp=dp, minibatch_rows=m)
    assert len(mbs) == 5 and info["num_replay_rows"] == 16
    lengths = actor.batch["attention_mask"].sum(-1)
    for k, mb in enumerate(mbs):
        flags = [bool(f) for x in mb for f in tu.get(x, REPLAY_FLAG)]
        assert all(flags) if k < 2 else not any(flags)
        loads = [int(x["input_ids"].offsets().diff().sum()) for x in mb]
        assert max(loads) - min(loads) <= int(lengths.max())
        for x in mb:  # replay rows reach the worker with their stored old log-probs and response mask
            assert x["old_log_probs"].shape[0] == m // dp
    assert info["metrics"]["replay/minibatches_with_replay"] == 2.0
    assert info["metrics"]["replay/actor_minibatches"] == 5.0


def verl_rows(order, *, dp: int, minibatch_rows: int) -> list[list[list[int]]]:
    """[k][r]: the rows (as ids in ``order``) that verl's own dispatch + iterator give rank r as its k-th
    mini-batch."""
    td = TensorDict({"row": torch.as_tensor(np.asarray(order), dtype=torch.long)}, batch_size=[len(order)])
    return [[x["row"].tolist() for x in mb] for mb in verl_minibatches(td, dp=dp, minibatch_rows=minibatch_rows)]


def test_stock_order_would_scatter_replay_across_minibatches():
    """Why the permutation is needed, on verl's own chunking and iterator: plain [replay ; fresh] order puts the 4
    replay rows on rank 0 only, over two of its mini-batches, and fresh rows into rank 1's first mini-batch;
    actor_order's permutation puts them all in the first global mini-batch, and the dispatch model the layout is
    planned with (rank_minibatches) is what verl does with either order."""
    dp, m = 2, 4
    lengths = list(range(1, 13))
    stock = verl_rows(np.arange(12), dp=dp, minibatch_rows=m)
    assert stock[0] == [[0, 1], [6, 7]] and stock[1] == [[2, 3], [8, 9]]
    assert stock == rank_minibatches(np.arange(12), minibatch_rows=m, dp=dp)
    order, _ = actor_order(lengths[:4], lengths[4:], minibatch_rows=m, dp=dp)
    planned = verl_rows(order, dp=dp, minibatch_rows=m)
    assert sorted(planned[0][0] + planned[0][1]) == [0, 1, 2, 3]
    assert not {0, 1, 2, 3} & {r for mb in planned[1:] for rows in mb for r in rows}
    assert planned == rank_minibatches(order, minibatch_rows=m, dp=dp)


def test_rows_that_do_not_fill_whole_minibatches_are_rejected():
    with pytest.raises(RuntimeError, match="whole mini-batches"):
        actor_order([5] * 3, [5] * 8, minibatch_rows=4, dp=2)
    with pytest.raises(RuntimeError, match="data-parallel"):
        actor_order([5] * 4, [5] * 8, minibatch_rows=4, dp=3)
