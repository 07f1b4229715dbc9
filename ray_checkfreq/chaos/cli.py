"""``ray-checkfreq chaos``: inject preemptions into a Ray Train job on a local cluster and report."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from ray_checkfreq.chaos.schedule import KINDS, SCHEDULES, parse_kinds

DEFAULT_KINDS = "commit,notice,persist,node,worker,snapshot,agent"
# Kills timed inside a persist would wait for the epoch arm's next persist (its epoch end):
# the comparison uses preemptions that strike at the scheduled iteration in both arms.
COMPARE_KINDS = "worker,notice,node,worker"

DESCRIPTION = """\
Runs a small CNN on scikit-learn's digits with TorchTrainer (DDP over gloo, float64) on a
local multi-node Ray cluster (ray.cluster_utils.Cluster, one CPU per node), injects
preemptions while it trains, and checks the result against an uninterrupted run:
preemptions survived, iterations lost per preemption against the 2k bound, seconds from
the kill to the first step of the restart, samples lost or repeated, final weights
identical. Without flags: 3 nodes, 2 workers, 4 preemptions (commit, notice, persist,
node), a lost node replaced after 3 s (fixed world size, as an autoscaler would).
It starts its own cluster: run it where no Ray runtime is started.
"""


def _kinds_help() -> str:
    return "\n".join(f"  {name:<9} {text}" for name, text in KINDS.items())


def _schedules_help() -> str:
    return "\n".join(f"  {name:<10} {text}" for name, text in SCHEDULES.items())


def add_parser(sub: Any) -> argparse.ArgumentParser:
    parser = sub.add_parser(
        "chaos", help="inject preemptions into a Ray Train job and compare with an uninterrupted run",
        description=DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=f"kinds (--kinds, comma-separated; they cycle in the order given):\n{_kinds_help()}\n\n"
               f"schedules (--schedule):\n{_schedules_help()}\n")
    add = parser.add_argument
    add("--preemptions", type=int, default=4, help="how many (default 4)")
    add("--kinds", default=None, help=f"comma-separated kinds (default {DEFAULT_KINDS}; with --compare "
                                      f"{COMPARE_KINDS})")
    add("--schedule", default=None, choices=sorted(SCHEDULES),
        help="when (default iterations; with --trace: trace)")
    add("--at", default=None, help="iterations of the 'iterations' schedule, comma-separated")
    add("--seed", type=int, default=0, help="seeds the schedule and the ranks hit (default 0)")
    add("--mtbp-s", type=float, default=15.0, help="mean running seconds between preemptions (poisson; default 15)")
    add("--min-gap", type=int, default=None, help="iterations between random preemptions (default 2k)")
    add("--iterations", type=int, default=56, help="iterations to train (default 56: 2 epochs)")
    add("--every", type=int, default=4, help="checkpoint interval k of ray_checkfreq; 0: its policy picks k "
                                              "(default 4)")
    add("--workers", type=int, default=2, help="training workers (default 2)")
    add("--min-workers", type=int, default=None,
        help="elastic: ScalingConfig(num_workers=(MIN, --workers)); use with --no-replace")
    add("--nodes", type=int, default=3, help="training nodes of the local cluster (default 3)")
    add("--no-replace", action="store_true", help="do not add a node back after one is lost")
    add("--replace-delay-s", type=float, default=3.0, help="seconds before a lost node is replaced (default 3)")
    add("--notice-deadline-s", type=float, default=2.0, help="deadline of a drain notice (default 2)")
    add("--sleep-s", type=float, default=0.1, help="pause per iteration, so kills can be aimed (default 0.1)")
    add("--compare", action="store_true",
        help="run the schedule twice: epoch-boundary checkpoints (notices ignored), then ray_checkfreq; "
             "print wasted work and time to finish")
    add("--trace", default=None, metavar="CSV",
        help="a spot trace (lines time_ms,add|remove,node): its losses are preemptions, its adds new nodes; "
             "the job is elastic (--min-workers, default 1) on up to --nodes nodes")
    add("--trace-start", type=float, default=0.0, help="trace seconds skipped (default 0)")
    add("--trace-duration", type=float, default=None, help="trace seconds replayed (default: to its end)")
    add("--compression", type=float, default=60.0, help="trace seconds per replayed second (default 60)")
    add("--notice-s", type=float, default=0.0,
        help="with --trace: replayed seconds of drain notice before each loss (kind notice; default 0: none)")
    add("--hog", type=int, default=0, metavar="N",
        help="N processes spinning on the CPU beside the run, as on a shared node (default 0)")
    add("--json", default=None, metavar="OUT", help="write the report here")
    add("--png", default=None, metavar="OUT", help="draw the timeline here (matplotlib)")
    add("--work-dir", default=None, help="keep the logs, stores and events here (default: a temp dir)")
    add("--cache-dir", default=None, help="where the uninterrupted run's weights are cached "
                                          "(default ~/.cache/ray_checkfreq/chaos)")
    parser.set_defaults(func=run)
    return parser


def config_from_args(args: argparse.Namespace) -> Any:
    from ray_checkfreq.chaos.runner import ChaosConfig

    for flag in ("preemptions", "iterations", "every", "workers", "nodes", "min_gap", "min_workers"):
        value = getattr(args, flag)
        low = 0 if flag in ("preemptions", "every") else 1
        if value is not None and value < low:
            raise ValueError(f"--{flag.replace('_', '-')}={value}: must be >= {low}")
    for flag in ("mtbp_s", "replace_delay_s", "notice_deadline_s", "sleep_s", "notice_s"):
        value = getattr(args, flag)
        if not value >= 0 or (flag == "mtbp_s" and value == 0):
            raise ValueError(f"--{flag.replace('_', '-')}={value:g}: must be {'> 0' if flag == 'mtbp_s' else '>= 0'}")
    traced = args.trace is not None
    workers = args.workers if args.min_workers is None and not traced else (args.min_workers or 1, args.workers)
    kinds = args.kinds or _default_kinds(args)
    return ChaosConfig(preemptions=args.preemptions, kinds=parse_kinds(kinds),
                       schedule=args.schedule or ("trace" if traced else "iterations"),
                       at=_iterations(args.at), seed=args.seed, mtbp_s=args.mtbp_s, min_gap=args.min_gap,
                       iterations=args.iterations, every=args.every or None, workers=workers, nodes=args.nodes,
                       replace=not (args.no_replace or traced), replace_delay_s=args.replace_delay_s,
                       trace=args.trace, trace_start_s=args.trace_start, trace_duration_s=args.trace_duration,
                       compression=args.compression, notice_s=args.notice_s,
                       notice_deadline_s=args.notice_deadline_s, sleep_s=args.sleep_s, work_dir=args.work_dir,
                       cache_dir=args.cache_dir, progress=_progress,
                       tolerance=0.0 if args.min_workers is None and not traced else 1e-9)


def _default_kinds(args: argparse.Namespace) -> str:
    if args.trace is not None:
        return "notice" if args.notice_s > 0 else "node"
    return COMPARE_KINDS if args.compare else DEFAULT_KINDS


def _iterations(text: str | None) -> tuple[int, ...] | None:
    if text is None:
        return None
    try:
        return tuple(int(part) for part in text.split(",") if part.strip())
    except ValueError as err:
        raise ValueError(f"--at {text!r}: expected comma-separated iterations") from err


def _progress(line: str) -> None:
    print(line, flush=True)


def run(args: argparse.Namespace) -> int:
    from ray_checkfreq.chaos import runner
    from ray_checkfreq.chaos.hog import cpu_hog

    config = config_from_args(args)
    if args.hog < 0:
        raise ValueError(f"--hog={args.hog}: must be >= 0")
    with cpu_hog(args.hog):
        if args.compare:
            return _run_compare(runner, config, args)
        result = runner.run_chaos(config)
    runner.write_outputs(result, json_path=args.json, png_path=args.png, title=_title(config))
    from ray_checkfreq.chaos.report import describe

    print("\n".join(describe(result)))
    return _exit_status(verdict(result))


def _exit_status(failures: list[str]) -> int:
    for failure in failures:
        print(f"FAILED: {failure}", file=sys.stderr)
    return 1 if failures else 0


def verdict(result: dict) -> list[str]:
    """What went wrong (empty: the run passed every check)."""
    failures = []
    if not result["finished"]:
        failures.append(f"the run did not finish: {result.get('error')}")
    if result["samples_lost"] or result["samples_repeated"]:
        failures.append("samples lost or repeated")
    if not result["lost_within_bound"]:
        failures.append("lost work beyond 2k")
    if result["identical_to_uninterrupted"] is False and not (
            result["max_abs_diff"] is not None and result["max_abs_diff"] <= (result.get("tolerance") or 0.0)):
        failures.append("final weights differ from the uninterrupted run")
    failures += result.get("injector_errors") or []
    return failures


def _title(config: Any) -> str:
    world = config.workers if isinstance(config.workers, int) else f"{config.workers[0]}-{config.workers[1]}"
    what = f"trace {config.trace}" if config.trace else f"{config.preemptions} preemptions"
    return (f"chaos: {what}, {world} workers on {config.nodes} nodes, "
            f"{config.checkpoints} checkpoints (k = {config.interval})")


def _run_compare(runner: Any, config: Any, args: argparse.Namespace) -> int:
    outcome = runner.compare(config)
    print(f"{'checkpoints':<24} {'k':>4} {'preemptions':>11} {'wasted iterations':>17} {'max lost':>8} "
          f"{'time to finish':>14} {'identical':>9}")
    for name, row in outcome["summary"].items():
        label = "epoch boundary" if name == "epoch" else "ray_checkfreq"
        finish = "-" if row["time_to_finish_s"] is None else f"{row['time_to_finish_s']:.1f} s"
        print(f"{label:<24} {row['k_max']:>4} {row['preemptions']:>11} {row['lost_iterations_total']:>17} "
              f"{row['lost_iterations_max']:>8} {finish:>14} {str(row['identical_to_uninterrupted']):>9}")
    if args.json:
        import json

        with open(args.json, "w") as out:
            json.dump({"summary": outcome["summary"],
                       "arms": {n: {k: v for k, v in r.items() if not k.startswith("_")}
                                for n, r in outcome["arms"].items()}}, out, indent=2, default=str)
    if args.png:
        for name, result in outcome["arms"].items():
            runner.write_outputs(result, json_path=None, png_path=args.png.replace(".png", f"-{name}.png"),
                                 title=f"{name} checkpoints")
    return _exit_status([f"{name}: {failure}" for name, r in outcome["arms"].items() for failure in verdict(r)])


if __name__ == "__main__":
    main_parser = argparse.ArgumentParser(prog="ray-checkfreq")
    add_parser(main_parser.add_subparsers(dest="command", required=True))
    parsed = main_parser.parse_args(["chaos", *sys.argv[1:]])
    raise SystemExit(parsed.func(parsed))
