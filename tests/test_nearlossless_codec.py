"""Near-lossless codec modes: the paper's absolute ``precision_factor`` and the relative
``precision_bits``, their bounds, what the blob records, and the refusals."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ray_checkfreq import codec
from ray_checkfreq.codec import blob as blobfmt

SMALL_FRAMES = codec.CodecConfig(frame_bytes=256, small_bytes=0)
DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64]
SPECIAL = [math.nan, math.inf, -math.inf, -0.0, 0.0, 1.0, -1.0]


def raw(t: torch.Tensor) -> bytes:
    return t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""


def unit_values(dtype: torch.dtype) -> st.SearchStrategy:
    """Values in [-1, 1] of ``dtype``'s range: plain, subnormal, and the special ones."""
    tiny = float(torch.finfo(dtype).smallest_normal)
    return st.one_of(st.floats(-1, 1), st.floats(-1, 1).map(lambda f: f * tiny),
                     st.sampled_from(SPECIAL))


@st.composite
def unit_tensors(draw: st.DrawFn) -> tuple[torch.Tensor, int]:
    dtype = draw(st.sampled_from(DTYPES))
    values = draw(st.lists(unit_values(dtype), min_size=0, max_size=300))
    log2 = draw(st.integers(0, 60))
    return torch.tensor(values, dtype=torch.float64).to(dtype), log2


def check_factor_bound(x: torch.Tensor, y: torch.Tensor, log2: int) -> None:
    xs, ys = x.double().tolist(), y.double().tolist()
    ux, uy = (t.view(torch.uint8).reshape(len(xs), x.element_size()) for t in (x, y))
    for i, (a, b) in enumerate(zip(xs, ys)):
        if not math.isfinite(a):
            assert torch.equal(ux[i], uy[i])  # inf and NaN kept bit for bit
            continue
        assert math.isfinite(b) and -1 <= b <= 1
        assert math.copysign(1, a) == math.copysign(1, b)  # sign kept, -0.0 included
        assert abs(b - a) <= math.ldexp(1, -log2 - 1)  # |x' - x| <= 1/(2B)
        assert b == round(a * 2.0 ** log2) / 2.0 ** log2 or b == a  # nearest, ties to even


@settings(max_examples=250, deadline=None)
@given(case=unit_tensors(), config=st.sampled_from([None, SMALL_FRAMES]))
def test_factor_rounds_to_multiples_of_one_over_b_within_the_bound(case, config):
    x, log2 = case
    before = raw(x)
    blob = codec.encode(x, precision_factor=2 ** log2, config=config)
    assert raw(x) == before  # the input is never modified
    y = codec.decode(blob)
    check_factor_bound(x, y, log2)
    info = codec.blob_info(blob)
    assert info["precision_factor"] == 2 ** log2 and info["precision_factor_rounded"]
    assert raw(codec.trim(x, precision_factor=2 ** log2)) == raw(y)


@settings(max_examples=150, deadline=None)
@given(case=unit_tensors(), outlier=st.one_of(st.floats(1, 1e4, exclude_min=True),
                                              st.floats(-1e4, -1, exclude_max=True)),
       at=st.integers(0, 300))
def test_a_tensor_with_any_finite_value_outside_unit_range_stays_exact(case, outlier, at):
    x, log2 = case
    values = x.double().tolist()
    values.insert(at % (len(values) + 1), outlier)
    x = torch.tensor(values, dtype=torch.float64).to(x.dtype)
    if not torch.isfinite(x).logical_and(x.abs() > 1).any():  # the cast may round to +-1
        return
    blob = codec.encode(x, precision_factor=2 ** log2)
    assert raw(codec.decode(blob)) == raw(x)
    info = codec.blob_info(blob)
    assert not info["precision_factor_rounded"] and not info["trimmed"]


@settings(max_examples=100, deadline=None)
@given(case=unit_tensors(), seed=st.integers(0, 2**31))
def test_factor_with_a_delta_base(case, seed):
    x, log2 = case
    noise = torch.from_numpy(np.random.default_rng(seed).normal(0, 1e-3, x.numel()))
    base = codec.trim(x + noise.to(x.dtype), precision_factor=2 ** log2)
    blob = codec.encode(x, base=base, precision_factor=2 ** log2)
    assert raw(codec.decode(blob, base=base)) == raw(codec.trim(x, precision_factor=2 ** log2))


BITS = {torch.float16: 10, torch.bfloat16: 7, torch.float32: 23, torch.float64: 52}


@settings(max_examples=150, deadline=None)
@given(dtype=st.sampled_from(DTYPES), data=st.binary(min_size=1, max_size=800),
       frac=st.floats(0, 1))
