"""The goodput replay: a slice of a spot trace, time-compressed, replayed against one
elastic TorchTrainer job per checkpointing method on a local multi-node cluster.

Per variant: a fresh ``cluster_utils.Cluster`` with the slice's initial node count (one-CPU
nodes), the job (``goodput_job.py``) under ``ScalingConfig(num_workers=(1, max_nodes))`` and
``FailureConfig(max_failures=-1)``; once it trains, the slice's events fire at their times
(``trace.local_schedule``): a ``remove`` takes away a node that runs a worker (a node loss:
``remove_node(allow_graceful=False)``; with a notice, drained that long before), an ``add``
adds a node. At the slice's end the job
is asked to stop. A reference run without events measures the failure-free throughput on
the initial nodes first. Everything is measured from the job's own log (rank 0's) and the
driver's event times, in wall seconds.

It owns its clusters: run it in a process without Ray (the CLI is one).
"""

from __future__ import annotations

import json
import logging
import os
import random
import threading
import time
from dataclasses import dataclass
from typing import Any

from benchmarks import goodput_job
from benchmarks.goodput_sim import Costs, Fleet, Method, simulate
from ray_checkfreq.chaos.harness import TrainJob, fit_job
from ray_checkfreq.chaos.kinds import TRAIN_RESOURCE, LocalCluster
from ray_checkfreq.chaos.runner import quiet_expected_deaths
from ray_checkfreq.chaos.trace import LocalSchedule

MiB = 1 << 20
RAY_ENV = {"RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S": "60", "RAY_DEDUP_LOGS": "0"}
FIRST_STEP_TIMEOUT_S = 240.0
STOP_TIMEOUT_S = 120.0
EVENTS_NAME = "events.json"
RESIZE_MONITOR_S = 60.0  # Ray Train's ScalingConfig.elastic_resize_monitor_interval_s default


@dataclass(frozen=True, kw_only=True)
class ReplayJob:
    """The job every variant trains, and how it checkpoints."""

    width: int = 512
    layers: int = 8  # 8 x (512 x 512 + 512) floats x 3 (weights, two Adam moments): ~25 MiB
    global_batch: int = 64
    every: int = 50  # N of the every-N baselines
    epoch_len: int = 400
    overhead: float = 0.035
    sleep_s: float = 0.15  # per iteration: a step of ~0.25 s, so that lost work weighs as on real jobs

    @property
    def state_mb(self) -> float:
        """Weights and Adam's two moments, MiB."""
        return 3 * self.layers * (self.width * self.width + self.width) * 4 / MiB


def run_variant(variant: str, schedule: LocalSchedule, job: ReplayJob, work_dir: str, *,
                max_nodes: int, seed: int = 0, notice_s: float = 0.0, say: Any = print) -> dict:
    """One variant over the schedule (``schedule.events`` empty: the reference run);
    ``notice_s``: replayed seconds of warning before each node loss (0: none)."""
    import ray

    os.environ.update({key: os.environ.get(key, value) for key, value in RAY_ENV.items()})
    logging.getLogger("ray").setLevel(logging.ERROR)
    quiet_expected_deaths()  # the node losses this replay causes
    os.makedirs(work_dir, exist_ok=True)
    log_dir, stop_file = os.path.join(work_dir, "logs"), os.path.join(work_dir, "stop")
    os.makedirs(log_dir, exist_ok=True)
    cluster = LocalCluster(nodes=schedule.initial_nodes)
    ray.init(address=cluster.address, log_to_driver=False, configure_logging=False, logging_level=logging.ERROR)
    driver: list[dict] = []
    try:
        config = {"variant": variant, "log_dir": log_dir, "stop_file": stop_file, "width": job.width,
                  "sleep_s": job.sleep_s,
                  "layers": job.layers, "global_batch": job.global_batch, "every": job.every,
                  "epoch_len": job.epoch_len, "overhead": job.overhead}
        train = TrainJob(train=goodput_job.train, config=config, name=f"goodput-{variant}",
                         storage_path=os.path.join(work_dir, "results"), workers=(1, max_nodes),
                         resources_per_worker={"CPU": 1, TRAIN_RESOURCE: 1}, max_failures=-1,
                         timeout_s=FIRST_STEP_TIMEOUT_S + schedule.duration_s + STOP_TIMEOUT_S)
        outcome: dict[str, Any] = {}
        fitting = threading.Thread(target=lambda: outcome.update(result=fit_job(train, raise_errors=False)),
                                   name="rcf-goodput-fit", daemon=True)
        fitting.start()
        t0 = _first_step(log_dir, fitting)
        driver.append({"t": t0, "event": "first_step", "nodes": schedule.initial_nodes})
        _follow(schedule, cluster, t0, driver, random.Random(seed), say, log_dir, notice_s)
        with open(stop_file, "w"):
            pass
        driver.append({"t": time.time(), "event": "stop"})
        fitting.join(STOP_TIMEOUT_S)
        error = outcome.get("result") if isinstance(outcome.get("result"), Exception) else None
    finally:
        ray.shutdown()
        cluster.shutdown()
    log, workers = _read_log(log_dir), _read_lines(os.path.join(log_dir, goodput_job.WORKERS_NAME))
    run = {"variant": variant, "driver": driver, "log": log, "workers": workers,
           "error": None if error is None else repr(error)}
    with open(os.path.join(work_dir, EVENTS_NAME), "w") as out:
        json.dump(run, out)
    return run


