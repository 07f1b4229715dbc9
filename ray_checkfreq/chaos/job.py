"""The chaos training job: a small float64 CNN on scikit-learn's digits, in a TorchTrainer.

Every rank appends JSON lines to ``<work_dir>/log-<rank>.jsonl``, each with the wall
time ``t``, the rank and the attempt (the writer generation the attempt's restore took:
every rank of one attempt shares it, a later attempt has a larger one):
- ``start``: the restored iteration, from what (``restore``), world size, node, pid, run;
- ``batch``: the iteration trained and the global sample ids this rank used, written
  after ``optimizer.step()`` and before ``cf.step()`` (a rank stopped inside ``cf.step()``
  by a notice has logged the iteration it checkpointed);
- ``stats`` (rank 0, with ``log_stats``): the engine's figures (k included) after every
  checkpoint interval, so that a killed attempt leaves its figures too;
- ``k`` (rank 0, when the policy picks k): the k in force, each time it changes;
- ``end``: the final iteration and the engine's figures.
Rank 0 saves the final weights to ``<work_dir>/final.pt``.

Config keys: ``work_dir``, ``store_dir``, ``control_dir`` (hold points, see ``holds.py``),
``iterations``, ``every`` (k; ``epoch_len`` for epoch-boundary checkpoints; None: the
engine's policy picks k),
``global_batch``, ``sleep_s`` (pacing, so that the injector can aim), ``notices``
(False: a baseline that does not react to drain notices). Optional: ``compress`` (the
engine's: None measures whether the codec pays; default False), ``store_uri`` and
``s3_endpoint`` (checkpoints on S3 instead of ``store_dir``; no hold points there).
"""

from __future__ import annotations

import json
import os
import time
from typing import Any

import torch

SAMPLES = 1792  # digits: every global batch of 64 is full (28 per epoch)
GLOBAL_BATCH = 64


def digits(samples: int = SAMPLES) -> tuple[torch.Tensor, torch.Tensor]:
    """The first ``samples`` digits as float64 images in [0, 1] (N, 1, 8, 8) and int64 labels."""
    pixels, labels = _digits_table()
    images = torch.tensor(pixels[:samples].reshape(-1, 1, 8, 8), dtype=torch.float64) / 16.0
    return images, torch.tensor(labels[:samples], dtype=torch.int64)


def _digits_table() -> tuple[Any, Any]:
    """scikit-learn's digits file read directly: importing ``sklearn.datasets`` costs 1.6 s
    here, paid by every worker of every attempt. ``load_digits`` where the file moved."""
    import importlib.util

    import numpy as np

    spec = importlib.util.find_spec("sklearn")
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    path = os.path.join(locations[0], "datasets", "data", "digits.csv.gz") if locations else ""
    if not os.path.exists(path):
        from sklearn.datasets import load_digits

        data = load_digits()
        return data.data, data.target
    table = np.loadtxt(path, delimiter=",")
    return table[:, :-1], table[:, -1].astype(np.int64)


def small_cnn() -> torch.nn.Module:
    """Float64, so that a change of world size (a different reduction order) stays within 1e-9."""
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Conv2d(1, 8, 3), torch.nn.ReLU(), torch.nn.Flatten(),
                               torch.nn.Linear(8 * 6 * 6, 10)).double()


