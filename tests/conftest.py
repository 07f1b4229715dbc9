"""Shared fixtures (one Ray cluster and one loopback S3 server per test session) and the
test tiers (unit / integration / chaos / tooling: markers given by module, docs/testing.md)."""

from __future__ import annotations

import contextlib
import os
import socket
import uuid

import pytest


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


# Fast dead-node detection, so tests that remove a node see it within seconds; but not so
# fast that a raylet starved for ~2 s on a loaded 2-core machine is declared dead (it was).
FAST_HEALTH_CHECKS = {"health_check_period_ms": 500, "health_check_failure_threshold": 6,
                      "health_check_timeout_ms": 1000}
TRAIN_RESOURCE = "rcf_train"
RUN_TIMEOUT_S = 600  # a Ray Train run that hangs fails its test (chaos.harness.TrainJob.timeout_s), not CI
SESSION_TRAIN_NODES = 2  # Train runs use 2 workers
NODE_START_ATTEMPTS = 2
TRAIN_ENV = {
    "RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S": "30",
    "RAY_TRAIN_PREEMPTION_POLL_INTERVAL_S": "0.5",
    # The controller polls its workers this often: it sees an ended or dead worker sooner.
    "RAY_TRAIN_HEALTH_CHECK_INTERVAL_S": "0.5",
    "RAY_DEDUP_LOGS": "0",
}

# Set before any test imports Ray, so the driver and every process it starts inherit it.
# Tests send nothing beyond loopback (no usage report). And with usage stats on, Ray Data
# starts a driver thread ("data-usage-metrics-poller") that fails to reach Prometheus every
# 10 s and formats the traceback; Python 3.11 formats tracebacks with ast.parse, and two
# threads parsing at once can raise "SystemError: AST constructor recursion depth mismatch"
# (CPython gh-106905) in whatever the main thread parses: a test, or pytest's own report.
os.environ["RAY_USAGE_STATS_ENABLED"] = "0"

LOOPBACK_S3_CREDENTIALS = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
                           "AWS_DEFAULT_REGION": "us-east-1"}


def start_cluster(train_nodes: int):
    """A local multi-node Ray cluster (``ray.cluster_utils.Cluster``), the driver connected.

    The head (the driver's node, never removed) runs the Ray Data tests; Train workers run on
    ``train_nodes`` one-CPU nodes, all added now: adding nodes later in a run failed ("Failed
    to connect to GCS ... Failed to find the key"; not root-caused). Tests only remove them.
    """
    import ray
    from ray.cluster_utils import Cluster

    tests_dir = os.path.dirname(os.path.abspath(__file__))
    os.environ.update(TRAIN_ENV)
    # Raylets start with these, so workers and node agents can reach the loopback S3 server.
    for key, value in LOOPBACK_S3_CREDENTIALS.items():
        os.environ.setdefault(key, value)
    # Raylets (and so every worker) inherit this: workers import the tests' training jobs.
    if tests_dir not in os.environ.get("PYTHONPATH", "").split(os.pathsep):
        os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (tests_dir, os.environ.get("PYTHONPATH")) if p)
    for attempt in range(NODE_START_ATTEMPTS):
        cluster = Cluster()
        try:
            cluster.add_node(num_cpus=4, object_store_memory=400 << 20, _system_config=FAST_HEALTH_CHECKS,
                             include_dashboard=False)  # the head
            for _ in range(train_nodes):
                cluster.add_node(num_cpus=1, resources={TRAIN_RESOURCE: 1})
            cluster.wait_for_nodes()
        except Exception as err:
            # Ray waits a fixed 30 s for a new raylet (ray._private.node); a loaded 2-core
            # machine (the suite, its early children, Ray's own processes) ran past that.
            cluster.shutdown()
            if "timed out during startup" not in str(err) or attempt + 1 == NODE_START_ATTEMPTS:
                raise
            continue
        ray.init(address=cluster.address, log_to_driver=False, configure_logging=False)
        return cluster
    raise AssertionError("unreachable")


@contextlib.contextmanager
def own_cluster(train_nodes: int):
    """A cluster of a module's own (one that removes nodes: the session's stays whole).

    The driver leaves the session cluster while it runs (a process joins one cluster at a
    time) and joins it again after; Ray objects the driver made before are gone then, so
    session fixtures keep none (``small_ray_dataset`` is made once per driver connection).
    """
    import ray

    session = ray.get_runtime_context().gcs_address if ray.is_initialized() else None
    ray.shutdown()
    cluster = start_cluster(train_nodes)
    try:
        yield cluster
    finally:
        ray.shutdown()
        cluster.shutdown()
        if session is not None:
            ray.init(address=session, log_to_driver=False, configure_logging=False)


@pytest.fixture(scope="session")
def ray_cluster():
    """One local multi-node Ray cluster for the whole session, with ``SESSION_TRAIN_NODES``
    one-CPU nodes for Train workers that no test removes (a module that removes nodes uses
    ``own_cluster``)."""
    import ray

    cluster = start_cluster(SESSION_TRAIN_NODES)
    yield cluster
    ray.shutdown()
    cluster.shutdown()


@pytest.fixture(scope="session")
def ray_session(ray_cluster):
    """A Ray cluster shared by every test that needs one (the ``ray`` module, connected)."""
    import ray

    yield ray


@pytest.fixture(scope="session")
def s3_server():
    """moto's S3 server on 127.0.0.1; yields its endpoint URL."""
    from moto.server import ThreadedMotoServer

    port = _free_port()
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    endpoint = f"http://127.0.0.1:{port}"
    saved = {k: os.environ.get(k) for k in _S3_ENV}
    os.environ.update(
        AWS_ACCESS_KEY_ID="testing",
        AWS_SECRET_ACCESS_KEY="testing",
        AWS_DEFAULT_REGION="us-east-1",
        AWS_ENDPOINT_URL=endpoint,
    )
    try:
        yield endpoint
    finally:
        server.stop()
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


