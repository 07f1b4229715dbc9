"""Corrupt and hostile stored files never stop a resume (issue 29).

A good store holds step 1 and step 2 (the newest). Each mutation damages step 2, a
stored JSON file (pointer, cached profile) or the store's directory, as an attacker of
the store would, re-signing the manifest wherever its checksum would otherwise catch the
change. Then every read path must: raise nothing but the library's own errors, agree
(``latest()`` is the checkpoint ``load()`` returns), still load step 1 bit-exactly, and
stay within a bounded peak memory.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import json
import logging
import shutil
import sys
import tempfile
import tracemalloc
from collections import OrderedDict
from pathlib import Path

import numpy as np
import pyarrow.fs
import pytest
import torch
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from ray_checkfreq import CheckFreq, CheckpointStore, codec
from ray_checkfreq.cli import main as cli_main
from ray_checkfreq.codec import blob as blobfmt
from ray_checkfreq.engine.checkfreq import PROFILE_NAME
from ray_checkfreq.engine.policy import Profile
from ray_checkfreq.errors import CheckFreqError, CorruptCheckpointError, StorageError, UnsupportedStateError
from ray_checkfreq.ray.registration import PointedSteps, Pointer, PointerError, read_pointer, write_pointer
from ray_checkfreq.storage.checksum import crc32
from ray_checkfreq.storage.manifest import _dump, body_checksum
from ray_checkfreq.storage.stored_json import StoredJsonError, parse_stored_json

LOCAL = pyarrow.fs.LocalFileSystem()
POINTED_STORE = "the-store-of-the-pointer"
HOSTILE = settings(max_examples=80, deadline=None, derandomize=True,
                   suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


# ------------------------------------------------------------------ the good store
def state_of(step: int) -> dict:
    gen = torch.Generator().manual_seed(step)
    return {
        "model": OrderedDict(w=torch.randn(512, 512, generator=gen), b=torch.arange(1000) * step),
        "np": np.random.default_rng(step).standard_normal((64, 64)),
        "flags": torch.rand(100, generator=gen) > 0.5,
        "meta": {"step": step, "betas": (0.9, 0.999), "none": None, "nan": float("nan")},
    }


STATE_BYTES = sum(leaf.nbytes if isinstance(leaf, np.ndarray) else leaf.numel() * leaf.element_size()
                  for leaf in (*state_of(1)["model"].values(), state_of(1)["np"], state_of(1)["flags"]))


def same_state(a, b) -> bool:
    """Bit-exact equality of two states (NaN equal to itself)."""
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape and (
            a.contiguous().view(torch.uint8).numpy().tobytes() == b.contiguous().view(torch.uint8).numpy().tobytes())
    if isinstance(a, np.ndarray):
        return isinstance(b, np.ndarray) and a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()
    if isinstance(a, dict):
        return type(a) is type(b) and list(a) == list(b) and all(same_state(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(same_state(x, y) for x, y in zip(a, b))
    if isinstance(a, float) and a != a:
        return isinstance(b, float) and b != b
    return type(a) is type(b) and a == b


def good_profile() -> dict:
    profile = Profile(iter_s=0.1, update_s=0.01, cpu_copy_s=0.02, persist_s=0.5, size_bytes=1000)
    return {"profile": profile.to_json(), "decision": {}, "fingerprint": {"state_bytes": 1}}


@pytest.fixture(scope="module")
def template(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("good") / "store"
    store = CheckpointStore(str(root), keep_last=5, full_every=1)
    store.save(1, state_of(1), codec="raw")
    store.save(2, state_of(2))  # rcfz: codec blobs to forge
    store.write_metadata(PROFILE_NAME, good_profile())
    experiment = root.parent / "experiment"
    write_pointer(LOCAL, str(experiment), Pointer(store_uri=POINTED_STORE, step=2, run_filesystem=False))
    return root


@contextlib.contextmanager
def copy_of(template: Path):
    with tempfile.TemporaryDirectory(prefix="hostile-") as tmp:
        root = Path(tmp) / "store"
        shutil.copytree(template, root, symlinks=True)
        shutil.copytree(template.parent / "experiment", Path(tmp) / "experiment")
        (Path(tmp) / "outside").mkdir()
        yield root


def newest_dir(root: Path, step: int = 2) -> Path:
    return next(p for p in root.iterdir() if p.name.startswith(f"step-{step:012d}-"))


def pointer_file(root: Path) -> Path:
    return next((root.parent / "experiment").glob("checkfreq-pointer-*/checkfreq-pointer.json"))


# ------------------------------------------------------------------ mutations
@contextlib.contextmanager
def unlimited_int_text():
    old = sys.get_int_max_str_digits()
    sys.set_int_max_str_digits(0)
    try:
        yield
    finally:
        sys.set_int_max_str_digits(old)


def resign(path: Path, edit) -> None:
    """Edit a manifest's body and write it back with a valid checksum."""
    body = json.loads(path.read_bytes())
    edit(body)
    with unlimited_int_text():
        body["manifest_crc32"] = body_checksum(body)
        path.write_bytes(_dump(body))


