"""Ray Train's own example patterns under ray_checkfreq, killed mid-epoch (``ray_train_jobs.
train_with_evaluation``): dropout, a per-epoch evaluation through a shuffling DataLoader,
an LR scheduler stepped after ``cf.step()``, and the user's metrics through ``cf.report``.

Two runs on the session cluster: the uninterrupted one with the scheduler stepped before
``cf.step()``, and one with it stepped after and rank 1 SIGKILLed mid-epoch (the last one). The order
does not change an uninterrupted run (``tests/test_engine_between_steps.py`` checks that,
and both orders killed, without Ray): the killed run must end bit-identical to the first.
"""

from __future__ import annotations

import os
import uuid

import pytest
from conftest import RUN_TIMEOUT_S
from test_ray_train import TRAIN_RESOURCE, assert_nothing_left, assert_same_weights, events, require_train_nodes

pytestmark = pytest.mark.chaos

EPOCHS = 2
EPOCH_LEN = 14


def fit_example(tmp_path, name: str, **config) -> tuple[object, str]:
    import ray_train_jobs

    from ray_checkfreq.chaos.harness import TrainJob, fit_job

    work_dir = str(tmp_path / name)
    os.makedirs(work_dir, exist_ok=True)
    run_name = f"{name}-{uuid.uuid4().hex[:6]}"
    result = fit_job(TrainJob(train=ray_train_jobs.train_with_evaluation,
                              config={"work_dir": work_dir, "epochs": EPOCHS, **config}, name=run_name,
                              storage_path=str(tmp_path / "results"), workers=2,
                              resources_per_worker={"CPU": 1, TRAIN_RESOURCE: 1}, max_failures=2,
                              timeout_s=RUN_TIMEOUT_S))
    assert_nothing_left(run_name)
    return result, work_dir


def final_model(work_dir: str) -> dict:
    import torch

    saved = torch.load(os.path.join(work_dir, "final.pt"), weights_only=True)
    assert saved["iteration"] == EPOCHS * EPOCH_LEN
    return saved["model"]


def test_eval_dropout_and_a_scheduler_after_cf_step_resume_bit_identical(ray_cluster, tmp_path):
    require_train_nodes(ray_cluster, 2)
    reference, ref_dir = fit_example(tmp_path, "example-ref", scheduler="before")
    assert [s["iteration"] for s in events(ref_dir, 0, "start")] == [0]
    # Rank 1 dies after iteration 17: the newest checkpoint is the end of epoch 1 (14), taken
    # just before that epoch's evaluation drew the RNG and the scheduler stepped.
    killed, work_dir = fit_example(tmp_path, "example-kill", scheduler="after", kill={"rank": 1, "iteration": 17})
    assert [s["iteration"] for s in events(work_dir, 0, "start")] == [0, EPOCH_LEN]
    assert [e["iteration"] for e in events(work_dir, 1, "kill")] == [17]
    assert_same_weights(final_model(work_dir), final_model(ref_dir))
    last_eval = events(ref_dir, 0, "eval")[-1]
    assert events(work_dir, 0, "eval")[-1] == {**last_eval, "t": events(work_dir, 0, "eval")[-1]["t"]}
    for result in (reference, killed):  # the user's metrics reach Result.metrics, beside ours
        assert result.metrics["eval_loss"] == last_eval["loss"] and result.metrics["epoch"] == EPOCHS - 1
        assert result.metrics["checkfreq_step"] == EPOCHS * EPOCH_LEN
