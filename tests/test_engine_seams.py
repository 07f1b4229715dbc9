"""The engine's seams for the Ray layer, without Ray.

Two "ranks" (two engines on two replicas of one model, trained on the same batches) share
a decision channel with lookahead 1: the planner's action for iteration i + 1 goes on the
wire (as ints, as a broadcast tensor would carry it) at step i and every rank applies it
at step i + 1. Host memory and persister are fakes over plain tensors and the real
``PersistWorker``.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from test_snapshot_copies import ASYNC, FakeOps, _two_device_state

from ray_checkfreq import CheckpointStore
from ray_checkfreq.engine import (
    Action,
    CheckFreq,
    EngineSeams,
    PersistWorker,
    local_rng_state,
)
from ray_checkfreq.engine.checkfreq import PROFILE_NAME
from ray_checkfreq.engine.seams import set_local_rng_state
from ray_checkfreq.engine.snapshot import Snapshotter
from ray_checkfreq.ray.decisions import ACTION_INTS, NO_ACTION_INTS, from_ints, to_ints
from ray_checkfreq.storage.tree import flatten_state, leaves_of, unflatten_state


# ------------------------------------------------------------------- fakes
class LookaheadChannel:
    """Rank 0 puts its plan on the wire at each step; every rank applies the previous step's."""

    lookahead = 1

    def __init__(self, wire: list[list[int]], *, is_planner: bool) -> None:
        self.wire, self.is_planner, self.steps = wire, is_planner, 0

    def exchange(self, planned: Action | None) -> Action | None:
        if self.is_planner:
            self.wire.append(to_ints(planned) if planned is not None else list(NO_ACTION_INTS))
        self.steps += 1
        return from_ints(self.wire[self.steps - 2]) if self.steps >= 2 else None


class RecordingPersister:
    """The real PersistWorker, with a record of what was submitted."""

    def __init__(self, store, on_done) -> None:
        self.inner = PersistWorker(store, on_done=on_done)
        self.submitted: list[tuple] = []

    @property
    def busy(self) -> bool:
        return self.inner.busy

    def submit(self, snapshot, **options) -> None:
        self.submitted.append((snapshot, options))
        self.inner.submit(snapshot, **options)

    def wait_idle(self) -> float:
        return self.inner.wait_idle()

    def raise_if_failed(self) -> None:
        self.inner.raise_if_failed()

    def close(self) -> None:
        self.inner.close()


class InlinePersister(RecordingPersister):
    """Persists inside ``submit``: never busy, so profiling's windows end at known iterations."""

    def submit(self, snapshot, **options) -> None:
        self.submitted.append((snapshot, options))
        result, error = self.inner._persist(snapshot, options)
        if error is not None:
            raise error
        self.inner._on_done(result)


class PlainHostMemory:
    """Host memory as plain preallocated tensors, reallocated when the layout changes."""

    def __init__(self, wrong_shape: bool = False) -> None:
        self.calls: list[tuple[int, list, object, dict]] = []  # (step, layout, token, views)
        self.wrong_shape = wrong_shape
        self._layout: list | None = None
        self._views: dict = {}

    def prepare(self, step, layout):
        if layout != self._layout:
            self._layout = list(layout)
            self._views = {path: torch.empty((shape[0] + 1, *shape[1:]) if self.wrong_shape and shape else shape,
                                             dtype=dtype)
                           for path, shape, dtype in layout}
        token = object()
        self.calls.append((step, list(layout), token, dict(self._views)))
        return token, dict(self._views)


def _recording(made: list, persister: type = RecordingPersister):
    def factory(store, on_done):
        made.append(persister(store, on_done))
        return made[-1]
    return factory


# ------------------------------------------------------------- the "ranks"
@dataclass
class Rank:
    model: torch.nn.Module
    opt: torch.optim.Optimizer
    cf: CheckFreq
    store: CheckpointStore
    persisters: list = field(default_factory=list)

    def steps(self) -> list[int]:
        return [snapshot.step for p in self.persisters for snapshot, _ in p.submitted]

    def submitted(self) -> list[tuple]:
        return [(s.step, s.epoch_boundary, o.get("codec")) for p in self.persisters for s, o in p.submitted]


def _replica():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))
    return model, torch.optim.Adam(model.parameters(), lr=1e-2)


