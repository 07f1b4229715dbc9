"""Deltas, near-lossless rounding and damaged blobs."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ray_checkfreq import codec

SMALL_FRAMES = codec.CodecConfig(frame_bytes=256, small_bytes=0)


def raw(t: torch.Tensor) -> bytes:
    return t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""


def bits_tensor(data: bytes, dtype: torch.dtype, n: int) -> torch.Tensor:
    size = dtype.itemsize
    buf = bytearray((data * (n * size // len(data) + 1))[:n * size])
    if not buf:
        return torch.empty(0, dtype=dtype)
    return torch.frombuffer(buf, dtype=torch.uint8).view(dtype)


# --- deltas ---------------------------------------------------------------------------

@settings(max_examples=60, deadline=None)
@given(dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float64, torch.int64,
                              torch.int8, torch.float8_e4m3fn]),
       n=st.integers(0, 3000), seed=st.integers(0, 2**31), config=st.sampled_from(
           [None, SMALL_FRAMES]))
def test_delta_round_trip(dtype, n, seed, config):
    g = np.random.default_rng(seed)
    base = bits_tensor(g.bytes(64) + b"\x01", dtype, n)
    x = base.clone()
    flips = torch.from_numpy(g.integers(0, 256, x.numel() * x.element_size(), dtype=np.uint8)
                             * (g.random(x.numel() * x.element_size()) < 0.1))
    if x.numel():
        x.view(torch.uint8).reshape(-1).bitwise_xor_(flips)
    x_before, base_before = raw(x), raw(base)
    blob = codec.encode(x, base=base, config=config)
    assert raw(x) == x_before and raw(base) == base_before
    assert codec.blob_info(blob)["delta"]
    assert raw(codec.decode(blob, base=base)) == x_before


def test_delta_of_nearby_checkpoints_is_small():
    g = torch.Generator().manual_seed(1)
    base = torch.randn(200_000, generator=g) * 0.05
    x = base + 1e-6 * torch.randn(200_000, generator=g)  # one small optimizer step
    full, delta = codec.encode(x), codec.encode(x, base=base)
    assert len(delta) < 0.75 * len(full)
    assert raw(codec.decode(delta, base=base)) == raw(x)


def test_wrong_or_missing_base_is_refused():
    base = torch.randn(10_000)
    x = base * 1.001
    blob = codec.encode(x, base=base)
    other = base.clone()
    other[1234] += 1.0
    with pytest.raises(codec.BaseMismatchError, match="different base"):
        codec.decode(blob, base=other)
    with pytest.raises(codec.BaseMismatchError, match="needs base"):
        codec.decode(blob)
    with pytest.raises(codec.BaseMismatchError, match="wrong base"):
        codec.decode(blob, base=base[:100])
    with pytest.raises(codec.CodecError, match="not a delta"):
        codec.decode(codec.encode(x), base=base)
    with pytest.raises(codec.CodecError, match="base must match"):
        codec.encode(x, base=base.double())


# --- near-lossless --------------------------------------------------------------------

FLOATS = {torch.float16: 10, torch.bfloat16: 7, torch.float32: 23, torch.float64: 52,
          torch.float8_e4m3fn: 3, torch.float8_e5m2: 2}


@settings(max_examples=200, deadline=None)
@given(dtype=st.sampled_from(list(FLOATS)), data=st.binary(min_size=1, max_size=400),
       frac=st.floats(0, 1), config=st.sampled_from([None, SMALL_FRAMES]))
def test_near_lossless_bound(dtype, data, frac, config):
    bits = int(frac * (FLOATS[dtype] + 2))
    x = bits_tensor(data, dtype, 97)
    y = codec.decode(codec.encode(x, precision_bits=bits, config=config))
    assert codec.blob_info(codec.encode(x, precision_bits=bits))["precision_bits"] == bits
    xs, ys = x.double().tolist(), y.double().tolist()
    u_x = x.view(torch.uint8).reshape(len(xs), -1)
    u_y = y.view(torch.uint8).reshape(len(xs), -1)
    tiny = float(torch.finfo(dtype).smallest_normal)
    for i, (a, b) in enumerate(zip(xs, ys)):
        if not math.isfinite(a):
            assert torch.equal(u_x[i], u_y[i])  # inf and NaN kept bit for bit
            continue
        assert math.isfinite(b) and math.copysign(1, a) == math.copysign(1, b)
        assert abs(b - a) <= math.ldexp(max(abs(a), tiny), -bits)


@settings(max_examples=100, deadline=None)
@given(data=st.binary(min_size=4, max_size=400))
def test_near_lossless_matches_round_to_nearest_even(data):
    # float32 kept to 7 mantissa bits is exactly torch's RNE cast to bfloat16, wherever
    # that cast stays finite.
    x = bits_tensor(data, torch.float32, 100)
    y = codec.decode(codec.encode(x, precision_bits=7))
    ref = x.to(torch.bfloat16).to(torch.float32)
    ok = torch.isfinite(ref) & torch.isfinite(x)
    assert torch.equal(y[ok].view(torch.int32), ref[ok].view(torch.int32))


def test_near_lossless_shrinks_and_full_precision_is_exact():
    x = torch.randn(100_000)
    assert len(codec.encode(x, precision_bits=7)) < 0.6 * len(codec.encode(x))
    assert raw(codec.decode(codec.encode(x, precision_bits=23))) == raw(x)


# --- damaged blobs --------------------------------------------------------------------

def _blob() -> tuple[torch.Tensor, bytes]:
    x = torch.randn(3000) * 0.01
    return x, codec.encode(x, config=codec.CodecConfig(frame_bytes=2048))


@settings(max_examples=150, deadline=None)
@given(pos=st.floats(0, 1), bit=st.integers(0, 7))
def test_any_bit_flip_is_caught(pos, bit):
    x, blob = _blob()
    damaged = bytearray(blob)
    i = min(int(pos * len(blob)), len(blob) - 1)
    damaged[i] ^= 1 << bit
    with pytest.raises(codec.CorruptBlobError):
        codec.verify(bytes(damaged))
    try:
        y = codec.decode(bytes(damaged))
    except codec.CodecError:
        return
    assert raw(y) == raw(x)  # a flip that changes nothing decoded may pass; wrong data never


@settings(max_examples=80, deadline=None)
@given(pos=st.floats(0, 1))
def test_truncated_or_padded_blob_is_refused(pos):
    _, blob = _blob()
    cut = int(pos * (len(blob) - 1))
    with pytest.raises(codec.CorruptBlobError):
        codec.decode(blob[:cut])
    with pytest.raises(codec.CorruptBlobError):
        codec.blob_info(blob[:cut])
    with pytest.raises(codec.CorruptBlobError):
        codec.decode(blob + b"\x00")


def test_payload_damage_in_every_stream_kind_is_caught():
    x, blob = _blob()
    header_len = codec.blob_info(blob)["header_bytes"]
    for i in range(header_len, len(blob), 97):
        damaged = bytearray(blob)
        damaged[i] ^= 0xFF
        with pytest.raises(codec.CorruptBlobError):
            codec.decode(bytes(damaged))


def test_not_a_blob():
    with pytest.raises(codec.CorruptBlobError, match="magic"):
        codec.decode(b"PK\x03\x04 definitely not ours")
    with pytest.raises(codec.CorruptBlobError):
        codec.decode(b"")


# --- format version 1 blobs (full-content crc) stay readable ---------------------------

import base64  # noqa: E402

# Written by the version-1 encoder: float32 (arange(96) - 40) * 0.37, frames of 128 bytes,
# as is and as a delta against a base with every third value + 1.
V1_FULL = base64.b64decode(
    "UkNGWgEGB2Zsb2F0MzIBYAAAAAAAAAD/BCAAAAAAAAAAAwAAAKnn+tR0HwjBACAAAAAAIAAAAAAgAAAAARYAAACo"
    "ObCzrgHXEAAgAAAAACAAAAAAIAAAAAAgAAAAGD0Kqv4egpQAIAAAAAAgAAAAACAAAAABFAAAAGNbSVTNSMM+uDOu"
    "KaQfmhWQCoUAe/Zx183DuK6kmpCFe3HNuMzh9QoeM0dccIWZrsLX6wAUKD2jzPUeR3CZwusUPcwe7Obg29XPycO9"
    "t7GrpZ+ZlI6Igvjs4NXJvbGlmY6C7NUotS/9ICBtAAAogoKBgIACAGATM8ACpJB7zaR7pKQApKR7pM17kKS4zXF7"
    "hZCapK64w83XcfZwwhTMcBRwcABwcBRwzBTCcB7MPRTrwplwRx71zKM9KL2ljuy9jr29AD09Dj1sDiU9VWwCDhkl"
    "MT1JVWBseAIIgICAf39/fn0AfX5/f3+AgICAgIGBgYGBgYGBgYGBgoJ7AIUKkBWaH6QprjO4PsNIzVLXXHEz9rh7"
    "PgDDhUgKzRQA69fCrpmFcFxHMx4K9eHMuKOPPTMoHhQKAPXr4dfMDhQZHyUrMTc9Q0lPVVtgZmxyeH4CBQgLDhEU"
    "FhkcHyIotS/9ICBdAAAYgoKDAgDAEB7AAg==")
V1_DELTA = base64.b64decode(
    "UkNGWgEFB2Zsb2F0MzIBYAAAAAAAAAD/BCAAAAAAAAAAAwAAAKnn+tS7hSqiWS1PUgEaAAAAARoAAAAAIAAAAAEV"
    "AAAAqDmws8Mq7tA19wXXACAAAAAAIAAAAAAgAAAAAR8AAAAYPQqq17dqNBGhCPcBFQAAAAEVAAAAACAAAAABEQAA"
    "AKt4uikotS/9ICCNAABIAACTAI8AAAAAAgAgwwjAAii1L/0gII0AAEgAAEcAPAAAAAACACDDCMACMAAAEAAAcAAA"
    "EAAAMAAAEAAA5gAAIAAAIAAA6gAAQAAotS/9ICBlAAAgAAABAAIAgMMIwAIAsAAANAAACgAA9gAAqwAAAAAAAAAA"
    "AAAAAAAAqwAAAABHAACyAAA3AADIAACqAAAAAAAAAAAAAAAAAACqAAAAAO4AAEgAAJwAAOMAANoAAEAAACAAAGAA"
    "ACAAAOoAABAotS/9ICC1AAB4AH8AAAEAAIEAfwABAAAAAgDgcACOKLUv/SAgZQAAIAAAewACAODAHcACKLUv/SAg"
    "ZQAAIAAA5AACAODAHcACAAAwAAAQAABwAAAQAAAQAADzAAAIAAAYAAAIAAA4AAAotS/9ICBFAAAQAAABACLAAg==")


def test_version_1_blobs_decode_and_are_checked():
    x = (torch.arange(96, dtype=torch.float32) - 40) * 0.37
    base = x.clone()
    base[::3] += 1
    assert V1_FULL[4] == 1 and codec.encode(x)[4] == 3
    assert raw(codec.decode(V1_FULL)) == raw(x)
    assert raw(codec.decode(V1_DELTA, base=base)) == raw(x)
    codec.verify(V1_FULL)
    header = codec.blob_info(V1_FULL)["header_bytes"]
    for i in range(header, len(V1_FULL), 7):
        damaged = bytearray(V1_FULL)
        damaged[i] ^= 0x10
        with pytest.raises(codec.CorruptBlobError):
            codec.decode(bytes(damaged))
