"""The policy in sharded mode: 2 spawned gloo ranks of FSDP2 training (float64, CPU) with
``every=None``. Rank 0 profiles, runs the compression trial and picks k; ``BroadcastDecisions``
hands every action (checkpoint, codec, k, stop) to both ranks at the same iteration. Rank 1's
storage is slow (each part lands ``SLOW_PART_S`` late): rank 0's persist, which waits for
the global commit, must carry that to the policy.

One module-scoped run: profiling, a checkpoint at the chosen k, a change of k that rank 0
makes (``set_k``, as a shared policy does: the adaptive rate's changes travel the same way,
in the next action), a checkpoint at the new k, then a stop that rank 0 plans (``stop_at``,
as a preemption does); then both ranks restore the newest committed step into fresh models.
"""

from __future__ import annotations

import json
import statistics
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import sharded_state_jobs as jobs
import torch
import torch.distributed as dist
from store_helpers import newest_sharded, part_store

from ray_checkfreq.engine import CheckFreq, CheckFreqConfig, EngineSeams
from ray_checkfreq.engine.profiling import WARMUP_ITERS
from ray_checkfreq.ray.decisions import BroadcastDecisions
from ray_checkfreq.storage.manifest import PartManifest
from ray_checkfreq.storage.store import CheckpointStore

SLOW_PART_S = 0.15  # rank 1 writes each part this late
TIMING_SLACK = 0.8  # rank 0 may start its persist a little after rank 1 (the ranks meet once an iteration)
MAX_ITERS = 600  # the run stops earlier (rank 0's stop); every rank stops here otherwise
K_STEP = 3  # rank 0 raises k by this much after the first checkpoint at the policy's k
# profile_iters=7: the fewest quiet iterations profiling takes. A generous p keeps k bound by
# the persist time (rank 1's slow part), where compression could pay: the trial runs.
CONFIG = CheckFreqConfig(every=None, compress=None, overhead=0.9, profile_iters=7, commit_wait_s=10.0)
GLOBAL_BATCH = 12


# ------------------------------------------------------------------ in the ranks
class WideNet(torch.nn.Module):
    """Over 1 MiB of state per rank of 2 (weights and AdamW moments, float64): compression
    is only tried on states that large (policy.MIN_COMPRESSIBLE_BYTES)."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = torch.nn.Linear(16, 384)
        self.mid = torch.nn.Linear(384, 256)
        self.out = torch.nn.Linear(256, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.tanh(self.mid(torch.tanh(self.inp(x)))))


def _training(seed: int, lr: float) -> tuple[torch.nn.Module, torch.optim.Optimizer, Any]:
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(seed)
    model = WideNet().double()
    fully_shard(model)  # one unit: one all-gather and one reduce-scatter an iteration
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.1)
    return model, opt, torch.optim.lr_scheduler.StepLR(opt, step_size=40, gamma=0.5)


def _iteration(model: torch.nn.Module, opt: torch.optim.Optimizer, sched: Any, it: int, rank: int,
               world: int) -> None:
    share = GLOBAL_BATCH // world
    gen = torch.Generator().manual_seed(1000 + it)
    x = torch.randn(GLOBAL_BATCH, 16, generator=gen, dtype=torch.float64)
    y = torch.randn(GLOBAL_BATCH, 4, generator=gen, dtype=torch.float64)
    mine = slice(rank * share, (rank + 1) * share)
    loss = torch.nn.functional.mse_loss(model(x[mine]), y[mine])
    opt.zero_grad()
    loss.backward()
    opt.step()
    sched.step()


class SlowPartStore(CheckpointStore):
    """Slow storage under one rank: each of its parts lands ``SLOW_PART_S`` late;
    ``writes_begin``: when each step's part write began (``time.monotonic``, system-wide)."""

    def __init__(self, uri: str, **options: Any) -> None:
        super().__init__(uri, **options)
        self.writes_begin: dict[int, float] = {}

    def save_part(self, step: int, **options: Any) -> PartManifest:
        time.sleep(SLOW_PART_S)
        self.writes_begin[step] = time.monotonic()
        return super().save_part(step, **options)