def _rank(root, name: str, channel, **config) -> Rank:
    model, opt = _replica()
    made: list = []
    store = CheckpointStore(str(root / name), keep_last=1000, codec="raw")
    seams = EngineSeams(decisions=channel, persister=_recording(made)) if channel else EngineSeams(
        persister=_recording(made))
    cf = CheckFreq(model=model, optimizer=opt, storage=store, seams=seams, **config)
    return Rank(model, opt, cf, store, made)


def _pair(root, **config) -> list[Rank]:
    wire: list[list[int]] = []
    return [_rank(root, "planner", LookaheadChannel(wire, is_planner=True), **config),
            _rank(root, "follower", LookaheadChannel(wire, is_planner=False), **config)]


def _train_step(model, opt, it: int) -> None:
    x = torch.randn(16, 8, generator=torch.Generator().manual_seed(it))
    opt.zero_grad()
    model(x).pow(2).mean().backward()
    opt.step()


def _run(ranks: list[Rank], start: int, stop: int, states: dict | None = None) -> None:
    for it in range(start, stop):
        for rank in ranks:
            _train_step(rank.model, rank.opt, it)
            rank.cf.step()
        if states is not None:
            states[ranks[0].cf.iteration] = _state_of(ranks[0].model, ranks[0].opt)


def _state_of(model, opt) -> list[torch.Tensor]:
    tensors = list(model.state_dict().values())
    tensors += [t for _, _, t in leaves_of(opt.state_dict()["state"]) if isinstance(t, torch.Tensor)]
    return [t.detach().clone() for t in tensors]


def _same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))


def _close(ranks: list[Rank]) -> None:
    for rank in ranks:
        rank.cf.close()


# ------------------------------------------------------ lookahead 1, two ranks
def test_with_lookahead_every_rank_checkpoints_every_k_and_on_epoch_ends_like_a_local_run(tmp_path):
    ranks = _pair(tmp_path, every=3, epoch_len=10)
    ranks[0].cf.restore()
    _run(ranks, 0, 25)
    _close(ranks)
    local = _rank(tmp_path, "local", None, every=3, epoch_len=10)
    local.cf.restore()
    _run([local], 0, 25)
    local.cf.close()
    expected = [3, 6, 9, 10, 13, 16, 19, 20, 23]  # k after the last one; epoch ends exactly
    assert ranks[0].steps() == ranks[1].steps() == local.steps() == expected
    assert ranks[0].submitted() == ranks[1].submitted() == local.submitted()
    assert [step for step, boundary, _ in ranks[0].submitted() if boundary] == [10, 20]
    assert _same(_state_of(ranks[0].model, ranks[0].opt), _state_of(local.model, local.opt))


def test_a_change_of_k_reaches_every_rank_at_the_same_iteration(tmp_path):
    ranks = _pair(tmp_path, every=3)
    ranks[0].cf.restore()
    _run(ranks, 0, 7)
    ranks[0].cf._k = 5  # as the adaptive rate does on the planner
    _run(ranks, 7, 20)
    _close(ranks)
    assert ranks[0].steps() == ranks[1].steps() == [3, 6, 9, 14, 19]
    assert ranks[0].cf.stats()["k_changes"] == ranks[1].cf.stats()["k_changes"] == [(9, 5)]
    assert ranks[0].cf.stats()["k"] == ranks[1].cf.stats()["k"] == 5


def test_the_policy_decides_under_lookahead_and_a_restore_resumes_bit_identically(tmp_path):
    config = dict(profile_iters=8, epoch_len=40, compress=False)
    ranks = _pair(tmp_path, **config)
    ranks[0].cf.restore()
    states: dict[int, list[torch.Tensor]] = {}
    done = 0
    while ranks[0].cf.decision is None and done < 600:
        _run(ranks, done, done + 10, states)
        done += 10
    assert ranks[0].cf.decision is not None, "the profiling window never reached a decision"
    end = done + 85  # two epoch ends at least, whatever k the policy chose
    _run(ranks, done, end, states)
    _close(ranks)
    planner, follower = ranks
    assert planner.cf.profile is not None and planner.store.read_metadata(PROFILE_NAME)
    assert follower.cf.decision is None, "the follower takes k from the actions, it does not profile"
    assert planner.submitted() == follower.submitted() and len(planner.steps()) >= 4
    assert [s for s in planner.steps() if s % 40 == 0] == list(range(40, end + 1, 40))
    assert follower.cf.stats()["k"] == planner.cf.stats()["k"] is not None
    assert follower.cf.stats()["k_changes"] == planner.cf.stats()["k_changes"]
    final = states[end]

    # every rank restores the committed step and goes on to the same final state
    committed = planner.store.latest().step
    wire: list[list[int]] = []
    again = [_rank(tmp_path, "planner", LookaheadChannel(wire, is_planner=True), **config),
             _rank(tmp_path / "again", "follower", LookaheadChannel(wire, is_planner=False), **config)]
    assert again[0].cf.restore() == committed
    assert again[1].cf.apply_state(planner.store.load()) == committed
    for rank in again:
        assert _same(_state_of(rank.model, rank.opt), states[committed])
    _run(again, committed, end)
    _close(again)
    for rank in again:
        assert _same(_state_of(rank.model, rank.opt), final)


