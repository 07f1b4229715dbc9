"""A DALI pipeline read through the resumable iterator, checkpointed by CheckFreq.

scikit-learn's digits (shipped with the package: nothing is downloaded) go through an
NVIDIA DALI pipeline that rotates each image by a random angle. The angle is drawn in
`read()` from the sample's own generator, seeded by (seed, epoch, index), and fed to
`fn.rotate` as an input, so a resumed run reproduces every augmented image bit for bit
(DALI's own random operators are seeded per pipeline, not per sample). The pipeline runs
on the CPU (`device_id=None`); `--device-id 0` runs it on a GPU. A small CNN trains on
the batches; the iterator's position (epoch and samples consumed) is part of every
checkpoint, so a restart continues at the exact next sample:

    python examples/dali_pipeline.py --storage /tmp/rcf-dali --crash-at 40   # SIGKILLs itself
    python examples/dali_pipeline.py --storage /tmp/rcf-dali                 # resumes, finishes

Needs `nvidia-dali` (e.g. `pip install nvidia-dali-cuda120`; its CPU pipelines need no GPU).
"""

from __future__ import annotations

import argparse
import hashlib
import os
import signal
import tempfile

import numpy as np
import torch
from sklearn.datasets import load_digits

from ray_checkfreq import CheckFreq
from ray_checkfreq.data import DaliSource, resumable


def digits_source(device_id: int | None) -> DaliSource:
    from nvidia.dali import fn

    digits = load_digits()
    images = (digits.images / 16.0).astype(np.float32)[..., None]  # HWC, one channel
    labels = digits.target.astype(np.int64)

    def read(index: int, rng: np.random.Generator) -> tuple[np.ndarray, ...]:
        angle = np.array(rng.uniform(-15.0, 15.0), dtype=np.float32)  # this sample's augmentation
        return images[index], angle, np.array(labels[index])

    def graph(image, angle, label):
        if device_id is not None:
            image = image.gpu()
        return fn.rotate(image, angle=angle, keep_size=True, fill_value=0.0), label

    return DaliSource(num_samples=len(images), read=read, graph=graph, num_inputs=3,
                      output_names=("image", "label"), device_id=device_id)


def digest(model: torch.nn.Module) -> str:
    hashed = hashlib.sha256()
    for tensor in model.state_dict().values():
        hashed.update(tensor.detach().contiguous().view(torch.uint8).numpy().tobytes())
    return hashed.hexdigest()[:16]


def train(args: argparse.Namespace) -> None:
    data = resumable(digits_source(args.device_id), batch_size=args.batch, seed=0)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Conv2d(1, 8, 3), torch.nn.ReLU(), torch.nn.Flatten(),
                                torch.nn.Linear(8 * 6 * 6, 10))
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    cf = CheckFreq(model=model, optimizer=optimizer, storage=args.storage, data=data,
                   every=args.every or None, epoch_len=len(data))
    start = cf.restore()
    print(f"started at iteration {start} (epoch {data.epoch}, {data.consumed} samples of it consumed)", flush=True)
    correct = seen = 0
    while cf.iteration < args.iterations:
        for batch in data:
            images = batch["image"].permute(0, 3, 1, 2)  # DALI gives HWC
            logits = model(images)
            loss = torch.nn.functional.cross_entropy(logits, batch["label"])
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            cf.step()
            correct += int((logits.argmax(1) == batch["label"]).sum())
            seen += len(batch["label"])
            if cf.iteration == args.crash_at:
                os.kill(os.getpid(), signal.SIGKILL)  # a preemption: nothing is flushed
            if cf.iteration >= args.iterations:
                break
    cf.close()
    stats = cf.stats()
    print(f"finished at iteration {cf.iteration}: training accuracy of this run {correct / max(seen, 1):.3f}, "
          f"{stats['checkpoints_committed']} checkpoints committed by this run (k = {stats['k']})", flush=True)
    print(f"weights digest {digest(model)}", flush=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--storage", default=os.path.join(tempfile.gettempdir(), "rcf-dali"),
                        help="checkpoint directory or URI (default: %(default)s)")
    parser.add_argument("--iterations", type=int, default=120, help="total iterations (default: %(default)s)")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--every", type=int, default=10, help="checkpoint interval k; 0: the policy picks it")
    parser.add_argument("--device-id", type=int, default=None, help="GPU for the DALI pipeline (default: CPU)")
    parser.add_argument("--crash-at", type=int, default=None, help="SIGKILL this process after that iteration")
    args = parser.parse_args()
    print(f"checkpoints in {args.storage}", flush=True)
    train(args)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
