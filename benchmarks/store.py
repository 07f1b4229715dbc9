"""``ray-checkfreq bench store``: save/load throughput against torch.save / torch.load.

Same state, same run: a model-like dict of float32 tensors of ``--size-mb`` in total.
Local disk: CheckpointStore.save (fsync + commit) vs ``torch.save`` + fsync, and
CheckpointStore.load (checksums verified) vs ``torch.load(weights_only=True)``. Every
save is a full checkpoint (``full_every=1``: an XOR delta of an unchanged state would
be nearly empty and flatter the figures), once stored raw and once compressed.
S3 (``--s3``): a moto server on 127.0.0.1 started here; CheckpointStore over boto3 vs
``torch.save`` into memory + one ``upload_fileobj``, and download + ``torch.load``.
"""

from __future__ import annotations

import argparse
import io
import os
import shutil
import tempfile
from collections.abc import Callable

import torch

from benchmarks import store_deltas
from benchmarks.harness import MiB, add_json_argument, median_seconds, moto_server, write_json
from ray_checkfreq.storage import CheckpointStore


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--size-mb", type=int, default=500, help="total state size in MiB (default 500)")
    parser.add_argument("--repeat", type=int, default=3, help="runs per measurement; the median is kept")
    parser.add_argument("--dir", default=None, help="local directory to write into (default: a temp dir)")
    parser.add_argument("--s3", action="store_true", help="also measure against a loopback moto S3 server")
    parser.add_argument("--deltas", action="store_true",
                        help="instead: sharded checkpoint bytes with and without XOR deltas of a model trained with "
                             "Adam (store_deltas.py; a minute)")
    store_deltas.add_arguments(parser)
    add_json_argument(parser)


def make_state(size_mb: int) -> dict:
    """Tensors of 1-8 MiB, like a model's layers plus Adam's two moments."""
    generator = torch.Generator().manual_seed(0)
    remaining = size_mb * MiB // 4
    tensors = {}
    index = 0
    while remaining > 0:
        numel = min(remaining, (1 + index % 8) * MiB // 4)
        tensors[f"layer{index}.weight"] = torch.randn(numel, generator=generator)
        remaining -= numel
        index += 1
    return {"model": tensors, "step": 1}


def _torch_save_fsync(state: dict, path: str) -> None:
    with open(path, "wb") as f:
        torch.save(state, f)
        f.flush()
        os.fsync(f.fileno())


CODECS = ("raw", "rcfz")


def _ours(open_store: Callable[[str], CheckpointStore], state: dict, repeat: int) -> dict:
    figures = {}
    for codec in CODECS:
        store = open_store(codec)
        steps = iter(range(10**9))
        figures[f"{codec}_save_s"] = median_seconds(lambda: store.save(next(steps), state), repeat)  # noqa: B023
        figures[f"{codec}_load_s"] = median_seconds(store.load, repeat)
        latest = store.latest()
        assert latest is not None, f"nothing committed in {store.uri}"
        figures[f"{codec}_stored_bytes"] = latest.size_bytes
    return figures


def bench_local(state: dict, root: str, repeat: int) -> dict:
    pt_path = os.path.join(root, "baseline.pt")
    figures = _ours(lambda codec: CheckpointStore(os.path.join(root, codec), keep_last=1, codec=codec,
                                                  full_every=1), state, repeat)
    figures["torch_save_s"] = median_seconds(lambda: _torch_save_fsync(state, pt_path), repeat)
    figures["torch_load_s"] = median_seconds(lambda: torch.load(pt_path, weights_only=True), repeat)
    for codec in CODECS:
        shutil.rmtree(os.path.join(root, codec), ignore_errors=True)
    return figures


def bench_s3(state: dict, repeat: int) -> dict:
    import boto3

    from ray_checkfreq.storage import S3Options

    with moto_server() as endpoint:
        client = boto3.client("s3", endpoint_url=endpoint)
        options = S3Options(endpoint_url=endpoint)

        def torch_upload() -> None:
            buffer = io.BytesIO()
            torch.save(state, buffer)
            buffer.seek(0)
            client.upload_fileobj(buffer, "bench", "baseline.pt")

        def torch_download() -> None:
            buffer = io.BytesIO()
            client.download_fileobj("bench", "baseline.pt", buffer)
            buffer.seek(0)
            torch.load(buffer, weights_only=True)

        figures = _ours(lambda codec: CheckpointStore(f"s3://bench/{codec}", keep_last=1, codec=codec,
                                                      full_every=1, s3=options), state, repeat)
        figures["torch_save_s"] = median_seconds(torch_upload, repeat)
        figures["torch_load_s"] = median_seconds(torch_download, repeat)
        return figures


def _print_table(size_mb: int, results: dict[str, dict]) -> None:
    print(f"state: {size_mb} MiB of float32 tensors (randn); median of runs; MB/s = MiB of state per second")
    print("torch = torch.save + fsync / torch.load (local); torch.save to memory + upload_fileobj / "
          "download + torch.load (S3)")
    print(f"{'where':<6} {'op':<5} {'ours raw':>12} {'ours rcfz':>12} {'torch':>12} "
          f"{'raw/torch':>10} {'rcfz/torch':>11}")
    for where, fig in results.items():
        for op in ("save", "load"):
            torch_rate = size_mb / fig[f"torch_{op}_s"]
            rates = [size_mb / fig[f"{codec}_{op}_s"] for codec in CODECS]
            print(f"{where:<6} {op:<5} {rates[0]:>7.0f} MB/s {rates[1]:>7.0f} MB/s {torch_rate:>7.0f} MB/s "
                  f"{rates[0] / torch_rate:>9.2f}x {rates[1] / torch_rate:>10.2f}x")
        stored = fig["rcfz_stored_bytes"] / fig["raw_stored_bytes"]
        print(f"{where:<6} compressed size: {stored:.1%} of raw")


def run(args: argparse.Namespace) -> int:
    if args.deltas:
        return store_deltas.run(args)
    if args.size_mb < 1 or args.repeat < 1:
        raise ValueError("--size-mb and --repeat must be >= 1")
    state = make_state(args.size_mb)
    root = args.dir or tempfile.mkdtemp(prefix="rcf-bench-")
    results = {"local": bench_local(state, root, args.repeat)}
    if args.s3:
        results["s3"] = bench_s3(state, args.repeat)
    if not args.dir:
        shutil.rmtree(root, ignore_errors=True)
    _print_table(args.size_mb, results)
    write_json(args.json, {"size_mb": args.size_mb, "results": results})
    return 0


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    add_arguments(parser)
    raise SystemExit(run(parser.parse_args()))
