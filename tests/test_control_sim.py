"""The control plane's simulator (``sim.control_plane``): what it counts follows from the design."""
from dataclasses import replace

import pytest

from spantrain_p2p.sim.control_plane import DESIGNS, Design, simulate


def test_todays_calls_per_peer_do_not_grow_with_the_swarm_but_its_bytes_do():
    small, large = simulate(DESIGNS["no-caches"], 16), simulate(DESIGNS["no-caches"], 400)
    # a read and half a store's search a second, 5 nodes each, 5 stores every other second, a job read every 5 s
    assert small.calls_per_s["mean"] == pytest.approx(large.calls_per_s["mean"], rel=0.05)
    assert large.calls_per_s["mean"] == pytest.approx(1.5 * 5 + 0.5 * 5 + 0.2 * 5, rel=0.05)
    # every find that reaches a replica carries the whole dictionary: bytes per peer grow with N
    assert large.bytes_per_s["mean"] / small.bytes_per_s["mean"] == pytest.approx(400 / 16, rel=0.1)
    assert large.largest_value == Design("x").sizes.value_base + 400 * Design("x").sizes.entry


def test_the_busiest_nodes_are_the_member_keys_replicas():
    f = simulate(DESIGNS["no-caches"], 200)
    # 5 replicas answer every peer's 1.5 searches a second: 200 x 1.5 / 5 = 60 finds each, plus 100 stores
    assert f.served_per_s["max"] == pytest.approx(200 * 1.5 + 200 * 0.5, rel=0.05)
    assert f.busiest_over_mean > 10


def test_with_caches_every_visited_node_answers_with_the_value():
    # a 20-node search: with caches all 20 answer with the dictionary, without only the 5 replicas
    cached = simulate(Design("c", visits=20, caches=True, job_poll_s=None), 100)
    plain = simulate(Design("p", visits=20, caches=False, job_poll_s=None), 100)
    assert cached.bytes_per_s["mean"] == pytest.approx(4 * plain.bytes_per_s["mean"], rel=0.1)
    assert cached.calls_per_s["mean"] == pytest.approx(plain.calls_per_s["mean"])


def test_a_crash_is_noticed_after_its_last_record_expires_and_within_a_poll_of_it():
    d = Design("d", heartbeat_s=2.0, ttl_heartbeats=3, poll_s=1.0)
    f = simulate(d, 50, crashes=50)
    ttl = d.heartbeat_s * d.ttl_heartbeats
    assert ttl - d.heartbeat_s <= f.crash_to_noticed_s["p50"] <= ttl + d.poll_s + f.search_s
    assert f.crash_to_noticed_s["max"] <= ttl + d.poll_s + f.search_s + 1e-9
    assert 0 < f.join_to_visible_s["max"] <= d.poll_s + 2 * f.search_s + d.replicas * d.call_s + 1e-9


def test_a_large_dictionary_is_slow_to_read_and_fills_a_home_link():
    f = simulate(DESIGNS["no-caches"], 5000)
    assert f.search_s > 2.0 and f.link_load["max"] > 1.0
    with pytest.raises(ValueError):
        simulate(DESIGNS["no-caches"], 1)


def test_swims_traffic_per_peer_hardly_grows_and_its_values_stay_small():
    from spantrain_p2p.sim.control_swim import SwimDesign, simulate_swim

    d = SwimDesign(churn_per_hour=0.0)  # no news to carry: probes, acks and record refreshes only
    small, large = simulate_swim(d, 50), simulate_swim(d, 2000)
    assert large.bytes_per_s["mean"] < 1.2 * small.bytes_per_s["mean"]
    # a probe a second, its record to 5 nodes and their lookup a minute, the job key's lookup and polls
    # (every 100 s at 2,000 idle peers: 20 job reads a second swarm-wide)
    expected = 1 / d.probe_s + 5 / d.record_s + 5 / d.lookup_s + 5 / d.lookup_s + 1 / max(d.job_poll_s, 2000 / d.job_reads_per_s)
    assert large.calls_per_s["mean"] == pytest.approx(expected, rel=0.05)
    assert large.largest_value <= d.sizes.value_base + 1.2 * 2000 / d.buckets * d.sizes.entry  # peers hash to buckets
    # a crash: the first probe of the dead peer (about one round), the direct and indirect timeouts,
    # the suspicion, the prober's next round, a message
    waits = 3 * d.ack_s + 0.5 + d.suspect_s
    assert waits < large.crash_to_noticed_s["p50"] < waits + 3 * d.probe_s
    # news costs bytes: with churn, each ping carries some
    assert simulate_swim(SwimDesign(churn_per_hour=4.0), 2000).bytes_per_s["mean"] > large.bytes_per_s["mean"]


def test_todays_stores_search_twenty_nodes_and_every_reader_serves_its_copy():
    today, bare = simulate(DESIGNS["today"], 64), simulate(DESIGNS["no-caches"], 64)
    # a store's search visits 20 nodes (hivemind's beam), a read's 5: 1 x 5 + 0.5 x 20 finds, 2.5 stores, 1 job find
    assert today.calls_per_s["mean"] == pytest.approx(5 + 10 + 2.5 + 1, rel=0.05)
    assert today.bytes_per_s["mean"] > 1.5 * bare.bytes_per_s["mean"]


