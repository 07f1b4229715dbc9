"""A Ray Data pipeline read through the resumable iterator by an elastic Ray Train job.

The digits of scikit-learn (shipped with the package: nothing is downloaded) become a
Ray Dataset, materialized once on the driver in a fixed block order. A `TorchTrainer`
with `ScalingConfig(num_workers=(1, 2))` (elastic: as many workers as the cluster has
CPUs for, between 1 and 2) reads it through `resumable(ds, global_batch_size=64)`: the
global batch stays 64 whatever the world size (32 per rank on 2 workers, 64 on 1), so
the learning rate stays as it is.

The script runs the job twice, each time in a new local Ray cluster (a child process):

1. a cluster with 2 CPUs: 2 workers; after iteration `--crash-at` rank 1 is SIGKILLed
   and, with no retries left (`max_failures=0`), the run fails: the cluster is lost;
2. a new cluster with 1 CPU, the same storage and run name: the elastic job starts with
   the 1 worker it can place, and `cf.restore()` resumes from the newest committed
   checkpoint; the rest of the epoch is re-sharded over the new world size.

It then prints where each phase started, its world size, and checks from the workers'
logs that every sample of each epoch was used exactly once (counting only the batches
that survived into the final weights). Exit status 1 if it was not.

    python examples/ray_data_elastic.py
    python examples/ray_data_elastic.py --epochs 3 --crash-at 40 --storage /tmp/rcf-elastic
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import signal
import subprocess
import sys
import tempfile

SAMPLES = 1792  # 28 full global batches of 64 (the 5 remaining digits are left out)
GLOBAL_BATCH = 64
RUN_NAME = "digits-elastic"


def load_rows() -> list[dict]:
    from sklearn.datasets import load_digits

    digits = load_digits()
    return [{"id": i, "x": digits.data[i] / 16.0, "y": int(digits.target[i])} for i in range(SAMPLES)]


def make_dataset():
    """The dataset, materialized in a reproducible block order: a new cluster numbers its rows the same way."""
    import ray.data

    ray.data.DataContext.get_current().execution_options.preserve_order = True
    return ray.data.from_items(load_rows(), override_num_blocks=7).materialize()


def train_func(config: dict) -> None:
    import ray.train
    import ray.train.torch
    import torch

    from ray_checkfreq.data import RayDataOptions, resumable
    from ray_checkfreq.ray import CheckFreq

    context = ray.train.get_context()
    rank, world = context.get_world_rank(), context.get_world_size()
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 10))
    model = ray.train.torch.prepare_model(net)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    options = RayDataOptions(chunk_rows=64, window_chunks=4, dtypes={"x": torch.float32})
    data = resumable(config["dataset"], global_batch_size=GLOBAL_BATCH, seed=0, options=options)
    cf = CheckFreq(model=model, optimizer=optimizer, data=data, epoch_len=len(data), every=config["every"])
    start = cf.restore()
    log = open(os.path.join(config["work_dir"], f"phase{config['phase']}-rank{rank}.jsonl"), "a")
    log.write(json.dumps({"start": start, "world_size": world, "restore": (cf.restore_info or {}).get("kind")}) + "\n")
    while cf.iteration < config["epochs"] * len(data):
        epoch = data.epoch
        for batch in data:
            loss = torch.nn.functional.cross_entropy(model(batch["x"]), batch["y"])
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            cf.step()
            log.write(json.dumps({"iteration": cf.iteration, "epoch": epoch, "ids": batch["id"].tolist()}) + "\n")
            log.flush()
            if cf.iteration == config["crash_at"] and rank == 1:
                os.kill(os.getpid(), signal.SIGKILL)  # the first cluster goes away
    cf.close()
    log.write(json.dumps({"end": cf.iteration, "loss": loss.item()}) + "\n")


def run_phase(args: argparse.Namespace) -> int:
    """One cluster's life: a local Ray with ``--cpus`` CPUs runs the elastic job once."""
    import ray
    from ray.train import FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    from ray_checkfreq.ray import CheckFreqCallback

    ray.init(address="local", num_cpus=args.cpus, include_dashboard=False, log_to_driver=args.verbose)
    config = {"dataset": make_dataset(), "epochs": args.epochs, "every": args.every, "phase": args.phase,
              "crash_at": args.crash_at if args.phase == 1 else None, "work_dir": args.storage}
    trainer = TorchTrainer(
        train_func, train_loop_config=config,
        scaling_config=ScalingConfig(num_workers=(1, 2)),
        run_config=RunConfig(storage_path=args.storage, name=RUN_NAME, callbacks=[CheckFreqCallback()],
                             failure_config=FailureConfig(max_failures=0 if args.phase == 1 else 3)),
    )
    try:
        trainer.fit()
        outcome = 0
    except Exception as err:  # phase 1 ends this way on purpose
        print(f"phase {args.phase}: the run failed: {type(err).__name__}", flush=True)
        outcome = 3
    ray.shutdown()
    return outcome


