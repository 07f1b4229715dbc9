"""Registration with Ray Train (pointer checkpoints), ``ray_checkfreq.ray.load``, metrics.

The pointer format, its reader, the protection it gives the store's retention and the
cadence are tested without Ray Train; one ``TorchTrainer`` run (2 workers,
``num_to_keep=1``) checks the whole path: ``Result.checkpoint`` loads bit-identically and no
live pointer ever names a step the store deleted.
"""

from __future__ import annotations

import importlib.util
import os
import uuid
from types import SimpleNamespace

import pyarrow.fs
import pytest
import torch
from conftest import RUN_TIMEOUT_S

from ray_checkfreq import CheckpointStore
from ray_checkfreq.ray.registration import (
    POINTER_FILE,
    POINTER_PREFIX,
    PointedSteps,
    Pointer,
    PointerError,
    RegistrationConfig,
    load,
    read_pointer,
    register_every,
    write_pointer,
)

LOCAL = pyarrow.fs.LocalFileSystem()


def checkpoint_at(path: str, filesystem=LOCAL) -> SimpleNamespace:
    """What load() uses of a ``ray.train.Checkpoint``: its path and filesystem."""
    return SimpleNamespace(path=path, filesystem=filesystem)


def state_of(step: int) -> dict:
    return {"model": {"w": torch.full((8,), float(step))}, "optimizer": {"lr": 0.1}}


# ------------------------------------------------------------------ pointers
def test_a_pointer_round_trips_and_loads_its_step(tmp_path):
    store = CheckpointStore(str(tmp_path / "store"), full_every=1)
    for step in (4, 8):
        store.save(step, state_of(step))
    path = write_pointer(LOCAL, str(tmp_path), Pointer(store_uri=store.uri, step=4, run_filesystem=True))
    assert os.path.dirname(path) == str(tmp_path) and os.path.basename(path).startswith(POINTER_PREFIX)
    assert os.listdir(path) == [POINTER_FILE]  # the partial file was renamed into place
    assert read_pointer(LOCAL, path) == Pointer(store_uri=store.uri, step=4, run_filesystem=True)
    state = load(checkpoint_at(path))
    assert torch.equal(state["model"]["w"], torch.full((8,), 4.0)) and state["optimizer"] == {"lr": 0.1}


def test_load_names_the_directory_that_is_not_a_pointer(tmp_path):
    (tmp_path / "plain").mkdir()
    with pytest.raises(PointerError, match=f"{tmp_path}/plain: not a ray_checkfreq pointer"):
        load(checkpoint_at(str(tmp_path / "plain")))
    (tmp_path / "plain" / POINTER_FILE).write_text('{"format": "something else"}')
    with pytest.raises(PointerError, match=f"plain/{POINTER_FILE}: not a ray_checkfreq pointer"):
        load(checkpoint_at(str(tmp_path / "plain")))
    (tmp_path / "plain" / POINTER_FILE).write_bytes(b"\x80not json")
    with pytest.raises(PointerError, match="not JSON"):
        load(checkpoint_at(str(tmp_path / "plain")))
    (tmp_path / "plain" / POINTER_FILE).write_text(
        '{"format": "ray_checkfreq.pointer", "version": 1, "store_uri": "/x", "step": -1, "run_filesystem": true}')
    with pytest.raises(PointerError, match="malformed pointer"):
        load(checkpoint_at(str(tmp_path / "plain")))


def test_pointed_steps_are_the_live_pointers_of_this_store(tmp_path):
    experiment = str(tmp_path)
    ours = write_pointer(LOCAL, experiment, Pointer(store_uri="/stores/a", step=12, run_filesystem=True))
    write_pointer(LOCAL, experiment, Pointer(store_uri="/stores/a", step=20, run_filesystem=True))
    write_pointer(LOCAL, experiment, Pointer(store_uri="/stores/other", step=16, run_filesystem=True))
    (tmp_path / f"{POINTER_PREFIX}000000000099-half").mkdir()  # no file: not a pointer (yet, or any more)
    (tmp_path / "checkpoint_2026-01-01").mkdir()  # Ray Train's own
    pointed = PointedSteps(LOCAL, experiment, "/stores/a")
    assert pointed() == {12, 20}
    LOCAL.delete_dir(ours)  # Ray evicted it
    assert pointed() == {20}
    assert PointedSteps(LOCAL, str(tmp_path / "not-yet"), "/stores/a")() == set()


