"""DALI front end: an ``nvidia.dali`` pipeline fed by the core through ``external_source``.

``DaliSource.read(index, rng)`` returns one sample's inputs as numpy arrays, including
any random augmentation parameters, drawn from ``rng`` (the sample's own generator,
seeded by (seed, epoch, index)). ``DaliSource.graph(*inputs)`` builds the pipeline from
the external-source nodes. DALI's own random operators are seeded per pipeline, not per
sample, so a resumed run only reproduces augmentations whose parameters come in this way.

The pipeline runs unpipelined with a prefetch depth of 1: each ``run()`` consumes exactly
the batch fed before it, so the cursor never runs ahead of what the caller received.
``device_id=None`` builds a CPU pipeline; with a GPU id, outputs are copied to the host
for the torch conversion (``as_cpu``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from ray_checkfreq.data.core import RankSlice, Sharding
from ray_checkfreq.data.iterator import ResumableIterator, wants_keys
from ray_checkfreq.data.order import FullOrder, Order, take_slices
from ray_checkfreq.data.seeds import SampleKeys, sample_rng


@dataclass(frozen=True, kw_only=True)
class DaliSource:
    num_samples: int
    read: Callable[[int, np.random.Generator], tuple[np.ndarray, ...]]
    graph: Callable[..., Any]
    num_inputs: int
    output_names: tuple[str, ...]
    num_threads: int = 1
    device_id: int | None = None

    def __post_init__(self) -> None:
        if self.num_samples < 0:
            raise ValueError(f"num_samples must be >= 0, got {self.num_samples}")
        if self.num_inputs < 1:
            raise ValueError(f"num_inputs must be >= 1, got {self.num_inputs}")
        if not self.output_names:
            raise ValueError("output_names must name at least one output, got ()")
        if self.num_threads < 1:
            raise ValueError(f"num_threads must be >= 1, got {self.num_threads}")


def _input_name(i: int) -> str:
    return f"rcf_input_{i}"


def build_pipeline(source: DaliSource, max_batch_size: int) -> Any:
    from nvidia.dali import fn
    from nvidia.dali.pipeline import Pipeline

    pipe = Pipeline(
        batch_size=max_batch_size,
        num_threads=source.num_threads,
        device_id=source.device_id,
        exec_async=False,
        exec_pipelined=False,
        prefetch_queue_depth=1,
    )
    with pipe:
        inputs = [fn.external_source(name=_input_name(i)) for i in range(source.num_inputs)]
        outputs = source.graph(*inputs)
        outputs = outputs if isinstance(outputs, (tuple, list)) else (outputs,)
        if len(outputs) != len(source.output_names):
            raise ValueError(
                f"graph returned {len(outputs)} outputs, output_names has {len(source.output_names)}"
            )
        pipe.set_outputs(*outputs)
    pipe.build()
    return pipe


def _to_numpy(tensor_list: Any) -> np.ndarray:
    if hasattr(tensor_list, "as_cpu"):
        tensor_list = tensor_list.as_cpu()
    return np.array(tensor_list.as_array())


class DaliIterator(ResumableIterator):
    """Resumable batches (dict output name -> tensor) from a DALI pipeline."""

    def __init__(
        self,
        source: DaliSource,
        *,
        sharding: Sharding,
        seed: int = 0,
        shuffle: bool = True,
        transform: Callable[..., Any] | None = None,
    ) -> None:
        super().__init__(num_samples=source.num_samples, sharding=sharding, seed=seed, shuffle=shuffle)
        self.source = source
        self.transform = transform
        self._pipe: Any = None

    def _order(self, epoch: int) -> Order:
        return FullOrder(
            num_samples=self.num_samples, seed=self.seed, epoch=epoch, shuffle=self.shuffle, version=self.order_version
        )

    def _pipeline(self) -> Any:
        if self._pipe is None:
            self._pipe = build_pipeline(self.source, self.sharding.batch_size)
        return self._pipe

    def _produce(self, order: Order, epoch: int, slices: Sequence[RankSlice]) -> Iterator[dict[str, Any]]:
        assert isinstance(order, FullOrder)
        pipe = self._pipeline()
        for indices in take_slices(order, slices):
            samples = [self._read(int(i), epoch) for i in indices]
            for k in range(self.source.num_inputs):
                pipe.feed_input(_input_name(k), [np.asarray(s[k]) for s in samples])
            outputs = pipe.run()
            batch = {name: torch.from_numpy(_to_numpy(out)) for name, out in zip(self.source.output_names, outputs)}
            if self.transform is not None:
                keys = SampleKeys(self.seed, epoch, indices)
                batch = self.transform(batch, keys) if wants_keys(self.transform) else self.transform(batch)
            yield batch

    def _read(self, index: int, epoch: int) -> tuple[np.ndarray, ...]:
        sample = self.source.read(index, sample_rng(self.seed, epoch, index))
        sample = sample if isinstance(sample, tuple) else (sample,)
        if len(sample) != self.source.num_inputs:
            raise ValueError(f"read({index}) returned {len(sample)} arrays, num_inputs is {self.source.num_inputs}")
        return sample
