"""The reports of ``bench all``: report.json, report.md and one PNG per benchmark.

Each benchmark's figures (its own ``--json``) get a short table and a plot here; its
printed table is embedded as it came. A figure missing from a benchmark's JSON (say,
after that benchmark changed) costs its summary and plot, never the report.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

logger = logging.getLogger("benchmarks")

TITLES = {
    "codec": "Codec: compression ratio and speed",
    "stall": "Stall per checkpoint, by method",
    "overhead": "Overhead and adaptive rate (interleaved with a run without checkpoints)",
    "iterator": "Data iterator: throughput, shuffle, resume",
    "restore": "Restore time by source",
    "persist": "One agent persist: CPU and wall time by write path",
    "ray": "Ray Train overhead by checkpointing method",
}


# ------------------------------------------------------------------ summaries (markdown rows)
def _table(header: list[str], rows: list[list[Any]]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return lines + ["| " + " | ".join(str(cell) for cell in row) + " |" for row in rows]


def _pct(value: float | None) -> str:
    return "n/a" if value is None else f"{100 * value:+.1f} %"


def summary_codec(f: dict) -> list[str]:
    rows = [[r["dtype"], r["method"], r["threads"], f"{r['ratio_pct']:.2f}", f"{r['encode_gbps']['median']:.2f}",
             f"{r['decode_gbps']['median']:.2f}", "yes" if r["bit_identical"] else "NO"] for r in f["rows"]]
    return [f"Input: `{f['input']}`, {f['repeats']} round(s).", "",
            *_table(["dtype", "method", "threads", "stored %", "encode GB/s (median)", "decode GB/s (median)",
                     "exact"], rows)]


def summary_stall(f: dict) -> list[str]:
    rows = [[name, f"{1e3 * r['stall_s']:.1f}", f"{1e3 * r['slowdown_s']:.1f}"] for name, r in f["results"].items()]
    return [f"{f['params'] / 1e6:.1f} M parameters, state {f['state_bytes'] / 2**20:.0f} MiB, step "
            f"{1e3 * f['step_s']:.0f} ms, a checkpoint every {f['every']} steps.", "",
            *_table(["method", "stall per checkpoint (ms)", "slowdown per checkpoint (ms)"], rows)]


def summary_overhead(f: dict) -> list[str]:
    lines = []
    if "first" in f:
        first = f["first"]
        lines.append(f"- first: {first['iterations']} iterations; overhead over the first "
                     f"{first['first_iterations']} (profiling included) {_pct(first['overhead_first'])}, after them "
                     f"{_pct(first['overhead_rest'])}; policy k {first.get('policy_k')}.")
    if "every" in f:
        every = f["every"]
        lines.append(f"- every: k = {every['every']} fixed: CheckFreq {_pct(every['overhead_checkfreq'])}, "
                     f"torch.save + fsync {_pct(every['overhead_torch_save'])}.")
    for name in ("adaptive", "fixed"):
        if name in f:
            phases = ", ".join(_pct(p) for p in f[name]["overhead_per_phase"])
            lines.append(f"- {name} k, phases normal / slow storage / normal: {phases}; k at each phase's end "
                         f"{f[name]['k_at_phase_end']}.")
    return lines


def summary_iterator(f: dict) -> list[str]:
    throughput = f.get("throughput_samples_per_s", {})
    lines = [f"- {name.strip()}: {value:,.0f} samples/s" for name, value in throughput.items()]
    if "order" in f:
        n, s = f["order"]["config"]["num_samples"], f["order"]["summary"]
        lines.append(f"- order alone at N = {n:,}: <= {s['order_rss_mib_at_n']:.1f} MiB per rank; first batch after "
                     f"a restore at 99.9 % / at 0: {s['first_batch_ratio_end_to_start']:.2f}x")
        if "epoch_samples_per_s_ratio_v2_to_v1" in s:
            lines.append(f"- one epoch, version 2 order / version 1: {s['epoch_samples_per_s_ratio_v2_to_v1']:.2f}x "
                         "samples/s")
    if "ratio_ours_to_stock" in f:
        lines.append(f"- ours / iter_torch_batches with a local shuffle buffer: {f['ratio_ours_to_stock']:.2f}x")
    lines += [f"- restore at {100 * r['position']:.0f} % of an epoch: first batch after {r['ours_s']:.3f} s "
              f"(skipping batches: {r['skip_batches_s']:.3f} s)" for r in f.get("resume", [])]
    lines += [f"- {name}: {v['repeated']} repeated, {v['missed']} missed" for name, v in f["before_after"].items()]
    return lines


def summary_restore(f: dict) -> list[str]:
    rows = [[name, f"{s['median_s']:.3f}", f"{s['times_vs_own_slot']:.1f}x", s["identical"]]
            for name, s in f["sources"].items()]
    target = f["target"]
    return [f"State {f['state_bytes'] / 2**20:.1f} MiB, {f['repeats']} round(s).", "",
            *_table(["source", "median s", "x own slot", "identical"], rows), "",
            f"Own-node slot against the fastest storage ({target['fastest_storage']}): "
            f"{target['own_slot_speedup_vs_fastest_storage']:.1f}x (target {target['required']}x: "
            f"{'met' if target['met'] else 'not met'})."]


def summary_persist(f: dict) -> list[str]:
    rows = [[name, f"{1e3 * m['cpu_s']:.1f}", f"{1e3 * m['wall_s']:.1f}", f"{f['cpu_vs_page_cache'][name]:.2f}x"]
            for name, m in f["median"].items()]
    return [f"A {f['size_mb']} MiB slot stored raw; medians of the rounds after the first.", "",
            *_table(["variant", "CPU ms", "wall ms", "CPU x page_cache"], rows)]


def summary_ray(f: dict) -> list[str]:
    rows = [[name, f"{v['seconds_per_iteration']['median']:.3f}", _pct(v["overhead"]["median"]),
             f"{_pct(v['overhead']['min'])} .. {_pct(v['overhead']['max'])}"] for name, v in f["variants"].items()]
    lines = [f"k = {f['k']}, Ti = {1e3 * f['iteration_s']:.0f} ms, state {f['state_bytes'] / 2**20:.0f} MiB.", "",
             *_table(["variant", "s / iteration", "overhead (median)", "min .. max"], rows)]
    recovery = f.get("recovery")
    if recovery:
        lines += ["", f"Recovery: killed at iteration {recovery.get('killed_at')}, "
                      f"{recovery.get('lost_iterations')} iterations lost, kill to first step "
                      f"{recovery.get('restart_to_first_step_s', float('nan')):.1f} s."]
    return lines


# ------------------------------------------------------------------ plots
def plot_codec(f: dict, ax: Any) -> None:
    rows = [r for r in f["rows"] if r["threads"] == min(x["threads"] for x in f["rows"])]
    labels = [f"{r['dtype'].split()[0]} {r['method']}" for r in rows]
    positions = range(len(rows))
    ax[0].bar(positions, [r["ratio_pct"] for r in rows], color="tab:blue")
    ax[0].set_ylabel("stored, % of raw bytes")
    ax[0].set_xticks(list(positions), labels, fontsize=7, rotation=60, ha="right")
    width = 0.4
    ax[1].bar([p - width / 2 for p in positions], [r["encode_gbps"]["median"] for r in rows], width, label="encode")
    ax[1].bar([p + width / 2 for p in positions], [r["decode_gbps"]["median"] for r in rows], width, label="decode")
    ax[1].set_ylabel(f"GB/s (median, {rows[0]['threads']} thread)")
    ax[1].set_xticks(list(positions), labels, fontsize=7, rotation=60, ha="right")
    ax[1].legend()


def plot_stall(f: dict, ax: Any) -> None:
    names = list(f["results"])
    ax[0].bar(range(len(names)), [1e3 * max(f["results"][n]["stall_s"], 1e-3) for n in names], color="tab:orange")
    ax[0].set_yscale("log")
    ax[0].set_ylabel("stall per checkpoint, ms (log)")
    ax[0].set_xticks(range(len(names)), [n.replace(" ", "\n", 1) for n in names], fontsize=7)
    ax[1].bar(range(len(names)), [1e3 * f["results"][n]["slowdown_s"] for n in names], color="tab:red")
    ax[1].set_ylabel("slowdown per checkpoint, ms")
    ax[1].set_xticks(range(len(names)), [n.replace(" ", "\n", 1) for n in names], fontsize=7)


def plot_overhead(f: dict, ax: Any) -> None:
    bars = {}
    if "first" in f:
        bars["first stretch"] = f["first"]["overhead_first"]
        bars["after it"] = f["first"]["overhead_rest"] or 0.0
    if "every" in f:
        bars[f"CheckFreq k={f['every']['every']}"] = f["every"]["overhead_checkfreq"]
        bars[f"torch.save k={f['every']['every']}"] = f["every"]["overhead_torch_save"]
    ax[0].bar(range(len(bars)), [100 * v for v in bars.values()], color="tab:green")
    ax[0].set_xticks(range(len(bars)), list(bars), fontsize=7)
    ax[0].set_ylabel("overhead, %")
    for name, color in (("adaptive", "tab:green"), ("fixed", "tab:gray")):
        if name in f:
            ax[1].plot([1, 2, 3], [100 * v for v in f[name]["overhead_per_phase"]], "o-", color=color,
                       label=f"{name} k")
    ax[1].set_xticks([1, 2, 3], ["normal", "slow storage", "normal"])
    ax[1].set_ylabel("overhead per phase, %")
    ax[1].legend()


def plot_iterator(f: dict, ax: Any) -> None:
    throughput = f.get("throughput_samples_per_s", {})
    names = list(throughput)
    ax[0].bar(range(len(names)), [throughput[n] for n in names], color="tab:purple")
    ax[0].set_xticks(range(len(names)), [n.strip().replace(" ", "\n", 1) for n in names], fontsize=7)
    ax[0].set_ylabel("samples/s")
    resume = f.get("resume", [])
    ax[1].plot([100 * r["position"] for r in resume], [r["ours_s"] for r in resume], "o-", label="ours (restore)")
    ax[1].plot([100 * r["position"] for r in resume], [r["skip_batches_s"] for r in resume], "o-",
               label="skip batches")
    ax[1].set_xlabel("resume position, % of an epoch")
    ax[1].set_ylabel("time to first batch, s")
    ax[1].legend()


def plot_restore(f: dict, ax: Any) -> None:
    names = list(f["sources"])
    ax[0].barh(range(len(names)), [f["sources"][n]["median_s"] for n in names], color="tab:cyan")
    ax[0].set_yticks(range(len(names)), names, fontsize=7)
    ax[0].invert_yaxis()
    ax[0].set_xlabel("restore time, s (median)")
    mib = f["state_bytes"] / 2**20
    ax[1].barh(range(len(names)), [mib / f["sources"][n]["median_s"] for n in names], color="tab:cyan")
    ax[1].set_yticks(range(len(names)), names, fontsize=7)
    ax[1].invert_yaxis()
    ax[1].set_xlabel("MiB/s of state restored (median)")


def plot_persist(f: dict, ax: Any) -> None:
    names = list(f["median"])
    for axis, key, label in ((ax[0], "cpu_s", "CPU"), (ax[1], "wall_s", "wall")):
        axis.bar(range(len(names)), [1e3 * f["median"][n][key] for n in names], color="tab:olive")
        axis.set_xticks(range(len(names)), [n.replace("_", "\n") for n in names], fontsize=7)
        axis.set_ylabel(f"{label} ms per persist of {f['size_mb']} MiB (median)")


def plot_ray(f: dict, ax: Any) -> None:
    names = list(f["variants"])
    medians = [100 * f["variants"][n]["overhead"]["median"] for n in names]
    low = [m - 100 * f["variants"][n]["overhead"]["min"] for m, n in zip(medians, names)]
    high = [100 * f["variants"][n]["overhead"]["max"] - m for m, n in zip(medians, names)]
    ax[0].bar(range(len(names)), medians, yerr=[low, high], color="tab:blue", capsize=3)
    ax[0].set_xticks(range(len(names)), [n.replace("_", "\n", 1) for n in names], fontsize=7)
    ax[0].set_ylabel("overhead against no checkpoints, % (median, min..max)")
    per_epoch = f.get("checkpoints_per_epoch", {})
    shown = [n for n in names if per_epoch.get(n) is not None]
    ax[1].bar(range(len(shown)), [per_epoch[n] for n in shown], color="tab:gray")
    ax[1].set_xticks(range(len(shown)), [n.replace("_", "\n", 1) for n in shown], fontsize=7)
    ax[1].set_ylabel(f"checkpoints per epoch ({f['config']['epoch_len']} iterations)")


SUMMARIES: dict[str, Callable[[dict], list[str]]] = {
    "codec": summary_codec, "stall": summary_stall, "overhead": summary_overhead,
    "iterator": summary_iterator, "restore": summary_restore, "persist": summary_persist, "ray": summary_ray,
}
PLOTS: dict[str, Callable[[dict, Any], None]] = {
    "codec": plot_codec, "stall": plot_stall, "overhead": plot_overhead,
    "iterator": plot_iterator, "restore": plot_restore, "persist": plot_persist, "ray": plot_ray,
}


def draw(name: str, figures: dict, out: Path) -> str:
    """The section's PNG (file name relative to ``out``)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(1, 2, figsize=(12, 4.5))
    try:
        PLOTS[name](figures, ax)
        fig.suptitle(TITLES[name])
        fig.tight_layout()
        fig.savefig(out / f"{name}.png", dpi=90)
    finally:
        plt.close(fig)
    return f"{name}.png"


