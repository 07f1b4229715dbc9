"""``ray-checkfreq bench overhead``: overhead at the policy's k, fixed k, and the adaptive rate.

Iteration times drift by several percent between runs on a shared machine, more than
the 3.5 % to be measured. So every figure here comes from one interleaved run: identical
models train in alternating blocks of ``--block`` iterations, one with CheckFreq (or
``torch.save``) and one without, and overhead = time(with) / time(without) - 1 over the
same stretch of wall-clock time. A CheckFreq block runs on past ``--block`` until no
checkpoint is in flight (so no persist spills into the baseline's block, and none is
left out), and the baseline's block then runs as many iterations.

Parts (``--parts``, default all):

- ``first``: p = ``--overhead``, the policy choosing k after its profiling window. Overhead
  over the first ``--first`` iterations (profiling and its checkpoints included) and over
  the rest, the policy's first k and the k the adaptive rate ends at.
- ``every``: a fixed ``--every`` k, CheckFreq (compression decided by measurement) against
  synchronous ``torch.save`` + fsync at the same k.
- ``adaptive`` (the paper's Table 5, both directions): storage is slowed (``--slow-s``
  extra seconds per checkpoint write) in the middle third of the run, then restored. The
  adaptive rate against a fixed k (the k the adaptive run had settled on by the end of
  phase 1): overhead per phase, and k at the end of each phase.

``--threads`` sets the training's torch threads (1 leaves a core to persist, as a GPU
job's host would; the default is torch's own).

``--noisy`` (instead of the parts): ``--runs`` interleaved runs of the policy (as part
first) under an injected background load: ``--hog-procs`` processes spinning a core
each, stopped and resumed every ``--hog-period-s`` seconds (a noisy neighbour). Per run:
the k history, the checkpoints taken (by cause: profiling, interval, epoch end), the
engine's measured overhead against the model's, and the wall-clock overhead against the
baseline; then the median wall-clock overhead, the worst run, and the checkpoints per
epoch against those of the paper's k (``Decision.k_floor``: persist done, To within p).
"""

from __future__ import annotations

import argparse
import copy
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from typing import Any

import torch

from benchmarks.harness import add_json_argument, write_json
from ray_checkfreq.engine import CheckFreq
from ray_checkfreq.storage import CheckpointStore

PARTS = ("first", "every", "adaptive")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--parts", default=",".join(PARTS), help=f"comma-separated, of {', '.join(PARTS)}")
    parser.add_argument("--iterations", type=int, default=900, help="CheckFreq iterations in part first")
    parser.add_argument("--first", type=int, default=300, help="the early stretch reported apart (part first)")
    parser.add_argument("--epoch-len", type=int, default=100_000, help="iterations per epoch")
    parser.add_argument("--overhead", type=float, default=0.035, help="allowed overhead p")
    parser.add_argument("--width", type=int, default=2048, help="MLP width (sets model size and step time)")
    parser.add_argument("--threads", type=int, default=None, help="torch threads for training")
    parser.add_argument("--block", type=int, default=50, help="iterations per interleaved block")
    parser.add_argument("--every", type=int, default=10, help="the fixed k of part every")
    parser.add_argument("--every-iters", type=int, default=300, help="iterations of part every")
    parser.add_argument("--phase-iters", type=int, default=600, help="CheckFreq iterations per phase (part adaptive)")
    parser.add_argument("--slow-s", type=float, default=3.0, help="extra seconds per write while storage is slow")
    parser.add_argument("--noisy", action="store_true", help="interleaved runs under a background load")
    parser.add_argument("--runs", type=int, default=3, help="runs of --noisy")
    parser.add_argument("--hog-procs", type=int, default=2, help="--noisy: processes spinning a core each")
    parser.add_argument("--hog-period-s", type=float, default=3.0, help="--noisy: the load is on, then off, this long")
    add_json_argument(parser)


class ThrottledStore(CheckpointStore):
    """A CheckpointStore whose writes take ``extra_s`` longer while ``slow`` is set."""

    slow = False
    extra_s = 0.0

    def save(self, *args: Any, **kwargs: Any) -> Any:
        ref = super().save(*args, **kwargs)
        if self.slow:
            time.sleep(self.extra_s)
        return ref


