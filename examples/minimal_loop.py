"""The smallest training loop with CheckFreq: restore, step, close (one process, no Ray).

An MLP learns scikit-learn's digits (shipped with the package: nothing is downloaded),
checkpointed every 10 iterations into a local directory. Kill it, run it again, and it
goes on from the newest committed checkpoint at the exact next sample:

    python examples/minimal_loop.py --storage /tmp/rcf-minimal --crash-at 47   # SIGKILLs itself
    python examples/minimal_loop.py --storage /tmp/rcf-minimal                 # resumes, finishes

The second run prints `started at iteration N` (N: the newest checkpoint the first run
committed, at most 2k = 20 iterations before the kill) and a digest of the final weights,
the same as an uninterrupted run's. `--every 0` lets the policy choose k (p = 3.5 %).
"""

from __future__ import annotations

import argparse
import hashlib
import os
import signal
import tempfile

import torch
from sklearn.datasets import load_digits

from ray_checkfreq import CheckFreq
from ray_checkfreq.data import resumable


def digest(model: torch.nn.Module) -> str:
    """A short fingerprint of the weights, to compare runs."""
    hashed = hashlib.sha256()
    for tensor in model.state_dict().values():
        hashed.update(tensor.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return hashed.hexdigest()[:16]


def train(storage: str, iterations: int, every: int | None, crash_at: int | None) -> None:
    digits = load_digits()
    x = torch.tensor(digits.data, dtype=torch.float32) / 16.0
    y = torch.tensor(digits.target)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 10))
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    data = resumable(len(x), batch_size=64, seed=0)  # batches of sample indices, resumable mid-epoch

    cf = CheckFreq(model=model, optimizer=optimizer, storage=storage, data=data, every=every, epoch_len=len(data))
    start = cf.restore()  # 0 on a fresh run; else the newest checkpoint's iteration, all state loaded
    print(f"started at iteration {start}", flush=True)
    while cf.iteration < iterations:
        for indices in data:  # the rest of the current epoch
            loss = torch.nn.functional.cross_entropy(model(x[indices]), y[indices])
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()  # waits for an in-flight snapshot of the previous iteration
            cf.step()  # may start a snapshot; persisted in the background
            if cf.iteration == crash_at:
                os.kill(os.getpid(), signal.SIGKILL)  # a preemption: nothing is flushed
            if cf.iteration >= iterations:
                break
    cf.close()  # the checkpoint in flight becomes durable
    stats = cf.stats()
    print(f"finished at iteration {cf.iteration}: loss {loss.item():.4f}, k = {stats['k']}, "
          f"{stats['checkpoints_committed']} checkpoints committed by this run", flush=True)
    print(f"weights digest {digest(model)}", flush=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--storage", default=os.path.join(tempfile.gettempdir(), "rcf-minimal-loop"),
                        help="checkpoint directory or URI (default: %(default)s)")
    parser.add_argument("--iterations", type=int, default=120, help="total iterations (default: %(default)s)")
    parser.add_argument("--every", type=int, default=10, help="checkpoint interval k; 0: the policy picks it")
    parser.add_argument("--crash-at", type=int, default=None, help="SIGKILL this process after that iteration")
    args = parser.parse_args()
    print(f"checkpoints in {args.storage}", flush=True)
    train(args.storage, args.iterations, args.every or None, args.crash_at)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
