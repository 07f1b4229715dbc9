"""Fixed global batch under elastic world sizes, and refusing loaders that shard again."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler

from ray_checkfreq.data import DataStateError, refuse_distributed_sampler, resumable

N = 203  # not a multiple of G: the last partial global batch is covered too
G = 12
SEED = 4


def _ranks(world, **kwargs):
    kwargs.setdefault("global_batch_size", G)
    return [resumable(N, seed=SEED, rank=r, world_size=world, **kwargs) for r in range(world)]


def _global_batches(its, state=None):
    """Lockstep over every rank: per global step, the ranks' batches concatenated in rank order."""
    for it in its:
        if state is not None:
            it.load_state_dict(state)
    epoch = its[0].epoch
    gens = [iter(it) for it in its]
    steps = []
    while its[0].epoch == epoch:
        parts = [next(g, np.empty(0, dtype=np.int64)) for g in gens]
        steps.append(np.concatenate(parts).tolist())
    assert all(it.state_dict() == its[0].state_dict() for it in its)
    return steps


@pytest.mark.parametrize("world", [1, 2, 3, 4, 6])
def test_fixed_global_batch_gives_the_same_global_batches_at_any_world_size(world):
    reference = _global_batches(_ranks(1))
    assert [len(s) for s in reference] == [G] * (N // G) + [N % G]
    assert _global_batches(_ranks(world)) == reference
    assert {it.sharding.batch_size for it in _ranks(world)} == {G // world}


def test_per_rank_batch_size_changes_the_global_batch_with_the_world_size():
    two = _global_batches(_ranks(2, global_batch_size=None, batch_size=6))
    four = _global_batches(_ranks(4, global_batch_size=None, batch_size=6))
    assert len(two[0]) == 12 and len(four[0]) == 24
    assert four[0] == two[0] + two[1]


def _mid_epoch_state(steps):
    its = _ranks(2)
    gens = [iter(it) for it in its]
    for _ in range(steps):
        for g in gens:
            next(g)
    return its[0].state_dict()


@pytest.mark.parametrize("new_world", [1, 4])
def test_resume_at_another_world_size_with_fixed_g_continues_the_fixed_run(new_world):
    uninterrupted = _global_batches(_ranks(2))
    done = 5
    state = _mid_epoch_state(done)
    assert state["consumed"] == done * G and state["global_batch_size"] == G
    resumed = _global_batches(_ranks(new_world), state)
    assert resumed == uninterrupted[done:]
    seen = [i for step in uninterrupted[:done] + resumed for i in step]
    assert sorted(seen) == list(range(N))  # every sample exactly once in that epoch
    assert _ranks(new_world)[0].sharding.batch_size == G // new_world  # re-derived, not the saved 6


def test_resume_with_another_global_batch_is_refused():
    state = _mid_epoch_state(2)
    other = resumable(N, seed=SEED, rank=0, world_size=2, global_batch_size=2 * G)
    with pytest.raises(DataStateError) as info:
        other.load_state_dict(state)
    assert info.value.field == "global_batch_size" and str(G) in str(info.value)


def test_switching_between_per_rank_and_fixed_global_batch_is_refused():
    fixed_state = _mid_epoch_state(2)
    per_rank = resumable(N, seed=SEED, rank=0, world_size=2, batch_size=G // 2)
    with pytest.raises(DataStateError, match="per-rank batch_size=6") as info:
        per_rank.load_state_dict(fixed_state)
    assert info.value.field == "global_batch_size"
    fixed = resumable(N, seed=SEED, rank=0, world_size=2, global_batch_size=G)
    with pytest.raises(DataStateError) as info:
        fixed.load_state_dict(per_rank.state_dict())
    assert info.value.field == "global_batch_size"


def test_per_rank_resume_keeps_b_and_refuses_another_b():
    its = _ranks(2, global_batch_size=None, batch_size=5)
    gens = [iter(it) for it in its]
    for g in gens:
        next(g)
    state = its[0].state_dict()
    assert state["global_batch_size"] is None and state["batch_size"] == 5
    wider = _ranks(4, global_batch_size=None, batch_size=5)
    steps = _global_batches(wider, state)
    assert len(steps[0]) == 20  # B kept, G = 5 * 4
    assert sorted(_first(state) + [i for s in steps for i in s]) == list(range(N))
    other_b = resumable(N, seed=SEED, rank=0, world_size=4, batch_size=3)
    with pytest.raises(DataStateError) as info:
        other_b.load_state_dict(state)
    assert info.value.field == "batch_size" and info.value.saved == 5 and info.value.expected == 3


def _first(state):
    from ray_checkfreq.data import FullOrder

    return FullOrder(num_samples=N, seed=SEED, epoch=state["epoch"]).take(0, state["consumed"]).tolist()


def test_a_state_from_before_fixed_g_reads_as_per_rank():
    state = resumable(N, seed=SEED, batch_size=4).state_dict()
    del state["global_batch_size"]
    it = resumable(N, seed=SEED, batch_size=4)
    it.load_state_dict({**state, "consumed": 8})
    assert it.consumed == 8


@pytest.mark.parametrize("world", [5, 7, 24])
def test_a_world_size_that_does_not_divide_g_is_a_clear_error(world):
    with pytest.raises(ValueError, match=f"global_batch_size={G} is not divisible by world_size={world}"):
        resumable(N, global_batch_size=G, rank=0, world_size=world)


@pytest.mark.parametrize(
    "kwargs", [{}, {"batch_size": 4, "global_batch_size": 8}], ids=["neither", "both"]
)
def test_exactly_one_batch_size_is_required(kwargs):
    with pytest.raises(ValueError, match="exactly one of batch_size .* and global_batch_size"):
        resumable(N, **kwargs)


def test_global_batch_size_must_be_positive():
    with pytest.raises(ValueError, match="global_batch_size must be >= 1, got 0"):
        resumable(N, global_batch_size=0)


def _dataset():
    return TensorDataset(torch.arange(16.0))


@pytest.mark.parametrize("sharded", [False, True])
def test_a_data_loader_source_is_refused_whatever_its_sampler(sharded):
    sampler = DistributedSampler(_dataset(), num_replicas=2, rank=0) if sharded else None
    loader = DataLoader(_dataset(), batch_size=4, sampler=sampler)
    with pytest.raises(TypeError, match=r"pass .*resumable\(loader.dataset"):
        resumable(loader, batch_size=4)


def test_refuse_distributed_sampler_both_ways():
    ds = _dataset()
    plain = DataLoader(ds, batch_size=4, shuffle=True)
    refuse_distributed_sampler(plain, "data=")
    refuse_distributed_sampler(ds, "data=")
    refuse_distributed_sampler(resumable(16, batch_size=4), "data=")
    by_sampler = DataLoader(ds, batch_size=4, sampler=DistributedSampler(ds, num_replicas=2, rank=1))
    with pytest.raises(TypeError, match="data= is a DataLoader sharded by a DistributedSampler"):
        refuse_distributed_sampler(by_sampler, "data=")
    batch_sampler = torch.utils.data.BatchSampler(DistributedSampler(ds, num_replicas=2, rank=0), 4, False)
    by_batch_sampler = DataLoader(ds, batch_sampler=batch_sampler)
    with pytest.raises(TypeError, match="prepare_data_loader"):
        refuse_distributed_sampler(by_batch_sampler, "data=")