def load_run(work_dir: str) -> dict:
    """A run that ``run_variant`` left in ``work_dir``: the model can be fed again from it."""
    path = os.path.join(work_dir, EVENTS_NAME)
    if not os.path.exists(path):
        raise FileNotFoundError(f"{path}: no replay run there (run_variant writes it)")
    with open(path) as saved:
        run = json.load(saved)
    run.setdefault("variant", os.path.basename(os.path.normpath(work_dir)))
    run.setdefault("error", None)
    return dict(run)


def _first_step(log_dir: str, fitting: threading.Thread) -> float:
    deadline = time.time() + FIRST_STEP_TIMEOUT_S
    while time.time() < deadline and fitting.is_alive():
        steps = [e for e in _read_log(log_dir) if e["event"] == "step"]
        if steps:
            return float(steps[0]["t"])
        time.sleep(0.2)
    raise RuntimeError(f"the job did not train within {FIRST_STEP_TIMEOUT_S:g} s (see {log_dir})")


def _follow(schedule: LocalSchedule, cluster: LocalCluster, t0: float, driver: list[dict], rng: random.Random,
            say: Any, log_dir: str, notice_s: float = 0.0) -> None:
    """Fire the schedule's events at their times (this thread: ``add_node`` needs the main
    one). With ``notice_s``, each node to lose is drained that long before (a preemption
    notice, as the autoscaler sends it: ``drain_node`` with a deadline), then removed."""
    actions = sorted([(max(0.0, e.at_s - notice_s), 0, n, e) for n, e in enumerate(schedule.events)
                      if e.action == "remove" and notice_s > 0]
                     + [(e.at_s, 1, n, e) for n, e in enumerate(schedule.events)], key=lambda a: a[:3])
    nodes, last_removal, noticed = schedule.initial_nodes, 0.0, {}
    for at, phase, index, event in actions:
        _sleep_until(t0 + at)
        if event.action == "remove" and phase == 0:  # the notice
            node = _node_to_take(cluster, log_dir, last_removal, rng)
            if node is not None:
                cluster.drain(node, deadline_epoch_s=time.time() + notice_s)
                noticed[index] = node
                driver.append({"t": time.time(), "event": "notice", "node": node, "deadline_s": notice_s})
                say(f"[{time.time() - t0:7.1f} s] notice: node {node[:8]} goes in {notice_s:g} s")
        elif event.action == "remove":
            node = noticed.pop(index, None) or _node_to_take(cluster, log_dir, last_removal, rng)
            if node is None or node not in {n.node_id for n in cluster.cluster.worker_nodes}:
                driver.append({"t": time.time(), "event": "skipped", "why": "no worker node to take"})
                continue
            cluster.remove(node)
            nodes, last_removal = nodes - 1, time.time()
            driver.append({"t": time.time(), "event": "remove", "node": node, "nodes": nodes,
                           "trace_time_s": event.trace_time_s})
            say(f"[{time.time() - t0:7.1f} s] preemption: node {node[:8]} removed ({nodes} left)")
        else:
            node = cluster.add_node()
            nodes += 1
            driver.append({"t": time.time(), "event": "add", "node": node, "nodes": nodes,
                           "trace_time_s": event.trace_time_s})
            say(f"[{time.time() - t0:7.1f} s] node {node[:8]} added ({nodes} now)")
    _sleep_until(t0 + schedule.duration_s)