def test_retention_keeps_a_pointed_step_and_drops_it_once_the_pointer_goes(tmp_path):
    experiment = str(tmp_path / "experiment")
    store = CheckpointStore(str(tmp_path / "store"), keep_last=1, keep_epoch_boundaries=False, full_every=1)
    store.protected_steps = PointedSteps(LOCAL, experiment, store.uri)
    store.save(4, state_of(4))
    pointer = write_pointer(LOCAL, experiment, Pointer(store_uri=store.uri, step=4, run_filesystem=False))
    for step in (8, 12):
        store.save(step, state_of(step))
    assert [ref.step for ref in store.list()] == [4, 12]
    assert torch.equal(load(checkpoint_at(pointer))["model"]["w"], torch.full((8,), 4.0))
    LOCAL.delete_dir(pointer)
    store.save(16, state_of(16))
    assert [ref.step for ref in store.list()] == [16]


def test_a_pointer_on_s3_through_pyarrow(s3_bucket, s3_server):
    """The run's storage filesystem may be S3: pointers and the store live there."""
    s3 = pyarrow.fs.S3FileSystem(endpoint_override=s3_server, scheme="http", access_key="testing",
                                 secret_key="testing", region="us-east-1")
    experiment = f"{s3_bucket}/runs/r1"
    store = CheckpointStore(f"{experiment}/checkfreq", filesystem=s3, keep_last=1, keep_epoch_boundaries=False,
                            full_every=1)
    store.protected_steps = PointedSteps(s3, experiment, store.uri)
    store.save(3, state_of(3))
    path = write_pointer(s3, experiment, Pointer(store_uri=store.uri, step=3, run_filesystem=True))
    store.save(6, state_of(6))
    assert [ref.step for ref in store.list()] == [3, 6]
    assert torch.equal(load(checkpoint_at(path, s3))["model"]["w"], torch.full((8,), 3.0))


# ----------------------------------------------------------------- cadence
def test_register_every_keeps_reports_inside_the_budget():
    config = RegistrationConfig()
    # 2 s report, 3.5 % budget, a quarter of it for registration, 12 ms iterations: 19048 iterations
    every = register_every(report_s=2.0, iter_s=0.012, overhead=0.035, config=config)
    assert every == 19048 and 2.0 / (every * 0.012) <= 0.25 * 0.035
    # slow iterations: Ray Train's 2 s poll is the floor
    assert register_every(report_s=0.01, iter_s=1.0, overhead=0.5, config=config) == 2
    assert register_every(report_s=2.0, iter_s=0.012, overhead=0.035, config=RegistrationConfig(every=7)) == 7


@pytest.mark.parametrize("bad", [{"every": 0}, {"every": True}, {"overhead_share": 0}, {"report_s": -1}])
def test_registration_config_is_validated(bad):
    with pytest.raises(ValueError, match=next(iter(bad))):
        RegistrationConfig(**bad)


def rank0_registrar(tmp_path, store: CheckpointStore, every: int = 8):
    from ray_checkfreq.ray.registration import Registrar

    storage = SimpleNamespace(storage_filesystem=LOCAL, experiment_fs_path=str(tmp_path / "experiment"))
    registrar = Registrar(rank=0, group=None, store=store, storage=storage, run_filesystem=False, overhead=0.035,
                          config=RegistrationConfig(every=every), metrics=dict)
    registrar.start(0, None)
    return registrar


def pointer_dirs(tmp_path) -> list[str]:
    root = tmp_path / "experiment"
    return sorted(os.listdir(root)) if root.exists() else []


def test_rank0_plans_a_report_only_for_a_new_committed_step(tmp_path):
    store = CheckpointStore(str(tmp_path / "store"), full_every=1)
    registrar = rank0_registrar(tmp_path, store)
    assert registrar._plan(8) == {"step": None, "path": None, "next_in": 2}  # nothing committed yet
    store.save(4, state_of(4))
    registrar.committed(4)
    plan = registrar._plan(10)
    assert plan["step"] == 4 and plan["next_in"] == 8 and read_pointer(LOCAL, plan["path"]).step == 4
    registrar.registered_step = 4  # what _report records once every rank reported
    assert registrar._plan(18)["step"] is None  # the same step is not registered twice
    assert len(pointer_dirs(tmp_path)) == 1


def test_a_step_gone_before_its_pointer_is_written_is_not_registered(tmp_path):
    store = CheckpointStore(str(tmp_path / "store"), keep_last=1, keep_epoch_boundaries=False, full_every=1)
    registrar = rank0_registrar(tmp_path, store)
    store.save(4, state_of(4))
    registrar.committed(4)
    store.save(8, state_of(8))  # retention (keep_last=1, no pointer yet) takes step 4
    assert registrar._plan(9)["step"] is None
    assert pointer_dirs(tmp_path) == []  # the pointer it wrote was removed again


