"""Epoch orders: which global sample sits at each position of epoch e.

Every order is a permutation of ``range(num_samples)`` and a pure function of
(seed, epoch, its parameters, the state version). Two families, picked by the version
recorded in the iterator state (``core.STATE_VERSIONS``):

- version 2, new runs: keyed pseudo-random bijections (``bijection.KeyedBijection``,
  a Feistel network with cycle walking) keyed by a splitmix64 hash of (seed, epoch,
  purpose, ...). The sample at a position is computed, not looked up: constant memory
  in the dataset size, and any position costs the same.
- version 1, runs that recorded it: numpy's PCG64 seeded through
  ``SeedSequence(entropy=seed, spawn_key=(purpose, epoch, ...))`` and
  ``Generator.permutation``, materialised (8 bytes a sample). Kept so that those
  checkpoints resume the order they started with.

Golden-value tests pin both: a change to either would silently change resumed orders.

- ``FullOrder``: a pseudo-random permutation of all samples (or the identity).
- ``WindowedOrder``: for sources without cheap random access (Ray Data blocks). The
  samples, rotated by a random per-epoch offset, are cut into chunks of ``chunk_rows``
  consecutive rows; the chunk order is a permutation of all chunks; consecutive runs of
  ``window_chunks`` chunks form windows, and each window's rows are permuted. A reader
  therefore needs one window (chunk_rows * window_chunks rows) in memory, and the whole
  dataset is mixed at the chunk level.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from functools import cached_property
from typing import Protocol

import numpy as np

from ray_checkfreq.data.bijection import KeyedBijection, stable_key
from ray_checkfreq.data.core import PERMUTATION_ORDER, STATE_VERSION, STATE_VERSIONS, RankSlice

_FULL = 1
_CHUNKS = 2
_WINDOW = 3
_OFFSET = 4
_KEY_DOMAIN = 0x0DE2_F00D
TAKE_GROUP = 1 << 16  # positions computed per numpy pass by take_slices


def epoch_rng(seed: int, epoch: int, purpose: int, *more: int) -> np.random.Generator:
    """PCG64 stream for (seed, epoch, purpose, *more) (version 1 orders)."""
    if seed < 0 or epoch < 0:
        raise ValueError(f"seed and epoch must be >= 0, got seed={seed}, epoch={epoch}")
    seq = np.random.SeedSequence(entropy=seed, spawn_key=(purpose, epoch, *more))
    return np.random.Generator(np.random.PCG64(seq))


def order_key(seed: int, epoch: int, purpose: int, *more: int) -> int:
    """64-bit bijection key for (seed, epoch, purpose, *more) (version 2 orders)."""
    if seed < 0 or epoch < 0:
        raise ValueError(f"seed and epoch must be >= 0, got seed={seed}, epoch={epoch}")
    return stable_key(_KEY_DOMAIN, seed, epoch, purpose, *more)


def check_order_version(version: int) -> None:
    if version not in STATE_VERSIONS:
        raise ValueError(f"order version must be one of {sorted(STATE_VERSIONS)}, got {version!r}")


class Order(Protocol):
    """A permutation of the epoch's samples, read by position ranges."""

    @property
    def num_samples(self) -> int:
        """How many samples the epoch holds."""
        ...

    def take(self, lo: int, hi: int) -> np.ndarray:
        """Global sample indices at epoch positions [lo, hi)."""
        ...

    def fingerprint(self) -> str:
        """Names the order's kind and parameters; stored in the iterator state."""
        ...


@dataclass(frozen=True, kw_only=True)
class FullOrder:
    num_samples: int
    seed: int
    epoch: int
    shuffle: bool = True
    version: int = STATE_VERSION

    def __post_init__(self) -> None:
        check_order_version(self.version)

    @cached_property
    def _perm(self) -> np.ndarray:
        rng = epoch_rng(self.seed, self.epoch, _FULL)
        return rng.permutation(self.num_samples).astype(np.int64, copy=False)

    @cached_property
    def bijection(self) -> KeyedBijection:
        return KeyedBijection(self.num_samples, order_key(self.seed, self.epoch, _FULL))

    def take_positions(self, positions: np.ndarray) -> np.ndarray:
        """Global sample indices at the given epoch positions."""
        positions = np.asarray(positions, dtype=np.int64)
        if not self.shuffle:
            return positions.copy()
        if self.version == PERMUTATION_ORDER:
            return self._perm[positions]
        return self.bijection.forward(positions)

    def take(self, lo: int, hi: int) -> np.ndarray:
        return self.take_positions(np.arange(lo, hi, dtype=np.int64))

    def fingerprint(self) -> str:
        return "full" if self.shuffle else "sequential"


