"""Near-lossless modes: relative trimming (``precision_bits``) and absolute rounding
(``precision_factor``), as in "Lossless and Near-Lossless Compression for Foundation
Models" (2024). The zeroed low bits then compress to almost nothing.

**precision_bits = b** rounds every float to ``b`` mantissa bits, round-to-nearest-even on
the raw bits. Bound, for every finite value x of a supported dtype and its stored value x':

    |x' - x| <= 2^-b * max(|x|, smallest normal of the dtype)

i.e. relative error at most 2^-b for normal values (2^-(b+1) where round-to-nearest
applies; a value that would round up past the largest finite value is truncated
instead, error below 2^-b), and absolute error at most 2^-b times the smallest normal for
subnormals. ``b`` at least the dtype's mantissa width stores the value exactly.

**precision_factor = B** (the paper's definition) rounds every value to the nearest
multiple of 1/B (ties to even), but only in a tensor whose finite values all lie in
[-1, 1]; a tensor with any finite value outside is stored exactly. Per tensor, not per
frame: one tensor is either rounded as a whole or kept. Bound, for every finite x:

    |x' - x| <= 1 / (2B)

and x' lies in [-1, 1] too. B must be a power of two (2^0 ... 2^254): the rounding is then
exact arithmetic (a scaling, an integer rounding, a value the dtype holds), and the
rounded values keep their low bits zero, which is what compresses; any other B would
fill them with rounding noise. Complex tensors round their real and imaginary parts (the
[-1, 1] rule applies to both). Supported: float16, bfloat16, float32, float64, complex.

Both modes keep infinities and NaNs (payload and sign included) and signed zeros bit for
bit; a finite value never becomes inf or NaN, and never changes sign (a negative value
may become -0.0).
"""

from __future__ import annotations

import math
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


# --- absolute rounding: the paper's precision factor B ---------------------------------

MAX_FACTOR_LOG2 = 254  # B = 2^254: every float16/bfloat16/float32 in [-1, 1] is then exact


def check_factor(info: DtypeInfo, factor: Any) -> int:
    """log2 of ``factor``, a power of two in [1, 2^254] (an int or a float equal to one)."""
    if info.unit_bytes < 2 or not info.finite_rule or not info.is_float:
        raise CodecError(f"precision_factor applies to float16, bfloat16, float32, float64 "
                         f"and their complex types, not {info.name}")
    try:
        exact = isinstance(factor, (int, float, np.integer, np.floating)) and not isinstance(
            factor, bool) and float(factor) > 0 and math.isfinite(factor)
        mantissa, exponent = math.frexp(float(factor)) if exact else (0.0, 0)
    except OverflowError:
        exact = False
    if not exact or mantissa != 0.5 or not 0 <= exponent - 1 <= MAX_FACTOR_LOG2 or (
            isinstance(factor, (int, np.integer)) and int(factor) != 1 << (exponent - 1)):
        raise CodecError(f"precision_factor must be a power of two from 1 to 2**"
                         f"{MAX_FACTOR_LOG2} (values are rounded to multiples of 1/B), "
                         f"got {factor!r}")
    return exponent - 1


def round_to_factor(raw: np.ndarray, info: DtypeInfo, factor_log2: int) -> np.ndarray | None:
    """``raw`` (bytes of whole elements) rounded to multiples of 2^-factor_log2, as a new
    uint8 array; None when a finite value lies outside [-1, 1] (the tensor stays exact).

    Every step is exact for a power-of-two B (a scaling, an integer rounding, and values
    that the dtype can hold), so the only error is the rounding itself.
    """
    utype = _UNSIGNED[info.unit_bytes]
    bits = raw.view(utype)
    work = _widen(bits, info, factor_log2)
    finite = np.isfinite(work)
    magnitude = np.abs(work)
    magnitude[~finite] = 0
    if magnitude.size and magnitude.max() > 1:
        return None
    with np.errstate(invalid="ignore"):  # signalling NaNs; their bits are restored below
        scaled = np.multiply(work, work.dtype.type(2.0 ** factor_log2), out=magnitude)
        np.rint(scaled, out=scaled)  # half to even
        scaled *= work.dtype.type(2.0 ** -factor_log2)
    return np.where(finite, _narrow(scaled, info), bits).view(np.uint8)


def _widen(bits: np.ndarray, info: DtypeInfo, factor_log2: int) -> np.ndarray:
    """The values as a float array wide enough to hold x * 2^factor_log2 exactly."""
    wide = np.float64 if info.unit_bytes == 8 or factor_log2 > 127 else np.float32
    if info.unit_bytes == 2 and info.exponent_bits == 8:  # bfloat16: the top half of a float32
        return (bits.astype(np.uint32) << np.uint32(16)).view(np.float32).astype(wide, copy=False)
    real = {2: np.float16, 4: np.float32, 8: np.float64}[info.unit_bytes]
    return bits.view(real).astype(wide, copy=False)


def _narrow(values: np.ndarray, info: DtypeInfo) -> np.ndarray:
    """Back to the dtype's bits; exact, since every rounded value is representable."""
    if info.unit_bytes == 2 and info.exponent_bits == 8:
        return (values.astype(np.float32).view(np.uint32) >> np.uint32(16)).astype(np.uint16)
    real = {2: np.float16, 4: np.float32, 8: np.float64}[info.unit_bytes]
    return values.astype(real).view(_UNSIGNED[info.unit_bytes])
