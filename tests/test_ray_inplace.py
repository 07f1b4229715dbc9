"""In-place recovery (torchft replica groups on Ray Train): a replica SIGKILLed mid-step
while the others train on, every sample once, and the weights of an uninterrupted run.

Two ``TorchTrainer`` runs of ``inplace_jobs.train`` with 3 replicas (one worker each) on the
session cluster, checkpointing every 10 steps to one storage. In the first, the replica of
world rank 0 (the checkpoint writer: rank 0 of the quorum) kills itself after its backward
pass of step 40, before the commit. The controller replaces only that worker; the new one
heals from a live peer (weights, optimizer and data position), the survivors' new rank 0
writes the checkpoints meanwhile, and the job ends at the first epoch end after the three
have trained together again for a while. The second run is the job submitted again: it
resumes from the newest checkpoint and trains one more epoch.
"""

from __future__ import annotations

import collections
import glob
import json
import os
import threading
import time
import uuid

import inplace_jobs  # tests/ is on sys.path
import pytest
import torch
from conftest import RUN_TIMEOUT_S

pytestmark = pytest.mark.chaos

REPLICAS = 3
CONFIG = {"samples": 1200, "global_batch": 12, "max_epochs": 6, "full_steps": 20, "kill_step": 40,
          "kill_rank": 0, "step_sleep_s": 0.02, "every": 10}
# The survivors' longest wait for a commit: the lighthouse's heartbeat timeout (1 s) and the
# new quorum's process group; 1.5 s measured at a load average of 7. Bounded loosely here
# (CI shares its 2 cores with Ray's own processes); the figure itself is printed.
SURVIVOR_PAUSE_LIMIT_S = 6.0
# Three shares of a step are summed in another order than one whole batch: float32 rounding.
WEIGHT_TOLERANCE = 1e-5


def read_events(work_dir: str) -> list[dict]:
    found = []
    for path in glob.glob(os.path.join(work_dir, "log-*.jsonl")):
        world_rank = int(path.rsplit("-", 1)[1].split(".")[0])
        with open(path) as lines:
            found += [dict(event, world_rank=world_rank) for event in map(json.loads, lines)]
    return sorted(found, key=lambda e: e["t"])


def when_all_trained(work_dir: str, world_rank: int, then, *, full_steps: int = 5,
                     timeout_s: float = RUN_TIMEOUT_S) -> threading.Thread:
    """A thread that calls ``then(node)`` with ``world_rank``'s node once every replica
    committed ``full_steps`` steps together (the worker group fully started)."""

    def watch() -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            try:
                events = read_events(work_dir)
            except ValueError:  # a line being written
                continue
            starts = [e for e in events if e["event"] == "start" and e["world_rank"] == world_rank]
            full = [e for e in events if e["event"] == "commit" and e["size"] == REPLICAS and e["world_rank"] == 0]
            if starts and len(full) >= full_steps:
                then(starts[0]["node"])
                return
            time.sleep(0.1)

    thread = threading.Thread(target=watch, daemon=True)
    thread.start()
    return thread


def remove_node(cluster, node: str) -> None:
    """The node whole: its raylet and processes SIGKILLed."""
    cluster.remove_node(next(n for n in cluster.worker_nodes if n.node_id == node), allow_graceful=False)


def committed_shares(events: list[dict], end_step: int, first: int = 0) -> dict[int, list[dict]]:
    """Step -> the shares its commit averaged: the last share each process fetched of that
    step in the quorum size the step committed with (a replica killed after its backward
    pass still gave its gradient to the commit it did not live to see)."""
    commits: dict[int, set[int]] = collections.defaultdict(set)
    for event in events:
        if event["event"] == "commit":
            commits[event["step"]].add(event["size"])
    shares = {}
    for step in range(first, end_step):
        sizes = commits.get(step)
        assert sizes is not None and len(sizes) == 1, f"step {step} committed at quorum sizes {sizes}"
        (size,) = sizes
        last: dict[int, dict] = {}
        for event in events:  # in time order: a rollback forgets the tries before it
            if event["event"] == "rollback" and event["step"] == step:
                last.clear()
            elif event["event"] == "share" and event["step"] == step and event["size"] == size:
                last[event["pid"]] = event
        shares[step] = list(last.values())
    return shares


