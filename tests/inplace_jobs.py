"""The in-place job (torchft replica groups, one Ray Train worker each) and its uninterrupted reference.

A linear regression over a fixed synthetic dataset, every step's global batch from
``QuorumSteps``. Each replica logs, per step, its share (step, quorum rank and size, sample
indices) when it has fetched it, then whether the step committed. With ``storage``, the
replicas checkpoint every ``every`` steps (one writer: the quorum's rank 0) and resume from
there. ``kill_step``: the replica of world rank ``kill_rank`` SIGKILLs itself after its
backward pass of that step, before the commit (once per test). The job ends at the first
epoch end after every replica has been back for ``full_steps`` steps (or after
``max_epochs``): all replicas decide it from the same step and quorum size, so they stop
together.
"""

from __future__ import annotations

import os
import signal
import time
from typing import Any

import torch
from ray_train_jobs import log, once  # tests/ is on sys.path

FEATURES = 8


def dataset(samples: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(7)
    x = torch.randn(samples, FEATURES, generator=generator)
    y = x @ torch.linspace(-1, 1, FEATURES).unsqueeze(1) + 0.1 * torch.randn(samples, 1, generator=generator)
    return x, y


def model_and_optimizer() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Linear(FEATURES, 1)
    return model, torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)


def quorum_steps(config: dict) -> Any:
    from ray_checkfreq.data import QuorumSteps, resumable

    return QuorumSteps(resumable(config["samples"], global_batch_size=config["global_batch"], seed=3,
                                 rank=0, world_size=1))


def share_loss(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor, share: Any) -> torch.Tensor:
    if len(share.indices) == 0:  # more participants than samples in this step
        return sum((p * 0).sum() for p in model.parameters())  # type: ignore[return-value]
    index = torch.as_tensor(share.indices)
    return torch.nn.functional.mse_loss(model(x[index]), y[index]) * share.loss_scale


def train(config: dict) -> None:
    import ray
    import ray.train

    from ray_checkfreq import CheckFreqConfig
    from ray_checkfreq.ray.inplace import InPlaceConfig, InPlaceReplica

    torch.set_num_threads(1)
    work_dir = config["work_dir"]
    world_rank = ray.train.get_context().get_world_rank()
    world = ray.train.get_context().get_world_size()
    x, y = dataset(config["samples"])
    model, optimizer = model_and_optimizer()
    steps = quorum_steps(config)
    # A replacement (of a killed or drained replica): its world rank has logged before.
    replacement = os.path.exists(os.path.join(work_dir, f"log-{world_rank}.jsonl"))
    replica = InPlaceReplica(model=model, optimizer=optimizer, steps=steps,
                             config=InPlaceConfig(timeout_s=config.get("timeout_s", 30.0),
                                                  replacement_wait_s=config.get("replacement_wait_s", 30.0)),
                             storage=config.get("storage"), checkpoint=CheckFreqConfig(every=config.get("every", 10)))
    log(work_dir, world_rank, event="start", step=replica.start_step, pid=os.getpid(),
        node=ray.get_runtime_context().get_node_id())
    saw_loss, full_since = replacement, None
    max_steps = config["max_epochs"] * steps.steps_per_epoch
    while steps.step < max_steps:
        share = replica.next_share()
        log(work_dir, world_rank, event="share", step=share.step, quorum_rank=share.rank, size=share.size,
            indices=share.indices.tolist(), pid=os.getpid())
        loss = share_loss(replica.model, x, y, share)
        loss.backward()
        if share.step == config.get("kill_step") and world_rank == config.get("kill_rank") and once(work_dir, "kill"):
            log(work_dir, world_rank, event="kill", step=share.step, pid=os.getpid())
            os.kill(os.getpid(), signal.SIGKILL)
        committed = replica.commit(share)
        log(work_dir, world_rank, event="commit" if committed else "rollback", step=share.step, size=share.size,
            writer=replica.is_writer, pid=os.getpid())
        time.sleep(config.get("step_sleep_s", 0.0))
        if not committed:
            continue
        saw_loss = saw_loss or share.size < world
        full_since = (full_since if full_since is not None else share.step) if share.size == world else None
        at_epoch_end = steps.step % steps.steps_per_epoch == 0
        if saw_loss and at_epoch_end and full_since is not None and share.step - full_since >= config["full_steps"]:
            break
    torch.save({"step": steps.step, "model": model.state_dict()}, os.path.join(work_dir, f"final-{world_rank}.pt"))
    log(work_dir, world_rank, event="end", step=steps.step, pid=os.getpid())
    replica.shutdown()


def reference(config: dict, until_steps: list[int]) -> dict[int, dict[str, torch.Tensor]]:
    """The weights after each of ``until_steps`` steps, the steps taken in one process,
    each over its whole global batch."""
    x, y = dataset(config["samples"])
    model, optimizer = model_and_optimizer()
    steps = quorum_steps(config)
    found = {0: {key: value.clone() for key, value in model.state_dict().items()}}
    for step in range(max(until_steps)):
        optimizer.zero_grad()
        share_loss(model, x, y, steps.share(step, rank=0, size=1)).backward()
        optimizer.step()
        if step + 1 in until_steps:
            found[step + 1] = {key: value.clone() for key, value in model.state_dict().items()}
    return found


def xfail_on_ray_node_race(outcome: Any, *, survivors_ended: bool) -> None:
    """Ray 2.60's controller sometimes fails the whole run when a replica's node dies in
    torchft mode, with a ``ControllerError`` from a call on the dead worker outside the paths
    that replace it ("The actor died because its node has died", or "The actor ... is
    unavailable: ... Connection refused"; 4 of 8 node-loss runs here, not root-caused). Our
    code raises a ControllerError only after the survivors' work ended. Not ours to fix
    here; shown as xfail, never as a pass."""
    import pytest
    from ray.train import ControllerError

    if isinstance(outcome, ControllerError) and not survivors_ended:
        pytest.xfail(f"Ray 2.60 controller race on a node's death (the run failed before the survivors ended): "
                     f"{str(outcome).splitlines()[-1][:200]}")
