"""Ray Data front end: the block layout it relies on, real Ray workers across resizes."""

from __future__ import annotations

import sys

import numpy as np
from data_fixtures import ray_dataset, row_ids, small_ray_dataset  # noqa: F401  (fixture)

from ray_checkfreq.data import resumable
from ray_checkfreq.data.ray_data import RayDataOptions, block_layout


def test_internal_block_api_matches_the_public_one(small_ray_dataset):
    # pins the internal iter_internal_ref_bundles(): same refs, same order, true row counts
    internal = block_layout(small_ray_dataset)
    public = block_layout(small_ray_dataset, public=True)
    assert [r.hex() for r in internal.refs] == [r.hex() for r in public.refs]
    assert internal.row_counts.tolist() == public.row_counts.tolist()
    assert internal.num_rows == 103 and len(internal.refs) > 1


def test_rematerialized_source_numbers_rows_the_same(small_ray_dataset):
    again = ray_dataset(103, num_blocks=5)
    assert np.array_equal(row_ids(again), row_ids(small_ray_dataset))


def _rank_task(ds, state, rank, world, steps, batch, seed, options):
    from ray_checkfreq.data import resumable

    it = resumable(ds, batch_size=batch, seed=seed, rank=rank, world_size=world, options=options)
    it.load_state_dict(state)
    ids: list[int] = []
    gen = iter(it)
    for _ in range(steps):
        got = next(gen, None)
        if got is None:
            break
        ids += got["id"].tolist()
    return ids, it.state_dict()


def test_elastic_4_3_5_1_with_real_ray_workers(small_ray_dataset):
    import ray
    import ray.cloudpickle

    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
    task = ray.remote(num_cpus=1)(_rank_task)
    options = RayDataOptions(chunk_rows=8, window_chunks=2)
    batch, seed = 4, 11
    state = resumable(small_ray_dataset, batch_size=batch, seed=seed, options=options).state_dict()
    seen: list[int] = []
    for world, steps in [(4, 2), (3, 3), (5, 1), (1, 1000)]:
        results = ray.get(
            [task.remote(small_ray_dataset, state, r, world, steps, batch, seed, options) for r in range(world)]
        )
        states = [s for _, s in results]
        assert all(s == states[0] for s in states)
        seen += [i for ids, _ in results for i in ids]
        state = states[0]
    assert state["epoch"] == 1 and state["consumed"] == 0
    assert sorted(seen) == list(range(103))


def test_batches_match_iter_torch_batches_types(small_ray_dataset):
    import torch

    options = RayDataOptions(chunk_rows=16, window_chunks=2, dtypes={"x": torch.float64})
    it = resumable(small_ray_dataset, batch_size=10, seed=0, options=options,
                   transform=lambda b: {**b, "y": b["id"] * 2})
    batches = list(it)
    first = batches[0]
    assert set(first) == {"id", "x", "y"}
    assert first["x"].dtype == torch.float64 and first["x"].shape == (10, 3)
    assert torch.equal(first["y"], first["id"] * 2)
    ids = torch.cat([b["id"] for b in batches])
    assert sorted(ids.tolist()) == list(range(103))
    xs = torch.cat([b["x"] for b in batches])
    assert torch.equal(xs[:, 1], ids.double() * 2.0)  # columns stay aligned with their rows


def test_sequential_order_reads_the_dataset_in_row_order(small_ray_dataset):
    options = RayDataOptions(chunk_rows=8, window_chunks=3)
    it = resumable(small_ray_dataset, batch_size=9, shuffle=False, options=options)
    ids = np.concatenate([b["id"].numpy() for b in it])
    assert np.array_equal(ids, row_ids(small_ray_dataset))


def _epoch(ds, rank, world, read):
    from data_fixtures import fingerprint

    options = RayDataOptions(chunk_rows=8, window_chunks=3, read=read, prefetch=False)
    it = resumable(ds, batch_size=4, seed=5, rank=rank, world_size=world, options=options)
    batches = list(it)
    return [fingerprint(b) for b in batches], sum(len(b["id"]) for b in batches), it.bytes_fetched


def test_remote_reads_fetch_only_the_ranks_rows_and_give_the_same_batches(small_ray_dataset):
    import ray

    row_bytes = sum(ray.get(ref).nbytes for ref in block_layout(small_ray_dataset).refs) / 103
    for world in (2, 4):
        for rank in range(world):
            local, rows, local_bytes = _epoch(small_ray_dataset, rank, world, "local")
            remote, rows_again, remote_bytes = _epoch(small_ray_dataset, rank, world, "remote")
            assert remote == local and rows == rows_again
            assert remote_bytes <= 1.5 * rows * row_bytes, (world, rank, remote_bytes, rows * row_bytes)
            assert local_bytes >= 0.9 * 103 * row_bytes  # local reads pull every block of every window
