"""Step shares under a changing quorum (in-place recovery on torchft replica groups).

Every sample of a step once whatever the quorum; a step fetched again until it commits;
the committed step travels to a healed replica; weighted losses give the global batch's
gradient."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ray_checkfreq.data import (
    DataStateError,
    IndexIterator,
    QuorumSteps,
    Sharding,
    WindowedOrder,
    resumable,
)

FAST = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
N, G, SEED = 203, 12, 7


class _Windowed(IndexIterator):
    """The Ray Data front end's order (``WindowedOrder``) without Ray: indices only."""

    def _order(self, epoch: int) -> WindowedOrder:
        return WindowedOrder(num_samples=self.num_samples, seed=self.seed, epoch=epoch, chunk_rows=5,
                             window_chunks=3, shuffle=self.shuffle, version=self.order_version)

    def _produce(self, order, epoch, slices):
        return (order.take(piece.lo, piece.hi) for piece in slices)


def _steps(n=N, g=G, *, seed=SEED, drop_last=False, world=1, rank=0, windowed=False, version=2) -> QuorumSteps:
    """A replica's steps; ``world``/``rank`` are the iterator's own (Train) ones, which play no part."""
    sharding = Sharding.for_global_batch(g, world_size=world, rank=rank, drop_last=drop_last)
    kind = _Windowed if windowed else IndexIterator
    return QuorumSteps(kind(n, sharding=sharding, seed=seed, order_version=version))


def _whole(steps: QuorumSteps, step: int) -> list[int]:
    return steps.share(step, rank=0, size=1).indices.tolist()


def _lockstep_batches(n, g, *, drop_last, epochs, windowed=False):
    """The global batches an ordinary one-rank iterator yields, epoch after epoch."""
    sharding = Sharding.for_global_batch(g, drop_last=drop_last)
    it = (_Windowed if windowed else IndexIterator)(n, sharding=sharding, seed=SEED)
    return [batch.tolist() for _ in range(epochs) for batch in it]


@st.composite
def _setups(draw):
    g = draw(st.integers(1, 24))
    drop_last = draw(st.booleans())
    n = draw(st.integers(g if drop_last else 1, 5 * g + 4))  # up to 6 steps an epoch, the last partial
    world = draw(st.sampled_from([w for w in range(1, g + 1) if g % w == 0]))
    return dict(n=n, g=g, drop_last=drop_last, world=world, rank=draw(st.integers(0, world - 1)),
                windowed=draw(st.booleans()))


