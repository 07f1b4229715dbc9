"""The resumable iterator protocol shared by every front end.

A front end supplies the epoch order and turns this rank's position slices into
batches (``_produce``); the base class owns the cursor and the order version (new runs
use ``STATE_VERSION``; a restored state brings its own, kept for the rest of the run). The
cursor moves when a batch is handed to the caller, not when a loader prefetches it, so
``state_dict()`` taken after receiving batch i always resumes at batch i + 1.

Fetch hooks (``add_fetch_hook``) run each time the caller asks for the next batch,
before it is produced and before the cursor moves: the point where a training iteration
begins, which ``CheckFreq`` uses to complete a checkpoint of the previous iteration.
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

from ray_checkfreq.data.core import STATE_VERSION, DataState, RankSlice, RankSlices, Sharding
from ray_checkfreq.data.order import Order, check_order_version
from ray_checkfreq.errors import CheckFreqError

logger = logging.getLogger("ray_checkfreq.data")


class StaleIteratorError(CheckFreqError, RuntimeError):
    """An iterator taken from a resumable loader before its state was restored was used."""


class ResumableIterator:
    """Iterates one epoch per ``iter()``; ``state_dict`` / ``load_state_dict`` resume it."""

    def __init__(
        self, *, num_samples: int, sharding: Sharding, seed: int, shuffle: bool, order_version: int = STATE_VERSION
    ) -> None:
        check_order_version(order_version)
        if num_samples < 0:
            raise ValueError(f"num_samples must be >= 0, got {num_samples}")
        if seed < 0:
            raise ValueError(f"seed must be >= 0, got {seed}")
        self.num_samples = num_samples
        self.sharding = sharding
        self.seed = seed
        self.shuffle = shuffle
        self.order_version = order_version
        self._epoch = 0
        self._consumed = 0
        self._generation = 0
        self._restored_at = 0  # the generation a restore started: iterators from before it are stale
        self._fetch_hooks: dict[int, Callable[[], None]] = {}
        self._set_epoch_logged = False

    # -- what a front end provides ------------------------------------------------
    def _order(self, epoch: int) -> Order:
        raise NotImplementedError

    def _produce(self, order: Order, epoch: int, slices: Sequence[RankSlice]) -> Iterator[Any]:
        """Yield one batch per slice, in order."""
        raise NotImplementedError

    # -- public protocol ----------------------------------------------------------
    @property
    def epoch(self) -> int:
        return self._epoch

    @property
    def consumed(self) -> int:
        """Global samples (all ranks) consumed in the current epoch."""
        return self._consumed

    def add_fetch_hook(self, hook: Callable[[], None]) -> FetchHookHandle:
        """Call ``hook()`` whenever the caller asks for a batch, before it is produced (and
        so before anything producing it draws from an RNG) and before the cursor moves."""
        key = max(self._fetch_hooks, default=0) + 1
        self._fetch_hooks[key] = hook
        return FetchHookHandle(self._fetch_hooks, key)

    def set_epoch(self, epoch: int) -> None:
        """What loops written for a ``DistributedSampler`` call at each epoch's start.

        The iterator counts epochs itself (``epoch``, restored from a checkpoint), so this
        only checks that the caller's loop agrees: a no-op (logged once) when ``epoch``
        is the iterator's epoch, a ``ValueError`` saying what to do otherwise.
        """
        if epoch != self._epoch:
            raise ValueError(
                f"set_epoch({epoch}): this resumable iterator is at epoch {self._epoch} (it counts epochs "
                "itself and resumes them from a checkpoint); loop `for epoch in range(loader.epoch, epochs)` "
                "so your epoch numbers follow it, or drop the set_epoch call")
        if not self._set_epoch_logged:
            self._set_epoch_logged = True
            logger.info("set_epoch(%d) is a no-op: resumable iterators keep their own epoch (loader.epoch)", epoch)

    @property
    def sampler(self) -> ResumableIterator:
        """This iterator, for code written for a DataLoader: ``loader.sampler.set_epoch(e)``."""
        return self

    def __iter__(self) -> Iterator[Any]:
        self._generation += 1
        return self._run(self._generation)

    def __len__(self) -> int:
        """Global steps in a whole epoch (a rank with no piece of the last one yields one batch fewer)."""
        g = self.sharding.global_batch
        return self.num_samples // g if self.sharding.drop_last else -(-self.num_samples // g)

    def state_dict(self) -> dict[str, Any]:
        return self._state(self._epoch, self._consumed).to_dict()

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore; the next ``iter()`` continues that epoch at its next sample."""
        parsed = DataState.from_dict(state, expect=self._state(0, 0))
        self._generation += 1  # a generator taken before the restore raises when next used
        self._restored_at = self._generation
        self._epoch, self._consumed = parsed.epoch, parsed.consumed
        self.order_version = parsed.version
        self._roll_if_done()

    # -- internals ------------------------------------------------------------------
    def _state(self, epoch: int, consumed: int) -> DataState:
        return DataState(
            epoch=epoch,
            consumed=consumed,
            num_samples=self.num_samples,
            seed=self.seed,
            order=self._order(0).fingerprint(),
            world_size=self.sharding.world_size,
            batch_size=self.sharding.batch_size,
            global_batch_size=self.sharding.fixed_global_batch,
            version=self.order_version,
        )

    def _roll_if_done(self) -> None:
        if self.sharding.epoch_done(self.num_samples, self._consumed):
            self._epoch += 1
            self._consumed = 0

    def _run(self, generation: int) -> Iterator[Any]:
        self._check_not_from_before_restore(generation)
        epoch = self._epoch
        slices = RankSlices(self.sharding, self.num_samples, self._consumed)
        if slices:
            batches = self._produce(self._order(epoch), epoch, slices)
            try:
                for piece in slices:
                    for hook in list(self._fetch_hooks.values()):
                        hook()
                    batch = next(batches, _NO_BATCH)
                    if batch is _NO_BATCH:
                        break
                    if generation != self._generation:
                        self._check_not_from_before_restore(generation)
                        return  # a newer iter() took over
                    self._consumed = piece.consumed_after
                    self._roll_if_done()
                    yield batch
            finally:
                close = getattr(batches, "close", None)
                if close is not None:
                    close()
        if generation == self._generation and self._epoch == epoch:
            # this rank had no piece of the last partial global batch
            self._epoch, self._consumed = epoch + 1, 0


    def _check_not_from_before_restore(self, generation: int) -> None:
        if generation < self._restored_at:
            raise StaleIteratorError(
                f"{type(self).__name__}: this iterator was taken before the loader's state was restored "
                "(cf.restore() / load_state_dict()), so it would not continue from the restored position: "
                "take a new one after the restore (`for batch in loader` or `iter(loader)` again)")


_NO_BATCH = object()


class FetchHookHandle:
    """Removes the fetch hook it was returned for."""

    def __init__(self, hooks: dict[int, Callable[[], None]], key: int) -> None:
        self._hooks, self._key = hooks, key

    def remove(self) -> None:
        self._hooks.pop(self._key, None)


def wants_keys(transform: Callable[..., Any]) -> bool:
    """True when ``transform`` takes a second positional argument (the sample keys)."""
    try:
        params = inspect.signature(transform).parameters.values()
    except (TypeError, ValueError):
        return False
    positional = [
        p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD, p.VAR_POSITIONAL)
    ]
    return len(positional) >= 2 or any(p.kind == p.VAR_POSITIONAL for p in positional)
