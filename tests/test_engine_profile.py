"""The engine's own numbers: profiling that sees interference, the cached profile's
fingerprint, compression decided by measurement, the overhead estimate against a measured
ground truth, the iteration counter after a failed persist, conflicting arguments."""

from __future__ import annotations

import time

import pytest
import torch

from ray_checkfreq import CheckFreq
from ray_checkfreq.engine import CheckFreqConfig, PersistError
from ray_checkfreq.engine.checkfreq import PROFILE_NAME
from ray_checkfreq.storage import CheckpointStore


class SlowStore(CheckpointStore):
    """Each save also spends ``delay_s``: asleep (no CPU), or spinning in Python with the GIL."""

    def __init__(self, *args, delay_s: float = 0.0, spin: bool = False, fail_steps=(), **kwargs):
        super().__init__(*args, **kwargs)
        self.delay_s, self.spin, self.fail_steps = delay_s, spin, set(fail_steps)
        self.codecs: list[str] = []

    def save(self, step, state, **kwargs):
        if step in self.fail_steps:
            raise OSError(28, "No space left on device")
        self.codecs.append(kwargs.get("codec"))
        if self.spin:
            end = time.perf_counter() + self.delay_s
            while time.perf_counter() < end:  # pure Python: holds the GIL between switches
                sum(range(200))
        else:
            time.sleep(self.delay_s)
        return super().save(step, state, **kwargs)


def _model(width: int = 16):
    torch.manual_seed(0)
    model = torch.nn.Linear(width, width)
    return model, torch.optim.SGD(model.parameters(), lr=0.01)


def _loop(model, opt, cf, iterations: int, sleep_s: float = 0.0, python_work: int = 0,
          until_decided: bool = False) -> float:
    """Iterations whose duration is mostly a sleep (plus some Python work that needs the GIL);
    with ``until_decided``, on past ``iterations`` (up to 40x) until the policy has chosen k."""
    start = time.perf_counter()
    x = torch.ones(4, model.in_features)
    done = 0
    while done < iterations or (until_decided and cf.decision is None and done < 40 * iterations):
        done += 1
        time.sleep(sleep_s)
        for _ in range(python_work):
            sum(range(100))
        opt.zero_grad()
        model(x).sum().backward()
        opt.step()
        if cf is not None:
            cf.step()
    return time.perf_counter() - start


# ---------------------------------------------------------------- arguments
def test_conflicting_constructor_arguments_are_refused(tmp_path):
    model, opt = _model()
    with pytest.raises(ValueError, match=r"config=\.\.\., every=5"):
        CheckFreq(model=model, optimizer=opt, storage=str(tmp_path), config=CheckFreqConfig(), every=5)
    with pytest.raises(ValueError, match="overhead=0.1"):
        CheckFreq(model=model, optimizer=opt, storage=str(tmp_path), config=CheckFreqConfig(every=3), overhead=0.1)
    cf = CheckFreq(model=model, optimizer=opt, storage=str(tmp_path), config=CheckFreqConfig(every=3))
    assert cf.config.every == 3
    cf.close()


# -------------------------------------------------------------- persist error
def test_a_caught_persist_error_leaves_the_iteration_in_step_with_the_optimizer(tmp_path):
    model, opt = _model()
    store = SlowStore(str(tmp_path), fail_steps={2}, codec="raw")
    cf = CheckFreq(model=model, optimizer=opt, storage=store, every=2)
    cf.restore()
    steps = failures = 0
    for _ in range(8):
        opt.step()
        steps += 1
        try:
            cf.step()
        except PersistError:
            failures += 1
        assert cf.iteration == steps
    cf.close()
    assert failures == 1
    newest = store.list()[-1]
    assert newest.step >= 7, "checkpoints go on after the failure"
    assert store.load(newest)["checkfreq"]["iteration"] == newest.step, "and record the right iteration"


# ---------------------------------------------------------- overhead estimate
@pytest.mark.parametrize(("every", "delay_s"), [(3, 0.08), (4, 0.05)])
def test_the_overhead_estimate_matches_a_measured_ground_truth(tmp_path, every, delay_s):
    """Same loop with and without checkpoints. At k = 3 of 10 ms iterations a store that
    waits 80 ms per save makes each checkpoint wait for the previous (truth ~1.7); at
    k = 25 with no delay the overhead is small."""
    model, opt = _model()
    baseline = _loop(model, opt, None, 75, sleep_s=0.01)
    store = SlowStore(str(tmp_path), delay_s=delay_s, codec="raw")
    cf = CheckFreq(model=model, optimizer=opt, storage=store, every=every)
    cf.restore()
    with_checkpoints = _loop(model, opt, cf, 75, sleep_s=0.01)
    truth = with_checkpoints / baseline - 1
    stats = cf.stats()
    estimate = stats["overhead_measured"]
    cf.close()
    assert abs(estimate - truth) <= 0.15 + 0.35 * truth, f"estimate {estimate:.3f}, measured {truth:.3f}"
    assert truth > 0.1
    # the exported figure is the share of wall time: in [0, 1], the same measurement
    assert 0 <= stats["overhead_estimate"] <= 1
    assert stats["overhead_estimate"] == pytest.approx(estimate / (1 + estimate), abs=1e-9)