def resign_part(directory: Path, edit) -> None:
    """Edit the part manifest (the skeleton's file) and re-sign it, then make the global
    manifest record its new size and checksum, as an attacker of the store would."""
    (part,) = directory.glob("part-r*.json")
    resign(part, edit)
    data = part.read_bytes()

    def record(body):
        body["parts"][0].update(size_bytes=len(data), crc32=crc32(data))
    resign(directory / "manifest.json", record)


def edit_newest(root: Path, where: str, edit) -> None:
    if where == "part":
        resign_part(newest_dir(root), edit)
    else:
        resign(newest_dir(root) / "manifest.json", edit)


def set_path(doc, path: tuple, value) -> None:
    for key in path[:-1]:
        doc = doc[key]
    doc[path[-1]] = value


def nesting_bomb(depth: int, inside: bool) -> str:
    bomb = "[" * depth + "]" * depth
    return f'{{"format": {bomb}}}' if inside else bomb


def mutate_json_file(root: Path, target: str, text: str) -> None:
    path = {"manifest": newest_dir(root) / "manifest.json", "pointer": pointer_file(root),
            "profile": root / PROFILE_NAME}[target]
    path.write_text(text)


def huge_int_text(root: Path, target: str, digits: int) -> None:
    """A number of ``digits`` digits where an int belongs, in a re-signed manifest or as is."""
    number = 10 ** digits - 1
    if target == "manifest":
        resign(newest_dir(root) / "manifest.json", lambda b: b["parts"][0]["files"][0].update(size_bytes=number))
        return
    path = pointer_file(root) if target == "pointer" else root / PROFILE_NAME
    doc = json.loads(path.read_bytes())
    if target == "pointer":
        doc["step"] = number
    else:
        doc["profile"]["iter_s"] = number
    with unlimited_int_text():
        path.write_text(json.dumps(doc))


# Where a wrong JSON type goes, in step 2's global manifest or its part (the skeleton).
SKELETON = ("skeletons", "0", "state")
TYPED_PATHS = [
    ("global", p) for p in [
        ("step",), ("epoch_boundary",), ("parts",), ("parts", 0, "files", 0, "size_bytes"), ("parts", 0, "crc32"),
        ("tensors", 0, "global_shape"), ("tensors", 0, "chunks", 0, "offset"), ("tensors", 1, "chunks", 0, "length"),
        ("tensors", 0, "key"), ("meta",), ("parts", 0, "delta_base"), ("placement",), ("history_trim",),
        ("tensors", 2, "dtype"), ("tensors", 2, "kind"), ("tensors", 0, "chunks", 0, "delta"),
        ("tensors", 0, "chunks", 0, "sizes"), ("tensors", 0, "chunks", 0, "block_crc32"),
        ("tensors", 0, "chunks", 0, "file"), ("tensors", 0, "chunks"),
    ]
] + [
    ("part", p) for p in [
        SKELETON + ("dict", "model", "dict", "w", "tensor"), SKELETON + ("dict", "model"),
        SKELETON + ("dict", "meta", "dict"), SKELETON + ("dict", "meta", "dict", "betas", "tuple"),
        SKELETON + ("dict", "meta", "dict", "nan", "float"), SKELETON + ("dict",), SKELETON,
        ("skeletons", "0", "keys"), ("skeletons", "0", "keys", 0), ("skeletons", "0"), ("skeletons",),
    ]
]
WRONG_VALUES = st.sampled_from(["x", "0", 1.5, 0.0, -1, [], [0], {}, {"list": 0}, {"dict": []}, {"items": [[{}, 1]]},
                                None, True, 2 ** 70])


