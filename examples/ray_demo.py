"""The Ray Train demo behind ``make demo``: survive three kinds of preemption, bit for bit.

Starts a local Ray cluster with 2 simulated one-CPU nodes, trains a small float64 CNN on
scikit-learn's digits images with ``TorchTrainer`` (2 workers, DDP over gloo) and
ray_checkfreq checkpointing to a local store, and meanwhile preempts it three times: a
worker process killed (SIGKILL), a node lost and replaced 3 s later (as an autoscaler
would), and a drain notice (the job checkpoints before the node goes). Each time Ray
Train restarts the job and it resumes from the newest checkpoint. At the end the final
weights are compared with those of an uninterrupted run (run once and cached in
``~/.cache/ray_checkfreq/chaos``): the last line says whether they are identical, and
the exit status is 1 if they are not (or the run failed a check), 2 for bad flags.

The job is ``ray_checkfreq.chaos.job`` run by ``ray_checkfreq.chaos.runner`` (as by
``ray-checkfreq chaos --kinds worker,node,notice --nodes 2 --every 0 --iterations 112
--at 60,74,88``): k is chosen by the engine's policy (profiled over the first ~50
iterations, within a 3.5 % overhead budget) and shown as it changes; the demo also lets
the engine measure whether compression pays.

    python examples/ray_demo.py [--preemptions N] [--work-dir DIR] [--json OUT] [--png OUT]
                                [--s3-endpoint URL --s3-bucket NAME] [--gpu]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import tempfile
import time
from typing import Any

KINDS = ("worker", "node", "notice")
NODES = 2
WORKERS = 2
# The policy profiles ~50 iterations before it picks k (quiet iterations, then three
# measured checkpoints); a restart before that would profile again.
FIRST_PREEMPTION = 60
EPOCH_LEN = 28  # 1792 digits in global batches of 64
ALL_DIGITS = 1797
VERDICT_YES = "final weights identical to an uninterrupted run: yes"
VERDICT_NO = "final weights identical to an uninterrupted run: no"
SOURCES = {"slot": "a node's RAM copy", "storage": "storage", "none": "scratch", None: "-"}


class FlagError(ValueError):
    """A bad command-line flag (exit status 2)."""


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preemptions", type=int, default=3,
                        help="how many; kinds cycle worker, node, notice (default 3)")
    parser.add_argument("--work-dir", default=None, help="keep logs, stores and the timeline here "
                                                          "(default: a new temp dir)")
    parser.add_argument("--json", default=None, metavar="OUT", help="write the report and the table here")
    parser.add_argument("--png", default=None, metavar="OUT",
                        help="the timeline picture (default: <work dir>/timeline.png)")
    parser.add_argument("--s3-endpoint", default=None, metavar="URL",
                        help="checkpoint to this S3 endpoint (credentials from the AWS environment)")
    parser.add_argument("--s3-bucket", default=None, metavar="NAME", help="the bucket (it must exist)")
    parser.add_argument("--gpu", action="store_true", help="train on the GPU (exit 2 if there is none)")
    parser.add_argument("--cache-dir", default=None,
                        help="where the uninterrupted run's weights are cached (default ~/.cache/ray_checkfreq/chaos)")
    return parser.parse_args(argv)


def validate(args: argparse.Namespace, *, cuda_available: bool) -> None:
    """Raise ``FlagError`` naming the flag that cannot be used."""
    if args.preemptions < 0:
        raise FlagError(f"--preemptions={args.preemptions}: must be >= 0")
    if args.s3_endpoint is not None and not args.s3_bucket:
        raise FlagError(f"--s3-endpoint={args.s3_endpoint}: also give --s3-bucket NAME")
    if args.s3_bucket is not None and (not args.s3_bucket or "/" in args.s3_bucket):
        raise FlagError(f"--s3-bucket={args.s3_bucket!r}: expected a bucket name (no '/')")
    if args.gpu and not cuda_available:
        raise FlagError("--gpu: torch sees no CUDA device on this machine; run without --gpu")


def iterations_for(preemptions: int) -> int:
    """Whole epochs: the profile first, ~12 iterations of room per preemption, 24 after the last."""
    return EPOCH_LEN * max(2, math.ceil((FIRST_PREEMPTION + 12 * max(0, preemptions - 1) + 24) / EPOCH_LEN))


def preemption_iterations(preemptions: int, iterations: int) -> tuple[int, ...]:
    """Evenly from FIRST_PREEMPTION to 24 before the end: room for a notice's deadline and a restart."""
    first, last = FIRST_PREEMPTION, iterations - 24
    if preemptions <= 1:
        return (first,) * preemptions
    return tuple(round(first + n * (last - first) / (preemptions - 1)) for n in range(preemptions))


