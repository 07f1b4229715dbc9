"""A discrete-event model of one data-parallel job on a spot fleet: goodput by
checkpointing method over a whole availability trace (pure: no Ray, no clock).

The job spans every node the trace holds (up to ``full_nodes``) with a fixed global batch:
an iteration takes ``iter_s * (full_nodes / n) ** scaling`` on ``n`` nodes (``scaling`` 1:
bound by compute). Every ``remove`` instant while it runs or restarts is one preemption,
however many nodes it takes: the job falls back to its newest recoverable iteration,
restarts (``restart_s`` plus the restore; a loss during a restart begins it again), and
resumes on the nodes then held; below ``min_nodes`` it waits. Nodes added while it runs
join at its next restart, or (``Fleet.resize_check_s``, Ray Train's elastic monitor) at
the monitor's next look, by a restart of their own.

Goodput is the iterations the job kept at the end over those an ideal job (no checkpoint,
no restart, no loss) makes on the same nodes: ``sum(n(t) / (full_nodes * iter_s) dt)``.

Methods (``Method.kind``):
- ``checkfreq``: a snapshot to RAM every k iterations (the stall), persisted beside training;
  k from the library's policy (``engine.policy.choose_interval``: p's k, then the k of the
  best expected goodput at the loss rate and uptimes observed so far, as the run-wide policy does;
  chosen at each restart), or fixed (``every``: the oracle's sweep). A
  preemption falls back to the newest snapshot while any node of the job survives (the
  node agents' RAM copies), else to the newest one persisted; a notice long enough for
  one snapshot loses nothing.
- ``async``: ``torch.save`` of a CPU copy in a thread and an upload every N iterations
  (the stall is the copy); a preemption falls back to the newest upload that finished.
- ``sync``: ``torch.save`` and upload inside the step every N iterations.
- ``epoch``: ``sync`` once an epoch.
- ``none``: no checkpoint; a preemption restarts from 0.
- ``inplace``: ``checkfreq``'s checkpoints on torchft replica groups (Ray 2.60's
  ``TorchftConfig``: one worker, one replica of replicated (DDP) state, per node), at a
  fixed worker count N (``Method.replicas``, default ``full_nodes``): Ray 2.60 replaces a
  lost replica in place only at an unchanged worker count, any resize being a full
  restart, so the job never resizes. It starts (and restarts) once N nodes are live (Ray
  places every worker first). A removal takes the job's training replicas first, then
  those healing, then spare nodes (the worst case). While one replica trains, a removal
  is a replica loss: the survivors pause ``pause_s``, then train on at n of N (an
  iteration takes ``iteration_s(n)``: the global batch is split over the participants),
  each lost replica being replaced on a free node (at once, or when the trace adds one):
  it joins ``heal_s`` after the node is there, then receives the state from a live peer
  (``state_gb / heal_gbps``, torchft's ``PGTransport``: the survivors' next step waits for
  the send), then trains. A removal of every training replica is a loss of the whole job:
  back to the newest persisted checkpoint (no RAM copy survives), then a restart, as for
  ``checkfreq``. Every step costs ``quorum_overhead`` more (torchft's per-step quorum). k:
  the policy's, at the observed rate of whole-job losses (the losses that need a
  checkpoint; 0 once only replica losses were seen: as few checkpoints as the lost-work
  bound allows), chosen at each start and each loss.
"""

from __future__ import annotations

import bisect
import math
from dataclasses import dataclass, field, replace

from ray_checkfreq.engine.policy import Profile, choose_interval, lost_work_cap, mtbf_estimate

KINDS = ("checkfreq", "async", "sync", "epoch", "none", "inplace")
SNAPSHOTS = ("checkfreq", "inplace")  # a RAM snapshot in the step, persisted beside training
GB = 1e9


