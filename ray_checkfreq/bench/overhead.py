"""``ray-checkfreq bench overhead``: overhead at the policy's k, and the adaptive rate.

Iteration times drift by several percent between runs on a shared machine, more than
the 3.5 % to be measured. So every figure here comes from one interleaved run: two
identical models train in alternating blocks of ``--block`` iterations, one with
CheckFreq and one without, and overhead = time(with) / time(without) - 1 over the same
stretch of wall-clock time. At each switch from the CheckFreq block, ``cf.flush()`` lets
the in-flight checkpoint finish so that it does not run under the baseline's block (that
wait is not counted; at most one persist per block).

Part 1: p = ``--overhead``, the policy choosing k after its profiling window; prints the
overhead, k and checkpoints per epoch.

Part 2 (the paper's Table 5, both directions): storage is slowed (``--slow-s`` extra
seconds per checkpoint write) in the middle third of the run, then restored. The adaptive
rate against a fixed k (the k the adaptive run had settled on by the end of phase 1):
overhead per phase, and k at the end of each phase.
"""

from __future__ import annotations

import argparse
import copy
import json
import tempfile
import time
from collections.abc import Callable

import torch

from ray_checkfreq.engine import CheckFreq
from ray_checkfreq.storage import CheckpointStore


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--iterations", type=int, default=1500, help="CheckFreq iterations in part 1")
    parser.add_argument("--epoch-len", type=int, default=1000, help="iterations per epoch")
    parser.add_argument("--overhead", type=float, default=0.035, help="allowed overhead p")
    parser.add_argument("--width", type=int, default=1024, help="MLP width (sets model size and step time)")
    parser.add_argument("--block", type=int, default=100, help="iterations per interleaved block")
    parser.add_argument("--phase-iters", type=int, default=1600, help="CheckFreq iterations per phase (part 2)")
    parser.add_argument("--slow-s", type=float, default=3.0, help="extra seconds per write while storage is slow")
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


class Trainer:
    """One model + optimizer + batch, stepping with or without CheckFreq."""

    def __init__(self, width: int) -> None:
        torch.manual_seed(0)
        self.model = torch.nn.Sequential(torch.nn.Linear(width, width), torch.nn.ReLU(),
                                         torch.nn.Linear(width, width), torch.nn.ReLU(), torch.nn.Linear(width, 16))
        self.opt = torch.optim.Adam(self.model.parameters(), lr=1e-4)
        self.inputs = torch.randn(64, width)
        self.cf: CheckFreq | None = None

    def twin(self) -> Trainer:
        other = copy.copy(self)
        other.model = copy.deepcopy(self.model)
        other.opt = torch.optim.Adam(other.model.parameters(), lr=1e-4)
        other.cf = None
        return other

    def run(self, iterations: int) -> float:
        start = time.perf_counter()
        for _ in range(iterations):
            self.opt.zero_grad(set_to_none=False)
            self.model(self.inputs).square().mean().backward()
            self.opt.step()
            if self.cf is not None:
                self.cf.step()
        return time.perf_counter() - start


def interleaved(plain: Trainer, checked: Trainer, iterations: int, block: int,
                before_block: Callable[[int], None] | None = None) -> list[tuple[float, float]]:
    """Alternate blocks; returns (seconds without, seconds with) per block pair."""
    pairs = []
    done = 0
    while done < iterations:
        n = min(block, iterations - done)
        if before_block:
            before_block(done)
        with_cf = checked.run(n)
        checked.cf.flush()
        without = plain.run(n)
        pairs.append((without, with_cf))
        done += n
    return pairs


def _overhead(pairs: list[tuple[float, float]]) -> float:
    without = sum(p[0] for p in pairs)
    return sum(p[1] for p in pairs) / without - 1


