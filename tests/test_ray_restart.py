"""The restart choice (pure) and the per-iteration decision broadcast (2 gloo processes, no Ray)."""

from __future__ import annotations

import json
import os
import socket
from typing import Any

import pytest
import torch
import torch.multiprocessing as mp

from ray_checkfreq.engine.seams import Action
from ray_checkfreq.ray import restart
from ray_checkfreq.ray.restart import RestartProtocol, RestoreChoice, choose_source
from ray_checkfreq.ray.slots import SLOT_COMPLETE, SLOT_WRITING
from ray_checkfreq.storage import CheckpointStore
from ray_checkfreq.storage.backends.posix import PosixBackend

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


def test_torn_and_foreign_slots_are_never_chosen():
    slots = {"a": [header(28, state=SLOT_WRITING), header(30, run="other")], "b": [header(12)]}
    choice = choose(16, slots, reachable=("a", "b"))
    assert (choice.kind, choice.step) == ("storage", 16)


def test_a_slot_on_a_node_without_a_rank_comes_through_its_agent():
    choice = choose(16, {"c": [header(20, path="C")], "a": [header(18)]}, reachable=("a", "b"))
    assert (choice.kind, choice.step, choice.node_id, choice.via_agent) == ("slot", 20, "c", True)
    both = choose(16, {"c": [header(20, path="C")], "b": [header(20, path="B")]}, reachable=("a", "b"))
    assert (both.node_id, both.via_agent) == ("b", False)  # a node with a rank wins the tie


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
    import numpy as np
    import torch
    import torch.distributed as dist

    from ray_checkfreq.ray.decisions import BroadcastDecisions
    from ray_checkfreq.ray.transfer import all_gather_state, broadcast_json, broadcast_state

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    channel = BroadcastDecisions(dist.new_group(backend="gloo"), rank)
    applied = []
    for iteration, planned in enumerate(plans, start=1):
        action = channel.exchange(planned if rank == 0 else None)
        applied.append((iteration, action))
    channel.close()
    out[rank] = applied
    group = dist.new_group(backend="gloo")
    mine = {"rank": rank, "t": torch.full((3,), float(rank)), "rng": (np.arange(rank + 2), 1.5, None)}
    gathered = all_gather_state(mine, world_size=2, group=group)
    sent = broadcast_state(mine if rank == 1 else None, src=1, rank=rank, world_size=2, group=group)
    out[f"gathered{rank}"] = [(g["rank"], g["t"].tolist(), g["rng"][0].tolist(), g["rng"][1:]) for g in gathered]
    out[f"sent{rank}"] = (sent["rank"], sent["t"].tolist(), sent["rng"][0].tolist())
    out[f"json{rank}"] = broadcast_json({"kind": "slot", "step": 20} if rank == 0 else None, src=0, rank=rank,
                                        group=group)
    dist.destroy_process_group()


def test_a_packed_state_round_trips_without_pickle():
    import numpy as np
    import torch

    from ray_checkfreq.ray.transfer import pack_state, unpack_state

    state = {"model": {"w": torch.arange(6, dtype=torch.bfloat16).reshape(2, 3)}, "n": [1, "x", None, 2.5],
             "np": np.arange(5, dtype=np.uint32), "empty": torch.zeros(0)}
    packed = pack_state(state)
    header_length = int.from_bytes(packed[:8].tobytes(), "little")
    assert set(json.loads(packed[8:8 + header_length].tobytes())) == {"skeleton", "offsets", "specs"}
    back = unpack_state(packed)
    assert torch.equal(back["model"]["w"], state["model"]["w"]) and back["model"]["w"].dtype == torch.bfloat16
    assert back["n"] == [1, "x", None, 2.5] and np.array_equal(back["np"], state["np"])
    assert back["empty"].shape == (0,)


