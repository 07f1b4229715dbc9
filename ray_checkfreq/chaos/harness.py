"""One way to run a Ray Train job with ray_checkfreq: the chaos runs, the demo, the Ray
benchmark and the Ray tests all build their ``TorchTrainer`` here.

    outcome = fit_job(TrainJob(train=job.train, config={...}, name="run", storage_path=dir))

``fit_job`` returns the ``Result``, or (``raise_errors=False``) the run's own exception,
for callers that assert on how a run failed. Every job gets ``CheckFreqCallback`` (the
controller hook that cleans up and fences a run's agents).
"""

from __future__ import annotations

import os
import signal
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True, kw_only=True)
class TrainJob:
    """A ``TorchTrainer`` run: its loop, config, workers and failure budget."""

    train: Callable[[dict], None]
    """The per-worker training function (``train_loop_per_worker``)."""
    config: Mapping[str, Any] = field(default_factory=dict)
    """``train_loop_config``."""
    name: str
    """The run's name (Ray Train's ``RunConfig.name``)."""
    storage_path: str
    """Where Ray Train keeps the run's results."""
    workers: int | tuple[int, int] = 2
    """A fixed world size, or (min, max) for an elastic run."""
    resources_per_worker: Mapping[str, float] = field(default_factory=lambda: {"CPU": 1})
    """Each worker's resources (a custom resource pins workers to simulated nodes)."""
    use_gpu: bool = False
    """Train on GPUs."""
    max_failures: int = 0
    """Worker-group restarts Ray Train may make."""
    num_to_keep: int | None = None
    """Ray Train's reported checkpoints kept (None: all)."""
    timeout_s: float | None = None
    """Seconds ``fit_job`` waits for the run (None: no limit); then it ends the run's
    controller and fails with a TimeoutError instead of waiting for ever."""
    in_place: Any = None
    """An ``InPlaceConfig``: run on torchft replica groups (``ray_checkfreq.ray.inplace``), one
    worker per replica, without ``CheckFreqCallback`` (the replicas checkpoint by themselves)."""

    def __post_init__(self) -> None:
        if not self.name:
            raise ValueError("name='': a run needs a name")
        workers = self.workers if isinstance(self.workers, tuple) else (self.workers, self.workers)
        if len(workers) != 2 or not all(isinstance(w, int) and not isinstance(w, bool) for w in workers) \
                or not 1 <= workers[0] <= workers[1]:
            raise ValueError(f"workers={self.workers!r}: must be an int >= 1 or (min, max) with 1 <= min <= max")
        if self.max_failures < -1:
            raise ValueError(f"max_failures={self.max_failures}: must be >= 0 (or -1: unlimited)")
        if self.num_to_keep is not None and self.num_to_keep < 1:
            raise ValueError(f"num_to_keep={self.num_to_keep}: must be None or >= 1")
        if self.timeout_s is not None and not self.timeout_s > 0:
            raise ValueError(f"timeout_s={self.timeout_s!r}: must be None or > 0 seconds")


def fit_job(job: TrainJob, *, raise_errors: bool = True) -> Any:
    """Run ``job`` to its end (at most ``job.timeout_s``); its ``Result``, or its exception
    where ``raise_errors`` is False."""
    trainer = _trainer(job)
    outcome = bounded_call(trainer.fit, timeout_s=job.timeout_s, what=f"Ray Train run {job.name!r}",
                           on_timeout=kill_train_controllers)
    if raise_errors and isinstance(outcome, Exception):
        raise outcome
    return outcome


def bounded_call(call: Callable[[], Any], *, timeout_s: float | None, what: str,
                 on_timeout: Callable[[], None]) -> Any:
    """``call()``'s result or exception; after ``timeout_s`` (None: never) a TimeoutError
    naming ``what``, once ``on_timeout`` ran (the call's thread is left behind, a daemon)."""
    if timeout_s is None:
        return _outcome(call)
    found: list[Any] = []
    thread = threading.Thread(target=lambda: found.append(_outcome(call)), name="rcf-bounded-call", daemon=True)
    thread.start()
    thread.join(timeout_s)
    if not found:
        on_timeout()
        return TimeoutError(f"{what} did not finish within timeout_s={timeout_s:g} s")
    return found[0]


def _outcome(call: Callable[[], Any]) -> Any:
    try:
        return call()
    except Exception as err:  # the run's own failure: the caller reports or asserts on it
        return err


def kill_train_controllers() -> None:
    """SIGKILL every live Ray Train controller process of this (local) cluster: a run that
    hangs holds its resources until its controller goes. Read from the GCS's actor table:
    the state API needs a dashboard, which test clusters run without."""
    from ray._private import state

    for actor in state.actors().values():
        if actor["ActorClassName"] == "TrainController" and actor["State"] == "ALIVE" and actor["Pid"]:
            try:
                os.kill(int(actor["Pid"]), signal.SIGKILL)
            except ProcessLookupError:
                pass


def _trainer(job: TrainJob) -> Any:
    from ray.train import CheckpointConfig, FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    from ray_checkfreq.ray import CheckFreqCallback

    extra: dict[str, Any] = {}
    callbacks: list[Any] = [CheckFreqCallback()]  # a ControllerCallback
    if job.in_place is not None:
        from ray_checkfreq.ray.inplace import in_place_config

        extra["torch_config"], callbacks = in_place_config(job.in_place), []
    return TorchTrainer(
        job.train,
        train_loop_config=dict(job.config),
        # Train v2's ScalingConfig (the one in force) takes (min, max); mypy sees v1's.
        scaling_config=ScalingConfig(num_workers=job.workers,  # type: ignore[arg-type]
                                     use_gpu=job.use_gpu, resources_per_worker=dict(job.resources_per_worker)),
        run_config=RunConfig(name=job.name, storage_path=job.storage_path,
                             failure_config=FailureConfig(max_failures=job.max_failures),
                             checkpoint_config=CheckpointConfig(num_to_keep=job.num_to_keep),
                             callbacks=callbacks),
        **extra,
    )
