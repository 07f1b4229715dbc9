"""The run's shared policy (``SharedPolicy``) with fake ranks and agents, the engine's
``set_k``, and the PolicyActor / PolicyLink round trip on the session cluster."""

from __future__ import annotations

import math

import pytest

from ray_checkfreq.engine.adaptive import AdaptiveConfig
from ray_checkfreq.ray.shared_policy import IterationReport, PersistReport, SharedPolicy, SharedPolicyConfig

TI = 0.1
WINDOW = AdaptiveConfig(window_iters=10, min_checkpoints_per_window=1, patience=1)


def policy(k: int = 4, k_floor: int = 2, world_size: int = 2, generation: int = 1) -> SharedPolicy:
    shared = SharedPolicy(SharedPolicyConfig(overhead=0.05, adaptive=WINDOW))
    assert shared.start(generation=generation, world_size=world_size, k=k, k_floor=k_floor, iter_s=TI) == k
    return shared


def iterations(first: int, count: int, *, iter_s: float = TI, stall_s: float = 0.0, k: int = 4,
               busy: bool | None = None) -> list[IterationReport]:
    """A rank's iterations; a stall at every k-th one (a checkpoint), busy then unless told."""
    reports = []
    for i in range(first, first + count):
        checkpoint = i % k == 0
        stall = stall_s if checkpoint else 0.0
        reports.append(IterationReport(iteration=i, iter_s=iter_s + stall, stall_s=stall,
                                       busy=checkpoint if busy is None else busy))
    return reports


def feed(shared: SharedPolicy, by_rank: dict[int, list[IterationReport]], generation: int = 1) -> None:
    for rank, reports in by_rank.items():
        shared.record_iterations(generation=generation, rank=rank, reports=reports)


def test_the_slowest_rank_decides():
    quiet = iterations(1, 40)
    stalled = iterations(1, 40, stall_s=0.1)  # rank 1 waits 100 ms at every checkpoint: 25 % at k = 4
    only_rank0 = policy()
    feed(only_rank0, {0: quiet, 1: quiet})
    assert only_rank0.k <= 4  # no overhead seen: k may only come down
    both = policy()
    feed(both, {0: quiet, 1: stalled})
    assert both.k > 4
    assert both.history[-1]["reason"] == "overhead"


def test_an_iteration_counts_once_every_rank_reported_it():
    shared = policy()
    feed(shared, {0: iterations(1, 40, stall_s=0.1)})
    assert shared.decision()["iterations_aggregated"] == 0 and shared.k == 4
    feed(shared, {1: iterations(1, 40)})
    assert shared.decision()["iterations_aggregated"] == 40
    assert shared.k > 4  # rank 0's stalls, once rank 1's iterations completed them


def test_a_persist_slower_than_the_interval_raises_k_at_once():
    shared = policy()
    before = shared.version
    shared.record_persist(generation=1, report=PersistReport(step=4, seconds=2.0, cpu_s=0.5))
    need = math.ceil(1.25 * 2.0 / TI)
    assert shared.k == need == 25
    assert shared.version == before + 1 and shared.history[-1]["reason"] == "persist"


def test_k_falls_again_once_persists_are_quick_but_never_below_their_need():
    shared = policy()
    shared.record_persist(generation=1, report=PersistReport(step=4, seconds=2.0))
    assert shared.k == 25
    for step in range(2):  # the slow one leaves the memory of the last two persists
        shared.record_persist(generation=1, report=PersistReport(step=8 + step, seconds=0.05))
    assert shared.persist_need() == 1
    first = 1
    for _ in range(10):  # quiet windows: overhead well below p
        feed(shared, {0: iterations(first, 60, k=shared.k), 1: iterations(first, 60, k=shared.k)})
        first += 60
    assert shared.k == 2  # the profile's floor, reached step by step
    reasons = [h["reason"] for h in shared.history]
    assert reasons[:2] == ["profile", "persist"] and set(reasons[2:]) == {"overhead"}
    ks = [h["k"] for h in shared.history[1:]]
    assert ks == sorted(ks, reverse=True), ks


def test_reports_of_an_older_generation_are_ignored():
    shared = policy(generation=3)
    feed(shared, {0: iterations(1, 40, stall_s=0.5), 1: iterations(1, 40, stall_s=0.5)}, generation=2)
    shared.record_persist(generation=2, report=PersistReport(step=4, seconds=9.0))
    assert shared.k == 4 and shared.decision()["iterations_aggregated"] == 0
    with pytest.raises(ValueError, match="older"):
        shared.start(generation=2, world_size=2, k=4, k_floor=2, iter_s=TI)


def test_a_restart_at_the_same_world_size_keeps_the_learned_k_and_another_size_starts_over():
    shared = policy()
    shared.record_persist(generation=1, report=PersistReport(step=4, seconds=2.0))
    assert shared.start(generation=2, world_size=2, k=4, k_floor=2, iter_s=TI) == 25
    assert shared.start(generation=3, world_size=3, k=6, k_floor=3, iter_s=0.2) == 6
    assert shared.decision()["persist_s"] == []
    assert shared.decision()["generation"] == 3