# ------------------------------------------------------------------ the reports
def write_reports(report: dict, out: Path) -> None:
    for name, section in report["sections"].items():
        if section["figures"] is None:
            continue
        try:
            section["plot"] = draw(name, section["figures"], out)
        except Exception as err:  # a plot is never worth the report
            logger.warning("bench all: no plot for %s: %r", name, err)
            section["notes"].append(f"no plot: {err!r}")
    (out / "report.json").write_text(json.dumps(report, indent=2, default=str))
    (out / "report.md").write_text(markdown(report))


def markdown(report: dict) -> str:
    lines = [f"# ray_checkfreq benchmark report ({report['settings']} settings)", "",
             f"Made by `{report['command']}` on {report['started_utc']} in {report['wall_s'] / 60:.1f} minutes.", "",
             *machine_lines(report["machine"]), "", *load_warning(report["machine"])]
    for name, section in report["sections"].items():
        lines += section_lines(name, section)
    return "\n".join(lines) + "\n"


def machine_lines(machine: dict) -> list[str]:
    memory = machine.get("memory_bytes")
    versions = ", ".join(f"{name} {version}" for name, version in machine["versions"].items() if version)
    load = machine.get("load_average_at_start") or []
    return _table(["machine", ""], [
        ["CPU", f"{machine['cpu_model']}, {machine['cores']} cores"],
        ["memory", f"{memory / 2**30:.1f} GiB" if memory else "unknown"],
        ["GPU", ", ".join(machine["gpus"]) or "none"],
        ["platform", machine["platform"]],
        ["versions", versions],
        ["ray_checkfreq commit", machine.get("ray_checkfreq_commit") or "unknown"],
        ["load average at start", " / ".join(f"{x:.2f}" for x in load)],
    ])


