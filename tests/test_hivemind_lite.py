"""The command-line processes import hivemind's subpackages without its whole package."""
import subprocess
import sys

CODE = """
import sys
from spantrain_p2p._hivemind_lite import install
install()
from hivemind.dht.node import DHTNode
from hivemind.p2p import P2P
import hivemind.p2p.p2p_daemon_bindings.p2pclient as p2pclient
light = "scipy" not in sys.modules and "hivemind.averaging" not in sys.modules and "hivemind.moe" not in sys.modules
import hivemind
from hivemind import Optimizer  # a user's module that wants the whole package still gets it
print(light, hivemind.DHT.__name__, Optimizer.__name__, hivemind.__version__)
"""


def test_a_peer_process_loads_only_what_it_uses_and_the_rest_on_first_use():
    r = subprocess.run([sys.executable, "-c", CODE], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    from importlib.metadata import version

    assert r.stdout.split() == ["True", "DHT", "Optimizer", version("hivemind")], r.stdout
