"""``ray-checkfreq bench iterator``: the Ray Data front end against ``iter_torch_batches``.

Measures, on one materialized dataset in one run:
- throughput (samples/s) of ``resumable(ds)`` and of ``ds.iter_torch_batches`` with its
  local shuffle buffer (target: ours >= 0.9x);
- how random each order is (see ``shuffle_quality``);
- time to the first batch after a restore at several positions of the epoch, ours
  (load_state_dict) against re-iterating and skipping the consumed batches;
- the before/after demo: samples repeated / missed across an interruption;
- with ``--num-samples N``: the order alone at N (indices only; ``iterator_order``): peak
  RSS per rank, time to the first batch after a restore at 0 and 0.999 N, samples/s of
  the version 2 order against version 1 (today's permutation) at ``--compare-samples``.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from benchmarks.harness import add_json_argument, write_json
from benchmarks.iterator_dataset import bench_dataset


@dataclass(frozen=True, kw_only=True)
class BenchConfig:
    rows: int = 200_000
    features: int = 16
    blocks: int = 40
    batch_size: int = 256
    shuffle_buffer: int = 10_000
    chunk_rows: int = 256
    window_chunks: int = 64
    positions: tuple[float, ...] = (0.1, 0.5, 0.9)
    repeats: int = 2
    num_cpus: int = 2

    def __post_init__(self) -> None:
        for name in ("rows", "features", "blocks", "batch_size", "chunk_rows", "window_chunks", "repeats", "num_cpus"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.shuffle_buffer < 0:
            raise ValueError(f"shuffle_buffer must be >= 0, got {self.shuffle_buffer}")
        bad = [p for p in self.positions if not 0.0 <= p < 1.0]
        if bad:
            raise ValueError(f"positions must be in [0, 1), got {bad}")


# -- shuffle quality ---------------------------------------------------------------------------
def shuffle_quality(ids: np.ndarray, num_rows: int, global_batch: int) -> dict[str, float]:
    """How far an epoch's order is from a uniform permutation (ids = rows in yield order).

    - spearman: rank correlation of epoch position and row index (uniform: ~0).
    - neighbours_same_batch: fraction of row pairs (i, i+1) that land in one batch
      (uniform: ~global_batch / num_rows).
    - displacement: mean |position - row| / num_rows (uniform: ~1/3).
    """
    pos = np.empty(num_rows, dtype=np.int64)
    pos[ids] = np.arange(len(ids))
    spearman = float(np.corrcoef(pos, np.arange(num_rows))[0, 1])
    batch_of = pos // global_batch
    same = float(np.mean(batch_of[1:] == batch_of[:-1]))
    displacement = float(np.mean(np.abs(pos - np.arange(num_rows))) / num_rows)
    return {"spearman": spearman, "neighbours_same_batch": same, "displacement": displacement}


# -- before / after ---------------------------------------------------------------------------------
def before_after(num_samples: int = 10_000, batch_size: int = 32,
                 interrupt_at: float = 0.6) -> dict[str, dict[str, int]]:
    """Samples repeated / missed in the interrupted epoch: stock iterators vs ours.

    Scenarios: (1) same world size, a DataLoader(shuffle=True) that restarts the epoch;
    (2) 4 ranks -> 3 ranks, DistributedSampler(seed, set_epoch) skipping each rank's
    consumed batches; ours in both. Indices only: no data is read.
    """
    import torch
    from torch.utils.data import DataLoader

    def count(seen: list[int]) -> dict[str, int]:
        hits = np.bincount(np.asarray(seen, dtype=np.int64), minlength=num_samples)
        return {"repeated": int(np.sum(np.maximum(hits - 1, 0))), "missed": int(np.sum(hits == 0))}

    data: Any = list(range(num_samples))  # a list is a map-style dataset; torch's stubs disagree
    steps = int(num_samples * interrupt_at) // batch_size
    loader = DataLoader(data, batch_size=batch_size, shuffle=True, generator=torch.Generator().manual_seed(0))
    seen = [i for _, b in zip(range(steps), loader) for i in b.tolist()]
    restarted = DataLoader(data, batch_size=batch_size, shuffle=True, generator=torch.Generator().manual_seed(1))
    seen += [i for b in restarted for i in b.tolist()]
    out = {"stock DataLoader, restart the epoch": count(seen)}
    out["ours, same world size"] = count(_ours_run(num_samples, batch_size, steps, 1, 1))
    for new in (3, 5):
        steps = int(num_samples * interrupt_at) // (batch_size * 4)
        stock = _stock_elastic(data, batch_size, steps, 4, new)
        out[f"stock DistributedSampler, 4 -> {new} ranks, skip"] = count(stock)
        out[f"ours, 4 -> {new} ranks"] = count(_ours_run(num_samples, batch_size, steps, 4, new))
    return out


def _stock_elastic(data: Any, batch_size: int, steps: int, old: int, new: int) -> list[int]:
    """DistributedSampler(seed, set_epoch): `old` ranks take `steps` batches, `new` ranks skip as many."""
    from torch.utils.data import DataLoader, DistributedSampler

    seen: list[int] = []
    for world, before in ((old, True), (new, False)):
        for rank in range(world):
            sampler: DistributedSampler[int] = DistributedSampler(
                data, num_replicas=world, rank=rank, shuffle=True, seed=0)
            sampler.set_epoch(0)
            for k, b in enumerate(DataLoader(data, batch_size=batch_size, sampler=sampler)):
                if (k < steps) == before:
                    seen += b.tolist()
    return seen


def _ours_run(num_samples: int, batch_size: int, steps: int, old: int, new: int) -> list[int]:
    """`old` ranks take `steps` lockstep batches, save rank 0's state; `new` ranks finish the epoch."""
    from ray_checkfreq.data import resumable

    seen: list[int] = []
    state = None
    for phase, world in enumerate((old, new)):
        its = [resumable(num_samples, batch_size=batch_size, seed=0, rank=r, world_size=world) for r in range(world)]
        for it in its:
            if state is not None:
                it.load_state_dict(state)
        gens = [iter(it) for it in its]
        for _ in range(steps if phase == 0 else num_samples):
            got = [b for b in (next(g, None) for g in gens) if b is not None]
            if not got:
                break
            seen += [i for b in got for i in b.tolist()]
        state = its[0].state_dict()
    return seen


