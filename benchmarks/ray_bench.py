"""``ray-checkfreq bench ray``: Ray Train's own checkpoints against ray_checkfreq, in one TorchTrainer run.

The job: an MLP with Adam (``--state-mb`` MiB of weights + moments), DDP over gloo, 2
workers on a local 2-node ``cluster_utils.Cluster`` (1 CPU each), synthetic data. Variants:
- ``none``: no checkpoints (the baseline);
- ``report_sync`` / ``report_async``: every k iterations rank 0 ``torch.save``s the state into
  a temp dir and every rank calls ``ray.train.report(metrics, checkpoint=...)`` with that
  upload mode (k chosen after the first baseline so that k x Ti >= ``--min-interval-s``);
- ``ours_policy``: ``ray_checkfreq.ray.CheckFreq`` with ``every=None`` (the policy picks k for
  overhead p = ``--overhead``); ``ours_same_k``: ``every=k``.
All run inside ONE ``fit()`` (a TorchTrainer start costs ~30 s here), in interleaved rounds
(none, report_sync, report_async, ours_policy, ours_same_k, none, ...). Each variant's
overhead is its timed stretch (``--iterations`` after ``--warmup`` untimed ones) over the
same round's baseline, minus 1; medians over rounds, with min and max. An epoch is
``--epoch-len`` iterations. Then (unless ``--no-kill``) the recovery run: ours at k, rank 1
SIGKILLed mid-interval, Ray Train restarts the group, and the restarted rank 0 records lost
iterations and the seconds from the kill to its first step.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import statistics
import tempfile
import time
from collections.abc import Iterator
from typing import Any

from benchmarks import ray_bench_job as job
from benchmarks.harness import add_json_argument, spread, write_json
from ray_checkfreq.chaos.harness import TrainJob, fit_job

TRAIN_RESOURCE = "rcf_bench_train"
SPEEDUP_TARGET = 5.0
RATIO_FLOOR = 0.001  # ours' overhead is floored here for the ratio against Ray Train's
MiB = 1024 * 1024
FAST_HEALTH_CHECKS = {"health_check_period_ms": 500, "health_check_failure_threshold": 3,
                      "health_check_timeout_ms": 500}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--state-mb", type=int, default=100, help="model + Adam state in MiB (default 100)")
    parser.add_argument("--batch", type=int, default=16, help="samples per rank per iteration (default 16)")
    parser.add_argument("--iterations", type=int, default=40,
                        help="timed iterations per variant (default 40; ours at its policy's k: at least 2 k)")
    parser.add_argument("--warmup", type=int, default=10, help="untimed iterations before them (default 10)")
    parser.add_argument("--policy-max-iterations", type=int, default=160,
                        help="cap on ours_policy's timed stretch (default 160; it spans 2 of its intervals below it)")
    parser.add_argument("--repeats", type=int, default=3, help="interleaved rounds (default 3)")
    parser.add_argument("--overhead", type=float, default=0.035, help="allowed overhead p (default 0.035)")
    parser.add_argument("--min-interval-s", type=float, default=2.0, help="k x Ti at least this (default 2)")
    parser.add_argument("--every", type=int, default=None, help="fix k instead of deriving it from Ti")
    parser.add_argument("--epoch-len", type=int, default=1000, help="iterations per epoch (default 1000)")
    parser.add_argument("--no-kill", action="store_true", help="skip the recovery run")
    parser.add_argument("--address", default=None,
                        help="run on this running Ray cluster instead of starting one; its nodes must share this "
                             "machine's temporary directory (a cluster on this machine), and 2 CPUs must be free")
    parser.add_argument("--worker-resource", default=None,
                        help="a custom resource each of the 2 workers also asks 1 of (with --address: places them)")
    add_json_argument(parser)


def run(args: argparse.Namespace) -> int:
    figures = run_ray_bench(args)
    print_table(figures)
    write_json(args.json, figures)
    return 0


def job_config(args: argparse.Namespace, work_dir: str) -> dict:
    from benchmarks.restore_state import mlp_shape

    for name in ("state_mb", "batch", "iterations", "warmup", "repeats", "epoch_len", "policy_max_iterations"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')}={getattr(args, name)}: must be >= 1")
    if args.worker_resource and not args.address:
        raise ValueError(f"--worker-resource={args.worker_resource} needs --address (the bench's own cluster "
                         f"places its workers itself)")
    if not 0 < args.overhead < 1 or not args.min_interval_s > 0:
        raise ValueError(f"--overhead={args.overhead} must be in (0, 1), --min-interval-s={args.min_interval_s} > 0")
    width, layers = mlp_shape(args.state_mb)
    return {"width": width, "layers": layers, "batch": args.batch, "iterations": args.iterations,
            "warmup": args.warmup, "repeats": args.repeats, "overhead": args.overhead,
            "min_interval_s": args.min_interval_s, "every": args.every, "epoch_len": args.epoch_len,
            "policy_max_iterations": max(args.policy_max_iterations, args.iterations),
            "profile_iters": max(2, args.warmup // 3), "kill": not args.no_kill, "work_dir": work_dir,
            "address": args.address, "worker_resource": args.worker_resource,
            "results_path": os.path.join(work_dir, "results.jsonl")}


def run_ray_bench(args: argparse.Namespace) -> dict:
    with tempfile.TemporaryDirectory(prefix="rcf-bench-ray-") as work_dir:
        config = job_config(args, work_dir)
        started = time.perf_counter()
        load_before = os.getloadavg()[0]
        if config["address"]:
            _fit_on_running_cluster(config, work_dir)
        else:
            _fit_on_own_cluster(config, work_dir)
        with open(config["results_path"]) as lines:
            results = [json.loads(line) for line in lines]
    figures = summarize(results, config)
    figures["load_average"] = {"before": load_before, "after": os.getloadavg()[0]}
    figures["wall_s"] = time.perf_counter() - started
    return figures


def _refuse_a_connected_process() -> None:
    import ray

    if ray.is_initialized():
        raise RuntimeError("bench ray connects to its own Ray cluster: run it in a process without Ray "
                           "(the CLI `ray-checkfreq bench ray` does)")
    os.environ.setdefault("RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S", "120")


def _fit_on_running_cluster(config: dict, work_dir: str) -> None:
    import ray

    _refuse_a_connected_process()
    ray.init(address=config["address"], log_to_driver=False, configure_logging=False)
    try:
        _fit(config, work_dir)
    finally:
        ray.shutdown()


def _fit_on_own_cluster(config: dict, work_dir: str) -> None:
    config["worker_resource"] = TRAIN_RESOURCE
    with local_cluster(2):
        _fit(config, work_dir)


@contextlib.contextmanager
def local_cluster(nodes: int, *, object_store_bytes: int = 256 * MiB) -> Iterator[None]:
    """A local ``cluster_utils.Cluster`` of ``nodes`` one-CPU nodes, the head one of them
    (every raylet started on this machine costs start-up time), each with one
    ``TRAIN_RESOURCE`` for one worker; the driver connected while it lasts."""
    import ray
    from ray.cluster_utils import Cluster

    _refuse_a_connected_process()
    node: dict[str, Any] = {"num_cpus": 1, "object_store_memory": object_store_bytes,
                            "resources": {TRAIN_RESOURCE: 1}}
    cluster = Cluster(initialize_head=True, head_node_args={
        **node, "include_dashboard": False, "_system_config": FAST_HEALTH_CHECKS})
    try:
        for _ in range(nodes - 1):
            cluster.add_node(**node)
        cluster.wait_for_nodes()
        ray.init(address=cluster.address, log_to_driver=False, configure_logging=False)
        yield
    finally:
        ray.shutdown()
        cluster.shutdown()


def _fit(config: dict, work_dir: str) -> None:
    resources: dict[str, float] = {"CPU": 1}
    if config["worker_resource"]:
        resources[config["worker_resource"]] = 1
    fit_job(TrainJob(train=job.train, config=config, name="bench-ray", storage_path=os.path.join(work_dir, "results"),
                     workers=2, resources_per_worker=resources, max_failures=1 if config["kill"] else 0,
                     num_to_keep=1))


# ------------------------------------------------------------------ figures
def summarize(results: list[dict], config: dict) -> dict:
    """Per variant: timed seconds and overhead against the same round's baseline."""
    variants = [r for r in results if r["kind"] == "variant"]
    reference = round_baselines(variants)
    k = next(r["k"] for r in variants if r["k"])
    per_variant: dict[str, dict[str, Any]] = {}
    for name in job.VARIANTS:
        runs = [r for r in variants if r["variant"] == name and r["repeat"] in reference]
        per_variant[name] = {
            "seconds": spread([r["seconds"] for r in runs]),
            "seconds_per_iteration": spread([r["seconds"] / r["iterations"] for r in runs]),
            "overhead": spread([r["seconds"] / r["iterations"] / reference[r["repeat"]] - 1 for r in runs]),
            "above_own_median": spread([above_own_median(r["iteration_ends_s"]) for r in runs
                                         if r.get("iteration_ends_s")] or [math.nan]),
            "checkpoints": [r["checkpoints"] for r in runs],
            "k": [r.get("k_used", r["k"]) for r in runs],
            "runs": runs,
        }
    iteration_s = statistics.median(reference.values())
    figures = {
        "k": k,
        "iteration_s": iteration_s,
        "k_times_iteration_s": k * iteration_s,
        "state_bytes": 12 * config["layers"] * (config["width"] ** 2 + config["width"]),
        "config": {key: config[key] for key in ("width", "layers", "batch", "iterations", "warmup", "repeats",
                                                "overhead", "min_interval_s", "epoch_len", "profile_iters")},
        "variants": per_variant,
        "overhead_ours_policy": per_variant[job.OURS_POLICY]["overhead"]["median"],
        "overhead_ours_same_k": per_variant[job.OURS_SAME_K]["overhead"]["median"],
        "overhead_ours_same_k_no_replicas": per_variant[job.OURS_SAME_K_NO_REPLICAS]["overhead"]["median"],
        "overhead_report_sync": per_variant[job.REPORT_SYNC]["overhead"]["median"],
        "overhead_report_async": per_variant[job.REPORT_ASYNC]["overhead"]["median"],
        "spikes": {name: entry["above_own_median"]["median"] for name, entry in per_variant.items()},
        "checkpoints_per_epoch": _checkpoints_per_epoch(per_variant, k, config["epoch_len"]),
    }
    recovery = [r for r in results if r["kind"] == "recovery"]
    figures["recovery"] = recovery[0] if recovery else None
    figures["targets"] = targets(figures, config["overhead"])
    return figures


