"""``ray-checkfreq export --precision-factor B`` / ``--precision-bits b``."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from safetensors import safe_open

from ray_checkfreq import CheckpointStore, codec
from ray_checkfreq.cli import main

STATE = {
    "model": {"w": (torch.rand(300, generator=torch.Generator().manual_seed(0)) - 0.5),
              "wide": torch.linspace(-3, 3, 50), "b": torch.linspace(-1, 1, 64).bfloat16()},
    "opt": {"m": np.linspace(-0.3, 0.3, 40).astype(np.float32), "step": torch.tensor(7)},
}


@pytest.fixture
def uri(tmp_path) -> str:
    store = CheckpointStore(str(tmp_path / "run"))
    store.save(5, STATE)
    return store.uri


def raw(t: torch.Tensor) -> bytes:
    return t.contiguous().view(torch.uint8).numpy().tobytes()


def test_export_with_a_precision_factor_rounds_tensors_within_unit_range(uri, tmp_path):
    target = str(tmp_path / "out.safetensors")
    assert main(["export", uri, "--to", target, "--precision-factor", "2**6"]) == 0
    with safe_open(target, "pt") as f:
        assert f.metadata()["ray_checkfreq.precision_factor"] == "64"
        got = {k: f.get_tensor(k) for k in f.keys()}
    assert raw(got["model/w"]) == raw(torch.round(STATE["model"]["w"] * 64) / 64)
    assert raw(got["model/b"]) == raw(codec.trim(STATE["model"]["b"], precision_factor=64))
    assert raw(got["model/wide"]) == raw(STATE["model"]["wide"])  # values outside [-1, 1]: exact
    assert np.array_equal(got["opt/m"].numpy(), np.round(STATE["opt"]["m"] * 64) / 64)
    assert int(got["opt/step"]) == 7


def test_export_with_precision_bits_to_pt(uri, tmp_path):
    target = str(tmp_path / "out.pt")
    assert main(["export", uri, "--to", target, "--precision-bits", "4"]) == 0
    got = torch.load(target, weights_only=False)
    for key in ("w", "wide", "b"):
        assert raw(got["model"][key]) == raw(codec.trim(STATE["model"][key], precision_bits=4))
    assert not torch.equal(got["model"]["w"], STATE["model"]["w"])


def test_export_refuses_both_settings_and_a_bad_factor(uri, tmp_path, capsys):
    target = str(tmp_path / "out.pt")
    with pytest.raises(SystemExit):
        main(["export", uri, "--to", target, "--precision-factor", "1024", "--precision-bits", "8"])
    assert "not allowed with argument" in capsys.readouterr().err
    assert main(["export", uri, "--to", target, "--precision-factor", "1000"]) == 1
    assert "precision_factor must be a power of two" in capsys.readouterr().err
    assert not (tmp_path / "out.pt").exists()
