"""The training function of the goodput replay (``bench goodput --replay``): one variant
per ``fit()``, trained until the driver asks it to stop.

The job: an MLP with Adam (``width`` x ``layers``), DDP over gloo, the global batch fixed
(each of W ranks trains ``global_batch / W`` rows), elastic, each step padded by ``sleep_s``
(the compute of a real step, which this machine's two cores cannot spend). Variants:
- ``ours``: ``ray_checkfreq.ray.CheckFreq`` with the policy (``overhead``);
- ``epoch``: Ray Train's ``report(checkpoint=)`` once an epoch (``epoch_len``), SYNC, as
  Ray's examples write it: rank 0 ``torch.save``s model, optimizer and iteration into a temp
  dir; a restart resumes from ``ray.train.get_checkpoint()``;
- ``sync`` / ``async``: the same every ``every`` iterations, SYNC or ASYNC upload;
- ``none``: no checkpoint; a restart begins at 0.

Rank 0 appends JSON lines to ``<log_dir>/log.jsonl`` (each with wall time ``t``): ``entered``
(the worker process reached the training function), ``start`` (the iteration it resumed
at, world size, node), ``step`` (each iteration, with ``ckpt_s``: the
seconds its checkpoint call took; ours: each ``K_EVERY`` iterations, the policy's ``k``)
and ``end``. Every ``STOP_EVERY`` iterations the ranks agree (an all-reduce) whether the
driver's stop file exists, and stop together. Every rank appends to ``workers.jsonl`` where
it runs as it enters, and once restored its timeline (entered, set-up begun, restore
begun, done): a restart waits for its slowest rank.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import time
from typing import Any

import torch
import torch.distributed as dist

VARIANTS = ("ours", "epoch", "sync", "async", "none")
STOP_EVERY = 5
K_EVERY = 10  # ours: the policy's k logged every this many iterations
STATE_FILE = "state.pt"
LOG_NAME = "log.jsonl"
WORKERS_NAME = "workers.jsonl"


def mlp(width: int, layers: int) -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(*(torch.nn.Linear(width, width) for _ in range(layers)))


class _Log:
    def __init__(self, log_dir: str, rank: int) -> None:
        self.path = os.path.join(log_dir, LOG_NAME) if rank == 0 else None

    def __call__(self, event: str, **fields: Any) -> None:
        if self.path is None:
            return
        with open(self.path, "a") as out:
            out.write(json.dumps({"t": time.time(), "event": event, **fields}) + "\n")


def train(config: dict) -> None:
    import ray
    import ray.train
    import ray.train.torch

    entered = time.time()
    torch.set_num_threads(1)
    context = ray.train.get_context()
    rank, world = context.get_world_rank(), context.get_world_size()
    log = _Log(config["log_dir"], rank)
    log("entered", pid=os.getpid())
    _note_worker(config["log_dir"], rank, ray.get_runtime_context().get_node_id())
    model = ray.train.torch.prepare_model(mlp(config["width"], config["layers"]))
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-4)
    rows = max(1, config["global_batch"] // world)
    generator = torch.Generator().manual_seed(1 + rank)
    inputs = torch.randn(rows, config["width"], generator=generator)
    targets = torch.randn(rows, config["width"], generator=generator)
    variant = config["variant"]
    set_up_begin = time.time()
    checkpoint, iteration = _setup(variant, config, model, optimizer)
    started = time.time()
    log("start", iteration=iteration, world=world, node=ray.get_runtime_context().get_node_id())
    _note_worker(config["log_dir"], rank, ray.get_runtime_context().get_node_id(), t_entered=entered,
                 t_set_up_begin=set_up_begin, t_restoring=getattr(checkpoint, "restoring", set_up_begin),
                 t_start=started)
    while True:
        loss = torch.nn.functional.mse_loss(model(inputs), targets)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        time.sleep(config["sleep_s"])  # the rest of a real step's compute
        iteration += 1
        started = time.perf_counter()
        checkpoint(iteration)
        took = round(time.perf_counter() - started, 5)
        k = checkpoint.k() if variant == "ours" and rank == 0 and iteration % K_EVERY == 0 else None
        log("step", iteration=iteration, ckpt_s=took, **({} if k is None else {"k": k}))  # k read after the timing
        if iteration % STOP_EVERY == 0 and _agree_to_stop(config["stop_file"], rank):
            break
    if variant == "ours":
        checkpoint.close()
    log("end", iteration=iteration)


def _setup(variant: str, config: dict, model: Any, optimizer: Any) -> tuple[Any, int]:
    """(a callable run after every iteration, the iteration to resume at)."""
    if variant == "ours":
        from ray_checkfreq.ray import CheckFreq

        cf = CheckFreq(model=model, optimizer=optimizer, overhead=config["overhead"], epoch_len=config["epoch_len"])
        restoring = time.time()
        start = cf.restore()

        class _Ours:
            def __init__(self) -> None:
                self.restoring = restoring  # CheckFreq() is the set-up, restore() the restore

            def __call__(self, iteration: int) -> None:
                cf.step()

            def close(self) -> None:
                cf.close()

            def k(self) -> int | None:
                """The policy's k (None before it decides)."""
                k = cf.stats()["k"]
                return None if k is None else int(k)

        return _Ours(), start
    if variant == "none":
        return (lambda iteration: None), 0
    every = config["epoch_len"] if variant == "epoch" else config["every"]
    mode = "ASYNC" if variant == "async" else "SYNC"
    return (lambda iteration: _report(model, optimizer, iteration, every, mode)), _ray_restore(model, optimizer)


