"""The GPU checks of the snapshot path, as one script for a lent GPU machine.

    python examples/gpu_check.py [--device cuda] [--out DIR]

1. Fence: a model whose every weight is the iteration number, updated by an optimizer
   that writes that number, checkpointed every 2 iterations in CPU mode (pinned host
   buffers, side stream) and GPU mode (spare GPU memory): every checkpoint must hold one
   iteration only.
2. Resume: a CUDA model with dropout, closed mid-run and resumed, ends bit-identical.
3. Policy: the profiling window on the GPU (Tg, M, Mmax measured; mode and k printed).
4. Slowdown: the iteration time of a matmul loop (timed on its own stream) while a
   checkpoint of ``--state-mb`` persists, against quiet iterations, in rounds interleaved
   with a baseline that persists device tensors the old way (each leaf copied to the host
   by the persist thread on the default stream, where training kernels queue behind it).
Exit status 0 only if 1 and 2 pass. On a machine without CUDA, ``--device cpu`` runs the
same checks on the CPU path. Then run ``ray-checkfreq bench stall --device cuda``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

import torch

from ray_checkfreq import CheckFreq, CheckpointStore
from ray_checkfreq.chaos import CountingOptimizer, torn_iterations
from ray_checkfreq.engine.persist import PersistWorker
from ray_checkfreq.engine.snapshot import CopyHandle, Snapshot, Snapshotter


def check_fence(device: str, mode: str, root: str) -> dict:
    width = 2048 if device.startswith("cuda") else 256  # the CPU path checks logic, not speed
    model = torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(8)]).to(device)
    opt = CountingOptimizer(model.parameters())
    store = CheckpointStore(os.path.join(root, f"fence-{mode}"), keep_last=100, codec="raw")
    cf = CheckFreq(model=model, optimizer=opt, storage=store, every=2)
    cf._snapshotter.set_mode(mode)
    cf.restore()
    for _ in range(20):
        opt.step()
        cf.step()
    cf.close()
    return {"mode": mode, "checkpoints": len(store.list()), "torn": torn_iterations(store), "stats": cf.stats()}


def _dropout_run(device: str, storage: str, total: int, stop_at: int | None):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.Dropout(0.3), torch.nn.Linear(512, 1)).to(device)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    cf = CheckFreq(model=model, optimizer=opt, storage=storage, every=5)
    start = cf.restore()
    for it in range(start, total):
        if it == stop_at:
            break
        x = torch.randn(64, 256, generator=torch.Generator().manual_seed(it)).to(device)
        opt.zero_grad()
        model(x).square().mean().backward()
        opt.step()
        cf.step()
    cf.close()
    return model


def check_resume(device: str, root: str) -> dict:
    reference = _dropout_run(device, os.path.join(root, "ref"), 40, None)
    _dropout_run(device, os.path.join(root, "run"), 40, 23)
    resumed = _dropout_run(device, os.path.join(root, "run"), 40, None)
    same = all(torch.equal(a, b) for a, b in zip(reference.state_dict().values(), resumed.state_dict().values()))
    return {"bit_identical": same}


def check_policy(device: str, root: str) -> dict:
    torch.manual_seed(0)
    width = 4096 if device.startswith("cuda") else 512
    model = torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(6)]).to(device)
    opt = torch.optim.Adam(model.parameters())
    cf = CheckFreq(model=model, optimizer=opt, storage=os.path.join(root, "policy"), epoch_len=2000)
    cf.restore()
    x = torch.randn(512, width, device=device)
    for _ in range(120):
        opt.zero_grad()
        model(x).square().mean().backward()
        opt.step()
        cf.step()
    cf.close()
    return {"profile": cf.profile.to_json() if cf.profile else None,
            "decision": vars(cf.decision) if cf.decision else None, "stats": cf.stats()}


def _matmul_iteration(device: str, size: int) -> Callable[[], float]:
    """One training-like kernel, timed by waiting for its own stream only (a device-wide
    synchronize would also wait for the checkpoint's copy streams)."""
    a = torch.randn(size, size, device=device)
    out = torch.empty_like(a)

    def one() -> float:
        start = time.perf_counter()
        torch.mm(a, a, out=out)
        if device.startswith("cuda"):
            torch.cuda.current_stream().synchronize()
        return time.perf_counter() - start

    return one


def _persisting_times(one: Callable[[], float], worker: PersistWorker, snapshot: Snapshot) -> list[float]:
    worker.submit(snapshot, codec="raw")
    times: list[float] = []
    while worker.busy or not times:
        times.append(one())
    worker.wait_idle()
    worker.raise_if_failed()
    return times


def check_slowdown(device: str, root: str, state_mb: int, size: int, rounds: int = 3) -> dict:
    count = max(1, state_mb * 2**20 // (4 * 2**22))
    live = {f"w{i}": torch.randn(2**22, device=device) for i in range(count)}  # 16 MiB each
    one = _matmul_iteration(device, size)
    mode = "gpu" if device.startswith("cuda") else "cpu"
    snapshotter = Snapshotter(mode)
    worker = PersistWorker(CheckpointStore(os.path.join(root, "slowdown"), keep_last=2, codec="raw"))
    quiet: list[float] = []
    busy: dict[str, list[float]] = {"two-phase": [], "default stream": []}
    for step in range(1, rounds + 1):
        for _ in range(3):
            one()  # warm-up after the previous round
        quiet += [one() for _ in range(20)]
        ours = snapshotter.take(2 * step, {"model_params": live}, {"model_params"})
        ours.copies.fence()
        busy["two-phase"] += _persisting_times(one, worker, ours)
        quiet += [one() for _ in range(20)]
        old_way = Snapshot(step=2 * step + 1, state={k: v.clone() for k, v in live.items()},
                           epoch_boundary=False, copies=CopyHandle(), size_bytes=0)
        old_way.copies._host_done.set()
        busy["default stream"] += _persisting_times(one, worker, old_way)
    worker.close()
    snapshotter.close()
    quiet_s = statistics.median(quiet)
    return {"state_mb": count * 16, "matmul": size, "mode": mode, "quiet_iter_ms": 1e3 * quiet_s,
            **{f"{name}_iter_ms": 1e3 * statistics.median(t) for name, t in busy.items()},
            **{f"{name}_slowdown": statistics.median(t) / quiet_s for name, t in busy.items()},
            **{f"{name}_mean_slowdown": statistics.fmean(t) / statistics.fmean(quiet) for name, t in busy.items()},
            **{f"{name}_iterations": len(t) for name, t in busy.items()}}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--out", default=os.environ.get("OUT") or tempfile.mkdtemp(prefix="rcf-gpu-"))
    parser.add_argument("--state-mb", type=int, default=None, help="checkpoint size for the slowdown check")
    parser.add_argument("--only", choices=["all", "slowdown"], default="all")
    args = parser.parse_args()
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        print("no CUDA device: run with --device cpu to check the CPU path", file=sys.stderr)
        return 2
    root = tempfile.mkdtemp(prefix="rcf-gpu-check-")
    cuda = args.device.startswith("cuda")
    modes = ["cpu", "gpu"] if cuda else ["cpu"]
    slowdown = check_slowdown(args.device, root, args.state_mb or (2048 if cuda else 64), 8192 if cuda else 384)
    print(_slowdown_line(slowdown), flush=True)
    if args.only == "slowdown":
        return 0
    report: dict[str, Any] = {
        "device": torch.cuda.get_device_name() if cuda else "cpu",
        "fence": [check_fence(args.device, mode, root) for mode in modes],
        "resume": check_resume(args.device, root),
        "policy": check_policy(args.device, root),
        "slowdown": slowdown,
    }
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "gpu_check.json"), "w") as f:
        json.dump(report, f, indent=2, default=str)
    ok = all(not f["torn"] and f["checkpoints"] > 0 for f in report["fence"]) and report["resume"]["bit_identical"]
    for fence in report["fence"]:
        print(f"fence, {fence['mode']} mode: {fence['checkpoints']} checkpoints, torn: {fence['torn'] or 'none'}")
    print(f"resume bit-identical: {report['resume']['bit_identical']}")
    decision = report["policy"]["decision"] or {}
    print(f"policy: mode {decision.get('mode')}, k {decision.get('k')}, To {decision.get('overhead_s')}")
    print("PASS" if ok else "FAIL")
    return 0 if ok else 1


def _slowdown_line(r: dict) -> str:
    return (f"slowdown of a {r['matmul']}^2 matmul while {r['state_mb']} MiB persist ({r['mode']} mode): "
            f"quiet {r['quiet_iter_ms']:.2f} ms; two-phase {r['two-phase_iter_ms']:.2f} ms "
            f"(median x{r['two-phase_slowdown']:.2f}, mean x{r['two-phase_mean_slowdown']:.2f}, "
            f"{r['two-phase_iterations']} iterations); default stream {r['default stream_iter_ms']:.2f} ms "
            f"(median x{r['default stream_slowdown']:.2f}, mean x{r['default stream_mean_slowdown']:.2f}, "
            f"{r['default stream_iterations']} iterations)")


if __name__ == "__main__":
    raise SystemExit(main())
