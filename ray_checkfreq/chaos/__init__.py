"""Chaos and consistency checks (layer 6): tools that try to break checkpoints and say so.

``runner.run_chaos`` injects preemptions into a Ray Train job (``ray-checkfreq chaos``);
``fence`` catches snapshots that mix two iterations. Imported lazily: the CLI reads this
package without loading torch or Ray.
"""

from __future__ import annotations

from typing import Any

__all__ = ["CountingOptimizer", "torn_iterations"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        from ray_checkfreq.chaos import fence

        return getattr(fence, name)
    raise AttributeError(f"module 'ray_checkfreq.chaos' has no attribute {name!r}")
