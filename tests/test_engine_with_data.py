"""CheckFreq and a resumable iterator together: a crash in mid-epoch loses and repeats nothing."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from resume_jobs import Progress, assert_resumed_at_newest, crash_in_child, newest_committed

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


@dataclass
class Run:
    model: torch.nn.Module
    start: int
    executed: int
    seen: list[int]


def _train(storage: str, kill_at: int | None = None, progress: str | None = None) -> Run:
    """The job; with ``kill_at`` it SIGKILLs its own process when it reaches that iteration."""
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    data = resumable(Points(), batch_size=BATCH, seed=3, options=TorchLoaderOptions(num_workers=0))
    cf = CheckFreq(model=model, optimizer=opt, storage=storage, data=data, every=5)
    record = Progress(progress)
    start = done = cf.restore()
    seen: list[int] = []
    while data.epoch < EPOCHS:
        for batch in data:
            record.kill_if(done, kill_at)
            opt.zero_grad()
            model(batch["x"]).pow(2).mean().backward()
            opt.step()
            seen.extend(batch["index"].tolist())
            done += 1
            cf.step()
            record.record(done, cf.stats(), batch["index"].tolist())
    cf.close()
    return Run(model, start, done - start, seen)


def test_resume_mid_epoch_is_exact_and_sees_every_sample_once(tmp_path):
    reference = _train(str(tmp_path / "ref"))
    crash = crash_in_child(_train, tmp_path / "progress", storage=str(tmp_path / "run"), kill_at=17)
    assert crash.kill_iteration == 17 and len(crash.samples) == 17 * BATCH
    newest = newest_committed(str(tmp_path / "run"))  # 15, or 10 if the save of 15 was still in flight
    resumed = _train(str(tmp_path / "run"))
    total = EPOCHS * (SAMPLES // BATCH)
    assert_resumed_at_newest(crash, newest, start=resumed.start, executed=resumed.executed, total=total)
    assert len(resumed.seen) == (total - newest.step) * BATCH
    # the batches after the newest checkpoint are trained again; nothing else repeats
    replayed = crash.samples[newest.step * BATCH:]
    assert resumed.seen[: len(replayed)] == replayed
    assert crash.samples[: newest.step * BATCH] + resumed.seen == reference.seen
    per_epoch = SAMPLES // BATCH * BATCH
    for epoch in range(EPOCHS):
        assert sorted(reference.seen[epoch * per_epoch:(epoch + 1) * per_epoch]) == list(range(SAMPLES))
    assert torch.equal(reference.model.weight, resumed.model.weight)
    assert torch.equal(reference.model.bias, resumed.model.bias)


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
