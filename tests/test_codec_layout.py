"""Frame layouts: the C kernels against the numpy definitions, the planar exponent split
field by field, the numpy fallback, and format version 2 blobs."""

from __future__ import annotations

import base64
import dataclasses
import os
import subprocess
import sys
import zlib

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ray_checkfreq import codec
from ray_checkfreq.codec import blob as blobfmt
from ray_checkfreq.codec import grouping, huffman, layout, planar


def raw(t: torch.Tensor) -> bytes:
    return t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def test_the_c_kernels_are_built():
    # The numpy fallback is correct but several times slower: an install that silently
    # lost its compiled kernels must fail here rather than only in the benchmarks.
    assert layout.kernels_available()


def test_planar_split_fields_of_known_values():
    x = np.array([1.0, -1.5, 3.0, 0.0], np.float32)
    # Exponents 127, 127, 128, 0; the sample (every 32nd element) is just 1.0, so the
    # offset is 127 - 32 = 95 and the exponents become 32, 32, 33 and (0 - 95) % 256 = 161.
    expected = [
        [32 << 2, 32 << 2 | 2, 33 << 2 | 2, (161 & 63) << 2],  # T: E5..E0, top 2 mantissa bits
        [95, (161 >> 6) << 6],  # K: the offset, then E7E6 of elements 0..3 at bits 0, 2, 4, 6
        [0] * 8,  # M: mantissa bits 20..13, then 12..5 (all zero for these values)
        [0 | 1 << 4, 0, 0],  # R: r = m4..m0 s as nibbles (only -1.5 has a sign), top bits
    ]
    frame = x.view(np.uint8)
    assert [s.tolist() for s in planar.split(frame, 4)] == expected
    assert [np.asarray(s).tolist() for s in layout.Layout(kind="e8", unit=4).split(frame)] == (
        expected)


FRAMES = st.tuples(st.sampled_from([2, 4]), st.integers(1, 5000), st.integers(0, 2**32 - 1),
                   st.sampled_from(["random", "normal", "zeros-and-values", "constant"]),
                   st.integers(0, 3))


def make_frame(width: int, n: int, seed: int, kind: str, misalign: int) -> np.ndarray:
    """n elements of `width` bytes at an address `misalign` bytes off alignment."""
    rng = np.random.default_rng(seed)
    if kind == "random":
        data = rng.integers(0, 256, n * width, dtype=np.uint8)
    else:
        values = rng.standard_normal(n).astype(np.float32) * rng.choice([1e-3, 1.0, 30.0])
        if kind == "zeros-and-values":
            values[rng.random(n) < 0.5] = 0.0
        elif kind == "constant":
            values[:] = values[0]
        words = values.view(np.uint32)
        data = (words >> 16).astype(np.uint16).view(np.uint8) if width == 2 else (
            words.view(np.uint8))
    holder = np.zeros(data.size + misalign, np.uint8)
    holder[misalign:] = data
    return holder[misalign:]


@settings(max_examples=150, deadline=None)
@given(FRAMES)
def test_planar_kernels_equal_the_numpy_definition_and_invert(case):
    width, n, seed, kind, misalign = case
    frame = make_frame(width, n, seed, kind, misalign)
    before = frame.copy()
    reference = [bytes(s) for s in planar.split(frame, width)]
    assert [len(s) for s in reference] == planar.stream_lengths(frame.nbytes, width)
    fast = [bytes(s) for s in layout.Layout(kind="e8", unit=width).split(frame)]
    assert fast == reference
    assert np.array_equal(frame, before)
    for merge in (lambda s, o: planar.merge_into(s, o, width),
                  layout.Layout(kind="e8", unit=width).merge):
        holder = np.full(frame.nbytes + misalign, 0xA5, np.uint8)
        merge(reference, holder[misalign:])
        assert np.array_equal(holder[misalign:], before)


@settings(max_examples=100, deadline=None)
@given(width=st.sampled_from([2, 4, 8]), n=st.integers(1, 3000), seed=st.integers(0, 2**31),
       rotation=st.integers(0, 63), misalign=st.integers(0, 7))
def test_byte_grouping_kernels_equal_the_numpy_definition(width, n, seed, rotation, misalign):
    rotation %= 8 * width
    holder = np.random.default_rng(seed).integers(0, 256, n * width + misalign, dtype=np.uint8)
    frame = holder[misalign:]
    lay = layout.Layout(kind="bytes", unit=width, rotation=rotation)
    reference = [bytes(s) for s in grouping.split(frame, width, rotation=rotation)]
    assert [bytes(s) for s in lay.split(frame)] == reference
    out = np.zeros(frame.nbytes + misalign, np.uint8)[misalign:]
    lay.merge(reference, out)
    assert np.array_equal(out, frame)


