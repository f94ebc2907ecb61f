#!/usr/bin/env python3
"""Figures of peers across real network boundaries (issue 28), on a virtual internet of network
namespaces (``spantrain_p2p/launch/hosts.py``); needs root, iproute2 and nftables
(``scripts/setup-netns.sh``). Every peer is started with the README's commands.

    sudo .venv/bin/python scripts/nat_world.py train [--steps 50] [--shape MBIT]
        the tiny Llama on 4 public hosts, on loopback (the same commands), and on 4 hosts of which
        2 sit behind home routers (endpoint-independent, symmetric), each holding a stage (--plan
        even): losses compared bit for bit, samples/s, and per pair the path, its probed bandwidth
        and the link's (tbf on every uplink with --shape)
    sudo .venv/bin/python scripts/nat_world.py relay-kill [--steps 300] [--kill-step 60]
        2 public peers, 2 behind symmetric NAT (their pair relayed, through a first); a SIGKILLed
        at a step: recovery time, lost steps, the pair's path afterwards
    sudo .venv/bin/python scripts/nat_world.py bench [--mib 16] [--reps 10] [--shape MBIT]
        16 MiB tensors over each path: direct, reversed, hole-punched, relayed
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from spantrain_p2p.launch import hosts  # noqa: E402
from spantrain_p2p.launch.chaos import parse as parse_chaos  # noqa: E402
from spantrain_p2p.launch.follow import train_and_report  # noqa: E402
from spantrain_p2p.launch.processes import PeerProcess  # noqa: E402
from spantrain_p2p.peer_command.main import peer_parser  # noqa: E402


def job(steps: int, peers: int, *more: str) -> list[str]:
    return ["--model", "hf:llama-tiny", "--steps", str(steps), "--peers", str(peers), "--compression", "none",
            "--precision", "fp32", "--seed", "1", *more]


def quiet(*a, **k):
    return None


def world_run(kinds, args_job, shape=None, chaos=()):
    run_dir = tempfile.mkdtemp(prefix="nat-world-")
    with hosts.World() as w:
        procs = w.swarm(kinds, args_job, run_dir)
        if shape:
            for h in w.hosts.values():
                w.shape(h, shape)
        t0 = time.monotonic()
        summary = train_and_report(procs, peer_parser().parse_args(args_job), quiet,
                                   chaos=[parse_chaos(c, [p.name for p in procs], []) for c in chaos])
        took = time.monotonic() - t0
        live = [p for p in procs if p.alive()]
        nets = {p.name: p.status(timeout=30)["network"] for p in live}
        meas = {p.name: p.status(timeout=30, path="/measurements") for p in live}
        for p in live:
            p.stop(5)
    return summary, nets, meas, took


def loopback_run(args_job):
    run_dir = tempfile.mkdtemp(prefix="nat-loopback-")
    founder = PeerProcess("a", ["--name", "a", *args_job], run_dir)
    founder.start().wait_ready(90)
    rest = [PeerProcess(n, ["--join", founder.info["address"], "--name", n], run_dir) for n in "bcd"]
    for p in rest:
        p.start()
    for p in rest:
        p.wait_ready(90)
    procs = [founder, *rest]
    try:
        return train_and_report(procs, peer_parser().parse_args(args_job), quiet)
    finally:
        for p in procs:
            p.stop(5)


def pairs(nets, meas):
    rows = []
    for src, net in sorted(nets.items()):
        links = meas[src].get("links", {})
        for dst, used in sorted(net["paths"].items()):
            if dst == src:
                continue
            m = links.get(dst) or {}
            mbps, rtt = m.get("mbps"), m.get("rtt_ms")
            rows.append(f"{src}->{dst}: {used['path']}" + (f" via {used['via']}" if used["via"] else "") +
                        (f", probed {mbps:.0f} Mbit/s, RTT {rtt:.2f} ms" if mbps and rtt else ", not probed"))
    return rows


def cmd_train(a):
    j = job(a.steps, 4, "--plan", "even", "--schedule", "1f1b")  # a fixed schedule: the same sums in the same order
    public, pub_nets, pub_meas, _ = world_run(["public"] * 4, j, a.shape)
    loop = loopback_run(j)
    nat, nat_nets, nat_meas, _ = world_run(["public", "public", "nat", "symmetric"], j, a.shape)
    same = public["losses"] == loop["losses"]
    out = {"steps": a.steps, "link_mbit_s": a.shape or "unshaped veth",
           "losses_equal_bit_for_bit": {"4 public hosts vs loopback": same,
                                        "2 behind NAT vs loopback": nat["losses"] == loop["losses"]},
           "worst_loss_rel_diff_vs_loopback": {
               name: max(abs(x - y) / abs(y) for x, y in zip(run["losses"], loop["losses"]))
               for name, run in (("public", public), ("nat", nat))},
           "loss_first_last": [loop["losses"][0], loop["losses"][-1]],
           "samples_per_s": {"loopback": loop["samples_per_s"], "4 public hosts": public["samples_per_s"],
                             "2 of 4 behind NAT": nat["samples_per_s"]},
           "lost_steps": {"public": public["lost_steps"], "nat": nat["lost_steps"]},
           "plan": [s["peers"] for s in nat["plan"]["stages"]],
           "reach": {n: net["reach"] for n, net in nat_nets.items()},
           "pairs_behind_nat": pairs(nat_nets, nat_meas), "pairs_public": pairs(pub_nets, pub_meas)}
    print(json.dumps(out, indent=1))


def cmd_relay_kill(a):
    j = job(a.steps, 4)
    summary, nets, _, took = world_run(["public", "public", "symmetric", "symmetric"], j,
                                       chaos=[f"kill:a@step={a.kill_step}"])
    kill = next((e for e in summary["events"] if e["kind"] == "kill"), None)
    print(json.dumps({"steps": a.steps, "lost_steps": summary["lost_steps"], "losses": len(summary["losses"]),
                      "kill": kill, "replans": summary["replans"],
                      "c_d_path_after": nets.get("c", {}).get("paths", {}).get("d"),
                      "d_c_path_after": nets.get("d", {}).get("paths", {}).get("c"),
                      "b_relay": nets.get("b", {}).get("relay"), "wall_s": round(took, 1)}, indent=1))


def cmd_bench(a):
    """Idle peers a (public, founder), b (public), c, d (endpoint-independent NAT), e (symmetric NAT);
    bench peers on a public host (to b: direct, to c: reversed) and behind an endpoint-independent
    router (to d: hole-punched, to e: relayed)."""
    run_dir = tempfile.mkdtemp(prefix="nat-bench-")
    with hosts.World() as w:
        procs = w.swarm(["public", "public", "nat", "nat", "symmetric"], [], run_dir)
        x, y = w.public("hx"), w.behind_nat("hy")
        if a.shape:
            for h in w.hosts.values():
                w.shape(h, a.shape)
        addr = procs[0].info["address"]
        rows = []
        for host, name, to in ((x, "x", "b,c"), (y, "y", "d,e")):
            cmd = [*host.wrap(), sys.executable, "-m", "spantrain_p2p.cli.path_bench", "--join", addr, "--name", name,
                   "--to", to, "--mib", str(a.mib), "--reps", str(a.reps)]
            r = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
            rows += [json.loads(ln) for ln in r.stdout.splitlines() if ln.startswith("{")]
            if r.returncode:
                print(r.stderr[-3000:], file=sys.stderr)
        for p in procs:
            p.stop(5)
    print(json.dumps({"link_mbit_s": a.shape or "unshaped veth", "rows": rows}, indent=1))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    t = sub.add_parser("train")
    t.add_argument("--steps", type=int, default=50)
    t.add_argument("--shape", type=float, default=None, metavar="MBIT")
    r = sub.add_parser("relay-kill")
    r.add_argument("--steps", type=int, default=300)
    r.add_argument("--kill-step", type=int, default=60)
    b = sub.add_parser("bench")
    b.add_argument("--mib", type=int, default=16)
    b.add_argument("--reps", type=int, default=10)
    b.add_argument("--shape", type=float, default=None, metavar="MBIT")
    a = p.parse_args()
    why = hosts.why_not()
    if why:
        print(f"nat_world: {why}", file=sys.stderr)
        return 2
    {"train": cmd_train, "relay-kill": cmd_relay_kill, "bench": cmd_bench}[a.cmd](a)
    return 0


if __name__ == "__main__":
    sys.exit(main())
