"""CheckFreq in one process: fence, one in flight, restore, profile cache, failures."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass

import pytest
import torch
from resume_jobs import Progress, assert_began_at_newest, assert_resumed_at_newest, crash_in_child, newest_committed

from ray_checkfreq import CheckpointStore
from ray_checkfreq.chaos import CountingOptimizer, torn_iterations
from ray_checkfreq.engine import CheckFreq, PersistError, RestoreMismatchError
from ray_checkfreq.engine.checkfreq import PROFILE_NAME
from ray_checkfreq.engine.snapshot import HostCopier


class SlowHostCopier(HostCopier):
    """Copies tensor by tensor with a pause: a window in which an unfenced update would tear it."""

    def submit(self, pairs, handle):
        def slow(pairs=pairs, handle=handle):
            for src, dst in pairs:
                time.sleep(0.004)
                dst.copy_(src)
            handle._host_done.set()

        threading.Thread(target=slow, daemon=True).start()


def _counting_run(tmp_path, fenced: bool) -> tuple[int, list[int]]:
    """(checkpoints, torn iterations) of a run with a deliberately slow snapshot copy."""
    model = torch.nn.Sequential(*[torch.nn.Linear(64, 64) for _ in range(8)])
    opt = CountingOptimizer(model.parameters())
    store = CheckpointStore(str(tmp_path), keep_last=100, codec="raw")
    cf = CheckFreq(model=model, optimizer=opt, storage=store, every=3)
    cf._snapshotter._host = SlowHostCopier()
    if not fenced:
        cf._hooks[0].remove()
    cf.restore()
    for _ in range(30):
        opt.step()
        cf.step()
    cf.close()
    return len(store.list()), torn_iterations(store)


def test_a_snapshot_is_never_a_mix_of_two_iterations(tmp_path):
    checkpoints, torn = _counting_run(tmp_path / "fenced", fenced=True)
    assert checkpoints == 10 and torn == []


def test_without_the_fence_the_same_run_tears_snapshots(tmp_path):
    checkpoints, torn = _counting_run(tmp_path / "unfenced", fenced=False)
    assert checkpoints == 10 and torn, "the control run must show what the fence prevents"


class SlowStore(CheckpointStore):
    def __init__(self, *args, delay_s: float = 0.15, fail_at: int | None = None, **kwargs):
        super().__init__(*args, **kwargs)
        self.delay_s = delay_s
        self.fail_at = fail_at
        self.active = 0
        self.max_active = 0
        self.saved_steps: list[int] = []
        self._count_lock = threading.Lock()

    def save(self, step, state, **kwargs):
        with self._count_lock:
            self.active += 1
            self.max_active = max(self.max_active, self.active)
        try:
            time.sleep(self.delay_s)
            if step == self.fail_at:
                raise OSError(28, "No space left on device")
            ref = super().save(step, state, **kwargs)
            self.saved_steps.append(step)
            return ref
        finally:
            with self._count_lock:
                self.active -= 1


def _tiny():
    torch.manual_seed(0)
    model = torch.nn.Linear(16, 4)
    return model, torch.optim.SGD(model.parameters(), lr=0.1)


def _train(model, opt, cf, start, stop):
    for it in range(start, stop):
        x = torch.randn(8, 16, generator=torch.Generator().manual_seed(it))
        opt.zero_grad()
        model(x).sum().backward()
        opt.step()
        cf.step()


def test_one_checkpoint_in_flight_none_abandoned_and_the_wait_is_stall(tmp_path):
    model, opt = _tiny()
    store = SlowStore(str(tmp_path), keep_last=50)
    cf = CheckFreq(model=model, optimizer=opt, storage=store, every=1)
    _train(model, opt, cf, cf.restore(), 12)
    cf.close()
    assert store.max_active == 1
    assert store.saved_steps == list(range(1, 13)), "every started checkpoint was committed, in order"
    stats = cf.stats()
    assert stats["checkpoints_committed"] == 12
    assert stats["persist_wait_s"] > 0.1 and stats["stall_s_total"] >= stats["persist_wait_s"]


def test_a_persist_failure_surfaces_on_the_next_step_or_close(tmp_path):
    model, opt = _tiny()
    cf = CheckFreq(model=model, optimizer=opt, storage=SlowStore(str(tmp_path), delay_s=0.0, fail_at=2), every=2)
    cf.restore()
    with pytest.raises(PersistError, match="iteration 2.*No space left") as info:
        _train(model, opt, cf, 0, 50)
    assert isinstance(info.value.__cause__, OSError)
    model, opt = _tiny()
    cf = CheckFreq(model=model, optimizer=opt, storage=SlowStore(str(tmp_path / "b"), delay_s=0.1, fail_at=3), every=3)
    _train(model, opt, cf, cf.restore(), 3)
    with pytest.raises(PersistError):
        cf.close()


class Counter:
    """Stands in for a data iterator: its state must come back with the checkpoint."""

    def __init__(self):
        self.consumed = 0

    def state_dict(self):
        return {"consumed": self.consumed}

    def load_state_dict(self, state):
        self.consumed = state["consumed"]


@dataclass
class Run:
    """A finished run of the job below: its live objects and where it started."""

    model: torch.nn.Module
    opt: torch.optim.Optimizer
    sched: torch.optim.lr_scheduler.LRScheduler
    data: Counter
    cf: CheckFreq
    start: int
    executed: int


TOTAL = 200  # iterations: the policy profiles over the first ~80-120 (a cold and three warm checkpoints)


def _full_run(storage, total, kill_at=None, progress=None) -> Run:
    """The job; with ``kill_at`` it SIGKILLs its own process when it reaches that iteration."""
    torch.manual_seed(1)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.BatchNorm1d(32), torch.nn.Dropout(0.3),
                                torch.nn.Linear(32, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=5, gamma=0.7)
    data = Counter()
    cf = CheckFreq(model=model, optimizer=opt, storage=storage, data=data, extra_state={"sched": sched},
                   profile_iters=4, epoch_len=20)
    record = Progress(progress)
    start = cf.restore()
    executed = 0
    for it in range(start, total):
        record.kill_if(it, kill_at)
        x = torch.randn(8, 16, generator=torch.Generator().manual_seed(it))
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), x[:, :1]).backward()  # dropout draws from the global RNG
        opt.step()
        sched.step()
        data.consumed += 8
        cf.step()
        executed += 1
        record.record(it + 1, cf.stats())
    cf.close()
    return Run(model, opt, sched, data, cf, start, executed)


def test_restore_after_a_crash_is_bit_identical_to_an_uninterrupted_run(tmp_path):
    reference = _full_run(str(tmp_path / "ref"), TOTAL)
    crash = crash_in_child(_full_run, tmp_path / "progress", storage=str(tmp_path / "run"), total=TOTAL, kill_at=27)
    assert 27 <= crash.kill_iteration < TOTAL
    newest = newest_committed(str(tmp_path / "run"))
    resumed = _full_run(str(tmp_path / "run"), TOTAL)
    assert_resumed_at_newest(crash, newest, start=resumed.start, executed=resumed.executed, total=TOTAL)
    for a, b in zip(reference.model.state_dict().values(), resumed.model.state_dict().values()):
        assert torch.equal(a, b)
    assert reference.sched.state_dict() == resumed.sched.state_dict()
    assert resumed.data.consumed == TOTAL * 8
    for a, b in zip(reference.opt.state_dict()["state"].values(), resumed.opt.state_dict()["state"].values()):
        assert all(torch.equal(a[k], b[k]) for k in a)


def test_the_profile_is_cached_and_reused_after_a_graceful_restart(tmp_path):
    first = _full_run(str(tmp_path), TOTAL).cf
    assert first.profile is not None, "the first run measured a profile"
    cached = CheckpointStore(str(tmp_path)).read_metadata(PROFILE_NAME)
    assert cached["decision"]["k"] == first.decision.k
    newest = CheckpointStore(str(tmp_path)).latest()
    second = _full_run(str(tmp_path), TOTAL + 15)
    assert newest is not None
    assert_began_at_newest(newest.step, start=second.start, executed=second.executed, total=TOTAL + 15)
    assert second.cf.stats()["profiling_s"] == 0.0
    assert second.cf.profile == first.profile, "a new profile would hold newly measured times"


def test_restoring_into_the_wrong_model_or_optimizer_names_the_key(tmp_path):
    _full_run(str(tmp_path), 25)
    torch.manual_seed(1)
    wrong = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.BatchNorm1d(32), torch.nn.Dropout(0.3),
                                torch.nn.Linear(32, 2))
    cf = CheckFreq(model=wrong, optimizer=torch.optim.AdamW(wrong.parameters()), storage=str(tmp_path),
                   extra_state={"sched": torch.optim.lr_scheduler.StepLR(torch.optim.SGD(wrong.parameters(), 1), 5)},
                   data=Counter())
    with pytest.raises(RestoreMismatchError, match=r"model/3.weight.*\(1, 32\).*\(2, 32\)"):
        cf.restore()
    cf.close()
    torch.manual_seed(1)
    right = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.BatchNorm1d(32), torch.nn.Dropout(0.3),
                                torch.nn.Linear(32, 1))
    cf = CheckFreq(model=right, optimizer=torch.optim.SGD(right.parameters(), lr=0.1), storage=str(tmp_path))
    with pytest.raises(RestoreMismatchError, match="saved by AdamW, loading into SGD"):
        cf.restore()
    cf.close()


def test_bad_configuration_is_refused_by_name(tmp_path):
    model, opt = _tiny()
    with pytest.raises(ValueError, match="overhead=1.5"):
        CheckFreq(model=model, optimizer=opt, storage=str(tmp_path), overhead=1.5)
    with pytest.raises(ValueError, match="every=0"):
        CheckFreq(model=model, optimizer=opt, storage=str(tmp_path), every=0)
    with pytest.raises(TypeError, match="data: int has no state_dict"):
        CheckFreq(model=model, optimizer=opt, storage=str(tmp_path), data=5)


def test_plain_values_in_extra_state_are_kept_and_restored_without_a_wrapper(tmp_path):
    model, opt = _tiny()
    history: list = []
    cf = CheckFreq(model=model, optimizer=opt, storage=str(tmp_path), every=2,
                   extra_state={"tokens": 0, "history": history, "config": {"name": "run", "lr": 0.1}, "note": None})
    for it in range(1, 5):  # the extra state as it is at cf.step() goes into that step's checkpoint
        cf.extra_state["tokens"] = 1000 * it  # an int is replaced: the engine reads it at each checkpoint
        history.append(it)  # a list is changed in place
        _train(model, opt, cf, it, it + 1)
    cf.flush()
    cf.close()
    model, opt = _tiny()
    history_now = ["stale"]
    config_now: dict = {"name": "other"}
    cf = CheckFreq(model=model, optimizer=opt, storage=str(tmp_path), every=2,
                   extra_state={"tokens": 0, "history": history_now, "config": config_now, "note": "x"})
    assert cf.restore() == 4
    assert cf.extra_state["tokens"] == 4000 and cf.extra_state["note"] is None
    assert history_now == [1, 2, 3, 4] and cf.extra_state["history"] is history_now  # refilled in place
    assert config_now == {"name": "run", "lr": 0.1} and cf.extra_state["config"] is config_now
    cf.close()
    with pytest.raises(TypeError, match=r"extra_state\['when'\]: tuple has no state_dict\(\)/load_state_dict\(\) "
                                        r"and is not a plain value"):
        CheckFreq(model=model, optimizer=opt, storage=str(tmp_path), extra_state={"when": (1, 2)})
    with pytest.raises(TypeError, match=r"extra_state\['keys'\]: dict has no state_dict"):
        CheckFreq(model=model, optimizer=opt, storage=str(tmp_path), extra_state={"keys": {1: "a"}})
