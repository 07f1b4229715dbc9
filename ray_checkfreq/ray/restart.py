"""Where a restarted run resumes from: a pure choice over what storage and the agents hold.

The protocol around it (``session.py``), in this order: find the run's live agents; wait
for their in-flight persists; only then take a new writer generation; choose with
``choose_source``; the rank on the chosen slot's node loads it and broadcasts it; a slot
newer than the newest commit is persisted under the new generation.
"""

from __future__ import annotations

import logging
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ray_checkfreq.ray.slots import SLOT_COMPLETE

logger = logging.getLogger("ray_checkfreq.ray")


@dataclass(frozen=True, kw_only=True)
class RestoreChoice:
    """``kind``: "none" (start at 0), "storage" (the newest valid commit) or "slot"."""

    kind: str
    step: int | None = None
    node_id: str | None = None
    path: str | None = None
    seq: int | None = None
    needs_persist: bool = False  # a slot newer than the newest commit
    committed_step: int | None = None
    via_agent: bool = False  # no rank on the slot's node: its agent sends it through the object store

    def __post_init__(self) -> None:
        if self.kind not in ("none", "storage", "slot"):
            raise ValueError(f"kind={self.kind!r}: expected 'none', 'storage' or 'slot'")


def choose_source(*, committed_step: int | None, slot_headers: Mapping[str, Sequence[Mapping[str, Any]]],
                  run: str, reachable_nodes: Collection[str], prefer_node: str | None = None) -> RestoreChoice:
    """The newest of the newest commit and every reachable COMPLETE slot of ``run``.

    A slot wins a tie with storage (RAM is faster). Slots of one step that disagree on
    their checksum across nodes are all ignored (a replica should be bit-identical).
    ``prefer_node`` breaks ties between nodes (rank 0's node: no broadcast hop), then nodes
    with a rank of this run (``reachable_nodes``); a slot on a node without one is sent
    by its agent (``via_agent``).
    """
    by_step: dict[int, list[tuple[str, Mapping[str, Any]]]] = {}
    for node, headers in slot_headers.items():
        for header in headers:
            if header.get("state") == SLOT_COMPLETE and header.get("run") == run:
                by_step.setdefault(int(header["step"]), []).append((node, header))
    for step in sorted(by_step, reverse=True):
        copies = by_step[step]
        if len({int(h["data_crc32"]) for _, h in copies}) > 1:
            logger.error("restore: the slots of step %d differ across nodes (%s); not using them", step,
                         ", ".join(node[:8] for node, _ in copies))
            continue
        if committed_step is not None and step < committed_step:
            break
        node, header = min(copies, key=lambda c: (c[0] != prefer_node, c[0] not in reachable_nodes, c[0]))
        return RestoreChoice(kind="slot", step=step, node_id=node, path=str(header["path"]), seq=int(header["seq"]),
                             needs_persist=committed_step is None or step > committed_step,
                             committed_step=committed_step, via_agent=node not in reachable_nodes)
    if committed_step is not None:
        return RestoreChoice(kind="storage", step=committed_step, committed_step=committed_step)
    return RestoreChoice(kind="none")