def test_a_rank_that_takes_no_snapshots_still_calls_rng_state_once_per_checkpoint(tmp_path):
    wire: list[list[int]] = []
    planner = _rank(tmp_path, "planner", LookaheadChannel(wire, is_planner=True), every=3)
    called_at: list[int] = []
    follower_made: list = []
    model, opt = _replica()
    follower_cf = CheckFreq(model=model, optimizer=opt, storage=str(tmp_path / "follower"), every=3,
                            seams=EngineSeams(decisions=LookaheadChannel(wire, is_planner=False),
                                              persister=_recording(follower_made), takes_snapshots=False,
                                              rng_state=lambda: called_at.append(follower_cf.iteration)))

    def no_snapshot(*args, **kwargs):
        raise AssertionError("a rank with takes_snapshots=False took a snapshot")

    follower_cf._snapshotter.take = no_snapshot
    follower = Rank(model, opt, follower_cf, follower_cf.store, follower_made)
    planner.cf.restore()
    _run([planner, follower], 0, 13)
    _close([planner, follower])
    assert called_at == planner.steps() == [3, 6, 9, 12]
    assert follower_made == [] and follower.store.list() == []


def test_rng_state_goes_into_the_snapshot_and_apply_state_hands_it_back(tmp_path):
    marks: list = []
    model, opt = _replica()
    holder: list[CheckFreq] = []
    seams = EngineSeams(rng_state=lambda: {"mine": local_rng_state(), "at": torch.tensor(holder[0].iteration)},
                        set_rng_state=marks.append)
    cf = CheckFreq(model=model, optimizer=opt, storage=str(tmp_path), every=4, seams=seams)
    holder.append(cf)
    cf.restore()
    _run([Rank(model, opt, cf, cf.store)], 0, 10)
    cf.close()
    assert int(cf.store.load()["rng"]["at"]) == 8
    model, opt = _replica()
    again = CheckFreq(model=model, optimizer=opt, storage=str(tmp_path), every=4, seams=EngineSeams(
        set_rng_state=marks.append))
    assert again.restore() == 8
    again.close()
    assert len(marks) == 1 and int(marks[0]["at"]) == 8


# --------------------------------------------------------------- host memory
def _growing_model():
    """Adam state for ``late`` appears only once it gets gradients, at iteration 3."""
    torch.manual_seed(0)
    model = torch.nn.ModuleDict({"early": torch.nn.Linear(8, 4), "late": torch.nn.Linear(4, 4)})
    return model, torch.optim.Adam(model.parameters(), lr=1e-2)


def _growing_step(model, opt, it: int) -> None:
    x = torch.randn(16, 8, generator=torch.Generator().manual_seed(it))
    opt.zero_grad()
    out = model["early"](x)
    if it >= 2:
        out = model["late"](out)
    out.pow(2).mean().backward()
    opt.step()


def test_snapshots_land_in_the_host_memory_views_and_the_store_gets_the_right_state(tmp_path):
    model, opt = _growing_model()
    memory, made = PlainHostMemory(), []
    store = CheckpointStore(str(tmp_path), keep_last=100, codec="raw")
    cf = CheckFreq(model=model, optimizer=opt, storage=store, every=1,
                   seams=EngineSeams(host_memory=memory, persister=_recording(made)))
    cf.restore()
    states = {}
    for it in range(5):
        _growing_step(model, opt, it)
        cf.step()
        states[cf.iteration] = _state_of(model, opt)
    cf.close()
    assert [step for step, *_ in memory.calls] == [1, 2, 3, 4, 5]
    layouts = [layout for _, layout, *_ in memory.calls]
    assert layouts[0] == layouts[1] != layouts[2] == layouts[3] == layouts[4]
    new_paths = {path for path, *_ in layouts[2]} - {path for path, *_ in layouts[1]}
    assert new_paths and all(path[0] == "optimizer" for path in new_paths), new_paths
    submitted = [snapshot for snapshot, _ in made[0].submitted]
    for snapshot, (_, layout, token, views) in zip(submitted, memory.calls, strict=True):
        assert snapshot.memory is token
        snapshot_ptrs = {t.data_ptr() for _, _, t in leaves_of(snapshot.state) if isinstance(t, torch.Tensor)}
        assert snapshot_ptrs == {view.data_ptr() for view in views.values()}
        assert len(views) == len(layout)
    for step in (2, 5):
        loaded = store.load(step)
        model_b, opt_b = _growing_model()
        model_b.load_state_dict(loaded["model"])
        opt_b.load_state_dict(loaded["optimizer"])
        assert _same(_state_of(model_b, opt_b), states[step])


