"""Epoch orders: which global sample sits at each position of epoch e.

Every order is a permutation of ``range(num_samples)`` and a pure function of
(seed, epoch, its parameters). Randomness comes from numpy's PCG64 seeded through
``SeedSequence(entropy=seed, spawn_key=(purpose, epoch, ...))``, so orders for
different epochs, windows and purposes are independent streams of one seed.
``Generator.permutation`` is pinned by a golden-value test: a numpy upgrade that
changed it would be caught before it silently changed resumed orders.

- ``FullOrder``: a uniform random permutation of all samples (or the identity).
- ``WindowedOrder``: for sources without cheap random access (Ray Data blocks). The
  samples, rotated by a random per-epoch offset, are cut into chunks of ``chunk_rows``
  consecutive rows; the chunk order is a uniform permutation of all chunks; consecutive
  runs of ``window_chunks`` chunks form windows, and each window's rows are uniformly
  permuted. A reader therefore needs one window (chunk_rows * window_chunks rows) in
  memory, and the whole dataset is mixed at the chunk level.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import Protocol

import numpy as np

_FULL = 1
_CHUNKS = 2
_WINDOW = 3
_OFFSET = 4


def epoch_rng(seed: int, epoch: int, purpose: int, *more: int) -> np.random.Generator:
    """PCG64 stream for (seed, epoch, purpose, *more)."""
    if seed < 0 or epoch < 0:
        raise ValueError(f"seed and epoch must be >= 0, got seed={seed}, epoch={epoch}")
    seq = np.random.SeedSequence(entropy=seed, spawn_key=(purpose, epoch, *more))
    return np.random.Generator(np.random.PCG64(seq))


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

    @cached_property
    def _perm(self) -> np.ndarray:
        if not self.shuffle:
            return np.arange(self.num_samples, dtype=np.int64)
        rng = epoch_rng(self.seed, self.epoch, _FULL)
        return rng.permutation(self.num_samples).astype(np.int64, copy=False)

    def take(self, lo: int, hi: int) -> np.ndarray:
        return self._perm[lo:hi]

    def fingerprint(self) -> str:
        return "full" if self.shuffle else "sequential"


@dataclass(frozen=True, kw_only=True)
class WindowedOrder:
    num_samples: int
    seed: int
    epoch: int
    chunk_rows: int
    window_chunks: int
    shuffle: bool = True

    def __post_init__(self) -> None:
        if self.chunk_rows < 1:
            raise ValueError(f"chunk_rows must be >= 1, got {self.chunk_rows}")
        if self.window_chunks < 1:
            raise ValueError(f"window_chunks must be >= 1, got {self.window_chunks}")

    def fingerprint(self) -> str:
        if not self.shuffle:
            return "sequential"
        return f"windowed:{self.chunk_rows}x{self.window_chunks}"

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
        return int(epoch_rng(self.seed, self.epoch, _OFFSET).integers(self.num_samples))

    @cached_property
    def _chunks(self) -> np.ndarray:
        if not self.shuffle:
            return np.arange(self.num_chunks, dtype=np.int64)
        return epoch_rng(self.seed, self.epoch, _CHUNKS).permutation(self.num_chunks)

    def _chunk_len(self, chunks: np.ndarray) -> np.ndarray:
        start = chunks * self.chunk_rows
        return np.minimum(start + self.chunk_rows, self.num_samples) - start

    @cached_property
    def _window_starts(self) -> np.ndarray:
        """Epoch position of each window's first row; one extra entry = num_samples."""
        lens = self._chunk_len(self._chunks)
        ends = np.cumsum(lens)[self.window_chunks - 1 :: self.window_chunks]
        starts = np.concatenate([[0], ends]).astype(np.int64)
        if starts[-1] != self.num_samples:
            starts = np.append(starts, self.num_samples)
        return starts

    def window_of(self, position: int) -> int:
        return int(np.searchsorted(self._window_starts, position, side="right") - 1)

    def window_bounds(self, window: int) -> tuple[int, int]:
        return int(self._window_starts[window]), int(self._window_starts[window + 1])

    def window_chunks_of(self, window: int) -> np.ndarray:
        return self._chunks[window * self.window_chunks : (window + 1) * self.window_chunks]

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
            if self.shuffle:
                perm = epoch_rng(self.seed, self.epoch, _WINDOW, window).permutation(hi - lo)
            else:
                perm = np.arange(hi - lo, dtype=np.int64)
            cache.clear()  # readers move forward window by window
            cache[window] = perm
        return cache[window]

    def locate(self, lo: int, hi: int) -> list[tuple[int, np.ndarray]]:
        """(window, layout offsets) covering epoch positions [lo, hi), in order."""
        out: list[tuple[int, np.ndarray]] = []
        pos = lo
        while pos < hi:
            w = self.window_of(pos)
            w_lo, w_hi = self.window_bounds(w)
            end = min(hi, w_hi)
            out.append((w, self.window_perm(w)[pos - w_lo : end - w_lo]))
            pos = end
        return out

    def take(self, lo: int, hi: int) -> np.ndarray:
        parts = [self._layout_rows(w)[offs] for w, offs in self.locate(lo, hi)]
        return np.concatenate(parts) if parts else np.empty(0, dtype=np.int64)

    def _layout_rows(self, window: int) -> np.ndarray:
        return np.concatenate([np.arange(a, b) for a, b in self.window_ranges(window)])
