"""``ray-checkfreq bench persist``: the CPU one node agent's persist takes from a busy node.

The agent's work per checkpoint is a store save of a sealed slot. Measured four ways in
interleaved rounds (medians; the first round only warms files and caches), against the
first as the baseline:
- ``page_cache``: buffered writes, the store computes every leaf's crc32 (before O_DIRECT
  and checksums from the seal);
- ``page_cache_seal_crc``: buffered writes, the crc32s the rank computed at the seal;
- ``direct``: ``O_DIRECT`` from the slot, crc32 computed;
- ``direct_seal_crc``: both (what the agent does).
The state: ``--size-mb`` MiB of float32 in 4 MiB matrices (an MLP's weights and Adam
moments) plus small biases, laid out as in a slot (page-aligned mapping), stored raw.
"""

from __future__ import annotations

import argparse
import functools
import math
import mmap
import os
import shutil
import statistics
import tempfile
import time
from typing import Any

import torch

from benchmarks.harness import add_json_argument, cpu_s, interleave, write_json
from ray_checkfreq.ray import slots
from ray_checkfreq.storage import CheckpointStore
from ray_checkfreq.storage.arrays import leaf_bytes
from ray_checkfreq.storage.checksum import crc32
from ray_checkfreq.storage.tree import flatten_state

VARIANTS = {"page_cache": (False, False), "page_cache_seal_crc": (False, True), "direct": (True, False),
            "direct_seal_crc": (True, True)}
BASELINE = "page_cache"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--size-mb", type=int, default=96, help="state size in MiB (default 96, as bench ray)")
    parser.add_argument("--repeats", type=int, default=6, help="interleaved rounds (default 6; the first is warm-up)")
    parser.add_argument("--dir", default=None, help="local directory to write into (default: a temp dir)")
    add_json_argument(parser)


def slot_like_state(size_mb: int) -> tuple[dict[str, torch.Tensor], mmap.mmap]:
    """About ``size_mb`` MiB of 4 MiB matrices (1024 x 1024, as ``bench ray``'s MLP and its Adam
    moments) and a bias each, at their slot offsets."""
    torch.manual_seed(0)
    layout = slots.slot_layout([path for i in range(max(1, size_mb // 4)) for path in (
        ((f"w{i}",), (1024, 1024), torch.float32), ((f"b{i}",), (1024,), torch.float32))])
    pages = mmap.mmap(-1, layout.data_bytes)
    state = {}
    for (key,), (offset, shape, dtype) in layout.entries.items():
        view = torch.frombuffer(pages, dtype=dtype, offset=offset, count=math.prod(shape)).view(shape)
        view.copy_(torch.randn(shape))
        state[key] = view
    return state, pages


def measure(state: dict, root: str, repeats: int) -> dict[str, list[dict]]:
    seal_crcs = [crc32(leaf_bytes(leaf)) for leaf in flatten_state(state).leaves]

    def persist(direct: bool, given: bool) -> dict:
        shutil.rmtree(root, ignore_errors=True)
        store = CheckpointStore(root, full_every=1, direct_io=direct)
        cpu, wall = cpu_s(), time.perf_counter()
        store.save(1, state, codec="raw", raw_crc32=seal_crcs if given else None)
        return {"cpu_s": cpu_s() - cpu, "wall_s": time.perf_counter() - wall}

    return interleave({name: functools.partial(persist, *flags) for name, flags in VARIANTS.items()}, repeats)


def summarize(runs: dict[str, list[dict]], size_mb: int) -> dict[str, Any]:
    medians = {name: {key: statistics.median(run[key] for run in rows[1:] or rows) for key in ("cpu_s", "wall_s")}
               for name, rows in runs.items()}
    base = medians[BASELINE]["cpu_s"]
    return {"size_mb": size_mb, "runs": runs, "median": medians,
            "cpu_vs_page_cache": {name: m["cpu_s"] / base for name, m in medians.items()}}


def print_table(figures: dict) -> None:
    print(f"one agent persist of a {figures['size_mb']} MiB slot (store save, raw, fsync + commit); "
          f"median of rounds after the first")
    print(f"{'variant':<22} {'CPU':>9} {'wall':>9} {'CPU vs page_cache':>18}")
    for name, median in figures["median"].items():
        print(f"{name:<22} {median['cpu_s'] * 1e3:>6.1f} ms {median['wall_s'] * 1e3:>6.1f} ms "
              f"{figures['cpu_vs_page_cache'][name]:>17.2f}x")


def run(args: argparse.Namespace) -> int:
    if args.size_mb < 1 or args.repeats < 2:
        raise ValueError(f"--size-mb={args.size_mb} must be >= 1 and --repeats={args.repeats} >= 2")
    state, pages = slot_like_state(args.size_mb)  # the views need ``pages`` mapped until the end
    base = args.dir or tempfile.mkdtemp(prefix="rcf-bench-persist-")
    root = os.path.join(base, "rcf-bench-persist-store")
    try:
        figures = summarize(measure(state, root, args.repeats), args.size_mb)
    finally:
        shutil.rmtree(root if args.dir else base, ignore_errors=True)
    del state, pages
    print_table(figures)
    write_json(args.json, figures)
    return 0
