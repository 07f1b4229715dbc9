"""The chaos injector's pure parts: schedules, the report over a synthetic event log, CLI flags, hold points."""

from __future__ import annotations

import glob
import os
import subprocess
import sys
import threading
import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ray_checkfreq.chaos import holds, report, schedule
from ray_checkfreq.chaos.runner import ChaosConfig, plan

KIND_LISTS = st.lists(st.sampled_from(sorted(schedule.KINDS)), min_size=1, max_size=7).map(tuple)


# ---------------------------------------------------------------------- schedules
@settings(max_examples=200, deadline=None)
@given(count=st.integers(0, 12), first=st.integers(1, 50), span=st.integers(0, 400), gap=st.integers(1, 30),
       seed=st.integers(0, 2**32), kinds=KIND_LISTS)
def test_seeded_random_iterations_are_in_the_window_apart_and_reproducible(count, first, span, gap, seed, kinds):
    last = first + span
    if count > 1 and (count - 1) * gap > span:
        with pytest.raises(ValueError, match="do not fit"):
            schedule.seeded_random(count, kinds, first=first, last=last, min_gap=gap, seed=seed)
        return
    drawn = schedule.seeded_random(count, kinds, first=first, last=last, min_gap=gap, seed=seed)
    at = [p.at_iteration for p in drawn]
    assert len(at) == count and all(first <= i <= last for i in at)
    assert all(b - a >= gap for a, b in zip(at, at[1:]))
    assert [p.kind for p in drawn] == [kinds[n % len(kinds)] for n in range(count)]
    assert drawn == schedule.seeded_random(count, kinds, first=first, last=last, min_gap=gap, seed=seed)


def test_a_different_seed_gives_a_different_random_schedule():
    draws = {tuple(p.at_iteration for p in schedule.seeded_random(4, ("node",), first=5, last=500, min_gap=5,
                                                                   seed=seed)) for seed in range(20)}
    assert len(draws) > 15


@settings(max_examples=100, deadline=None)
@given(count=st.integers(0, 30), mtbp=st.floats(0.1, 1e4), seed=st.integers(0, 2**32), kinds=KIND_LISTS)
def test_poisson_gaps_are_positive_and_reproducible(count, mtbp, seed, kinds):
    drawn = schedule.poisson(count, kinds, mtbp_s=mtbp, seed=seed)
    assert len(drawn) == count and all(p.after_s > 0 and p.at_iteration is None for p in drawn)
    assert drawn == schedule.poisson(count, kinds, mtbp_s=mtbp, seed=seed)


def test_poisson_gaps_have_the_mean_asked_for():
    gaps = [p.after_s for p in schedule.poisson(4000, ("worker",), mtbp_s=30.0, seed=7)]
    assert sum(gaps) / len(gaps) == pytest.approx(30.0, rel=0.06)
    # exponential: about 1/e of the gaps exceed the mean
    assert sum(g > 30.0 for g in gaps) / len(gaps) == pytest.approx(0.368, abs=0.03)


@settings(max_examples=100, deadline=None)
@given(iterations=st.lists(st.integers(1, 10_000), min_size=0, max_size=10, unique=True), kinds=KIND_LISTS)
def test_given_iterations_fire_in_order(iterations, kinds):
    drawn = schedule.at_iterations(iterations, kinds)
    assert [p.at_iteration for p in drawn] == sorted(iterations)
    assert [p.index for p in drawn] == list(range(len(iterations)))


def test_bad_schedules_name_the_value():
    with pytest.raises(ValueError, match="mtbp_s=0"):
        schedule.poisson(2, ("node",), mtbp_s=0, seed=1)
    with pytest.raises(ValueError, match=r"iterations \[3, 3\]"):
        schedule.at_iterations([3, 3], ("node",))
    with pytest.raises(ValueError, match="'meteor'"):
        schedule.Preemption(index=0, kind="meteor", at_iteration=3)
    with pytest.raises(ValueError, match="exactly one"):
        schedule.Preemption(index=0, kind="node", at_iteration=3, after_s=1.0)