def fit(work_dir: str, config: dict) -> list[dict]:
    from ray_checkfreq.chaos.harness import TrainJob, fit_job
    from ray_checkfreq.ray.inplace import InPlaceConfig

    fit_job(TrainJob(train=inplace_jobs.train, config={"work_dir": work_dir, **config}, workers=REPLICAS,
                     name=f"inplace-{uuid.uuid4().hex[:6]}", storage_path=work_dir + "/results", max_failures=2,
                     timeout_s=RUN_TIMEOUT_S, in_place=InPlaceConfig()))
    return read_events(work_dir)


def end_step(events: list[dict]) -> int:
    ends = {e["step"] for e in events if e["event"] == "end"}
    assert len(ends) == 1, f"the replicas ended at steps {ends}"
    return ends.pop()


@pytest.fixture(scope="module")
def runs(ray_session, tmp_path_factory):
    """(storage, the killed run's events, the resubmitted run's events, the killed run's
    checkpoints: (ref, state) as they were before the second run's retention removed them)."""
    from ray_checkfreq import CheckpointStore

    root = tmp_path_factory.mktemp("inplace")
    storage = str(root / "checkpoints")
    killed = fit(str(root / "killed"), {**CONFIG, "storage": storage})
    store = CheckpointStore(storage)
    checkpoints = [(ref, store.load(ref)) for ref in store.list()]
    epochs = end_step(killed) // inplace_jobs.quorum_steps(CONFIG).steps_per_epoch
    again = fit(str(root / "again"), {**CONFIG, "storage": storage, "kill_step": None, "max_epochs": epochs + 1})
    return storage, killed, again, checkpoints


@pytest.fixture(scope="module")
def killed_run(runs):
    return runs[1]



def test_survivors_train_on_while_the_lost_replica_is_replaced(killed_run):
    events = killed_run
    (kill,) = [e for e in events if e["event"] == "kill"]
    killed_pid = kill["pid"]
    commits = [e for e in events if e["event"] == "commit"]
    survivors = {e["pid"] for e in commits if e["t"] < kill["t"]} - {killed_pid}
    assert len(survivors) == REPLICAS - 1
    pauses = []
    for pid in survivors:
        times = [e["t"] for e in commits if e["pid"] == pid]
        around = [b - a for a, b in zip(times, times[1:]) if b > kill["t"] - 1]
        pauses.append(max(around[:5]))
    print(f"survivors' longest wait for a commit after the kill: {max(pauses):.2f} s")
    assert max(pauses) < SURVIVOR_PAUSE_LIMIT_S
    # They trained on without it (a smaller quorum), and did not restart: same processes to the end.
    smaller = [e for e in commits if e["t"] > kill["t"] and e["size"] == REPLICAS - 1]
    assert survivors <= {e["pid"] for e in smaller} and len(smaller) >= 2 * 5
    ends = [e for e in events if e["event"] == "end"]
    assert len(ends) == REPLICAS and len({e["step"] for e in ends}) == 1
    assert survivors < {e["pid"] for e in ends}
    # The replacement began where the survivors were (healed from a live peer), not at step 0
    # or at a checkpoint, and the three trained together again.
    (replacement,) = {e["pid"] for e in ends} - survivors
    first = next(e for e in events if e["event"] == "share" and e["pid"] == replacement)
    survivor_steps = [e["step"] for e in commits if e["pid"] in survivors and e["t"] < first["t"]]
    assert first["step"] == max(survivor_steps) + 1 and first["world_rank"] == kill["world_rank"]
    healed = [e for e in commits if e["pid"] == replacement]
    assert healed and all(e["size"] == REPLICAS for e in healed[-CONFIG["full_steps"]:])
    print(f"the replacement's first step: {first['t'] - kill['t']:.1f} s after the kill (step {first['step']})")


