"""Every rank of a sharded restore resumes at the same step (issue 58): with a byte of ONE
rank's part of the newest step flipped, that rank's read fails and the other's would not,
so the ranks must agree before any loads, and fall back together.

A plain run commits replicated steps 3 and 6; then one 2-rank job (FSDP2, gloo, CPU,
float64; one spawn: starting ranks is most of the cost) commits sharded steps 3 and 6,
flips in each store a byte of step 6 where only rank 1 reads it (in rank 1's data file;
in the CRC blocks of rank 1's rows of a whole tensor), and restores every way there is,
each into fresh weights: ``cf.restore()``; ``cf.load_sharded(6)`` as rank 0 chose it,
then with ``fall_back=True`` as the Ray layer's restart calls it (tests/test_ray_restart.py
checks that it does); ``cf.restore()`` of the replicated store. A hang kills the job
(``spawn_within``) and fails the test.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import sharded_state_jobs as jobs
import torch
import torch.distributed as dist
from store_helpers import part_store

from ray_checkfreq.engine import CheckFreq, CheckFreqConfig, EngineSeams
from ray_checkfreq.engine.agreement import DAMAGED as DAMAGED_PART
from ray_checkfreq.engine.agreement import FAILED, READY, PeerRestoreError, outcome_code, settle
from ray_checkfreq.engine.restore import optimizer_by_name, parameter_names
from ray_checkfreq.errors import CorruptCheckpointError
from ray_checkfreq.ray.decisions import BroadcastDecisions
from ray_checkfreq.storage.store import CheckpointStore
from ray_checkfreq.storage.tree import leaves_of

EVERY, TOTAL, DAMAGED = 3, 6, 6  # DAMAGED: the step whose byte is flipped
ROWS = 512  # inp.weight: 512 x 8 float64 = 32 KiB, 8 CRC blocks of 4 KiB; rank 1 of 2 holds rows 256-511
BLOCK = 4096
BATCH = 12
TIMEOUT_S = 120.0


class Wide(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = torch.nn.Linear(8, ROWS)
        self.out = torch.nn.Linear(ROWS, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.tanh(self.inp(x)))


def _training(seed: int, *, sharded: bool, lr: float = 1e-2) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = Wide().double()
    if sharded:
        from torch.distributed.fsdp import fully_shard

        fully_shard(model.inp)
        fully_shard(model.out)
        fully_shard(model)
    return model, torch.optim.AdamW(model.parameters(), lr=lr)


def _iteration(model: torch.nn.Module, opt: torch.optim.Optimizer, it: int, rank: int, world: int) -> None:
    gen = torch.Generator().manual_seed(1000 + it)
    x = torch.randn(BATCH, 8, generator=gen, dtype=torch.float64)
    y = torch.randn(BATCH, 3, generator=gen, dtype=torch.float64)
    mine = slice(rank * BATCH // world, (rank + 1) * BATCH // world)
    loss = torch.nn.functional.mse_loss(model(x[mine]), y[mine])
    opt.zero_grad()
    loss.backward()
    opt.step()


def _engine(model: torch.nn.Module, opt: torch.optim.Optimizer, store: CheckpointStore, rank: int,
            restore_group: Any = None) -> tuple[CheckFreq, BroadcastDecisions]:
    decisions = BroadcastDecisions(dist.new_group(backend="gloo"), rank)
    cf = CheckFreq(model=model, optimizer=opt, storage=store,
                   config=CheckFreqConfig(every=EVERY, compress=False, commit_wait_s=10.0),
                   seams=EngineSeams(decisions=decisions, restore_group=restore_group))
    return cf, decisions


def _record(root: Path, name: str, rank: int, world: int, model: torch.nn.Module, opt: torch.optim.Optimizer,
            report: dict) -> None:
    """Every rank's ``report`` and the whole state rank 0 gathers (collectives)."""
    state = jobs.full_state(model, opt)
    if rank == 0:
        jobs.save_arrays(root / f"{name}.npz", state)
    jobs.gather_json(root / f"{name}.json", rank, world, report)