class Trainer:
    """One model + optimizer + batch, stepping with CheckFreq, a checkpoint hook, or neither."""

    def __init__(self, width: int) -> None:
        torch.manual_seed(0)
        self.model = torch.nn.Sequential(torch.nn.Linear(width, width), torch.nn.ReLU(),
                                         torch.nn.Linear(width, width), torch.nn.ReLU(), torch.nn.Linear(width, 16))
        self.opt = torch.optim.Adam(self.model.parameters(), lr=1e-4)
        self.inputs = torch.randn(64, width)
        self.cf: CheckFreq | None = None
        self.after_step: Callable[[int], None] | None = None
        self.iteration = 0

    def twin(self) -> Trainer:
        other = copy.copy(self)
        other.model = copy.deepcopy(self.model)
        other.opt = torch.optim.Adam(other.model.parameters(), lr=1e-4)
        other.cf = None
        other.after_step = None
        return other

    def step(self) -> None:
        self.opt.zero_grad(set_to_none=False)
        self.model(self.inputs).square().mean().backward()
        self.opt.step()
        self.iteration += 1
        if self.cf is not None:
            self.cf.step()
        if self.after_step is not None:
            self.after_step(self.iteration)

    def run(self, iterations: int) -> float:
        start = time.perf_counter()
        for _ in range(iterations):
            self.step()
        return time.perf_counter() - start

    def run_until_idle(self, iterations: int) -> tuple[int, float]:
        """At least ``iterations``, then on until no checkpoint is in flight, so that the
        block pays for the persist it started. Where persists take longer than k iterations
        there is always one in flight: after ``iterations`` more the block waits for it.
        Also on while profiling times a checkpoint's cost (at most 4 x ``iterations``): the
        baseline's block would otherwise run inside that window and count as its cost."""
        start = time.perf_counter()
        done = 0
        while done < iterations or self._keeps_going(done, iterations):
            self.step()
            done += 1
        if self.cf is not None:
            self.cf.flush()
        return done, time.perf_counter() - start

    def _keeps_going(self, done: int, iterations: int) -> bool:
        if self.cf is None:
            return False
        return (self.cf.in_flight and done < 2 * iterations) or (self.cf.measuring_cost and done < 4 * iterations)


Pair = tuple[int, float, float]  # iterations, seconds without, seconds with


def interleaved(plain: Trainer, checked: Trainer, iterations: int, block: int,
                before_block: Callable[[int], None] | None = None) -> list[Pair]:
    """Alternate blocks; returns (iterations, seconds without, seconds with) per block pair."""
    pairs: list[Pair] = []
    done = 0
    while done < iterations:
        if before_block:
            before_block(done)
        n, with_cf = checked.run_until_idle(min(block, iterations - done))
        without = plain.run(n)
        pairs.append((n, without, with_cf))
        done += n
    return pairs


def _overhead(pairs: list[Pair]) -> float:
    return sum(p[2] for p in pairs) / sum(p[1] for p in pairs) - 1


def _split(pairs: list[Pair], first: int) -> tuple[list[Pair], list[Pair]]:
    done = 0
    for index, pair in enumerate(pairs):
        done += pair[0]
        if done >= first:
            return pairs[:index + 1], pairs[index + 1:]
    return pairs, []


def _pair_of_trainers(width: int) -> tuple[Trainer, Trainer]:
    plain = Trainer(width)
    checked = plain.twin()
    plain.run(5)  # warm-up: Adam state allocated
    checked.run(5)
    return plain, checked


def part_first(args: argparse.Namespace, root: str) -> dict:
    plain, checked = _pair_of_trainers(args.width)
    checked.cf = CheckFreq(model=checked.model, optimizer=checked.opt, storage=f"{root}/first",
                           overhead=args.overhead, epoch_len=args.epoch_len)
    checked.cf.restore()
    pairs = interleaved(plain, checked, args.iterations, args.block)
    checked.cf.close()
    stats = checked.cf.stats()
    first, rest = _split(pairs, args.first)
    decision = checked.cf.decision
    return {
        "iterations": sum(p[0] for p in pairs),
        "first_iterations": sum(p[0] for p in first),
        "iter_s": sum(p[1] for p in pairs) / sum(p[0] for p in pairs),
        "overhead_first": _overhead(first),
        "overhead_rest": _overhead(rest) if rest else None,
        "overhead": _overhead(pairs),
        "engine_estimate": stats["overhead_estimate"],
        "policy_k": decision.k if decision else None,
        "policy_cost_ms": 1e3 * decision.cost_s if decision else None,
        "k": stats["k"],
        "k_changes": stats["k_changes"],
        "mode": stats["mode"],
        "compress": stats["compress"],
        "checkpoints": stats["checkpoints_committed"],
        "stall_ms_median": 1e3 * stats["stall_s_median"],
    }