@dataclass(frozen=True, kw_only=True)
class Costs:
    """What one job's checkpoints, restores and restarts cost; seconds, GB and GB/s."""

    iter_s: float = 1.0  # an iteration on full_nodes
    state_gb: float = 10.0
    storage_gbps: float = 1.0  # the job's write and read bandwidth to storage
    snapshot_gbps: float = 10.0  # a device -> host copy (the stall of checkfreq and async)
    serialize_gbps: float = 2.0  # torch.save of a host copy
    ram_restore_gbps: float = 5.0  # a restore from a node agent's RAM copy
    restart_s: float = 60.0  # group restart, process start and set-up; the restore apart
    notice_s: float = 0.0  # warning before a node goes (AWS: 120 s); 0: none
    epoch_iterations: int = 2000
    overhead: float = 0.035  # the policy's p
    sharded: bool = False  # FSDP2: each node copies, saves and restores from RAM its 1/n of the state
    # An iteration on n of full_nodes takes iter_s * (full_nodes / n) ** scaling: 1, a fixed
    # global batch bound by compute; 0, a step no node count shortens (the replay's, a sleep).
    scaling: float = 1.0
    # The restart after the n-th preemption takes restarts_s[n - 1] (a replay's measured ones),
    # restart_s past its end and at a resize; the restore apart in both.
    restarts_s: tuple[float, ...] = ()
    # In place (kind "inplace"): measured on a CPU cluster with a tiny state (Ray 2.60,
    # torchft 0.2.0): survivors' next step 0.15-1.2 s after a kill; the replacement trained
    # again ~4 s after its node was there. The peer's send of the state is not in those 4 s.
    pause_s: float = 1.2  # the survivors' pause at a replica loss
    heal_s: float = 4.0  # a free node -> its replacement replica in the quorum
    heal_gbps: float = 1.0  # a live peer -> the replacement: the state's transfer
    quorum_overhead: float = 0.01  # torchft's per-step quorum, a fraction of each step

    def __post_init__(self) -> None:
        for name in ("iter_s", "state_gb", "storage_gbps", "snapshot_gbps", "serialize_gbps", "ram_restore_gbps"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name}={getattr(self, name)!r}: must be > 0")
        if not 0 <= self.scaling <= 1:
            raise ValueError(f"scaling={self.scaling!r}: must be in [0, 1]")
        if self.restart_s < 0 or self.notice_s < 0:
            raise ValueError("restart_s and notice_s must be >= 0")
        if any(not seconds >= 0 for seconds in self.restarts_s):
            raise ValueError(f"restarts_s={self.restarts_s!r}: each must be >= 0")
        for name in ("pause_s", "heal_s", "quorum_overhead"):
            if not getattr(self, name) >= 0:
                raise ValueError(f"{name}={getattr(self, name)!r}: must be >= 0")
        if not self.heal_gbps > 0:
            raise ValueError(f"heal_gbps={self.heal_gbps!r}: must be > 0")
        if self.epoch_iterations < 1 or not 0 < self.overhead < 1:
            raise ValueError("epoch_iterations must be >= 1 and overhead in (0, 1)")

    def iteration_s(self, nodes: int, full_nodes: int) -> float:
        """An iteration's seconds on ``nodes`` of ``full_nodes``."""
        return self.iter_s * (full_nodes / nodes) ** self.scaling

    def share_gb(self, nodes: int) -> float:
        """What one node holds of the state."""
        return self.state_gb / nodes if self.sharded else self.state_gb

    def snapshot_s(self, nodes: int) -> float:
        return self.share_gb(nodes) / self.snapshot_gbps

    def save_s(self, nodes: int) -> float:
        return self.share_gb(nodes) / self.serialize_gbps

    @property
    def upload_s(self) -> float:
        return self.state_gb / self.storage_gbps

    @property
    def transfer_s(self) -> float:
        """A live peer's send of the state to a replacement replica."""
        return self.state_gb / self.heal_gbps


@dataclass(frozen=True, kw_only=True)
class Method:
    name: str
    kind: str
    every: int | None = None  # N; checkfreq and inplace: a fixed k instead of the policy's
    replicas: int | None = None  # inplace: the fixed worker count (None: the fleet's full_nodes)

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"kind={self.kind!r}: expected one of {', '.join(KINDS)}")
        if self.kind in ("async", "sync") and self.every is None:
            raise ValueError(f"{self.name}: an every-N method needs every")
        if self.every is not None and self.every < 1:
            raise ValueError(f"{self.name}: every={self.every!r}: must be >= 1")
        if self.replicas is not None and (self.kind != "inplace" or self.replicas < 1):
            raise ValueError(f"{self.name}: replicas={self.replicas!r}: only for kind 'inplace', and >= 1")


