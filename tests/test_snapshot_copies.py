"""The device side of a snapshot, on the CPU: a fake ``DeviceOps`` plays two accelerators.

Fake device tensors are CPU tensors the fake says live on "dev0" / "dev1"; its copies are
deferred until something waits for them, as on a GPU. ``CudaOps`` itself is checked
against a mock ``torch.cuda``.
"""

from __future__ import annotations

import os
import threading
from collections import Counter
from unittest import mock

import pytest
import torch
from state_strategies import assert_same_state

from ray_checkfreq import CheckFreq, CheckpointStore
from ray_checkfreq.chaos import CountingOptimizer, torn_iterations
from ray_checkfreq.engine.devices import CudaOps
from ray_checkfreq.engine.snapshot import CopyHandle, Snapshotter
from ray_checkfreq.engine.threads import BACKGROUND_NICE
from ray_checkfreq.storage.tree import leaves_of


class FakeEvent:
    def __init__(self, kind: str, device, pairs=(), after=()) -> None:
        self.kind, self.device, self.pairs, self.after = kind, device, list(pairs), list(after)
        self.done = False
        self._lock = threading.Lock()

    def run(self) -> None:
        with self._lock:  # the fence (training thread) and the persist thread may both wait
            if self.done:
                return
            for event in self.after:
                event.run()
            for src, dst in self.pairs:
                dst.copy_(src)
            self.done = True


class FakeOps:
    """Two fake accelerators; counts device-to-host copies per destination buffer."""

    def __init__(self) -> None:
        self.where: dict[int, str] = {}
        self.pinned: set[int] = set()
        self.log: list[tuple] = []
        self.to_host: Counter = Counter()

    def put(self, tensor: torch.Tensor, device: str) -> torch.Tensor:
        self.where[_storage(tensor)] = device
        return tensor

    def device_of(self, tensor):
        return self.where.get(_storage(tensor))

    def empty_host(self, like, *, pinned):
        tensor = torch.empty(like.shape, dtype=like.dtype)
        self.where.pop(_storage(tensor), None)  # an address freed by a fake device tensor
        if pinned:
            self.pinned.add(_storage(tensor))
        return tensor

    def empty_device(self, like, device):
        return self.put(torch.empty(like.shape, dtype=like.dtype), device)

    def mark(self, device):
        event = FakeEvent("mark", device)
        self.log.append(("mark", device, event))
        return event

    def copy(self, device, pairs, after):
        for src, dst in pairs:
            assert device in (self.device_of(src), self.device_of(dst)), "copied on another device's stream"
            if self.device_of(src) is not None and self.device_of(dst) is None:
                self.to_host[_storage(dst)] += 1
        event = FakeEvent("copy", device, pairs, after)
        self.log.append(("copy", device, event))
        return event

    def fence(self, device, event):
        self.log.append(("fence", device, event))
        event.run()

    def synchronize(self, event):
        event.run()

    def entries(self, kind):
        return [entry for entry in self.log if entry[0] == kind]


def _storage(tensor: torch.Tensor) -> int:
    return tensor.untyped_storage().data_ptr()


def _two_device_state(ops: FakeOps, offset: float = 0.0) -> dict:
    return {
        "params": {"w0": ops.put(torch.full((4,), 1.0 + offset), "dev0"),
                   "w1": ops.put(torch.full((4,), 2.0 + offset), "dev1")},
        "optimizer": {"state": {0: {"m": ops.put(torch.full((4,), 3.0 + offset), "dev1")}}},
        "buffers": {"bn": ops.put(torch.full((2,), 4.0 + offset), "dev0"), "host": torch.full((2,), 5.0 + offset)},
    }


ASYNC = {"params", "optimizer"}


