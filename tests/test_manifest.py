"""Manifest encoding and validation (pure, no I/O)."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from legacy_writer import encode_manifest

from ray_checkfreq.storage.arrays import LeafSpec
from ray_checkfreq.storage.legacy import Manifest, ShardEntry, TensorEntry, decode_manifest
from ray_checkfreq.storage.manifest import ManifestError, body_checksum

DTYPES = [("torch", "float32", 4), ("torch", "bfloat16", 2), ("torch", "bool", 1), ("numpy", "<i8", 8)]


@st.composite
def manifests(draw) -> Manifest:
    count = draw(st.integers(0, 6))
    tensors = []
    offset = 0
    for _ in range(count):
        kind, dtype, itemsize = draw(st.sampled_from(DTYPES))
        shape = tuple(draw(st.lists(st.integers(0, 5), max_size=3)))
        spec = LeafSpec(kind=kind, dtype=dtype, shape=shape)
        tensors.append(TensorEntry(
            key=draw(st.text(max_size=10)), spec=spec, codec="raw", shard="shard-00000.bin",
            offset=offset, length=spec.nbytes, stored_crc32=draw(st.integers(0, 2**32 - 1)),
            raw_crc32=draw(st.integers(0, 2**32 - 1)),
        ))
        offset += spec.nbytes
    tags = {"torch": "tensor", "numpy": "ndarray"}
    state = {"list": [{tags[t.spec.kind]: i} for i, t in enumerate(tensors)]}
    return Manifest(
        step=draw(st.integers(0, 10**12)), epoch_boundary=draw(st.booleans()),
        created_unix_ns=draw(st.integers(0, 2**63)), shards=(ShardEntry("shard-00000.bin", offset),),
        tensors=tuple(tensors), state=state,
        meta=draw(st.dictionaries(st.text(max_size=5), st.integers() | st.text(max_size=5), max_size=3)),
    )


@settings(max_examples=80, deadline=None)
@given(manifest=manifests())
def test_encode_decode_round_trip(manifest):
    assert decode_manifest(encode_manifest(manifest)) == manifest


@settings(max_examples=80, deadline=None)
@given(manifest=manifests(), data=st.data())
def test_any_flipped_bit_is_refused(manifest, data):
    blob = bytearray(encode_manifest(manifest))
    position = data.draw(st.integers(0, len(blob) - 1))
    blob[position] ^= 1 << data.draw(st.integers(0, 7))
    with pytest.raises(ManifestError):
        decode_manifest(bytes(blob))


def test_a_flip_that_keeps_the_meaning_is_refused_too():
    """Found by the property test above: the case of a hex digit in a \\u escape changes the
    bytes but not the parsed JSON, so the checksum over the meaning alone missed it."""
    manifest = Manifest(step=0, epoch_boundary=False, created_unix_ns=0, shards=(), tensors=(),
                        state={"dict": {}}, meta={"\x1f": 0})
    blob = encode_manifest(manifest)
    assert b"\\u001f" in blob
    with pytest.raises(ManifestError, match="bytes differ"):
        decode_manifest(blob.replace(b"\\u001f", b"\\u001F"))
    assert decode_manifest(blob) == manifest


def _resigned(manifest: Manifest, edit) -> bytes:
    body = json.loads(encode_manifest(manifest))
    edit(body)
    body["manifest_crc32"] = body_checksum(body)
    return json.dumps(body, indent=1).encode()  # as the writer writes


def _one_tensor() -> Manifest:
    spec = LeafSpec(kind="torch", dtype="float32", shape=(4,))
    entry = TensorEntry(key="w", spec=spec, codec="raw", shard="shard-00000.bin", offset=0, length=16,
                        stored_crc32=1, raw_crc32=1)
    return Manifest(step=3, epoch_boundary=False, created_unix_ns=1, shards=(ShardEntry("shard-00000.bin", 16),),
                    tensors=(entry,), state={"dict": {"w": {"tensor": 0}}})


@pytest.mark.parametrize(
    "edit, message",
    [
        (lambda b: b.update(format_version=3), "format version 3 is not supported"),
        (lambda b: b["shards"][0].update(name="../x"), "not a plain file name"),
        (lambda b: b["shards"][0].update(name="a/b"), "not a plain file name"),
        (lambda b: b["tensors"][0].update(shard="other.bin"), "unlisted shard"),
        (lambda b: b["tensors"][0].update(length=32), "extends past the end"),
        (lambda b: b["tensors"][0].update(dtype="object"), "unknown torch dtype"),
        (lambda b: b["tensors"][0].update(shape=[-1]), "bad shape"),
        (lambda b: b.update(state={"dict": {}}), "does not reference every tensor"),
        (lambda b: b.update(state={"dict": {"w": {"pickle": 0}}}), "unknown skeleton tag 'pickle'"),
        (lambda b: b.update(step="3"), "'step'"),
        (lambda b: b["tensors"][0].update(codec="pickle"), "unknown codec"),
        (lambda b: b["tensors"][0].update(delta=True), "raw tensor cannot be a delta"),
        (lambda b: b.update(delta_base="../step-000000000001-abcdef01"), "not a checkpoint directory"),
    ],
)
def test_hostile_but_well_signed_manifests_are_refused(edit, message):
    with pytest.raises(ManifestError, match=message):
        decode_manifest(_resigned(_one_tensor(), edit))


def test_not_json_and_not_ours():
    with pytest.raises(ManifestError, match="not valid JSON"):
        decode_manifest(b"\x80\x00")
    with pytest.raises(ManifestError, match="not a ray_checkfreq manifest"):
        decode_manifest(b'{"format": "torch"}')
