"""The main job: train with CheckFreq, SIGKILL the process mid-epoch, resume, compare.

A small classifier trains for 3 epochs on a map-style dataset read through
`ray_checkfreq.data.resumable`, checkpointed by `CheckFreq` at the interval its policy
picks (p = 3.5 %). A child process runs the same job and kills itself with SIGKILL in
the middle of epoch 2, with no chance to flush anything. The job is then restarted: it
resumes from the newest committed checkpoint at the exact next sample, and must finish
with weights bit-identical to an uninterrupted run, every sample used exactly once per
epoch. It also checks that the restart began at the newest checkpoint the store had
committed (not at 0), ran only the remaining iterations and lost at most 2k; it exits 1
naming what failed. (The Ray Train version, with preemptions injected, is `examples/ray_demo.py`: `make demo`.)
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

from ray_checkfreq import CheckFreq, CheckpointStore
from ray_checkfreq.data import TorchLoaderOptions, resumable

SAMPLES = 4096
BATCH = 32
EPOCHS = 3
ITERS_PER_EPOCH = SAMPLES // BATCH
KILL_AT = 2 * SAMPLES // BATCH - 37  # inside epoch 2


class Blobs(torch.utils.data.Dataset):
    """Two noisy Gaussian blobs; sample i is a pure function of i."""

    def __len__(self) -> int:
        return SAMPLES

    def __getitem__(self, index: int) -> dict:
        generator = torch.Generator().manual_seed(index)
        label = index % 2
        x = torch.randn(16, generator=generator) + (1.5 if label else -1.5)
        return {"index": torch.tensor(index), "x": x, "y": torch.tensor(float(label))}


def train(storage: str, kill_at: int | None = None, progress: str | None = None) -> dict:
    """Run the job; with ``kill_at`` the process SIGKILLs itself on reaching that iteration.

    ``progress`` gets one line per finished iteration ("iteration k"), written with one
    write(2) each, so the record survives the kill.
    """
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.ReLU(), torch.nn.Dropout(0.2), torch.nn.Linear(64, 1))
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=100, gamma=0.9)
    data = resumable(Blobs(), batch_size=BATCH, seed=1, options=TorchLoaderOptions(num_workers=0))
    cf = CheckFreq(model=model, optimizer=opt, storage=storage, data=data, extra_state={"sched": sched},
                   overhead=0.035, epoch_len=SAMPLES // BATCH)
    record = os.open(progress, os.O_WRONLY | os.O_CREAT | os.O_APPEND) if progress else None
    start = iteration = cf.restore()
    seen: list[int] = []
    while data.epoch < EPOCHS:
        for batch in data:
            if iteration == kill_at:
                os.kill(os.getpid(), signal.SIGKILL)  # a preemption: nothing is flushed
            loss = torch.nn.functional.binary_cross_entropy_with_logits(model(batch["x"]).squeeze(1), batch["y"])
            opt.zero_grad()
            loss.backward()
            opt.step()
            sched.step()
            seen += batch["index"].tolist()
            iteration += 1
            cf.step()
            if record is not None:
                os.write(record, f"{iteration} {cf.stats()['k']}\n".encode())
    cf.close()
    return {"start": start, "executed": iteration - start, "seen": seen, "stats": cf.stats(),
            "weights": [t.tolist() for t in model.state_dict().values()]}


def crash(storage: str, progress: str) -> int:
    """Run 1: a child process trains and is killed by SIGKILL at iteration KILL_AT."""
    child = subprocess.run([sys.executable, __file__, "--child", "--storage", storage, "--progress", progress])
    print(f"run 1: killed by SIGKILL at iteration {KILL_AT} (exit status {child.returncode})")
    if child.returncode != -signal.SIGKILL:
        print(f"FAILED: run 1 should have died by SIGKILL, it exited with {child.returncode}", file=sys.stderr)
        return 1
    return 0


def read_progress(progress: str) -> tuple[int, dict[int, int | None]]:
    """(iterations the killed run finished, k in force after each)."""
    rows = [line.split() for line in Path(progress).read_text().splitlines()]
    k_after = {int(it): None if k == "None" else int(k) for it, k in rows}
    return (max(k_after) if k_after else 0), k_after


def resume(storage: str, progress: str) -> int:
    """Run 2: restart on the same storage, then check the resume against the store and a reference."""
    killed_at, k_after = read_progress(progress)
    store = CheckpointStore(storage)
    newest = store.latest()
    if newest is None:
        print(f"FAILED: run 1 committed no checkpoint in {storage}", file=sys.stderr)
        return 1
    newest_k = store.load(newest)["checkfreq"]["k"]
    print(f"store: newest committed checkpoint before the restart is iteration {newest.step} ({newest.name})")
    with tempfile.TemporaryDirectory(prefix="ray-checkfreq-ref-") as scratch:
        reference = train(os.path.join(scratch, "ckpt"))
    resumed = train(storage)
    stats = resumed["stats"]
    ks = [k for k in [newest_k, *(k_after.get(it) for it in range(newest.step, killed_at + 1))] if k is not None]
    # Epoch ends are checkpoints too: with no k in force yet (profiling) or k longer than an
    # epoch (the lost-work floor lets it be), the interval that bounds the loss is the epoch.
    k = min(max(ks, default=0) or ITERS_PER_EPOCH, ITERS_PER_EPOCH)
    print(f"run 2: resumed at iteration {resumed['start']} (lost {killed_at - resumed['start']} iterations; "
          f"the bound is 2k = {2 * k}), ran {resumed['executed']} iterations to finish {EPOCHS} epochs")
    print(f"policy: mode {stats['mode']}, k = {stats['k']}, {stats['checkpoints_committed']} checkpoints committed "
          f"after the restart, stall {stats['stall_s_per_checkpoint'] * 1e3:.1f} ms per checkpoint")
    problems = resume_problems(newest.step, k, killed_at, resumed)
    per_epoch = SAMPLES // BATCH * BATCH
    tail = reference["seen"][-len(resumed["seen"]):] if resumed["seen"] else []
    checks = {
        "resumed run read exactly the samples the uninterrupted run read after that point":
            resumed["seen"] == tail,
        "every sample exactly once per epoch":
            all(sorted(reference["seen"][e * per_epoch:(e + 1) * per_epoch]) == list(range(SAMPLES))
                for e in range(EPOCHS)),
        "final weights bit-identical to an uninterrupted run":
            json.dumps(reference["weights"]) == json.dumps(resumed["weights"]),
    }
    for claim, holds in checks.items():
        print(f"{claim}: {holds}")
        if not holds:
            problems.append(f"not true: {claim}")
    for problem in problems:
        print(f"FAILED: {problem}", file=sys.stderr)
    return 1 if problems else 0


def resume_problems(newest: int, k: int, killed_at: int, resumed: dict) -> list[str]:
    """Why the restart is not a resume from the newest checkpoint losing at most 2k, if it is not."""
    start, total = resumed["start"], EPOCHS * (SAMPLES // BATCH)
    problems = []
    if not (start == newest > 0):
        problems.append(f"run 2 began at iteration {start}, not at the newest committed checkpoint "
                        f"(iteration {newest}): restore() did not resume")
    if resumed["executed"] != total - newest:
        problems.append(f"run 2 ran {resumed['executed']} iterations, but only the {total - newest} "
                        f"after iteration {newest} remained")
    if killed_at - start > 2 * k:
        problems.append(f"run 2 lost {killed_at - start} iterations, more than 2k = {2 * k}")
    return problems


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--storage", default=None, help="checkpoint URI (default: a temporary directory)")
    parser.add_argument("--stage", choices=("all", "crash", "resume"), default="all",
                        help="run 1 only (crash), run 2 and the checks only (resume), or both")
    parser.add_argument("--progress", default=None,
                        help="file where run 1 records its iterations (needed by --stage crash / resume)")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        train(args.storage, kill_at=KILL_AT, progress=args.progress)
        return 0
    if args.stage != "all" and not (args.storage and args.progress):
        parser.error(f"--stage {args.stage} needs --storage and --progress")
    storage = args.storage or tempfile.mkdtemp(prefix="ray-checkfreq-demo-")
    progress = args.progress or os.path.join(tempfile.mkdtemp(prefix="ray-checkfreq-progress-"), "run1.txt")
    if args.stage in ("all", "crash") and crash(storage, progress) != 0:
        return 1
    return resume(storage, progress) if args.stage in ("all", "resume") else 0


if __name__ == "__main__":
    raise SystemExit(main())
