"""What user code does between ``cf.step()`` and the next batch is in the checkpoint.

The job is Ray Train's FashionMNIST example in small: dropout, a per-epoch evaluation with
an ordinary shuffling DataLoader (it draws the global torch RNG right after the epoch-end
checkpoint), an LR scheduler stepped before or after ``cf.step()``, a "logging sampler"
drawing the RNG after every step, and a draw at the top of the epoch loop (which a
mid-epoch resume runs again), and the dataset's augmentation draws the global RNG as
it reads. It is SIGKILLed mid-epoch and must end bit-identical to the
uninterrupted run, having begun at the newest committed checkpoint.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import pytest
import torch
from resume_jobs import Progress, assert_resumed_at_newest, crash_in_child, newest_committed

from ray_checkfreq import CheckFreq
from ray_checkfreq.data import TorchLoaderOptions, resumable

SAMPLES = 96
BATCH = 8
EPOCHS = 3
EPOCH_LEN = SAMPLES // BATCH  # 12: checkpoints at 5, 10, 12 (epoch end), 17, 22, 24, ...


class Points(torch.utils.data.Dataset):
    def __len__(self):
        return SAMPLES

    def __getitem__(self, index):
        generator = torch.Generator().manual_seed(index)
        x = torch.randn(4, generator=generator)
        noisy = x + 0.01 * torch.rand(4)  # an augmentation drawing the global RNG (read in this process)
        return {"index": torch.tensor(index), "x": noisy, "y": x.sum(dim=0, keepdim=True)}


@dataclass
class Run:
    state: dict
    start: int
    executed: int


def _evaluate(model: torch.nn.Module, loader: torch.utils.data.DataLoader) -> float:
    model.eval()
    with torch.no_grad():
        loss = sum(torch.nn.functional.mse_loss(model(b["x"]), b["y"]).item() for b in loader)
    model.train()
    return loss


def _train(storage: str, order: str, kill_at: int | None = None, progress: str | None = None) -> Run:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 16), torch.nn.ReLU(), torch.nn.Dropout(0.5), torch.nn.Linear(16, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda it: 1.0 / (1.0 + 0.1 * it))
    data = resumable(Points(), batch_size=BATCH, seed=3, options=TorchLoaderOptions(num_workers=0))
    evaluation = torch.utils.data.DataLoader(Points(), batch_size=16, shuffle=True)  # draws the global RNG
    cf = CheckFreq(model=model, optimizer=opt, storage=storage, data=data, extra_state={"sched": sched},
                   every=5, epoch_len=EPOCH_LEN)
    record = Progress(progress)
    start = done = cf.restore()
    for epoch in range(data.epoch, EPOCHS):
        data.sampler.set_epoch(epoch)  # as code written for a DistributedSampler does
        torch.rand(()).item()  # the top of the loop: run again by a mid-epoch resume
        for batch in data:
            record.kill_if(done, kill_at)
            loss = torch.nn.functional.mse_loss(model(batch["x"]), batch["y"])
            opt.zero_grad()
            loss.backward()
            opt.step()
            if order == "before":
                sched.step()
            cf.step()
            if order == "after":
                sched.step()
            torch.rand(1)  # a logging sampler between steps
            done += 1
            record.record(done, cf.stats(), batch["index"].tolist())
        _evaluate(model, evaluation)
    cf.close()
    state = {f"model/{k}": v.clone() for k, v in model.state_dict().items()}
    state["lr"] = torch.tensor(opt.param_groups[0]["lr"])
    state["rng"] = torch.get_rng_state()
    return Run(state, start, done - start)


def _assert_identical(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    different = [key for key in a if not torch.equal(a[key], b[key])]
    assert not different, f"differ from the uninterrupted run: {different}"


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> dict:
    return _train(str(tmp_path_factory.mktemp("reference")), "before").state


@pytest.mark.parametrize(("order", "kill_at"), [("after", 26), ("before", 26), ("after", 20)])
def test_resume_after_evaluation_scheduler_and_draws_between_steps_is_exact(reference, tmp_path, order, kill_at):
    """Killed before iteration 27 the run resumes at 24 (the epoch end, just before its
    evaluation) or at 22; killed before 21, at 17 (mid-epoch) or 12."""
    run = str(tmp_path / "run")
    crash = crash_in_child(_train, tmp_path / "progress", storage=run, order=order, kill_at=kill_at)
    assert crash.kill_iteration == kill_at
    newest = newest_committed(run)
    resumed = _train(run, order)
    assert_resumed_at_newest(crash, newest, start=resumed.start, executed=resumed.executed,
                             total=EPOCHS * EPOCH_LEN)
    _assert_identical(resumed.state, reference)


def test_the_scheduler_order_does_not_change_an_uninterrupted_run(reference, tmp_path):
    _assert_identical(_train(str(tmp_path / "after"), "after").state, reference)


def test_a_batch_fetched_before_cf_step_is_named_in_a_warning(tmp_path, caplog):
    """The one loop the fetch hook cannot see: the next batch asked for before ``cf.step()``."""
    model = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    data = resumable(Points(), batch_size=BATCH, seed=3, options=TorchLoaderOptions(num_workers=0))
    cf = CheckFreq(model=model, optimizer=opt, storage=str(tmp_path / "s"), data=data, every=2)
    cf.restore()
    batches = iter(data)
    batch = next(batches)
    with caplog.at_level(logging.WARNING, logger="ray_checkfreq.engine"):
        for _ in range(4):
            opt.zero_grad()
            torch.nn.functional.mse_loss(model(batch["x"]), batch["y"]).backward()
            opt.step()
            batch = next(batches)  # prefetched: before cf.step()
            cf.step()
    cf.close()
    assert "began without asking data= for its batch after cf.step()" in caplog.text
    assert cf.stats()["checkpoints_committed"] == 2


def test_set_epoch_is_a_check_of_the_callers_epoch():
    data = resumable(Points(), batch_size=BATCH, seed=3)
    data.set_epoch(0)
    data.sampler.set_epoch(0)
    data.load_state_dict({**data.state_dict(), "epoch": 2})
    with pytest.raises(ValueError, match=r"set_epoch\(0\): .* at epoch 2 .*range\(loader.epoch, epochs\)"):
        data.set_epoch(0)
    data.set_epoch(2)


def test_a_fetch_hook_runs_before_the_batch_is_read_and_before_the_cursor_moves():
    """A dataset may draw the global RNG as it reads: the hook (where a checkpoint is
    completed) must run before, or a resumed run would draw it twice."""
    events: list = []

    class Logged(Points):
        def __getitem__(self, index):
            events.append("read")
            return super().__getitem__(index)

    data = resumable(Logged(), batch_size=BATCH, seed=3, options=TorchLoaderOptions(num_workers=0))
    handle = data.add_fetch_hook(lambda: events.append(("hook", data.consumed)))
    batches = iter(data)
    next(batches)
    next(batches)
    assert events == [("hook", 0), *["read"] * BATCH, ("hook", BATCH), *["read"] * BATCH]
    handle.remove()
    next(batches)
    assert ("hook", 2 * BATCH) not in events


@pytest.mark.parametrize("order", ["before", "after"])
def test_without_fetch_hooks_a_scheduler_stepped_after_cf_step_is_named_in_a_warning(tmp_path, caplog, order):
    """``data=`` that is not a resumable() iterator: the order matters, and the wrong one is named."""
    model = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda it: 0.9 ** it)
    cf = CheckFreq(model=model, optimizer=opt, storage=str(tmp_path / "s"), extra_state={"sched": sched}, every=2)
    cf.restore()
    with caplog.at_level(logging.WARNING, logger="ray_checkfreq.engine"):
        for _ in range(3):
            opt.zero_grad()
            model(torch.ones(2, 4)).sum().backward()
            opt.step()
            if order == "before":
                sched.step()
            cf.step()
            if order == "after":
                sched.step()
    cf.close()
    named = "a scheduler stepped after cf.step()?" in caplog.text
    assert named == (order == "after"), caplog.text


def test_refresh_copies_into_the_snapshots_buffers_and_refuses_a_changed_shape():
    from ray_checkfreq.engine.snapshot import Snapshotter

    snapshotter = Snapshotter("cpu")
    live = {"rng": {"torch": torch.zeros(3, dtype=torch.uint8), "python": (3, [1, 2])}, "extra": {"n": 1}}
    snapshot = snapshotter.take(5, live, set())
    buffer = snapshot.state["rng"]["torch"]
    snapshotter.refresh(snapshot, {("rng",): {"torch": torch.full((3,), 7, dtype=torch.uint8), "python": (4, [5])},
                                   ("extra",): {"n": 2}})
    assert snapshot.state["rng"]["torch"] is buffer and buffer.tolist() == [7, 7, 7]
    assert snapshot.state["rng"]["python"] == (4, [5]) and snapshot.state["extra"] == {"n": 2}
    with pytest.raises(ValueError, match=r"\('rng', 'torch'\) changed from \(3,\) torch.uint8 to \(4,\)"):
        snapshotter.refresh(snapshot, {("rng",): {"torch": torch.ones(4, dtype=torch.uint8), "python": (5, [])}})
    assert buffer.tolist() == [7, 7, 7] and snapshot.state["rng"]["python"] == (4, [5])
    snapshotter.close()
