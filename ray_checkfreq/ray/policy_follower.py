"""Rank 0 between the engine and the run's policy actor: propose the engine's profiled k
once, then apply each new k the actor decides (the next planned action carries it to
every rank)."""

from __future__ import annotations

import logging
from dataclasses import asdict
from typing import Any

from ray_checkfreq.ray.policy_actor import PolicyLink

logger = logging.getLogger("ray_checkfreq.ray")


class PolicyFollower:
    def __init__(self, link: PolicyLink) -> None:
        self.link = link
        self.decisions: list[dict] = []  # each new decision of the policy actor
        self._version = -1
        self.lost_work = True  # False when this attempt resumed from a notice checkpoint that kept everything

    def after_step(self, engine: Any, *, world_size: int, generation: int | None) -> None:
        link = self.link
        if link.started is None:
            if engine.policy_ready and engine.decision is not None and engine.profile is not None:
                link.start(world_size=world_size, k=engine.decision.k, k_floor=engine.decision.k_floor,
                           iter_s=engine.profile.iter_s, overhead=engine.config.overhead,
                           adaptive=asdict(engine.config.adaptive_config), k_cap=engine.decision.k_cap,
                           cost_s=engine.decision.cost_s, max_overhead=engine.config.max_overhead,
                           restart_s=engine.config.restart_s, lost_work=self.lost_work)
            return
        decision = link.poll()
        if (decision is None or decision.get("generation") != generation or decision.get("k") is None
                or decision["version"] == self._version):
            return
        self._version = decision["version"]
        self.decisions.append(decision)
        if decision["k"] != engine.planned_k:
            logger.info("policy actor: k -> %d (overhead %s, persists %s s)", decision["k"], decision["overhead"],
                        decision["persist_s"])
        engine.set_k(decision["k"])
