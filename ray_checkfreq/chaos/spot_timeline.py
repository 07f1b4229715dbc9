"""What a job on the local spot cluster went through, on one clock (seconds since ``start``).

Three sources, recorded as they happen:
- polled every ``poll_s``: the spot nodes Ray lists as alive (``node_up``, ``node_gone``) and
  the steps committed in the run's store on the cluster's S3 (``commit``);
- the job's output, line by line (``follow``): each attempt's first line (``attempt``, with
  the iteration it began at, its world size, rank 0's node and where it restored from) and
  its end (``done``);
- what the harness did (``mark``): ``submit``, ``notice``, ``kill``, ``job_end``.

``figures()`` turns a run into the times users ask about: nodes up after a submit; for each
loss, the replacement node, the next attempt and the return to full size; with a notice, the
step its checkpoint committed and how long before the deadline; ours' share of a restart
(the restore's own seconds); the idle nodes' removal after the job.
"""

from __future__ import annotations

import ast
import json
import re
import threading
import time
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from ray_checkfreq.chaos.spot_cluster import BUCKET, S3_CREDENTIALS, SpotCluster, spot_nodes
from ray_checkfreq.storage.names import parse_checkpoint_dir

ATTEMPT = re.compile(r"attempt starts at iteration (?P<iteration>\d+) on (?P<world>\d+) workers "
                     r"\(rank 0 on node (?P<node>[0-9a-f]+)\); restored from: (?P<restore>\{.*\})")
DONE = re.compile(r"done: (?P<iterations>\d+) iterations, weights sha256 (?P<digest>[0-9a-f]{64})")


@dataclass(frozen=True)
class Event:
    t_s: float
    kind: str
    detail: dict = field(default_factory=dict)


def committed_steps(cluster: SpotCluster, run: str, *, prefix: str = "runs") -> list[int]:
    """The steps with a global manifest in ``s3://rcf-spot/<prefix>/<run>/checkfreq``."""
    import boto3

    s3 = boto3.client("s3", endpoint_url=cluster.s3_endpoint, region_name=S3_CREDENTIALS["AWS_REGION"],
                      aws_access_key_id=S3_CREDENTIALS["AWS_ACCESS_KEY_ID"],
                      aws_secret_access_key=S3_CREDENTIALS["AWS_SECRET_ACCESS_KEY"])
    pages = s3.get_paginator("list_objects_v2").paginate(Bucket=BUCKET, Prefix=f"{prefix}/{run}/checkfreq/")
    steps = set()
    for page in pages:
        for entry in page.get("Contents", []):
            parts = entry["Key"].split("/")
            parsed = parse_checkpoint_dir(parts[-2]) if parts[-1] == "manifest.json" else None
            if parsed is not None:
                steps.add(parsed[0])
    return sorted(steps)


