"""The training function of ``bench ray``: every variant measured in turn inside one ``fit()``.

Both ranks run the same schedule: an untimed warm-up, then ``repeats`` rounds of the
variants in a fixed interleaved order. Each variant trains ``warmup`` untimed iterations
(ours: its profiling window) and then ``iterations`` timed ones; rank 0 times that stretch
(first timed iteration to the last) and appends one JSON line to ``results_path``. The
k of Ray Train's reports is chosen after the first baseline run (k x Ti >= ``min_interval_s``)
and broadcast, so every rank reports at the same iterations.

Recovery (optional, last): ours at the same k; rank 1 SIGKILLs itself in the middle of an
interval. Ray Train restarts the group (``FailureConfig(max_failures=1)``); the new attempt
sees the kill record, restores, and rank 0 records the restored step and the time of its
first step after the kill.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import signal
import tempfile
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

BASELINE = "none"
REPORT_SYNC = "report_sync"
REPORT_ASYNC = "report_async"
OURS_POLICY = "ours_policy"
OURS_SAME_K = "ours_same_k"
# The same k with a RAM copy on rank 0's node only: on one machine the other node's replica
# copy competes for the same cores, which on a real cluster it does not.
OURS_SAME_K_NO_REPLICAS = "ours_same_k_no_replicas"
VARIANTS = (BASELINE, REPORT_SYNC, REPORT_ASYNC, OURS_POLICY, OURS_SAME_K, OURS_SAME_K_NO_REPLICAS)
KILL_RECORD = "kill.json"
POLICY_WAIT_ITERS = 500


def mlp(width: int, layers: int) -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(*(torch.nn.Linear(width, width) for _ in range(layers)))


def append_result(path: str, **entry: Any) -> None:
    with open(path, "a") as out:
        out.write(json.dumps(entry) + "\n")
        out.flush()
        os.fsync(out.fileno())


class Job:
    """One rank's model, optimizer and synthetic batch; ``train_step`` is one iteration."""

    def __init__(self, config: dict) -> None:
        import ray.train
        import ray.train.torch

        torch.set_num_threads(1)  # one CPU per worker
        self.config = config
        self.rank = ray.train.get_context().get_world_rank()
        self.model = ray.train.torch.prepare_model(mlp(config["width"], config["layers"]))
        self.optimizer = torch.optim.Adam(self.model.parameters(), lr=1e-4)
        generator = torch.Generator().manual_seed(1 + self.rank)
        self.inputs = torch.randn(config["batch"], config["width"], generator=generator)
        self.targets = torch.randn(config["batch"], config["width"], generator=generator)
        self.results = config["results_path"]
        self.iteration_ends: list[float] = []

    def train_step(self) -> None:
        loss = torch.nn.functional.mse_loss(self.model(self.inputs), self.targets)
        self.optimizer.zero_grad()
        loss.backward()
        self.optimizer.step()

    def state(self) -> dict:
        from ray_checkfreq.ray import unwrap_model

        return {"model": unwrap_model(self.model).state_dict(), "optimizer": self.optimizer.state_dict()}

    def timed(self, after_step: Callable[[int], None], warmup: int, iterations: int) -> float:
        """Seconds from the first timed iteration to the last; ``after_step(i)`` follows each step."""
        for i in range(1, warmup + 1):
            self.train_step()
            after_step(i)
        start = time.perf_counter()
        self.iteration_ends = []  # seconds since start, per timed iteration (where the time went)
        for i in range(warmup + 1, warmup + iterations + 1):
            self.train_step()
            after_step(i)
            self.iteration_ends.append(round(time.perf_counter() - start, 4))
        return time.perf_counter() - start


# ------------------------------------------------------------------ variants
def run_baseline(job: Job, k: int) -> dict:
    seconds = job.timed(lambda i: None, job.config["warmup"], job.config["iterations"])
    return {"seconds": seconds, "checkpoints": 0, "iteration_ends_s": job.iteration_ends}