def test_direct_reads_and_stores_cost_one_call_per_replica_and_load_the_replicas():
    """As shipped (GuardedDHT straight at the key's nodes): a read and a store are a call to each of
    the 5 replicas, a search only every 30 s; calls do not grow with the swarm, and every read of
    the member key lands on those 5 nodes."""
    small, large = simulate(DESIGNS["direct"], 16), simulate(DESIGNS["direct"], 400)
    per_peer = (5 * 1.0 + 5 * 0.5) * (1 - 5 / 400) + 5 * 0.2 * (1 - 5 / 400) + 2 * 5 / 30.0
    assert large.calls_per_s["mean"] == pytest.approx(per_peer, rel=0.05)
    assert small.calls_per_s["mean"] == pytest.approx(large.calls_per_s["mean"], rel=0.1)
    assert large.calls_per_s["mean"] < 0.5 * simulate(DESIGNS["today"], 400).calls_per_s["mean"]
    assert large.busiest_over_mean > 400 / 5 * 0.5  # the replicas serve the swarm: the ceiling this design has


def test_with_two_watchers_a_peers_reads_stop_growing_with_the_swarm_and_the_planner_sees_as_soon():
    """Only the planner and its standby read the member key every poll; the others read about 8
    records a poll (``membership.read_interval``): their bytes stop growing with N until the
    minute's floor, and the member key's nodes serve far fewer reads. The planner's times stay."""
    direct, watched = simulate(DESIGNS["direct"], 400), simulate(DESIGNS["watchers"], 400)
    assert watched.bytes_per_s["p50"] < 0.1 * direct.bytes_per_s["p50"]
    assert watched.bytes_per_s["max"] < 0.1 * direct.bytes_per_s["max"]  # the key's nodes
    # a typical peer's reads: 8 records a second whatever N (stores and lookups beside them)
    small, large = simulate(DESIGNS["watchers"], 64), simulate(DESIGNS["watchers"], 400)
    assert large.bytes_per_s["p50"] == pytest.approx(small.bytes_per_s["p50"], rel=0.1)
    assert watched.crash_to_noticed_s == direct.crash_to_noticed_s
    # up to 8 peers everyone reads every poll: only the holders' lookups are lighter
    same = replace(DESIGNS["watchers"], lookup_value=True)
    assert simulate(same, 8).bytes_per_s == simulate(DESIGNS["direct"], 8).bytes_per_s


def test_a_seldom_reader_asking_one_node_a_read_sends_and_receives_about_a_fifth():
    five, one = simulate(DESIGNS["watchers"], 400), simulate(DESIGNS["watchers-1"], 400)
    assert one.bytes_per_s["p50"] < 0.35 * five.bytes_per_s["p50"]
    assert one.calls_per_s["p50"] < five.calls_per_s["p50"]


def test_member_buckets_keep_each_value_small_and_spread_the_heartbeats_at_a_cost_in_small_swarms():
    """The member records in 8 keys (``keys.MEMBER_BUCKETS``): at 1,000 peers no value passes 256 KiB
    and the busiest node serves far less against the mean than one key's nodes did; in a swarm of 16,
    a read of 8 keys costs more calls and bytes (each key's answer carries the node's neighbours)."""
    one, eight = simulate(DESIGNS["watchers-2-1"], 1000), simulate(DESIGNS["buckets-8"], 1000)
    assert one.largest_value > 1 << 20 and eight.largest_value < 256 << 10
    assert eight.busiest_over_mean < 0.2 * one.busiest_over_mean
    small_one, small_eight = simulate(DESIGNS["watchers-2-1"], 16), simulate(DESIGNS["buckets-8"], 16)
    assert small_one.calls_per_s["mean"] < small_eight.calls_per_s["mean"] < 2 * small_one.calls_per_s["mean"]
    assert small_eight.bytes_per_s["mean"] < 1.5 * small_one.bytes_per_s["mean"]
    assert small_eight.served_per_s["max"] < small_one.served_per_s["max"]  # no node takes every heartbeat


def test_a_joiners_ping_phase_is_the_sum_of_its_round_trips_in_turn_and_the_slowest_at_once():
    from spantrain_p2p.cli.join_path import ping_phase_s

    far = [0.1] * 24
    t1, r1 = ping_phase_s(far)  # 24 x 0.11 s a round: the 10 s deadline before 10 rounds
    assert t1 == 10.0 and r1 < 10
    t8, r8 = ping_phase_s(far, at_once=8)  # 3 groups a round
    assert r8 == 10 and t8 == pytest.approx(11 * 3 * 0.1106, rel=0.01)
    lan, rounds = ping_phase_s([0.0005] * 3)
    assert 0.5 <= lan < 0.7 and rounds > 10  # at least min_s, more rounds to fill it
    assert ping_phase_s([]) == (0.0, 0)


