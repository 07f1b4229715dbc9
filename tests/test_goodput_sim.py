"""The goodput model (benchmarks/goodput_sim.py) on fleets small enough to work out by hand."""

from __future__ import annotations

import math

import pytest

from benchmarks.goodput_sim import Costs, Fleet, Method, oracle, policy_k, rate_k, simulate

# 1 s iterations on 2 nodes; 1 GB: a snapshot 0.1 s, torch.save 0.5 s, an upload 1 s.
COSTS = Costs(iter_s=1.0, state_gb=1.0, snapshot_gbps=10.0, serialize_gbps=2.0, storage_gbps=1.0,
              ram_restore_gbps=10.0, restart_s=30.0, epoch_iterations=50)


def test_without_preemptions_goodput_is_the_checkpoint_cost_alone() -> None:
    fleet = Fleet([(0.0, 0, 2), (1000.0, 0, 2)], full_nodes=2)
    assert simulate(fleet, Method(name="none", kind="none"), COSTS).goodput == pytest.approx(1.0)
    sync = simulate(fleet, Method(name="sync", kind="sync", every=10), COSTS)
    assert sync.goodput == pytest.approx(10 / (10 + 1.5))  # save 0.5 s + upload 1 s every 10 s
    ours = simulate(fleet, Method(name="ours", kind="checkfreq", every=10), COSTS)
    assert ours.goodput == pytest.approx(10 / 10.1)  # the snapshot only; the upload runs beside
    assert ours.restarts == 0 and ours.lost_iterations == 0
    sharded = Costs(**{**COSTS.__dict__, "sharded": True})  # each of 2 nodes copies half the state
    halved = simulate(fleet, Method(name="ours", kind="checkfreq", every=10), sharded)
    assert halved.goodput == pytest.approx(10 / 10.05)


def test_a_preemption_costs_the_work_since_what_each_method_can_recover_plus_the_restart() -> None:
    # Node 2 of 2 goes at t = 105 s and comes back at once: the job restarts on 2 nodes.
    fleet = Fleet([(0.0, 0, 2), (105.0, 1, 2), (1000.0, 0, 2)], full_nodes=2)
    none = simulate(fleet, Method(name="none", kind="none"), COSTS)
    assert none.lost_iterations == pytest.approx(105.0) and none.restarts == 1
    assert none.iterations == pytest.approx(1000 - 105 - 30)  # restarts from 0 after 30 s
    ours = simulate(fleet, Method(name="ours", kind="checkfreq", every=10), COSTS)
    at_preemption = 105 * 10 / 10.1
    assert ours.lost_iterations == pytest.approx(at_preemption - 100)  # the RAM copy of iteration 100 survives
    assert ours.restart_s == pytest.approx(30 + 0.1)  # restart plus 1 GB from RAM at 10 GB/s
    late = simulate(fleet, Method(name="async", kind="async", every=10), COSTS)
    # a checkpoint is durable 1.5 s (save and upload) after its stall: iteration 100's, reached
    # at ~101 s, was durable at ~102.5 s, before the preemption
    assert late.lost_iterations == pytest.approx(105 * 10 / 10.1 - 100)
    assert late.restart_s == pytest.approx(30 + 1.0)  # from storage


def test_a_job_that_loses_every_node_restores_from_storage_and_waits_for_nodes() -> None:
    fleet = Fleet([(0.0, 0, 2), (100.5, 2, 0), (200.0, 0, 2), (1000.0, 0, 2)], full_nodes=2)
    ours = simulate(fleet, Method(name="ours", kind="checkfreq", every=10), COSTS)
    reached = 100.5 * 10 / 10.1
    # no RAM copy survives: the newest snapshot whose upload (1 s) was done by then
    durable = math.floor((reached - 1.0 * 10 / 10.1) / 10) * 10
    assert ours.lost_iterations == pytest.approx(reached - durable)
    assert ours.restart_s == pytest.approx(30 + 1.0)
    ideal = 100.5 + (1000 - 200)
    assert ours.ideal_iterations == pytest.approx(ideal)


