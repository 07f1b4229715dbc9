"""Retention honours ``protected_steps``: steps something outside the store points at."""

from __future__ import annotations

import logging
import pickle

import torch

from ray_checkfreq import CheckpointStore


class Pins:
    """A picklable ``protected_steps``: the steps in a set the test changes."""

    def __init__(self, *steps: int) -> None:
        self.steps = set(steps)

    def __call__(self) -> set[int]:
        return set(self.steps)


class Failing:
    def __call__(self) -> set[int]:
        raise OSError("pointer listing unreachable")


def steps_of(store: CheckpointStore) -> list[int]:
    return [ref.step for ref in store.list()]


def save_steps(store: CheckpointStore, steps: range) -> None:
    for step in steps:
        store.save(step, {"w": torch.full((64,), float(step))})


def test_a_protected_step_outlives_keep_last_until_its_pin_goes(tmp_path):
    pins = Pins(2)
    store = CheckpointStore(str(tmp_path), keep_last=1, keep_epoch_boundaries=False, full_every=1,
                            protected_steps=pins)
    save_steps(store, range(1, 6))
    assert steps_of(store) == [2, 5]
    assert torch.equal(store.load(2)["w"], torch.full((64,), 2.0))
    pins.steps.clear()  # the pointer went away: the step is an ordinary old checkpoint again
    save_steps(store, range(6, 7))
    assert steps_of(store) == [6]


def test_a_protected_delta_keeps_its_base(tmp_path):
    pins = Pins(3)
    store = CheckpointStore(str(tmp_path), keep_last=1, keep_epoch_boundaries=False, full_every=4,
                            protected_steps=pins)
    weights = torch.randn(4096)
    for step in range(1, 8):
        weights[step] += 1.0
        store.save(step, {"w": weights.clone()})
        if step == 3:
            expected = weights.clone()
    # 1 is the full base of delta 3; 5 is full, 7 a delta on 5
    assert steps_of(store) == [1, 3, 5, 7]
    assert torch.equal(store.load(3)["w"], expected)


def test_failing_protection_deletes_nothing(tmp_path, caplog):
    store = CheckpointStore(str(tmp_path), keep_last=1, keep_epoch_boundaries=False, full_every=1,
                            protected_steps=Failing())
    with caplog.at_level(logging.WARNING, logger="ray_checkfreq.storage"):
        save_steps(store, range(1, 4))
    assert steps_of(store) == [1, 2, 3]
    assert "protected_steps failed: pointer listing unreachable" in caplog.text


def test_protection_travels_with_the_store(tmp_path):
    """A node agent persists with a pickled store and ``with_writer``: both keep the pins."""
    store = CheckpointStore(str(tmp_path), keep_last=1, keep_epoch_boundaries=False, full_every=1,
                            protected_steps=Pins(1))
    writer = pickle.loads(pickle.dumps(store)).with_writer(store.acquire_writer())
    save_steps(writer, range(1, 4))
    assert steps_of(writer) == [1, 3]


def test_protected_steps_must_be_callable(tmp_path):
    import pytest

    with pytest.raises(TypeError, match="protected_steps"):
        CheckpointStore(str(tmp_path), protected_steps={1, 2})  # type: ignore[arg-type]