def test_a_probe_takes_a_few_tenths_of_a_second_on_any_link_and_longer_for_a_long_one():
    from spantrain_p2p.cli.join_path import probe_s

    lan = probe_s(0.0005, 1000.0)
    assert 0.4 < lan < 1.0  # 0.77 s a link live on the emulated LAN (lan-4, 2026-11-28)
    assert probe_s(0.150, 100.0) > probe_s(0.005, 100.0) > 0.4


def test_a_joiners_way_grows_little_with_the_swarm_and_its_phases_add_up():
    from spantrain_p2p.cli.join_path import JoinCosts, simulate_join

    costs = JoinCosts(start_s=2.6, job_s=1.2, profile_s=2.0, ready_s=0.0)
    small, large = simulate_join(20, costs, samples=50), simulate_join(1000, costs, samples=50, plan_s=1.0,
                                                                         map_bytes=80_000)
    for r in (small, large):
        at = [r["at"][m]["p50"] for m in ("joined", "job", "profiled", "pinged", "probed", "map")]
        assert at == sorted(at) and r["at"]["planned"]["p50"] >= r["at"]["probed"]["p50"]
    # 24 members pinged 8 at a time (10 s one after another), 10 links probed, about a second each
    assert large["phase"]["pinged"]["p95"] < 8.0 and large["phase"]["probed"]["p95"] < 12.0
    assert large["at"]["map"]["p95"] < small["at"]["map"]["p95"] + 5.0
    with pytest.raises(ValueError):
        simulate_join(1)


def test_before_the_joiner_pinged_everyone_in_turn_and_the_planner_could_not_read_a_thousand_peers_links():
    from spantrain_p2p.cli.join_path import JoinCosts, simulate_join

    costs = JoinCosts(start_s=2.6, job_s=1.2, profile_s=2.0, ready_s=0.0)
    old, new = (simulate_join(1000, costs, samples=30, plan_s=1.0, before=b) for b in (True, False))
    assert old["phase"]["pinged"]["p50"] >= 10.0 > new["phase"]["pinged"]["p95"]  # 999 pings in turn: the deadline
    assert old["at"]["planned"]["p50"] == float("inf")  # one links key of 3 MB: over a response's 2 MiB
    assert new["at"]["planned"]["p95"] < 30.0
    small_old, small_new = (simulate_join(20, costs, samples=30, before=b) for b in (True, False))
    assert small_old["at"]["planned"]["p95"] < float("inf")


def test_a_training_swarm_at_a_thousand_peers_costs_a_peer_a_few_kb_a_second_now_and_hundreds_before():
    """``sim.control_job`` with the code's rates (``cli.control_job.designs``), a 75 KB stage map: a
    quiet network's steady state now within issue 33's 4 KB/s mean and 16 KB/s p99; before, every
    peer read the map every 2 s and the lease every second, and 17 readers read every link and
    profile every 50 s."""
    import math
    from dataclasses import replace

    from spantrain_p2p.cli.control_job import designs
    from spantrain_p2p.sim.control_job import JobSizes, simulate_job

    z = JobSizes(map_bytes=75_000)
    quiet = designs(1000, weather=False)
    now, now_epoch = simulate_job(quiet["now"], 1000, z)
    before, before_epoch = simulate_job(quiet["before"], 1000, z)
    assert now.bytes_per_s["mean"] < 4 * 1024 and now.bytes_per_s["p99"] < 16 * 1024
    assert before.bytes_per_s["mean"] > 50 * now.bytes_per_s["mean"]
    assert before_epoch["planner_bytes"] > 20 * now_epoch["planner_bytes"]  # /status of every peer, not a ping
    # the worst weather (every peer's links at the code's most often) costs the readers the most
    worst, _ = simulate_job(designs(1000)["now"], 1000, z)
    assert worst.bytes_per_s["p99"] > now.bytes_per_s["p99"]
    # links read back from their key, not sent with the record: each reader a 100 KB key per change
    unpushed, _ = simulate_job(replace(designs(1000)["now"], pushed=False), 1000, z)
    assert unpushed.bytes_per_s["p99"] > 5 * worst.bytes_per_s["p99"]
    # a new map down the tree of its peers: the burst's busiest node is no longer one of the map key's
    untreed, untreed_epoch = simulate_job(replace(quiet["now"], map_push=False), 1000, z)
    assert untreed_epoch["max_bytes"] > 5 * now_epoch["max_bytes"] and now_epoch["max_bytes"] == now_epoch["planner_bytes"]
    assert untreed.bytes_per_s == now.bytes_per_s  # (between epochs, the same)
    b = now_epoch["busiest"]  # what the busiest node answers, by kind, adds up to what it answers
    assert sum(b["parts"].values()) == pytest.approx(b["bytes_per_s"]) and b["parts"]["other"] >= 0
    with pytest.raises(ValueError):
        simulate_job(replace(quiet["now"], weather_s=math.inf), 1)
