"""The node provider of the local spot cluster: Ray's fake multi-node provider, with spot VMs.

Ray's autoscaler (v1) loads it by name from the cluster config
(``provider: {type: external, module: ray_checkfreq.chaos.spot_provider.SpotNodeProvider}``)
in its monitor process. Three differences from the stock provider:

- Each node has a temp directory of its own (``node_temp_dir``: its session directory, logs,
  sockets, runtime environments), as each VM has its own disk. The stock provider gives
  every node the head's: then every node's log monitor tails every node's worker logs (a
  job's log shows each line once per node), and one node's runtime-env agent deletes and
  unpacks a job's working directory again under another node's workers (a worker whose
  working directory was deleted dies at ``import torch``: "Intel oneMKL FATAL ERROR:
  Cannot load libtorch_cpu.so").

- A node whose raylet died is reported terminated, as a cloud reports a reclaimed VM, so the
  autoscaler launches a replacement (the stock provider keeps listing it, and the autoscaler
  waits on it for good).
- Each node it launches gets ``cluster/spot_notice_watcher.sh`` running beside it, as the
  launcher config's ``worker_start_ray_commands`` start it on EC2, reading the IMDSv2
  stand-in (``chaos/imds.py``) at the node's own address.

Provider config keys of ours: ``watcher`` (the script's path; none: no watchers),
``imds_url`` (the stand-in's http://host:port) and ``temp_root`` (the cluster's temp
directory, where each node's own goes).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
from typing import Any

from ray.autoscaler._private.fake_multi_node.node_provider import FakeMultiNodeProvider
from ray.autoscaler.tags import (
    NODE_KIND_WORKER,
    STATUS_UP_TO_DATE,
    TAG_RAY_NODE_KIND,
    TAG_RAY_NODE_NAME,
    TAG_RAY_NODE_STATUS,
    TAG_RAY_USER_NODE_TYPE,
)

from ray_checkfreq.chaos.spot_cluster import node_temp_dir, pids_using, signal_all


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
        import ray._private.node

        with self.lock:
            node_id = self._next_hex_node_id()
            node_type = tags[TAG_RAY_USER_NODE_TYPE]
            node = ray._private.node.Node(node_params(self.provider_config, node_id, node_type, resources, labels),
                                          head=False, shutdown_at_exit=False, spawn_reaper=False)
            entry: dict[str, Any] = {"node": node, "tags": {
                TAG_RAY_NODE_KIND: NODE_KIND_WORKER, TAG_RAY_USER_NODE_TYPE: node_type, TAG_RAY_NODE_NAME: node_id,
                TAG_RAY_NODE_STATUS: STATUS_UP_TO_DATE, **tags}}
            self._nodes[node_id] = entry
            self._start_watcher(node_id)

    def terminate_node(self, node_id: str) -> None:
        with self.lock:
            self._stop_watcher(node_id)
            super().terminate_node(node_id)
            self._kill_leftovers(node_id)

    def _forget(self, node_id: str) -> None:
        """A reclaimed node: whatever is left of it goes, and it is no longer listed."""
        node: Any = self._nodes.pop(node_id)["node"]
        self._stop_watcher(node_id)
        node.kill_all_processes(check_alive=False, allow_graceful=False)
        self._kill_leftovers(node_id)

    def _kill_leftovers(self, node_id: str) -> None:
        """The node's processes that Ray's ``Node`` did not start itself (its raylet's agents
        and workers) and that would outlive the raylet: they have files in its temp directory."""
        signal_all(pids_using(node_temp_dir(self.provider_config["temp_root"], node_id)), signal.SIGKILL)

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


def node_params(provider_config: dict[str, Any], node_id: str, node_type: str, resources: dict[str, Any],
                labels: dict[str, str]) -> Any:
    """The ``RayParams`` of a spot node: the stock provider's (any ports, the node id and
    resources in the environment Ray reads them from), with a temp directory of its own."""
    import ray._private.parameter
    import ray._private.ray_constants as ray_constants

    resources = dict(resources)
    gcs = provider_config["gcs_address"]
    return ray._private.parameter.RayParams(
        min_worker_port=0, max_worker_port=0, dashboard_port=None, dashboard_agent_listen_port=0,
        num_cpus=resources.pop("CPU", 0), num_gpus=resources.pop("GPU", 0),
        object_store_memory=resources.pop("object_store_memory", None), resources=resources, labels=labels,
        redis_address=gcs, gcs_address=gcs, temp_dir=node_temp_dir(provider_config["temp_root"], node_id),
        env_vars={"RAY_OVERRIDE_NODE_ID_FOR_TESTING": node_id, "RAY_CLOUD_INSTANCE_ID": node_id,
                  "RAY_NODE_TYPE_NAME": node_type,
                  ray_constants.RESOURCES_ENVIRONMENT_VARIABLE: json.dumps(resources),
                  ray_constants.LABELS_ENVIRONMENT_VARIABLE: json.dumps(labels)})


def _reclaimed(entry: dict) -> bool:
    """A worker node whose raylet is gone (the head has no ``node`` entry)."""
    node = entry.get("node")
    if node is None:
        return False
    return any(kind == "raylet" for kind, _ in node.dead_processes())