def above_own_median(iteration_ends_s: list[float]) -> float:
    """The timed stretch's seconds above as many of its own median iterations, as a fraction
    of them: the spikes (stalls, report barriers, a persist's local slowdown), free of the
    drift between variants that moves the median itself by up to 10 % on a shared machine.
    A lower bound of the cost (an even slowdown of every iteration moves the median too)."""
    if not iteration_ends_s:
        raise ValueError("no timed iterations")
    durations = [b - a for a, b in zip([0.0, *iteration_ends_s[:-1]], iteration_ends_s)]
    median = statistics.median(durations)
    return (iteration_ends_s[-1] - len(durations) * median) / (len(durations) * median)


def round_baselines(variants: list[dict]) -> dict[int, float]:
    """Each round's reference seconds per iteration: the mean of its own baseline and the next round's (the
    closing baseline after the last round), or its own where no later one exists. The
    baseline row's overhead against it shows the drift between neighbouring baselines."""
    own = {r["repeat"]: r["seconds"] / r["iterations"] for r in variants if r["variant"] == job.BASELINE}
    rounds = {r["repeat"] for r in variants if r["variant"] != job.BASELINE}
    return {repeat: (own[repeat] + own.get(repeat + 1, own[repeat])) / 2 for repeat in sorted(rounds) if repeat in own}


