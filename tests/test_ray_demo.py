"""`make demo` (examples/ray_demo.py): its flags, its plan and its closing table, without Ray.

The run itself is the chaos runner's (tests/test_chaos_run.py runs it on a local cluster);
these tests hold the demo's own parts: what it schedules, what it prints, how it exits.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

from ray_checkfreq.chaos.runner import plan

DEMO = Path(__file__).resolve().parent.parent / "examples" / "ray_demo.py"
VERDICT_YES = "final weights identical to an uninterrupted run: yes"
VERDICT_NO = "final weights identical to an uninterrupted run: no"


@pytest.fixture(scope="module")
def demo():
    spec = importlib.util.spec_from_file_location("ray_demo", DEMO)
    module = importlib.util.module_from_spec(spec)
    sys.modules["ray_demo"] = module
    spec.loader.exec_module(module)
    return module


def _report(*, identical: bool | None = True, commits: int = 16) -> dict:
    """The keys of a chaos report the demo reads (values as a 3-preemption run gives them)."""
    preemptions = [
        {"kind": "worker", "iteration": 14, "restored_step": 12, "restored_from": "slot", "lost_iterations": 2},
        {"kind": "node", "iteration": 25, "restored_step": 24, "restored_from": "slot", "lost_iterations": 1},
        {"kind": "notice", "iteration": 37, "restored_step": 38, "restored_from": "storage", "lost_iterations": 0},
    ]
    return {"iterations": 56, "commits": commits, "k_max": 4, "lost_iterations_bound": 8,
            "identical_to_uninterrupted": identical, "max_abs_diff": 0.0 if identical else 3e-4,
            "detail": {"preemptions": preemptions}}


STATS = {"overhead_estimate": 0.021, "compression_ratio": 0.93, "compress": True, "checkpoints_committed": 5}


def test_the_table_shows_each_figure_and_ends_with_the_verdict(demo):
    lines = demo.table(demo.summarize(_report(), STATS, accuracy=0.9805))
    text = "\n".join(lines)
    assert lines[-1] == VERDICT_YES
    assert "56 (2 epochs of 28)" in text
    assert "checkpoints per epoch              8.0" in text
    assert "4 (chosen by the policy" in text
    assert "2.1 %" in text and "0.93 (compressed)" in text and "compression (stored / state bytes)" in text
    assert "98.0 % (training set: all 1797 digit images" in text
    # the proof of the resume: the iteration each restart began at, and the work it lost
    assert ("worker  fired at iteration  14; training reached  14; the restart resumed at  12 "
            "(from a node's RAM copy); lost 2") in text
    assert "node    fired at iteration  25; training reached  25; the restart resumed at  24" in text
    assert ("notice  fired at iteration  37; training reached  38; the restart resumed at  38 (from storage); "
            "lost 0") in text


def test_different_weights_print_no_and_exit_1(demo):
    summary = demo.summarize(_report(identical=False), STATS, accuracy=0.5)
    assert demo.table(summary)[-1] == VERDICT_NO
    assert demo.exit_code(summary, []) == 1
    unknown = demo.summarize(_report(identical=None), {}, accuracy=None)  # the run never finished
    assert demo.table(unknown)[-1] == VERDICT_NO and demo.exit_code(unknown, []) == 1


def test_a_failed_check_exits_1_even_with_identical_weights(demo):
    summary = demo.summarize(_report(), STATS, accuracy=0.98)
    assert demo.exit_code(summary, []) == 0
    assert demo.exit_code(summary, ["samples lost or repeated"]) == 1


def test_checkpoints_per_epoch_falls_back_to_the_engine_count_without_followed_commits(demo):
    # On S3 the injector does not see commits (it follows the local store): the engine's count is used.
    summary = demo.summarize(_report(commits=0), STATS, accuracy=None)
    assert summary["checkpoints_per_epoch"] == pytest.approx(2.5)
    assert demo.table(summary)[-1] == VERDICT_YES


@pytest.mark.parametrize(("argv", "cuda", "flag"), [
    (["--preemptions", "-1"], False, "--preemptions=-1"),
    (["--s3-endpoint", "http://127.0.0.1:9000"], False, "--s3-bucket"),
    (["--s3-bucket", "a/b"], False, "--s3-bucket='a/b'"),
    (["--gpu"], False, "--gpu"),
])
def test_bad_flags_are_named(demo, argv, cuda, flag):
    with pytest.raises(demo.FlagError, match=flag.replace("?", r"\?")):
        demo.validate(demo.parse_args(argv), cuda_available=cuda)


def test_gpu_is_accepted_where_cuda_is(demo):
    demo.validate(demo.parse_args(["--gpu"]), cuda_available=True)


def test_main_exits_2_naming_the_flag_before_starting_anything(demo, capsys, monkeypatch):
    monkeypatch.setattr("torch.cuda.is_available", lambda: False)
    assert demo.main(["--gpu"]) == 2
    assert "--gpu" in capsys.readouterr().err
    assert demo.main(["--preemptions", "-2"]) == 2
    assert "--preemptions=-2" in capsys.readouterr().err


def test_the_default_plan_is_three_preemptions_of_three_kinds_on_two_nodes(demo, tmp_path):
    config = demo.chaos_config(demo.parse_args([]), str(tmp_path))
    assert (config.nodes, config.workers, config.replace) == (2, 2, True)
    preemptions = plan(config)
    assert [p.kind for p in preemptions] == ["worker", "node", "notice"]
    # the last one leaves room for a notice's deadline (~2 s of training) and a checkpoint after the restart
    assert [p.at_iteration for p in preemptions] == [60, 74, 88]
    assert config.iterations == 112 and config.tolerance == 0.0  # identical means bit-identical
    assert config.every is None  # the policy chooses k


@pytest.mark.parametrize("preemptions", [0, 1, 2, 5, 8, 20])
def test_any_count_of_preemptions_gets_distinct_iterations_with_room_after(demo, preemptions, tmp_path):
    config = demo.chaos_config(demo.parse_args(["--preemptions", str(preemptions)]), str(tmp_path))
    at = [p.at_iteration for p in plan(config)]
    assert len(at) == preemptions and len(set(at)) == preemptions
    assert all(demo.FIRST_PREEMPTION <= i <= config.iterations - 24 for i in at)
    assert config.iterations % 28 == 0 and config.iterations >= 12 * preemptions


def test_engine_figures_combine_every_attempt_not_just_the_last(demo):
    def stats(iteration, overhead, written, ratio, commits, compress=True):
        return {"iteration": iteration, "overhead_estimate": overhead, "bytes_written": written,
                "compression_ratio": ratio, "checkpoints_committed": commits, "compress": compress}

    events = [
        {"event": "start", "rank": 0, "attempt": 1, "iteration": 0},
        {"event": "stats", "rank": 0, "attempt": 1, "stats": stats(8, 0.5, 100, 0.5, 1)},
        {"event": "stats", "rank": 0, "attempt": 1, "stats": stats(20, 0.02, 400, 0.8, 4)},  # killed after this
        {"event": "stats", "rank": 1, "attempt": 1, "stats": stats(20, 0.9, 1, 0.1, 9)},  # other ranks: ignored
        {"event": "start", "rank": 0, "attempt": 2, "iteration": 16},
        {"event": "end", "rank": 0, "attempt": 2, "stats": stats(56, 0.05, 200, 1.0, 10, compress=False)},
    ]
    figures = demo.engine_figures(events)
    assert figures["overhead_estimate"] == pytest.approx((20 * 0.02 + 40 * 0.05) / 60)
    assert figures["compression_ratio"] == pytest.approx(600 / (400 / 0.8 + 200 / 1.0))
    assert figures["checkpoints_committed"] == 14
    assert figures["compress"] is False
    assert demo.engine_figures([])["overhead_estimate"] is None


def test_a_run_that_cannot_be_made_still_ends_with_no_and_exit_1(demo, capsys, monkeypatch, tmp_path):
    def unreachable_store(config):
        raise OSError("s3://demo: bucket not found")

    monkeypatch.setattr("ray_checkfreq.chaos.runner.run_chaos", unreachable_store)
    assert demo.main(["--work-dir", str(tmp_path)]) == 1
    out = capsys.readouterr().out
    assert "bucket not found" in out and out.splitlines()[-1] == VERDICT_NO
