"""A local spot cluster: Ray's own autoscaler launching and losing nodes on this machine.

    ray-checkfreq cluster up --local --dir /tmp/spot --max-workers 2
    eval "$(ray-checkfreq cluster env --dir /tmp/spot)"     # RAY_ADDRESS, the token, S3
    STORAGE_PATH=s3://rcf-spot/runs cluster/submit.sh --cpu --workers 1-2 ...
    ray-checkfreq cluster down --dir /tmp/spot

What ``up`` starts, every process with the cluster's marker (``RCF_SPOT_CLUSTER=<id>``) in
its environment or a file in its temp directory (``cluster_pids``), so that ``down`` stops
exactly these (never ``ray stop``, which stops every Ray on the machine):

- a Ray head with no resources for training, the Jobs API and dashboard on 127.0.0.1, and
  Ray's token authentication with a token file of the cluster's own;
- Ray's autoscaler (v1) with one worker type ``spot`` (min 0, max ``max_workers``), through
  ``SpotNodeProvider`` (``chaos/spot_provider.py``): nodes are local raylets that may vanish
  like spot VMs, each with a temp directory of its own (``node_temp_dir``) and the
  spot-notice watcher beside it;
- an S3 server (moto) with the bucket ``rcf-spot``, and the IMDSv2 stand-in
  (``chaos/imds.py``) the watchers read (``spot_services.py``).

``kill_node`` takes a node away without notice (its raylet, agents and workers, SIGKILL);
``announce`` gives one the EC2 notice.

Ray's agents and workers rename themselves (``ray::DashboardAgent``), which overwrites the
environment that /proc shows: the marker cannot be read there. Every process of a node has
its working directory or a file (its logs) in the node's temp directory, so that is how
``cluster_pids`` and ``kill_node`` find them.
"""

from __future__ import annotations

import json
import logging
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

logger = logging.getLogger("ray_checkfreq.chaos")

MARKER = "RCF_SPOT_CLUSTER"
BUCKET = "rcf-spot"
WORKER_TYPE = "spot"
STATE_FILE = "cluster.json"
OBJECT_STORE_BYTES = 256 << 20  # per node: Ray's default (30 % of RAM) for every local node would overcommit
WATCHER = Path(__file__).resolve().parents[2] / "cluster" / "spot_notice_watcher.sh"
# Dead-node detection as on a spot cluster (set on the head, where the GCS runs): Ray's
# defaults (a check every 3 s, 10 s timeout, 5 failures) take 15 s for a node whose raylet
# refuses connections and about 50 s for a VM that vanished (every check times out); Ray
# Train restarts only once the node is declared dead. Here: 5 s, and about 10 s for a VM.
NODE_DEATH_DETECTION = {"RAY_health_check_period_ms": "1000", "RAY_health_check_timeout_ms": "1000",
                        "RAY_health_check_failure_threshold": "5"}
# Loopback credentials for the local S3 server (moto accepts any).
S3_CREDENTIALS = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
                  "AWS_DEFAULT_REGION": "us-east-1", "AWS_REGION": "us-east-1"}


@dataclass(frozen=True, kw_only=True)
class SpotClusterConfig:
    """A local spot cluster's shape; units in the names."""

    directory: str
    """Where the cluster keeps its config, token, logs and state (created)."""
    max_workers: int = 2
    """Spot worker nodes the autoscaler may run at once."""
    cpus_per_node: int = 1
    """CPUs each spot node offers (one Ray Train worker each at 1 CPU per worker)."""
    idle_timeout_s: float = 15.0
    """Seconds an idle spot node stays before the autoscaler removes it."""
    start_timeout_s: float = 180.0
    """Seconds ``up`` waits for the services and the head (``ray start --head`` took over 60 s
    at a load average of 12, beside a test suite)."""

    def __post_init__(self) -> None:
        if not self.directory:
            raise ValueError("directory='': the cluster needs a directory of its own")
        if self.max_workers < 1:
            raise ValueError(f"max_workers={self.max_workers}: must be >= 1")
        if self.cpus_per_node < 1:
            raise ValueError(f"cpus_per_node={self.cpus_per_node}: must be >= 1")
        for name in ("idle_timeout_s", "start_timeout_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name}={getattr(self, name)!r}: must be > 0 seconds")


