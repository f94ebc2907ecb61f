"""A killed daemon's Unix socket file is swept at the next peer's start: only one nothing listens on."""
import os
import socket
import time

from spantrain_p2p.swarm.daemon import daemon_socket_pattern, sweep_stale_sockets


def _bound(path: str, listen: bool) -> socket.socket:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.bind(path)
    if listen:
        s.listen(1)
    return s


def test_only_old_sockets_nobody_listens_on_go(tmp_path):
    old = time.time() - 3600
    dead = str(tmp_path / "hivemind-p2pd-dead.sock")
    _bound(dead, listen=False).close()  # a daemon killed: the file stays, nothing listens
    live = _bound(str(tmp_path / "hivemind-p2pd-live.sock"), listen=True)
    young = str(tmp_path / "hivemind-p2pd-young.sock")
    _bound(young, listen=False).close()  # bound a moment ago: maybe a daemon before its listen
    plain = tmp_path / "hivemind-p2pd-plain.sock"
    plain.write_text("not a socket")
    for path in (dead, live.getsockname(), str(plain)):
        os.utime(path, (old, old))
    try:
        gone = sweep_stale_sockets(str(tmp_path / "hivemind-p2pd-*.sock"))
        assert gone == 1
        assert not os.path.exists(dead)
        assert os.path.exists(live.getsockname()) and os.path.exists(young) and plain.exists()
        probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        probe.connect(live.getsockname())  # the live one still answers
        probe.close()
    finally:
        live.close()


def test_the_pattern_is_where_hivemind_puts_a_daemons_socket():
    assert daemon_socket_pattern() == "/tmp/hivemind-p2pd-*.sock"
