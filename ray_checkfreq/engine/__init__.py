"""The engine (layer 3): two-phase snapshot/persist and the CheckFreq policy, no Ray."""

from ray_checkfreq.engine.adaptive import AdaptiveConfig, AdaptiveRate
from ray_checkfreq.engine.checkfreq import CheckFreq, CheckFreqConfig
from ray_checkfreq.engine.persist import PersistError, PersistResult, PersistWorker
from ray_checkfreq.engine.policy import Decision, Profile, choose_interval
from ray_checkfreq.engine.restore import RestoreMismatchError
from ray_checkfreq.engine.seams import (
    Action,
    DecisionChannel,
    EngineSeams,
    HostMemory,
    LocalDecisions,
    Persister,
    PersisterFactory,
    local_rng_state,
    set_local_rng_state,
)
from ray_checkfreq.engine.snapshot import Snapshot

__all__ = [
    "Action",
    "AdaptiveConfig",
    "AdaptiveRate",
    "CheckFreq",
    "CheckFreqConfig",
    "Decision",
    "DecisionChannel",
    "EngineSeams",
    "HostMemory",
    "LocalDecisions",
    "PersistError",
    "PersistResult",
    "PersistWorker",
    "Persister",
    "PersisterFactory",
    "Profile",
    "RestoreMismatchError",
    "Snapshot",
    "choose_interval",
    "local_rng_state",
    "set_local_rng_state",
]
