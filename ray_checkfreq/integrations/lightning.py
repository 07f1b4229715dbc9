"""``CheckFreqLightningCallback``: exact resume for PyTorch Lightning, with one callback.

    trainer = pl.Trainer(..., callbacks=[CheckFreqLightningCallback()])  # in a Ray Train worker
    trainer = pl.Trainer(..., callbacks=[CheckFreqLightningCallback(storage="/ckpt/run1")])  # alone

At ``on_fit_start`` (optimizers exist, no batch fetched yet) it builds CheckFreq over the
LightningModule, its optimizer, the LR schedulers, Lightning's loop counters and the train
data, and restores the newest checkpoint. The train ``DataLoader`` is replaced by a
``resumable()`` iterator over its dataset (same batch size, shuffle, drop_last, collate),
sharded by rank, so a resume continues at the exact next batch.

An iteration is one optimizer step, and it ends where the next batch starts: ``cf.step()``
for step i runs at the start of the batch after it (and at the end of training), so a
checkpoint of iteration i holds what ran between the steps (validation and its RNG
draws, scheduler steps, the epoch's end). The train data's fetch hook, the engine's one
mechanism for "the next iteration starts", fires there too: it completes that checkpoint,
and after a restore the engine sets the RNG states, schedulers, loop counters and the
optimizer's hyper-parameters again, undoing whatever ran between the restore and that batch.

A checkpoint written by another number of workers is refused at restore, by name:
Lightning counts its loops per rank (batches an epoch, validation points, the schedulers'
steps), so a run at another world size would not continue where it stands.
"""

from __future__ import annotations

import copy
import logging
import math
import os
import warnings
from collections import deque
from collections.abc import Callable, Iterator, Mapping
from typing import Any

from ray_checkfreq.integrations import _lightning_loops as loops
from ray_checkfreq.integrations._common import announce, in_ray_train, open_checkfreq, unwrap_optimizer

__all__ = ["CheckFreqLightningCallback", "ResumableTrainData"]

logger = logging.getLogger("ray_checkfreq.integrations.lightning")

_LOOPS_KEY = "lightning_loops"