# ---------------------------------------------------------------- metrics
def test_metrics_are_recorded_and_kept(ray_session):
    from ray_checkfreq.ray.metrics import CheckFreqMetrics

    metrics = CheckFreqMetrics(run="unit", rank=0, node_id="f" * 40, every_s=3600)
    metrics.record_stats({"k": 5, "stall_s_total": 0.25, "overhead_estimate": 0.01, "compression_ratio": None})
    metrics.record_persist(0.5, 1000)
    metrics.record_persist(0.7, 500)
    metrics.record_restore("slot", lost_iterations=3)
    metrics.record_restore("none")
    metrics.maybe_record_stats(lambda: {"k": 9})  # not due: every_s has not passed
    values = metrics.values()
    assert values["k"] == 5 and values["stall_seconds"] == 0.25 and "compression_ratio" not in values
    assert values["bytes_written"] == 1500 and values["checkpoints_committed"] == 2
    assert values["persist_seconds"] == 0.7 and values["restores"] == 1 and values["lost_iterations"] == 3
    assert values["notices_handled"] == 0


# ------------------------------------------------------------- Ray Train
TRAIN_RESOURCE = "rcf_train"
# Inside the first epoch and a multiple of k = 4: the last iteration is a checkpoint, which
# close() makes durable before the final registration (close() takes no extra checkpoint).
ITERATIONS = 24


@pytest.fixture(scope="module")
def two_train_nodes(ray_cluster):
    from test_ray_train import require_train_nodes

    require_train_nodes(ray_cluster, 2)
    yield ray_cluster


@pytest.mark.chaos
def test_result_checkpoint_loads_bit_identically_with_num_to_keep_1(two_train_nodes, tmp_path):
    import ray_train_jobs
    from test_ray_train import assert_nothing_left, assert_same_weights, events

    from ray_checkfreq.chaos.harness import TrainJob, fit_job
    from ray_checkfreq.ray import load as load_result

    work_dir = str(tmp_path / "job")
    os.makedirs(work_dir)
    run_name = f"register-{uuid.uuid4().hex[:6]}"
    result = fit_job(TrainJob(train=ray_train_jobs.train,
                              config={"work_dir": work_dir, "iterations": ITERATIONS, "register_every": 5,
                                      "check_pointers": True},
                              name=run_name, storage_path=str(tmp_path / "results"), workers=2,
                              resources_per_worker={"CPU": 1, TRAIN_RESOURCE: 1}, num_to_keep=1,
                              timeout_s=RUN_TIMEOUT_S))
    assert_nothing_left(run_name)

    model = ray_train_jobs.small_cnn()
    model.load_state_dict(load_result(result.checkpoint)["model"])
    final = torch.load(os.path.join(work_dir, "final.pt"), weights_only=True)
    assert final["iteration"] == ITERATIONS
    assert_same_weights(model.state_dict(), final["model"])
    pointer = read_pointer(result.checkpoint.filesystem, result.checkpoint.path)
    assert pointer.step == ITERATIONS  # the final registration comes after the last commit
    assert result.metrics["checkfreq_step"] == ITERATIONS

    end = events(work_dir, 0, "end")[-1]["stats"]
    assert end["registration"]["registrations"] >= 3  # so Ray evicted pointers while the run went on
    experiment = os.path.join(str(tmp_path / "results"), run_name)
    live = [name for name in os.listdir(experiment) if name.startswith(POINTER_PREFIX)]
    assert live == [os.path.basename(result.checkpoint.path)]  # Ray deleted every evicted pointer
    assert events(work_dir, 0, "dangling") == []  # no live pointer ever named a deleted step
    store = CheckpointStore(os.path.join(experiment, "checkfreq"))
    assert ITERATIONS in [ref.step for ref in store.list()]

    metrics = end["metrics"]
    assert metrics["checkpoints_committed"] >= 5 and metrics["bytes_written"] > 0
    assert metrics["k"] == 4 and metrics["restores"] == 0 and metrics["registered_step"] == ITERATIONS


@pytest.mark.skipif(importlib.util.find_spec("prometheus_client") is None,
                    reason="ray[default] (prometheus_client) is not installed: Ray exports no metrics here")
def test_metrics_reach_the_prometheus_endpoint(ray_session):
    import time
    import urllib.request

    import ray

    @ray.remote(num_cpus=0)
    def record() -> None:
        from ray_checkfreq.ray.metrics import CheckFreqMetrics

        CheckFreqMetrics(run="scrape", rank=0, node_id=ray.get_runtime_context().get_node_id()).record_stats(
            {"k": 7})

    ray.get(record.remote())
    port = ray._private.worker.global_worker.node.metrics_export_port
    deadline = time.monotonic() + 30
    while True:
        text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
        if "checkfreq_k" in text:
            return
        assert time.monotonic() < deadline, "checkfreq_k never reached the metrics endpoint"
        time.sleep(1)


def test_the_registration_budget_is_the_engines_overhead_however_it_is_given():
    from ray_checkfreq import CheckFreqConfig
    from ray_checkfreq.ray.session import _overhead_of

    assert _overhead_of({"config": CheckFreqConfig(overhead=0.01)}) == 0.01
    assert _overhead_of({"overhead": 0.02}) == 0.02
    assert _overhead_of({}) == CheckFreqConfig().overhead
