"""The index core: lockstep sharding of an epoch order, and the iterator state.

Lockstep rule. With per-rank batch size B and world size W, the global batch size is
G = B * W. From the epoch position ``start`` (global samples already consumed), global
batch g covers positions [start + g*G, start + (g+1)*G) and rank r takes the r-th run of
B positions. Every rank therefore knows, on its own, the global count after each of its
batches (start + (g+1)*G): no communication is needed to agree on the state, and the
states of all ranks after the same step are equal.

Last partial global batch (p = num_samples - consumed < G samples left):
- drop_last=False: the p positions are split into W contiguous near-equal pieces
  (the first p % W ranks get one more); a rank whose piece is empty (p < W) yields no
  batch for it. After it the epoch is complete.
- drop_last=True: the p samples are not used this epoch.
Both rules use the G in force when the remainder is reached, so after a resize the
epoch ends where the new world size says: a state saved under W=4 that still has
p >= 3*B samples left continues with full batches on W=3.

An epoch is complete when nothing is left (or, with drop_last, less than G): the state
then reads (epoch + 1, consumed 0), so a checkpoint taken right after the last batch
resumes with the next epoch.

Two batch modes, recorded in the state as ``global_batch_size`` (None in per-rank mode):
- fixed G (``Sharding.for_global_batch``): B = G / W, so global batch g covers the same
  epoch positions at every world size; a resume re-derives B from G and the new W and
  refuses a state saved under another G.
- per-rank B: G = B * W changes with W; a resume keeps B and refuses a state saved under
  another B (a different B is what fixed G is for).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, overload

from ray_checkfreq.errors import CheckFreqError

PERMUTATION_ORDER = 1
BIJECTION_ORDER = 2
# The state's version names the family of epoch orders the run draws from; a state keeps
# its version, so a run started under version 1 resumes (and continues) with version 1.
STATE_VERSIONS = {
    PERMUTATION_ORDER: "PCG64 permutation orders (rng.permutation, 8 bytes a sample)",
    BIJECTION_ORDER: "keyed Feistel bijection orders (constant memory)",
}
STATE_VERSION = BIJECTION_ORDER  # what new runs write


class DataStateError(CheckFreqError, ValueError):
    """A saved iterator state does not fit this iterator; names the field and values."""

    def __init__(self, field: str, saved: Any, expected: Any) -> None:
        super().__init__(field, saved, expected)
        self.field = field
        self.saved = saved
        self.expected = expected

    def __str__(self) -> str:
        return (
            f"iterator state field {self.field!r} is {self.saved!r}, "
            f"but this iterator has {self.expected!r}"
        )


@dataclass(frozen=True, kw_only=True)
class Sharding:
    batch_size: int
    world_size: int = 1
    rank: int = 0
    drop_last: bool = False
    global_batch_fixed: bool = False

    @classmethod
    def for_global_batch(
        cls, global_batch_size: int, *, world_size: int = 1, rank: int = 0, drop_last: bool = False
    ) -> Sharding:
        """Each of ``world_size`` ranks takes ``global_batch_size // world_size`` samples."""
        if global_batch_size < 1:
            raise ValueError(f"global_batch_size must be >= 1, got {global_batch_size}")
        if world_size < 1 or global_batch_size % world_size:
            raise ValueError(
                f"global_batch_size={global_batch_size} is not divisible by world_size={world_size}: "
                "pick a global batch size that every possible world size divides"
            )
        return cls(
            batch_size=global_batch_size // world_size,
            world_size=world_size,
            rank=rank,
            drop_last=drop_last,
            global_batch_fixed=True,
        )

    def __post_init__(self) -> None:
        if self.batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {self.batch_size}")
        if self.world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {self.world_size}")
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank must be in [0, {self.world_size}), got {self.rank}")

    @property
    def global_batch(self) -> int:
        return self.batch_size * self.world_size

    @property
    def fixed_global_batch(self) -> int | None:
        """G when it was fixed by the caller, None when the per-rank size was."""
        return self.global_batch if self.global_batch_fixed else None

    def epoch_done(self, num_samples: int, consumed: int) -> bool:
        left = num_samples - consumed
        return left <= 0 or (self.drop_last and left < self.global_batch)


@dataclass(frozen=True)
class RankSlice:
    """This rank's epoch positions [lo, hi) and the global count once it is consumed."""

    lo: int
    hi: int
    consumed_after: int


