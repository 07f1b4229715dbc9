"""Every benchmark, declared once: its module, its title, its settings under ``bench all``,
and how its figures (its ``--json``) read as a table and two bar panels in the report.

A case's ``rows`` turns the figures into ``{row label: {column key: value}}``; the report
renders every case's table and plot from those rows with one function each (report.py).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

Rows = dict[str, dict[str, Any]]


@dataclass(frozen=True, kw_only=True)
class Column:
    key: str
    header: str
    fmt: str = "{}"  # a format string for the value; None prints as "n/a"


@dataclass(frozen=True, kw_only=True)
class Panel:
    keys: tuple[str, ...]  # columns drawn side by side, one bar per row each
    label: str
    log: bool = False


@dataclass(frozen=True, kw_only=True)
class Case:
    name: str
    module: str
    title: str
    small: tuple[str, ...]  # flags under `bench all`: minutes each on 2 cores
    quick: tuple[str, ...]  # under `bench all --quick`: a smoke test, not figures to quote
    rows: Callable[[dict], Rows]
    columns: tuple[Column, ...]
    panels: tuple[Panel, Panel]
    intro: Callable[[dict], str] = lambda figures: ""
    notes: Callable[[dict], list[str]] = lambda figures: []


def pct(value: float | None) -> float | None:
    return None if value is None else 100 * value


PCT = "{:+.1f} %"


def _codec_rows(f: dict) -> Rows:
    return {f"{r['dtype']} {r['method']} x{r['threads']}": {
        "stored": r["ratio_pct"], "encode": r["encode_gbps"]["median"], "decode": r["decode_gbps"]["median"],
        "exact": "yes" if r["bit_identical"] else "NO"} for r in f["rows"]}


def _overhead_rows(f: dict) -> Rows:
    rows: Rows = {}
    if "first" in f:
        first = f["first"]
        rows[f"first {first['first_iterations']} iterations (profiling)"] = {
            "overhead": pct(first["overhead_first"]), "k": first.get("policy_k")}
        rows[f"the other {first['iterations'] - first['first_iterations']}"] = {"overhead": pct(first["overhead_rest"])}
    if "every" in f:
        every = f["every"]
        rows[f"CheckFreq, k = {every['every']}"] = {"overhead": pct(every["overhead_checkfreq"])}
        rows[f"torch.save + fsync, k = {every['every']}"] = {"overhead": pct(every["overhead_torch_save"])}
    for name in ("adaptive", "fixed"):
        for phase, overhead, k in zip(("normal", "slow storage", "normal again"), f.get(name, {}).get(
                "overhead_per_phase", []), f.get(name, {}).get("k_at_phase_end", [])):
            rows[f"{name} k, {phase}"] = {"overhead": pct(overhead), "k": k}
    return rows


def _iterator_rows(f: dict) -> Rows:
    rows: Rows = {name.strip(): {"samples_s": value} for name, value in f.get("throughput_samples_per_s", {}).items()}
    for r in f.get("resume", []):
        rows[f"restore at {100 * r['position']:.0f} %"] = {"first_s": r["ours_s"], "skip_s": r["skip_batches_s"]}
    for name, v in f["before_after"].items():
        rows[name] = {"repeated": v["repeated"], "missed": v["missed"]}
    return rows


def _iterator_notes(f: dict) -> list[str]:
    lines = []
    if "order" in f:
        n, s = f["order"]["config"]["num_samples"], f["order"]["summary"]
        lines.append(f"- order alone at N = {n:,}: <= {s['order_rss_mib_at_n']:.1f} MiB per rank; first batch after "
                     f"a restore at 99.9 % / at 0: {s['first_batch_ratio_end_to_start']:.2f}x")
        if "epoch_samples_per_s_ratio_v2_to_v1" in s:
            lines.append(f"- one epoch, version 2 order / version 1: {s['epoch_samples_per_s_ratio_v2_to_v1']:.2f}x "
                         "samples/s")
    if "ratio_ours_to_stock" in f:
        lines.append(f"- ours / iter_torch_batches with a local shuffle buffer: {f['ratio_ours_to_stock']:.2f}x")
    return lines


def _restore_notes(f: dict) -> list[str]:
    target = f["target"]
    return [f"Own-node slot against the fastest storage ({target['fastest_storage']}): "
            f"{target['own_slot_speedup_vs_fastest_storage']:.1f}x (target {target['required']}x: "
            f"{'met' if target['met'] else 'not met'})."]


def _ray_rows(f: dict) -> Rows:
    per_epoch = f.get("checkpoints_per_epoch", {})
    return {name: {"s_per_iteration": v["seconds_per_iteration"]["median"], "overhead": pct(v["overhead"]["median"]),
                   "low": pct(v["overhead"]["min"]), "high": pct(v["overhead"]["max"]),
                   "per_epoch": per_epoch.get(name)} for name, v in f["variants"].items()}


def _ray_notes(f: dict) -> list[str]:
    recovery = f.get("recovery")
    if not recovery:
        return []
    return [f"Recovery: killed at iteration {recovery.get('killed_at')}, {recovery.get('lost_iterations')} iterations "
            f"lost, kill to first step {recovery.get('restart_to_first_step_s', float('nan')):.1f} s."]


CASES: tuple[Case, ...] = (
    Case(name="codec", module="benchmarks.codec", title="Codec: compression ratio and speed",
         small=("--repeats", "3", "--threads", "1", "--no-delta"),
         quick=("--repeats", "1", "--threads", "1", "--methods", "ours", "--no-delta"),
         intro=lambda f: f"Input: `{f['input']}`, {f['repeats']} round(s).",
         rows=_codec_rows,
         columns=(Column(key="stored", header="stored %", fmt="{:.2f}"),
                  Column(key="encode", header="encode GB/s (median)", fmt="{:.2f}"),
                  Column(key="decode", header="decode GB/s (median)", fmt="{:.2f}"),
                  Column(key="exact", header="exact")),
         panels=(Panel(keys=("stored",), label="stored, % of raw bytes"),
                 Panel(keys=("encode", "decode"), label="GB/s (median)"))),
    Case(name="stall", module="benchmarks.stall", title="Stall per checkpoint, by method",
         small=("--params-m", "25", "--batch", "64", "--every", "4", "--checkpoints", "3"),
         quick=("--params-m", "1", "--batch", "8", "--every", "2", "--checkpoints", "2"),
         intro=lambda f: (f"{f['params'] / 1e6:.1f} M parameters, state {f['state_bytes'] / 2**20:.0f} MiB, step "
                          f"{1e3 * f['step_s']:.0f} ms, a checkpoint every {f['every']} steps."),
         rows=lambda f: {name: {"stall": 1e3 * r["stall_s"], "slowdown": 1e3 * r["slowdown_s"]}
                         for name, r in f["results"].items()},
         columns=(Column(key="stall", header="stall per checkpoint (ms)", fmt="{:.1f}"),
                  Column(key="slowdown", header="slowdown per checkpoint (ms)", fmt="{:.1f}")),
         panels=(Panel(keys=("stall",), label="stall per checkpoint, ms (log)", log=True),
                 Panel(keys=("slowdown",), label="slowdown per checkpoint, ms"))),
    Case(name="overhead", module="benchmarks.overhead",
         title="Overhead and adaptive rate (interleaved with a run without checkpoints)",
         small=("--threads", "1", "--width", "1024", "--iterations", "300", "--first", "100", "--every", "10",
                "--every-iters", "200", "--phase-iters", "100", "--slow-s", "1"),
         quick=("--iterations", "40", "--first", "20", "--epoch-len", "200", "--every-iters", "6", "--every", "3",
                "--phase-iters", "12", "--width", "64", "--block", "10", "--slow-s", "0.02"),
         rows=_overhead_rows,
         columns=(Column(key="overhead", header="overhead", fmt=PCT), Column(key="k", header="k")),
         panels=(Panel(keys=("overhead",), label="overhead, %"), Panel(keys=("k",), label="checkpoint interval k"))),
    Case(name="iterator", module="benchmarks.iterator", title="Data iterator: throughput, shuffle, resume",
         small=("--rows", "50000", "--blocks", "20", "--repeats", "2", "--num-samples", "1000000000",
                "--order-repeats", "2"),
         quick=("--rows", "4000", "--blocks", "4", "--repeats", "1", "--positions", "0.5", "--shuffle-buffer", "500"),
         rows=_iterator_rows, notes=_iterator_notes,
         columns=(Column(key="samples_s", header="samples/s", fmt="{:,.0f}"),
                  Column(key="first_s", header="first batch after a restore, s", fmt="{:.3f}"),
                  Column(key="skip_s", header="skipping batches, s", fmt="{:.3f}"),
                  Column(key="repeated", header="repeated"), Column(key="missed", header="missed")),
         panels=(Panel(keys=("samples_s",), label="samples/s"),
                 Panel(keys=("first_s", "skip_s"), label="time to first batch, s"))),
    Case(name="restore", module="benchmarks.restore", title="Restore time by source",
         small=("--state-mb", "50", "--repeats", "3"), quick=("--state-mb", "3", "--repeats", "1", "--no-s3"),
         intro=lambda f: f"State {f['state_bytes'] / 2**20:.1f} MiB, {f['repeats']} round(s).",
         rows=lambda f: {name: {"median_s": s["median_s"], "times": s["times_vs_own_slot"], "identical": s["identical"],
                                "mib_s": f["state_bytes"] / 2**20 / s["median_s"]} for name, s in f["sources"].items()},
         notes=_restore_notes,
         columns=(Column(key="median_s", header="median s", fmt="{:.3f}"),
                  Column(key="times", header="x own slot", fmt="{:.1f}x"), Column(key="identical", header="identical")),
         panels=(Panel(keys=("median_s",), label="restore time, s (median)"),
                 Panel(keys=("mib_s",), label="MiB/s of state restored (median)"))),
    Case(name="persist", module="benchmarks.persist", title="One agent persist: CPU and wall time by write path",
         small=("--size-mb", "96", "--repeats", "4"), quick=("--size-mb", "8", "--repeats", "2"),
         intro=lambda f: f"A {f['size_mb']} MiB slot stored raw; medians of the rounds after the first.",
         rows=lambda f: {name: {"cpu": 1e3 * m["cpu_s"], "wall": 1e3 * m["wall_s"],
                                "ratio": f["cpu_vs_page_cache"][name]} for name, m in f["median"].items()},
         columns=(Column(key="cpu", header="CPU ms", fmt="{:.1f}"), Column(key="wall", header="wall ms", fmt="{:.1f}"),
                  Column(key="ratio", header="CPU x page_cache", fmt="{:.2f}x")),
         panels=(Panel(keys=("cpu",), label="CPU ms per persist (median)"),
                 Panel(keys=("wall",), label="wall ms per persist (median)"))),
    Case(name="ray", module="benchmarks.ray_bench", title="Ray Train overhead by checkpointing method",
         small=("--state-mb", "50", "--iterations", "30", "--repeats", "2"),
         quick=("--state-mb", "2", "--iterations", "8", "--warmup", "4", "--repeats", "1", "--every", "4"),
         intro=lambda f: (f"k = {f['k']}, Ti = {1e3 * f['iteration_s']:.0f} ms, "
                          f"state {f['state_bytes'] / 2**20:.0f} MiB."),
         rows=_ray_rows, notes=_ray_notes,
         columns=(Column(key="s_per_iteration", header="s / iteration", fmt="{:.3f}"),
                  Column(key="overhead", header="overhead (median)", fmt=PCT),
                  Column(key="low", header="min", fmt=PCT), Column(key="high", header="max", fmt=PCT),
                  Column(key="per_epoch", header="checkpoints per epoch", fmt="{:.1f}")),
         panels=(Panel(keys=("low", "overhead", "high"), label="overhead against no checkpoints, % (min, median, max)"),
                 Panel(keys=("per_epoch",), label="checkpoints per epoch"))),
)
BY_NAME = {case.name: case for case in CASES}
SECTIONS = tuple(BY_NAME)  # the report's order
# `bench store` measures the store alone and `bench all` runs the others: neither is a report section.
OTHER_MODULES = {"store": "benchmarks.store", "sharded": "benchmarks.sharded", "goodput": "benchmarks.goodput",
                 "inplace": "benchmarks.inplace", "all": "benchmarks.all"}
