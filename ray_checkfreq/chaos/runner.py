"""Run the chaos job on a local multi-node cluster, inject preemptions, and report.

    report = run_chaos(ChaosConfig(preemptions=4, kinds=("commit", "node", "persist", "notice")))

``run_chaos`` starts a ``cluster_utils.Cluster`` (``nodes`` one-CPU training nodes; the
head only hosts the driver), gets the final weights of an uninterrupted run (cached by
job settings), runs the job under ``TorchTrainer`` while an injector thread follows its
event log and fires each preemption of the schedule, and builds the report
(``report.py``) from the events. With ``replace`` (the fixed-world-size setting) a lost
node is added back after ``replace_delay_s``, as an autoscaler would; without it (and
``workers=(min, max)``) the job goes on at a smaller world size.

It must run in a process without Ray (it owns the cluster): the CLI and the tests start
it in a child process.
"""

from __future__ import annotations

import glob
import hashlib
import json
import logging
import os
import shutil
import tempfile
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from typing import Any

from ray_checkfreq.chaos import job as chaos_job
from ray_checkfreq.chaos import report as reports
from ray_checkfreq.chaos import schedule as schedules
from ray_checkfreq.chaos.harness import TrainJob, fit_job
from ray_checkfreq.chaos.kinds import TRAIN_RESOURCE, JobView, KindSettings, LocalCluster, inject
from ray_checkfreq.chaos.trace import TraceSlice, local_schedule, read_trace

DEFAULT_KINDS = ("commit", "notice", "persist", "node", "worker", "snapshot", "agent")
CHECKPOINTING = ("checkfreq", "epoch")
RAY_ENV = {"RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S": "60", "RAY_TRAIN_PREEMPTION_POLL_INTERVAL_S": "0.5",
           "RAY_DEDUP_LOGS": "0"}
NO_RESTART_KINDS = ("agent",)  # a node agent is replaced without restarting the job
# With the policy k is not known beforehand: the schedule is spaced as for k = 4. The policy
# profiles ~50 iterations first, so a run with it wants preemptions after that (``at``).
POLICY_SPACING_K = 4
JOB_VERSION = "digits-cnn-1"  # part of the reference's cache key: change it when the job changes


