"""ray-checkfreq ls / verify / export."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest
import torch

from ray_checkfreq import CheckpointStore, cli
from ray_checkfreq.cli import main


@pytest.fixture
def store_with_two(tmp_path):
    store = CheckpointStore(str(tmp_path / "run"))
    store.save(10, {"model": {"w": torch.arange(6.0).reshape(2, 3), "b": torch.ones(2).bfloat16()},
                    "opt": {"state": {0: {"m": np.ones(3, dtype=np.float32)}}, "lr": 0.5}}, epoch_boundary=True)
    store.save(20, {"model": {"w": torch.zeros(2, 3), "b": torch.zeros(2).bfloat16()}, "opt": {"lr": 0.25}})
    return store


def test_ls_lists_steps_and_leftovers(store_with_two, capsys):
    os.makedirs(os.path.join(store_with_two.uri, "step-000000000030-0badc0de"))
    assert main(["ls", store_with_two.uri]) == 0
    out = capsys.readouterr().out
    assert "10" in out and "20" in out and "yes" in out
    assert "step-000000000030-0badc0de" in out and "uncommitted" in out


@pytest.mark.parametrize("command", [["ls"], ["verify"], ["export", "--to", "out.pt"]])
def test_a_missing_path_is_an_error_and_is_not_created(tmp_path, capsys, command):
    missing = str(tmp_path / "no" / "such" / "path")
    assert main([command[0], missing, *command[1:]]) == 1
    err = capsys.readouterr().err
    assert missing in err and "does not exist" in err
    assert not os.path.exists(tmp_path / "no")


def test_ls_shows_the_writer_generation_and_lists_the_newest_writer_last(store_with_two, capsys):
    CheckpointStore(store_with_two.uri).save(5, {"x": torch.ones(2)})  # a new writer, a lower step
    assert main(["ls", store_with_two.uri]) == 0
    rows = [line.split() for line in capsys.readouterr().out.splitlines()[1:]]
    assert [(row[0], row[1]) for row in rows] == [("1", "10"), ("1", "20"), ("2", "5")]


def test_verify_exit_codes_and_the_faulty_file_is_named(store_with_two, capsys):
    assert main(["verify", store_with_two.uri]) == 0
    assert main(["verify", store_with_two.uri, "--step", "10"]) == 0
    ref = store_with_two.list()[-1]
    shard = os.path.join(ref.uri, next(f for f in sorted(os.listdir(ref.uri)) if f.endswith(".bin")))
    with open(shard, "r+b") as f:
        f.seek(3)
        f.write(b"\xff")
    capsys.readouterr()
    assert main(["verify", store_with_two.uri]) == 1
    out = capsys.readouterr().out
    assert shard in out and "checksum mismatch" in out
    assert main(["verify", store_with_two.uri, "--step", "10"]) == 0
    assert main(["verify", store_with_two.uri, "--step", "99"]) == 1


def test_verify_checks_the_alignment_padding_that_loading_never_reads(store_with_two, capsys):
    """Bytes no chunk covers: ``load`` never reads them, ``verify`` does (it says it reads every byte)."""
    from ray_checkfreq.storage.part_files import ALIGN_BYTES

    ref = store_with_two.list()[-1]
    manifest = store_with_two.reader(ref).manifest
    chunks = sorted((c for t in manifest.tensors for c in t.chunks), key=lambda c: c.offset)
    shard = os.path.join(ref.uri, chunks[0].file)
    first_end = chunks[0].offset + chunks[0].length
    assert first_end % ALIGN_BYTES, "the fixture's first chunk ends on the alignment: no padding to damage"
    with open(shard, "r+b") as f:
        f.seek(first_end)
        f.write(b"\x01")
    assert torch.equal(store_with_two.load(ref.step)["model"]["w"], torch.zeros(2, 3))  # what load reads is intact
    capsys.readouterr()
    assert main(["verify", store_with_two.uri, "--step", str(ref.step)]) == 1
    out = capsys.readouterr().out
    assert shard in out and f"bytes {first_end}-" in out and "not zeros" in out


def test_export_safetensors_with_flattened_keys(store_with_two, tmp_path):
    from safetensors.torch import load_file

    target = str(tmp_path / "out.safetensors")
    assert main(["export", store_with_two.uri, "--step", "10", "--to", target]) == 0
    tensors = load_file(target)
    assert set(tensors) == {"model/w", "model/b", "opt/state/0/m"}
    assert torch.equal(tensors["model/w"], torch.arange(6.0).reshape(2, 3))
    assert tensors["model/b"].dtype == torch.bfloat16
    assert torch.equal(tensors["opt/state/0/m"], torch.ones(3))


def test_export_pt_state_dict(store_with_two, tmp_path):
    target = str(tmp_path / "out.pt")
    assert main(["export", store_with_two.uri, "--step", "20", "--to", target]) == 0
    state = torch.load(target, weights_only=True)
    assert torch.equal(state["model"]["w"], torch.zeros(2, 3)) and state["opt"]["lr"] == 0.25


def test_export_refuses_an_unknown_suffix(store_with_two, tmp_path, capsys):
    assert main(["export", store_with_two.uri, "--to", str(tmp_path / "x.bin")]) == 1
    assert "x.bin" in capsys.readouterr().err


def test_console_script_is_installed(store_with_two):
    script = os.path.join(os.path.dirname(sys.executable), "ray-checkfreq")
    result = subprocess.run([script, "ls", store_with_two.uri], capture_output=True, text=True, check=True)
    assert "step-0000000000" in result.stdout


def test_bench_lists_every_benchmark_of_the_checkout():
    import benchmarks

    assert list(cli.BENCHMARK_NAMES) == list(benchmarks.BENCHMARKS)


def test_bench_outside_a_checkout_says_where_the_benchmarks_are(monkeypatch, tmp_path, capsys):
    # An installed wheel: no importable benchmarks package, none beside the installed package.
    monkeypatch.setitem(sys.modules, "benchmarks", None)
    monkeypatch.setattr(cli, "__file__", str(tmp_path / "site-packages" / "ray_checkfreq" / "cli.py"))
    assert cli.main(["bench", "store", "--size-mb", "1"]) == 1
    err = capsys.readouterr().err
    assert "benchmark unavailable" in err and "checkout of the repository" in err
