"""``CheckFreqCallback``: the run's policy actor from the start, and the end of the run's
node agents (and their slots) and policy actor when ``fit()`` ends.

Pass it in ``RunConfig(callbacks=[CheckFreqCallback()])``. It runs in the Train controller,
whose lifetime is the run's: agents and the policy actor outlive worker-group restarts and
end with ``fit()``, whether it returns or fails. Without it rank 0 creates the policy actor
(on the head node). With it or without, an agent or the policy actor also ends when nobody
renewed its lease for ``RayConfig.agent_lease_s``: the end of a run stopped with
``ray job stop`` (no callback runs then), unless it is submitted again before.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from ray.train.v2._internal.execution.callback import ControllerCallback

from ray_checkfreq.ray.agent import shutdown_agents
from ray_checkfreq.ray.names import SLOT_PREFIX, run_key
from ray_checkfreq.ray.policy_actor import get_or_create_policy, shutdown_policy
from ray_checkfreq.ray.slots import sweep_leftovers

logger = logging.getLogger("ray_checkfreq.ray")


class CheckFreqCallback(ControllerCallback):
    def __init__(self, shm_dir: str = "/dev/shm", policy_lease_s: float = 600.0) -> None:
        self.shm_dir = shm_dir
        self.policy_lease_s = policy_lease_s
        self.run: str | None = None

    def after_controller_start(self, train_run_context: Any) -> None:
        import ray

        self.run = run_key(train_run_context.get_run_config().name)
        # On the controller's node, the driver's side; .remote() does not block the loop.
        get_or_create_policy(self.run, node_id=ray.get_runtime_context().get_node_id(),
                             lease_s=self.policy_lease_s)

    async def before_controller_shutdown(self) -> None:
        # Hooks run on the controller's event loop: the blocking calls go to a thread.
        await asyncio.to_thread(self._end_agents)

    def before_controller_abort(self) -> None:
        self._end_agents()

    def _end_agents(self) -> None:
        if self.run is None:
            return
        try:
            count = shutdown_agents(self.run)
            shutdown_policy(self.run)
            swept = sweep_leftovers(self.shm_dir, SLOT_PREFIX)  # agents that were killed, on this host
            logger.info("ray_checkfreq: ended %d node agent(s), swept %d slot file(s)", count, len(swept))
        except Exception as err:
            logger.warning("ray_checkfreq: could not end the node agents: %s", err)