def test_kernels_refuse_streams_of_the_wrong_size():
    frame = np.arange(40, dtype=np.uint8)
    streams = [bytes(s) for s in layout.Layout(kind="e8", unit=4).split(frame)]
    out = np.empty_like(frame)
    with pytest.raises(ValueError, match="stream 2"):
        layout.Layout(kind="e8", unit=4).merge(streams[:2] + [streams[2][:-1]] + streams[3:], out)
    with pytest.raises(ValueError):
        layout.Layout(kind="bytes", unit=4, rotation=3).merge([b"\x00" * 9] * 4, out)
    with pytest.raises(ValueError):
        layout.Layout(kind="e8", unit=4).merge(streams, out[:-1])


def test_exponent_offset_keeps_the_top_exponent_bits_constant_across_binades():
    # N(0, 1) values lie on both sides of 2.0, where the top exponent bits flip: after
    # the offset they are constant in every frame, so stream K costs almost nothing.
    x = torch.randn(400_000, generator=torch.Generator().manual_seed(1))
    blob = codec.encode(x, config=codec.CodecConfig(frame_bytes=1 << 18))
    header, _ = blobfmt.unpack(blob)
    k_raw = planar.stream_lengths(1 << 18, 4)[1]
    for frame in header.frames[:-1]:
        assert frame.streams[1][1] < 0.05 * k_raw
    assert raw(codec.decode(blob)) == raw(x)


def test_numpy_fallback_writes_and_reads_the_same_blobs(monkeypatch):
    # Without the kernels nothing is Huffman-coded (huffman.py has no numpy encoder), so
    # the blobs match once the kernels' encoder is kept from it too; the fallback still
    # decodes the Huffman-coded blobs (by the format's reference decoder).
    g = torch.Generator().manual_seed(2)
    tensors = [torch.randn(70_001, generator=g), torch.randn(50_003, generator=g).bfloat16(),
               torch.randn(30_001, generator=g).half(), torch.randn(9_999, generator=g).double()]
    config = codec.CodecConfig(frame_bytes=1 << 16)
    with_huffman = [codec.encode(t, config=config) for t in tensors]
    assert [b[4] for b in with_huffman] == [5, 5, 3, 3]
    monkeypatch.setattr(huffman, "MIN_BYTES", 1 << 62)
    fast = [codec.encode(t, config=config) for t in tensors]
    monkeypatch.setattr(layout, "_kernels", None)
    monkeypatch.setattr(layout, "_warned", False)
    with pytest.warns(RuntimeWarning, match="numpy fallback"):
        slow = [codec.encode(t, config=config) for t in tensors]
    assert slow == fast
    for t, blob, huffman_blob in zip(tensors, fast, with_huffman, strict=True):
        assert raw(codec.decode(blob)) == raw(t)
        assert raw(codec.decode(huffman_blob)) == raw(t)


# Written by the version 2 encoder (sign bit rotated next to the mantissa): float32
# (arange(96) - 40) * 0.37 and the same cast to bfloat16, frames of 128 bytes.
V2_FLOAT32 = base64.b64decode(
    "UkNGWgIGB2Zsb2F0MzIBYAAAAAAAAAD/BCAAAAAAAAAAAwAAALPmmbmlMADwACAAAAAAIAAAAAAgAAAAARoAAACu"
    "AdcQrgHXEAAgAAAAACAAAAAAIAAAAAAgAAAAMiUf+xkPDx4AIAAAAAAgAAAAACAAAAABGAAAAA3jd73NSMM+uDOu"
    "KaQfmhWQCoUAe/Zx183DuK6kmpCFe3HNuMzh9QoeM0dccIWZrsLX6wAUKD2jzPUeR3CZwusUPcwe7Obg29XPycO9"
    "t7GrpZ+ZlI6Igvjs4NXJvbGlmY6C7NUotS/9JCBtAAAogoKBgIACAGATM8ACic2A0qSQe82ke6SkAKSke6TNe5Ck"
    "uM1xe4WQmqSuuMPN13H2cMIUzHAUcHAAcHAUcMwUwnAezD0U68KZcEce9cyjPSi9pY7svY69vQA9PQ49bA4lPVVs"
    "Ag4ZJTE9SVVgbHgCCICAgH9/f359AH1+f39/gICAgICBgYGBgYGBgYGBgYKCewCFCpAVmh+kKa4zuD7DSM1S11xx"
    "M/a4ez4Aw4VICs0UAOvXwq6ZhXBcRzMeCvXhzLijjz0zKB4UCgD16+HXzA4UGR8lKzE3PUNJT1VbYGZscnh+AgUI"
    "Cw4RFBYZHB8iKLUv/SQgXQAAGIKCgwIAwBAewAKR20vS")