def _open_store(root: Path, rank: int, *, slow: bool) -> tuple[CheckpointStore, int | None]:
    """Rank 0 takes the writer generation and names the newest committed step; every rank
    adopts both (as the Ray layer does). Every step is kept, for the test to read."""
    store = (SlowPartStore if slow else CheckpointStore)(str(root / "store"), codec="rcfz", keep_last=MAX_ITERS)
    chosen: list[Any] = [None, None]
    if rank == 0:
        generation = store.acquire_writer()
        latest = newest_sharded(store)
        chosen = [generation, None if latest is None else latest.step]
    dist.broadcast_object_list(chosen, src=0)
    store.adopt_generation(chosen[0])
    return store, chosen[1]


def _engine(model: torch.nn.Module, opt: torch.optim.Optimizer, sched: Any, store: CheckpointStore, rank: int,
            on_persisted: Any = None) -> tuple[CheckFreq, BroadcastDecisions]:
    decisions = BroadcastDecisions(dist.new_group(backend="gloo"), rank)
    cf = CheckFreq(model=model, optimizer=opt, storage=store, extra_state={"sched": sched}, config=CONFIG,
                   seams=EngineSeams(decisions=decisions, on_persisted=on_persisted))
    return cf, decisions


def _steer(cf: CheckFreq) -> None:
    """Rank 0, once the policy decided: k + K_STEP after the first checkpoint at its k, then
    a stop one k after the second."""
    if not cf.policy_ready or cf.stop_at is not None:
        return
    stats = cf.stats()
    intervals = stats["checkpoints_by_cause"]["interval"]
    if intervals == 1 and len(stats["k_history"]) == 1:
        cf.set_k(stats["k_history"][0]["k"] + K_STEP)
    elif intervals == 2:
        cf.stop_at = cf.iteration + (cf.planned_k or 1)


def _train(rank: int, world: int, root: Path) -> None:
    """Train until the stop rank 0 plans (``_steer``); record what each rank persisted and
    what its stats say."""
    model, opt, sched = _training(seed=0, lr=1e-2)
    store, _ = _open_store(root, rank, slow=rank == 1)
    persisted: list[dict] = []

    def on_persisted(result: Any) -> None:
        persisted.append({"step": result.step, "seconds": result.seconds, "codec": result.codec,
                          "done_at": time.monotonic()})

    cf, decisions = _engine(model, opt, sched, store, rank, on_persisted)
    while not cf.stop_requested and cf.iteration < MAX_ITERS:
        _iteration(model, opt, sched, cf.iteration, rank, world)
        cf.step()
        if rank == 0:
            _steer(cf)
    jobs.save_full(root / "state-final.npz", rank, model, opt, sched)
    cf.close()
    decisions.close()
    stats = cf.stats()
    kept = ("k", "k_changes", "k_history", "compress", "profiling", "checkpoints_by_cause", "checkpoints_committed")
    writes_begin = store.writes_begin if isinstance(store, SlowPartStore) else {}
    jobs.gather_json(root / "train.json", rank, world, {"iteration": cf.iteration, "stopped": cf.stop_requested,
                                                   "persisted": persisted, "stats": {n: stats[n] for n in kept},
                                                   "writes_begin": {str(s): t for s, t in writes_begin.items()}})


def _restore(rank: int, world: int, root: Path) -> None:
    """Fresh models (other weights, learning rate and schedule) load the newest committed step."""
    model, opt, sched = _training(seed=7, lr=0.5)
    store, step = _open_store(root, rank, slow=False)
    assert step is not None
    cf, decisions = _engine(model, opt, sched, store, rank)
    start = cf.load_sharded(step)
    jobs.save_full(root / "state-restored.npz", rank, model, opt, sched)
    decisions.close()
    cf.close()
    jobs.gather_json(root / "restore.json", rank, world, {"latest": step, "start": start})


def policy_job(rank: int, world: int, root: Path) -> None:
    torch.set_num_threads(1)
    _train(rank, world, root)
    _restore(rank, world, root)


# ------------------------------------------------------------------ the run
@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("sharded-policy")
    jobs.spawn(policy_job, 2, str(root))
    return root


def _ranks(run: Path) -> list[dict]:
    return json.loads((run / "train.json").read_text())


def _steps(report: dict) -> list[int]:
    return [p["step"] for p in report["persisted"]]


def _profile_iter_s(profiling: dict) -> float:
    """Ti as the policy took it (profiling.ProfilingWindow.iter_s)."""
    return statistics.median(profiling["quiet_s"][WARMUP_ITERS:])


