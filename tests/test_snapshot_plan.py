"""The snapshot plan (engine/snapshot_plan.py): a sharded snapshot's view of the state,
reused while the live objects stay the same, is always the view a full build gives now.

FSDP2 on a one-rank gloo group in this process (the plan does not depend on the boxes;
the sharded engine's tests run it on 2-4 ranks).
"""

from __future__ import annotations

import gc
import weakref
from collections.abc import Iterator
from pathlib import Path

import pytest
import sharded_state_jobs as jobs
import torch
import torch.distributed as dist
from hypothesis import given, settings
from hypothesis import strategies as st

from ray_checkfreq.engine.snapshot_plan import LocalViews, SnapshotView
from ray_checkfreq.engine.state import state_adapter
from ray_checkfreq.storage.tree import flatten_state


@pytest.fixture(scope="module", autouse=True)
def one_rank_group(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    assert not dist.is_initialized(), "another test left a default process group behind"
    rendezvous = tmp_path_factory.mktemp("pg") / "rendezvous"
    dist.init_process_group("gloo", init_method=f"file://{rendezvous}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def _training(seed: int = 0) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    model = jobs.sharded_net(seed=seed)
    opt = jobs.optimizer_of(model)
    jobs.train(model, opt, range(1), rank=0, world=1)  # the optimizer's state exists
    return model, opt


def _described(view: SnapshotView) -> tuple:
    """Everything a snapshot reads from a view: its skeleton (non-tensor leaves included),
    each tensor leaf's path and memory, which keys are parameters, and the places."""
    flat = flatten_state(view.state)
    memory = [(leaf.data_ptr(), tuple(leaf.shape), leaf.stride(), leaf.dtype) for leaf in flat.leaves]
    return flat.skeleton, flat.paths, memory, view.param_keys, dict(view.places)


def _fresh(model: torch.nn.Module, opt: torch.optim.Optimizer) -> tuple:
    view = LocalViews(state_adapter(model, opt)).take()  # a new LocalViews always builds
    return _described(view)


def _reused(views: LocalViews) -> tuple:
    view = views.take()
    try:
        return _described(view)
    finally:
        view.release()


# ------------------------------------------------------------------ what changes between two checkpoints
def _train(model: torch.nn.Module, opt: torch.optim.Optimizer, step: int) -> None:
    jobs.train(model, opt, range(step, step + 1), rank=0, world=1)


def _new_lr(model: torch.nn.Module, opt: torch.optim.Optimizer, step: int) -> None:
    for group in opt.param_groups:
        group["lr"] = 1e-3 * (step + 1)


def _reloaded_optimizer(model: torch.nn.Module, opt: torch.optim.Optimizer, step: int) -> None:
    saved = opt.state_dict()
    saved["state"] = {key: {name: value.clone() for name, value in entry.items()}
                      for key, entry in saved["state"].items()}
    opt.load_state_dict(saved)  # new state tensors, same values


def _replaced_buffer(model: torch.nn.Module, opt: torch.optim.Optimizer, step: int) -> None:
    model.scale = model.scale.clone() + step  # a new buffer object


def _swapped_storage(model: torch.nn.Module, opt: torch.optim.Optimizer, step: int) -> None:
    model.scale.data = model.scale.clone() * 2  # the same buffer object, other memory


def _new_hyper_parameter(model: torch.nn.Module, opt: torch.optim.Optimizer, step: int) -> None:
    opt.param_groups[0][f"extra{step}"] = float(step)


CHANGES = [_train, _new_lr, _reloaded_optimizer, _replaced_buffer, _swapped_storage, _new_hyper_parameter]


@settings(max_examples=40, deadline=None)
@given(st.lists(st.sampled_from(CHANGES), max_size=8))
def test_a_reused_view_is_the_view_a_full_build_gives_now(changes: list) -> None:
    model, opt = _training()
    views = LocalViews(state_adapter(model, opt))
    assert _reused(views) == _fresh(model, opt)
    for step, change in enumerate(changes, start=1):
        change(model, opt, step)
        assert _reused(views) == _fresh(model, opt), change.__name__


def test_training_in_place_builds_once_and_reuses_the_plan() -> None:
    model, opt = _training()
    views = LocalViews(state_adapter(model, opt))
    for step in range(1, 6):
        _train(model, opt, step)
        _new_lr(model, opt, step)
        assert _reused(views) == _fresh(model, opt)
    assert (views.builds, views.reuses) == (1, 4)
    _reloaded_optimizer(model, opt, 6)
    _reused(views)
    assert views.builds == 2


class _Counted(torch.nn.Module):
    """A module whose state holds a count that changes without any tensor changing."""

    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def get_extra_state(self) -> dict:
        self.calls += 1
        return {"calls": self.calls}

    def set_extra_state(self, state: dict) -> None:
        self.calls = state["calls"]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x


def test_a_view_the_plan_could_not_reproduce_is_built_every_time() -> None:
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), _Counted())
    fully_shard(model)
    opt = torch.optim.Adam(model.parameters())
    model(torch.randn(2, 4)).sum().backward()
    opt.step()
    views = LocalViews(state_adapter(model, opt))
    counts = []
    for _ in range(3):
        view = views.take()
        counts.append(view.state["model"]["1._extra_state"]["calls"])
        view.release()
    assert counts == sorted(set(counts)) and views.builds == 3 and views.reuses == 0


def test_the_plan_keeps_no_replaced_tensor_alive() -> None:
    model, opt = _training()
    views = LocalViews(state_adapter(model, opt))
    views.take().release()
    old = weakref.ref(next(iter(opt.state.values()))["exp_avg"]._local_tensor)  # what a view holds
    _reloaded_optimizer(model, opt, 1)
    gc.collect()
    assert old() is None
    assert _reused(views) == _fresh(model, opt) and views.builds == 2


def test_a_released_view_holds_no_tensor(tmp_path: Path) -> None:
    model, opt = _training()
    views = LocalViews(state_adapter(model, opt))
    view = views.take()
    assert flatten_state(view.state).leaves
    view.release()
    assert not flatten_state(view.state).leaves


def test_a_dtensor_placed_anew_over_the_same_memory_is_built_again() -> None:
    """A new spec over the same local memory: here a global shape twice as tall, so the
    local piece is no longer its box, which the full build refuses by name."""
    import dataclasses

    from torch.distributed.tensor._dtensor_spec import TensorMeta

    from ray_checkfreq.errors import UnsupportedStateError

    model, opt = _training()
    views = LocalViews(state_adapter(model, opt))
    views.take().release()
    weight = model.inp.weight
    meta = weight._spec.tensor_meta
    taller = TensorMeta(torch.Size([2 * meta.shape[0], *meta.shape[1:]]), meta.stride, meta.dtype)
    weight._spec = dataclasses.replace(weight._spec, tensor_meta=taller)
    with pytest.raises(UnsupportedStateError, match="inp.weight"):
        views.take()


def test_a_state_dict_hook_that_copies_keeps_no_plan_and_every_view_has_the_values_of_now() -> None:
    model, opt = _training()

    def copies(module: torch.nn.Module, state: dict, prefix: str, local_metadata: dict) -> None:
        state[f"{prefix}scale"] = state[f"{prefix}scale"].clone()

    model._register_state_dict_hook(copies)
    views = LocalViews(state_adapter(model, opt))
    for _ in range(2):
        with torch.no_grad():
            model.scale.add_(1.0)
        view = views.take()
        assert torch.equal(view.state["model"]["scale"], model.scale)
        view.release()
    assert (views.builds, views.reuses) == (2, 0)