def _checkpoints_per_epoch(per_variant: dict, k: int, epoch_len: int) -> dict:
    policy_ks = [value for value in per_variant[job.OURS_POLICY]["k"] if value]
    policy = epoch_len / statistics.median(policy_ks) if policy_ks else None
    return {job.REPORT_SYNC: epoch_len / k, job.REPORT_ASYNC: epoch_len / k, job.OURS_SAME_K: epoch_len / k,
            job.OURS_SAME_K_NO_REPLICAS: epoch_len / k, job.OURS_POLICY: policy, job.BASELINE: 0.0}


def targets(figures: dict, overhead: float) -> dict:
    ours = max(figures["overhead_ours_same_k"], RATIO_FLOOR)  # at or below it: beyond what this can resolve
    sync_ratio = figures["overhead_report_sync"] / ours
    async_ratio = figures["overhead_report_async"] / ours
    return {
        "ours_policy_within_p": {"value": figures["overhead_ours_policy"], "required": overhead,
                                 "met": figures["overhead_ours_policy"] <= overhead},
        "ours_same_k_vs_sync": {"value": sync_ratio, "required": SPEEDUP_TARGET, "met": sync_ratio >= SPEEDUP_TARGET},
        "ours_same_k_below_async": {"value": async_ratio, "required": 1.0,
                                    "met": figures["overhead_ours_same_k"] < figures["overhead_report_async"]},
    }


