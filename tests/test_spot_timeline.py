"""The spot cluster's timeline (chaos/spot_timeline.py): what it reads from a job's output and
the figures it derives from its events, on events given here (no cluster)."""

from __future__ import annotations

from ray_checkfreq.chaos.spot_timeline import Event, Timeline

ATTEMPT_0 = ("(RayTrainWorker pid=1) attempt starts at iteration 0 on 2 workers (rank 0 on node ff01); "
             "restored from: "
             "{'kind': 'none', 'step': 0, 'seconds': 0.0, 'lost_after_notice': None}\n")
ATTEMPT_1 = ("(RayTrainWorker pid=9) attempt starts at iteration 851 on 2 workers (rank 0 on node ff02); "
             "restored from: "
             "{'kind': 'slot', 'step': 851, 'node_id': 'ff01', 'seconds': 0.5, 'lost_after_notice': 0}\n")
DONE = "(RayTrainWorker pid=9) done: 3000 iterations, weights sha256 " + "ab" * 32 + ", stats {}\n"


def timeline_of(events: list[Event]) -> Timeline:
    timeline = Timeline(cluster=None, run="r")  # type: ignore[arg-type]  # never started: no polling
    timeline.events = events
    return timeline


def test_each_attempt_and_the_end_count_once_though_every_node_forwards_the_line() -> None:
    timeline = timeline_of([])
    timeline.follow([ATTEMPT_0, ATTEMPT_0, "noise\n", ATTEMPT_1, ATTEMPT_1, ATTEMPT_1, DONE, DONE])
    attempts = timeline.of("attempt")
    assert [(a.detail["iteration"], a.detail["world"], a.detail["rank0_node"]) for a in attempts] == \
        [(0, 2, "ff01"), (851, 2, "ff02")]
    assert attempts[1].detail["restore"] == {"kind": "slot", "step": 851, "node_id": "ff01", "seconds": 0.5,
                                             "lost_after_notice": 0}
    (done,) = timeline.of("done")
    assert done.detail == {"iterations": 3000, "digest": "ab" * 32}
    assert len(timeline.output) == 8


def test_the_figures_of_a_notice_a_loss_and_the_scale_down() -> None:
    restore = {"kind": "slot", "step": 851, "seconds": 0.5, "lost_after_notice": 0}
    timeline = timeline_of([
        Event(0.0, "submit"), Event(10.0, "node_up", {"node": "a", "alive": 1}),
        Event(12.0, "node_up", {"node": "b", "alive": 2}),
        Event(30.0, "attempt", {"iteration": 0, "world": 2, "restore": {"kind": "none"}}),
        Event(31.0, "commit", {"step": 20}), Event(32.0, "notice", {"node": "b"}),
        Event(35.0, "commit", {"step": 851}), Event(37.0, "kill", {"node": "b", "notice": True}),
        Event(39.0, "node_up", {"node": "c", "alive": 3}),
        Event(47.0, "attempt", {"iteration": 851, "world": 1, "restore": restore}),
        Event(57.0, "attempt", {"iteration": 900, "world": 2, "restore": restore}),
        Event(70.0, "job_end"), Event(75.0, "job_end"), Event(80.0, "node_gone", {"node": "a", "alive": 0})])
    figures = timeline.figures(full_world=2)
    assert figures["nodes_at_full_size_after_submit_s"] == 12.0
    (loss,) = figures["losses"]
    assert loss == {"at_s": 37.0, "with_notice": True, "replacement_node_up_s": 2.0, "next_attempt_s": 10.0,
                    "next_attempt_world": 1, "resumed_at": 851, "restored_from": "slot", "restore_s": 0.5,
                    "ours_share": 0.05, "lost_after_notice": 0, "full_size_again_s": 20.0,
                    "notice_checkpoint_step": 851, "notice_checkpoint_before_deadline_s": 2.0}
    assert figures["nodes_removed_after_job_s"] == 5.0  # from the last job's end