def test_a_notice_long_enough_for_a_snapshot_loses_nothing_to_ours_only() -> None:
    fleet = Fleet([(0.0, 0, 2), (105.0, 1, 2), (1000.0, 0, 2)], full_nodes=2)
    noticed = Costs(**{**COSTS.__dict__, "notice_s": 120.0})
    assert simulate(fleet, Method(name="ours", kind="checkfreq", every=10), noticed).lost_iterations == 0
    assert simulate(fleet, Method(name="sync", kind="sync", every=10), noticed).lost_iterations > 0


def test_fewer_nodes_train_slower_at_the_same_global_batch() -> None:
    fleet = Fleet([(0.0, 0, 2), (100.0, 1, 1), (1100.0, 0, 1)], full_nodes=2)
    none = simulate(fleet, Method(name="none", kind="none"), COSTS)
    assert none.ideal_iterations == pytest.approx(100 + 1000 / 2)
    assert none.iterations == pytest.approx((1000 - 30) / 2)


def test_the_oracle_is_at_least_every_fixed_interval_and_the_policy_k_comes_from_the_library() -> None:
    fleet = Fleet([(0.0, 0, 2)] + [(t, 1, 2) for t in range(300, 6000, 300)] + [(6000.0, 0, 2)], full_nodes=2)
    method = Method(name="ours", kind="checkfreq")
    best = oracle(fleet, method, COSTS, candidates=[1, 5, 20, 80])
    for k in (1, 5, 20, 80):
        assert best.goodput >= simulate(fleet, Method(name="k", kind="checkfreq", every=k), COSTS).goodput
    observed_mtbf = [t / (n + 1) for n, t in enumerate(range(300, 6000, 300), 1)]  # mtbf_estimate
    expected = [policy_k(COSTS, m, nodes=2, full_nodes=2) for m in [None, *observed_mtbf]]
    assert max(expected) > expected[0]  # Young/Daly raised it once the rate was seen
    assert simulate(fleet, method, COSTS).k == expected
    with pytest.raises(ValueError, match="every-N method needs every"):
        Method(name="x", kind="sync")


def test_bench_goodput_projects_a_slice_of_the_shipped_trace(tmp_path, capsys) -> None:
    import json

    from ray_checkfreq import cli

    out = tmp_path / "goodput.json"
    assert cli.main(["bench", "goodput", "--model-only", "--state-gb", "1", "--trace-start", "3600",
                     "--trace-duration", "7200", "--json", str(out)]) == 0
    figures = json.loads(out.read_text())["sizes"]["1 GB"]
    methods = {m["method"]: m for m in figures["methods"]}
    assert set(methods) == {"ours (policy)", "Ray Train, per epoch", "sync every 100", "async every 100",
                            "no checkpoint"}
    assert all(m["restarts"] == methods["no checkpoint"]["restarts"] > 0 for m in methods.values())
    assert methods["ours (policy)"]["goodput"] > methods["sync every 100"]["goodput"]
    assert 0.9 < figures["ours_over_oracle"] <= 1.1
    placed = figures["in_place"]
    assert placed["restarts"] == 0 and placed["replica_losses"] == methods["no checkpoint"]["restarts"]
    ratio = placed["goodput"] / methods["ours (policy)"]["goodput"]
    assert ratio > 1 and figures["in_place_over_ours"] == pytest.approx(ratio, abs=1e-4)
    out = capsys.readouterr().out
    assert "ours / its oracle fixed interval" in out and "ours in place / ours with group restarts" in out