def print_table(figures: dict) -> None:
    cfg = figures["config"]
    print(f"job: MLP {cfg['layers']} x {cfg['width']} + Adam, DDP over gloo, 2 workers on 2 one-CPU nodes "
          f"(the head one of them), batch {cfg['batch']}/rank; Ti {figures['iteration_s'] * 1000:.0f} ms; "
          f"k = {figures['k']} "
          f"(k x Ti = {figures['k_times_iteration_s']:.1f} s); {cfg['repeats']} interleaved rounds of "
          f"{cfg['iterations']} timed iterations after {cfg['warmup']} untimed; epoch = {cfg['epoch_len']} iterations")
    print(f"{'variant':<23} {'k':>8} {'ckpt/epoch':>10} {'timed ckpts':>11} {'s/iter':>9} "
          f"{'overhead':>9} {'min':>8} {'max':>8} {'spikes':>8}")
    for name, entry in figures["variants"].items():
        overhead = entry["overhead"]
        ks = "-" if name == job.BASELINE else "/".join(sorted({str(value) for value in entry["k"]}))
        ckpts = "/".join(str(c) for c in entry["checkpoints"])
        per_epoch = figures["checkpoints_per_epoch"][name]
        per_epoch_text = "-" if per_epoch is None else f"{per_epoch:.1f}"
        print(f"{name:<23} {ks:>8} {per_epoch_text:>10} {ckpts:>11} {entry['seconds_per_iteration']['median']:>9.3f} "
              f"{overhead['median']:>8.1%} {overhead['min']:>7.1%} {overhead['max']:>7.1%} "
              f"{entry['above_own_median']['median']:>7.1%}")
    print("(none: each round's baseline against the mean of it and the next one, i.e. the drift: the noise floor;\n"
          " spikes: seconds above the run's own median iteration, a lower bound free of that drift, median of rounds)")
    _print_start_up(figures["variants"])
    _print_recovery(figures["recovery"])
    load = figures["load_average"]
    print(f"load average (1 min) before / after: {load['before']:.2f} / {load['after']:.2f}; "
          f"wall {figures['wall_s']:.0f} s")
    floored = figures["overhead_ours_same_k"] <= RATIO_FLOOR
    for name, target in figures["targets"].items():
        note = f", ours floored at {RATIO_FLOOR:.1%}" if floored and name != "ours_policy_within_p" else ""
        print(f"target {name}: {'met' if target['met'] else 'not met'} "
              f"({target['value']:.3g} against {target['required']:.3g}{note})")


def _print_start_up(variants: dict) -> None:
    runs = [r for name in (job.OURS_POLICY, job.OURS_SAME_K) for r in variants[name]["runs"]]
    reports = [r["registration"]["report_s"] for r in runs if (r.get("registration") or {}).get("report_s")]
    start_up = [r["start_up_iterations"] for r in runs if "start_up_iterations" in r]
    if start_up:
        measured = f"{statistics.median(reports):.2f} s" if reports else "not measured"
        print(f"ours' start-up (untimed): {min(start_up)}-{max(start_up)} iterations (policy profiling, first "
              f"registration with Ray Train; its report: {measured})")


def _print_recovery(recovery: dict | None) -> None:
    if recovery is None:
        print("recovery: not run (--no-kill)")
        return
    print(f"recovery (ours, k = {recovery['k']}): rank 1 SIGKILLed at iteration {recovery['killed_at']}, "
          f"restored step {recovery['restored_step']} from {recovery['source']}: "
          f"{recovery['lost_iterations']} iterations lost; "
          f"kill -> first step {recovery['restart_to_first_step_s']:.1f} s "
          f"(kill -> training function {recovery['kill_to_function_start_s']:.1f} s, "
          f"restore {recovery['restore_s']:.2f} s)")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    add_arguments(parser)
    raise SystemExit(run(parser.parse_args()))