def forge_blob(root: Path, shape: tuple[int, ...], in_manifest: bool) -> None:
    """Step 2's first codec blob re-headed to declare ``shape`` (header checksum, stored
    checksum and manifest checksum all recomputed); the manifest agrees if ``in_manifest``."""
    directory = newest_dir(root)
    body = json.loads((directory / "manifest.json").read_bytes())
    index, entry = next((i, t["chunks"][0]) for i, t in enumerate(body["tensors"])
                        if t["chunks"][0]["codec"] == "rcfz" and len(t["global_shape"]) == 2)
    shard = directory / entry["file"]
    data = bytearray(shard.read_bytes())
    blob = bytes(data[entry["offset"]:entry["offset"] + entry["length"]])
    header, start = blobfmt.unpack(blob)
    numel = 1
    for dim in shape:
        numel *= dim
    forged = blobfmt.pack(dataclasses.replace(header, shape=shape, frame_elems=numel, frames=header.frames[:1]))
    new_blob = forged + blob[start:start + header.frames[0].stored_len]
    data[entry["offset"]:entry["offset"] + len(new_blob)] = new_blob
    shard.write_bytes(bytes(data))

    def edit(b):
        t = b["tensors"][index]
        chunk = t["chunks"][0]
        block = chunk["crc_block_bytes"]
        chunk["length"], chunk["stored_crc32"] = len(new_blob), crc32(new_blob)
        chunk["block_crc32"] = [crc32(new_blob[i:i + block]) for i in range(0, len(new_blob), block)]
        if in_manifest:
            t["global_shape"] = chunk["sizes"] = list(shape)

    resign(directory / "manifest.json", edit)


STRAY_DIGITS = st.integers(1, 40).map(lambda n: "9" * n)
STRAY_NAMES = st.one_of(
    st.builds(lambda s, g: f"step-{s}-g{g}-deadbeef", STRAY_DIGITS, STRAY_DIGITS),
    st.builds(lambda s: f"step-{s}-deadbeef", STRAY_DIGITS),
    st.text(st.characters(codec="utf-8", exclude_characters="/\x00"), min_size=1, max_size=40).filter(
        lambda n: n not in (".", "..")),
)


def stray(root: Path, name: str, with_manifest: bool, marker_digits: int) -> None:
    directory = root / name
    directory.mkdir(exist_ok=True)
    if with_manifest:
        shutil.copy(newest_dir(root) / "manifest.json", directory / "manifest.json")
    (root / "writers").mkdir(exist_ok=True)
    (root / "writers" / f"gen-{'9' * marker_digits}.json").write_text("{}")


def symlinks(root: Path, kind: str) -> None:
    outside = root.parent / "outside"
    if kind == "writers":
        shutil.rmtree(root / "writers")
        (root / "writers").symlink_to(outside)
    elif kind == "checkpoint_dir":
        target = outside / "copy"
        shutil.copytree(newest_dir(root), target)
        (root / "step-000000000009-g000009-0badc0de").symlink_to(target)
    else:  # a shard replaced by a link to a file elsewhere
        shard = next(newest_dir(root).glob("*.bin"))
        (outside / "big.bin").write_bytes(shard.read_bytes())
        shard.unlink()
        shard.symlink_to(outside / "big.bin")