def _node_to_take(cluster: LocalCluster, log_dir: str, since: float, rng: random.Random) -> str | None:
    """A live node on which a worker of the job started since ``since`` (the last removal),
    else any live worker node."""
    live = sorted(n.node_id for n in cluster.cluster.worker_nodes)
    started = _read_lines(os.path.join(log_dir, goodput_job.WORKERS_NAME))
    candidates = sorted({w["node"] for w in started if w["t"] >= since} & set(live)) or live
    return rng.choice(candidates) if candidates else None


def _sleep_until(t: float) -> None:
    while (left := t - time.time()) > 0:
        time.sleep(min(left, 0.2))


def _read_log(log_dir: str) -> list[dict]:
    return _read_lines(os.path.join(log_dir, goodput_job.LOG_NAME))


def _read_lines(path: str) -> list[dict]:
    """The complete JSON lines of ``path`` ([] before it exists)."""
    if not os.path.exists(path):
        return []
    with open(path) as lines:
        return [json.loads(line) for line in lines if line.endswith("\n") and line.strip()]


# ---------------------------------------------------------------------- figures
def figures(run: dict, *, reference_rate: float) -> dict:
    """Goodput and where the time went, from one variant's log and driver events."""
    log, driver = run["log"], run["driver"]
    t0 = next(e["t"] for e in driver if e["event"] == "first_step")
    stop = next(e["t"] for e in driver if e["event"] == "stop")
    attempts = _attempts(log, [w for w in run["workers"] if "t_start" in w])
    steps = [e for e in log if e["event"] == "step" and e["t"] <= stop]
    kept = _kept(steps, attempts, [e for e in driver if e["event"] == "remove" and e["t"] <= stop])
    recomputed = sum(max(0, previous["reached"] - current["start"]["iteration"])
                     for previous, current in zip(attempts, attempts[1:]))
    preemptions = [e for e in driver if e["event"] == "remove"]
    recoveries = [_recovery(e["t"], attempts, [p["t"] for p in preemptions]) for e in preemptions]
    ckpt_s = sum(e.get("ckpt_s", 0.0) for e in steps)
    running_s = sum(a["running_s"] for a in attempts)
    duration = stop - t0
    return {
        "variant": run["variant"],
        "goodput": round(kept / (reference_rate * duration), 4) if reference_rate > 0 and duration > 0 else None,
        "iterations_kept": kept,
        "iterations_recomputed": recomputed,
        "restarts": len(attempts) - 1,
        "preemptions": len(preemptions),
        "seconds": round(duration, 1),
        "checkpoint_overhead": round(ckpt_s / running_s, 4) if running_s > 0 else None,
        "recoveries": [r for r in recoveries if r is not None],
        "step_s_by_world": _step_s_by_world(attempts),
        "error": run["error"],
    }