def part_every(args: argparse.Namespace, root: str) -> dict:
    """CheckFreq at a fixed k against torch.save + fsync at the same k, each vs a baseline."""
    plain, checked = _pair_of_trainers(args.width)
    saver = plain.twin()
    saver.run(5)
    checked.cf = CheckFreq(model=checked.model, optimizer=checked.opt, storage=f"{root}/every",
                           every=args.every)
    checked.cf.restore()
    saver.after_step = _torch_saver(saver, f"{root}/torch-save", args.every)
    cf_pairs: list[Pair] = []
    save_pairs: list[Pair] = []
    done = 0
    rounds = 0
    while done < args.every_iters:
        # The CheckFreq block decides n (it runs on until its persist is done); the other two
        # then run n each, in an order reversed every other round, so that neither always
        # follows the other's writes.
        n, with_cf = checked.run_until_idle(min(args.block, args.every_iters - done))
        if rounds % 2 == 0:
            without, with_save = plain.run(n), saver.run(n)
        else:
            with_save, without = saver.run(n), plain.run(n)
        cf_pairs.append((n, without, with_cf))
        save_pairs.append((n, without, with_save))
        done += n
        rounds += 1
    checked.cf.close()
    stats = checked.cf.stats()
    return {"every": args.every, "iterations": done, "overhead_checkfreq": _overhead(cf_pairs),
            "overhead_torch_save": _overhead(save_pairs), "compress": stats["compress"],
            "checkpoints": stats["checkpoints_committed"], "stall_ms_median": 1e3 * stats["stall_s_median"]}


def _torch_saver(trainer: Trainer, root: str, every: int) -> Callable[[int], None]:
    os.makedirs(root, exist_ok=True)

    def save(iteration: int) -> None:
        if iteration % every:
            return
        path = os.path.join(root, "ckpt.pt")
        with open(path + ".tmp", "wb") as f:
            torch.save({"model": trainer.model.state_dict(), "optimizer": trainer.opt.state_dict()}, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(path + ".tmp", path)

    return save


def part_adaptive(args: argparse.Namespace, root: str, every: int | None) -> dict:
    """``every=None``: the adaptive rate; else a fixed k."""
    plain, checked = _pair_of_trainers(args.width)
    store = ThrottledStore(f"{root}/adaptive-{every}", keep_last=2)
    store.extra_s = args.slow_s
    checked.cf = CheckFreq(model=checked.model, optimizer=checked.opt, storage=store, overhead=args.overhead,
                           epoch_len=args.epoch_len, every=every)
    checked.cf.restore()
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
            "k_at_phase_end": ks, "k_changes": checked.cf.stats()["k_changes"]}


HOG = "while True:\n    pass\n"


class NoisyNeighbour:
    """``procs`` processes spinning a core each, stopped and resumed every ``period_s``."""

    def __init__(self, procs: int, period_s: float) -> None:
        self.period_s = period_s
        self._procs = [subprocess.Popen([sys.executable, "-c", HOG]) for _ in range(procs)]
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._toggle, name="rcf-noisy-neighbour", daemon=True)
        self._thread.start()

    def _toggle(self) -> None:
        running = True
        while not self._stop.wait(self.period_s):
            running = not running
            for proc in self._procs:
                proc.send_signal(signal.SIGCONT if running else signal.SIGSTOP)

    def close(self) -> None:
        self._stop.set()
        self._thread.join()
        for proc in self._procs:
            proc.kill()
            proc.wait()


