"""``ray-checkfreq bench overhead``: overhead at the policy's k, and the adaptive rate.

Part 1: the same loop with and without CheckFreq (p = ``--overhead``), the policy choosing
k after its profiling window; prints the measured overhead (with and without the one-off
profiling), k and checkpoints per epoch.

Part 2 (the paper's Table 5, both directions): storage is slowed down (``--slow-s`` extra
seconds per checkpoint write) for the middle third of the run, then restored. A fixed k
(the policy's first choice, never adapted) is compared with the adaptive rate: overhead
per phase and k at the end of each phase.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time

import torch

from ray_checkfreq.engine import CheckFreq
from ray_checkfreq.storage import CheckpointStore


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--iterations", type=int, default=900, help="iterations per run (part 1)")
    parser.add_argument("--epoch-len", type=int, default=1000, help="iterations per epoch")
    parser.add_argument("--overhead", type=float, default=0.035, help="allowed overhead p")
    parser.add_argument("--width", type=int, default=1024, help="MLP width (sets model size and step time)")
    parser.add_argument("--phase-iters", type=int, default=600, help="iterations per phase (part 2)")
    parser.add_argument("--slow-s", type=float, default=0.6, help="extra seconds per write while storage is slow")
    parser.add_argument("--json", default=None, help="write the figures to this file")


class ThrottledStore(CheckpointStore):
    """A CheckpointStore whose writes take ``extra_s`` longer while ``slow`` is set."""

    slow = False
    extra_s = 0.0

    def save(self, *args, **kwargs):
        ref = super().save(*args, **kwargs)
        if self.slow:
            time.sleep(self.extra_s)
        return ref


def _model(width: int) -> tuple[torch.nn.Module, torch.optim.Optimizer, torch.Tensor]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(width, width), torch.nn.ReLU(), torch.nn.Linear(width, width),
                                torch.nn.ReLU(), torch.nn.Linear(width, 16))
    return model, torch.optim.Adam(model.parameters(), lr=1e-4), torch.randn(64, width)


def _step(model, opt, inputs) -> None:
    opt.zero_grad(set_to_none=False)
    model(inputs).square().mean().backward()
    opt.step()


def _timed_loop(model, opt, inputs, iterations: int, cf: CheckFreq | None, marks: dict | None = None) -> list[float]:
    """Per-iteration wall times; ``marks[i]`` runs before iteration i (a phase change)."""
    times = []
    for it in range(iterations):
        if marks and it in marks:
            marks[it]()
        start = time.perf_counter()
        _step(model, opt, inputs)
        if cf is not None:
            cf.step()
        times.append(time.perf_counter() - start)
    return times


def part_overhead(args: argparse.Namespace, root: str) -> dict:
    model, opt, inputs = _model(args.width)
    _timed_loop(model, opt, inputs, 20, None)
    before = sum(_timed_loop(model, opt, inputs, args.iterations, None))
    cf = CheckFreq(model=model, optimizer=opt, storage=f"{root}/overhead", overhead=args.overhead,
                   epoch_len=args.epoch_len)
    cf.restore()
    with_cf = sum(_timed_loop(model, opt, inputs, args.iterations, cf))
    cf.close()
    after = sum(_timed_loop(model, opt, inputs, args.iterations, None))
    baseline = (before + after) / 2
    stats = cf.stats()
    return {
        "baseline_s": baseline,
        "checkfreq_s": with_cf,
        "profiling_s": stats["profiling_s"],
        "overhead": (with_cf - stats["profiling_s"] - baseline) / baseline,
        "overhead_with_profiling": (with_cf - baseline) / baseline,
        "k": stats["k"],
        "policy_k": cf.decision.k,
        "mode": stats["mode"],
        "compress": stats["compress"],
        "checkpoints": stats["checkpoints_committed"],
        "checkpoints_per_epoch": args.epoch_len / stats["k"],
        "k_changes": stats["k_changes"],
    }


def part_adaptive(args: argparse.Namespace, root: str, adaptive: bool) -> dict:
    model, opt, inputs = _model(args.width)
    _timed_loop(model, opt, inputs, 20, None)
    reference = sum(_timed_loop(model, opt, inputs, 200, None)) / 200
    store = ThrottledStore(f"{root}/adaptive-{adaptive}", keep_last=2)
    store.extra_s = args.slow_s
    cf = CheckFreq(model=model, optimizer=opt, storage=store, overhead=args.overhead, epoch_len=args.epoch_len,
                   adaptive=adaptive)
    cf.restore()
    n = args.phase_iters
    ks: list[int] = []

    def phase(slow: bool):
        def change():
            ks.append(cf.stats()["k"])
            store.slow = slow
        return change

    times = _timed_loop(model, opt, inputs, 3 * n, cf, marks={n: phase(True), 2 * n: phase(False)})
    ks.append(cf.stats()["k"])
    cf.close()
    skip = cf.config.profiling_window() + 1
    phases = [times[skip:n], times[n:2 * n], times[2 * n:]]
    return {
        "adaptive": adaptive,
        "reference_iter_s": reference,
        "overhead_per_phase": [sum(p) / (len(p) * reference) - 1 for p in phases],
        "k_at_phase_end": ks,
        "k_changes": cf.stats()["k_changes"],
    }


def run(args: argparse.Namespace) -> int:
    if not 0 < args.overhead < 1:
        raise ValueError(f"--overhead {args.overhead}: must be a fraction in (0, 1)")
    root = tempfile.mkdtemp(prefix="rcf-overhead-")
    first = part_overhead(args, root)
    fixed = part_adaptive(args, root, adaptive=False)
    adaptive = part_adaptive(args, root, adaptive=True)
    _print(args, first, fixed, adaptive)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"overhead": first, "fixed": fixed, "adaptive": adaptive}, f, indent=2)
    return 0


def _print(args: argparse.Namespace, first: dict, fixed: dict, adaptive: dict) -> None:
    print(f"part 1: p = {args.overhead:.1%}, {args.iterations} iterations, epoch = {args.epoch_len} iterations")
    print(f"  baseline {first['baseline_s']:.2f} s, with CheckFreq {first['checkfreq_s']:.2f} s "
          f"(profiling {first['profiling_s']:.2f} s once)")
    print(f"  mode {first['mode']}, compression {'on' if first['compress'] else 'off'}, policy k {first['policy_k']}, "
          f"final k {first['k']}, {first['checkpoints']} checkpoints, {first['checkpoints_per_epoch']:.0f} per epoch")
    print(f"  overhead {first['overhead']:.2%} (with the one-off profiling: {first['overhead_with_profiling']:.2%})")
    print(f"part 2: storage {args.slow_s:.1f} s slower per write during phase 2; {args.phase_iters} iterations a phase")
    print(f"  {'':<10} {'phase 1 (normal)':>18} {'phase 2 (slow)':>18} {'phase 3 (normal)':>18}")
    for name, result in (("fixed k", fixed), ("adaptive", adaptive)):
        cells = [f"{o:>7.1%}  k={k:<5}" for o, k in zip(result["overhead_per_phase"], result["k_at_phase_end"])]
        print(f"  {name:<10} " + " ".join(f"{c:>18}" for c in cells))


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    add_arguments(parser)
    raise SystemExit(run(parser.parse_args()))
