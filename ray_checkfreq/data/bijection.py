"""A keyed pseudo-random bijection on [0, n), evaluated per position in O(1) memory.

A balanced Feistel network permutes [0, 4^h), the smallest power of 4 that holds n (two
halves of h bits each); cycle walking (apply it again while the value is >= n) turns
that into a bijection on [0, n): every element of [0, n) lies on a cycle of the larger
permutation, and walking that cycle from an element in range reaches the next element
in range, so distinct inputs never meet. The domain is at most 4n (less than 2n when the
bit length of n - 1 is even), so a position takes about 4^h / n evaluations on average.

The round function is a multiply-xorshift hash of (right half + round key), in 32-bit
arithmetic while the domain fits 32 bits (n <= 2^32 - 1: three times faster in numpy)
and 64-bit beyond; the round keys come from a 64-bit key through splitmix64. Everything
is vectorised over numpy unsigned arrays (wrapping arithmetic), so a batch of positions
costs a few dozen array passes. This is a keyed pseudo-random permutation, not a cryptographic one, and it does
not draw uniformly from all n! permutations: it is one of at most 2^64 per n.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from ray_checkfreq.data.seeds import mix64

ROUNDS = 6
# (dtype, multiplier 1, shift 1, multiplier 2, shift 2) of the round hash per word size
_WORD32 = (np.uint32, 0x7FEB352D, 15, 0x846CA68B, 16)
_WORD64 = (np.uint64, 0xD6E8FEB86659FD93, 32, 0xFF51AFD7ED558CCD, 29)
_ROUND_DOMAIN = 0x6A09E667F3BCC909
MAX_SIZE = 1 << 62


def stable_key(*parts: int) -> int:
    """A 64-bit key from non-negative integers, stable across processes and machines."""
    acc = np.zeros(1, dtype=np.uint64)
    for part in parts:
        if part < 0:
            raise ValueError(f"key parts must be >= 0, got {part}")
        acc = mix64(acc ^ np.uint64(part & 0xFFFF_FFFF_FFFF_FFFF))
    return int(acc[0])


@dataclass(frozen=True)
class KeyedBijection:
    """``forward`` maps positions to indices, ``inverse`` indices back to positions."""

    size: int
    key: int
    half_bits: int = field(init=False)
    round_keys: np.ndarray = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if not 0 <= self.size <= MAX_SIZE:
            raise ValueError(f"size must be in [0, 2^62], got {self.size}")
        if not 0 <= self.key < 1 << 64:
            raise ValueError(f"key must be a 64-bit unsigned integer, got {self.key}")
        half = max(1, -(-max(self.size - 1, 1).bit_length() // 2))
        object.__setattr__(self, "half_bits", half)
        keys = [stable_key(_ROUND_DOMAIN, self.key, r) for r in range(ROUNDS)]
        if self._word[0] is np.uint32:
            keys = [(k ^ (k >> 32)) & 0xFFFF_FFFF for k in keys]
        object.__setattr__(self, "round_keys", np.array(keys, dtype=self._word[0]))

    @property
    def _word(self) -> tuple:
        return _WORD32 if 2 * self.half_bits <= 32 and self.size < 1 << 32 else _WORD64

    @property
    def domain(self) -> int:
        """The power of 4 the Feistel network permutes (>= size)."""
        return 1 << (2 * self.half_bits)

    def forward(self, positions: np.ndarray) -> np.ndarray:
        """Indices (int64) at the given positions (each in [0, size))."""
        return self._walk(positions, inverse=False)

    def inverse(self, indices: np.ndarray) -> np.ndarray:
        """Positions (int64) of the given indices: ``inverse(forward(p)) == p``."""
        return self._walk(indices, inverse=True)

    def _walk(self, values: np.ndarray, *, inverse: bool) -> np.ndarray:
        x = np.asarray(values, dtype=np.int64)
        if x.size and (int(x.min()) < 0 or int(x.max()) >= self.size):
            raise ValueError(f"values must be in [0, {self.size}), got [{int(x.min())}, {int(x.max())}]")
        word = self._word[0]
        step = self._feistel_inverse if inverse else self._feistel
        limit = word(self.size)
        out = step(x.astype(word))
        todo = np.flatnonzero(out >= limit)
        while todo.size:  # cycle walking: the few values that left the range step again
            moved = step(out[todo])
            out[todo] = moved
            todo = todo[moved >= limit]
        return out.astype(np.int64)

    def _round(self, right: np.ndarray, key: np.generic) -> np.ndarray:
        word, m1, s1, m2, s2 = self._word
        y = right + key
        y *= word(m1)
        y ^= y >> word(s1)
        y *= word(m2)
        y ^= y >> word(s2)
        return y

    def _halves(self, x: np.ndarray) -> tuple[np.generic, np.generic, np.ndarray, np.ndarray]:
        word = self._word[0]
        h, mask = word(self.half_bits), word((1 << self.half_bits) - 1)
        return h, mask, x >> h, x & mask

    def _feistel(self, x: np.ndarray) -> np.ndarray:
        h, mask, left, right = self._halves(x)
        for key in self.round_keys:
            f = self._round(right, key)
            f &= mask
            f ^= left
            left, right = right, f
        left <<= h
        left |= right
        return left

    def _feistel_inverse(self, x: np.ndarray) -> np.ndarray:
        h, mask, left, right = self._halves(x)
        for key in self.round_keys[::-1]:
            f = self._round(left, key)
            f &= mask
            f ^= right
            left, right = f, left
        left <<= h
        left |= right
        return left