def part_noisy(args: argparse.Namespace, root: str, index: int) -> dict:
    """One run of the policy against its baseline, interleaved, under the neighbour's load."""
    plain, checked = _pair_of_trainers(args.width)
    checked.cf = CheckFreq(model=checked.model, optimizer=checked.opt, storage=f"{root}/noisy-{index}",
                           overhead=args.overhead, epoch_len=args.epoch_len)
    checked.cf.restore()
    pairs = interleaved(plain, checked, args.iterations, args.block)
    checked.cf.close()
    stats = checked.cf.stats()
    decision = checked.cf.decision
    iterations = sum(p[0] for p in pairs)
    return {
        "iterations": iterations,
        "wall_overhead": _overhead(pairs),
        "measured": stats["overhead_measured"],
        "measured_error": stats["overhead_measured_error"],
        "model": stats["overhead_model"],
        "k_history": [entry["k"] for entry in stats["k_history"]],
        "checkpoints": stats["checkpoints_committed"],
        "by_cause": stats["checkpoints_by_cause"],
        "paper_k": decision.k_floor if decision else None,
        "policy_k": decision.k if decision else None,
        **_profile_rule(stats.get("profiling") or {}, checked.cf.profile),
    }


def _profile_rule(profiling: dict, profile) -> dict:
    """Which figure of the warm samples set the profiled k (the median, their mean where the
    median's k would break p, the largest where they disagreed) and the samples' costs."""
    codec = "rcfz" if profile is not None and profile.compress else "raw"
    rule = ("largest" if profiling.get("disagreed", {}).get(codec)
            else "mean" if profiling.get("conservative", {}).get(codec) else "median")
    costs = [sample["interference_s"] for sample in profiling.get("samples", {}).get(codec, [])]
    return {"profile_rule": rule if costs else None, "profile_costs_s": costs}


def run_noisy(args: argparse.Namespace, root: str) -> dict:
    neighbour = NoisyNeighbour(args.hog_procs, args.hog_period_s)
    try:
        runs = [part_noisy(args, root, index) for index in range(args.runs)]
    finally:
        neighbour.close()
    walls = [r["wall_overhead"] for r in runs]
    return {"runs": runs, "median_wall_overhead": statistics.median(walls), "worst_wall_overhead": max(walls)}


def _print_noisy(args: argparse.Namespace, noisy: dict) -> None:
    print(f"noisy: {args.runs} runs of {args.iterations} iterations; {args.hog_procs} processes spinning a core "
          f"each, on and off every {args.hog_period_s:.0f} s; epoch {args.epoch_len} iterations")
    print(f"  {'run':<4} {'wall-clock':>10} {'measured':>16} {'model':>7} {'ckpts':>5} "
          f"{'(profiling/interval/epoch end)':>30} {'paper k':>7}  k history")
    for index, r in enumerate(noisy["runs"]):
        causes = r["by_cause"]
        split = f"{causes['profiling']}/{causes['interval']}/{causes['epoch_end']}"
        model = "n/a" if r["model"] is None else f"{r['model']:.1%}"
        measured = f"{r['measured']:.1%} +- {r['measured_error']:.1%}"
        print(f"  {index + 1:<4} {r['wall_overhead']:>10.1%} {measured:>16} {model:>7} {r['checkpoints']:>5} "
              f"{split:>30} {r['paper_k']!s:>7}  {r['k_history']}")
    p = args.overhead
    print(f"  median wall-clock overhead {noisy['median_wall_overhead']:.1%} (target <= p + 1.5 = {p + 0.015:.1%}); "
          f"worst run {noisy['worst_wall_overhead']:.1%} (target <= 2p = {2 * p:.1%})")
    for index, r in enumerate(noisy["runs"]):
        if r["paper_k"]:
            taken = r["by_cause"]["interval"] + r["by_cause"]["epoch_end"] + r["by_cause"]["profiling"]
            per_epoch = taken * args.epoch_len / r["iterations"]
            print(f"  run {index + 1}: {per_epoch:.1f} checkpoints per epoch; the paper's k = {r['paper_k']} "
                  f"gives {args.epoch_len / r['paper_k']:.1f}")
        if r.get("profile_rule"):
            costs = ", ".join(f"{1e3 * cost:.0f}" for cost in r["profile_costs_s"])
            print(f"  run {index + 1}: profiled k {r['policy_k']} from the {r['profile_rule']} of the warm "
                  f"samples' costs ({costs} ms)")


