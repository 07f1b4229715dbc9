"""Breaks ``CheckFreq.restore()`` on purpose, for tests/test_resume_mutation.py only.

Python imports this module at start-up when its folder is on PYTHONPATH; it does nothing
unless RAY_CHECKFREQ_MUTANT names a mutant. Child processes inherit both variables, so
the break reaches every process a test starts (the demo's included).
  restore-noop      restore() loads nothing and returns 0: the job retrains from scratch
  restore-previous  restore() loads the newest checkpoint but one (an older step), or
                    nothing when only one step is committed
"""

from __future__ import annotations

import os
import sys

MUTANT = os.environ.get("RAY_CHECKFREQ_MUTANT")


def _restore_noop(self) -> int:
    return 0


def _restore_previous_factory(restore):
    def restore_previous(self) -> int:
        refs = self.store.list()
        older = [ref for ref in refs if ref.step < refs[-1].step] if refs else []
        if not older:
            return 0  # only one checkpoint step: restore nothing, so the mutant is always wrong
        store, chosen = self.store, older[-1]
        # hide the newer checkpoints from this CheckFreq's own store object only
        store.list = lambda **filters: older[:]
        store.latest = lambda: chosen
        store.load = lambda ref_or_step=None: type(store).load(store, chosen if ref_or_step is None else ref_or_step)
        try:
            return restore(self)
        finally:
            for name in ("list", "latest", "load"):
                vars(store).pop(name, None)

    return restore_previous


if MUTANT:
    from ray_checkfreq.engine.checkfreq import CheckFreq

    if MUTANT == "restore-noop":
        CheckFreq.restore = _restore_noop
    elif MUTANT == "restore-previous":
        CheckFreq.restore = _restore_previous_factory(CheckFreq.restore)
    else:
        raise SystemExit(f"RAY_CHECKFREQ_MUTANT={MUTANT!r}: unknown mutant")
    print(f"ray_checkfreq mutant active: {MUTANT} (pid {os.getpid()})", file=sys.stderr)
