"""The engine under SIGKILL: 50 seeded kills of a training process while it snapshots and persists.

``tests/test_crash_consistency.py`` kills a bare ``CheckpointStore.save`` loop; this kills
the whole engine (the fenced snapshot, the background persist thread, restore) at seeded
random moments. The model's every value is the iteration it was trained to
(``CountingOptimizer``), so a checkpoint mixing two iterations or a half-written one
shows. After every kill: every committed checkpoint is whole, the newest commit never
goes back, and the next process restores exactly the newest commit, untorn.
"""

from __future__ import annotations

import multiprocessing
import os
import random
import signal
import time

import pytest

from ray_checkfreq import CheckpointStore
from ray_checkfreq.chaos import torn_iterations

pytestmark = pytest.mark.chaos

KILLS = 50
SEED = 20261201


def _train_until_killed(root: str, conn) -> None:
    import torch

    from ray_checkfreq.chaos import CountingOptimizer
    from ray_checkfreq.engine import CheckFreq

    torch.set_num_threads(1)
    model = torch.nn.Sequential(*[torch.nn.Linear(96, 96) for _ in range(6)])
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()  # iteration 0
    optimizer = CountingOptimizer(model.parameters())
    store = CheckpointStore(root, keep_last=2, codec="raw", shard_size_bytes=48 << 10, io_threads=2)
    cf = CheckFreq(model=model, optimizer=optimizer, storage=store, every=2)
    start = cf.restore()
    whole = all(bool((p == start).all()) for p in model.parameters())
    conn.send((start, whole))
    while True:
        optimizer.step()
        cf.step()


def _context() -> multiprocessing.context.BaseContext:
    # A fork server with torch imported once: each child starts in milliseconds, and never
    # forks a process whose thread pools already ran.
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(["torch", "ray_checkfreq.engine"])
    return context


def test_fifty_kills_during_snapshots_and_writes_never_load_a_torn_checkpoint(tmp_path):
    root = str(tmp_path / "ckpt")
    rng = random.Random(SEED)
    context = _context()
    newest = 0
    interrupted = 0
    restores = []
    for kill in range(KILLS):
        receiver, sender = context.Pipe(duplex=False)
        child = context.Process(target=_train_until_killed, args=(root, sender), daemon=True)
        child.start()
        sender.close()
        assert receiver.poll(60), f"kill {kill}: the child never restored"
        start, whole = receiver.recv()
        restores.append(start)
        assert whole, f"kill {kill}: restored iteration {start} is torn"
        assert start == newest, f"kill {kill}: restored {start}, the newest commit was {newest}"
        time.sleep(rng.uniform(0.01, 0.3))
        os.kill(child.pid, signal.SIGKILL)
        child.join()
        receiver.close()

        store = CheckpointStore(root)
        assert torn_iterations(store) == [], f"kill {kill}: a committed checkpoint mixes iterations"
        latest = store.latest()
        step = latest.step if latest else 0
        assert step >= newest, f"kill {kill}: the newest commit went back from {newest} to {step}"
        newest = step
        interrupted += any(ref is None and fault is None for ref, _, fault in store.scan())
    assert newest > KILLS, "training made progress between kills"
    assert len(set(restores)) > KILLS // 2, "most restarts resumed from a newer checkpoint"
    assert interrupted >= KILLS // 5, f"only {interrupted} kills landed inside a write"