@dataclass(frozen=True, kw_only=True)
class SpotCluster:
    """A running local spot cluster: what clients need to reach it."""

    directory: str
    cluster_id: str
    gcs_address: str
    dashboard_url: str
    s3_endpoint: str
    imds_url: str
    token_path: str
    temp_dir: str

    def client_env(self) -> dict[str, str]:
        """The environment of a client: ``ray job submit``, a driver, boto3 or pyarrow on its S3."""
        return {"RAY_ADDRESS": self.dashboard_url, "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": self.token_path,
                "AWS_ENDPOINT_URL": self.s3_endpoint, **S3_CREDENTIALS}

    def save(self) -> None:
        Path(self.directory, STATE_FILE).write_text(json.dumps(asdict(self), indent=1) + "\n")

    @classmethod
    def load(cls, directory: str) -> SpotCluster:
        path = Path(directory, STATE_FILE)
        try:
            return cls(**json.loads(path.read_text()))
        except FileNotFoundError:
            raise FileNotFoundError(f"{path}: no local spot cluster was started with this directory") from None


class HeadStartError(RuntimeError):
    """``ray start --head`` failed (on a loaded machine Ray's own 30 s wait for its raylet can end it)."""


def up(config: SpotClusterConfig) -> SpotCluster:
    """Start the cluster of the module docstring; ``down`` stops it (also when ``up`` fails).
    A head that fails to start is started once more, on new ports, after ``down``."""
    try:
        return _up_once(config)
    except HeadStartError as err:
        logger.warning("the head did not start (%s); once more", err)
        return _up_once(config)


def _up_once(config: SpotClusterConfig) -> SpotCluster:
    directory = Path(config.directory).resolve()
    directory.mkdir(parents=True, exist_ok=True)
    if (directory / STATE_FILE).exists():
        raise FileExistsError(f"{directory / STATE_FILE}: a cluster was started here; `down` it first")
    cluster_id = secrets.token_hex(4)
    gcs_port, dashboard_port, agent_port, s3_port, imds_port = _free_ports(5)
    cluster = SpotCluster(directory=str(directory), cluster_id=cluster_id, gcs_address=f"127.0.0.1:{gcs_port}",
                          dashboard_url=f"http://127.0.0.1:{dashboard_port}", s3_endpoint=f"http://127.0.0.1:{s3_port}",
                          imds_url=f"http://127.0.0.1:{imds_port}", token_path=str(directory / "auth_token"),
                          temp_dir=f"/tmp/rcf-spot-{cluster_id}")  # short: Ray's socket paths must fit
    _write_token(Path(cluster.token_path))
    cluster.save()
    # Every node, job entrypoint and watcher runs this Python (its `python` and `ray` first on PATH).
    path = os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")])
    env = {**os.environ, **cluster.client_env(), MARKER: cluster_id, "RAY_FAKE_CLUSTER": "1",
           "AUTOSCALER_UPDATE_INTERVAL_S": "1", "PATH": path, **NODE_DEATH_DETECTION}
    env.pop("RAY_ADDRESS")  # the head's own `ray start` must not join another cluster
    # Ray's state API client inside the cluster (Ray Train's PlacementGroupCleaner) otherwise
    # guesses the cluster from the raylets on this machine and fails where there are several.
    env["RAY_API_SERVER_ADDRESS"] = cluster.dashboard_url
    try:
        _start_services(cluster, env, s3_port=s3_port, imds_port=imds_port, timeout_s=config.start_timeout_s)
        autoscaling = directory / "autoscaling.json"
        autoscaling.write_text(json.dumps(autoscaling_config(cluster, config), indent=1) + "\n")
        try:
            _run([sys.executable, "-m", "ray.scripts.scripts", "start", "--head", f"--port={gcs_port}",
                  "--node-ip-address=127.0.0.1", "--num-cpus=0", "--num-gpus=0", "--include-dashboard=true",
                  f"--object-store-memory={OBJECT_STORE_BYTES}",
                  "--dashboard-host=127.0.0.1", f"--dashboard-port={dashboard_port}",
                  f"--dashboard-agent-listen-port={agent_port}", f"--temp-dir={cluster.temp_dir}",
                  f"--autoscaling-config={autoscaling}", "--disable-usage-stats"],
                 env=env, log=directory / "ray-start.log", timeout_s=config.start_timeout_s)
        except (RuntimeError, subprocess.TimeoutExpired) as err:
            raise HeadStartError(str(err)) from err
    except BaseException:
        down(str(directory))
        raise
    return cluster


