"""``ray-checkfreq bench sharded``: FSDP2 (DTensor) state checkpointed by ours against PyTorch
DCP, per checkpoint, on spawned gloo ranks (issue 25).

Not a ``TorchTrainer`` job: Ray adds start-up cost, not checkpoint cost (the Ray path is
tested in tests/test_ray_sharded.py). Each round trains the same iterations four ways:
no checkpoints (the baseline), ours every k, ``dcp.async_save`` every k (waiting for the
previous future first, as a user must) and ``dcp.save`` every k (what
``ray.train.report(checkpoint=...)`` of a DCP save costs). Then restores: ours at the saved
world size, ours onto one rank fewer (resharding, ranged reads: 2 -> 1, 4 -> 3), DCP's load at the saved world size.
The ranks are in benchmarks/sharded_job.py. ``--ray`` runs benchmarks/sharded_ray.py instead:
ours with and without peer copies in one ``TorchTrainer`` run, and restores from the own
slot, a peer copy and storage.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import tempfile
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

from benchmarks import sharded_job as job
from benchmarks.harness import add_json_argument, machine_info, write_json
from benchmarks.sharded_job import Settings

MiB = job.MiB
STALL_TARGET = 5.0  # ours' stall at least this many times below async_save's


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--ray", action="store_true",
                        help="one TorchTrainer run on simulated one-CPU nodes instead: ours with and without peer "
                             "copies, then restores from the own slot, a peer copy and storage")
    parser.add_argument("--workers", type=int, default=2, help="--ray: Ray Train workers, one per simulated node")
    parser.add_argument("--ranks", type=int, default=2, help="gloo ranks (processes; without --ray)")
    parser.add_argument("--state-mb", type=float, default=64, help="params + Adam moments in all, MiB (float32)")
    parser.add_argument("--width", type=int, default=1024, help="width of each Linear layer")
    parser.add_argument("--batch", type=int, default=32, help="samples per rank per iteration")
    parser.add_argument("--iterations", type=int, default=40, help="iterations per variant and round")
    parser.add_argument("--every", type=int, default=5, help="checkpoint interval k in iterations")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds (figures are medians)")
    add_json_argument(parser)


def run(args: argparse.Namespace) -> int:
    if args.ray:
        from benchmarks import sharded_ray

        return sharded_ray.run(args)
    started = time.perf_counter()
    settings = job.Settings(ranks=args.ranks, state_mb=args.state_mb, width=args.width, batch=args.batch,
                            iterations=args.iterations, every=args.every, rounds=args.rounds)
    print(_intro(settings))
    root = Path(tempfile.mkdtemp(prefix="rcf-bench-sharded-"))
    try:
        job.write_settings(root, settings)
        job.spawn(job.save_job, settings.ranks, root)
        job.spawn(job.restore_job, settings.ranks, root)
        job.spawn(job.restore_job, settings.ranks - 1, root)
        saves = json.loads((root / "results-save.json").read_text())
        restores = {world: json.loads((root / f"results-restore-{world}.json").read_text())
                    for world in (settings.ranks, settings.ranks - 1)}
    finally:
        shutil.rmtree(root, ignore_errors=True)
    described = {**asdict(settings), "layers": settings.layers, "state_bytes": settings.state_bytes}
    figures: dict[str, Any] = {"settings": described, "variants": save_figures(saves, settings),
                               "restore": restore_figures(restores, settings), "machine": machine_info()}
    figures["targets"] = targets(figures["variants"])
    figures["wall_s"] = time.perf_counter() - started
    print(table(figures))
    write_json(args.json, figures)
    return 0


def _intro(settings: Settings) -> str:
    return (f"bench sharded: FSDP2 over {settings.ranks} spawned gloo ranks (CPU), {settings.layers} Linear layers "
            f"of {settings.width}, float32 params + Adam moments {settings.state_bytes / MiB:.0f} MiB in all; "
            f"{settings.rounds} interleaved rounds of {settings.iterations} iterations, checkpoint every "
            f"{settings.every}.\nNot a TorchTrainer job: Ray adds start-up cost, not checkpoint cost (the Ray path "
            "is tested in tests/test_ray_sharded.py). Stall: time in checkpoint calls (ours: cf.step() and the "
            "fence in optimizer.step()); a run's first checkpoint builds what later ones reuse, so it is shown "
            "apart. Peak RSS: VmHWM reset (/proc/self/clear_refs) before each variant; "
            "restores read files the page cache holds.")



# ------------------------------------------------------------------ figures
def save_figures(saves: list[list[dict]], settings: Settings) -> dict:
    """Per variant: stall per checkpoint (median over rounds; rank 0 and the slowest rank),
    slowdown per checkpoint against the same round's baseline (wall: the slowest rank)."""
    ranks = len(saves)
    by_variant: dict[str, dict] = {}
    for name in job.VARIANTS:
        runs = [[entry for entry in rank_runs if entry["variant"] == name] for rank_runs in saves]
        walls = [max(runs[r][n]["wall_s"] for r in range(ranks)) for n in range(settings.rounds)]
        checkpoints = [runs[0][n]["checkpoints"] for n in range(settings.rounds)]
        stall_by_rank = [statistics.median(e["stall_s"] / max(e["checkpoints"], 1) for e in runs[r])
                         for r in range(ranks)]
        first, later = interval_figures(runs)
        by_variant[name] = {"wall_s": walls, "checkpoints": checkpoints,
                            "stall_s_per_checkpoint": {"rank0": stall_by_rank[0], "slowest": max(stall_by_rank),
                                                       "by_rank": stall_by_rank},
                            "stall_s_first_checkpoint": {"slowest": max(first), "by_rank": first},
                            "stall_s_later_checkpoints": {"slowest": max(later), "by_rank": later},
                            **rss_figures(runs)}
        if name == "ours":
            steps = [s for r in range(ranks) for e in runs[r] for s in e["off_checkpoint_step_s"]]
            by_variant[name]["step_s_off_checkpoint_median"] = statistics.median(steps) if steps else 0.0
            by_variant[name]["engine_stall_s_per_checkpoint"] = statistics.median(
                e["engine_stall_s"] / max(e["checkpoints"], 1) for r in range(ranks) for e in runs[r])
    baseline = by_variant["baseline"]["wall_s"]
    for name, entry in by_variant.items():
        per_round = [(wall - base) / max(count, 1) for wall, base, count in
                     zip(entry["wall_s"], baseline, entry["checkpoints"])]
        entry["slowdown_s_per_checkpoint"] = statistics.median(per_round) if name != "baseline" else 0.0
        entry["slowdown_per_round_s"] = per_round
    return by_variant


