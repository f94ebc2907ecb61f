"""The job options: declared once, here, for both command lines and the launcher.

``spantrain-peer`` adds them to its parser (``add_job_arguments``) and turns what it parsed into a
``JobSpec`` and ``TrainOptions`` (``job_fields``, ``train_fields``); ``spantrain swarm`` and
``spantrain bench`` add the same options and pass them on to the peers they start
(``peer_argv``): the job's fields to the peer that defines the job, a peer's own options to every
peer. An option added here is accepted by all of them and reaches the peer.
"""
from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import Any, Callable, Optional

from ..pipeline.schedule import AUTO, SCHEDULE_NAMES
from ..plan import PLAN_KINDS

# as job.spec.OPTIMIZERS (tests/test_cli_options.py ties them): importing job.spec here would load
# torch for every `spantrain --help`
OPTIMIZERS = ("adam", "sgd", "adam8bit")
PRECISIONS = ("fp32", "bf16", "fp16")  # as job.spec.PRECISIONS (tied by the same test)
FIRST, EVERY = "first", "every"  # which peers of a launched swarm get an option


def parse_model_args(pairs: list[str]) -> dict:
    """``--model-arg KEY=VALUE`` pairs as a dict; values become int, float or bool where they read so."""
    out = {}
    for kv in pairs:
        k, sep, v = kv.partition("=")
        if not sep or not k:
            raise ValueError(f"--model-arg wants KEY=VALUE, not {kv!r}")
        for conv in (int, float):
            try:
                out[k] = conv(v)
                break
            except ValueError:
                continue
        else:
            out[k] = {"true": True, "false": False}.get(v.lower(), v)
    return out


def _same(value: Any) -> Any:
    return value


_AS_PEER = object()  # `spantrain swarm` has the peer's default


@dataclass(frozen=True)
class JobOption:
    """One command-line option of the training job, and where its value goes."""

    flag: str
    help: Optional[str] = None
    type: Optional[Callable[[str], Any]] = None
    default: Any = None
    choices: Optional[tuple[str, ...]] = None
    metavar: Optional[str] = None
    action: str = "store"  # store | append | store_true
    job: Optional[str] = None  # the JobSpec field it sets (on the peer that defines the job)
    train: Optional[str] = None  # the TrainOptions field it sets (on this peer)
    value: Callable[[Any], Any] = _same  # parsed value -> field value
    train_value: Optional[Callable[[Any], Any]] = None  # parsed value -> TrainOptions value (default: value)
    to: str = FIRST  # which peers `spantrain swarm` passes it to: the job's first peer, or every peer
    swarm_help: Optional[str] = None  # its help in `spantrain swarm` where the launcher adds to it
    swarm_default: Any = _AS_PEER  # `spantrain swarm`'s default where it differs

    @property
    def dest(self) -> str:
        return self.flag[2:].replace("-", "_")

    def add_to(self, parser, swarm: bool = False) -> None:
        kw: dict[str, Any] = {"help": (self.swarm_help if swarm and self.swarm_help else self.help)}
        if self.action == "store_true":
            kw["action"] = "store_true"
        else:
            kw["action"] = self.action
            default = self.swarm_default if swarm and self.swarm_default is not _AS_PEER else self.default
            kw["default"] = [] if self.action == "append" else default
            for k in ("type", "choices", "metavar"):
                if getattr(self, k) is not None:
                    kw[k] = getattr(self, k)
        parser.add_argument(self.flag, **kw)

    def argv(self, value: Any) -> list[str]:
        """The value again as command-line words (nothing for a default that need not be said)."""
        if self.action == "store_true":
            return [self.flag] if value else []
        if self.action == "append":
            return [w for v in value for w in (self.flag, str(v))]
        return [] if value is None else [self.flag, str(value)]


