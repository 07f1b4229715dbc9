"""The training function the Ray Train tests run: a small CNN on sklearn's digits.

Faults come from the config (as Ray Train's own tests do), each at most once per test
(a marker file in ``work_dir``): SIGKILL of a rank after a given iteration, a persist
held in an agent (a given step's, or the notice's stop checkpoint's: the chaos layer's
hold points, ``ray_checkfreq.chaos.holds``, through the store's file system), a slot
sealed late.
Every rank logs JSON lines to ``work_dir/log-<rank>.jsonl``: where each attempt started
(and from what), the sample ids of every batch, and rank 0 saves the final weights to
``work_dir/final.pt``.
"""

from __future__ import annotations

import json
import os
import signal
import time
from typing import Any

import torch

DIGITS_BATCH = 64


def digits() -> tuple[torch.Tensor, torch.Tensor]:
    """The first 1792 digits: every global batch is full. A last partial batch would be
    split unevenly across ranks, and a per-rank mean loss then weighs its samples by the
    world size, so a run resized before it could not follow the fixed run."""
    from ray_checkfreq.chaos.job import digits as first_digits

    return first_digits(1792)


def small_cnn() -> torch.nn.Module:
    """Float64: a change of world size changes only the reduction order, whose rounding
    Adam would amplify in float32 (it divides tiny gradients by their own size)."""
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Conv2d(1, 8, 3), torch.nn.ReLU(), torch.nn.Flatten(), torch.nn.Linear(8 * 6 * 6, 10)
    ).double()


