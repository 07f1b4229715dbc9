"""The Hugging Face Trainer job of the integration tests: a tiny GPT-2 built from a config.

One function builds the Trainer the same way in one process and in a Ray Train worker.
Each attempt logs JSON lines to ``work_dir/log-<rank>.jsonl``: where it began (the
iteration ray_checkfreq restored, the Trainer's global step at its first step), the sample
ids of every batch, the steps the Trainer evaluated at, and a random number drawn at each
epoch's end, and the learning rate of every optimizer step. Rank 0 saves the final model
and optimizer state and the log history to ``work_dir/final.pt``. ``crash_at``: the first
attempt SIGKILLs a rank after that optimizer step (once per test: a marker file);
``stop_at``: the Trainer stops after that step (its end: the checkpoint made durable).

    python hf_jobs.py WORK_DIR STORAGE [CRASH_AT]     # one process, outside Ray
"""

from __future__ import annotations

import json
import os
import signal
import sys
from typing import Any

import torch
from ray_train_jobs import log, once  # tests/ is on sys.path

SEQUENCE, VOCAB = 8, 64
TRAIN_SAMPLES = 60  # 1 rank: 15 batches of 4 an epoch, so the last of 8 optimizer steps takes one batch
EPOCHS = 3
EVAL_IDS = 1000  # the evaluation samples' ids start here


class Tokens(torch.utils.data.Dataset):
    """Random token sequences, each with its id (the collator logs and drops it)."""

    def __init__(self, count: int, seed: int, first: int = 0) -> None:
        self.first = first
        self.ids = torch.randint(0, VOCAB, (count, SEQUENCE), generator=torch.Generator().manual_seed(seed))

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, index: int) -> dict:
        return {"input_ids": self.ids[index], "labels": self.ids[index], "sample": self.first + index}


def tiny_gpt2() -> torch.nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    config = GPT2Config(vocab_size=VOCAB, n_positions=SEQUENCE, n_embd=32, n_layer=1, n_head=2,
                        resid_pdrop=0.1, embd_pdrop=0.1, attn_pdrop=0.1)  # dropout: the RNG must resume too
    return GPT2LMHeadModel(config)


def build_trainer(*, work_dir: str, rank: int, storage: str | None, crash_at: int | None = None,
                  stop_at: int | None = None, every: int = 2, gradient_accumulation: int = 2,
                  ray_reporting: bool = False) -> Any:
    from transformers import Trainer, TrainerCallback, TrainingArguments

    from ray_checkfreq.integrations.transformers import CheckFreqTrainerCallback

    def collate(features: list[dict]) -> dict:
        ids = [f["sample"] for f in features]
        log(work_dir, rank, event="eval_batch" if ids[0] >= EVAL_IDS else "batch", ids=ids)
        return {key: torch.stack([f[key] for f in features]) for key in ("input_ids", "labels")}

    class Watch(TrainerCallback):
        """Logs where the attempt began and each evaluation; the fault."""

        first = True

        def on_step_begin(self, args, state, control, **kwargs):
            if self.first:
                self.first = False
                log(work_dir, rank, event="first_step", global_step=state.global_step, epoch=state.epoch,
                    restored=checkfreq.checkfreq.restore_info if hasattr(checkfreq.checkfreq, "restore_info")
                    else None, iteration=checkfreq.checkfreq.iteration)

        def on_epoch_end(self, args, state, control, **kwargs):
            # A user's callback that draws the RNG between two steps (after the epoch's last
            # checkpoint was taken, before the next batch): the checkpoint must hold the RNG after it.
            log(work_dir, rank, event="draw", global_step=state.global_step, value=torch.rand(1).item())

        def on_evaluate(self, args, state, control, metrics=None, **kwargs):
            log(work_dir, rank, event="eval", global_step=state.global_step, epoch=state.epoch,
                loss=metrics["eval_loss"])

        def on_optimizer_step(self, args, state, control, optimizer=None, **kwargs):
            # The learning rate this optimizer step used (the scheduler steps after it).
            log(work_dir, rank, event="lr", global_step=state.global_step + 1, lr=optimizer.param_groups[0]["lr"])

        def on_step_end(self, args, state, control, **kwargs):
            if stop_at is not None and state.global_step == stop_at:
                control.should_training_stop = True
            if crash_at is not None and state.global_step == crash_at and rank == min(1, args.world_size - 1) \
                    and once(work_dir, "crash"):
                log(work_dir, rank, event="crash", global_step=state.global_step)
                os.kill(os.getpid(), signal.SIGKILL)

    args = TrainingArguments(
        output_dir=os.path.join(work_dir, "hf"), per_device_train_batch_size=4,
        gradient_accumulation_steps=gradient_accumulation, num_train_epochs=EPOCHS, learning_rate=3e-3,
        lr_scheduler_type="linear", logging_steps=3, eval_strategy="epoch", per_device_eval_batch_size=8,
        save_strategy="steps" if ray_reporting else "no", save_steps=4, report_to=[], seed=0, use_cpu=True,
        dataloader_num_workers=0, remove_unused_columns=False, disable_tqdm=True)
    checkfreq = CheckFreqTrainerCallback(storage=storage, every=every, compress=False)
    callbacks: list[Any] = [checkfreq, Watch()]
    if ray_reporting:
        from ray.train.huggingface.transformers import RayTrainReportCallback

        callbacks.append(RayTrainReportCallback())
    trainer = Trainer(model=tiny_gpt2(), args=args, train_dataset=Tokens(TRAIN_SAMPLES, seed=1),
                      eval_dataset=Tokens(16, seed=2, first=EVAL_IDS), data_collator=collate, callbacks=callbacks)
    return trainer


def save_final(trainer: Any, work_dir: str) -> None:
    torch.save({"model": trainer.model.state_dict(), "optimizer": trainer.optimizer.optimizer.state_dict(),
                "global_step": trainer.state.global_step, "log_history": json.dumps(trainer.state.log_history)},
               os.path.join(work_dir, "final.pt"))


def train_func(config: dict) -> None:
    """The Ray Train worker: Ray's documented pattern (prepare_trainer, and, where the config
    asks, RayTrainReportCallback with a get_checkpoint() resume) plus the callback."""
    import ray.train
    from ray.train.huggingface.transformers import prepare_trainer

    work_dir = config["work_dir"]
    rank = ray.train.get_context().get_world_rank()
    trainer = prepare_trainer(build_trainer(work_dir=work_dir, rank=rank, storage=config.get("storage"),
                                            crash_at=config.get("crash_at"), stop_at=config.get("stop_at"),
                                            ray_reporting=config.get("ray_reporting", False)))
    checkpoint = ray.train.get_checkpoint() if config.get("ray_reporting") else None
    if checkpoint is not None:
        with checkpoint.as_directory() as directory:
            trainer.train(resume_from_checkpoint=directory)
    else:
        trainer.train()
    if rank == 0:
        save_final(trainer, work_dir)


def main() -> None:
    work_dir, storage = sys.argv[1], sys.argv[2]
    crash_at = int(sys.argv[3]) if len(sys.argv) > 3 else None
    torch.set_num_threads(1)  # as the test's own process runs it: bit-identity needs one reduction order
    trainer = build_trainer(work_dir=work_dir, rank=0, storage=storage, crash_at=crash_at)
    trainer.train()
    save_final(trainer, work_dir)


if __name__ == "__main__":
    main()
