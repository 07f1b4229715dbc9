"""The Hugging Face Trainer callback: a SIGKILLed run resumes bit-identical, where its checkpoint says.

The job (``hf_jobs.py``): a tiny GPT-2 from a config, with dropout, a linear schedule,
gradient accumulation 2 over 15 batches an epoch (so the last optimizer step of an epoch
takes one batch), evaluation at each epoch's end, 3 epochs, 24 optimizer steps.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import uuid

import hf_jobs  # tests/ is on sys.path
import pytest
import torch

from ray_checkfreq import CheckpointStore

TESTS = os.path.dirname(os.path.abspath(__file__))
STEPS_PER_EPOCH, BATCHES_PER_EPOCH = 8, 15  # one rank: 7 steps of 2 batches, then 1 of 1


def events(work_dir: str, kind: str, rank: int = 0) -> list[dict]:
    with open(os.path.join(work_dir, f"log-{rank}.jsonl")) as lines:
        return [e for e in map(json.loads, lines) if e["event"] == kind]


def attempts(work_dir: str, rank: int = 0) -> list[list[dict]]:
    """The log of each attempt (a new attempt starts with its first training batch after a crash)."""
    found: list[list[dict]] = [[]]
    with open(os.path.join(work_dir, f"log-{rank}.jsonl")) as lines:
        for entry in map(json.loads, lines):
            found[-1].append(entry)
            if entry["event"] == "crash":
                found.append([])
    return found


def batches_before_step(step: int) -> int:
    """Training batches one rank took before optimizer step ``step`` (1 rank)."""
    epochs, steps = divmod(step, STEPS_PER_EPOCH)
    return epochs * BATCHES_PER_EPOCH + steps * 2


def run_in_process(work_dir: str, storage: str) -> dict:
    trainer = hf_jobs.build_trainer(work_dir=work_dir, rank=0, storage=storage)
    trainer.train()
    hf_jobs.save_final(trainer, work_dir)
    return torch.load(os.path.join(work_dir, "final.pt"), weights_only=True)


def crash_in_a_process(work_dir: str, storage: str, crash_at: int) -> int:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([TESTS, os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, os.path.join(TESTS, "hf_jobs.py"), work_dir, storage, str(crash_at)],
                          env=env, capture_output=True, text=True, timeout=300)
    return done.returncode


def assert_same_state(a: dict, b: dict, context: str = "") -> None:
    assert a["global_step"] == b["global_step"] == 3 * STEPS_PER_EPOCH  # no extra epoch
    differing = [key for key in a["model"] if not torch.equal(a["model"][key], b["model"][key])]
    if differing:
        first = differing[0]
        gap = (a["model"][first] - b["model"][first]).abs().max()
        raise AssertionError(f"{context}: {len(differing)} of {len(a['model'])} model tensors differ, "
                             f"first {first} by up to {gap}")
    for index, slots in a["optimizer"]["state"].items():
        for name, value in slots.items():
            assert torch.equal(torch.as_tensor(value), torch.as_tensor(b["optimizer"]["state"][index][name])), \
                f"optimizer state {index}.{name} differs"


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Every run of this module on one intra-op thread (the SIGKILLed child pins it too): a
    parallel reduction's order may depend on how many threads a loaded machine gives it."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def reference(one_thread, tmp_path_factory) -> tuple[str, dict]:
    work_dir = str(tmp_path_factory.mktemp("hf-reference"))
    return work_dir, run_in_process(work_dir, os.path.join(work_dir, "store"))


def test_a_sigkilled_trainer_resumes_bit_identical_at_its_checkpoint(reference, tmp_path, capsys):
    reference_dir, expected = reference
    work_dir, storage = str(tmp_path), str(tmp_path / "store")
    assert crash_in_a_process(work_dir, storage, crash_at=13) == -9  # SIGKILL, after step 13 (epoch 2 of 3)
    checkpoint = CheckpointStore(storage).latest()
    assert checkpoint is not None and 0 < checkpoint.step <= 13

    capsys.readouterr()
    resumed = run_in_process(work_dir, storage)
    # A plain script shows that it resumed (INFO logs it does not show).
    assert [line for line in capsys.readouterr().out.splitlines() if line.startswith("ray_checkfreq:")] == \
        [f"ray_checkfreq: CheckFreqTrainerCallback resumed at step {checkpoint.step} of {3 * STEPS_PER_EPOCH} "
         f"(epoch {checkpoint.step // STEPS_PER_EPOCH}, "
         f"batch {batches_before_step(checkpoint.step) % BATCHES_PER_EPOCH} of it; iteration {checkpoint.step})"]

    assert_same_state(expected, resumed, f"resumed at step {checkpoint.step}")
    first, second = attempts(work_dir)
    began = [e for e in second if e["event"] == "first_step"][0]
    assert began["global_step"] == checkpoint.step  # the resumed attempt began where its checkpoint says
    assert began["epoch"] == pytest.approx(batches_before_step(checkpoint.step) / BATCHES_PER_EPOCH)
    # Every sample once, in the uninterrupted run's order: the first attempt's batches up to the
    # checkpoint, then the resumed attempt's from the next one.
    reference_batches = [e["ids"] for e in events(reference_dir, "batch")]
    kept = batches_before_step(checkpoint.step)
    assert [e["ids"] for e in first if e["event"] == "batch"][:kept] == reference_batches[:kept]
    assert [e["ids"] for e in second if e["event"] == "batch"] == reference_batches[kept:]
    # A draw from the RNG between steps (a user's callback at each epoch's end) resumes too.
    drawn = [(e["global_step"], e["value"]) for e in second if e["event"] == "draw"]
    assert drawn == [(e["global_step"], e["value"]) for e in events(reference_dir, "draw")
                     if e["global_step"] > checkpoint.step]
    # Evaluation at the same steps with the same results, and the same logged epochs and FLOPs.
    evaluated = [(e["global_step"], e["loss"]) for e in events(work_dir, "eval")]
    assert evaluated == [(e["global_step"], e["loss"]) for e in events(reference_dir, "eval")]
    history, expected_history = json.loads(resumed["log_history"]), json.loads(expected["log_history"])
    assert [(h["step"], h["epoch"]) for h in history] == [(h["step"], h["epoch"]) for h in expected_history]
    assert history[-1]["total_flos"] == expected_history[-1]["total_flos"]
    # Steps/s of the resumed attempt count its own steps (the Trainer's train() metrics).
    steps_run = history[-1]["train_steps_per_second"] * history[-1]["train_runtime"]
    assert abs(steps_run - (3 * STEPS_PER_EPOCH - checkpoint.step)) < 0.5


def test_a_resume_from_checkpoint_argument_is_ignored_with_a_warning(tmp_path, caplog):
    """Ray's documented resume hands the Trainer ray.train.get_checkpoint()'s directory: a
    ray_checkfreq pointer has no Trainer checkpoint in it (it crash-looped every retry)."""
    trainer = hf_jobs.build_trainer(work_dir=str(tmp_path), rank=0, storage=str(tmp_path / "store"))
    pointer = tmp_path / f"checkfreq-pointer-{uuid.uuid4().hex[:8]}" / "checkpoint"
    with caplog.at_level(logging.WARNING, logger="ray_checkfreq.integrations"):
        trainer.train(resume_from_checkpoint=str(pointer))
    assert trainer.state.global_step == 3 * STEPS_PER_EPOCH
    assert any("resume_from_checkpoint" in r.getMessage() and "ray_checkfreq" in r.getMessage()
               for r in caplog.records)


def test_a_callback_added_after_the_trainer_was_built_fails_by_name(tmp_path):
    from transformers import Trainer

    from ray_checkfreq.integrations.transformers import CheckFreqTrainerCallback

    built = hf_jobs.build_trainer(work_dir=str(tmp_path), rank=0, storage=str(tmp_path / "store"))
    trainer = Trainer(model=built.model, args=built.args, train_dataset=built.train_dataset,
                      eval_dataset=built.eval_dataset, data_collator=built.data_collator)
    trainer.add_callback(CheckFreqTrainerCallback(storage=str(tmp_path / "late")))
    with pytest.raises(RuntimeError, match=r"Trainer\(callbacks=\[\.\.\.\]\)"):
        trainer.train()


def test_outside_ray_train_storage_is_required(tmp_path):
    trainer = hf_jobs.build_trainer(work_dir=str(tmp_path), rank=0, storage=None)
    with pytest.raises(ValueError, match="storage="):
        trainer.train()


def test_several_processes_outside_ray_train_fail_by_name(tmp_path, monkeypatch):
    """The engine outside Ray Train is one process: several (torchrun) would be several writers."""
    from transformers import TrainingArguments

    trainer = hf_jobs.build_trainer(work_dir=str(tmp_path), rank=0, storage=str(tmp_path / "store"))
    monkeypatch.setattr(TrainingArguments, "world_size", property(lambda self: 2))
    with pytest.raises(RuntimeError, match="with 2 processes outside Ray Train"):
        trainer.callback_handler.on_train_begin(trainer.args, trainer.state, trainer.control)


def test_an_unknown_transformers_version_fails_by_name(monkeypatch):
    import transformers

    from ray_checkfreq.integrations.transformers import CheckFreqTrainerCallback

    monkeypatch.setattr(transformers, "__version__", "4.46.3")
    with pytest.raises(RuntimeError, match=r"transformers 4\.46\.3"):
        CheckFreqTrainerCallback(storage="unused")


def test_the_optimizer_under_accelerates_wrapper_is_the_one_checkpointed():
    """accelerate's AcceleratedOptimizer subclasses Optimizer without its hooks: handed to
    CheckFreq as it is, it failed with "no attribute '_optimizer_step_pre_hooks'"."""
    from accelerate.optimizer import AcceleratedOptimizer

    from ray_checkfreq.integrations._common import unwrap_optimizer

    inner = torch.optim.SGD(torch.nn.Linear(2, 2).parameters(), lr=0.1)
    assert unwrap_optimizer(AcceleratedOptimizer(inner, device_placement=False)) is inner
    assert unwrap_optimizer(inner) is inner
    with pytest.raises(TypeError, match="dict: not a torch.optim.Optimizer"):
        unwrap_optimizer({})


@pytest.mark.chaos
def test_on_ray_train_a_killed_rank_resumes_bit_identical_with_rays_documented_pattern(ray_cluster, tmp_path):
    """Ray's guide: prepare_trainer, RayTrainReportCallback (the Trainer's checkpoints reported
    beside ray_checkfreq's pointers) and a get_checkpoint() resume, which used to crash-loop on
    the pointer. Rank 1 is SIGKILLed after step 5 (2 ranks: 4 steps an epoch, 12 in all)."""
    from conftest import RUN_TIMEOUT_S
    from test_ray_train import TRAIN_RESOURCE, assert_nothing_left

    from ray_checkfreq.chaos.harness import TrainJob, fit_job

    def fit(name: str, **config) -> tuple[object, str]:
        work_dir = str(tmp_path / name)
        os.makedirs(work_dir)
        run_name = f"hf-{name}-{uuid.uuid4().hex[:6]}"
        result = fit_job(TrainJob(train=hf_jobs.train_func, config={"work_dir": work_dir, "ray_reporting": True,
                                                                   **config},
                                  name=run_name, storage_path=str(tmp_path / "results"), workers=2,
                                  resources_per_worker={"CPU": 1, TRAIN_RESOURCE: 1}, max_failures=2,
                                  timeout_s=RUN_TIMEOUT_S))
        assert_nothing_left(run_name)
        return result, work_dir

    reference, reference_dir = fit("reference")
    killed, work_dir = fit("killed", crash_at=5)
    expected = torch.load(os.path.join(reference_dir, "final.pt"), weights_only=True)
    resumed = torch.load(os.path.join(work_dir, "final.pt"), weights_only=True)
    for key in expected["model"]:
        assert torch.equal(expected["model"][key], resumed["model"][key]), f"model {key} differs"
    assert expected["global_step"] == resumed["global_step"] == 12
    assert [e["global_step"] for e in events(work_dir, "crash", rank=1)] == [5]
    for rank in (0, 1):
        began = events(work_dir, "first_step", rank=rank)
        assert [b["global_step"] for b in began][0] == 0 and len(began) == 2
        restored = began[1]["restored"]
        # The restarted attempt began at the step its restore says, from RAM or storage.
        assert 0 < began[1]["global_step"] == began[1]["iteration"] <= 5 and restored["kind"] != "none"
    assert [(e["global_step"], e["loss"]) for e in events(work_dir, "eval")][-1] == \
        [(e["global_step"], e["loss"]) for e in events(reference_dir, "eval")][-1]
    for result in (reference, killed):  # the Trainer's evaluation reaches Result.metrics
        assert result.metrics["eval_loss"] == events(reference_dir, "eval")[-1]["loss"]


@pytest.mark.chaos
def test_restarted_from_2_workers_on_1_the_schedule_continues_as_a_run_on_1_worker(reference, ray_cluster, tmp_path):
    """The issue: restarted on 1 worker from 2, the scheduler kept the 2-worker step count under
    the 1-worker total (the lr jumped, and the run ended at 0.00102 instead of about 0). On 2
    workers (4 steps an epoch, 12 in all) the Trainer stops after step 6 (epoch 1, its sample
    32); a new run on 1 worker (8 steps an epoch, 24 in all) resumes from that storage at step
    12, where a run on 1 worker has seen the same samples, and every step after it has the
    lr, the batch and the evaluations of the uninterrupted run on 1 worker."""
    from conftest import RUN_TIMEOUT_S
    from test_ray_train import TRAIN_RESOURCE

    from ray_checkfreq.chaos.harness import TrainJob, fit_job

    reference_dir, _ = reference
    storage = str(tmp_path / "store")

    def fit(name: str, workers: int, **config) -> str:
        work_dir = str(tmp_path / name)
        os.makedirs(work_dir)
        fit_job(TrainJob(train=hf_jobs.train_func, config={"work_dir": work_dir, "storage": storage, **config},
                         name=f"hf-{name}-{uuid.uuid4().hex[:6]}", storage_path=str(tmp_path / "results"),
                         workers=workers, resources_per_worker={"CPU": 1, TRAIN_RESOURCE: 1},
                         timeout_s=RUN_TIMEOUT_S))
        return work_dir

    fit("two", 2, stop_at=6)
    assert CheckpointStore(storage).latest().step == 6
    work_dir = fit("one", 1)

    began = events(work_dir, "first_step")[0]
    assert (began["iteration"], began["global_step"]) == (6, 12)  # 6 of 12 steps on 2 workers: 12 of 24 on 1
    expected_lr = [(e["global_step"], e["lr"]) for e in events(reference_dir, "lr") if e["global_step"] > 12]
    assert [(e["global_step"], e["lr"]) for e in events(work_dir, "lr")] == expected_lr
    assert expected_lr[-1][0] == 3 * STEPS_PER_EPOCH and expected_lr[-1][1] < 1.5e-4  # the schedule's end
    kept = batches_before_step(12)  # the same samples before that step, on 1 worker
    assert [e["ids"] for e in events(work_dir, "batch")] == [e["ids"] for e in events(reference_dir, "batch")][kept:]
    assert [e["global_step"] for e in events(work_dir, "eval")] == \
        [e["global_step"] for e in events(reference_dir, "eval") if e["global_step"] > 12]