@pytest.mark.parametrize("mode", ["cpu", "gpu"])
def test_every_device_holding_state_is_fenced_on_its_own_copy_event(mode):
    ops = FakeOps()
    snapshotter = Snapshotter(mode, ops=ops)
    snapshot = snapshotter.take(1, _two_device_state(ops), ASYNC)
    copies = {device: event for _, device, event in ops.entries("copy")}
    assert set(copies) == {"dev0", "dev1"}
    snapshot.copies.fence()
    assert {(device, id(event)) for _, device, event in ops.entries("fence")} == {
        (device, id(event)) for device, event in copies.items()}
    snapshotter.close()


@pytest.mark.parametrize("mode", ["cpu", "gpu"])
def test_copies_start_after_the_work_queued_on_their_device(mode):
    ops = FakeOps()
    snapshotter = Snapshotter(mode, ops=ops)
    snapshotter.take(1, _two_device_state(ops), ASYNC)
    marks = {device: event for _, device, event in ops.entries("mark")}
    for _, device, event in ops.entries("copy"):
        assert event.after == [marks[device]]
    snapshotter.close()


def test_a_gpu_snapshot_goes_to_the_host_once_per_leaf_into_reused_pinned_buffers():
    ops = FakeOps()
    snapshotter = Snapshotter("gpu", ops=ops)
    pointers = []
    for step, offset in ((1, 0.0), (2, 10.0)):
        live = _two_device_state(ops, offset)
        snapshot = snapshotter.take(step, live, ASYNC)
        assert sum(ops.to_host.values()) == 4 * (step - 1)  # nothing moves to the host before persist
        snapshot.copies.wait()
        snapshot.copies.wait()  # the profiling window persists one snapshot twice
        found = leaves_of(snapshot.state)
        leaves = [leaf for _, _, leaf in found]
        assert all(ops.device_of(leaf) is None for leaf in leaves), "the encoder must read host buffers"
        device_leaves = [leaf for path, _, leaf in found if path != ("buffers", "host")]
        assert len(device_leaves) == 4 and {_storage(leaf) for leaf in device_leaves} <= ops.pinned
        assert all(ops.to_host[_storage(leaf)] == step for leaf in device_leaves)
        pointers.append(sorted(_storage(leaf) for leaf in leaves))
        assert_same_state(live, snapshot.state)
    assert pointers[0] == pointers[1], "buffers are reused from one snapshot to the next"
    assert sum(ops.to_host.values()) == 2 * 4
    snapshotter.close()


def test_moving_to_the_host_waits_for_the_snapshot_copy_of_its_device():
    ops = FakeOps()
    snapshotter = Snapshotter("gpu", ops=ops)
    snapshot = snapshotter.take(1, _two_device_state(ops), ASYNC)
    snapshot_copies = {device: event for _, device, event in ops.entries("copy")}
    snapshot.copies.wait()
    staging = ops.entries("copy")[len(snapshot_copies):]
    assert {device for _, device, _ in staging} == {"dev0", "dev1"}
    for _, device, event in staging:
        assert event.after == [snapshot_copies[device]]
    snapshotter.close()


def test_a_cpu_snapshot_copies_device_leaves_once_into_pinned_buffers():
    ops = FakeOps()
    snapshotter = Snapshotter("cpu", ops=ops)
    snapshot = snapshotter.take(1, _two_device_state(ops), ASYNC)
    snapshot.copies.wait()
    async_leaves = [snapshot.state["params"]["w0"], snapshot.state["params"]["w1"],
                    snapshot.state["optimizer"]["state"][0]["m"]]
    assert [ops.to_host[_storage(leaf)] for leaf in async_leaves] == [1, 1, 1]
    assert {_storage(leaf) for leaf in async_leaves} <= ops.pinned
    assert _storage(snapshot.state["buffers"]["host"]) not in ops.pinned
    again = snapshotter.take(2, _two_device_state(ops, 10.0), ASYNC)
    again.copies.wait()
    assert [_storage(leaf) for _, _, leaf in leaves_of(again.state)] == [
        _storage(leaf) for _, _, leaf in leaves_of(snapshot.state)], "buffers are reused"
    assert_same_state(_two_device_state(FakeOps(), 10.0), again.state)
    snapshotter.close()


