"""Ray Data front end: a windowed epoch order read straight from the dataset's blocks.

The dataset is materialized once (into the object store, spread over the cluster and
spillable; pass an already materialized dataset to share it between Train workers). Its
block references and row counts give a global row index. Each epoch's order is a
``WindowedOrder``: chunks of rows from all over the dataset in a uniformly random order,
rows uniformly permuted inside each window of ``window_chunks`` chunks. A rank holds its
own rows of one window as numpy columns (plus the next window's, prefetched on a thread),
never the whole dataset: per rank about 2 * chunk_rows * window_chunks / world_size rows.
Resuming at position c fetches the window of c and nothing before it.

With ``read="local"`` (the default) every rank fetches every block of a window
(zero-copy from the local object store) and copies out only its own rows; on several
nodes each node therefore pulls the whole dataset over the network once per epoch. With
``read="remote"`` a small task on each block's node takes the rank's rows out of it, so a
node receives only the bytes of its own samples (one task per chunk piece and window).

Block layout: ``Dataset.iter_internal_ref_bundles()`` (internal API) gives the block refs
in their fixed order with row counts in the metadata, without touching the data. If that
API changes shape, the layout falls back to the public ``to_arrow_refs()`` plus one small
task per block for its row count; a test pins that both agree.
"""

from __future__ import annotations

import concurrent.futures as cf
import functools
import warnings
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from ray_checkfreq.data.context import train_context
from ray_checkfreq.data.core import RankSlice, RankSlices, Sharding
from ray_checkfreq.data.iterator import ResumableIterator, wants_keys
from ray_checkfreq.data.order import Order, WindowedOrder
from ray_checkfreq.data.seeds import SampleKeys

READS = ("local", "remote")


@dataclass(frozen=True, kw_only=True)
class RayDataOptions:
    """``chunk_rows`` should not exceed the block size (a chunk fetches 1-2 blocks)."""

    chunk_rows: int = 256
    """Rows per chunk; at most the block size."""
    window_chunks: int = 64
    """Chunks per shuffle window."""
    prefetch: bool = True
    """Read the next window on a thread."""
    dtypes: torch.dtype | dict[str, torch.dtype] | None = None
    """A torch dtype, or one per column."""
    device: str = "cpu"
    """Where the batches go."""
    read: str = "local"
    """``"local"``: fetch each window's blocks, zero-copy on one node; ``"remote"``: a task on each block's node
    takes out this rank's rows, so on several nodes a node receives only its own samples' bytes, at a task round
    trip per window."""

    def __post_init__(self) -> None:
        if self.chunk_rows < 1:
            raise ValueError(f"chunk_rows must be >= 1, got {self.chunk_rows}")
        if self.window_chunks < 1:
            raise ValueError(f"window_chunks must be >= 1, got {self.window_chunks}")
        if self.read not in READS:
            raise ValueError(f"read must be one of {', '.join(map(repr, READS))}, got {self.read!r}")

    @property
    def window_rows(self) -> int:
        return self.chunk_rows * self.window_chunks


@dataclass(frozen=True)
class BlockLayout:
    refs: list[Any]
    row_counts: np.ndarray

    @property
    def starts(self) -> np.ndarray:
        return np.concatenate([[0], np.cumsum(self.row_counts)]).astype(np.int64)

    @property
    def num_rows(self) -> int:
        return int(self.row_counts.sum())


def _internal_layout(ds: Any) -> BlockLayout | None:
    try:
        entries = [e for bundle in ds.iter_internal_ref_bundles() for e in bundle.blocks]
        return BlockLayout([e.ref for e in entries], np.array([e.metadata.num_rows for e in entries], dtype=np.int64))
    except (AttributeError, TypeError):
        return None


def _public_layout(ds: Any) -> BlockLayout:
    import ray

    refs = ds.to_arrow_refs()
    counts = ray.get([_num_rows_task().remote(ref) for ref in refs])
    return BlockLayout(list(refs), np.array(counts, dtype=np.int64))


def _num_rows_task() -> Any:
    import ray

    return ray.remote(num_cpus=0)(_num_rows)


def _num_rows(table: Any) -> int:
    return table.num_rows


def block_layout(ds: Any, *, public: bool = False) -> BlockLayout:
    """Block refs in their fixed order with their row counts."""
    layout = None if public else _internal_layout(ds)
    if layout is None or np.any(layout.row_counts < 0):
        layout = _public_layout(ds)
    return layout


def materialized(ds: Any) -> Any:
    """``ds`` materialized in a reproducible block order.

    Ray Data emits blocks in completion order unless ``preserve_order`` is set, so two
    materializations of one source could number their rows differently and a restarted
    job would resume another order. A dataset that is already materialized is taken as
    is: materialize it with ``preserve_order=True`` (as here) to resume across restarts.
    """
    from ray.data.dataset import MaterializedDataset

    if isinstance(ds, MaterializedDataset):
        return ds
    if train_context() is not None:
        warnings.warn(
            "materializing a Ray Dataset inside a Train worker: every worker holds its own copy "
            "in the object store; materialize it once on the driver and pass that instead",
            stacklevel=3,
        )
    ds.context.execution_options.preserve_order = True
    return ds.materialize()


