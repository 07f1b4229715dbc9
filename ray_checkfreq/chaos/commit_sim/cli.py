"""``ray-checkfreq simulate``: run the commit protocol's deterministic simulation at scale."""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import sys
import time
from collections.abc import Iterator
from typing import Any

from ray_checkfreq.chaos.commit_sim.runner import SimConfig, report, run_many, shrink
from ray_checkfreq.chaos.commit_sim.scheduler import Faults
from ray_checkfreq.chaos.commit_sim.workload import Workload

DESCRIPTION = """\
Runs seeded schedules of the checkpoint commit protocol: the real store code over an
in-memory storage whose every operation is a yield point, writers of several generations
(kills, pauses, zombies), readers, pointers and stray files, then a clean generation, and
checks the invariants of docs/guarantees.md after each. One seed is one schedule: a
failure prints its seed, the smallest workload that still fails, and the trace to it.
"""


def add_parser(sub: Any) -> argparse.ArgumentParser:
    parser = sub.add_parser("simulate", help="deterministic simulation of the commit protocol",
                            description=DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter)
    add = parser.add_argument
    add("--schedules", type=int, default=10_000, help="how many (default 10000)")
    add("--seed", type=int, default=0, help="the first schedule's seed (default 0)")
    add("--store", choices=("sharded", "replicated"), default="sharded",
        help="sharded: 1 to --max-world parts; replicated: CheckpointStore.save (default sharded)")
    add("--generations", type=int, default=Workload.generations)
    add("--steps", type=int, default=Workload.steps, help="steps each generation saves")
    add("--max-world", type=int, default=Workload.max_world)
    add("--readers", type=int, default=Workload.readers)
    add("--full-every", type=int, default=Workload.full_every,
        help="> 1: rcfz saves, XOR deltas between full ones (default 1: raw, no deltas)")
    add("--kill", type=float, default=Faults.kill, help="chance per yield point that the actor is killed")
    add("--pause", type=float, default=Faults.pause, help="chance per yield point that the actor pauses")
    add("--processes", type=int, default=os.cpu_count() or 1, help="worker processes (default: every core)")
    add("--json", default=None, help="write the summary here too")
    parser.set_defaults(func=run)
    return parser


def config_from_args(args: argparse.Namespace) -> SimConfig:
    workload = Workload(store=args.store, generations=args.generations, steps=args.steps,
                        max_world=args.max_world, readers=args.readers, full_every=args.full_every)
    return SimConfig(workload=workload, faults=Faults(kill=args.kill, pause=args.pause))


def run(args: argparse.Namespace) -> int:
    if args.schedules < 1 or args.processes < 1:
        raise ValueError("--schedules and --processes must be >= 1")
    config = config_from_args(args)
    started = time.monotonic()
    batches = _batches(args.seed, args.schedules, args.processes)
    done, failures = 0, []
    for count, failed in _results(batches, config, args.processes):
        done += count
        failures += failed
        _progress(done, args.schedules, started, failures)
    seconds = time.monotonic() - started
    summary = {"schedules": done, "seconds": round(seconds, 1), "schedules_per_second": round(done / seconds, 1),
               "processes": args.processes, "violations": len(failures), "failed_seeds": sorted(failures)[:100],
               "config": repr(config)}
    print(json.dumps(summary))
    if args.json:
        with open(args.json, "w") as out:
            json.dump(summary, out, indent=1)
    if failures:
        smallest, outcome = shrink(min(failures), config)
        print(report(outcome, smallest), file=sys.stderr)
        return 1
    return 0


def _results(batches: list[tuple[int, int]], config: SimConfig,
             processes: int) -> Iterator[tuple[int, list[int]]]:
    """Each batch's (schedules run, failing seeds), in this process or in forked workers."""
    jobs = [(first, count, config) for first, count in batches]
    if processes == 1:
        yield from map(_run_batch, jobs)
        return
    with multiprocessing.get_context("fork").Pool(processes) as pool:
        yield from pool.imap_unordered(_run_batch, jobs)


def _batches(first: int, count: int, processes: int, size: int = 500) -> list[tuple[int, int]]:
    size = max(1, min(size, count // (4 * processes) or 1))
    return [(seed, min(size, first + count - seed)) for seed in range(first, first + count, size)]


def _run_batch(job: tuple[int, int, SimConfig]) -> tuple[int, list[int]]:
    first, count, config = job
    summary = run_many(first, count, config)
    return summary.schedules, [outcome.seed for outcome in summary.failures]


def _progress(done: int, total: int, started: float, failures: list[int]) -> None:
    rate = done / max(time.monotonic() - started, 1e-9)
    seeds = f" (seeds {sorted(failures)[:10]})" if failures else ""
    print(f"{done}/{total} schedules, {rate:.0f}/s, {len(failures)} violation(s){seeds}", file=sys.stderr,
          flush=True)
