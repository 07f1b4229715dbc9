"""The planner alone, on plain numbers: no model, no store, no threads, no clock.

A small simulated loop stands in for the engine: each step it reports the iteration just
timed (``observe``), a persist that finished (``record_persist``), and asks for the plan.
A checkpoint's persist runs for ``persist_iters`` iterations, slowing each by
``slowdown_s``; the iteration after a checkpoint carries ``stall_s`` (the fence).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest

from ray_checkfreq.engine.config import CheckFreqConfig
from ray_checkfreq.engine.persist import PersistResult
from ray_checkfreq.engine.planner import Planner
from ray_checkfreq.engine.policy import Profile
from ray_checkfreq.engine.seams import Action
from ray_checkfreq.engine.stats import EngineStats

ITER_S = 0.1


@dataclass
class Loop:
    planner: Planner
    persist_iters: int = 10
    slowdown_s: float = 0.01  # each iteration a persist runs beside
    stall_s: float = 0.0  # the iteration right after a checkpoint
    persist_s: float = 1.0
    lookahead: int = 0
    stop_at: int | None = None
    now: int = 0
    actions: list[Action] = field(default_factory=list)
    _in_flight: tuple[int, int, str] | None = None  # (step, done at, codec)
    _due: list[Action] = field(default_factory=list)  # planned ahead, not applied yet

    def run(self, steps: int) -> Loop:
        for _ in range(steps):
            self.step()
        return self

    def step(self) -> None:
        self.now += 1
        busy = self._in_flight is not None
        after_checkpoint = bool(self.actions) and self.actions[-1].checkpoint \
            and self.actions[-1].iteration == self.now - 1
        if self.now > 1:
            iter_s = ITER_S + (self.slowdown_s if busy else 0.0) + (self.stall_s if after_checkpoint else 0.0)
            self.planner.observe(self.now, iter_s, self.stall_s if after_checkpoint else 0.0, busy)
        self.planner.record_update(0.02)
        if self._in_flight is not None and self.now >= self._in_flight[1]:
            step, _, codec = self._in_flight
            self._in_flight = None
            self._report(step, codec)
        planned = self.planner.plan(self.now + self.lookahead, now=self.now, stop_at=self.stop_at)
        if planned is not None:
            self._due.append(planned)
        while self._due and self._due[0].iteration == self.now:
            self._apply(self._due.pop(0))
        self.planner.end_step()

    def _report(self, step: int, codec: str) -> None:
        self.planner.record_persist(PersistResult(step=step, seconds=self.persist_s, copy_s=0.05, codec=codec,
                                                  raw_bytes=1000, stored_bytes=1000, uri=""))

    def _apply(self, action: Action) -> None:
        self.actions.append(action)
        if action.checkpoint:
            if self._in_flight is not None:  # a checkpoint waits for the persist in flight
                self._report(*self._in_flight[::2])
            self._in_flight = (action.iteration, self.now + self.persist_iters, action.codec or "raw")

    def checkpoints(self) -> list[int]:
        return [a.iteration for a in self.actions if a.checkpoint]


def planner(**config) -> Planner:
    p = Planner(CheckFreqConfig(**config), stats=EngineStats(), forced_codec="raw")
    p.begin(0)
    return p


def profile(**overrides) -> Profile:
    # To = max(0, 0.05 - (0.1 - 0.02)) = 0; persist needs ceil((0.05 + 0.95) / 0.1) = 10;
    # the measured cost 0.1 s needs ceil(0.1 / (0.035 * 0.1)) = 29: k = 29.
    values = dict(iter_s=ITER_S, update_s=0.02, cpu_copy_s=0.05, persist_s=0.95, size_bytes=1000,
                  interference_s=0.1)
    return Profile(**{**values, **overrides})


def test_profiling_measures_a_cold_then_three_warm_checkpoints_then_plans_every_k():
    p = planner(profile_iters=10)
    loop = Loop(p).run(300)
    profiling = [a.iteration for a in loop.actions if a.checkpoint and a.k is None]
    # 10 quiet iterations (2..11) first; then each checkpoint's 10 busy iterations and one to
    # see it done; then 8 fresh quiet ones before each warm one.
    assert profiling == [11, 30, 49, 68]
    assert [a.codec for a in loop.actions if a.checkpoint and a.k is None] == ["raw"] * 4
    decided = next(a for a in loop.actions if a.k is not None)
    assert decided.checkpoint is False and decided.k == 29 and decided.iteration == 79
    assert p.policy_ready and p.profile is not None
    assert p.profile.iter_s == pytest.approx(ITER_S) and p.profile.update_s == pytest.approx(0.02)
    assert p.profile.persist_s == pytest.approx(0.95) and p.profile.interference_s == pytest.approx(0.1)
    after = [i for i in loop.checkpoints() if i > 68]
    assert after[0] == 68 + 29 and {b - a for a, b in zip(after, after[1:])} == {29}
    assert p.stats.checkpoints_by_cause == {"interval": len(after), "epoch_end": 0, "profiling": 4, "notice": 0,
                                            "stop": 0}
    assert p.stats.k_history == [{"iteration": 79, "k": 29, "reason": "profile"}]
    assert p.take_new_profile() == p.profile and p.take_new_profile() is None, "handed out once, to be cached"


def test_measuring_cost_spans_each_profiling_checkpoints_busy_window_and_nothing_else():
    loop = Loop(planner(profile_iters=10))
    measuring = [loop.now for _ in range(100) if not loop.step() and loop.planner.measuring_cost]
    # Measuring starts where each profiling checkpoint (11, 30, 49, 68) is planned and lasts
    # through its busy iterations; never in the quiet stretches nor once k is decided.
    starts = [i for i in measuring if i - 1 not in measuring]
    ends = [i for i in measuring if i + 1 not in measuring]
    assert starts == [11, 30, 49, 68]
    assert ends == [21, 40, 59, 78]


def test_epoch_ends_are_checkpoints_between_those_every_k():
    loop = Loop(planner(every=10, epoch_len=25), persist_iters=1).run(60)
    assert loop.checkpoints() == [10, 20, 25, 35, 45, 50, 60]
    assert [a.iteration for a in loop.actions if a.epoch_boundary] == [25, 50]
    assert loop.planner.stats.checkpoints_by_cause["epoch_end"] == 2


def test_without_epoch_end_checkpoints_only_k_counts_and_an_epoch_end_on_it_is_still_marked():
    loop = Loop(planner(every=10, epoch_len=25, checkpoint_epoch_end=False), persist_iters=1).run(60)
    assert loop.checkpoints() == [10, 20, 30, 40, 50, 60]
    assert [a.iteration for a in loop.actions if a.epoch_boundary] == [50]


def test_an_epoch_end_during_profiling_is_a_checkpoint_with_the_codec_being_measured():
    loop = Loop(planner(profile_iters=10, epoch_len=15)).run(16)
    assert loop.checkpoints() == [11, 15]
    assert loop.actions[-1].epoch_boundary and loop.actions[-1].codec == "raw"
    assert loop.planner.stats.checkpoints_by_cause == {"interval": 0, "epoch_end": 1, "profiling": 1, "notice": 0,
                                                       "stop": 0}


def adopted(**config) -> Planner:
    p = planner(**config)
    p.adopt_cached_profile(profile(), now=0)
    return p


def test_the_lost_work_cap_bounds_the_policys_k():
    capped = adopted(epoch_len=100, max_lost_fraction=0.1, lost_work_floor_s=0.0)
    assert capped.k == 10 and capped.decision is not None and capped.decision.capped
    assert capped.decision.k_uncapped == 29 and capped.decision.k_cap == 10
    assert Loop(capped, persist_iters=1).run(35).checkpoints() == [10, 20, 30]
    uncapped = adopted(epoch_len=100, max_lost_fraction=None)
    assert uncapped.k == 29 and uncapped.decision is not None and not uncapped.decision.capped


def test_the_lost_work_floor_lifts_the_cap_where_an_epoch_is_short_in_seconds():
    # 10 % of 100 iterations is 1 s of work: under the 5 s floor, so up to 50 iterations may be lost.
    p = adopted(epoch_len=100, max_lost_fraction=0.1, lost_work_floor_s=5.0)
    assert p.k == 29 and p.decision is not None and p.decision.k_cap == 50


def test_the_adaptive_rate_raises_k_when_checkpoints_cost_more_than_p():
    p = adopted()
    # Each checkpoint stalls the next iteration by 0.5 s: 0.5 / (29 * 0.1) = 17 % against p = 3.5 %.
    loop = Loop(p, persist_iters=5, slowdown_s=0.0, stall_s=0.5).run(1200)
    assert p.adaptive is not None
    raised = [entry for entry in p.stats.k_history if entry["reason"].startswith("measured overhead")]
    assert raised and all(b["k"] > a["k"] for a, b in zip([{"k": 29}, *raised], raised)), p.stats.k_history
    assert p.k is not None and p.k > 2 * 29
    carried = [a.k for a in loop.actions if a.k is not None]
    changes = [k for i, k in enumerate(carried) if i == 0 or k != carried[i - 1]]
    assert changes == [entry["k"] for entry in p.stats.k_history], "every new k reaches the ranks in an action"
    gaps = [b - a for a, b in zip(loop.checkpoints(), loop.checkpoints()[1:])]
    assert gaps[0] == 29 and gaps[-1] > 2 * 29


def test_without_local_adaptation_k_moves_only_by_set_k():
    p = Planner(CheckFreqConfig(), stats=EngineStats(), forced_codec="raw", local_adaptive=False)
    p.begin(0)
    p.set_k(7, now=0)
    assert p.k is None, "before the policy decided: ignored"
    p.adopt_cached_profile(profile(), now=0)
    loop = Loop(p, persist_iters=5, slowdown_s=0.0, stall_s=0.5).run(30)
    assert p.adaptive is None and p.k == 29
    p.set_k(5, now=loop.now)  # the next checkpoint moves to the last one (29) + 5
    loop.run(30)
    assert loop.checkpoints() == [29, 34, 39, 44, 49, 54, 59]
    assert [a.k for a in loop.actions if a.iteration == 31] == [5], "the next action carries the new k"
    assert p.stats.k_history[-1] == {"iteration": 30, "k": 5, "reason": "shared policy"}
    with pytest.raises(ValueError, match="k=0"):
        p.set_k(0, now=loop.now)


def test_a_stop_checkpoints_at_its_iteration_once_and_then_nothing_is_planned():
    loop = Loop(planner(every=10), persist_iters=1, stop_at=13).run(40)
    assert loop.checkpoints() == [10, 13]
    stop = loop.actions[-1]
    assert stop.stop and stop.checkpoint and stop.iteration == 13 and stop.k == 10
    assert loop.planner.stats.checkpoints_by_cause["stop"] == 1


def test_a_stop_planned_ahead_lands_on_the_first_iteration_planned_at_or_after_it():
    loop = Loop(planner(every=10), persist_iters=1, lookahead=1)
    loop.run(12)
    loop.stop_at = 12  # already planned up to 13
    loop.run(10)
    assert [(a.iteration, a.stop) for a in loop.actions if a.checkpoint] == [(10, False), (14, True)]


def test_a_new_k_is_announced_once_even_without_a_checkpoint():
    p = adopted()
    loop = Loop(p, persist_iters=1).run(5)
    assert loop.actions == [Action(iteration=1, k=29)]


def test_the_compression_trial_waits_for_the_persist_only_when_its_checkpoint_is_applied_now():
    p = Planner(CheckFreqConfig(every=5), stats=EngineStats())  # the codec is measured
    p.begin(0)
    assert p.needs_settled_persist(5, now=5) and not p.needs_settled_persist(4, now=4)
    assert not p.needs_settled_persist(5, now=4), "planned ahead: no waiting"
    assert p.needs_settled_persist(3, now=3, stop_at=3)
    # The raw persist (2 s) outlasts k iterations (0.5 s): the next checkpoint tries compression.
    loop = Loop(p, persist_iters=2, persist_s=2.0).run(10)
    assert [a.codec for a in loop.actions if a.checkpoint] == ["raw", "rcfz"]
    decided = Planner(CheckFreqConfig(every=5), stats=EngineStats(), forced_codec="raw")
    decided.begin(0)
    assert not decided.needs_settled_persist(5, now=5), "nothing to measure"


def test_a_requested_checkpoint_is_taken_once_out_of_turn_and_the_interval_counts_on_from_it():
    loop = Loop(planner(every=10), persist_iters=1, lookahead=1)
    loop.run(13)
    loop.planner.request_checkpoint(15)  # a preemption notice's: the next iteration it can plan
    loop.run(25)
    assert loop.checkpoints() == [10, 15, 25, 35]
    assert loop.planner.stats.checkpoints_by_cause["notice"] == 1
    with pytest.raises(ValueError, match="at=-1"):
        loop.planner.request_checkpoint(-1)