class _Reader:
    """Turns row ranges into numpy columns, block by block.

    ``local``: this process gets every block the window touches (zero-copy where the block
    is on this node) and copies out its rows. ``remote``: a task pinned to each block's node
    takes this rank's rows out of it, and only those rows travel. ``bytes_fetched`` counts
    the bytes of the objects this reader got (whole blocks, or row slices).
    """

    def __init__(self, layout: BlockLayout, mode: str = "local") -> None:
        self.layout = layout
        self.starts = layout.starts
        self.mode = mode
        self.bytes_fetched = 0

    def _pieces(self, ranges: list[tuple[int, int]]) -> list[tuple[int, int, int]]:
        wanted: list[tuple[int, int, int]] = []  # (block, start in block, length)
        for a, b in ranges:
            while a < b:
                blk = int(np.searchsorted(self.starts, a, side="right") - 1)
                end = min(b, int(self.starts[blk + 1]))
                wanted.append((blk, a - int(self.starts[blk]), end - a))
                a = end
        return wanted

    def read(self, ranges: list[tuple[int, int]], rows: np.ndarray | None = None) -> dict[str, np.ndarray]:
        """Columns of the concatenated ranges, or of only their ``rows`` (sorted offsets)."""
        from ray.data.block import BlockAccessor

        wanted = self._pieces(ranges)
        if self.mode == "remote" and rows is not None:
            table = self._remote(wanted, rows)
        else:
            table = self._local(wanted, rows)
        columns = BlockAccessor.for_block(table).to_numpy()
        assert isinstance(columns, dict)  # columns=None: one array per column
        return columns

    def _local(self, wanted: list[tuple[int, int, int]], rows: np.ndarray | None) -> Any:
        import pyarrow as pa
        import ray

        uniq = sorted({w[0] for w in wanted})
        tables = dict(zip(uniq, ray.get([self.layout.refs[i] for i in uniq])))
        self.bytes_fetched += sum(t.nbytes for t in tables.values())
        table = pa.concat_tables([tables[blk].slice(off, length) for blk, off, length in wanted])
        if rows is not None and len(rows) < table.num_rows:
            table = table.take(pa.array(rows))  # copy only this rank's rows
        return table

    def _remote(self, wanted: list[tuple[int, int, int]], rows: np.ndarray) -> Any:
        import pyarrow as pa
        import ray

        lengths = np.array([length for _, _, length in wanted], dtype=np.int64)
        ends = np.cumsum(lengths)
        cuts = np.searchsorted(rows, ends)  # rows is sorted: piece i holds rows[cuts[i-1]:cuts[i]]
        jobs, first = [], 0
        for (blk, off, _), end, cut in zip(wanted, ends - lengths, cuts):
            mine, first = rows[first:cut] - end + off, int(cut)
            if len(mine):
                jobs.append((self.layout.refs[blk], mine))
        # one task per node holding blocks (not one per piece: each task may start a worker)
        groups: dict[str | None, list[int]] = {}
        homes = _home_nodes([ref for ref, _ in jobs])
        for i, (ref, _) in enumerate(jobs):
            groups.setdefault(homes.get(ref.hex()), []).append(i)
        futures = [_take_rows_task().options(scheduling_strategy=_on(node)).remote(
            [jobs[i][1] for i in members], *[jobs[i][0] for i in members]) for node, members in groups.items()]
        pieces: list[Any] = [None] * len(jobs)
        for members, tables in zip(groups.values(), ray.get(futures)):
            for i, table in zip(members, tables):
                pieces[i] = table
        self.bytes_fetched += sum(t.nbytes for t in pieces)
        return pa.concat_tables(pieces)


def _home_nodes(refs: list[Any]) -> dict[str, str]:
    """Per block ref (hex): a node that holds it."""
    from ray.experimental import get_object_locations

    return {ref.hex(): where["node_ids"][0] for ref, where in get_object_locations(refs).items()
            if where.get("node_ids")}


def _on(node: str | None) -> Any:
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    return "DEFAULT" if node is None else NodeAffinitySchedulingStrategy(node_id=node, soft=True)


@functools.cache
def _take_rows_task() -> Any:
    import ray

    return ray.remote(num_cpus=0)(_take_rows)


def _take_rows(indices: list[np.ndarray], *blocks: Any) -> list[Any]:
    import pyarrow as pa

    return [block.take(pa.array(rows)) for rows, block in zip(indices, blocks)]


