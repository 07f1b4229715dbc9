"""The loop ``test_chaos_kill_loop.py`` runs in a process of its own: train with the engine in
a forked child, SIGKILL it at a seeded random moment, check what survived, repeat.

Run as ``python chaos_kill_child.py ROOT KILLS SEED``; prints a JSON summary. Children
are forked from this process, which has imported torch and built its first optimizer
(~1.3 s of one-off set-up) on one thread, so each child starts at once and no thread
pool is forked.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import random
import signal
import sys
import time

import torch

from ray_checkfreq import CheckpointStore
from ray_checkfreq.chaos import CountingOptimizer, torn_iterations
from ray_checkfreq.engine import CheckFreq

torch.set_num_threads(1)
CountingOptimizer(torch.nn.Linear(2, 2).parameters())


def train_until_killed(root: str, conn) -> None:
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


def kill_loop(root: str, kills: int, seed: int) -> dict:
    rng = random.Random(seed)
    context = multiprocessing.get_context("fork")
    failures: list[str] = []
    newest = interrupted = 0
    restores = []
    for kill in range(kills):
        receiver, sender = context.Pipe(duplex=False)
        child = context.Process(target=train_until_killed, args=(root, sender), daemon=True)
        child.start()
        sender.close()
        if not receiver.poll(60):
            failures.append(f"kill {kill}: the child never restored")
            break
        start, whole = receiver.recv()
        restores.append(start)
        if not whole:
            failures.append(f"kill {kill}: restored iteration {start} is torn")
        if start != newest:
            failures.append(f"kill {kill}: restored {start}, the newest commit was {newest}")
        time.sleep(rng.uniform(0.01, 0.3))
        os.kill(child.pid, signal.SIGKILL)
        child.join()
        receiver.close()
        store = CheckpointStore(root)
        torn = torn_iterations(store)
        if torn:
            failures.append(f"kill {kill}: committed checkpoints {torn} mix iterations")
        latest = store.latest()
        step = latest.step if latest else 0
        if step < newest:
            failures.append(f"kill {kill}: the newest commit went back from {newest} to {step}")
        newest = max(newest, step)
        interrupted += any(ref is None and fault is None for ref, _, fault in store.scan())
    return {"failures": failures, "newest": newest, "restores": restores, "interrupted": interrupted}


if __name__ == "__main__":
    print(json.dumps(kill_loop(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]))))