def chaos_config(args: argparse.Namespace, work_dir: str) -> Any:
    from ray_checkfreq.chaos.runner import ChaosConfig

    iterations = iterations_for(args.preemptions)
    return ChaosConfig(preemptions=args.preemptions, kinds=KINDS, nodes=NODES, workers=WORKERS, every=None,
                       iterations=iterations, at=preemption_iterations(args.preemptions, iterations) or None,
                       replace=True, work_dir=work_dir,
                       cache_dir=args.cache_dir, tolerance=0.0, compress=None, s3_endpoint=args.s3_endpoint,
                       s3_bucket=args.s3_bucket, use_gpu=args.gpu, log_stats=True, progress=_progress)


def _progress(line: str) -> None:
    """One line per event, commits left out (at the policy's k they come every iteration or
    two: the table counts them and the timeline marks them)."""
    if "] commit: " not in line:
        print(line, flush=True)


# ---------------------------------------------------------------------- the table (pure)
def engine_figures(events: list[dict]) -> dict:
    """The engine's figures over the whole run: rank 0's last ``stats``/``end`` of each attempt, combined.

    Overhead: the attempts' estimates weighted by the iterations each ran; compression:
    bytes stored over raw bytes; checkpoints: the sum of each attempt's commits.
    """
    starts = {e["attempt"]: e["iteration"] for e in events if e["event"] == "start" and e.get("rank") == 0}
    last: dict[int, dict] = {}
    for e in events:
        if e["event"] in ("stats", "end") and e.get("rank") == 0 and e.get("stats"):
            last[e["attempt"]] = e["stats"]
    weighted = iterations = stored = raw = commits = 0.0
    compress = None
    for attempt, stats in last.items():
        ran = max(0, stats["iteration"] - starts.get(attempt, 0))
        weighted += ran * (stats.get("overhead_estimate") or 0.0)
        iterations += ran
        commits += stats.get("checkpoints_committed") or 0
        if stats.get("compression_ratio"):
            stored += stats["bytes_written"]
            raw += stats["bytes_written"] / stats["compression_ratio"]
        compress = stats["compress"] if stats.get("compress") is not None else compress
    return {"overhead_estimate": weighted / iterations if iterations else None,
            "compression_ratio": stored / raw if raw else None, "compress": compress,
            "checkpoints_committed": int(commits)}


def summarize(report: dict, stats: dict, accuracy: float | None) -> dict:
    """The figures of the table, from the chaos report and the engine's end stats."""
    epochs = report["iterations"] / EPOCH_LEN
    commits = report["commits"] or stats.get("checkpoints_committed") or 0
    return {
        "iterations": report["iterations"],
        "epochs": epochs,
        "checkpoints_per_epoch": commits / epochs if epochs else 0.0,
        "k": report["k_max"],
        "overhead_percent": None if stats.get("overhead_estimate") is None else 100 * stats["overhead_estimate"],
        "compression_ratio": stats.get("compression_ratio"),
        "compressed": stats.get("compress"),
        "preemptions": [{"kind": p["kind"], "at_iteration": p["iteration"], "resumed_at": p["restored_step"],
                         "from": p["restored_from"], "lost_iterations": p["lost_iterations"]}
                        for p in report["detail"]["preemptions"]],
        "lost_bound": report["lost_iterations_bound"],
        "accuracy": accuracy,
        "identical": report["identical_to_uninterrupted"] is True,
        "max_abs_diff": report["max_abs_diff"],
    }