_S3_ENV = ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_DEFAULT_REGION", "AWS_ENDPOINT_URL")


@pytest.fixture
def s3_bucket(s3_server):
    """A fresh bucket on the loopback server; yields its name."""
    import boto3

    name = f"test-{uuid.uuid4().hex[:12]}"
    boto3.client("s3", endpoint_url=s3_server).create_bucket(Bucket=name)
    return name


# The tier of each test module (docs/testing.md): `pytest -m unit` and so on selects one.
# unit: the library in process (a few tests may spawn a child to SIGKILL it), seconds each;
# integration: real components (the session's Ray cluster, the loopback S3 server, the CLI
# and multi-process runs); chaos: faults injected into real runs (SIGKILLs, node loss,
# drain notices) and where the restart began; tooling: the repository around the library
# (docs, layers, benchmarks, examples, the demo, cluster configs, the mutation harness).
# A test marked `chaos` by itself (a long fault-injection run) is in the chaos tier wherever
# its module is, so the four tiers split the suite. tests/test_tiers.py checks every module is here.
TIERS = {
    "unit": (
        "test_checksum.py", "test_chunk_reader.py", "test_codec.py", "test_codec_huffman.py", "test_codec_integrity.py",
        "test_codec_layout.py", "test_data_core.py", "test_data_global_batch.py", "test_data_order.py",
        "test_data_quorum.py",
        "test_engine.py", "test_engine_between_steps.py", "test_engine_measured.py", "test_engine_planner.py",
        "test_engine_policy.py", "test_engine_profile.py", "test_engine_seams.py", "test_engine_state.py",
        "test_engine_with_data.py", "test_key_paths.py", "test_manifest.py", "test_nearlossless_codec.py",
        "test_nearlossless_store.py", "test_retention_plan.py", "test_sharded_chunks.py", "test_snapshot_copies.py",
        "test_store_direct.py", "test_store_local.py", "test_store_protected.py", "test_ray_agent.py",
        "test_ray_restart.py", "test_slots.py", "test_chaos_units.py", "test_shard_copies.py", "test_snapshot_plan.py",
        "test_canonical_json.py", "test_commit_protocol.py", "test_sharded_deltas.py", "test_legacy_formats.py",
        "test_chaos_trace.py", "test_spot_watcher.py", "test_spot_timeline.py", "test_notice_sim.py",
    ),
    "integration": (
        "test_cli.py", "test_nearlossless_export.py", "test_data_ray.py", "test_data_resume.py",
        "test_store_s3.py", "test_sharded_store.py", "test_sharded_export.py", "test_store_fencing.py",
        "test_hostile_store.py", "test_engine_sharded.py", "test_engine_sharded_policy.py",
        "test_sharded_restore_agreement.py",
        "test_shared_policy.py",
        "test_ray_registration.py", "test_inplace_unplaced_units.py",
        "test_backend_contract.py",
        "test_integration_transformers.py", "test_integration_lightning.py",
    ),
    "chaos": (
        "test_chaos_kill_loop.py", "test_chaos_run.py", "test_crash_consistency.py", "test_ray_policy.py",
        "test_ray_train.py", "test_ray_sharded.py", "test_chaos_sharded_kills.py", "test_ray_inplace.py",
        "test_ray_inplace_unplaced.py", "test_ray_inplace_notice.py", "test_commit_sim.py", "test_spot_cluster.py",
    ),
    "tooling": (
        "test_layers.py", "test_docs.py", "test_tiers.py", "test_benchmarks.py", "test_bench_all.py",
        "test_bench_ray.py", "test_bench_restore.py", "test_data_bench.py", "test_nearlossless_bench.py",
        "test_cluster_configs.py", "test_examples.py", "test_demo.py", "test_ray_demo.py",
        "test_resume_mutation.py", "test_bench_sharded.py", "test_goodput_sim.py", "test_goodput_replay.py",
    ),
}
TIER_OF = {module: tier for tier, modules in TIERS.items() for module in modules}


_SELECTED = pytest.StashKey[set]()
_config = None


def tier_of(item) -> str:
    if item.get_closest_marker("chaos") is not None:
        return "chaos"
    return TIER_OF.get(item.path.name, "unit")  # an unlisted module: tests/test_tiers.py fails


def pytest_collection_modifyitems(config, items):
    for item in items:
        item.add_marker(tier_of(item))
    # Tests that compare wall-clock times run first, on a machine the early children do not load yet.
    items.sort(key=lambda item: item.get_closest_marker("quiet") is None)


_quiet_left: set[str] = set()


def pytest_collection_finish(session):
    """The selected long tests with a child of their own start it now (tests/early_children.py),
    or once the ``quiet`` tests are done."""
    if session.config.option.collectonly:
        return
    _quiet_left.update(item.nodeid for item in session.items if item.get_closest_marker("quiet"))
    session.config.stash[_SELECTED] = {item.nodeid for item in session.items}
    if not _quiet_left:
        _start_early_children(session.config)


def pytest_runtest_logfinish(nodeid, location):
    if nodeid in _quiet_left:
        _quiet_left.discard(nodeid)
        if not _quiet_left:
            _start_early_children(_config)


def pytest_configure(config):
    global _config
    _config = config


def _start_early_children(config) -> None:
    import early_children

    early_children.start_selected(config.stash[_SELECTED])


def pytest_sessionfinish(session, exitstatus):
    import early_children

    early_children.stop_all()
