import json
from dataclasses import replace

import pytest

from spantrain_p2p import PROTOCOL_VERSION
from spantrain_p2p.plan.stagemap import StageMap, even_split, placeholder_map
from spantrain_p2p.job.spec import JobRefused, JobSpec, ModelHandle, check_compatible

USER = "spantrain_p2p.models.example_user_model:tiny_mlp"


def test_even_split_covers_all_layers_with_near_equal_stages():
    assert even_split(6, 4) == [(0, 2), (2, 4), (4, 5), (5, 6)]
    assert even_split(5, 5) == [(i, i + 1) for i in range(5)]
    with pytest.raises(ValueError):
        even_split(3, 4)


def test_placeholder_map_is_the_same_whatever_order_peers_are_listed_in():
    a = placeholder_map(["c", "a", "b"], 6, "j")
    b = placeholder_map(["b", "c", "a"], 6, "j")
    assert a == b and [s.peers for s in a.stages] == [("a",), ("b",), ("c",)]
    assert placeholder_map(list("abcdefgh"), 6, "j").num_stages == 6  # extra peers stand by


@pytest.mark.parametrize("patch,reason", [
    ({"epoch": -1}, "epoch"),
    ({"stages": []}, "1 to 4096"),
    ({"stages": [{"peers": ["a"], "layers": [0, 3]}, {"peers": ["b"], "layers": [4, 6]}]}, "do not continue"),
    ({"stages": [{"peers": ["a"], "layers": [0, 3]}, {"peers": ["a"], "layers": [3, 6]}]}, "two places"),
    ({"stages": [{"peers": ["a"], "layers": [0, 5]}]}, "covers layers"),
    ({"stages": [{"peers": [], "layers": [0, 6]}]}, "non-empty"),
    ({"names": [["a"]]}, "names"),
    ({"copy_every": 0}, "copy_every"),
    ({"copy_every": 10_001}, "copy_every"),
    ({"copy_every": True}, "copy_every"),
    ({"copy_every": 2.0}, "copy_every"),
])
def test_an_invalid_stage_map_is_rejected(patch, reason):
    d = placeholder_map(["a", "b"], 6, "j").to_dict()
    d.update(patch)
    with pytest.raises(ValueError, match=reason):
        StageMap.from_dict(d, 6)


def test_a_stage_map_round_trips():
    m = placeholder_map(["a", "b", "c"], 6, "j", epoch=4, names={"a": "cloud-1"})
    assert StageMap.from_dict(m.to_dict(), 6) == m
    assert "copy_every" not in m.to_dict()  # 1, the default, is not written (older peers read the map)
    slow = replace(m, copy_every=8)
    assert StageMap.from_dict(slow.to_dict(), 6) == slow and slow.summary()["copy_every"] == 8
    assert m.summary()["stages"][0] == {"peers": ["cloud-1"], "layers": [0, 2], "microbatch_share": {"cloud-1": 1.0},
                                        "recompute": "none", "shard": False}


def test_replicated_stages_deal_peers_in_order_and_share_micro_batches():
    m = placeholder_map(list("edcba"), 6, "j", num_stages=2)
    assert [s.peers for s in m.stages] == [("a", "b", "c"), ("d", "e")]
    assert m.stages[0].assign(7) == ["a", "b", "c", "a", "b", "c", "a"]
    assert StageMap.from_dict(m.to_dict(), 6) == m


def test_micro_batches_follow_the_shares_and_are_spread_over_the_step():
    from spantrain_p2p.pipeline.assignment import assign_microbatches

    got = assign_microbatches(["fast", "slow"], [3.0, 1.0], 8)
    assert got.count("fast") == 6 and got.count("slow") == 2
    assert got.index("slow") < 4  # not bunched at the end
    assert assign_microbatches(["a", "b"], [1.0, 1.0], 1) == ["a"]


@pytest.mark.parametrize("patch,reason", [
    ({"steps": -1}, "steps"), ({"lr": 0}, "lr"), ({"micro_batch_size": 10**6}, "micro_batch_size"),
    ({"schedule": "pipedream"}, "schedule"), ({"model": "os.system"}, "package.module:function"),
    ({"model_args": {"x": [1]}}, "model_args"), ({"bogus": 1}, "unknown job fields"),
    ({"lr": float("nan")}, "lr"), ({"peers": True}, "peers"),
])
def test_an_invalid_job_from_the_network_is_rejected(patch, reason):
    d = JobSpec().to_dict()
    d.update(patch)
    with pytest.raises(ValueError, match=reason):
        JobSpec.from_dict(d)


