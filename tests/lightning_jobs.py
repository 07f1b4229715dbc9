"""The Lightning runs the integration tests make: a tiny float64 MLP with dropout, a StepLR,
validation and the training's start drawing the global RNG, and callbacks that record, crash
and SIGKILL.

``train_ray`` is the Ray Train worker function (Ray's Lightning guide: RayDDPStrategy,
RayLightningEnvironment, prepare_trainer, RayTrainReportCallback and its
``get_checkpoint()`` resume) plus ``CheckFreqLightningCallback``. Each rank logs JSON lines
to ``work_dir/log-<rank>.jsonl``; rank 0 saves the final weights to ``work_dir/final.pt``.
"""

from __future__ import annotations

import json
import os
import signal
from typing import Any

import lightning.pytorch as pl
import torch
from torch.utils.data import DataLoader, TensorDataset


class SimulatedCrash(RuntimeError):
    """Raised by ``Crash`` in place of a process dying."""


def dataset(num: int, *, seed: int) -> TensorDataset:
    """Features, labels and each sample's own index (to check every sample once per epoch)."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(num, 6, generator=gen, dtype=torch.float64)
    return TensorDataset(x, (x[:, 0] > 0).long() + (x[:, 1] > 0).long(), torch.arange(num))


class TinyModule(pl.LightningModule):
    def __init__(self, *, train_samples: int = 40, batch_size: int = 4) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.ReLU(), torch.nn.Dropout(0.3),
                                       torch.nn.Linear(16, 3)).double()
        self.train_samples, self.batch_size = train_samples, batch_size

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y, _ = batch
        loss = torch.nn.functional.cross_entropy(self.net(x), y)
        self.log("train_loss", loss)
        return loss

    def on_train_start(self) -> None:
        # The global RNG as training starts: a resumed fit runs it again after the restore,
        # before its first batch, and the restored RNG states must be set again after it.
        self.start_noise = float(torch.rand(()))

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, y, _ = batch
        noise = torch.rand((), dtype=torch.float64)  # the global RNG, between two training steps
        self.log("val_loss", torch.nn.functional.cross_entropy(self.net(x), y), sync_dist=True)
        self.log("val_noise", noise)

    def configure_optimizers(self) -> Any:
        optimizer = torch.optim.Adam(self.parameters(), lr=1e-2)
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=4, gamma=0.7)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

    def train_dataloader(self) -> DataLoader:
        return DataLoader(dataset(self.train_samples, seed=0), batch_size=self.batch_size, shuffle=True)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(dataset(12, seed=1), batch_size=6, shuffle=True)


class Recorder(pl.Callback):
    """Every batch (global step before it, epoch, index, sample ids) and every validation
    (global step, its RNG draw); with ``path``, also as JSON lines."""

    def __init__(self, path: str | None = None, checkfreq: Any = None) -> None:
        self.batches: list[tuple[int, int, int, list[int]]] = []
        self.validations: list[tuple[int, float]] = []
        self.path, self.checkfreq = path, checkfreq

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        if self.checkfreq is not None:
            self._log(event="start", restored=self.checkfreq.restored_iteration)

    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
        entry = (trainer.global_step, trainer.current_epoch, batch_idx, batch[2].tolist())
        if not self.batches:
            self._log(event="first_batch", global_step=entry[0], epoch=entry[1], batch_idx=entry[2])
        self.batches.append(entry)

    def on_validation_end(self, trainer: Any, pl_module: Any) -> None:
        if not trainer.sanity_checking:
            self.validations.append((trainer.global_step, float(trainer.callback_metrics["val_noise"])))

    def _log(self, **event: Any) -> None:
        if self.path is not None:
            with open(self.path, "a") as out:
                out.write(json.dumps(event) + "\n")


class Crash(pl.Callback):
    """Raises ``SimulatedCrash`` right after optimizer step ``at``."""

    def __init__(self, at: int) -> None:
        self.at = at

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        if trainer.global_step == self.at:
            raise SimulatedCrash(f"crash after step {self.at}")


class Kill(pl.Callback):
    """SIGKILLs this process after optimizer step ``at`` on ``rank``, once per test (a marker file)."""

    def __init__(self, *, at: int | None, rank: int, marker: str) -> None:
        self.at, self.rank, self.marker = at, rank, marker

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        if self.at is None or trainer.global_step != self.at or trainer.global_rank != self.rank:
            return
        try:
            os.close(os.open(self.marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
        except FileExistsError:
            return
        os.kill(os.getpid(), signal.SIGKILL)


def train_ray(config: dict) -> None:
    """Ray's Lightning guide plus the callback: 2 ranks of 8 samples per batch over 160
    samples, 10 steps an epoch, 4 epochs (``max_epochs`` in the config); checkpoints in the
    run's storage, or in ``storage`` where the config gives one."""
    import ray.train
    from ray.train.lightning import RayDDPStrategy, RayLightningEnvironment, RayTrainReportCallback, prepare_trainer

    from ray_checkfreq.integrations.lightning import CheckFreqLightningCallback

    work_dir = config["work_dir"]
    rank = ray.train.get_context().get_world_rank()
    checkfreq = CheckFreqLightningCallback(storage=config.get("storage"), every=3)
    recorder = Recorder(os.path.join(work_dir, f"log-{rank}.jsonl"), checkfreq)
    trainer = pl.Trainer(max_epochs=config.get("max_epochs", 4), devices="auto", accelerator="cpu",
                         strategy=RayDDPStrategy(),
                         plugins=[RayLightningEnvironment()], val_check_interval=0.5, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         callbacks=[RayTrainReportCallback(), checkfreq, recorder,
                                    Kill(at=config.get("kill_at"), rank=1,
                                         marker=os.path.join(work_dir, "killed"))])
    trainer = prepare_trainer(trainer)
    model = TinyModule(train_samples=160, batch_size=8)
    checkpoint = ray.train.get_checkpoint()
    if checkpoint:
        with checkpoint.as_directory() as ckpt_dir:
            trainer.fit(model, ckpt_path=os.path.join(ckpt_dir, RayTrainReportCallback.CHECKPOINT_NAME))
    else:
        trainer.fit(model)
    recorder._log(event="end", restored=checkfreq.restored_iteration, global_step=trainer.global_step,
                  validations=recorder.validations)
    if rank == 0:
        torch.save(model.state_dict(), os.path.join(work_dir, "final.pt"))