@dataclass(frozen=True, kw_only=True)
class ChaosConfig:
    """One chaos run; units in the names.

    ``checkpoints``: "checkfreq" (every ``every`` iterations, notices handled; ``every``
    None: k chosen and adapted by the engine's policy) or "epoch" (one checkpoint per
    epoch, notices ignored: the baseline of ``compare``).
    ``at``: the iterations of the "iterations" schedule (default: spread evenly).
    ``workers``: a count (fixed world size) or (min, max) (elastic).
    ``compress``: the engine's (None: measured). ``s3_bucket`` (and ``s3_endpoint``):
    checkpoints on S3, credentials from the AWS environment (commits are then not
    followed, and the ``persist`` kind has no hold point). ``use_gpu``: workers on the
    GPU. ``log_stats``: rank 0 logs the engine's figures every k iterations.
    ``trace`` (the "trace" schedule): a spot trace file, replayed from ``trace_start_s``
    for ``trace_duration_s`` trace seconds (None: to its end), ``compression`` times
    faster, on at most ``nodes`` training nodes (``trace.local_schedule``); each loss is a
    ``node`` or, ``notice_s`` seconds before it, a ``notice`` (the kinds cycle). Its nodes
    come back when the trace adds them, not after ``replace_delay_s``.
    """

    preemptions: int = 4
    kinds: tuple[str, ...] = DEFAULT_KINDS
    schedule: str = "iterations"
    at: tuple[int, ...] | None = None
    seed: int = 0
    mtbp_s: float = 15.0
    min_gap: int | None = None
    iterations: int = 56
    every: int | None = 4
    checkpoints: str = "checkfreq"
    workers: int | tuple[int, int] = 2
    nodes: int = 3
    replace: bool = True
    replace_delay_s: float = 3.0
    sleep_s: float = 0.1
    notice_deadline_s: float = 2.0
    hold_wait_s: float = 90.0
    work_dir: str | None = None
    cache_dir: str | None = None
    compare_reference: bool = True
    tolerance: float = 1e-9
    progress: Callable[[str], None] | None = print
    compress: bool | None = False
    s3_endpoint: str | None = None
    s3_bucket: str | None = None
    use_gpu: bool = False
    log_stats: bool = False
    trace: str | None = None
    trace_start_s: float = 0.0
    trace_duration_s: float | None = None
    compression: float = 60.0
    notice_s: float = 0.0

    def __post_init__(self) -> None:
        schedules.parse_kinds(",".join(self.kinds))
        if self.schedule not in schedules.SCHEDULES:
            raise ValueError(f"schedule={self.schedule!r}: expected one of {', '.join(schedules.SCHEDULES)}")
        if self.checkpoints not in CHECKPOINTING:
            raise ValueError(f"checkpoints={self.checkpoints!r}: expected one of {', '.join(CHECKPOINTING)}")
        for name in ("iterations", "nodes"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)!r}: must be >= 1")
        if self.every is not None and self.every < 1:
            raise ValueError(f"every={self.every!r}: must be >= 1, or None (the policy picks k)")
        if self.preemptions < 0:
            raise ValueError(f"preemptions={self.preemptions!r}: must be >= 0")
        low, high = self.world_range
        if not 1 <= low <= high:
            raise ValueError(f"workers={self.workers!r}: need 1 <= min <= max")
        if high > self.nodes:
            raise ValueError(f"workers={self.workers!r}: more workers than the {self.nodes} training nodes")
        odd = [size for size in range(low, high + 1) if chaos_job.GLOBAL_BATCH % size]
        if odd:
            raise ValueError(f"workers={self.workers!r}: the chaos job's global batch of {chaos_job.GLOBAL_BATCH} "
                             f"does not divide by {odd[0]} workers, a world size this range allows")
        for name in ("replace_delay_s", "sleep_s", "notice_deadline_s", "hold_wait_s", "mtbp_s", "tolerance"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name}={getattr(self, name)!r}: must be >= 0")
        if self.s3_endpoint is not None and not self.s3_bucket:
            raise ValueError(f"s3_endpoint={self.s3_endpoint!r}: needs s3_bucket")
        if self.at is not None and any(i < 1 or i > self.iterations for i in self.at):
            raise ValueError(f"at={self.at!r}: every iteration must be in [1, {self.iterations}]")
        if (self.schedule == "trace") != (self.trace is not None):
            raise ValueError(f"schedule={self.schedule!r}, trace={self.trace!r}: a trace file goes with the "
                             "'trace' schedule, and only with it")
        if self.trace is not None:
            TraceSlice(start_s=self.trace_start_s, duration_s=self.trace_duration_s, compression=self.compression)
            if self.replace:
                raise ValueError("a trace adds its nodes back itself: replace must be False")
            if ("notice" in self.kinds) != (self.notice_s > 0):
                raise ValueError(f"kinds={self.kinds!r}, notice_s={self.notice_s!r}: a trace's losses are "
                                 "noticed (kind 'notice') exactly when notice_s > 0")
        if not self.notice_s >= 0:
            raise ValueError(f"notice_s={self.notice_s!r}: must be >= 0")

    @property
    def world_range(self) -> tuple[int, int]:
        return (self.workers, self.workers) if isinstance(self.workers, int) else tuple(self.workers)  # type: ignore[return-value]

    @property
    def epoch_len(self) -> int:
        return chaos_job.epoch_length(chaos_job.SAMPLES, chaos_job.GLOBAL_BATCH)

    @property
    def interval(self) -> int | None:
        """k for the job: fixed, one epoch, or None (the policy picks it)."""
        return self.epoch_len if self.checkpoints == "epoch" else self.every

    @property
    def spacing(self) -> int:
        """The k the schedule spaces preemptions by (the policy's k is not known beforehand)."""
        return self.every or POLICY_SPACING_K