def test_a_job_round_trips_and_its_fingerprint_is_stable():
    job = JobSpec(model_args={"dim": 32}).finalized()
    again = JobSpec.from_dict(job.to_dict())
    assert again == job and ModelHandle(again).fingerprint() == job.fingerprint
    assert JobSpec(model_args={"dim": 16}).finalized().fingerprint != job.fingerprint


def test_a_peer_refuses_a_job_it_cannot_run_and_says_why():
    with pytest.raises(JobRefused, match=f"protocol {PROTOCOL_VERSION + 1}"):
        check_compatible(JobSpec(protocol=PROTOCOL_VERSION + 1).finalized())
    user_job = JobSpec(model=USER).finalized()
    with pytest.raises(JobRefused, match="only runs models named with --model"):
        check_compatible(user_job)
    assert check_compatible(user_job, (USER,)).num_layers == 4
    with pytest.raises(JobRefused, match="fingerprint"):
        check_compatible(JobSpec(fingerprint="0" * 32))
    with pytest.raises(JobRefused, match="cannot build"):
        check_compatible(JobSpec(model="nosuchpkg.mod:fn", fingerprint="x"), ("nosuchpkg.mod:fn",))


def test_a_re_plan_with_the_same_stages_peers_shares_and_schedule_is_no_move():
    from spantrain_p2p.plan.stagemap import Stage, StageMap
    from spantrain_p2p.train.decide import same_layout as _same_layout
    a = StageMap(1, "j", (Stage(("p", "q"), (0, 3), (0.5, 0.5)), Stage(("r",), (3, 6), (1.0,))), schedule="zb-h1")
    assert _same_layout(a, StageMap(2, "j", (Stage(("q", "p"), (0, 3), (0.501, 0.499)), Stage(("r",), (3, 6), (1.0,))),
                                    start_step=7, schedule="zb-h1"))
    assert not _same_layout(a, StageMap(2, "j", (Stage(("p", "q"), (0, 3), (0.7, 0.3)), Stage(("r",), (3, 6), (1.0,))),
                                        schedule="zb-h1"))  # shares moved: a cheap move, but a move
    assert not _same_layout(a, StageMap(2, "j", (Stage(("p", "q"), (0, 4), (0.5, 0.5)), Stage(("r",), (4, 6), (1.0,))),
                                        schedule="zb-h1"))
    assert not _same_layout(a, StageMap(2, "j", a.stages, schedule="1f1b"))


def test_a_map_with_islands_round_trips_and_each_island_covers_every_layer():
    from spantrain_p2p.plan.stagemap import Island, StageMap
    from spantrain_p2p.plan.types import Stage

    stages = (Stage(("a1",), (0, 2)), Stage(("a2",), (2, 4)), Stage(("b1", "b2"), (0, 4)))
    smap = StageMap(3, "job", stages, islands=(Island(2, 5, "1f1b", ("int8",), 0.1), Island(1, 2, "gpipe", (), 0.3)),
                    exchange_codec="topk:0.1", sync_reason="islands: asked for")
    back = StageMap.from_dict(json.loads(json.dumps(smap.to_dict())), 4)
    assert back == smap
    assert [back.island_of(p) for p in ("a1", "a2", "b2", "zz")] == [0, 0, 1, None]
    one = back.island_map(1)
    assert one.stages == stages[2:] and one.schedule == "gpipe" and one.predicted_step_s == 0.3 and not one.islands
    assert back.island_map(0).compression == ("int8",)
    d = smap.to_dict()
    for bad, match in ((dict(d, islands=d["islands"][:1]), "2 to"),
                       (dict(d, islands=[dict(d["islands"][0], stages=1, compression=[]), dict(d["islands"][1], stages=2)]),
                        "cover layers"),
                       (dict(d, islands=[d["islands"][0], dict(d["islands"][1], steps_per_round=0)]), "steps_per_round"),
                       (dict(d, exchange_codec=""), "exchange_codec"),
                       (dict(d, exchange_codec="topk:0.9"), "unknown exchange codec")):
        with pytest.raises(ValueError, match=match):
            StageMap.from_dict(bad, 4)
    plain = StageMap(1, "job", stages[:2])
    assert plain.island_of("a1") is None and "islands" not in plain.to_dict()


