"""``cluster/spot_notice_watcher.sh`` against the IMDSv2 stand-in (``ray_checkfreq.chaos.imds``).

The watcher runs as on a spot node, with the stand-in's address for the node and a
``ray`` on its PATH that records the drain it is asked for (no cluster needed).
"""

from __future__ import annotations

import os
import shlex
import subprocess
import time
from pathlib import Path

import pytest

from ray_checkfreq.chaos.imds import NOTICE_PATH, TOKEN_PATH, MetadataService

WATCHER = Path(__file__).resolve().parent.parent / "cluster" / "spot_notice_watcher.sh"


@pytest.fixture
def imds():
    with MetadataService() as service:
        yield service


@pytest.fixture
def fake_ray(tmp_path) -> Path:
    """A ``ray`` command that appends its arguments to ``drains.txt``."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    script = bin_dir / "ray"
    script.write_text(f"#!/usr/bin/env bash\necho \"$@\" >> {shlex.quote(str(tmp_path / 'drains.txt'))}\n")
    script.chmod(0o755)
    return tmp_path


def start(imds_url: str, fake_ray: Path) -> subprocess.Popen:
    env = {**os.environ, "RCF_IMDS_URL": imds_url, "RCF_NODE_ID": "node-abc", "RCF_NOTICE_POLL_S": "0.1",
           "RCF_GCS_ADDRESS": "127.0.0.1:1", "PATH": f"{fake_ray / 'bin'}{os.pathsep}{os.environ['PATH']}"}
    return subprocess.Popen(["bash", str(WATCHER)], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)


def drains(fake_ray: Path) -> list[list[str]]:
    path = fake_ray / "drains.txt"
    return [line.split() for line in path.read_text().splitlines()] if path.exists() else []


def statuses(imds: MetadataService, path: str) -> list[int]:
    return [status for _, requested, status in imds.requests if requested.endswith(path)]


def wait_for(condition, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


def test_without_a_notice_it_keeps_polling_and_drains_nothing(imds, fake_ray):
    watcher = start(imds.base_url("a"), fake_ray)
    try:
        wait_for(lambda: statuses(imds, NOTICE_PATH).count(404) >= 5)
        assert watcher.poll() is None and drains(fake_ray) == []
    finally:
        watcher.kill()
        watcher.wait()
    assert statuses(imds, TOKEN_PATH) == [200]  # one token, reused while it is valid


def test_a_notice_drains_the_node_with_the_notices_deadline(imds, fake_ray):
    imds.announce("a", deadline_epoch_s=time.time() + 30)
    imds.announce("b", deadline_epoch_s=time.time() + 5)  # another node's notice is not this one's
    watcher = start(imds.base_url("a"), fake_ray)
    assert watcher.wait(timeout=20) == 0, watcher.stderr.read() if watcher.stderr else ""
    (drain,) = drains(fake_ray)
    assert drain[:1] == ["drain-node"] and drain[drain.index("--node-id") + 1] == "node-abc"
    assert drain[drain.index("--reason") + 1] == "DRAIN_NODE_REASON_PREEMPTION"
    assert 27 <= int(drain[drain.index("--deadline-remaining-seconds") + 1]) <= 30


def test_a_notice_past_its_time_drains_at_once(imds, fake_ray):
    imds.announce("a", deadline_epoch_s=time.time() - 60)
    watcher = start(imds.base_url("a"), fake_ray)
    assert watcher.wait(timeout=20) == 0
    (drain,) = drains(fake_ray)
    assert drain[drain.index("--deadline-remaining-seconds") + 1] == "0"


def test_an_expired_token_is_renewed_and_the_notice_still_seen(imds, fake_ray):
    watcher = start(imds.base_url("a"), fake_ray)
    try:
        wait_for(lambda: 404 in statuses(imds, NOTICE_PATH))
        imds.expire_tokens()
        wait_for(lambda: 401 in statuses(imds, NOTICE_PATH))
        imds.announce("a", deadline_epoch_s=time.time() + 20)
        assert watcher.wait(timeout=20) == 0
    finally:
        watcher.kill()
    assert statuses(imds, TOKEN_PATH) == [200, 200]  # the first token, and one after it expired
    assert statuses(imds, NOTICE_PATH)[-1] == 200 and len(drains(fake_ray)) == 1


def test_an_unreachable_metadata_service_fails_by_its_address(fake_ray):
    with MetadataService() as gone:
        url = gone.base_url("a")  # the port is closed once the service stops
    watcher = start(url, fake_ray)
    assert watcher.wait(timeout=20) == 1
    assert f"no instance metadata service at {url}/latest" in (watcher.stderr.read() if watcher.stderr else "")
    assert drains(fake_ray) == []


def test_the_stand_in_answers_as_imdsv2_does(imds):
    import urllib.error
    import urllib.request

    def call(method: str, path: str, headers: dict) -> int:
        request = urllib.request.Request(imds.base_url("a") + path, method=method, headers=headers)
        try:
            return urllib.request.urlopen(request, timeout=5).status
        except urllib.error.HTTPError as err:
            return err.code

    assert call("PUT", TOKEN_PATH, {}) == 400  # a token needs a TTL
    assert call("GET", NOTICE_PATH, {}) == 401  # and a notice a token
    assert call("GET", NOTICE_PATH, {"X-aws-ec2-metadata-token": "made-up"}) == 401
    with pytest.raises(ValueError, match="node='a/b'"):
        imds.announce("a/b", deadline_epoch_s=0)
