"""The training function of ``bench sharded --ray`` (benchmarks/sharded_ray.py): FSDP2 under
``ray_checkfreq.ray.CheckFreq`` in one ``TorchTrainer`` run, three ways per round, then the
restores of the last round's run with peer copies, timed inside the function.

Model, training step and RSS readings are benchmarks/sharded_job.py's. Every variant is a
fresh model and (ours) a fresh ``CheckFreq`` on a storage directory of its own; between
variants every rank waits for its peer copy in flight and rank 0 empties the run's agents
(``ray_bench_job.end_agents``: one Ray Train run, so one run key, for all of them), so no
slot or peer copy of one variant is seen by the next. Rank 0 writes what every rank
measured (gathered) to ``results_path``.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from typing import Any

import torch
import torch.distributed as dist

from benchmarks.ray_bench_job import end_agents
from benchmarks.restore import drop_page_cache
from benchmarks.sharded_job import Settings, build, peak_rss_bytes, reset_peak_rss, rss_bytes, train_step

BASELINE = "none"
PEER = "ours (peer copies)"
NO_PEER = "ours (no peer copies)"
VARIANTS = (BASELINE, PEER, NO_PEER)
RESTORE_KINDS = ("slot", "peer", "storage", "storage cold")
COPY_WAIT_S = 120.0


def train(config: dict) -> None:
    import ray.train

    torch.set_num_threads(1)
    context = ray.train.get_context()
    rank, world = context.get_world_rank(), context.get_world_size()
    settings = Settings(**config["settings"])
    restore_group = dist.new_group(backend="gloo")  # the restore engine's decision broadcast
    # An untimed baseline first: a process's first run pays its warm-up (allocator, page faults, gloo).
    run_variant(BASELINE, settings, rank=rank, work_dir=config["work_dir"], number=-1)
    measured: list[dict] = []
    for number in range(settings.rounds):
        for name in VARIANTS[::-1] if number % 2 else VARIANTS:
            restores = {"group": restore_group, "repeats": config["restore_repeats"]} \
                if name == PEER and number == settings.rounds - 1 else None
            figures = run_variant(name, settings, rank=rank, work_dir=config["work_dir"], number=number,
                                  restores=restores)
            measured.append({"round": number, "variant": name, **figures})
    gathered: list[Any] = [None] * world
    dist.all_gather_object(gathered, measured)
    if rank == 0:
        with open(config["results_path"], "w") as out:
            json.dump(gathered, out)


def run_variant(name: str, settings: Settings, *, rank: int, work_dir: str, number: int,
                restores: dict | None = None) -> dict:
    """One variant's timed stretch (wall: to the last checkpoint durable); with ``restores``,
    then the restores of one more checkpoint, taken untimed once no peer copy travels."""
    model, opt = build(settings, seed=0)
    train_step(model, opt, settings, 0, rank)  # the optimizer state exists before anything is timed
    storage = os.path.join(work_dir, f"store-{VARIANTS.index(name)}-{number}")
    cf = None if name == BASELINE else _checkfreq(model, opt, settings, storage, peer_copies=name == PEER)
    if cf is not None:
        cf.restore()  # a fresh store: starts at 0 and takes the writer generation
    dist.barrier()
    reset_peak_rss()
    rss_at_start = rss_bytes()
    in_step_s = 0.0
    start = time.perf_counter()
    for it in range(1, settings.iterations + 1):
        train_step(model, opt, settings, it, rank)
        if cf is not None:
            before = time.perf_counter()
            cf.step()
            in_step_s += time.perf_counter() - before
    if cf is not None:
        cf.flush()  # the last checkpoint durable: part of the wall time
    wall = time.perf_counter() - start
    figures: dict[str, Any] = {"wall_s": wall, "rss_at_start_bytes": rss_at_start, "peak_rss_bytes": peak_rss_bytes()}
    if cf is None:
        return {**figures, "checkpoints": 0}
    _wait_for_peer_copy(cf)  # untimed: the copy in flight is counted once it arrived
    stats = cf.stats()
    figures.update(checkpoints=stats["checkpoints_committed"], loop_stall_s=in_step_s + stats["fence_wait_s"],
                   engine_stall_s=stats["stall_s_total"], peer_copies=stats["peer_copies"])
    newest = _checkpoint_for_restores(cf, model, opt, settings) if restores is not None else None
    cf.close()  # nothing of the run's engine competes with the restores
    if restores is not None and newest is not None:
        figures["restores"] = _time_restores(cf, settings, {**restores, "storage": storage}, *newest)
    end_agents(cf.run)
    if rank == 0:
        shutil.rmtree(storage, ignore_errors=True)
    return figures


def _checkfreq(model: torch.nn.Module, opt: torch.optim.Optimizer, settings: Settings, storage: str, *,
               peer_copies: bool) -> Any:
    from ray_checkfreq.ray import CheckFreq, RayConfig

    # No pointer reports to Ray Train: their cost is bench ray's, not a sharded checkpoint's.
    config = RayConfig(peer_copies=peer_copies, registration=None)
    return CheckFreq(model=model, optimizer=opt, storage=storage, every=settings.every, compress=False,
                     ray_config=config)


def _wait_for_peer_copy(cf: Any) -> None:
    deadline = time.monotonic() + COPY_WAIT_S
    while (cf.stats()["peer_copies"] or {}).get("in_flight"):
        if time.monotonic() > deadline:
            raise TimeoutError(f"rank {cf.rank}: a peer copy still travels after {COPY_WAIT_S:.0f} s")
        time.sleep(0.01)


# ------------------------------------------------------------------ restores
def _checkpoint_for_restores(cf: Any, model: torch.nn.Module, opt: torch.optim.Optimizer,
                             settings: Settings) -> tuple[int, dict]:
    """One more checkpoint, untimed, taken while no copy travels (so its peer copy is sent),
    durable and copied; the step to restore and this rank's RAM sources of it."""
    for it in range(settings.iterations + 1, settings.iterations + settings.every + 1):
        train_step(model, opt, settings, it, cf.rank)
        cf.step()
    cf.flush()
    _wait_for_peer_copy(cf)
    dist.barrier()  # every rank's part durable, so rank 0's flush saw the step committed
    return _restore_sources(cf)


