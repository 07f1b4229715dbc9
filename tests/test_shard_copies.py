"""RAM copies of sharded runs without Ray: the restart's choice (pure), the peer ring, the
agent's slots per rank and peer copies (in process), and the sealer with a fake agent."""

from __future__ import annotations

import types

import numpy as np
import pytest
import ray
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ray_checkfreq.engine.sharded_restore import SHARDING_KEY
from ray_checkfreq.engine.snapshot import CopyHandle, Snapshot
from ray_checkfreq.engine.state import ChunkPlace
from ray_checkfreq.ray import shard_copies, slots
from ray_checkfreq.ray.agent import NodeAgent
from ray_checkfreq.ray.shard_copies import ShardSealer, choose_shard_sources, peer_node

RUN = "run1"


def slot(owner, step, gen=1, *, state=slots.SLOT_COMPLETE, run=RUN, world=2, path="/dev/shm/s") -> dict:
    return {"owner": owner, "step": step, "generation": gen, "state": state, "run": run, "world_size": world,
            "path": path, "seq": 1}


def peer(owner, step, gen=1, *, run=RUN, world=2) -> dict:
    return {"owner": owner, "step": step, "generation": gen, "run": run, "world_size": world}


def choose(committed, slot_headers, peer_headers=None, *, world=2, nodes=("a", "b")):
    return choose_shard_sources(committed_step=committed, slot_headers=slot_headers, peer_headers=peer_headers or {},
                                run=RUN, world_size=world, rank_nodes=list(nodes))


def chosen(result) -> tuple[int, set[int]]:
    step, sources = result
    return step, {s.generation for s in sources}


# ------------------------------------------------------------------ the choice (pure)
def test_the_newest_step_every_rank_holds_wins_and_a_step_missing_a_rank_does_not():
    both = {"a": [slot(0, 20), slot(0, 10)], "b": [slot(1, 20), slot(1, 10)]}
    step, sources = choose(None, both)
    assert step == 20 and [(s.owner, s.node_id) for s in sources] == [(0, "a"), (1, "b")]
    assert choose(None, {**both, "a": [slot(0, 30), *both["a"]]})[0] == 20  # rank 1 has no 30
    assert choose(None, both, {"a": [peer(1, 30)], "b": [peer(0, 30)]})[0] == 30  # peer copies count


def test_a_step_split_over_two_generations_is_not_complete():
    headers = {"a": [slot(0, 30, gen=2), slot(0, 20)], "b": [slot(1, 30, gen=1), slot(1, 20)]}
    assert chosen(choose(None, headers)) == (20, {1})
    headers["b"].append(slot(1, 30, gen=2))
    assert chosen(choose(None, headers)) == (30, {2})


def test_copies_saved_at_another_world_size_are_ignored():
    headers = {"a": [slot(0, 20, world=4), slot(1, 20, world=4)], "b": [slot(2, 20, world=4)]}
    assert choose(None, headers, {"b": [peer(3, 20, world=4)]}, world=2) is None  # elastic: read storage
    assert choose(None, headers, {"b": [peer(3, 20, world=2)]}, world=4) is None
    assert choose(None, headers, {"b": [peer(3, 20, world=4)]}, world=4, nodes="aabb")[0] == 20


def test_ram_at_the_committed_step_wins_the_tie_and_older_ram_is_not_chosen():
    headers = {"a": [slot(0, 20)], "b": [slot(1, 20)]}
    assert choose(20, headers)[0] == 20
    assert choose(24, headers) is None


@pytest.mark.parametrize("bad", [slot(1, 40, state=slots.SLOT_WRITING), slot(1, 40, run="other"),
                                 slot(None, 40, world=None)], ids=["torn", "foreign", "replica"])
def test_torn_foreign_and_replica_slots_are_never_chosen(bad):
    headers = {"a": [slot(0, 40), slot(0, 20)], "b": [bad, slot(1, 20)]}
    assert choose(None, headers)[0] == 20


def test_a_foreign_peer_copy_is_never_chosen():
    assert choose(None, {"a": [slot(0, 40)]}, {"a": [peer(1, 40, run="other")]}) is None


def test_each_rank_prefers_its_node_then_a_slot_over_a_peer_copy():
    # Rank 0 runs on node "a" now; rank 1's only copy is a peer copy on "c".
    offers = [("a", "slot"), ("a", "peer"), ("b", "slot"), ("b", "peer")]
    while offers:
        slot_headers = {n: [slot(0, 20, path=f"{n}-0")] for n, kind in offers if kind == "slot"}
        peer_headers = {n: [peer(0, 20)] for n, kind in offers if kind == "peer"}
        peer_headers.setdefault("c", []).append(peer(1, 20))
        _, sources = choose(None, slot_headers, peer_headers)
        assert (sources[0].node_id, sources[0].kind) == offers[0]
        assert (sources[1].node_id, sources[1].kind) == ("c", "peer")
        offers.pop(0)


