"""``ray-checkfreq cluster``: a local spot cluster to rehearse on (``spot_cluster.py``)."""

from __future__ import annotations

import argparse
import shlex
import time
from typing import Any

from ray_checkfreq.chaos.spot_cluster import (
    SpotCluster,
    SpotClusterConfig,
    announce,
    down,
    kill_node,
    spot_nodes,
    up,
)


def add_parser(sub: Any) -> argparse.ArgumentParser:
    parser = sub.add_parser("cluster",
                            help="a local spot cluster: Ray's autoscaler, S3 and spot notices on this machine")
    actions = parser.add_subparsers(dest="action", required=True)
    start = actions.add_parser("up", help="start it (prints the environment its clients need)")
    start.add_argument("--local", action="store_true", required=True,
                       help="on this machine (the only kind: a cloud cluster is `ray up cluster/aws-spot-gpu.yaml`)")
    start.add_argument("--dir", required=True, help="the cluster's own directory (config, token, logs)")
    start.add_argument("--max-workers", type=int, default=SpotClusterConfig.max_workers)
    start.add_argument("--cpus-per-node", type=int, default=SpotClusterConfig.cpus_per_node)
    start.add_argument("--idle-timeout-s", type=float, default=SpotClusterConfig.idle_timeout_s)
    start.set_defaults(func=_up)
    env = actions.add_parser("env", help="print `export ...` lines for its clients (ray job submit, boto3)")
    env.add_argument("--dir", required=True)
    env.set_defaults(func=_env)
    preempt = actions.add_parser("preempt", help="take a spot node away, with EC2's notice first or without")
    preempt.add_argument("--dir", required=True)
    preempt.add_argument("--node", default=None, help="the spot node's id (default: the newest alive)")
    preempt.add_argument("--notice-s", type=float, default=None,
                         help="announce the interruption this many seconds ahead (EC2: 120), then kill the node "
                              "at the deadline; without it the node is killed now")
    preempt.set_defaults(func=_preempt)
    stop = actions.add_parser("down", help="stop every process of the cluster, its nodes' agents included "
                                           "(never `ray stop`)")
    stop.add_argument("--dir", required=True)
    stop.set_defaults(func=_down)
    return parser


def _exports(cluster: SpotCluster) -> str:
    return "\n".join(f"export {name}={shlex.quote(value)}" for name, value in cluster.client_env().items())


def _up(args: argparse.Namespace) -> int:
    cluster = up(SpotClusterConfig(directory=args.dir, max_workers=args.max_workers,
                                   cpus_per_node=args.cpus_per_node, idle_timeout_s=args.idle_timeout_s))
    print(f"# local spot cluster {cluster.cluster_id}: dashboard {cluster.dashboard_url}, S3 {cluster.s3_endpoint} "
          f"(bucket rcf-spot), GCS {cluster.gcs_address}")
    print(_exports(cluster))
    return 0


def _env(args: argparse.Namespace) -> int:
    print(_exports(SpotCluster.load(args.dir)))
    return 0


def _down(args: argparse.Namespace) -> int:
    stopped = down(args.dir)
    print(f"stopped {len(stopped)} processes")
    return 0


def _preempt(args: argparse.Namespace) -> int:
    cluster = SpotCluster.load(args.dir)
    alive = spot_nodes(cluster)
    if args.node is not None and args.node not in alive:
        raise SystemExit(f"--node {args.node}: not an alive spot node of this cluster (alive: {alive or 'none'})")
    if not alive:
        raise SystemExit("no spot node is alive: submit a job first")
    if args.notice_s is not None and not args.notice_s >= 0:
        raise SystemExit(f"--notice-s {args.notice_s}: must be >= 0 seconds")
    node = args.node or alive[-1]
    if args.notice_s is not None:
        deadline = announce(cluster, node, notice_s=args.notice_s)
        print(f"node {node}: interruption notice, deadline in {args.notice_s:g} s", flush=True)
        time.sleep(max(0.0, deadline - time.time()))
    killed = kill_node(cluster, node)
    print(f"node {node}: {len(killed)} processes killed (SIGKILL)")
    return 0
