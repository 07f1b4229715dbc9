"""The listing contract of backends/listing.py, checked on every storage backend: POSIX,
pyarrow's local filesystem, boto3 S3 and pyarrow's S3 filesystem (both on loopback moto)."""

from __future__ import annotations

import os
import time
from urllib.parse import urlparse

import pytest
from pyarrow import fs as pafs

from ray_checkfreq import StorageError
from ray_checkfreq.storage.backends import posix
from ray_checkfreq.storage.backends.arrowfs import ArrowBackend
from ray_checkfreq.storage.backends.listing import STAGING_PREFIX, sizes_of, staging_name, store_dirs
from ray_checkfreq.storage.backends.posix import PosixBackend
from ray_checkfreq.storage.backends.s3 import S3Backend

FILES = {"empty": b"", "one": b"x", "several-thousand": bytes(range(256)) * 12}
SIZES = {name: len(data) for name, data in FILES.items()}
ALL_KINDS = [
    "posix",
    "arrow_local",
    pytest.param("s3", marks=pytest.mark.s3),
    pytest.param("arrow_s3", marks=pytest.mark.s3),
]
ARROW_KINDS = ["arrow_local", pytest.param("arrow_s3", marks=pytest.mark.s3)]


def _arrow_s3_filesystem(endpoint):
    return pafs.S3FileSystem(endpoint_override=urlparse(endpoint).netloc, scheme="http", access_key="testing",
                             secret_key="testing", region="us-east-1")


def _make_backend(kind, request, tmp_path):
    if kind == "posix":
        return PosixBackend(str(tmp_path))
    if kind == "arrow_local":
        return ArrowBackend(pafs.LocalFileSystem(), str(tmp_path))
    endpoint, bucket = request.getfixturevalue("s3_server"), request.getfixturevalue("s3_bucket")
    if kind == "s3":
        return S3Backend(f"s3://{bucket}/prefix")
    return ArrowBackend(_arrow_s3_filesystem(endpoint), f"{bucket}/prefix")


@pytest.fixture(params=ALL_KINDS)
def kind(request):
    return request.param


@pytest.fixture
def backend(kind, request, tmp_path):
    made = _make_backend(kind, request, tmp_path)
    yield made
    made.close()


@pytest.fixture(params=ARROW_KINDS)
def arrow_backend(request, tmp_path):
    return _make_backend(request.param, request, tmp_path)


def _fill(backend, rel_dir, files=FILES):
    backend.make_dir(rel_dir)
    for name, data in files.items():
        backend.write(f"{rel_dir}/{name}", [data] if data else [])


def _add_subdirectory(backend, rel_dir):
    backend.make_dir(f"{rel_dir}/sub")
    backend.write(f"{rel_dir}/sub/inner", [b"inner"])


# 1. list_files


def test_list_files_gives_every_file_at_its_exact_size_and_no_subdirectory(backend):
    _fill(backend, "d")
    _add_subdirectory(backend, "d")
    assert backend.list_files("d") == SIZES


def test_list_files_of_a_missing_directory_is_empty(backend):
    _fill(backend, "d")
    assert backend.list_files("missing") == {}


# 2. list_tree and list_dirs never show the staging area


def _write_through_every_path(backend, rel_dir):
    _fill(backend, rel_dir)
    backend.write_atomic(f"{rel_dir}/manifest.json", b"{}")
    assert backend.create_exclusive(f"{rel_dir}/marker", b"m")


def test_list_tree_maps_each_directory_to_its_files_and_never_shows_staging(backend):
    _write_through_every_path(backend, "a")
    _write_through_every_path(backend, "b")
    expected = {**SIZES, "manifest.json": 2, "marker": 1}
    assert backend.list_tree() == {"a": expected, "b": expected}
    assert sorted(backend.list_dirs()) == ["a", "b"]


def test_a_staged_leftover_is_never_listed_as_a_store_directory(backend):
    _fill(backend, "a")
    backend.write(staging_name(), [b"partial"])  # left at the root by a killed writer
    backend.make_dir(f"{STAGING_PREFIX}not-a-step")
    backend.write(f"{STAGING_PREFIX}not-a-step/x.tmp", [b"partial"])
    assert sorted(backend.list_dirs()) == ["a"]
    assert backend.list_tree() == {"a": SIZES}


