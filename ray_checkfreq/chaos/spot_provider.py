"""The node provider of the local spot cluster: Ray's fake multi-node provider, with spot VMs.

Ray's autoscaler (v1) loads it by name from the cluster config
(``provider: {type: external, module: ray_checkfreq.chaos.spot_provider.SpotNodeProvider}``)
in its monitor process. Two differences from the stock provider:

- A node whose raylet died is reported terminated, as a cloud reports a reclaimed VM, so the
  autoscaler launches a replacement (the stock provider keeps listing it, and the autoscaler
  waits on it for good).
- Each node it launches gets ``cluster/spot_notice_watcher.sh`` running beside it, as the
  launcher config's ``worker_start_ray_commands`` start it on EC2, reading the IMDSv2
  stand-in (``chaos/imds.py``) at the node's own address.

Provider config keys of ours: ``watcher`` (the script's path; none: no watchers) and
``imds_url`` (the stand-in's http://host:port).
"""

from __future__ import annotations

import os
import subprocess
from typing import Any

from ray.autoscaler._private.fake_multi_node.node_provider import FakeMultiNodeProvider


class SpotNodeProvider(FakeMultiNodeProvider):
    def __init__(self, provider_config: dict[str, Any], cluster_name: str) -> None:
        super().__init__(provider_config, cluster_name)
        self._watchers: dict[str, subprocess.Popen] = {}

    def non_terminated_nodes(self, tag_filters: dict[str, str]) -> list[str]:
        with self.lock:
            for node_id in [n for n, entry in self._nodes.items() if _reclaimed(entry)]:
                self._forget(node_id)
        return super().non_terminated_nodes(tag_filters)

    def _create_node_with_resources_and_labels(self, node_config: Any, tags: Any, count: int, resources: Any,
                                               labels: Any) -> None:
        with self.lock:
            before = set(self._nodes)
            super()._create_node_with_resources_and_labels(node_config, tags, count, resources, labels)
            for node_id in set(self._nodes) - before:
                self._start_watcher(node_id)

    def terminate_node(self, node_id: str) -> None:
        with self.lock:
            self._stop_watcher(node_id)
            super().terminate_node(node_id)

    def _forget(self, node_id: str) -> None:
        """A reclaimed node: whatever is left of it goes, and it is no longer listed."""
        node: Any = self._nodes.pop(node_id)["node"]
        self._stop_watcher(node_id)
        node.kill_all_processes(check_alive=False, allow_graceful=False)

    def _start_watcher(self, node_id: str) -> None:
        script, imds = self.provider_config.get("watcher"), self.provider_config.get("imds_url")
        if not script or not imds:
            return
        env = {**os.environ, "RCF_IMDS_URL": f"{imds}/node/{node_id}", "RCF_NODE_ID": node_id,
               "RCF_GCS_ADDRESS": self._gcs_address or "127.0.0.1:6379", "RCF_NOTICE_POLL_S": "0.5"}
        with open(os.path.join(self.provider_config["log_dir"], f"watcher-{node_id[-5:]}.log"), "ab") as log:
            self._watchers[node_id] = subprocess.Popen(["bash", script], env=env, stdout=log, stderr=log,
                                                       start_new_session=True)

    def _stop_watcher(self, node_id: str) -> None:
        watcher = self._watchers.pop(node_id, None)
        if watcher is not None and watcher.poll() is None:
            watcher.kill()


def _reclaimed(entry: dict) -> bool:
    """A worker node whose raylet is gone (the head has no ``node`` entry)."""
    node = entry.get("node")
    if node is None:
        return False
    return any(kind == "raylet" for kind, _ in node.dead_processes())
