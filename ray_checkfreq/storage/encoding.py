"""Encode one array leaf for a shard, and decode it back, with both checksums.

``raw`` stores the leaf's bytes as they are (no copy for contiguous CPU tensors);
``rcfz`` stores a ``ray_checkfreq.codec`` blob; given the same leaf of an earlier full
checkpoint, an XOR delta against it where that is the smaller of the two.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from ray_checkfreq import codec
from ray_checkfreq.storage.arrays import LeafSpec, leaf_bytes, leaf_from_buffer, leaf_spec
from ray_checkfreq.storage.checksum import crc32


@dataclass(frozen=True, kw_only=True)
class EncodeOptions:
    codec: str = "rcfz"
    level: int | None = None
    threads: int | None = None

    def __post_init__(self) -> None:
        if self.codec not in ("raw", "rcfz"):
            raise ValueError(f"codec={self.codec!r}: expected 'raw' or 'rcfz'")


@dataclass
class EncodedLeaf:
    data: Any  # bytes-like to write
    codec: str
    raw_crc32: int
    stored_crc32: int
    delta: bool


def encode_leaf(leaf: Any, options: EncodeOptions, base: Any = None, raw_crc: int | None = None) -> EncodedLeaf:
    """``leaf`` encoded; with a ``base`` (the same leaf of an earlier full checkpoint), as an
    XOR delta of it where that is smaller than the full blob. ``raw_crc``: the checksum of
    the leaf's bytes where it is known already (kept as given)."""
    raw = leaf_bytes(leaf)
    raw_crc = crc32(raw) if raw_crc is None else raw_crc
    if options.codec == "raw":
        return EncodedLeaf(data=raw, codec="raw", raw_crc32=raw_crc, stored_crc32=raw_crc, delta=False)
    if isinstance(leaf, np.ndarray) and not leaf.dtype.isnative:
        return EncodedLeaf(data=raw, codec="raw", raw_crc32=raw_crc, stored_crc32=raw_crc, delta=False)
    try:
        blob = codec.encode(leaf, level=options.level, threads=options.threads)
        delta = None
        if base is not None and _same_spec(leaf, base):
            delta = codec.encode(leaf, base=base, level=options.level, threads=options.threads)
    except codec.CodecError:  # a dtype the codec does not group: store it as it is
        return EncodedLeaf(data=raw, codec="raw", raw_crc32=raw_crc, stored_crc32=raw_crc, delta=False)
    # A delta only where it is smaller: values that change in every bit (Adam's moments) XOR to
    # noise, which compresses worse than the values themselves. A tie goes full (it needs no base).
    if delta is not None and len(delta) < len(blob):
        return EncodedLeaf(data=delta, codec="rcfz", raw_crc32=raw_crc, stored_crc32=crc32(delta), delta=True)
    return EncodedLeaf(data=blob, codec="rcfz", raw_crc32=raw_crc, stored_crc32=crc32(blob), delta=False)


def _same_spec(leaf: Any, base: Any) -> bool:
    return leaf_spec(leaf) == leaf_spec(base)


class LeafDecodeError(ValueError):
    """The stored bytes do not decode to what the manifest promises."""


def decode_leaf(spec: LeafSpec, codec_name: str, buffer: Any, offset: int, length: int,
                raw_crc32: int, base: Any = None, threads: int | None = None) -> Any:
    """The leaf; ``buffer`` has already passed the stored checksum."""
    if codec_name == "raw":
        return leaf_from_buffer(spec, buffer, offset)
    blob = memoryview(buffer)[offset:offset + length]
    leaf: Any
    try:
        # The manifest's size, checked against the blob's header before decoding allocates.
        if spec.kind == "torch":
            leaf = codec.decode(blob, base=base, threads=threads, expected_nbytes=spec.nbytes)
        else:
            leaf = codec.decode_numpy(blob, base=base, threads=threads, expected_nbytes=spec.nbytes)
    except codec.CodecError as err:
        raise LeafDecodeError(str(err)) from None
    if leaf_spec(leaf) != spec:
        raise LeafDecodeError(f"decoded {leaf_spec(leaf)} where the manifest says {spec}")
    if crc32(leaf_bytes(leaf)) != raw_crc32:
        raise LeafDecodeError("decoded bytes do not match raw_crc32")
    return leaf


def copy_leaf(leaf: Any) -> Any:
    """A private copy, kept as the base of later deltas."""
    if isinstance(leaf, torch.Tensor):
        return leaf.detach().to("cpu", copy=True).contiguous()
    return np.array(leaf, copy=True)
