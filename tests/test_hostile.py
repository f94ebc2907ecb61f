"""Hostile input: every parser of untrusted bytes fails only with its own error, and live peers keep
training through fuzzed messages and through connections that announce huge frames and stall."""
import asyncio
import os
import random
import time

import pytest
import torch

from spantrain_p2p.launch import wait_until
from spantrain_p2p.net import framing, handshake, secure
from spantrain_p2p.net.client import DataPlaneClient
from spantrain_p2p.net.dataplane import RemoteError
from spantrain_p2p.net.handshake import Authenticator, HandshakeError
from spantrain_p2p.net.wire import REQUEST, REQUEST_MAGIC
from spantrain_p2p.pipeline.messages import Expect, decode_tensor, encode_tensor
from spantrain_p2p.swarm.identity import Identity
from spantrain_p2p.swarm.records import BadRecord, open_record, sign_payload
from spantrain_p2p.swarm.sealing import SealError, SwarmKey
from spantrain_p2p.job.spec import JobSpec
from tests import fuzz_harness
from tests._reference_cache import default_losses
from tests.test_train_swarm import training_statuses, wait_done

N_PURE = 1000


def test_parsers_of_untrusted_bytes_fail_only_with_their_own_errors():
    rng = random.Random(1)
    ident, key = Identity.generate(), SwarmKey.generate()
    auth = Authenticator(ident)
    expect = Expect("act", "job", 1, frozenset({"peer"}), (4, 32, 64), 4)
    for _ in range(N_PURE):
        kind, header, bufs = fuzz_harness.mutated_tensor_message(rng, "job", 1, 5, "peer")
        body = fuzz_harness.frame_bytes(rng, header, bufs)
        try:
            h, b = framing.decode(bytearray(body))
            decode_tensor(h, b, expect, (5, 6))
        except framing.FrameError:
            pass
        v = fuzz_harness.random_value(rng)
        with pytest.raises(BadRecord):
            open_record("peer", v if rng.random() < 0.5 else sign_payload(
                v if isinstance(v, dict) else {"v": v}, ident, 1 << 20))
        with pytest.raises(SealError):
            key.open(rng.choice([v, b"STS1" + rng.randbytes(rng.randrange(0, 80))]), "k", "s", 1.0)
        hello = handshake.pack(v if isinstance(v, dict) else {"v": v})
        try:
            auth.server_hello(hello[:rng.randrange(8, len(hello) + 1)] if rng.random() < 0.3 else hello)
        except HandshakeError:
            pass
    # a valid message survives the same path (the loop above is not refusing everything for one reason)
    header, bufs = encode_tensor("act", "job", 1, 5, 0, "peer", torch.ones(4, 32, 64))
    h, b = framing.decode(bytearray(b"".join(bytes(c) for c in framing.encode(header, bufs))))
    assert decode_tensor(h, b, expect, (5, 6))[2].shape == (4, 32, 64)


def _rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS")


def _training_pair(peers, swarm: str, steps: int, *extra: str, tag: str = ""):
    a = peers(f"{tag}a", "--swarm", swarm, "--steps", str(steps), "--peers", "2", "--plan", "even", *extra)
    a.wait_ready(60)
    b = peers(f"{tag}b", "--swarm", swarm, "--join", a.info["address"], *extra)
    b.wait_ready(60)
    wait_until(lambda: all(p.status()["state"] == "training" for p in (a, b)), 60, interval=0.1)
    return a, b


def _report_losses(procs) -> list[list]:
    """The [step, loss] rows of the last stage's report."""
    return max((p.status(path="/report") for p in procs), key=lambda r: r["stage"])["losses"]


def _losses(procs) -> list[float]:
    return [l for _, l in _report_losses(procs)]


def _match_one_process(losses: list[float]) -> None:
    """``losses``, the first steps of the default job (of any length), are one process's within 1e-4."""
    ref = default_losses(len(losses))
    assert max(abs(x - y) / abs(y) for x, y in zip(losses, ref)) <= 1e-4


def _losses_match_one_process(procs, steps: int) -> None:
    losses = _losses(procs)
    assert len(losses) == steps  # no step lost
    _match_one_process(losses)