def test_a_step_that_no_node_count_shortens_trains_at_one_rate_on_any_number_of_nodes() -> None:
    # scaling 0 (the replay's steps, a sleep each): one iteration a second on 2 nodes or on 1
    fleet = Fleet([(0.0, 0, 2), (100.0, 1, 1), (1100.0, 0, 1)], full_nodes=2)
    flat = Costs(**{**COSTS.__dict__, "scaling": 0.0})
    none = simulate(fleet, Method(name="none", kind="none"), flat)
    assert none.ideal_iterations == pytest.approx(1100)
    assert none.iterations == pytest.approx(1000 - 30)
    with pytest.raises(ValueError, match="scaling=1.5"):
        Costs(scaling=1.5)


def test_the_elastic_monitor_restarts_a_job_onto_the_nodes_added_while_it_ran() -> None:
    # The job starts on 1 node (2 s an iteration); a node comes at 10 s. The monitor looks
    # 60 s after the attempt began: a restart (30 s) onto 2 nodes, then nothing to grow.
    fleet = Fleet([(0.0, 0, 1), (10.0, 0, 2), (1000.0, 0, 2)], full_nodes=2, resize_check_s=60.0)
    none = simulate(fleet, Method(name="none", kind="none"), COSTS)
    assert none.restarts == 1 and none.lost_iterations == pytest.approx(30)
    assert none.iterations == pytest.approx(1000 - 90)
    assert none.ideal_iterations == pytest.approx(10 / 2 + 990)
    ours = simulate(fleet, Method(name="ours", kind="checkfreq", every=10), COSTS)
    reached = 60 * 10 / 20.1  # 10 iterations and a 0.1 s snapshot each 20.1 s
    assert ours.lost_iterations == pytest.approx(reached - 20)  # every node survives: the RAM copy
    assert ours.iterations == pytest.approx(20 + (1000 - 90.1) * 10 / 10.1)  # 0.1 s from RAM
    unwatched = simulate(Fleet(fleet.instants, full_nodes=2), Method(name="none", kind="none"), COSTS)
    assert unwatched.restarts == 0 and unwatched.iterations == pytest.approx(500)
    with pytest.raises(ValueError, match="resize_check_s=0"):
        Fleet(fleet.instants, full_nodes=2, resize_check_s=0)


def test_a_loss_during_a_restart_begins_the_restart_again_and_loses_nothing_more() -> None:
    fleet = Fleet([(0.0, 0, 2), (100.0, 1, 2), (110.0, 1, 2), (1000.0, 0, 2)], full_nodes=2)
    none = simulate(fleet, Method(name="none", kind="none"), COSTS)
    assert none.restarts == 2 and none.lost_iterations == pytest.approx(100)
    assert none.restart_s == pytest.approx(10 + 30)
    assert none.iterations == pytest.approx(1000 - 110 - 30)
    ours = simulate(fleet, Method(name="ours", kind="checkfreq", every=10), COSTS)
    assert ours.lost_iterations == pytest.approx(100 * 10 / 10.1 - 90)
    assert ours.iterations == pytest.approx(90 + (1000 - 110 - 30.1) * 10 / 10.1)


def test_each_restart_can_take_its_own_measured_seconds() -> None:
    fleet = Fleet([(0.0, 0, 2), (100.0, 1, 2), (300.0, 1, 2), (1000.0, 0, 2)], full_nodes=2)
    measured = Costs(**{**COSTS.__dict__, "restarts_s": (10.0, 50.0)})
    none = simulate(fleet, Method(name="none", kind="none"), measured)
    assert none.restart_s == pytest.approx(10 + 50)
    assert none.lost_iterations == pytest.approx(100 + 190) and none.iterations == pytest.approx(1000 - 350)
    with pytest.raises(ValueError, match="restarts_s=.*-1"):
        Costs(restarts_s=(-1.0,))


# In place (kind "inplace"): every=10, no quorum cost unless stated; a loss pauses the
# survivors 2 s, a replacement joins 4 s after its node is there, a peer's send takes 2 s.
IN_PLACE = Costs(**{**COSTS.__dict__, "pause_s": 2.0, "heal_s": 4.0, "heal_gbps": 0.5, "quorum_overhead": 0.0})
PLACED = Method(name="in place", kind="inplace", every=10)
FULL, HALF = 10 / 10.1, 10 / 20.1  # iterations a second on both replicas, on one (2 s iterations)


