"""``ray-checkfreq``: inspect, verify and export checkpoints; run the benchmarks."""

from __future__ import annotations

import argparse
import importlib
import logging
import os
import sys
from collections.abc import Sequence
from datetime import datetime, timezone

from ray_checkfreq.codec.nearlossless import MAX_FACTOR_LOG2
from ray_checkfreq.errors import CheckFreqError, CheckpointNotFoundError, CorruptCheckpointError, StorageError
from ray_checkfreq.storage import CheckpointStore


def main(argv: Sequence[str] | None = None) -> int:
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    argv = list(sys.argv[1:] if argv is None else argv)
    # Only the benchmark that runs is imported: some pull in Ray or DALI.
    wanted = argv[1] if len(argv) > 1 and argv[0] == "bench" else None
    parser = _parser(wanted)
    args, unknown = parser.parse_known_args(argv)
    # A benchmark that cannot load has no flags to parse: its run reports why instead.
    if unknown and not getattr(args, "bench_unavailable", None):
        parser.error(f"unrecognized arguments: {' '.join(unknown)}")
    try:
        return args.func(args)
    except (CheckFreqError, ValueError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    except OSError as err:  # a file the command writes or reads, named by the OS error
        print(f"error: {err.filename or ''}: {err.strerror or err}", file=sys.stderr)
        return 1


def _parser(benchmark: str | None = None) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="ray-checkfreq", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    ls = sub.add_parser("ls", help="list the checkpoints under a URI")
    ls.add_argument("uri")
    ls.set_defaults(func=cmd_ls)

    verify = sub.add_parser("verify", help="check every byte of checkpoints against their checksums")
    verify.add_argument("uri")
    verify.add_argument("--step", type=int, default=None, help="only this step (default: every checkpoint)")
    verify.set_defaults(func=cmd_verify)

    export = sub.add_parser("export", help="write one checkpoint as .safetensors, .pt or (sharded) a DCP directory")
    export.add_argument("uri")
    export.add_argument("--step", type=int, default=None, help="default: the newest valid checkpoint")
    export.add_argument("--to", required=True, dest="target", help="FILE.safetensors, FILE.pt or (dcp) DIRECTORY")
    export.add_argument("--format", choices=("safetensors", "pt", "dcp"), default=None, dest="export_format",
                        help="default: from the --to file name; dcp: a PyTorch Distributed Checkpoint "
                             "directory (sharded checkpoints only)")
    trim = export.add_mutually_exclusive_group()
    trim.add_argument("--precision-factor", type=_power_of_two, default=None, metavar="B",
                      help="near-lossless: round tensors whose values lie in [-1, 1] to multiples of 1/B "
                           "(B a power of two: 524288, 2**19 or 2^19; error <= 1/(2B))")
    trim.add_argument("--precision-bits", type=int, default=None, metavar="BITS",
                      help="near-lossless: keep BITS mantissa bits of every float (relative error <= 2^-BITS)")
    export.set_defaults(func=cmd_export)

    from ray_checkfreq.chaos.cli import add_parser as add_chaos_parser

    add_chaos_parser(sub)

    from ray_checkfreq.chaos.cluster_cli import add_parser as add_cluster_parser

    add_cluster_parser(sub)

    from ray_checkfreq.chaos.commit_sim.cli import add_parser as add_simulate_parser

    add_simulate_parser(sub)

    bench = sub.add_parser("bench", help="run a benchmark (from a repository checkout: benchmarks/)")
    bench_sub = bench.add_subparsers(dest="benchmark", required=True)
    for name in BENCHMARK_NAMES:
        bench_parser = bench_sub.add_parser(name)
        bench_parser.set_defaults(func=_bench_runner(name))
        if name == benchmark:
            _bench_arguments(name, bench_parser)
    return parser


# The benchmarks are not part of the library (nor of its wheel): they live in the repository's
# top-level ``benchmarks/`` package, loaded by name only when ``bench`` runs. The names are
# repeated here so that ``--help`` works without it; tests/test_cli.py keeps both lists equal.
BENCHMARK_NAMES = ("store", "persist", "codec", "iterator", "stall", "overhead", "restore", "ray", "sharded", "goodput",
                   "inplace", "all")


def _benchmark_module(name: str):
    """``benchmarks.<module of NAME>``, from the checkout this package was installed from."""
    try:
        benchmarks = importlib.import_module("benchmarks")
    except ImportError:
        root = os.path.dirname(os.path.dirname(os.path.realpath(__file__)))
        if not os.path.isfile(os.path.join(root, "benchmarks", "__init__.py")):
            raise ImportError("the benchmarks are not installed with the package: run `ray-checkfreq bench` from a "
                              "checkout of the repository (pip install -e .), whose benchmarks/ they are") from None
        # Child processes (``bench all``'s, Ray's workers) find it the same way.
        sys.path.insert(0, root)
        os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p)
        benchmarks = importlib.import_module("benchmarks")
    return importlib.import_module(benchmarks.BENCHMARKS[name])


