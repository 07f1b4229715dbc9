"""The constant-memory order (state version 2): a keyed bijection, its quality, its cost, and version 1."""

from __future__ import annotations

import tracemalloc

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ray_checkfreq.data import FullOrder, Sharding, resumable
from ray_checkfreq.data.bijection import KeyedBijection, stable_key
from ray_checkfreq.data.core import RankSlices
from ray_checkfreq.data.index import IndexIterator
from ray_checkfreq.data.order import TAKE_GROUP

FAST = settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
PRIMES = [2, 3, 5, 7, 13, 31, 97, 251, 1021, 4093, 65521]
KEYS = st.integers(0, 2**64 - 1)
SIZES = st.one_of(
    st.sampled_from([1, 2, 3, 4, 15, 16, 17, 63, 64, 65, *PRIMES]),
    st.integers(0, 14).map(lambda k: 2**k),
    st.integers(1, 5000),
)


# -- the bijection -----------------------------------------------------------------------
@FAST
@given(n=SIZES, key=KEYS)
def test_the_bijection_is_a_permutation_for_any_size_and_key(n, key):
    bij = KeyedBijection(n, key)
    image = bij.forward(np.arange(n))
    assert image.dtype == np.int64
    assert np.array_equal(np.sort(image), np.arange(n))
    assert np.array_equal(bij.inverse(image), np.arange(n))


@FAST
@given(
    n=st.sampled_from([2**40, 2**40 - 87, 10**12 + 39, 2**41 + 1, 2**32 - 1, 2**32, 2**31 + 11]),
    key=KEYS,
    picks=st.lists(st.integers(0, 2**42), min_size=1, max_size=300, unique=True),
)
def test_the_bijection_on_2_40_maps_sampled_positions_into_range_distinct_and_back(n, key, picks):
    positions = np.array(sorted({p % n for p in picks} | {0, n - 1}), dtype=np.int64)
    bij = KeyedBijection(n, key)
    image = bij.forward(positions)
    assert image.min() >= 0 and image.max() < n
    assert len(np.unique(image)) == len(positions)
    assert np.array_equal(bij.inverse(image), positions)


def test_a_position_maps_the_same_alone_or_in_any_batch():
    bij = KeyedBijection(10**9, stable_key(1, 2))
    batch = np.array([5, 999_999_999, 123_456_789, 0])
    assert [int(bij.forward(np.array([p]))[0]) for p in batch] == bij.forward(batch).tolist()


def test_out_of_range_values_and_sizes_are_refused():
    bij = KeyedBijection(10, 3)
    with pytest.raises(ValueError, match=r"in \[0, 10\), got \[0, 10\]"):
        bij.forward(np.array([0, 10]))
    with pytest.raises(ValueError, match=r"got \[-1, -1\]"):
        bij.inverse(np.array([-1]))
    with pytest.raises(ValueError, match="size must be in"):
        KeyedBijection(-1, 0)
    with pytest.raises(ValueError, match="64-bit"):
        KeyedBijection(5, 2**64)


def test_keys_separate_seeds_and_epochs():
    orders = {(s, e): FullOrder(num_samples=1000, seed=s, epoch=e).take(0, 1000) for s in range(3) for e in range(3)}
    assert len({o.tobytes() for o in orders.values()}) == 9
    assert stable_key(1, 2) != stable_key(2, 1) and stable_key(0) != stable_key(0, 0)


