"""``ray-checkfreq bench sharded --ray``: FSDP2 (DTensor) state under
``ray_checkfreq.ray.CheckFreq`` in ONE ``TorchTrainer`` run, with and without peer copies.

``--workers`` W workers, one per simulated one-CPU node of a local ``cluster_utils.Cluster``
(the head one of them). Interleaved rounds (every other one in reverse) train the same
iterations three ways: no checkpoints; ours every k with peer copies (the default); ours
every k with ``RayConfig(peer_copies=False)``. After the last round's run with peer copies,
one more checkpoint is taken untimed and every rank restores it, timed inside the training
function: from its own slot, from its peer copy on the next node, from storage. No restart:
the restore protocol's choice is not timed, only each rank's read and load. The training
function is benchmarks/sharded_ray_job.py.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from dataclasses import asdict
from typing import Any

from benchmarks import sharded_ray_job as job
from benchmarks.harness import machine_info, write_json
from benchmarks.ray_bench import TRAIN_RESOURCE, local_cluster
from benchmarks.sharded import mib_per_rank, ms, rss_figures
from benchmarks.sharded_job import MiB, Settings
from ray_checkfreq.chaos.harness import TrainJob, fit_job

PEER_RESTORE_TARGET = 3.0  # restore from a peer copy at least this many times faster than from storage
RESTORE_REPEATS = 5
FIT_TIMEOUT_S = 3600.0
RESTORE_LABELS = {"slot": "own slot (/dev/shm on its node)", "peer": "peer copy (next node's agent)",
                  "storage": "storage (page cache)",
                  "storage cold": "storage, page cache dropped (as on a new node)"}


def settings_of(args: argparse.Namespace) -> Settings:
    if isinstance(args.workers, bool) or not isinstance(args.workers, int) or args.workers < 2:
        raise ValueError(f"--workers: at least 2 (a peer copy goes to another node), got {args.workers!r}")
    return Settings(ranks=args.workers, state_mb=args.state_mb, width=args.width, batch=args.batch,
                    iterations=args.iterations, every=args.every, rounds=args.rounds)


def run(args: argparse.Namespace) -> int:
    settings = settings_of(args)
    started = time.perf_counter()
    load_before = os.getloadavg()[0]
    print(intro(settings))
    with tempfile.TemporaryDirectory(prefix="rcf-bench-sharded-ray-") as work_dir:
        results_path = os.path.join(work_dir, "results.json")
        config = {"settings": asdict(settings), "work_dir": work_dir, "results_path": results_path,
                  "restore_repeats": RESTORE_REPEATS}
        # Room for the peer copies on their way (the sender's and the receiver's store) and the reads back.
        object_store = max(256 * MiB, 4 * settings.state_bytes // settings.ranks + 64 * MiB)
        with local_cluster(settings.ranks, object_store_bytes=object_store):
            fit_job(TrainJob(train=job.train, config=config, name="bench-sharded-ray",
                             storage_path=os.path.join(work_dir, "results"), workers=settings.ranks,
                             resources_per_worker={"CPU": 1, TRAIN_RESOURCE: 1}, timeout_s=FIT_TIMEOUT_S))
        with open(results_path) as f:
            gathered = json.load(f)
    described = {**asdict(settings), "workers": settings.ranks, "layers": settings.layers,
                 "state_bytes": settings.state_bytes}
    figures: dict[str, Any] = {"settings": described, "variants": variant_figures(gathered, settings),
                               "restore": restore_figures(gathered), "machine": machine_info()}
    figures["targets"] = targets(figures["restore"])
    figures["load_average"] = {"before": load_before, "after": os.getloadavg()[0]}
    figures["wall_s"] = time.perf_counter() - started
    print(table(figures))
    write_json(args.json, figures)
    return 0


def intro(settings: Settings) -> str:
    return (f"bench sharded --ray: FSDP2 in one TorchTrainer run, {settings.ranks} workers on {settings.ranks} "
            f"simulated one-CPU nodes (ray.cluster_utils.Cluster on this machine), {settings.layers} Linear layers "
            f"of {settings.width}, float32 params + Adam moments {settings.state_bytes / MiB:.0f} MiB in all; "
            f"{settings.rounds} interleaved rounds of {settings.iterations} iterations, checkpoint every "
            f"{settings.every}; variants {', '.join(job.VARIANTS)} (ours: uncompressed, "
            "RayConfig(registration=None)).\nStall: the engine's stall_s_total per checkpoint, and the loop's time in "
            "cf.step() plus the fence waits. Wall: to the last checkpoint durable (cf.flush()). Peak RSS: VmHWM reset "
            "before each variant (slot pages this rank wrote count). Restores: every rank, after the last round's "
            f"'{job.PEER}' and one more untimed checkpoint, {RESTORE_REPEATS} repeats after an untimed one; "
            "storage twice: as this machine's page cache holds it, and with its files dropped from the page cache "
            "(fsync, POSIX_FADV_DONTNEED) as a restart on a new node finds it.")


# ------------------------------------------------------------------ figures
def _runs(gathered: list[list[dict]], name: str) -> list[list[dict]]:
    """Per rank, the variant's runs in round order."""
    return [sorted((e for e in rank_runs if e["variant"] == name), key=lambda e: e["round"]) for rank_runs in gathered]