def test_an_island_split_must_divide_the_micro_batches():
    assert JobSpec(num_micro_batches=4, island_split=2).island_split == 2
    with pytest.raises(ValueError, match="must divide the micro-batches"):
        JobSpec(num_micro_batches=4, island_split=3)
    with pytest.raises(ValueError, match="island_split"):
        JobSpec(island_split=0)


def test_the_exchange_compression_is_auto_or_a_codec_the_exchange_knows():
    assert JobSpec(exchange_compression="int:4").exchange_compression == "int:4"
    with pytest.raises(ValueError, match="unknown exchange codec"):
        JobSpec(exchange_compression="zip")


def test_a_relayed_pair_is_priced_for_the_relay_it_crosses():
    from spantrain_p2p.train.planning import charge_relays, snapshot

    rows = [{"src": "c", "dst": "d", "rtt_ms": 1.0, "mbps": 900.0, "status": "ok", "via": "a"},
            {"src": "c", "dst": "a", "rtt_ms": 1.0, "mbps": 100.0, "status": "ok", "via": ""},
            {"src": "a", "dst": "d", "rtt_ms": 1.0, "mbps": 400.0, "status": "ok"},
            {"src": "d", "dst": "c", "rtt_ms": 1.0, "mbps": 80.0, "status": "ok", "via": "b"}]  # legs unknown
    out = {(r["src"], r["dst"]): r for r in charge_relays(rows)}
    assert out[("c", "d")]["mbps"] == 50.0  # half the slowest leg (c -> a)
    assert out[("d", "c")]["mbps"] == 40.0
    assert out[("c", "a")]["mbps"] == 100.0 and out[("a", "d")]["mbps"] == 400.0
    assert all("via" not in r for r in out.values())
    prof = {"profile": {"effective_tflops": 1.0, "memory_bytes": 2**30}}
    links = {"c": {"d": rows[0], "a": rows[1]}, "a": {"d": rows[2]}}
    snap = snapshot({p: prof for p in "acd"}, links, ["a", "c", "d"])
    assert snap.network.link("c", "d").bandwidth == pytest.approx(50e6 / 8)


def test_buddy_copies_weigh_each_lone_stages_state_over_the_link_to_its_nearest_peer():
    """A lone stage's layers go to the nearest other peer of the map (by RTT, as the peers choose):
    the planner weighs their state (weights and Adam's two moments) over that link; a replicated
    stage copies nothing."""
    from spantrain_p2p.plan.types import Stage
    from spantrain_p2p.train.planning import buddy_copies, model_profile, snapshot

    job = JobSpec(steps=10)
    prof = model_profile(job)
    n = len(prof.layers)
    rows = {("a", "b"): (5.0, 80.0), ("a", "c"): (1.0, 20.0), ("b", "c"): (2.0, 40.0), ("c", "d"): (1.0, 800.0),
            ("b", "d"): (9.0, 800.0), ("a", "d"): (9.0, 800.0)}
    links: dict = {}
    for (x, y), (rtt, mbps) in rows.items():
        for s, d in ((x, y), (y, x)):
            links.setdefault(s, {})[d] = {"src": s, "dst": d, "rtt_ms": rtt, "mbps": mbps, "status": "ok"}
    profs = {p: {"profile": {"effective_tflops": 1.0, "memory_bytes": 2**30}} for p in "abcd"}
    snap = snapshot(profs, links, list("abcd"))
    m = StageMap(1, job.job_id, (Stage(("a",), (0, 1), (1.0,)), Stage(("b",), (1, 2), (1.0,)),
                                 Stage(("c", "d"), (2, n), (0.5, 0.5))))
    state = [3 * prof.layers[i].param_bytes for i in range(2)]  # weights + two Adam moments
    assert buddy_copies(m, job, snap) == [(state[0], 20e6 / 8), (state[1], 40e6 / 8)]  # a -> c, b -> c
