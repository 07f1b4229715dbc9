"""Every use of Lightning's private trainer internals by the Lightning integration, in one place.

Which Lightning: ``lightning.pytorch``, else ``pytorch_lightning`` (the order
``ray.train.lightning`` imports them in, so our callback, Ray's strategy and the user's
Trainer are of one package). Only the versions in ``SUPPORTED`` were tested: any other
fails by name (``check_version``) before a run starts, since a changed loop could resume
at the wrong batch without a sound.

The loop state a checkpoint holds is the fit loop's own ``state_dict()`` taken as the
next batch starts, normalised to "between two batches" (``loop_state``); it is loaded with
the loop's own ``load_state_dict()``, so Lightning's restart path resumes mid-epoch at that
batch (batch index, epoch-end validation, ``global_step``).
"""

from __future__ import annotations

import copy
import re
from collections.abc import Callable
from typing import Any

try:
    import lightning.pytorch as pl
except ModuleNotFoundError:  # Ray's order: lightning.pytorch first
    try:
        import pytorch_lightning as pl  # type: ignore[no-redef]
    except ModuleNotFoundError as err:
        raise ImportError("ray_checkfreq.integrations.lightning needs Lightning: pip install 'lightning>=2.6,<2.7' "
                          "(or pytorch_lightning of the same versions)") from err

SUPPORTED = ((2, 6), (2, 7))
"""Lightning versions >= the first and < the second (tested: 2.6.6)."""
SUPPORTED_TEXT = ">=2.6,<2.7"

_BATCHES = "epoch_loop.batch_progress"
_SCHEDULERS = "epoch_loop.scheduler_progress"
_OPTIM = "epoch_loop.automatic_optimization.optim_progress"
_VAL_BATCHES = "epoch_loop.val_loop.batch_progress"
_EPOCHS = "epoch_progress"
_STEPPED = "epoch_loop.state_dict"


def lightning_version() -> str:
    return str(pl.__version__)


def check_version() -> None:
    """RuntimeError naming the installed Lightning and the supported range when they differ."""
    version = lightning_version()
    found = re.match(r"(\d+)\.(\d+)", version)
    if found is None or not SUPPORTED[0] <= (int(found[1]), int(found[2])) < SUPPORTED[1]:
        raise RuntimeError(
            f"ray_checkfreq's Lightning integration supports {pl.__name__} {SUPPORTED_TEXT} (tested 2.6.6), "
            f"installed: {pl.__name__} {version}. It restores Lightning's private loop counters, whose meaning "
            f"changes between versions: install a supported version (pip install '{pl.__name__.split('.')[0]}"
            f"{SUPPORTED_TEXT}') or drop CheckFreqLightningCallback")


# ------------------------------------------------------------------ what a run may not use
def unsupported(trainer: Any) -> str | None:
    """Why this trainer cannot resume exactly with the callback; None when it can."""
    module = trainer.lightning_module
    if not module.automatic_optimization:
        return "manual optimization (automatic_optimization=False)"
    if len(trainer.optimizers) != 1:
        return f"{len(trainer.optimizers)} optimizers (exactly one is supported)"
    if "deepspeed" in type(trainer.strategy).__name__.lower():
        return f"the {type(trainer.strategy).__name__} strategy"
    if trainer.limit_train_batches not in (1.0, None) or trainer.overfit_batches:
        return "limit_train_batches / overfit_batches (the data's epochs would not follow Lightning's)"
    if "dataloader_iter" in _step_parameters(module):
        return "training_step(dataloader_iter) (the batch index is then the step's own)"
    return None


def _step_parameters(module: Any) -> list[str]:
    import inspect

    return list(inspect.signature(module.training_step).parameters)


# ------------------------------------------------------------------ loop state
def loop_state(trainer: Any) -> dict:
    """The fit loop's state as the next batch starts: a batch fetched but not started is
    not counted, and loader states are left to ray_checkfreq's data."""
    state = copy.deepcopy(trainer.fit_loop.state_dict())
    for key in [k for k in state if k == "state_dict" or k.endswith(".state_dict")]:
        state[key].pop("combined_loader", None)
    batches = state[_BATCHES]
    if batches["current"]["ready"] == batches["current"]["started"] + 1:
        batches["current"]["ready"] -= 1
        batches["total"]["ready"] -= 1
    batches["is_last_batch"] = False if _epoch_open(state) else batches["is_last_batch"]
    if not _epoch_open(state):
        _as_next_epoch(state)
    return state


