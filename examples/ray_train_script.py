"""A Ray Train script with ray_checkfreq: the diff against a plain script, and an automatic resume.

A `TorchTrainer` trains a small CNN on scikit-learn's digits (shipped with the package:
nothing is downloaded) with DDP over gloo on a local Ray cluster. Every line that differs
from the same script without ray_checkfreq carries a `# ray_checkfreq:` comment: `+` added,
`~` changed (the plain line follows in a `# ray_checkfreq: -` comment); the script counts
them when it starts. Lines marked `# demo:` only inject the fault and report on it.

With `--crash-at N`, rank 1 SIGKILLs itself after iteration N (once). Ray Train notices
the dead worker and restarts the worker group (`FailureConfig(max_failures=3)`); the new
group's `cf.restore()` resumes from the newest snapshot: the one still held in the node
agent's shared memory when it is newer than the newest commit. The checkpoint interval is
the policy's (p = 3.5 %), and every epoch end is checkpointed. The plain script already
retries with `FailureConfig`, but each retry would start again at iteration 0. The
driver prints where each attempt started and evaluates `result.checkpoint` on held-out
digits:

    python examples/ray_train_script.py --crash-at 30
    python examples/ray_train_script.py --workers 2 --epochs 4 --storage /tmp/rcf-ray-train

Needs a machine with `--workers` free CPUs (one per worker; default 2).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import tempfile
import uuid
from pathlib import Path

import ray
import ray.train
import ray.train.torch
import torch
from ray.train import FailureConfig, RunConfig, ScalingConfig
from ray.train.torch import TorchTrainer
from torch.utils.data import DataLoader, TensorDataset

from ray_checkfreq.data import TorchLoaderOptions, resumable  # ray_checkfreq: +
from ray_checkfreq.ray import CheckFreq, CheckFreqCallback, load  # ray_checkfreq: +

TRAIN_SAMPLES = 1536  # 24 global batches of 64; the remaining 261 digits are held out


def digits(*, train: bool) -> TensorDataset:
    from sklearn.datasets import load_digits

    data = load_digits()
    images = torch.tensor(data.images, dtype=torch.float32).unsqueeze(1) / 16.0
    labels = torch.tensor(data.target)
    part = slice(0, TRAIN_SAMPLES) if train else slice(TRAIN_SAMPLES, None)
    return TensorDataset(images[part], labels[part])


def make_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Conv2d(1, 8, 3), torch.nn.ReLU(), torch.nn.Flatten(),
                               torch.nn.Linear(8 * 6 * 6, 10))


def train_func(config: dict) -> None:
    train_set = digits(train=True)
    model = ray.train.torch.prepare_model(make_model())
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    # ray_checkfreq: - loader = ray.train.torch.prepare_data_loader(DataLoader(train_set, batch_size=32, shuffle=True))
    loader = resumable(train_set, global_batch_size=64, options=TorchLoaderOptions(num_workers=0))  # ray_checkfreq: ~
    cf = CheckFreq(model=model, optimizer=optimizer, data=loader, epoch_len=len(loader))  # ray_checkfreq: +
    start = cf.restore()  # ray_checkfreq: +
    record_attempt(config, start, cf)  # demo:
    # ray_checkfreq: - for epoch in range(config["epochs"]):
    for epoch in range(loader.epoch, config["epochs"]):  # noqa: B007  # ray_checkfreq: ~
        for images, labels in loader:
            loss = torch.nn.functional.cross_entropy(model(images), labels)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            cf.step()  # ray_checkfreq: +
            maybe_crash(config, cf.iteration)  # demo:
    cf.close()  # ray_checkfreq: +


def record_attempt(config: dict, start: int, cf: CheckFreq) -> None:
    """Rank 0 notes where this attempt of the worker group started, and from what."""
    if ray.train.get_context().get_world_rank() == 0:
        entry = {"start": start, "world_size": ray.train.get_context().get_world_size(), "restore": cf.restore_info}
        with open(os.path.join(config["work_dir"], "attempts.jsonl"), "a") as out:
            out.write(json.dumps(entry, default=str) + "\n")


def maybe_crash(config: dict, iteration: int) -> None:
    """Rank 1 SIGKILLs itself after iteration ``crash_at``, once per run (a marker file)."""
    if iteration != config["crash_at"] or ray.train.get_context().get_world_rank() != 1:
        return
    try:
        os.close(os.open(os.path.join(config["work_dir"], "crashed"), os.O_CREAT | os.O_EXCL | os.O_WRONLY))
    except FileExistsError:
        return
    with open(os.path.join(config["work_dir"], "crash.json"), "w") as out:
        json.dump({"iteration": iteration}, out)
    os.kill(os.getpid(), signal.SIGKILL)


def changed_lines() -> int:
    """Lines of this file that differ from the plain Ray Train script (added or changed)."""
    with open(__file__) as source:
        return sum(1 for line in source if re.search(r"# ray_checkfreq: [+~]$", line.rstrip()))


def evaluate(checkpoint: ray.train.Checkpoint) -> float:
    model = make_model()
    model.load_state_dict(load(checkpoint)["model"])  # plain keys: no DDP "module." prefix
    correct = total = 0
    with torch.no_grad():
        for images, labels in DataLoader(digits(train=False), batch_size=256):
            correct += int((model(images).argmax(1) == labels).sum())
            total += len(labels)
    return correct / total


def report(work_dir: str, result: ray.train.Result) -> None:
    with open(os.path.join(work_dir, "attempts.jsonl")) as lines:
        attempts = [json.loads(line) for line in lines]
    crash = Path(work_dir, "crash.json")
    crashed_at = json.loads(crash.read_text())["iteration"] if crash.exists() else None
    for number, attempt in enumerate(attempts, 1):
        source = (attempt["restore"] or {}).get("kind", "none")
        line = f"attempt {number}: {attempt['world_size']} workers, started at iteration {attempt['start']}"
        if number > 1 and crashed_at is not None:
            line += f" (restored from {source}; rank 1 was killed after iteration {crashed_at}: "
            line += f"{crashed_at - attempt['start']} iterations lost)"
        print(line, flush=True)
    if result.checkpoint is None:
        print("result.checkpoint: none registered", flush=True)
        return
    step = json.loads(Path(result.checkpoint.path, "checkfreq-pointer.json").read_text()).get("step")
    print(f"result.checkpoint: step {step}; held-out accuracy {evaluate(result.checkpoint):.3f}", flush=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--storage", default=None, help="RunConfig storage_path (default: a temporary directory)")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--crash-at", type=int, default=None, help="rank 1 SIGKILLs itself after this iteration")
    parser.add_argument("--verbose", action="store_true", help="show the workers' logs")
    args = parser.parse_args()
    print(f"this script differs from the plain Ray Train script in {changed_lines()} lines", flush=True)
    storage = os.path.abspath(args.storage or tempfile.mkdtemp(prefix="rcf-ray-train-"))
    work_dir = os.path.join(storage, "example")
    os.makedirs(work_dir, exist_ok=True)
    ray.init(address="local", num_cpus=args.workers, include_dashboard=False, log_to_driver=args.verbose)
    trainer = TorchTrainer(
        train_func,
        train_loop_config={"epochs": args.epochs, "crash_at": args.crash_at, "work_dir": work_dir},
        scaling_config=ScalingConfig(num_workers=args.workers),
        run_config=RunConfig(storage_path=storage, name=f"digits-{uuid.uuid4().hex[:6]}",
                             failure_config=FailureConfig(max_failures=3),
                             callbacks=[CheckFreqCallback()]),  # ray_checkfreq: +
    )
    result = trainer.fit()
    report(work_dir, result)
    ray.shutdown()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
