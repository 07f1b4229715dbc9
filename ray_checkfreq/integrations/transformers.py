"""ray_checkfreq for the Hugging Face ``Trainer``: one callback.

    trainer = Trainer(model=model, args=args, train_dataset=train_set,
                      callbacks=[CheckFreqTrainerCallback()])        # storage=... outside Ray Train
    trainer.train()

On Ray Train (with or without ``ray.train.huggingface.transformers.prepare_trainer``) and in
one plain process. Before the first step the callback restores the model, the optimizer
(under accelerate's wrapper), the learning-rate scheduler, every RNG, the ``TrainerState``
(global step, epoch, log history, best metric) and the data position; it checkpoints at
optimizer steps (gradient accumulation counts one), and on Ray Train reports what the
Trainer logs, evaluation metrics included, to ``result.metrics``.

The Trainer's training data is iterated by ``ray_checkfreq.data.resumable`` over the
Trainer's own dataset and collator: shuffled by ``args.data_seed`` (else ``args.seed``),
each rank a disjoint share, every sample once per epoch across restarts.

Restored at another world size, the samples already seen set the Trainer's step, epoch and
learning-rate schedule to those of a run of the new size at that point (its schedule built
for its own total steps, replayed), or the restore fails by name where no step of the new
size ends there (``_transformers_loop.continue_at``).
"""

from __future__ import annotations

import logging
import math
from typing import Any

import torch
from transformers import TrainerCallback, TrainerControl, TrainerState, TrainingArguments

from ray_checkfreq.data import TorchLoaderOptions, resumable
from ray_checkfreq.integrations import _transformers_loop as loop
from ray_checkfreq.integrations._common import announce, in_ray_train, open_checkfreq, unwrap_optimizer

logger = logging.getLogger("ray_checkfreq.integrations")


class CheckFreqTrainerCallback(TrainerCallback):
    """Checkpoints a ``transformers.Trainer`` run with ray_checkfreq; add it in ``Trainer(callbacks=[...])``.

    ``storage``: where checkpoints go (a path or ``s3://`` URL); on Ray Train the run's
    storage by default, required elsewhere. ``checkfreq_options``: the options of
    ``CheckFreq`` (``overhead=``, ``every=``, ``ray_config=``, ...).
    """

    def __init__(self, *, storage: Any = None, **checkfreq_options: Any) -> None:
        loop.check_version()
        for taken in ("model", "optimizer", "data", "extra_state"):
            if taken in checkfreq_options:
                raise TypeError(f"CheckFreqTrainerCallback({taken}=...): the callback takes it from the Trainer")
        self.storage = storage
        self.options = checkfreq_options
        self.trainer: Any = None
        self.checkfreq: Any = None
        self.resume_point = loop.ResumePoint()
        self._data: Any = None
        self._logged: dict[str, float] = {}

    # ------------------------------------------------------------- set-up
    def on_init_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
                    **kwargs: Any) -> None:
        self.trainer = loop.find_trainer()
        if self.trainer is not None:
            loop.patch_trainer(self.trainer, loader=self._loader, resume=self.resume_point)

    def _loader(self) -> Any:
        """The Trainer's training data, iterated resumably (replaces ``get_train_dataloader``)."""
        trainer, args = self.trainer, self.trainer.args
        built = type(trainer).get_train_dataloader(trainer)  # the Trainer's dataset and collator, as it prepares them
        dataset = _map_style(built.dataset)
        world = args.world_size
        drop_last = args.dataloader_drop_last or _uneven(len(dataset), args.per_device_train_batch_size, world)
        self._data = resumable(
            dataset, batch_size=args.per_device_train_batch_size, rank=args.process_index, world_size=world,
            seed=args.data_seed if args.data_seed is not None else args.seed, drop_last=drop_last,
            options=TorchLoaderOptions(num_workers=args.dataloader_num_workers, collate_fn=built.collate_fn,
                                       pin_memory=args.dataloader_pin_memory,
                                       prefetch_factor=args.dataloader_prefetch_factor))
        return _TrainerLoader(self._data, dataset)

    def on_train_begin(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
                       **kwargs: Any) -> None:
        if args.world_size > 1 and not in_ray_train():
            raise RuntimeError(
                f"CheckFreqTrainerCallback with {args.world_size} processes outside Ray Train: one process, or the "
                "Trainer inside a Ray Train worker (TorchTrainer), where ray_checkfreq coordinates the ranks")
        if self.trainer is None or self._data is None:
            raise RuntimeError(
                "CheckFreqTrainerCallback must be given to Trainer(callbacks=[...]) when the Trainer is built "
                "(trainer.add_callback() after that is too late: the callback sets up the Trainer's data)")
        trainer = self.trainer
        model = kwargs["model"]
        progress = loop.TrainerProgress(trainer, self._data)  # before the restore: the schedule as built
        self.checkfreq = open_checkfreq(
            model=_unwrapped(model), optimizer=unwrap_optimizer(trainer.optimizer), data=self._data,
            extra_state={"lr_scheduler": trainer.lr_scheduler, "trainer": progress},
            storage=self.storage, options=self.options)
        start = self.checkfreq.restore()
        if start > 0:
            self._resume_at(start, progress.moved)

    def _resume_at(self, start: int, moved: loop.WorldChange | None) -> None:
        data, state, args = self._data, self.trainer.state, self.trainer.args
        where = loop.step_at(data, args.gradient_accumulation_steps, data.epoch, data.consumed)
        if isinstance(where, str) or state.global_step != where[0]:
            raise RuntimeError(f"ray_checkfreq restored iteration {start} with the Trainer at global step "
                               f"{state.global_step}, but its data position says otherwise ({where}): a checkpoint "
                               "of another run in this storage?")
        self.resume_point.set(epoch=data.epoch, batches_done=data.consumed // data.sharding.global_batch)
        line = (f"ray_checkfreq: CheckFreqTrainerCallback resumed at step {state.global_step} of "
                f"{state.max_steps} (epoch {data.epoch}, batch {self.resume_point.batches_done} of it; "
                f"iteration {start})")
        if moved is not None:
            line += (f"; the checkpoint was written by {moved.saved_world} workers at step {moved.saved_step}, "
                     f"and on {moved.world} the schedule continues at step {moved.step} (lr {moved.lr:.6g})")
        announce(line, logger)

    # ------------------------------------------------------------- steps
    def on_step_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
                    **kwargs: Any) -> None:
        # After the optimizer and scheduler steps. The checkpoint of this step stays open until the
        # Trainer asks for the next step's first batch: what its logging and evaluation change in
        # between (log history, best metric, RNG) is taken then, as the next step starts.
        self.checkfreq.step()

    def on_log(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
               logs: dict[str, Any] | None = None, **kwargs: Any) -> None:
        if self.checkfreq is None or not in_ray_train():
            return
        # Everything logged so far, newest values first (as Ray's RayTrainReportCallback reports):
        # Result.metrics holds the newest report, and evaluation logs apart from training.
        self._logged.update({key: float(value) for key, value in (logs or {}).items()
                             if isinstance(value, (int, float)) and not isinstance(value, bool)
                             and math.isfinite(value)})
        self.checkfreq.report(dict(self._logged))  # every rank logs the same entries: report is a barrier

    def on_train_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
                     **kwargs: Any) -> None:
        if self.checkfreq is not None:
            self.checkfreq.close()


