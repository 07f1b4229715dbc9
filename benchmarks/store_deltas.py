"""``ray-checkfreq bench store --deltas``: sharded checkpoint bytes with and without XOR deltas.

A small MLP (``MODEL``) trained with Adam on a synthetic regression task; after
``--train-steps`` steps, ``--checkpoints`` checkpoints ``EVERY`` steps apart, each written the
way a sharded run writes one: ``WRITERS`` writers, each owning every ``WRITERS``-th layer
(its weights and Adam's moments of them), save their part and try the commit once, the
highest rank first (so rank 0 commits and every other rank only learns of the commit
later). The same checkpoints go into a store with deltas (``full_every=FULL_EVERY``) and
one without (``full_every=1``); every checkpoint is loaded back and compared bit for bit.
"""

from __future__ import annotations

import argparse
import shutil
import tempfile
import time
from typing import Any

import torch

from benchmarks.harness import write_json
from ray_checkfreq.storage import CheckpointStore
from ray_checkfreq.storage.chunks import Box
from ray_checkfreq.storage.part_files import ChunkSource

MODEL = (256, 768, 768, 256)  # layer widths: 1.0 M parameters, 4.1 MB of float32
BATCH = 32
LR = 1e-3
EVERY = 10
FULL_EVERY = 8
WRITERS = 2


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--train-steps", type=int, default=300,
                        help="with --deltas: Adam steps before the first checkpoint (default 300)")
    parser.add_argument("--checkpoints", type=int, default=10,
                        help=f"with --deltas: checkpoints taken, {EVERY} steps apart (default 10)")


def _model() -> torch.nn.Module:
    layers: list[torch.nn.Module] = []
    for width_in, width_out in zip(MODEL, MODEL[1:]):
        layers += [torch.nn.Linear(width_in, width_out), torch.nn.GELU()]
    return torch.nn.Sequential(*layers[:-1])


