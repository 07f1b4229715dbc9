"""A model state that encodes its iteration, to catch a snapshot that mixes two iterations."""

from __future__ import annotations

import torch

from ray_checkfreq.storage import CheckpointStore


class CountingOptimizer(torch.optim.Optimizer):
    """Each step writes the step count into every parameter and into its own state."""

    def __init__(self, params) -> None:
        super().__init__(params, {})

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                state = self.state[p]
                if "count" not in state:
                    state["count"] = torch.zeros_like(p)
                state["count"].add_(1)
                p.copy_(state["count"])


def torn_iterations(store: CheckpointStore) -> list[int]:
    """Iterations whose checkpoint holds any parameter or optimizer value of another one."""
    torn = []
    for ref in store.list():
        state = store.load(ref)
        iteration = state["checkfreq"]["iteration"]
        tensors = list(state["model"].values()) + [s["count"] for s in state["optimizer"]["state"].values()]
        if not all(bool((t == iteration).all()) for t in tensors):
            torn.append(iteration)
    return torn
