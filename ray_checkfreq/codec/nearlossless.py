"""Near-lossless mode: round every float to ``b`` mantissa bits before storing it.

Rounding is round-to-nearest-even on the raw bits, as the paper ("Lossless and
Near-Lossless Compression for Foundation Models", 2024) trims low mantissa bits; the
zeroed low bits then compress to almost nothing.

Bound, for every finite value x of a supported dtype and its stored value x':

    |x' - x| <= 2^-b * max(|x|, smallest normal of the dtype)

i.e. relative error at most 2^-b for normal values (2^-(b+1) where round-to-nearest
applies; a value that would round up past the largest finite value is truncated
instead, error below 2^-b), and absolute error at most 2^-b times the smallest normal for
subnormals. Infinities and NaNs (payload and sign included) and signed zeros are kept
bit for bit; a finite value never becomes inf or NaN, and never changes sign.
``b`` at least the dtype's mantissa width stores the value exactly.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ray_checkfreq.codec.dtypes import DtypeInfo
from ray_checkfreq.codec.errors import CodecError

_UNSIGNED = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}


def check_supported(info: DtypeInfo, bits: int) -> None:
    if not info.is_float:
        raise CodecError(f"precision_bits applies to floating dtypes only, not {info.name}")
    if not info.finite_rule:
        raise CodecError(f"precision_bits is not supported for {info.name}")
    if isinstance(bits, bool) or not isinstance(bits, int) or not 0 <= bits < 255:
        raise CodecError(f"precision_bits must be an int in [0, 254], got {bits!r}")


def round_frame(frame: np.ndarray, info: DtypeInfo, bits: int) -> np.ndarray:
    """A new uint8 array: ``frame`` (raw bytes of whole elements) rounded to ``bits``."""
    drop = info.mantissa_bits - bits
    if drop <= 0:
        return frame
    utype = _UNSIGNED[info.unit_bytes]
    u = frame.view(utype)
    one = utype(1)
    low_mask: Any = utype((1 << drop) - 1)
    truncated = u & ~low_mask
    rounded = u + utype((1 << (drop - 1)) - 1)
    rounded += (u >> utype(drop)) & one
    rounded &= ~low_mask
    sign_shift = utype(info.unit_bytes * 8 - 1)
    keep_rounded = _finite(rounded, info) & (((rounded ^ u) >> sign_shift) == 0)
    out = np.where(keep_rounded, rounded, truncated)
    out = np.where(_finite(u, info), out, u)
    return out.view(np.uint8)


def _finite(u: np.ndarray, info: DtypeInfo) -> np.ndarray:
    utype = u.dtype.type
    nbits = info.unit_bytes * 8
    if info.finite_rule == "ieee":
        exp_mask = utype((1 << info.exponent_bits) - 1)
        return ((u >> utype(info.mantissa_bits)) & exp_mask) != exp_mask
    magnitude = utype((1 << (nbits - 1)) - 1)  # "fn": only all-ones magnitude is NaN
    return (u & magnitude) != magnitude