def test_list_tree_agrees_with_list_dirs_and_list_files(backend):
    _fill(backend, "files")
    _add_subdirectory(backend, "only-a-subdirectory")
    assert backend.list_tree() == {name: backend.list_files(name) for name in backend.list_dirs()}
    assert backend.list_tree()["only-a-subdirectory"] == {}


@pytest.mark.s3
@pytest.mark.parametrize("kind", ["s3", "arrow_s3"])
def test_a_directory_marker_object_is_not_listed_as_a_file(backend, s3_server, s3_bucket):
    # pyarrow's S3FileSystem.create_dir leaves an empty object named "<dir>/"; a store that
    # pyarrow wrote is read through boto3 too (test_store_s3.py)
    import boto3

    _fill(backend, "d")
    boto3.client("s3", endpoint_url=s3_server).put_object(Bucket=s3_bucket, Key="prefix/d/", Body=b"")
    assert backend.list_files("d") == SIZES
    assert backend.list_tree() == {"d": SIZES}


# 3. exclusive creates and atomic writes leave only final names, at every moment


def _snapshot_inside_writes(kind, backend, monkeypatch, snapshot):
    """Call ``snapshot`` at the backend's intermediate steps: between staging and linking
    (POSIX: the directory fsyncs), before a move or an upload (pyarrow), before a PUT (S3)."""
    if kind == "posix":
        original = posix._fsync_dir
        monkeypatch.setattr(posix, "_fsync_dir", lambda path: (snapshot(), original(path)))
    elif kind == "s3":
        original_put = backend.client.put_object
        monkeypatch.setattr(backend.client, "put_object", lambda **kw: (snapshot(), original_put(**kw))[1])
    else:
        backend.fs = _Intercepted(backend.fs, {"move", "open_output_stream"}, snapshot)


class _Intercepted:
    """A filesystem that calls ``before`` ahead of the named methods and delegates all else."""

    def __init__(self, inner, names, before):
        self._inner, self._names, self._before = inner, names, before

    def __getattr__(self, name):
        attribute = getattr(self._inner, name)
        if name not in self._names:
            return attribute

        def intercepted(*args, **kwargs):
            self._before()
            return attribute(*args, **kwargs)
        return intercepted


def test_creates_and_atomic_writes_never_show_a_temporary_name_in_the_directory(kind, backend, monkeypatch):
    backend.make_dir("d")
    seen = []
    _snapshot_inside_writes(kind, backend, monkeypatch, lambda: seen.append(set(backend.list_files("d"))))
    assert backend.create_exclusive("d/marker", b"first")
    assert not backend.create_exclusive("d/marker", b"second")
    backend.write_atomic("d/manifest.json", b"{}")
    backend.write_atomic("d/manifest.json", b'{"v": 2}')
    final = {"marker", "manifest.json"}
    assert seen, "the snapshots ran inside the writes"
    assert all(names <= final for names in seen), seen
    assert backend.list_files("d") == {"marker": 5, "manifest.json": 8}
    assert bytes(backend.read_small("d/marker")) == b"first"


def test_create_exclusive_of_an_existing_name_is_false_and_leaves_its_content(backend):
    _fill(backend, "d")
    assert not backend.create_exclusive("d/one", b"other")
    assert bytes(backend.read_small("d/one")) == b"x"
    assert backend.list_files("d") == SIZES


# 4. stat_size


def test_stat_size_answers_the_size_or_none(backend):
    _fill(backend, "d")
    assert {name: backend.stat_size(f"d/{name}") for name in FILES} == SIZES
    assert backend.stat_size("d/missing") is None
    assert backend.stat_size("missing/file") is None


# 5. a file that vanishes is skipped, never the whole listing


def test_sizes_of_skips_a_name_that_vanished_and_keeps_the_rest():
    def size_of(name):
        if name == "gone":
            raise FileNotFoundError(name)
        return None if name == "a-directory" else len(name)

    assert sizes_of(["ab", "gone", "abcd", "a-directory"], size_of) == {"ab": 2, "abcd": 4}


def test_store_dirs_drops_only_staged_names():
    assert store_dirs(["a", staging_name(), "b", ".staging", "step-1"]) == ["a", "b", ".staging", "step-1"]


