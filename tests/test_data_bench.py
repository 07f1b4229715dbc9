"""The iterator benchmark's pure parts: the before/after demo and the shuffle metrics."""

from __future__ import annotations

import argparse
import json

import numpy as np

from benchmarks import iterator as bench


def test_before_after_counts():
    counts = bench.before_after(num_samples=2000, batch_size=16, interrupt_at=0.5)
    assert counts["stock DataLoader, restart the epoch"]["repeated"] == 62 * 16
    assert counts["stock DistributedSampler, 4 -> 5 ranks, skip"]["missed"] > 0
    assert counts["stock DistributedSampler, 4 -> 3 ranks, skip"]["repeated"] > 0
    ours = {k: v for k, v in counts.items() if k.startswith("ours")}
    assert len(ours) == 3 and all(v == {"repeated": 0, "missed": 0} for v in ours.values())


def test_shuffle_quality_separates_sequential_from_uniform():
    n = 10_000
    seq = bench.shuffle_quality(np.arange(n), n, 100)
    uni = bench.shuffle_quality(np.random.default_rng(0).permutation(n), n, 100)
    assert seq["spearman"] == 1.0 and seq["displacement"] == 0.0 and seq["neighbours_same_batch"] > 0.98
    assert abs(uni["spearman"]) < 0.05 and abs(uni["displacement"] - 1 / 3) < 0.02
    assert uni["neighbours_same_batch"] < 0.03


def test_demo_only_run_prints_and_writes_json(tmp_path, capsys):
    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)
    out = tmp_path / "iter.json"
    assert bench.run(parser.parse_args(["--demo-only", "--json", str(out)])) == 0
    assert "ours, 4 -> 3 ranks" in capsys.readouterr().out
    assert json.loads(out.read_text())["before_after"]["ours, same world size"] == {"repeated": 0, "missed": 0}


def test_order_bench_cases_skip_the_permutation_where_it_would_not_fit():
    from benchmarks.iterator_order import OrderBenchConfig, cases

    listed = cases(OrderBenchConfig(num_samples=10**9, compare_samples=10**7))
    assert {(c.num_samples, c.version) for c in listed} == {(10**9, 2), (10**7, 2), (10**7, 1)}
    assert {c.position for c in listed} == {0.0, 0.999}
    whole_epoch = [c for c in listed if c.num_samples == 10**7 and c.position == 0.0]
    assert all(c.samples == 10**7 for c in whole_epoch)  # the ratio compares whole epochs


def test_order_bench_child_restores_at_the_position_and_reads_on():
    from benchmarks.iterator_order import Case, child

    result = child(Case(10**9, 2, 0.999, 5000), batch_size=100, world_size=4)
    assert result["start_position"] == 999_000_000 and result["read"] >= 5000 // 4
    assert result["peak_rss"] >= result["rss_after_imports"] > 0 and result["samples_per_s"] > 0


def test_order_bench_runs_end_to_end_and_prints_its_table(tmp_path, capsys):
    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)
    out = tmp_path / "iter.json"
    argv = ["--demo-only", "--num-samples", "200000", "--compare-samples", "200000", "--measure-samples", "20000",
            "--order-repeats", "1", "--json", str(out)]
    assert bench.run(parser.parse_args(argv)) == 0
    order = json.loads(out.read_text())["order"]
    assert [(r["version"], r["position"]) for r in order["rows"]] == [(2, 0.0), (2, 0.999), (1, 0.0), (1, 0.999)]
    assert order["rows"][0]["read"] == 200_000 and order["rows"][1]["start_position"] == 199_680
    assert "samples/s version 2 / version 1" in capsys.readouterr().out