class RayDataIterator(ResumableIterator):
    """Resumable torch batches (dict column -> tensor) of a ``ray.data.Dataset``."""

    def __init__(
        self,
        dataset: Any,
        *,
        sharding: Sharding,
        seed: int = 0,
        shuffle: bool = True,
        transform: Callable[..., Any] | None = None,
        options: RayDataOptions | None = None,
    ) -> None:
        self.options = options or RayDataOptions()
        self.dataset = materialized(dataset)
        self.layout = block_layout(self.dataset)
        super().__init__(num_samples=self.layout.num_rows, sharding=sharding, seed=seed, shuffle=shuffle)
        self.transform = transform
        self._with_keys = transform is not None and wants_keys(transform)
        self._reader = _Reader(self.layout, self.options.read)
        self.windows_read = 0  # for tests and benchmarks: resume reads no earlier window

    def _order(self, epoch: int) -> WindowedOrder:
        return WindowedOrder(
            num_samples=self.num_samples,
            seed=self.seed,
            epoch=epoch,
            chunk_rows=self.options.chunk_rows,
            window_chunks=self.options.window_chunks,
            shuffle=self.shuffle,
            version=self.order_version,
        )

    @property
    def bytes_fetched(self) -> int:
        """Bytes of the objects this iterator's reader got so far (blocks or row slices)."""
        return self._reader.bytes_fetched

    def _load(self, order: WindowedOrder, window: int, rows: np.ndarray) -> dict[str, np.ndarray]:
        self.windows_read += 1
        return self._reader.read(order.window_ranges(window), rows)

    def _needed(self, order: WindowedOrder, slices: RankSlices, window: int) -> np.ndarray:
        """The sorted layout offsets this rank reads from ``window`` (about 1/W of it)."""
        lo, hi = order.window_bounds(window)
        perm = order.window_perm(window)
        mine = [slices[i] for i in slices.overlapping(lo, hi)]
        parts = [perm[max(s.lo, lo) - lo : min(s.hi, hi) - lo] for s in mine]
        return np.unique(np.concatenate(parts)) if parts else np.empty(0, dtype=np.int64)

    def _produce(self, order: Order, epoch: int, slices: Sequence[RankSlice]) -> Iterator[dict[str, Any]]:
        assert isinstance(order, WindowedOrder) and isinstance(slices, RankSlices)
        if not slices:
            return
        last_window = order.window_of(slices[-1].hi - 1)
        pool = cf.ThreadPoolExecutor(1) if self.options.prefetch else None
        needed: dict[int, np.ndarray] = {}  # computed per window as the reader gets there
        cache: dict[int, Any] = {}

        def rows_of(w: int) -> np.ndarray:
            if w not in needed:
                needed[w] = self._needed(order, slices, w)
            return needed[w]

        def following(w: int) -> int | None:
            for nxt in range(w + 1, last_window + 1):
                if len(rows_of(nxt)):
                    return nxt
            return None

        def load(w: int) -> Any:
            return pool.submit(self._load, order, w, rows_of(w)) if pool else self._load(order, w, rows_of(w))

        def window(w: int) -> dict[str, np.ndarray]:
            for old in [k for k in cache if k < w]:
                del cache[old]  # memory bound: the current window and the next
                needed.pop(old, None)
            if w not in cache:
                cache[w] = load(w)
            nxt = following(w) if pool else None
            if nxt is not None and nxt not in cache:
                cache[nxt] = load(nxt)
            return cache[w].result() if pool else cache[w]

        try:
            for piece in slices:
                parts = order.locate(piece.lo, piece.hi)
                cols = [(window(w), np.searchsorted(rows_of(w), offs)) for w, offs in parts]
                batch = {k: _gather([c[k] for c, _ in cols], [i for _, i in cols]) for k in cols[0][0]}
                yield self._finish(batch, order, epoch, piece)
        finally:
            if pool:
                pool.shutdown(wait=True, cancel_futures=True)

    def _finish(self, batch: dict[str, np.ndarray], order: Order, epoch: int, piece: RankSlice) -> Any:
        if self.transform is not None:
            if self._with_keys:
                keys = SampleKeys(self.seed, epoch, order.take(piece.lo, piece.hi))
                batch = self.transform(batch, keys)
            else:
                batch = self.transform(batch)
        return _to_torch(batch, self.options)


def _gather(columns: list[np.ndarray], offsets: list[np.ndarray]) -> np.ndarray:
    if len(columns) == 1:
        return columns[0][offsets[0]]
    return np.concatenate([c[o] for c, o in zip(columns, offsets)])


def _to_torch(batch: Any, options: RayDataOptions) -> Any:
    if not isinstance(batch, dict):
        return batch
    out = {}
    for key, value in batch.items():
        tensor = torch.as_tensor(value) if isinstance(value, np.ndarray) and value.dtype != object else value
        if isinstance(tensor, torch.Tensor):
            dtype = options.dtypes.get(key) if isinstance(options.dtypes, dict) else options.dtypes
            tensor = tensor.to(device=options.device, dtype=dtype or tensor.dtype)
        out[key] = tensor
    return out
