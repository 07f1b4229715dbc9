"""Placeholder main job: train, checkpoint, "crash", restore, and compare bit for bit.

Until the engine and Ray Train issues land, this drives CheckpointStore directly: a small
MLP trains for 60 steps with a checkpoint every 10; the run is killed at step 37 (its
in-memory state thrown away), restarts from the newest checkpoint, and must finish with
weights bit-identical to an uninterrupted run.
"""

from __future__ import annotations

import argparse
import tempfile
import time

import torch

from ray_checkfreq import CheckpointStore

TOTAL_STEPS = 60


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Data as a pure function of the step, so a restart sees the same samples."""
    generator = torch.Generator().manual_seed(10_000 + step)
    inputs = torch.randn(64, 32, generator=generator)
    return inputs, (inputs.sum(dim=1, keepdim=True) > 0).float()


def build() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Dropout(0.1), torch.nn.Linear(64, 1))
    return model, torch.optim.Adam(model.parameters(), lr=1e-2)


def train(store: CheckpointStore | None, every: int, crash_at: int | None) -> tuple[torch.nn.Module, int]:
    model, opt = build()
    start = 0
    if store is not None and store.latest() is not None:
        state = store.load()
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["optimizer"])
        torch.set_rng_state(state["rng"])
        start = state["step"]
    for step in range(start, TOTAL_STEPS):
        if step == crash_at:
            return model, step
        inputs, targets = batch(step)
        loss = torch.nn.functional.binary_cross_entropy_with_logits(model(inputs), targets)
        opt.zero_grad()
        loss.backward()
        opt.step()
        if store is not None and (step + 1) % every == 0:
            store.save(step + 1, {"model": model.state_dict(), "optimizer": opt.state_dict(),
                                  "rng": torch.get_rng_state(), "step": step + 1})
    return model, TOTAL_STEPS


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--storage", default=None, help="checkpoint URI (default: a temporary directory)")
    args = parser.parse_args()
    uri = args.storage or tempfile.mkdtemp(prefix="ray-checkfreq-demo-")
    reference, _ = train(None, every=10, crash_at=None)

    store = CheckpointStore(uri)
    started = time.perf_counter()
    _, crashed_at = train(store, every=10, crash_at=37)
    print(f"run 1: killed at step {crashed_at}; checkpoints: {[r.step for r in store.list()]}")
    resume_from = store.latest().step
    resumed, finished = train(CheckpointStore(uri), every=10, crash_at=None)
    print(f"run 2: resumed from step {resume_from}, finished at step {finished}")
    identical = all(torch.equal(a, b) for a, b in zip(reference.state_dict().values(), resumed.state_dict().values()))
    print(f"final weights bit-identical to an uninterrupted run: {identical}")
    print(f"checkpoints in {uri}: {[r.step for r in store.list()]} ({time.perf_counter() - started:.2f} s)")
    return 0 if identical else 1


if __name__ == "__main__":
    raise SystemExit(main())
