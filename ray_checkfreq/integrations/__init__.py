"""Training frameworks that own the loop: one callback each.

    from ray_checkfreq.integrations.transformers import CheckFreqTrainerCallback
    from ray_checkfreq.integrations.lightning import CheckFreqLightningCallback

Each module imports its framework; this package imports neither. A callback builds
``ray_checkfreq.ray.CheckFreq`` inside a Ray Train worker and the engine's ``CheckFreq``
(with ``storage=``) in a plain process, restores before the framework's first step, and
steps once per optimizer step (docs/frameworks.md).
"""