JOB_OPTIONS: tuple[JobOption, ...] = (
    JobOption("--steps", "define the swarm's job: train this many steps", type=int, job="steps",
              swarm_help="train this many steps, then stop (default: only form)"),
    JobOption("--peers", "ready peers to wait for before training (default 1)", type=int, default=1, job="peers",
              swarm_help="ready peers to wait for before training (default: the scenario's peers that start "
              "with the swarm)", swarm_default=None),
    JobOption("--model", "'transformer' (built in), hf:PRESET or hf:DIR (a transformers causal LM: GPT-2, Llama, "
              "Qwen2, Mistral; a preset config or a local directory with config.json and model.safetensors; nothing "
              "is downloaded), or package.module:function returning a list of layers; on a joiner it names the user "
              "model or model directory this peer agrees to run", default="transformer", metavar="SPEC",
              job="model", to=EVERY),
    JobOption("--model-arg", "argument of the model (transformer: dim, depth, heads, mlp_ratio, vocab, seed; hf: any "
              "config field, e.g. num_hidden_layers, and seed); "
              "repeatable", action="append", metavar="KEY=VALUE", job="model_args",
              value=lambda v: dict(v) if isinstance(v, dict) else parse_model_args(v)),
    JobOption("--seq-len", type=int, default=32, job="seq_len"),
    JobOption("--workload", "emulate training this transformers model (hf:PRESET such as hf:gpt2-xl or "
              "hf:llama-7b, or hf:DIR with its config.json) while computing the small --model as its proxy: every "
              "op is padded to the workload's FLOPs, every message charged the workload's bytes, and the planner "
              "plans the workload's memory; the built-in proxy gets its layer count; on a joiner it names the "
              "model directory this peer agrees to read", metavar="SPEC", job="workload",
              value=lambda v: v or "", to=EVERY),
    JobOption("--workload-seq-len", "the workload's sequence length (default 1024)", type=int, default=1024,
              job="workload_seq_len"),
    JobOption("--micro-batch-size", type=int, default=4, job="micro_batch_size"),
    JobOption("--micro-batches", "micro-batches per step", type=int, default=4, job="num_micro_batches"),
    JobOption("--lr", type=float, default=1e-3, job="lr"),
    JobOption("--optimizer", "adam (default; fp32 state, exact), sgd, or adam8bit: Adam with its two moments in 8 "
              "bits, block-wise (torchao's Adam8bit: ~2 bytes of state a parameter instead of 8; tensors under 4,096 "
              "values stay fp32; its step is compiled once per peer)", default="adam", choices=OPTIMIZERS,
              job="optimizer"),
    JobOption("--precision", "compute dtype: fp32, bf16 or fp16 (autocast; weights, their gradients and the "
              "optimizer state stay fp32; activations and their gradients cross the wire in 2 bytes; fp16 scales "
              "the loss dynamically and skips a step that overflows on every peer) (default fp32)",
              default="fp32", choices=PRECISIONS, job="precision"),
    JobOption("--loss-scale", "fp16: the dynamic loss scale's initial value (halved on each overflow, doubled "
              "after 2000 clean steps) (default 65536)", type=float, default=65536.0, job="loss_scale"),
    JobOption("--data", "the data set: a text file, a folder of them, .jsonl (a 'text' field), .parquet (a 'text' "
              "column), a datasets dataset saved with save_to_disk (its folder: its 'text' column) or 'stdlib' (this "
              "Python's standard library); default: a generated corpus. Every peer "
              "checks its copy against the swarm's fingerprint", metavar="PATH", job="data", train="data",
              value=lambda v: v or "", to=EVERY),
    JobOption("--tokenizer", "'bytes' (default), a tokenizers tokenizer.json or a transformers tokenizer folder "
              "(`spantrain tokenizer` trains one)", metavar="PATH", job="tokenizer", train="tokenizer",
              value=lambda v: v or "bytes", train_value=_same, to=EVERY),  # a joiner without it: the job's path
    JobOption("--data-cache", "where this peer keeps tokenized data shards (default: $SPANTRAIN_CACHE/data, else "
              "~/.cache/spantrain/data)", metavar="DIR", train="data_cache", to=EVERY),
    JobOption("--seed", "seed of the data order and the model init", type=int, default=0, job="seed"),
    JobOption("--schedule", "pipeline schedule (default auto: the planner picks)", default=AUTO,
              choices=(AUTO, *SCHEDULE_NAMES), job="schedule"),
    JobOption("--plan", "who places the layers (default: the planner, from the measurements)", default="planner",
              choices=PLAN_KINDS, job="plan"),
    JobOption("--sync", "how regions train together: global (one step-synchronous plan), islands (each network "
              "group trains its own plan on its own data and the islands exchange compressed pseudo-gradients once a "
              "round, DiLoCo-style), islands:H (H steps a round on the fastest island), or auto (the planner "
              "predicts both and picks the faster) (default global)", default="global", metavar="MODE", job="sync"),
    JobOption("--outer-lr", "islands: the outer optimizer's Nesterov learning rate (default 0.7)", type=float,
              default=0.7, job="outer_lr"),
    JobOption("--outer-momentum", "islands: the outer optimizer's momentum (default 0.9)", type=float, default=0.9,
              job="outer_momentum"),
    JobOption("--island-split", "islands: an island takes each data step as K optimizer steps of 1/K of its "
              "micro-batches each; with K = the number of islands each makes as many updates per token as the global "
              "plan, as DiLoCo's replicas share the global batch (must divide --micro-batches; default 1)", type=int,
              default=1, metavar="K", job="island_split"),
    JobOption("--exchange-compression", "islands: the codec of the pseudo-gradients between islands (int8, int:4, "
              "topk:R; error feedback keeps what it drops), or auto: the least lossy that the round hides (default auto)",
              default="auto", metavar="CODEC", job="exchange_compression"),
    JobOption("--recv-timeout", "upper bound of every activation/gradient receive; below it the deadline follows "
              "the recent waits (default %(default)s)", type=float, default=60.0, metavar="S", job="recv_timeout_s",
              to=EVERY),
    JobOption("--aggregate", "how the replicas' gradients (and islands' pseudo-gradients) add up: robust "
              "(CenteredClip around a robust centre: one peer's arithmetic cannot wreck the model; a clean step "
              "equals the plain sum) or sum (plain; a closed swarm that trusts its members) (default robust)",
              default="robust", choices=("robust", "sum"), job="aggregate"),
    JobOption("--verify", "with --aggregate robust: the probability that a replica recomputes one micro-batch of "
              "another in a step and compares (verified computation; 0: never; default %(default)s)", type=float,
              default=0.05, metavar="P", job="verify"),
    JobOption("--recompute", "activation recomputation: auto (the planner turns it on for the stages whose peers "
              "cannot hold their activations otherwise), none, or full on every stage (a stage keeps each layer's "
              "input and runs its forward again in the backward; zero-bubble schedules in B and again in W) "
              "(default auto)", default="auto", choices=("auto", "none", "full"), job="recompute"),
    JobOption("--shard-optimizer", "the optimizer state of a stage's replicas sharded across them (ZeRO-1: each "
              "steps its own layers and sends the others their new weights; the same arithmetic): auto (the planner "
              "turns it on where a stage's peers cannot hold the state otherwise, inside a fast group), none, or "
              "full on every replicated stage; with --aggregate sum only (default auto)", default="auto",
              choices=("auto", "none", "full"), job="shard_optimizer"),
    JobOption("--offload-optimizer", "keep the optimizer's state in host memory and step it there: the device keeps "
              "weights and gradients only, each step copies them to the host and the new weights back (the same "
              "arithmetic: equal losses)", action="store_true", job="offload_optimizer"),
    JobOption("--compression", "activations/gradients between stages: none, fp16, int8, int:BITS (2-7), topk:R or "
              "adaptive (default none)", default="none", job="compression"),
    JobOption("--stages", "pipeline depth: 0 = one peer per stage; N = peers share N stages as data-parallel "
              "replicas", type=int, default=0, job="stages"),
    JobOption("--checkpoint-every", "checkpoint every K steps (0: never)", type=int, default=0, metavar="K",
              job="checkpoint_every"),
    JobOption("--checkpoint-dir", "where this peer writes its checkpoints", default="checkpoints",
              train="checkpoint_dir", to=EVERY),
    JobOption("--resume", "start from the checkpoint directory DIR (written by --checkpoint-every): the swarm "
              "resumes at the latest step at which every layer survives, on the stage layout the planner picks now",
              metavar="DIR", train="resume_dir", to=EVERY),
    JobOption("--device", "where this peer's layers, optimizer state and received tensors live: auto (the first "
              "CUDA device when torch sees one, else the CPU), cpu, cuda or cuda:N", default="auto", metavar="DEV",
              train="device", to=EVERY),
    JobOption("--no-measure", "skip device profiling and link probing", action="store_true", train="measure",
              value=lambda skip: not skip, to=EVERY),
    JobOption("--measure-only", "measure (profile and probe), then stop", action="store_true", train="measure_only",
              to=EVERY, swarm_help="profile devices and probe links, print the measurements, stop"),
    JobOption("--lanes", "run each step whole on the stage's compute thread, its activations and gradients on "
              "connections of their own to the peers of this machine that run with --lanes too, off the event "
              "loop (the rest go through it as before): far less CPU a tensor where peers share a machine's "
              "cores. Not taken with compression, the defences (--aggregate robust), fp16 or a GPU",
              action="store_true", train="lanes", to=EVERY),
    JobOption("--dump-grads", "save this stage's gradients of --dump-step to DIR (testing)", metavar="DIR",
              train="dump_grads_dir", to=EVERY),
    JobOption("--dump-step", type=int, default=0, train="dump_step", to=EVERY),
)


