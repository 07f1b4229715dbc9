"""The engine's sharded mode on spawned gloo ranks (FSDP2, float64, CPU): every rank
snapshots and writes its own part, rank 0 waits for the one global commit, and every rank
loads its boxes back at any world size.

One module-scoped chain of runs shares a directory: a 2-rank reference run checkpoints
every 3 iterations up to 12; the same run again is SIGKILLed (every rank) right after
iteration 9 handed its checkpoint to the persist thread, so step 9 may or may not be
committed; a 2-rank restart resumes from what that crash left and trains to 12 with rank 1
never writing its part of step 12; a 3-rank restore reads the crash's store and a 1-rank
``restore()`` the restart's (resharding).
"""

from __future__ import annotations

import copy
import json
import os
import shutil
import signal
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import sharded_state_jobs as jobs
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from store_helpers import newest_sharded, part_store

from ray_checkfreq.engine import CheckFreq, CheckFreqConfig, EngineSeams, PersistError
from ray_checkfreq.engine.restore import RestoreMismatchError, optimizer_by_name, optimizer_by_number, parameter_names
from ray_checkfreq.engine.rng import seed_new_rank, set_own_rng
from ray_checkfreq.engine.seams import local_rng_state
from ray_checkfreq.engine.sharded_persist import ShardedPersistWorker, rank_part
from ray_checkfreq.engine.snapshot import Snapshot, Snapshotter
from ray_checkfreq.engine.state import ChunkPlace
from ray_checkfreq.errors import FencedWriterError
from ray_checkfreq.ray.decisions import BroadcastDecisions
from ray_checkfreq.storage import CheckpointStore
from ray_checkfreq.storage.chunks import Box
from ray_checkfreq.storage.store import CheckpointStore, ChunkSource
from ray_checkfreq.storage.tree import leaves_of

EVERY = 3
KILLED_AT = 9  # every rank of the crashed run is SIGKILLed right after this iteration's cf.step()
TOTAL = 12
SKIPPED = 12  # rank 1 of the restart never writes its part of this step
RECORDED = (6, 9)  # the reference run keeps its full state and RNG states at these iterations
COMMIT_WAIT_S = 2.0


# ------------------------------------------------------------------ helpers (run in the ranks)
def _training(seed: int, lr: float = 1e-2) -> tuple[torch.nn.Module, torch.optim.Optimizer, Any]:
    model = jobs.sharded_net(seed=seed)
    opt = jobs.optimizer_of(model, lr=lr)
    return model, opt, torch.optim.lr_scheduler.StepLR(opt, step_size=4, gamma=0.5)


def _iteration(model: torch.nn.Module, opt: torch.optim.Optimizer, sched: Any, it: int, rank: int,
               world: int) -> None:
    """Global batch ``it`` split by rank, plus noise from this rank's own global RNG (so a
    resumed run only matches when each rank's RNG state came back)."""
    share = jobs.GLOBAL_BATCH // world
    gen = torch.Generator().manual_seed(1000 + it)
    x = torch.randn(jobs.GLOBAL_BATCH, 8, generator=gen, dtype=torch.float64)
    y = torch.randn(jobs.GLOBAL_BATCH, 5, generator=gen, dtype=torch.float64)
    mine = slice(rank * share, (rank + 1) * share)
    noise = 1e-3 * torch.randn(share, 8, dtype=torch.float64)
    loss = torch.nn.functional.mse_loss(model(x[mine] + noise), y[mine])
    opt.zero_grad()
    loss.backward()
    opt.step()
    sched.step()


def _engine(model: torch.nn.Module, opt: torch.optim.Optimizer, sched: Any, store: CheckpointStore, rank: int,
            persister: Any = None) -> tuple[CheckFreq, BroadcastDecisions]:
    decisions = BroadcastDecisions(dist.new_group(backend="gloo"), rank)
    config = CheckFreqConfig(every=EVERY, compress=False, commit_wait_s=COMMIT_WAIT_S)
    cf = CheckFreq(model=model, optimizer=opt, storage=store, extra_state={"sched": sched}, config=config,
                   seams=EngineSeams(decisions=decisions, persister=persister))
    return cf, decisions


def _shared_writer(store: CheckpointStore, rank: int, *, choose_latest: bool) -> int | None:
    """Rank 0 takes the generation (and, restoring, picks the newest committed step) and
    hands both to every rank, as the Ray layer does."""
    chosen: list[Any] = [None, None]
    if rank == 0:
        generation = store.acquire_writer()
        step = None
        if choose_latest:
            store.salvage()
            latest = newest_sharded(store)
            step = None if latest is None else latest.step
        chosen = [generation, step]
    dist.broadcast_object_list(chosen, src=0)
    store.adopt_generation(chosen[0])
    return chosen[1]


def _gather_rng(path: Path, rank: int, world: int) -> None:
    gathered: list[Any] = [None] * world
    dist.all_gather_object(gathered, torch.get_rng_state().tolist())
    if rank == 0:
        path.write_text(json.dumps(gathered))


class _SkipStep:
    """A persister that drops one step's snapshot: that rank never writes its part."""

    def __init__(self, inner: ShardedPersistWorker, step: int) -> None:
        self.inner, self.step = inner, step

    @property
    def busy(self) -> bool:
        return self.inner.busy

    def submit(self, snapshot: Snapshot, **options: Any) -> None:
        if snapshot.step != self.step:
            self.inner.submit(snapshot, **options)

    def wait_idle(self) -> float:
        return self.inner.wait_idle()

    def raise_if_failed(self) -> None:
        self.inner.raise_if_failed()

    def close(self) -> None:
        self.inner.close()


# ------------------------------------------------------------------ jobs
def _run(rank: int, world: int, root: Path, store_dir: str, *, kill_at: int | None) -> None:
    """TOTAL iterations from scratch; SIGKILLed after ``kill_at`` when given."""
    model, opt, sched = _training(seed=0)
    torch.manual_seed(100 + rank)  # after the model, which seeds every rank alike
    store = part_store(str(root / store_dir))
    _shared_writer(store, rank, choose_latest=False)
    persisted: list[dict] = []

    def persister(store: CheckpointStore, on_done: Any) -> ShardedPersistWorker:
        def done(result: Any) -> None:
            persisted.append({"step": result.step, "seconds": result.seconds, "stored_bytes": result.stored_bytes})
            on_done(result)
        return ShardedPersistWorker(store, rank=rank, world_size=world, commit_wait_s=COMMIT_WAIT_S, on_done=done)

    cf, decisions = _engine(model, opt, sched, store, rank, persister=persister)
    for it in range(TOTAL):
        _iteration(model, opt, sched, it, rank, world)
        cf.step()
        if cf.iteration == kill_at:
            os.kill(os.getpid(), signal.SIGKILL)  # its checkpoint is in the persist thread now
        if kill_at is None and cf.iteration in RECORDED:
            _gather_rng(root / f"rng-{cf.iteration}.json", rank, world)
            jobs.save_full(root / f"state-{cf.iteration}.npz", rank, model, opt, sched)
    jobs.save_full(root / "state-final.npz", rank, model, opt, sched)
    cf.close()
    decisions.close()
    jobs.gather_json(root / "train-stats.json", rank, world, {"committed": cf.stats()["checkpoints_committed"],
                                                         "persisted": persisted})
    if rank == 0:
        (root / "train-steps.json").write_text(json.dumps([ref.step for ref in store.list()]))


def reference_job(rank: int, world: int, root: Path) -> None:
    _run(rank, world, root, "run", kill_at=None)


def crash_job(rank: int, world: int, root: Path) -> None:
    _run(rank, world, root, "crashed", kill_at=KILLED_AT)


def resume_job(rank: int, world: int, root: Path) -> None:
    """A restart after the crash: other weights, RNG and learning rate, all replaced."""
    model, opt, sched = _training(seed=123, lr=0.5)
    torch.manual_seed(555 + rank)
    store = part_store(str(root / "resume"))
    step = _shared_writer(store, rank, choose_latest=True)
    assert step is not None

    def persister(store: CheckpointStore, on_done: Any) -> Any:
        inner = ShardedPersistWorker(store, rank=rank, world_size=world, commit_wait_s=COMMIT_WAIT_S,
                                     on_done=on_done)
        return _SkipStep(inner, SKIPPED) if rank == 1 else inner

    cf, decisions = _engine(model, opt, sched, store, rank, persister=persister)
    start = cf.load_sharded(step)
    for it in range(start, TOTAL):
        _iteration(model, opt, sched, it, rank, world)
        cf.step()
    jobs.save_full(root / "state-resumed.npz", rank, model, opt, sched)
    try:
        cf.close()  # rank 0: waits for step SKIPPED, which never commits
        error = None
    except PersistError as err:
        error = str(err)
    decisions.close()
    jobs.gather_json(root / "resume.json", rank, world, {"step": step, "start": start, "end": cf.iteration,
                                                     "error": error})
    dist.barrier()
    if rank == 0:
        (root / "resume-steps.json").write_text(json.dumps([ref.step for ref in store.list()]))


class _counting_optimizer_steps:
    """Counts the zero-gradient optimizer steps a restore takes to make the optimizer's state."""

    def __enter__(self) -> list[int]:
        import torch.distributed.checkpoint.state_dict as dcp_state_dict

        self.module, self.original, self.calls = dcp_state_dict, dcp_state_dict._init_optim_state, []
        def counted(optim: Any) -> None:
            if not optim.state:  # torch's helper steps only an optimizer without state
                self.calls.append(1)
            self.original(optim)

        dcp_state_dict._init_optim_state = counted
        return self.calls

    def __exit__(self, *exc: Any) -> None:
        self.module._init_optim_state = self.original


def reshard_job(rank: int, world: int, root: Path) -> None:
    """A restore at another world size: 3 ranks from what the crash left, 1 rank
    (``restore()``, with salvage) from the restart's store, whose step SKIPPED lacks a
    part; and the mismatches a sharded engine refuses."""
    model, opt, sched = _training(seed=321, lr=0.5)
    torch.manual_seed(777 + rank)
    refused = []
    if world > 1:
        try:
            CheckFreq(model=model, optimizer=opt, storage=str(root / "unused"), every=EVERY)
        except ValueError as err:
            refused.append(str(err))
    try:
        CheckFreq(model=model, optimizer=opt, storage=str(root / "unused"), every=EVERY,
                  seams=EngineSeams(decisions=BroadcastDecisions(None, rank), takes_snapshots=False))
    except ValueError as err:
        refused.append(str(err))
    store = part_store(str(root / "restore-copy"))
    store_by_uri = None
    steps_taken: list[int] = []
    if world == 1:
        by_uri = CheckFreq(model=model, optimizer=opt, storage=str(root / "by-uri"), every=EVERY)
        store_by_uri = f"{type(by_uri.store).__name__} {by_uri.store.config.codec}"
        by_uri.close()
        cf = CheckFreq(model=model, optimizer=opt, storage=store, extra_state={"sched": sched}, every=EVERY)
        start = cf.restore()
    else:
        step = _shared_writer(store, rank, choose_latest=True)
        cf, decisions = _engine(model, opt, sched, store, rank)
        assert step is not None
        with _counting_optimizer_steps() as steps_taken:
            start = cf.load_sharded(step)
        decisions.close()
    _gather_rng(root / f"rng-w{world}.json", rank, world)
    jobs.save_full(root / f"state-w{world}.npz", rank, model, opt, sched)
    jobs.gather_json(root / f"reshard-w{world}.json", rank, world, {"start": start, "refused": refused,
                                                                       "store_by_uri": store_by_uri,
                                                                       "optimizer_steps": len(steps_taken)})
    cf.close()


def from_replicated_job(rank: int, world: int, root: Path) -> None:
    """FSDP2 on 2 ranks resumes from the replicated checkpoint a plain run wrote, with other
    weights, learning rate and RNG first, then trains EVERY iterations more."""
    model, opt, sched = _training(seed=999, lr=0.5)
    torch.manual_seed(444 + rank)
    store = part_store(str(root / "plain"))
    chosen: list[Any] = [None, None]
    if rank == 0:
        chosen = [store.acquire_writer(), store.list()[-1].step]
    dist.broadcast_object_list(chosen, src=0)
    store.adopt_generation(chosen[0])
    cf, decisions = _engine(model, opt, sched, store, rank)
    start = cf.load_sharded(chosen[1])
    _gather_rng(root / "rng-from-plain.json", rank, world)
    jobs.save_full(root / "state-from-plain.npz", rank, model, opt, sched)
    for it in range(start, start + EVERY):
        _iteration(model, opt, sched, it, rank, world)
        cf.step()
    _gather_rng(root / "rng-sharded-end.json", rank, world)
    jobs.save_full(root / "state-sharded-end.npz", rank, model, opt, sched)
    cf.close()
    decisions.close()
    jobs.gather_json(root / "from-plain.json", rank, world, {"start": start})


def _plain_training(seed: int, lr: float) -> tuple[torch.nn.Module, torch.optim.Optimizer, Any]:
    torch.manual_seed(seed)
    model = jobs.Net().double()
    opt = jobs.optimizer_of(model, lr=lr)
    return model, opt, torch.optim.lr_scheduler.StepLR(opt, step_size=4, gamma=0.5)


def _plain_named_state(model: torch.nn.Module, opt: torch.optim.Optimizer, sched: Any) -> dict[str, np.ndarray]:
    """A plain model's state named as ``jobs.full_state`` names an FSDP2 model's."""
    named = optimizer_by_name(opt.state_dict(), parameter_names(model, opt))
    found = {name: leaf.numpy().copy() for _, name, leaf in leaves_of({"model": model.state_dict(),
                                                                        "optimizer": named})}
    return {**found, "sched/last_epoch": np.array(sched.last_epoch)}


# ------------------------------------------------------------------ the runs
@pytest.fixture(scope="module")
def across_placements(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A plain run (one process) checkpoints to 2 * EVERY, an FSDP2 run of 2 ranks resumes
    from it and checkpoints EVERY more (a sharded step in the same store), and a plain
    ``restore()`` then resumes from that sharded step."""
    root = tmp_path_factory.mktemp("across-placements")
    model, opt, sched = _plain_training(seed=0, lr=1e-2)
    cf = CheckFreq(model=model, optimizer=opt, storage=part_store(str(root / "plain")),
                   extra_state={"sched": sched}, every=EVERY, compress=False)
    for it in range(2 * EVERY):
        _iteration(model, opt, sched, it, 0, 1)
        cf.step()
    cf.close()
    jobs.save_arrays(root / "state-plain.npz", _plain_named_state(model, opt, sched))
    (root / "rng-plain.json").write_text(json.dumps(torch.get_rng_state().tolist()))
    jobs.spawn(from_replicated_job, 2, str(root))
    model, opt, sched = _plain_training(seed=5, lr=0.5)
    cf = CheckFreq(model=model, optimizer=opt, storage=part_store(str(root / "plain")),
                   extra_state={"sched": sched}, every=EVERY, compress=False)
    start = cf.restore()
    jobs.save_arrays(root / "state-plain-again.npz", _plain_named_state(model, opt, sched))
    (root / "plain-again.json").write_text(json.dumps({"start": start, "rng": torch.get_rng_state().tolist()}))
    cf.close()
    return root


def test_a_replicated_checkpoint_loads_into_fsdp2_ranks(across_placements: Path) -> None:
    """Each of 2 FSDP2 ranks reads its boxes of the plain run's whole tensors; the numbered
    optimizer state lands under the parameters' names, the scheduler and RNG come back."""
    root = across_placements
    assert [r["start"] for r in json.loads((root / "from-plain.json").read_text())] == [2 * EVERY] * 2
    _assert_same(jobs.load_arrays(root / "state-from-plain.npz"), jobs.load_arrays(root / "state-plain.npz"))
    rng = json.loads((root / "rng-plain.json").read_text())
    assert json.loads((root / "rng-from-plain.json").read_text()) == [rng, rng]  # one process's, on every rank


def test_a_sharded_checkpoint_resumes_a_plain_model_with_its_optimizer(across_placements: Path) -> None:
    """Back: the plain ``restore()`` takes the newest step, the FSDP2 run's sharded one,
    gathered whole, optimizer state numbered again, rank 0's RNG."""
    root = across_placements
    store = part_store(str(root / "plain"))
    assert [(ref.step, ref.placement) for ref in store.list()] == [(2 * EVERY, "replicated"), (3 * EVERY, "sharded")]
    again = json.loads((root / "plain-again.json").read_text())
    assert again["start"] == 3 * EVERY
    _assert_same(jobs.load_arrays(root / "state-plain-again.npz"), jobs.load_arrays(root / "state-sharded-end.npz"))
    assert again["rng"] == json.loads((root / "rng-sharded-end.json").read_text())[0]


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("engine-sharded")
    jobs.spawn(reference_job, 2, str(root))
    with pytest.raises(mp.ProcessExitedException, match="SIGKILL"):
        jobs.spawn(crash_job, 2, str(root))
    committed = [ref.step for ref in part_store(str(root / "crashed")).list()]
    (root / "crash-committed.json").write_text(json.dumps(committed))
    shutil.copytree(root / "crashed", root / "resume")
    shutil.copytree(root / "crashed", root / "restore-copy")
    jobs.spawn(resume_job, 2, str(root))
    jobs.spawn(reshard_job, 3, str(root))
    shutil.rmtree(root / "restore-copy")
    shutil.copytree(root / "resume", root / "restore-copy")  # its step SKIPPED lacks rank 1's part
    jobs.spawn(reshard_job, 1, str(root))
    return root


def _assert_same(found: dict[str, np.ndarray], expected: dict[str, np.ndarray]) -> None:
    assert sorted(found) == sorted(expected)
    different = [name for name in expected if not np.array_equal(found[name], expected[name])]
    assert different == []


def _resumed_from(runs: Path) -> int:
    return int(json.loads((runs / "resume.json").read_text())[0]["start"])


def test_the_run_committed_every_kth_iteration_on_every_rank(runs: Path) -> None:
    assert json.loads((runs / "train-steps.json").read_text())[-2:] == [9, 12]  # keep_last=2
    stats = json.loads((runs / "train-stats.json").read_text())
    assert [entry["committed"] for entry in stats] == [4, 4]
    assert [[p["step"] for p in entry["persisted"]] for entry in stats] == [[3, 6, 9, 12]] * 2


def test_restart_after_a_sigkill_resumes_at_the_newest_committed_step_and_continues_bit_identically(
        runs: Path) -> None:
    committed_at_crash = json.loads((runs / "crash-committed.json").read_text())
    assert committed_at_crash and committed_at_crash[-1] in (6, 9)  # 9 only if its commit beat the kill
    report = json.loads((runs / "resume.json").read_text())
    start = report[0]["start"]
    assert start in (6, 9) and start >= committed_at_crash[-1]  # 9 also when salvage committed it
    assert [(r["step"], r["start"], r["end"]) for r in report] == [(start, start, TOTAL)] * 2
    _assert_same(jobs.load_arrays(runs / "state-resumed.npz"), jobs.load_arrays(runs / "state-final.npz"))


def test_a_step_missing_one_rank_part_is_not_committed_and_the_previous_one_stays(runs: Path) -> None:
    report = json.loads((runs / "resume.json").read_text())
    assert report[1]["error"] is None
    assert report[0]["error"] is not None
    assert f"iteration {SKIPPED}" in report[0]["error"] and "ranks [1] of 2 wrote no part" in report[0]["error"]
    assert json.loads((runs / "resume-steps.json").read_text())[-1] == 9


def test_restore_at_three_ranks_equals_the_saved_state(runs: Path) -> None:
    step = _resumed_from(runs)
    report = json.loads((runs / "reshard-w3.json").read_text())
    assert [r["start"] for r in report] == [step] * 3
    # the optimizer's state was made as the checkpoint holds it, not by an optimizer step
    assert [r["optimizer_steps"] for r in report] == [0] * 3
    _assert_same(jobs.load_arrays(runs / "state-w3.npz"), jobs.load_arrays(runs / f"state-{step}.npz"))


def test_restore_at_one_rank_loads_the_newest_complete_step(runs: Path) -> None:
    assert json.loads((runs / "reshard-w1.json").read_text())[0]["start"] == 9  # not SKIPPED: a part lacks
    _assert_same(jobs.load_arrays(runs / "state-w1.npz"), jobs.load_arrays(runs / "state-9.npz"))


def test_a_sharded_step_loads_whole_in_one_process_and_into_a_plain_model(runs: Path) -> None:
    """FSDP2 to a plain model: ``CheckpointStore.load`` gathers a sharded step, every model
    and optimizer tensor whole and equal to the full state the run had at that step."""
    store = CheckpointStore(str(runs / "run"))
    steps = {ref.step for ref in store.list(placement="sharded")}
    step = max(steps & set(RECORDED))
    state = store.load(step)
    expected = jobs.load_arrays(runs / f"state-{step}.npz")
    kept = {key: state[key] for key in ("model", "optimizer")}
    found = {name: np.asarray(leaf) for _, name, leaf in leaves_of(kept)}
    _assert_same(found, {name: value for name, value in expected.items() if not name.startswith("sched/")})
    plain = jobs.Net().double()  # the same module, not sharded
    plain.load_state_dict(state["model"])
    assert all(torch.equal(plain.state_dict()[name], state["model"][name]) for name in state["model"])
    # latest() and load() with no step: the newest exact checkpoint of either placement, gathered.
    newest = store.latest()
    assert newest is not None and newest.step == max(steps) and newest.placement == "sharded"
    by_step, newest_state = store.load(max(steps)), store.load()
    assert all(torch.equal(newest_state["model"][name], by_step["model"][name]) for name in by_step["model"])


def test_each_rank_gets_its_own_rng_and_a_new_rank_is_seeded(runs: Path) -> None:
    saved = json.loads((runs / f"rng-{_resumed_from(runs)}.json").read_text())
    loaded = json.loads((runs / "rng-w3.json").read_text())
    assert saved[0] != saved[1]
    assert loaded[:2] == saved
    before = torch.get_rng_state()
    try:
        seed_new_rank(0, 2, 2)
        expected = torch.get_rng_state().tolist()
    finally:
        torch.set_rng_state(before)
    assert loaded[2] == expected
    assert json.loads((runs / "rng-w1.json").read_text()) == json.loads((runs / "rng-9.json").read_text())[:1]


def test_sharded_model_refuses_local_decisions_and_no_snapshots(runs: Path) -> None:
    at_three = json.loads((runs / "reshard-w3.json").read_text())
    for rank in at_three:
        local, no_snapshots = rank["refused"]
        assert "LocalDecisions" in local and "3 ranks" in local
        assert "takes_snapshots=False" in no_snapshots
    alone = json.loads((runs / "reshard-w1.json").read_text())[0]
    # alone, LocalDecisions is fine
    assert len(alone["refused"]) == 1 and "takes_snapshots=False" in alone["refused"][0]
    # a URI gets a CheckpointStore's defaults: compress=None can run the compression trial
    assert alone["store_by_uri"] == "CheckpointStore rcfz"


# ------------------------------------------------------------------ the pieces, in process
def test_adopt_generation_is_idempotent_and_refuses_another(tmp_path: Path) -> None:
    store = part_store(str(tmp_path))
    store.adopt_generation(5)
    store.adopt_generation(5)
    assert store.writer_generation == 5
    with pytest.raises(ValueError, match="generation 5, cannot adopt generation 6"):
        store.adopt_generation(6)
    with pytest.raises(ValueError, match="generation=0"):
        part_store(str(tmp_path)).adopt_generation(0)


def test_save_part_takes_the_codec_of_the_action(tmp_path: Path) -> None:
    store = part_store(str(tmp_path), writer_generation=1)
    data = torch.arange(4096, dtype=torch.float64) % 7
    chunk = ChunkSource(key="model/w", data=data, global_shape=(4096,), offsets=(0,), rank=0)
    for step, codec in ((1, "rcfz"), (2, None)):
        store.save_part(step, world_size=1, skeletons={0: {}}, chunks=[chunk], codec=codec)
        assert store.try_commit(step).committed
        assert store.reader(step).manifest.tensor("model/w").chunks[0].codec == (codec or "raw")
        loaded = store.reader(step).load_boxes({"model/w": [Box((0,), (4096,))]})["model/w"][0]
        assert torch.equal(torch.as_tensor(loaded), data)


@pytest.mark.parametrize("codec", ["rcfz", None])
def test_a_box_is_read_into_the_memory_given_and_a_wrong_destination_is_refused(tmp_path: Path,
                                                                                  codec: str | None) -> None:
    store = part_store(str(tmp_path), writer_generation=1)
    data = torch.arange(4096, dtype=torch.float64).reshape(64, 64) % 7
    store.save_part(1, world_size=1, skeletons={0: {}}, codec=codec,
                    chunks=[ChunkSource(key="model/w", data=data, global_shape=(64, 64), offsets=(0, 0), rank=0)])
    assert store.try_commit(1).committed
    target = torch.full((16, 64), -1.0, dtype=torch.float64)
    into = {"model/w": target.reshape(-1).view(torch.uint8).numpy().reshape(16, 64, 8)}
    loaded = store.reader(1).load_boxes({"model/w": [Box((8, 0), (16, 64))]}, into=into)["model/w"][0]
    assert torch.equal(target, data[8:24]) and loaded.data_ptr() == target.data_ptr()
    with pytest.raises(ValueError, match=r"tensor 'model/w': a destination of \(16, 64, 4\)"):
        store.reader(1).load_boxes({"model/w": [Box((8, 0), (16, 64))]},
                                   into={"model/w": np.zeros((16, 64, 4), np.uint8)})


def test_the_optimizer_state_is_made_as_saved_without_an_optimizer_step(monkeypatch) -> None:
    import torch.distributed.checkpoint.state_dict as dcp_state_dict

    from ray_checkfreq.engine.state import PlainStateAdapter, SavedLeaf

    model, opt, _ = _plain_training(seed=0, lr=1e-2)
    names = parameter_names(model, opt)[0]
    saved = {name: {"step": SavedLeaf((), torch.float32), "exp_avg": SavedLeaf(tuple(p.shape), torch.float64),
                    "exp_avg_sq": SavedLeaf(tuple(p.shape), torch.float64)}
             for name, p in model.named_parameters()}
    adapter = PlainStateAdapter(model, opt)
    assert not adapter.prepare_optimizer_state({k: v for k, v in saved.items() if k != names[-1]})
    assert not opt.state  # one parameter's state missing: nothing made, the restore takes the step
    original = dcp_state_dict._init_optim_state

    def no_step(optim: Any) -> None:
        assert optim.state, "an optimizer step was taken"
        original(optim)

    monkeypatch.setattr(dcp_state_dict, "_init_optim_state", no_step)
    before = [p.detach().clone() for p in model.parameters()]
    assert adapter.prepare_optimizer_state(saved)
    targets = adapter.restore_targets()
    assert len(targets) == 3 * len(names) + len(dict(model.state_dict()))
    for param, was in zip(model.parameters(), before):
        state = opt.state[param]
        assert state["exp_avg"].shape == param.shape and state["exp_avg_sq"].dtype == torch.float64
        assert state["step"].shape == () and state["step"].device.type == "cpu"
        assert torch.equal(param, was)
    assert not adapter.prepare_optimizer_state(saved)  # state exists now: left as it is


def test_sharded_store_shares_the_metadata_documents(tmp_path: Path) -> None:
    part_store(str(tmp_path)).write_metadata("checkfreq-profile.json", {"a": 1})
    assert CheckpointStore(str(tmp_path)).read_metadata("checkfreq-profile.json") == {"a": 1}
    with pytest.raises(ValueError, match="metadata name"):
        part_store(str(tmp_path)).read_metadata("../x.json")


def test_set_own_rng_takes_a_list_or_a_mapping_of_ranks() -> None:
    before = torch.get_rng_state()
    try:
        torch.manual_seed(1)
        one = local_rng_state()
        torch.manual_seed(2)
        two = local_rng_state()
        set_own_rng({"world_size": 2, "ranks": [one, two]}, rank=1, seed=0)
        assert torch.equal(torch.get_rng_state(), two["torch"])
        set_own_rng({"world_size": 2, "ranks": {0: one}}, rank=0, seed=0)
        assert torch.equal(torch.get_rng_state(), one["torch"])
        set_own_rng({"world_size": 2, "ranks": {}}, rank=3, seed=0)
        seeded = torch.get_rng_state()
        seed_new_rank(0, 3, 2)
        assert torch.equal(seeded, torch.get_rng_state())
    finally:
        torch.set_rng_state(before)


@pytest.mark.parametrize("wait", [0, -1.0, float("inf"), True, "5"])
def test_commit_wait_is_validated(wait: Any) -> None:
    with pytest.raises(ValueError, match="commit_wait_s"):
        CheckFreqConfig(commit_wait_s=wait)


def _snapshot(step: int) -> Snapshot:
    state = {"model": {"w": torch.arange(6.0).reshape(3, 2), "scale": torch.ones(2)},
             "rng": {"torch": torch.arange(4, dtype=torch.uint8)}, "checkfreq": {"iteration": step}}
    places = {("model", "w"): ChunkPlace(name="model/w", global_shape=(6, 2), offsets=(3, 0), owner=True),
              ("model", "scale"): ChunkPlace(name="model/scale", global_shape=(2,), offsets=(0,), owner=False)}
    snapshotter = Snapshotter("cpu")
    try:
        snapshot = snapshotter.take(step, state, set())  # copied now: its copies are complete
    finally:
        snapshotter.close()
    snapshot.places = places
    return snapshot


def test_rank_part_keeps_owned_chunks_by_name_and_own_leaves_by_rank() -> None:
    snapshot = _snapshot(3)
    assert snapshot.places is not None
    part = rank_part(snapshot.state, snapshot.places, rank=1)
    assert [(c.key, c.global_shape, c.offsets, c.rank) for c in part.chunks] == [
        ("model/w", (6, 2), (3, 0), 1), ("rank/1/rng/torch", (4,), (0,), 1)]  # scale: rank 0 owns it
    assert part.skeleton["leaves"] == [{"key": "model/w", "rank": False}, {"key": "model/scale", "rank": False},
                                       {"key": "rank/1/rng/torch", "rank": True}]


def test_a_fenced_rank_part_is_a_persist_failure(tmp_path: Path) -> None:
    store = part_store(str(tmp_path))
    store.acquire_writer()
    part_store(str(tmp_path)).acquire_writer()  # a newer run took over
    worker = ShardedPersistWorker(store, rank=1, world_size=2, commit_wait_s=1.0)
    try:
        worker.submit(_snapshot(3))
        worker.wait_idle()
        with pytest.raises(PersistError, match="iteration 3.*FencedWriterError") as failure:
            worker.raise_if_failed()
        assert isinstance(failure.value.__cause__, FencedWriterError)
    finally:
        worker.close()
    assert store.list() == []


# ------------------------------------------------------------------ a rank's own snapshot (RAM copy)
def own_snapshot_job(rank: int, world: int, root: Path) -> None:
    """Each rank keeps a copy of its own pieces with their sharding record (as its slot
    holds it), trains on, checks which records fit, and loads its copy back."""
    from ray_checkfreq.engine.sharded_restore import (
        SHARDING_KEY,
        load_rank_snapshot,
        sharding_record,
        snapshot_mismatch,
    )

    torch.set_num_threads(1)
    model = jobs.sharded_net(seed=0)
    opt = jobs.optimizer_of(model)
    jobs.train(model, opt, range(3), rank, world)
    adapter = jobs.fsdp_adapter(model, opt)
    view = adapter.local_view(adapter.live_state())
    copied = {**copy.deepcopy(view.state), "checkfreq": {"optimizer_class": type(opt).__qualname__}}
    record = sharding_record({c.path: ChunkPlace.of(c) for c in view.chunks}, rank=rank, world_size=world)
    state = {**copied, SHARDING_KEY: record}
    saved = jobs.full_state(model, opt)
    jobs.train(model, opt, range(3, 5), rank, world)
    name = view.chunks[0].name
    shifted = {**record, "offsets": {**record["offsets"], name: [o + 1 for o in record["offsets"][name]]}}
    checks = {
        "fits": snapshot_mismatch(state, adapter, rank=rank, world_size=world, optimizer_class="AdamW"),
        "other rank": snapshot_mismatch({**state, SHARDING_KEY: {**record, "rank": 1 - rank}}, adapter,
                                        rank=rank, world_size=world, optimizer_class="AdamW"),
        "other world": snapshot_mismatch(state, adapter, rank=rank, world_size=world + 1, optimizer_class="AdamW"),
        "shifted": snapshot_mismatch({**state, SHARDING_KEY: shifted}, adapter, rank=rank, world_size=world,
                                     optimizer_class="AdamW"),
        "no record": snapshot_mismatch(copied, adapter, rank=rank, world_size=world, optimizer_class="AdamW"),
        "optimizer": snapshot_mismatch(state, adapter, rank=rank, world_size=world, optimizer_class="SGD"),
    }
    load_rank_snapshot(state, adapter)
    loaded = jobs.full_state(model, opt)
    if rank == 0:
        (root / "checks.json").write_text(json.dumps({**checks, "name": name}))
        jobs.save_arrays(root / "saved.npz", saved)
        jobs.save_arrays(root / "loaded.npz", loaded)


def test_a_ranks_own_snapshot_loads_back_only_where_its_pieces_fit(tmp_path: Path) -> None:
    jobs.spawn(own_snapshot_job, 2, str(tmp_path))
    checks = json.loads((tmp_path / "checks.json").read_text())
    assert checks["fits"] is None
    assert "saved by rank 1 of 2, this is rank 0 of 2" in checks["other rank"]
    assert "this is rank 0 of 3" in checks["other world"]
    assert checks["shifted"].startswith(f"{checks['name']}: saved at offsets")
    assert checks["no record"] == "it has no sharding record"
    assert "saved by AdamW, loading into SGD" in checks["optimizer"]
    _assert_same(jobs.load_arrays(tmp_path / "loaded.npz"), jobs.load_arrays(tmp_path / "saved.npz"))


class _CommitsLate:
    """A store whose step is committed at the ``commit_at``-th ``try_commit`` (never: None)."""

    def __init__(self, commit_at: int | None) -> None:
        self.commit_at = commit_at
        self.calls = 0

    def try_commit(self, step: int) -> Any:
        from ray_checkfreq.storage.store import CommitResult

        self.calls += 1
        done = self.commit_at is not None and self.calls >= self.commit_at
        return CommitResult(committed=done, by_me=False, missing_ranks=() if done else (1,))


def _polling_worker(store: Any, pauses: list[float], now: list[float]) -> ShardedPersistWorker:
    def sleep(seconds: float) -> None:
        pauses.append(seconds)
        now[0] += seconds

    return ShardedPersistWorker(store, rank=0, world_size=2, commit_wait_s=2.0, sleep=sleep, clock=lambda: now[0])


def test_rank0_polls_the_commit_backing_off_to_50_ms_and_names_the_missing_ranks_at_the_deadline():
    """Rank 0's next checkpoint waits for its persist, which waits for the commit: a poll
    later than 50 ms after the last part landed would be stall."""
    pauses: list[float] = []
    store = _CommitsLate(commit_at=12)
    worker = _polling_worker(store, pauses, [0.0])
    try:
        first = store.try_commit(7)
        assert worker._wait_for_commit(7, first).committed and store.calls == 12
    finally:
        worker.close()
    assert pauses[:4] == pytest.approx([0.005, 0.01, 0.02, 0.04]) and max(pauses) == pytest.approx(0.05)
    never = _CommitsLate(commit_at=None)
    worker = _polling_worker(never, [], [0.0])
    try:
        with pytest.raises(PersistError, match=r"commit_wait_s=2 s: ranks \[1\]"):
            worker._wait_for_commit(7, never.try_commit(7))
    finally:
        worker.close()


def test_optimizer_state_is_renamed_by_place_and_a_mismatch_is_named() -> None:
    model, opt, sched = _plain_training(seed=0, lr=1e-2)
    _iteration(model, opt, sched, 0, 0, 1)
    names = parameter_names(model, opt)
    assert names == [[name for name, _ in model.named_parameters()]]
    numbered = opt.state_dict()
    named = optimizer_by_name(numbered, names)
    assert sorted(named["state"]) == sorted(names[0]) and named["param_groups"][0]["params"] == names[0]
    assert torch.equal(named["state"]["out.bias"]["exp_avg"], opt.state[model.out.bias]["exp_avg"])
    back = optimizer_by_number(named, names)
    assert back["param_groups"] == numbered["param_groups"] and sorted(back["state"]) == sorted(numbered["state"])
    swapped = [[names[0][1], names[0][0], *names[0][2:]]]
    with pytest.raises(RestoreMismatchError, match=r"optimizer/param_groups/0/params/0.*'inp.weight' saved, "
                                                   r"'inp.bias' now"):
        optimizer_by_number(named, swapped)
    with pytest.raises(RestoreMismatchError, match=r"optimizer/param_groups/0/params.*8 parameters saved, 7 now"):
        optimizer_by_name(numbered, [names[0][:-1]])
    with pytest.raises(RestoreMismatchError, match="optimizer/param_groups.*1 saved, 2 now"):
        optimizer_by_name(numbered, [names[0], []])
