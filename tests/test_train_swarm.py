"""Training across real peer processes on loopback, checked against single-process training."""
import asyncio
import glob
import os
import subprocess
import sys

import pytest
import torch

from spantrain_p2p.launch import wait_until
from spantrain_p2p.job.spec import JobSpec
from spantrain_p2p.job.reference import reference_run
from tests._helpers import run_swarm_json, swarm_json

USER = "spantrain_p2p.models.example_user_model:tiny_mlp"


def rel(a, b):
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-12))


def training_statuses(procs) -> list[dict]:
    """Each peer's /status, every peer alive and none with a training error (else AssertionError with
    the dead peer's log or the errors)."""
    for p in procs:
        if not p.alive():
            raise AssertionError(f"{p.name} exited:\n{p.log_tail()}")
    sts = [p.status() for p in procs]
    errors = [s["train"]["error"] for s in sts if s.get("train", {}).get("error")]
    assert not errors, errors
    return sts


def wait_done(procs, timeout):
    def all_done():
        return all(s["state"] == "done" for s in training_statuses(procs))
    try:
        wait_until(all_done, timeout, interval=0.3)
    except TimeoutError as e:  # say where each peer stood (a CI run keeps no logs)
        raise TimeoutError(f"{e}\n" + "\n".join(f"--- {p.name}:\n{p.log_tail(40)}" for p in procs)) from None


@pytest.mark.heavy
def test_four_peers_started_by_hand_train_exactly_like_one_process(peers, tmp_path):
    """1 peer defines the job, 3 join by hand: gradients after step 0 and 30 losses match the reference."""
    swarm, steps, grads_dir = f"hand-{os.getpid()}", 30, str(tmp_path / "grads")
    origin = peers("p0", "--swarm", swarm, "--steps", str(steps), "--peers", "4", "--dump-grads", grads_dir,
                   "--plan", "even", "--schedule", "gpipe")
    origin.wait_ready(60)
    rest = [peers(f"p{i}", "--swarm", swarm, "--join", origin.info["address"], "--dump-grads", grads_dir)
            for i in range(1, 4)]
    for p in rest:
        p.wait_ready(60)
    everyone = [origin, *rest]
    wait_done(everyone, 120)

    reports = [p.status(path="/report") for p in everyone]
    assert sorted(r["stage"] for r in reports) == [0, 1, 2, 3]
    # each peer's step reaches the DHT with its record (done peers keep their last progress): the
    # planner and its standby hold every record (SWIM sends them each new one); another peer holds
    # only those it needed
    def every_step_seen():
        views = [p.status()["members"] for p in everyone]
        return any(len(v) == 4 and all(m["progress"].get("step") == steps for m in v) for v in views)

    wait_until(every_step_seen, 20)
    # what a run's follower reads (/status/brief): the progress and the plan, not the dashboard's histories
    tail = everyone[max(range(4), key=lambda i: reports[i]["stage"])]  # (its stage has the losses)
    brief, full = tail.status(path="/status/brief"), tail.status()
    assert brief["train"]["steps_done"] == steps and brief["train"]["plan"] == full["train"]["plan"]
    assert brief["train"]["recent_losses"] == full["train"]["recent_losses"] != []
    assert {"loss_history", "step_breakdown", "links_mbps"} <= full["train"].keys()
    assert not {"loss_history", "step_breakdown", "links_mbps", "cpu"} & brief["train"].keys()
    assert "control" in full and "control" not in brief
    last = max(reports, key=lambda r: r["stage"])
    losses = [l for _, l in last["losses"]]

    ref_losses, ref_grads = reference_run(JobSpec(steps=steps), steps, grads_at=0)
    assert len(losses) == steps
    worst_loss = max(abs(a - b) / abs(b) for a, b in zip(losses, ref_losses))
    assert worst_loss <= 1e-4, worst_loss

    grads = {}
    for f in glob.glob(os.path.join(grads_dir, "grads-step0-*.pt")):
        grads.update(torch.load(f))
    assert grads.keys() == ref_grads.keys()
    worst_grad = max(rel(grads[k], ref_grads[k]) for k in ref_grads)
    assert worst_grad <= 1e-5, worst_grad
    print(f"\n4 peers by hand: worst gradient rel. error {worst_grad:.2e}, worst loss rel. error {worst_loss:.2e} "
          f"over {steps} steps; loss {losses[0]:.3f} -> {losses[-1]:.3f}")


@pytest.mark.heavy
def test_replicated_stages_average_gradients_and_train_like_one_process(tmp_path):
    """lan-4 as 2 stages of 2 data-parallel replicas: same gradients and losses as one process."""
    steps, grads_dir = 20, str(tmp_path / "grads")
    summary = swarm_json(tmp_path, "--steps", str(steps), "--stages", "2", "--micro-batches", "6",
                         "--dump-grads", grads_dir)
    stages = summary["plan"]["stages"]
    assert [len(s["peers"]) for s in stages] == [2, 2]
    job = JobSpec(steps=steps, num_micro_batches=6)
    ref_losses, ref_grads = reference_run(job, steps, grads_at=0)
    assert max(abs(a - b) / b for a, b in zip(summary["losses"], ref_losses)) <= 1e-4
    files = glob.glob(os.path.join(grads_dir, "grads-step0-*.pt"))
    assert len(files) == 4
    for f in files:  # every replica holds the full (summed) gradient of its stage
        for k, g in torch.load(f).items():
            assert rel(g, ref_grads[k]) <= 1e-5, k