@pytest.mark.parametrize("mode", ["cpu", "gpu"])
def test_checkfreq_on_two_fake_devices_never_tears_and_persists_host_buffers(tmp_path, mode):
    ops = FakeOps()
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 8))
    for index, param in enumerate(model.parameters()):
        ops.put(param, f"dev{index % 2}")
    opt = CountingOptimizer(model.parameters())
    store = CheckpointStore(str(tmp_path), keep_last=100, codec="raw")
    cf = CheckFreq(model=model, optimizer=opt, storage=store, every=2)
    cf._snapshotter.close()
    cf._snapshotter = Snapshotter(mode, ops=ops)
    cf.restore()
    for _ in range(3):  # optimizer state appears at the first step: register it as on-device too
        opt.step()
        for index, state in enumerate(opt.state.values()):
            ops.put(state["count"], f"dev{index % 2}")
        cf.step()
    for _ in range(9):
        opt.step()
        cf.step()
    cf.close()
    assert len(store.list()) == 6 and torn_iterations(store) == []
    fenced = {device for _, device, _ in ops.entries("fence")}
    assert fenced == {"dev0", "dev1"}
    if mode == "gpu":
        assert sum(ops.to_host.values()) == 8 * 6  # 4 parameters + 4 optimizer tensors, 6 checkpoints


# ------------------------------------------------------------------ CudaOps on a mock torch.cuda
def _mock_cuda():
    cuda = mock.MagicMock(name="torch.cuda")
    cuda.Stream.priority_range.return_value = (3, -5)  # not 0: the test sees which one is used
    cuda.Stream.side_effect = lambda device, priority: mock.MagicMock(name=f"stream-{device}", priority=priority)
    return cuda


def test_cuda_copies_run_on_one_lowest_priority_stream_per_device_and_record_their_sources():
    cuda = _mock_cuda()
    ops = CudaOps(cuda)
    src = mock.MagicMock(is_cuda=True)
    dst = mock.MagicMock(is_cuda=False)
    before = mock.sentinel.before
    done = ops.copy("cuda:1", [(src, dst)], after=[before])
    stream = ops.copy_stream("cuda:1")
    assert ops.copy_stream("cuda:1") is stream and ops.copy_stream("cuda:0") is not stream
    cuda.Stream.assert_any_call(device="cuda:1", priority=3)
    stream.wait_event.assert_called_once_with(before)
    cuda.stream.assert_called_once_with(stream)
    dst.copy_.assert_called_once_with(src, non_blocking=True)
    src.record_stream.assert_called_once_with(stream)
    dst.record_stream.assert_not_called()
    done.record.assert_called_once_with(stream)


def test_cuda_fence_and_mark_use_each_devices_current_stream():
    cuda = _mock_cuda()
    ops = CudaOps(cuda)
    event = mock.sentinel.event
    ops.fence("cuda:1", event)
    cuda.current_stream.assert_called_with("cuda:1")
    cuda.current_stream.return_value.wait_event.assert_called_once_with(event)
    mark = ops.mark("cuda:0")
    cuda.current_stream.assert_called_with("cuda:0")
    mark.record.assert_called_once_with(cuda.current_stream.return_value)


class _PriorityProbe:
    """A copy target that records the nice value of the thread copying into it."""

    def __init__(self) -> None:
        self.seen: list[int] = []

    def copy_(self, src: torch.Tensor) -> None:
        self.seen.append(os.getpriority(os.PRIO_PROCESS, threading.get_native_id()))


def test_the_host_copy_thread_runs_below_trainings_cpu_priority():
    snapshotter = Snapshotter("cpu")
    probe, handle = _PriorityProbe(), CopyHandle()
    try:
        snapshotter._host.submit([(torch.zeros(1), probe)], handle)
        handle.fence()
        assert probe.seen == [min(19, os.getpriority(os.PRIO_PROCESS, 0) + BACKGROUND_NICE)]
    finally:
        snapshotter.close()
