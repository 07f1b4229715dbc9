"""``ray-checkfreq bench codec --near-lossless``: what each near-lossless setting stores,
how fast, and what it does to the model's outputs.

Every floating tensor of the input is coded on its own (as the checkpoint store does) at
lossless, the paper's absolute precision factor B = 2^23, 2^19, 2^16 (tensors whose values
lie in [-1, 1] rounded to multiples of 1/B, the others kept exact) and the relative
precision_bits = 16, 12, 8. Decoded weights are checked against each mode's bound. With a
BERT model (all-MiniLM-L6-v2 by default: ``config.json`` and ``vocab.txt`` next to the
weights), sentence embeddings of ``SENTENCES`` (mean pooling of the last hidden state, as
sentence-transformers does for this model; :mod:`benchmarks.minilm`) are computed
with the original and with the decoded weights: the cosine similarity of each pair, and
how much the similarity between any two sentences moved.
"""

from __future__ import annotations

import argparse
import os
import statistics
from pathlib import Path
from typing import Any

import torch

from benchmarks import minilm
from benchmarks.harness import rounds, stopwatch, write_json
from ray_checkfreq import codec

SETTINGS: list[tuple[str, dict[str, int]]] = [
    ("lossless", {}),
    ("B=2^23", {"precision_factor": 2 ** 23}),
    ("B=2^19", {"precision_factor": 2 ** 19}),
    ("B=2^16", {"precision_factor": 2 ** 16}),
    ("bits=16", {"precision_bits": 16}),
    ("bits=12", {"precision_bits": 12}),
    ("bits=8", {"precision_bits": 8}),
]

SENTENCES = [
    "The cat sat quietly on the warm windowsill.",
    "A kitten was resting in the sun by the window.",
    "The stock market fell sharply after the announcement.",
    "Investors sold shares when the news came out.",
    "How do I reset my password?",
    "I forgot my login credentials and cannot sign in.",
    "The recipe calls for two cups of flour and an egg.",
    "Heavy rain is expected across the region tomorrow.",
    "She scored the winning goal in the final minute.",
    "Training large models on spot instances saves money but risks preemption.",
]


def load_floats(path: Path) -> dict[str, torch.Tensor]:
    """The floating tensors of a .safetensors or .pt state dict, by name, in file order."""
    if path.suffix == ".safetensors":
        from safetensors.torch import load_file
        state = load_file(str(path))
    else:
        state = torch.load(path, map_location="cpu", weights_only=True)
    floats = {k: v.contiguous() for k, v in state.items()
              if isinstance(v, torch.Tensor) and v.is_floating_point()}
    if not floats:
        raise SystemExit(f"{path} holds no floating tensors")
    return floats


def find_model(path: Path) -> tuple[minilm.BertShape, minilm.WordPiece] | None:
    """The BERT shape and tokenizer beside the weights, if both files are there."""
    config, vocab = path.parent / "config.json", path.parent / "vocab.txt"
    if not (config.exists() and vocab.exists()):
        return None
    return minilm.BertShape.from_config(config), minilm.WordPiece.from_file(vocab)


def _encode_all(tensors: dict[str, torch.Tensor], setting: dict, threads: int) -> dict[str, bytes]:
    return {k: codec.encode(v, threads=threads, **setting) for k, v in tensors.items()}


def _decode_all(blobs: dict[str, bytes], threads: int) -> dict[str, torch.Tensor]:
    return {k: codec.decode(b, threads=threads) for k, b in blobs.items()}


def time_settings(tensors: dict[str, torch.Tensor], threads: int, repeats: int) -> dict[str, dict]:
    """Every setting in turn, ``repeats`` rounds (every other one in reverse order)."""
    raw = sum(v.numel() * v.element_size() for v in tensors.values())
    rows: dict[str, dict[str, Any]] = {name: {"setting": name, **setting, "threads": threads, "encode_s": [],
                                              "decode_s": [], "encode_cpu_s": [], "decode_cpu_s": []}
                                       for name, setting in SETTINGS}
    for _, (name, setting) in rounds(SETTINGS, repeats, alternate=True, collect=True):
        row = rows[name]
        with stopwatch() as encoding:
            blobs = _encode_all(tensors, setting, threads)
        with stopwatch() as decoding:
            decoded = _decode_all(blobs, threads)
        for what, lap in (("encode", encoding), ("decode", decoding)):
            row[f"{what}_s"].append(lap.wall_s)
            row[f"{what}_cpu_s"].append(lap.cpu_s)  # all threads: what the work cost
        row["ratio_pct"] = 100 * sum(len(b) for b in blobs.values()) / raw
        row["tensors"] = len(blobs)
        rounded = [k for k, b in blobs.items() if codec.blob_info(b)["precision_factor_rounded"]]
        row["tensors_rounded"] = len(rounded)
        row["bytes_rounded_pct"] = 100 * sum(tensors[k].numel() * tensors[k].element_size()
                                             for k in rounded) / raw
        row["bound_held"] = all(_within_bound(tensors[k], decoded[k], setting) for k in tensors)
        row["decoded"] = decoded  # the last round's, for the accuracy columns (dropped from JSON)
    for row in rows.values():
        for what in ("encode", "decode", "encode_cpu", "decode_cpu"):
            row[f"{what}_gbps_median"] = raw / statistics.median(row[f"{what}_s"]) / 1e9
    return rows


