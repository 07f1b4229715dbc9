"""The Ray layer: node agents, the per-iteration decision, and the Ray Train session.

    from ray_checkfreq.ray import CheckFreq, CheckFreqCallback

This package imports Ray; the layers below it never do.
"""

from __future__ import annotations

from ray_checkfreq.ray.callback import CheckFreqCallback
from ray_checkfreq.ray.registration import RegistrationConfig, load
from ray_checkfreq.ray.session import CheckFreq, RayConfig, unwrap_model

__all__ = ["CheckFreq", "CheckFreqCallback", "RayConfig", "RegistrationConfig", "load", "unwrap_model"]