def test_a_replica_loss_with_a_node_at_hand_costs_that_replicas_share_until_its_replacement_joined() -> None:
    # Node 2 of 2 goes at 105 s and a node comes at once: no pause, no send (the share alone)
    fleet = Fleet([(0.0, 0, 2), (105.0, 1, 2), (1000.0, 0, 2)], full_nodes=2)
    share_only = Costs(**{**IN_PLACE.__dict__, "pause_s": 0.0, "heal_gbps": 1e12})
    placed = simulate(fleet, PLACED, share_only)
    assert placed.restarts == 0 and placed.lost_iterations == 0 and placed.replica_losses == 1
    assert placed.iterations == pytest.approx(1000 * FULL - 4.0 * (FULL - HALF))  # half the speed for heal_s
    assert placed.short_iterations == pytest.approx(4.0 * (FULL - HALF))
    assert placed.ideal_iterations == pytest.approx(1000)
    # with the survivors' pause (2 s) and the peer's send (2 s) at the join, 109 to 111 s
    paused = simulate(fleet, PLACED, IN_PLACE)
    assert paused.paused_s == pytest.approx(2.0 + 2.0)
    assert paused.iterations == pytest.approx((105 + 889) * FULL + 2.0 * HALF)
    ours = simulate(fleet, Method(name="ours", kind="checkfreq", every=10), COSTS)
    assert ours.restarts == 1 and paused.iterations > ours.iterations + 25  # a 30 s restart saved


def test_a_spare_node_beyond_the_worker_count_replaces_a_lost_replica_at_once() -> None:
    # 2 replicas on a fleet of 3 (an iteration 1.5 s on 2 of 3): the removal takes a replica
    # (the worst case), the spare heals in
    fleet = Fleet([(0.0, 0, 3), (100.0, 1, 2), (1000.0, 0, 2)], full_nodes=3)
    placed = simulate(fleet, Method(name="in place", kind="inplace", every=10, replicas=2), IN_PLACE)
    two, one = 10 / 15.1, 10 / 30.1
    assert placed.replica_losses == 1 and placed.restarts == 0
    assert placed.iterations == pytest.approx(100 * two + 2 * one + (1000 - 106) * two)
    assert placed.ideal_iterations == pytest.approx(100 + 900 * 2 / 3)  # the ideal uses all 3 first


def test_without_a_node_for_the_replacement_the_survivors_train_on_at_reduced_size() -> None:
    fleet = Fleet([(0.0, 0, 2), (100.0, 1, 1), (600.0, 0, 2), (1000.0, 0, 2)], full_nodes=2)
    placed = simulate(fleet, PLACED, IN_PLACE)
    assert placed.restarts == 0 and placed.lost_iterations == 0 and placed.replica_losses == 1
    # paused 100-102, one replica to 604 (the node came at 600), the send to 606
    assert placed.iterations == pytest.approx(100 * FULL + (604 - 102) * HALF + (1000 - 606) * FULL)
    assert placed.short_iterations == pytest.approx(4 * (FULL - HALF))  # a node was there for 4 s only
    assert placed.ideal_iterations == pytest.approx(100 + 500 / 2 + 400)


