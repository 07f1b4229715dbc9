"""The main job: train with CheckFreq, SIGKILL the process mid-epoch, resume, compare.

A small classifier trains for 3 epochs on a map-style dataset read through
`ray_checkfreq.data.resumable`, checkpointed by `CheckFreq` at the interval its policy
picks (p = 3.5 %). A child process runs the same job and kills itself with SIGKILL in
the middle of epoch 2, with no chance to flush anything. The job is then restarted: it
resumes from the newest committed checkpoint at the exact next sample, and must finish
with weights bit-identical to an uninterrupted run, every sample used exactly once per
epoch. (The Ray Train version of this job lands with the Ray integration issue.)
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile

import torch

from ray_checkfreq import CheckFreq
from ray_checkfreq.data import TorchLoaderOptions, resumable

SAMPLES = 4096
BATCH = 32
EPOCHS = 3
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


def train(storage: str, kill_at: int | None = None) -> dict:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.ReLU(), torch.nn.Dropout(0.2), torch.nn.Linear(64, 1))
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=100, gamma=0.9)
    data = resumable(Blobs(), batch_size=BATCH, seed=1, options=TorchLoaderOptions(num_workers=0))
    cf = CheckFreq(model=model, optimizer=opt, storage=storage, data=data, extra_state={"sched": sched},
                   overhead=0.035, epoch_len=SAMPLES // BATCH)
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
    cf.close()
    return {"start": start, "seen": seen, "stats": cf.stats(),
            "weights": [t.tolist() for t in model.state_dict().values()]}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--storage", default=None, help="checkpoint URI (default: a temporary directory)")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        train(args.storage, kill_at=KILL_AT)
        return 0
    storage = args.storage or tempfile.mkdtemp(prefix="ray-checkfreq-demo-")
    reference = train(os.path.join(tempfile.mkdtemp(prefix="ray-checkfreq-ref-"), "ckpt"))
    child = subprocess.run([sys.executable, __file__, "--child", "--storage", storage])
    print(f"run 1: killed by SIGKILL at iteration {KILL_AT} (exit status {child.returncode})")
    resumed = train(storage)
    stats = resumed["stats"]
    print(f"run 2: resumed at iteration {resumed['start']} (lost {KILL_AT - resumed['start']} iterations), "
          f"finished {EPOCHS} epochs")
    print(f"policy: mode {stats['mode']}, k = {stats['k']}, {stats['checkpoints_committed']} checkpoints committed "
          f"after the restart, stall {stats['stall_s_per_checkpoint'] * 1e3:.1f} ms per checkpoint")
    per_epoch = SAMPLES // BATCH * BATCH
    tail = reference["seen"][-len(resumed["seen"]):] if resumed["seen"] else []
    same_samples = resumed["seen"] == tail
    epochs_exact = all(sorted(reference["seen"][e * per_epoch:(e + 1) * per_epoch]) == list(range(SAMPLES))
                       for e in range(EPOCHS))
    identical = json.dumps(reference["weights"]) == json.dumps(resumed["weights"])
    print(f"resumed run read exactly the samples the uninterrupted run read after that point: {same_samples}")
    print(f"every sample exactly once per epoch: {epochs_exact}")
    print(f"final weights bit-identical to an uninterrupted run: {identical}")
    return 0 if (child.returncode == -signal.SIGKILL and same_samples and epochs_exact and identical) else 1


if __name__ == "__main__":
    raise SystemExit(main())
