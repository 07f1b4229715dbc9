"""The state ``bench restore`` restores: an MLP and its Adam state, rebuilt bit for bit anywhere.

Every process (the driver, each actor) builds the same reference state from ``state_mb``
alone, so a restore is checked against the original without shipping it around. A restore
target is a fresh model and optimizer whose tensors exist already (Adam's state made by
one step); restoring copies into them, as a resumed training job's ``load_state_dict`` does.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from typing import Any

import torch

from ray_checkfreq.ray import slots
from ray_checkfreq.storage.tree import flatten_state, unflatten_state

MiB = 1024 * 1024
_SEED = 20260


@contextlib.contextmanager
def single_threaded_torch() -> Iterator[None]:
    """torch intra-op threads set to 1 while inside (restored after)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def mlp_shape(state_mb: int) -> tuple[int, int]:
    """(width, layers) of square Linear layers whose weights + Adam's two moments fill ~state_mb MiB."""
    params = max(1, state_mb * MiB // 12)  # fp32 weight, exp_avg, exp_avg_sq: 12 bytes per parameter
    width = min(1024, max(16, int((params / 4) ** 0.5)))
    layers = max(1, round(params / (width * width + width)))
    return width, layers


def build(state_mb: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """The reference model and optimizer: deterministic weights, one Adam step with fixed gradients."""
    width, layers = mlp_shape(state_mb)
    model = torch.nn.Sequential(*(torch.nn.Linear(width, width) for _ in range(layers)))
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    generator = torch.Generator().manual_seed(_SEED)
    with torch.no_grad():
        for param in model.parameters():
            param.copy_(torch.randn(param.shape, generator=generator))
            param.grad = torch.randn(param.shape, generator=generator)
    optimizer.step()
    model.zero_grad(set_to_none=True)
    return model, optimizer


def reference_state(state_mb: int) -> dict[str, Any]:
    model, optimizer = build(state_mb)
    return {"model": model.state_dict(), "optimizer": optimizer.state_dict()}


def state_bytes(state: Any) -> int:
    return sum(leaf.numel() * leaf.element_size() for leaf in flatten_state(state).leaves
               if isinstance(leaf, torch.Tensor))


class Target:
    """A fresh model + optimizer of the same shape, its tensors preallocated."""

    def __init__(self, state_mb: int) -> None:
        self.model, self.optimizer = build(state_mb)
        self.scramble()

    def scramble(self) -> None:
        """Zero every tensor, so a restore that copies nothing is caught by ``equals``."""
        with torch.no_grad():
            for tensor in self._tensors():
                tensor.zero_()

    def load(self, state: Any) -> None:
        """One copy per tensor into the existing ones (``optimizer.load_state_dict`` would alias them)."""
        self.model.load_state_dict(state["model"])
        saved = state["optimizer"]
        params = [p for group in self.optimizer.param_groups for p in group["params"]]
        with torch.no_grad():
            for index, values in saved["state"].items():
                current = self.optimizer.state[params[int(index)]]
                for key, value in values.items():
                    current[key].copy_(torch.as_tensor(value))
        for group, saved_group in zip(self.optimizer.param_groups, saved["param_groups"]):
            group.update({k: v for k, v in saved_group.items() if k != "params"})

    def equals(self, reference: dict[str, Any]) -> bool:
        """Bit-identical to ``reference`` (every tensor's bytes, and the param groups)."""
        mine = {"model": self.model.state_dict(), "optimizer": self.optimizer.state_dict()}
        ours, theirs = flatten_state(mine), flatten_state(reference)
        if ours.skeleton != theirs.skeleton or len(ours.leaves) != len(theirs.leaves):
            return False
        return all(_same_bits(a, b) for a, b in zip(ours.leaves, theirs.leaves))

    def _tensors(self) -> list[torch.Tensor]:
        state = self.optimizer.state.values()
        return [*self.model.parameters(), *(t for values in state for t in values.values())]


def _same_bits(a: Any, b: Any) -> bool:
    if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)):
        return bool(type(a) is type(b) and (a == b).all())
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    return bool(torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8)))


def write_slot(path: str, state: dict[str, Any], *, step: int = 1) -> slots.MappedSlot:
    """A new COMPLETE slot file at ``path`` holding ``state`` (tensors in its data region)."""
    flat = flatten_state(state)
    tensors = [(p, tuple(leaf.shape), leaf.dtype) for p, leaf in zip(flat.paths, flat.leaves)
               if isinstance(leaf, torch.Tensor)]
    layout = slots.slot_layout(tensors)
    slots.create_slot_file(path, run="bench-restore", node=f"pid{os.getpid()}", incarnation=0,
                           data_capacity=slots.data_capacity_for(layout),
                           meta_capacity=slots.meta_capacity_for(layout))
    slot = slots.MappedSlot.open(path)
    views = slot.begin_write(step=step, generation=1, layout=layout)
    leaves = []
    for p, leaf in zip(flat.paths, flat.leaves):
        if isinstance(leaf, torch.Tensor):
            views[p].copy_(leaf)
            leaf = views[p]
        leaves.append(leaf)
    slot.finish_write(unflatten_state(flat.skeleton, leaves))
    return slot


def slot_directory(nbytes: int) -> str:
    """``/dev/shm`` when it has room for the slot files (with a margin), else the temp dir."""
    try:
        if slots.shm_free_bytes("/dev/shm") > 4 * nbytes + 256 * MiB:
            return "/dev/shm"
    except OSError:
        pass
    import tempfile

    return tempfile.gettempdir()