def test_the_default_plan_spreads_the_kinds_over_the_run():
    drawn = plan(ChaosConfig(preemptions=4, kinds=("persist", "commit", "node", "notice"), iterations=56, every=4))
    assert [p.kind for p in drawn] == ["persist", "commit", "node", "notice"]
    at = [p.at_iteration for p in drawn]
    assert at[0] > 4 and at[-1] < 56 and all(b - a >= 8 for a, b in zip(at, at[1:]))


def test_config_is_validated():
    with pytest.raises(ValueError, match="'meteor'"):
        ChaosConfig(kinds=("node", "meteor"))
    with pytest.raises(ValueError, match="schedule='daily'"):
        ChaosConfig(schedule="daily")
    with pytest.raises(ValueError, match="more workers than the 2 training nodes"):
        ChaosConfig(workers=3, nodes=2)
    with pytest.raises(ValueError, match=r"workers=\(2, 1\)"):
        ChaosConfig(workers=(2, 1))
    with pytest.raises(ValueError, match="does not divide by 3 workers"):
        ChaosConfig(workers=(2, 4), nodes=4)
    with pytest.raises(ValueError, match="at="):
        ChaosConfig(at=(0, 5))
    with pytest.raises(ValueError, match="every=0"):
        ChaosConfig(every=0)


def test_with_the_policy_the_job_gets_no_k_and_the_schedule_is_spaced_as_for_k_4():
    policy = ChaosConfig(every=None, preemptions=3, iterations=56)
    assert policy.interval is None
    fixed = ChaosConfig(every=4, preemptions=3, iterations=56)
    assert [p.at_iteration for p in plan(policy)] == [p.at_iteration for p in plan(fixed)]
    assert ChaosConfig(every=4, checkpoints="epoch").interval == 28


class _PolicyEngine:
    applied_k: int | None = None


class _FakeCheckFreq:
    """What the chaos job's loop uses of CheckFreq: the policy picks k 2 at step 3, 5 at step 6."""

    def __init__(self) -> None:
        self.iteration = 0
        self.engine = _PolicyEngine()

    def step(self) -> None:
        self.iteration += 1
        self.engine.applied_k = None if self.iteration < 3 else 2 if self.iteration < 6 else 5


@pytest.mark.parametrize(("rank", "every", "logged"), [(0, None, [(3, 2), (6, 5)]), (1, None, []), (0, 4, [])])
def test_with_the_policy_rank0_logs_each_k_it_switches_to(tmp_path, rank, every, logged):
    import json

    import torch

    from ray_checkfreq.chaos import job

    images, labels = job.digits(8)
    model = job.small_cnn()
    log = job.EventLog(str(tmp_path), rank)
    job._train_loop({"iterations": 8, "every": every}, _FakeCheckFreq(), [[0, 1], [2, 3], [4, 5], [6, 7]], model,
                    torch.optim.SGD(model.parameters(), lr=0.1), images, labels, log, 4)
    with open(log.path) as lines:
        events = [json.loads(line) for line in lines]
    assert [(e["iteration"], e["k"]) for e in events if e["event"] == "k"] == logged
    assert [e["iteration"] for e in events if e["event"] == "batch"] == list(range(1, 9))


def test_every_0_on_the_command_line_is_the_policy():
    import argparse

    from ray_checkfreq.chaos.cli import add_parser, config_from_args

    parser = argparse.ArgumentParser()
    add_parser(parser.add_subparsers())
    assert config_from_args(parser.parse_args(["chaos", "--every", "0"])).every is None
    assert config_from_args(parser.parse_args(["chaos", "--every", "6"])).every == 6


# ---------------------------------------------------------------------- report
SAMPLES, BATCH, EPOCH_LEN = 8, 4, 2  # 2 iterations per epoch, 2 ranks of 2 samples each