# ------------------------------------------------------------------ the job (in the ranks)
def job(rank: int, world: int, root: Path) -> None:
    """Save, flip (rank 0), then restore each way, each into fresh weights."""
    _save(rank, world, root)
    if rank == 0:
        _flip_both(root)
    dist.barrier()
    sharded = part_store(str(root / "sharded"))
    # cf.restore(): rank 0 chooses, every rank loads the newest step every rank reads.
    model, opt = _training(11, sharded=True, lr=0.5)
    cf, decisions = _engine(model, opt, sharded, rank)
    start = cf.restore()
    _record(root, "restore", rank, world, model, opt, {"start": start})
    cf.close()
    decisions.close()
    # load_sharded(step) of the step rank 0 chose: every rank raises, none loads; with
    # fall_back (the Ray layer's call) every rank loads the newest step every rank reads.
    model, opt = _training(12, sharded=True, lr=0.5)
    cf, decisions = _engine(model, opt, sharded, rank, restore_group=dist.new_group(backend="gloo"))
    try:
        outcome: dict[str, Any] = {"loaded": cf.load_sharded(DAMAGED)}
    except Exception as err:  # the report names whatever it was
        outcome = {"error": type(err).__name__, "message": str(err)}
    outcome["fell_back_to"] = cf.load_sharded(DAMAGED, fall_back=True)
    _record(root, "load-sharded", rank, world, model, opt, outcome)
    cf.close()
    decisions.close()
    # A replicated store into FSDP2 ranks.
    model, opt = _training(14, sharded=True, lr=0.5)
    cf, decisions = _engine(model, opt, part_store(str(root / "replicated"), crc_block_bytes=BLOCK), rank)
    start = cf.restore()
    _record(root, "replicated", rank, world, model, opt, {"start": start})
    cf.close()
    decisions.close()


def _save(rank: int, world: int, root: Path) -> None:
    """TOTAL iterations, committed every EVERY; the whole state kept at each commit."""
    model, opt = _training(0, sharded=True)
    cf, decisions = _engine(model, opt, part_store(str(root / "sharded")), rank)
    assert cf.restore() == 0  # an empty store: rank 0's writer generation, on every rank
    for it in range(TOTAL):
        _iteration(model, opt, it, rank, world)
        cf.step()
        if cf.iteration % EVERY == 0:
            _record(root, f"saved-{cf.iteration}", rank, world, model, opt, {})
    cf.close()  # rank 0: step TOTAL is committed
    decisions.close()


def _flip_both(root: Path) -> None:
    files = {
        # rank 1's own rows, in rank 1's data file
        "sharded": _flip(root / "sharded", DAMAGED, lambda chunks: (next(c for c in chunks if c.rank == 1), 100)),
        # block 6 of the whole tensor: rows 384-447, which only rank 1 reads
        "replicated": _flip(root / "replicated", DAMAGED, lambda chunks: (chunks[0], 6 * BLOCK + 100)),
    }
    (root / "flipped.json").write_text(json.dumps(files))


def _flip(root: Path, step: int, offset_of: Any) -> str:
    """Flip one byte of ``model/inp.weight`` in ``step``: ``offset_of(chunks)`` picks the
    chunk and the byte in it; returns the file's name."""
    reader = part_store(str(root)).reader(step)
    chunks = reader.manifest.tensor("model/inp.weight").chunks  # type: ignore[union-attr]
    chunk, byte = offset_of(chunks)
    path = root / reader.dir_name / chunk.file
    data = bytearray(path.read_bytes())
    data[chunk.offset + byte] ^= 0x10
    path.write_bytes(bytes(data))
    return chunk.file


# ------------------------------------------------------------------ in the test process
def _plain_run(root: Path) -> None:
    """The replicated store: one plain process, steps 3 and 6, CRC blocks of 4 KiB."""
    model, opt = _training(0, sharded=False)
    cf = CheckFreq(model=model, optimizer=opt, storage=part_store(str(root / "replicated"), crc_block_bytes=BLOCK),
                   every=EVERY, compress=False)
    for it in range(TOTAL):
        _iteration(model, opt, it, 0, 1)
        cf.step()
        if cf.iteration == EVERY:
            named = optimizer_by_name(opt.state_dict(), parameter_names(model, opt))
            state = {"model": model.state_dict(), "optimizer": named}
            jobs.save_arrays(root / "plain-3.npz", {name: leaf.numpy().copy() for _, name, leaf in leaves_of(state)})
    cf.close()


