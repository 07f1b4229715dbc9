"""The NodeAgent's own logic, in process (its class is a plain class; Ray only wraps it)."""

from __future__ import annotations

import os

import pytest
import torch

from ray_checkfreq import CheckpointStore, FencedWriterError
from ray_checkfreq.ray import slots
from ray_checkfreq.ray.agent import NodeAgent


def write_snapshot(path: str, step: int, state: dict, generation: int = 1) -> slots.SlotHeader:
    """What a rank does: begin, copy into the views, seal."""
    layout = slots.slot_layout([((key,), tuple(t.shape), t.dtype) for key, t in state.items()])
    slot = slots.MappedSlot.open(path)
    try:
        views = slot.begin_write(step=step, generation=generation, layout=layout)
        for key, tensor in state.items():
            views[(key,)].copy_(tensor)
        return slot.finish_write({key: views[(key,)] for key in state})
    finally:
        slot.close()


@pytest.fixture
def agent(tmp_path):
    shm = tmp_path / "shm"
    shm.mkdir()
    node = NodeAgent("run1", "node-a", shm_dir=str(shm))
    yield node
    node._remove_all()


def test_a_complete_slot_is_committed_under_the_requested_generation(agent, tmp_path):
    state = {"w": torch.arange(1000, dtype=torch.float32), "b": torch.ones(3, dtype=torch.float64)}
    paths = agent.allocate(8192, 1 << 20)
    assert len(paths) == 2 and all(os.path.exists(p) for p in paths)
    header = write_snapshot(paths[0], 7, state)
    store = CheckpointStore(str(tmp_path / "ckpt"), codec="raw")
    generation = store.acquire_writer()
    done = agent.persist(paths[0], header.seq, store, generation)
    assert done["step"] == 7
    loaded = CheckpointStore(str(tmp_path / "ckpt")).load()
    assert all(torch.equal(loaded[k], v) for k, v in state.items())
    # A newer writer took the store: the agent's stale generation can no longer commit.
    CheckpointStore(str(tmp_path / "ckpt")).acquire_writer()
    header = write_snapshot(paths[1], 8, state)
    with pytest.raises(FencedWriterError):
        agent.persist(paths[1], header.seq, store, generation)


def test_a_slot_rewritten_since_the_request_is_refused(agent, tmp_path):
    state = {"w": torch.zeros(10)}
    path = agent.allocate(4096, 1 << 20)[0]
    old = write_snapshot(path, 3, state)
    write_snapshot(path, 4, state)
    store = CheckpointStore(str(tmp_path / "ckpt"))
    with pytest.raises(slots.SlotError, match="request was for"):
        agent.persist(path, old.seq, store, store.acquire_writer())
    assert store.list() == []


def test_outgrown_slots_are_removed_and_every_file_goes_at_the_end(agent):
    small = agent.allocate(4096, 1 << 20)
    assert agent.allocate(4096, 1 << 20) == small  # still fits: the same files
    large = agent.allocate(1 << 16, 1 << 20)
    assert set(large).isdisjoint(small)
    assert not any(os.path.exists(p) for p in small)
    assert [h["path"] for h in agent.slot_headers()] == large
    agent._remove_all()
    assert not any(os.path.exists(p) for p in large)


def test_a_persist_may_still_read_a_slot_outgrown_meanwhile(agent, tmp_path):
    state = {"w": torch.arange(64, dtype=torch.float32)}
    path = agent.allocate(4096, 1 << 20)[0]
    header = write_snapshot(path, 5, state)
    agent._in_flight = 4  # a persist is running: the outgrown files must stay
    agent.allocate(1 << 16, 1 << 20)
    assert os.path.exists(path)
    agent._in_flight = None
    store = CheckpointStore(str(tmp_path / "ckpt"))
    assert agent.persist(path, header.seq, store, store.acquire_writer())["step"] == 5
    assert not os.path.exists(path)  # removed once that persist ended


def test_a_slot_is_sent_packed_to_a_rank_on_another_node(agent):
    from ray_checkfreq.ray.transfer import unpack_state

    state = {"w": torch.arange(12, dtype=torch.float64), "n": torch.tensor([3], dtype=torch.int64)}
    path = agent.allocate(4096, 1 << 20)[0]
    header = write_snapshot(path, 9, state)
    back = unpack_state(agent.read_packed(path, header.seq))
    assert all(torch.equal(back[k], v) for k, v in state.items())
    write_snapshot(path, 10, state)  # rewritten since: the old request is refused
    with pytest.raises(slots.SlotError, match="request was for"):
        agent.read_packed(path, header.seq)


def test_forget_removes_the_slots_and_writers_and_the_agent_serves_again(agent, tmp_path):
    state = {"w": torch.arange(100, dtype=torch.float32)}
    paths = agent.allocate(4096, 1 << 20)
    header = write_snapshot(paths[0], 5, state)
    store = CheckpointStore(str(tmp_path / "ckpt"), codec="raw")
    agent.persist(paths[0], header.seq, store, store.acquire_writer())
    agent.forget()
    assert agent.slot_headers() == [] and not any(os.path.exists(p) for p in paths)
    assert agent._stores == {}
    fresh = agent.allocate(4096, 1 << 20)
    assert set(fresh).isdisjoint(paths) and all(os.path.exists(p) for p in fresh)
    assert [h["step"] for h in agent.slot_headers()] == [-1, -1]  # nothing of before is restorable