def part_overhead(args: argparse.Namespace, root: str) -> dict:
    plain = Trainer(args.width)
    checked = plain.twin()
    plain.run(30)
    checked.run(30)
    checked.cf = CheckFreq(model=checked.model, optimizer=checked.opt, storage=f"{root}/overhead",
                           overhead=args.overhead, epoch_len=args.epoch_len)
    checked.cf.restore()
    window = checked.cf.config.profiling_window() + 1
    profiling = interleaved(plain, checked, window, window)  # the one-off profiling, apart
    pairs = interleaved(plain, checked, args.iterations - window, args.block)
    checked.cf.close()
    stats = checked.cf.stats()
    return {
        "iterations": args.iterations,
        "iter_s": sum(p[0] for p in pairs) / (args.iterations - window),
        "overhead": _overhead(pairs),
        "overhead_with_profiling": _overhead(pairs + profiling),
        "overhead_last_half": _overhead(pairs[len(pairs) // 2:]),
        "engine_estimate": stats["overhead_estimate"],
        "policy_k": checked.cf.decision.k,
        "k": stats["k"],
        "k_changes": stats["k_changes"],
        "mode": stats["mode"],
        "compress": stats["compress"],
        "checkpoints": stats["checkpoints_committed"],
        "checkpoints_per_epoch": args.epoch_len / stats["k"],
        "stall_s_per_checkpoint": stats["stall_s_per_checkpoint"],
    }


def part_adaptive(args: argparse.Namespace, root: str, every: int | None) -> dict:
    """``every=None``: the adaptive rate; else a fixed k."""
    plain = Trainer(args.width)
    checked = plain.twin()
    plain.run(30)
    checked.run(30)
    store = ThrottledStore(f"{root}/adaptive-{every}", keep_last=2)
    store.extra_s = args.slow_s
    checked.cf = CheckFreq(model=checked.model, optimizer=checked.opt, storage=store, overhead=args.overhead,
                           epoch_len=args.epoch_len, every=every)
    checked.cf.restore()
    if every is None:
        window = checked.cf.config.profiling_window() + 1
        interleaved(plain, checked, window, window)
    n = args.phase_iters
    phases, settled, ks = [], [], []
    for slow in (False, True, False):
        store.slow = slow
        pairs = interleaved(plain, checked, n, args.block)
        phases.append(_overhead(pairs))
        settled.append(_overhead(pairs[len(pairs) // 2:]))
        ks.append(checked.cf.stats()["k"])
    checked.cf.close()
    return {"adaptive": every is None, "overhead_per_phase": phases, "overhead_second_half": settled,
            "k_at_phase_end": ks,
            "k_changes": checked.cf.stats()["k_changes"]}


def run(args: argparse.Namespace) -> int:
    if not 0 < args.overhead < 1:
        raise ValueError(f"--overhead {args.overhead}: must be a fraction in (0, 1)")
    for name in ("iterations", "epoch_len", "width", "block", "phase_iters"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} {getattr(args, name)}: must be >= 1")
    root = tempfile.mkdtemp(prefix="rcf-overhead-")
    first = part_overhead(args, root)
    adaptive = part_adaptive(args, root, every=None)
    # the fixed k is the one the adaptive run had settled on under normal storage
    fixed = part_adaptive(args, root, every=adaptive["k_at_phase_end"][0])
    _print(args, first, fixed, adaptive)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"overhead": first, "fixed": fixed, "adaptive": adaptive}, f, indent=2)
    return 0


def _print(args: argparse.Namespace, first: dict, fixed: dict, adaptive: dict) -> None:
    print(f"part 1: p = {args.overhead:.1%}; {first['iterations']} iterations of {first['iter_s'] * 1e3:.1f} ms, "
          f"interleaved with a baseline in blocks of {args.block}; epoch = {args.epoch_len} iterations")
    print(f"  mode {first['mode']}, compression {'on' if first['compress'] else 'off'}; policy k {first['policy_k']}, "
          f"adapted to {first['k']} (changes at iteration: {first['k_changes']})")
    print(f"  {first['checkpoints']} checkpoints, {first['checkpoints_per_epoch']:.0f} per epoch at the final k; "
          f"stall {first['stall_s_per_checkpoint'] * 1e3:.1f} ms per checkpoint")
    print(f"  overhead {first['overhead']:.2%} (second half: {first['overhead_last_half']:.2%}; "
          f"with the one-off profiling: {first['overhead_with_profiling']:.2%}; "
          f"the engine's own estimate: {first['engine_estimate']:.2%})")
    print(f"part 2: storage {args.slow_s:.1f} s slower per write in phase 2; {args.phase_iters} iterations a phase")
    print("  overhead over the whole phase / over its second half, and k at the end of the phase")
    print(f"  {'':<10} {'phase 1 (normal)':>24} {'phase 2 (slow)':>24} {'phase 3 (normal)':>24}")
    for name, result in (("fixed k", fixed), ("adaptive", adaptive)):
        cells = [f"{o:>6.1%} / {h:>6.1%} k={k:<4}" for o, h, k in
                 zip(result["overhead_per_phase"], result["overhead_second_half"], result["k_at_phase_end"])]
        print(f"  {name:<10} " + " ".join(f"{c:>24}" for c in cells))


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    add_arguments(parser)
    raise SystemExit(run(parser.parse_args()))
