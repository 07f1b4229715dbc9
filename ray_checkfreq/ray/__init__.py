"""The Ray layer: node agents, the per-iteration decision, and the Ray Train session.

    from ray_checkfreq.ray import CheckFreq, CheckFreqCallback

The naming rule: one ``CheckFreq`` per import path. ``ray_checkfreq.CheckFreq`` is the
engine of one process (a plain PyTorch loop); ``ray_checkfreq.ray.CheckFreq`` is what a
Ray Train worker uses, with the same ``step()`` / ``restore()`` / ``close()`` calls: it
builds one engine per rank (its ``engine`` attribute) and adds node agents, the shared
decision and the restart protocol around it. Nothing else of either name is public.

This package imports Ray; the layers below it never do. Its public names load on first
use: a node agent's or the policy actor's process imports only its own module, not
Ray Train (1.3 s of every actor start).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ray_checkfreq.ray.callback import CheckFreqCallback
    from ray_checkfreq.ray.registration import RegistrationConfig, load
    from ray_checkfreq.ray.session import CheckFreq, RayConfig, unwrap_model

_HOMES = {
    "CheckFreq": "session",
    "CheckFreqCallback": "callback",
    "RayConfig": "session",
    "RegistrationConfig": "registration",
    "load": "registration",
    "unwrap_model": "session",
}

__all__ = ["CheckFreq", "CheckFreqCallback", "RayConfig", "RegistrationConfig", "load", "unwrap_model"]


def __getattr__(name: str) -> Any:
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module 'ray_checkfreq.ray' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"ray_checkfreq.ray.{home}"), name)
    globals()[name] = value
    return value
