"""The training job: what the swarm trains, defined by the peer that starts it, adopted by joiners.

A ``JobSpec`` travels through the DHT, so ``from_dict`` treats it as untrusted. A joiner only
takes part if it runs the same protocol, is allowed to load the model (the built-in transformer,
or a user model the operator named on this peer with ``--model``: a job from the network never
makes a peer import arbitrary code), and builds a model with the same fingerprint.
"""
from __future__ import annotations

import hashlib
import json
import math
import secrets
from dataclasses import asdict, dataclass, field, replace
from typing import Any, Mapping, Optional

import torch
from torch import nn

from .. import PROTOCOL_VERSION, __version__
from ..errors import JobRefused  # noqa: F401 (raised by check_compatible and the trainer)
from ..pipeline.loss_scale import check_init
from ..pipeline.schedule import AUTO, SCHEDULE_NAMES
from ..plan.baselines import PLAN_KINDS
from ..models import model as model_lib
from ..models.precision import PRECISIONS
from ..models.hf_model import PREFIX, is_hf
from ..models.hf_presets import PRESETS
from ..plan.levers import MODES as RECOMPUTE

BUILTIN = "transformer"
SCHEDULES = (*SCHEDULE_NAMES, AUTO)  # auto: the planner picks
PLANS = PLAN_KINDS
OPTIMIZERS = ("adam", "sgd", "adam8bit")  # adam8bit: torchao's 8-bit Adam state (job.optim)
# robust: CenteredClip around a robust centre (robust.aggregate; a clean step's sum is the plain one);
# sum: the plain sum (a closed swarm that trusts its members' arithmetic)
AGGREGATES = ("robust", "sum")


def is_hf_preset(model: str) -> bool:
    """A named transformers config: data, not code; any peer may build it without naming it (a model
    directory must be named with --model: a job from the network never makes a peer read a path)."""
    return is_hf(model) and model[len(PREFIX):] in PRESETS


def _scalar_args(d: Any) -> dict:
    if not isinstance(d, dict) or len(d) > 32:
        raise ValueError("model_args must be a map of at most 32 entries")
    for k, v in d.items():
        if not isinstance(k, str) or len(k) > 64:
            raise ValueError("model_args keys must be short strings")
        ok = isinstance(v, (bool, int, str)) or (isinstance(v, float) and math.isfinite(v))
        if not ok or (isinstance(v, str) and len(v) > 256) or (isinstance(v, int) and abs(v) > 2**40):
            raise ValueError(f"model_args[{k!r}] must be a bounded int, float, bool or short string")
    return dict(d)