def test_host_memory_of_the_wrong_shape_is_refused_by_path(tmp_path):
    model, opt = _replica()
    cf = CheckFreq(model=model, optimizer=opt, storage=str(tmp_path), every=1,
                   seams=EngineSeams(host_memory=PlainHostMemory(wrong_shape=True)))
    cf.restore()
    _train_step(model, opt, 0)
    with pytest.raises(ValueError, match=r"host memory for \('model_params', '0.weight'\)"):
        cf.step()
    cf.close()


def test_a_gpu_mode_snapshot_moves_to_the_host_memory_views_not_its_own_pinned_buffers():
    ops, memory = FakeOps(), PlainHostMemory()
    snapshotter = Snapshotter("gpu", ops=ops, host_memory=memory)
    live = _two_device_state(ops)
    snapshot = snapshotter.take(1, live, ASYNC)
    snapshot.copies.wait()
    (_, _, token, views), = memory.calls
    assert snapshot.memory is token and ops.pinned == set()
    for path, _, value in leaves_of(snapshot.state):
        assert value.data_ptr() == views[path].data_ptr()
    for path, _, value in leaves_of(live):
        assert torch.equal(views[path], value)
    snapshotter.close()


# ------------------------------------------------------------------ actions
actions = st.builds(
    Action,
    iteration=st.integers(1, 2**63 - 1),
    checkpoint=st.booleans(),
    epoch_boundary=st.booleans(),
    codec=st.sampled_from([None, "raw", "rcfz"]),
    k=st.none() | st.integers(1, 2**63 - 1),
    stop=st.booleans(),
)


@given(actions)
def test_an_action_survives_its_int_encoding(action):
    ints = to_ints(action)
    assert len(ints) == ACTION_INTS and all(-(2**63) <= v < 2**63 for v in ints)
    assert from_ints(torch.tensor(ints, dtype=torch.int64).tolist()) == action


def test_no_action_and_bad_encodings():
    assert from_ints(NO_ACTION_INTS) is None
    for bad in ([1, 5, 8, -1, -1], [1, 5, 0, 2, -1], [1, 5, 0, -1, 0], [2, 5, 0, -1, -1], [1, 5, 0]):
        with pytest.raises(ValueError):
            from_ints(bad)
    with pytest.raises(ValueError, match="codec='zip'"):
        Action(iteration=1, codec="zip")
    with pytest.raises(ValueError, match="iteration=0"):
        Action(iteration=0)


class ScriptedChannel:
    lookahead = 0
    is_planner = True

    def __init__(self, script: dict[int, Action]) -> None:
        self.script, self.steps = script, 0

    def exchange(self, planned):
        self.steps += 1
        return self.script.get(self.steps, planned)


def test_a_stop_action_is_recorded_and_does_nothing_else(tmp_path):
    model, opt = _replica()
    made: list = []
    cf = CheckFreq(model=model, optimizer=opt, storage=str(tmp_path), every=100, seams=EngineSeams(
        decisions=ScriptedChannel({4: Action(iteration=4, stop=True)}), persister=_recording(made)))
    cf.restore()
    seen = []
    for it in range(6):
        _train_step(model, opt, it)
        cf.step()
        seen.append(cf.stop_requested)
    cf.close()
    assert seen == [False, False, False, True, True, True]
    assert made[0].submitted == [] and cf.stats()["k"] == 100


def test_an_action_for_another_iteration_is_refused_naming_both(tmp_path):
    model, opt = _replica()
    cf = CheckFreq(model=model, optimizer=opt, storage=str(tmp_path), every=100, seams=EngineSeams(
        decisions=ScriptedChannel({2: Action(iteration=3, checkpoint=True)})))
    cf.restore()
    _train_step(model, opt, 0)
    cf.step()
    _train_step(model, opt, 1)
    with pytest.raises(RuntimeError, match="iteration 2 the action planned for iteration 3"):
        cf.step()
    cf.close()


