"""The shared resume-equivalence test every front end must pass, and no-replay checks."""

from __future__ import annotations

import multiprocessing

import numpy as np
import pytest
from data_fixtures import (
    SquaresDataset,
    assert_same_stream,
    batch_ids,
    collect,
    dali_source,
    jitter_batch,
    jitter_sample,
    row_ids,
    small_ray_dataset,  # noqa: F401  (fixture)
)

from ray_checkfreq.data import resumable
from ray_checkfreq.data.ray_data import RayDataOptions
from ray_checkfreq.data.torch_loader import TorchLoaderOptions

N, BATCH, WORLD, RANK, EPOCHS = 103, 8, 2, 1, 3
# rank 1 of 2: 6 full global batches of 16, then 7 left -> 4 for rank 0, 3 for rank 1
PER_EPOCH = 7
# (epoch, batches of that epoch taken before the interruption)
STOPS = {
    "start": (0, 0),
    "middle": (1, 3),
    "last_batch": (1, PER_EPOCH - 1),
    "epoch_boundary": (1, PER_EPOCH),
}


# DataLoader workers come from a forkserver, never a fork of this Ray driver process
# (a fork after ray.init was seen to hang a later Ray Data job); ray_data still runs first.
@pytest.fixture(params=["ray_data", "index", "torch", "dali"])
def make(request):
    kind = request.param
    if kind == "index":
        source, extra = N, {}
    elif kind == "torch":
        # Workers fork from a forkserver that has imported torch once, instead of each
        # importing it anew (seconds per worker, dozens of workers in this module).
        multiprocessing.set_forkserver_preload(["torch", "data_fixtures", "ray_checkfreq.data.torch_loader"])
        options = TorchLoaderOptions(num_workers=2, multiprocessing_context="forkserver")
        source, extra = SquaresDataset(N), dict(transform=jitter_sample, options=options)
    elif kind == "dali":
        source, extra = dali_source(N), {}
    else:
        source = request.getfixturevalue("small_ray_dataset")
        extra = dict(transform=jitter_batch, options=RayDataOptions(chunk_rows=8, window_chunks=3))

    def build(rank: int = RANK, world_size: int = WORLD):
        return resumable(source, batch_size=BATCH, seed=7, rank=rank, world_size=world_size, **extra)

    build.kind = kind
    return build


def test_resume_reproduces_uninterrupted_run(make):
    reference, _ = collect(make(), EPOCHS)
    assert len(reference) == EPOCHS * PER_EPOCH
    ids = np.concatenate([batch_ids(b) for b in reference[:PER_EPOCH]])
    assert len(ids) == 51 and len(set(ids.tolist())) == 51  # rank 1's share of epoch 0
    for name, stop in STOPS.items():
        head, state = collect(make(), EPOCHS, stop=stop)
        assert state is not None, name
        fresh = make()
        fresh.load_state_dict(state)
        tail, _ = collect(fresh, EPOCHS)
        assert len(head) == stop[0] * PER_EPOCH + stop[1], name
        assert_same_stream(head + tail, reference)


def _per_sample(batches) -> dict[int, bytes]:
    """id -> bytes of that sample's row in every output (the augmented tensors)."""
    out: dict[int, bytes] = {}
    for batch in batches:
        ids = batch_ids(batch)
        for pos, i in enumerate(ids.tolist()):
            if isinstance(batch, dict):
                out[i] = b"".join(np.asarray(batch[k])[pos].tobytes() for k in sorted(batch))
            else:
                out[i] = b""
    return out


def test_augmentation_is_keyed_by_seed_epoch_and_sample(make):
    # the same sample gets the same augmented tensors whichever rank and world size read it
    alone = make(rank=0, world_size=1)
    epoch0, epoch1 = _per_sample(alone), _per_sample(alone)
    sharded = {}
    for rank in range(3):
        sharded.update(_per_sample(make(rank=rank, world_size=3)))
    assert sorted(epoch0) == list(range(N)) and sharded == epoch0
    if make.kind != "index":
        assert sum(epoch0[i] != epoch1[i] for i in range(N)) > N // 2  # redrawn each epoch


def test_epochs_have_new_orders(make):
    it = make()
    first = np.concatenate([batch_ids(b) for b in it])
    second = np.concatenate([batch_ids(b) for b in it])
    assert not np.array_equal(first, second)


def test_dali_parameters_come_from_the_sample_generator():
    from ray_checkfreq.data import sample_rng

    it = resumable(dali_source(20), batch_size=6, seed=5)
    for batch in it:
        for i, angle in zip(batch["id"].tolist(), batch["angle"].tolist()):
            assert angle == pytest.approx(float(np.float32(sample_rng(5, 0, i).uniform(-40.0, 40.0))))
    assert it.epoch == 1


def test_torch_resume_reads_only_the_rest():
    dataset = SquaresDataset(50)
    options = TorchLoaderOptions(num_workers=0)
    it = resumable(dataset, batch_size=4, seed=3, options=options)
    taken = []
    for k, batch in enumerate(it):
        taken += batch["id"].tolist()
        if k == 6:
            break
    state = it.state_dict()
    assert state["epoch"] == 0 and state["consumed"] == 28
    dataset.reads.clear()
    fresh = resumable(dataset, batch_size=4, seed=3, options=options)
    fresh.load_state_dict(state)
    rest = [i for batch in fresh for i in batch["id"].tolist()]
    assert sorted(dataset.reads) == sorted(rest) and len(rest) == 22
    assert sorted(taken + rest) == list(range(50))


def test_ray_resume_reads_no_earlier_window(small_ray_dataset):
    options = RayDataOptions(chunk_rows=8, window_chunks=2, prefetch=False)
    it = resumable(small_ray_dataset, batch_size=5, seed=1, options=options)
    order = it._order(0)
    state = {**it.state_dict(), "consumed": 90}
    it.load_state_dict(state)
    rest = [i for b in it for i in b["id"].tolist()]
    assert rest == row_ids(small_ray_dataset)[order.take(90, 103)].tolist()
    needed = {w for w, _ in order.locate(90, 103)}
    assert it.windows_read == len(needed) < order.num_windows


def test_an_iterator_taken_before_the_restore_raises_by_name_instead_of_yielding_nothing():
    from ray_checkfreq.data import StaleIteratorError

    saved_from = resumable(100, global_batch_size=10, seed=3, world_size=1, rank=0)
    batches = iter(saved_from)
    first = [next(batches) for _ in range(4)]
    state = saved_from.state_dict()
    loader = resumable(100, global_batch_size=10, seed=3, world_size=1, rank=0)
    early = iter(loader)  # taken before the restore, as a framework may
    loader.load_state_dict(state)
    with pytest.raises(StaleIteratorError, match="taken before the loader's state was restored"):
        next(early)
    fresh = iter(loader)
    assert np.array_equal(next(fresh), next(batches)) and len(first) == 4  # a new one continues at batch 5
    replaced = iter(loader)  # a newer iter() takes over: the older one ends, as before
    assert list(fresh) == []
    assert np.array_equal(next(replaced), next(batches))