def load_warning(machine: dict) -> list[str]:
    load = (machine.get("load_average_at_start") or [0.0])[0]
    cores = machine.get("cores") or 1
    if load <= cores:
        return []
    return [f"**The machine was shared**: load average {load:.1f} on {cores} cores when the run started. "
            "Other work took CPU time at random moments, so timings (and the overheads, which are differences "
            "of timings) are noisy; compression ratios, sizes, counts and exactness are not affected.", ""]


def section_lines(name: str, section: dict) -> list[str]:
    status = "" if section["exit_code"] == 0 else f" (FAILED: {section['error']})"
    lines = [f"## {TITLES[name]}{status}", "", f"`{section['command']}` ({section['wall_s']:.0f} s)", ""]
    lines += [f"Note: {note}" for note in section["notes"]]
    if section["figures"] is not None:
        try:
            lines += [*SUMMARIES[name](section["figures"]), ""]
        except (KeyError, TypeError, ValueError, ZeroDivisionError) as err:
            lines += [f"(no summary: {err!r}; the figures are in report.json)", ""]
    if section.get("plot"):
        lines += [f"![{name}]({section['plot']})", ""]
    if section["output"].strip():
        lines += ["<details><summary>printed by the benchmark</summary>", "", "```",
                  section["output"].rstrip(), "```", "", "</details>", ""]
    return lines
