"""The run's shared policy (``SharedPolicy``) with fake ranks and agents, the engine's
``set_k``, and the PolicyActor / PolicyLink round trip on the session cluster."""

from __future__ import annotations

import math

import pytest

from ray_checkfreq.engine.adaptive import AdaptiveConfig
from ray_checkfreq.engine.policy import Profile, choose_interval
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


def restart_after(shared: SharedPolicy, generation: int, *, at_s: float, restart_s: float, **start) -> int:
    """A persist reported ``restart_s`` before a restart at ``at_s`` (the measured restart cost)."""
    shared.record_persist(generation=generation - 1, report=PersistReport(step=generation, seconds=0.01),
                          now_s=at_s - restart_s)
    return shared.start(generation=generation, world_size=2, iter_s=TI, cost_s=0.05, now_s=at_s, **start)


def best_k(mtbf_s: float, restart_s: float, k_cap: int | None = None) -> int:
    profile = Profile(iter_s=TI, update_s=TI, cpu_copy_s=0.0, persist_s=0.01, size_bytes=0, interference_s=0.05)
    return choose_interval(profile, overhead=0.05, loss_rate_per_s=1 / mtbf_s, restart_s=restart_s, k_cap=k_cap).k


def test_once_a_loss_was_seen_k_maximises_goodput_at_the_observed_rate():
    """One loss in 2 hours: fewer checkpoints than p's k (4); a loss every 10 s: more than p
    allows (its floor 20), the adaptive rate then holding k to that overhead; the restart cost
    is measured (last report to the new start)."""
    rare = SharedPolicy(SharedPolicyConfig(overhead=0.05, adaptive=WINDOW))
    rare.start(generation=1, world_size=2, k=4, k_floor=2, iter_s=TI, cost_s=0.05, now_s=0.0)
    assert rare.decision()["goodput_k"] is None and rare.k == 4  # nothing seen yet
    k = restart_after(rare, 2, at_s=7200.0, restart_s=12.0, k=4, k_floor=2)
    assert k == best_k(3600.0, 12.0) > 4 and rare.history[-1]["reason"] == "goodput"
    assert rare.decision()["restarts"] == 1 and rare.decision()["mtbf_s"] == 3600.0
    frequent = SharedPolicy(SharedPolicyConfig(overhead=0.05, adaptive=WINDOW))
    frequent.start(generation=1, world_size=2, k=40, k_floor=20, iter_s=TI, cost_s=0.05, now_s=0.0)
    for generation in range(2, 6):
        k = restart_after(frequent, generation, at_s=30.0 * generation, restart_s=2.0, k=40, k_floor=20)
    assert k == best_k(150.0 / 5, 2.0) < 20 and frequent.history[-1]["reason"] in ("goodput", "cap")
    assert frequent._rate is not None and frequent._rate.k_floor == k  # the adaptive rate may not undo it


def test_a_notice_that_kept_everything_is_no_loss_that_needs_a_checkpoint():
    shared = SharedPolicy(SharedPolicyConfig(overhead=0.05, adaptive=WINDOW))
    shared.start(generation=1, world_size=2, k=4, k_floor=2, iter_s=TI, k_cap=50, cost_s=0.05, now_s=0.0)
    # Restarts after notices only: as few checkpoints as the lost-work bound allows.
    assert restart_after(shared, 2, at_s=60.0, restart_s=10.0, k=4, k_floor=2, k_cap=50, lost_work=False) == 50
    assert shared.decision()["mtbf_s"] == 60.0  # no loss that needed a checkpoint yet
    k = restart_after(shared, 3, at_s=120.0, restart_s=10.0, k=4, k_floor=2, k_cap=50)
    assert k == best_k(60.0, 10.0, k_cap=50) < 50


def test_each_loss_counts_how_long_its_generation_trained():
    """Losses in a wave: generation 2 trains 0.3 s (its last iteration report) before it is
    lost, far under one interval; generation 1 trained 99 s. The k is the model's with those
    measured uptimes, above the memoryless one at the same rate."""
    shared = SharedPolicy(SharedPolicyConfig(overhead=0.05, adaptive=WINDOW))
    shared.start(generation=1, world_size=1, k=4, k_floor=2, iter_s=TI, cost_s=0.05, now_s=0.0)
    shared.record_iterations(generation=1, rank=0, reports=iterations(1, 4), now_s=99.0)
    shared.start(generation=2, world_size=1, k=4, k_floor=2, iter_s=TI, cost_s=0.05, now_s=100.0)
    shared.record_iterations(generation=2, rank=0, reports=iterations(5, 3), now_s=100.3)
    shared.record_iterations(generation=1, rank=0, reports=iterations(9, 1), now_s=150.0)  # an old rank's: ignored
    k = shared.start(generation=3, world_size=1, k=4, k_floor=2, iter_s=TI, cost_s=0.05, now_s=101.3)
    profile = Profile(iter_s=TI, update_s=TI, cpu_copy_s=0.0, persist_s=0.0, size_bytes=0, interference_s=0.05)
    expected = choose_interval(profile, overhead=0.05, loss_rate_per_s=3 / 101.3, restart_s=1.3,
                               uptimes_s=[99.0, 0.3])
    memoryless = choose_interval(profile, overhead=0.05, loss_rate_per_s=3 / 101.3, restart_s=1.3)
    assert shared._uptimes == pytest.approx([99.0, 0.3])
    assert k == shared.decision()["goodput_k"] == expected.k > memoryless.k, (k, expected.k, memoryless.k)


def test_without_a_loss_p_holds_however_long_the_run():
    shared = SharedPolicy(SharedPolicyConfig(overhead=0.05, adaptive=WINDOW))
    shared.start(generation=1, world_size=1, k=4, k_floor=2, iter_s=TI, cost_s=0.05, now_s=0.0)
    shared.record_persist(generation=1, report=PersistReport(step=4, seconds=0.01), now_s=0.5)
    shared.record_persist(generation=1, report=PersistReport(step=8, seconds=0.01), now_s=20_000.0)
    assert shared.k == 4 and shared.decision()["goodput_k"] is None
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