def _steps_so_far(procs) -> list[float]:
    """The losses of the steps a running pair has trained so far, from the last stage's report: every
    step from 0 there, none lost (AssertionError if a peer died, failed or skipped one)."""
    training_statuses(procs)
    rows = _report_losses(procs)
    steps = [s for s, _ in rows]
    assert steps == list(range(len(steps))), steps
    return [l for _, l in rows]


def _losses_so_far_match_one_process(procs, at_least: int) -> int:
    """``_losses_match_one_process`` for the steps trained so far (at least ``at_least``), the run going
    on: a test whose attacks are over checks the steps they met, not the rest of the run (the filler
    that outlasts them on a loaded box: a minute of two peers' training); returns their number."""
    losses = _steps_so_far(procs)
    assert len(losses) >= at_least, (len(losses), at_least)
    _match_one_process(losses)
    return len(losses)


REFERENCE_STEPS = 800  # past ~900 steps a pipeline's summation order drifts from one process's (chaos)


@pytest.mark.heavy
def test_a_training_swarm_survives_forgery_fuzzing_and_stalled_connections(peers):
    """One training swarm, three attacks: a forged activation (right in every field but its sender);
    hostile messages from a member of the swarm (and outsiders); 100 connections that each announce a
    256 MiB frame, send 1 KiB and stall. Each forgery is refused with its reason, no peer crashes,
    every /status answers, the peer's memory grows by far less than 300 MB, the stalled connections
    are closed after the stall timeout, no step trained through the attacks is lost and their losses
    equal single-process training. The run is left there: its steps after the attacks only outlast
    them (a long run, ``scripts/fuzz.sh``, is trained to its end and set beside a clean one)."""
    n = int(os.environ.get("SPANTRAIN_FUZZ_MESSAGES", "300"))
    # training should outlast the attacks (~12 s: fuzzing ~5 s, the stall timeout and its closes ~7 s; an idle
    # box trains ~25 steps/s): at 170 steps a quiet run had finished before the stall attack, which then
    # found the peer done; a run that finishes during the attack anyway is checked for all the rest
    swarm, steps, stall_s = f"fuzz-{os.getpid()}", max(400, n // 5), 2.0
    a, b = _training_pair(peers, swarm, steps, "--stall-timeout", str(stall_s))
    _forge_an_activation(a, b)
    st = a.status()["train"]
    targets = [{"peer_id": p.info["peer_id"], "data_url": p.info["data_url"]} for p in (a, b)]
    t0 = time.monotonic()
    got = asyncio.run(fuzz_harness.fuzz(targets, a.info["address"], swarm, n, seed=7, job=st["job"],
                                        epoch=st["epoch"], step=st["step"]))
    st_after = a.status()["train"]
    print(f"\n{n} fuzzed messages in {time.monotonic() - t0:.1f}s while steps {st['step']}..{st_after['step']} "
          f"trained (epoch {st['epoch']} -> {st_after['epoch']}); outcomes: {dict(sorted(got.items()))}")
    assert sum(got.values()) == n
    assert not any(k.endswith(":ACCEPTED") for k in got), got  # no outsider's message is taken
    for p in (a, b):
        assert p.alive(), p.log_tail()
        assert p.status()["state"] in ("training", "done")
    after = _stall_attack(a, stall_s)
    if steps <= REFERENCE_STEPS:  # the attacks are over: the steps they met are checked, the run is left
        checked = _losses_so_far_match_one_process([a, b], at_least=after)
        print(f"steps 0..{checked - 1} of {steps} checked against one process")
        return
    wait_done([a, b], 60 + steps / 5)
    fuzzed = _losses([a, b])  # a long run (scripts/fuzz.sh): the same run without the attacks, loss for loss
    for p in (a, b):
        p.stop()
    c, d = _training_pair(peers, swarm + "-clean", steps, tag="clean-")
    wait_done([c, d], 60 + steps / 5)
    clean = _losses([c, d])
    print(f"{steps} steps: attacked and clean runs' losses equal at {sum(x == y for x, y in zip(fuzzed, clean))} "
          f"of {len(clean)} steps")
    assert len(fuzzed) == steps and fuzzed == clean


def _forge_an_activation(a, b) -> None:
    """An activation for stage 1 right in every field (job, epoch, step, shape, dtype, the sender it
    claims) but sent by someone else: without a handshake, over HTTP, or authenticated as another peer."""
    import urllib.error
    import urllib.request

    stage1 = next(p for p in (a, b) if p.status()["train"]["stage"] == 1)
    stage0 = a if stage1 is b else b
    st = stage1.status()["train"]
    spec = JobSpec()
    shape = (spec.micro_batch_size, spec.seq_len, 64)  # the built-in model's activation
    header, bufs = encode_tensor("act", st["job"], st["epoch"], st["step"] + 1, 0, stage0.info["peer_id"],
                                 torch.full(shape, 1e3))
    url = stage1.info["data_url"]

    async def attempts():
        refusals = []
        for client in (DataPlaneClient(), DataPlaneClient(auth=Authenticator(Identity.generate()))):
            with pytest.raises(RemoteError) as e:
                await client.send(url, "act", header, bufs, timeout=10)
            refusals.append((e.value.status, e.value.reason))
            await client.close()
        return refusals

    (unauth, reason_u), (stranger, reason_s) = asyncio.run(attempts())
    assert unauth == 401 and "authenticated connections only" in reason_u, reason_u
    assert stranger == 403 and "authenticated as" in reason_s, reason_s
    body = b"".join(bytes(c) for c in framing.encode(header, bufs))
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(urllib.request.Request(f"{url}/msg/act", data=body, method="POST"), timeout=10)
    assert e.value.code in (404, 405)  # a peer takes no message over plain HTTP
    print(f"\nforged activation refused: {unauth} ({reason_u}); {stranger} ({reason_s}); HTTP {e.value.code}")


def _stall_attack(target, stall_s: float) -> int:
    """The stall attack on ``target``, checked; the steps it had trained by its end."""
    host, port = target.info["data_url"].removeprefix("http://").split(":")
    idents = [Identity.generate() for _ in range(4)]
    before_rss = _rss_mb(target.proc.pid)

    async def attack():
        conns, throttled = [], []
        for i in range(100):  # from an address of its own (the per-address limits throttle it: counted as closed)
            r, w = await asyncio.open_connection(host, int(port), local_addr=("127.0.0.69", 0))
            try:
                raw = w
                if i % 5:  # most authenticate first (an open swarm lets anyone); some do not bother
                    session = await Authenticator(idents[i % 4]).client(r, w)
                    if session.encrypted:  # as every peer's is: the attack speaks the protocol
                        w = secure.SecureWriter(w, session.send_key)
                w.write(REQUEST.pack(REQUEST_MAGIC, 3, 256 << 20) + b"act" + os.urandom(1024))
                await w.drain()
                w = raw
            except (HandshakeError, ConnectionError):
                throttled.append(w)
                continue
            conns.append((r, w))
        t_sent = time.monotonic()
        await asyncio.sleep(1.0)
        peak = _rss_mb(target.proc.pid)
        status = target.status()  # it still serves
        closed_after = []
        for r, w in conns:
            try:
                while await asyncio.wait_for(r.read(1 << 16), stall_s + 10):
                    pass
            except (ConnectionError, asyncio.TimeoutError):
                pass
            closed_after.append(time.monotonic() - t_sent)
            w.close()
        for w in throttled:
            w.close()
        print(f"{len(throttled)} of 100 refused at once by the per-address limits")
        return peak, status, closed_after or [0.0]

    before_step = target.status()["train"]["steps_done"]
    peak, status, closed_after = asyncio.run(attack())
    after_step = target.status()["train"]["steps_done"]
    print(f"RSS {before_rss:.0f} MB before, {peak:.0f} MB with 100 stalled 256 MiB announcements; all closed "
          f"{min(closed_after):.1f}-{max(closed_after):.1f}s after the last was sent (stall timeout {stall_s:.0f}s); "
          f"steps {before_step}..{after_step} trained meanwhile")
    assert status["state"] in ("training", "done")  # it still serves
    assert peak - before_rss < 300, (before_rss, peak)
    assert max(closed_after) < stall_s + 5, max(closed_after)
    assert after_step > before_step or status["state"] == "done"  # training went on (or had ended)
    return after_step