@dataclass(frozen=True)
class JobSpec:
    model: str = BUILTIN  # "transformer", "hf:PRESET_OR_DIR" (models.hf_model) or "package.module:function"
    model_args: Mapping[str, Any] = field(default_factory=dict)  # ModelConfig fields, or the function's kwargs
    seq_len: int = 32
    micro_batch_size: int = 4
    num_micro_batches: int = 4
    steps: int = 100
    seed: int = 0  # data order; the built-in model's init seed comes from model_args (default: this)
    lr: float = 1e-3
    optimizer: str = "adam"
    schedule: str = "gpipe"
    compression: str = "none"  # none | fp16 | int8 | int:BITS | topk:R | adaptive (per link, see compress.adaptive)
    plan: str = "planner"  # who places the layers: the planner, an even split, or a baseline
    sync: str = "global"  # global | islands | islands:H | auto (plan.islands)
    outer_lr: float = 0.7  # islands: the outer optimizer's Nesterov learning rate and momentum (islands.outer)
    outer_momentum: float = 0.9
    island_split: int = 1  # islands: optimizer steps per data step, each on 1/island_split of its micro-batches
    exchange_compression: str = "auto"  # islands: the pseudo-gradients' codec, or auto (the planner's choice)
    aggregate: str = "robust"  # how replicas' gradients and islands' pseudo-gradients add up (AGGREGATES)
    verify: float = 0.05  # with the robust defences: how often a replica recomputes another's micro-batch (robust.verify)
    # activation recomputation (pipeline.memory): auto (the planner's choice per stage: where a stage's
    # peers cannot hold its activations otherwise), none, or full on every stage (plan.levers)
    recompute: str = "auto"
    # the optimizer state of replicated stages sharded across their replicas (ZeRO-1, train.shard):
    # auto (where their peers cannot hold it otherwise, inside a fast group), none, or full (every
    # replicated stage); with --aggregate sum only (the robust sum needs every part at every replica)
    shard_optimizer: str = "auto"
    offload_optimizer: bool = False  # the optimizer's state and step on the host (job.offload)
    peers: int = 1  # ready peers to wait for before the first stage map
    stages: int = 0  # pipeline depth of the placeholder map: 0 = one peer per stage, else peers share stages
    checkpoint_every: int = 0  # steps between local checkpoints of each stage (0: none)
    recv_timeout_s: float = 60.0
    precision: str = "fp32"
    loss_scale: float = 65536.0  # fp16: the dynamic loss scale's initial value (pipeline.loss_scale)
    workload: str = ""  # hf:PRESET|hf:DIR: the model the emulated world trains (models.workload); "" none
    workload_seq_len: int = 1024  # the workload's sequence length
    data: str = ""  # the data set the starting peer named ("": the generated corpus); a joiner may have its own copy
    tokenizer: str = "bytes"  # likewise, the tokenizer it named
    data_fingerprint: str = ""  # what every peer's copy of the data set must hash to
    tokenizer_fingerprint: str = ""
    protocol: int = PROTOCOL_VERSION
    version: str = __version__
    job_id: str = ""
    fingerprint: str = ""

    def __post_init__(self) -> None:
        ints = {"seq_len": (1, 1 << 16), "micro_batch_size": (1, 4096), "num_micro_batches": (1, 4096),
                "steps": (0, 10**8), "seed": (0, 2**32 - 1), "peers": (1, 100_000), "protocol": (0, 2**31),
                "stages": (0, 100_000), "checkpoint_every": (0, 10**8), "workload_seq_len": (1, 1 << 20),
                "island_split": (1, 4096)}
        for name, (lo, hi) in ints.items():
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or not lo <= v <= hi:
                raise ValueError(f"job field {name!r} must be an int in [{lo}, {hi}], not {v!r}")
        for name, (lo, hi) in {"lr": (0.0, 10.0), "recv_timeout_s": (0.1, 3600.0), "outer_lr": (0.0, 10.0)}.items():
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not lo < v <= hi:
                raise ValueError(f"job field {name!r} must be a number in ({lo}, {hi}], not {v!r}")
        if not isinstance(self.model, str) or not 0 < len(self.model) <= 200:
            raise ValueError("job field 'model' must be a short string")
        if self.model != BUILTIN and self.model.count(":") != 1:
            raise ValueError(f"model {self.model!r} must be {BUILTIN!r}, 'hf:PRESET_OR_DIR' or 'package.module:function'")
        if isinstance(self.verify, bool) or not isinstance(self.verify, (int, float)) or not 0 <= self.verify <= 1:
            raise ValueError(f"job field 'verify' must be a probability in [0, 1], not {self.verify!r}")
        if not isinstance(self.offload_optimizer, bool):
            raise ValueError(f"job field 'offload_optimizer' must be a bool, not {self.offload_optimizer!r}")
        if self.recompute not in RECOMPUTE:
            raise ValueError(f"recompute must be one of {RECOMPUTE}, not {self.recompute!r}")
        if self.aggregate not in AGGREGATES:
            raise ValueError(f"aggregate must be one of {AGGREGATES}, not {self.aggregate!r}")
        if self.shard_optimizer not in ("auto", "none", "full"):
            raise ValueError(f"shard_optimizer must be auto, none or full, not {self.shard_optimizer!r}")
        if self.shard_optimizer == "full" and self.aggregate != "sum":
            raise ValueError("a sharded optimizer state needs --aggregate sum: the robust sum has every replica "
                             "judge every part, where a shard's owner sums its layers alone")
        if self.optimizer not in OPTIMIZERS:
            raise ValueError(f"optimizer must be one of {OPTIMIZERS}, not {self.optimizer!r}")
        if self.schedule not in SCHEDULES:
            raise ValueError(f"schedule must be one of {SCHEDULES}, not {self.schedule!r}")
        if self.plan not in PLANS:
            raise ValueError(f"plan must be one of {PLANS}, not {self.plan!r}")
        if self.compression != "adaptive":
            from ..compress import codecs

            try:
                codecs.parse_spec(self.compression)
            except (ValueError, TypeError) as e:
                raise ValueError(f"compression {self.compression!r}: {e}") from None
        from ..plan.islands import parse_sync

        parse_sync(self.sync)
        m = self.outer_momentum
        if isinstance(m, bool) or not isinstance(m, (int, float)) or not 0.0 <= m < 1.0:
            raise ValueError(f"job field 'outer_momentum' must be a number in [0, 1), not {m!r}")
        if self.exchange_compression != "auto":
            from ..plan.islands import exchange_ratio

            exchange_ratio(self.exchange_compression)  # a codec the exchange knows, or ValueError
        if self.num_micro_batches % self.island_split:
            raise ValueError(f"--island-split {self.island_split} must divide the micro-batches of a step "
                             f"({self.num_micro_batches})")
        if self.precision not in PRECISIONS:
            raise ValueError(f"precision must be one of {PRECISIONS}, not {self.precision!r}")
        object.__setattr__(self, "loss_scale", check_init(self.loss_scale))
        if not isinstance(self.workload, str) or len(self.workload) > 4096 or \
                (self.workload and not self.workload.startswith("hf:")):
            raise ValueError(f"workload {str(self.workload)[:60]!r}: name a transformers model, hf:PRESET or hf:DIR")
        for name in ("version", "job_id", "fingerprint", "data_fingerprint", "tokenizer_fingerprint"):
            v = getattr(self, name)
            if not isinstance(v, str) or len(v) > 128:
                raise ValueError(f"job field {name!r} must be a short string")
        for name in ("data", "tokenizer"):
            v = getattr(self, name)
            if not isinstance(v, str) or len(v) > 4096:
                raise ValueError(f"job field {name!r} must be a path of at most 4096 characters")
        object.__setattr__(self, "model_args", _scalar_args(self.model_args))

    @property
    def samples_per_step(self) -> int:
        return self.micro_batch_size * self.num_micro_batches

    def to_dict(self) -> dict:
        d = asdict(self)
        d["model_args"] = dict(self.model_args)
        return d

    @classmethod
    def from_dict(cls, d: Any) -> "JobSpec":
        if not isinstance(d, dict):
            raise ValueError("a job must be a map")
        known = {f for f in cls.__dataclass_fields__}
        unknown = set(d) - known
        if unknown:
            raise ValueError(f"unknown job fields: {sorted(unknown)[:5]}")
        return cls(**d)

    def finalized(self) -> "JobSpec":
        """This job with a fresh id and the model fingerprint filled in (done by the peer that starts
        it). With a workload, the built-in proxy gets the workload's depth unless it was given one;
        a proxy of another layer count is refused."""
        job = replace(self, job_id=self.job_id or secrets.token_hex(8))
        if job.workload:
            from ..models import workload

            n = workload.num_layers(job)
            if job.model == BUILTIN and "depth" not in job.model_args:
                job = replace(job, model_args={**job.model_args, "depth": n - 2})
        handle = ModelHandle(job)  # one build of the model answers both questions
        if job.workload and handle.num_layers != n:
            raise ValueError(f"the proxy model {job.model!r} has {handle.num_layers} layers, the "
                             f"workload {job.workload!r} {n}: they must match layer for layer")
        return replace(job, fingerprint=handle.fingerprint())


