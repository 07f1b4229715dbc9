"""The restart choice (pure) and the per-iteration decision broadcast (2 gloo processes, no Ray)."""

from __future__ import annotations

import os
import socket

import pytest
import torch.multiprocessing as mp

from ray_checkfreq.engine.seams import Action
from ray_checkfreq.ray.restart import RestoreChoice, choose_source
from ray_checkfreq.ray.slots import SLOT_COMPLETE, SLOT_WRITING

RUN = "run1"


def header(step: int, *, state: int = SLOT_COMPLETE, crc: int = 7, run: str = RUN, seq: int = 1,
           path: str = "/dev/shm/x") -> dict:
    return {"step": step, "state": state, "data_crc32": crc, "run": run, "seq": seq, "path": path}


def choose(committed, slots, reachable=("a", "b"), prefer="a") -> RestoreChoice:
    return choose_source(committed_step=committed, slot_headers=slots, run=RUN, reachable_nodes=set(reachable),
                         prefer_node=prefer)


def test_a_slot_newer_than_the_commit_wins_and_must_be_persisted():
    choice = choose(16, {"a": [header(20, path="A"), header(12)], "b": []})
    assert (choice.kind, choice.step, choice.node_id, choice.path, choice.needs_persist) == ("slot", 20, "a", "A", True)
    assert choice.committed_step == 16


def test_a_slot_of_the_committed_step_wins_without_a_persist():
    choice = choose(20, {"a": [header(20)]})
    assert (choice.kind, choice.needs_persist) == ("slot", False)


def test_storage_wins_over_older_slots_and_none_means_a_fresh_start():
    assert choose(24, {"a": [header(20)]}).kind == "storage"
    assert choose(None, {}).kind == "none"
    assert choose(None, {"a": [header(4)]}).kind == "slot"


def test_torn_foreign_and_unreachable_slots_are_never_chosen():
    slots = {"a": [header(28, state=SLOT_WRITING), header(30, run="other")], "c": [header(32)]}
    choice = choose(16, slots, reachable=("a", "b"))
    assert (choice.kind, choice.step) == ("storage", 16)


def test_replicas_that_disagree_on_their_checksum_are_ignored():
    choice = choose(16, {"a": [header(20, crc=1), header(18)], "b": [header(20, crc=2)]})
    assert (choice.kind, choice.step, choice.node_id) == ("slot", 18, "a")


def test_ties_between_nodes_prefer_the_given_node():
    slots = {"a": [header(20, path="A")], "b": [header(20, path="B")]}
    assert choose(16, slots, prefer="b").path == "B"
    assert choose(16, slots, prefer="a").path == "A"


def test_a_bad_kind_is_refused():
    with pytest.raises(ValueError, match="kind"):
        RestoreChoice(kind="ram")


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _rank_main(rank: int, port: int, plans: list, out: dict) -> None:
    import torch.distributed as dist

    from ray_checkfreq.ray.decisions import BroadcastDecisions

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    channel = BroadcastDecisions(dist.new_group(backend="gloo"), rank)
    applied = []
    for iteration, planned in enumerate(plans, start=1):
        action = channel.exchange(planned if rank == 0 else None)
        applied.append((iteration, action))
    channel.close()
    out[rank] = applied
    dist.destroy_process_group()


def test_every_rank_applies_rank0s_plan_one_iteration_later():
    plans = [Action(iteration=i + 1, checkpoint=i % 3 == 0, k=3 + i // 4) if i % 2 == 0 else None
             for i in range(1, 12)]
    with mp.Manager() as manager:
        out = manager.dict()
        port = _free_port()
        mp.start_processes(_rank_main, args=(port, plans, out), nprocs=2, start_method="spawn", join=True)
        by_rank = dict(out)
    assert by_rank[0] == by_rank[1]
    for (iteration, action), planned in zip(by_rank[0], [None, *plans]):
        assert action == planned
        assert action is None or action.iteration == iteration
    os.environ.pop("MASTER_ADDR", None)
