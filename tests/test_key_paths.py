"""Leaves are keyed by tuple paths and named uniquely: keys that "/"-joined names would
merge ("a/b" and ("a", "b"), 0 and "0") never share a buffer, a delta base or a name."""

from __future__ import annotations

from collections import OrderedDict

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from state_strategies import assert_same_state, map_tensors, tricky_states

from ray_checkfreq import CheckFreq, CheckpointStore
from ray_checkfreq.engine.snapshot import Snapshotter
from ray_checkfreq.storage.export import write_safetensors
from ray_checkfreq.storage.tree import METADATA, flatten_state, key_names, leaves_of

COLLIDING = {
    "slash": {"a/b": torch.zeros(3), "a": {"b": torch.ones(3)}},
    "int_and_str": {0: torch.zeros(3), "0": torch.ones(3)},
    "bool_none_float": {True: torch.zeros(3), "True": torch.ones(3), None: torch.full((3,), 2.0),
                        "None": torch.full((3,), 3.0), 1.5: torch.full((3,), 4.0), "1.5": torch.full((3,), 5.0)},
    "escape_char": {"%2F": torch.zeros(3), "/": torch.ones(3)},
    "empty_key": {"": {"x": torch.zeros(3), "": torch.full((3,), 2.0)}, "x": torch.ones(3), "/": torch.full((3,), 3.0)},
}


@pytest.mark.parametrize("keys, names", [
    (["a", "b.c", "layer.0.weight"], ["a", "b.c", "layer.0.weight"]),  # ordinary names unchanged
    ([0, 1, -1], ["0", "1", "-1"]),
    (["0", "1"], ["0", "1"]),  # a str that reads like an int is escaped only beside one
    ([0, "0", "00"], ["0", "%30", "00"]),
    ([True, "True", None, "None", 1.5, "1.5"], ["True", "%54rue", "None", "%4Eone", "1.5", "%31.5"]),
    (["a/b", "%", "%30"], ["a%2Fb", "%25", "%2530"]),
])
def test_key_names(keys, names):
    assert key_names(keys) == names


@pytest.mark.parametrize("case", sorted(COLLIDING))
def test_colliding_keys_get_distinct_names_and_paths(case):
    for state in ({"extra": COLLIDING[case]}, COLLIDING[case]):  # nested and at the root
        flat = flatten_state(state)
        assert len(set(flat.key_paths)) == len(flat.key_paths) == len(flat.leaves)
        assert len(set(flat.paths)) == len(flat.paths)


def test_names_of_existing_checkpoints_are_unchanged():
    state = {"model": OrderedDict(w=torch.ones(1)), "optimizer": {"state": {0: {"exp_avg": torch.ones(1)}},
                                                                  "param_groups": [{"params": [0]}]}}
    assert flatten_state(state).key_paths == ["model/w", "optimizer/state/0/exp_avg"]


def test_metadata_has_its_own_path():
    value: OrderedDict = OrderedDict(_metadata=torch.zeros(1))
    value._metadata = {"": torch.ones(1)}  # type: ignore[attr-defined]
    found = leaves_of({"m": value})
    assert [p for p, _, _ in found] == [("m", "_metadata"), ("m", METADATA, "")]
    assert len({n for _, n, _ in found}) == 2


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(state=tricky_states())
def test_store_round_trip_of_tricky_keys_is_exact_also_as_a_delta(tmp_path_factory, state):
    flat = flatten_state(state)
    assert len(set(flat.key_paths)) == len(flat.key_paths)
    store = CheckpointStore(str(tmp_path_factory.mktemp("keys")), codec="rcfz", full_every=4)
    store.save(1, state)
    later = _plus(state, 100.0)  # same structure, new values: saved as a delta against step 1
    store.save(2, later)
    assert_same_state(state, store.load(1))
    assert_same_state(later, store.load(2))