def trace_plan(config: ChaosConfig) -> schedules.TracePlan:
    """The "trace" schedule's slice on this run's nodes."""
    if config.trace is None:
        raise ValueError("this run has no trace")
    window = TraceSlice(start_s=config.trace_start_s, duration_s=config.trace_duration_s,
                        compression=config.compression)
    local = local_schedule(read_trace(config.trace), window, max_nodes=config.nodes,
                           min_nodes=config.world_range[0])
    return schedules.from_trace(local, config.kinds, notice_s=config.notice_s, seed=config.seed)


def plan(config: ChaosConfig) -> list[schedules.Preemption]:
    """The preemptions of this run (the same for both arms of ``compare``)."""
    if config.schedule == "trace":
        return trace_plan(config).preemptions
    # The last preemption leaves room for a notice's deadline and a checkpoint after the restart.
    first, last = min(config.spacing + 2, config.iterations), max(config.iterations - 2 * config.spacing - 4, 1)
    if config.schedule == "poisson":
        return schedules.poisson(config.preemptions, config.kinds, mtbp_s=config.mtbp_s, seed=config.seed)
    if config.schedule == "random":
        gap = config.min_gap or 2 * config.spacing
        return schedules.seeded_random(config.preemptions, config.kinds, first=first, last=last, min_gap=gap,
                                       seed=config.seed)
    if config.at is not None:
        return schedules.at_iterations(list(config.at), config.kinds, seed=config.seed)
    return schedules.evenly(config.preemptions, config.kinds, first=first, last=max(first, last), seed=config.seed)


# ---------------------------------------------------------------------- entry points
def run_chaos(config: ChaosConfig) -> dict:
    """One chaos run on its own local cluster; returns the report (``report.build_report`` + config)."""
    with _OwnCluster(config) as cluster:
        reference = _reference(cluster, config) if config.compare_reference else None
        return _chaos_arm(cluster, config, reference)


def compare(config: ChaosConfig) -> dict:
    """The same job and schedule with epoch-boundary checkpoints and with ray_checkfreq."""
    with _OwnCluster(config) as cluster:
        reference = _reference(cluster, config) if config.compare_reference else None
        arms = {}
        for name in ("epoch", "checkfreq"):
            _say(config, f"--- {name} checkpoints ---")
            arms[name] = _chaos_arm(cluster, replace(config, checkpoints=name), reference)
    return {"arms": arms, "summary": {name: _comparison_row(r) for name, r in arms.items()}}


def _comparison_row(report: dict) -> dict:
    return {key: report[key] for key in ("preemptions", "k_max", "lost_iterations_total", "lost_iterations_max",
                                         "time_to_finish_s", "identical_to_uninterrupted", "samples_lost",
                                         "samples_repeated", "finished")}


# ---------------------------------------------------------------------- cluster
class _OwnCluster:
    """Ray environment, the local cluster, and the driver's connection (all undone on exit)."""

    def __init__(self, config: ChaosConfig) -> None:
        self.config = config

    def __enter__(self) -> LocalCluster:
        import ray

        if ray.is_initialized():
            raise RuntimeError("ray-checkfreq chaos starts its own Ray cluster: run it in a process without Ray")
        os.environ.update({key: os.environ.get(key, value) for key, value in RAY_ENV.items()})
        logging.getLogger("ray").setLevel(logging.ERROR)
        quiet_expected_deaths()
        nodes = self.config.nodes if self.config.trace is None else trace_plan(self.config).initial_nodes
        _say(self.config, f"starting a local Ray cluster: {nodes} training nodes (1 CPU each)")
        self.cluster = LocalCluster(nodes=nodes)
        ray.init(address=self.cluster.address, log_to_driver=False, configure_logging=False,
                 logging_level=logging.ERROR)
        return self.cluster

    def __exit__(self, *exc: Any) -> None:
        import ray

        ray.shutdown()
        self.cluster.shutdown()


