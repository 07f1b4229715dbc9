"""The reports of ``bench all``: report.json, report.md and one PNG per benchmark.

Each benchmark's figures (its own ``--json``) become rows (its case in cases.py); one
function renders every case's rows as a table, one as a plot; its printed table is
embedded as it came. A figure missing from a benchmark's JSON (say, after that benchmark
changed) costs its summary and plot, never the report.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

from benchmarks.cases import BY_NAME, Case, Rows

logger = logging.getLogger("benchmarks")


def _table(header: list[str], rows: list[list[Any]]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return lines + ["| " + " | ".join(str(cell) for cell in row) + " |" for row in rows]


def summary(case: Case, figures: dict) -> list[str]:
    """The case's intro line, its table of rows, its notes."""
    rows = case.rows(figures)
    shown = [c for c in case.columns if any(c.key in row for row in rows.values())]
    cells = [[label, *(_cell(row, c.key, c.fmt) for c in shown)] for label, row in rows.items()]
    intro = case.intro(figures)
    return [*([intro, ""] if intro else []), *_table(["", *(c.header for c in shown)], cells),
            *(["", *case.notes(figures)] if case.notes(figures) else [])]


def _cell(row: dict, key: str, fmt: str) -> str:
    if key not in row:
        return ""
    return "n/a" if row[key] is None else fmt.format(row[key])


def plot(case: Case, rows: Rows, ax: Any) -> None:
    """One panel per ``case.panels``: a bar per row (that has the panel's columns), side by side per column."""
    for axis, panel in zip(ax, case.panels):
        labels = [label for label, row in rows.items() if any(row.get(k) is not None for k in panel.keys)]
        width = 0.8 / len(panel.keys)
        for index, key in enumerate(panel.keys):
            offset = (index - (len(panel.keys) - 1) / 2) * width
            axis.bar([i + offset for i in range(len(labels))], [rows[label].get(key) or 0 for label in labels],
                     width, label=next((c.header for c in case.columns if c.key == key), key))
        crowded = len(labels) > 6 or max(map(len, labels), default=0) > 14
        axis.set_xticks(range(len(labels)), labels, fontsize=7, rotation=30 if crowded else 0,
                        ha="right" if crowded else "center")
        axis.set_ylabel(panel.label)
        if panel.log:
            axis.set_yscale("log")
        if len(panel.keys) > 1:
            axis.legend(fontsize=7)


def draw(name: str, figures: dict, out: Path) -> str:
    """The section's PNG (file name relative to ``out``)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    case = BY_NAME[name]
    fig, ax = plt.subplots(1, 2, figsize=(12, 4.5))
    try:
        plot(case, case.rows(figures), ax)
        fig.suptitle(case.title)
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
    lines = [f"## {BY_NAME[name].title}{status}", "", f"`{section['command']}` ({section['wall_s']:.0f} s)", ""]
    lines += [f"Note: {note}" for note in section["notes"]]
    if section["figures"] is not None:
        try:
            lines += [*summary(BY_NAME[name], section["figures"]), ""]
        except (KeyError, TypeError, ValueError, ZeroDivisionError) as err:
            lines += [f"(no summary: {err!r}; the figures are in report.json)", ""]
    if section.get("plot"):
        lines += [f"![{name}]({section['plot']})", ""]
    if section["output"].strip():
        lines += ["<details><summary>printed by the benchmark</summary>", "", "```",
                  section["output"].rstrip(), "```", "", "</details>", ""]
    return lines
