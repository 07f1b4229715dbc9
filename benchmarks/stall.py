"""``ray-checkfreq bench stall``: the training loop's stall per checkpoint, four ways, one run.

A ~100 M-parameter MLP with Adam state (about 1.2 GB in all) trains on random data; every
``--every`` iterations it checkpoints with, in turn:

- ``torch.save + fsync``: synchronous, on the critical path;
- ``dcp.async_save``: PyTorch's own async checkpoint (stages to CPU memory, writes in a thread);
- ``background persist``: a full in-memory copy on the critical path, then CheckpointStore in
  a thread (phase 2 only);
- ``checkfreq``: the two-phase engine (copy overlapped with the next forward/backward, a
  fence at the next optimizer step, persist in the background).

"stall" is the median time the loop spends inside one checkpoint call, waiting for the
previous checkpoint and, for CheckFreq, at the fence. "slowdown" is the loop's extra wall
time per checkpoint against a run without checkpoints right before it (the median over
``--repeats`` such pairs); on a CPU-only machine it also includes the cores the
background copy and write take from training. CheckFreq runs with ``every``, compression
decided by measurement, as a user who fixes k gets it.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import threading
import time
from collections.abc import Callable
from typing import Any

import torch

from benchmarks.harness import add_json_argument, write_json
from ray_checkfreq.engine import CheckFreq
from ray_checkfreq.engine.snapshot import tensors_in
from ray_checkfreq.storage import CheckpointStore


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--params-m", type=float, default=100, help="model size in millions of parameters")
    parser.add_argument("--batch", type=int, default=256, help="batch size (sets the iteration time)")
    parser.add_argument("--every", type=int, default=4, help="checkpoint interval in iterations")
    parser.add_argument("--checkpoints", type=int, default=3, help="checkpoints measured per method")
    parser.add_argument("--repeats", type=int, default=1, help="baseline + method pairs per method")
    parser.add_argument("--dir", default=None, help="where to write (default: a temp dir)")
    parser.add_argument("--device", default="cpu", help="where the model trains: cpu or cuda")
    add_json_argument(parser)


def build(params_m: float, device: str = "cpu") -> tuple[torch.nn.Module, torch.optim.Optimizer, int]:
    width = 2048
    layers = max(1, round(params_m * 1e6 / (width * width + width)))
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(width, width), torch.nn.ReLU())
                                  for _ in range(layers)]).to(device)
    return model, torch.optim.Adam(model.parameters(), lr=1e-4), width


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def train_step(model: torch.nn.Module, opt: torch.optim.Optimizer, inputs: torch.Tensor) -> None:
    opt.zero_grad(set_to_none=False)
    model(inputs).square().mean().backward()
    opt.step()


def _state(model: torch.nn.Module, opt: torch.optim.Optimizer) -> dict:
    return {"model": model.state_dict(), "optimizer": opt.state_dict()}


class Method:
    """One way of checkpointing: ``checkpoint(step)`` is on the critical path."""

    name = ""

    def __init__(self, model: torch.nn.Module, opt: torch.optim.Optimizer, root: str) -> None:
        self.model, self.opt, self.root = model, opt, root
        self.stalls: list[float] = []

    def checkpoint(self, step: int) -> None:
        raise NotImplementedError

    def after_step(self, step: int) -> None:
        pass

    def finish(self) -> None:
        pass


class TorchSave(Method):
    name = "torch.save + fsync"

    def checkpoint(self, step: int) -> None:
        start = time.perf_counter()
        with open(os.path.join(self.root, f"ckpt-{step}.pt"), "wb") as f:
            torch.save(_state(self.model, self.opt), f)
            f.flush()
            os.fsync(f.fileno())
        self.stalls.append(time.perf_counter() - start)


class DcpAsync(Method):
    name = "dcp.async_save"

    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        self.future: Any = None

    def checkpoint(self, step: int) -> None:
        import torch.distributed.checkpoint as dcp

        start = time.perf_counter()
        if self.future is not None:
            self.future.result()
        self.future = dcp.async_save(_state(self.model, self.opt), checkpoint_id=os.path.join(self.root, f"dcp-{step}"),
                                     no_dist=True)
        self.stalls.append(time.perf_counter() - start)

    def finish(self) -> None:
        if self.future is not None:
            self.future.result()


class BackgroundPersist(Method):
    name = "background persist only"

    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        self.store = CheckpointStore(os.path.join(self.root, "bg"), keep_last=1)
        self.thread: threading.Thread | None = None

    def checkpoint(self, step: int) -> None:
        start = time.perf_counter()
        if self.thread is not None:
            self.thread.join()
        copy = {k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in self.model.state_dict().items()}
        opt_state = _clone_tree(self.opt.state_dict())
        self.thread = threading.Thread(target=self.store.save, args=(step, {"model": copy, "optimizer": opt_state}))
        self.thread.start()
        self.stalls.append(time.perf_counter() - start)

    def finish(self) -> None:
        if self.thread is not None:
            self.thread.join()


class TwoPhase(Method):
    name = "checkfreq (two-phase)"

    def __init__(self, model, opt, root, every: int) -> None:
        super().__init__(model, opt, root)
        self.cf = CheckFreq(model=model, optimizer=opt, storage=CheckpointStore(os.path.join(root, "cf"), keep_last=1),
                            every=every)
        self.cf.restore()
        self._seen = 0

    def checkpoint(self, step: int) -> None:
        pass  # the engine decides inside after_step

    def after_step(self, step: int) -> None:
        self.cf.step()

    def finish(self) -> None:
        self.cf.close()
        self.stalls = [self.cf.stats()["stall_s_median"]]


def _clone_tree(value):
    if isinstance(value, torch.Tensor):
        return value.clone()
    if isinstance(value, dict):
        return {k: _clone_tree(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_clone_tree(v) for v in value]
    return value


def run_loop(model, opt, inputs, iterations: int, every: int, method: Method | None) -> float:
    _sync(str(inputs.device))
    start = time.perf_counter()
    for step in range(1, iterations + 1):
        train_step(model, opt, inputs)
        if method is not None:
            method.after_step(step)
            if step % every == 0:
                method.checkpoint(step)
    if method is not None:
        method.finish()
    _sync(str(inputs.device))
    return time.perf_counter() - start


def run(args: argparse.Namespace) -> int:
    for name in ("batch", "every", "checkpoints", "repeats"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name} {getattr(args, name)}: must be >= 1")
    if not args.params_m > 0:
        raise ValueError(f"--params-m {args.params_m}: must be > 0")
    model, opt, width = build(args.params_m, args.device)
    params = sum(p.numel() for p in model.parameters())
    inputs = torch.randn(args.batch, width, device=args.device)
    root = args.dir or tempfile.mkdtemp(prefix="rcf-stall-")
    iterations = args.every * args.checkpoints
    run_loop(model, opt, inputs, 2, args.every, None)  # warm-up: Adam state allocated
    state_bytes = sum(t.numel() * t.element_size() for t in tensors_in(_state(model, opt)))
    baseline = run_loop(model, opt, inputs, iterations, args.every, None)
    step_s = baseline / iterations
    factories: list[Callable[[], Method]] = [
        lambda: TorchSave(model, opt, root),
        lambda: DcpAsync(model, opt, root),
        lambda: BackgroundPersist(model, opt, root),
        lambda: TwoPhase(model, opt, root, args.every),
    ]
    results = {}
    for factory in factories:
        stalls, slowdowns = [], []
        for _ in range(args.repeats):
            baseline = run_loop(model, opt, inputs, iterations, args.every, None)
            method = factory()
            wall = run_loop(model, opt, inputs, iterations, args.every, method)
            stalls.append(statistics.median(method.stalls) if method.stalls else 0.0)
            slowdowns.append((wall - baseline) / args.checkpoints)  # signed: noise shows as such
            _clean(root)
        results[method.name] = {"stall_s": statistics.median(stalls), "slowdown_s": statistics.median(slowdowns)}
    if not args.dir:
        shutil.rmtree(root, ignore_errors=True)
    _print(params, state_bytes, step_s, args, results)
    write_json(args.json, {"params": params, "state_bytes": state_bytes, "step_s": step_s, "every": args.every,
                       "results": results})
    return 0


def _print(params: int, state_bytes: int, step_s: float, args: argparse.Namespace, results: dict) -> None:
    two_phase = results["checkfreq (two-phase)"]["stall_s"]
    print(f"model: {params / 1e6:.0f} M parameters, Adam; state {state_bytes / 2**20:.0f} MiB; "
          f"step {step_s * 1e3:.0f} ms (batch {args.batch}); checkpoint every {args.every} steps, "
          f"{args.checkpoints} checkpoints per method; {os.cpu_count()} cores; device {_device_name(args.device)}")
    print(f"{'method':<26} {'stall/ckpt':>11} {'vs two-phase':>13} {'slowdown/ckpt':>14}   (medians)")
    for name, fig in results.items():
        ratio = fig["stall_s"] / two_phase if two_phase > 0 else float("inf")
        print(f"{name:<26} {fig['stall_s'] * 1e3:>8.1f} ms {ratio:>12.1f}x {fig['slowdown_s'] * 1e3:>11.0f} ms")


def _device_name(device: str) -> str:
    if device.startswith("cuda"):
        return torch.cuda.get_device_name(torch.device(device))
    return "CPU (no GPU)" if not torch.cuda.is_available() else "CPU"


def _clean(root: str) -> None:
    for name in os.listdir(root):
        path = os.path.join(root, name)
        shutil.rmtree(path, ignore_errors=True) if os.path.isdir(path) else os.unlink(path)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    add_arguments(parser)
    raise SystemExit(run(parser.parse_args()))