# -- Ray Data measurements -----------------------------------------------------------------------------
def _timed_epoch(batches: Iterable[dict[str, Any]]) -> tuple[float, np.ndarray]:
    start = time.perf_counter()
    ids = [b["id"].numpy() for b in batches]
    return time.perf_counter() - start, np.concatenate(ids)


def _first_batch_s(make: Callable[[], Iterable[Any]]) -> float:
    start = time.perf_counter()
    next(iter(make()))
    return time.perf_counter() - start


STOCK = "iter_torch_batches"


def measure(cfg: BenchConfig) -> dict[str, Any]:
    import itertools

    from ray_checkfreq.data import resumable
    from ray_checkfreq.data.ray_data import RayDataOptions, block_layout

    ds = bench_dataset(cfg)
    row_index = np.concatenate([np.asarray(_ids_of(ref)) for ref in block_layout(ds).refs])
    to_row = np.empty(cfg.rows, dtype=np.int64)
    to_row[row_index] = np.arange(cfg.rows)
    options = RayDataOptions(chunk_rows=cfg.chunk_rows, window_chunks=cfg.window_chunks)

    def ours(seed: int = 0):
        return resumable(ds, batch_size=cfg.batch_size, seed=seed, rank=0, world_size=1, options=options)

    def stock(source: Any = ds):
        return source.iter_torch_batches(
            batch_size=cfg.batch_size, local_shuffle_buffer_size=cfg.shuffle_buffer or None)

    def ours_v1(seed: int) -> Any:
        it = ours(seed=seed)
        it.order_version = 1  # the permutation order a version 1 state would bring
        return it

    variants: dict[str, Callable[[int], Iterable[Any]]] = {
        "ours": lambda rep: ours(seed=rep),
        "  ours, version 1 order": lambda rep: ours_v1(rep),
        STOCK: lambda rep: stock(),
        "  + randomize_block_order": lambda rep: stock(ds.randomize_block_order(seed=rep)),
        "  no shuffle buffer": lambda rep: ds.iter_torch_batches(batch_size=cfg.batch_size),
    }
    times: dict[str, list[float]] = {k: [] for k in variants}
    ids: dict[str, np.ndarray] = {}
    for rep in range(cfg.repeats):  # interleaved so all see the same machine state
        for name, make in variants.items():
            t, ids[name] = _timed_epoch(make(rep))
            times[name].append(t)
    throughput = {k: cfg.rows / min(v) for k, v in times.items()}
    uniform = np.random.default_rng(0).permutation(cfg.rows)
    quality = {k: shuffle_quality(to_row[v], cfg.rows, cfg.batch_size) for k, v in ids.items()}
    quality["uniform permutation"] = shuffle_quality(uniform, cfg.rows, cfg.batch_size)

    resume = []
    batches_per_epoch = -(-cfg.rows // cfg.batch_size)
    for p in cfg.positions:
        skip = int(batches_per_epoch * p)
        state = {**ours().state_dict(), "consumed": skip * cfg.batch_size}

        def restored(state: dict = state) -> Any:
            it = ours()
            it.load_state_dict(state)
            return it

        def skipped(skip: int = skip) -> Any:
            return itertools.islice(stock(), skip, None)

        ours_s = min(_first_batch_s(restored) for _ in range(cfg.repeats))
        skip_s = min(_first_batch_s(skipped) for _ in range(cfg.repeats))
        resume.append({"position": p, "skipped_batches": skip, "ours_s": ours_s, "skip_batches_s": skip_s})
    return {
        "config": asdict(cfg),
        "throughput_samples_per_s": throughput,
        "ratio_ours_to_stock": throughput["ours"] / throughput[STOCK],
        "shuffle_quality": quality,
        "resume": resume,
    }


def _ids_of(ref: Any) -> np.ndarray:
    import ray

    return ray.get(ref)["id"].to_numpy()


# -- printing ---------------------------------------------------------------------------------------------
def format_report(result: dict[str, Any]) -> str:
    lines = []
    if "order" in result:
        from benchmarks.iterator_order import format_order

        lines += [*format_order(result["order"]), ""]
    if "nodes" in result:
        from benchmarks.iterator_nodes import format_nodes

        lines += [*format_nodes(result["nodes"]), ""]
    if "throughput_samples_per_s" in result:
        tp = result["throughput_samples_per_s"]
        lines += ["throughput (one epoch, best of repeats)", f"  {'iterator':<28}{'samples/s':>12}"]
        lines += [f"  {k:<28}{v:>12,.0f}" for k, v in tp.items()]
        lines += [f"  ratio ours / {STOCK} (local shuffle buffer): {result['ratio_ours_to_stock']:.2f}x", ""]
        lines += ["shuffle quality", f"  {'order':<28}{'spearman':>10}{'nbr same batch':>16}{'displacement':>14}"]
        for k, q in result["shuffle_quality"].items():
            lines.append(f"  {k:<28}{q['spearman']:>10.3f}{q['neighbours_same_batch']:>16.4f}"
                         f"{q['displacement']:>14.3f}")
        lines += ["", "time to first batch after a restore (best of repeats)",
                  f"  {'position':>9}{'skipped':>9}{'ours s':>10}{'skip s':>10}"]
        for r in result["resume"]:
            lines.append(f"  {r['position']:>9.0%}{r['skipped_batches']:>9}{r['ours_s']:>10.3f}"
                         f"{r['skip_batches_s']:>10.3f}")
        lines.append("")
    lines += ["before/after: interrupted epoch", f"  {'iterator':<46}{'repeated':>9}{'missed':>8}"]
    lines += [f"  {k:<46}{v['repeated']:>9}{v['missed']:>8}" for k, v in result["before_after"].items()]
    return "\n".join(lines)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    d = BenchConfig()
    parser.add_argument("--rows", type=int, default=d.rows)
    parser.add_argument("--features", type=int, default=d.features, help="float32 columns per row")
    parser.add_argument("--blocks", type=int, default=d.blocks)
    parser.add_argument("--batch-size", type=int, default=d.batch_size)
    parser.add_argument("--shuffle-buffer", type=int, default=d.shuffle_buffer, help="iter_torch_batches local buffer")
    parser.add_argument("--chunk-rows", type=int, default=d.chunk_rows)
    parser.add_argument("--window-chunks", type=int, default=d.window_chunks)
    parser.add_argument("--positions", default=",".join(str(p) for p in d.positions), help="epoch fractions")
    parser.add_argument("--repeats", type=int, default=d.repeats)
    parser.add_argument("--num-cpus", type=int, default=d.num_cpus, help="local Ray cluster size")
    parser.add_argument("--demo-only", action="store_true", help="only the before/after demo (no Ray)")
    parser.add_argument("--num-samples", type=int, help="also measure the order alone at N samples (indices only)")
    parser.add_argument("--compare-samples", type=int, default=10_000_000,
                        help="N for version 2 against version 1 over one epoch")
    parser.add_argument("--measure-samples", type=int, default=10_000_000,
                        help="samples read after each restore (at most)")
    parser.add_argument("--world-size", type=int, default=1, help="ranks the order is sharded over (rank 0 runs)")
    parser.add_argument("--order-repeats", type=int, default=3)
    parser.add_argument("--nodes", help="also per-node reads on local clusters of these node counts, e.g. 2,4")
    add_json_argument(parser)


def _config(args: argparse.Namespace) -> BenchConfig:
    return BenchConfig(
        rows=args.rows,
        features=args.features,
        blocks=args.blocks,
        batch_size=args.batch_size,
        shuffle_buffer=args.shuffle_buffer,
        chunk_rows=args.chunk_rows,
        window_chunks=args.window_chunks,
        positions=tuple(float(p) for p in args.positions.split(",") if p.strip()),
        repeats=args.repeats,
        num_cpus=args.num_cpus,
    )


def run(args: argparse.Namespace) -> int:
    cfg = _config(args)
    result: dict[str, Any] = {}
    if args.num_samples is not None:  # before Ray starts: the children have the machine
        from benchmarks.iterator_order import OrderBenchConfig, measure_order

        result["order"] = measure_order(OrderBenchConfig(
            num_samples=args.num_samples, compare_samples=args.compare_samples,
            measure_samples=args.measure_samples, batch_size=args.batch_size, world_size=args.world_size,
            repeats=args.order_repeats))
    if args.nodes:  # clusters of their own, before the single-node one
        from benchmarks.iterator_nodes import measure_nodes

        result["nodes"] = measure_nodes(tuple(int(n) for n in args.nodes.split(",")), cfg)
    if not args.demo_only:
        import ray

        started = not ray.is_initialized()
        if started:
            # address="local": a cluster of its own, even where another one was started on this machine
            ray.init(address="local", num_cpus=cfg.num_cpus, include_dashboard=False, log_to_driver=False,
                     configure_logging=False)
        try:
            import ray.data

            ray.data.DataContext.get_current().enable_progress_bars = False
            result.update(measure(cfg))
        finally:
            if started:
                ray.shutdown()
    result["before_after"] = before_after()
    print(format_report(result))
    write_json(args.json, result)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="ray-checkfreq bench iterator", description=__doc__.splitlines()[0])
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
