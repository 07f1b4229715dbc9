"""Local stores write large files around the page cache (``O_DIRECT``): the same bytes on
disk whatever the chunks' sizes and addresses, large leaves written from the caller's
memory, and a filesystem that refuses a direct write gets buffered ones."""

from __future__ import annotations

import errno
import fcntl
import mmap
import os

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ray_checkfreq.storage import CheckpointStore
from ray_checkfreq.storage.backends import direct, posix
from ray_checkfreq.storage.backends.direct import BLOCK, LARGE_LEAF_BYTES, DirectWriter, address_of
from ray_checkfreq.storage.manifest import MANIFEST_NAME, decode_global

PAGES = mmap.mmap(-1, 64 * BLOCK)  # page-aligned source memory
PAGES[:] = np.random.default_rng(0).integers(0, 256, 64 * BLOCK, dtype=np.uint8).tobytes()

# A chunk: plain bytes of any length, or a view of the aligned pages at a block boundary
# (the kind a direct write can take in place) of any length.
chunk = st.one_of(
    st.binary(max_size=3 * BLOCK + 7),
    st.tuples(st.integers(0, 40), st.integers(0, 20 * BLOCK + 99)).map(
        lambda at: memoryview(PAGES)[at[0] * BLOCK:at[0] * BLOCK + at[1]]),
)


def _records_writers(monkeypatch) -> list[DirectWriter]:
    made: list[DirectWriter] = []

    class Recording(DirectWriter):
        def __init__(self, fd: int) -> None:
            super().__init__(fd)
            made.append(self)

    monkeypatch.setattr(posix, "DirectWriter", Recording)
    return made


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(chunks=st.lists(chunk, max_size=8))
def test_the_file_holds_exactly_the_chunks_given(tmp_path_factory, monkeypatch, chunks):
    monkeypatch.setattr(posix, "DIRECT_MIN_BYTES", 0)
    backend = posix.PosixBackend(str(tmp_path_factory.mktemp("direct")))
    backend.make_dir("d")
    backend.write("d/f.bin", chunks)
    with open(os.path.join(backend.root, "d", "f.bin"), "rb") as f:
        assert f.read() == b"".join(bytes(c) for c in chunks)