MUTATIONS = st.one_of(
    st.builds(lambda t, d, i: ("nesting", lambda r: mutate_json_file(r, t, nesting_bomb(d, i))),
              st.sampled_from(["manifest", "pointer", "profile"]), st.integers(300, 200_000), st.booleans()),
    st.builds(lambda t, d: ("huge_int", lambda r: huge_int_text(r, t, d)),
              st.sampled_from(["manifest", "pointer", "profile"]), st.integers(41, 20_000)),
    st.builds(lambda p, v: ("wrong_type", lambda r: edit_newest(r, p[0], lambda b: set_path(b, p[1], v))),
              st.sampled_from(TYPED_PATHS), WRONG_VALUES),
    st.builds(lambda t, v: ("profile_type", lambda r: mutate_json_file(
        r, "profile", json.dumps({**good_profile(), "profile": {**good_profile()["profile"], t: v}}))),
              st.sampled_from(["iter_s", "gpu_copy_s", "compress", "peak_memory_bytes", "size_bytes"]),
              WRONG_VALUES),
    st.builds(lambda s: ("shape", lambda r: resign(newest_dir(r) / "manifest.json",
                                                   lambda b: b["tensors"][0].update(global_shape=s))),
              st.sampled_from([[2**32, 2**32], [2**64], [2**62, 2**62, 2**62], [0, 2**70], [1] * 65, [2**40]])),
    # Declared sizes the manifest does not agree with, or that no blob of its length can hold.
    st.builds(lambda sm: ("forged_blob", lambda r: forge_blob(r, *sm)),
              st.sampled_from([((2**26, 1), False), ((2**26, 1), True), ((2**38, 1), False), ((2**38, 1), True),
                               ((1024, 1024), False), ((513, 512), False), ((513, 512), True), ((256, 512), True)])),
    st.builds(lambda n, w, d: ("stray", lambda r: stray(r, n, w, d)), STRAY_NAMES, st.booleans(), st.integers(1, 30)),
    st.builds(lambda k: ("symlink", lambda r: symlinks(r, k)), st.sampled_from(["writers", "checkpoint_dir", "shard"])),
)


# ------------------------------------------------------------------ the property
def only_library_errors(call):
    """What ``call()`` returns, or the library error it raised; anything else fails."""
    try:
        return call()
    except CheckFreqError as err:
        return err


def read_everything(root: Path) -> None:
    store = CheckpointStore(str(root))
    refs = only_library_errors(store.list)
    assert isinstance(refs, list)
    only_library_errors(store.scan)
    tracemalloc.start()
    try:
        latest = store.latest()
        loaded = store.load()
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert latest is not None and latest.step in (1, 2)
    assert peak < 4 * STATE_BYTES, f"peak {peak} bytes for a {STATE_BYTES}-byte state"
    assert same_state(loaded, store.load(latest)), "latest() is not the checkpoint load() returned"
    assert same_state(store.load(1), state_of(1)), "the previous good checkpoint no longer loads"
    for ref in refs:
        only_library_errors(lambda ref=ref: store.verify(ref))
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        assert cli_main(["ls", str(root)]) == 0
        assert cli_main(["verify", str(root)]) in (0, 1)


def read_pointer_and_profile(root: Path) -> None:
    experiment = root.parent / "experiment"
    only_library_errors(lambda: read_pointer(LOCAL, str(pointer_file(root).parent)))
    assert PointedSteps(LOCAL, str(experiment), POINTED_STORE)() <= {2}  # never raises
    model = torch.nn.Linear(2, 2)
    cf = CheckFreq(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), storage=str(root),
                   profile_iters=8)
    try:
        cf.load_cached_profile()
    finally:
        cf.close()


def save_after(root: Path) -> None:
    """A new writer's save is either refused with a library error or is the newest checkpoint."""
    store = CheckpointStore(str(root), keep_last=5)
    saved = only_library_errors(lambda: store.save(3, state_of(3)))
    if not isinstance(saved, CheckFreqError):
        latest = CheckpointStore(str(root)).latest()
        assert latest is not None and latest.step == 3, "a committed save is invisible"
    assert not any((root.parent / "outside").glob("gen-*")), "a writer marker was written out of the root"


