"""CheckpointStore on a real S3-protocol server (moto) on 127.0.0.1, via boto3 and pyarrow."""

from __future__ import annotations

import contextlib
from urllib.parse import urlparse

import boto3
import pytest
import torch
from faultproxy import FaultProxy
from state_strategies import assert_same_state

from ray_checkfreq import CheckpointStore, S3Options, StorageError

pytestmark = pytest.mark.s3
MiB = 1024 * 1024


def _objects(endpoint: str, bucket: str) -> list[str]:
    client = boto3.client("s3", endpoint_url=endpoint)
    return [o["Key"] for o in client.list_objects_v2(Bucket=bucket).get("Contents", [])]


def _drifted(step: int) -> dict:
    """One state, its weights a little changed each step: its saves are deltas (of unrelated
    values a chunk is stored full)."""
    state = _state(0)
    state["model"]["w"] = state["model"]["w"] + 1e-6 * step
    return state


def _state(seed: int, numel: int = 1000) -> dict:
    generator = torch.Generator().manual_seed(seed)
    return {
        "model": {"w": torch.randn(numel, generator=generator), "b": torch.randn(7, generator=generator).bfloat16()},
        "optimizer": {"state": {0: {"step": torch.tensor(3.0)}}, "param_groups": [{"lr": 0.1, "betas": (0.9, 0.99)}]},
        "iterator": {"epoch": 2, "consumed": 512},
    }


def test_round_trip_retention_and_listing_over_s3(s3_server, s3_bucket):
    store = CheckpointStore(f"s3://{s3_bucket}/run1", keep_last=2)
    for step in (10, 20, 30):
        store.save(step, _state(step), epoch_boundary=(step == 10), meta={"loss": step / 10})
    assert [r.step for r in store.list()] == [10, 20, 30]
    assert store.latest().uri.startswith(f"s3://{s3_bucket}/run1/step-000000000030-")
    assert_same_state(_state(30), store.load())
    assert_same_state(_state(20), store.load(20))
    assert store.list()[0].meta == {"loss": 1.0}


def test_multipart_upload_of_a_checkpoint_larger_than_the_threshold(s3_server, s3_bucket):
    port = urlparse(s3_server).port
    with FaultProxy(port) as proxy:
        options = S3Options(endpoint_url=proxy.url, multipart_threshold_bytes=5 * MiB,
                            multipart_chunksize_bytes=5 * MiB)
        store = CheckpointStore(f"s3://{s3_bucket}/big", s3=options, shard_size_bytes=64 * MiB, codec="raw")
        state = _state(1, numel=3 * MiB)  # 12 MiB of float32 in one shard
        store.save(1, state)
        uploads = [p for m, p in proxy.requests if m == "PUT" and "uploadId=" in p and ".bin" in p]
        assert len(uploads) >= 3, "the shard went up in at least three parts"
        assert_same_state(state, store.load())


def _shard_put(method: str, path: str) -> bool:
    return method == "PUT" and ".bin" in path  # a data file


def test_server_errors_and_dropped_connections_are_retried(s3_server, s3_bucket):
    with FaultProxy(urlparse(s3_server).port) as proxy:
        proxy.add_rule(_shard_put, "500", times=2)
        proxy.add_rule(lambda m, p: m == "PUT" and "manifest.json" in p, "drop", times=1)
        proxy.add_rule(lambda m, p: m == "GET" and ".bin" in p, "503", times=1)
        proxy.add_rule(lambda m, p: m == "GET" and ".bin" in p, "drop", times=1)
        store = CheckpointStore(f"s3://{s3_bucket}/flaky", s3=S3Options(endpoint_url=proxy.url))
        store.save(5, _state(5))
        assert_same_state(_state(5), store.load())
        assert {action for _, _, action in proxy.injected} == {"500", "drop", "503"}
        assert len(proxy.injected) == 5