def _time_restores(cf: Any, settings: Settings, restores: dict, step: int, sources: dict) -> dict:
    """On every rank: its own slot, its peer copy on the next node and storage (as the page
    cache holds it, and with its files dropped from it), in rotating order, ``repeats``
    times each after an untimed round, into one fresh model."""
    from ray_checkfreq.engine import CheckFreq as Engine
    from ray_checkfreq.engine import CheckFreqConfig, EngineSeams
    from ray_checkfreq.ray.decisions import BroadcastDecisions
    from ray_checkfreq.storage.manifest import forget_decoded

    fresh, fresh_opt = build(settings, seed=1)
    decisions = BroadcastDecisions(restores["group"], cf.rank)
    engine = Engine(model=fresh, optimizer=fresh_opt, storage=cf.store,
                    config=CheckFreqConfig(every=settings.every, compress=False),
                    seams=EngineSeams(decisions=decisions))
    timed: dict[str, list[float]] = {kind: [] for kind in RESTORE_KINDS}
    loaded: dict[str, list[int]] = {kind: [] for kind in RESTORE_KINDS}
    for repeat in range(-1, restores["repeats"]):  # repeat -1: untimed, each source's first-read costs
        shift = repeat % len(RESTORE_KINDS)
        for kind in RESTORE_KINDS[shift:] + RESTORE_KINDS[:shift]:
            if kind == "storage cold":
                drop_page_cache(restores["storage"])  # every rank: each reads other ranks' files too
            forget_decoded()  # each restore decodes the manifest, as a restarted process does
            dist.barrier()
            start = time.perf_counter()
            iteration = _restore(kind, engine, cf, sources, step)
            seconds = time.perf_counter() - start
            if repeat >= 0:
                loaded[kind].append(iteration)
                timed[kind].append(seconds)
    engine.close()
    decisions.close()
    return {"step": step, "expected_step": settings.iterations + settings.every, "held": sources["held"],
            "seconds": timed,
            "iteration": loaded}


def _restore_sources(cf: Any) -> tuple[int, dict]:
    """The newest step that every rank holds in its slot, as a peer copy and in storage,
    and this rank's ``RankSource`` of each RAM copy of it."""
    import ray

    from ray_checkfreq.ray.agent import live_agents
    from ray_checkfreq.ray.shard_copies import RankSource, peer_node
    from ray_checkfreq.ray.slots import SLOT_COMPLETE

    agents = live_agents(cf.run)
    holder = peer_node(cf.nodes, cf.node_id)
    slots = {int(h["step"]): h for h in ray.get(agents[cf.node_id].slot_headers.remote(), timeout=60)
             if h["owner"] == cf.rank and h["state"] == SLOT_COMPLETE and h["run"] == cf.run}
    copies = {int(c["step"]): c for c in ray.get(agents[holder].peer_headers.remote(), timeout=60)
              if c["owner"] == cf.rank and c["run"] == cf.run} if holder is not None else {}
    committed = {ref.step for ref in cf.store.list(placement="sharded")}
    mine = {"slot": sorted(slots), "peer": sorted(copies), "storage": sorted(committed)}
    everyone: list[Any] = [None] * cf.world_size
    dist.all_gather_object(everyone, mine)
    common = set.intersection(*(set(held[kind]) for held in everyone for kind in mine))
    if not common:
        raise RuntimeError(f"no step is in every rank's slot, peer copy and storage (per rank: {everyone})")
    step = max(common)
    slot, copy = slots[step], copies[step]
    return step, {"held": mine,
        "slot": RankSource(kind="slot", node_id=cf.node_id, owner=cf.rank, step=step,
                           generation=int(slot["generation"]), path=str(slot["path"]), seq=int(slot["seq"])),
        "peer": RankSource(kind="peer", node_id=str(holder), owner=cf.rank, step=step,
                           generation=int(copy["generation"])),
    }


def _restore(kind: str, engine: Any, cf: Any, sources: dict, step: int) -> int:
    """What a restart at the same world size does on each rank for that source (a collective)."""
    from ray_checkfreq.ray.shard_copies import read_rank_source

    if kind in ("storage", "storage cold"):
        return int(engine.load_sharded(step))
    state = read_rank_source(sources[kind], run=cf.run, node_id=cf.node_id)
    why = engine.rank_snapshot_mismatch(state)
    if why is not None:
        raise RuntimeError(f"rank {cf.rank}: its {kind} copy of step {step} does not fit: {why}")
    return int(engine.load_rank_snapshot(state))