class _TrainerLoader:
    """What the Trainer's loop needs of a data loader, over a resumable iterator.

    ``set_epoch`` is a no-op: the iterator counts its own epochs (restored from the
    checkpoint), and the Trainer's loop is put at the same epoch by the restore.
    """

    def __init__(self, data: Any, dataset: Any) -> None:
        self.data, self.dataset = data, dataset

    def __iter__(self) -> Any:
        return iter(self.data)

    def __len__(self) -> int:
        return len(self.data)

    def set_epoch(self, epoch: int) -> None:
        pass


class _MapStyle(torch.utils.data.Dataset):
    """A ``datasets.Dataset`` (indexable, sized, not a torch Dataset) as a map-style torch Dataset."""

    def __init__(self, dataset: Any) -> None:
        self.dataset = dataset

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, index: int) -> Any:
        return self.dataset[index]


def _map_style(dataset: Any) -> Any:
    if isinstance(dataset, torch.utils.data.IterableDataset) or not hasattr(dataset, "__getitem__"):
        raise TypeError(f"CheckFreqTrainerCallback: the train_dataset ({type(dataset).__name__}) must be map-style "
                        "(indexable with a length) to resume at an exact sample")
    return dataset if isinstance(dataset, torch.utils.data.Dataset) else _MapStyle(dataset)


def _uneven(num_samples: int, batch_size: int, world_size: int) -> bool:
    """Several ranks and a last global batch that not every rank has a piece of: each rank must
    take the same number of steps (the gradients' all-reduce), so that batch is dropped."""
    global_batch = batch_size * world_size
    uneven = world_size > 1 and num_samples % global_batch != 0
    if uneven:
        logger.warning("ray_checkfreq: the last %d samples of each epoch are dropped (the global batch %d does not "
                       "divide %d samples; set dataloader_drop_last=True to say so)",
                       num_samples % global_batch, global_batch, num_samples)
    return uneven


def _unwrapped(model: torch.nn.Module) -> torch.nn.Module:
    return model.module if isinstance(model, torch.nn.parallel.DistributedDataParallel) else model