def _batches(attempt: int, iterations: range, t0: float) -> list[dict]:
    out = []
    for n, i in enumerate(iterations):
        epoch, within = divmod(i - 1, EPOCH_LEN)
        ids = _perm(epoch)[within * BATCH:(within + 1) * BATCH]
        for rank in (0, 1):
            out.append({"t": t0 + n + rank * 0.01, "event": "batch", "rank": rank, "attempt": attempt,
                        "iteration": i, "epoch": epoch, "ids": ids[rank * 2:(rank + 1) * 2]})
    return out


def _perm(epoch: int) -> list[int]:
    return [(5 * j + 3 * epoch) % SAMPLES for j in range(SAMPLES)]


def _start(attempt: int, iteration: int, t: float, kind: str = "slot") -> list[dict]:
    return [{"t": t, "event": "start", "rank": r, "attempt": attempt, "iteration": iteration, "world_size": 2,
             "node": f"n{r}", "pid": 100 + r, "run": "run", "k": 2, "samples": SAMPLES, "global_batch": BATCH,
             "epoch_len": EPOCH_LEN, "restore": {"kind": "none" if iteration == 0 else kind}} for r in (0, 1)]


def _log() -> list[dict]:
    """8 iterations (4 epochs); attempt 1 reaches 5, a node dies, attempt 2 resumes at 4 and finishes."""
    events = [{"t": 0.0, "event": "run_start"}, *_start(1, 0, 1.0), *_batches(1, range(1, 6), 2.0)]
    events.append({"t": 7.5, "event": "inject", "index": 0, "kind": "node", "t_kill": 7.6, "iteration": 5})
    events += [{"t": 3.5, "event": "commit", "step": 2}, {"t": 5.5, "event": "commit", "step": 4}]
    events += [*_start(2, 4, 20.0), *_batches(2, range(5, 9), 21.6)]
    events += [{"t": 30.0, "event": "end", "rank": r, "attempt": 2, "iteration": 8} for r in (0, 1)]
    return events


def test_report_counts_lost_work_restart_time_and_no_lost_or_repeated_samples():
    totals = report.build_report(_log(), identical=True)
    assert totals["preemptions"] == 1 and totals["preemptions_survived"] == 1 and totals["finished"]
    assert totals["lost_iterations_max"] == 1 and totals["lost_iterations_bound"] == 4 and totals["k_max"] == 2
    assert totals["restart_to_first_step_s_mean"] == pytest.approx(21.6 - 7.6)
    assert totals["samples_lost"] == 0 and totals["samples_repeated"] == 0
    assert totals["commits"] == 2 and totals["time_to_finish_s"] == pytest.approx(30.0)
    outcome = totals["detail"]["preemptions"][0]
    assert outcome["restored_step"] == 4 and outcome["restored_from"] == "slot"


def test_with_the_policy_the_bound_uses_the_largest_k_it_picked():
    events = [dict(e, k=None) if e["event"] == "start" else e for e in _log()]
    events += [{"t": 2.5, "event": "k", "rank": 0, "attempt": 1, "iteration": 1, "k": 1},
               {"t": 4.5, "event": "k", "rank": 0, "attempt": 1, "iteration": 3, "k": 3},
               {"t": 4.5, "event": "k", "rank": 1, "attempt": 1, "iteration": 3, "k": 9}]  # not rank 0's: ignored
    totals = report.build_report(events)
    assert totals["k_max"] == 3 and totals["lost_iterations_bound"] == 6


def test_report_sees_a_repeated_sample():
    events = _log()
    dup = next(e for e in events if e["event"] == "batch" and e["attempt"] == 2 and e["iteration"] == 6)
    dup["ids"] = [dup["ids"][0], dup["ids"][0]]  # one sample twice, another never
    totals = report.build_report(events)
    assert totals["samples_repeated"] == 1 and totals["samples_lost"] == 1