def _within_bound(x: torch.Tensor, y: torch.Tensor, setting: dict) -> bool:
    finite = torch.isfinite(x)
    err = (y.double() - x.double()).abs()[finite]
    if "precision_factor" in setting:  # rounded within [-1, 1], else exact
        in_range = not err.numel() or bool(x.double().abs()[finite].max() <= 1)
        return bool((err <= (0.5 / setting["precision_factor"] if in_range else 0.0)).all())
    if "precision_bits" in setting:
        tiny = torch.finfo(x.dtype).smallest_normal
        return bool((err <= x.double().abs()[finite].clamp(min=tiny) * 2.0 ** -setting["precision_bits"]).all())
    return bool(torch.equal(x.view(torch.uint8), y.view(torch.uint8)) if x.numel() else True)


def output_effect(model: tuple[minilm.BertShape, minilm.WordPiece], original: dict[str, torch.Tensor],
                  decoded: dict[str, torch.Tensor], reference: torch.Tensor) -> dict:
    """Cosine similarity of each sentence's embedding with its original, and the largest
    change of the cosine similarity between two sentences."""
    shape, tokenizer = model
    emb = minilm.sentence_embeddings({**original, **decoded}, shape, tokenizer, SENTENCES)
    cos = torch.nn.functional.cosine_similarity(emb, reference, dim=1)
    pairs_before, pairs_after = _pairwise(reference), _pairwise(emb)
    return {"cos_min": cos.min().item(), "one_minus_cos_mean": (1 - cos).mean().item(),
            "pair_sim_max_change": (pairs_after - pairs_before).abs().max().item()}


def _pairwise(emb: torch.Tensor) -> torch.Tensor:
    unit = torch.nn.functional.normalize(emb, dim=1)
    return unit @ unit.T


def run(args: argparse.Namespace, path: Path) -> int:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    tensors = load_floats(path)
    threads = int(args.threads.split(",")[-1]) if args.threads else (os.cpu_count() or 1)
    model = find_model(path)
    raw = sum(v.numel() * v.element_size() for v in tensors.values())
    print(f"input: {path} ({len(tensors)} floating tensors, {raw / 1e6:.1f} MB, "
          f"{', '.join(sorted({str(v.dtype).removeprefix('torch.') for v in tensors.values()}))}); "
          f"{threads} threads; {args.repeats} rounds, settings interleaved; load average "
          f"{' '.join(f'{v:.2f}' for v in os.getloadavg())}")
    rows = time_settings(tensors, threads, args.repeats)
    reference = None
    if model is not None:
        reference = minilm.sentence_embeddings(tensors, model[0], model[1], SENTENCES)
    _print_table(rows, tensors, model, reference)
    print("speeds: medians over the rounds, of wall time and of the process's CPU time (all threads)")
    print(f"load average at the end {' '.join(f'{v:.2f}' for v in os.getloadavg())}")
    for row in rows.values():
        row.pop("decoded")
    write_json(args.json, {"input": str(path), "threads": threads, "repeats": args.repeats,
                           "sentences": SENTENCES, "near_lossless": list(rows.values())})
    return 0 if all(r["bound_held"] for r in rows.values()) else 1


def _print_table(rows: dict[str, dict], tensors: dict, model: Any, reference: torch.Tensor | None) -> None:
    header = (f"{'setting':<10}{'ratio%':>8}{'enc GB/s wall/cpu':>19}{'dec GB/s wall/cpu':>19}"
              f"{'rounded':>9}{'bound':>7}"
              f"{'min cos':>14}{'mean 1-cos':>12}{'max d(sim)':>12}")
    print(header)
    print("-" * len(header))
    for row in rows.values():
        effect = None if model is None or reference is None else output_effect(
            model, tensors, row["decoded"], reference)
        if effect:
            row.update(effect)
        rounded = f"{row['tensors_rounded']}/{row['tensors']}" if "precision_factor" in row else "-"
        tail = (f"{effect['cos_min']:>14.10f}{effect['one_minus_cos_mean']:>12.2e}"
                f"{effect['pair_sim_max_change']:>12.2e}") if effect else f"{'n/a':>14}{'n/a':>12}{'n/a':>12}"
        speeds = "".join(f"{row[f'{what}_gbps_median']:>12.2f}/{row[f'{what}_cpu_gbps_median']:<6.2f}"
                         for what in ("encode", "decode"))
        held = "ok" if row["bound_held"] else "NO"
        print(f"{row['setting']:<10}{row['ratio_pct']:>8.2f}{speeds}{rounded:>9}{held:>7}{tail}", flush=True)
    factor_rows = [r for r in rows.values() if "precision_factor" in r]
    if factor_rows:
        outside = max(((v.numel(), k, v.abs().max().item()) for k, v in tensors.items() if v.abs().max() > 1),
                      default=None)
        print(f"B rows: the rounded tensors hold {factor_rows[0]['bytes_rounded_pct']:.1f} % of the bytes; the "
              f"others have a value outside [-1, 1] and stay exact"
              + (f" (the largest of them: {outside[1]}, max |x| {outside[2]:.2f})" if outside else ""))
    if model is None:
        print("(no config.json + vocab.txt beside the weights: output columns skipped)")
    else:
        print(f"output columns: {len(SENTENCES)} fixed sentences, embeddings from the decoded weights against "
              f"the original's; d(sim): change of the cosine similarity between two sentences")
