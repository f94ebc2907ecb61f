"""Which addresses a peer binds and announces (pure functions of the flags)."""
import pytest

from spantrain_p2p.net.addresses import announced_urls, default_binds, order_maddrs, p2p_announce, parse_announce

JOIN = "/ip4/11.0.0.10/tcp/4001/p2p/QmXbhmthAuEdQT9tHN4Y5B4BSCGfbnUUihKVj2siLssBVG"


def test_joining_a_non_loopback_address_binds_every_interface():
    assert default_binds(None, None, []) == ("/ip4/127.0.0.1/tcp/0", "127.0.0.1")
    assert default_binds(None, None, [JOIN]) == ("/ip4/0.0.0.0/tcp/0", "0.0.0.0")
    assert default_binds("/ip4/0.0.0.0/tcp/4001", None, []) == ("/ip4/0.0.0.0/tcp/4001", "0.0.0.0")
    assert default_binds(None, "10.1.2.3", [JOIN]) == ("/ip4/0.0.0.0/tcp/0", "10.1.2.3")  # what is given stays


def test_an_unspecified_bind_is_never_announced():
    urls = announced_urls("0.0.0.0", 7001, interfaces=["127.0.0.1", "11.0.0.5", "192.168.1.2"])
    assert urls == ["http://11.0.0.5:7001", "http://192.168.1.2:7001"]
    assert announced_urls("0.0.0.0", 7001, interfaces=["127.0.0.1"]) == ["http://127.0.0.1:7001"]
    assert announced_urls("10.0.0.2", 7001, interfaces=[]) == ["http://10.0.0.2:7001"]


def test_announce_comes_first_with_its_own_port():
    urls = announced_urls("0.0.0.0", 7001, ["203.0.113.7:9000", "peer.example.org"], interfaces=["11.0.0.5"])
    assert urls == ["http://203.0.113.7:9000", "http://peer.example.org:7001", "http://11.0.0.5:7001"]
    assert parse_announce("[2001:db8::1]:7001") == ("2001:db8::1", 7001)
    for bad in ("0.0.0.0", "", "host:0", "host:70000", "a/b", "[::1"):
        with pytest.raises(ValueError, match="--announce"):
            parse_announce(bad)


def test_the_daemon_announces_a_forwarded_port_and_hands_out_a_reachable_address_first():
    assert p2p_announce("/ip4/0.0.0.0/tcp/4001", ["203.0.113.7"]) == ["/ip4/203.0.113.7/tcp/4001"]
    assert p2p_announce("/ip4/0.0.0.0/tcp/0", ["203.0.113.7"]) == []  # port unknown before start
    maddrs = ["/ip4/127.0.0.1/tcp/1/p2p/X", "/ip4/192.168.1.2/tcp/1/p2p/X", "/ip4/11.0.0.5/tcp/1/p2p/X"]
    assert order_maddrs(maddrs, ["http://11.0.0.5:7001"])[0] == "/ip4/11.0.0.5/tcp/1/p2p/X"
    assert order_maddrs(maddrs)[-1] == "/ip4/127.0.0.1/tcp/1/p2p/X"


def test_only_a_daemon_listening_beyond_this_host_asks_the_router_for_a_port():
    from spantrain_p2p.net.addresses import port_mapping_wanted

    assert port_mapping_wanted("/ip4/0.0.0.0/tcp/4001") and port_mapping_wanted("/ip4/11.0.0.5/tcp/0")
    for local in ("/ip4/127.0.0.1/tcp/0", "/ip6/::1/tcp/0", "/ip4/127.0.0.2/tcp/9", "/unix/tmp/p2pd.sock"):
        assert not port_mapping_wanted(local), local