# a peer's own options (its copy of the data, its device, where it keeps things, ...): every peer of a
# swarm takes them, a joiner too; the others are the job's, given once by the peer that defines it
PEER_OWN = frozenset(o.dest for o in JOB_OPTIONS if o.train)


def add_job_arguments(parser, swarm: bool = False) -> None:
    """Adds every job option to ``parser`` (an ArgumentParser or argument group); ``swarm``: with the
    launcher's help and defaults."""
    for opt in JOB_OPTIONS:
        opt.add_to(parser, swarm)


def job_fields(args: argparse.Namespace) -> dict[str, Any]:
    """The ``JobSpec`` keyword arguments the parsed options give."""
    return {o.job: o.value(getattr(args, o.dest)) for o in JOB_OPTIONS if o.job}


def train_fields(args: argparse.Namespace) -> dict[str, Any]:
    """The ``TrainOptions`` keyword arguments (other than ``job`` and ``allowed_models``) the options give."""
    return {o.train: (o.train_value or o.value)(getattr(args, o.dest)) for o in JOB_OPTIONS if o.train}


def peer_argv(values: dict[str, Any]) -> tuple[list[str], list[str]]:
    """(flags for the peer that defines the job, flags for every peer) that give a peer these values
    (by ``dest``; the parsed options of ``spantrain swarm``)."""
    first: list[str] = []
    every: list[str] = []
    for opt in JOB_OPTIONS:
        (every if opt.to == EVERY else first).extend(opt.argv(values[opt.dest]))
    return first, every


