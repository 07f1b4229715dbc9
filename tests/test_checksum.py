"""storage.checksum.crc32 gives zlib.crc32's values, through the codec's kernel or zlib."""

from __future__ import annotations

import platform
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
    yield rng.bytes(64 * 1024 + 3)
    yield memoryview(rng.bytes(3_000_001))
    yield np.frombuffer(rng.bytes(800_000), dtype=np.float32).reshape(400, 500)
    yield leaf_bytes(torch.randn(300, 300))


@pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64"), reason="carry-less multiply: x86-64 kernels")
def test_the_kernel_is_in_use_on_this_machine():
    assert checksum.accelerated(), "the codec kernels are built with carry-less multiply on x86-64"


def test_crc32_matches_zlib_on_every_kind_of_buffer():
    for data in _buffers():
        assert checksum.crc32(data) == zlib.crc32(data)
        assert checksum.crc32(data, 0xDEADBEEF) == zlib.crc32(data, 0xDEADBEEF), "a running crc continues"


def test_a_strided_buffer_is_refused_as_zlib_refuses_it():
    view = memoryview(np.arange(200_000, dtype=np.int64)[::2])
    with pytest.raises(BufferError):
        zlib.crc32(view)
    with pytest.raises(BufferError):
        checksum.crc32(view)