def test_an_epoch_end_checkpoints_also_at_the_iteration_a_profiling_measurement_ends(tmp_path):
    """With persists done inline, every profiling window ends at a fixed iteration; over
    these epoch lengths one epoch end falls on each kind of window end (a cold, a warm and
    the last, deciding measurement): every epoch end still gets its checkpoint."""
    for epoch_len in range(5, 31):
        model, opt = _replica()
        made: list = []
        store = CheckpointStore(str(tmp_path / str(epoch_len)), keep_last=1000, codec="raw")
        seams = EngineSeams(persister=_recording(made, InlinePersister))
        cf = CheckFreq(model=model, optimizer=opt, storage=store, seams=seams,
                       profile_iters=2, epoch_len=epoch_len, compress=False)
        cf.restore()
        for it in range(90):
            _train_step(model, opt, it)
            cf.step()
        cf.close()
        assert cf.decision is not None, epoch_len
        steps = {snapshot.step for p in made for snapshot, _ in p.submitted}
        missing = [end for end in range(epoch_len, 91, epoch_len) if end not in steps]
        assert not missing, f"epoch_len={epoch_len}: no checkpoint at epoch ends {missing}"



def _draws() -> tuple:
    return random.random(), random.gauss(0, 1), float(np.random.rand()), float(torch.rand(()))


@given(st.integers(0, 2**31 - 1), st.integers(0, 5), st.booleans())
def test_rng_states_come_back_from_a_stored_checkpoint_in_either_python_form(seed, drawn, tuple_form):
    """The Python RNG's 625 words travel as one uint32 array (not 625 leaves for every
    snapshot to walk); the tuple of ``random.getstate()``, which older checkpoints hold,
    still loads."""
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    for _ in range(drawn):
        _draws()
    random.gauss(0, 1)  # leaves a cached second Gaussian in the state
    state = local_rng_state()
    if tuple_form:
        state["python"] = random.getstate()
    flat = flatten_state({"rng": state})
    assert tuple_form or len(json.dumps(flat.skeleton)) < 2000  # 625 words as scalars: > 6000
    expected = _draws()
    _draws()
    set_local_rng_state(unflatten_state(flat.skeleton, flat.leaves)["rng"])
    assert _draws() == expected


class _RecordedPuts:
    """A queue whose ``put`` calls (made on the training thread) are written to ``order``."""

    def __init__(self, inner: Any, order: list[str]) -> None:
        self.inner, self.order = inner, order

    def put(self, item: Any) -> None:
        if item is not None:  # None: the thread's end, at close()
            self.order.append("handed over")
        self.inner.put(item)

    def get(self) -> Any:
        return self.inner.get()


def test_at_a_checkpoint_the_next_decision_broadcast_is_handed_over_after_the_snapshot(tmp_path):
    import torch.distributed as dist

    from ray_checkfreq.engine import CheckFreqConfig
    from ray_checkfreq.ray.decisions import BroadcastDecisions

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'rendezvous'}", rank=0, world_size=1)
    try:
        decisions = BroadcastDecisions(dist.new_group(backend="gloo"), rank=0)
        order: list[str] = []
        decisions._outbox = _RecordedPuts(decisions._outbox, order)  # type: ignore[assignment]
        model = torch.nn.Linear(4, 2)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        cf = CheckFreq(model=model, optimizer=opt, storage=CheckpointStore(str(tmp_path / "store")),
                       config=CheckFreqConfig(every=2, compress=False), seams=EngineSeams(decisions=decisions))
        take = cf._executor._take_snapshot
        cf._executor._take_snapshot = lambda *args: order.append("snapshot") or take(*args)  # type: ignore[method-assign]
        for step in range(1, 5):
            model(torch.ones(1, 4)).sum().backward()
            opt.step()
            opt.zero_grad()
            cf.step()
            order.append(f"step {step} done")
        cf.close()
        decisions.close()
    finally:
        dist.destroy_process_group()
    # Steps 1 and 3 hand the next action over at once; steps 2 and 4 checkpoint first, and
    # every step hands its action over before it returns.
    assert order == ["handed over", "step 1 done", "snapshot", "handed over", "step 2 done",
                     "handed over", "step 3 done", "snapshot", "handed over", "step 4 done"]
    assert [ref.step for ref in CheckpointStore(str(tmp_path / "store")).list()] == [2, 4]
