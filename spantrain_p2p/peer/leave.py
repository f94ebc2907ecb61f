"""Leaving the swarm: a peer's tasks stopped (training first: it must not answer its own
departure), the goodbye and the tombstone (if graceful), then its servers and its daemon.

Every part is bounded, and the log says what each took: a daemon that died first or froze, or a
task that ignores its cancellation, must not leave a peer that never exits (a SIGTERM promises
2 s). In CI on 2026-12-01 a SIGTERM took 8.2 s: 3 s before the DHT's stop, where no part
warned (the tombstone's store, whose calls time out after 3 s, the likely one), then 5 s asking
the daemon to remove the DHT's handlers. With the daemon frozen (SIGSTOP) the old order took
13.1 s; this one 1.15-1.26 s (tests/test_operator_view.py)."""
import asyncio
import logging
import time

from . import admission

log = logging.getLogger("spantrain.peer")
SHUTDOWN_STEP_S = 5.0  # the most any one part of leaving may take
LEAVE_NOTICE_S = 0.8  # the most the goodbye and the tombstone may take together
DAEMON_STOP_S = 0.3  # a daemon that has not exited this long after its SIGTERM is killed


async def leave(peer, graceful: bool = True) -> None:
    took: dict[str, float] = {}  # each part, in s
    t0 = time.monotonic()
    for t in peer._tasks:
        t.cancel()
    try:
        await asyncio.wait_for(asyncio.gather(*peer._tasks, return_exceptions=True), SHUTDOWN_STEP_S)
    except asyncio.TimeoutError:
        log.warning("shutdown: tasks %s did not stop within %.0fs",
                    [t.get_name() for t in peer._tasks if not t.done()], SHUTDOWN_STEP_S)
    peer._tasks.clear()
    took["tasks"] = time.monotonic() - t0
    if graceful and peer._dht is not None and peer.identity is not None and peer.state != "left":
        peer.state = "left"
        t = time.monotonic()
        await say_goodbye(peer)
        took["goodbye"] = time.monotonic() - t
    for name, step in (("advertiser", stop_advertiser), ("client", lambda p: p.client.close()),
                       ("dataplane", stop_dataplane), ("dht", stop_dht), ("p2p", stop_p2p)):
        t = time.monotonic()
        try:
            await asyncio.wait_for(step(peer), SHUTDOWN_STEP_S)
        except asyncio.TimeoutError:
            log.warning("shutdown step %s did not finish within %.0fs: going on", name, SHUTDOWN_STEP_S)
        except Exception as e:
            log.warning("shutdown step %s failed: %s", name, e)
        took[name] = time.monotonic() - t
    log.info("left in %.2fs (%s)", time.monotonic() - t0, ", ".join(f"{k} {v:.2f}" for k, v in took.items()))
    admission.forget_key_file(peer)  # (a peer that failed before its daemon started)


async def say_goodbye(peer) -> None:
    """SWIM's goodbye to the watchers and the tombstone in the DHT, side by side and together
    bounded by ``LEAVE_NOTICE_S`` (one after the other, each had a bound of its own, 2 s and 5 s): a
    member that misses both still sees this peer go by its silence. ~0.01-0.02 s on a quiet swarm."""
    tasks = {"tombstone": asyncio.ensure_future(peer._announce())}
    if peer.swim is not None:
        tasks["goodbye"] = asyncio.ensure_future(peer.swim.leave())
    _, pending = await asyncio.wait(tasks.values(), timeout=LEAVE_NOTICE_S)
    for k, t in tasks.items():
        if t in pending:
            t.cancel()
            log.warning("could not send the %s within %.1fs", k, LEAVE_NOTICE_S)
        elif t.exception() is not None:
            log.warning("could not send the %s: %s", k, t.exception())
    await asyncio.gather(*pending, return_exceptions=True)


async def stop_advertiser(peer) -> None:
    if peer._advertiser is not None:
        await peer._advertiser.stop()
        peer._advertiser = None


async def stop_dataplane(peer) -> None:
    if peer.dataplane is not None:
        await peer.dataplane.stop()


async def stop_dht(peer) -> None:
    """Stops the DHT node's own work (its routing refresh). Its handlers go with the daemon, which
    ``stop_p2p`` stops next: asking that daemon to remove them first is what hung for 5 s."""
    if peer._dht is not None:
        node = getattr(peer._dht, "node", peer._dht)  # a GuardedDHT wraps the node
        node.is_alive = False
        peer._dht = None


async def stop_p2p(peer) -> None:
    """Stops the daemon: SIGTERM, then SIGKILL after ``DAEMON_STOP_S`` (a frozen daemon never acts
    on the SIGTERM, and the peer would wait out the whole step's bound)."""
    if peer._p2p is not None:
        p2p, peer._p2p = peer._p2p, None
        try:
            await asyncio.wait_for(p2p.shutdown(), DAEMON_STOP_S)
        except asyncio.TimeoutError:
            child = getattr(p2p, "_child", None)  # hivemind's asyncio subprocess of p2pd
            if child is not None and child.returncode is None:
                log.warning("the p2p daemon did not stop within %.1fs: killing it", DAEMON_STOP_S)
                child.kill()
                await child.wait()
    peer.emulator = peer.device = None
