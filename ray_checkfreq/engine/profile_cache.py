"""The profile cached beside the checkpoints: read at start-up, written once profiling decided.

A restarted run with the same state size, device, world size, codec and CPU skips
profiling and takes k from the cached profile; any change re-profiles.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from ray_checkfreq.engine.policy import Decision, Profile
from ray_checkfreq.engine.profiling import cached_profile, fingerprint, fingerprint_changes
from ray_checkfreq.storage import CheckpointStore

logger = logging.getLogger("ray_checkfreq.engine")

PROFILE_NAME = "checkfreq-profile.json"


class ProfileCache:
    def __init__(self, store: CheckpointStore, model: torch.nn.Module,
                 optimizer: torch.optim.Optimizer, *, compress: bool | None) -> None:
        self.store = store
        self.model = model
        self.optimizer = optimizer
        self.compress = compress

    def read(self) -> tuple[Profile, Any] | None:
        """(profile, fingerprint) of the cached profile; None when there is none or it is
        unusable (with a warning naming the file)."""
        cached = self.store.read_metadata(PROFILE_NAME)
        if not cached:
            return None
        try:
            return cached_profile(cached)
        except (KeyError, TypeError, ValueError) as err:
            logger.warning("ignoring cached profile %s: %s", self.store.backend.uri(PROFILE_NAME), err)
            return None

    def changes(self, cached_fingerprint: Any) -> list[str]:
        """What changed since the cached profile was measured (empty: it still fits)."""
        return fingerprint_changes(cached_fingerprint, self.fingerprint())

    def write(self, profile: Profile, decision: Decision) -> None:
        self.store.write_metadata(PROFILE_NAME, {"profile": profile.to_json(), "decision": vars(decision),
                                                 "fingerprint": self.fingerprint()})

    def fingerprint(self) -> dict:
        config = self.store.config
        codec = {"codec": config.codec, "level": config.codec_level, "threads": config.codec_threads,
                 "compress": self.compress}
        return fingerprint(self.model, self.optimizer, codec)
