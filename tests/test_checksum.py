"""storage.checksum.crc32 gives zlib.crc32's values, through libdeflate or without it."""

from __future__ import annotations

import zlib

import numpy as np
import pytest
import torch

from ray_checkfreq.storage import checksum
from ray_checkfreq.storage.arrays import leaf_bytes


def _buffers():
    rng = np.random.default_rng(0)
    yield b""
    yield b"123456789"
    yield rng.bytes(64 * 1024 + 3)  # just above the size where libdeflate takes over
    yield memoryview(rng.bytes(3_000_001))
    yield np.frombuffer(rng.bytes(800_000), dtype=np.float32).reshape(400, 500)
    yield leaf_bytes(torch.randn(300, 300))


@pytest.mark.parametrize("accelerated", [True, False])
def test_crc32_matches_zlib_on_every_kind_of_buffer(monkeypatch, accelerated):
    if not accelerated:
        monkeypatch.setattr(checksum, "_libdeflate_crc32", None)
    for data in _buffers():
        assert checksum.crc32(data) == zlib.crc32(data)
        assert checksum.crc32(data, 0xDEADBEEF) == zlib.crc32(data, 0xDEADBEEF), "a running crc continues"


def test_a_strided_buffer_is_refused_as_zlib_refuses_it():
    view = memoryview(np.arange(200_000, dtype=np.int64)[::2])
    with pytest.raises(BufferError):
        zlib.crc32(view)
    with pytest.raises(BufferError):
        checksum.crc32(view)