def autoscaling_config(cluster: SpotCluster, config: SpotClusterConfig) -> dict[str, Any]:
    """The autoscaler's cluster config: the launcher's schema, a head without resources for
    training and one spot worker type, through ``SpotNodeProvider``."""
    return {
        "cluster_name": f"rcf-spot-{cluster.cluster_id}",
        "max_workers": config.max_workers,
        "upscaling_speed": 1.0,
        "idle_timeout_minutes": config.idle_timeout_s / 60,
        "provider": {"type": "external", "module": "ray_checkfreq.chaos.spot_provider.SpotNodeProvider",
                     "gcs_address": cluster.gcs_address, "use_node_id_as_ip": True,
                     "disable_node_updaters": True, "disable_launch_config_check": True, "launch_multiple": True,
                     "watcher": str(WATCHER), "imds_url": cluster.imds_url, "log_dir": cluster.directory,
                     "temp_root": cluster.temp_dir},
        "available_node_types": {
            "ray.head.default": {"resources": {"CPU": 0}, "node_config": {}, "max_workers": 0},
            WORKER_TYPE: {"resources": {"CPU": config.cpus_per_node, WORKER_TYPE: 1,
                                        "object_store_memory": OBJECT_STORE_BYTES}, "node_config": {},
                          "min_workers": 0, "max_workers": config.max_workers},
        },
        "head_node_type": "ray.head.default",
        "auth": {}, "head_node": {}, "worker_nodes": {}, "file_mounts": {}, "cluster_synced_files": [],
        "file_mounts_sync_continuously": False, "rsync_exclude": [], "rsync_filter": [],
        "initialization_commands": [], "setup_commands": [], "head_setup_commands": [],
        "worker_setup_commands": [], "head_start_ray_commands": [], "worker_start_ray_commands": [],
    }


def down(directory: str, *, grace_s: float = 5.0) -> list[int]:
    """Stop every process of the cluster started in ``directory`` (``cluster_pids``), remove
    its temporary directory, the RAM slot files its killed node agents left, and its state
    file; returns the pids it stopped."""
    from ray_checkfreq.ray.names import SLOT_PREFIX
    from ray_checkfreq.ray.slots import sweep_leftovers

    cluster = SpotCluster.load(directory)
    pids = cluster_pids(cluster)
    signal_all(pids, signal.SIGTERM)
    _wait_gone(pids, grace_s)
    left = cluster_pids(cluster)  # and any started meanwhile
    signal_all(left, signal.SIGKILL)
    _wait_gone(left, grace_s)
    shutil.rmtree(cluster.temp_dir, ignore_errors=True)
    # Every node shares this machine's /dev/shm (a VM's would go with it).
    sweep_leftovers("/dev/shm", SLOT_PREFIX)
    Path(directory, STATE_FILE).unlink(missing_ok=True)
    return sorted(set(pids) | set(left))


def kill_node(cluster: SpotCluster, node_id: str) -> list[int]:
    """A spot VM reclaimed without notice: SIGKILL the node's raylet, agents and workers (they
    carry its id, or have files in its temp directory, or Ray lists them on it); returns the pids."""
    workers = {int(w["pid"]) for w in state_api(cluster, "workers") if w.get("node_id") == node_id and w.get("pid")}
    pids = sorted(workers | set(_pids_with("RAY_OVERRIDE_NODE_ID_FOR_TESTING", node_id))
                  | set(pids_using(node_temp_dir(cluster.temp_dir, node_id))))
    signal_all(pids, signal.SIGKILL)
    return pids


def node_temp_dir(temp_root: str, node_id: str) -> str:
    """A spot node's own temp directory, inside the cluster's (short: Ray's socket paths must fit)."""
    return os.path.join(temp_root, f"node-{node_id[-5:]}")


def spot_nodes(cluster: SpotCluster) -> list[str]:
    """The spot nodes Ray lists as alive."""
    return [n["node_id"] for n in state_api(cluster, "nodes") if n["state"] == "ALIVE"
            and WORKER_TYPE in n["resources_total"]]


def state_api(cluster: SpotCluster, resource: str) -> list[dict]:
    """Ray's state API (``/api/v0/<resource>``) through the dashboard, with the cluster's token:
    a process that is not a client of this cluster (a test, the harness) reads it without
    joining it."""
    import urllib.request

    request = urllib.request.Request(f"{cluster.dashboard_url}/api/v0/{resource}?limit=10000",
                                     headers={"Authorization": f"Bearer {Path(cluster.token_path).read_text()}"})
    return list(json.loads(urllib.request.urlopen(request, timeout=30).read())["data"]["result"]["result"])


def announce(cluster: SpotCluster, node_id: str, *, notice_s: float) -> float:
    """EC2's interruption notice for ``node_id``, ``notice_s`` from now; returns the deadline."""
    from ray_checkfreq.chaos.imds import announce_over_http

    deadline = time.time() + notice_s
    announce_over_http(cluster.imds_url, node_id, deadline_epoch_s=deadline)
    return deadline


def marked_pids(cluster_id: str) -> list[int]:
    """The processes with this cluster's marker in their environment."""
    return [pid for pid in _pids_with(MARKER, cluster_id) if pid != os.getpid()]