def test_every_rank_applies_rank0s_plan_one_iteration_later():
    plans = [Action(iteration=i + 1, checkpoint=i % 3 == 0, k=3 + i // 4) if i % 2 == 0 else None
             for i in range(1, 12)]
    with mp.Manager() as manager:
        out = manager.dict()
        port = _free_port()
        mp.start_processes(_rank_main, args=(port, plans, out), nprocs=2, start_method="spawn", join=True)
        by_rank = dict(out)
    assert by_rank[0] == by_rank[1]
    expected = [(r, [float(r)] * 3, list(range(r + 2)), (1.5, None)) for r in range(2)]
    assert by_rank["gathered0"] == by_rank["gathered1"] == expected
    assert by_rank["sent0"] == by_rank["sent1"] == (1, [1.0] * 3, [0, 1, 2])
    assert by_rank["json0"] == by_rank["json1"] == {"kind": "slot", "step": 20}
    for (iteration, action), planned in zip(by_rank[0], [None, *plans]):
        assert action == planned
        assert action is None or action.iteration == iteration
    os.environ.pop("MASTER_ADDR", None)


def test_the_stop_iteration_leaves_the_margin_before_the_deadline():
    from ray_checkfreq.ray.preemption import Notice, stop_iteration

    notice = Notice(node_id="a", deadline_s=100.0, seen_s=50.0)
    # 100 - (2 * 4 + 2 * 0.5 + 0.5) = 90.5 is the last safe moment: 81 iterations of 0.5 s from 50.
    at = stop_iteration(now_s=50.0, notice=notice, iteration=10, iter_s=0.5, persist_s=4.0, detection_lag_s=0.5)
    assert at == 10 + 81
    late = stop_iteration(now_s=99.0, notice=notice, iteration=10, iter_s=0.5, persist_s=4.0, detection_lag_s=0.5)
    assert late == 10  # past the safe moment: at once
    none = Notice(node_id="a", deadline_s=None, seen_s=50.0)
    assert stop_iteration(now_s=50.0, notice=none, iteration=7, iter_s=0.5, persist_s=1.0, detection_lag_s=0.5) == 7


def test_the_loss_after_a_notice_is_counted_once_even_when_the_stop_was_never_confirmed():
    from ray_checkfreq.ray.preemption import lost_after_notice, notice_record

    planned = notice_record([{"node_id": "a"}], generation=3, stop_at=20, stopped_at=None)
    confirmed = notice_record([{"node_id": "a"}], generation=3, stop_at=20, stopped_at=20)
    assert lost_after_notice(confirmed, restored=20, generation=4) == 0
    assert lost_after_notice(confirmed, restored=16, generation=4) == 4
    # Torn down before rank 0 confirmed the stop: no rank trains past it, so at most stop - restored.
    assert lost_after_notice(planned, restored=16, generation=4) == 4
    assert lost_after_notice(planned, restored=20, generation=4) == 0  # the stop checkpoint committed anyway
    assert lost_after_notice(planned, restored=0, generation=5) == 20  # nothing committed: from scratch
    # Not a notice of an earlier attempt: none, already counted, or written by this attempt (or a newer one).
    assert lost_after_notice(None, restored=8, generation=4) is None
    assert lost_after_notice({**confirmed, "settled_by": 4}, restored=8, generation=5) is None
    assert lost_after_notice(confirmed, restored=8, generation=3) is None


def test_a_notice_is_counted_by_every_restart_until_an_attempt_after_it_commits():
    """Seen on the local spot cluster: the attempt after a notice restored its checkpoint and
    marked the notice counted, then ended before its first commit (resized to more workers);
    the next attempt resumed at the same step and reported no notice at all (None)."""
    import types

    from ray_checkfreq.ray.preemption import NOTICES_NAME, notice_record
    from ray_checkfreq.ray.restart import RestartProtocol

    stored = {NOTICES_NAME: notice_record([{"node_id": "a"}], generation=3, stop_at=501, stopped_at=501)}
    store = types.SimpleNamespace(write_metadata=stored.__setitem__, read_metadata=stored.get)

    def attempt(generation: int, *, commits: bool) -> int | None:
        protocol = RestartProtocol(rank=0, world_size=1, run="r", node_id="n", nodes=["n"], store=store,
                                   group=None, wait_s=0.0, warn_every_s=1.0)
        lost = protocol._count_notice_loss(store.read_metadata(NOTICES_NAME), 501, generation)
        if commits:
            protocol.settle_notice()
        return lost

    assert attempt(4, commits=False) == 0  # resized before its first commit
    assert attempt(5, commits=True) == 0  # the same notice, counted again
    assert attempt(6, commits=False) is None  # a later loss: not the notice's


def test_the_drain_watcher_reports_only_the_runs_nodes():
    import time

    from ray_checkfreq.ray.preemption import DrainWatcher

    drains: dict = {}
    watcher = DrainWatcher({"a", "b"}, poll_s=0.01, source=lambda: dict(drains))
    try:
        drains["other"] = 5.0
        time.sleep(0.1)
        assert watcher.notice is None
        drains["b"] = 123.0
        deadline = time.monotonic() + 5
        while watcher.notice is None and time.monotonic() < deadline:
            time.sleep(0.01)
        assert watcher.notice is not None
        assert (watcher.notice.node_id, watcher.notice.deadline_s) == ("b", 123.0)
        assert watcher.draining() == {"b"}
    finally:
        watcher.close()


# ------------------------------------------------------------------ what the choice reads
class CountingBackend(PosixBackend):
    """Local files, counting every byte read: data files apart from manifests."""

    def __init__(self, root: str) -> None:
        super().__init__(root, direct_io=False)
        self.data_bytes = 0
        self.other_bytes = 0

    def _count(self, rel_path: str, data: Any) -> Any:
        if rel_path.rsplit("/", 1)[-1].endswith(".bin"):
            self.data_bytes += len(data)
        else:
            self.other_bytes += len(data)
        return data

    def read(self, rel_path: str) -> Any:
        return self._count(rel_path, super().read(rel_path))

    def read_range(self, rel_path: str, offset: int, length: int) -> Any:
        return self._count(rel_path, super().read_range(rel_path, offset, length))


def _protocol(store: CheckpointStore, monkeypatch: pytest.MonkeyPatch, slots_of_node: list[dict]) -> RestartProtocol:
    monkeypatch.setattr(restart.agents, "live_agents", lambda run: {})
    monkeypatch.setattr(restart, "slot_headers", lambda live: {"a": slots_of_node})
    return RestartProtocol(rank=0, world_size=1, run=RUN, node_id="a", nodes=["a"], store=store, group=None,
                           wait_s=0.0, warn_every_s=60.0)


def test_a_restore_from_ram_reads_no_checkpoint_data_from_storage(tmp_path, monkeypatch) -> None:
    """The choice comes from listings and manifests: a slot of the newest committed step
    wins without a byte of that step's data read; the data is read only when storage is
    the source, and then checked (a corrupt newest falls back to the one before)."""
    state = {"model": {"w": torch.arange(50_000, dtype=torch.float32)}}
    writer = CheckpointStore(str(tmp_path), codec="raw")
    for step in (1, 2):
        writer.save(step, {"model": {"w": state["model"]["w"] + step}})
    backend = CountingBackend(str(tmp_path))
    store = CheckpointStore(str(tmp_path), filesystem=backend, codec="raw")
    choice, _ = _protocol(store, monkeypatch, [header(2)])._choose()
    assert (choice.kind, choice.step, choice.committed_step, choice.needs_persist) == ("slot", 2, 2, False)
    assert backend.data_bytes == 0 and 0 < backend.other_bytes < 20_000  # manifests, the writer record
    choice, _ = _protocol(store, monkeypatch, [header(1)])._choose()
    assert (choice.kind, choice.step) == ("storage", 2)
    assert backend.data_bytes == 0
    newest = next(p for p in tmp_path.iterdir() if p.name.startswith("step-000000000002"))
    data = next(p for p in newest.iterdir() if p.name.endswith(".bin"))
    with open(data, "r+b") as f:
        f.seek(1000)
        f.write(b"\xff\xff\xff\xff")
    loaded = restart.read_source(choice, store=store, run=RUN)
    assert torch.equal(loaded["model"]["w"], state["model"]["w"] + 1)  # step 2 is corrupt: step 1, checked
    assert backend.data_bytes >= 2 * 200_000


def test_the_stop_moves_earlier_when_the_iterations_slow_down_after_a_notice(monkeypatch, tmp_path):
    """Seen on the local spot cluster: a replacement node starting beside the training made
    iterations 3x slower after the notice, and the stop planned at the old pace fell after the
    deadline (789 iterations trained again). The plan is checked again at every iteration."""
    import types

    from ray_checkfreq.ray import preemption
    from ray_checkfreq.ray.preemption import Notice, Preemption

    clock = types.SimpleNamespace(now=1000.0)
    monkeypatch.setattr(preemption, "time", types.SimpleNamespace(time=lambda: clock.now,
                                                                   monotonic=lambda: clock.now,
                                                                   sleep=lambda s: None))
    notice = Notice(node_id="a", deadline_s=1010.0, seen_s=1000.0)
    watcher = types.SimpleNamespace(notice=None, close=lambda: None)
    requested: list[int] = []
    engine = types.SimpleNamespace(iteration=0, stop_at=None, request_checkpoint=requested.append,
                                   stats=lambda: {"slowest_recent_persist_s": 0.1, "last_persisted_step": None})
    store = types.SimpleNamespace(write_metadata=lambda name, record: None)
    handling = Preemption(rank=0, store=store, watcher=watcher, detection_lag_s=0.5, generation=lambda: 1)

    def iterate(seconds: float) -> None:
        clock.now += seconds
        engine.iteration += 1
        handling.time_iteration()
        handling.plan_for_notice(engine, lookahead=1)

    for _ in range(50):  # 10 ms iterations before the notice
        iterate(0.01)
    watcher.notice = notice
    iterate(0.01)
    first_plan = engine.stop_at
    assert first_plan > engine.iteration + 700  # ~9.3 s of 10 ms iterations
    assert requested == [engine.iteration + 2]  # the notice's own checkpoint: the next one planned
    while engine.iteration + 1 < engine.stop_at:  # then 30 ms iterations until the planned stop
        iterate(0.03)
    assert engine.stop_at < first_plan
    assert clock.now + 0.03 <= notice.deadline_s  # the stop checkpoint starts before the deadline
    assert handling.notices[-1]["iteration"] == engine.stop_at


class _ShardedEngine:
    """What a sharded restore calls on the engine, recorded (the loads return their step)."""

    def __init__(self) -> None:
        self.loads: list[tuple[int, dict]] = []

    def load_sharded(self, step: int, **options: Any) -> int:
        self.loads.append((step, options))
        return step

    def rank_snapshot_mismatch(self, state: Any) -> str | None:
        return None


def test_a_sharded_restore_from_storage_asks_the_engine_to_fall_back_with_every_rank(tmp_path, monkeypatch):
    """Rank 0 chose the newest commit from listings alone; a rank's part of it may be
    damaged, so every storage load the protocol makes lets the engine fall back past it
    on every rank together (``load_sharded(step, fall_back=True)``; the fallback itself:
    tests/test_sharded_restore_agreement.py): from storage chosen, and from storage after
    the RAM copies turned out unusable on some rank."""
    from dataclasses import asdict

    from ray_checkfreq.ray.restart import Decided
    from ray_checkfreq.ray.shard_copies import RankSource

    protocol = RestartProtocol(rank=0, world_size=2, run=RUN, node_id="a", nodes=["a", "b"],
                               store=CheckpointStore(str(tmp_path)), group=None, wait_s=0.0, warn_every_s=60.0,
                               sharded=True)
    engine = _ShardedEngine()
    chosen = RestoreChoice(kind="storage", step=9, committed_step=9)
    restored = protocol.apply(Decided(chosen, generation=3, notice_record=None), engine)
    assert (restored.iteration, restored.info["kind"]) == (9, "storage")
    monkeypatch.setattr(restart, "read_rank_source", lambda source, **_: {"rank": source.owner})
    monkeypatch.setattr(restart, "all_gather_json", lambda why, **_: [why, "its slot is torn"])  # rank 1's
    sources = [asdict(RankSource(kind="slot", node_id=node, owner=rank, step=12, generation=3, path="/x", seq=1))
               for rank, node in enumerate("ab")]
    in_ram = RestoreChoice(kind="slot", step=12, committed_step=9, sources=sources)
    restored = protocol.apply(Decided(in_ram, generation=3, notice_record=None), engine)
    assert (restored.iteration, restored.info["kind"]) == (9, "storage")
    assert engine.loads == [(9, {"fall_back": True})] * 2
