"""A peer's sampled stacks put down to its parts (``launch.cpu_samples``): the innermost frame of
ours decides, the loop's own frames and torch's say nothing."""
from spantrain_p2p.launch.cpu_samples import part_of, shares

LOOP = ["<module> (<string>:1)", "serve (/w/spantrain_p2p/launch/zygote.py:134)",
        "main (/w/spantrain_p2p/peer_command/main.py:220)", "BaseEventLoop._run_once (/py/asyncio/base_events.py:1922)",
        "Handle._run (/py/asyncio/events.py:80)"]


def test_the_innermost_frame_of_ours_decides():
    swim = LOOP + ["DataPlane._serve (/w/spantrain_p2p/net/dataplane.py:300)", "SwimLoop.handle (/w/spantrain_p2p/peer/swim_loop.py:220)",
                   "verify (/w/spantrain_p2p/swarm/identity.py:60)", "RSAPublicKey.verify (/py/site-packages/cryptography/x.py:1)"]
    tensor = LOOP + ["DataPlane._serve (/w/spantrain_p2p/net/dataplane.py:300)", "decode (/w/spantrain_p2p/compress/codecs.py:10)",
                     "Tensor.copy_ (/py/site-packages/torch/_tensor.py:5)"]
    compute = ["thread (77): stage-0", "StageExecutor._run (/w/spantrain_p2p/pipeline/executor.py:180)", "forward (/py/site-packages/torch/nn/modules/linear.py:1)"]
    dht = LOOP + ["DHTNode.get_many (/py/site-packages/hivemind/dht/node.py:500)"]
    page = LOOP + ["status (/w/spantrain_p2p/view/dashboard.py:40)", "dumps (/py/json/__init__.py:231)"]
    assert part_of(swim) == "control" and part_of(dht) == "control"
    assert part_of(tensor) == "data plane" and part_of(compute) == "training" and part_of(page) == "pages"
    assert part_of(LOOP) == "loop"  # the launcher's frames are everybody's: not a part


def test_shares_of_a_core_from_raw_lines():
    lines = ["thread (1): MainThread;" + ";".join(LOOP + ["probe (/w/spantrain_p2p/peer/swim_loop.py:340)"]) + " 3",
             "thread (2): stage;" + "run (/w/spantrain_p2p/pipeline/executor.py:1) 12",
             "garbage line", ""]
    got = shares(lines, rate_hz=10, seconds=2)
    assert got["samples"] == 15
    assert got["share_of_a_core"] == {"control": 0.15, "training": 0.6} and got["all"] == 0.75
