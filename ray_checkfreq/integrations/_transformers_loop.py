"""What the Trainer callback touches inside ``transformers.Trainer``, in one version-checked place.

A ``TrainerCallback`` sees neither the Trainer nor its loop's counters, and the loop keeps
the epoch it starts at and the batches it skips in local variables computed before the
first callback that can restore. So the callback finds its Trainer when it is built
(``on_init_end``, from the call stack) and replaces four of its methods on that instance:

- ``get_train_dataloader`` (a documented override point): the Trainer's dataset and
  collator, iterated by a resumable iterator;
- ``get_resumed_dataloader`` (documented): that iterator is already at its position;
- ``_run_epoch``: after a restore, epochs already done are skipped and the epoch in
  progress continues at its next batch, through the Trainer's own resume path;
- ``train``: ``resume_from_checkpoint`` is ignored (ray_checkfreq restores), so Ray's
  documented ``get_checkpoint()`` resume cannot fail on a ray_checkfreq pointer.

And the counters a resume must set: ``_initial_global_step`` (steps/s of this attempt),
``_globalstep_last_logged`` (the loss window starts at the restore, as in the Trainer's
own resume), ``_initial_num_input_tokens_seen``; at another world size also the
``TrainerState``'s global step and epoch, and the ``lr_scheduler`` the Trainer built.
"""

from __future__ import annotations

import copy
import logging
import sys
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

logger = logging.getLogger("ray_checkfreq.integrations")

SUPPORTED = ((5, 25), (6, 0))
"""transformers versions this module was tested with: [low, high)."""
# The Trainer's own resume path needs a non-None checkpoint to continue an epoch at a
# batch; this one names no directory, so the Trainer finds no RNG file in it and leaves
# the RNG as the restore set it.
RESUMED = "<ray_checkfreq: restored; no Trainer checkpoint>"
# The TrainerState fields a checkpoint keeps (the rest is configuration, set anew by the Trainer).
STATE_FIELDS = ("epoch", "global_step", "num_input_tokens_seen", "total_flos", "log_history",
                "best_metric", "best_global_step", "best_model_checkpoint")


def check_version() -> None:
    """Fail by name on a transformers this module does not know."""
    import transformers

    found = tuple(int(part) for part in transformers.__version__.split(".")[:2] if part.isdigit())
    low, high = SUPPORTED
    if not low <= found < high or not hasattr(transformers.Trainer, "_run_epoch"):
        raise RuntimeError(
            f"ray_checkfreq's CheckFreqTrainerCallback supports transformers >={'.'.join(map(str, low))},"
            f"<{'.'.join(map(str, high))}; this is transformers {transformers.__version__}")


def find_trainer(max_depth: int = 12) -> Any:
    """The ``transformers.Trainer`` whose ``__init__`` is on the call stack (None if none)."""
    from transformers import Trainer

    frame: Any = sys._getframe(1)
    for _ in range(max_depth):
        if frame is None:
            return None
        candidate = frame.f_locals.get("self")
        if isinstance(candidate, Trainer):
            return candidate
        frame = frame.f_back
    return None


class ResumePoint:
    """Where the restored run stands in the Trainer's loop: (epoch, batches of it done on this rank)."""

    def __init__(self) -> None:
        self.epoch: int | None = None
        self.batches_done = 0

    def set(self, *, epoch: int, batches_done: int) -> None:
        self.epoch, self.batches_done = epoch, batches_done


def patch_trainer(trainer: Any, *, loader: Callable[[], Any], resume: ResumePoint) -> None:
    """Replace the four methods of the module docstring on this Trainer instance."""
    run_epoch, train = trainer._run_epoch, trainer.train

    def get_train_dataloader() -> Any:
        return loader()

    def get_resumed_dataloader(dataloader: Any, num_batches: int) -> Any:
        return dataloader  # the resumable iterator continues at its restored position

    def resumed_run_epoch(**arguments: Any) -> Any:
        if resume.epoch is not None:
            if arguments["epoch"] < resume.epoch:
                return None  # done before the checkpoint
            if arguments["epoch"] == resume.epoch:
                arguments.update(epochs_trained=resume.epoch, steps_trained_in_current_epoch=resume.batches_done,
                                 resume_from_checkpoint=RESUMED)
                resume.epoch = None
        return run_epoch(**arguments)

    def train_without_its_checkpoint(resume_from_checkpoint: Any = None, *args: Any, **kwargs: Any) -> Any:
        if resume_from_checkpoint not in (None, False):
            logger.warning(
                "ray_checkfreq restores this run itself: train(resume_from_checkpoint=%r) is ignored. Remove the "
                "resume_from_checkpoint argument (and the ray.train.get_checkpoint() resume around it).",
                resume_from_checkpoint)
        return train(None, *args, **kwargs)

    trainer.get_train_dataloader = get_train_dataloader
    trainer.get_resumed_dataloader = get_resumed_dataloader
    trainer._run_epoch = resumed_run_epoch
    trainer.train = train_without_its_checkpoint


