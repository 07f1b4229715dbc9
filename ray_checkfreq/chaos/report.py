"""The chaos report: totals and a timeline, computed from the event log alone (pure).

Events are dicts with a wall time ``t`` and an ``event`` name. From the job (one per
rank and line, see ``job.py``): ``start``, ``batch``, ``end``. From the injector:
``inject`` (a preemption: index, kind, ``t_kill`` when the process or node died), ``notice``
(a drain sent), ``replace`` (a node added back), ``commit`` (a checkpoint's manifest seen
in storage: ``step``).

Which batches count: an attempt that began at iteration s rolls back every earlier
attempt's batches after s. So a batch of attempt a at iteration i survives iff no later
attempt began before i. Over the surviving batches every sample of a finished epoch must
appear exactly once, and the last epoch's samples once each; anything else is a lost or
repeated sample. Lost work of a restart: the iterations the previous attempt reached
beyond the iteration the restart began at; CheckFreq bounds it by 2k.
"""

from __future__ import annotations

import statistics
from collections import Counter, defaultdict
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Attempt:
    attempt: int
    started_t: float
    start_iteration: int
    world_size: int
    restore: dict | None
    first_step_t: float | None
    reached: int


def attempts(events: list[dict]) -> list[Attempt]:
    """The job's attempts in order (the writer generation each restore took orders them)."""
    starts: dict[int, list[dict]] = defaultdict(list)
    batches: dict[int, list[dict]] = defaultdict(list)
    for e in events:
        if e["event"] == "start":
            starts[e["attempt"]].append(e)
        elif e["event"] == "batch":
            batches[e["attempt"]].append(e)
    found = []
    for attempt in sorted(starts):
        first = min(starts[attempt], key=lambda s: s["rank"])
        done = batches.get(attempt, [])
        found.append(Attempt(
            attempt=attempt, started_t=min(s["t"] for s in starts[attempt]), start_iteration=first["iteration"],
            world_size=first["world_size"], restore=first.get("restore"),
            first_step_t=min((b["t"] for b in done), default=None),
            reached=max((b["iteration"] for b in done), default=first["iteration"])))
    return found


def surviving_batches(events: list[dict], found: list[Attempt]) -> list[dict]:
    """Batches no later attempt rolled back."""
    later_min: dict[int, float] = {}
    lowest = float("inf")
    for a in reversed(found):
        later_min[a.attempt] = lowest
        lowest = min(lowest, a.start_iteration)
    return [e for e in events if e["event"] == "batch" and e["attempt"] in later_min
            and e["iteration"] <= later_min[e["attempt"]]]