def variant_figures(gathered: list[list[dict]], settings: Settings) -> dict:
    """Per variant: wall per round (slowest rank), slowdown per checkpoint against the same
    round's baseline (median over rounds), stall per checkpoint (median over rounds per
    rank; the slowest rank), peer copies per round (all ranks), peak RSS per rank."""
    found: dict[str, dict] = {}
    for name in job.VARIANTS:
        runs = _runs(gathered, name)
        walls = [max(rank_runs[n]["wall_s"] for rank_runs in runs) for n in range(settings.rounds)]
        entry: dict[str, Any] = {"wall_s": walls, "checkpoints": [runs[0][n]["checkpoints"]
                                                                  for n in range(settings.rounds)],
                                 **rss_figures(runs)}
        if name != job.BASELINE:
            for key in ("engine_stall_s", "loop_stall_s"):
                by_rank = [statistics.median(e[key] / max(e["checkpoints"], 1) for e in rank_runs)
                           for rank_runs in runs]
                entry[f"{key}_per_checkpoint"] = {"slowest": max(by_rank), "by_rank": by_rank}
            entry["peer_copies"] = {count: [sum(rank_runs[n]["peer_copies"][count] for rank_runs in runs)
                                            for n in range(settings.rounds)] for count in ("sent", "skipped", "failed")}
            copy_s = [e["peer_copies"]["last_copy_s"] for rank_runs in runs for e in rank_runs
                      if e["peer_copies"]["last_copy_s"] is not None]
            entry["peer_copies"]["last_copy_s_median"] = statistics.median(copy_s) if copy_s else None
        found[name] = entry
    baseline = found[job.BASELINE]["wall_s"]
    for name, entry in found.items():
        per_round = [(wall - base) / max(count, 1) for wall, base, count in
                     zip(entry["wall_s"], baseline, entry["checkpoints"])]
        entry["slowdown_per_round_s"] = per_round
        entry["slowdown_s_per_checkpoint"] = statistics.median(per_round) if name != job.BASELINE else 0.0
    return found


def restore_figures(gathered: list[list[dict]]) -> dict:
    """Per source: each repeat's slowest rank, their median, and the iterations the ranks loaded."""
    per_rank = [next(e["restores"] for e in rank_runs if "restores" in e) for rank_runs in gathered]
    kinds: dict[str, dict] = {}
    for kind in job.RESTORE_KINDS:
        seconds = [max(values) for values in zip(*(rank["seconds"][kind] for rank in per_rank))]
        kinds[kind] = {"seconds": seconds, "median_s": statistics.median(seconds),
                       "by_rank_median_s": [statistics.median(rank["seconds"][kind]) for rank in per_rank],
                       "iterations": sorted({it for rank in per_rank for it in rank["iteration"][kind]})}
    return {"step": per_rank[0]["step"], "expected_step": per_rank[0]["expected_step"], "kinds": kinds,
            "held_by_rank": [rank["held"] for rank in per_rank]}


