"""Training entrypoint for a spot GPU cluster: Ray Train's TorchTrainer with ray_checkfreq.

Submitted by ``cluster/submit.sh`` (Ray cluster launcher) or run as a KubeRay ``RayJob``
entrypoint. It trains a small residual MLP classifier on synthetic data generated from a
seed (no download), checkpointing with CheckFreq into ``<storage_path>/<name>/checkfreq``.
When a spot node is preempted Ray Train restarts the worker group (``max_failures=-1``)
once the autoscaler has brought up a replacement, and ``cf.restore()`` resumes at the exact
next sample. Swap ``make_dataset`` and ``make_model`` for your own.

    python cluster/train_spot.py --storage-path s3://my-bucket/runs --name digits-spot
    RAY_ADDRESS=local python cluster/train_spot.py --storage-path /tmp/rcf-runs --cpu --workers 2  # rehearsal

Importing this module starts nothing: Ray is imported inside the functions that need it.
"""

from __future__ import annotations

import argparse
import hashlib
import math
from typing import Any

import torch

NUM_CLASSES = 10


def make_dataset(num_samples: int, features: int, seed: int) -> torch.utils.data.TensorDataset:
    """A learnable synthetic classification set, identical on every worker (a pure function of the seed)."""
    generator = torch.Generator().manual_seed(seed)
    centers = torch.randn(NUM_CLASSES, features, generator=generator) * 2.0
    labels = torch.randint(0, NUM_CLASSES, (num_samples,), generator=generator)
    inputs = centers[labels] + torch.randn(num_samples, features, generator=generator)
    return torch.utils.data.TensorDataset(inputs, labels)


def make_model(features: int, width: int, depth: int) -> torch.nn.Module:
    torch.manual_seed(0)
    layers: list[torch.nn.Module] = [torch.nn.Linear(features, width), torch.nn.ReLU()]
    for _ in range(depth):
        layers += [torch.nn.Linear(width, width), torch.nn.ReLU()]
    layers.append(torch.nn.Linear(width, NUM_CLASSES))
    return torch.nn.Sequential(*layers)


def train_func(config: dict[str, Any]) -> None:
    """The training function every Ray Train worker runs (the ray_checkfreq lines are marked)."""
    import ray
    import ray.train
    import ray.train.torch

    from ray_checkfreq.data import TorchLoaderOptions, resumable  # ray_checkfreq
    from ray_checkfreq.ray import CheckFreq  # ray_checkfreq

    device = ray.train.torch.get_device()
    dataset = make_dataset(config["samples"], config["features"], seed=config["seed"])
    model = ray.train.torch.prepare_model(make_model(config["features"], config["width"], config["depth"]))
    optimizer = torch.optim.AdamW(model.parameters(), lr=config["lr"])
    # In-memory tensors: no DataLoader worker processes needed. For data read from disk,
    # raise num_workers (and use multiprocessing_context="forkserver" inside Ray workers).
    loader = resumable(dataset, global_batch_size=config["global_batch"], seed=config["seed"],  # ray_checkfreq
                       drop_last=True, options=TorchLoaderOptions(num_workers=0, pin_memory=device.type == "cuda"))
    cf = CheckFreq(model=model, optimizer=optimizer, data=loader, epoch_len=len(loader),  # ray_checkfreq
                   overhead=config["overhead"], storage=config["checkpoint_uri"])
    start = cf.restore()  # ray_checkfreq: 0 on a fresh run, else the iteration to resume at
    if ray.train.get_context().get_world_rank() == 0:
        print(f"attempt starts at iteration {start} on {ray.train.get_context().get_world_size()} workers "
              f"(rank 0 on node {ray.get_runtime_context().get_node_id()}); restored from: {cf.restore_info}",
              flush=True)
    total = config["epochs"] * len(loader)
    while cf.iteration < total:  # ray_checkfreq: the position lives in cf, not in a loop counter
        for inputs, labels in loader:
            inputs, labels = inputs.to(device, non_blocking=True), labels.to(device, non_blocking=True)
            loss = torch.nn.functional.cross_entropy(model(inputs), labels)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            cf.step()  # ray_checkfreq
            if cf.iteration >= total:
                break
    cf.close()  # ray_checkfreq: the last checkpoint is durable before the function returns
    if ray.train.get_context().get_world_rank() == 0:
        print(f"done: {cf.iteration} iterations, weights sha256 {weights_digest(model)}, stats {cf.stats()}",
              flush=True)


