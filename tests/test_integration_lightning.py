"""The Lightning callback: exact resume in process (a crash raised at a chosen step, a
fresh Trainer resuming), its regressions, and one Ray Train run SIGKILLed mid-epoch.

Exactness is checked against an uninterrupted run of the same configuration: every model,
optimizer and scheduler tensor bit-identical, validation at the same global steps with the
same RNG draws, the same batches in the same order (every sample once per epoch), and the
resumed attempt's first batch at the iteration the checkpoint says.
"""

from __future__ import annotations

import json
import logging
import os
import uuid
import warnings
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from lightning_jobs import Crash, Recorder, SimulatedCrash, TinyModule, dataset

from ray_checkfreq.data import StaleIteratorError, TorchLoaderOptions, resumable
from ray_checkfreq.integrations import _lightning_loops
from ray_checkfreq.integrations.lightning import CheckFreqLightningCallback, ResumableTrainData, is_pointer_path

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning:lightning", "ignore::DeprecationWarning")

EPOCHS, STEPS_PER_EPOCH = 3, 10


def run(storage: Any, *, every: int, crash_at: int | None = None, ckpt_path: str | None = None,
        epochs: int = EPOCHS) -> tuple[CheckFreqLightningCallback, Recorder, TinyModule, pl.Trainer, bool]:
    checkfreq = CheckFreqLightningCallback(storage=str(storage), every=every)
    recorder = Recorder()
    callbacks: list[Any] = [checkfreq, recorder] + ([Crash(crash_at)] if crash_at is not None else [])
    trainer = pl.Trainer(accelerator="cpu", devices=1, max_epochs=epochs, val_check_interval=0.5, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         callbacks=callbacks)
    module = TinyModule()
    crashed = False
    try:
        trainer.fit(module, ckpt_path=ckpt_path)
    except SimulatedCrash:
        crashed = True
    return checkfreq, recorder, module, trainer, crashed


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory) -> dict:
    """One uninterrupted run per ``every`` the tests use."""
    runs = {}
    for every in (2, 5):
        _, recorder, module, trainer, crashed = run(tmp_path_factory.mktemp(f"full-{every}"), every=every)
        assert not crashed and trainer.global_step == EPOCHS * STEPS_PER_EPOCH
        runs[every] = (recorder, _state(module, trainer))
    return runs


def _state(module: TinyModule, trainer: pl.Trainer) -> dict:
    return {"model": module.state_dict(), "optimizer": trainer.optimizers[0].state_dict(),
            "scheduler": trainer.lr_scheduler_configs[0].scheduler.state_dict()}