def test_both_ranks_checkpoint_the_same_iterations_with_the_same_codec_and_each_commits(run: Path) -> None:
    first, second = _ranks(run)
    assert first["stopped"] and second["stopped"]
    assert first["iteration"] == second["iteration"] < MAX_ITERS
    steps = _steps(first)
    assert _steps(second) == steps
    assert steps == sorted(set(steps)) and steps[-1] == first["iteration"]  # the stop's checkpoint is the last
    assert [p["codec"] for p in second["persisted"]] == [p["codec"] for p in first["persisted"]]
    assert first["stats"]["checkpoints_committed"] == second["stats"]["checkpoints_committed"] == len(steps)
    store = part_store(str(run / "store"))
    assert [ref.step for ref in store.list()] == steps  # committed: both ranks' parts are in
    for persisted in first["persisted"]:
        manifest = store.reader(persisted["step"]).manifest
        written = {(chunk.rank, chunk.codec) for tensor in manifest.tensors for chunk in tensor.chunks
                   if chunk.dtype == "float64"}
        assert written == {(0, persisted["codec"]), (1, persisted["codec"])}, persisted["step"]


def test_rank_0_profiles_tries_compression_and_both_ranks_apply_its_k_and_codec(run: Path) -> None:
    first, second = _ranks(run)
    stats = first["stats"]
    profiling = stats["profiling"]
    assert profiling is not None and second["stats"]["profiling"] is None  # rank 1 never profiles: it follows
    assert sorted(profiling["samples"]) == ["raw", "rcfz"]  # the compression trial measured both codecs
    measured = profiling["checkpoints"]
    steps = _steps(first)
    assert len(steps) == len(measured) + 3 and steps[:len(measured)] == measured
    assert stats["checkpoints_by_cause"] == {"profiling": len(measured), "interval": 2, "epoch_end": 0, "notice": 0,
                                               "stop": 1}
    assert isinstance(stats["compress"], bool)
    chosen = "rcfz" if stats["compress"] else "raw"
    assert [p["codec"] for p in first["persisted"][len(measured):]] == [chosen] * 3
    k = stats["k_history"][0]["k"]
    assert [(h["k"], h["reason"]) for h in stats["k_history"]] == [(k, "profile"), (k + K_STEP, "shared policy")]
    first_interval, second_interval = steps[len(measured):len(measured) + 2]
    assert second_interval - first_interval == k + K_STEP  # the next checkpoint moved with k
    # Both ranks switched at the action after the first interval checkpoint and end at the new k.
    assert first["stats"]["k_changes"] == second["stats"]["k_changes"] == [[first_interval + 1, k + K_STEP]]
    assert first["stats"]["k"] == second["stats"]["k"] == k + K_STEP


def test_rank_0s_persist_times_include_the_slow_ranks_part_and_set_k(run: Path) -> None:
    first, second = _ranks(run)
    begun = {int(step): at for step, at in second["writes_begin"].items()}
    assert sorted(begun) == _steps(first)
    # Rank 0's persist reports once the step is committed: after rank 1's part was written.
    early = [(p["step"], round(begun[p["step"]] - p["done_at"], 3)) for p in first["persisted"]
             if p["done_at"] <= begun[p["step"]]]
    assert early == []
    assert [p for p in second["persisted"] if p["seconds"] < SLOW_PART_S] == []
    profiling = first["stats"]["profiling"]
    # The policy decided from those persists of rank 0 (a warm sample: copy_s + persist_s = its seconds).
    seconds = [p["seconds"] for p in first["persisted"]]
    samples = [s for codec in profiling["samples"].values() for s in codec]
    assert [s for s in samples if min(abs(s["copy_s"] + s["persist_s"] - t) for t in seconds) > 1e-9] == []
    k = first["stats"]["k_history"][0]["k"]
    assert k >= TIMING_SLACK * SLOW_PART_S / _profile_iter_s(profiling)  # the slowest rank's persist fits in k


def test_a_restore_loads_the_newest_committed_step_on_both_ranks(run: Path) -> None:
    last = _steps(_ranks(run)[0])[-1]
    assert json.loads((run / "restore.json").read_text()) == [{"latest": last, "start": last}] * 2
    found = jobs.load_arrays(run / "state-restored.npz")
    expected = jobs.load_arrays(run / "state-final.npz")
    assert sorted(found) == sorted(expected)
    assert [name for name in expected if not np.array_equal(found[name], expected[name])] == []
