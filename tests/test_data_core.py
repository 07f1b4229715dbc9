"""The index core: orders, lockstep sharding, state, elastic re-sharding, per-sample seeds."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ray_checkfreq.data import (
    DataStateError,
    FullOrder,
    Sharding,
    WindowedOrder,
    rank_slices,
    resumable,
    sample_rng,
    sample_seeds,
)

FAST = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])


# -- orders ----------------------------------------------------------------------------
@FAST
@given(
    n=st.integers(0, 400),
    chunk=st.integers(1, 40),
    window=st.integers(1, 9),
    seed=st.integers(0, 2**40),
    epoch=st.integers(0, 50),
    cuts=st.lists(st.integers(0, 400), max_size=6),
    version=st.sampled_from([1, 2]),
    shuffle=st.booleans(),
)
def test_windowed_order_is_a_permutation_read_in_any_pieces(n, chunk, window, seed, epoch, cuts, version, shuffle):
    order = WindowedOrder(num_samples=n, seed=seed, epoch=epoch, chunk_rows=chunk, window_chunks=window,
                          version=version, shuffle=shuffle)
    whole = order.take(0, n)
    assert sorted(whole.tolist()) == list(range(n))
    bounds = sorted({0, n, *(c for c in cuts if c <= n)})
    pieces = [order.take(a, b) for a, b in zip(bounds, bounds[1:])]
    assert np.array_equal(np.concatenate(pieces) if pieces else whole, whole)
    for w in range(order.num_windows):  # a window's rows are exactly its ranges' rows
        lo, hi = order.window_bounds(w)
        rows = sorted(i for a, b in order.window_ranges(w) for i in range(a, b))
        assert rows == sorted(whole[lo:hi].tolist())
        assert hi - lo <= chunk * window
        assert all(order.window_of(p) == w for p in range(lo, hi))
    if not shuffle:
        assert whole.tolist() == list(range(n))


def test_windowed_window_bounds_are_the_same_whether_computed_or_stored():
    # version 2 computes window starts arithmetically; they must match summing chunk lengths
    for n, chunk, window in [(1000, 7, 3), (999, 10, 4), (64, 8, 8), (5, 8, 2), (1001, 1, 1)]:
        for seed in range(20):
            order = WindowedOrder(num_samples=n, seed=seed, epoch=1, chunk_rows=chunk, window_chunks=window)
            lens = [sum(min(c * chunk + chunk, n) - c * chunk for c in order.window_chunks_of(w))
                    for w in range(order.num_windows)]
            starts = np.concatenate([[0], np.cumsum(lens)]).tolist()
            assert [order.window_bounds(w) for w in range(order.num_windows)] == list(zip(starts, starts[1:]))


@pytest.mark.parametrize("version", [1, 2])
def test_orders_are_pure_functions_of_seed_and_epoch(version):
    def take(**kw):
        return FullOrder(num_samples=1000, version=version, **kw).take(0, 1000)

    a = take(seed=5, epoch=3)
    assert np.array_equal(a, take(seed=5, epoch=3))
    assert not np.array_equal(a, take(seed=5, epoch=4))
    assert not np.array_equal(a, take(seed=6, epoch=3))
    assert take(seed=0, epoch=0, shuffle=False).tolist() == list(range(1000))


def test_order_golden_values_pin_numpy_streams():
    # a numpy change to PCG64/SeedSequence/permutation would change every resumed version 1 order
    assert FullOrder(num_samples=10, seed=0, epoch=0, version=1).take(0, 10).tolist() == [7, 3, 0, 5, 1, 6, 9, 2, 8, 4]
    assert int(sample_seeds(1, 2, [3])[0]) == GOLDEN_SAMPLE_SEED


def test_order_golden_values_pin_the_keyed_bijection():
    # a change to the Feistel rounds, the key hash or cycle walking would change every resumed version 2 order
    assert FullOrder(num_samples=10, seed=0, epoch=0).take(0, 10).tolist() == [8, 4, 3, 6, 0, 7, 9, 5, 1, 2]
    assert FullOrder(num_samples=10**12, seed=3, epoch=1).take(10**12 - 4, 10**12).tolist() == [
        471446895257, 71746209107, 366058656471, 401823110958]
    assert FullOrder(num_samples=2**32, seed=3, epoch=1).take(2**32 - 4, 2**32).tolist() == [  # 64-bit words
        695086816, 2103910401, 1351885019, 4190242768]
    windowed = WindowedOrder(num_samples=20, seed=0, epoch=0, chunk_rows=3, window_chunks=2)
    assert windowed.take(0, 20).tolist() == [14, 9, 8, 10, 15, 13, 2, 4, 12, 3, 11, 16, 18, 1, 0, 17, 19, 6, 5, 7]


GOLDEN_SAMPLE_SEED = 8977515779221018042


@pytest.mark.parametrize("version", [1, 2])
def test_windowed_order_mixes_the_whole_dataset(version):
    n = 100_000
    orders = [WindowedOrder(num_samples=n, seed=seed, epoch=0, chunk_rows=256, window_chunks=64, version=version)
              for seed in range(10)]
    # the first batches already draw from all over the dataset, not from its start: 1024 rows
    # (64 chunks) over 10 bins, the emptiest bin averages ~45 rows over seeds (sequential: 0)
    emptiest = [np.histogram(o.take(0, 1024), bins=10, range=(0, n))[0].min() for o in orders]
    assert np.mean(emptiest) > 30
    spearman = np.corrcoef(np.argsort(np.argsort(orders[0].take(0, n))), np.arange(n))[0, 1]
    assert abs(spearman) < 0.05


# -- lockstep sharding ---------------------------------------------------------------------
def test_last_partial_global_batch_rule():
    def shares(drop_last):
        out = []
        for r in range(4):
            sh = Sharding(batch_size=2, world_size=4, rank=r, drop_last=drop_last)
            out.append([(s.lo, s.hi, s.consumed_after) for s in rank_slices(sh, 19, 8)])
        return out

    # 11 left from position 8: one full global batch of 8, then 3 split 1/1/1/0
    assert shares(False) == [
        [(8, 10, 16), (16, 17, 19)],
        [(10, 12, 16), (17, 18, 19)],
        [(12, 14, 16), (18, 19, 19)],
        [(14, 16, 16)],
    ]
    assert shares(True) == [[(8 + 2 * r, 10 + 2 * r, 16)] for r in range(4)]


def test_states_agree_across_ranks_and_roll_over_at_the_epoch_end():
    its = [resumable(10, batch_size=2, seed=1, rank=r, world_size=4) for r in range(4)]
    gens = [iter(it) for it in its]
    for g in gens:
        next(g)
    assert {it.consumed for it in its} == {8} and {it.epoch for it in its} == {0}
    assert [next(g, None) is None for g in gens] == [False, False, True, True]
    assert [it.state_dict() for it in its] == [its[0].state_dict()] * 4
    assert its[0].state_dict()["epoch"] == 1 and its[0].state_dict()["consumed"] == 0


def _phase(n, batch, world, state, steps, seed, drop_last):
    """`world` ranks take up to `steps` lockstep batches from `state`; returns (indices, state, world)."""
    its = [resumable(n, batch_size=batch, seed=seed, rank=r, world_size=world, drop_last=drop_last)
           for r in range(world)]
    for it in its:
        it.load_state_dict(state)
    gens = [iter(it) for it in its]
    seen: list[int] = []
    for _ in range(steps):
        if its[0].epoch != state["epoch"]:
            break
        for g in gens:
            seen.extend(next(g, np.empty(0, dtype=np.int64)).tolist())
    states = [it.state_dict() for it in its]
    assert all(s == states[0] for s in states)  # lockstep: every rank computes the same count
    return seen, states[0]


def _run_elastic(n, batch, phases, seed, drop_last):
    state = resumable(n, batch_size=batch, seed=seed).state_dict()
    seen: list[int] = []
    last_world = 1
    for world, steps in phases:
        if state["epoch"] != 0:
            break
        got, state = _phase(n, batch, world, state, steps, seed, drop_last)
        seen += got
        last_world = world
    if state["epoch"] == 0:  # finish the epoch on the last world size
        got, state = _phase(n, batch, last_world, state, n + 1, seed, drop_last)
        seen += got
    assert state["epoch"] == 1 and state["consumed"] == 0
    return seen, last_world


@FAST
@given(
    n=st.integers(1, 300),
    batch=st.integers(1, 16),
    phases=st.lists(st.tuples(st.integers(1, 7), st.integers(0, 12)), min_size=1, max_size=5),
    seed=st.integers(0, 1000),
    drop_last=st.booleans(),
)
def test_elastic_resize_uses_each_sample_once(n, batch, phases, seed, drop_last):
    seen, last_world = _run_elastic(n, batch, phases, seed, drop_last)
    assert len(seen) == len(set(seen))
    if not drop_last:
        assert sorted(seen) == list(range(n))
        return
    order = FullOrder(num_samples=n, seed=seed, epoch=0).take(0, n)
    dropped = n - len(seen)
    assert set(seen) == set(order[: len(seen)].tolist())  # only the epoch's tail is dropped
    assert dropped < batch * max(w for w, _ in phases)


def test_elastic_4_3_5_1_within_one_epoch():
    seen, _ = _run_elastic(1000, 7, [(4, 5), (3, 6), (5, 4), (1, 1000)], seed=3, drop_last=False)
    assert sorted(seen) == list(range(1000))


def test_drop_last_state_rolls_over_when_the_new_world_has_no_full_batch():
    it = resumable(20, batch_size=4, seed=0, drop_last=True)
    state = {**it.state_dict(), "consumed": 8}
    big = resumable(20, batch_size=4, seed=0, rank=0, world_size=4, drop_last=True)
    big.load_state_dict(state)  # 12 left < 16: that epoch is over under 4 ranks
    assert (big.epoch, big.consumed) == (1, 0)


def test_a_new_iter_continues_where_the_last_one_stopped():
    it = resumable(12, batch_size=3, seed=2)
    first = iter(it)
    a = next(first)
    b = next(iter(it))  # supersedes `first`
    assert list(first) == []
    rest = [x for x in it]
    assert sorted(np.concatenate([a, b, *rest]).tolist()) == list(range(12))


# -- state validation --------------------------------------------------------------------------
@pytest.mark.parametrize(
    "field, value",
    [("version", 99), ("num_samples", 11), ("seed", 4), ("order", "sequential"), ("consumed", 13), ("epoch", -1)],
)
def test_mismatched_state_is_a_clear_error(field, value):
    it = resumable(12, batch_size=3, seed=2)
    state = {**it.state_dict(), field: value}
    with pytest.raises(DataStateError) as info:
        it.load_state_dict(state)
    assert info.value.field == field and repr(value) in str(info.value)


@pytest.mark.parametrize("version", [0, 3, "2", True, None, [2]])
def test_an_unknown_state_version_is_refused_naming_the_known_ones(version):
    it = resumable(12, batch_size=3, seed=2)
    with pytest.raises(DataStateError, match="'version'") as info:
        it.load_state_dict({**it.state_dict(), "version": version})
    assert "1 (PCG64 permutation" in str(info.value) and "2 (keyed Feistel" in str(info.value)
    assert (it.epoch, it.consumed, it.order_version) == (0, 0, 2)  # nothing was taken from the bad state


def test_state_is_a_few_integers():
    state = resumable(12, batch_size=3, seed=2).state_dict()
    assert set(state) == {"version", "epoch", "consumed", "num_samples", "seed", "order", "world_size", "batch_size",
                          "global_batch_size"}


# -- per-sample seeds ------------------------------------------------------------------------------
def test_sample_seeds_are_keyed_by_seed_epoch_and_index():
    seeds = sample_seeds(1, 2, np.arange(1000))
    assert len(set(seeds.tolist())) == 1000
    assert int(seeds[7]) == int(sample_seeds(1, 2, [7])[0])
    assert not np.array_equal(seeds, sample_seeds(1, 3, np.arange(1000)))
    assert not np.array_equal(seeds, sample_seeds(2, 2, np.arange(1000)))
    assert sample_rng(1, 2, 7).random() == sample_rng(1, 2, 7).random() != sample_rng(1, 2, 8).random()


# -- factory -------------------------------------------------------------------------------------------------
def test_factory_defaults_and_errors():
    it = resumable(10, batch_size=2)
    assert (it.sharding.rank, it.sharding.world_size) == (0, 1)
    with pytest.raises(ValueError, match="rank=1"):
        resumable(10, batch_size=2, rank=1)
    with pytest.raises(ValueError, match="rank must be in"):
        resumable(10, batch_size=2, rank=3, world_size=3)
    with pytest.raises(ValueError, match="batch_size must be >= 1, got 0"):
        resumable(10, batch_size=0)
    with pytest.raises(TypeError, match="cannot iterate a str"):
        resumable("data", batch_size=2)


def test_iterable_dataset_is_refused():
    import torch

    class Stream(torch.utils.data.IterableDataset):
        def __iter__(self):
            return iter(range(3))

    with pytest.raises(TypeError, match="Stream"):
        resumable(Stream(), batch_size=2)


def test_importing_the_data_layer_imports_neither_ray_nor_dali():
    code = "import sys, ray_checkfreq.data; print(sorted(m for m in ('ray', 'nvidia.dali') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_rank_and_world_size_default_to_the_train_context(monkeypatch):
    import ray.train

    class Context:
        def get_world_rank(self) -> int:
            return 2

        def get_world_size(self) -> int:
            return 3

    monkeypatch.setattr(ray.train, "get_context", lambda: Context())
    it = resumable(10, batch_size=2)
    assert (it.sharding.rank, it.sharding.world_size) == (2, 3)
    monkeypatch.setattr(ray.train, "get_context", lambda: (_ for _ in ()).throw(RuntimeError("not in Train")))
    assert resumable(10, batch_size=2).sharding.world_size == 1


def test_options_must_fit_the_front_end():
    from data_fixtures import SquaresDataset

    from ray_checkfreq.data.ray_data import RayDataOptions
    from ray_checkfreq.data.torch_loader import TorchLoaderOptions

    with pytest.raises(TypeError, match="TorchLoaderOptions, got RayDataOptions"):
        resumable(SquaresDataset(4), batch_size=2, options=RayDataOptions())
    with pytest.raises(ValueError, match="takes no options"):
        resumable(4, batch_size=2, options=TorchLoaderOptions())
    with pytest.raises(ValueError, match="num_workers must be >= 0, got -1"):
        TorchLoaderOptions(num_workers=-1)
    with pytest.raises(ValueError, match="chunk_rows must be >= 1, got 0"):
        RayDataOptions(chunk_rows=0)