class ModelHandle:
    """Builds the job's model, or a slice of it, and knows its shapes."""

    def __init__(self, job: JobSpec):
        self.job = job
        self._hf = None
        self._shapes: Optional[list[tuple[int, ...]]] = None
        self._meta: Optional[list[nn.Module]] = None

    @property
    def hf(self):
        """The ``hf:`` model of the job (``models.hf_model.HFModel``), or None."""
        if self._hf is None and is_hf(self.job.model):
            from ..models.hf_model import HFModel

            self._hf = HFModel(self.job.model, self.job.model_args, self.job.seed, self.job.seq_len)
        return self._hf

    def _config(self) -> model_lib.ModelConfig:
        args = {"seed": self.job.seed, **self.job.model_args, "seq_len": self.job.seq_len}
        return model_lib.ModelConfig.from_dict({**model_lib.ModelConfig().to_dict(), **args})

    def _build_all(self) -> list[nn.Module]:
        if self.job.model == BUILTIN:
            return model_lib.build_layers(self._config())
        if self.hf is not None:
            return self.hf.build(0, self.hf.num_layers)
        return model_lib.load_user_model(self.job.model, **self.job.model_args)

    def build(self, first: int, last_exclusive: int) -> list[nn.Module]:
        if self.job.model == BUILTIN:
            return model_lib.build_layer_range(self._config(), first, last_exclusive)
        if self.hf is not None:
            return self.hf.build(first, last_exclusive)
        return self._build_all()[first:last_exclusive]

    def meta_layers(self) -> list[nn.Module]:
        """The layers on the meta device (shapes, no data), built once: read them, never change them."""
        if self._meta is None:
            if self.hf is not None:
                self._meta = self.hf.meta_layers()
            else:
                with torch.device("meta"):
                    self._meta = self._build_all()
        return self._meta

    @property
    def num_layers(self) -> int:
        return len(self.meta_layers())

    def warm(self) -> "ModelHandle":
        """Builds what the handle's questions need (the layer count, the boundary shapes) now, so that
        later answers come at once: building a large model takes seconds, and a peer asks from its
        event loop. The trainer calls this off the loop."""
        self.boundary_shapes()
        return self

    def boundary_shapes(self) -> list[tuple[int, ...]]:
        """shapes[i] = shape of the activation entering layer i (i >= 1) for one micro-batch; [0] = input."""
        if self._shapes is None:
            self._shapes = self._boundary_shapes()
        return list(self._shapes)

    def _boundary_shapes(self) -> list[tuple[int, ...]]:
        B, T = self.job.micro_batch_size, self.job.seq_len
        layers = self.meta_layers()
        x = torch.empty(B, T, dtype=torch.long, device="meta")
        shapes = [tuple(x.shape)]
        with torch.no_grad():
            for layer in layers[:-1]:
                x = layer(x)
                if not isinstance(x, torch.Tensor):
                    raise ValueError(f"layer {len(shapes) - 1} returned {type(x).__name__}, not a tensor")
                shapes.append(tuple(x.shape))
        return shapes

    def fingerprint(self) -> str:
        """Hash of the model spec and every parameter's name and shape, layer by layer."""
        layers = self.meta_layers()
        desc = [self.job.model, sorted(self.job.model_args.items()), self.job.seq_len,
                [[(n, list(p.shape)) for n, p in layer.named_parameters()] for layer in layers]]
        if self.hf is not None:  # the config, the weights' contents and the init seed
            desc.append(self.hf.describe())
        return hashlib.sha256(json.dumps(desc, default=str).encode()).hexdigest()[:32]