def quiet_expected_deaths() -> None:
    """The driver prints every raylet error message; the deaths the injector caused are expected."""
    import ray._private.worker as ray_worker

    original = getattr(ray_worker, "print_to_stdstream", None)
    if original is None or getattr(original, "rcf_quiet", False):
        return

    def print_unless_expected(data: dict, *args: Any, **kwargs: Any) -> None:
        if data.get("pid") == "raylet" and any(_EXPECTED in line for line in data.get("lines", [])
                                               for _EXPECTED in _EXPECTED_DEATHS):
            return
        original(data, *args, **kwargs)

    print_unless_expected.rcf_quiet = True  # type: ignore[attr-defined]
    ray_worker.print_to_stdstream = print_unless_expected


_EXPECTED_DEATHS = ("A worker died or was killed", "has been marked dead", "Raylet is terminated")


# ---------------------------------------------------------------------- one fit
def _work_dir(config: ChaosConfig, name: str) -> str:
    root = config.work_dir or tempfile.mkdtemp(prefix="rcf-chaos-")
    path = os.path.join(root, f"{name}-{uuid.uuid4().hex[:6]}")
    for sub in ("logs", "control", "store"):
        os.makedirs(os.path.join(path, sub), exist_ok=True)
    return path


def _job_config(config: ChaosConfig, work_dir: str, *, sleep_s: float) -> dict:
    return {"work_dir": os.path.join(work_dir, "logs"), "store_dir": os.path.join(work_dir, "store"),
            "control_dir": os.path.join(work_dir, "control"), "iterations": config.iterations,
            "every": config.interval, "sleep_s": sleep_s, "notices": config.checkpoints == "checkfreq",
            "compress": config.compress, "log_stats": config.log_stats, **_s3_store(config, work_dir)}


def _s3_store(config: ChaosConfig, work_dir: str) -> dict:
    """With ``s3_bucket``: checkpoints go to s3://bucket/<run>; commits are then not followed."""
    if not config.s3_bucket:
        return {}
    return {"store_uri": f"s3://{config.s3_bucket}/{os.path.basename(work_dir)}", "s3_endpoint": config.s3_endpoint}


def _fit(config: ChaosConfig, work_dir: str, *, workers: Any, sleep_s: float, max_failures: int) -> Exception | None:
    job = TrainJob(train=chaos_job.train, config=_job_config(config, work_dir, sleep_s=sleep_s),
                   name=os.path.basename(work_dir), storage_path=os.path.join(work_dir, "results"),
                   workers=workers, resources_per_worker=_worker_resources(config), use_gpu=config.use_gpu,
                   max_failures=max_failures)
    outcome = fit_job(job, raise_errors=False)  # the run's own failure: reported, not raised
    return outcome if isinstance(outcome, Exception) else None


def _worker_resources(config: ChaosConfig) -> dict:
    # Half a GPU: the simulated nodes share the machine's GPU(s), each node may report it.
    return {"CPU": 1, TRAIN_RESOURCE: 1, **({"GPU": 0.5} if config.use_gpu else {})}


def _reference(cluster: LocalCluster, config: ChaosConfig) -> dict:
    """Final weights of the uninterrupted run at the full world size (cached by job settings)."""
    import torch

    settings = [JOB_VERSION, config.iterations, config.world_range[1]] + (["gpu"] if config.use_gpu else [])
    key = hashlib.blake2b(json.dumps(settings).encode(),
                          digest_size=8).hexdigest()
    cache_dir = config.cache_dir or os.path.join(os.path.expanduser("~"), ".cache", "ray_checkfreq", "chaos")
    cached = os.path.join(cache_dir, f"reference-{key}.pt")
    if os.path.exists(cached):
        _say(config, f"reference: the uninterrupted run's weights from {cached}")
        return torch.load(cached, weights_only=True)["model"]
    _say(config, f"reference: an uninterrupted run of {config.iterations} iterations")
    work_dir = _work_dir(config, "reference")
    error = _fit(config, work_dir, workers=config.world_range[1], sleep_s=0.0, max_failures=0)
    if error is not None:
        raise RuntimeError(f"the uninterrupted reference run failed: {error}") from error
    os.makedirs(cache_dir, exist_ok=True)
    tmp = f"{cached}.{os.getpid()}.tmp"
    shutil.copyfile(os.path.join(work_dir, "logs", "final.pt"), tmp)
    os.replace(tmp, cached)
    return torch.load(cached, weights_only=True)["model"]


