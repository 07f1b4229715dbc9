"""``ray-checkfreq bench all``: a smoke run of the cheap benchmarks, and its reports."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest

from benchmarks import all as bench_all

CHEAP = ("codec", "stall", "overhead", "persist")


def test_quick_run_reports_every_requested_section_with_its_plot(tmp_path):
    out = tmp_path / "report"
    done = subprocess.run(
        [sys.executable, "-m", "ray_checkfreq.cli", "bench", "all", "--out", str(out), "--quick",
         "--only", ",".join(CHEAP)],
        capture_output=True, text=True, timeout=300,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    report = json.loads((out / "report.json").read_text())
    assert list(report["sections"]) == list(CHEAP)
    assert report["command"] == f"ray-checkfreq bench all --out {out} --only {','.join(CHEAP)} --quick"
    assert report["machine"]["cores"] >= 1 and report["machine"]["versions"]["torch"]
    for name, section in report["sections"].items():
        assert section["exit_code"] == 0, (name, section["error"])
        assert section["figures"], name
        assert section["plot"] == f"{name}.png" and (out / section["plot"]).stat().st_size > 1000
    assert report["sections"]["codec"]["figures"]["rows"][0]["bit_identical"]
    assert set(report["sections"]["overhead"]["figures"]) >= {"first", "every", "adaptive"}
    assert report["sections"]["persist"]["figures"]["cpu_vs_page_cache"]["page_cache"] == 1.0
    md = (out / "report.md").read_text()
    assert re.findall(r"!\[(\w+)\]\((\w+)\.png\)", md) == [(name, name) for name in CHEAP]
    assert report["command"] in md and "| CPU |" in md


def test_a_failing_benchmark_is_reported_and_fails_the_run(tmp_path):
    out = tmp_path / "report"
    code = subprocess.run(
        [sys.executable, "-m", "ray_checkfreq.cli", "bench", "all", "--out", str(out), "--quick", "--only", "stall",
         "--set", "stall=--batch 0"],
        capture_output=True, text=True, timeout=120,
    ).returncode
    assert code == 1
    section = json.loads((out / "report.json").read_text())["sections"]["stall"]
    assert section["exit_code"] != 0 and "--batch 0" in section["error"]
    assert "FAILED" in (out / "report.md").read_text()


@pytest.mark.parametrize("only", ["codec,nope", ""])
def test_unknown_sections_are_refused_by_name(only):
    with pytest.raises(ValueError, match="--only"):
        bench_all._sections(only)


def test_extra_flags_need_a_known_benchmark():
    assert bench_all._extra_flags(["ray=--repeats 3 --no-kill"]) == {"ray": ["--repeats", "3", "--no-kill"]}
    with pytest.raises(ValueError, match="--set 'repeats=3'"):
        bench_all._extra_flags(["repeats=3"])


def test_the_recorded_command_parses_back_to_the_same_run():
    import argparse
    import shlex

    parser = argparse.ArgumentParser()
    bench_all.add_arguments(parser)
    args = parser.parse_args(["--out", "r", "--only", "ray,codec", "--quick", "--set", "ray=--repeats 3",
                              "--timeout-s", "90"])
    words = shlex.split(bench_all.command_line(args))
    assert words[:3] == ["ray-checkfreq", "bench", "all"]
    assert vars(parser.parse_args(words[3:])) == vars(args)
