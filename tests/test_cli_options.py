"""The job options are declared once: `spantrain swarm` (and bench) accept every job flag that
`spantrain-peer` accepts, and the launcher hands each value on to the peers unchanged. No peer starts."""
from __future__ import annotations

import dataclasses
import os
import re
import subprocess
import sys

import pytest

from spantrain_p2p.cli.main import main_parser
from spantrain_p2p.launch.swarm import job_args
from spantrain_p2p.job.options import JOB_OPTIONS, OPTIMIZERS, PLAN_KINDS
from spantrain_p2p.peer_command.main import peer_parser

FLAG = re.compile(r"(?<![\w-])(--[a-z][a-z0-9-]*)")


def _help(*argv: str) -> str:
    out = subprocess.run([sys.executable, "-m", "spantrain_p2p", *argv, "--help"], capture_output=True, text=True,
                         timeout=60, env={**os.environ, "COLUMNS": "200"})
    assert out.returncode == 0, out.stderr
    return out.stdout


def _job_section(help_text: str) -> str:
    return help_text.split("training job", 1)[1]


def test_swarm_and_bench_help_list_every_job_flag_of_spantrain_peer():
    peer_flags = set(FLAG.findall(_job_section(_help("peer"))))
    assert {"--steps", "--optimizer", "--no-measure", "--dump-step", "--checkpoint-dir"} <= peer_flags
    for cmd in ("swarm", "bench"):
        missing = peer_flags - set(FLAG.findall(_help(cmd)))
        assert not missing, f"`spantrain {cmd}` lacks {sorted(missing)}"


# a value other than the default for every job option
NON_DEFAULT = {
    "--steps": "7", "--peers": "3", "--model": "tests.user_model:build", "--seq-len": "16",
    "--micro-batch-size": "2", "--micro-batches": "5", "--lr": "0.0025", "--optimizer": "sgd", "--seed": "11",
    "--schedule": "1f1b", "--plan": "gpipe-uniform", "--recv-timeout": "12.5", "--compression": "int8",
    "--stages": "2", "--checkpoint-every": "4", "--checkpoint-dir": "/tmp/ckpt", "--resume": "/tmp/ckpt-in",
    "--precision": "fp16", "--loss-scale": "1024", "--data": "stdlib", "--tokenizer": "/tmp/tok.json", "--data-cache": "/tmp/dc", "--dump-grads": "/tmp/grads",
    "--dump-step": "3", "--device": "cpu", "--workload": "hf:gpt2", "--workload-seq-len": "512",
    "--sync": "islands:12", "--outer-lr": "0.5", "--outer-momentum": "0.8", "--island-split": "5",
    "--exchange-compression": "int:4", "--aggregate": "sum", "--verify": "0.25", "--recompute": "full",
    "--shard-optimizer": "full",
}


def _swarm_argv() -> list[str]:
    argv = ["swarm", "--scenario", "peers/lan-4.toml"]
    for opt in JOB_OPTIONS:
        if opt.action == "store_true":
            argv.append(opt.flag)
        elif opt.action == "append":
            argv += [opt.flag, "dim=64", opt.flag, "depth=3"]
        else:
            argv += [opt.flag, NON_DEFAULT[opt.flag]]
    return argv


def test_every_job_option_reaches_the_peers_unchanged():
    swarm = main_parser().parse_args(_swarm_argv())
    first, every = job_args(swarm, num_peers=4)
    peer = peer_parser().parse_args(first + every)
    for opt in JOB_OPTIONS:
        assert getattr(peer, opt.dest) == getattr(swarm, opt.dest), opt.flag
    assert peer.peers == 3  # --peers, when given, wins over the scenario's count


def test_joiners_get_only_the_options_of_a_peer_not_the_job():
    first, every = job_args(main_parser().parse_args(_swarm_argv()), num_peers=4)
    joiner = peer_parser().parse_args(every)
    assert joiner.steps is None and joiner.model == "tests.user_model:build" and joiner.no_measure


def test_the_job_waits_for_the_scenario_s_peers_unless_told():
    first, _ = job_args(main_parser().parse_args(["swarm", "--scenario", "x.toml", "--steps", "5"]), num_peers=4)
    assert peer_parser().parse_args(first).peers == 4