@dataclass(frozen=True)
class Fleet:
    """A trace as the job sees it: (time, nodes removed then, live nodes after) per instant."""

    instants: list[tuple[float, int, int]]
    full_nodes: int
    min_nodes: int = 1
    end_s: float | None = None  # default: the last instant
    # Ray Train's elastic monitor (ScalingConfig.elastic_resize_monitor_interval_s): every this
    # many seconds of an attempt, a job on fewer nodes than it could hold restarts onto them
    # (no preemption: every node survives). None: nodes added join at the next preemption.
    resize_check_s: float | None = None

    def __post_init__(self) -> None:
        if not 1 <= self.min_nodes <= self.full_nodes:
            raise ValueError(f"min_nodes={self.min_nodes!r}, full_nodes={self.full_nodes!r}: need 1 <= min <= full")
        if self.resize_check_s is not None and not self.resize_check_s > 0:
            raise ValueError(f"resize_check_s={self.resize_check_s!r}: must be > 0 (None: no monitor)")


@dataclass
class Outcome:
    method: str
    goodput: float
    iterations: float
    ideal_iterations: float
    lost_iterations: float
    restarts: int
    stall_s: float
    restart_s: float
    k: list[int] = field(default_factory=list)  # the k (or N) of each attempt
    replica_losses: int = 0  # inplace: removals survived in place
    paused_s: float = 0.0  # inplace: survivors' pauses and waits for a peer's send
    short_iterations: float = 0.0  # inplace: iterations not made while replacements joined
    waited_iterations: float = 0.0  # inplace: the ideal's iterations while the job waited for N nodes


def policy_k(costs: Costs, mtbf_s: float | None, *, nodes: int, full_nodes: int,
             uptimes_s: tuple[float, ...] = ()) -> int:
    """The library policy's k for these costs on ``nodes`` of ``full_nodes`` (the copy not
    hidden by the update), as the run-wide policy decides it (ray/shared_policy.py): p's k
    until a loss was seen; then the k of the best expected goodput at the observed rate of
    losses that need a checkpoint (none where the notice covers a snapshot: those keep
    everything) and the training seconds before each of them (``uptimes_s``), within the
    hard cap on overhead and the lost-work bound."""
    rate = None if mtbf_s is None else (0.0 if costs.notice_s >= costs.snapshot_s(nodes) else 1 / mtbf_s)
    return rate_k(costs, rate, nodes=nodes, full_nodes=full_nodes, uptimes_s=uptimes_s)


def rate_k(costs: Costs, rate: float | None, *, nodes: int, full_nodes: int, from_storage: bool = False,
           uptimes_s: tuple[float, ...] = ()) -> int:
    """The library policy's k at ``rate`` losses a second that need a checkpoint (None:
    none seen yet, p's k; 0: losses seen, none of which needed one); ``from_storage``: the
    restart restores from storage (no RAM copy survives such a loss)."""
    iteration_s = costs.iteration_s(nodes, full_nodes)
    profile = Profile(iter_s=iteration_s, update_s=iteration_s, cpu_copy_s=costs.snapshot_s(nodes),
                      persist_s=costs.upload_s, size_bytes=int(costs.share_gb(nodes) * GB))
    k_cap = lost_work_cap(costs.epoch_iterations, 0.25, iter_s=iteration_s, floor_s=10.0)  # the engine's default
    restore_s = costs.upload_s if from_storage else costs.share_gb(nodes) / costs.ram_restore_gbps
    restart_s = costs.restart_s + restore_s  # as a run measures it
    return choose_interval(profile, overhead=costs.overhead, loss_rate_per_s=rate, restart_s=restart_s,
                           k_cap=k_cap, uptimes_s=uptimes_s).k