@pytest.mark.parametrize("victim", ["the entry being statted", "a later entry"])
def test_posix_listing_skips_a_file_unlinked_between_the_directory_read_and_its_stat(tmp_path, monkeypatch, victim):
    backend = PosixBackend(str(tmp_path))
    _fill(backend, "d")
    original = posix._file_size
    unlinked = []

    def file_size_racing_a_deleter(entry):
        if not unlinked:
            doomed = entry.name if victim == "the entry being statted" else _another(entry.name)
            os.unlink(tmp_path / "d" / doomed)
            unlinked.append(doomed)
        return original(entry)

    monkeypatch.setattr(posix, "_file_size", file_size_racing_a_deleter)
    listed = backend.list_files("d")
    assert unlinked and listed == {n: s for n, s in SIZES.items() if n != unlinked[0]}


def _another(name):
    return next(other for other in FILES if other != name)


def test_files_deleted_before_a_listing_are_absent_and_the_rest_listed(backend):
    _fill(backend, "d")
    backend.delete_file("d/one")
    assert backend.list_files("d") == {"empty": 0, "several-thousand": SIZES["several-thousand"]}
    assert backend.list_tree() == {"d": {"empty": 0, "several-thousand": SIZES["several-thousand"]}}


def test_files_deleted_after_a_listing_leave_it_as_it_was(backend):
    _fill(backend, "d")
    listed = backend.list_files("d")
    for name in FILES:
        backend.delete_file(f"d/{name}")
    assert listed == SIZES
    assert backend.list_files("d") == {}
    assert backend.stat_size("d/one") is None


class _VanishingEntries:
    """A filesystem whose directory listing fails (an entry vanished under pyarrow's
    per-entry stat) the first ``failures`` times, then delegates."""

    def __init__(self, inner, failures):
        self._inner, self.failures = inner, failures

    def get_file_info(self, what):
        if isinstance(what, pafs.FileSelector) and self.failures:
            self.failures -= 1
            raise FileNotFoundError("an entry vanished while listed")
        return self._inner.get_file_info(what)

    def __getattr__(self, name):
        return getattr(self._inner, name)


def test_arrow_listing_is_taken_again_when_an_entry_vanishes_under_it(arrow_backend):
    _fill(arrow_backend, "d")
    arrow_backend.fs = _VanishingEntries(arrow_backend.fs, failures=1)
    assert arrow_backend.list_files("d") == SIZES
    arrow_backend.fs.failures = 1
    assert arrow_backend.list_dirs() == ["d"]


def test_arrow_listing_whose_entries_keep_vanishing_fails_rather_than_answering_empty(arrow_backend):
    _fill(arrow_backend, "d")
    arrow_backend.fs = _VanishingEntries(arrow_backend.fs, failures=1000)
    with pytest.raises(StorageError, match="kept vanishing"):
        arrow_backend.list_files("d")


# 6. atomic_exclusive_create


def test_atomic_exclusive_create_is_true_only_where_the_create_is_one_conditional_step(kind, backend):
    expected = {"posix": True, "s3": True, "arrow_local": False, "arrow_s3": False}[kind]
    assert backend.atomic_exclusive_create is expected


# 7. clean_staging


def _staged_leftover(tmp_path, name, age_s):
    leftover = tmp_path / f"{STAGING_PREFIX}{name}"
    leftover.write_bytes(b"partial")
    then = time.time() - age_s
    os.utime(leftover, (then, then))
    return leftover


def test_clean_staging_removes_old_leftovers_and_keeps_fresh_ones(tmp_path):
    backend = PosixBackend(str(tmp_path))
    (tmp_path / "keep.json").write_bytes(b"{}")  # not staged: never removed
    old = _staged_leftover(tmp_path, "old.tmp", age_s=7200)
    fresh = _staged_leftover(tmp_path, "fresh.tmp", age_s=0)
    backend.clean_staging(3600)
    assert not old.exists() and fresh.exists()
    backend.clean_staging(older_than_s=0)
    assert not fresh.exists()
    assert backend.list_dirs() == []
    assert sorted(os.listdir(tmp_path)) == ["keep.json"]