def epoch_length(samples: int, global_batch: int) -> int:
    return -(-samples // global_batch)


class EventLog:
    """One rank's JSON lines (appended and flushed line by line: a SIGKILL loses no written line)."""

    def __init__(self, work_dir: str, rank: int) -> None:
        self.path = os.path.join(work_dir, f"log-{rank}.jsonl")
        self.rank = rank
        self.attempt: int | None = None
        self.k: int | None = None  # the k last logged

    def __call__(self, event: str, **fields: Any) -> None:
        line = json.dumps({"t": time.time(), "event": event, "rank": self.rank, "attempt": self.attempt, **fields})
        with open(self.path, "a") as out:
            out.write(line + "\n")


def train(config: dict) -> None:
    """The TorchTrainer training function."""
    import ray.train
    import ray.train.torch

    from ray_checkfreq.chaos.holds import HeldSeal

    context = ray.train.get_context()
    rank, world = context.get_world_rank(), context.get_world_size()
    torch.set_num_threads(1)
    HeldSeal.install(config["control_dir"])
    log = EventLog(config["work_dir"], rank)
    device = ray.train.torch.get_device()
    images, labels = (t.to(device) for t in digits())
    global_batch = config.get("global_batch", GLOBAL_BATCH)
    epoch_len = epoch_length(len(images), global_batch)
    model = ray.train.torch.prepare_model(small_cnn())
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    cf, data = _checkfreq(config, model, optimizer, len(images), global_batch, epoch_len)
    start = cf.restore()
    log.attempt = cf.generation
    log("start", iteration=start, world_size=world, node=cf.node_id, pid=os.getpid(), run=cf.run,
        restore=cf.restore_info, k=config["every"], samples=len(images), global_batch=global_batch,
        epoch_len=epoch_len)
    _train_loop(config, cf, data, model, optimizer, images, labels, log, epoch_len)
    cf.close()
    if rank == 0:
        weights = {k: v.cpu() for k, v in cf.engine.model.state_dict().items()}
        torch.save({"iteration": cf.iteration, "model": weights},
                   os.path.join(config["work_dir"], "final.pt"))
    log("end", iteration=cf.iteration, stats=_plain(cf.stats()))


def _checkfreq(config: dict, model: Any, optimizer: Any, samples: int, global_batch: int,
               epoch_len: int) -> tuple[Any, Any]:
    from ray_checkfreq.data import resumable
    from ray_checkfreq.ray import CheckFreq, RayConfig

    data = resumable(samples, global_batch_size=global_batch, seed=1)
    store = _store(config)
    ray_config = RayConfig(restart_wait_s=config.get("restart_wait_s", 5.0),
                           watch_preemption=config.get("notices", True), registration=None, metrics_every_s=None)
    cf = CheckFreq(model=model, optimizer=optimizer, data=data, storage=store, every=config["every"],
                   epoch_len=epoch_len, compress=config.get("compress", False), ray_config=ray_config)
    return cf, data


def _store(config: dict) -> Any:
    from ray_checkfreq.chaos.holds import holding_filesystem
    from ray_checkfreq.storage import CheckpointStore, S3Options

    if config.get("store_uri"):
        return CheckpointStore(config["store_uri"], s3=S3Options(endpoint_url=config.get("s3_endpoint")))
    return CheckpointStore(config["store_dir"], filesystem=holding_filesystem(config["control_dir"]))


def _train_loop(config: dict, cf: Any, data: Any, model: Any, optimizer: Any, images: torch.Tensor,
                labels: torch.Tensor, log: EventLog, epoch_len: int) -> None:
    total = config["iterations"]
    while cf.iteration < total:
        for indices in data:
            ids = torch.as_tensor(indices)
            loss = torch.nn.functional.cross_entropy(model(images[ids]), labels[ids])
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            iteration = cf.iteration + 1
            log("batch", iteration=iteration, epoch=(iteration - 1) // epoch_len, ids=ids.tolist())
            cf.step()
            if config["every"] is None and log.rank == 0 and cf.engine.applied_k != log.k:
                log.k = cf.engine.applied_k
                log("k", iteration=cf.iteration, k=log.k)
            if config.get("log_stats") and log.rank == 0 and cf.iteration % (config["every"] or log.k or 1) == 0:
                log("stats", iteration=cf.iteration, stats=_plain(cf.engine.stats()))
            if config.get("sleep_s"):
                time.sleep(config["sleep_s"])
            if cf.iteration >= total:
                break


def _plain(stats: dict) -> dict:
    return {k: v for k, v in stats.items() if isinstance(v, (int, float, str, bool, type(None), dict, list))}
