"""A replacement replica that Ray cannot place, ended so that ``fit()`` returns.

Ray 2.60's controller replaces a lost replica group by creating its worker and waiting for
it with ``ray.get`` and no timeout (``WorkerGroup._create_workers``, called from
``_replace_replica_group_impl``). With no node left for the worker's placement-group bundle,
that wait never ends: the survivors finish the job's work and ``fit()`` still does not
return. A replica whose work has ended waits a stated time for the replacement to be
placed, then ends it, from the GCS's actor table (a worker holds no handle to it).

Ending the unplaced worker alone is not enough: the controller retries that startup failure
(``WorkerGroupStartupFailedError`` is retryable, and ``controller_failure_limit`` is unbounded
by default), and the retry replaces the same group again from its stale poll status. So the
worker group's barrier actor goes first; the retry then fails at ``sync_actor.reset`` with an
error the controller does not retry, and ``fit()`` raises ``ControllerError``.
"""

from __future__ import annotations

import logging
import time

import ray

logger = logging.getLogger("ray_checkfreq.ray")

TRAIN_WORKER_CLASS = "RayTrainWorker"
_NOT_PLACED = frozenset({"DEPENDENCIES_UNREADY", "PENDING_CREATION"})


def unplaced_train_workers(job_id: str) -> list[str]:
    """The actor ids (hex) of this Ray job's Train workers that wait for a node."""
    from ray._private import state

    return [actor_id for actor_id, actor in state.actors().items()
            if actor["JobID"] == job_id and actor["ActorClassName"] == TRAIN_WORKER_CLASS
            and actor["State"] in _NOT_PLACED]


def end_actor(actor_id: str, *, timeout_s: float = 10.0) -> None:
    """End an actor by id through the GCS (the way ``ray.kill`` does for a handle's owner)."""
    from ray._private.grpc_utils import init_grpc_channel
    from ray.core.generated import gcs_service_pb2, gcs_service_pb2_grpc

    channel = init_grpc_channel(ray.get_runtime_context().gcs_address)  # carries the cluster's auth token
    try:
        request = gcs_service_pb2.KillActorViaGcsRequest(  # type: ignore[attr-defined]
            actor_id=bytes.fromhex(actor_id), force_kill=True, no_restart=True)
        reply = gcs_service_pb2_grpc.ActorInfoGcsServiceStub(channel).KillActorViaGcs(request, timeout=timeout_s)
    finally:
        channel.close()
    if reply.status.code != 0:
        raise RuntimeError(f"the GCS did not end actor {actor_id}: {reply.status.message}")


def end_unplaced_replacements(wait_s: float, *, poll_s: float = 0.5) -> list[str]:
    """From a Train worker whose work has ended: wait up to ``wait_s`` for every unplaced
    replacement worker of this job to be placed; end those still waiting (the barrier actor
    first, see the module's docstring). Returns the ended workers' actor ids."""
    from ray.train.v2._internal.execution.context import get_train_context

    job_id = ray.get_runtime_context().get_job_id()
    deadline = time.monotonic() + wait_s
    while (waiting := unplaced_train_workers(job_id)) and time.monotonic() < deadline:
        time.sleep(poll_s)
    if not waiting:
        return []
    logger.warning("in-place: %d replacement worker(s) not placed %.0f s after this replica's work ended "
                   "(no node for them); ending them so that fit() returns instead of waiting for ever. "
                   "fit() raises ControllerError, after the survivors' work ended.",
                   len(waiting), wait_s)
    ray.kill(get_train_context().execution_context.synchronization_actor)  # type: ignore[arg-type]
    for actor_id in waiting:
        end_actor(actor_id)
    return waiting
