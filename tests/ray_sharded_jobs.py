"""The training function of tests/test_ray_sharded.py: an FSDP2 model (float64, uneven
shards) under ``ray_checkfreq.ray.CheckFreq`` with nothing else changed, its batches from
``ray_checkfreq.data.resumable`` (a fixed global batch of 12 over 120 samples: 10
iterations an epoch), and the same training without checkpoints on spawned gloo ranks
(the reference).

Sample ``i`` is drawn from its own seed, and the global batch is fixed, so a run resumed at
any world size trains on the same global batches. Every rank logs to
``work_dir/log-<rank>.jsonl`` (``ray_train_jobs.log``; each batch with the sample ids it
trained); after the last step (and after each iteration of ``gather_at``) the whole state is
gathered and rank 0 saves it to ``work_dir/final.npz`` (``at-<i>.npz``).
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

import sharded_state_jobs as jobs
import torch
from ray_train_jobs import log, once

SAMPLES = 120
EPOCH_LEN = SAMPLES // jobs.GLOBAL_BATCH


def batches(data, iterations: int, done: int) -> Iterator[list[int]]:
    """The iterator's batches (sample ids) from iteration ``done`` until ``iterations``, across epochs."""
    while done < iterations:
        for indices in data:
            done += 1
            yield [int(i) for i in indices]
            if done >= iterations:
                return


def train_batch(model: torch.nn.Module, optimizer: torch.optim.Optimizer, ids: Sequence[int]) -> None:
    """One step on this rank's samples (each drawn from its own seed)."""
    gens = [torch.Generator().manual_seed(1000 + i) for i in ids]
    x = torch.stack([torch.randn(8, generator=g, dtype=torch.float64) for g in gens])
    y = torch.stack([torch.randn(5, generator=g, dtype=torch.float64) for g in gens])
    loss = torch.nn.functional.mse_loss(model(x), y)
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()


def train(config: dict) -> None:
    import ray.train

    from ray_checkfreq.data import resumable
    from ray_checkfreq.ray import CheckFreq, RayConfig

    torch.set_num_threads(1)
    work_dir = config["work_dir"]
    context = ray.train.get_context()
    rank, world = context.get_world_rank(), context.get_world_size()
    model = jobs.sharded_net(seed=0)
    optimizer = jobs.optimizer_of(model)
    data = resumable(SAMPLES, global_batch_size=jobs.GLOBAL_BATCH, seed=1)
    storage = config["storage"]
    if config.get("hold_control"):  # a store whose writes stop where the test armed a hold (chaos/holds.py)
        from ray_checkfreq.chaos.holds import holding_filesystem
        from ray_checkfreq.storage import CheckpointStore

        storage = CheckpointStore(storage, filesystem=holding_filesystem(config["hold_control"]))
    cf = CheckFreq(model=model, optimizer=optimizer, data=data, storage=storage, every=config["every"],
                   epoch_len=EPOCH_LEN, compress=False, ray_config=RayConfig(restart_wait_s=3.0))
    start = cf.restore()
    log(work_dir, rank, event="start", iteration=start, world_size=world, node=cf.node_id, restore=cf.restore_info,
        pid=os.getpid())
    for ids in batches(data, config["iterations"], start):
        train_batch(model, optimizer, ids)
        cf.step()
        log(work_dir, rank, event="batch", iteration=cf.iteration, epoch=(cf.iteration - 1) // EPOCH_LEN, ids=ids,
            peer_copies=cf.stats()["peer_copies"])
        kill = config.get("kill")  # {"rank": r, "iteration": i}
        if kill and rank == kill["rank"] and cf.iteration == kill["iteration"] and once(work_dir, "kill"):
            log(work_dir, rank, event="kill", iteration=cf.iteration)
            os.kill(os.getpid(), signal.SIGKILL)
        if cf.iteration in config.get("gather_at", ()):  # the whole state as this iteration's checkpoint holds it
            arrays = jobs.full_state(model, optimizer)  # a collective
            if rank == 0:
                jobs.save_arrays(Path(work_dir) / f"at-{cf.iteration}.npz", arrays)
        time.sleep(config.get("sleep_s", 0.0))
    cf.close()
    arrays = jobs.full_state(model, optimizer)  # a collective
    if rank == 0:
        jobs.save_arrays(Path(work_dir) / "final.npz", arrays)
    stats = cf.stats()
    log(work_dir, rank, event="end", iteration=cf.iteration, generation=cf.generation, node=cf.node_id,
        ram=ram_held(cf.run) if rank == 0 else None,
        stats={key: stats.get(key) for key in ("k", "sharded", "snapshots", "checkpoints_committed",
                                               "stale_ram_released")})


def ram_held(run: str) -> dict:
    """{node: {"slots": [[owner, generation]], "peers": [[owner, generation]]}} of the run's live agents."""
    from ray_checkfreq.ray.agent import live_agents
    from ray_checkfreq.ray.shard_copies import ram_headers

    slot_found, peer_found = ram_headers(live_agents(run))
    return {node: {"slots": [[h["owner"], h["generation"]] for h in slot_found[node] if h["owner"] is not None],
                   "peers": [[h["owner"], h["generation"]] for h in peer_found.get(node, [])]}
            for node in slot_found}


def reference(rank: int, world: int, root: Path, *, iterations: int, gather_at: tuple[int, ...] = ()) -> None:
    """A job for ``sharded_state_jobs.spawn`` (``functools.partial`` for the keywords):
    ``iterations`` steps on the same batches without checkpoints, the whole state saved to
    ``reference.npz`` at the end and to ``at-<i>.npz`` after each iteration ``i`` of ``gather_at``."""
    from ray_checkfreq.data import resumable

    torch.set_num_threads(1)
    model = jobs.sharded_net(seed=0)
    optimizer = jobs.optimizer_of(model)
    data = resumable(SAMPLES, global_batch_size=jobs.GLOBAL_BATCH, seed=1, rank=rank, world_size=world)
    for done, ids in enumerate(batches(data, iterations, 0), start=1):
        train_batch(model, optimizer, ids)
        if done in (*gather_at, iterations):
            arrays = jobs.full_state(model, optimizer)  # a collective
            if rank == 0:
                jobs.save_arrays(root / ("reference.npz" if done == iterations else f"at-{done}.npz"), arrays)