def test_report_sees_a_restart_that_replayed_rolled_back_batches_as_repeats():
    # the second attempt claims to resume at 5 but trains iteration 5 again (a restore that did nothing)
    events = [e for e in _log() if not (e["event"] == "start" and e["attempt"] == 2)] + _start(2, 5, 20.0)
    totals = report.build_report(events)
    assert totals["samples_repeated"] == 4 and totals["lost_iterations_max"] == 0


def test_report_sees_lost_samples_when_a_restart_skips_ahead():
    events = [e for e in _log() if not (e["event"] == "batch" and e["attempt"] == 2 and e["iteration"] == 5)]
    totals = report.build_report(events)
    assert totals["samples_lost"] == 4 and totals["samples_repeated"] == 0


def test_lost_work_beyond_2k_is_flagged():
    events = [e for e in _log() if not (e["event"] == "start" and e["attempt"] == 2)
              and not (e["event"] == "batch" and e["attempt"] == 2)]
    events += [*_start(2, 0, 20.0, kind="storage"), *_batches(2, range(1, 9), 21.0)]
    totals = report.build_report(events)
    assert totals["lost_iterations_max"] == 5 and not totals["lost_within_bound"]
    assert totals["samples_lost"] == 0 and totals["samples_repeated"] == 0


def test_a_preemption_without_restart_loses_nothing():
    events = _log() + [{"t": 3.2, "event": "inject", "index": 1, "kind": "agent", "t_kill": 3.2, "iteration": 2}]
    outcomes = report.build_report(events)["detail"]["preemptions"]
    assert [(o["kind"], o["restarted"], o["lost_iterations"]) for o in outcomes] == [("agent", False, 0),
                                                                                    ("node", True, 1)]


def test_the_iterations_lost_after_each_notice_are_reported():
    events = [dict(e, kind="notice") if e["event"] == "inject" else e for e in _log()]
    for event in events:
        if event["event"] == "start" and event["attempt"] == 2:
            event["restore"] = {"kind": "slot", "lost_after_notice": 0}
    totals = report.build_report(events, identical=True)
    assert totals["detail"]["preemptions"][0]["lost_after_notice"] == 0
    assert "iterations lost after each notice (None: not counted): 0" in report.describe(totals)


def test_the_cpu_hog_spins_beside_the_block_and_ends_with_it():
    import multiprocessing

    from ray_checkfreq.chaos.hog import cpu_hog

    with cpu_hog(2):
        hogs = [p for p in multiprocessing.active_children() if p.name.startswith("rcf-hog-")]
        assert len(hogs) == 2 and all(p.is_alive() for p in hogs)
    assert not any(p.is_alive() for p in hogs)
    with pytest.raises(ValueError, match="processes=-1"):
        with cpu_hog(-1):
            pass


def test_timeline_png_is_written(tmp_path):
    events = _log()
    out = tmp_path / "t.png"
    report.plot_timeline(events, report.build_report(events, identical=True), str(out))
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


# ---------------------------------------------------------------------- hold points
def test_exactly_one_process_claims_an_armed_hold_and_says_where(tmp_path):
    control = str(tmp_path)
    holds.hold_here(control, "commit")  # not armed: returns at once
    holds.arm(control, "commit", hold_s=0.5)
    threads = [threading.Thread(target=holds.hold_here, args=(control, "commit"), kwargs={"step": 8})
               for _ in range(4)]
    started = time.monotonic()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    marker = holds.inside(control, "commit")
    assert marker["pid"] == os.getpid() and marker["step"] == 8
    assert 0.4 < time.monotonic() - started < 3
    assert not os.path.exists(os.path.join(control, "arm-commit"))
    assert len([f for f in os.listdir(control) if f.startswith("claimed-commit")]) == 1


