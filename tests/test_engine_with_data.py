"""CheckFreq and a resumable iterator together: a crash in mid-epoch loses and repeats nothing."""

from __future__ import annotations

import torch

from ray_checkfreq import CheckFreq
from ray_checkfreq.data import TorchLoaderOptions, resumable

SAMPLES = 96
BATCH = 8
EPOCHS = 3


class Points(torch.utils.data.Dataset):
    def __len__(self):
        return SAMPLES

    def __getitem__(self, index):
        generator = torch.Generator().manual_seed(index)
        return {"index": torch.tensor(index), "x": torch.randn(4, generator=generator)}


def _train(storage: str, crash_after: int | None, seen: list[int]):
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    data = resumable(Points(), batch_size=BATCH, seed=3, options=TorchLoaderOptions(num_workers=0))
    cf = CheckFreq(model=model, optimizer=opt, storage=storage, data=data, every=5)
    done = cf.restore()
    while data.epoch < EPOCHS:
        for batch in data:
            if done == crash_after:
                cf.close()
                return None
            opt.zero_grad()
            model(batch["x"]).pow(2).mean().backward()
            opt.step()
            seen.extend(batch["index"].tolist())
            done += 1
            cf.step()
    cf.close()
    return model


def test_resume_mid_epoch_is_exact_and_sees_every_sample_once(tmp_path):
    reference_seen: list[int] = []
    reference = _train(str(tmp_path / "ref"), None, reference_seen)
    first: list[int] = []
    assert _train(str(tmp_path / "run"), 17, first) is None  # 17 batches, checkpoint after 15
    second: list[int] = []
    resumed = _train(str(tmp_path / "run"), None, second)
    # the 2 batches after the last checkpoint are trained again; nothing else repeats
    replayed = first[15 * BATCH:]
    assert second[: len(replayed)] == replayed
    assert first[: 15 * BATCH] + second == reference_seen
    per_epoch = SAMPLES // BATCH * BATCH
    for epoch in range(EPOCHS):
        assert sorted(reference_seen[epoch * per_epoch:(epoch + 1) * per_epoch]) == list(range(SAMPLES))
    assert torch.equal(reference.weight, resumed.weight) and torch.equal(reference.bias, resumed.bias)


def test_iterating_and_resuming_leave_the_global_rng_alone():
    data = resumable(Points(), batch_size=BATCH, seed=3, options=TorchLoaderOptions(num_workers=0))
    torch.manual_seed(123)
    before = torch.get_rng_state()
    batches = iter(data)
    next(batches)
    state = data.state_dict()
    fresh = resumable(Points(), batch_size=BATCH, seed=3, options=TorchLoaderOptions(num_workers=0))
    fresh.load_state_dict(state)
    for _ in fresh:
        pass
    assert torch.equal(torch.get_rng_state(), before)
