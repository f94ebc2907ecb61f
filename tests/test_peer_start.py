"""A peer starting its job keeps answering, and a joiner does not give up on a busy founder."""
import os
import signal
import time

import pytest

from spantrain_p2p.launch.processes import wait_until

SLOW = "tests.slow_user_model:slow_mlp"


@pytest.mark.heavy
@pytest.mark.serial  # times its answers and its event loop: three tests at a time here held the loop 1.07 s once
def test_a_founder_answers_status_and_the_dht_while_it_builds_and_profiles_its_model(peers):
    """Every build of the founder's model blocks its thread 1.5 s (hashing, checking, profiling and
    the stage each build it): the founder still answers /status within a second throughout, its
    event loop is never held for a second, and a peer joining meanwhile (its DHT ping answered by
    the founder's loop) gets in."""
    swarm = f"busy-{os.getpid()}"
    founder = peers("f", "--swarm", swarm, "--model", SLOW, "--model-arg", "build_s=1.5", "--steps", "3",
                    "--peers", "1")
    founder.wait_ready(60)
    joiner = None
    worst, states = 0.0, []
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        t = time.monotonic()
        st = founder.status(timeout=30)
        worst = max(worst, time.monotonic() - t)
        if not states or states[-1] != st["state"]:
            states.append(st["state"])
        if joiner is None and st["state"] in ("measuring", "ready"):
            joiner = peers("j", "--swarm", swarm, "--join", founder.info["address"], "--model", SLOW)
        if st["state"] in ("done", "failed"):
            break
        time.sleep(0.1)
    lag = founder.status()["loop_lag"]
    print(f"\nfounder states {states}; slowest /status answer {worst:.2f}s; event loop held at most "
          f"{lag['max_ms']:.0f} ms")
    assert st["state"] == "done", (states, founder.log_tail())
    assert "measuring" in states, states  # the founder was timed while it built and profiled its model
    assert worst < 1.0 and lag["max_ms"] < 1000, (worst, lag)
    assert joiner is not None
    joiner.wait_ready(60)
    wait_until(lambda: joiner.status()["member_count"] == 2, 30)


def test_a_joiner_retries_a_founder_that_does_not_answer_at_first(peers):
    """The founder is stopped (SIGSTOP) while a peer joins: its p2p daemon accepts the connection but
    nobody answers the DHT ping. The joiner says so, tries again with backoff, and joins once the
    founder goes on, instead of exiting after hivemind's single 3 s try."""
    swarm = f"retry-{os.getpid()}"
    founder = peers("f", "--swarm", swarm)
    founder.wait_ready(60)
    founder.proc.send_signal(signal.SIGSTOP)
    try:
        joiner = peers("j", "--swarm", swarm, "--join", founder.info["address"])
        wait_until(lambda: "no answer to the DHT ping" in open(joiner.log_file).read() or joiner.proc.poll() is not None,
                   60)
        assert joiner.proc.poll() is None, joiner.log_tail()
    finally:
        founder.proc.send_signal(signal.SIGCONT)
    joiner.wait_ready(60)
    wait_until(lambda: joiner.status()["member_count"] == 2 and founder.status()["member_count"] == 2, 30)
    print("\n" + "\n".join(l for l in open(joiner.log_file).read().splitlines() if "DHT" in l))