class Timeline(threading.Thread):
    """Records the events of the module docstring until ``stop()``."""

    def __init__(self, cluster: SpotCluster, run: str, *, poll_s: float = 0.5) -> None:
        super().__init__(daemon=True, name="spot-timeline")
        self.cluster, self.run_name, self.poll_s = cluster, run, poll_s
        self.started = time.monotonic()
        self.events: list[Event] = []
        self.output: list[str] = []
        self._lock = threading.Lock()
        self._halt = threading.Event()
        self._nodes: set[str] = set()
        self._steps: set[int] = set()

    def now(self) -> float:
        return round(time.monotonic() - self.started, 2)

    def mark(self, kind: str, **detail: Any) -> None:
        with self._lock:
            self.events.append(Event(self.now(), kind, detail))

    def run(self) -> None:
        while not self._halt.wait(self.poll_s):
            try:
                nodes, steps = set(spot_nodes(self.cluster)), set(committed_steps(self.cluster, self.run_name))
            except OSError:  # the dashboard or S3 busy for a moment: the next poll sees it
                continue
            for node in sorted(nodes - self._nodes):
                self.mark("node_up", node=node, alive=len(nodes))
            for node in sorted(self._nodes - nodes):
                self.mark("node_gone", node=node, alive=len(nodes))
            for step in sorted(steps - self._steps):
                self.mark("commit", step=step)
            self._nodes, self._steps = nodes, steps

    def stop(self) -> None:
        self._halt.set()
        self.join(timeout=10)

    def follow(self, lines: Iterable[str]) -> None:
        """Read the job's output; each distinct line counts once (every node's log monitor
        of a local cluster forwards the same worker log)."""
        seen: set[str] = set()
        for line in lines:
            self.output.append(line)
            attempt, done = ATTEMPT.search(line), DONE.search(line)
            found = attempt or done
            if found is None or found.group(0) in seen:
                continue
            seen.add(found.group(0))
            if attempt:
                restore = ast.literal_eval(attempt["restore"])  # the job's own printed dict: literals only
                self.mark("attempt", iteration=int(attempt["iteration"]), world=int(attempt["world"]),
                          rank0_node=attempt["node"], restore=restore)
            elif done:
                self.mark("done", iterations=int(done["iterations"]), digest=done["digest"])

    def of(self, kind: str, after_s: float = -1.0) -> list[Event]:
        with self._lock:
            return [e for e in self.events if e.kind == kind and e.t_s > after_s]

    def alive_now(self) -> int:
        return len(self._nodes)

    def figures(self, *, full_world: int) -> dict[str, Any]:
        """The times of the module docstring, in seconds, from the recorded events."""
        figures: dict[str, Any] = {}
        submit = self.of("submit")
        if submit:
            full = [e for e in self.of("node_up", submit[0].t_s) if e.detail["alive"] >= full_world]
            if full:
                figures["nodes_at_full_size_after_submit_s"] = round(full[0].t_s - submit[0].t_s, 2)
        figures["losses"] = [self._loss_figures(kill, full_world) for kill in self.of("kill")]
        job_end = self.of("job_end")
        if job_end:  # the last job's end: the nodes are idle from then on
            gone = [e for e in self.of("node_gone", job_end[-1].t_s) if e.detail["alive"] == 0]
            if gone:
                figures["nodes_removed_after_job_s"] = round(gone[0].t_s - job_end[-1].t_s, 2)
        return figures

    def _loss_figures(self, kill: Event, full_world: int) -> dict[str, Any]:
        loss: dict[str, Any] = {"at_s": kill.t_s, "with_notice": kill.detail.get("notice", False)}
        replaced = self.of("node_up", kill.t_s)
        if replaced:
            loss["replacement_node_up_s"] = round(replaced[0].t_s - kill.t_s, 2)
        attempts = self.of("attempt", kill.t_s)
        if attempts:
            restore = attempts[0].detail["restore"]
            to_attempt = attempts[0].t_s - kill.t_s
            loss.update(next_attempt_s=round(to_attempt, 2), next_attempt_world=attempts[0].detail["world"],
                        resumed_at=attempts[0].detail["iteration"], restored_from=restore.get("kind"),
                        restore_s=round(float(restore.get("seconds", 0.0)), 4),
                        ours_share=round(float(restore.get("seconds", 0.0)) / to_attempt, 4) if to_attempt > 0
                        else None, lost_after_notice=restore.get("lost_after_notice"))
            full = [a for a in attempts if a.detail["world"] >= full_world]
            if full:
                loss["full_size_again_s"] = round(full[0].t_s - kill.t_s, 2)
        notices = [e for e in self.of("notice") if e.t_s <= kill.t_s]
        if loss["with_notice"] and notices:  # the notice's checkpoint: the last commit before the deadline
            commits = [e for e in self.of("commit", notices[-1].t_s) if e.t_s <= kill.t_s]
            if commits:
                loss.update(notice_checkpoint_step=commits[-1].detail["step"],
                            notice_checkpoint_before_deadline_s=round(kill.t_s - commits[-1].t_s, 2))
        return loss

    def write(self, path: Path, *, full_world: int) -> dict[str, Any]:
        """The events and figures as JSON at ``path``; returns the figures."""
        figures = self.figures(full_world=full_world)
        path.write_text(json.dumps({"run": self.run_name, "figures": figures,
                                    "events": [asdict(e) for e in self.events]}, indent=1) + "\n")
        return figures
