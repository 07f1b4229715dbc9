"""``ray-checkfreq bench inplace``: what torchft's per-step quorum costs against plain DDP, same job.

Two ``TorchTrainer`` runs of the same job on a local Ray instance, ``--replicas`` one-CPU
workers, an MLP of ``--width`` and ``--layers`` over synthetic data, each step's global
batch from ``QuorumSteps``:
- ``ddp``: PyTorch DDP over gloo, one process group of every worker (Ray's default);
- ``in_place``: ``InPlaceReplica`` (torchft: a synchronous quorum through the lighthouse,
  the gradient average by the manager, ``should_commit``), no checkpoints.
Each times ``--steps`` steps after ``--warmup``; the figure is the median step over those,
and the quorum's cost the difference of the two medians. The runs alternate ``--rounds``
times (ddp, in_place, ddp, ...), each a fresh ``fit()``: a loaded machine moves both alike.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
import uuid
from typing import Any

from benchmarks.harness import add_json_argument, write_json

VARIANTS = ("ddp", "in_place")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--replicas", type=int, default=3, help="workers, one replica each (default 3)")
    parser.add_argument("--width", type=int, default=512, help="MLP width (default 512)")
    parser.add_argument("--layers", type=int, default=4, help="MLP hidden layers (default 4)")
    parser.add_argument("--global-batch", type=int, default=96, help="samples per step (default 96)")
    parser.add_argument("--steps", type=int, default=200, help="timed steps per run (default 200)")
    parser.add_argument("--warmup", type=int, default=20, help="untimed steps before them (default 20)")
    parser.add_argument("--rounds", type=int, default=2, help="ddp/in_place pairs of runs (default 2)")
    add_json_argument(parser)


def run(args: argparse.Namespace) -> int:
    figures = measure(args)
    print_table(figures)
    write_json(args.json, figures)
    return 0


def measure(args: argparse.Namespace) -> dict:
    import ray

    for name in ("replicas", "width", "layers", "global_batch", "steps", "warmup", "rounds"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')}={getattr(args, name)}: must be >= 1")
    if not ray.is_initialized():
        ray.init(address="local", num_cpus=args.replicas + 1, include_dashboard=False, log_to_driver=False)
    config = {"width": args.width, "layers": args.layers, "global_batch": args.global_batch,
              "steps": args.steps, "warmup": args.warmup}
    medians: dict[str, list[float]] = {variant: [] for variant in VARIANTS}
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="rcf-bench-inplace-") as work_dir:
        for round_index in range(args.rounds):
            for variant in VARIANTS:
                out = os.path.join(work_dir, f"{variant}-{round_index}.json")
                fit(variant, {**config, "out": out}, args.replicas, work_dir)
                with open(out) as saved:
                    medians[variant].append(statistics.median(json.load(saved)["step_s"]))
    ddp, in_place = (statistics.median(medians[v]) for v in VARIANTS)
    return {"replicas": args.replicas, "parameters": parameter_count(args.width, args.layers),
            "median_step_ms": {v: round(1000 * statistics.median(medians[v]), 2) for v in VARIANTS},
            "per_round_ms": {v: [round(1000 * m, 2) for m in medians[v]] for v in VARIANTS},
            "quorum_cost_ms": round(1000 * (in_place - ddp), 2),
            "quorum_cost_fraction": round(in_place / ddp - 1, 4), "wall_s": round(time.monotonic() - started, 1)}


def parameter_count(width: int, layers: int) -> int:
    return 16 * width + width + layers * (width * width + width) + width + 1


def fit(variant: str, config: dict, replicas: int, work_dir: str) -> None:
    from ray_checkfreq.chaos.harness import TrainJob, fit_job
    from ray_checkfreq.ray.inplace import InPlaceConfig

    fit_job(TrainJob(train=train, config={**config, "variant": variant}, workers=replicas,
                     name=f"bench-inplace-{variant}-{uuid.uuid4().hex[:6]}", storage_path=os.path.join(work_dir, "ray"),
                     in_place=InPlaceConfig() if variant == "in_place" else None, timeout_s=900))


def train(config: dict) -> None:
    """One worker: ``config["steps"]`` timed steps; rank 0 writes their durations."""
    import ray.train
    import torch

    from ray_checkfreq.data import QuorumSteps, resumable

    torch.set_num_threads(1)
    context = ray.train.get_context()
    rank, world = context.get_world_rank(), context.get_world_size()
    torch.manual_seed(0)
    layers: list[Any] = [torch.nn.Linear(16, config["width"]), torch.nn.ReLU()]
    for _ in range(config["layers"]):
        layers += [torch.nn.Linear(config["width"], config["width"]), torch.nn.ReLU()]
    model = torch.nn.Sequential(*layers, torch.nn.Linear(config["width"], 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    total = config["warmup"] + config["steps"]
    steps = QuorumSteps(resumable(total * config["global_batch"], global_batch_size=config["global_batch"],
                                  rank=0, world_size=1))
    x = torch.randn(total * config["global_batch"], 16)
    y = x.sum(dim=1, keepdim=True)
    one_step, close = _in_place_step(model, optimizer, steps) if config["variant"] == "in_place" else \
        _ddp_step(model, optimizer, steps, rank, world)
    durations = []
    while steps.step < total:
        begun = time.perf_counter()
        one_step(x, y)
        durations.append(time.perf_counter() - begun)
    close()
    if rank == 0:
        with open(config["out"], "w") as out:
            json.dump({"step_s": durations[config["warmup"]:]}, out)


def _ddp_step(model: Any, optimizer: Any, steps: Any, rank: int, world: int) -> Any:
    import torch

    wrapped = torch.nn.parallel.DistributedDataParallel(model)

    def step(x: Any, y: Any) -> None:
        share = steps.fetch(rank=rank, size=world)
        optimizer.zero_grad()
        index = torch.as_tensor(share.indices)
        (torch.nn.functional.mse_loss(wrapped(x[index]), y[index]) * share.loss_scale).backward()
        optimizer.step()
        steps.commit(share.step)

    return step, lambda: None


def _in_place_step(model: Any, optimizer: Any, steps: Any) -> Any:
    import torch

    from ray_checkfreq.ray.inplace import InPlaceReplica

    replica = InPlaceReplica(model=model, optimizer=optimizer, steps=steps)

    def step(x: Any, y: Any) -> None:
        share = replica.next_share()
        index = torch.as_tensor(share.indices)
        (torch.nn.functional.mse_loss(replica.model(x[index]), y[index]) * share.loss_scale).backward()
        replica.commit(share)

    return step, replica.shutdown


def print_table(figures: dict) -> None:
    print(f"per-step quorum cost, {figures['replicas']} replicas, {figures['parameters']:,} parameters "
          f"(gloo, one CPU each), measured wall {figures['wall_s']} s:")
    for variant in VARIANTS:
        print(f"  {variant:9s} median step {figures['median_step_ms'][variant]:8.2f} ms "
              f"(per run: {figures['per_round_ms'][variant]})")
    share = 100 * figures["quorum_cost_fraction"]
    print(f"  torchft's quorum: {figures['quorum_cost_ms']:+.2f} ms a step ({share:+.1f} %)")