@pytest.mark.parametrize("failing", ["shard", "manifest"])
def test_a_save_that_keeps_failing_leaves_no_manifest_and_the_last_checkpoint(s3_server, s3_bucket, failing):
    with FaultProxy(urlparse(s3_server).port) as proxy:
        store = CheckpointStore(f"s3://{s3_bucket}/broken", s3=S3Options(endpoint_url=proxy.url, max_attempts=3))
        store.save(1, _state(1))
        marker = ".bin" if failing == "shard" else "manifest.json"
        proxy.add_rule(lambda m, p: m == "PUT" and marker in p and "step-000000000002" in p, "500", times=10**6)
        with pytest.raises(StorageError, match="InternalError") as info:
            store.save(2, _state(2))
        assert "step-000000000002" in str(info.value)
        keys = _objects(s3_server, s3_bucket)
        assert not [k for k in keys if "step-000000000002" in k and k.endswith("manifest.json")]
        assert store.latest().step == 1
        assert_same_state(_state(1), store.load())


def test_a_missing_bucket_is_named_and_nothing_is_written(s3_server):
    store = CheckpointStore("s3://no-such-bucket-here/run")
    with pytest.raises(StorageError, match="bucket does not exist") as info:
        store.save(1, _state(1))
    assert "s3://no-such-bucket-here" in str(info.value)
    with pytest.raises(StorageError, match="bucket does not exist"):
        store.latest()


@contextlib.contextmanager
def _moto_checks_credentials():
    from moto import settings

    previous = settings.INITIAL_NO_AUTH_ACTION_COUNT
    settings.INITIAL_NO_AUTH_ACTION_COUNT = 0
    try:
        yield
    finally:
        settings.INITIAL_NO_AUTH_ACTION_COUNT = previous


def test_wrong_credentials_are_reported_as_such(s3_server, s3_bucket, monkeypatch):
    store = CheckpointStore(f"s3://{s3_bucket}/creds")
    store.save(1, _state(1))
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "AKIAWRONGWRONGWRONG1")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "not-the-secret")
    with _moto_checks_credentials():
        intruder = CheckpointStore(f"s3://{s3_bucket}/creds")
        with pytest.raises(StorageError, match="credentials rejected"):
            intruder.save(2, _state(2))
    monkeypatch.undo()
    assert [r.step for r in store.list()] == [1]


def test_pyarrow_s3_filesystem_reads_and_writes_the_same_format(s3_server, s3_bucket):
    from pyarrow import fs as pafs

    filesystem = pafs.S3FileSystem(
        endpoint_override=urlparse(s3_server).netloc, scheme="http", access_key="testing",
        secret_key="testing", region="us-east-1",
    )
    via_arrow = CheckpointStore(f"{s3_bucket}/shared", filesystem=filesystem)
    via_arrow.save(1, _state(1))
    via_boto = CheckpointStore(f"s3://{s3_bucket}/shared")
    assert [r.step for r in via_boto.list()] == [1]
    assert_same_state(_state(1), via_boto.load())
    via_boto.save(2, _state(2))
    assert via_arrow.latest().step == 2
    assert_same_state(_state(2), via_arrow.load())
    assert not [k for k in _objects(s3_server, s3_bucket) if k.endswith(".tmp")]


def test_a_save_lists_the_prefix_a_fixed_number_of_times_however_many_checkpoints_are_kept(s3_server, s3_bucket):
    with FaultProxy(urlparse(s3_server).port) as proxy:
        store = CheckpointStore(f"s3://{s3_bucket}/lists", keep_last=6, s3=S3Options(endpoint_url=proxy.url))
        for step in range(7):
            store.save(step, _drifted(step))
        before = len(proxy.requests)
        store.save(7, _drifted(7))
        requests = proxy.requests[before:]
    lists = [path for method, path in requests if method == "GET" and "list-type=2" in path]
    manifest_reads = [path for method, path in requests if "manifest.json" in path and method in ("GET", "HEAD")]
    # a scan before the save and one after the commit, the writer markers (before the part manifest,
    # before and after the create), the new directory and its delta base's (before the create), one
    # removal (its files, then what is left of the prefix)
    assert len(lists) <= 9, lists
    # retention: one GET per committed manifest (7 kept + the new one), no HEAD; and the delta base's
    # twice (is it there, before the part is written; still committed, before the create)
    assert len(manifest_reads) == 10