@settings(max_examples=80, deadline=None)
@given(state=tricky_states())
def test_a_snapshot_of_tricky_keys_is_exact_and_shares_no_buffer(state):
    snapshotter = Snapshotter("cpu")
    try:
        for offset in (0.0, 100.0):  # the second snapshot reuses the first one's buffers
            live = _plus(state, offset)
            snapshot = snapshotter.take(1, {"extra": live}, {"extra"})
            snapshot.copies.wait()
            assert_same_state({"extra": live}, snapshot.state)
        pointers = [leaf.data_ptr() for _, _, leaf in leaves_of(snapshot.state)]
        assert len(set(pointers)) == len(pointers)
    finally:
        snapshotter.close()


@pytest.mark.parametrize("case", sorted(COLLIDING))
def test_checkfreq_never_mixes_colliding_keys(tmp_path, case):
    holder = _Holder(COLLIDING[case])
    model = torch.nn.Linear(2, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    store = CheckpointStore(str(tmp_path), codec="rcfz", full_every=3)
    cf = CheckFreq(model=model, optimizer=opt, storage=store, every=1, extra_state={"holder": holder})
    cf.restore()
    for _ in range(3):
        opt.step()
        cf.step()
    cf.flush()
    for ref in store.list():
        assert_same_state(COLLIDING[case], store.load(ref)["extra"]["holder"])
    cf.close()


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(state=tricky_states())
def test_checkfreq_checkpoints_of_tricky_keys_are_exact(tmp_path_factory, state):
    holder = _Holder(state)
    model = torch.nn.Linear(2, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    store = CheckpointStore(str(tmp_path_factory.mktemp("cf")), codec="rcfz", full_every=3)
    with CheckFreq(model=model, optimizer=opt, storage=store, every=1, extra_state={"holder": holder}) as cf:
        cf.restore()
        for offset in (0.0, 100.0):
            holder.state = _plus(state, offset)
            opt.step()
            cf.step()
    loaded = [store.load(ref)["extra"]["holder"] for ref in store.list()]
    assert len(loaded) == 2
    assert_same_state(state, loaded[0])
    assert_same_state(_plus(state, 100.0), loaded[1])


@pytest.mark.parametrize("case", sorted(COLLIDING))
def test_safetensors_export_keeps_every_leaf(tmp_path, case):
    from safetensors.torch import load_file

    state = {"extra": COLLIDING[case], "__metadata__": torch.full((2,), 7.0)}
    target = str(tmp_path / "out.safetensors")
    write_safetensors(state, target)
    loaded = load_file(target)
    flat = flatten_state(state)
    assert len(loaded) == len(flat.leaves)
    for name, leaf in zip(flat.key_paths, flat.leaves):
        assert torch.equal(loaded[name if name != "__metadata__" else "%5F_metadata__"], leaf)


class _Holder:
    def __init__(self, state: dict) -> None:
        self.state = state

    def state_dict(self) -> dict:
        return self.state

    def load_state_dict(self, state: dict) -> None:
        self.state = state


def _plus(value, offset: float):
    return map_tensors(value, lambda t: t + offset)


def test_checkpoints_written_with_colliding_names_still_load(tmp_path, monkeypatch):
    """Before names were unique, {0: x, "0": y} stored two tensors named "extra/0"; those
    checkpoints (format 1) must still load exactly."""
    from legacy_writer import write_format_1

    from ray_checkfreq.storage import tree

    state = COLLIDING["int_and_str"]
    with monkeypatch.context() as patch:
        patch.setattr(tree, "key_names", lambda keys, parent="": [str(k) for k in keys])
        flats = [flatten_state({"extra": value}) for value in (state, _plus(state, 100.0))]
        assert len(set(flats[0].key_paths)) == 1
    for step, flat in enumerate(flats, start=1):
        write_format_1(str(tmp_path / f"step-{step:012d}-g000001-0000000{step}"), step, None, writer_generation=1,
                       flat=flat)
    reader = CheckpointStore(str(tmp_path))
    assert_same_state({"extra": state}, reader.load(1))
    assert_same_state({"extra": _plus(state, 100.0)}, reader.load(2))
