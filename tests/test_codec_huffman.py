"""The Huffman coding of exponent streams (huffman.py, blob version 5): the C coder
against the format's reference decoder, malformed streams, and blobs that use it."""

from __future__ import annotations

import gc
import struct
import zlib

import numpy as np
import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

from ray_checkfreq import codec
from ray_checkfreq.codec import blob as blobfmt
from ray_checkfreq.codec import huffman, layout

kernels = layout._kernels


def raw(t: torch.Tensor) -> bytes:
    return t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def make_stream(n: int, seed: int, kind: str) -> bytes:
    rng = np.random.default_rng(seed)
    if kind == "uniform":
        data = rng.integers(0, 256, n)
    elif kind == "geometric":  # skewed enough that unlimited codes would exceed 12 bits
        data = np.minimum(rng.geometric(0.45, n) - 1, 255)
    elif kind == "two":
        data = rng.choice([17, 200], n)
    elif kind == "one":
        data = np.full(n, 255)
    else:  # exponent-like: a few hundred symbols around a peak
        data = np.clip(rng.normal(120, 6, n), 0, 255)
    return data.astype(np.uint8).tobytes()


def repeated_word_share(data: bytes) -> float:
    """The share of 8-byte words equal to the word before: the coder leaves a stream to zstd
    above 1/64 (a single repeat does it in a short stream, whatever its kind)."""
    words = np.frombuffer(data[: len(data) // 8 * 8], np.uint64)
    return float((words[1:] == words[:-1]).sum()) / max(len(words), 1)


def decode(stored: bytes, n: int) -> bytes:
    out = np.empty(n, np.uint8)
    kernels.huf_decode(stored, out)
    return out.tobytes()


@settings(max_examples=120, deadline=None)
@given(n=st.integers(0, 3000), seed=st.integers(0, 2**32 - 1),
       kind=st.sampled_from(["uniform", "geometric", "two", "one", "exponent"]))
@example(n=280, seed=552608602, kind="geometric")  # one repeated word of 35: left to zstd
def test_c_coder_round_trips_and_matches_the_reference_decoder(n, seed, kind):
    data = make_stream(n, seed, kind)
    stored = kernels.huf_encode(data)
    if stored is None:  # judged to have runs: left to zstd
        assert repeated_word_share(data) > 1 / 64, (kind, n)
        return
    assert decode(stored, n) == data
    assert huffman.reference_decode(stored, n) == data
    lengths = huffman.code_lengths(stored)
    assert max(lengths) <= huffman.TABLE_LOG
    huffman.canonical_codes(lengths)  # complete


def test_large_skewed_stream_is_near_its_entropy_and_round_trips():
    data = make_stream(1 << 20, 1, "exponent")
    stored = kernels.huf_encode(data)
    counts = np.bincount(np.frombuffer(data, np.uint8), minlength=256)
    p = counts[counts > 0] / len(data)
    entropy_bytes = -(p * np.log2(p)).sum() * len(data) / 8
    assert len(stored) < 1.01 * entropy_bytes + huffman.HEADER_BYTES
    assert decode(stored, len(data)) == data


def test_streams_with_runs_are_left_to_zstd():
    runs = np.repeat(np.frombuffer(make_stream(2000, 2, "uniform"), np.uint8), 32).tobytes()
    assert kernels.huf_encode(runs) is None
    assert kernels.huf_encode(bytes(100_000)) is None


@settings(max_examples=200, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), pos=st.floats(0, 1), value=st.integers(0, 255),
       cut=st.integers(-40, 40))
def test_malformed_streams_are_refused_or_decode_within_bounds(seed, pos, value, cut):
    # The blob's crc32 rejects damaged streams before they are decoded; the decoder must
    # still never read or write outside its buffers whatever it is given.
    n = 5000
    stored = bytearray(kernels.huf_encode(make_stream(n, seed, "exponent")))
    stored[min(int(pos * len(stored)), len(stored) - 1)] = value
    if cut < 0:
        stored = stored[:cut]
    elif cut > 0:
        stored += bytes(cut)
    out = np.zeros(n + 64, np.uint8)
    try:
        kernels.huf_decode(bytes(stored), out[:n])
    except ValueError:
        pass
    assert not out[n:].any()


def test_decoder_checks_the_header():
    stored = kernels.huf_encode(make_stream(4000, 3, "exponent"))
    bad_log = b"\x0b" + stored[1:]
    incomplete = stored[:1] + b"\x00" * 128 + stored[129:]
    lanes = list(struct.unpack_from("<4I", stored, 129))
    lanes[0] += 1
    bad_lanes = stored[:129] + struct.pack("<4I", *lanes) + stored[145:]
    for bad in (bad_log, incomplete, bad_lanes, stored[:100], stored + b"\x00"):
        with pytest.raises(ValueError):
            decode(bad, 4000)
        with pytest.raises(ValueError):
            huffman.reference_decode(bad, 4000)
    with pytest.raises(ValueError):
        decode(stored, 4001)  # the lanes hold other symbol counts


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_float_blobs_huffman_code_their_exponent_stream(dtype):
    x = (torch.randn(400_000, generator=torch.Generator().manual_seed(4)) * 0.02).to(dtype)
    blob = codec.encode(x)
    info = codec.blob_info(blob)
    assert blob[4] == blobfmt.VERSION_HUF
    assert info["stream_methods"]["huffman"] == info["frames"]
    assert raw(codec.decode(blob)) == raw(x)
    assert raw(codec.decode(blob, threads=1)) == raw(x)
    codec.verify(blob)
    # a zstd-only blob of the same tensor (explicit level) is no smaller
    assert len(blob) <= len(codec.encode(x, level=1)) * 1.002


def test_damage_in_a_huffman_stream_is_caught_before_decoding():
    x = torch.randn(100_000, generator=torch.Generator().manual_seed(5))
    blob = codec.encode(x)
    header, start = blobfmt.unpack(blob)
    method, n = header.frames[0].streams[0]
    assert method == blobfmt.METHOD_HUF
    for offset in (0, 5, 200, n // 2, n - 1):
        damaged = bytearray(blob)
        damaged[start + offset] ^= 0x04
        with pytest.raises(codec.CorruptBlobError, match="Huffman-coded"):
            codec.decode(bytes(damaged))


def test_only_blobs_that_need_version_5_are_written_as_it():
    x = torch.randn(100_000, generator=torch.Generator().manual_seed(6))
    assert codec.encode(x)[4] == 5
    assert codec.encode(x, level=3)[4] == 3  # zstd everywhere: readers before 5 read it
    assert codec.encode(x[:1000])[4] == 3  # exponent stream below huffman.MIN_BYTES
    assert codec.encode(x.half())[4] == 3  # byte grouping: no planar exponent stream
    factor = codec.encode(x.clamp(-1, 1), precision_factor=2**16)
    assert factor[4] == 5 and codec.blob_info(factor)["precision_factor"] == 2**16
    assert raw(codec.decode(factor)) == raw(codec.trim(x.clamp(-1, 1), precision_factor=2**16))


def test_huffman_method_in_an_older_version_is_refused():
    # A version 5 blob with a precision factor has the header layout of version 4:
    # relabelled 4 (header checksum redone), its Huffman streams are an unknown method.
    x = torch.randn(100_000, generator=torch.Generator().manual_seed(7)).clamp(-1, 1)
    older = bytearray(codec.encode(x, precision_factor=2**16))
    _, start = blobfmt.unpack(bytes(older))
    older[4] = 4
    older[start - 4:start] = struct.pack("<I", zlib.crc32(bytes(older[:start - 4])))
    assert blobfmt.unpack(bytes(older))[0].version == 4
    with pytest.raises(codec.CorruptBlobError, match="invalid stream entry"):
        codec.decode(bytes(older))


def test_decoded_tensor_does_not_share_the_decoder_scratch():
    # The exponent stream is decoded into per-thread scratch; what decode returns must own
    # its memory: it stays intact once its blob is gone and the same scratch has been
    # reused by other decodes (of every planar dtype, on this thread).
    g = torch.Generator().manual_seed(8)
    x = torch.randn(300_000, generator=g)
    blob = codec.encode(x)
    first = codec.decode(blob, threads=1)
    del blob
    gc.collect()
    for other in (torch.randn(300_000, generator=g) * 100, x.bfloat16() * 3, x[:70_000] - 1):
        assert raw(codec.decode(codec.encode(other), threads=1)) == raw(other)
    gc.collect()
    assert raw(first) == raw(x)
    first.mul_(2)  # ordinary, writable memory of its own
    assert torch.equal(first, x * 2)


def test_prefetch_hint_changes_nothing():
    data = make_stream(50_000, 9, "exponent")
    stored = kernels.huf_encode(data)
    out = np.empty(len(data), np.uint8)
    for ahead in (b"", bytes(10), np.zeros(1 << 20, np.uint8)):
        out[:] = 0
        kernels.huf_decode(stored, out, ahead)
        assert out.tobytes() == data


def test_constant_exponent_bits_are_stored_as_a_fill():
    # N(0, 0.02) float32: every exponent lies within the offset's window, so stream K is
    # its offset byte then zeros in every frame: 2 stored bytes, rebuilt by a fill.
    x = torch.randn(1 << 18, generator=torch.Generator().manual_seed(10)) * 0.02
    blob = codec.encode(x, config=codec.CodecConfig(frame_bytes=1 << 18))
    header, start = blobfmt.unpack(blob)
    assert [f.streams[1] for f in header.frames] == [(blobfmt.METHOD_FILL, 2)] * len(header.frames)
    assert codec.blob_info(blob)["stream_methods"]["fill"] == len(header.frames)
    assert raw(codec.decode(blob)) == raw(x)
    # a value far outside the window makes that frame's K stream non-constant
    y = x.clone()
    y[5] = 1e30
    header_y, _ = blobfmt.unpack(codec.encode(y, config=codec.CodecConfig(frame_bytes=1 << 18)))
    assert header_y.frames[0].streams[1][0] == blobfmt.METHOD_ZSTD
    assert header_y.frames[1].streams[1][0] == blobfmt.METHOD_FILL
    # damage to a fill's bytes is caught by the frame checksum
    fill_at = start + header.frames[0].streams[0][1]
    for k in (0, 1):
        damaged = bytearray(blob)
        damaged[fill_at + k] ^= 0x01
        with pytest.raises(codec.CorruptBlobError, match="checksum mismatch"):
            codec.decode(bytes(damaged))