def test_rare_preemptions_raise_k_to_young_daly_and_frequent_ones_leave_p_in_charge():
    """The restarts seen give the preemption rate: at one restart in 2 hours and 0.05 s per
    checkpoint, sqrt(2 * 0.05 * 3600) = 19 s is k = 189 at 0.1 s iterations (p alone: 4);
    with a restart every 10 s Young/Daly's k (10) is under p's floor and p's k stands."""
    rare = SharedPolicy(SharedPolicyConfig(overhead=0.05, adaptive=WINDOW))
    rare.start(generation=1, world_size=2, k=4, k_floor=2, iter_s=TI, cost_s=0.05, now_s=0.0)
    assert rare.decision()["goodput_k"] == 1 and rare.k == 4  # nothing seen yet
    assert rare.start(generation=2, world_size=2, k=4, k_floor=2, iter_s=TI, cost_s=0.05, now_s=7200.0) == \
        math.floor(math.sqrt(2 * 0.05 * 3600) / TI)
    assert rare.decision()["restarts"] == 1 and rare.decision()["mtbf_s"] == 3600.0
    assert rare.history[-1]["reason"] == "goodput"
    frequent = SharedPolicy(SharedPolicyConfig(overhead=0.05, adaptive=WINDOW))
    for generation in range(1, 6):
        k = frequent.start(generation=generation, world_size=2, k=40, k_floor=20, iter_s=TI, cost_s=0.05,
                           now_s=10.0 * generation)
    assert frequent.decision()["goodput_k"] < 20 and k == 40
    capped = SharedPolicy(SharedPolicyConfig(overhead=0.05, adaptive=WINDOW))
    capped.start(generation=1, world_size=2, k=4, k_floor=2, iter_s=TI, k_cap=50, cost_s=0.05, now_s=0.0)
    assert capped.start(generation=2, world_size=2, k=4, k_floor=2, iter_s=TI, cost_s=0.05, now_s=7200.0) == 50


def test_the_preemption_rate_estimate_grows_with_quiet_time_between_persists():
    shared = SharedPolicy(SharedPolicyConfig(overhead=0.05, adaptive=WINDOW))
    shared.start(generation=1, world_size=1, k=4, k_floor=2, iter_s=TI, cost_s=0.05, now_s=0.0)
    shared.record_persist(generation=1, report=PersistReport(step=4, seconds=0.01), now_s=0.5)
    assert shared.k == 4  # 0.5 s without a preemption: Young/Daly's k is 2, under p's
    shared.record_persist(generation=1, report=PersistReport(step=8, seconds=0.01), now_s=20_000.0)
    assert shared.k == math.floor(math.sqrt(2 * 0.05 * 20_000) / TI)  # no restart in 5.5 hours
    assert shared.decision()["mtbf_s"] == 20_000.0


def test_reports_before_start_or_from_unknown_ranks_are_ignored():
    shared = SharedPolicy()
    shared.record_iterations(generation=0, rank=0, reports=iterations(1, 5))
    assert shared.k is None and shared.decision()["k"] is None
    started = policy(world_size=2)
    feed(started, {5: iterations(1, 40, stall_s=1.0)})
    assert started.decision()["iterations_aggregated"] == 0


@pytest.mark.parametrize("bad", [{"overhead": 0}, {"overhead": 1.5}, {"persist_margin": 0.5},
                                 {"persist_memory": 0}])
def test_config_is_validated(bad):
    with pytest.raises(ValueError, match=next(iter(bad))):
        SharedPolicyConfig(**bad)


# ----------------------------------------------------------------- the engine's set_k
def test_set_k_moves_the_next_checkpoint_and_is_for_the_planner_only(tmp_path):
    import torch

    from ray_checkfreq.engine import CheckFreq
    from ray_checkfreq.engine.seams import EngineSeams

    class Remote:  # a rank that only applies decisions
        lookahead = 0
        is_planner = False

        def exchange(self, planned):
            return None

    model = torch.nn.Linear(4, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    seen: list[tuple] = []
    cf = CheckFreq(model=model, optimizer=optimizer, storage=str(tmp_path / "a"), overhead=0.5, profile_iters=3,
                   seams=EngineSeams(observe=lambda *row: seen.append(row), local_adaptive=False))
    cf.set_k(7)  # before the policy decided: nothing to move yet
    assert cf.planned_k is None
    while not cf.policy_ready:
        model(torch.ones(1, 4)).sum().backward()
        optimizer.step()
        cf.step()
    assert cf._adaptive is None  # adapting is left to the shared policy
    start = cf.iteration
    cf.set_k(5)
    assert cf.planned_k == 5
    committed_before = cf.stats()["checkpoints_committed"]
    for _ in range(12):
        model(torch.ones(1, 4)).sum().backward()
        optimizer.step()
        cf.step()
    cf.flush()
    steps = [ref.step for ref in cf.store.list() if ref.step > start]
    assert steps and all(b - a == 5 for a, b in zip(steps, steps[1:])), steps
    assert cf.stats()["checkpoints_committed"] > committed_before
    assert cf.stats()["k_changes"][-1][1] == 5
    assert [row[0] for row in seen] == list(range(2, cf.iteration + 1))  # every timed iteration, in order
    with pytest.raises(ValueError, match="k=0"):
        cf.set_k(0)
    cf.close()
    other = CheckFreq(model=model, optimizer=optimizer, storage=str(tmp_path / "b"), every=3,
                      seams=EngineSeams(decisions=Remote()))
    with pytest.raises(RuntimeError, match="plans"):
        other.set_k(4)
    other.close()
