"""The order part of ``ray-checkfreq bench iterator --num-samples N``: indices only, no payload.

Each measurement runs in a fresh child process (so its peak RSS is its own): it imports
the data layer, takes one batch of a small unrelated order (numpy's first calls), records
its RSS, builds ``IndexIterator`` for one rank, restores a state
at a position of epoch 0, times the first batch, then reads on for up to
``measure_samples`` samples and reports samples/s and its peak RSS (``VmHWM``). Time to
the first batch is the best of ``FIRST_BATCH_TRIES`` restores in the process, each with
its order built anew (version 1 builds its permutation each time). The order's own memory
is reported as an upper bound: the peak minus the RSS after imports (the import of torch
may itself have set the peak; 0 where the peak did not rise).

Version 2 (the keyed bijection) runs at ``N``; version 1 (today's permutation, 8 bytes a
sample) only where it fits ``max_permutation_bytes``. Both run at ``compare_samples``
(default 10^7) over one whole epoch from position 0, order construction included, for the
samples/s ratio. Rows are interleaved across repeats; times are the best of the repeats.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from typing import Any

POSITIONS = (0.0, 0.999)
FIRST_BATCH_TRIES = 5  # restores timed per process (each builds its order anew); the best counts


@dataclass(frozen=True, kw_only=True)
class OrderBenchConfig:
    num_samples: int
    compare_samples: int = 10_000_000
    measure_samples: int = 10_000_000
    batch_size: int = 256
    world_size: int = 1
    repeats: int = 3
    max_permutation_bytes: int = 2 * 2**30

    def __post_init__(self) -> None:
        for name in ("num_samples", "compare_samples", "measure_samples", "batch_size", "world_size", "repeats"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")


@dataclass(frozen=True)
class Case:
    num_samples: int
    version: int
    position: float
    samples: int  # how many to read after the restore (whole epoch rest if smaller)


def cases(cfg: OrderBenchConfig) -> list[Case]:
    out = []
    sizes = sorted({cfg.compare_samples, cfg.num_samples}, reverse=True)
    for n in sizes:
        for version in (2, 1):
            if version == 1 and 8 * n > cfg.max_permutation_bytes:
                continue
            for p in POSITIONS:
                samples = n if n == cfg.compare_samples and p == 0.0 else cfg.measure_samples
                out.append(Case(n, version, p, samples))
    return out


def _status_bytes(field: str) -> int:
    """``VmRSS`` (now) or ``VmHWM`` (its peak) of this process: one accounting for both, so
    the peak is never below a reading taken earlier (``ru_maxrss`` and statm can disagree)."""
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"/proc/self/status has no {field}")


def _rss_bytes() -> int:
    return _status_bytes("VmRSS")


def _first_batch_s(case: Case, sharding: Any, position: int) -> float:
    from ray_checkfreq.data.index import IndexIterator

    start = time.perf_counter()
    it = IndexIterator(case.num_samples, sharding=sharding, seed=0, order_version=case.version)
    it.load_state_dict({**it.state_dict(), "consumed": position})
    next(iter(it))
    return time.perf_counter() - start


def child(case: Case, batch_size: int, world_size: int) -> dict[str, Any]:
    """One measurement, in this (fresh) process."""
    from ray_checkfreq.data.core import Sharding
    from ray_checkfreq.data.index import IndexIterator

    sharding = Sharding(batch_size=batch_size, world_size=world_size, rank=0)
    warm = IndexIterator(1000, sharding=sharding, seed=1, order_version=case.version)
    next(iter(warm))  # numpy's first calls, not the order under test
    rss_imports = _rss_bytes()
    global_batch = batch_size * world_size
    position = int(case.num_samples * case.position) // global_batch * global_batch
    first_s = min(_first_batch_s(case, sharding, position) for _ in range(FIRST_BATCH_TRIES - 1))
    start = time.perf_counter()
    it = IndexIterator(case.num_samples, sharding=sharding, seed=0, order_version=case.version)
    it.load_state_dict({**it.state_dict(), "consumed": position})
    gen = iter(it)
    first = next(gen)
    first_s = min(first_s, time.perf_counter() - start)
    read, target = len(first), max(1, min(case.samples, case.num_samples - position) // world_size)
    for batch in gen:
        read += len(batch)
        if read >= target:
            break
    total_s = time.perf_counter() - start
    return {**asdict(case), "start_position": position, "first_batch_s": first_s, "read": read,
            "samples_per_s": read / total_s, "rss_after_imports": rss_imports,
            "peak_rss": _status_bytes("VmHWM")}


def _run_child(case: Case, cfg: OrderBenchConfig) -> dict[str, Any]:
    spec = json.dumps({"case": asdict(case), "batch_size": cfg.batch_size, "world_size": cfg.world_size})
    out = subprocess.run([sys.executable, "-m", "benchmarks.iterator_order", spec],
                         capture_output=True, text=True, timeout=1800)
    if out.returncode != 0:
        raise RuntimeError(f"order bench child {case} failed:\n{out.stderr[-2000:]}")
    return dict(json.loads(out.stdout.strip().splitlines()[-1]))


def measure_order(cfg: OrderBenchConfig) -> dict[str, Any]:
    runs: dict[Case, list[dict[str, Any]]] = {c: [] for c in cases(cfg)}
    for _ in range(cfg.repeats):
        for case in runs:
            runs[case].append(_run_child(case, cfg))
    rows = []
    for case, results in runs.items():
        rows.append({**asdict(case), "start_position": results[0]["start_position"],
                     "first_batch_s": min(r["first_batch_s"] for r in results),
                     "samples_per_s": max(r["samples_per_s"] for r in results),
                     "read": results[0]["read"],
                     "peak_rss_mib": max(r["peak_rss"] for r in results) / 2**20,
                     "order_rss_mib": max(max(0, r["peak_rss"] - r["rss_after_imports"]) for r in results) / 2**20})
    return {"config": asdict(cfg), "rows": rows, "summary": _summary(cfg, rows)}


def _row(rows: list[dict[str, Any]], n: int, version: int, position: float) -> dict[str, Any] | None:
    found = [r for r in rows if (r["num_samples"], r["version"], r["position"]) == (n, version, position)]
    return found[0] if found else None


def _summary(cfg: OrderBenchConfig, rows: list[dict[str, Any]]) -> dict[str, Any]:
    big0, big_end = _row(rows, cfg.num_samples, 2, 0.0), _row(rows, cfg.num_samples, 2, POSITIONS[-1])
    new, old = _row(rows, cfg.compare_samples, 2, 0.0), _row(rows, cfg.compare_samples, 1, 0.0)
    assert big0 is not None and big_end is not None and new is not None
    out: dict[str, Any] = {
        "order_rss_mib_at_n": max(big0["order_rss_mib"], big_end["order_rss_mib"]),
        "first_batch_ratio_end_to_start": big_end["first_batch_s"] / big0["first_batch_s"],
    }
    if old is not None:
        out["epoch_samples_per_s_ratio_v2_to_v1"] = new["samples_per_s"] / old["samples_per_s"]
    return out


def format_order(result: dict[str, Any]) -> list[str]:
    cfg = result["config"]
    lines = [f"order: indices only, rank 0 of {cfg['world_size']}, batch {cfg['batch_size']}; "
             f"a fresh process per row, best of {cfg['repeats']} (peak RSS: the worst)",
             f"  {'N':>14}{'version':>9}{'resume at':>11}{'first batch s':>15}{'samples/s':>13}"
             f"{'read':>12}{'peak RSS MiB':>14}{'order MiB <=':>14}"]
    for r in result["rows"]:
        lines.append(f"  {r['num_samples']:>14,}{r['version']:>9}{r['position']:>11.1%}{r['first_batch_s']:>15.4f}"
                     f"{r['samples_per_s']:>13,.0f}{r['read']:>12,}{r['peak_rss_mib']:>14.1f}"
                     f"{r['order_rss_mib']:>14.1f}")
    if 8 * cfg["num_samples"] > cfg["max_permutation_bytes"]:
        lines.append(f"  version 1 not run at N = {cfg['num_samples']:,}: its permutation needs "
                     f"{8 * cfg['num_samples'] / 2**30:.1f} GiB per rank")
    s = result["summary"]
    lines.append(f"  order memory at N = {cfg['num_samples']:,}: <= {s['order_rss_mib_at_n']:.1f} MiB "
                 f"(target < 100 MB); first batch at {POSITIONS[-1]:.1%} / at 0: "
                 f"{s['first_batch_ratio_end_to_start']:.2f}x")
    if "epoch_samples_per_s_ratio_v2_to_v1" in s:
        lines.append(f"  one epoch of {cfg['compare_samples']:,} from 0, samples/s version 2 / version 1: "
                     f"{s['epoch_samples_per_s_ratio_v2_to_v1']:.2f}x (target >= 1)")
    return lines


def main(argv: list[str]) -> int:
    spec = json.loads(argv[0])
    result = child(Case(**spec["case"]), spec["batch_size"], spec["world_size"])
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