def check_compatible(job: JobSpec, allowed_models: tuple[str, ...] = ()) -> ModelHandle:
    """The model handle if this peer can run ``job``; JobRefused with the reason otherwise."""
    if job.protocol != PROTOCOL_VERSION:
        raise JobRefused(f"the swarm's job speaks protocol {job.protocol} (software {job.version}); this peer "
                         f"speaks {PROTOCOL_VERSION} (software {__version__}): upgrade or downgrade to match")
    if job.workload and not is_hf_preset(job.workload) and job.workload not in allowed_models:
        raise JobRefused(f"the swarm emulates workload {job.workload!r}, a model directory; this peer only reads "
                         f"directories named with --workload")
    if job.model != BUILTIN and job.model not in allowed_models and not is_hf_preset(job.model):
        what = "model directory" if is_hf(job.model) else "user model"
        raise JobRefused(f"the swarm trains {what} {job.model!r}; this peer only runs models named with "
                         f"--model (it has: {list(allowed_models) or 'none'})")
    try:
        handle = ModelHandle(job)
        fp = handle.fingerprint()
    except Exception as e:
        raise JobRefused(f"cannot build model {job.model!r} of the swarm's job: {e}") from None
    if job.fingerprint and fp != job.fingerprint:
        raise JobRefused(f"model {job.model!r} built here differs from the swarm's (fingerprint {fp[:12]} vs "
                         f"{job.fingerprint[:12]}): the peers run different code for it")
    return handle
