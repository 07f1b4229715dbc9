"""A small GPT-style language model trained in bfloat16 with CheckFreq, resumed after a kill.

The "text" is scikit-learn's digits (shipped with the package: nothing is downloaded):
each 8x8 image becomes a sequence of 65 tokens, its class token followed by its 64
pixel intensities (0-16), and a causal decoder (pre-norm blocks, 4 heads) learns to
predict each next token. Parameters, gradients and Adam moments are all bfloat16, so
the checkpoints exercise the codec on bfloat16 state (`--compress on`, the default here,
prints its ratio). A warm-up/cosine learning-rate schedule is checkpointed with it.

    python examples/gpt_bf16.py --storage /tmp/rcf-gpt --crash-at 70   # SIGKILLs itself at 70
    python examples/gpt_bf16.py --storage /tmp/rcf-gpt                 # resumes, finishes
    python examples/gpt_bf16.py --device cuda --layers 6 --width 256    # where there is a GPU

The second run prints `started at iteration N` (the newest committed checkpoint) and a
digest of the final weights, equal to an uninterrupted run's on the same device.
"""

from __future__ import annotations

import argparse
import hashlib
import math
import os
import signal
import tempfile
import time

import torch
import torch.nn.functional as F
from sklearn.datasets import load_digits

from ray_checkfreq import CheckFreq
from ray_checkfreq.data import resumable

PIXEL_TOKENS = 17  # intensities 0..16
VOCAB = PIXEL_TOKENS + 10  # then one token per class
SEQ_LEN = 1 + 64


def digit_sequences() -> torch.Tensor:
    digits = load_digits()
    pixels = torch.tensor(digits.data, dtype=torch.int64)
    classes = torch.tensor(digits.target, dtype=torch.int64).unsqueeze(1) + PIXEL_TOKENS
    return torch.cat([classes, pixels], dim=1)  # (1797, 65)


class Block(torch.nn.Module):
    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.norm1 = torch.nn.LayerNorm(width)
        self.qkv = torch.nn.Linear(width, 3 * width)
        self.proj = torch.nn.Linear(width, width)
        self.norm2 = torch.nn.LayerNorm(width)
        self.mlp = torch.nn.Sequential(
            torch.nn.Linear(width, 4 * width), torch.nn.GELU(), torch.nn.Linear(4 * width, width)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, length, width = x.shape
        q, k, v = self.qkv(self.norm1(x)).split(width, dim=2)
        q, k, v = (t.view(batch, length, self.heads, width // self.heads).transpose(1, 2) for t in (q, k, v))
        attended = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(attended.transpose(1, 2).reshape(batch, length, width))
        return x + self.mlp(self.norm2(x))


class TinyGPT(torch.nn.Module):
    def __init__(self, *, layers: int, width: int, heads: int) -> None:
        super().__init__()
        self.tokens = torch.nn.Embedding(VOCAB, width)
        self.positions = torch.nn.Embedding(SEQ_LEN, width)
        self.blocks = torch.nn.ModuleList(Block(width, heads) for _ in range(layers))
        self.norm = torch.nn.LayerNorm(width)
        self.head = torch.nn.Linear(width, VOCAB, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.tokens(tokens) + self.positions(torch.arange(tokens.shape[1], device=tokens.device))
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


def schedule(total: int, warmup: int = 20):
    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        return 0.5 * (1 + math.cos(math.pi * min(1.0, (step - warmup) / max(1, total - warmup))))

    return factor


def digest(model: torch.nn.Module) -> str:
    hashed = hashlib.sha256()
    for tensor in model.state_dict().values():
        hashed.update(tensor.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return hashed.hexdigest()[:16]


def train(args: argparse.Namespace) -> None:
    device = torch.device(args.device)
    sequences = digit_sequences().to(device)
    torch.manual_seed(0)
    model = TinyGPT(layers=args.layers, width=args.width, heads=4).to(device=device, dtype=torch.bfloat16)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01, eps=1e-6)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, schedule(args.iterations))
    data = resumable(len(sequences), batch_size=args.batch, seed=0)
    compress = {"on": True, "off": False, "auto": None}[args.compress]
    cf = CheckFreq(model=model, optimizer=optimizer, storage=args.storage, data=data,
                   extra_state={"scheduler": scheduler}, every=args.every or None, epoch_len=len(data),
                   compress=compress)
    start = cf.restore()
    print(f"started at iteration {start}", flush=True)
    began = time.perf_counter()
    loss = torch.tensor(float("nan"))
    while cf.iteration < args.iterations:
        for indices in data:
            batch = sequences[torch.as_tensor(indices, device=device)]
            logits = model(batch[:, :-1])
            loss = F.cross_entropy(logits.float().reshape(-1, VOCAB), batch[:, 1:].reshape(-1))
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            scheduler.step()
            cf.step()
            if cf.iteration % 20 == 0:
                print(f"iteration {cf.iteration}: loss {loss.item():.3f}", flush=True)
            if cf.iteration == args.crash_at:
                os.kill(os.getpid(), signal.SIGKILL)  # a preemption: nothing is flushed
            if cf.iteration >= args.iterations:
                break
    cf.close()
    report(cf, model, loss, time.perf_counter() - began)


def report(cf: CheckFreq, model: torch.nn.Module, loss: torch.Tensor, seconds: float) -> None:
    stats = cf.stats()
    params = sum(p.numel() for p in model.parameters())
    ratio = stats["compression_ratio"]
    stored = f"{100 * ratio:.1f} % of the raw bytes" if ratio is not None else "n/a"
    print(f"finished at iteration {cf.iteration} in {seconds:.1f} s: loss {loss.item():.3f} (bits/token "
          f"{loss.item() / math.log(2):.2f}); {params / 1e6:.2f} M bfloat16 parameters", flush=True)
    print(f"checkpoints: {stats['checkpoints_committed']} committed by this run, k = {stats['k']}, "
          f"compression {'on' if stats['compress'] else 'off'}, stored {stored}, "
          f"stall {stats['stall_s_per_checkpoint'] * 1e3:.1f} ms per checkpoint", flush=True)
    print(f"weights digest {digest(model)}", flush=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--storage", default=os.path.join(tempfile.gettempdir(), "rcf-gpt-bf16"),
                        help="checkpoint directory or URI (default: %(default)s)")
    parser.add_argument("--iterations", type=int, default=200, help="total iterations (default: %(default)s)")
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--width", type=int, default=128, help="model width (a multiple of 4 heads)")
    parser.add_argument("--batch", type=int, default=32, help="sequences per iteration")
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--every", type=int, default=10, help="checkpoint interval k; 0: the policy picks it")
    parser.add_argument("--compress", choices=("on", "off", "auto"), default="on",
                        help="the checkpoint codec: always, never, or when the engine measures that it pays")
    parser.add_argument("--device", default="cpu", help="cpu or cuda")
    parser.add_argument("--crash-at", type=int, default=None, help="SIGKILL this process after that iteration")
    args = parser.parse_args()
    if args.width % 4:
        parser.error(f"--width {args.width}: must be a multiple of 4 (the number of heads)")
    print(f"checkpoints in {args.storage}", flush=True)
    train(args)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
