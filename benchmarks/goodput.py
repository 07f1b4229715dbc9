"""``ray-checkfreq bench goodput``: goodput by checkpointing method over a real spot trace.

1. The replay (``goodput_replay.py``, skipped with ``--model-only``): a slice of the trace,
   time-compressed, against one elastic TorchTrainer job per method on a local cluster of
   at most ``--max-nodes`` one-CPU nodes, after a reference run without preemptions. Per
   method: goodput (iterations kept over the reference's throughput times the slice),
   iterations recomputed, restarts, the time from each preemption to the next step and
   where it went, checkpoint overhead; ``--png`` draws the timelines.
2. The model (``goodput_sim.py``) fed with the replay's own measured costs, on the same
   slice: its goodput beside the measured one, per method.
3. The model at full scale over the whole trace for each ``--state-gb``: every method,
   each mechanism's best fixed interval chosen knowing the whole trace (an oracle no user
   has), and ours as a share of its oracle. Those costs are the options' (stated). Beside
   ours with group restarts, ours in place (torchft replica groups, ``goodput_sim.py``'s
   ``inplace``: a lost replica replaced and healed from a live peer while the others train
   on; a fixed worker count, ``--in-place-replicas``; ``--pause-s``, ``--heal-s``,
   ``--heal-gbps``, ``--quorum-overhead``), and the ratio of the two.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict, replace
from pathlib import Path

from benchmarks import goodput_job
from benchmarks.goodput_sim import Costs, Fleet, Method, Outcome, oracle, simulate
from ray_checkfreq.chaos.trace import TraceSlice, instants, read_trace

TRACE = Path(__file__).resolve().parent / "traces" / "ec2-p3-spot.csv"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add = parser.add_argument
    add("--trace", default=str(TRACE), help="time_ms,add|remove,node file (default: the EC2 p3 trace)")
    add("--trace-start", type=float, default=0.0, help="trace seconds to skip")
    add("--trace-duration", type=float, default=None, help="trace seconds to model (default: to the end)")
    add("--state-gb", default="1,10,100", help="comma-separated state sizes (default 1,10,100)")
    add("--storage-gbps", type=float, default=Costs.storage_gbps, help="the job's storage bandwidth, GB/s")
    add("--iter-s", type=float, default=Costs.iter_s, help="an iteration on every node of the trace's peak")
    add("--restart-s", type=float, default=Costs.restart_s, help="a restart, restore apart")
    add("--notice-s", type=float, default=0.0,
        help="warning before a node goes, trace seconds (AWS: 120); the replay's is this over --compression")
    add("--every", type=int, default=100, help="N of the every-N baselines (default 100)")
    add("--epoch-iterations", type=int, default=Costs.epoch_iterations)
    add("--sharded", action="store_true", help="the state sharded over the job's nodes (FSDP2)")
    add("--in-place-replicas", type=int, default=None,
        help="ours in place: its fixed worker count, one replica each (default: the trace's peak)")
    add("--pause-s", type=float, default=Costs.pause_s, help="ours in place: the survivors' pause at a replica loss")
    add("--heal-s", type=float, default=Costs.heal_s,
        help="ours in place: a free node -> its replacement in the quorum, the state's transfer apart")
    add("--heal-gbps", type=float, default=Costs.heal_gbps,
        help="ours in place: a live peer's send of the state to a replacement, GB/s (the survivors wait for it)")
    add("--quorum-overhead", type=float, default=Costs.quorum_overhead,
        help="ours in place: torchft's per-step quorum, a fraction of each step (default 0.01: stated, not measured)")
    add("--json", default=None, help="write the figures here too")
    add("--model-only", action="store_true", help="skip the replay (parts 1 and 2)")
    add("--replay-start", type=float, default=10800.0, help="trace second the replay's slice begins at")
    add("--replay-duration", type=float, default=2700.0, help="trace seconds the replay's slice lasts")
    add("--compression", type=float, default=30.0, help="trace seconds per replayed second (default 30)")
    add("--max-nodes", type=int, default=3, help="local training nodes at most (default 3)")
    add("--reference-s", type=float, default=45.0,
        help="seconds the reference run trains without preemptions (at most the slice; default 45)")
    add("--variants", default=",".join(goodput_job.VARIANTS), help="which methods the replay runs")
    add("--png", default=None, help="draw the replay's timelines here (matplotlib)")
    add("--work-dir", default=None, help="where the replay's runs go (default: a temporary directory)")
    add("--replay-from", default=None,
        help="a --work-dir an earlier replay of the same slice left: its runs measured again and fed to the "
             "model, nothing replayed")


def run(args: argparse.Namespace) -> int:
    if not args.reference_s > 0:
        raise ValueError(f"--reference-s={args.reference_s:g}: must be > 0")
    window = TraceSlice(start_s=args.trace_start, duration_s=args.trace_duration)
    fleet = _fleet(args.trace, window)
    base = Costs(iter_s=args.iter_s, storage_gbps=args.storage_gbps, restart_s=args.restart_s,
                 notice_s=args.notice_s, epoch_iterations=args.epoch_iterations, sharded=args.sharded,
                 pause_s=args.pause_s, heal_s=args.heal_s, heal_gbps=args.heal_gbps,
                 quorum_overhead=args.quorum_overhead)
    print(f"trace {args.trace}: {len(fleet.instants)} instants, "
          f"{sum(1 for _, removed, _ in fleet.instants if removed)} with preemptions, up to {fleet.full_nodes} "
          f"nodes, {(fleet.end_s or 0) / 3600:.1f} h")
    replay = None if args.model_only else _replay(args)
    figures = {}
    for size in [float(part) for part in args.state_gb.split(",")]:
        costs = replace(base, state_gb=size)
        figures[f"{size:g} GB"] = _one_size(fleet, costs, args.every, in_place_replicas=args.in_place_replicas)
    if args.json:
        Path(args.json).write_text(json.dumps({"replay": replay, "costs": asdict(base), "sizes": figures}, indent=1))
    return 0


def _replay(args: argparse.Namespace) -> dict:
    import tempfile
    import time

    from benchmarks import goodput_replay as replay
    from ray_checkfreq.chaos.trace import LocalSchedule, local_schedule

    window = TraceSlice(start_s=args.replay_start, duration_s=args.replay_duration, compression=args.compression)
    schedule = local_schedule(read_trace(args.trace), window, max_nodes=args.max_nodes)
    job = replay.ReplayJob()
    root = args.replay_from or args.work_dir or tempfile.mkdtemp(prefix="rcf-goodput-")
    removes = sum(e.action == "remove" for e in schedule.events)
    print(f"replay: trace seconds {window.start_s:g} to {window.start_s + args.replay_duration:g}, "
          f"{args.compression:g}x faster: {schedule.duration_s:.0f} s, {removes} node losses, "
          f"{schedule.initial_nodes} to {args.max_nodes} one-CPU nodes; job state {job.state_mb:.1f} MiB, "
          f"runs under {root}")
    started = time.monotonic()
    quiet = LocalSchedule(initial_nodes=schedule.initial_nodes, events=[], peak_live=schedule.peak_live,
                          duration_s=min(args.reference_s, schedule.duration_s))

    def run_one(variant: str, name: str, plan: LocalSchedule) -> dict:
        if args.replay_from:  # the runs a replay left: only the figures and the model again
            return replay.load_run(f"{args.replay_from}/{name}")
        return replay.run_variant(variant, plan, job, f"{root}/{name}", max_nodes=args.max_nodes,
                                  notice_s=args.notice_s / args.compression if plan.events else 0.0)

    rate = replay.reference_rate(run_one("none", "reference", quiet))
    print(f"reference (no preemption, {schedule.initial_nodes} nodes): {rate:.2f} iterations/s")
    runs, rows = {}, []
    for variant in args.variants.split(","):
        print(f"--- {variant} ---")
        runs[variant] = run_one(variant, variant, schedule)
        rows.append(replay.figures(runs[variant], reference_rate=rate))
    print(replay.table(rows))
    modelled = replay.model_check(rows, runs, schedule, job, rate=rate, max_nodes=args.max_nodes,
                                  notice_s=args.notice_s / args.compression)
    print(replay.model_table(modelled))
    if args.png:
        replay.plot(runs, args.png)
    print(f"replay wall time: {time.monotonic() - started:.0f} s")
    return {"reference_rate": rate, "variants": rows, "model": modelled, "work_dir": root}


def _fleet(path: str, window: TraceSlice) -> Fleet:
    moments = instants(read_trace(path))
    end = moments[-1][0] if window.duration_s is None else window.start_s + window.duration_s
    kept = [(time - window.start_s, removed, live) for time, removed, live in moments
            if window.start_s <= time <= end]
    live_before = [live for time, _, live in moments if time < window.start_s]
    if live_before:
        kept.insert(0, (0.0, 0, live_before[-1]))
    return Fleet(kept, full_nodes=max(live for _, _, live in kept), end_s=end - window.start_s)


def _one_size(fleet: Fleet, costs: Costs, every: int, *, in_place_replicas: int | None = None) -> dict:
    in_place = None if costs.sharded else Method(name="ours in place", kind="inplace", replicas=in_place_replicas)
    methods = [Method(name="ours (policy)", kind="checkfreq"),
               Method(name="Ray Train, per epoch", kind="epoch"),
               Method(name=f"sync every {every}", kind="sync", every=every),
               Method(name=f"async every {every}", kind="async", every=every),
               Method(name="no checkpoint", kind="none")]
    outcomes = [simulate(fleet, method, costs) for method in methods]
    oracles = [oracle(fleet, Method(name=name, kind=kind, every=1), costs)
               for name, kind in (("ours", "checkfreq"), ("async", "async"), ("sync", "sync"))]
    placed = simulate(fleet, in_place, costs) if in_place else None
    placed_best = oracle(fleet, replace(in_place, name="ours in place", every=1), costs) if in_place else None
    print(f"\n{costs.state_gb:g} GB state, storage {costs.storage_gbps:g} GB/s, iteration {costs.iter_s:g} s"
          f"{', sharded' if costs.sharded else ''}:")
    print(f"{'method':30s} {'goodput':>8s} {'recomputed':>11s} {'restarts':>8s} {'stalled s':>10s} "
          f"{'restarting s':>12s}")
    for outcome in outcomes[:1] + ([placed] if placed else []) + outcomes[1:] + oracles[:1] + (
            [placed_best] if placed_best else []) + oracles[1:]:
        print(_row(outcome))
    share = outcomes[0].goodput / oracles[0].goodput if oracles[0].goodput else 0.0
    print(f"ours / its oracle fixed interval: {share:.3f}; ours / Ray Train per epoch: "
          f"{_ratio(outcomes[0].goodput, outcomes[1].goodput)}")
    figures = {"methods": [_as_json(o) for o in outcomes], "oracles": [_as_json(o) for o in oracles],
               "ours_over_oracle": round(share, 4)}
    if placed and placed_best:
        figures["in_place"] = _as_json(placed)
        figures["in_place_oracle"] = _as_json(placed_best)
        figures["in_place_over_ours"] = round(placed.goodput / outcomes[0].goodput, 4) if outcomes[0].goodput else None
        print(_in_place_lines(placed, placed_best, outcomes[0], costs, in_place_replicas or fleet.full_nodes))
    return figures


def _in_place_lines(placed: Outcome, best: Outcome, ours: Outcome, costs: Costs, replicas: int) -> str:
    share = placed.goodput / best.goodput if best.goodput else 0.0
    return (f"ours in place / ours with group restarts: {_ratio(placed.goodput, ours.goodput, digits=3)}; "
            f"ours in place / its oracle fixed interval: {share:.3f}\n"
            f"  in place: {replicas} replicas; {placed.replica_losses} replica losses survived, "
            f"{placed.restarts} whole-job restarts; paused {placed.paused_s:.0f} s (a loss {costs.pause_s:g} s, "
            f"a peer's send {costs.transfer_s:g} s); {placed.short_iterations:.0f} iterations short while "
            f"replacements joined ({costs.heal_s:g} s each); the ideal's {placed.waited_iterations:.0f} iterations "
            f"before {replicas} nodes were live; quorum {costs.quorum_overhead:.1%} of each step")


def _row(outcome: Outcome) -> str:
    return (f"{outcome.method:30s} {outcome.goodput:8.3f} {outcome.lost_iterations:11.0f} {outcome.restarts:8d} "
            f"{outcome.stall_s:10.0f} {outcome.restart_s:12.0f}")


def _ratio(ours: float, other: float, *, digits: int = 1) -> str:
    return f"{ours / other:.{digits}f}x" if other > 0 else "inf (the baseline keeps nothing)"


def _as_json(outcome: Outcome) -> dict:
    data = asdict(outcome)
    data["k"] = sorted(set(outcome.k))
    return data
