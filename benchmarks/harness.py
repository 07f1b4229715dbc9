"""The one harness under every benchmark: clocks, interleaved rounds, figures as JSON, the
machine a run came from, and a loopback S3 server.

A benchmark measures variants against a baseline in the same run. On a shared machine the
load changes from second to second, so variants run in interleaved rounds (every variant
once per round) and figures are medians over rounds, never one long stretch per variant.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import logging
import os
import platform
import resource
import socket
import statistics
import subprocess
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import TypeVar

T = TypeVar("T")
MiB = 1024 * 1024
PACKAGES = ("torch", "ray", "numpy", "zstandard", "pyarrow", "nvidia-dali-cuda120", "zipnn")


# ------------------------------------------------------------------ figures out
def add_json_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", default=None, metavar="OUT", help="write the figures to this file")


def write_json(path: str | Path | None, figures: dict) -> None:
    """The figures as JSON at ``path`` (``--json``); nothing without one."""
    if path:
        Path(path).write_text(json.dumps(figures, indent=2))


# ------------------------------------------------------------------ clocks
def cpu_s() -> float:
    """CPU seconds of this process, every thread, user and system."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


@dataclass
class Lap:
    wall_s: float = 0.0
    cpu_s: float = 0.0


@contextlib.contextmanager
def stopwatch() -> Iterator[Lap]:
    """Wall and process CPU time of the block (CPU time: what the work cost, less sensitive
    than wall time to other load)."""
    lap = Lap()
    wall, cpu = time.perf_counter(), time.process_time()
    try:
        yield lap
    finally:
        lap.wall_s, lap.cpu_s = time.perf_counter() - wall, time.process_time() - cpu


def seconds(action: Callable[[], object]) -> float:
    start = time.perf_counter()
    action()
    return time.perf_counter() - start


def median_seconds(action: Callable[[], object], repeats: int) -> float:
    return statistics.median(seconds(action) for _ in range(repeats))


def spread(values: Sequence[float]) -> dict:
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "values": list(values)}


# ------------------------------------------------------------------ interleaved rounds
def rounds(names: Sequence[T], repeats: int, *, warmup: int = 0, alternate: bool = False,
           collect: bool = False) -> Iterator[tuple[int, T]]:
    """``(round, name)`` for every name in every round: ``warmup`` untimed rounds (numbered
    below 0) first. ``alternate`` runs every other round in reverse, so that no variant always
    follows the same other one (what that left in the allocator and caches would bias it);
    ``collect`` garbage-collects before each, so an earlier variant's garbage is not timed."""
    for number in range(-warmup, repeats):
        for name in names[::-1] if alternate and number % 2 else names:
            if collect:
                gc.collect()
            yield number, name


def interleave(variants: dict[str, Callable[[], T]], repeats: int, *, warmup: int = 0,
               alternate: bool = False) -> dict[str, list[T]]:
    """Every variant's results over the timed rounds."""
    results: dict[str, list[T]] = {name: [] for name in variants}
    for number, name in rounds(list(variants), repeats, warmup=warmup, alternate=alternate):
        result = variants[name]()
        if number >= 0:
            results[name].append(result)
    return results


# ------------------------------------------------------------------ the machine
def machine_info() -> dict:
    """The machine and software a report's figures come from."""
    return {
        "cpu_model": _cpu_model(),
        "cores": os.cpu_count(),
        "memory_bytes": _memory_bytes(),
        "gpus": _gpus(),
        "platform": platform.platform(),
        "load_average_at_start": list(os.getloadavg()),
        "versions": _versions(),
        "ray_checkfreq_commit": _git_commit(),
    }


def _cpu_model() -> str:
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


def _memory_bytes() -> int | None:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None


def _gpus() -> list[str]:
    try:
        import torch

        if torch.cuda.is_available():
            return [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    except Exception:  # a broken CUDA install reads as no GPU here
        return []
    return []


def _versions() -> dict[str, str | None]:
    found: dict[str, str | None] = {"python": platform.python_version()}
    for name in PACKAGES:
        try:
            found[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            found[name] = None
    return found


def _git_commit() -> str | None:
    try:
        done = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=Path(__file__).resolve().parent,
                              capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return done.stdout.strip() or None if done.returncode == 0 else None


# ------------------------------------------------------------------ loopback services
def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@contextlib.contextmanager
def moto_server(bucket: str = "bench") -> Iterator[str]:
    """A moto S3 server on 127.0.0.1 with ``bucket`` made; yields its endpoint URL."""
    import boto3
    from moto.server import ThreadedMotoServer

    port = free_port()
    logging.getLogger("werkzeug").setLevel(logging.WARNING)  # moto's server logs every request
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    endpoint = f"http://127.0.0.1:{port}"
    for key, value in (("AWS_ACCESS_KEY_ID", "bench"), ("AWS_SECRET_ACCESS_KEY", "bench"),
                       ("AWS_DEFAULT_REGION", "us-east-1")):
        os.environ.setdefault(key, value)
    try:
        boto3.client("s3", endpoint_url=endpoint).create_bucket(Bucket=bucket)
        yield endpoint
    finally:
        server.stop()