@dataclass
class _Job:
    method: Method
    costs: Costs
    fleet: Fleet
    progress: float = 0.0
    nodes: int = 0
    restart_left: float = 0.0
    waiting: bool = True
    k: int = 1
    durable_floor: float = 0.0  # what the restore brought back: durable whatever happens next
    history: list[tuple[float, float]] = field(default_factory=list)  # (time, progress) while running
    lost: float = 0.0
    restarts: int = 0
    stall_s: float = 0.0
    restart_spent_s: float = 0.0
    ks: list[int] = field(default_factory=list)
    next_check: float = math.inf  # the elastic monitor's next look at the nodes
    from_ram: bool = False  # where the restore of this attempt comes from
    trained_s: float = 0.0  # seconds this attempt trained, its restart apart
    uptimes: list[float] = field(default_factory=list)  # trained_s at each preemption
    pause_left: float = 0.0  # inplace: seconds the survivors still wait (a loss, a peer's send)
    paused_s: float = 0.0
    replicas: int = 0  # inplace: the worker count N; ``nodes`` is then the replicas training
    target: int = 0  # inplace: the replicas that could train (N, or the live nodes if fewer)
    short: float = 0.0  # inplace: iterations not made because nodes < target (replacements joining)
    loss_rate: float | None = None  # inplace: whole-job losses a second, as the policy sees them

    def interval(self) -> int | None:
        kind = self.method.kind
        if kind == "none":
            return None
        if kind == "epoch":
            return self.costs.epoch_iterations
        return self.k

    def per_checkpoint_s(self, iteration_s: float) -> float:
        """Training seconds one checkpoint costs, its wait for the one before included."""
        costs, k = self.costs, self.interval()
        if k is None:
            return 0.0
        if self.method.kind in ("sync", "epoch"):
            return costs.save_s(self.nodes) + costs.upload_s
        return costs.snapshot_s(self.nodes) + max(0.0, self.lag_s() - k * iteration_s)

    def lag_s(self) -> float:
        """Seconds from a checkpoint's stall until it is durable in storage."""
        if self.method.kind in SNAPSHOTS:
            return self.costs.upload_s
        if self.method.kind == "async":
            return self.costs.save_s(self.nodes) + self.costs.upload_s
        return 0.0

    def run(self, start: float, seconds: float) -> None:
        if seconds <= 0:
            return
        if self.waiting:
            return
        if self.restart_left > 0:
            spent = min(self.restart_left, seconds)
            self.restart_left -= spent
            self.restart_spent_s += spent
            start, seconds = start + spent, seconds - spent
            if seconds <= 0:
                return
        self.trained_s += seconds
        if self.pause_left > 0:
            spent = min(self.pause_left, seconds)
            self.pause_left -= spent
            self.paused_s += spent
            start, seconds = start + spent, seconds - spent
            if self.history:  # no progress over the pause
                self.history.append((start, self.progress))
            if seconds <= 0:
                return
        if not self.history:
            self.history = [(start, self.progress)]
        rate, stall = self.rate(self.nodes)
        self.progress += rate * seconds
        self.stall_s += seconds * stall
        if self.target > self.nodes:
            self.short += (self.rate(self.target)[0] - rate) * seconds
        self.history.append((start + seconds, self.progress))

    def rate(self, nodes: int) -> tuple[float, float]:
        """(iterations a second, the share of time stalled by checkpoints) on ``nodes``."""
        iteration_s = self.costs.iteration_s(nodes, self.fleet.full_nodes)
        if self.method.kind == "inplace":
            iteration_s *= 1 + self.costs.quorum_overhead
        k = self.interval()
        if k is None:
            return 1.0 / iteration_s, 0.0
        cost = self.per_checkpoint_s(iteration_s)
        return k / (k * iteration_s + cost), cost / (k * iteration_s + cost)

    def progress_at(self, time: float) -> float:
        if not self.history or time <= self.history[0][0]:
            return self.durable_floor
        times = [t for t, _ in self.history]
        i = bisect.bisect_right(times, time) - 1
        if i >= len(self.history) - 1:
            return self.history[-1][1]
        (t0, p0), (t1, p1) = self.history[i], self.history[i + 1]
        return p0 + (p1 - p0) * (time - t0) / (t1 - t0)

    def recoverable(self, now: float, survivors: int) -> tuple[float, bool]:
        """(iteration the job falls back to, whether from RAM) at a preemption now."""
        k = self.interval()
        if k is None:
            return 0.0, False
        running = not self.waiting and self.restart_left <= 0
        if not running:  # it had not trained since its restore: the same copy again
            return self.progress, self.from_ram and survivors > 0
        if self.method.kind in SNAPSHOTS:
            if self.costs.notice_s >= self.costs.snapshot_s(self.nodes):
                return self.progress, survivors > 0  # a stop checkpoint at the notice
            if survivors > 0:
                return max(self.durable_floor, math.floor(self.progress / k) * k), True
        durable = math.floor(self.progress_at(now - self.lag_s()) / k) * k
        return max(self.durable_floor, durable), False

    def can_grow(self, live: int) -> bool:
        """Whether the elastic monitor would restart the job now onto more nodes."""
        return not self.waiting and self.restart_left <= 0 and self.nodes < min(live, self.fleet.full_nodes)

    def restart(self, now: float, live: int, mtbf_s: float | None, *, preemption: int | None = None,
                survivors: int | None = None) -> None:
        """A preemption (the ``preemption``-th, from 1) or a resize: back to the newest
        recoverable iteration, then a restart on the ``live`` nodes (a loss while restarting
        begins the restart again). ``survivors``: the job's nodes that outlive it (default:
        as many of its nodes as are live)."""
        survivors = min(self.nodes, live) if survivors is None else survivors
        if preemption is not None:
            self.uptimes.append(self.trained_s)
        back, from_ram = self.recoverable(now, survivors)
        self.from_ram = from_ram
        self.lost += self.progress - back
        self.progress = self.durable_floor = back
        self.restarts += 1
        restore_s = 0.0
        if self.interval() is not None and back > 0:
            restore_s = (self.costs.share_gb(max(1, min(self.nodes, live))) / self.costs.ram_restore_gbps if from_ram
                         else self.costs.state_gb / self.costs.storage_gbps)
        given = self.costs.restarts_s
        restart_s = self.costs.restart_s
        if preemption is not None and preemption <= len(given):
            restart_s = given[preemption - 1]
        self.restart_left = restart_s + restore_s
        self.pause_left = 0.0
        self.start_attempt(now, live, mtbf_s)

    def start_attempt(self, now: float, live: int, mtbf_s: float | None) -> None:
        if self.method.kind == "inplace":  # a fixed worker count, every worker placed first
            self.nodes = min(live, self.replicas)
            self.waiting = self.nodes < self.replicas
        else:
            self.nodes = min(live, self.fleet.full_nodes)
            self.waiting = self.nodes < self.fleet.min_nodes
        self.history = []
        self.trained_s = 0.0
        check = self.fleet.resize_check_s
        self.next_check = now + check if check is not None and not self.waiting else math.inf
        if self.method.kind == "checkfreq":
            self.k = self.method.every or policy_k(self.costs, mtbf_s, nodes=max(1, self.nodes),
                                                   full_nodes=self.fleet.full_nodes, uptimes_s=tuple(self.uptimes))
        elif self.method.kind == "inplace":
            self.choose_k()
            return
        elif self.method.every is not None:
            self.k = self.method.every
        self.ks.append(self.interval() or 0)

    def choose_k(self) -> None:
        """inplace: the policy's k at ``loss_rate`` (the rate of whole-job losses)."""
        self.k = self.method.every or rate_k(self.costs, self.loss_rate, nodes=self.replicas,
                                             full_nodes=self.fleet.full_nodes, from_storage=True)
        self.ks.append(self.k)


