"""Every benchmark runs end to end on a tiny input and writes the figures it prints.

These are not speed checks (the figures come from full-size runs, in the README); they
keep the benchmark commands working.
"""

from __future__ import annotations

import json

import torch

from ray_checkfreq.cli import main


def test_bench_store(tmp_path, capsys):
    out = tmp_path / "store.json"
    assert main(["bench", "store", "--size-mb", "4", "--repeat", "1", "--s3", "--json", str(out)]) == 0
    figures = json.loads(out.read_text())["results"]
    assert set(figures) == {"local", "s3"} and all(v > 0 for v in figures["local"].values())
    assert "ours raw" in capsys.readouterr().out


def test_bench_store_deltas_writes_every_checkpoint_both_ways(tmp_path, capsys):
    out = tmp_path / "deltas.json"
    assert main(["bench", "store", "--deltas", "--train-steps", "1", "--checkpoints", "3", "--json", str(out)]) == 0
    figures = json.loads(out.read_text())
    plain, deltas = figures["without_deltas"]["rows"], figures["with_deltas"]["rows"]
    assert [r["step"] for r in plain] == [r["step"] for r in deltas] == [1, 11, 21]
    assert not any(r["delta_ranks"] for r in plain) and deltas[1]["delta_ranks"] == [0, 1]
    assert "delta parts (ranks)" in capsys.readouterr().out


def test_bench_persist_measures_the_four_ways_and_leaves_the_given_dir(tmp_path, capsys):
    out = tmp_path / "persist.json"
    keep = tmp_path / "mine.txt"
    keep.write_text("not the bench's")
    assert main(["bench", "persist", "--size-mb", "8", "--repeats", "2", "--dir", str(tmp_path),
                 "--json", str(out)]) == 0
    figures = json.loads(out.read_text())
    assert set(figures["median"]) == {"page_cache", "page_cache_seal_crc", "direct", "direct_seal_crc"}
    assert all(len(runs) == 2 and all(r["cpu_s"] > 0 and r["wall_s"] > 0 for r in runs)
               for runs in figures["runs"].values())
    assert figures["cpu_vs_page_cache"]["page_cache"] == 1.0
    assert keep.read_text() == "not the bench's" and sorted(p.name for p in tmp_path.iterdir()) == [
        "mine.txt", "persist.json"]
    assert "direct_seal_crc" in capsys.readouterr().out


def test_bench_stall(tmp_path):
    out = tmp_path / "stall.json"
    assert main(["bench", "stall", "--params-m", "1", "--batch", "8", "--every", "2", "--checkpoints", "2",
                 "--json", str(out)]) == 0
    results = json.loads(out.read_text())["results"]
    assert len(results) == 4 and all(r["stall_s"] >= 0 for r in results.values())


def test_bench_overhead(tmp_path):
    out = tmp_path / "overhead.json"
    assert main(["bench", "overhead", "--iterations", "40", "--first", "20", "--epoch-len", "200",
                 "--every-iters", "6", "--every", "3",
                 "--phase-iters", "12", "--width", "64", "--block", "10", "--slow-s", "0.02",
                 "--json", str(out)]) == 0
    figures = json.loads(out.read_text())
    assert figures["first"]["checkpoints"] >= 1 and figures["first"]["first_iterations"] >= 20
    assert figures["every"]["checkpoints"] >= 1 and "overhead_torch_save" in figures["every"]
    assert len(figures["adaptive"]["overhead_per_phase"]) == 3


def test_bench_overhead_noisy_prints_each_runs_k_history_and_figures(tmp_path, capsys):
    out = tmp_path / "noisy.json"
    # 900 iterations: on a loaded machine profiling lengthens its samples (they disagree) past 300.
    assert main(["bench", "overhead", "--noisy", "--runs", "2", "--iterations", "900", "--width", "64",
                 "--block", "20", "--epoch-len", "200", "--hog-procs", "1", "--hog-period-s", "0.5",
                 "--json", str(out)]) == 0
    runs = json.loads(out.read_text())["noisy"]["runs"]
    assert len(runs) == 2 and all(r["k_history"] and r["checkpoints"] >= r["by_cause"]["profiling"] for r in runs)
    printed = capsys.readouterr().out
    assert "k history" in printed and "median wall-clock overhead" in printed
    assert all(r["profile_rule"] in ("median", "mean", "largest") and r["profile_costs_s"] for r in runs)
    assert "from the " + runs[0]["profile_rule"] + " of the warm samples' costs" in printed


def test_bench_overhead_names_a_bad_part(capsys):
    assert main(["bench", "overhead", "--parts", "firts"]) != 0
    assert "--parts 'firts'" in capsys.readouterr().err


def test_bench_codec_on_a_given_file(tmp_path):
    from safetensors.torch import save_file

    source = tmp_path / "tiny.safetensors"
    save_file({"a": torch.randn(64, 64), "b": torch.randn(300)}, str(source))
    out = tmp_path / "codec.json"
    assert main(["bench", "codec", "--input", str(source), "--repeats", "2", "--no-delta", "--json", str(out)]) == 0
    figures = json.loads(out.read_text())
    ours = [r for r in figures["rows"] if r["method"] == "ours"]
    assert ours and all(r["bit_identical"] and r["input_unchanged"] for r in ours)
    assert all(len(r["decode_s"]) == 2 and set(r["decode_gbps"]) == {"best", "min", "median", "max"}
               for r in figures["rows"])
    if any(r["method"].startswith("zipnn") for r in figures["rows"]):
        assert {p["baseline"] for p in figures["paired_speedups"]} == {"zipnn-0.5.4", "zipnn/tensor"}


def test_the_delta_between_two_training_checkpoints_round_trips_and_stores_less_than_a_full_encode():
    from benchmarks.codec import delta_case

    delta = delta_case(steps_apart=2, warmup=1)  # the command's default: 10 steps after 20
    assert delta["bit_identical"]
    for part in ("model", "checkpoint"):
        assert delta[part]["delta_ratio_pct"] < delta[part]["full_ratio_pct"] < 100, delta


def test_bench_codec_interleaves_the_methods_round_by_round_in_alternating_order():
    from benchmarks import codec as bench_codec

    calls = []

    def method(name):
        return (lambda x: x, lambda x: calls.append(name) or x.numpy().tobytes(),
                lambda blob, x: blob)

    rows = bench_codec.time_interleaved([("ours", method("ours")), ("zipnn", method("zipnn"))],
                                        torch.arange(10, dtype=torch.float32), 1, 3)
    assert calls == ["ours", "zipnn", "zipnn", "ours", "ours", "zipnn"]
    assert all(r["bit_identical"] and len(r["encode_s"]) == 3 for r in rows)