def assert_every_step_whole(events: list[dict], first: int, last: int) -> list[int]:
    """Each committed step of [first, last) averaged one share of every quorum rank, together
    its whole global batch; returns the samples taken, in step order."""
    steps = inplace_jobs.quorum_steps(CONFIG)
    taken_all = []
    for step, shares in committed_shares(events, last, first).items():
        size = shares[0]["size"]
        assert sorted(s["quorum_rank"] for s in shares) == list(range(size)), f"step {step}: {shares}"
        taken = [i for s in shares for i in s["indices"]]
        assert sorted(taken) == sorted(steps.share(step, rank=0, size=1).indices.tolist()), f"step {step}"
        taken_all += taken
    return taken_all


def assert_weights(found: dict, expected: dict, what: str) -> None:
    for key, value in expected.items():
        assert torch.allclose(found[key], value, rtol=0, atol=WEIGHT_TOLERANCE), \
            f"{what}, {key}: {float((found[key] - value).abs().max())} from the uninterrupted run"


def test_every_sample_once_and_the_weights_of_an_uninterrupted_run(runs):
    _, events, _, _ = runs
    last = end_step(events)
    per_epoch = inplace_jobs.quorum_steps(CONFIG).steps_per_epoch
    assert last % per_epoch == 0
    taken = assert_every_step_whole(events, 0, last)
    for epoch in range(last // per_epoch):
        in_epoch = taken[epoch * CONFIG["samples"]:(epoch + 1) * CONFIG["samples"]]
        assert sorted(in_epoch) == list(range(CONFIG["samples"])), f"epoch {epoch}: not every sample once"
    expected = inplace_jobs.reference(CONFIG, [last])[last]
    work_dir = _work_dir(runs, "killed")
    finals = [torch.load(os.path.join(work_dir, f"final-{r}.pt"), weights_only=True) for r in range(REPLICAS)]
    for final in finals:
        assert final["step"] == last
        for key in expected:
            assert torch.equal(final["model"][key], finals[0]["model"][key]), f"replicas differ in {key}"
        assert_weights(final["model"], expected, "the killed run's end")


def _work_dir(runs, name: str) -> str:
    storage = runs[0]
    return os.path.join(os.path.dirname(storage), name)


def test_one_writer_at_a_time_and_every_checkpoint_exact(runs):
    _, events, _, checkpoints = runs
    writers = collections.Counter(e["step"] for e in events if e["event"] == "commit" and e["writer"])
    committed = {e["step"] for e in events if e["event"] == "commit"}
    assert max(writers.values()) == 1, "two replicas wrote for one step"
    # A step has no writer only where its quorum's rank 0 did not commit it: it died between
    # its backward pass and the commit, or its commit failed while the others' went through
    # (a loaded replica timed out; it heals from them at the next quorum).
    rolled_back = {e["step"] for e in events if e["event"] == "rollback"}
    assert committed - set(writers) <= {CONFIG["kill_step"]} | rolled_back
    # The survivors' new rank 0 took over with a newer writer generation (fencing the dead one);
    # retention kept the newest few, all of the run's last writers.
    assert checkpoints and all(ref.writer_generation >= 2 for ref, _ in checkpoints)
    expected = inplace_jobs.reference(CONFIG, [ref.step for ref, _ in checkpoints])
    for ref, state in checkpoints:
        assert state["extra"]["data"]["step"] == ref.step
        assert_weights(state["model"], expected[ref.step], f"checkpoint of step {ref.step}")


def test_a_job_submitted_again_resumes_from_the_newest_checkpoint(runs):
    storage, killed, again, checkpoints = runs
    newest_of_killed = max(ref.step for ref, _ in checkpoints)
    # Where its checkpoint says, not 0. A replica that starts later may find a newer one: the
    # first quorum formed without it (1 s join timeout) and trained on; it heals to them anyway.
    starts = sorted(e["step"] for e in again if e["event"] == "start")
    assert len(starts) == REPLICAS and starts[0] == newest_of_killed
    first = min(e["step"] for e in again if e["event"] == "share")
    assert first == newest_of_killed
    last = end_step(again)
    assert last == end_step(killed) + inplace_jobs.quorum_steps(CONFIG).steps_per_epoch
    assert_every_step_whole(again, newest_of_killed, last)
    final = torch.load(os.path.join(_work_dir(runs, "again"), "final-0.pt"), weights_only=True)
    assert_weights(final["model"], inplace_jobs.reference(CONFIG, [last])[last], "the resubmitted run's end")