def simulate(fleet: Fleet, method: Method, costs: Costs) -> Outcome:
    """One method over the whole fleet trace."""
    if method.kind == "inplace":
        return _simulate_in_place(fleet, method, costs)
    instants = fleet.instants
    end = fleet.end_s if fleet.end_s is not None else instants[-1][0]
    job = _Job(method=method, costs=costs, fleet=fleet)
    ideal, live, now, preemptions = 0.0, 0, instants[0][0], 0
    started, first_start = False, 0.0

    def ideal_over(seconds: float) -> float:
        if live < fleet.min_nodes:
            return 0.0
        return seconds / costs.iteration_s(min(live, fleet.full_nodes), fleet.full_nodes)

    for time, removed, live_after in instants + [(end, 0, -1)]:
        time = min(time, end)
        while job.next_check < time:
            ideal += ideal_over(job.next_check - now)
            job.run(now, job.next_check - now)
            now = job.next_check
            job.next_check = now + (fleet.resize_check_s or math.inf)
            if job.can_grow(live):
                job.restart(now, live, mtbf_estimate(now - first_start, preemptions))
        ideal += ideal_over(time - now)
        job.run(now, time - now)
        now = time
        if live_after < 0 or time >= end:
            break
        if removed and started and not job.waiting:  # running or restarting: preempted
            preemptions += 1
            job.restart(now, live_after, mtbf_estimate(now - first_start, preemptions), preemption=preemptions)
        elif live_after >= fleet.min_nodes and (not started or job.waiting):  # (re)starts on enough nodes
            if not started:
                started, first_start = True, now
            job.start_attempt(now, live_after, mtbf_estimate(now - first_start, preemptions))
        live = live_after
    return Outcome(method=method.name, goodput=job.progress / ideal if ideal else 0.0, iterations=job.progress,
                   ideal_iterations=ideal, lost_iterations=job.lost, restarts=job.restarts, stall_s=job.stall_s,
                   restart_s=job.restart_spent_s, k=job.ks)