def test_a_large_leaf_of_an_aligned_buffer_is_written_in_place(tmp_path, monkeypatch):
    made = _records_writers(monkeypatch)
    source = mmap.mmap(-1, 2 << 20)  # a slot's data region: page-aligned
    big = torch.frombuffer(source, dtype=torch.float32, count=(1 << 20) // 4)
    big.copy_(torch.randn(big.numel()))
    state = {"bias": torch.randn(10), "big": big, "odd": torch.randn(LARGE_LEAF_BYTES // 4 + 3)}
    store = CheckpointStore(str(tmp_path), full_every=1)
    store.save(1, state, codec="raw")
    manifest = decode_global((tmp_path / store.latest().name / MANIFEST_NAME).read_bytes())
    offsets = {tensor.key: tensor.chunks[0].offset for tensor in manifest.tensors}
    assert all(offsets[key] % BLOCK == 0 for key in ("big", "odd"))  # large: a block boundary
    assert made and made[0].direct_bytes >= big.numel() * 4  # from the buffer itself, no staging copy
    loaded = store.load()
    assert all(torch.equal(loaded[key], state[key]) for key in state)
    del big
    source.close()


def test_a_refused_direct_write_goes_on_buffered_with_the_same_bytes(tmp_path, monkeypatch):
    monkeypatch.setattr(posix, "DIRECT_MIN_BYTES", 0)
    made = _records_writers(monkeypatch)
    real_write = os.write

    def refuse_direct(fd: int, data) -> int:
        if fcntl.fcntl(fd, fcntl.F_GETFL) & direct.O_DIRECT:
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_write(fd, data)

    monkeypatch.setattr(direct.os, "write", refuse_direct)
    chunks = [memoryview(PAGES)[:5 * BLOCK], b"tail"]
    backend = posix.PosixBackend(str(tmp_path))
    backend.write("f.bin", chunks)
    assert (tmp_path / "f.bin").read_bytes() == bytes(PAGES[:5 * BLOCK]) + b"tail"
    assert made[0].direct is False and made[0].direct_bytes == 0


def test_a_platform_without_o_direct_writes_buffered(tmp_path, monkeypatch):
    monkeypatch.setattr(posix, "DIRECT_MIN_BYTES", 0)
    monkeypatch.setattr(direct, "O_DIRECT", 0)
    made = _records_writers(monkeypatch)
    posix.PosixBackend(str(tmp_path)).write("f.bin", [memoryview(PAGES)[:3 * BLOCK]])
    assert (tmp_path / "f.bin").read_bytes() == bytes(PAGES[:3 * BLOCK])
    assert made == []


def test_a_write_error_is_raised_naming_the_file(tmp_path, monkeypatch):
    monkeypatch.setattr(posix, "DIRECT_MIN_BYTES", 0)

    def no_space(fd: int, data) -> int:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(direct.os, "write", no_space)
    from ray_checkfreq.errors import StorageError

    with pytest.raises(StorageError, match="f.bin.*no space left on device"):
        posix.PosixBackend(str(tmp_path)).write("f.bin", [memoryview(PAGES)[:3 * BLOCK]])


def test_address_of_reads_only_and_empty_views():
    assert address_of(memoryview(PAGES)) % mmap.PAGESIZE == 0
    assert address_of(memoryview(PAGES)[BLOCK:]) == address_of(memoryview(PAGES)) + BLOCK
    assert address_of(memoryview(b"")) == 0
    assert address_of(memoryview(b"read-only")) > 0


def test_the_engines_host_buffers_of_large_tensors_start_on_a_page():
    from ray_checkfreq.engine.devices import CudaOps

    ops = CudaOps()
    large = ops.empty_host(torch.empty(LARGE_LEAF_BYTES // 4 + 1), pinned=False)
    assert large.data_ptr() % mmap.PAGESIZE == 0 and large.shape == (LARGE_LEAF_BYTES // 4 + 1,)
    large.fill_(2.0)
    assert float(large.sum()) == 2.0 * large.numel()


def test_a_single_process_checkpoint_writes_the_weights_in_place(tmp_path, monkeypatch):
    from ray_checkfreq import CheckFreq

    made = _records_writers(monkeypatch)
    model = torch.nn.Linear(512, 512)  # 1 MiB of weights, 2 MiB of Adam moments
    optimizer = torch.optim.Adam(model.parameters())
    cf = CheckFreq(model=model, optimizer=optimizer, storage=str(tmp_path), every=1, compress=False)
    cf.restore()
    loss = model(torch.randn(4, 512)).square().mean()
    loss.backward()
    optimizer.step()
    cf.step()
    cf.close()
    assert sum(writer.direct_bytes for writer in made) >= 3 * 512 * 512 * 4


def test_direct_io_false_writes_buffered_and_survives_pickling_and_a_new_writer(tmp_path, monkeypatch):
    import pickle

    made = _records_writers(monkeypatch)
    state = {"w": torch.randn(1 << 19)}  # 2 MiB: a shard that would go direct
    store = CheckpointStore(str(tmp_path), direct_io=False)
    for copy in (store, pickle.loads(pickle.dumps(store)), store.with_writer(7)):
        assert copy.config.direct_io is False and copy.backend.direct_io is False
    store.save(1, state, codec="raw")
    assert made == [] and torch.equal(store.load()["w"], state["w"])
    CheckpointStore(str(tmp_path / "on")).save(1, state, codec="raw")
    assert len(made) == 1
    with pytest.raises(ValueError, match="direct_io='yes'"):
        CheckpointStore(str(tmp_path), direct_io="yes")