def python_namespace(values: dict[str, Any]) -> argparse.Namespace:
    """The options as ``spantrain-peer`` would have parsed them, from Python keyword arguments named
    as the flags are (``micro_batches=8`` for ``--micro-batches 8``, ``offload_optimizer=True``,
    ``model_arg={"num_hidden_layers": 2}`` or a list of ``KEY=VALUE``): the Python API's jobs come
    from the same declaration as the flags, so ``job_fields`` and ``train_fields`` turn both into
    the same ``JobSpec`` and ``TrainOptions``. An unknown name, a value of the wrong type or one
    outside the option's choices is refused, naming the option."""
    by_name = {o.dest: o for o in JOB_OPTIONS}
    unknown = sorted(set(values) - set(by_name))
    if unknown:
        raise TypeError(f"unknown job option {unknown[0]!r}; the options are: {', '.join(sorted(by_name))}")
    ns = argparse.Namespace()
    for name, opt in by_name.items():
        v = values.get(name, None)
        if v is None:
            v = [] if opt.action == "append" else (False if opt.action == "store_true" else opt.default)
        elif opt.action == "store_true":
            if not isinstance(v, bool):
                raise TypeError(f"{name} (--{opt.flag[2:]}) wants True or False, not {v!r}")
        elif opt.action == "append":
            if isinstance(v, dict):
                v = [f"{k}={x}" for k, x in v.items()] if name != "model_arg" else v
            elif isinstance(v, str) or not all(isinstance(x, str) for x in v):
                raise TypeError(f"{name} (--{opt.flag[2:]}) wants a dict or a list of KEY=VALUE strings, not {v!r}")
        elif opt.type in (int, float):
            if isinstance(v, bool) or not isinstance(v, (int, float)) or (opt.type is int and not isinstance(v, int)):
                raise TypeError(f"{name} (--{opt.flag[2:]}) wants {'an int' if opt.type is int else 'a number'}, "
                                f"not {v!r}")
            v = opt.type(v)
        else:
            v = str(v) if not isinstance(v, str) and hasattr(v, "__fspath__") else v
            if not isinstance(v, str):
                raise TypeError(f"{name} (--{opt.flag[2:]}) wants a string, not {v!r}")
        if opt.choices and v not in opt.choices and v is not None and opt.action == "store":
            raise ValueError(f"{name} (--{opt.flag[2:]}) must be one of {', '.join(opt.choices)}, not {v!r}")
        setattr(ns, name, v)
    return ns