def _chaos_arm(cluster: LocalCluster, config: ChaosConfig, reference: dict | None) -> dict:
    work_dir = _work_dir(config, f"chaos-{config.checkpoints}")
    traced = trace_plan(config) if config.trace is not None else None
    preemptions = plan(config) if traced is None else traced.preemptions
    if traced is not None:
        cluster.resize(traced.initial_nodes)  # an arm of ``compare`` starts where the trace does
    injector = Injector(cluster, config, work_dir, preemptions,
                        additions_s=None if traced is None else traced.additions_s)
    workers = config.workers if isinstance(config.workers, int) else tuple(config.workers)
    outcome: dict[str, Exception | None] = {}

    def fit() -> None:
        outcome["error"] = _fit(config, work_dir, workers=workers, sleep_s=config.sleep_s,
                                max_failures=len(preemptions) + 3)

    # fit() waits in a thread: the injector needs the main thread (a node is added from there).
    trainer = threading.Thread(target=fit, name="rcf-chaos-fit", daemon=True)
    trainer.start()
    events = injector.follow(trainer.is_alive)
    trainer.join()
    error = outcome.get("error")
    with open(os.path.join(work_dir, "events.jsonl"), "w") as out:
        out.writelines(json.dumps(e) + "\n" for e in events)
    identical, diff = _compare_weights(os.path.join(work_dir, "logs", "final.pt"), reference)
    result = reports.build_report(events, identical=identical, max_abs_diff=diff, tolerance=config.tolerance)
    result.update(error=None if error is None else repr(error), work_dir=work_dir, injector_errors=injector.errors,
                  config=_plain_config(config), schedule=[asdict(p) for p in preemptions],
                  unreached_preemptions=injector.unreached)
    result["_events"] = events
    return result


def _compare_weights(final_path: str, reference: dict | None) -> tuple[bool | None, float | None]:
    import torch

    if reference is None or not os.path.exists(final_path):
        return None, None
    final = torch.load(final_path, weights_only=True)["model"]
    if final.keys() != reference.keys():
        return False, None
    identical = all(torch.equal(final[k], reference[k]) for k in final)
    diff = max(float((final[k] - reference[k]).abs().max()) for k in final)
    return identical, diff


def _plain_config(config: ChaosConfig) -> dict:
    return {k: v for k, v in asdict(config).items() if k != "progress"}


def _say(config: ChaosConfig, line: str) -> None:
    if config.progress is not None:
        config.progress(line)


# ---------------------------------------------------------------------- the injector
class EventTail:
    """New JSON lines of the job's per-rank logs, and new commits in its store, since the last call."""

    def __init__(self, log_dir: str, store_dir: str) -> None:
        self.log_dir = log_dir
        self.store_dir = store_dir
        self._offsets: dict[str, int] = {}
        self._commits: set[str] = set()

    def read(self) -> list[dict]:
        found = []
        for path in sorted(glob.glob(os.path.join(self.log_dir, "log-*.jsonl"))):
            with open(path, "rb") as lines:
                lines.seek(self._offsets.get(path, 0))
                data = lines.read()
            complete = data[:data.rfind(b"\n") + 1]
            self._offsets[path] = self._offsets.get(path, 0) + len(complete)
            found += [json.loads(line) for line in complete.splitlines() if line.strip()]
        return found + self._new_commits()

    def _new_commits(self) -> list[dict]:
        found = []
        for manifest in glob.glob(os.path.join(self.store_dir, "step-*", "manifest.json")):
            name = os.path.basename(os.path.dirname(manifest))
            if name in self._commits:
                continue
            try:
                t = os.stat(manifest).st_mtime
            except FileNotFoundError:  # removed by retention meanwhile
                continue
            self._commits.add(name)
            found.append({"t": t, "event": "commit", "step": int(name.split("-")[1]), "name": name})
        return found