class ResumableTrainData:
    """What Lightning iterates as the train data: a ``resumable()`` iterator whose
    ``state_dict()`` is the position of the batch that started last (Lightning fetches a
    batch before its hooks run, some loaders one more ahead). Its fetch hooks
    (``add_fetch_hook``, CheckFreq's) run when Lightning starts a batch (``batch_starts``),
    not when it prefetches one."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self._handed: deque[dict] = deque()  # position before each batch handed out, not yet started
        self._position: dict = inner.state_dict()
        self._fetch_hooks: dict[int, Callable[[], None]] = {}
        self.restored_world_size: int | None = None
        """The world size of the state the last ``load_state_dict`` loaded."""

    def __len__(self) -> int:
        return len(self.inner)

    def __iter__(self) -> Iterator[Any]:
        self._handed.clear()  # a new iterator: batches handed out before it never start
        return self._batches()

    def _batches(self) -> Iterator[Any]:
        it = iter(self.inner)  # taken at the first next(): an iterator made before a restore stays valid
        while True:
            before = self.inner.state_dict()
            try:
                batch = next(it)
            except StopIteration:
                return
            self._handed.append(before)
            yield batch

    def add_fetch_hook(self, hook: Callable[[], None]) -> Any:
        """Call ``hook()`` whenever a batch starts (``run_fetch_hooks``)."""
        from ray_checkfreq.data.iterator import FetchHookHandle

        key = max(self._fetch_hooks, default=0) + 1
        self._fetch_hooks[key] = hook
        return FetchHookHandle(self._fetch_hooks, key)

    def batch_starts(self) -> None:
        """The oldest batch handed out starts: the position is now 'this batch is next'."""
        if self._handed:
            self._position = self._handed.popleft()

    def run_fetch_hooks(self) -> None:
        """The batch that started is asked for: nothing of it has run yet."""
        for hook in list(self._fetch_hooks.values()):
            hook()

    def training_ends(self) -> None:
        """After the last batch: the position of the next batch that never started."""
        self._position = self._handed[0] if self._handed else self.inner.state_dict()

    def state_dict(self) -> dict:
        return copy.deepcopy(self._position)

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.inner.load_state_dict(state)
        self.restored_world_size = state.get("world_size")
        self._handed.clear()
        self._position = self.inner.state_dict()

    @property
    def sampler(self) -> ResumableTrainData:
        """For Lightning's ``sampler.set_epoch(epoch)`` at each epoch's start."""
        return self

    def set_epoch(self, epoch: int) -> None:
        if not self._handed and epoch != self.inner.epoch:
            raise RuntimeError(f"ray_checkfreq: Lightning starts epoch {epoch} while the train data is at epoch "
                               f"{self.inner.epoch}: the data would not follow Lightning's epochs (an epoch cut "
                               "short, or a train_dataloader returned for another run?)")


class _LoopState:
    """Lightning's loop counters as CheckFreq's ``extra_state`` entry.

    Loaded before fit's loops run (the restore), it is Lightning's own loop restore; loaded
    again once a batch started (the engine sets the restored state again at the first
    batch), the loops restarted from it already, and it only settles what Lightning's
    restart path counts differently (``settle_after_restart``)."""

    def __init__(self, trainer: Any) -> None:
        self.trainer = trainer
        self.loaded: dict | None = None  # restored, until the first batch starts
        self.batches_started = False

    def state_dict(self) -> dict:
        return copy.deepcopy(self.loaded) if self.loaded is not None else loops.loop_state(self.trainer)

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        if self.batches_started:
            loops.settle_after_restart(self.trainer, copy.deepcopy(dict(state)))
            self.loaded = None
            return
        self.loaded = copy.deepcopy(dict(state))
        loops.load_loop_state(self.trainer, self.loaded)


class CheckFreqLightningCallback(loops.pl.Callback):
    """CheckFreq checkpoints and exact resume for a Lightning ``Trainer``.

    ``storage``: where checkpoints go (None: the Ray Train run's storage; required outside
    Ray Train). ``seed``: the train data's shuffle order (and new ranks' RNG under Ray).
    ``checkfreq_options``: CheckFreq's options (``every=5``, ``overhead=0.035``, ...).
    """

    def __init__(self, *, storage: Any = None, seed: int = 0, **checkfreq_options: Any) -> None:
        loops.check_version()
        super().__init__()
        self.storage, self.seed, self.options = storage, seed, dict(checkfreq_options)
        self.cf: Any = None
        self.restored_iteration: int | None = None
        """The iteration (optimizer steps) the last fit resumed at; 0 on a fresh run."""
        self._data: ResumableTrainData | None = None
        self._loops: _LoopState | None = None
        self._done = False

    # ------------------------------------------------------------------ set-up
    def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
        if stage != "fit":
            return
        loops.check_version()
        if trainer.world_size > 1 and not in_ray_train():
            raise RuntimeError(f"CheckFreqLightningCallback with {trainer.world_size} processes outside Ray Train: "
                               "run the Trainer in a Ray Train worker (TorchTrainer), or in one process")
        self._data, self._loops, self._done, self.cf = None, None, False, None
        loops.patch_resume_start(trainer, self._checkpoint_path)
        loops.wrap_train_source(trainer, self._train_data(trainer))

    def on_fit_start(self, trainer: Any, pl_module: Any) -> None:
        reason = loops.unsupported(trainer)
        if reason is not None:
            raise NotImplementedError(f"CheckFreqLightningCallback does not support {reason}")
        data = loops.request_train_data(trainer)
        optimizer = unwrap_optimizer(trainer.optimizers[0])
        self._loops = _LoopState(trainer)
        extra: dict[str, Any] = {_LOOPS_KEY: self._loops}
        extra.update({f"lr_scheduler_{i}": config.scheduler for i, config in enumerate(trainer.lr_scheduler_configs)})
        scaler = getattr(trainer.precision_plugin, "scaler", None)
        if callable(getattr(scaler, "state_dict", None)):
            extra["grad_scaler"] = scaler
        self.cf = open_checkfreq(model=pl_module, optimizer=optimizer, data=data, extra_state=extra,
                                 storage=self.storage, options=self._options(trainer, data))
        self.restored_iteration = self.cf.restore()
        if self.restored_iteration > 0:
            self._refuse_another_world_size(trainer, data)
            _announce_resume(self.restored_iteration, data)
            if loops.drop_loaded_checkpoint(trainer):
                warnings.warn(f"ray_checkfreq restored iteration {self.restored_iteration}: the Lightning checkpoint "
                              "of fit(ckpt_path=...) is not applied (ray_checkfreq resumes the run; drop ckpt_path)",
                              stacklevel=2)

    def _refuse_another_world_size(self, trainer: Any, data: ResumableTrainData) -> None:
        saved = data.restored_world_size
        if saved is not None and saved != trainer.world_size:
            raise RuntimeError(
                f"CheckFreqLightningCallback: the checkpoint of iteration {self.restored_iteration} was written by "
                f"{saved} workers and this run has {trainer.world_size}: resuming Lightning at another world size is "
                "not supported (its loops count batches per rank: the batches an epoch, the validation points and "
                f"the step-interval LR schedulers would not continue where a run on {trainer.world_size} stands). "
                f"Restart on {saved} workers, or start a new run in another storage")

    def _options(self, trainer: Any, data: ResumableTrainData) -> dict:
        options = dict(self.options)
        options.setdefault("epoch_len", max(1, math.ceil(len(data) / trainer.accumulate_grad_batches)))
        if in_ray_train():
            options.setdefault("seed", self.seed)
        return options

    def _train_data(self, trainer: Any) -> Callable[[Callable[[], Any]], ResumableTrainData]:
        def make(request: Callable[[], Any]) -> ResumableTrainData:
            if self._data is None:
                self._data = ResumableTrainData(_as_resumable(request(), seed=self.seed, rank=trainer.global_rank,
                                                              world_size=trainer.world_size))
            return self._data

        return make

    def _checkpoint_path(self, path: Any) -> Any:
        """``fit(ckpt_path=...)``: one of ray_checkfreq's pointer checkpoints is not a
        Lightning checkpoint; ray_checkfreq restores the run by itself."""
        if is_pointer_path(path):
            warnings.warn(f"ray_checkfreq: ckpt_path={str(path)!r} is a ray_checkfreq pointer checkpoint, not a "
                          "Lightning checkpoint; it is ignored and CheckFreqLightningCallback resumes the run. Remove "
                          "the ckpt_path=... from trainer.fit() (and the ray.train.get_checkpoint() lines before it)",
                          stacklevel=2)
            return None
        return path

    # ------------------------------------------------------------------ each batch
    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
        assert self._data is not None and self._loops is not None
        self._data.batch_starts()
        self._step_to(trainer.global_step)  # the iteration that ended: its checkpoint taken as this batch starts
        first = not self._loops.batches_started
        self._loops.batches_started = True
        self._data.run_fetch_hooks()  # the engine completes that checkpoint, or sets a restored state again
        if first and trainer.global_step != self.cf.iteration:
            raise RuntimeError(f"ray_checkfreq: Lightning resumed at global_step {trainer.global_step}, the "
                               f"checkpoint at iteration {self.cf.iteration}")

    def _step_to(self, global_step: int) -> None:
        """One ``cf.step()`` per optimizer step since the last (a batch that only
        accumulated gradients has none)."""
        if global_step < self.cf.iteration:
            raise RuntimeError(f"ray_checkfreq: Lightning's global_step {global_step} is behind CheckFreq's "
                               f"iteration {self.cf.iteration}: the loops did not resume where the checkpoint says")
        while self.cf.iteration < global_step:
            self.cf.step()

    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        assert self._data is not None
        self._data.training_ends()
        self._step_to(trainer.global_step)
        self._done = True
        self.cf.close()

    # ------------------------------------------------------------------ metrics
    def on_validation_end(self, trainer: Any, pl_module: Any) -> None:
        if not trainer.sanity_checking and not trainer.is_last_batch:  # the epoch's end reports just after
            self._report(trainer)

    def on_train_epoch_end(self, trainer: Any, pl_module: Any) -> None:
        self._report(trainer)

    def _report(self, trainer: Any) -> None:
        """Under Ray Train: Lightning's logged metrics reach ``Result.metrics`` (a barrier:
        every rank reaches the same hooks)."""
        if self.cf is None or not callable(getattr(self.cf, "report", None)):
            return
        self.cf.report({"epoch": trainer.current_epoch, "step": trainer.global_step,
                        **plain_metrics(trainer.callback_metrics)})

    # ------------------------------------------------------------------ ending
    def on_exception(self, trainer: Any, pl_module: Any, exception: BaseException) -> None:
        # Under Ray, closing is a collective the other ranks never reach: Ray ends the group.
        if self.cf is not None and not self._done and not in_ray_train():
            self._done = True
            self.cf.close()

    def teardown(self, trainer: Any, pl_module: Any, stage: str) -> None:
        if stage == "fit":
            loops.unpatch_resume_start(trainer)
            loops.unwrap_train_source(trainer)


def _announce_resume(iteration: int, data: ResumableTrainData) -> None:
    inner = data.inner
    announce(f"ray_checkfreq: CheckFreqLightningCallback resumed at step {iteration} (epoch {inner.epoch}, batch "
             f"{inner.consumed // inner.sharding.global_batch} of it)", logger)


def plain_metrics(metrics: Mapping[str, Any]) -> dict[str, float]:
    """The logged metrics that are one number, as floats."""
    import torch

    found: dict[str, float] = {}
    for name, value in metrics.items():
        if isinstance(value, torch.Tensor) and value.numel() == 1:
            found[name] = float(value.item())
        elif isinstance(value, (int, float)) and not isinstance(value, bool):
            found[name] = float(value)
    return found


def is_pointer_path(path: Any) -> bool:
    """True when ``path`` (a ``ckpt_path``) lies in a ray_checkfreq pointer checkpoint: a
    directory ``checkfreq-pointer-...`` or one holding ``checkfreq-pointer.json``."""
    from ray_checkfreq.ray.registration import POINTER_FILE, POINTER_PREFIX

    text = os.fspath(path) if isinstance(path, (str, os.PathLike)) else None
    if text is None:
        return False
    parts = text.replace("\\", "/").rstrip("/").split("/")
    if any(part.startswith(POINTER_PREFIX) for part in parts):
        return True
    here = text if os.path.isdir(text) else os.path.dirname(text)
    return os.path.isfile(os.path.join(here or ".", POINTER_FILE)) and not os.path.isfile(text)


def _as_resumable(loader: Any, *, seed: int, rank: int, world_size: int) -> Any:
    """The train data as a ``resumable()`` iterator: one given, or one built from a
    ``DataLoader``'s dataset and settings."""
    from torch.utils.data import DataLoader

    from ray_checkfreq.data import ResumableIterator, TorchLoaderOptions, resumable

    if isinstance(loader, ResumableIterator):
        return loader
    if not isinstance(loader, DataLoader):
        raise TypeError(f"CheckFreqLightningCallback: the train data is a {type(loader).__name__}; return one torch "
                        "DataLoader over a map-style Dataset (or ray_checkfreq.data.resumable(...)) from "
                        "train_dataloader()")
    options = TorchLoaderOptions(num_workers=loader.num_workers, collate_fn=loader.collate_fn,
                                 pin_memory=loader.pin_memory,
                                 prefetch_factor=loader.prefetch_factor if loader.num_workers else None,
                                 timeout_s=float(loader.timeout))
    return resumable(loader.dataset, batch_size=_batch_size(loader), seed=seed, rank=rank, world_size=world_size,
                     shuffle=_shuffles(loader), drop_last=loader.drop_last, options=options)


def _batch_size(loader: Any) -> int:
    if loader.batch_size is None:
        raise TypeError("CheckFreqLightningCallback: the train DataLoader has a batch_sampler of its own; give it "
                        "batch_size= (ray_checkfreq orders and shards the batches itself)")
    return int(loader.batch_size)


def _shuffles(loader: Any) -> bool:
    from torch.utils.data import RandomSampler, SequentialSampler
    from torch.utils.data.distributed import DistributedSampler

    sampler = loader.sampler
    if isinstance(sampler, DistributedSampler):
        return bool(sampler.shuffle)
    if type(sampler) in (RandomSampler, SequentialSampler):
        return isinstance(sampler, RandomSampler)
    raise TypeError(f"CheckFreqLightningCallback: the train DataLoader's sampler is a {type(sampler).__name__}; "
                    "use shuffle=True/False (ray_checkfreq orders and shards the samples itself, resumably)")