@dataclass
class _Group:
    """An in-place job's nodes: replicas training, and replacements joining (each one's time)."""

    size: int
    training: int = 0
    joining: list[float] = field(default_factory=list)

    @property
    def held(self) -> int:
        return self.training + len(self.joining)

    def remove(self, removed: int) -> int:
        """The worst case: ``removed`` nodes taken from the training replicas first, then from
        the replacements nearest to joining; returns the training replicas lost."""
        training = min(removed, self.training)
        self.training -= training
        joining = min(removed - training, len(self.joining))
        self.joining = sorted(self.joining)[joining:]
        return training

    def replace(self, now: float, live: int, heal_s: float) -> None:
        """A replacement for each missing replica on each live node the group does not hold."""
        for _ in range(min(self.size - self.held, live - self.held)):
            self.joining.append(now + heal_s)

    def joins_by(self, time: float) -> list[float]:
        """The replacements that join by ``time``, in order (no longer joining after)."""
        due = sorted(t for t in self.joining if t <= time)
        self.joining = [t for t in self.joining if t > time]
        return due


def _simulate_in_place(fleet: Fleet, method: Method, costs: Costs) -> Outcome:
    """``inplace`` (the module docstring) over the whole fleet trace."""
    size = method.replicas or fleet.full_nodes
    if size > fleet.full_nodes:
        raise ValueError(f"{method.name}: replicas={size} > the fleet's full_nodes={fleet.full_nodes}")
    if costs.sharded:
        raise ValueError(f"{method.name}: sharded=True: in-place recovery keeps replicated (DDP) state only")
    instants = fleet.instants
    end = fleet.end_s if fleet.end_s is not None else instants[-1][0]
    job = _Job(method=method, costs=costs, fleet=fleet, replicas=size)
    group = _Group(size=size)
    ideal, waited, live, now = 0.0, 0.0, 0, instants[0][0]
    first_start: float | None = None
    losses = whole_losses = replica_losses = 0

    def advance(to: float) -> None:
        nonlocal ideal, waited, now
        if live >= fleet.min_nodes:
            gained = (to - now) / costs.iteration_s(min(live, fleet.full_nodes), fleet.full_nodes)
            ideal += gained
            waited += gained if first_start is None or job.waiting else 0.0
        job.target = min(live, size)
        job.run(now, to - now)
        now = to

    def loss_rate() -> float | None:
        if losses == 0 or first_start is None:
            return None
        if whole_losses == 0:
            return 0.0
        return 1 / (mtbf_estimate(now - first_start, whole_losses) or math.inf)

    for time, removed, live_after in instants + [(end, 0, -1)]:
        time = min(time, end)
        for joined in group.joins_by(time):  # a replacement healed from a live peer: the send stalls the step
            advance(joined)
            group.training += 1
            job.nodes = group.training
            job.pause_left = max(job.pause_left, costs.transfer_s)
        advance(time)
        if live_after < 0 or time >= end:
            break
        live = live_after
        hit = min(removed, group.held) if first_start is not None and not job.waiting else 0
        if hit:
            losses += 1
            restarting = job.restart_left > 0
            lost_training = group.remove(hit)
            if group.training == 0 or restarting:  # every replica, or one of a group still starting
                whole_losses += costs.notice_s < costs.snapshot_s(size)  # a stop checkpoint keeps all
                group = _Group(size=size)
                job.loss_rate = loss_rate()
                job.restart(now, live, None, preemption=job.restarts + 1, survivors=0)
                group.training = job.nodes if not job.waiting else 0
            else:
                replica_losses += 1
                job.nodes = group.training
                if lost_training:
                    job.pause_left = max(job.pause_left, costs.pause_s)
                job.loss_rate = loss_rate()
                job.choose_k()
        if first_start is None or job.waiting:
            if live >= size:
                first_start = now if first_start is None else first_start
                job.start_attempt(now, live, None)
                group = _Group(size=size, training=size)
        else:
            group.replace(now, live, costs.heal_s)
    return Outcome(method=method.name, goodput=job.progress / ideal if ideal else 0.0, iterations=job.progress,
                   ideal_iterations=ideal, lost_iterations=job.lost, restarts=job.restarts, stall_s=job.stall_s,
                   restart_s=job.restart_spent_s, k=job.ks, replica_losses=replica_losses, paused_s=job.paused_s,
                   short_iterations=job.short, waited_iterations=waited)


def oracle(fleet: Fleet, method: Method, costs: Costs, *, candidates: list[int] | None = None) -> Outcome:
    """The best fixed interval for ``method``'s mechanism, chosen knowing the whole trace."""
    grid = candidates or sorted({max(1, round(1.25 ** i)) for i in range(0, 45)})
    results = [simulate(fleet, replace(method, every=n, name=f"{method.name} best N={n}"), costs) for n in grid]
    return max(results, key=lambda outcome: outcome.goodput)