@HOSTILE
@given(mutation=MUTATIONS)
def test_every_read_path_survives_any_hostile_mutation(template, mutation):
    kind, apply = mutation
    event(kind)
    logger = logging.getLogger("ray_checkfreq")
    level = logger.level
    logger.setLevel(logging.ERROR)  # the warnings of 80 examples: the regression tests check them
    try:
        with copy_of(template) as root:
            apply(root)
            read_everything(root)
            read_pointer_and_profile(root)
            save_after(root)
    finally:
        logger.setLevel(level)


# ------------------------------------------------------------------ one regression per class
def _warned_about(caplog, name: str) -> bool:
    return any(name in record.getMessage() for record in caplog.records if record.levelno >= logging.WARNING)


def test_nesting_bomb_in_the_newest_manifest_falls_back_with_a_warning(template, caplog):
    caplog.set_level(logging.WARNING, logger="ray_checkfreq")
    with copy_of(template) as root:
        mutate_json_file(root, "manifest", nesting_bomb(100_000, inside=True))
        store = CheckpointStore(str(root))
        assert store.latest().step == 1 and same_state(store.load(), state_of(1))
        assert _warned_about(caplog, newest_dir(root).name)
        assert cli_main(["ls", str(root)]) == 0


def test_a_huge_integer_makes_the_file_corrupt_not_the_store_unreadable(template, caplog):
    with copy_of(template) as root:
        huge_int_text(root, "manifest", 5000)
        store = CheckpointStore(str(root))
        assert [ref.step for ref in store.list()] == [1]
        assert same_state(store.load(), state_of(1))
        huge_int_text(root, "pointer", 5000)
        with pytest.raises(PointerError, match="digits"):
            read_pointer(LOCAL, str(pointer_file(root).parent))


def test_an_ill_typed_skeleton_with_a_valid_checksum_fails_verify_and_falls_back(template):
    with copy_of(template) as root:
        resign_part(newest_dir(root), lambda b: set_path(b, SKELETON + ("dict", "model", "dict", "w", "tensor"), "0"))
        store = CheckpointStore(str(root))
        assert store.latest().step == 1 and same_state(store.load(), state_of(1))
        assert cli_main(["verify", str(root)]) == 1  # the fault is reported, not passed
    for path, value in [(SKELETON + ("dict", "meta", "dict"), []),  # a container of the wrong kind
                        (SKELETON + ("dict", "meta", "dict", "none"), {"tensor": 0.0})]:  # a second, float reference
        with copy_of(template) as root:
            resign_part(newest_dir(root), lambda b, p=path, v=value: set_path(b, p, v))
            store = CheckpointStore(str(root))
            assert store.latest().step == 1 and same_state(store.load(), state_of(1))


@pytest.mark.parametrize("shape", [[2**32, 2**32], [2**64]])
def test_an_overflowing_shape_is_refused_and_latest_agrees_with_load(tmp_path, shape):
    store = CheckpointStore(str(tmp_path), keep_last=5, full_every=1)
    store.save(1, {"w": torch.arange(4.0)}, codec="raw")
    ref = store.save(2, {"w": torch.zeros(0)}, codec="raw")
    resign(tmp_path / ref.name / "manifest.json", lambda b: b["tensors"][0].update(global_shape=shape))
    reader = CheckpointStore(str(tmp_path))
    assert reader.latest().step == 1
    assert torch.equal(reader.load()["w"], torch.arange(4.0))


@pytest.mark.parametrize("shape, in_manifest", [((2**26, 1), False), ((2**38, 1), False), ((2**26, 1), True)])
def test_a_forged_blob_header_is_refused_before_anything_is_allocated(template, shape, in_manifest):
    with copy_of(template) as root:
        forge_blob(root, shape, in_manifest)
        store = CheckpointStore(str(root))
        tracemalloc.start()
        try:
            with pytest.raises(CorruptCheckpointError, match="declares|expansion"):
                store.load(2)
            _, peak = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
        assert peak < 4 * STATE_BYTES
        assert store.latest().step == 1


