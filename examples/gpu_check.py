"""The GPU checks of the snapshot path, as one script for a lent GPU machine.

    python examples/gpu_check.py [--device cuda] [--out DIR]

1. Fence: a model whose every weight is the iteration number, updated by an optimizer
   that writes that number, checkpointed every 2 iterations in CPU mode (pinned host
   buffers, side stream) and GPU mode (spare GPU memory): every checkpoint must hold one
   iteration only.
2. Resume: a CUDA model with dropout, closed mid-run and resumed, ends bit-identical.
3. Policy: the profiling window on the GPU (Tg, M, Mmax measured; mode and k printed).
Exit status 0 only if 1 and 2 pass. On a machine without CUDA, ``--device cpu`` runs the
same checks on the CPU path. Then run ``ray-checkfreq bench stall --device cuda``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile

import torch

from ray_checkfreq import CheckFreq, CheckpointStore
from ray_checkfreq.chaos import CountingOptimizer, torn_iterations


def check_fence(device: str, mode: str, root: str) -> dict:
    model = torch.nn.Sequential(*[torch.nn.Linear(2048, 2048) for _ in range(8)]).to(device)
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
    model = torch.nn.Sequential(*[torch.nn.Linear(4096, 4096) for _ in range(6)]).to(device)
    opt = torch.optim.Adam(model.parameters())
    cf = CheckFreq(model=model, optimizer=opt, storage=os.path.join(root, "policy"), epoch_len=2000)
    cf.restore()
    x = torch.randn(512, 4096, device=device)
    for _ in range(120):
        opt.zero_grad()
        model(x).square().mean().backward()
        opt.step()
        cf.step()
    cf.close()
    return {"profile": cf.profile.to_json() if cf.profile else None,
            "decision": vars(cf.decision) if cf.decision else None, "stats": cf.stats()}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--out", default=os.environ.get("OUT") or tempfile.mkdtemp(prefix="rcf-gpu-"))
    args = parser.parse_args()
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        print("no CUDA device: run with --device cpu to check the CPU path", file=sys.stderr)
        return 2
    root = tempfile.mkdtemp(prefix="rcf-gpu-check-")
    modes = ["cpu", "gpu"] if args.device.startswith("cuda") else ["cpu"]
    report = {
        "device": torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu",
        "fence": [check_fence(args.device, mode, root) for mode in modes],
        "resume": check_resume(args.device, root),
        "policy": check_policy(args.device, root),
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


if __name__ == "__main__":
    raise SystemExit(main())