def _epoch_open(state: dict) -> bool:
    epochs = state[_EPOCHS]["total"]
    return bool(epochs["started"] == epochs["processed"] + 1)


def _as_next_epoch(state: dict) -> None:
    """A finished epoch (the end of fit): the per-epoch counters as the next one starts."""
    for key in (_BATCHES, _SCHEDULERS):
        state[key]["current"] = {name: 0 for name in state[key]["current"]}
    state[_BATCHES]["is_last_batch"] = False
    for part in state[_OPTIM]["optimizer"].values():
        part["current"] = {name: 0 for name in part["current"]}
    state[_VAL_BATCHES]["total"] = {name: 0 for name in state[_VAL_BATCHES]["total"]}


def load_loop_state(trainer: Any, state: dict) -> None:
    """Lightning's own loop restore (``load_state_dict``: the loops restart from it)."""
    trainer.fit_loop.load_state_dict(copy.deepcopy(state))


def settle_after_restart(trainer: Any, saved: dict) -> None:
    """At the first batch after a restore: Lightning's restart path, which expects a
    checkpoint saved inside validation, counts one extra stepped batch (a logging step)
    where validation was due just before the restored batch; that count is set back. Any
    other counter that differs from the checkpoint's raises: a resume at the wrong batch."""
    live = loop_state(trainer)
    trainer.fit_loop.epoch_loop._batches_that_stepped = saved[_STEPPED]["_batches_that_stepped"]
    live[_STEPPED] = saved[_STEPPED]
    differ = sorted(key for key in set(live) | set(saved) if live.get(key) != saved.get(key))
    if differ:
        raise RuntimeError(
            f"ray_checkfreq: Lightning {lightning_version()} did not resume its loops where the checkpoint "
            f"says ({', '.join(differ)} differ: {[(live.get(k), saved.get(k)) for k in differ]!r:.600}); "
            f"the integration supports {pl.__name__} {SUPPORTED_TEXT}")


# ------------------------------------------------------------------ checkpoint path, data source
def patch_resume_start(trainer: Any, decide: Callable[[Any], Any]) -> None:
    """``trainer.fit(ckpt_path=p)`` loads ``decide(p)`` instead (None: nothing)."""
    connector = trainer._checkpoint_connector
    original = type(connector).resume_start.__get__(connector)

    def resume_start(checkpoint_path: Any = None, weights_only: Any = None) -> None:
        original(decide(checkpoint_path) if checkpoint_path else checkpoint_path, weights_only=weights_only)

    connector.resume_start = resume_start


def unpatch_resume_start(trainer: Any) -> None:
    vars(trainer._checkpoint_connector).pop("resume_start", None)


def drop_loaded_checkpoint(trainer: Any) -> bool:
    """Forget a Lightning checkpoint loaded from ``ckpt_path`` before its training state
    (optimizer, schedulers, loops) is applied; True when there was one."""
    connector = trainer._checkpoint_connector
    loaded = bool(connector._loaded_checkpoint)
    connector._loaded_checkpoint = {}
    return loaded


def wrap_train_source(trainer: Any, make: Callable[[Callable[[], Any]], Any]) -> None:
    """Lightning's request for the train data returns ``make(request)`` (``request()``:
    what the module, the datamodule or ``fit(train_dataloaders=)`` gives)."""
    source = trainer.fit_loop._data_source
    original = type(source).dataloader.__get__(source)
    source.dataloader = lambda: make(original)


def unwrap_train_source(trainer: Any) -> None:
    vars(trainer.fit_loop._data_source).pop("dataloader", None)


def request_train_data(trainer: Any) -> Any:
    """The train data as Lightning would request it now (through ``wrap_train_source``)."""
    return trainer.fit_loop._data_source.dataloader()