def sample_accounting(kept: list[dict], *, samples: int, global_batch: int, epoch_len: int,
                      total_iterations: int) -> dict:
    """Lost and repeated samples per epoch over the surviving batches."""
    per_epoch: dict[int, Counter] = defaultdict(Counter)
    for batch in kept:
        per_epoch[batch["epoch"]].update(batch["ids"])
    lost = repeated = 0
    epochs = -(-total_iterations // epoch_len)
    for epoch in range(epochs):
        iterations = min(epoch_len, total_iterations - epoch * epoch_len)
        expected = min(samples, iterations * global_batch)
        seen = per_epoch.get(epoch, Counter())
        valid = {i for i in seen if 0 <= i < samples}
        repeated += sum(seen.values()) - len(seen)
        lost += max(0, expected - len(valid))
    extra_epochs = [e for e in per_epoch if not 0 <= e < epochs]
    repeated += sum(sum(per_epoch[e].values()) for e in extra_epochs)
    return {"samples_lost": lost, "samples_repeated": repeated}


def largest_k(events: list[dict]) -> int:
    """The largest k in force: the fixed k of the start events, or every k the policy picked."""
    fixed = [e.get("k") or 0 for e in events if e["event"] == "start"]
    picked = [e.get("k") or 0 for e in events if e["event"] == "k" and e.get("rank") == 0]
    return max(fixed + picked, default=0)


def preemption_outcomes(events: list[dict], found: list[Attempt]) -> list[dict]:
    """Per injected preemption: the restart it caused (if any), what it restored, the work lost."""
    injects = sorted((e for e in events if e["event"] == "inject"), key=lambda e: e["t"])
    outcomes = []
    for n, inject in enumerate(injects):
        until = injects[n + 1]["t"] if n + 1 < len(injects) else float("inf")
        t_kill = inject.get("t_kill", inject["t"])
        restarts = [a for a in found if inject["t"] <= a.started_t < until]
        entry = {"index": inject.get("index", n), "kind": inject["kind"], "t": inject["t"], "t_kill": t_kill,
                 "iteration": inject.get("iteration"), "restarted": bool(restarts), "lost_iterations": 0,
                 "restored_step": None, "restored_from": None, "restart_to_first_step_s": None,
                 "lost_after_notice": None}
        if restarts:
            restart = restarts[-1]  # a start that failed and was retried ends with the one that ran
            before = found.index(restarts[0]) - 1
            reached = found[before].reached if before >= 0 else 0
            entry.update(restored_step=restart.start_iteration,
                         restored_from=(restart.restore or {}).get("kind"),
                         lost_after_notice=(restart.restore or {}).get("lost_after_notice"),
                         lost_iterations=max(0, reached - restart.start_iteration))
            if restart.first_step_t is not None:
                entry["restart_to_first_step_s"] = restart.first_step_t - t_kill
        outcomes.append(entry)
    return outcomes


def build_report(events: list[dict], *, identical: bool | None = None, max_abs_diff: float | None = None,
                 tolerance: float | None = None) -> dict:
    """Totals (the keys ``--json`` promises) plus per-preemption and per-attempt detail."""
    found = attempts(events)
    if not found:
        raise ValueError("the event log has no start event: the job never ran")
    first = next(e for e in events if e["event"] == "start")
    ends = [e for e in events if e["event"] == "end" and e["rank"] == 0]
    total = max((e["iteration"] for e in ends), default=max(a.reached for a in found))
    kept = surviving_batches(events, found)
    accounting = sample_accounting(kept, samples=first["samples"], global_batch=first["global_batch"],
                                   epoch_len=first["epoch_len"], total_iterations=total)
    outcomes = preemption_outcomes(events, found)
    k_max = largest_k(events)
    lost = [o["lost_iterations"] for o in outcomes]
    restarts = [o["restart_to_first_step_s"] for o in outcomes if o["restart_to_first_step_s"] is not None]
    run_start = min(e["t"] for e in events if e["event"] in ("run_start", "start"))
    totals = {
        "preemptions": len(outcomes),
        "preemptions_survived": len(outcomes) if ends else 0,
        "finished": bool(ends),
        "iterations": total,
        "k_max": k_max,
        "lost_iterations_bound": 2 * k_max,
        "lost_iterations_total": sum(lost),
        "lost_iterations_mean": statistics.fmean(lost) if lost else 0.0,
        "lost_iterations_max": max(lost, default=0),
        "lost_within_bound": all(value <= 2 * k_max for value in lost),
        "restart_to_first_step_s_mean": statistics.fmean(restarts) if restarts else None,
        "restart_to_first_step_s_max": max(restarts, default=None),
        "restarts": len(found) - 1,
        "commits": len({e["step"] for e in events if e["event"] == "commit"}),
        "nodes_replaced": sum(e["event"] == "replace" for e in events),
        "nodes_added": sum(e["event"] == "add" for e in events),
        "time_to_finish_s": (max(e["t"] for e in ends) - run_start) if ends else None,
        "identical_to_uninterrupted": identical,
        "max_abs_diff": max_abs_diff,
        "tolerance": tolerance,
        **accounting,
    }
    totals["detail"] = {"preemptions": outcomes,
                        "attempts": [vars(a) for a in found]}
    return totals


def kinds_seen(report: dict) -> set[str]:
    return {p["kind"] for p in report["detail"]["preemptions"]}


def describe(report: dict) -> list[str]:
    """Human-readable lines of the totals."""
    same = report["identical_to_uninterrupted"]
    weights = "not compared" if same is None else ("yes" if same else
                                                   f"no (max abs diff {report['max_abs_diff']})")
    if same is False and report.get("tolerance") is not None and report["max_abs_diff"] is not None:
        weights += f"; within {report['tolerance']:g}: {report['max_abs_diff'] <= report['tolerance']}"
    mean_restart = report["restart_to_first_step_s_mean"]
    unreached = report.get("unreached_preemptions") or []
    beyond = [f"trace losses after the run ended (not injected): {len(unreached)}"] if unreached else []
    notices = [o for o in report["detail"].get("preemptions", []) if o.get("kind") == "notice"]
    if notices:
        beyond.append("iterations lost after each notice (None: not counted): "
                      + ", ".join(str(o.get("lost_after_notice")) for o in notices))
    return beyond + [
        f"preemptions survived: {report['preemptions_survived']} of {report['preemptions']} "
        f"({report['restarts']} restarts, {report['commits']} checkpoints committed)",
        f"lost iterations per preemption: mean {report['lost_iterations_mean']:.1f}, max "
        f"{report['lost_iterations_max']} (bound 2k = {report['lost_iterations_bound']}; "
        f"within: {'yes' if report['lost_within_bound'] else 'NO'})",
        "restart to first step: " + ("no restart" if mean_restart is None else
                                     f"mean {mean_restart:.1f} s, max {report['restart_to_first_step_s_max']:.1f} s"),
        f"world sizes: {' -> '.join(str(a['world_size']) for a in report['detail']['attempts'])} "
        f"({report['nodes_replaced']} nodes replaced, {report['nodes_added']} added)",
        f"samples lost: {report['samples_lost']}, repeated: {report['samples_repeated']}",
        f"final weights identical to an uninterrupted run: {weights}",
    ]


def plot_timeline(events: list[dict], report: dict, path: str, *, title: str = "chaos run") -> None:
    """Iteration against wall time; commits, notices, preemptions and restores marked; lost work per preemption."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    t0 = min(e["t"] for e in events if e["event"] in ("run_start", "start"))
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(10, 6.5), gridspec_kw={"height_ratios": [3, 1]})
    _plot_progress(top, events, t0)
    _plot_marks(top, events, report, t0)
    top.set_xlabel("seconds since fit() started")
    top.set_ylabel("iteration")
    top.set_title(title)
    top.legend(loc="lower right", fontsize=8)
    _plot_lost(bottom, report)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _plot_progress(ax: Any, events: list[dict], t0: float) -> None:
    by_attempt: dict[int, list[tuple[float, int]]] = defaultdict(list)
    for e in events:
        if e["event"] == "batch" and e["rank"] == 0:
            by_attempt[e["attempt"]].append((e["t"] - t0, e["iteration"]))
    for n, attempt in enumerate(sorted(by_attempt)):
        points = sorted(by_attempt[attempt])
        ax.plot([p[0] for p in points], [p[1] for p in points], color="tab:blue", lw=1.5,
                label="training (rank 0)" if n == 0 else None)


def _plot_marks(ax: Any, events: list[dict], report: dict, t0: float) -> None:
    commits = [e for e in events if e["event"] == "commit"]
    ax.scatter([e["t"] - t0 for e in commits], [e["step"] for e in commits], marker="o", s=14,
               color="tab:green", label="checkpoint committed", zorder=3)
    for n, e in enumerate(e for e in events if e["event"] == "add"):
        ax.axvline(e["t"] - t0, color="tab:cyan", ls=":", lw=1, label="node added" if n == 0 else None)
    for n, e in enumerate(e for e in events if e["event"] == "notice"):
        ax.axvline(e["t"] - t0, color="tab:orange", ls="--", lw=1, label="drain notice" if n == 0 else None)
    for n, p in enumerate(report["detail"]["preemptions"]):
        ax.axvline(p["t_kill"] - t0, color="tab:red", lw=1, label="preemption" if n == 0 else None)
        ax.annotate(f"{p['index'] + 1}: {p['kind']}", (p["t_kill"] - t0, ax.get_ylim()[1]), rotation=90,
                    fontsize=7, va="top", ha="right", color="tab:red")
    attempts_ = report["detail"]["attempts"][1:]
    ax.scatter([a["started_t"] - t0 for a in attempts_], [a["start_iteration"] for a in attempts_],
               marker="^", s=40, color="tab:purple", label="restore (iteration resumed at)", zorder=4)


def _plot_lost(ax: Any, report: dict) -> None:
    outcomes = report["detail"]["preemptions"]
    labels = [f"{p['index'] + 1}: {p['kind']}" for p in outcomes]
    bars = ax.bar(range(len(outcomes)), [p["lost_iterations"] for p in outcomes], color="tab:red")
    ax.bar_label(bars, labels=[str(p["lost_iterations"]) for p in outcomes], fontsize=8)
    ax.axhline(report["lost_iterations_bound"], color="black", ls=":", lw=1, label="bound 2k")
    ax.set_xticks(range(len(outcomes)), labels, fontsize=8)
    ax.set_ylabel("lost iterations")
    ax.set_ylim(0, max(report["lost_iterations_bound"], report["lost_iterations_max"]) * 1.2 + 1)
    ax.legend(loc="upper right", fontsize=8)
