"""The engine (layer 3): two-phase snapshot/persist and the CheckFreq policy, no Ray."""

from ray_checkfreq.engine.adaptive import AdaptiveConfig, AdaptiveRate
from ray_checkfreq.engine.checkfreq import CheckFreq, CheckFreqConfig
from ray_checkfreq.engine.persist import PersistError
from ray_checkfreq.engine.policy import Decision, Profile, choose_interval
from ray_checkfreq.engine.restore import RestoreMismatchError

__all__ = [
    "AdaptiveConfig",
    "AdaptiveRate",
    "CheckFreq",
    "CheckFreqConfig",
    "Decision",
    "PersistError",
    "Profile",
    "RestoreMismatchError",
    "choose_interval",
]
