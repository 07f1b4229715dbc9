"""History checkpoints kept near-lossless (``CheckpointStore(history_trim=HistoryTrim(...))``):
what is rewritten, what never is, deltas between trimmed copies, a crash between the copy's
commit and the source's deletion, and that a resume never reads a trimmed copy."""

from __future__ import annotations

import multiprocessing
import os
import pickle
import signal

import numpy as np
import pytest
import torch

from ray_checkfreq import CheckpointStore, codec
from ray_checkfreq.errors import CheckpointNotFoundError
from ray_checkfreq.storage import commit
from ray_checkfreq.storage.history import HistoryTrim
from ray_checkfreq.storage.legacy import decode_any_manifest, decode_manifest
from ray_checkfreq.storage.manifest import MANIFEST_NAME, ManifestError, body_checksum, decode_global

B = 2 ** 10


def state_of(step: int) -> dict:
    """Weights that drift a little from step to step: a chunk is stored as a delta only
    where that is smaller, and deltas of unrelated values are not."""
    start, g = np.random.default_rng(0), np.random.default_rng(step)

    def drifted(values: np.ndarray) -> np.ndarray:
        return values + g.normal(0, 1e-5, values.shape)
    return {
        "model": {"w": torch.from_numpy(drifted(start.uniform(-0.5, 0.5, 3000)).astype(np.float32)),
                  "wide": torch.from_numpy(drifted(start.normal(0, 5, 500)).astype(np.float32)),  # outside [-1, 1]
                  "half": torch.from_numpy(drifted(start.uniform(-1, 1, 800))).to(torch.bfloat16)},
        "optimizer": {"step": torch.tensor(step), "counts": np.arange(step, step + 10)},
        "iterator": {"epoch": step // 2, "lr": 0.1 / step},
    }


def raw(t: torch.Tensor) -> bytes:
    return t.contiguous().view(torch.uint8).numpy().tobytes()


def save_steps(store: CheckpointStore, steps, epoch_every: int = 2) -> None:
    for step in steps:
        store.save(step, state_of(step), epoch_boundary=step % epoch_every == 1)


def manifest_of(store: CheckpointStore, name: str):
    return decode_any_manifest(store.backend.read_small(f"{name}/{MANIFEST_NAME}"))


def check_trimmed_copy(loaded: dict, step: int) -> None:
    exact = state_of(step)
    for key in ("w", "half"):
        assert raw(loaded["model"][key]) == raw(codec.trim(exact["model"][key], precision_factor=B))
        assert not torch.equal(loaded["model"][key], exact["model"][key])
    assert raw(loaded["model"]["wide"]) == raw(exact["model"]["wide"])  # values outside [-1, 1]: exact
    assert torch.equal(loaded["optimizer"]["step"], exact["optimizer"]["step"])
    assert np.array_equal(loaded["optimizer"]["counts"], exact["optimizer"]["counts"])
    assert loaded["iterator"] == exact["iterator"]


def test_history_checkpoints_are_rewritten_trimmed_and_the_newest_stay_exact(tmp_path):
    store = CheckpointStore(str(tmp_path), keep_last=2, full_every=1,
                            history_trim=HistoryTrim(precision_factor=B))
    save_steps(store, range(1, 9))
    refs = store.list()
    assert [(r.step, r.trimmed) for r in refs] == [(1, True), (3, True), (5, True), (7, False), (8, False)]
    assert store.latest().step == 8 and not store.latest().trimmed
    assert refs[0].size_bytes < 0.8 * refs[3].size_bytes  # the copy stores less than an exact one
    for step in (7, 8):
        assert raw(store.load(step)["model"]["w"]) == raw(state_of(step)["model"]["w"])
    for ref in refs[:3]:
        check_trimmed_copy(store.load(ref.step), ref.step)
        trim = manifest_of(store, ref.name).history_trim
        assert trim["precision_factor"] == B and trim["source"].startswith(f"step-{ref.step:012d}-")
    assert len(os.listdir(tmp_path)) == 5 + 1  # the checkpoints and writers/: no source left


def test_trimmed_copies_are_deltas_against_the_newest_full_trimmed_copy(tmp_path):
    store = CheckpointStore(str(tmp_path), keep_last=1, full_every=1,
                            history_trim=HistoryTrim(precision_factor=B, full_every=3))
    save_steps(store, range(1, 12))
    trimmed = [r for r in store.list() if r.trimmed]
    assert [r.step for r in trimmed] == [1, 3, 5, 7, 9]
    bases = [next(iter(manifest_of(store, r.name).delta_bases), None) for r in trimmed]
    assert bases == [None, trimmed[0].name, trimmed[0].name, None, trimmed[3].name]
    for ref in trimmed:
        check_trimmed_copy(store.load(ref.step), ref.step)


def test_a_resume_never_reads_a_trimmed_copy(tmp_path):
    store = CheckpointStore(str(tmp_path), keep_last=2, full_every=1,
                            history_trim=HistoryTrim(precision_bits=4))
    save_steps(store, range(1, 5))
    exact = [r for r in store.list() if not r.trimmed]
    for ref in exact:  # break every exact checkpoint: only trimmed copies are readable
        for shard in os.listdir(tmp_path / ref.name):
            if shard != MANIFEST_NAME:
                os.remove(tmp_path / ref.name / shard)
    reader = CheckpointStore(str(tmp_path))
    assert reader.latest() is None
    with pytest.raises(CheckpointNotFoundError, match=r"history copies \(load them by step\) at steps \[1\]"):
        reader.load()
    assert reader.load(1)["iterator"] == state_of(1)["iterator"]  # asked for by step: given


def test_a_newer_writer_generation_does_not_make_a_trimmed_copy_the_latest(tmp_path):
    old = CheckpointStore(str(tmp_path), keep_last=2, full_every=1)
    save_steps(old, range(1, 5))  # 1 and 3 epoch boundaries, all exact
    new = CheckpointStore(str(tmp_path), keep_last=2, full_every=1,
                          history_trim=HistoryTrim(precision_factor=B))
    new.save(5, state_of(5))  # a new writer: its copy of step 1 sorts after the old writer's 4
    refs = new.list()
    assert [(r.step, r.trimmed) for r in refs] == [(3, False), (4, False), (1, True), (5, False)]
    new.delete(5)
    assert new.latest().step == 4 and new.load()["iterator"] == state_of(4)["iterator"]
    new.save(6, state_of(6))  # the copy does not count among the newest keep_last
    assert [(r.step, r.trimmed) for r in new.list()] == [(4, False), (1, True), (3, True), (6, False)]


def test_a_protected_step_stays_exact_until_unprotected(tmp_path):
    protected = {1}
    store = CheckpointStore(str(tmp_path), keep_last=2, full_every=1,
                            history_trim=HistoryTrim(precision_factor=B), protected_steps=lambda: protected)
    save_steps(store, range(1, 5))
    assert [(r.step, r.trimmed) for r in store.list()] == [(1, False), (3, False), (4, False)]
    protected.clear()
    store.save(5, state_of(5))  # one rewrite per retention: step 1, then step 3 at the next save
    assert [(r.step, r.trimmed) for r in store.list()] == [(1, True), (3, False), (4, False), (5, False)]
    store.save(6, state_of(6))
    assert [(r.step, r.trimmed) for r in store.list()] == [(1, True), (3, True), (5, False), (6, False)]
    check_trimmed_copy(store.load(1), 1)


def test_a_delta_base_in_use_stays_exact_until_no_exact_checkpoint_needs_it(tmp_path):
    store = CheckpointStore(str(tmp_path), keep_last=2, full_every=4,
                            history_trim=HistoryTrim(precision_factor=B))
    save_steps(store, range(1, 6), epoch_every=100)  # 1 full (an epoch boundary), 2-4 deltas on it, 5 full
    assert [(r.step, r.trimmed) for r in store.list()] == [(1, False), (4, False), (5, False)]
    store.save(6, state_of(6))  # a delta on 5: nothing kept refers to step 1 any more
    assert [(r.step, r.trimmed) for r in store.list()] == [(1, True), (5, False), (6, False)]
    check_trimmed_copy(store.load(1), 1)


def _save_then_die_between_copy_and_delete(root: str, trim: HistoryTrim) -> None:
    # Runs in a forked child: every tensor of state_of() is one codec frame and below torch's
    # parallel grain, so no thread pool inherited from the parent is ever entered.
    store = CheckpointStore(root, keep_last=2, full_every=1, history_trim=trim)
    save_steps(store, range(1, 3))
    first = store.list()[0].name
    plain_delete = commit.remove_committed

    def crash_on_source(backend, name: str, generation: int) -> None:
        if name == first:
            os.kill(os.getpid(), signal.SIGKILL)
        plain_delete(backend, name, generation)

    commit.remove_committed = crash_on_source  # a forked child: the patch dies with it
    store.save(3, state_of(3), epoch_boundary=True)


def test_sigkill_between_the_copy_commit_and_the_source_delete_loses_nothing(tmp_path):
    root = str(tmp_path)
    trim = HistoryTrim(precision_factor=B)
    child = multiprocessing.get_context("fork").Process(
        target=_save_then_die_between_copy_and_delete, args=(root, trim))
    child.start()
    child.join(60)
    assert child.exitcode == -signal.SIGKILL
    store = CheckpointStore(root, keep_last=2, full_every=1, history_trim=trim)
    assert [(r.step, r.trimmed) for r in store.list()] == [(1, False), (1, True), (2, False), (3, False)]
    assert store.latest().step == 3
    check_trimmed_copy(store.load(1), 1)  # the committed copy is the newest save of step 1
    store.save(4, state_of(4))
    assert [(r.step, r.trimmed) for r in store.list()] == [(1, True), (3, False), (4, False)]


def test_config_is_validated_and_survives_pickling(tmp_path):
    for kwargs, match in (({}, "exactly one"), ({"precision_factor": 8, "precision_bits": 3}, "exactly one"),
                          ({"precision_factor": 3}, "power of two"), ({"precision_bits": -1}, "precision_bits"),
                          ({"precision_factor": 8, "full_every": 0}, "full_every")):
        with pytest.raises(ValueError, match=match):
            HistoryTrim(**kwargs)
    with pytest.raises(ValueError, match="keep_epoch_boundaries"):
        CheckpointStore(str(tmp_path), keep_epoch_boundaries=False, history_trim=HistoryTrim(precision_bits=8))
    with pytest.raises(TypeError, match="HistoryTrim"):
        CheckpointStore(str(tmp_path), history_trim={"precision_bits": 8})
    store = CheckpointStore(str(tmp_path), history_trim=HistoryTrim(precision_factor=2.0 ** 19))
    assert pickle.loads(pickle.dumps(store)).config.history_trim == HistoryTrim(precision_factor=2 ** 19)


def test_history_trim_is_recorded_only_where_a_reader_checks_it(tmp_path):
    import json

    from ray_checkfreq.storage.canonical_json import dumps_indented

    store = CheckpointStore(str(tmp_path), keep_last=1, full_every=1, history_trim=HistoryTrim(precision_bits=8))
    save_steps(store, range(1, 3))
    copy = manifest_of(store, store.list()[0].name)
    exact = manifest_of(store, store.list()[-1].name)
    assert copy.history_trim["precision_bits"] == 8 and exact.history_trim is None
    body = json.loads(store.backend.read_small(f"{store.list()[-1].name}/{MANIFEST_NAME}"))
    body.update(history_trim=dict(copy.history_trim), manifest_crc32=0)  # checked like any other field
    body["manifest_crc32"] = body_checksum(body)
    assert decode_global(dumps_indented(body)).history_trim == copy.history_trim
    body.update(placement="replicated", history_trim={"source": "../elsewhere", "precision_bits": 8})
    body["manifest_crc32"] = body_checksum(body)
    with pytest.raises(ManifestError, match="naming its source checkpoint"):
        decode_global(dumps_indented(body))


def test_a_format_1_manifest_with_history_trim_is_refused(tmp_path):
    """Format 2 marked history copies; a version-1 manifest claiming one is damage."""
    import json

    from legacy_writer import write_format_1

    write_format_1(str(tmp_path / "step-000000000001-g000001-00000001"), 1, state_of(1), writer_generation=1)
    path = tmp_path / "step-000000000001-g000001-00000001" / MANIFEST_NAME
    assert b'"format_version": 1' in path.read_bytes()
    body = json.loads(path.read_bytes())
    body["history_trim"] = {"source": "step-000000000000-g000001-00000000", "precision_bits": 8}
    body["manifest_crc32"] = body_checksum(body)
    with pytest.raises(ManifestError, match="history_trim in a format version 1"):
        decode_manifest(json.dumps(body, indent=1).encode())