@pytest.mark.parametrize("field_of", ["job", "train"])
def test_every_field_of_the_job_and_the_trainer_options_has_its_option(field_of):
    from spantrain_p2p.job.spec import JobSpec
    from spantrain_p2p.train.trainer import TrainOptions

    if field_of == "job":
        fields = {f.name for f in dataclasses.fields(JobSpec)} - {"protocol", "version", "job_id", "fingerprint",
                                                                  "data_fingerprint", "tokenizer_fingerprint"}
        declared = {o.job for o in JOB_OPTIONS if o.job}
    else:
        # set by the command line itself (job, allowed_models, the attack harness's --byzantine) or by
        # tests and the Python API only
        fields = {f.name for f in dataclasses.fields(TrainOptions)} - {"job", "allowed_models", "profile_cache_dir",
                                                                       "poll_s", "byzantine"}
        declared = {o.train for o in JOB_OPTIONS if o.train}
    assert declared == fields


def test_choices_are_the_job_s_own():
    from spantrain_p2p.pipeline.schedule import AUTO, SCHEDULE_NAMES
    from spantrain_p2p.job import spec as job

    by_flag = {o.flag: o for o in JOB_OPTIONS}
    assert set(by_flag["--plan"].choices) == set(PLAN_KINDS) == set(job.PLANS)
    assert set(by_flag["--optimizer"].choices) == set(OPTIMIZERS) == set(job.OPTIMIZERS)
    assert set(by_flag["--precision"].choices) == set(job.PRECISIONS)
    assert set(by_flag["--schedule"].choices) == {AUTO, *SCHEDULE_NAMES} == set(job.SCHEDULES)


def test_a_peer_turns_the_options_into_the_job_and_its_trainer_options():
    from spantrain_p2p.peer_command.main import train_options

    args = peer_parser().parse_args(["--steps", "3", "--optimizer", "sgd", "--no-measure", "--model-arg", "dim=32",
                                     "--model-arg", "depth=2", "--micro-batches", "2", "--checkpoint-dir", "/tmp/c"])
    opts = train_options(args)
    assert opts.job.optimizer == "sgd" and opts.job.steps == 3 and opts.job.num_micro_batches == 2
    assert opts.job.model_args["dim"] == 32 and opts.job.model_args["depth"] == 2
    assert opts.measure is False and opts.checkpoint_dir == "/tmp/c" and opts.allowed_models == ()


def test_a_joiner_that_names_no_tokenizer_or_data_uses_the_paths_the_job_names():
    from spantrain_p2p.job.options import train_fields
    from spantrain_p2p.peer_command.main import peer_parser

    fields = train_fields(peer_parser().parse_args(["--join", "/ip4/127.0.0.1/tcp/1/p2p/QmX"]))
    assert fields["tokenizer"] is None and not fields["data"]  # open_data falls back to the job's


def test_what_importing_torchao_says_of_kernels_this_machine_lacks_is_left_out_of_the_log(caplog):
    """transformers' model code imports torchao, which warns of the CUDA kernels and Triton this
    machine lacks ("Failed to load ... .so"), and torch of torchao's enum registrations: five lines at
    the end of the demo's export. Those lines alone are left out; torchao's other warnings show."""
    import logging

    from spantrain_p2p.peer_command.main import setup_logging

    setup_logging(0)
    with caplog.at_level(logging.WARNING):
        logging.getLogger("torchao").warning("Failed to load %s: Could not load this library: %s", "/x/_C.so", "/x/_C.so")
        logging.getLogger("torchao.kernel.intmm").warning("Warning: Detected no triton, on systems without Triton ...")
        logging.getLogger("torch.utils._pytree").warning(
            "%s is an Enum subclass and is now natively supported by torch.compile as an opaque value type.", "E")
        logging.getLogger("torchao").warning("8-bit state could not be quantized: %s", "a real problem")
        logging.getLogger("spantrain.peer").warning("Failed to load the job")  # another logger: not touched
    assert [r.getMessage() for r in caplog.records] == ["8-bit state could not be quantized: a real problem",
                                                        "Failed to load the job"]