V2_BFLOAT16 = base64.b64decode(
    "UkNGWgIGCGJmbG9hdDE2AWAAAAAAAAAA/wJAAAAAAAAAAAIAAABAodrUpBx4GwBAAAAAATEAAAB0kTNtkROmYgAg"
    "AAAAARgAAAB7/SGu7efh29XPycO9uLKspqCalI6Igvnt4dXJvbKmmo6C7dW9po7tvY69vQA9PQ49bQ4mPVVtAg4a"
    "JjI9SVVhbXkCCCi1L/0kQCUBANiCgoGAgICAgH9/f359AH1+f39/gICAgICBgoIDEAB2b3fGAq2K23oOFBogJiwy"
    "OD1DSU9VW2FnbXN5fwIFCAsOERQXGh0gIyi1L/0kIF0AABiCgoMCAMAQHsACkdtL0g==")


def test_version_2_blobs_decode():
    x = (torch.arange(96, dtype=torch.float32) - 40) * 0.37
    for blob, expected in ((V2_FLOAT32, x), (V2_BFLOAT16, x.to(torch.bfloat16))):
        assert blob[4] == 2
        assert codec.blob_info(blob)["layout"] == "sign-rotated"
        assert raw(codec.decode(blob)) == raw(expected)
        codec.verify(blob)
    assert codec.encode(x)[4] == blobfmt.VERSION == 3


# Written by the encoder before the SIMD kernels and crc32 changes (format version 3, 160
# N(0, 1) float32 values in 320-byte frames): blobs already stored must keep decoding.
V3_FLOAT32_BEFORE_KERNELS = base64.b64decode(
    "UkNGWgMIB2Zsb2F0MzIBoAAAAAAAAAD/BABQAAAAAAAAAAIAAAB/BYhBsmFVzQBQAAAAARUAAAAAoAAAAAA8"
    "AAAAopHz4bRP+NQAUAAAAAEVAAAAAKAAAAAAPAAAAHcmczBhgICHg4d3iYOEg4F6h3OFiYOLiYt/iYB9fY2E"
    "dnuKg4eGiIZ0h4R7e3iIeImKhnuFjIaIeIR+hXiFiYV+g3yIhH6HiImGhYuDeomFgYGAiii1L/0kFUUAABBd"
    "AAEACcACtnNMqAnHYh9G7rJc4PbWtb9xfY9gUpooXYURVwT7CE81QB6k1Hg+dSkTqyYRFebfbzDgoyEAGczE"
    "nQp2QVbBZ4BpEr+iRzCUS1ss+Gk5B4M85QAY6Kne7lTkyWETu2TPG5kM+3lk2nzv3d0ZGlaUPkd02+ABf1zU"
    "qzs2H9gAdXtvRgR/uzYbEt8PgJnRhQzBHLWVr2g8q7VKbds8JPIu5kSvzBiimZmGPaj6i7N5cyF2/2ubtR4H"
    "36wj2kJvmM6liZTy3jlI+bzVzHlrl0crAY9vK7XL40AJaLaPwg/nPzx+fH13eoRpf4SBboF9hGWAhX2GiHyD"
    "eYiCgHp/eXqBgIR1cIR8goN6dYB3h4R9iIKGgoKCeIaEhXR8eYOEgHKCgYWFeINqgX2AaH58hYKGgSi1L/0k"
    "FUUAABBeAAEACcACI7VchNnbpLpQdOYYqjkuWHA1h6opjMAS3zM/faf9kuOllp4oIhGENyjdxiq3upf9hs5B"
    "xfwNwzswJf/ENmEdzWRXjVgCHAfuutKOOnsTAcyDdJ1eMN80syfOJOgdhkbYG2B2xN8AuBYjDetQXtarYR77"
    "pMV7TkfKTRjK+TJtTbGPMdPaAMyTX8C4IE4l9qEc89doqzJjPUk1eyMaWjcXeqlrwa/9/DGV6qmFiYuXGwqf"
    "ovdqO1Iy6lT7bcOvzVaGM7X8NflcKF1L9Zcw3pAlWKfk0XHrdCKivvKT2w5UsZg=")