def _step_s_by_world(attempts: list[dict]) -> dict[int, float]:
    """The median seconds between steps of attempts at each world size, each attempt's
    first 3 steps left out (warm-up)."""
    gaps: dict[int, list[float]] = {}
    for attempt in attempts:
        times = [step["t"] for step in attempt["steps"][3:]]
        world = int(attempt["start"].get("world") or 0)
        gaps.setdefault(world, []).extend(b - a for a, b in zip(times, times[1:]))
    return {world: round(sorted(g)[len(g) // 2], 4) for world, g in sorted(gaps.items()) if g}


def _kept(steps: list[dict], attempts: list[dict], removals: list[dict]) -> int:
    """The progress the job holds at the stop: its newest iteration, unless the job was down
    then: a node was lost after that step, or a node of the attempt that made it was lost
    after it started (a step logged as its node went): the iteration the next attempt resumed at."""
    if not steps:
        return 0
    last = steps[-1]
    current = [a for a in attempts if a["start"]["t"] <= last["t"]]
    nodes = {rank["node"] for rank in current[-1]["ranks"]} if current else set()
    since = current[-1]["start"]["t"] if current else last["t"]
    down = [r["t"] for r in removals
            if r["t"] > last["t"] or (r["t"] >= since and r.get("node") in nodes)]
    if not down:
        return int(last["iteration"])
    later = [a for a in attempts if a["start"]["t"] > min(down)]
    return int(later[0]["start"]["iteration"]) if later else 0


def _attempts(log: list[dict], timelines: list[dict]) -> list[dict]:
    """Each attempt of the job: rank 0's start, first step and newest iteration, and every
    rank's timeline (those that finished their restore within 5 s of rank 0's)."""
    attempts: list[dict] = []
    for event in log:
        if event["event"] == "start":
            ranks = [line for line in timelines if abs(line["t_start"] - event["t"]) < 5.0]
            attempts.append({"start": event, "ranks": ranks, "first_step": None, "reached": event["iteration"],
                             "running_s": 0.0, "last_t": None, "steps": []})
        elif event["event"] == "step" and attempts:
            current = attempts[-1]
            if current["first_step"] is None:
                current["first_step"] = event
            else:
                current["running_s"] += event["t"] - current["last_t"]
            current["last_t"] = event["t"]
            current["steps"].append(event)
            current["reached"] = max(current["reached"], event["iteration"])
    return attempts


def _recovery(t: float, attempts: list[dict], removals: list[float]) -> dict | None:
    """From a preemption at ``t`` to the next attempt's first step, and where it went: to
    the slowest rank's entry into the training function (Ray Train's group restart and
    the process start), the job's own set-up (model, DDP), the checkpointing's set-up and
    restore (ours: CheckFreq() and restore(); Ray Train's: get_checkpoint and load), the
    first step. ``hit``: another node was lost before that attempt began (a restart that
    began again: its time to the next step is not one restart's)."""
    after = [a for a in attempts if a["start"]["t"] > t and a["first_step"] is not None and a["ranks"]]
    if not after:
        return None
    attempt = after[0]
    hit = any(t < other < attempt["start"]["t"] for other in removals)
    ranks = attempt["ranks"]
    entered = max(r["t_entered"] for r in ranks)
    set_up = max(r["t_set_up_begin"] for r in ranks)
    done = attempt["start"]["t"]
    return {"to_next_step_s": round(attempt["first_step"]["t"] - t, 2),
            "group_restart_and_process_start_s": round(entered - t, 2),
            "job_set_up_s": round(max(0.0, set_up - entered), 2),
            "checkpointing_s": round(done - max(set_up, entered), 2),
            "restore_s": round(done - max(r["t_restoring"] for r in ranks), 2),
            "first_step_s": round(attempt["first_step"]["t"] - done, 2),
            "resumed_at": attempt["start"]["iteration"], "hit": hit}


def reference_rate(run: dict) -> float:
    """Iterations per second of a run without preemptions, its first 10 % left out (warm-up)."""
    steps = [e for e in run["log"] if e["event"] == "step"]
    if len(steps) < 20:
        raise RuntimeError(f"the reference run made {len(steps)} steps: too few to measure")
    steady = steps[len(steps) // 10:]
    return (steady[-1]["iteration"] - steady[0]["iteration"]) / (steady[-1]["t"] - steady[0]["t"])


# ---------------------------------------------------------------------- tables
def table(rows: list[dict]) -> str:
    lines = [f"{'method':8s} {'goodput':>8s} {'kept':>6s} {'recomputed':>10s} {'restarts':>8s} "
             f"{'to next step s':>14s} {'checkpointing s':>15s} {'overhead':>8s}"]
    for row in rows:
        recoveries = row["recoveries"]
        to_next = _mean([r["to_next_step_s"] for r in recoveries])
        ours = _mean([r["checkpointing_s"] for r in recoveries])
        lines.append(f"{row['variant']:8s} {_fmt(row['goodput'], 8, 3)} {row['iterations_kept']:6d} "
                     f"{row['iterations_recomputed']:10d} {row['restarts']:8d} {_fmt(to_next, 14, 1)} "
                     f"{_fmt(ours, 15, 2)} {_fmt(row['checkpoint_overhead'], 8, 3)}")
    return "\n".join(lines)


def model_check(rows: list[dict], runs: dict[str, dict], schedule: LocalSchedule, job: ReplayJob, *,
                rate: float, max_nodes: int, notice_s: float = 0.0) -> list[dict]:
    """The model on the replayed slice, fed with each method's measured costs: its goodput
    beside the measured one. Per method, from its own run: the node losses and additions
    at the times the driver made them, each restart's seconds (a node loss to the next
    step, the restore apart; the model begins a restart again at a loss during one), the
    stall per checkpoint, the restore, ours' k as the job logged it, and the step (the
    machine's load moves it from run to run). The job's step is a sleep and little
    compute, as long on any world size: scaling 0. Goodput as the replay counts it: the
    iterations kept over the reference's rate times the run's seconds."""
    state_gb = job.state_mb * MiB / 1e9
    out = []
    for row in rows:
        variant, run = row["variant"], runs[row["variant"]]
        fleet = Fleet(_driver_instants(run, schedule.initial_nodes), full_nodes=max_nodes, end_s=row["seconds"],
                      resize_check_s=RESIZE_MONITOR_S)
        recoveries = row["recoveries"]
        restore = max(_mean([r["restore_s"] for r in recoveries]) or 0.0, 1e-3)
        every = {"sync": job.every, "async": job.every, "ours": _interval(run["log"])}.get(variant)
        stall = max(_checkpoint_stall(run["log"], variant, job, k=every), 1e-5)
        upload = min(restore, stall / 2)
        clean = [r["to_next_step_s"] - r["restore_s"] for r in recoveries if not r.get("hit")]
        mean_restart_s = _mean(clean or [r["to_next_step_s"] - r["restore_s"] for r in recoveries]) or 0.0
        step_s = _mean_step_s(_attempts(run["log"], [])) or 1.0 / rate
        costs = Costs(iter_s=step_s, scaling=0.0, state_gb=state_gb,
                      storage_gbps=state_gb / upload, ram_restore_gbps=state_gb / restore,
                      snapshot_gbps=state_gb / stall, serialize_gbps=state_gb / max(stall - upload, 1e-5),
                      restart_s=mean_restart_s, restarts_s=_restarts_s(run, mean_restart_s),
                      epoch_iterations=job.epoch_len, overhead=job.overhead, notice_s=notice_s)
        method = Method(name=variant, kind={"ours": "checkfreq"}.get(variant, variant), every=every)
        modelled = simulate(fleet, method, costs)
        goodput = modelled.iterations / (rate * row["seconds"]) if rate > 0 and row["seconds"] > 0 else 0.0
        out.append({"variant": variant, "measured": row["goodput"], "model": round(goodput, 4),
                    "points": None if row["goodput"] is None else round(100 * (goodput - row["goodput"]), 1),
                    "model_recomputed": round(modelled.lost_iterations), "stall_s": round(stall, 4),
                    "restart_s": round(mean_restart_s, 2), "restarts_s": list(costs.restarts_s),
                    "step_s": round(step_s, 4), "k": every})
    return out


def _driver_instants(run: dict, initial_nodes: int) -> list[tuple[float, int, int]]:
    """The node losses and additions of a run as the model's instants, at the times the
    driver made them (seconds from the first step)."""
    t0 = next(e["t"] for e in run["driver"] if e["event"] == "first_step")
    moments: list[tuple[float, int, int]] = [(0.0, 0, initial_nodes)]
    for event in run["driver"]:
        if event["event"] in ("remove", "add"):
            at, removed = max(0.0, event["t"] - t0), int(event["event"] == "remove")
            if moments[-1][0] == at:
                moments[-1] = (at, moments[-1][1] + removed, event["nodes"])
            else:
                moments.append((at, removed, event["nodes"]))
    return moments


def _restarts_s(run: dict, fallback_s: float) -> tuple[float, ...]:
    """Each node loss's seconds to the next step, the restore apart (``fallback_s`` for a
    loss that no attempt followed)."""
    attempts = _attempts(run["log"], [w for w in run["workers"] if "t_start" in w])
    removals = [e["t"] for e in run["driver"] if e["event"] == "remove"]
    seconds = []
    for t in removals:
        recovery = _recovery(t, attempts, removals)
        seconds.append(fallback_s if recovery is None else max(0.0, recovery["to_next_step_s"] - recovery["restore_s"]))
    return tuple(seconds)


def _mean_step_s(attempts: list[dict]) -> float | None:
    """The mean seconds from a step to the next, its checkpoint call apart, each attempt's
    first 3 steps left out (warm-up)."""
    gaps = [b["t"] - a["t"] - b["ckpt_s"] for attempt in attempts
            for a, b in zip(attempt["steps"][3:], attempt["steps"][4:])]
    return sum(gaps) / len(gaps) if gaps else None


def model_table(rows: list[dict]) -> str:
    lines = [f"{'method':8s} {'measured':>8s} {'model':>8s} {'points':>7s} {'stall s':>8s} {'restart s':>9s}"]
    lines += [f"{r['variant']:8s} {_fmt(r['measured'], 8, 3)} {r['model']:8.3f} {_fmt(r['points'], 7, 1)} "
              f"{r['stall_s']:8.4f} {r['restart_s']:9.2f}" for r in rows]
    return "\n".join(lines)


def _checkpoint_stall(log: list[dict], variant: str, job: ReplayJob, *, k: int | None = None) -> float:
    """Mean seconds of a checkpoint call at a checkpoint. Ours: with its ``k``, the
    seconds of every call (each iteration's decision too, each attempt's costlier first
    snapshot) over the snapshots k implies, so that the model stalls as long in all;
    without, the calls well above the per-iteration decision's."""
    steps = [e for e in log if e["event"] == "step"]
    if variant in ("sync", "async", "epoch"):
        every = job.epoch_len if variant == "epoch" else job.every
        return _mean([e["ckpt_s"] for e in steps if e["iteration"] % every == 0]) or 0.0
    if variant == "none" or not steps:
        return 0.0
    if k is not None:
        return k * sum(e["ckpt_s"] for e in steps) / len(steps)
    return _mean([e["ckpt_s"] for e in _our_checkpoints(steps)]) or 0.0


def _our_checkpoints(steps: list[dict]) -> list[dict]:
    """Ours' steps that took a snapshot: their calls well above the per-iteration decision's."""
    ordinary = sorted(e["ckpt_s"] for e in steps)[len(steps) // 2] if steps else 0.0
    return [e for e in steps if e["ckpt_s"] > 4 * ordinary + 0.001]


def _interval(log: list[dict]) -> int | None:
    """Ours' k as the replay's policy chose it: the mean of the k the job logged, else (a
    run before it logged k) the mean count of iterations from an attempt's start, or its
    snapshot before, to each snapshot (None: no snapshot)."""
    logged = [e["k"] for e in log if e["event"] == "step" and e.get("k")]
    if logged:
        return max(1, round(sum(logged) / len(logged)))
    snapshots = {id(e) for e in _our_checkpoints([e for e in log if e["event"] == "step"])}
    spans, previous = [], None
    for event in log:
        if event["event"] == "start":
            previous = event["iteration"]
        elif id(event) in snapshots and previous is not None:
            spans.append(event["iteration"] - previous)
            previous = event["iteration"]
    return max(1, round(sum(spans) / len(spans))) if spans else None


def _mean(values: list[float]) -> float | None:
    return sum(values) / len(values) if values else None


def _fmt(value: float | None, width: int, digits: int) -> str:
    return f"{'-':>{width}s}" if value is None else f"{value:{width}.{digits}f}"


def plot(runs: dict[str, dict], path: str) -> None:
    """Per method: iterations over time, node losses (red) and additions (green), checkpoints."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(len(runs), 1, figsize=(10, 2.2 * len(runs)), sharex=True, squeeze=False)
    for axis, (variant, run) in zip(axes[:, 0], runs.items()):
        t0 = next(e["t"] for e in run["driver"] if e["event"] == "first_step")
        steps = [e for e in run["log"] if e["event"] == "step"]
        axis.plot([e["t"] - t0 for e in steps], [e["iteration"] for e in steps], ".", markersize=1.5)
        slow = [e for e in steps if e["ckpt_s"] > 0.01]
        axis.plot([e["t"] - t0 for e in slow], [e["iteration"] for e in slow], "k|", markersize=6)
        for event in run["driver"]:
            colour = {"remove": "red", "add": "green", "stop": "black"}.get(event["event"])
            if colour:
                axis.axvline(event["t"] - t0, color=colour, linewidth=0.8, alpha=0.6)
        axis.set_ylabel(f"{variant}\niteration")
    axes[-1, 0].set_xlabel("seconds since the first step (red: node lost, green: node added, |: checkpoint)")
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)