# ------------------------------------------------------------------ profiling
def _profiled(tmp_path, spin: bool) -> CheckFreq:
    model, opt = _model()
    store = SlowStore(str(tmp_path), delay_s=0.6, spin=spin)
    cf = CheckFreq(model=model, optimizer=opt, storage=store, profile_iters=8, adaptive=False)
    cf.restore()
    _loop(model, opt, cf, 60, sleep_s=0.004, python_work=20, until_decided=True)
    cf.close()
    return cf


def test_profiling_measures_what_a_persist_takes_from_training(tmp_path):
    """A persist that holds the interpreter slows the iterations beside it: the policy's k
    accounts for that cost, which the paper's To (zero here) does not see."""
    sleeping = _profiled(tmp_path / "sleep", spin=False)
    spinning = _profiled(tmp_path / "spin", spin=True)
    assert sleeping.decision is not None and spinning.decision is not None
    assert spinning.decision.overhead_s < 0.005, "the copy is hidden: the paper's To is ~0"
    assert spinning.decision.cost_s > max(0.1, 2 * sleeping.decision.cost_s)
    assert spinning.decision.k == spinning.decision.k_cost > spinning.decision.k_persist
    # profiling_s sums the warm samples; the decision took their median (two are >= it), or
    # where they disagreed the largest
    disagreed = spinning.stats()["profiling"]["disagreed"]["raw"]
    assert spinning.stats()["profiling_s"] >= (1 if disagreed else 2) * spinning.decision.cost_s


def test_profiling_commits_its_checkpoint_and_decides_raw_on_a_fast_disk(tmp_path):
    model, opt = _model(1024)  # 4 MiB of state: enough bytes for compression to be considered
    cf = CheckFreq(model=model, optimizer=opt, storage=str(tmp_path), profile_iters=8)
    cf.restore()
    _loop(model, opt, cf, 40, sleep_s=0.01, until_decided=True)
    cf.close()
    assert cf.profile is not None and cf.profile.compress is False
    assert cf.stats()["compress"] is False
    steps = [r.step for r in CheckpointStore(str(tmp_path)).list()]
    assert steps and steps[0] >= 8, "the profiling checkpoint is a real one"


class ColdStore(CheckpointStore):
    """The first save is slow (``cold_s``), as a first write to new files and buffers is."""

    def __init__(self, *args, cold_s: float, **kwargs):
        super().__init__(*args, **kwargs)
        self.cold_s, self.saves = cold_s, 0

    def save(self, step, state, **kwargs):
        self.saves += 1
        if self.saves == 1:
            time.sleep(self.cold_s)
        return super().save(step, state, **kwargs)


def test_the_policy_decides_from_a_warm_checkpoint_not_the_cold_first_one(tmp_path):
    model, opt = _model()
    store = ColdStore(str(tmp_path), cold_s=1.0)
    cf = CheckFreq(model=model, optimizer=opt, storage=store, profile_iters=8)
    cf.restore()
    _loop(model, opt, cf, 60, sleep_s=0.005, until_decided=True)
    cf.close()
    assert cf.profile is not None and cf.decision is not None
    assert cf.profile.persist_s < 0.5, "the cold save's second is not the persist time"
    assert cf.decision.k_persist < 20, "one cold save (200 iterations long) does not set k"
    assert len(CheckpointStore(str(tmp_path)).list()) >= 2, "both profiling checkpoints are real"


def _cached_run(tmp_path, width: int, iterations: int) -> CheckFreq:
    model, opt = _model(width)
    cf = CheckFreq(model=model, optimizer=opt, storage=str(tmp_path), profile_iters=8)
    cf.restore()
    _loop(model, opt, cf, iterations, sleep_s=0.005, until_decided=iterations > 10)
    cf.close()
    return cf


def test_the_cached_profile_is_reused_only_while_its_fingerprint_holds(tmp_path):
    first = _cached_run(tmp_path, 16, 40)
    cached = CheckpointStore(str(tmp_path)).read_metadata(PROFILE_NAME)
    assert cached["fingerprint"]["state_bytes"] == (16 * 16 + 16) * 4
    same = _cached_run(tmp_path, 16, 5)
    assert same.profile == first.profile and same.stats()["profiling_s"] == 0.0
    bigger = _cached_run(tmp_path / "other", 16, 40)  # a store of its own, then a grown model reads it
    store = CheckpointStore(str(tmp_path / "other"))
    for ref in store.list():
        store.delete(ref)
    grown = _cached_run(tmp_path / "other", 32, 3)
    assert bigger.profile is not None
    assert grown.profile is None and grown.decision is None, "the state size changed: profiling again"