class Injector:
    """Follows the job and fires the schedule's preemptions from a driver thread."""

    def __init__(self, cluster: LocalCluster, config: ChaosConfig, work_dir: str,
                 preemptions: list[schedules.Preemption], *, additions_s: list[float] | None = None) -> None:
        self.cluster = cluster
        self.config = config
        self.pending = list(preemptions)
        self.additions_s = sorted(additions_s or [])  # seconds after the first step (a trace's adds)
        self.unreached: list[int] = []  # the trace's preemptions due after the run ended
        self.total = len(preemptions)
        self.tail = EventTail(os.path.join(work_dir, "logs"), os.path.join(work_dir, "store"))
        self.settings = KindSettings(control_dir=os.path.join(work_dir, "control"),
                                     notice_deadline_s=config.notice_s if config.trace else config.notice_deadline_s,
                                     hold_wait_s=config.hold_wait_s)
        self.events: list[dict] = [{"t": time.time(), "event": "run_start"}]
        self.errors: list[str] = []
        self.view = JobView()
        self._attempt_started_t = 0.0
        self._replacements: list[float] = []
        self._last_kill_t = 0.0
        self._restart_after: float | None = None  # an injection that restarts the job: its start
        self._resumed_t: float | None = None
        self._first_step_t: float | None = None
        self._fired_at_s: float | None = None  # the trace time of the last preemption fired
        self._t0 = time.time()

    def follow(self, running: Callable[[], bool]) -> list[dict]:
        """Follow the job and fire the schedule while ``running()``; returns every event, in time order.

        Runs on the main thread: ``Cluster.add_node`` installs a signal handler.
        """
        while running():
            self._absorb(self.tail.read())
            self._replace_due_nodes()
            self._add_due_nodes()
            if self.pending and self._due(self.pending[0]):
                self._fire(self.pending.pop(0))
            time.sleep(0.05)
        self._absorb(self.tail.read())
        for preemption in self.pending:
            if preemption.at_s is not None:  # a trace runs on after the job: not a failure
                self.unreached.append(preemption.index)
            else:
                self.errors.append(f"preemption {preemption.index + 1}: the run ended before it was due")
        return sorted(self.events, key=lambda e: e["t"])

    # --------------------------------------------------------------- following
    def _absorb(self, new: list[dict]) -> None:
        for event in sorted(new, key=lambda e: e["t"]):
            self.events.append(event)
            kind = event["event"]
            if kind == "start":
                self._on_start(event)
            elif kind == "batch" and event["rank"] == 0 and event["attempt"] == self.view.attempt:
                self.view.iteration = event["iteration"]
                if self._first_step_t is None:
                    self._first_step_t = event["t"]
                if self._resumed_t is None and self._resumed_by(event):
                    self._resumed_t = event["t"]
            elif kind == "commit":
                self._print(event["t"], f"commit: checkpoint of iteration {event['step']}")
            elif kind == "k":
                self._print(event["t"], f"policy: k = {event['k']} from iteration {event['iteration']}")

    def _resumed_by(self, batch: dict) -> bool:
        """Whether this batch shows the job training again after the last preemption: after the
        kill, and in an attempt that began after it where the preemption restarts the job (the
        processes of a removed node may still log a step or two before they notice)."""
        if batch["t"] <= self._last_kill_t:
            return False
        return self._restart_after is None or self._attempt_started_t > self._restart_after

    def _on_start(self, event: dict) -> None:
        if self.view.attempt is None or event["attempt"] > self.view.attempt:
            self.view.attempt, self.view.ranks = event["attempt"], {}
            self._attempt_started_t = event["t"]
        if event["attempt"] == self.view.attempt:
            self.view.ranks[event["rank"]] = event
            self.view.run = event["run"]
        if event["rank"] == 0:
            restore = event.get("restore") or {}
            origin = restore.get("kind", "none")
            where = f" on node {restore['node_id'][:8]}" if restore.get("node_id") else ""
            self._print(event["t"], f"start: attempt {event['attempt']}, {event['world_size']} workers, "
                                    f"resumed at iteration {event['iteration']} from {origin}{where}")

    def _due(self, preemption: schedules.Preemption) -> bool:
        if preemption.at_s is not None and preemption.at_s == self._fired_at_s:
            return True  # another node of the trace's instant that just fired: lost together
        if self._resumed_t is None or not self.view.ranks:
            return False  # the job has not (re)started training since the last preemption
        if preemption.at_iteration is not None:
            return self.view.iteration >= preemption.at_iteration
        if preemption.at_s is not None:  # due while the job restarts: fired once it trains again (a
            return self._since_first_step() >= preemption.at_s  # loss then fails Ray 2.60's controller)
        assert preemption.after_s is not None
        return time.time() - self._resumed_t >= preemption.after_s

    def _since_first_step(self) -> float:
        return -1.0 if self._first_step_t is None else time.time() - self._first_step_t

    # --------------------------------------------------------------- acting
    def _fire(self, preemption: schedules.Preemption) -> None:
        t = time.time()
        label = f"preemption {preemption.index + 1}/{self.total}: {preemption.kind}"
        try:
            hit = inject(preemption.kind, view=self.view, target=preemption.target, cluster=self.cluster,
                         settings=self.settings, emit=self._emit)
        except Exception as err:  # a preemption that could not be made is reported, the run goes on
            self.errors.append(f"{label}: {err!r}")
            self._print(time.time(), f"{label} NOT injected: {err}")
            return
        self._last_kill_t = hit.get("t_kill", t)
        self._fired_at_s = preemption.at_s
        self._restart_after = None if preemption.kind in NO_RESTART_KINDS else t
        self._resumed_t = None
        self.events.append({"t": t, "event": "inject", "index": preemption.index, "kind": preemption.kind,
                            "iteration": self.view.iteration, **hit})
        self._print(hit.get("t_kill", t), f"{label} at iteration {self.view.iteration}: {hit['what']}")
        if hit.get("lost_node") and self.config.replace:
            self._replacements.append(time.time() + self.config.replace_delay_s)

    def _emit(self, event: str, **fields: Any) -> None:
        self.events.append({"t": time.time(), "event": event, **fields})
        if "what" in fields:
            self._print(time.time(), fields["what"])

    def _replace_due_nodes(self) -> None:
        now = time.time()
        for due in [d for d in self._replacements if d <= now]:
            self._replacements.remove(due)
            try:
                node = self.cluster.add_node()
            except Exception as err:
                self.errors.append(f"replacement node: {err!r}")
                self._print(time.time(), f"replacement node NOT added: {err}")
                continue
            self.events.append({"t": time.time(), "event": "replace", "node": node})
            self._print(time.time(), f"replacement node {node[:8]} added (as an autoscaler would)")

    def _add_due_nodes(self) -> None:
        """The trace's ``add`` events: nodes the cloud grants, which an elastic job may grow onto."""
        while self.additions_s and 0 <= self.additions_s[0] <= self._since_first_step():
            self.additions_s.pop(0)
            try:
                node = self.cluster.add_node()
            except Exception as err:
                self.errors.append(f"trace node addition: {err!r}")
                continue
            self.events.append({"t": time.time(), "event": "add", "node": node})
            self._print(time.time(), f"node {node[:8]} added (the trace's add)")

    def _print(self, t: float, line: str) -> None:
        if self.config.progress is not None:
            self.config.progress(f"[{t - self._t0:6.1f} s] {line}")


def write_outputs(result: dict, *, json_path: str | None, png_path: str | None, title: str) -> None:
    """The report as JSON (without the raw events) and its timeline picture."""
    if json_path:
        with open(json_path, "w") as out:
            json.dump({k: v for k, v in result.items() if not k.startswith("_")}, out, indent=2, default=str)
    if png_path:
        reports.plot_timeline(result["_events"], result, png_path, title=title)


__all__ = ["ChaosConfig", "compare", "plan", "run_chaos", "write_outputs"]
