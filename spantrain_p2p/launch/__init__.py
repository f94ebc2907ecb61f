"""Local swarms of peer processes: ``spantrain swarm``, ``spantrain bench`` and the tests use this.

Each peer is a real ``spantrain-peer`` process with its own log file, forked by this launcher's
zygote (torch and hivemind imported once; ``SPANTRAIN_ZYGOTE=0`` starts each peer as
``python -m spantrain_p2p peer`` instead). The launcher only starts processes and reads what they
report, it coordinates nothing.

    processes.py  PeerProcess (start, ready, /status, signal, stop, kill), run folders, wait_until
    zygote.py     the fork server that starts peer processes fast, and the launcher's handle on it
    swarm.py      ``spantrain swarm``: one peer per scenario peer, then form, measure or train
    follow.py     following a training run: progress, chaos fired at its step or time, losses, events
    chaos.py      the ``--chaos`` specs, and the message that changes the peers' emulated links
    report.py     the run summary and figures from the peers' reports, a stage map in words
    bench.py      ``spantrain bench``: the planner's plan against the baselines, back to back
"""
from .bench import bench_command
from .chaos import Chaos, set_link_factor
from .follow import RunFollower, train_and_report
from .processes import PeerProcess, new_run_dir, wait_until
from .report import describe_plan, epoch_figures, figures, measure_and_report, measurement_summary, summarize
from .swarm import job_args, launch_scenario, run_swarm, swarm_command

__all__ = [
    "Chaos", "PeerProcess", "RunFollower", "bench_command", "describe_plan", "epoch_figures", "figures", "job_args",
    "launch_scenario", "measure_and_report", "measurement_summary", "new_run_dir", "run_swarm", "set_link_factor",
    "summarize", "swarm_command", "train_and_report", "wait_until",
]
