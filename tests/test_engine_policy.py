"""The CheckFreq policy math and the adaptive rate, against hand-computed cases."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ray_checkfreq.engine.adaptive import AdaptiveConfig, AdaptiveRate
from ray_checkfreq.engine.policy import (
    MAX_OVERHEAD,
    Profile,
    choose_interval,
    choose_mode,
    critical_overhead_s,
    expected_goodput,
    interval_overhead,
    lost_per_loss_s,
    smallest_interval_within,
    young_daly_interval_s,
)

GiB = 1024**3


def cpu_profile(**overrides) -> Profile:
    values = dict(iter_s=1.0, update_s=0.2, cpu_copy_s=0.5, persist_s=3.0, size_bytes=100)
    values.update(overrides)
    return Profile(**values)


def test_cpu_mode_copy_hidden_by_compute_is_free_and_k_waits_for_persist():
    # To = max(0, 0.5 - (1 - 0.2)) = 0; k = ceil((0.5 + 3 - 0) / 1) = 4
    decision = choose_interval(cpu_profile(), overhead=0.035)
    assert (decision.mode, decision.overhead_s, decision.k_min, decision.k_persist, decision.k) == ("cpu", 0.0, 1, 4, 4)


def test_the_five_percent_one_unit_example_gives_k_20():
    # To = 1.5 - (1 - 0.5) = 1 unit; kmin = ceil(1 / (0.05 * 1)) = 20 (not 21 from rounding)
    profile = cpu_profile(update_s=0.5, cpu_copy_s=1.5, persist_s=2.0)
    decision = choose_interval(profile, overhead=0.05)
    assert decision.overhead_s == pytest.approx(1.0)
    assert (decision.k_min, decision.k_persist, decision.k) == (20, 3, 20)
    assert decision.expected_overhead == pytest.approx(0.05)


def test_gpu_mode_when_the_snapshot_fits_in_spare_memory():
    profile = cpu_profile(iter_s=0.5, cpu_copy_s=0.4, persist_s=2.0, gpu_copy_s=0.1, size_bytes=10 * GiB,
                          peak_memory_bytes=60 * GiB, total_memory_bytes=80 * GiB)
    decision = choose_interval(profile, overhead=0.035)
    # To = Tg = 0.1; kmin = ceil(0.1 / (0.035 * 0.5)) = 6; k_persist = ceil((0.4 + 2 - 0.1) / 0.5) = 5
    assert (decision.mode, decision.k_min, decision.k_persist, decision.k) == ("gpu", 6, 5, 6)


def test_cpu_mode_when_the_snapshot_does_not_fit():
    profile = cpu_profile(gpu_copy_s=0.1, size_bytes=30 * GiB, peak_memory_bytes=60 * GiB, total_memory_bytes=80 * GiB)
    assert choose_mode(profile) == "cpu"
    assert critical_overhead_s(profile, "cpu") == 0.0
    assert choose_mode(cpu_profile()) == "cpu"  # no GPU measured


def test_without_a_loss_rate_p_holds():
    profile = cpu_profile(update_s=0.5, cpu_copy_s=1.2, persist_s=40.0)  # To = 0.7, persist needs 41
    loose = choose_interval(profile, overhead=0.05)
    assert loose.k == 41 and loose.young_daly_k is None and loose.bound == "p" and loose.expected_goodput is None
    assert choose_interval(profile, overhead=0.05, loss_rate_per_s=0.0) == loose
    assert young_daly_interval_s(2.0, 3600) == pytest.approx(120.0)


def brute_force_k(profile, stall_s: float, *, rate: float, restart_s: float, low: int, high: int) -> int:
    return max(range(low, high + 1),
               key=lambda k: expected_goodput(profile, stall_s, k, loss_rate_per_s=rate, restart_s=restart_s))


def test_frequent_losses_buy_more_checkpoints_than_p_allows_up_to_the_cap():
    # A large replicated state: To = 0.3 s a checkpoint at 1 s iterations, persist 2 s.
    profile = cpu_profile(update_s=0.3, cpu_copy_s=1.0, persist_s=2.0, interference_s=0.3)
    at_p = choose_interval(profile, overhead=0.035)
    assert at_p.bound == "p" and at_p.k == 9  # ceil(0.3 / 0.035)
    frequent = choose_interval(profile, overhead=0.035, loss_rate_per_s=1 / 60, restart_s=10.0)
    assert frequent.bound == "goodput" and frequent.k < at_p.k
    assert 0.035 < interval_overhead(profile, 0.3, frequent.k) <= MAX_OVERHEAD
    assert frequent.k == brute_force_k(profile, 0.3, rate=1 / 60, restart_s=10.0, low=1, high=500)
    assert frequent.expected_goodput > expected_goodput(profile, 0.3, at_p.k, loss_rate_per_s=1 / 60,
                                                        restart_s=10.0)
    # Losses every 5 s would want a checkpoint nearly every iteration: the cap holds overhead.
    quick = cpu_profile(update_s=0.3, cpu_copy_s=0.3, persist_s=0.2, interference_s=0.3)  # C = 0.3, no wait
    capped = choose_interval(quick, overhead=0.035, loss_rate_per_s=1 / 5, restart_s=0.5, max_overhead=0.1)
    assert (capped.k, capped.bound) == (3, "cap")  # 0.3 / 3 = 0.1; the best k unbounded is below
    assert brute_force_k(quick, 0.0, rate=1 / 5, restart_s=0.5, low=1, high=50) < 3
    with pytest.raises(ValueError, match="max_overhead=1.5"):
        choose_interval(profile, overhead=0.035, max_overhead=1.5)


def test_rare_losses_checkpoint_less_often_than_p_within_the_lost_work_bound():
    profile = cpu_profile(update_s=0.9, cpu_copy_s=0.1, persist_s=0.5, interference_s=0.2)  # kcost = 4 at 5 %
    rare = choose_interval(profile, overhead=0.05, mtbf_s=2000)  # the user states the rate: 1 / mtbf_s
    assert rare.k > 4 and rare.bound == "goodput" and rare.young_daly_k == 28  # sqrt(2 * 0.2 * 2000)
    assert rare.k == brute_force_k(profile, 0.0, rate=1 / 2000, restart_s=60.0, low=1, high=400)
    bounded = choose_interval(profile, overhead=0.05, mtbf_s=20_000, k_cap=20)
    assert (bounded.k, bounded.bound) == (20, "goodput")
    below = choose_interval(profile, overhead=0.01, mtbf_s=2000, k_cap=3, max_overhead=0.05)
    assert (below.k, below.bound, below.k_uncapped) == (3, "lost_work", 4)


@settings(max_examples=60, deadline=None)
@given(iter_s=st.floats(0.01, 5.0), copy_s=st.floats(0.0, 5.0), persist_s=st.floats(0.0, 50.0),
       interference_s=st.floats(0.0, 2.0), mtbf_s=st.floats(30.0, 1e6), restart_s=st.floats(0.0, 300.0))
def test_the_goodput_k_is_the_best_k_within_the_cap(iter_s, copy_s, persist_s, interference_s, mtbf_s, restart_s):
    profile = cpu_profile(iter_s=iter_s, update_s=iter_s / 2, cpu_copy_s=copy_s, persist_s=persist_s,
                          interference_s=interference_s)
    decision = choose_interval(profile, overhead=0.035, mtbf_s=mtbf_s, restart_s=restart_s, k_cap=400)
    low = smallest_interval_within(profile, decision.overhead_s, MAX_OVERHEAD)
    if low > 400:
        assert decision.bound == "lost_work"
        return
    best = brute_force_k(profile, decision.overhead_s, rate=1 / mtbf_s, restart_s=restart_s, low=low, high=400)

    def value(k: int) -> float:
        return expected_goodput(profile, decision.overhead_s, k, loss_rate_per_s=1 / mtbf_s, restart_s=restart_s)

    assert value(decision.k) >= value(best) - 1e-12
    assert interval_overhead(profile, decision.overhead_s, decision.k) <= MAX_OVERHEAD + 1e-9


def test_losses_that_came_before_one_interval_cost_their_uptime_not_half_an_interval():
    # Per loss at a 100 s period: 5 s trained (all of it lost), 400 s (half a period), the loss to come (half).
    assert lost_per_loss_s(100.0, [5.0, 400.0]) == pytest.approx((5.0 + 50.0 + 50.0) / 3)
    assert lost_per_loss_s(100.0) == 50.0  # no uptimes: the memoryless model
    # A large replicated state, a loss every 500 s: half of them in waves, 40 s after the restart
    # before. Those cost their 40 s whatever k is, so fewer checkpoints pay than the rate alone says.
    profile = cpu_profile(update_s=1.0, cpu_copy_s=10.0, persist_s=100.0)  # 10 s stall, 100 s persist
    memoryless = choose_interval(profile, overhead=0.035, loss_rate_per_s=1 / 500, restart_s=80.0, k_cap=500)
    long_only = choose_interval(profile, overhead=0.035, loss_rate_per_s=1 / 500, restart_s=80.0, k_cap=500,
                                uptimes_s=[900.0] * 10)
    assert long_only.k == memoryless.k  # every loss came after many intervals: half an interval each
    waves = [40.0, 900.0] * 5
    bursty = choose_interval(profile, overhead=0.035, loss_rate_per_s=1 / 500, restart_s=80.0, k_cap=500,
                             uptimes_s=waves)
    assert bursty.bound == "goodput" and bursty.k > memoryless.k

    def value(k: int) -> float:
        return expected_goodput(profile, 10.0, k, loss_rate_per_s=1 / 500, restart_s=80.0, uptimes_s=waves)

    low = smallest_interval_within(profile, 10.0, MAX_OVERHEAD)
    assert value(bursty.k) == pytest.approx(max(value(k) for k in range(low, 501)))
    with pytest.raises(ValueError, match="uptimes_s has \\[-1.0\\]"):
        choose_interval(profile, loss_rate_per_s=1 / 500, uptimes_s=[3.0, -1.0])


def test_the_goodput_k_can_sit_just_below_an_observed_uptime():
    # Nine losses 49.6 s into their attempts: G drops where the period passes 49.6 s, and rises
    # again far above; the best k is the last under it, which no point of the grid is near.
    profile = cpu_profile(iter_s=0.3226, update_s=0.3226, cpu_copy_s=1.8258, persist_s=19.18, interference_s=1.056)
    decision = choose_interval(profile, overhead=0.035, mtbf_s=1239.0, restart_s=98.6, k_cap=400,
                               uptimes_s=[49.6] * 9)
    low = smallest_interval_within(profile, decision.overhead_s, MAX_OVERHEAD)

    def value(k: int) -> float:
        return expected_goodput(profile, decision.overhead_s, k, loss_rate_per_s=1 / 1239.0, restart_s=98.6,
                                uptimes_s=[49.6] * 9)

    best = max(range(low, 401), key=value)
    assert decision.k == best < 400 and value(best) > value(400)
    assert best * 0.3226 * (1 + interval_overhead(profile, decision.overhead_s, best)) < 49.6


@pytest.mark.parametrize("bad", [dict(iter_s=0), dict(persist_s=-1), dict(size_bytes=-5)])
def test_invalid_profiles_are_named(bad):
    with pytest.raises(ValueError, match=next(iter(bad))):
        cpu_profile(**bad)


def test_profile_json_round_trip_and_unknown_fields():
    profile = cpu_profile(gpu_copy_s=0.25)
    assert Profile.from_json(profile.to_json()) == profile
    with pytest.raises(ValueError, match="unknown fields"):
        Profile.from_json({**profile.to_json(), "extra": 1})


def _drive(rate: AdaptiveRate, iterations: int, stall_per_checkpoint) -> list[int]:
    """A loop with Ti = 1 s whose checkpoints stall ``stall_per_checkpoint(k)`` seconds."""
    ks = []
    since = 0
    for _ in range(iterations):
        since += 1
        stall = 0.0
        if since >= rate.k:
            since = 0
            stall = stall_per_checkpoint(rate.k)
        rate.record(1.0 + stall, stall)
        ks.append(rate.k)
    return ks


def test_adaptive_rate_raises_under_pressure_and_comes_back_down_without_oscillating():
    rate = AdaptiveRate(k=10, k_floor=10, overhead=0.035, config=AdaptiveConfig(window_iters=50))
    calm = _drive(rate, 400, lambda k: 0.2)  # 0.2 / 10 = 2 % < p: stays at the floor
    assert set(calm) == {10}
    slow = _drive(rate, 2000, lambda k: 2.0)  # 2 / 10 = 20 %: k must grow until <= p
    settled = rate.k
    assert settled > 10 and 2.0 / settled <= 0.035
    assert len(set(slow[-600:])) == 1, "k settles instead of oscillating"
    _drive(rate, 3000, lambda k: 0.2)
    assert rate.k == 10, "k returns to the floor once the pressure is gone"
    assert rate.history and max(o for o, _ in rate.history[-3:]) <= 0.035


def test_adaptive_rate_counts_persist_waits_as_pressure():
    # a persist that needs 30 s: checkpoints closer than that wait for it
    rate = AdaptiveRate(k=5, k_floor=5, overhead=0.035)
    ks = _drive(rate, 4000, lambda k: max(0.0, 30.0 - k) + 0.05)
    assert max(ks[:200]) >= 30, "k reaches the persist's 30 within two windows (in proportion, far above p)"
    # Not fed the persist times, lowering cannot see the cliff at 30 (below it every checkpoint waits): k probes
    # below it now and then and is raised back at once; most of the time it is above.
    assert sum(k >= 30 for k in ks[2000:]) >= 0.75 * 2000, ks[2000:]


def test_fed_the_persist_times_k_stops_probing_below_the_persist():
    rate = AdaptiveRate(k=5, k_floor=5, overhead=0.035, reference_iter_s=1.0)
    rate.record_persist(30.0)  # the same 30 s persist, now known to the rate
    ks = _drive(rate, 4000, lambda k: max(0.0, 30.0 - k) + 0.05)
    assert min(ks[1000:]) >= 30 and len(set(ks[2000:])) == 1, "no probing below the cliff: k settles above it"
    assert rate.persist_floor == math.ceil(1.25 * 30.0)


def test_the_persist_floor_stops_k_falling_but_does_not_lift_it():
    rate = AdaptiveRate(k=40, k_floor=10, overhead=0.035, reference_iter_s=1.0)
    rate.record_persist(20.0)  # needs 25 iterations with the margin
    _stalled(rate, 2000, 0.02)  # nearly free: k falls, to the floor and no further
    assert rate.k == 25, rate.history
    for seconds in (60.0, 1.0, 1.0):  # one slow persist: k holds, not lifted to 75
        rate.record_persist(seconds)
        _stalled(rate, 200, 0.02)
        assert rate.k == 25, rate.history
    rate.record_persist(1.0)  # the slow one is out of the last 3: k may fall again
    _stalled(rate, 2000, 0.02)
    assert rate.k == 10, rate.history


def _stalled(rate: AdaptiveRate, iterations: int, stall_s: float) -> None:
    """Ti = 1 s, no checkpoint work but a stall of ``stall_s`` every k iterations."""
    for i in range(1, iterations + 1):
        stall = stall_s if i % rate.k == 0 else 0.0
        rate.record(1.0 + stall, stall, busy=stall > 0)


def test_far_above_p_k_rises_in_proportion_after_one_window():
    # 1.4 s every 10 iterations: 14 % = 4p; k ~ 10 * 14 / (0.8 * 3.5) = 50, at most 3x at once
    rate = AdaptiveRate(k=10, k_floor=10, overhead=0.035)
    _stalled(rate, 50, 1.4)
    assert rate.k == 30, rate.history
    near = AdaptiveRate(k=10, k_floor=10, overhead=0.035)
    _stalled(near, 50, 0.5)  # 5 %: above p, not 2p: the damped path, which waits for a second window
    assert near.k == 10
    _stalled(near, 50, 0.5)
    assert near.k == 15, near.history


def test_one_long_stall_is_not_a_reason_to_jump():
    # one persist's heavy tail: a 10 s stall in an otherwise free window (about 20 %)
    rate = AdaptiveRate(k=10, k_floor=10, overhead=0.035)
    for i in range(1, 51):
        stall = 10.0 if i == 25 else 0.0
        rate.record(1.0 + stall, stall, busy=stall > 0)
    assert rate.last_overhead is not None and rate.last_overhead > 0.15
    assert rate.k == 10, "one event: pooled over windows like any other, no jump"


def test_below_a_k_it_held_before_k_climbs_back_in_damped_steps():
    rate = AdaptiveRate(k=40, k_floor=10, overhead=0.035)
    _stalled(rate, 400, 0.02)  # nearly free: k falls (by at most 1.25x)
    lowered = rate.k
    assert lowered < 40
    for _ in range(10):  # far above p again (16 %), but k was fine higher up: 1.5x, not 3x
        _stalled(rate, lowered, 5.0)
        if rate.k != lowered:
            break
    assert lowered < rate.k <= math.ceil(1.5 * lowered), rate.history


def test_adaptive_rate_sees_iterations_slowed_by_background_work():
    # no stall at all, but every iteration takes 10 % longer than the profiled 1 s
    rate = AdaptiveRate(k=4, k_floor=4, overhead=0.035, reference_iter_s=1.0)
    for _ in range(100):  # two windows: k moves on two windows at least
        rate.record(1.10, 0.0)
    assert rate.k > 4 and rate.last_overhead == pytest.approx(0.10)


def test_adaptive_rate_takes_its_reference_from_quiet_iterations():
    # the loop got slower for reasons of its own (2 s, not the profiled 1 s): no pressure
    rate = AdaptiveRate(k=4, k_floor=4, overhead=0.035, reference_iter_s=1.0,
                        config=AdaptiveConfig(window_iters=60))
    for i in range(120):
        rate.record(2.0, 0.0, busy=(i % 4 == 0))
    assert rate.k == 4 and rate.last_overhead == pytest.approx(0.0)
    # busy iterations 40 % slower than quiet ones: a quarter of the window -> 10 %
    for i in range(120):
        rate.record(2.8 if i % 4 == 0 else 2.0, 0.0, busy=(i % 4 == 0))
    assert rate.k > 4 and rate.last_overhead == pytest.approx(0.10)


# ------------------------------------------------------- measured interference
from ray_checkfreq.engine.policy import (  # noqa: E402
    choose_codec,
    compression_could_pay,
    fixed_interval_codec,
    interference_s,
    iteration_time_s,
    quiet_reference_s,
)
from ray_checkfreq.engine.profiling import (  # noqa: E402
    MEASURE_ITERS,
    REFERENCE_ITERS,
    REFERENCE_WAIT_ITERS,
    WARM_SAMPLES,
    CodecTrial,
    ProfilingWindow,
)


def test_measured_interference_sets_k_when_it_exceeds_the_papers_stall():
    # To = 0 (copy hidden), persist needs ceil((0.5 + 3) / 1) = 4; but training lost 0.7 s
    # per checkpoint beside the persist: kcost = ceil(0.7 / (0.035 * 1)) = 20
    decision = choose_interval(cpu_profile(interference_s=0.7), overhead=0.035)
    assert (decision.overhead_s, decision.k_min, decision.k_persist, decision.k_cost, decision.k) == (0.0, 1, 4, 20, 20)
    assert decision.cost_s == pytest.approx(0.7)
    assert decision.expected_overhead == pytest.approx(0.035)
    assert decision.k_floor == 4, "the adaptive rate may come down to the paper's k"


def test_interference_below_the_stall_changes_nothing():
    # To = 1.5 - (1 - 0.5) = 1 > 0.3 measured: the paper's k = 20 stands
    profile = cpu_profile(update_s=0.5, cpu_copy_s=1.5, persist_s=2.0, interference_s=0.3)
    decision = choose_interval(profile, overhead=0.05)
    assert (decision.cost_s, decision.k_cost, decision.k) == (pytest.approx(1.0), 20, 20)


def test_interference_is_what_busy_iterations_lost_against_the_quiet_mean():
    quiet = [1.0, 1.0, 1.2, 0.8, 1.0, 9.0]  # 9.0 is a pause (>= 3x the median): left out
    assert quiet_reference_s(quiet) == pytest.approx(1.0)
    assert interference_s(quiet, [1.5, 1.25, 1.0, 1.0]) == pytest.approx(0.75)
    assert interference_s(quiet, [0.9, 0.9]) == 0.0, "never negative"
    assert interference_s(quiet, [1.5, 4.0]) == pytest.approx(3.5), "a stretched busy iteration counts in full"
    assert iteration_time_s([5.0, 3.0, 1.0, 1.2, 0.9, 1.1, 1.0], warmup=2) == pytest.approx(1.0)
    with pytest.raises(ValueError, match="warm-up of 2"):
        iteration_time_s([5.0, 3.0], warmup=2)


def test_compression_is_tried_only_where_the_persist_holds_k_up():
    persist_bound = choose_interval(cpu_profile(persist_s=30.0, interference_s=0.1))  # k_persist 31, k_cost 3
    cost_bound = choose_interval(cpu_profile(persist_s=0.2, interference_s=0.7))  # k_persist 1, k_cost 20
    assert compression_could_pay(persist_bound, size_bytes=100 << 20)
    assert not compression_could_pay(persist_bound, size_bytes=4096), "per-file latency, not bytes"
    assert not compression_could_pay(cost_bound, size_bytes=100 << 20)
    barely = choose_interval(cpu_profile(persist_s=1.0, iter_s=1.0, cpu_copy_s=0.5))  # k = k_persist = 2
    assert not compression_could_pay(barely, size_bytes=100 << 20), "ceil(0.66 * 2) = 2: no clear gain possible"


def test_compression_wins_only_by_a_clear_margin_in_k():
    raw = choose_interval(cpu_profile(persist_s=30.0, interference_s=0.1))  # k 31
    rcfz = choose_interval(cpu_profile(persist_s=18.0, interference_s=0.3, compress=True))  # k 19 <= 0.8 * 31
    assert choose_codec({"raw": raw, "rcfz": rcfz}) == "rcfz"
    assert choose_codec({"raw": raw}) == "raw"
    close = choose_interval(cpu_profile(persist_s=26.0, interference_s=0.1, compress=True))  # k 27 > 24.8
    assert choose_codec({"raw": raw, "rcfz": close}) == "raw", "a gain within timing noise"
    slow_rcfz = choose_interval(cpu_profile(persist_s=29.0, interference_s=1.2, compress=True))  # kcost 35
    assert choose_codec({"raw": raw, "rcfz": slow_rcfz}) == "raw"


def test_with_a_fixed_k_compression_is_tried_once_and_only_when_the_persist_outlasts_k():
    assert fixed_interval_codec({"raw": 0.5}, interval_s=1.0) == "raw"
    assert fixed_interval_codec({"raw": 3.0, "rcfz": 2.0}, interval_s=1.0) == "rcfz"
    assert fixed_interval_codec({"raw": 3.0, "rcfz": 3.5}, interval_s=1.0) == "raw"
    fast = CodecTrial()
    assert fast.next_codec() == "raw"
    fast.record("raw", 0.2, interval_s=1.0)
    assert (fast.decided, fast.next_codec()) == ("raw", "raw")
    slow = CodecTrial()
    slow.record("raw", 4.0, interval_s=1.0)
    assert slow.decided is None and slow.next_codec() == "rcfz"
    slow.record("rcfz", 2.5, interval_s=1.0)
    assert slow.decided == "rcfz"
    slow.record("rcfz", 9.0, interval_s=1.0)
    assert slow.decided == "rcfz", "decided once"


def fresh_reference(window: ProfilingWindow, iter_s: float) -> None:
    """The quiet iterations a warm checkpoint waits for: REFERENCE_ITERS of them, no fewer."""
    assert not any(window.record_quiet(iter_s) for _ in range(REFERENCE_ITERS - 1))
    assert window.record_quiet(iter_s)


def busy_window(window: ProfilingWindow, iter_s: float) -> None:
    assert not any(window.record_busy(iter_s, persist_busy=False) for _ in range(MEASURE_ITERS - 1))
    assert not window.record_busy(iter_s, persist_busy=True), "the persist is still running"
    assert window.record_busy(iter_s, persist_busy=False)


def test_the_profiling_window_takes_ti_from_five_samples_after_warm_up_and_times_each_persist():
    window = ProfilingWindow(quiet_iters=2)  # asked for 2: still 2 warm-up + 5 samples
    times = [9.0, 3.0, 1.0, 1.0, 1.0, 1.0]
    assert not any(window.record_quiet(t) for t in times)
    assert window.record_quiet(1.0)
    assert window.iter_s() == 1.0
    window.start_measuring("raw")
    busy_window(window, 1.1)
    assert window.needs_warm_measurement(), "a codec's first checkpoint is cold"
    window.discard_cold()
    assert not window.measuring and not window.measured and window.next_codec == "raw"
    fresh_reference(window, 1.0)
    window.start_measuring("raw")
    busy_window(window, 1.1)
    assert not window.needs_warm_measurement()
    assert window.finish_measuring(copy_s=0.1, persist_s=0.5, size_bytes=10) is None, "1 of 3 warm samples"
    # a noisy sample, then a typical one; each persist long enough to cost what it did
    for busy_s, persist_s in ((1.5, 1.9), (1.2, 0.7)):
        fresh_reference(window, 1.0)
        window.start_measuring("raw")
        assert not window.needs_warm_measurement()
        assert not any(window.record_busy(busy_s, persist_busy=False) for _ in range(MEASURE_ITERS - 1))
        assert window.record_busy(busy_s, persist_busy=False)
        measured = window.finish_measuring(copy_s=0.1, persist_s=persist_s, size_bytes=10)
    # the median of the three warm samples: 5 x 0.1 (one busy iteration more: its persist
    # ran on), 4 x 0.5 and 4 x 0.2 s lost
    assert measured is not None and measured.interference_s == pytest.approx(MEASURE_ITERS * 0.2)
    assert measured.persist_s == pytest.approx(0.7)
    assert not window.measuring and window.measured["raw"] == measured
    window.start_measuring("rcfz")
    assert window.needs_warm_measurement(), "each codec gets its own warm measurement"


def test_where_checkpoint_work_never_stops_a_warm_checkpoint_waits_a_bounded_time():
    window = ProfilingWindow(quiet_iters=7)
    assert not any(window.record_quiet(1.0) for _ in range(6))
    assert window.record_quiet(1.0)
    window.start_measuring("raw")
    busy_window(window, 1.5)
    window.discard_cold()
    # epoch-end checkpoints keep a persist in flight: no fresh quiet iteration comes
    assert not any(window.record_waiting() for _ in range(REFERENCE_WAIT_ITERS - 1))
    assert window.record_waiting()
    window.start_measuring("raw")
    busy_window(window, 1.2)
    window.finish_measuring(copy_s=0.1, persist_s=1.5, size_bytes=10)  # as long as the 1 s it cost
    sample = window.samples["raw"][-1]
    assert sample.reference_s == pytest.approx(1.0)  # the newest quiet iterations there were
    assert sample.interference_s == pytest.approx(sample.busy_iters * 0.2)


def test_each_warm_checkpoint_is_compared_with_the_quiet_iterations_right_before_it():
    """A slow start (other processes still starting: 1.6 s iterations, then 1.0 s) must not
    hide the cost: the warm checkpoints lose 0.1 s per busy iteration against 1.0 s."""
    window = ProfilingWindow(quiet_iters=7)
    assert not any(window.record_quiet(t) for t in (2.0, 1.8, 1.6, 1.6, 1.6, 1.6))
    assert window.record_quiet(1.6)
    window.start_measuring("raw")
    busy_window(window, 1.7)
    window.discard_cold()
    for _ in range(WARM_SAMPLES):
        fresh_reference(window, 1.0)
        window.start_measuring("raw")
        busy_window(window, 1.1)
        measured = window.finish_measuring(copy_s=0.1, persist_s=0.5, size_bytes=10)
    assert measured is not None
    assert measured.busy_iters == MEASURE_ITERS + 1  # one more while the persist ran on
    assert measured.interference_s == pytest.approx(measured.busy_iters * 0.1)
    assert measured.reference_s == pytest.approx(1.0)