def test_a_store_on_the_holding_filesystem_stops_inside_the_commit_and_a_kill_there_leaves_no_checkpoint(tmp_path):
    control, root = str(tmp_path / "control"), str(tmp_path / "store")
    holds.arm(control, "commit", hold_s=60)
    script = ("import numpy as np\nfrom ray_checkfreq import CheckpointStore\n"
              "from ray_checkfreq.chaos.holds import holding_filesystem\n"
              f"s = CheckpointStore({root!r}, filesystem=holding_filesystem({control!r}))\n"
              "s.save(1, {'w': np.ones(10)})\n")
    child = subprocess.Popen([sys.executable, "-c", script])
    deadline = time.monotonic() + 60
    while holds.inside(control, "commit") is None:
        assert child.poll() is None and time.monotonic() < deadline, "never reached the commit"
        time.sleep(0.02)
    marker = holds.inside(control, "commit")
    assert marker["pid"] == child.pid and marker["path"].endswith("/manifest.json")
    # written under a temporary name of its own, staged at the root outside the step directory, not yet moved
    assert glob.glob(os.path.join(root, ".staging-*.tmp"))
    assert not glob.glob(os.path.join(os.path.dirname(marker["path"]), "*.tmp"))
    child.kill()
    child.wait()
    from ray_checkfreq import CheckpointStore

    store = CheckpointStore(root)
    assert store.latest() is None
    assert [fault for ref, _, fault in store.scan()] == [None]  # an interrupted save, not a checkpoint


def test_a_persist_hold_falls_on_the_armed_step_only_on_the_armed_nodes_and_a_release_ends_it(tmp_path):
    """The one fault-injection mechanism the Ray tests use on a node agent's persist: a store
    on the holding file system, armed from a step (an earlier step's persist passes), for
    some nodes, released early once the test has seen what it waits for."""
    import numpy as np

    from ray_checkfreq import CheckpointStore

    control = str(tmp_path / "control")
    store = CheckpointStore(str(tmp_path / "store"), filesystem=holds.holding_filesystem(control))
    holds.arm(control, "persist", hold_s=60, nodes=["another-node"])
    store.save(1, {"w": np.ones(4)})  # this process is on no listed node: not held
    assert holds.inside(control, "persist") is None and os.path.exists(os.path.join(control, "arm-persist"))
    holds.arm(control, "persist", hold_s=60, from_step=3)
    started = time.monotonic()
    saver = threading.Thread(target=lambda: [store.save(step, {"w": np.full(4, step)}) for step in (2, 3)])
    saver.start()
    while holds.inside(control, "persist") is None:
        assert saver.is_alive() and time.monotonic() - started < 30, "the persist of step 3 was never held"
        time.sleep(0.02)
    marker = holds.inside(control, "persist")
    assert marker["step"] == 3 and "step-000000000003" in marker["path"]
    assert store.latest().step == 2  # step 2 passed; 3 waits inside its persist, uncommitted
    holds.release(control, "persist")
    saver.join(timeout=30)
    assert not saver.is_alive() and time.monotonic() - started < 30  # released, not timed out
    assert store.latest().step == 3


# ---------------------------------------------------------------------- CLI
def test_help_documents_every_kind_and_schedule(capsys):
    from ray_checkfreq import cli

    with pytest.raises(SystemExit) as done:
        cli.main(["chaos", "--help"])
    assert done.value.code == 0
    text = capsys.readouterr().out
    for name in (*schedule.KINDS, *schedule.SCHEDULES):
        assert f"  {name} " in text, name
    for flag in ("--preemptions", "--seed", "--kinds", "--schedule", "--mtbp-s", "--json", "--png", "--compare"):
        assert flag in text, flag


@pytest.mark.parametrize(("args", "named"), [
    (["--kinds", "node,meteor"], "'meteor'"),
    (["--preemptions", "-1"], "--preemptions=-1"),
    (["--schedule", "poisson", "--mtbp-s", "0"], "--mtbp-s=0"),
    (["--workers", "5", "--nodes", "3"], "more workers than the 3 training nodes"),
    (["--min-workers", "3", "--workers", "2"], "workers=(3, 2)"),
    (["--at", "4,x"], "--at '4,x'"),
    (["--every", "-1"], "--every=-1"),
])
def test_bad_flags_name_the_value(args, named, capsys):
    from ray_checkfreq import cli

    assert cli.main(["chaos", *args]) == 1  # refused before any cluster starts
    assert named in capsys.readouterr().err