@pytest.mark.heavy
def test_a_user_model_trains_through_spantrain_swarm(tmp_path):
    steps = 20
    summary = run_swarm_json("--scenario", "peers/lan-4.toml", "--steps", str(steps), "--model", USER, "--no-measure",
                             "--run-dir", str(tmp_path))
    assert summary["steps"] == steps and len(summary["losses"]) == steps
    assert summary["samples_per_s"] > 0 and summary["step_s"] > 0
    stages = summary["plan"]["stages"]
    assert [s["layers"] for s in stages] == [[0, 1], [1, 2], [2, 3], [3, 4]]  # tiny_mlp: 4 layers, 4 peers
    assert sorted(p for s in stages for p in s["peers"]) == ["p0", "p1", "p2", "p3"]
    ref, _ = reference_run(JobSpec(model=USER, steps=steps), steps)
    assert max(abs(a - b) / b for a, b in zip(summary["losses"], ref)) <= 1e-4
    assert summary["losses"][-1] < summary["losses"][0] - 0.5


def test_a_joiner_refuses_a_job_it_may_not_run_and_the_others_carry_on(peers):
    swarm = f"refuse-{os.getpid()}"
    origin = peers("origin", "--swarm", swarm, "--steps", "5", "--peers", "2", "--model", USER)
    origin.wait_ready(60)
    stranger = peers("stranger", "--swarm", swarm, "--join", origin.info["address"])  # no --model: not allowed
    assert stranger.proc.wait(60) == 3
    log = open(stranger.log_file).read()
    assert "refusing to join this run" in log and USER in log
    ok = peers("ok", "--swarm", swarm, "--join", origin.info["address"], "--model", USER)
    ok.wait_ready(60)
    wait_done([origin, ok], 90)


async def test_a_joiner_refuses_a_job_of_another_protocol_version(peers):
    """An in-process peer publishes a job as a newer release would; a CLI joiner refuses it."""
    import asyncio
    from dataclasses import replace

    from spantrain_p2p import PROTOCOL_VERSION
    from spantrain_p2p.peer import Peer, PeerConfig
    from spantrain_p2p.train.trainer import Trainer, TrainOptions

    job = replace(JobSpec(steps=3).finalized(), protocol=PROTOCOL_VERSION + 1, version="9.9.9")
    swarm = f"proto-{os.getpid()}"
    peer = Peer(PeerConfig(swarm=swarm, heartbeat_s=0.5))
    trainer = Trainer(peer, TrainOptions(job=job))
    async with peer:
        peer.spawn(trainer.run(), "trainer")
        joiner = peers("joiner", "--swarm", swarm, "--join", peer.address)
        code = await asyncio.get_running_loop().run_in_executor(None, joiner.proc.wait, 60)
        assert code == 3
        log = open(joiner.log_file).read()
        assert f"protocol {PROTOCOL_VERSION + 1}" in log and "9.9.9" in log