NODES = ("a", "b", "c")
FLAWS = (None,) * 5 + ("torn", "foreign", "world")
entries_st = st.lists(st.tuples(st.sampled_from(("slot", "peer")), st.sampled_from(NODES),
                                st.sampled_from((0, 1, 2, None)), st.integers(0, 2), st.integers(1, 2),
                                st.sampled_from(FLAWS)), min_size=24, max_size=40)


@settings(max_examples=100, deadline=None)
@given(entries_st, st.one_of(st.none(), st.integers(0, 2)), st.lists(st.sampled_from(NODES), min_size=3, max_size=3))
def test_the_choice_matches_a_brute_force_oracle(entries, committed, rank_nodes):
    slot_headers: dict = {n: [] for n in NODES}
    peer_headers: dict = {n: [] for n in NODES}
    held: dict = {}  # (step, generation) -> {rank: [(node, kind)]}, only what may be chosen
    for kind, node, owner, step, gen, flaw in entries:
        run, world = ("other" if flaw == "foreign" else RUN), (2 if flaw == "world" or owner is None else 3)
        if kind == "slot":
            state = slots.SLOT_WRITING if flaw == "torn" else slots.SLOT_COMPLETE
            slot_headers[node].append(slot(owner, step, gen, state=state, run=run, world=world))
        elif owner is not None:  # a peer copy is always of a rank
            peer_headers[node].append(peer(owner, step, gen, run=run, world=world))
        if owner is not None and (flaw is None or (kind, flaw) == ("peer", "torn")):
            held.setdefault((step, gen), {}).setdefault(owner, []).append((node, kind))
    complete = [key for key, ranks in held.items() if set(ranks) == {0, 1, 2}
                and (committed is None or key[0] >= committed)]
    result = choose(committed, slot_headers, peer_headers, world=3, nodes=rank_nodes)
    if not complete:
        assert result is None
        return
    step, sources = result
    assert {(s.step, s.generation) for s in sources} == {max(complete)} and step == max(complete)[0]
    for rank, source in enumerate(sources):
        assert source.owner == rank and (source.node_id, source.kind) in held[max(complete)][rank]
        if (rank_nodes[rank], "slot") in held[max(complete)][rank]:
            assert (source.node_id, source.kind) == (rank_nodes[rank], "slot")


# ------------------------------------------------------------------ the ring of peers
def test_peer_node_follows_the_ring_of_the_runs_nodes():
    assert [peer_node("abc", n) for n in "abc"] == ["b", "c", "a"]
    assert [peer_node(["a", "a", "b", "b", "c"], n) for n in "abc"] == ["b", "c", "a"]  # ranks per node
    assert peer_node(["a", "a"], "a") is None and peer_node("ab", "z") is None


# ------------------------------------------------------------------ the agent, in process
@pytest.fixture
def agent(tmp_path):
    shm = tmp_path / "shm"
    shm.mkdir()
    node = NodeAgent(RUN, "node-a", shm_dir=str(shm))
    yield node
    node._remove_all()


def _held(boxed: list) -> np.ndarray:
    """The data a peer copy hands out: an object in Ray's store where this process runs Ray
    (the suite's shared cluster), else the agent's private array."""
    import ray

    return ray.get(boxed[0]) if isinstance(boxed[0], ray.ObjectRef) else boxed[0]


def info(owner: int, step: int, gen: int = 1) -> dict:
    return {"run": RUN, "owner": owner, "world_size": 2, "step": step, "generation": gen}


def test_the_agent_keeps_the_two_newest_peer_copies_per_rank_and_replaces_a_step(agent):
    for step in (10, 20, 30):
        agent.keep_peer_copy(info(1, step), b"", np.full(4, step, dtype=np.uint8))
    agent.keep_peer_copy(info(0, 10), b"", np.zeros(4, dtype=np.uint8))
    agent.keep_peer_copy(info(1, 30, gen=2), b"", np.full(4, 31, dtype=np.uint8))
    assert sorted((h["owner"], h["step"], h["generation"]) for h in agent.peer_headers()) == \
        [(0, 10, 1), (1, 20, 1), (1, 30, 2)]
    assert _held(agent.read_peer(1, 30, 2)[1]).tolist() == [31] * 4
    with pytest.raises(slots.SlotError, match="step 10"):
        agent.read_peer(1, 10, 1)
    with pytest.raises(slots.SlotError, match="step 30 .generation 1"):
        agent.read_peer(1, 30, 1)


