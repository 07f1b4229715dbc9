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
own resume), ``_initial_num_input_tokens_seen``.
"""

from __future__ import annotations

import copy
import logging
import sys
from collections.abc import Callable
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
    """The Trainer's ``TrainerState`` as checkpoint state (``extra_state``): plain values only."""

    def __init__(self, trainer: Any) -> None:
        self.trainer = trainer

    def state_dict(self) -> dict[str, Any]:
        state = self.trainer.state
        return {"current_flos": float(self.trainer.current_flos),  # not yet added to state.total_flos
                **{name: copy.deepcopy(getattr(state, name)) for name in STATE_FIELDS}}

    def load_state_dict(self, saved: dict[str, Any]) -> None:
        trainer = self.trainer
        for name in STATE_FIELDS:
            setattr(trainer.state, name, copy.deepcopy(saved[name]))
        trainer.current_flos = saved["current_flos"]
        # This attempt's counters start at the restore, as after the Trainer's own resume.
        trainer._initial_global_step = trainer.state.global_step
        trainer._globalstep_last_logged = trainer.state.global_step
        trainer._initial_num_input_tokens_seen = trainer.state.num_input_tokens_seen
