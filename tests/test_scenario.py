import glob

import pytest

from spantrain_p2p import scenario


@pytest.mark.parametrize("path", sorted(glob.glob("peers/*.toml")))
def test_shipped_scenarios_load(path):
    s = scenario.load(path)
    assert s.peers
    for a in s.peers:
        for b in s.peers:
            if a != b:
                link, _ = s.link_between(a.name, b.name)
                assert link.mbps > 0 and link.rtt_ms > 0


def test_cee_3region_matches_the_testbed():
    s = scenario.load("peers/cee-3region.toml")
    by_region = {}
    for p in s.peers:
        by_region.setdefault(p.region, []).append(s.device_of(p.name).gpus)
    assert by_region == {"cloud": [4, 4], "edge": [2, 2], "end": [1, 1, 1]}
    assert s.link_between("cloud-1", "edge-1")[0].mbps == 100
    assert s.link_between("cloud-2", "end-3")[0].mbps == 100
    assert s.link_between("edge-1", "edge-2")[0].mbps == 1000
    assert s.link_between("edge-2", "end-1")[0].mbps == 1000


BASE = {
    "name": "t",
    "link_classes": {"lan": {"rtt_ms": 1, "mbps": 100}},
    "device_classes": {"d": {"tflops": 1, "memory_gb": 1}},
    "regions": {"r": {"link": "lan"}},
    "peers": [{"name": "a", "region": "r", "device": "d"}],
}


@pytest.mark.parametrize("patch,reason", [
    ({"name": ""}, "missing 'name'"),
    ({"link_classes": {"lan": {"rtt_ms": -1, "mbps": 100}}}, r"link_classes.lan.rtt_ms"),
    ({"link_classes": {"lan": {"mbps": 100}}}, "missing 'rtt_ms'"),
    ({"peers": [{"name": "a", "region": "mars", "device": "d"}]}, "region 'mars'"),
    ({"peers": [{"name": "a", "region": "r", "device": "gpu"}]}, "device 'gpu'"),
    ({"peers": [{"name": "a", "region": "r", "device": "d"}] * 2}, "unique"),
    ({"peers": []}, "no \\[\\[peers\\]\\]"),
    ({"regions": {"r": {"link": "fiber"}}}, "regions.r.link"),
])
def test_scenario_mistakes_are_reported_by_field(patch, reason):
    with pytest.raises(scenario.ScenarioError, match=reason):
        scenario.parse({**BASE, **patch})


def test_regions_without_a_link_between_them_are_an_error():
    data = {**BASE, "regions": {"r": {"link": "lan"}, "s": {"link": "lan"}},
            "peers": [{"name": "a", "region": "r", "device": "d"}, {"name": "b", "region": "s", "device": "d"}]}
    with pytest.raises(scenario.ScenarioError, match="no link between regions r and s"):
        scenario.parse(data)


def test_time_dilation_can_be_set_for_a_run_on_a_copy_of_the_same_world(tmp_path):
    """`spantrain swarm|bench --time-dilation K`: the peers read a copy at K, the world unchanged."""
    from spantrain_p2p import scenario as sc

    src = sc.load("peers/cee-testbed-real.toml")
    out = sc.write_dilated("peers/cee-testbed-real.toml", 18, str(tmp_path / "s.toml"))
    s = sc.load(out)
    assert s.time_dilation == 18.0 and src.time_dilation != 18.0
    assert (s.name, s.peers, s.link_classes, s.device_classes) == (src.name, src.peers, src.link_classes, src.device_classes)
    two = sc.load(sc.write_dilated(out, 2.5, str(tmp_path / "t.toml")))  # a copy of a copy: one line, replaced
    assert two.time_dilation == 2.5
    for bad in (0, -1, float("nan")):
        with pytest.raises(sc.ScenarioError):
            sc.write_dilated("peers/cee-testbed-real.toml", bad, str(tmp_path / "u.toml"))