def test_a_loss_of_every_replica_restarts_from_storage_as_ours_does() -> None:
    fleet = Fleet([(0.0, 0, 2), (100.5, 2, 0), (200.0, 0, 2), (1000.0, 0, 2)], full_nodes=2)
    placed = simulate(fleet, PLACED, IN_PLACE)
    ours = simulate(fleet, Method(name="ours", kind="checkfreq", every=10), COSTS)
    assert placed.restarts == ours.restarts == 1 and placed.replica_losses == 0
    assert ours.lost_iterations > 0 and placed.lost_iterations == pytest.approx(ours.lost_iterations)
    assert placed.restart_s == pytest.approx(30 + 1.0)  # from storage: no RAM copy survives
    assert placed.iterations == pytest.approx(ours.iterations)
    # a node lost while the whole job restarts (both nodes back at once): the restart begins again
    fleet = Fleet([(0.0, 0, 2), (100.5, 2, 2), (110.0, 1, 2), (1000.0, 0, 2)], full_nodes=2)
    again = simulate(fleet, PLACED, IN_PLACE)
    assert again.restarts == 2 and again.replica_losses == 0
    assert again.restart_s == pytest.approx(9.5 + 31) and again.lost_iterations == pytest.approx(ours.lost_iterations)
    # the last training replica lost while its replacement joins (104 s): the whole job
    fleet = Fleet([(0.0, 0, 2), (100.0, 1, 2), (102.0, 1, 2), (1000.0, 0, 2)], full_nodes=2)
    placed = simulate(fleet, PLACED, IN_PLACE)
    assert placed.replica_losses == 1 and placed.restarts == 1 and placed.restart_s == pytest.approx(31)


def test_the_job_starts_once_its_worker_count_is_live_and_pays_the_quorum_on_every_step() -> None:
    fleet = Fleet([(0.0, 0, 1), (100.0, 0, 2), (1100.0, 0, 2)], full_nodes=2)
    quorum = Costs(**{**IN_PLACE.__dict__, "quorum_overhead": 0.05})
    placed = simulate(fleet, PLACED, quorum)
    assert placed.waited_iterations == pytest.approx(50) == placed.ideal_iterations - 1000
    assert placed.iterations == pytest.approx(1000 * 10 / (10 * 1.05 + 0.1))


def test_in_place_k_comes_from_the_rate_of_losses_of_the_whole_job_only() -> None:
    # two replica losses with a node at hand, then a loss of both replicas at 3000 s
    fleet = Fleet([(0.0, 0, 2), (1000.0, 1, 2), (2000.0, 1, 2), (3000.0, 2, 2), (6000.0, 0, 2)], full_nodes=2)
    costs = Costs(**{**IN_PLACE.__dict__, "epoch_iterations": 2000})  # a lost-work bound of 500
    placed = simulate(fleet, Method(name="in place", kind="inplace"), costs)
    p_k = rate_k(costs, None, nodes=2, full_nodes=2, from_storage=True)
    none_lossy = rate_k(costs, 0.0, nodes=2, full_nodes=2, from_storage=True)  # as few as the bound allows
    lossy = rate_k(costs, 1 / 1500, nodes=2, full_nodes=2, from_storage=True)  # mtbf_estimate(3000 s, 1)
    assert (p_k, none_lossy) == (3, 500) and lossy not in (p_k, none_lossy)
    assert placed.k == [p_k, none_lossy, none_lossy, lossy]
    ours = simulate(fleet, Method(name="ours", kind="checkfreq"), costs)
    assert ours.k[1] == policy_k(costs, 1000 / 2, nodes=2, full_nodes=2) not in (none_lossy, lossy)  # every loss


def test_in_place_settings_are_checked() -> None:
    fleet = Fleet([(0.0, 0, 2), (10.0, 0, 2)], full_nodes=2)
    with pytest.raises(ValueError, match="replicas=3 > the fleet's full_nodes=2"):
        simulate(fleet, Method(name="x", kind="inplace", replicas=3), IN_PLACE)
    with pytest.raises(ValueError, match="sharded=True"):
        simulate(fleet, PLACED, Costs(**{**IN_PLACE.__dict__, "sharded": True}))
    with pytest.raises(ValueError, match="replicas=2: only for kind 'inplace'"):
        Method(name="x", kind="checkfreq", replicas=2)
    with pytest.raises(ValueError, match="pause_s=-1"):
        Costs(pause_s=-1.0)
    with pytest.raises(ValueError, match="heal_gbps=0"):
        Costs(heal_gbps=0.0)