# ---------------------------------------------------------------------- injector triggers
def test_the_next_preemption_waits_for_the_restarted_job_not_for_steps_of_dying_processes(tmp_path):
    from ray_checkfreq.chaos.runner import Injector

    drawn = schedule.at_iterations([5, 8], ("node", "worker"))
    injector = Injector(None, ChaosConfig(progress=None), str(tmp_path), drawn)  # type: ignore[arg-type]
    injector._absorb(_start(1, 0, 1.0) + _batches(1, range(1, 7), 2.0))
    assert injector._due(drawn[0]) and not injector._due(drawn[1])
    # the node of rank 0 is removed at t=10; its processes still log iterations 7-9 just after
    injector._last_kill_t, injector._restart_after, injector._resumed_t = 10.0, 9.5, None
    injector._absorb([dict(b, t=10.2 + n * 0.01) for n, b in enumerate(_batches(1, range(7, 10), 0.0))])
    assert injector.view.iteration == 9 and not injector._due(drawn[1])
    injector._absorb(_start(2, 6, 30.0) + _batches(2, range(7, 9), 31.0))
    assert injector._due(drawn[1])


def test_after_an_agent_kill_the_same_attempt_training_on_is_enough(tmp_path):
    from ray_checkfreq.chaos.runner import Injector

    drawn = schedule.at_iterations([3, 5], ("agent", "worker"))
    injector = Injector(None, ChaosConfig(progress=None), str(tmp_path), drawn)  # type: ignore[arg-type]
    injector._absorb(_start(1, 0, 1.0) + _batches(1, range(1, 4), 2.0))
    injector._last_kill_t, injector._restart_after, injector._resumed_t = 4.5, None, None
    injector._absorb(_batches(1, range(4, 6), 5.0))
    assert injector._due(drawn[1])


def test_the_jobs_digits_are_scikit_learns_first_samples():
    import torch
    from sklearn.datasets import load_digits

    from ray_checkfreq.chaos.job import digits

    images, labels = digits(1792)
    expected = load_digits()
    assert torch.equal(images, torch.tensor(expected.images[:1792], dtype=torch.float64).unsqueeze(1) / 16.0)
    assert torch.equal(labels, torch.tensor(expected.target[:1792], dtype=torch.int64))


@pytest.mark.parametrize("bad", [{"workers": 0}, {"workers": (3, 2)}, {"workers": (1, 2, 3)}, {"workers": True},
                                 {"name": ""}, {"max_failures": -2}, {"num_to_keep": 0}])
def test_a_train_job_names_its_bad_setting(bad: dict) -> None:
    from ray_checkfreq.chaos.harness import TrainJob

    settings = {"train": print, "name": "run", "storage_path": "/tmp/x", **bad}
    with pytest.raises(ValueError, match=next(iter(bad))):
        TrainJob(**settings)


# ------------------------------------------------------------------ bounded Ray Train runs
def test_a_run_past_its_timeout_fails_by_name_after_its_controllers_are_ended():
    from ray_checkfreq.chaos.harness import bounded_call

    ended, release = [], threading.Event()
    started = time.monotonic()
    outcome = bounded_call(lambda: release.wait(30), timeout_s=0.2, what="Ray Train run 'stuck'",
                           on_timeout=lambda: ended.append(time.monotonic()))
    release.set()
    assert isinstance(outcome, TimeoutError) and "Ray Train run 'stuck'" in str(outcome), outcome
    assert "timeout_s=0.2 s" in str(outcome)
    assert len(ended) == 1 and 0.2 <= ended[0] - started < 5