def interval_figures(runs: list[list[dict]]) -> tuple[list[float], list[float]]:
    """Per rank: the stall of a run's first checkpoint (median over rounds), which builds
    what later ones reuse (ours: the snapshot plan and buffers; DCP: its planning and
    threads), and the median stall of every later checkpoint of every round."""
    first, later = [], []
    for rank_runs in runs:
        intervals = [e["interval_stall_s"] for e in rank_runs if e["interval_stall_s"]]
        first.append(statistics.median(i[0] for i in intervals) if intervals else 0.0)
        rest = [s for i in intervals for s in i[1:]]
        later.append(statistics.median(rest) if rest else 0.0)
    return first, later


def restore_figures(restores: dict[int, list[list[dict]]], settings: Settings) -> dict:
    fewer = settings.ranks - 1
    labels = {(settings.ranks, "ours"): f"ours, storage, {settings.ranks} ranks",
              (fewer, "ours"): f"ours, storage, {settings.ranks} -> {fewer} rank{'s' * (fewer > 1)} (resharding)",
              (settings.ranks, "dcp load"): f"dcp.load, {settings.ranks} ranks"}
    found: dict[str, dict] = {}
    for (world, name), label in labels.items():
        runs = [[entry for entry in rank_runs if entry["variant"] == name] for rank_runs in restores[world]]
        seconds = [max(runs[r][n]["seconds"] for r in range(world)) for n in range(settings.rounds)]
        found[label] = {"seconds": seconds, "median_s": statistics.median(seconds),
                        "iteration": [runs[0][n]["iteration"] for n in range(settings.rounds)],
                        "phases_s": phase_figures(runs), **rss_figures(runs)}
    return found


def phase_figures(runs: list[list[dict]]) -> dict[str, float] | None:
    """Each phase of ours' restore: the median over rounds of the slowest rank's seconds."""
    if any(entry.get("phases_s") is None for rank_runs in runs for entry in rank_runs):
        return None
    phases = list(runs[0][0]["phases_s"])
    return {phase: statistics.median(max(rank_runs[n]["phases_s"].get(phase, 0.0) for rank_runs in runs)
                                     for n in range(len(runs[0])))
            for phase in phases}


def rss_figures(runs: list[list[dict]]) -> dict:
    """Per rank: the highest peak RSS over rounds, and the largest rise above the RSS at the reset."""
    return {"peak_rss_bytes": [max(e["peak_rss_bytes"] for e in rank_runs) for rank_runs in runs],
            "rss_rise_bytes": [max(e["peak_rss_bytes"] - e["rss_at_start_bytes"] for e in rank_runs)
                               for rank_runs in runs]}


def targets(variants: dict) -> dict:
    """The stall target on the later checkpoints (what a long run pays per checkpoint);
    the ratio over every checkpoint, the first included, goes along."""
    ours, dcp_async = variants["ours"], variants["dcp async_save"]

    def below(key: str) -> float:
        stall_ours, stall_async = ours[key]["slowest"], dcp_async[key]["slowest"]
        return stall_async / stall_ours if stall_ours > 0 else float("inf")

    stall_ratio = below("stall_s_later_checkpoints")
    return {"stall_below_async_x": stall_ratio, "stall_met": stall_ratio >= STALL_TARGET,
            "stall_below_async_x_all_checkpoints": below("stall_s_per_checkpoint"),
            "slowdown_ours_s": ours["slowdown_s_per_checkpoint"],
            "slowdown_async_s": dcp_async["slowdown_s_per_checkpoint"],
            "slowdown_met": ours["slowdown_s_per_checkpoint"] <= dcp_async["slowdown_s_per_checkpoint"]}