def test_a_peer_copy_is_private_to_the_agent(agent):
    packed = np.arange(8, dtype=np.uint8)
    agent.keep_peer_copy(info(1, 20), b"meta", packed)
    packed[:] = 0
    meta, data, _ = agent.read_peer(1, 20, 1)
    assert meta == b"meta" and _held(data).tolist() == list(range(8))


def test_under_ray_a_peer_copy_is_an_object_of_the_agents_own_handed_out_by_reference(agent, ray_session):
    sent = np.arange(16, dtype=np.uint8)
    agent.keep_peer_copy(info(1, 20), b"meta", sent)
    sent[:] = 0  # the sender's buffer is reused: the copy is not
    _, boxed, _ = agent.read_peer(1, 20, 1)
    assert isinstance(boxed[0], ray_session.ObjectRef)  # no copy of the bytes in the read
    assert ray_session.get(boxed[0]).tolist() == list(range(16))


def test_a_peer_copy_travels_as_the_slots_regions_and_is_checked_where_it_is_restored(agent):
    from ray_checkfreq.ray.shard_copies import verified

    [path, _] = agent.allocate(4096, 1 << 20, 1, 2)
    with slots.MappedSlot.open(path) as target:
        layout = slots.slot_layout([(("model", "w"), (64,), torch.float64)])
        views = target.begin_write(step=20, generation=1, layout=layout)
        views[("model", "w")].copy_(torch.arange(64, dtype=torch.float64))
        target.finish_write({"model": {"w": views[("model", "w")]}, "step": torch.tensor(3)})
        _, crcs = target.read_with_checksums()[::2]
        header, meta, data = target.regions()
        agent.keep_peer_copy({**info(1, 20), "leaf_crc32": crcs}, meta, data)
        del data
    assert header.data_bytes == 64 * 8 and "leaf_crc32" not in agent.peer_headers()[0]
    meta, boxed, sent = agent.read_peer(1, 20, 1)
    kept = _held(boxed)
    assert sent == crcs
    state, _ = slots.decode_copy(meta, kept, "copy")
    assert torch.equal(verified(state, sent, "copy")["model"]["w"], torch.arange(64, dtype=torch.float64))
    assert int(state["step"]) == 3
    damaged = kept.copy()
    damaged[8] ^= 1  # a byte of the weights
    with pytest.raises(slots.SlotError, match="copy: data crc32 mismatch in leaf #0"):
        verified(slots.decode_copy(meta, damaged, "copy")[0], sent, "copy")
    with pytest.raises(slots.SlotError, match="copy: bad meta region"):
        slots.decode_copy(meta[:-8] + bytes(8), kept, "copy")


def test_each_rank_and_the_replica_get_slot_files_of_their_own(agent):
    owned = {owner: agent.allocate(4096, 1 << 20, owner, None if owner is None else 2) for owner in (0, 1, None)}
    assert len({p for paths in owned.values() for p in paths}) == 6
    assert agent.allocate(4096, 1 << 20, 0, 2) == owned[0]  # still fits: the same files
    headers = {h["path"]: (h["owner"], h["world_size"]) for h in agent.slot_headers()}
    assert headers == {p: (owner, None if owner is None else 2) for owner, paths in owned.items() for p in paths}
    for rank in (0, 1):
        with slots.MappedSlot.open(owned[rank][0]) as target:
            target.finish_write(begin(target, step=12, rank=rank))
    step, sources = choose(None, {"node-a": agent.slot_headers()}, nodes=["node-a"] * 2)
    assert step == 12 and [s.path for s in sources] == [owned[0][0], owned[1][0]]



def test_after_a_generations_first_commit_the_agent_frees_what_no_restart_can_choose(agent):
    """Rank 0 left this node (its slots hold generation 1 only), rank 2 left too but sealed
    generation 2 here (kept), rank 1 is here now, and the replica is not a rank's: only rank
    0's slots and the generation-1 peer copy go, files and all."""
    import os

    owned = {owner: agent.allocate(4096, 1 << 20, owner, None if owner is None else 3) for owner in (0, 1, 2, None)}
    for owner, generation in ((0, 1), (1, 1), (2, 2)):
        with slots.MappedSlot.open(owned[owner][0]) as target:
            target.finish_write(begin(target, step=9, rank=owner, generation=generation))
    agent.keep_peer_copy(info(0, 9, gen=1), b"", np.zeros(8, dtype=np.uint8))
    agent.keep_peer_copy(info(2, 12, gen=2), b"", np.zeros(8, dtype=np.uint8))
    size = sum(os.path.getsize(path) for path in owned[0])
    assert agent.release_stale(2, [1]) == {"slots": 2, "peer_copies": 1, "bytes": size + 8}
    assert not any(os.path.exists(path) for path in owned[0])
    assert {h["owner"] for h in agent.slot_headers()} == {1, 2, None}
    assert [(h["owner"], h["generation"]) for h in agent.peer_headers()] == [(2, 2)]
    assert agent.release_stale(2, [1]) == {"slots": 0, "peer_copies": 0, "bytes": 0}

