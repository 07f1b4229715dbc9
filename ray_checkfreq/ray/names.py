"""The names a run's Ray actors and slot files go by, in one place.

Every actor of a run is detached and named in ``NAMESPACE``, so a restarted worker group
finds the agents and the policy actor the group before it started. ``run`` is
``run_key(experiment)``: short and safe in file names.
"""

from __future__ import annotations

import hashlib

NAMESPACE = "ray_checkfreq"
SLOT_PREFIX = "rcf-"


def run_key(experiment: str) -> str:
    """A short, file-name-safe key for a run (the experiment's storage path)."""
    return hashlib.blake2b(experiment.encode(), digest_size=6).hexdigest()


def agent_name(run: str, node_id: str) -> str:
    return f"rcf-agent:{run}:{node_id}"


def agent_prefix(run: str) -> str:
    return f"rcf-agent:{run}:"


def policy_name(run: str) -> str:
    return f"rcf-policy:{run}"