def test_a_cached_profile_without_a_fingerprint_is_not_trusted(tmp_path):
    first = _cached_run(tmp_path, 16, 40)
    store = CheckpointStore(str(tmp_path))
    cached = store.read_metadata(PROFILE_NAME)
    store.write_metadata(PROFILE_NAME, {"profile": cached["profile"], "decision": cached["decision"]})
    again = _cached_run(tmp_path, 16, 3)
    assert first.profile is not None and again.profile is None


# ---------------------------------------------------------------- compression
def test_with_a_fixed_k_compression_is_measured_not_assumed(tmp_path):
    model, opt = _model(512)
    fast = SlowStore(str(tmp_path / "fast"))
    cf = CheckFreq(model=model, optimizer=opt, storage=fast, every=10)
    cf.restore()
    _loop(model, opt, cf, 30, sleep_s=0.03)  # 300 ms between checkpoints
    cf.close()
    assert fast.codecs == ["raw"] * 3 and cf.stats()["compress"] is False
    # a persist far longer than k iterations: compression is tried once, then kept only if faster
    slow = SlowStore(str(tmp_path / "slow"), delay_s=0.2)
    cf = CheckFreq(model=model, optimizer=opt, storage=slow, every=2)
    cf.restore()
    _loop(model, opt, cf, 10, sleep_s=0.001)
    cf.close()
    assert slow.codecs[:2] == ["raw", "rcfz"] and len(set(slow.codecs[2:])) == 1
    forced = SlowStore(str(tmp_path / "forced"))
    cf = CheckFreq(model=model, optimizer=opt, storage=forced, every=2, compress=True)
    cf.restore()
    _loop(model, opt, cf, 6)
    cf.close()
    assert forced.codecs == ["rcfz"] * 3


# ------------------------------------------------------------------ fencing
def test_a_restarted_run_fences_the_old_one_still_writing(tmp_path):
    """An old rank 0 still training after a restart cannot commit over the new run: the
    new run's restore() takes a newer writer generation; the old run's next checkpoint
    fails loudly, and the newest checkpoint is the new run's."""
    old_model, old_opt = _model()
    old = CheckFreq(model=old_model, optimizer=old_opt, storage=str(tmp_path), every=5)
    old.restore()
    _loop(old_model, old_opt, old, 10)
    old.flush()
    new_model, new_opt = _model()
    new = CheckFreq(model=new_model, optimizer=new_opt, storage=str(tmp_path), every=5)
    assert new.restore() == 10, "the new run resumes from the old run's newest checkpoint"
    with pytest.raises(PersistError, match="FencedWriterError"):
        _loop(old_model, old_opt, old, 10)
        old.close()
    _loop(new_model, new_opt, new, 5)
    new.close()
    latest = CheckpointStore(str(tmp_path)).latest()
    assert latest is not None and latest.step == 15
    assert latest.writer_generation == new.store.writer_generation > old.store.writer_generation


def test_a_pause_beside_a_profiling_checkpoint_is_not_counted_as_its_cost(tmp_path):
    """Every third iteration pauses 0.3 s (evaluation, a data stall, another job's turn), so
    every measured checkpoint has a pause among the iterations beside it. The pause is not
    the checkpoint's cost: a sample's cost is bounded by its stalls plus its persist's wall
    time, and the k decided stays far below the one the pauses would give."""
    model, opt = _model(256)
    cf = CheckFreq(model=model, optimizer=opt, storage=str(tmp_path), profile_iters=8, adaptive=False,
                   compress=False)
    cf.restore()
    x = torch.ones(4, 256)
    done = 0
    while cf.decision is None and done < 600:
        done += 1
        if done % 3 == 0:
            time.sleep(0.3)
        opt.zero_grad()
        model(x).sum().backward()
        opt.step()
        cf.step()
    stats = cf.stats()
    cf.close()
    assert cf.decision is not None, f"no decision after {done} iterations"
    samples = stats["profiling"]["samples"]["raw"]
    assert samples, "profiling measured no warm checkpoint"
    for sample in samples:
        assert sample["inflation_s"] >= 0.2, f"the busy window held no pause: {sample}"
        assert sample["interference_s"] <= sample["bound_s"] + 1e-12
        assert sample["interference_s"] < 0.2, f"a pause was taken for the checkpoint's cost: {sample}"
    assert cf.decision.cost_s < 0.2
