"""Round trips of the codec over every dtype, shape and layout; input never mutated."""

from __future__ import annotations

import pickle
import threading
import time

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ray_checkfreq import codec
from ray_checkfreq.codec import api as codec_api
from ray_checkfreq.codec.dtypes import BY_NAME

ALL_DTYPES = [info.torch_dtype for info in BY_NAME.values()]
# Force grouping and many frames on small inputs, so hypothesis reaches every code path.
TINY_FRAMES = codec.CodecConfig(frame_bytes=64, small_bytes=0)
CONFIGS = st.sampled_from([None, TINY_FRAMES, codec.CodecConfig(frame_bytes=4096, small_bytes=0)])
SHAPES = st.lists(st.integers(0, 6), min_size=0, max_size=3).map(tuple)


def raw(t: torch.Tensor) -> bytes:
    if t.numel() == 0:
        return b""
    return t.contiguous().as_strided((t.numel(),), (1,)).view(torch.uint8).numpy().tobytes()


def tensor_from_bytes(data: bytes, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    itemsize = dtype.itemsize
    n = int(np.prod(shape, dtype=np.int64))
    buf = bytearray((data * (n * itemsize // max(len(data), 1) + 1))[:n * itemsize]
                    if data else bytes(n * itemsize))
    u8 = torch.frombuffer(buf, dtype=torch.uint8) if buf else torch.empty(0, dtype=torch.uint8)
    if dtype == torch.bool:
        u8 = u8 & 1
    return u8.view(dtype).reshape(shape)


ADVERSARIAL = [
    b"\x00",  # all zero
    b"\xff",  # NaN with every payload bit set / -1
    b"\x01\x00\x00\x00\x00\x00\x00\x00",  # smallest denormals
    b"\x00\x00\x80\x7f\x00\x00\x80\xff",  # +inf, -inf (float32)
    b"\x01\x00\xc0\x7f\x01\x00\x80\x7f",  # quiet and signalling NaNs with payloads
    b"\x00\x7c\x00\xfc\x01\x7c",  # float16 +inf -inf sNaN
    b"\x80\x7f\x80\xff\xc1\x7f",  # bfloat16 +inf -inf NaN
    b"\x2a",  # all equal
]


@st.composite
def tensors(draw, dtypes=ALL_DTYPES) -> torch.Tensor:
    dtype = draw(st.sampled_from(dtypes))
    shape = draw(SHAPES)
    data = draw(st.one_of(st.binary(min_size=1, max_size=512), st.sampled_from(ADVERSARIAL)))
    t = tensor_from_bytes(data, dtype, shape)
    layout = draw(st.sampled_from(["contiguous", "transposed", "strided"]))
    if layout == "transposed" and t.ndim >= 2:
        t = t.transpose(0, 1)
    elif layout == "strided" and t.ndim >= 1:
        t = tensor_from_bytes(data, dtype, (t.shape[0] * 2, *t.shape[1:]))[::2]
    return t


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(x=tensors(), config=CONFIGS, threads=st.sampled_from([None, 1, 3]))
def test_round_trip_is_bit_identical_and_input_untouched(x, config, threads):
    before = raw(x)
    blob = codec.encode(x, config=config, threads=threads)
    assert raw(x) == before
    y = codec.decode(blob, threads=threads)
    assert y.dtype == x.dtype and y.shape == x.shape
    assert y.is_contiguous() and y.device.type == "cpu"
    assert raw(y) == before
    info = codec.blob_info(blob)
    assert info["raw_bytes"] == len(before) and info["stored_bytes"] == len(blob)
    codec.verify(blob)


NUMPY_DTYPES = ["bool", "uint8", "int8", "<i2", ">i2", "uint16", "<i4", ">u4", "int64",
                "uint64", "<f2", ">f2", "<f4", ">f4", "<f8", ">f8", "complex64", ">c16"]


@settings(max_examples=150, deadline=None)
@given(dtype=st.sampled_from(NUMPY_DTYPES), shape=SHAPES,
       data=st.binary(min_size=1, max_size=256), config=CONFIGS, step=st.sampled_from([1, 2]))
def test_numpy_round_trip(dtype, shape, data, config, step):
    dt = np.dtype(dtype)
    n = int(np.prod((shape[0] * step, *shape[1:]) if shape else (), dtype=np.int64))
    buf = (data * (n * dt.itemsize // len(data) + 1))[:n * dt.itemsize]
    a = np.frombuffer(buf, dtype=np.uint8).copy()
    if dt.kind == "b":
        a &= 1
    a = a.view(dt).reshape((shape[0] * step, *shape[1:]) if shape else ())
    if shape:
        a = a[::step]
    before = a.copy()
    blob = codec.encode(a, config=config)
    assert a.tobytes() == before.tobytes()
    native = a.astype(dt.newbyteorder("="))
    y = codec.decode_numpy(blob)
    assert y.dtype == native.dtype and y.shape == a.shape
    assert y.tobytes() == native.tobytes()
    t = codec.decode(blob)
    assert raw(t) == native.tobytes()


def test_numpy_object_and_other_inputs_are_refused():
    with pytest.raises(codec.CodecError, match="object"):
        codec.encode(np.array([1, "a"], dtype=object))
    with pytest.raises(codec.CodecError):
        codec.encode([1.0, 2.0])
    blob = codec.encode(torch.zeros(3, dtype=torch.bfloat16))
    with pytest.raises(codec.CodecError, match="bfloat16"):
        codec.decode_numpy(blob)


def test_special_shapes():
    for x in [torch.tensor(3.5), torch.empty(0), torch.empty(0, 7, dtype=torch.int64),
              torch.tensor(True), torch.zeros(1, 1, 1, 1, 1, dtype=torch.float16)]:
        y = codec.decode(codec.encode(x))
        assert y.shape == x.shape and y.dtype == x.dtype and raw(y) == raw(x)


def test_small_tensor_header_is_small():
    assert len(codec.encode(torch.tensor(1.0))) < 64
    assert len(codec.encode(torch.zeros(100))) < 80


def test_requires_grad_conj_and_neg_views():
    w = torch.randn(5, 4, requires_grad=True)
    assert raw(codec.decode(codec.encode(w))) == raw(w.detach())
    c = torch.randn(6, dtype=torch.complex64)
    assert raw(codec.decode(codec.encode(c.conj()))) == raw(c.conj().resolve_conj())


def test_large_float_tensors_compress_with_their_layout():
    g = torch.Generator().manual_seed(0)
    expected = {torch.float32: ("e8", 0, 4), torch.bfloat16: ("e8", 0, 3),
                torch.float16: ("bytes", 1, 2), torch.float64: ("bytes", 1, 8)}
    for dtype, (kind, rotation, streams) in expected.items():
        x = (torch.randn(300_000, generator=g) * 0.02).to(dtype)
        blob = codec.encode(x, config=codec.CodecConfig(frame_bytes=1 << 18))
        info = codec.blob_info(blob)
        assert (info["layout"], info["rotation_bits"], info["streams_per_frame"]) == (
            kind, rotation, streams)
        assert info["frames"] > 1
        assert len(blob) < 0.9 * info["raw_bytes"]
        assert raw(codec.decode(blob)) == raw(x)


def test_frames_decode_in_parallel_to_the_same_bytes(monkeypatch):
    x = torch.randn(64, 1024)
    config = codec.CodecConfig(frame_bytes=4096)
    blob1 = codec.encode(x, threads=1, config=config)
    blob2 = codec.encode(x, threads=2, config=config)
    assert blob1 == blob2  # frames are independent: the thread count changes nothing

    seen: set[int] = set()
    real = codec_api.decode_frame

    def recording(*args, **kwargs):
        seen.add(threading.get_ident())
        time.sleep(0.002)  # keep frames slow enough that both lanes take some
        return real(*args, **kwargs)

    monkeypatch.setattr(codec_api, "decode_frame", recording)
    y = codec.decode(blob1, threads=2)
    assert len(seen) == 2
    assert raw(y) == raw(x)


def test_errors_pickle():
    for err in (codec.CodecError("x"), codec.CorruptBlobError("y"), codec.BaseMismatchError("z")):
        back = pickle.loads(pickle.dumps(err))
        assert type(back) is type(err) and str(back) == str(err)


def test_bad_arguments_are_refused():
    x = torch.randn(10)
    for kwargs in ({"level": 0}, {"level": 99}, {"threads": 0}, {"precision_bits": -1}):
        with pytest.raises(codec.CodecError):
            codec.encode(x, **kwargs)
    with pytest.raises(codec.CodecError, match="floating"):
        codec.encode(torch.arange(5), precision_bits=3)
    with pytest.raises(codec.CodecError):
        codec.CodecConfig(frame_bytes=100)


def test_explicit_level_round_trips():
    x = torch.randn(50_000)
    for level in (-1, 1, 19):
        assert raw(codec.decode(codec.encode(x, level=level))) == raw(x)


# --- layout internals and the decode_into path ------------------------------------------

from ray_checkfreq.codec import grouping  # noqa: E402


@settings(max_examples=120, deadline=None)
@given(width=st.sampled_from([2, 4, 8]), n=st.integers(0, 70), seed=st.integers(0, 2**31),
       rotation=st.integers(0, 63))
def test_rotation_matches_its_definition_and_inverts(width, n, seed, rotation):
    rotation %= 8 * width
    frame = np.random.default_rng(seed).integers(0, 256, n * width, dtype=np.uint8)
    before = frame.copy()
    streams = grouping.split(frame, width, rotation=rotation)
    bits = 8 * width
    for i, word in enumerate(before.view(f"<u{width}").tolist()):
        rotated = ((word << rotation) | (word >> (bits - rotation))) & ((1 << bits) - 1)
        assert [int(s[i]) for s in streams] == list(rotated.to_bytes(width, "little"))
    assert np.array_equal(frame, before)  # split never writes into its input
    out = np.full_like(frame, 0x5A)
    grouping.merge_into([s.tobytes() for s in streams], out, width, rotation=rotation)
    assert np.array_equal(out, before)


def test_decode_into_reuses_the_buffer_and_checks_it():
    g = torch.Generator().manual_seed(3)
    x = torch.randn(40_000, generator=g).to(torch.bfloat16).reshape(200, 200)
    blob = codec.encode(x, config=codec.CodecConfig(frame_bytes=1 << 14))
    out = torch.empty_like(x)
    assert codec.decode_into(blob, out) is out and raw(out) == raw(x)
    flat = np.zeros(x.numel() * 2, np.uint8)
    codec.decode_into(blob, flat, threads=2)
    assert flat.tobytes() == raw(x)
    a = np.empty((100, 100), np.float32)
    blob32 = codec.encode(torch.from_numpy(np.arange(10_000, dtype=np.float32).reshape(100, 100)))
    codec.decode_into(blob32, a)
    assert np.array_equal(a, np.arange(10_000, dtype=np.float32).reshape(100, 100))
    base = x.clone()
    base[::7] += 1
    delta = codec.encode(x, base=base)
    codec.decode_into(delta, out.zero_(), base=base)
    assert raw(out) == raw(x)
    for bad in (torch.empty(200, 199, dtype=torch.bfloat16), torch.empty_like(x).t(),
                torch.empty(200, 200, dtype=torch.float16), np.empty(x.numel(), np.int16),
                np.zeros(x.numel() * 2, np.uint8)[::2], b"\x00" * (x.numel() * 2)):
        with pytest.raises(codec.CodecError):
            codec.decode_into(blob, bad)


def test_decoded_tensor_owns_ordinary_memory():
    x = torch.randn(300_000)
    y = codec.decode(codec.encode(x))
    assert raw(y) == raw(x) and pickle.loads(pickle.dumps(y)).equal(y)
    y += 1  # writable, its own memory
    assert not torch.equal(y, x)


def test_incompressible_streams_are_stored_raw_under_a_checksum():
    # Streams zstd cannot shrink are stored as they are (decode reads them in place) and
    # covered by the frame's raw crc32, which decode checks.
    x = torch.from_numpy(np.random.default_rng(0).integers(0, 2**32, 300_000, dtype=np.uint32))
    blob = codec.encode(x.view(torch.float32))
    info = codec.blob_info(blob)
    assert info["stream_methods"] == {"raw": info["frames"] * info["streams_per_frame"]}
    assert len(blob) < info["raw_bytes"] + 4096
    assert raw(codec.decode(blob)) == raw(x)
    damaged = bytearray(blob)
    damaged[info["header_bytes"] + 1000] ^= 0x10
    with pytest.raises(codec.CorruptBlobError, match="stored raw"):
        codec.decode(bytes(damaged))
