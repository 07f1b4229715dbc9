"""Where this process sits in a Ray Train run, if it is in one."""

from __future__ import annotations

import sys


def train_context() -> tuple[int, int] | None:
    """(world rank, world size) inside a Ray Train worker, else None.

    Ray is not imported for this: a Train worker has imported it already.
    """
    if "ray" not in sys.modules:
        return None
    try:
        import ray.train

        ctx = ray.train.get_context()
        return int(ctx.get_world_rank()), int(ctx.get_world_size())
    except (RuntimeError, AttributeError, ValueError, TypeError):
        return None
