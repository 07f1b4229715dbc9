"""Per-node reads of the Ray Data front end: ``ray-checkfreq bench iterator --nodes 2,4``.

For each node count n, a ``ray.cluster_utils.Cluster`` of n one-CPU nodes on this machine
(each with its own raylet and object store; objects on another node really are pulled
between object stores), one materialized dataset whose blocks Ray Data spreads over the
nodes, and one rank per node (pinned by a per-node resource) reading one epoch with
``read="local"`` and then ``read="remote"``. Each rank reports the bytes of the objects its
reader got (``bytes_fetched``: whole blocks, or its row slices) against the bytes its
samples occupy (its rows x the dataset's bytes per row).
"""

from __future__ import annotations

from typing import Any

import numpy as np

NODE_RESOURCE = "rcf_bench_node_{}"


def _rank_epoch(ds: Any, rank: int, world: int, read: str, batch_size: int, chunk_rows: int,
                window_chunks: int) -> dict[str, Any]:
    import time

    from ray_checkfreq.data.core import Sharding
    from ray_checkfreq.data.ray_data import RayDataIterator, RayDataOptions

    options = RayDataOptions(chunk_rows=chunk_rows, window_chunks=window_chunks, read=read)
    it = RayDataIterator(ds, sharding=Sharding(batch_size=batch_size, world_size=world, rank=rank), options=options)
    start = time.perf_counter()
    rows = sum(len(b["id"]) for b in it)
    return {"rows": rows, "bytes_fetched": it.bytes_fetched, "seconds": time.perf_counter() - start}


def _one_cluster(nodes: int, cfg: Any) -> dict[str, Any]:
    import ray
    from ray.cluster_utils import Cluster
    from ray.experimental import get_object_locations

    from benchmarks.iterator_dataset import bench_dataset
    from ray_checkfreq.data.ray_data import block_layout

    cluster = Cluster(initialize_head=True, head_node_args={
        "num_cpus": 1, "object_store_memory": 200 << 20, "include_dashboard": False,
        "resources": {NODE_RESOURCE.format(0): 1}})
    try:
        for i in range(1, nodes):
            cluster.add_node(num_cpus=1, object_store_memory=200 << 20, resources={NODE_RESOURCE.format(i): 1})
        cluster.wait_for_nodes()
        ray.init(address=cluster.address, log_to_driver=False, configure_logging=False)
        import ray.data

        ray.data.DataContext.get_current().enable_progress_bars = False
        ds = bench_dataset(cfg)
        refs = block_layout(ds).refs
        homes = [tuple(w.get("node_ids") or ()) for w in get_object_locations(refs).values()]
        row_bytes = sum(t.nbytes for t in ray.get(refs)) / cfg.rows
        task = ray.remote(num_cpus=1)(_rank_epoch)
        out: dict[str, Any] = {"blocks_per_node": sorted(np.unique([h[0] for h in homes if h], return_counts=True)[1]
                                                          .tolist()), "row_bytes": row_bytes}
        for read in ("local", "remote"):
            ranks = ray.get([task.options(resources={NODE_RESOURCE.format(r): 1}).remote(
                ds, r, nodes, read, cfg.batch_size, cfg.chunk_rows, cfg.window_chunks) for r in range(nodes)])
            for r in ranks:
                r["ratio"] = r["bytes_fetched"] / (r["rows"] * row_bytes)
            out[read] = ranks
        return out
    finally:
        ray.shutdown()
        cluster.shutdown()


def measure_nodes(node_counts: tuple[int, ...], cfg: Any) -> dict[str, Any]:
    return {str(n): _one_cluster(n, cfg) for n in node_counts}


def format_nodes(result: dict[str, Any]) -> list[str]:
    lines = ["per-node reads: bytes fetched per node / bytes its samples occupy (one rank per node, one epoch)",
             f"  {'nodes':>5}{'blocks per node':>18}{'read':>8}{'worst':>8}{'mean':>8}{'epoch s (slowest)':>19}"]
    for n, figures in result.items():
        for read in ("local", "remote"):
            ratios = [r["ratio"] for r in figures[read]]
            slowest = max(r["seconds"] for r in figures[read])
            lines.append(f"  {n:>5}{str(figures['blocks_per_node']):>18}{read:>8}{max(ratios):>7.2f}x"
                         f"{np.mean(ratios):>7.2f}x{slowest:>19.2f}")
    return lines