def run_report(job: Job, k: int, mode_name: str) -> dict:
    """``torch.save`` of the state into a temp dir by rank 0, then ``ray.train.report`` on every rank."""
    import ray.train
    from ray.train import Checkpoint, CheckpointUploadMode

    mode = CheckpointUploadMode.SYNC if mode_name == REPORT_SYNC else CheckpointUploadMode.ASYNC
    count = 0

    def after_step(i: int) -> None:
        nonlocal count
        if i % k:
            return
        count += i > job.config["warmup"]  # counted in the timed stretch
        if job.rank != 0:
            ray.train.report({"iteration": i}, checkpoint_upload_mode=mode)
            return
        directory = tempfile.mkdtemp(prefix="rcf-bench-ray-report-")
        torch.save(job.state(), os.path.join(directory, "state.pt"))
        ray.train.report({"iteration": i}, checkpoint=Checkpoint.from_directory(directory),
                         checkpoint_upload_mode=mode)
        if mode == CheckpointUploadMode.SYNC:
            shutil.rmtree(directory, ignore_errors=True)  # ASYNC removes its own after the upload

    seconds = job.timed(after_step, job.config["warmup"], job.config["iterations"])
    return {"seconds": seconds, "checkpoints": count, "iteration_ends_s": job.iteration_ends}


def _checkfreq(job: Job, storage: str, every: int | None, replicas: bool = True) -> Any:
    from ray_checkfreq.ray import CheckFreq, RayConfig

    return CheckFreq(model=job.model, optimizer=job.optimizer, storage=storage, every=every,
                     overhead=job.config["overhead"], epoch_len=job.config["epoch_len"],
                     profile_iters=job.config["profile_iters"], ray_config=RayConfig(replicas=replicas))


def run_ours(job: Job, k: int | None, storage: str, *, replicas: bool = True) -> dict:
    cf = _checkfreq(job, storage, k, replicas)
    cf.restore()
    profiling = 0
    # Start-up, untimed: the policy's profiling window (until rank 0 has its k) and the run's
    # first registration with Ray Train (a report barrier, then rare: see registration.py).
    # Rank 0 says when (a broadcast per start-up iteration): every rank leaves at the same one.
    while profiling < POLICY_WAIT_ITERS and not _rank0_says(_started_up(cf, policy=k is None)):
        job.train_step()
        cf.step()
        profiling += 1
    decided = cf.stats()["k"] is not None
    iterations = job.config["iterations"]
    if k is None:  # the timed stretch spans two of the policy's intervals, within the cap
        wanted = min(max(iterations, 2 * (cf.stats()["k"] or 0)), job.config["policy_max_iterations"])
        iterations = _broadcast_int(wanted if job.rank == 0 else 0)
    committed_before: list[int] = []

    def after_step(i: int) -> None:
        cf.step()
        if i == job.config["warmup"]:  # untimed: the warm-up's checkpoints committed, then counted
            cf.flush()
            committed_before.append(cf.stats()["checkpoints_committed"])

    seconds = job.timed(after_step, job.config["warmup"], iterations)
    stats = cf.stats()
    cf.flush()
    timed_checkpoints = cf.stats()["checkpoints_committed"] - committed_before[0]  # taken in the timed stretch
    cf.close()
    end_agents(cf.run)
    return {"seconds": seconds, "iterations": iterations, "checkpoints": timed_checkpoints,
            "checkpoints_total": stats["checkpoints_committed"],
            "k_used": stats["k"], "k_changes": stats["k_changes"], "mode": stats["mode"], "compress": stats["compress"],
            "policy_decided_before_timing": decided, "start_up_iterations": profiling,
            "registration": _registration(stats),
            "stall_s_median": stats["stall_s_median"], "last_persist_s": stats["last_persist_s"],
            "profiling": stats["profiling"], "iteration_ends_s": job.iteration_ends}


def _started_up(cf: Any, *, policy: bool) -> bool:
    stats = cf.stats()
    registration = stats.get("registration")
    registered = registration is None or registration.get("registrations", 1) >= 1
    return registered and (stats["k"] is not None or not policy)


def _registration(stats: dict) -> dict:
    registration = stats.get("registration") or {}
    return {"registrations": registration.get("registrations"), "report_s": registration.get("report_s")}


def end_agents(run: str) -> None:
    """The next CheckFreq of this run starts with empty agents and a fresh policy actor: a
    slot left by this variant would otherwise be restored by the next one, and the k this
    variant's policy learned would be kept. The agents' processes stay (their start-up is
    not what a variant measures)."""
    import ray

    from ray_checkfreq.ray.agent import live_agents
    from ray_checkfreq.ray.policy_actor import shutdown_policy

    dist.barrier()
    if dist.get_rank() == 0:
        ray.get([agent.forget.remote() for agent in live_agents(run).values()])
        shutdown_policy(run)
    dist.barrier()