def table(summary: dict) -> list[str]:
    """The closing table; its last line is the verdict on the final weights."""
    overhead = summary["overhead_percent"]
    ratio = summary["compression_ratio"]
    codec = {True: "compressed", False: "stored raw: the codec's trial found it does not pay here",
             None: "not measured"}[summary["compressed"]]
    lines = [
        f"{'iterations':<34} {summary['iterations']} ({summary['epochs']:g} epochs of {EPOCH_LEN})",
        f"{'checkpoints per epoch':<34} {summary['checkpoints_per_epoch']:.1f}",
        f"{'k (iterations between checkpoints)':<34} {summary['k']} (chosen by the policy; the largest in force)",
        f"{'checkpoint overhead':<34} " + ("-" if overhead is None else
                                          f"{overhead:.1f} % (engine's estimate; iterations include 0.1 s pacing)"),
        f"{'compression (stored / state bytes)':<34} " + ("-" if ratio is None else f"{ratio:.2f} ({codec})"),
        f"{'preemptions':<34} {len(summary['preemptions'])} (lost work bound 2k = {summary['lost_bound']})",
    ]
    for n, p in enumerate(summary["preemptions"], 1):
        if p["resumed_at"] is None:
            lines.append(f"  {n}. {p['kind']:<7} fired at iteration {p['at_iteration']:>3}; no restart")
            continue
        reached = p["resumed_at"] + p["lost_iterations"]
        lines.append(f"  {n}. {p['kind']:<7} fired at iteration {p['at_iteration']:>3}; training reached {reached:>3}; "
                     f"the restart resumed at {p['resumed_at']:>3} (from {SOURCES.get(p['from'], p['from'])}); "
                     f"lost {p['lost_iterations']}")
        if p["kind"] == "notice":
            lines.append("     (a notice: training goes on until its deadline, the node leaves after a checkpoint)")
    accuracy = summary["accuracy"]
    lines.append(f"{'final accuracy':<34} " + ("-" if accuracy is None else
                 f"{100 * accuracy:.1f} % (training set: all {ALL_DIGITS} digit images; 1792 trained on)"))
    lines.append(VERDICT_YES if summary["identical"] else VERDICT_NO)
    return lines


def exit_code(summary: dict, failures: list[str]) -> int:
    return 0 if summary["identical"] and not failures else 1


def accuracy_of(final_path: str) -> float | None:
    """Accuracy of the final weights over every digits image (the job trained on the first 1792)."""
    import torch

    from ray_checkfreq.chaos.job import digits, small_cnn

    if not os.path.exists(final_path):
        return None
    model = small_cnn()
    model.load_state_dict(torch.load(final_path, weights_only=True)["model"])
    images, labels = digits(ALL_DIGITS)
    with torch.no_grad():
        return float((model(images).argmax(1) == labels).double().mean())


# ---------------------------------------------------------------------- main
def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        import torch

        validate(args, cuda_available=torch.cuda.is_available())
    except FlagError as err:
        print(f"ray_demo.py: error: {err}", file=sys.stderr)
        return 2
    from ray_checkfreq.chaos import runner
    from ray_checkfreq.chaos.cli import verdict

    work_dir = args.work_dir or tempfile.mkdtemp(prefix="rcf-demo-")
    os.makedirs(work_dir, exist_ok=True)
    started = time.monotonic()
    config = chaos_config(args, work_dir)
    try:
        result = runner.run_chaos(config)
    except Exception as err:  # the run could not be made at all (a store, a cluster): still a verdict
        print(f"FAILED: the demo run did not complete: {err!r}\n{VERDICT_NO}", flush=True)
        return 1
    stats = engine_figures(result["_events"])
    summary = summarize(result, stats, accuracy_of(os.path.join(result["work_dir"], "logs", "final.pt")))
    png = args.png or os.path.join(work_dir, "timeline.png")
    runner.write_outputs(result, json_path=None, png_path=png,
                         title=f"ray_checkfreq demo: {args.preemptions} preemptions ({', '.join(KINDS)}), "
                               f"{WORKERS} workers on {NODES} nodes, k chosen by the policy")
    if args.json:
        with open(args.json, "w") as out:
            report = {k: v for k, v in result.items() if not k.startswith("_")}
            json.dump({"summary": summary, "report": report}, out, indent=2, default=str)
    failures = verdict(result)
    print(f"\ntimeline: {png}\nlogs and stores: {work_dir}\nwall time: {time.monotonic() - started:.0f} s\n")
    for failure in failures:
        print(f"FAILED: {failure}", flush=True)
    print("\n".join(table(summary)), flush=True)
    return exit_code(summary, failures)


if __name__ == "__main__":
    raise SystemExit(main())