# -- every sample of a step once, whatever the quorum ---------------------------------------
@FAST
@given(setup=_setups(), step=st.integers(0, 40), size=st.integers(1, 30))
def test_the_shares_of_any_quorum_tile_the_steps_global_batch(setup, step, size):
    steps = _steps(**setup)
    step %= 3 * steps.steps_per_epoch  # steps of three epochs
    shares = [steps.share(step, rank=r, size=size) for r in range(size)]
    whole = _whole(steps, step)
    assert np.concatenate([s.indices for s in shares]).tolist() == whole  # in rank order, none twice
    assert len(set(whole)) == len(whole) == shares[0].step_samples
    assert max(len(s.indices) for s in shares) - min(len(s.indices) for s in shares) <= 1
    assert all(s.weight == len(s.indices) / len(whole) for s in shares)
    assert math.isclose(math.fsum(s.weight for s in shares), 1.0, abs_tol=1e-12)
    assert {s.epoch for s in shares} == {step // steps.steps_per_epoch}
    # deterministic: another replica's object, built on its own, computes the same share
    other = _steps(**{**setup, "world": 1, "rank": 0})
    assert [other.share(step, rank=r, size=size).indices.tolist() for r in range(size)] == [
        s.indices.tolist() for s in shares]


@FAST
@given(setup=_setups())
def test_the_steps_are_the_lockstep_iterators_global_batches_across_epochs(setup):
    steps = _steps(**setup)
    n, g, drop_last = setup["n"], setup["g"], setup["drop_last"]
    reference = _lockstep_batches(n, g, drop_last=drop_last, epochs=2, windowed=setup["windowed"])
    assert [_whole(steps, s) for s in range(2 * steps.steps_per_epoch)] == reference
    for epoch in range(2):
        seen = sum((_whole(steps, s) for s in range(epoch * steps.steps_per_epoch,
                                                    (epoch + 1) * steps.steps_per_epoch)), [])
        used = n - n % g if drop_last else n
        assert len(seen) == len(set(seen)) == used and set(seen) <= set(range(n))  # every sample once


# -- a step that does not commit is fetched again -------------------------------------------
@FAST
@given(setup=_setups(), attempts=st.lists(st.tuples(st.integers(1, 6), st.booleans()), min_size=1, max_size=16))
def test_a_step_that_does_not_commit_is_fetched_again_with_the_same_samples(setup, attempts):
    steps = _steps(**setup)
    reference = _steps(**setup)
    committed = []
    for size, commits in attempts:
        before = steps.step
        taken = [steps.fetch(rank=r, size=size) for r in range(size)]
        assert {s.step for s in taken} == {before} and steps.step == before  # fetching moves nothing
        assert np.concatenate([s.indices for s in taken]).tolist() == _whole(reference, before)
        if commits:
            steps.commit(before)
            committed.append(before)
        assert steps.step == before + commits
    assert committed == list(range(len(committed)))


def test_commit_takes_each_step_once_in_order():
    steps = _steps()
    steps.commit(0)
    steps.commit(np.int64(1))
    with pytest.raises(ValueError, match=r"commit\(1\): the next uncommitted step is 2"):
        steps.commit(1)
    with pytest.raises(ValueError, match=r"commit\(5\): the next uncommitted step is 2"):
        steps.commit(5)
    assert steps.step == 2


# -- a healed replica gets the data position with the weights -------------------------------
@FAST
@given(setup=_setups(), quorums=st.lists(st.integers(1, 6), max_size=16), version=st.sampled_from([1, 2]))
def test_a_healed_replica_resumes_at_the_committed_step(setup, quorums, version):
    live = _steps(**setup, version=version)
    for size in quorums:
        live.fetch(rank=size - 1, size=size)
        live.commit(live.step)
    state = json.loads(json.dumps(live.state_dict()))  # what a checkpoint transport carries
    assert state["step"] == len(quorums)
    healed = _steps(**{**setup, "world": 1, "rank": 0})  # a fresh process, new order version by default
    healed.load_state_dict(state)
    assert healed.step == live.step
    for size in (1, 2, 5):
        assert [healed.fetch(rank=r, size=size).indices.tolist() for r in range(size)] == [
            live.fetch(rank=r, size=size).indices.tolist() for r in range(size)]
    # the ordinary iterator reads the same position: its next global batch is the next step
    plain = IndexIterator(setup["n"], sharding=Sharding.for_global_batch(setup["g"], drop_last=setup["drop_last"]),
                          seed=SEED)
    if not setup["windowed"]:
        plain.load_state_dict(state)
        assert next(iter(plain)).tolist() == _whole(live, live.step)


def test_the_steps_start_where_the_iterator_stands():
    live = _steps()
    for step in range(_steps().steps_per_epoch + 3):  # into epoch 1
        live.commit(step)
    it = resumable(N, global_batch_size=G, seed=SEED, rank=1, world_size=3)
    it.load_state_dict(live.state_dict())
    assert (it.epoch, it.consumed) == (1, 3 * G)
    assert QuorumSteps(it).step == live.step


def test_a_state_that_does_not_fit_is_refused_naming_the_field():
    live = _steps()
    live.commit(0)
    state = live.state_dict()
    with pytest.raises(DataStateError, match="'step' is 9"):
        _steps().load_state_dict({**state, "step": 9})
    with pytest.raises(DataStateError, match="'seed' is 7"):
        _steps(seed=8).load_state_dict(state)
    with pytest.raises(DataStateError, match="'global_batch_size' is 12"):
        _steps(g=6).load_state_dict(state)
    mid_step = resumable(N, global_batch_size=G, seed=SEED, rank=0, world_size=1).state_dict()
    with pytest.raises(DataStateError, match="'consumed' is 5, but this iterator has 'a multiple of"):
        _steps().load_state_dict({**mid_step, "consumed": 5})


def test_bad_arguments_are_refused_naming_the_value():
    with pytest.raises(ValueError, match="per-rank batch_size=4: build it with resumable"):
        QuorumSteps(resumable(N, batch_size=4, rank=0, world_size=1))
    with pytest.raises(ValueError, match="an epoch of 5 samples holds no step of global_batch_size=6"):
        _steps(5, 6, drop_last=True)
    steps = _steps()
    with pytest.raises(ValueError, match=r"quorum rank must be in \[0, 3\), got 3"):
        steps.fetch(rank=3, size=3)
    with pytest.raises(ValueError, match="quorum size must be >= 1, got 0"):
        steps.fetch(rank=0, size=0)
    with pytest.raises(ValueError, match="quorum rank must be an integer, got 1.0"):
        steps.fetch(rank=1.0, size=3)
    with pytest.raises(ValueError, match="step must be >= 0, got -1"):
        steps.share(-1, rank=0, size=1)


# -- an uneven split is weighted: the update is the mean over the global batch ----------------
def test_weighted_losses_give_the_gradient_of_the_whole_global_batch():
    n, g, features = 47, 10, 5  # steps of 10, 10, 10, 10, 7 samples: uneven for 3, 4 and 11 participants
    torch.manual_seed(0)
    x, y = torch.randn(n, features), torch.randn(n)
    model = torch.nn.Linear(features, 1)
    steps = _steps(n, g)

    def gradient(indices: np.ndarray, scale: float) -> torch.Tensor:
        model.zero_grad()
        if len(indices) == 0:  # a participant with nothing to read contributes zeros
            return torch.zeros(features + 1)
        rows = torch.as_tensor(indices)
        loss = torch.nn.functional.mse_loss(model(x[rows]).squeeze(-1), y[rows]) * scale
        loss.backward()
        return torch.cat([p.grad.flatten() for p in model.parameters()])

    checked_uneven = 0
    for step in range(steps.steps_per_epoch + 1):  # into the next epoch
        reference = gradient(steps.share(step, rank=0, size=1).indices, 1.0)
        for size in (1, 2, 3, 4, 11):
            shares = [steps.share(step, rank=r, size=size) for r in range(size)]
            # torchft's Manager.allreduce and DDP: sum over the participants, divided by their number
            averaged = sum(gradient(s.indices, s.loss_scale) for s in shares) / size
            assert (averaged - reference).abs().max().item() < 1e-6, (step, size)
            weighted = sum(s.weight * gradient(s.indices, 1.0) for s in shares)
            assert (weighted - reference).abs().max().item() < 1e-6, (step, size)
            if len({len(s.indices) for s in shares}) > 1:  # unweighted, an uneven split is off
                unweighted = sum(gradient(s.indices, 1.0) for s in shares if len(s.indices)) / size
                assert (unweighted - reference).abs().max().item() > 1e-3, (step, size)
                checked_uneven += 1
    assert checked_uneven >= 8