class RankSlices(Sequence[RankSlice]):
    """This rank's batches from epoch position ``start`` to the end of the epoch.

    Computed per index, never stored: a billion-sample epoch costs no memory here.
    """

    def __init__(self, sharding: Sharding, num_samples: int, start: int) -> None:
        self.sharding, self.num_samples, self.start = sharding, num_samples, start
        self.full = max(0, (num_samples - start) // sharding.global_batch)
        self._last = self._partial()

    def _partial(self) -> RankSlice | None:
        sh = self.sharding
        pos = self.start + self.full * sh.global_batch
        left = self.num_samples - pos
        if left <= 0 or sh.drop_last:
            return None
        q, extra = divmod(left, sh.world_size)
        lo = pos + sh.rank * q + min(sh.rank, extra)
        hi = lo + q + (1 if sh.rank < extra else 0)
        return RankSlice(lo, hi, self.num_samples) if hi > lo else None

    def __len__(self) -> int:
        return self.full + (self._last is not None)

    @overload
    def __getitem__(self, i: int) -> RankSlice: ...

    @overload
    def __getitem__(self, i: slice) -> Sequence[RankSlice]: ...

    def __getitem__(self, i: int | slice) -> RankSlice | Sequence[RankSlice]:
        if isinstance(i, slice):
            return [self[k] for k in range(*i.indices(len(self)))]
        if i < 0:
            i += len(self)
        if not 0 <= i < len(self):
            raise IndexError(f"slice {i} of {len(self)}")
        if i == self.full:
            assert self._last is not None
            return self._last
        b, g = self.sharding.batch_size, self.sharding.global_batch
        pos = self.start + i * g
        return RankSlice(pos + self.sharding.rank * b, pos + (self.sharding.rank + 1) * b, pos + g)

    def __iter__(self) -> Iterator[RankSlice]:
        return (self[i] for i in range(len(self)))

    def overlapping(self, lo: int, hi: int) -> range:
        """Indices of the slices that hold a position in [lo, hi)."""
        g = self.sharding.global_batch
        first = max(0, (lo - self.start) // g - 1)
        last = min(len(self), max(0, (hi - self.start) // g + 1))
        keep = [i for i in range(first, last) if self[i].lo < hi and self[i].hi > lo]
        return range(keep[0], keep[-1] + 1) if keep else range(0)


def rank_slices(sharding: Sharding, num_samples: int, start: int) -> Iterator[RankSlice]:
    """This rank's batches from epoch position ``start`` to the end of the epoch."""
    return iter(RankSlices(sharding, num_samples, start))


@dataclass(frozen=True, kw_only=True)
class DataState:
    """Where the data stream stands: a few integers (plus what checks they fit)."""

    epoch: int
    consumed: int
    num_samples: int
    seed: int
    order: str
    world_size: int
    batch_size: int
    global_batch_size: int | None = None
    version: int = STATE_VERSION

    def to_dict(self) -> dict[str, Any]:
        return {
            "version": self.version,
            "epoch": self.epoch,
            "consumed": self.consumed,
            "num_samples": self.num_samples,
            "seed": self.seed,
            "order": self.order,
            "world_size": self.world_size,
            "batch_size": self.batch_size,
            "global_batch_size": self.global_batch_size,
        }

    @classmethod
    def from_dict(cls, state: Mapping[str, Any], *, expect: DataState) -> DataState:
        """Validate a saved state against this iterator (``expect``) and parse it."""
        if not isinstance(state, Mapping):
            raise DataStateError("<state>", type(state).__name__, "a mapping")
        version = state.get("version")
        if not isinstance(version, int) or isinstance(version, bool) or version not in STATE_VERSIONS:
            known = " or ".join(f"{v} ({name})" for v, name in STATE_VERSIONS.items())
            raise DataStateError("version", version, known)
        for key in ("num_samples", "seed", "order"):
            if state.get(key) != getattr(expect, key):
                raise DataStateError(key, state.get(key), getattr(expect, key))
        epoch, consumed = state.get("epoch"), state.get("consumed")
        if not isinstance(epoch, int) or epoch < 0:
            raise DataStateError("epoch", epoch, "an integer >= 0")
        if not isinstance(consumed, int) or not 0 <= consumed <= expect.num_samples:
            raise DataStateError("consumed", consumed, f"an integer in [0, {expect.num_samples}]")
        _check_batch_mode(state, expect)
        return cls(
            epoch=epoch,
            consumed=consumed,
            num_samples=expect.num_samples,
            seed=expect.seed,
            order=expect.order,
            world_size=int(state.get("world_size", expect.world_size)),
            batch_size=int(state.get("batch_size", expect.batch_size)),
            global_batch_size=expect.global_batch_size,
            version=int(version),
        )


def _check_batch_mode(state: Mapping[str, Any], expect: DataState) -> None:
    """Fixed G must match G (B is re-derived from the new W); per-rank B must match B."""
    saved_global = state.get("global_batch_size")  # absent in states from before fixed G
    if saved_global != expect.global_batch_size:
        expected = expect.global_batch_size or f"None (per-rank batch_size={expect.batch_size})"
        raise DataStateError("global_batch_size", saved_global, expected)
    if saved_global is None and "batch_size" in state and state["batch_size"] != expect.batch_size:
        raise DataStateError("batch_size", state["batch_size"], expect.batch_size)