def iterations_per_epoch(num_samples: int, global_batch: int) -> int:
    return -(-num_samples // global_batch)


def once(work_dir: str, name: str) -> bool:
    """True the first time ``name`` is claimed in this test (across attempts and ranks)."""
    try:
        os.close(os.open(os.path.join(work_dir, f"fault-{name}"), os.O_CREAT | os.O_EXCL | os.O_WRONLY))
        return True
    except FileExistsError:
        return False


def log(work_dir: str, rank: int, **event: Any) -> None:
    with open(os.path.join(work_dir, f"log-{rank}.jsonl"), "a") as out:
        out.write(json.dumps({"t": round(time.time(), 3), **event}) + "\n")
        out.flush()


def train(config: dict) -> None:
    import ray
    import ray.train
    import ray.train.torch

    from ray_checkfreq.data import resumable
    from ray_checkfreq.ray import CheckFreq, RayConfig, RegistrationConfig

    work_dir = config["work_dir"]
    context = ray.train.get_context()
    rank, world = context.get_world_rank(), context.get_world_size()
    images, labels = digits()
    model = ray.train.torch.prepare_model(small_cnn())
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    data = resumable(len(images), global_batch_size=config.get("global_batch", DIGITS_BATCH), seed=1)
    epoch_len = iterations_per_epoch(len(images), config.get("global_batch", DIGITS_BATCH))
    _install_slow_seal(config, work_dir)
    _debug_log_decisions(work_dir, rank)
    cf = CheckFreq(model=model, optimizer=optimizer, data=data, storage=_storage(config, context),
                   ray_config=RayConfig(restart_wait_s=config.get("restart_wait_s", 3.0),
                                        registration=RegistrationConfig(every=config.get("register_every"))),
                   **_engine_options(config, epoch_len))
    start = cf.restore()
    _release_held_persists(work_dir, rank, cf)
    log(work_dir, rank, event="start", iteration=start, world_size=world, node=cf.node_id,
        restore=cf.restore_info, pid=os.getpid())
    total = config["iterations"]
    while cf.iteration < total:
        for indices in data:
            ids = torch.as_tensor(indices)
            loss = torch.nn.functional.cross_entropy(model(images[ids]), labels[ids])
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            cf.step()
            log(work_dir, rank, event="batch", iteration=cf.iteration, epoch=_epoch_of(data, cf.iteration, epoch_len),
                ids=ids.tolist())
            _faults(config, work_dir, rank, cf)
            if config.get("check_pointers") and rank == 0:
                _check_pointers(work_dir, cf)
            if config.get("sleep_s"):
                time.sleep(config["sleep_s"])
            if cf.iteration >= total:
                break
    cf.close()
    if rank == 0:
        torch.save({"iteration": cf.iteration, "model": cf.engine.model.state_dict()},
                   os.path.join(work_dir, "final.pt"))
    log(work_dir, rank, event="end", iteration=cf.iteration, stats=_plain(cf.stats()))


def _engine_options(config: dict, epoch_len: int) -> dict:
    """Fixed k (``every``, default 4), or the policy (``policy``: CheckFreqConfig fields,
    ``adaptive`` holding AdaptiveConfig fields)."""
    if "policy" not in config:
        return {"every": config.get("every", 4), "epoch_len": epoch_len, "compress": False}
    from ray_checkfreq.engine import AdaptiveConfig, CheckFreqConfig

    fields = dict(config["policy"])
    fields["adaptive_config"] = AdaptiveConfig(**fields.pop("adaptive", {}))
    return {"config": CheckFreqConfig(compress=False, **fields)}


def _storage(config: dict, context: Any) -> Any:
    """The run's storage by default; an S3 bucket behind a proxy with ``s3``: {bucket, endpoint};
    with a held persist, the run's storage path through the chaos layer's holding file system."""
    from ray_checkfreq.storage import CheckpointStore, S3Options

    if config.get("hold_persist") or config.get("hold_stop_persist"):
        from ray_checkfreq.chaos.holds import holding_filesystem

        path = os.path.join(context.get_storage().experiment_fs_path, "checkfreq")
        return CheckpointStore(path, filesystem=holding_filesystem(_holds_dir(config["work_dir"])))
    if "s3" not in config:
        return None

    s3 = config["s3"]
    return CheckpointStore(f"s3://{s3['bucket']}/run", s3=S3Options(endpoint_url=s3["endpoint"]))


def _epoch_of(data: Any, iteration: int, epoch_len: int) -> int:
    return (iteration - 1) // epoch_len


def _holds_dir(work_dir: str) -> str:
    return os.path.join(work_dir, "holds")


def _faults(config: dict, work_dir: str, rank: int, cf: Any) -> None:
    import ray

    from ray_checkfreq.chaos import holds

    hold = config.get("hold_persist")  # {"iteration": i, "step": s, "seconds": t}: rank 0's agent holds step s
    if hold and rank == 0 and cf.iteration == hold["iteration"] and cf.agent is not None \
            and once(work_dir, "hold"):
        # A step, not "the next persist": an earlier step's persist may still be on its way.
        holds.arm(_holds_dir(work_dir), "persist", hold_s=hold["seconds"], from_step=hold["step"],
                  nodes=[cf.node_id])
    hold_stop = config.get("hold_stop_persist")  # {"seconds": s}: the notice's stop persist, on other nodes
    if hold_stop and rank == 0 and cf.engine.stop_at is not None and once(work_dir, "hold-stop"):
        _hold_stop_persist(work_dir, cf, hold_stop["seconds"])
    kill_agent = config.get("kill_agent")  # {"iteration": i}: rank 0's node agent dies mid-run
    if kill_agent and rank == 0 and cf.iteration == kill_agent["iteration"] and once(work_dir, "kill-agent"):
        log(work_dir, rank, event="kill-agent", iteration=cf.iteration)
        ray.kill(cf.agent)
    kill = config.get("kill")  # {"rank": r, "iteration": i}
    if kill and rank == kill["rank"] and cf.iteration == kill["iteration"] and once(work_dir, "kill"):
        log(work_dir, rank, event="kill", iteration=cf.iteration)
        os.kill(os.getpid(), signal.SIGKILL)


def _hold_stop_persist(work_dir: str, cf: Any, seconds: float) -> None:
    """Rank 0 planned the notice's checkpoints (at a later step() than this one): the other
    nodes' agents hold the persist of the first of them (the notice checkpoint's, else the
    stop's), and the later ones, for ``seconds``."""
    from ray_checkfreq.chaos import holds
    from ray_checkfreq.ray.agent import live_agents

    others = {node: handle for node, handle in live_agents(cf.run).items() if node != cf.node_id}
    first = cf._preemption.notice_checkpoint or cf.engine.stop_at
    holds.arm(_holds_dir(work_dir), "persist", hold_s=seconds, from_step=first, nodes=others)
    log(work_dir, 0, event="stop-planned", iteration=cf.iteration, stop=first, planned_stop=cf.engine.stop_at,
        held=sorted(others))


def _check_pointers(work_dir: str, cf: Any) -> None:
    """Log a live pointer checkpoint whose step is gone from the store (it must never happen)."""
    from ray_checkfreq.ray.registration import PointedSteps

    storage = cf._registrar.storage
    pointed = PointedSteps(storage.storage_filesystem, storage.experiment_fs_path, cf.store.uri)
    missing = pointed() - {ref.step for ref in cf.store.list()}
    still_pointed = missing & pointed()  # Ray may delete a pointer, then retention its step, meanwhile
    if still_pointed:
        log(work_dir, 0, event="dangling", iteration=cf.iteration, steps=sorted(still_pointed))


def _release_held_persists(work_dir: str, rank: int, cf: Any) -> None:
    """After a restart has chosen what to restore, a persist held in an agent may go on."""
    from ray_checkfreq.chaos import holds

    if rank == 0 and os.path.exists(os.path.join(work_dir, "fault-hold")) and once(work_dir, "release"):
        holds.release(_holds_dir(work_dir), "persist")


def _debug_log_decisions(work_dir: str, rank: int) -> None:
    from ray_checkfreq.ray.decisions import BroadcastDecisions

    original = BroadcastDecisions.exchange

    def exchange(self: Any, planned: Any) -> Any:
        got = original(self, planned)
        log(work_dir, rank, event="decision", planned=repr(planned), got=repr(got))
        return got

    BroadcastDecisions.exchange = exchange  # type: ignore[method-assign]


def _install_slow_seal(config: dict, work_dir: str) -> None:
    """Seal the slot of one step late (attempt 1 only): a kill then lands mid-snapshot."""
    slow = config.get("slow_seal")  # {"step": s, "seconds": t}
    if not slow or os.path.exists(os.path.join(work_dir, "fault-kill")):
        return
    from ray_checkfreq.ray import slots

    original = slots.MappedSlot.finish_write

    def finish_write(self: Any, state: Any) -> Any:
        if self.header().step == slow["step"]:
            time.sleep(slow["seconds"])
        return original(self, state)

    slots.MappedSlot.finish_write = finish_write  # type: ignore[method-assign]


def _plain(stats: dict) -> dict:
    return {k: v for k, v in stats.items() if isinstance(v, (int, float, str, bool, type(None), dict, list))}