def _bench_arguments(name: str, parser: argparse.ArgumentParser) -> None:
    try:
        _benchmark_module(name).add_arguments(parser)
    except ImportError as err:
        parser.set_defaults(bench_unavailable=str(err))


def _bench_runner(name: str):
    def run(args: argparse.Namespace) -> int:
        if getattr(args, "bench_unavailable", None):
            print(f"error: benchmark unavailable: {args.bench_unavailable}", file=sys.stderr)
            return 1
        return _benchmark_module(name).run(args)

    return run


def _existing_store(uri: str) -> CheckpointStore:
    """A store for reading; refuses a root that is not there (and creates nothing)."""
    store = CheckpointStore(uri)
    if not store.backend.root_exists():
        local = getattr(store.backend, "root", None)
        if local is not None and os.path.lexists(local):
            raise StorageError(store.uri, "is not a directory (a checkpoint store is one)")
        raise StorageError(store.uri, "does not exist")
    return store


def cmd_ls(args: argparse.Namespace) -> int:
    store = _existing_store(args.uri)
    rows = store.scan()
    if not rows:
        print(f"no checkpoints in {store.uri}")
        return 0
    # Rows come oldest first: by writer generation, then step (the newest writer's last).
    print(f"{'writer':>6}  {'step':>10}  {'epoch':>5}  {'ranks':>5}  {'size':>10}  {'committed (UTC)':<19}  "
          "directory")
    for ref, name, fault in rows:
        if ref is not None:
            when = datetime.fromtimestamp(ref.created_unix_ns / 1e9, tz=timezone.utc).strftime("%Y-%m-%d %H:%M:%S")
            flag = "yes" if ref.epoch_boundary else "-"
            ranks = "-" if ref.placement == "replicated" else str(ref.world_size)
            print(f"{ref.writer_generation:>6}  {ref.step:>10}  {flag:>5}  {ranks:>5}  {_human(ref.size_bytes):>10}  "
                  f"{when:<19}  {name}")
        else:
            status = f"CORRUPT MANIFEST: {fault.reason}" if fault else "uncommitted (interrupted save)"
            print(f"{'':>6}  {'?':>10}  {'':>5}  {'':>5}  {'':>10}  {'':<19}  {name}  [{status}]")
    return 0


def cmd_verify(args: argparse.Namespace) -> int:
    store = _existing_store(args.uri)
    failures = 0
    if args.step is not None:
        targets = [args.step]
    else:
        targets = []
        for ref, _name, fault in store.scan():
            if fault is not None:
                print(f"FAULT {fault}")
                failures += 1
            elif ref is not None:
                targets.append(ref)
        if not targets and not failures:
            print(f"error: no committed checkpoints in {store.uri}", file=sys.stderr)
            return 1
    for target in targets:
        try:
            store.verify(target)
            print(f"ok    {getattr(target, 'uri', target)}")
        except (CorruptCheckpointError, CheckpointNotFoundError) as err:
            print(f"FAULT {err}")
            failures += 1
    return 1 if failures else 0


def cmd_export(args: argparse.Namespace) -> int:
    from ray_checkfreq.storage.export import export_store

    store = _existing_store(args.uri)
    written = export_store(store, args.step, args.target, fmt=args.export_format,
                           precision_factor=args.precision_factor, precision_bits=args.precision_bits)
    print(f"wrote {written}")
    return 0


def _power_of_two(text: str) -> int | float:
    """``2**19``, ``2^19`` or a number (the codec checks it is a power of two); an
    exponent is range-checked before anything is computed from it."""
    for sep in ("**", "^"):
        base, found, exponent = text.partition(sep)
        if found and base.strip() == "2" and exponent.strip().isdigit():
            digits = exponent.strip().lstrip("0") or "0"
            if len(digits) > 3 or int(digits) > MAX_FACTOR_LOG2:
                raise argparse.ArgumentTypeError(f"{text}: the exponent must be 0 to {MAX_FACTOR_LOG2}")
            return 2 ** int(digits)
    try:
        return int(text)
    except ValueError:
        return float(text)


def _human(nbytes: int) -> str:
    size = float(nbytes)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if size < 1024 or unit == "GiB":
            return f"{size:.1f} {unit}" if unit != "B" else f"{nbytes} B"
        size /= 1024
    return f"{nbytes} B"


if __name__ == "__main__":
    sys.exit(main())