def assert_identical(a: Any, b: Any, path: str = "") -> None:
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b), f"{path} differs"
    elif isinstance(a, dict):
        assert a.keys() == b.keys(), f"{path}: keys differ"
        for key in a:
            assert_identical(a[key], b[key], f"{path}/{key}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), f"{path}: lengths differ"
        for i, (x, y) in enumerate(zip(a, b)):
            assert_identical(x, y, f"{path}[{i}]")
    else:
        assert a == b, f"{path}: {a!r} != {b!r}"


# every, crash after step, the iteration the checkpoint resumes at, where it lies
SCENARIOS = [
    (2, 13, 12, "mid-epoch: the epoch-end validation is still ahead"),
    (5, 12, 10, "an epoch's end, after its validation"),
    (5, 17, 15, "mid-epoch, just after a validation"),
]


@pytest.mark.parametrize("every, crash_at, resumes_at, where", SCENARIOS)
def test_resume_is_exact(tmp_path, uninterrupted, every, crash_at, resumes_at, where, capsys, caplog):
    full, full_state = uninterrupted[every]
    _, first, _, _, crashed = run(tmp_path, every=every, crash_at=crash_at)
    assert crashed
    capsys.readouterr()
    checkfreq, second, module, trainer, crashed = run(tmp_path, every=every)
    assert not crashed and checkfreq.restored_iteration == resumes_at, where
    # A plain script shows that it resumed (one line; INFO logs it does not show).
    epoch, batch = divmod(resumes_at, STEPS_PER_EPOCH)
    assert [line for line in capsys.readouterr().out.splitlines() if line.startswith("ray_checkfreq:")] == \
        [f"ray_checkfreq: CheckFreqLightningCallback resumed at step {resumes_at} (epoch {epoch}, batch {batch} of it)"]

    # Each checkpoint completed by the data's fetch hook as the next batch starts (never by
    # the engine's fallback at the next optimizer step, which warns).
    assert [r.getMessage() for r in caplog.records if r.name.startswith("ray_checkfreq")
            and r.levelno >= logging.WARNING] == []
    # (a) the resumed attempt starts at the checkpoint's iteration, at the batch the full run had there
    assert second.batches[0][0] == resumes_at
    assert second.batches[0][:3] == full.batches[resumes_at][:3]
    # (b) bit-identical model, optimizer and scheduler
    assert_identical(_state(module, trainer), full_state)
    # (c) validation at the same global steps with the same RNG draws
    assert [v for v in first.validations if v[0] <= resumes_at] + second.validations == full.validations
    # (d) the same batches: every sample once per epoch
    batches = [b for b in first.batches if b[0] < resumes_at] + second.batches
    assert batches == full.batches
    for epoch in range(EPOCHS):
        ids = sorted(i for b in batches if b[1] == epoch for i in b[3])
        assert ids == list(range(40)), f"epoch {epoch}"


def test_resume_mid_epoch_validates_at_epoch_end(tmp_path, uninterrupted):
    """The regression: a resume mid-epoch ran no epoch-end validation (nor its RNG draw)."""
    run(tmp_path, every=2, crash_at=13)
    _, second, _, _, _ = run(tmp_path, every=2)
    steps = [step for step, _ in second.validations]
    assert steps == [15, 20, 25, 30]
    assert second.validations == uninterrupted[2][0].validations[2:]


def test_iterator_taken_before_restore(tmp_path):
    """An iterator taken before a restore and used after it resumes from the restored
    position (never 0 batches); one already used before it raises StaleIteratorError."""
    def data() -> ResumableTrainData:
        return ResumableTrainData(resumable(dataset(40, seed=0), batch_size=4, seed=0, rank=0, world_size=1,
                                            options=TorchLoaderOptions(num_workers=0)))

    source = data()
    it = iter(source)
    for _ in range(3):
        next(it)
        source.batch_starts()
    saved = source.state_dict()  # the third batch started: it is the next one to train, 8 remain

    lazy, used = data(), data()
    taken = iter(lazy)
    used_it = iter(used)
    next(used_it)
    lazy.load_state_dict(saved)
    used.load_state_dict(saved)
    assert len(list(taken)) == 8
    with pytest.raises(StaleIteratorError):
        next(used_it)


def test_ckpt_path_of_a_pointer_is_ignored(tmp_path):
    """Ray's resume pattern, fit(ckpt_path=<get_checkpoint() dir>/checkpoint.ckpt), with one
    of our pointer checkpoints: a warning naming ray_checkfreq and the line, no crash."""
    named = tmp_path / "run" / "checkfreq-pointer-000000000012-0123abcd"
    copied = tmp_path / "as_directory-copy"
    for directory in (named, copied):
        directory.mkdir(parents=True)
        (directory / "checkfreq-pointer.json").write_text(json.dumps({"format": "ray_checkfreq.pointer"}))
    for directory in (named, copied):
        ckpt_path = str(directory / "checkpoint.ckpt")
        assert is_pointer_path(ckpt_path)
        with pytest.warns(UserWarning, match=r"ray_checkfreq.*pointer checkpoint.*Remove the ckpt_path"):
            _, _, _, trainer, crashed = run(tmp_path / f"store-{directory.name}", every=5, epochs=1,
                                            ckpt_path=ckpt_path)
        assert not crashed and trainer.global_step == STEPS_PER_EPOCH
    assert not is_pointer_path(str(tmp_path / "lightning" / "checkpoint.ckpt"))


def test_unknown_lightning_version_fails_by_name(tmp_path, monkeypatch):
    monkeypatch.setattr(_lightning_loops.pl, "__version__", "2.9.1")
    with pytest.raises(RuntimeError, match=r"lightning.pytorch 2\.9\.1.*|2\.9\.1") as err:
        CheckFreqLightningCallback(storage=str(tmp_path))
    assert ">=2.6,<2.7" in str(err.value)


def test_storage_required_outside_ray(tmp_path):
    trainer = pl.Trainer(accelerator="cpu", devices=1, max_epochs=1, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False,
                         callbacks=[CheckFreqLightningCallback(every=2)])
    with pytest.raises(ValueError, match="storage"):
        trainer.fit(TinyModule())


# ------------------------------------------------------------------ Ray Train
def _lines(work_dir: str, rank: int) -> list[dict]:
    with open(os.path.join(work_dir, f"log-{rank}.jsonl")) as lines:
        return [json.loads(line) for line in lines]


def _ray_run(tmp_path, name: str, *, workers: int = 2, raise_errors: bool = True, **config) -> tuple[Any, str]:
    import lightning_jobs
    from conftest import RUN_TIMEOUT_S, TRAIN_RESOURCE

    from ray_checkfreq.chaos.harness import TrainJob, fit_job

    work_dir = str(tmp_path / name)
    os.makedirs(work_dir)
    job = TrainJob(train=lightning_jobs.train_ray, config={"work_dir": work_dir, **config},
                   name=f"lightning-{name}-{uuid.uuid4().hex[:6]}", storage_path=str(tmp_path / "results"),
                   workers=workers, resources_per_worker={"CPU": 1, TRAIN_RESOURCE: 1},
                   max_failures=2 if raise_errors else 0, timeout_s=RUN_TIMEOUT_S)
    return fit_job(job, raise_errors=raise_errors), work_dir


@pytest.mark.chaos
def test_ray_train_sigkill_resumes_exactly(tmp_path, ray_session):
    """TorchTrainer, 2 workers, RayDDPStrategy + RayLightningEnvironment + prepare_trainer,
    RayTrainReportCallback beside ours and Ray's get_checkpoint() resume: rank 1 is SIGKILLed
    after step 17 (mid-epoch, a validation at step 15); the restarted group resumes at the
    iteration its checkpoint says and ends bit-identical to an uninterrupted run.

    Then a run on 1 worker restarts from the uninterrupted run's storage (the issue: from 2
    workers on 1, the run went on silently with Lightning's per-rank counters of 2 workers,
    the lr jumped and the validations moved): refused at restore, by name."""
    from ray_checkfreq import CheckpointStore

    storage = str(tmp_path / "full-store")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        full, full_dir = _ray_run(tmp_path, "full", storage=storage)
        killed, killed_dir = _ray_run(tmp_path, "killed", kill_at=17)
        refused, one_dir = _ray_run(tmp_path, "one", workers=1, raise_errors=False, storage=storage)
    assert os.path.exists(os.path.join(killed_dir, "killed"))
    for rank in (0, 1):
        lines = _lines(killed_dir, rank)
        starts = [e["restored"] for e in lines if e["event"] == "start"]
        firsts = [e["global_step"] for e in lines if e["event"] == "first_batch"]
        assert starts[0] == 0 and 0 < starts[1] <= 17 and firsts == starts, lines
        restored = starts[1]
        full_end = [e for e in _lines(full_dir, rank) if e["event"] == "end"]
        killed_end = [e for e in lines if e["event"] == "end"]
        assert killed_end[0]["global_step"] == full_end[0]["global_step"] == 40
        assert killed_end[0]["validations"] == [v for v in full_end[0]["validations"] if v[0] > restored]
    assert_identical(torch.load(os.path.join(killed_dir, "final.pt"), weights_only=True),
                     torch.load(os.path.join(full_dir, "final.pt"), weights_only=True))
    assert "val_loss" in killed.metrics and "val_loss" in full.metrics
    assert CheckpointStore(storage).latest().step == 40
    assert isinstance(refused, Exception)
    assert "CheckFreqLightningCallback" in str(refused) and "written by 2 workers and this run has 1" in str(refused)
    assert not os.path.exists(os.path.join(one_dir, "log-0.jsonl"))  # refused at restore: training never began
