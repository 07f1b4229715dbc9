"""The Ray Dataset the iterator benchmarks read: ``rows`` ids in ``blocks`` blocks, each row
with ``features`` float32 values derived from its id (so a batch shows which rows it holds)."""

from __future__ import annotations

from typing import Any

import numpy as np


def bench_dataset(cfg: Any) -> Any:
    import ray.data

    from ray_checkfreq.data.ray_data import materialized

    width = cfg.features

    def features(batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        ids = batch["id"]
        return {"id": ids, "x": (ids[:, None] + np.arange(width)[None, :]).astype(np.float32)}

    return materialized(ray.data.range(cfg.rows, override_num_blocks=cfg.blocks).map_batches(features))