def _snapshot(model: torch.nn.Module, opt: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    """The checkpoint's tensors by key: ``model/...`` and ``optim/...`` (Adam's moments)."""
    state = {f"model/{k}": v.detach().clone() for k, v in model.state_dict().items()}
    names = {id(p): k for k, p in model.named_parameters()}
    for param, moments in opt.state.items():
        for kind, value in moments.items():
            if isinstance(value, torch.Tensor) and value.numel() > 1:
                state[f"optim/{names[id(param)]}.{kind}"] = value.detach().clone()
    return state


def train(train_steps: int, checkpoints: int) -> list[tuple[int, dict[str, torch.Tensor]]]:
    """(step, tensors) of each checkpoint."""
    torch.manual_seed(0)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # small matrices: more threads only contend (a loaded machine most of all)
    try:
        return _train(train_steps, checkpoints)
    finally:
        torch.set_num_threads(threads)


def _train(train_steps: int, checkpoints: int) -> list[tuple[int, dict[str, torch.Tensor]]]:
    model = _model()
    target = torch.nn.Linear(MODEL[0], MODEL[-1])
    opt = torch.optim.Adam(model.parameters(), lr=LR)
    taken = []
    last = train_steps + (checkpoints - 1) * EVERY
    for step in range(1, last + 1):
        x = torch.randn(BATCH, MODEL[0])
        with torch.no_grad():
            y = target(x)
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        if step >= train_steps and (step - train_steps) % EVERY == 0:
            taken.append((step, _snapshot(model, opt)))
    return taken


def _write(root: str, full_every: int, checkpoints: list[tuple[int, dict[str, torch.Tensor]]]) -> dict[str, Any]:
    """Every checkpoint into a fresh store at ``root``: bytes per checkpoint and per part."""
    first = CheckpointStore(root, codec="rcfz", full_every=full_every, keep_last=len(checkpoints) + 1)
    generation = first.acquire_writer()
    writers = [first] + [CheckpointStore(root, codec="rcfz", full_every=full_every, keep_last=len(checkpoints) + 1,
                                         writer_generation=generation) for _ in range(WRITERS - 1)]
    rows, seconds = [], 0.0
    for step, state in checkpoints:
        keys = sorted(state)
        owners = _owners(keys)
        started = time.perf_counter()
        delta_ranks = []
        for rank in reversed(range(WRITERS)):
            chunks = [ChunkSource(key=k, data=state[k], global_shape=tuple(state[k].shape),
                                  offsets=(0,) * state[k].dim(), rank=rank) for k in keys if owners[k] == rank]
            part = writers[rank].save_part(step, world_size=WRITERS, skeletons={rank: {}}, chunks=chunks)
            if part.delta_base is not None:
                delta_ranks.append(rank)
            writers[rank].try_commit(step)
        seconds += time.perf_counter() - started
        reader = first.reader(step)
        by_kind = {"model": 0, "optim": 0}
        for tensor in reader.manifest.tensors:
            by_kind[tensor.key.split("/")[0]] += sum(c.length for c in tensor.chunks)
        loaded = reader.load_boxes({k: [Box((0,) * state[k].dim(), tuple(state[k].shape))] for k in keys})
        if not all(torch.equal(loaded[k][0], state[k]) for k in keys):
            raise SystemExit(f"step {step} (full_every={full_every}) did not load back bit for bit")
        rows.append({"step": step, "bytes": reader.manifest.size_bytes, "model_bytes": by_kind["model"],
                     "optim_bytes": by_kind["optim"], "delta_ranks": sorted(delta_ranks)})
    return {"rows": rows, "save_s": seconds}


def _owners(keys: list[str]) -> dict[str, int]:
    """The writer of each key: layer ``i`` (``model/<i>.weight`` and its moments) is rank ``i % WRITERS``."""
    layers = sorted({int(k.split("/")[1].split(".")[0]) for k in keys})
    return {k: layers.index(int(k.split("/")[1].split(".")[0])) % WRITERS for k in keys}


def run(args: argparse.Namespace) -> int:
    if args.train_steps < 1 or args.checkpoints < 1:
        raise ValueError(f"--train-steps={args.train_steps}, --checkpoints={args.checkpoints}: must be >= 1")
    started = time.perf_counter()
    checkpoints = train(args.train_steps, args.checkpoints)
    train_s = time.perf_counter() - started
    raw = sum(v.numel() * v.element_size() for v in checkpoints[0][1].values())
    root = args.dir or tempfile.mkdtemp(prefix="rcf-bench-deltas-")
    try:
        full = _write(f"{root}/full", 1, checkpoints)
        delta = _write(f"{root}/delta", FULL_EVERY, checkpoints)
    finally:
        shutil.rmtree(f"{root}/full", ignore_errors=True)
        shutil.rmtree(f"{root}/delta", ignore_errors=True)
        if not args.dir:
            shutil.rmtree(root, ignore_errors=True)
    _print(args.train_steps, raw, train_s, full, delta)
    write_json(args.json, {"train_steps": args.train_steps, "raw_bytes": raw, "model": list(MODEL),
                           "every": EVERY, "full_every": FULL_EVERY, "writers": WRITERS,
                           "without_deltas": full, "with_deltas": delta})
    return 0


def _print(train_steps: int, raw: int, train_s: float, full: dict, delta: dict) -> None:
    print(f"MLP {'-'.join(map(str, MODEL))} + Adam (lr={LR}), {len(full['rows'])} checkpoints {EVERY} steps apart from "
          f"step {train_steps} ({train_s:.0f} s of training); {raw / 1e6:.1f} MB raw each; {WRITERS} writers, "
          f"rcfz; deltas: full_every={FULL_EVERY}")
    print(f"{'step':>6} {'no deltas':>10} {'deltas':>10} {'ratio':>7} {'model':>7} {'optim':>7}  delta parts (ranks)")
    for plain, mine in zip(full["rows"], delta["rows"]):
        print(f"{plain['step']:>6} {plain['bytes']:>10} {mine['bytes']:>10} {mine['bytes'] / plain['bytes']:>7.1%} "
              f"{mine['model_bytes'] / plain['model_bytes']:>7.1%} {mine['optim_bytes'] / plain['optim_bytes']:>7.1%}"
              f"  {mine['delta_ranks']}")
    totals = [sum(r[k] for r in run["rows"]) for run in (full, delta) for k in ("bytes", "model_bytes", "optim_bytes")]
    print(f"{'total':>6} {totals[0]:>10} {totals[3]:>10} {totals[3] / totals[0]:>7.1%} "
          f"{totals[4] / totals[1]:>7.1%} {totals[5] / totals[2]:>7.1%}")
    print(f"save time, all checkpoints: {full['save_s']:.2f} s without deltas, {delta['save_s']:.2f} s with")