@pytest.fixture(scope="module")
def restored(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("restore-agreement")
    _plain_run(root)
    jobs.spawn_within(job, 2, str(root), TIMEOUT_S)
    return root


def _same(found: dict[str, np.ndarray], expected: dict[str, np.ndarray]) -> None:
    assert sorted(found) == sorted(expected)
    assert [name for name in expected if not np.array_equal(found[name], expected[name])] == []


def _report(root: Path, name: str) -> list[dict]:
    return json.loads((root / f"{name}.json").read_text())


def test_both_steps_committed_and_the_flip_is_caught(restored: Path) -> None:
    """The premise: both steps committed, and the flip is caught."""
    store = part_store(str(restored / "sharded"))
    assert [ref.step for ref in store.list()] == [EVERY, DAMAGED]
    with pytest.raises(CorruptCheckpointError, match="checksum mismatch"):
        store.load(DAMAGED)


def test_restore_on_two_ranks_falls_back_together_to_the_previous_step_bit_identically(restored: Path) -> None:
    assert [r["start"] for r in _report(restored, "restore")] == [EVERY, EVERY]
    _same(jobs.load_arrays(restored / "restore.npz"), jobs.load_arrays(restored / f"saved-{EVERY}.npz"))


def test_load_sharded_of_a_step_one_rank_cannot_read_raises_on_every_rank_and_falls_back_together(
        restored: Path) -> None:
    report = _report(restored, "load-sharded")
    assert [r.get("error") for r in report] == ["CorruptCheckpointError"] * 2, report
    assert "checksum mismatch" in report[1]["message"]  # rank 1's own error
    assert "rank(s) [1] of 2 found their part damaged" in report[0]["message"]
    # fall_back=True (what the Ray layer's restart calls), after the failed try
    assert [r["fell_back_to"] for r in report] == [EVERY, EVERY]
    _same(jobs.load_arrays(restored / "load-sharded.npz"), jobs.load_arrays(restored / f"saved-{EVERY}.npz"))


def test_a_replicated_step_one_rank_cannot_read_falls_back_on_every_rank(restored: Path) -> None:
    assert [r["start"] for r in _report(restored, "replicated")] == [EVERY, EVERY]
    _same(jobs.load_arrays(restored / "replicated.npz"), jobs.load_arrays(restored / "plain-3.npz"))


# ------------------------------------------------------------------ the rule, alone
def _raised(error: Exception | None, codes: list[int]) -> BaseException | None:
    try:
        settle(error, codes, where="step 6")
    except Exception as raised:
        return raised
    return None


def test_the_worst_outcome_of_any_rank_decides_what_every_rank_raises() -> None:
    """Damage anywhere: every rank raises CorruptCheckpointError (so every restore loop
    falls back in step); any other failure anywhere: no rank raises one (none falls back
    alone), a rank's own error stays its own."""
    damaged = CorruptCheckpointError("part-r00001.bin", "checksum mismatch")
    other = OSError("disk gone")
    assert _raised(None, [READY, READY]) is None
    assert _raised(damaged, [DAMAGED_PART, READY]) is damaged
    peer = _raised(None, [READY, DAMAGED_PART])
    assert isinstance(peer, CorruptCheckpointError) and "rank(s) [1] of 2" in str(peer)
    assert _raised(other, [READY, FAILED]) is other
    stopped = _raised(damaged, [DAMAGED_PART, FAILED])  # not CorruptCheckpointError: it would fall back alone
    assert isinstance(stopped, PeerRestoreError) and stopped.ranks == [1] and stopped.__cause__ is damaged
    assert isinstance(_raised(None, [FAILED, DAMAGED_PART, READY]), PeerRestoreError)
    assert [outcome_code(e) for e in (None, damaged, other)] == [READY, DAMAGED_PART, FAILED]