# ------------------------------------------------------------------ the table
def _below(variants: dict, entry: dict, key: str) -> str:
    """How many times ``entry``'s stall (slowest rank) is below async_save's."""
    ours, theirs = entry[key]["slowest"], variants["dcp async_save"][key]["slowest"]
    return f"{theirs / ours:.1f}x" if ours > 0 else "-"


def ms(seconds: float) -> str:
    return f"{1000 * seconds:.1f} ms"


def mib_per_rank(entry: dict) -> str:
    return " / ".join(f"{peak / MiB:.0f} (+{rise / MiB:.0f})"
                      for peak, rise in zip(entry["peak_rss_bytes"], entry["rss_rise_bytes"]))


def table(figures: dict) -> str:
    variants, restores, aims = figures["variants"], figures["restore"], figures["targets"]
    base_wall = statistics.median(variants["baseline"]["wall_s"])
    lines = ["", "| variant | stall / ckpt, rank 0 | slowest rank | first ckpt | later ckpts (median) | "
             "x below async_save (all / later) | slowdown / ckpt | vs baseline wall | ckpts per round | "
             "peak RSS per rank, MiB (rise) |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for name, entry in variants.items():
        stall = entry["stall_s_per_checkpoint"]
        below = "-" if name == "baseline" else " / ".join(
            _below(variants, entry, key) for key in ("stall_s_per_checkpoint", "stall_s_later_checkpoints"))
        extra = statistics.median(entry["wall_s"]) / base_wall - 1
        lines.append(f"| {name} | {ms(stall['rank0'])} | {ms(stall['slowest'])} | "
                     f"{ms(entry['stall_s_first_checkpoint']['slowest'])} | "
                     f"{ms(entry['stall_s_later_checkpoints']['slowest'])} | {below} | "
                     f"{ms(entry['slowdown_s_per_checkpoint'])} | {100 * extra:+.1f} % | "
                     f"{'/'.join(str(c) for c in entry['checkpoints'])} | {mib_per_rank(entry)} |")
    phases = next((list(e["phases_s"]) for e in restores.values() if e.get("phases_s")), [])
    lines += ["", "| restore | median (slowest rank) | rounds | iteration | peak RSS per rank, MiB (rise) | "
              + "".join(f"{phase} | " for phase in phases),
              "|---|---|---|---|---|" + "---|" * len(phases)]
    for label, entry in restores.items():
        rounds = ", ".join(ms(s) for s in entry["seconds"])
        split = entry.get("phases_s") or {}
        lines.append(f"| {label} | {ms(entry['median_s'])} | {rounds} | {entry['iteration'][0]} | "
                     f"{mib_per_rank(entry)} | " + "".join(f"{ms(split[p]) if p in split else '-'} | "
                                                            for p in phases))
    ours = variants["ours"]
    lines += ["", f"ours: cf.step() on an iteration without a checkpoint {ms(ours['step_s_off_checkpoint_median'])} "
              f"(median; the decision exchange, counted in its stall); the engine's own stall count "
              f"{ms(ours['engine_stall_s_per_checkpoint'])} per checkpoint"]
    lines += [f"baseline wall per round: {', '.join(f'{w:.2f} s' for w in variants['baseline']['wall_s'])}",
              f"target: stall at least {STALL_TARGET:.0f}x below async_save (slowest rank, later checkpoints): "
              f"{aims['stall_below_async_x']:.1f}x, {'met' if aims['stall_met'] else 'not met'} (every checkpoint, "
              f"the first included: {aims['stall_below_async_x_all_checkpoints']:.1f}x)",
              f"target: slowdown per checkpoint no worse than async_save's: {ms(aims['slowdown_ours_s'])} vs "
              f"{ms(aims['slowdown_async_s'])}, {'met' if aims['slowdown_met'] else 'not met'}",
              "restore phases (ours; each the median of the slowest rank's; each restore starts with no manifest "
              "decoded, as a restarted process): find = list the store for the step (reads and checks every "
              "listed manifest), manifest = the global manifest (decoded by find already), skeleton = this rank's "
              "skeleton and the optimizer's state created, plan = the boxes to read, read = ranged reads and "
              "decode into place, fill = model and optimizer set, rest = extra state, data and RNG",
              "not measured here: restore from the own slot and a peer copy (the Ray layer's; see bench sharded --ray)",
              f"whole run: {figures['wall_s']:.1f} s"]
    return "\n".join(lines)