def run(args: argparse.Namespace) -> int:
    if not 0 < args.overhead < 1:
        raise ValueError(f"--overhead {args.overhead}: must be a fraction in (0, 1)")
    for name in ("iterations", "first", "epoch_len", "width", "block", "every", "every_iters", "phase_iters", "runs"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} {getattr(args, name)}: must be >= 1")
    parts = [p.strip() for p in args.parts.split(",") if p.strip()]
    unknown = sorted(set(parts) - set(PARTS))
    if unknown or not parts:
        raise ValueError(f"--parts {args.parts!r}: expected some of {', '.join(PARTS)}")
    if args.threads is not None:
        if args.threads < 1:
            raise ValueError(f"--threads {args.threads}: must be >= 1")
        torch.set_num_threads(args.threads)
    if args.hog_procs < 0 or not args.hog_period_s > 0:
        raise ValueError(f"--hog-procs {args.hog_procs} must be >= 0 and --hog-period-s {args.hog_period_s} > 0")
    root = tempfile.mkdtemp(prefix="rcf-overhead-")
    try:
        figures = {"noisy": run_noisy(args, root)} if args.noisy else _run_parts(args, parts, root)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    _print(args, figures)
    write_json(args.json, figures)
    return 0


def _run_parts(args: argparse.Namespace, parts: list[str], root: str) -> dict[str, Any]:
    figures: dict[str, Any] = {}
    if "first" in parts:
        figures["first"] = part_first(args, root)
    if "every" in parts:
        figures["every"] = part_every(args, root)
    if "adaptive" in parts:
        figures["adaptive"] = part_adaptive(args, root, every=None)
        # the fixed k is the one the adaptive run had settled on under normal storage
        settled = figures["adaptive"]["k_at_phase_end"][0] or args.every  # None: still profiling (short runs)
        figures["fixed"] = part_adaptive(args, root, every=settled)
    return figures


def _print(args: argparse.Namespace, figures: dict) -> None:
    print(f"MLP width {args.width}, Adam, {torch.get_num_threads()} training threads, {os.cpu_count()} cores; "
          f"p = {args.overhead:.1%}; interleaved with a baseline in blocks of {args.block}")
    if "first" in figures:
        _print_first(args, figures["first"])
    if "every" in figures:
        e = figures["every"]
        print(f"every: k = {e['every']} fixed, {e['iterations']} iterations; compression "
              f"{_on_off(e['compress'])}; {e['checkpoints']} checkpoints, median stall {e['stall_ms_median']:.1f} ms")
        print(f"  overhead: checkfreq {e['overhead_checkfreq']:.2%}, torch.save + fsync {e['overhead_torch_save']:.2%}")
    if "adaptive" in figures:
        _print_adaptive(args, figures["fixed"], figures["adaptive"])
    if "noisy" in figures:
        _print_noisy(args, figures["noisy"])


def _print_first(args: argparse.Namespace, f: dict) -> None:
    rest = "n/a" if f["overhead_rest"] is None else f"{f['overhead_rest']:.2%}"
    print(f"first: {f['iterations']} iterations of {f['iter_s'] * 1e3:.1f} ms; mode {f['mode']}, compression "
          f"{_on_off(f['compress'])}; policy k {f['policy_k']} (measured cost {f['policy_cost_ms'] or 0:.0f} ms "
          f"per checkpoint), k at the end {f['k']} (changes at iteration: {f['k_changes']})")
    print(f"  overhead over the first {f['first_iterations']} iterations (profiling included): "
          f"{f['overhead_first']:.2%}; after them: {rest}; whole run: {f['overhead']:.2%} "
          f"(the engine's own estimate: {f['engine_estimate']:.2%})")
    print(f"  {f['checkpoints']} checkpoints committed, median stall {f['stall_ms_median']:.1f} ms")


def _print_adaptive(args: argparse.Namespace, fixed: dict, adaptive: dict) -> None:
    print(f"adaptive: storage {args.slow_s:.1f} s slower per write in phase 2; {args.phase_iters} iterations a phase")
    print("  overhead over the whole phase / over its second half, and k at the end of the phase")
    print(f"  {'':<10} {'phase 1 (normal)':>24} {'phase 2 (slow)':>24} {'phase 3 (normal)':>24}")
    for name, result in (("fixed k", fixed), ("adaptive", adaptive)):
        cells = [f"{o:>6.1%} / {h:>6.1%} k={k!s:<4}" for o, h, k in
                 zip(result["overhead_per_phase"], result["overhead_second_half"], result["k_at_phase_end"])]
        print(f"  {name:<10} " + " ".join(f"{c:>24}" for c in cells))


def _on_off(compress: bool | None) -> str:
    return "undecided" if compress is None else ("on" if compress else "off")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    add_arguments(parser)
    raise SystemExit(run(parser.parse_args()))