def test_the_codec_bounds_what_a_blob_may_declare():
    encoded = codec.encode(torch.zeros(16))
    header, start = blobfmt.unpack(encoded)
    forged = blobfmt.pack(dataclasses.replace(header, shape=(2**28,), frame_elems=2**28)) + encoded[start:]
    tracemalloc.start()
    try:
        with pytest.raises(codec.CodecError, match="expansion"):
            codec.decode(forged)
        with pytest.raises(codec.CodecError, match="expects 64 bytes"):
            codec.decode(forged, expected_nbytes=64)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 1 << 20


def test_a_stray_directory_with_a_long_generation_hides_no_later_save(tmp_path):
    (tmp_path / "step-000000000001-g999999999999999999-deadbeef").mkdir(parents=True)
    store = CheckpointStore(str(tmp_path))
    for step in (1, 2, 3):
        store.save(step, {"w": torch.full((4,), float(step))})
    assert [ref.step for ref in store.list()][-1] == 3
    assert store.latest().step == 3 and torch.equal(store.load()["w"], torch.full((4,), 3.0))
    marker = tmp_path / "writers" / f"gen-{store.writer_generation:012d}.json"
    assert marker.exists()


def test_an_older_writer_cannot_commit_after_a_newer_one_took_over(tmp_path):
    old = CheckpointStore(str(tmp_path))
    old.save(1, {"w": torch.zeros(2)})
    (tmp_path / "step-000000000001-g999999999999999999-deadbeef").mkdir()  # a stray, uncommitted
    new = CheckpointStore(str(tmp_path))
    new.save(2, {"w": torch.ones(2)})  # takes over (and, as housekeeping, may remove older leftovers)
    with pytest.raises(StorageError, match="fenced"):
        old.save(3, {"w": torch.full((2,), 3.0)})
    assert CheckpointStore(str(tmp_path)).latest().step == 2


def test_writer_markers_are_never_written_through_a_symlink_out_of_the_root(tmp_path):
    root, outside = tmp_path / "store", tmp_path / "outside"
    root.mkdir()
    outside.mkdir()
    (root / "writers").symlink_to(outside)
    with pytest.raises(StorageError, match="symlink"):
        CheckpointStore(str(root)).save(1, {"w": torch.zeros(2)})
    assert list(outside.iterdir()) == []


def test_an_unparsable_pointer_does_not_skip_retention(tmp_path, caplog):
    caplog.set_level(logging.WARNING, logger="ray_checkfreq")
    experiment = tmp_path / "experiment"
    store = CheckpointStore(str(tmp_path / "store"), keep_last=1, keep_epoch_boundaries=False)
    store.protected_steps = PointedSteps(LOCAL, str(experiment), store.uri)
    write_pointer(LOCAL, str(experiment), Pointer(store_uri=store.uri, step=1, run_filesystem=False))
    broken = write_pointer(LOCAL, str(experiment), Pointer(store_uri=store.uri, step=2, run_filesystem=False))
    Path(broken, "checkfreq-pointer.json").write_text(nesting_bomb(50_000, inside=False))
    for step in (1, 2, 3, 4):
        store.save(step, {"w": torch.zeros(2)})
    assert [ref.step for ref in store.list()] == [1, 4], "retention ran: only the pointed step and the newest"
    assert _warned_about(caplog, "checkfreq-pointer.json")


def test_a_cached_profile_of_wrong_types_is_ignored_with_a_warning(tmp_path, caplog):
    caplog.set_level(logging.WARNING, logger="ray_checkfreq")
    store = CheckpointStore(str(tmp_path))
    store.write_metadata(PROFILE_NAME, {**good_profile(), "profile": {**good_profile()["profile"],
                                                                      "peak_memory_bytes": "lots"}})
    model = torch.nn.Linear(2, 2)
    cf = CheckFreq(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), storage=str(tmp_path),
                   profile_iters=8)
    cf.load_cached_profile()
    cf.close()
    assert cf._cached is None and _warned_about(caplog, PROFILE_NAME)


