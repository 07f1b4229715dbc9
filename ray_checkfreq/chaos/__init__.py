"""Chaos and consistency checks (layer 6): tools that try to break checkpoints and say so."""

from ray_checkfreq.chaos.fence import CountingOptimizer, torn_iterations

__all__ = ["CountingOptimizer", "torn_iterations"]