def _note_worker(log_dir: str, rank: int, node: str, **times: float) -> None:
    """Every rank: where it runs (the driver takes nodes that run a worker), then, once
    restored, when it entered, began its set-up, its restore, and was done."""
    with open(os.path.join(log_dir, WORKERS_NAME), "a") as out:
        out.write(json.dumps({"t": time.time(), "rank": rank, "node": node, **times}) + "\n")


def _report(model: Any, optimizer: Any, iteration: int, every: int, mode_name: str) -> None:
    import ray.train
    from ray.train import Checkpoint, CheckpointUploadMode

    if iteration % every:
        return
    mode = getattr(CheckpointUploadMode, mode_name)
    if dist.get_rank() != 0:
        ray.train.report({"iteration": iteration}, checkpoint_upload_mode=mode)
        return
    directory = tempfile.mkdtemp(prefix="rcf-goodput-")
    torch.save({"model": _unwrapped(model).state_dict(), "optimizer": optimizer.state_dict(),
                "iteration": iteration}, os.path.join(directory, STATE_FILE))
    ray.train.report({"iteration": iteration}, checkpoint=Checkpoint.from_directory(directory),
                     checkpoint_upload_mode=mode)
    if mode == CheckpointUploadMode.SYNC:
        shutil.rmtree(directory, ignore_errors=True)  # ASYNC removes its own after the upload


def _ray_restore(model: Any, optimizer: Any) -> int:
    import ray.train

    checkpoint = ray.train.get_checkpoint()
    if checkpoint is None:
        return 0
    with checkpoint.as_directory() as directory:
        state = torch.load(os.path.join(directory, STATE_FILE), weights_only=True)
    _unwrapped(model).load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])
    return int(state["iteration"])


def _unwrapped(model: Any) -> Any:
    return model.module if isinstance(model, torch.nn.parallel.DistributedDataParallel) else model


def _agree_to_stop(stop_file: str, rank: int) -> bool:
    flag = torch.tensor([1.0 if rank == 0 and os.path.exists(stop_file) else 0.0])
    if dist.is_initialized():
        dist.all_reduce(flag)
    return bool(flag.item() > 0)