@pytest.mark.heavy
def test_a_model_that_does_not_import_stops_the_run_at_once_with_the_reason(tmp_path):
    """A typo in --model: the peer that defines the job exits naming it, the launcher stops every peer."""
    r = subprocess.run([sys.executable, "-m", "spantrain_p2p", "swarm", "--scenario", "peers/lan-4.toml",
                        "--steps", "5", "--model", "no_such_pkg.models:build", "--json", "--run-dir", str(tmp_path)],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode != 0
    assert "cannot import 'no_such_pkg.models'" in r.stderr, r.stderr[-2000:]


async def test_a_trainer_that_fails_unexpectedly_says_so_and_its_peer_is_marked_failed():
    """Whatever breaks inside a trainer ends as its error in /status and the state 'failed', never as
    a peer that looks idle while nothing happens (the command line then leaves the swarm)."""
    from spantrain_p2p.peer import Peer, PeerConfig
    from spantrain_p2p.train.trainer import Trainer, TrainOptions

    spec = "no_such_pkg.models:build"
    peer = Peer(PeerConfig(swarm=f"crash-{os.getpid()}", heartbeat_s=0.5))
    trainer = Trainer(peer, TrainOptions(job=JobSpec(model=spec, steps=3), allowed_models=(spec,)))
    async with peer:
        await trainer.run()
        assert trainer.finished.is_set() and trainer.crashed
        assert "no_such_pkg.models" in trainer.error and trainer.refused is None
        assert peer.state == "failed"


async def test_stage_map_news_wakes_a_waiting_peer_and_is_rate_limited(monkeypatch):
    """A planner's "mapnews" wakes whoever waits for a stage map (they then read the DHT); news of
    another job, or news right after news, wakes no one. The gap between news is read on a fake
    clock (on the real one, a worker stalled 0.15 s between two news on a loaded box would let the
    second through)."""
    import types

    from spantrain_p2p.train import run_records
    from spantrain_p2p.train.run_records import MAP_NEWS_MIN_GAP_S, RunRecords

    clock = [1000.0]
    monkeypatch.setattr(run_records, "time", types.SimpleNamespace(monotonic=lambda: clock[0]))
    records = RunRecords(types.SimpleNamespace(), log_bad=lambda sub, why: None)
    records.job = JobSpec(job_id="job-a")
    loop = asyncio.get_running_loop()

    async def woken_after(header, at: float) -> float:
        t0 = loop.time()
        waiter = asyncio.ensure_future(records.news_or(1.0))
        await asyncio.sleep(0.05)
        clock[0] = at
        await records.on_news(header, [])
        await waiter
        return loop.time() - t0

    assert MAP_NEWS_MIN_GAP_S < 1.0
    assert await woken_after({"job": "job-b"}, 1000.0) >= 1.0
    assert await woken_after({"job": "job-a"}, 1000.0) < 0.5
    assert await woken_after({"job": "job-a"}, 1000.0 + MAP_NEWS_MIN_GAP_S / 2) >= 1.0  # within the gap: ignored
    assert await woken_after({"job": "job-a"}, 1000.0 + 1.5 * MAP_NEWS_MIN_GAP_S) < 0.5  # the gap over: wakes again


async def test_a_map_of_a_higher_term_supersedes_one_of_the_same_epoch():
    """Two peers each took the other for dead and each, planner of its own term, published an epoch 2
    with itself alone. The one of term 2 saw its map superseded by term 3's epoch 2, and waited for an
    epoch over 2 for ever while the other trained the job to its end (a suite run, 2026-12-02 08:23).
    Maps are ordered by (term, epoch), as ``newest_map`` and the epoch watch order them."""
    import types

    from spantrain_p2p.plan.stagemap import Stage, StageMap
    from spantrain_p2p.train.run_records import RunRecords

    records = RunRecords(types.SimpleNamespace(), log_bad=lambda sub, why: None)
    records.job = JobSpec(job_id="j")
    theirs = StageMap(2, "j", (Stage(("a",), (0, 6), (1.0,)),), term=3)

    async def newest(*_a, **_k):
        return theirs
    records.newest_map = newest
    records.news_or = lambda s: asyncio.sleep(0.01)
    records._log_map = lambda smap: None
    assert await records.await_map((2, 2), lambda: "") is theirs  # ours: term 2, epoch 2
    assert await records.await_map((1, 1), lambda: "") is theirs
    with pytest.raises(asyncio.TimeoutError):  # not newer than itself
        await asyncio.wait_for(records.await_map((3, 2), lambda: ""), 0.2)


async def test_a_stage_map_read_serves_this_peers_readers_until_news_or_its_age():
    """The planner's loop (every 0.5 s) and the trainer's watch share one read of the stage maps for
    MAP_REUSE_S; news of a map, or this peer's own publishing, makes the next read go to the DHT."""
    import types

    from spantrain_p2p.train import run_records
    from spantrain_p2p.train.run_records import RunRecords

    reads = []

    async def get(key, latest=False, **kw):
        reads.append(key)
        return None

    peer = types.SimpleNamespace(dht=types.SimpleNamespace(get=get), config=types.SimpleNamespace(swarm="s"))
    records = RunRecords(peer, log_bad=lambda sub, why: None)
    records.job = JobSpec(job_id="job-a")
    for _ in range(3):
        assert await records.newest_map() is None
    assert len(reads) == 1
    records._news_at = -1e9  # past the news gap: the next news wakes waiters
    await records.on_news({"job": "job-b"}, [])  # another job's news: the kept read still serves
    await records.newest_map()
    assert len(reads) == 1
    await records.on_news({"job": "job-a"}, [])
    await records.newest_map()
    await records.newest_map()
    assert len(reads) == 2
    records._map_read = (records._map_read[0] - run_records.MAP_REUSE_S, *records._map_read[1:])
    await records.newest_map()
    assert len(reads) == 3


@pytest.mark.heavy
def test_a_peer_that_joins_a_fixed_plan_mid_run_waits_as_a_spare_and_is_done_with_the_job(peers):
    """A third peer joins after a fixed 2-stage plan started: no map takes it (a fixed plan is not
    re-planned for a newcomer), and once the two peers of the map are done, so is it (it waited for
    a map forever before: a volunteer that came late never heard that the job had ended)."""
    swarm = f"spare-{os.getpid()}"
    origin = peers("p0", "--swarm", swarm, "--steps", "40", "--peers", "2", "--plan", "even", "--stages", "2")
    origin.wait_ready(60)
    second = peers("p1", "--swarm", swarm, "--join", origin.info["address"])
    second.wait_ready(60)
    wait_until(lambda: origin.status()["state"] in ("training", "done"), 60, interval=0.3)
    late = peers("p2", "--swarm", swarm, "--join", origin.info["address"])
    late.wait_ready(60)
    wait_done([origin, second, late], 120)
    assert late.status(path="/report")["stage"] is None
    assert "ran it to the end without this peer" in late.log_tail(60)