def test_bits_relative_bound_and_trim_agree(dtype, data, frac):
    bits = int(frac * (BITS[dtype] + 2))
    n = len(data) // dtype.itemsize
    x = torch.frombuffer(bytearray(data[:n * dtype.itemsize]), dtype=torch.uint8).view(dtype) \
        if n else torch.empty(0, dtype=dtype)
    y = codec.decode(codec.encode(x, precision_bits=bits))
    assert raw(codec.trim(x, precision_bits=bits)) == raw(y)
    tiny = float(torch.finfo(dtype).smallest_normal)
    for i, (a, b) in enumerate(zip(x.double().tolist(), y.double().tolist())):
        if not math.isfinite(a):
            assert raw(x[i:i + 1]) == raw(y[i:i + 1])
            continue
        assert math.isfinite(b) and math.copysign(1, a) == math.copysign(1, b)
        assert abs(b - a) <= math.ldexp(max(abs(a), tiny), -bits)


def test_complex_rounds_both_parts_and_numpy_works():
    z = torch.complex(torch.rand(1000) - 0.5, torch.rand(1000) - 0.5)
    y = codec.decode(codec.encode(z, precision_factor=2 ** 8))
    assert (torch.view_as_real(y) * 256 == torch.round(torch.view_as_real(z) * 256)).all()
    a = (np.random.default_rng(0).random(5000) - 0.5).astype(np.float32)
    got = codec.decode_numpy(codec.encode(a, precision_factor=2 ** 12))
    assert np.array_equal(got, np.round(a * 4096) / 4096)
    assert np.array_equal(codec.trim(a, precision_factor=2 ** 12), got)


def test_factor_compresses_and_large_b_is_exact():
    x = (torch.rand(200_000) - 0.5) * 0.2
    lossless = len(codec.encode(x))
    assert len(codec.encode(x, precision_factor=2 ** 16)) < 0.7 * lossless
    # float32 values in [-1, 1] are multiples of 2^-149: B = 2^149 changes none of them
    assert raw(codec.decode(codec.encode(x, precision_factor=2 ** 149))) == raw(x)


def test_blob_records_the_factor_and_lossless_blobs_stay_version_3():
    x = torch.rand(5000) - 0.5
    assert codec.encode(x)[4] == blobfmt.VERSION == 3
    assert codec.encode(x, precision_bits=10)[4] == 3
    trimmed = codec.encode(x, precision_factor=2 ** 19)
    assert trimmed[4] == blobfmt.VERSION_FACTOR == 4
    header, _ = blobfmt.unpack(trimmed)
    assert header.precision_factor_log2 == 19 and header.factor_rounded
    info = codec.blob_info(codec.encode(x))
    assert info["precision_factor"] is None and not info["trimmed"]
    assert codec.blob_info(codec.encode(x, precision_bits=10))["trimmed"]
    codec.verify(trimmed)


@pytest.mark.parametrize("factor", [0, -2, 3, 2.5, 0.5, True, math.inf, math.nan, 2 ** 255, "8",
                                    [2]])
def test_bad_factor_is_refused_naming_it(factor):
    with pytest.raises(codec.CodecError, match="precision_factor must be a power of two"):
        codec.encode(torch.rand(10), precision_factor=factor)


def test_factor_accepts_int_float_and_numpy_powers_of_two():
    x = torch.rand(100) - 0.5
    want = raw(codec.trim(x, precision_factor=2 ** 19))
    for factor in (2.0 ** 19, np.int64(2 ** 19), np.float32(2 ** 19)):
        assert raw(codec.trim(x, precision_factor=factor)) == want


def test_both_modes_or_unsupported_dtypes_are_refused():
    x = torch.rand(10)
    with pytest.raises(codec.CodecError, match="precision_bits=8 and precision_factor=1024"):
        codec.encode(x, precision_bits=8, precision_factor=1024)
    with pytest.raises(codec.CodecError, match="give one or the other"):
        codec.trim(x, precision_bits=8, precision_factor=1024)
    with pytest.raises(codec.CodecError, match="give precision_bits or precision_factor"):
        codec.trim(x)
    for t in (torch.arange(5), x.to(torch.float8_e4m3fn)):
        with pytest.raises(codec.CodecError, match="precision_factor applies to"):
            codec.encode(t, precision_factor=2 ** 4)


NAN_BITS = {torch.float32: (0x7F800001, 0xFFC12345), torch.bfloat16: (0x7F81, 0xFFC1),
            torch.float16: (0x7C01, 0xFE01), torch.float64: (0x7FF0000000000001, 0xFFF8000000000123)}
INT_OF = {4: torch.int32, 2: torch.int16, 8: torch.int64}


@pytest.mark.parametrize("dtype", DTYPES)
def test_nan_payloads_and_signs_survive_rounding(dtype):
    ints = INT_OF[dtype.itemsize]
    patterns = [p - (1 << (8 * dtype.itemsize)) if p >= 1 << (8 * dtype.itemsize - 1) else p
                for p in NAN_BITS[dtype]]
    nans = torch.tensor(patterns, dtype=ints).view(dtype)
    x = torch.cat([nans, (torch.rand(50, dtype=torch.float64) - 0.5).to(dtype)])
    y = codec.decode(codec.encode(x, precision_factor=2 ** 6))
    assert codec.blob_info(codec.encode(x, precision_factor=2 ** 6))["precision_factor_rounded"]
    assert raw(y[:2]) == raw(nans)
