"""``CheckFreqCallback``: ends the run's node agents (and their slots) when ``fit()`` ends.

Pass it in ``RunConfig(callbacks=[CheckFreqCallback()])``. It runs in the Train controller,
whose lifetime is the run's: agents outlive worker-group restarts and end with ``fit()``,
whether it returns or fails. Without it an agent ends when no rank renewed its lease for
``RayConfig.agent_lease_s``.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from ray.train.v2._internal.execution.callback import ControllerCallback

from ray_checkfreq.ray.agent import SLOT_PREFIX, run_key, shutdown_agents
from ray_checkfreq.ray.slots import sweep_leftovers

logger = logging.getLogger("ray_checkfreq.ray")


class CheckFreqCallback(ControllerCallback):
    def __init__(self, shm_dir: str = "/dev/shm") -> None:
        self.shm_dir = shm_dir
        self.run: str | None = None

    def after_controller_start(self, train_run_context: Any) -> None:
        self.run = run_key(train_run_context.get_run_config().name)

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
            swept = sweep_leftovers(self.shm_dir, SLOT_PREFIX)  # agents that were killed, on this host
            logger.info("ray_checkfreq: ended %d node agent(s), swept %d slot file(s)", count, len(swept))
        except Exception as err:
            logger.warning("ray_checkfreq: could not end the node agents: %s", err)
