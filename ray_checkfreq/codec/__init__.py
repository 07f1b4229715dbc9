"""Model-aware tensor codec: byte grouping + zstd, XOR deltas, near-lossless rounding.

Bytes in, bytes out: no Ray, no torch.distributed, no storage. Public surface:
:func:`encode`, :func:`decode`, :func:`decode_into`, :func:`decode_numpy`, :func:`blob_info`, :func:`verify`,
:func:`trim`, :class:`CodecConfig` and the errors. The blob format is described in
:mod:`ray_checkfreq.codec.blob`, the near-lossless modes and their bounds in
:mod:`ray_checkfreq.codec.nearlossless`.
"""

from ray_checkfreq.codec.api import (
    MAX_EXPANSION,
    CodecConfig,
    blob_info,
    decode,
    decode_into,
    decode_numpy,
    encode,
    trim,
    verify,
)
from ray_checkfreq.codec.errors import BaseMismatchError, CodecError, CorruptBlobError

__all__ = [
    "MAX_EXPANSION",
    "BaseMismatchError",
    "CodecConfig",
    "CodecError",
    "CorruptBlobError",
    "blob_info",
    "decode",
    "decode_into",
    "decode_numpy",
    "encode",
    "trim",
    "verify",
]