def take_slices(order: FullOrder, slices: Iterable[RankSlice], group: int = TAKE_GROUP) -> Iterator[np.ndarray]:
    """Each slice's indices in turn, computed ``group`` positions at a time.

    One numpy pass over many batches costs far less than one per batch; only the group
    in hand is held, so memory stays constant.
    """
    pending: list[RankSlice] = []
    count = 0
    for piece in slices:
        pending.append(piece)
        count += piece.hi - piece.lo
        if count >= group:
            yield from _split(order, pending)
            pending, count = [], 0
    yield from _split(order, pending)


def _split(order: FullOrder, pieces: list[RankSlice]) -> Iterator[np.ndarray]:
    if not pieces:
        return
    positions = np.concatenate([np.arange(p.lo, p.hi, dtype=np.int64) for p in pieces])
    indices = order.take_positions(positions)
    ends = np.cumsum([p.hi - p.lo for p in pieces])
    yield from np.split(indices, ends[:-1])


@dataclass(frozen=True, kw_only=True)
class WindowedOrder:
    num_samples: int
    seed: int
    epoch: int
    chunk_rows: int
    window_chunks: int
    shuffle: bool = True
    version: int = STATE_VERSION

    def __post_init__(self) -> None:
        if self.chunk_rows < 1:
            raise ValueError(f"chunk_rows must be >= 1, got {self.chunk_rows}")
        if self.window_chunks < 1:
            raise ValueError(f"window_chunks must be >= 1, got {self.window_chunks}")
        check_order_version(self.version)

    def fingerprint(self) -> str:
        if not self.shuffle:
            return "sequential"
        return f"windowed:{self.chunk_rows}x{self.window_chunks}"

    @property
    def _permuted(self) -> bool:
        """Version 1 shuffled orders keep the chunk permutation in memory."""
        return self.shuffle and self.version == PERMUTATION_ORDER

    @cached_property
    def num_chunks(self) -> int:
        return -(-self.num_samples // self.chunk_rows)

    @cached_property
    def num_windows(self) -> int:
        return -(-self.num_chunks // self.window_chunks)

    @cached_property
    def _offset(self) -> int:
        if not self.shuffle or self.num_samples == 0:
            return 0
        if self.version == PERMUTATION_ORDER:
            return int(epoch_rng(self.seed, self.epoch, _OFFSET).integers(self.num_samples))
        return order_key(self.seed, self.epoch, _OFFSET) % self.num_samples

    @cached_property
    def _chunks(self) -> np.ndarray:
        return epoch_rng(self.seed, self.epoch, _CHUNKS).permutation(self.num_chunks)

    @cached_property
    def _chunk_bijection(self) -> KeyedBijection:
        return KeyedBijection(self.num_chunks, order_key(self.seed, self.epoch, _CHUNKS))

    def _chunks_at(self, lo: int, hi: int) -> np.ndarray:
        """Chunk ids at chunk positions [lo, hi)."""
        if not self.shuffle:
            return np.arange(lo, hi, dtype=np.int64)
        if self.version == PERMUTATION_ORDER:
            return self._chunks[lo:hi]
        return self._chunk_bijection.forward(np.arange(lo, hi, dtype=np.int64))

    def _chunk_len(self, chunks: np.ndarray) -> np.ndarray:
        start = chunks * self.chunk_rows
        return np.minimum(start + self.chunk_rows, self.num_samples) - start

    @cached_property
    def _window_starts(self) -> np.ndarray:
        """Version 1: epoch position of each window's first row; one extra entry = num_samples."""
        lens = self._chunk_len(self._chunks)
        ends = np.cumsum(lens)[self.window_chunks - 1 :: self.window_chunks]
        starts = np.concatenate([[0], ends]).astype(np.int64)
        if starts[-1] != self.num_samples:
            starts = np.append(starts, self.num_samples)
        return starts

    @cached_property
    def _short_chunk(self) -> tuple[int, int]:
        """(window holding the last, possibly short, chunk; rows it lacks)."""
        if self.num_chunks == 0:
            return 0, 0
        last = self.num_chunks - 1
        missing = (last + 1) * self.chunk_rows - self.num_samples
        where = int(self._chunk_bijection.inverse(np.array([last]))[0]) if self.shuffle else last
        return where // self.window_chunks, missing

    def _window_start(self, window: int) -> int:
        """Every chunk but one has chunk_rows rows, so window starts are arithmetic."""
        if window >= self.num_windows:
            return self.num_samples
        short_window, missing = self._short_chunk
        return window * self.window_chunks * self.chunk_rows - (missing if window > short_window else 0)

    def window_of(self, position: int) -> int:
        if self._permuted:
            return int(np.searchsorted(self._window_starts, position, side="right") - 1)
        short_window, missing = self._short_chunk
        rows = self.window_chunks * self.chunk_rows
        shifted = (position + missing) // rows
        return shifted if shifted > short_window else position // rows

    def window_bounds(self, window: int) -> tuple[int, int]:
        if self._permuted:
            return int(self._window_starts[window]), int(self._window_starts[window + 1])
        return self._window_start(window), self._window_start(window + 1)

    def window_chunks_of(self, window: int) -> np.ndarray:
        lo = window * self.window_chunks
        return self._chunks_at(lo, min(lo + self.window_chunks, self.num_chunks))

    def window_ranges(self, window: int) -> list[tuple[int, int]]:
        """Real row ranges [a, b) whose concatenation is the window's layout."""
        ranges: list[tuple[int, int]] = []
        n = self.num_samples
        for chunk in self.window_chunks_of(window):
            a = int(chunk) * self.chunk_rows
            b = min(a + self.chunk_rows, n)
            a, b = (a + self._offset) % n, (b - 1 + self._offset) % n + 1
            ranges.extend([(a, b)] if a < b else [(a, n), (0, b)])
        return ranges

    @cached_property
    def _last_perm(self) -> dict[int, np.ndarray]:
        return {}

    def window_perm(self, window: int) -> np.ndarray:
        """Layout offset of the row at each position of the window."""
        cache = self._last_perm
        if window not in cache:
            lo, hi = self.window_bounds(window)
            if len(cache) >= 2:  # readers move forward: the current window and the next
                del cache[min(cache)]
            cache[window] = self._make_window_perm(window, hi - lo)
        return cache[window]

    def _make_window_perm(self, window: int, rows: int) -> np.ndarray:
        if not self.shuffle:
            return np.arange(rows, dtype=np.int64)
        if self.version == PERMUTATION_ORDER:
            return epoch_rng(self.seed, self.epoch, _WINDOW, window).permutation(rows)
        key = order_key(self.seed, self.epoch, _WINDOW, window)
        return KeyedBijection(rows, key).forward(np.arange(rows, dtype=np.int64))

    def locate(self, lo: int, hi: int) -> list[tuple[int, np.ndarray]]:
        """(window, layout offsets) covering epoch positions [lo, hi), in order."""
        out: list[tuple[int, np.ndarray]] = []
        pos = lo
        while pos < hi:
            w = self.window_of(pos)
            w_lo, w_hi = self.window_bounds(w)
            if not w_lo <= pos < w_hi:  # window_of and window_bounds must agree, or this never ends
                raise AssertionError(f"position {pos} is not in window {w} = [{w_lo}, {w_hi})")
            end = min(hi, w_hi)
            out.append((w, self.window_perm(w)[pos - w_lo : end - w_lo]))
            pos = end
        return out

    def take(self, lo: int, hi: int) -> np.ndarray:
        parts = [self._layout_rows(w)[offs] for w, offs in self.locate(lo, hi)]
        return np.concatenate(parts) if parts else np.empty(0, dtype=np.int64)

    def _layout_rows(self, window: int) -> np.ndarray:
        return np.concatenate([np.arange(a, b) for a, b in self.window_ranges(window)])