def read_log(path: str) -> list[dict]:
    with open(path) as lines:
        return [json.loads(line) for line in lines]


def check(args: argparse.Namespace) -> int:
    """Where each phase started, and every sample once per epoch in what the final weights saw."""
    phases = {p: {path: read_log(path) for path in sorted(glob.glob(os.path.join(args.storage, f"phase{p}-rank*")))}
              for p in (1, 2)}
    starts = {p: next(e for e in logs[min(logs)] if "start" in e) for p, logs in phases.items() if logs}
    if set(starts) != {1, 2}:
        print("FAILED: a phase left no log", file=sys.stderr)
        return 1
    resumed = starts[2]["start"]
    reached = max(e["iteration"] for logs in phases[1].values() for e in logs if "iteration" in e)
    print(f"phase 1: {starts[1]['world_size']} workers, started at iteration {starts[1]['start']}, "
          f"trained to iteration {reached}, then lost its cluster", flush=True)
    print(f"phase 2: {starts[2]['world_size']} worker(s), resumed at iteration {resumed} from "
          f"{starts[2]['restore']} ({reached - resumed} iterations lost), global batch {GLOBAL_BATCH} in both",
          flush=True)
    kept = [e for logs in phases[1].values() for e in logs if e.get("iteration", 0) and e["iteration"] <= resumed]
    kept += [e for logs in phases[2].values() for e in logs if "iteration" in e]
    problems = []
    for epoch in range(args.epochs):
        ids = sorted(i for e in kept if e["epoch"] == epoch for i in e["ids"])
        once = ids == list(range(SAMPLES))
        print(f"epoch {epoch}: every sample exactly once: {once}", flush=True)
        if not once:
            problems.append(f"epoch {epoch}: {len(ids)} samples used, {len(set(ids))} distinct, of {SAMPLES}")
    if not 0 < resumed <= reached:
        problems.append(f"phase 2 began at iteration {resumed}, not at a checkpoint of phase 1 (1..{reached})")
    for problem in problems:
        print(f"FAILED: {problem}", file=sys.stderr)
    return 1 if problems else 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--storage", default=None, help="RunConfig storage_path (default: a new temporary directory)")
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--crash-at", type=int, default=20, help="phase 1 loses its cluster after this iteration")
    parser.add_argument("--every", type=int, default=None, help="fixed checkpoint interval k (default: the policy)")
    parser.add_argument("--verbose", action="store_true", help="show the workers' logs")
    parser.add_argument("--phase", type=int, choices=(1, 2), default=None, help=argparse.SUPPRESS)
    parser.add_argument("--cpus", type=int, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.phase is not None:
        return run_phase(args)
    args.storage = os.path.abspath(args.storage or tempfile.mkdtemp(prefix="rcf-elastic-"))
    os.makedirs(args.storage, exist_ok=True)
    print(f"storage: {args.storage}", flush=True)
    for phase, cpus in ((1, 2), (2, 1)):
        command = [sys.executable, __file__, "--phase", str(phase), "--cpus", str(cpus), "--storage", args.storage,
                   "--epochs", str(args.epochs), "--crash-at", str(args.crash_at)]
        command += (["--every", str(args.every)] if args.every else []) + (["--verbose"] if args.verbose else [])
        print(f"phase {phase}: a local Ray cluster with {cpus} CPU(s)", flush=True)
        done = subprocess.run(command)
        if done.returncode != (3 if phase == 1 else 0):
            print(f"FAILED: phase {phase} exited with {done.returncode}", file=sys.stderr)
            return 1
    return check(args)


if __name__ == "__main__":
    raise SystemExit(main())