class TrainerProgress:
    """The Trainer's ``TrainerState`` as checkpoint state (``extra_state``): plain values only,
    with the world size and the data position (epoch, global samples of it) it was taken at.

    Loaded under another world size, the step counters and the learning-rate schedule move
    to where a run of this world size stands at that data position (``continue_at``): the
    samples already seen define the position, the total steps are the Trainer's for the new
    world size (built before the restore). ``moved`` then says from where to where.
    """

    def __init__(self, trainer: Any, data: Any) -> None:
        self.trainer, self.data = trainer, data
        self.fresh = FreshSchedule.of(trainer)  # before the restore: the Trainer's own schedule for this run
        self.moved: WorldChange | None = None

    def state_dict(self) -> dict[str, Any]:
        state = self.trainer.state
        return {"current_flos": float(self.trainer.current_flos),  # not yet added to state.total_flos
                **{name: copy.deepcopy(getattr(state, name)) for name in STATE_FIELDS},
                "world_size": int(self.trainer.args.world_size),
                "data_epoch": int(self.data.epoch), "data_consumed": int(self.data.consumed)}

    def load_state_dict(self, saved: dict[str, Any]) -> None:
        trainer = self.trainer
        for name in STATE_FIELDS:
            setattr(trainer.state, name, copy.deepcopy(saved[name]))
        trainer.current_flos = saved["current_flos"]
        world = int(trainer.args.world_size)
        saved_world = saved.get("world_size", world)  # absent: a checkpoint from before world sizes were kept
        if saved_world != world:
            self.moved = continue_at(trainer, self.data, self.fresh, saved_world=saved_world,
                                     saved_step=saved["global_step"],
                                     position=(saved["data_epoch"], saved["data_consumed"]))
        # This attempt's counters start at the restore, as after the Trainer's own resume.
        trainer._initial_global_step = trainer.state.global_step
        trainer._globalstep_last_logged = trainer.state.global_step
        trainer._initial_num_input_tokens_seen = trainer.state.num_input_tokens_seen


@dataclass(frozen=True)
class FreshSchedule:
    """The Trainer's learning-rate scheduler and optimizer hyper-parameters as built for this
    run, before any step: what a replay of the schedule starts from."""

    scheduler: dict[str, Any]
    groups: list[dict[str, Any]]

    @classmethod
    def of(cls, trainer: Any) -> FreshSchedule:
        from ray_checkfreq.integrations._common import unwrap_optimizer

        optimizer = unwrap_optimizer(trainer.optimizer)
        return cls(scheduler=copy.deepcopy(trainer.lr_scheduler.state_dict()),
                   groups=[copy.deepcopy({k: v for k, v in group.items() if k != "params"})
                           for group in optimizer.param_groups])


@dataclass(frozen=True)
class WorldChange:
    """A restore under another world size: the saved step and world size, and the step
    this world size continues at (its learning rate and total steps)."""

    saved_world: int
    world: int
    saved_step: int
    step: int
    max_steps: int
    lr: float


def steps_per_epoch(data: Any, accumulation: int) -> int:
    """Optimizer steps an epoch of ``data`` (this world size) takes: the Trainer's count."""
    batches = len(data)
    return max(batches // accumulation + int(batches % accumulation > 0), 1)


def step_at(data: Any, accumulation: int, epoch: int, consumed: int) -> tuple[int, int, int] | str:
    """(global step, epoch, batches of it done) of a run of ``data``'s world size at data
    position (``epoch``, ``consumed`` global samples); a reason when no step of it ends there."""
    sharding = data.sharding
    if sharding.epoch_done(data.num_samples, consumed):
        epoch, consumed = epoch + 1, 0
    batches, rest = divmod(consumed, sharding.global_batch)
    if rest or batches % accumulation:
        return (f"sample {consumed} of epoch {epoch} is not where an optimizer step of the global batch "
                f"{sharding.global_batch} x gradient accumulation {accumulation} ends")
    return epoch * steps_per_epoch(data, accumulation) + batches // accumulation, epoch, batches


def continue_at(trainer: Any, data: Any, fresh: FreshSchedule, *, saved_world: int, saved_step: int,
                position: tuple[int, int]) -> WorldChange:
    """Put the Trainer's step, epoch and learning-rate schedule where a run of this world size
    stands at the data ``position``: the schedule built for this run, replayed to that step."""
    world, accumulation = int(trainer.args.world_size), int(trainer.args.gradient_accumulation_steps)
    where = step_at(data, accumulation, *position)
    refused = where if isinstance(where, str) else _why_not_replayable(trainer.lr_scheduler)
    if refused is not None:
        raise RuntimeError(
            f"CheckFreqTrainerCallback: the checkpoint (step {saved_step}) was written by {saved_world} workers and "
            f"this run has {world}: the Trainer's schedule cannot continue at {world} ({refused}). Restart on "
            f"{saved_world} workers")
    assert not isinstance(where, str)
    step, epoch, batches = where
    _replay(trainer, fresh, step)
    trainer.state.global_step = step
    trainer.state.epoch = epoch + batches / len(data)
    return WorldChange(saved_world=saved_world, world=world, saved_step=saved_step, step=step,
                       max_steps=int(trainer.state.max_steps), lr=float(trainer.lr_scheduler.get_last_lr()[0]))


def _why_not_replayable(scheduler: Any) -> str | None:
    import torch

    if not isinstance(scheduler, torch.optim.lr_scheduler.LRScheduler) or \
            isinstance(scheduler, torch.optim.lr_scheduler.ReduceLROnPlateau):
        return f"its {type(scheduler).__name__} scheduler steps on metrics, not steps: it cannot be replayed"
    return None


def _replay(trainer: Any, fresh: FreshSchedule, steps: int) -> None:
    """The scheduler as built for this run, stepped ``steps`` times: the learning rate (and
    every scheduled hyper-parameter) a run of this world size has there, bit for bit."""
    from ray_checkfreq.integrations._common import unwrap_optimizer

    for group, saved in zip(unwrap_optimizer(trainer.optimizer).param_groups, fresh.groups):
        group.update(copy.deepcopy(saved))
    scheduler = trainer.lr_scheduler
    scheduler.load_state_dict(copy.deepcopy(fresh.scheduler))
    with warnings.catch_warnings():  # "lr_scheduler.step() before optimizer.step()": a replay, on purpose
        warnings.simplefilter("ignore", UserWarning)
        for _ in range(steps):
            scheduler.step()