def weights_digest(model: torch.nn.Module) -> str:
    """A digest of the model's parameters and buffers: equal digests, bit-identical weights."""
    digest = hashlib.sha256()
    for name, tensor in sorted(model.state_dict().items()):
        digest.update(name.encode())
        digest.update(tensor.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def parse_workers(text: str) -> int | tuple[int, int]:
    """``"4"``: a fixed world size; ``"2-8"``: elastic, between 2 and 8 workers."""
    low, _, high = text.partition("-")
    try:
        bounds = (int(low), int(high or low))
    except ValueError:
        raise argparse.ArgumentTypeError(f"--workers {text!r}: expected N or MIN-MAX, e.g. 4 or 2-8") from None
    if not 1 <= bounds[0] <= bounds[1]:
        raise argparse.ArgumentTypeError(f"--workers {text!r}: need 1 <= MIN <= MAX")
    return bounds[0] if bounds[0] == bounds[1] else bounds


def check_global_batch(global_batch: int, workers: int | tuple[int, int]) -> None:
    """Every world size the run may take must divide the global batch (it is split evenly)."""
    low, high = (workers, workers) if isinstance(workers, int) else workers
    bad = [w for w in range(low, high + 1) if global_batch % w]
    if bad:
        multiple = math.lcm(*range(low, high + 1))
        raise ValueError(f"--global-batch {global_batch} is not divisible by world size(s) {bad}; "
                         f"use a multiple of {multiple}")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--storage-path", required=True,
                        help="Ray Train storage_path: s3://bucket/prefix on a cluster (an absolute path to rehearse)")
    parser.add_argument("--name", default="checkfreq-spot", help="run name; the same name resumes the same run")
    parser.add_argument("--workers", type=parse_workers, default=parse_workers("2-4"),
                        help="N (fixed) or MIN-MAX (elastic); one GPU each")
    parser.add_argument("--cpu", action="store_true", help="train on CPUs (gloo): a rehearsal without GPUs")
    parser.add_argument("--epochs", type=int, default=20)
    parser.add_argument("--samples", type=int, default=240_000)
    parser.add_argument("--features", type=int, default=256)
    parser.add_argument("--width", type=int, default=2048)
    parser.add_argument("--depth", type=int, default=6)
    parser.add_argument("--global-batch", type=int, default=960, help="all ranks together (fixed under resizes)")
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--overhead", type=float, default=0.035, help="checkpoint overhead budget p")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--resize-interval-s", type=float, default=15.0,
                        help="elastic runs: how often Ray Train looks for room to grow (Ray's default, 60 s, leaves a "
                             "replaced spot node idle for up to a minute)")
    parser.add_argument("--checkpoint-uri", default=None,
                        help="where CheckFreq stores checkpoints (default: <storage-path>/<name>/checkfreq on the "
                             "run's filesystem); an s3:// URI here uses boto3 and S3's conditional writes")
    args = parser.parse_args(argv)
    check_global_batch(args.global_batch, args.workers)
    return args


def build_trainer(args: argparse.Namespace) -> Any:
    from ray.train import CheckpointConfig, FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    from ray_checkfreq.ray import CheckFreqCallback

    config = {name: getattr(args, name) for name in
              ("epochs", "samples", "features", "width", "depth", "global_batch", "lr", "overhead", "seed",
               "checkpoint_uri")}
    return TorchTrainer(
        train_func,
        train_loop_config=config,
        scaling_config=ScalingConfig(num_workers=args.workers, use_gpu=not args.cpu,
                                     **({"elastic_resize_monitor_interval_s": args.resize_interval_s}
                                        if isinstance(args.workers, tuple) else {})),
        run_config=RunConfig(
            name=args.name,
            storage_path=args.storage_path,
            # Retry forever: every preemption is survivable (preemptions with a drain
            # notice are counted apart, under max_preemption_failures, unlimited by default).
            failure_config=FailureConfig(max_failures=-1),
            # Ray Train keeps the two newest pointer checkpoints; the data stays in the store.
            checkpoint_config=CheckpointConfig(num_to_keep=2),
            callbacks=[CheckFreqCallback()],  # ends the node agents (and their slots) with fit()
        ),
    )


def main(argv: list[str] | None = None) -> None:
    import ray

    args = parse_args(argv)
    ray.init()  # the cluster this job was submitted to (RAY_ADDRESS), or a local one
    result = build_trainer(args).fit()
    print(f"finished: checkpoint {result.checkpoint}")


if __name__ == "__main__":
    main()