def cluster_pids(cluster: SpotCluster) -> list[int]:
    """Every process of the cluster: those with its marker in their environment or a file in
    its temp directory (every node's is inside it), and their descendants; never this
    process or one of its ancestors."""
    parents = _parents()
    found = set(marked_pids(cluster.cluster_id)) | set(pids_using(cluster.temp_dir))
    found |= {pid for pid in parents if _ancestors(pid, parents) & found}
    return sorted(found - _ancestors(os.getpid(), parents) - {os.getpid()})


def pids_using(path: str) -> list[int]:
    """The processes (not this one) whose working directory or an open file is ``path`` or under it."""
    root = os.path.realpath(path)
    inside = root.rstrip("/") + "/"
    return [pid for pid in _all_pids() if pid != os.getpid()
            and any(link == root or link.startswith(inside) for link in _links(pid))]


def signal_all(pids: list[int], sig: signal.Signals) -> None:
    for pid in pids:
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass


# ------------------------------------------------------------------ internals
def _all_pids() -> list[int]:
    return [int(entry) for entry in os.listdir("/proc") if entry.isdigit()]


def _pids_with(name: str, value: str) -> list[int]:
    wanted = f"{name}={value}".encode()
    found = []
    for pid in _all_pids():
        try:
            environ = Path("/proc", str(pid), "environ").read_bytes()
        except OSError:  # gone, or not ours to read
            continue
        if wanted in environ.split(b"\0"):
            found.append(pid)
    return found


def _links(pid: int) -> list[str]:
    """The working directory and open files of ``pid`` (what it lets us read of them)."""
    base = f"/proc/{pid}"
    try:
        names = ["cwd", *(f"fd/{fd}" for fd in os.listdir(f"{base}/fd"))]
    except OSError:  # gone, or not ours to read
        return []
    links = []
    for name in names:
        try:
            links.append(os.readlink(f"{base}/{name}"))
        except OSError:  # closed meanwhile
            continue
    return links


def _parents() -> dict[int, int]:
    """{pid: parent pid} of every process."""
    parents = {}
    for pid in _all_pids():
        try:
            stat = Path("/proc", str(pid), "stat").read_text()
        except OSError:
            continue
        parents[pid] = int(stat.rsplit(")", 1)[1].split()[1])  # after the name, which may hold spaces
    return parents


def _ancestors(pid: int, parents: dict[int, int]) -> set[int]:
    found: set[int] = set()
    while (pid := parents.get(pid, 0)) > 1 and pid not in found:
        found.add(pid)
    return found


def _wait_gone(pids: list[int], timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and any(_alive(pid) for pid in pids):
        time.sleep(0.2)


def _alive(pid: int) -> bool:
    """Running, not a zombie (a stopped child of ours that nobody reaped yet)."""
    try:
        return "zombie" not in Path("/proc", str(pid), "status").read_text()
    except OSError:
        return False


def _free_ports(count: int) -> list[int]:
    sockets = [socket.socket() for _ in range(count)]
    try:
        for sock in sockets:
            sock.bind(("127.0.0.1", 0))
        return [sock.getsockname()[1] for sock in sockets]
    finally:
        for sock in sockets:
            sock.close()


def _write_token(path: Path) -> None:
    descriptor = os.open(path, os.O_CREAT | os.O_WRONLY | os.O_TRUNC, 0o600)
    with os.fdopen(descriptor, "w") as out:
        out.write(secrets.token_hex(32))


def _start_services(cluster: SpotCluster, env: dict[str, str], *, s3_port: int, imds_port: int,
                    timeout_s: float) -> None:
    ready = Path(cluster.directory, "services.ready")
    ready.unlink(missing_ok=True)
    log = open(Path(cluster.directory, "services.log"), "ab")
    service = subprocess.Popen([sys.executable, "-m", "ray_checkfreq.chaos.spot_services", "--s3-port", str(s3_port),
                                "--imds-port", str(imds_port), "--bucket", BUCKET, "--ready", str(ready)],
                               env=env, stdout=log, stderr=log, start_new_session=True)
    deadline = time.monotonic() + timeout_s
    while not ready.exists():
        if service.poll() is not None:
            raise RuntimeError(f"the S3 and metadata services exited ({service.returncode}): "
                               f"see {cluster.directory}/services.log")
        if time.monotonic() > deadline:
            raise TimeoutError(f"the S3 and metadata services did not start in {timeout_s} s")
        time.sleep(0.1)


def _run(command: list[str], *, env: dict[str, str], log: Path, timeout_s: float) -> None:
    with open(log, "ab") as out:
        done = subprocess.run(command, env=env, stdout=out, stderr=out, timeout=timeout_s, start_new_session=True)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(command[:5])} ... failed ({done.returncode}): see {log}")