def test_version_3_blobs_of_the_previous_encoder_decode():
    blob = V3_FLOAT32_BEFORE_KERNELS
    assert blob[4] == 3 and codec.blob_info(blob)["layout"] == "e8"
    codec.verify(blob)
    y = codec.decode(blob)
    assert y.dtype == torch.float32 and tuple(y.shape) == (160,)
    assert zlib.crc32(raw(y)) == 0x807112BF
    assert y[:3].tolist() == [0.001230153371579945, 0.2987455427646637, -0.27413785457611084]


def test_headers_naming_a_layout_that_cannot_fit_are_refused():
    x = torch.randn(5000)
    blob = codec.encode(x)
    header, start = blobfmt.unpack(blob)
    bad_headers = [
        dataclasses.replace(header, flags=header.flags | blobfmt.FLAG_GROUPED),
        dataclasses.replace(header, flags=header.flags | blobfmt.FLAG_ROTATE),
        dataclasses.replace(header, rotation=3),
        dataclasses.replace(header, dtype="float16"),
        dataclasses.replace(header, width=4 - 1),
    ]
    for bad in bad_headers:
        with pytest.raises(codec.CorruptBlobError):
            codec.decode(blobfmt.pack(bad) + blob[start:])


@settings(max_examples=150, deadline=None)
@given(n=st.integers(0, 700), seed=st.integers(0, 2**31), start=st.integers(0, 2**32 - 1),
       misalign=st.integers(0, 15))
def test_kernel_crc32_equals_zlib(n, seed, start, misalign):
    data = np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8).tobytes()
    holder = np.zeros(n + misalign, np.uint8)
    holder[misalign:] = np.frombuffer(data, np.uint8)
    view = holder[misalign:]
    assert layout.crc32(view, start) == zlib.crc32(data, start)
    assert layout.crc32(data) == zlib.crc32(data)


def test_kernel_crc32_equals_zlib_on_large_buffers():
    data = np.random.default_rng(3).integers(0, 256, (1 << 20) + 77, dtype=np.uint8)
    for size in (64, 65, 127, 128, 1000, 4096 + 15, data.size):
        assert layout.crc32(data[:size]) == zlib.crc32(data[:size].tobytes())


SSE2_CHECK = """
import os, zlib, numpy as np
from ray_checkfreq.codec import _kernels, layout, planar
if os.environ.get("RAY_CHECKFREQ_CODEC_NO_AVX2"):
    assert (_kernels.avx2, _kernels.avx512, _kernels.clmul) == (0, 0, 0)
else:
    assert _kernels.avx512 == 0
rng = np.random.default_rng(5)
for width in (2, 4):
    for n in (1, 15, 16, 33, 63, 64, 100, 127, 2047, 2048, 5001):
        for kind in ("random", "normal"):
            data = (rng.integers(0, 256, n * width, dtype=np.uint8) if kind == "random" else
                    (rng.standard_normal(n).astype(np.float32).view(np.uint32) >> (16 if width == 2 else 0))
                    .astype(np.uint16 if width == 2 else np.uint32).view(np.uint8))
            reference = [bytes(s) for s in planar.split(data, width)]
            lay = layout.Layout(kind="e8", unit=width)
            assert [bytes(s) for s in lay.split(data)] == reference, (width, n, kind)
            out = np.empty_like(data)
            lay.merge(reference, out)
            assert np.array_equal(out, data), (width, n, kind)
blob = rng.integers(0, 256, 100_003, dtype=np.uint8)
assert _kernels.crc32(blob, 7) == zlib.crc32(blob.tobytes(), 7)
for n in (0, 5, 4096, 100_001):  # Huffman: the scalar table build and fast loop
    data = np.clip(rng.normal(120, 6, n), 0, 255).astype(np.uint8)
    out = np.empty(n, np.uint8)
    _kernels.huf_decode(_kernels.huf_encode(data), out)
    assert np.array_equal(out, data), n
print("ok")
"""


def test_sse2_kernels_without_avx2_equal_the_numpy_definition():
    # The AVX2 and carry-less multiply paths are chosen at import; this checks the SSE2 and
    # table paths that CPUs without them run.
    env = dict(os.environ, RAY_CHECKFREQ_CODEC_NO_AVX2="1")
    done = subprocess.run([sys.executable, "-c", SSE2_CHECK], env=env, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr


def test_avx2_kernels_without_avx512_equal_the_numpy_definition():
    if not getattr(layout._kernels, "avx2", 0):
        pytest.skip("this CPU has no AVX2")
    env = dict(os.environ, RAY_CHECKFREQ_CODEC_NO_AVX512="1")
    done = subprocess.run([sys.executable, "-c", SSE2_CHECK], env=env, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr
