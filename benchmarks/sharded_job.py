"""The ranks of ``bench sharded`` (benchmarks/sharded.py): spawned gloo processes that train
an FSDP2 model and checkpoint it four ways, then restore it three ways.

Every job reads its settings from ``settings.json`` under its directory and rank 0 writes
what every rank measured (gathered) as ``results-<job>.json`` there. Peak RSS is the
process's VmHWM after resetting it (``/proc/self/clear_refs``) right before each variant.
"""

from __future__ import annotations

import faulthandler
import json
import os
import shutil
import sys
import time
import uuid
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

VARIANTS = ("baseline", "ours", "dcp async_save", "dcp save")
MiB = 1024 * 1024


@dataclass(frozen=True, kw_only=True)
class Settings:
    ranks: int = 2
    state_mb: float = 64.0
    width: int = 1024
    batch: int = 32
    iterations: int = 40
    every: int = 5
    rounds: int = 3

    def __post_init__(self) -> None:
        for name in ("ranks", "width", "batch", "iterations", "every", "rounds"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"--{name}: a positive integer, got {value!r}")
        if self.ranks < 2:
            raise ValueError(f"--ranks: at least 2 (the restores reshard onto one rank fewer), got {self.ranks}")
        if not self.state_mb > 0:
            raise ValueError(f"--state-mb: a positive size in MiB, got {self.state_mb!r}")
        if self.every > self.iterations:
            raise ValueError(f"--every {self.every} is above --iterations {self.iterations}: no checkpoint")

    @property
    def layers(self) -> int:
        """Linear layers whose float32 weights, biases and two Adam moments make ``state_mb``."""
        per_layer = 3 * 4 * (self.width * self.width + self.width)
        return max(1, round(self.state_mb * MiB / per_layer))

    @property
    def state_bytes(self) -> int:
        return self.layers * 3 * 4 * (self.width * self.width + self.width)


def write_settings(root: Path, settings: Settings) -> None:
    (root / "settings.json").write_text(json.dumps(asdict(settings)))


def _settings(root: Path) -> Settings:
    return Settings(**json.loads((root / "settings.json").read_text()))


# ------------------------------------------------------------------ processes
def spawn(job: Any, world: int, root: Path) -> None:
    """``job(rank, world, root)`` on ``world`` gloo ranks meeting through a fresh file."""
    rendezvous = root / f"rendezvous-{uuid.uuid4().hex}"
    mp.spawn(_entry, args=(world, f"file://{rendezvous}", job, str(root)), nprocs=world, join=True)


def _entry(rank: int, world: int, init_method: str, job: Any, root: str) -> None:
    faulthandler.enable()  # a native crash in a rank prints every thread's Python stack
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=world)
    try:
        job(rank, world, Path(root))
        dist.barrier()  # no rank leaves while another is still in a collective
    finally:
        dist.destroy_process_group()
    # Results are written: skip the interpreter's teardown, where gloo's threads can abort.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def reset_peak_rss() -> None:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def peak_rss_bytes() -> int:
    return _status_bytes("VmHWM:")


def rss_bytes() -> int:
    return _status_bytes("VmRSS:")


def _status_bytes(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"/proc/self/status has no {field} line")


def _gather(item: Any, world: int) -> list[Any]:
    gathered: list[Any] = [None] * world
    dist.all_gather_object(gathered, item)
    return gathered


# ------------------------------------------------------------------ model and training
def build(settings: Settings, seed: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(seed)
    model = torch.nn.Sequential(*[torch.nn.Linear(settings.width, settings.width) for _ in range(settings.layers)])
    for layer in model:
        fully_shard(layer)
    fully_shard(model)
    return model, torch.optim.Adam(model.parameters(), lr=1e-4)


def train_step(model: torch.nn.Module, opt: torch.optim.Optimizer, settings: Settings, it: int, rank: int) -> None:
    gen = torch.Generator().manual_seed(1000 * it + rank)
    x = torch.randn(settings.batch, settings.width, generator=gen)
    opt.zero_grad()
    model(x).square().mean().backward()
    opt.step()


def dcp_state(model: torch.nn.Module, opt: torch.optim.Optimizer) -> dict:
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_state, optim_state = get_state_dict(model, opt)
    return {"model": model_state, "optim": optim_state}


# ------------------------------------------------------------------ checkpointers
class NoCheckpoints:
    """The baseline; ``stall_s`` is the time the loop spent in checkpoint calls, and
    ``interval_stall_s`` that time per checkpoint interval (its k iterations' calls and,
    for ours, the fence in the next ``optimizer.step()``)."""

    def __init__(self, every: int = 1) -> None:
        self.every = every
        self.stall_s = 0.0
        self.checkpoints = 0
        self.engine_stall_s: float | None = None  # ours: the engine's own count, for comparison
        self.off_checkpoint_step_s: list[float] = []  # ours: cf.step() on iterations that take no checkpoint
        self.interval_stall_s: list[float] = []
        self._interval = 0.0

    def count(self, it: int, seconds: float) -> None:
        """Checkpoint work of iteration ``it``; an interval closes at each multiple of k."""
        self.stall_s += seconds
        self._interval += seconds
        if it % self.every == 0:
            self.interval_stall_s.append(self._interval)
            self._interval = 0.0

    def after_step(self, it: int) -> None:
        pass

    def finish(self) -> None:
        pass


class Ours(NoCheckpoints):
    """The engine in sharded mode at a fixed k, uncompressed: time in ``cf.step()`` on
    every iteration plus its ``optimizer.step()`` pre-hook (the fence), timed by two
    hooks of our own around it; the fence of checkpoint j runs in the interval after it
    and is counted to checkpoint j."""

    def __init__(self, model: torch.nn.Module, opt: torch.optim.Optimizer, settings: Settings, rank: int,
                 directory: Path, group: Any) -> None:
        from ray_checkfreq.engine import CheckFreq, CheckFreqConfig, EngineSeams
        from ray_checkfreq.ray.decisions import BroadcastDecisions
        from ray_checkfreq.storage import CheckpointStore

        super().__init__(settings.every)
        store = CheckpointStore(str(directory), codec="raw", full_every=1)  # raw parts, as async_save writes
        chosen: list[Any] = [store.acquire_writer() if rank == 0 else None]
        dist.broadcast_object_list(chosen, src=0)
        store.adopt_generation(chosen[0])
        self.decisions = BroadcastDecisions(group, rank)
        self._hook_started = 0.0
        self._fence_s = 0.0
        self._hooks = [opt.register_step_pre_hook(self._before_ours)]
        self.cf = CheckFreq(model=model, optimizer=opt, storage=store,
                            config=CheckFreqConfig(every=settings.every, compress=False),
                            seams=EngineSeams(decisions=self.decisions))
        self._hooks.append(opt.register_step_pre_hook(self._after_ours))

    def _before_ours(self, *args: Any) -> None:
        self._hook_started = time.perf_counter()

    def _after_ours(self, *args: Any) -> None:
        self._fence_s = time.perf_counter() - self._hook_started

    def after_step(self, it: int) -> None:
        fence, self._fence_s = self._fence_s, 0.0
        if self.interval_stall_s and it % self.every == 1 % self.every:  # the previous checkpoint's fence
            self.interval_stall_s[-1] += fence
            self.stall_s += fence
            fence = 0.0
        start = time.perf_counter()
        self.cf.step()
        took = time.perf_counter() - start
        self.count(it, took + fence)
        if it % self.every:
            self.off_checkpoint_step_s.append(took)

    def finish(self) -> None:
        self.cf.close()
        self.decisions.close()
        for hook in self._hooks:
            hook.remove()
        stats = self.cf.stats()
        self.checkpoints = stats["checkpoints_committed"]
        self.engine_stall_s = stats["stall_s_total"]


class DcpSave(NoCheckpoints):
    """``dcp.save`` every k on the critical path (what ``report(checkpoint=...)`` of a DCP save costs)."""

    def __init__(self, model: torch.nn.Module, opt: torch.optim.Optimizer, settings: Settings,
                 directory: Path) -> None:
        super().__init__(settings.every)
        self.model, self.opt, self.directory = model, opt, directory

    def after_step(self, it: int) -> None:
        if it % self.every:
            return
        start = time.perf_counter()
        self.save(it)
        self.count(it, time.perf_counter() - start)
        self.checkpoints += 1

    def save(self, it: int) -> None:
        import torch.distributed.checkpoint as dcp

        dcp.save(dcp_state(self.model, self.opt), checkpoint_id=str(self.directory / f"step-{it}"))


class DcpAsyncSave(DcpSave):
    """``dcp.async_save`` every k, waiting for the previous save's future first (as a user
    must), on its own gloo group (as DCP asks: its write thread's collectives would
    otherwise interleave with training's on the default group)."""

    future: Any = None
    group: Any = None

    def save(self, it: int) -> None:
        import torch.distributed.checkpoint as dcp

        if self.future is not None:
            self.future.result()
        self.future = dcp.async_save(dcp_state(self.model, self.opt), checkpoint_id=str(self.directory / f"step-{it}"),
                                     process_group=self.group)

    def finish(self) -> None:
        if self.future is not None:
            self.future.result()


def _checkpointer(name: str, model: torch.nn.Module, opt: torch.optim.Optimizer, settings: Settings, rank: int,
                  directory: Path, groups: tuple[Any, Any]) -> NoCheckpoints:
    """``groups``: ours' decisions group and async_save's group (gloo both)."""
    if name == "ours":
        return Ours(model, opt, settings, rank, directory, groups[0])
    if name == "dcp save":
        return DcpSave(model, opt, settings, directory)
    if name == "dcp async_save":
        saver = DcpAsyncSave(model, opt, settings, directory)
        saver.group = groups[1]
        return saver
    return NoCheckpoints()


def variant_dir(root: Path, name: str) -> Path:
    return root / "saved" / name.replace(" ", "-")


# ------------------------------------------------------------------ jobs
def save_job(rank: int, world: int, root: Path) -> None:
    """Every variant once per round, every other round in reverse, after an untimed
    baseline; the last round's checkpoints stay for the restores."""
    settings = _settings(root)
    groups = (dist.new_group(backend="gloo"), dist.new_group(backend="gloo"))
    measured: list[dict] = []
    # An untimed baseline first: a process's first run pays its warm-up (allocator, page faults, gloo).
    _one_run("baseline", settings, rank, variant_dir(root, "baseline"), groups)
    for number in range(settings.rounds):
        for name in VARIANTS[::-1] if number % 2 else VARIANTS:
            directory = variant_dir(root, name)
            if rank == 0:
                shutil.rmtree(directory, ignore_errors=True)
                directory.mkdir(parents=True)
            dist.barrier()
            measured.append({"round": number, "variant": name, **_one_run(name, settings, rank, directory, groups)})
    gathered = _gather(measured, world)
    if rank == 0:
        (root / "results-save.json").write_text(json.dumps(gathered))


def _one_run(name: str, settings: Settings, rank: int, directory: Path, groups: tuple[Any, Any]) -> dict:
    model, opt = build(settings, seed=0)
    train_step(model, opt, settings, 0, rank)  # the optimizer state exists before anything is timed
    checkpointer = _checkpointer(name, model, opt, settings, rank, directory, groups)
    dist.barrier()
    reset_peak_rss()
    rss_at_start = rss_bytes()
    start = time.perf_counter()
    for it in range(1, settings.iterations + 1):
        train_step(model, opt, settings, it, rank)
        checkpointer.after_step(it)
    checkpointer.finish()  # the last checkpoint durable: part of the run's wall time
    wall = time.perf_counter() - start
    return {"wall_s": wall, "stall_s": checkpointer.stall_s, "checkpoints": checkpointer.checkpoints,
            "engine_stall_s": checkpointer.engine_stall_s, "off_checkpoint_step_s": checkpointer.off_checkpoint_step_s,
            "interval_stall_s": checkpointer.interval_stall_s,
            "rss_at_start_bytes": rss_at_start, "peak_rss_bytes": peak_rss_bytes()}


def restore_job(rank: int, world: int, root: Path) -> None:
    """Ours (every world size) and, at the saved world size, DCP's load, in interleaved rounds."""
    from ray_checkfreq.storage.manifest import forget_decoded

    settings = _settings(root)
    names = ("ours", "dcp load") if world == settings.ranks else ("ours",)
    group = dist.new_group(backend="gloo")
    measured: list[dict] = []
    for number in range(-1, settings.rounds):  # round -1: untimed, the process's warm-up
        for name in names[::-1] if number % 2 else names:
            model, opt = build(settings, seed=1)
            forget_decoded()  # each restore decodes the manifest, as a restarted process does
            dist.barrier()
            reset_peak_rss()
            rss_at_start = rss_bytes()
            start = time.perf_counter()
            loaded, phases = _restore_ours(model, opt, settings, rank, root, group) if name == "ours" else \
                (_restore_dcp(model, opt, settings, root), None)
            seconds = time.perf_counter() - start
            if number < 0:
                continue
            measured.append({"round": number, "variant": name, "seconds": seconds, "iteration": loaded,
                             "phases_s": phases,
                             "rss_at_start_bytes": rss_at_start, "peak_rss_bytes": peak_rss_bytes()})
            del model, opt
    gathered = _gather(measured, world)
    if rank == 0:
        (root / f"results-restore-{world}.json").write_text(json.dumps(gathered))


def _restore_ours(model: torch.nn.Module, opt: torch.optim.Optimizer, settings: Settings, rank: int, root: Path,
                  group: Any) -> tuple[int, dict]:
    """The restored iteration, and the seconds of each phase of the engine's restore."""
    from ray_checkfreq.engine import CheckFreq, CheckFreqConfig, EngineSeams
    from ray_checkfreq.ray.decisions import BroadcastDecisions
    from ray_checkfreq.storage import CheckpointStore

    store = CheckpointStore(str(variant_dir(root, "ours")), codec="raw", full_every=1)
    config = CheckFreqConfig(every=settings.every, compress=False)
    if dist.get_world_size() == 1:
        cf = CheckFreq(model=model, optimizer=opt, storage=store, config=config)
        loaded = cf.restore()  # alone: salvage and the newest committed step, resharded
        cf.close()
        return loaded, cf.stats()["restore_phases_s"]
    chosen: list[Any] = [None, None]
    if rank == 0:
        generation = store.acquire_writer()
        store.salvage()
        refs = store.list(placement="sharded")
        chosen = [generation, refs[-1].step if refs else None]
    dist.broadcast_object_list(chosen, src=0)
    store.adopt_generation(chosen[0])
    decisions = BroadcastDecisions(group, rank)
    cf = CheckFreq(model=model, optimizer=opt, storage=store, config=config, seams=EngineSeams(decisions=decisions))
    loaded = cf.load_sharded(chosen[1])
    cf.close()
    decisions.close()
    return loaded, cf.stats()["restore_phases_s"]


def _restore_dcp(model: torch.nn.Module, opt: torch.optim.Optimizer, settings: Settings, root: Path) -> int:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import set_state_dict

    step = settings.iterations - settings.iterations % settings.every
    state = dcp_state(model, opt)
    dcp.load(state, checkpoint_id=str(variant_dir(root, "dcp save") / f"step-{step}"))
    set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    return step