def test_cli_errors_are_clean(template, tmp_path, capsys):
    assert cli_main(["export", str(template), "--to", str(tmp_path / "missing" / "out.pt")]) == 1
    assert "does not exist" in capsys.readouterr().err
    a_file = tmp_path / "file"
    a_file.write_text("x")
    for command in ("ls", "verify"):
        assert cli_main([command, str(a_file)]) == 1
        assert "is not a directory" in capsys.readouterr().err


def test_a_precision_factor_exponent_is_range_checked_before_it_is_computed(template, tmp_path, capsys):
    with pytest.raises(SystemExit) as info:
        cli_main(["export", str(template), "--to", str(tmp_path / "x.pt"), "--precision-factor", "2**99999999999"])
    assert info.value.code == 2 and "exponent" in capsys.readouterr().err


def test_the_writer_never_writes_what_a_reader_would_refuse(tmp_path):
    store = CheckpointStore(str(tmp_path))
    pcg64 = np.random.default_rng(0).bit_generator.state  # 39-digit ints: within the limit
    store.save(1, {"w": torch.zeros(2), "rng": pcg64})
    assert store.load()["rng"] == pcg64
    with pytest.raises(UnsupportedStateError, match="digits"):
        store.save(2, {"w": torch.zeros(2), "big": 10**100})
    deep: list = []
    for _ in range(300):
        deep = [deep]
    with pytest.raises(UnsupportedStateError, match="nested"):
        store.save(2, {"w": torch.zeros(2)}, meta={"deep": deep})
    assert [ref.step for ref in store.list()] == [1]


@pytest.mark.parametrize("text, accepted", [
    ("[" * 256 + "]" * 256, True), ("[" * 257 + "]" * 257, False), ('["' + "[" * 300 + '"]', True),
    ("9" * 100, True), ("-" + "9" * 101, False), ("1." + "0" * 100, False), ("1e999", False),
    ("NaN", False), ("[-Infinity]", False), ('{"a": 1.5e300}', True), ('"\\' + '"' * 1000, False),
])
def test_the_stored_json_limits_are_exact(text, accepted):
    if accepted:
        assert parse_stored_json(text.encode(), max_bytes=4096) == json.loads(text)
    else:
        with pytest.raises(StoredJsonError):
            parse_stored_json(text.encode(), max_bytes=4096)
    with pytest.raises(StoredJsonError, match="more than the 8 allowed"):
        parse_stored_json(b"[" + b" " * 8 + b"]", max_bytes=8)


@pytest.mark.parametrize("edit, reason", [
    # leaf 0 named twice (and another leaf never): the state would alias one tensor
    (lambda b: set_path(b, SKELETON + ("dict", "model", "dict", "b", "tensor"), 0), "exactly once"),
    (lambda b: b["skeletons"]["0"]["keys"].reverse(), "referenced as|not one whole tensor"),
    (lambda b: b["skeletons"]["0"]["keys"].append("model/x"), "skeleton names 5 leaves"),
    (lambda b: b["skeletons"]["0"].update(extra=1), "is {state, keys}"),
])
def test_a_replicated_skeleton_that_does_not_name_each_array_once_is_refused_by_name(template, edit, reason):
    with copy_of(template) as root:
        resign_part(newest_dir(root), edit)
        store = CheckpointStore(str(root))
        with pytest.raises(CorruptCheckpointError, match=reason) as info:
            store.load(2)
        assert "part-r00000.json" in str(info.value)
        assert store.latest().step == 1 and same_state(store.load(), state_of(1))


def test_a_replicated_manifest_claiming_two_parts_is_refused_by_name(template):
    with copy_of(template) as root:
        def two_parts(body):
            body["world_size"] = 2
            body["parts"].append(dict(body["parts"][0], name="part-r00001.json", ranks=[1], files=[]))
        resign(newest_dir(root) / "manifest.json", two_parts)
        store = CheckpointStore(str(root))
        with pytest.raises(CorruptCheckpointError, match="a replicated checkpoint of 2 parts"):
            store.load(2)
        assert store.latest().step == 1 and same_state(store.load(), state_of(1))