# ------------------------------------------------------------------ schedule
def choose_k(iteration_s: float, min_interval_s: float) -> int:
    """The smallest k with k x Ti >= min_interval_s (past Ray Train's report throttle)."""
    return max(1, math.ceil(min_interval_s / iteration_s))


def _broadcast_int(value: int) -> int:
    tensor = torch.tensor([value], dtype=torch.int64)
    dist.broadcast(tensor, src=0)
    return int(tensor.item())


def _rank0_says(flag: bool) -> bool:
    return bool(_broadcast_int(int(flag)))


def _agreed_k(job: Job, warmup_s: float, baseline: dict) -> int:
    """From the faster of the warm-up's and the first baseline's iteration time: a load spike
    during one of them must not leave k x Ti under the throttle."""
    config = job.config
    if config.get("every"):
        return int(config["every"])
    iteration_s = min(warmup_s / config["warmup"], baseline["seconds"] / config["iterations"])
    return _broadcast_int(choose_k(iteration_s, config["min_interval_s"]) if job.rank == 0 else 0)


def run_variant(job: Job, variant: str, k: int, repeat: int) -> dict:
    storage = os.path.join(job.config["work_dir"], f"store-{variant}-{repeat}")
    if variant == BASELINE:
        return run_baseline(job, k)
    if variant in (REPORT_SYNC, REPORT_ASYNC):
        return run_report(job, k, variant)
    return run_ours(job, None if variant == OURS_POLICY else k, storage, replicas=variant != OURS_SAME_K_NO_REPLICAS)


def measure_variants(job: Job) -> int:
    """Rounds of every variant, then one closing baseline: each round's overhead is taken
    against the mean of the baselines before and after it, which cancels a linear drift
    of the machine's speed."""
    config = job.config
    warmup_s = job.timed(lambda i: None, 0, config["warmup"])  # first-call costs, not counted
    k = 0
    schedule = [(repeat, variant) for repeat in range(config["repeats"]) for variant in VARIANTS]
    for repeat, variant in [*schedule, (config["repeats"], BASELINE)]:
        figures = run_variant(job, variant, k, repeat)
        if not k:
            k = _agreed_k(job, warmup_s, figures)
        if job.rank == 0:
            append_result(job.results, **{"kind": "variant", "variant": variant, "repeat": repeat, "k": k,
                                          "iterations": config["iterations"], **figures})
    return k


# ------------------------------------------------------------------ recovery
def recovery_kill_at(k: int) -> int:
    """Mid-interval after the second checkpoint (ours at fixed k checkpoints at k, 2k, ...)."""
    return 2 * k + max(1, k // 2)


def run_recovery(job: Job, k: int) -> None:
    """First attempt: train to the kill iteration; rank 1 records the time and SIGKILLs itself."""
    storage = os.path.join(job.config["work_dir"], "store-recovery")
    cf = _checkfreq(job, storage, k)
    cf.restore()
    kill_at = recovery_kill_at(k)
    for i in range(1, kill_at + 1):
        job.train_step()
        cf.step()
        if i == kill_at and job.rank == 1:
            with open(os.path.join(job.config["work_dir"], KILL_RECORD), "w") as out:
                json.dump({"iteration": i, "k": k, "time": time.time()}, out)
            os.kill(os.getpid(), signal.SIGKILL)
    while True:  # rank 0 waits in the next collective until Ray Train tears the group down
        job.train_step()
        cf.step()


def resume_after_kill(job: Job, kill: dict) -> None:
    started = time.time()
    storage = os.path.join(job.config["work_dir"], "store-recovery")
    cf = _checkfreq(job, storage, int(kill["k"]))
    start = cf.restore()
    restored = time.time()
    job.train_step()
    cf.step()
    first_step = time.time()
    for _ in range(2):
        job.train_step()
        cf.step()
    info = cf.restore_info or {}
    cf.close()
    if job.rank == 0:
        append_result(job.results, kind="recovery", killed_at=kill["iteration"], k=kill["k"], restored_step=start,
                      lost_iterations=kill["iteration"] - start, source=info.get("kind"),
                      kill_to_function_start_s=started - kill["time"], restore_s=restored - started,
                      restart_to_first_step_s=first_step - kill["time"])


def train(config: dict) -> None:
    job = Job(config)
    kill_path = os.path.join(config["work_dir"], KILL_RECORD)
    if os.path.exists(kill_path):
        with open(kill_path) as f:
            resume_after_kill(job, json.load(f))
        return
    k = measure_variants(job)
    if config["kill"]:
        run_recovery(job, k)