def test_a_bounded_run_gives_back_its_result_or_its_own_error():
    from ray_checkfreq.chaos.harness import TrainJob, bounded_call

    def fail() -> None:
        raise RuntimeError("the run's own failure")

    called: list[int] = []
    never = called.append
    assert bounded_call(lambda: 42, timeout_s=5, what="x", on_timeout=lambda: never(1)) == 42
    assert bounded_call(lambda: 7, timeout_s=None, what="x", on_timeout=lambda: never(1)) == 7
    error = bounded_call(fail, timeout_s=5, what="x", on_timeout=lambda: never(1))
    assert isinstance(error, RuntimeError) and str(error) == "the run's own failure"
    with pytest.raises(ValueError, match="timeout_s=0"):
        TrainJob(train=print, name="n", storage_path="/tmp", timeout_s=0)
    assert not called  # no timeout, no controller killed


class _Nodes:
    """A cluster's node set, as the node kinds see it."""

    def __init__(self, *nodes: str) -> None:
        self.held = set(nodes)

    def node_ids(self) -> set[str]:
        return set(self.held)

    def remove(self, node_id: str) -> None:
        self.held.remove(node_id)


def test_the_nodes_of_one_trace_instant_go_together_and_a_later_loss_waits_for_the_restart(tmp_path):
    import time

    from ray_checkfreq.chaos.runner import Injector

    drawn = [schedule.Preemption(index=n, kind="node", at_s=at, target=0) for n, at in enumerate((1.0, 1.0, 2.0))]
    injector = Injector(None, ChaosConfig(progress=None), str(tmp_path), drawn)  # type: ignore[arg-type]
    assert not injector._due(drawn[0])  # before the first step: the trace's clock has not started
    now = time.time()
    injector._absorb(_start(1, 0, now - 5.0) + _batches(1, range(1, 3), now - 4.0))
    injector._resumed_t = now - 4.0
    assert injector._due(drawn[0]) and injector._due(drawn[2])
    # the first loss fired: the job restarts
    injector._resumed_t, injector._fired_at_s, injector._last_kill_t = None, 1.0, now
    assert injector._due(drawn[1])  # a second node of the same instant goes at once
    assert not injector._due(drawn[2])  # a later one waits until the job trains again
    injector._absorb(_start(2, 2, now + 1.0) + _batches(2, range(3, 5), now + 1.5))
    assert injector._due(drawn[2])


def test_a_second_loss_before_the_restart_takes_a_node_still_up():
    from ray_checkfreq.chaos.kinds import JobView, _node

    view = JobView(ranks={r: start for r, start in enumerate(_start(1, 0, 1.0))})
    nodes = _Nodes("n0", "n1", "spare")
    first = _node(view=view, target=0, cluster=nodes)
    second = _node(view=view, target=0, cluster=nodes)
    assert (first["lost_node"], second["lost_node"]) == ("n0", "n1")
    third = _node(view=view, target=0, cluster=nodes)  # no rank's node is left: any training node
    assert third["lost_node"] == "spare" and nodes.held == set()
    with pytest.raises(RuntimeError, match="no training node is left"):
        _node(view=view, target=0, cluster=nodes)


def test_up_starts_a_head_that_failed_once_more_and_nothing_else(monkeypatch, tmp_path):
    from ray_checkfreq.chaos import spot_cluster

    tries: list[str] = []

    def failing_once(config):
        tries.append(config.directory)
        if len(tries) == 1:
            raise spot_cluster.HeadStartError("The current node timed out during startup")
        return "cluster"

    monkeypatch.setattr(spot_cluster, "_up_once", failing_once)
    config = spot_cluster.SpotClusterConfig(directory=str(tmp_path))
    assert spot_cluster.up(config) == "cluster" and len(tries) == 2

    def other_failure(config):
        tries.append(config.directory)
        raise FileExistsError("a cluster was started here")

    monkeypatch.setattr(spot_cluster, "_up_once", other_failure)
    with pytest.raises(FileExistsError):
        spot_cluster.up(config)
    assert len(tries) == 3  # not retried