def begin(target: slots.MappedSlot, *, step: int, rank: int, generation: int = 1) -> dict:
    layout = slots.slot_layout([(("model", "w"), (4,), torch.float32)])
    views = target.begin_write(step=step, generation=generation, layout=layout)
    views[("model", "w")].fill_(rank + 0.5)
    return {"model": {"w": views[("model", "w")]}}


# ------------------------------------------------------------------ the sealer, with a fake agent
@pytest.fixture
def fake_ray(monkeypatch):
    def get(ref, timeout=None):
        if ref.error is not None:
            raise ref.error
        return ref.result

    def wait(refs, timeout=None):
        return [r for r in refs if r.done], [r for r in refs if not r.done]

    fake = types.SimpleNamespace(wait=wait, get=get, exceptions=ray.exceptions)
    monkeypatch.setattr(shard_copies, "ray", fake)


@pytest.fixture
def sealing(agent, fake_ray):
    """Makes a sealing rank 1 (of 2) over a real slot of its own in ``agent``."""
    made: list[Sealing] = []
    yield lambda peer_handle="peer-agent": made.append(Sealing(agent, peer_handle)) or made[-1]
    for rank in made:
        rank.slot.close()


class Sealing:
    """A rank's sealer over a real slot, a fake agent that records replicate calls, a fake peer lookup."""

    def __init__(self, agent: NodeAgent, peer_handle: object | None) -> None:
        self.slot = slots.MappedSlot.open(agent.allocate(4096, 1 << 20, 1, 2)[0])
        self.sent: list[tuple] = []
        self.refs: list[types.SimpleNamespace] = []
        self.lookups: list[bool] = []
        replicate = types.SimpleNamespace(remote=self._replicate)
        self.sealer = ShardSealer(rank=1, world_size=2, agent=lambda: types.SimpleNamespace(replicate=replicate),
                                  peer=lambda refresh: self.lookups.append(refresh) or peer_handle)

    def _replicate(self, *args) -> types.SimpleNamespace:
        self.sent.append(args)
        self.refs.append(types.SimpleNamespace(done=False, result={"seconds": 0.25}, error=None))
        return self.refs[-1]

    def seal(self, step: int) -> None:
        state = begin(self.slot, step=step, rank=1)
        places = {("model", "w"): ChunkPlace(name="model.w", global_shape=(8,), offsets=(4,), owner=True)}
        self.sealer(Snapshot(step=step, state=state, epoch_boundary=True, copies=CopyHandle(), size_bytes=16,
                             memory=self.slot, places=places))


def test_a_seal_while_a_copy_travels_is_skipped_and_the_sealed_slot_carries_its_sharding(sealing):
    rank = sealing()
    rank.seal(10)
    rank.seal(12)  # the copy of 10 is still on its way
    assert len(rank.sent) == 1 and rank.sealer.counts == {"sent": 0, "skipped": 1, "failed": 0}
    assert rank.sealer.stats()["in_flight"]
    rank.refs[0].done = True
    rank.seal(14)
    assert rank.sealer.counts == {"sent": 1, "skipped": 1, "failed": 0} and rank.sealer.last_copy_s == 0.25
    assert rank.sent[1] == (rank.slot.path, 3, 1, "peer-agent")
    header, state = rank.slot.read(copy=True)
    assert (header.step, header.state, state["model"]["w"].tolist()) == (14, slots.SLOT_COMPLETE, [1.5] * 4)
    assert state[SHARDING_KEY] == {"rank": 1, "world_size": 2, "epoch_boundary": True,
                                  "offsets": {"model.w": [4]}}


def test_a_failed_copy_is_counted_and_the_next_send_looks_the_peer_up_again(sealing):
    rank = sealing()
    rank.seal(10)
    rank.refs[0].done, rank.refs[0].error = True, ray.exceptions.RayError("peer agent died")
    rank.seal(12)
    rank.refs[1].done = True
    rank.seal(14)
    assert rank.sealer.counts == {"sent": 1, "skipped": 0, "failed": 1}
    assert rank.lookups == [False, True, False] and len(rank.sent) == 3


def test_without_a_peer_nothing_is_sent(sealing):
    rank = sealing(None)
    rank.seal(10)
    rank.seal(12)
    assert rank.sent == [] and rank.sealer.counts == {"sent": 0, "skipped": 0, "failed": 0}
    assert rank.slot.read()[0].step == 12