def targets(restore: dict) -> dict:
    """Against storage as a restart on a new node finds it (not in its page cache); against
    the page cache too."""
    kinds = restore["kinds"]
    ratio = kinds["storage cold"]["median_s"] / kinds["peer"]["median_s"]
    return {"peer_faster_than_storage_x": ratio, "peer_restore_met": ratio >= PEER_RESTORE_TARGET,
            "peer_faster_than_page_cache_x": kinds["storage"]["median_s"] / kinds["peer"]["median_s"]}


# ------------------------------------------------------------------ the table
def _copies(entry: dict) -> str:
    copies = entry.get("peer_copies")
    if copies is None:
        return "-"
    return "/".join(f"{sent}/{skipped}" for sent, skipped in zip(copies["sent"], copies["skipped"]))


def table(figures: dict) -> str:
    variants, restore, aims = figures["variants"], figures["restore"], figures["targets"]
    base_wall = statistics.median(variants[job.BASELINE]["wall_s"])
    lines = ["", "| variant | stall / ckpt, engine (slowest rank) | in cf.step() + fence | slowdown / ckpt | "
             "vs baseline wall | ckpts per round | peer copies sent/skipped per round | "
             "peak RSS per rank, MiB (rise) |", "|---|---|---|---|---|---|---|---|"]
    for name, entry in variants.items():
        engine = entry.get("engine_stall_s_per_checkpoint")
        loop = entry.get("loop_stall_s_per_checkpoint")
        extra = statistics.median(entry["wall_s"]) / base_wall - 1
        stalls = [ms(stall["slowest"]) if stall else "-" for stall in (engine, loop)]
        lines.append(f"| {name} | {stalls[0]} | {stalls[1]} | "
                     f"{ms(entry['slowdown_s_per_checkpoint'])} | {100 * extra:+.1f} % | "
                     f"{'/'.join(str(c) for c in entry['checkpoints'])} | {_copies(entry)} | {mib_per_rank(entry)} |")
    storage_s = restore["kinds"]["storage cold"]["median_s"]
    lines += ["", f"| restore of step {restore['step']}, every rank | median (slowest rank) | repeats | per rank "
              "(median) | iteration loaded | x faster than storage (dropped) |", "|---|---|---|---|---|---|"]
    for kind, entry in restore["kinds"].items():
        lines.append(f"| {RESTORE_LABELS[kind]} | {ms(entry['median_s'])} | "
                     f"{', '.join(ms(s) for s in entry['seconds'])} | "
                     f"{' / '.join(ms(s) for s in entry['by_rank_median_s'])} | "
                     f"{'/'.join(str(i) for i in entry['iterations'])} | {storage_s / entry['median_s']:.1f}x |")
    copy_s = variants[job.PEER]["peer_copies"]["last_copy_s_median"]
    load = figures["load_average"]
    lines += ["", f"peer copy of one rank's snapshot (the agent's pack and send): "
              f"{'not measured' if copy_s is None else ms(copy_s)} (median of each run's last)",
              f"baseline wall per round: {', '.join(f'{w:.2f} s' for w in variants[job.BASELINE]['wall_s'])}",
              f"target: restore from a peer copy at least {PEER_RESTORE_TARGET:.0f}x faster than from storage "
              f"(slowest rank; local disk, page cache dropped): {aims['peer_faster_than_storage_x']:.1f}x, "
              f"{'met' if aims['peer_restore_met'] else 'not met'}; from the page cache "
              f"{aims['peer_faster_than_page_cache_x']:.1f}x (a peer copy crosses the object store between simulated "
              "nodes of this machine)",
              f"load average (1 min) before / after: {load['before']:.2f} / {load['after']:.2f}",
              f"whole run: {figures['wall_s']:.1f} s"]
    return "\n".join(lines)
