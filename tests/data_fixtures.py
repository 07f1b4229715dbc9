"""Sources and helpers shared by the data-layer tests (imported, not a conftest)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torch

from ray_checkfreq.data import ResumableIterator, SampleKeys


class SquaresDataset(torch.utils.data.Dataset):
    """Sample i: its index and a small float vector derived from it."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.reads: list[int] = []

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict[str, Any]:
        self.reads.append(i)
        return {"id": i, "x": torch.arange(4, dtype=torch.float32) * i}


def jitter_sample(sample: dict[str, Any], rng: np.random.Generator) -> dict[str, Any]:
    """Per-sample augmentation drawn from the sample's own generator."""
    noise = torch.from_numpy(rng.standard_normal(4).astype(np.float32))
    return {"id": sample["id"], "x": sample["x"] + noise}


def jitter_batch(batch: dict[str, np.ndarray], keys: SampleKeys) -> dict[str, np.ndarray]:
    noise = (keys.seeds % np.uint64(1 << 20)).astype(np.float32)[:, None] / (1 << 20)
    return {**batch, "x": batch["x"] + noise}


def dali_source(n: int):
    from nvidia.dali import fn

    from ray_checkfreq.data.dali import DaliSource

    def read(i: int, rng: np.random.Generator) -> tuple[np.ndarray, ...]:
        image = (np.arange(64, dtype=np.float32).reshape(8, 8, 1) + i) % 17
        angle = np.array(rng.uniform(-40.0, 40.0), dtype=np.float32)
        return image, angle, np.array(i, dtype=np.int64)

    def graph(image, angle, index):
        return fn.rotate(image, angle=angle, keep_size=True, fill_value=0.0), angle, index

    return DaliSource(num_samples=n, read=read, graph=graph, num_inputs=3, output_names=("image", "angle", "id"))


def ray_dataset(n: int, num_blocks: int = 5):
    import ray.data

    def features(batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        ids = batch["id"]
        return {"id": ids, "x": np.stack([ids * 0.5, ids * 2.0, -ids], axis=1).astype(np.float32)}

    from ray_checkfreq.data.ray_data import materialized

    return materialized(ray.data.range(n, override_num_blocks=num_blocks).map_batches(features))


def row_ids(ds) -> np.ndarray:
    """The id column in global row order (the order the front end numbers rows in)."""
    import ray

    from ray_checkfreq.data.ray_data import block_layout

    refs = block_layout(ds).refs
    return np.concatenate([ray.get(ref)["id"].to_numpy() for ref in refs])


def batch_ids(batch: Any) -> np.ndarray:
    if isinstance(batch, dict):
        return np.asarray(batch["id"]).reshape(-1).astype(np.int64)
    return np.asarray(batch, dtype=np.int64)


def fingerprint(batch: Any) -> list[tuple[str, str, tuple[int, ...], bytes]]:
    """Bit-exact description of a batch (tensor/array dtypes, shapes and bytes)."""
    items = batch.items() if isinstance(batch, dict) else [("", batch)]
    out = []
    for key, value in sorted(items, key=lambda kv: kv[0]):
        arr = value.numpy() if isinstance(value, torch.Tensor) else np.asarray(value)
        out.append((key, str(arr.dtype), arr.shape, np.ascontiguousarray(arr).tobytes()))
    return out


def collect(
    it: ResumableIterator, epochs: int, stop: tuple[int, int] | None = None
) -> tuple[list[Any], dict[str, Any] | None]:
    """Batches until ``it.epoch == epochs``; with stop=(epoch, k), the state after k batches of that epoch."""
    out: list[Any] = []
    if stop is not None and stop == (it.epoch, 0):
        return out, it.state_dict()
    while it.epoch < epochs:
        epoch, k = it.epoch, 0
        for batch in it:
            out.append(batch)
            k += 1
            if stop == (epoch, k):
                return out, it.state_dict()
    return out, None


def assert_same_stream(a: list[Any], b: list[Any]) -> None:
    assert len(a) == len(b), f"{len(a)} batches against {len(b)}"
    for i, (x, y) in enumerate(zip(a, b)):
        assert fingerprint(x) == fingerprint(y), f"batch {i} differs"


_DATASETS: dict[tuple[str, int], Any] = {}


@pytest.fixture(scope="module")
def small_ray_dataset(ray_session):
    # one materialization per driver connection, even though several modules import this
    # fixture (each import is a separate fixture definition): fewer Ray Data runs. A module
    # with a cluster of its own (conftest.own_cluster) reconnects the driver: a new job, whose
    # objects the old one's dataset cannot reach.
    key = (ray_session.get_runtime_context().get_job_id(), 103)
    if key not in _DATASETS:
        _DATASETS[key] = ray_dataset(103)
    return _DATASETS[key]


Maker = Callable[..., ResumableIterator]