# -- shuffle quality ---------------------------------------------------------------------
@pytest.mark.parametrize("n", [100_000, 65_536, 70_001])
def test_order_is_not_trivially_structured(n):
    positions = np.arange(n)
    for seed in range(3):
        order = FullOrder(num_samples=n, seed=seed, epoch=seed).take(0, n)
        # position and index uncorrelated (uniform: |r| ~ 1/sqrt(n) = 0.003)
        assert abs(np.corrcoef(positions, order)[0, 1]) < 0.02
        # neighbouring positions spread over the dataset (uniform: mean gap n/3, 2% within n/100)
        gaps = np.abs(np.diff(order))
        assert abs(gaps.mean() / n - 1 / 3) < 0.02
        assert np.mean(gaps < n // 100) < 0.03
        # the same for neighbouring indices, read back through the inverse
        spread = np.abs(np.diff(FullOrder(num_samples=n, seed=seed, epoch=seed).bijection.inverse(positions)))
        assert abs(spread.mean() / n - 1 / 3) < 0.02
        # each tenth of the epoch draws evenly from each tenth of the dataset (uniform: ~1000 each)
        table = np.histogram2d(positions, order, bins=10)[0]
        assert table.min() > 0.85 * n / 100 and table.max() < 1.15 * n / 100
    next_epoch = FullOrder(num_samples=n, seed=0, epoch=1).take(0, n)
    assert abs(np.corrcoef(FullOrder(num_samples=n, seed=0, epoch=0).take(0, n), next_epoch)[0, 1]) < 0.02


# -- cost independent of the dataset size and the position -------------------------------
def _first_batch_after_resume(n: int, position: int, monkeypatch) -> tuple[np.ndarray, int]:
    evaluated: list[int] = []
    forward = KeyedBijection.forward

    def counting(self, positions):
        evaluated.append(len(positions))
        return forward(self, positions)

    monkeypatch.setattr(KeyedBijection, "forward", counting)
    it = resumable(n, batch_size=4, seed=9, rank=1, world_size=3)
    it.load_state_dict({**it.state_dict(), "consumed": position})
    batch = next(iter(it))
    monkeypatch.undo()
    return batch, sum(evaluated)


@pytest.mark.parametrize("fraction", [0.0, 0.5, 0.999])
def test_resume_at_any_position_of_a_trillion_samples_evaluates_one_group(fraction, monkeypatch):
    n = 10**12
    position = int(n * fraction) // 12 * 12
    batch, evaluated = _first_batch_after_resume(n, position, monkeypatch)
    assert batch.tolist() == FullOrder(num_samples=n, seed=9, epoch=0).take(position + 4, position + 8).tolist()
    assert evaluated <= TAKE_GROUP


def test_iterating_a_trillion_sample_epoch_holds_constant_memory():
    it = resumable(10**12, batch_size=1024, seed=1, rank=2, world_size=4)
    tracemalloc.start()
    try:
        gen = iter(it)
        seen = [next(gen) for _ in range(300)]
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 16 * 2**20, f"peak {peak / 2**20:.1f} MiB"
    assert it.consumed == 300 * 4096 and len(np.unique(np.concatenate(seen))) == 300 * 1024


@FAST
@given(
    n=st.integers(0, 500), batch=st.integers(1, 9), world=st.integers(1, 5), start=st.integers(0, 500),
    lo=st.integers(0, 520), width=st.integers(0, 80), drop_last=st.booleans(),
)
def test_rank_slices_overlapping_finds_exactly_the_slices_in_a_range(n, batch, world, start, lo, width, drop_last):
    start = min(start, n)
    for rank in range(world):
        slices = RankSlices(Sharding(batch_size=batch, world_size=world, rank=rank, drop_last=drop_last), n, start)
        listed = list(slices)
        assert len(listed) == len(slices) and [slices[i] for i in range(-len(slices), 0)] == listed
        brute = [i for i, s in enumerate(listed) if s.lo < lo + width and s.hi > lo]
        assert list(slices.overlapping(lo, lo + width)) == brute


# -- version 1: the permutation order stays readable -------------------------------------
def _stream(it, epochs: int) -> list[list[int]]:
    out = []
    while it.epoch < epochs:
        out += [b.tolist() for b in it]
    return out


def test_a_version_1_state_resumes_the_permutation_order_it_started_with():
    def old_run():
        return IndexIterator(50, sharding=Sharding(batch_size=4, world_size=2, rank=0), seed=4, order_version=1)

    reference = _stream(old_run(), 2)
    assert reference[0] == FullOrder(num_samples=50, seed=4, epoch=0, version=1).take(0, 4).tolist()
    interrupted = old_run()
    gen = iter(interrupted)
    head = [next(gen).tolist() for _ in range(3)]
    state = interrupted.state_dict()
    assert state["version"] == 1 and state["consumed"] == 24
    fresh = resumable(50, batch_size=4, seed=4, rank=0, world_size=2)  # a new run would use version 2
    assert fresh.state_dict()["version"] == 2
    fresh.load_state_dict(state)
    assert head + _stream(fresh, 2) == reference  # the rest of epoch 0 and all of epoch 1 on version 1
    assert fresh.state_dict()["version"] == 1


def test_versions_give_different_orders_and_version_2_is_the_default():
    v1 = FullOrder(num_samples=100, seed=0, epoch=0, version=1).take(0, 100)
    v2 = FullOrder(num_samples=100, seed=0, epoch=0).take(0, 100)
    assert not np.array_equal(v1, v2) and sorted(v1.tolist()) == sorted(v2.tolist())
    assert np.array_equal(np.concatenate(list(resumable(100, batch_size=100, seed=0))), v2)
    with pytest.raises(ValueError, match="order version must be one of \\[1, 2\\], got 3"):
        FullOrder(num_samples=10, seed=0, epoch=0, version=3)
