"""A training job defined in Python (``Job``), and the trainer's options of a peer, from the one
declaration of the job's options (``job.options``) that ``spantrain-peer``'s flags come from too:
``train_options`` is what both ways in call, so the command line and the API cannot drift."""
from __future__ import annotations

import argparse
import os
import tempfile
from typing import Any, Callable, Optional, Union

from ..job.options import JOB_OPTIONS, PEER_OWN, job_fields, python_namespace, train_fields

ModelLike = Union[str, Callable[..., list], Any]  # a spec, a function returning layers, a transformers model


def train_options(a: argparse.Namespace, defines_job: bool, byzantine: str = ""):
    """The trainer's options (``train.trainer.TrainOptions``) of a peer, from its options as parsed
    (``spantrain-peer``'s flags, or ``job.options.python_namespace``): with ``defines_job`` the job
    too, built once here (its fingerprint goes into it), so that a model that does not import or
    build stops this peer now, with the reason, instead of leaving a swarm that waits."""
    from ..job.spec import BUILTIN, JobSpec
    from ..models.devices import resolve_device
    from ..robust.attacks import check
    from ..train.trainer import TrainOptions

    resolve_device(a.device)  # a device this machine lacks stops the peer now, saying what there is
    allowed = ((a.model,) if a.model != BUILTIN else ()) + ((a.workload,) if getattr(a, "workload", "") else ())
    job = None
    if defines_job:
        job = JobSpec(**job_fields(a))
        try:
            job = job.finalized()
        except Exception as e:
            raise ValueError(str(e) if isinstance(e, ValueError) else f"--model {a.model!r} failed to build: {e!r}") \
                from None
    return TrainOptions(job=job, allowed_models=allowed, byzantine=check(byzantine) if byzantine else "",
                        **train_fields(a))


class Job:
    """A training job, as the peer that starts a swarm defines it.

        Job("hf:gpt2-tiny", data="corpus.txt", steps=30, seq_len=64, micro_batches=4)

    Every option is named as its ``spantrain-peer`` flag (``micro_batches=8`` for ``--micro-batches 8``,
    ``offload_optimizer=True``, ``model_arg={"num_hidden_layers": 2}``; ``Job.option_names()`` lists
    them, ``spantrain-peer --help`` says what each does), typed and checked as the flag is.

    ``model``: a spec as ``--model`` takes it (``"hf:gpt2-tiny"``, ``"hf:DIR"``, ``"transformer"``,
    ``"package.module:function"``); a function returning the model's list of layers (defined at a
    module's top level: peers in this process import it from there, peers elsewhere need that module);
    or a transformers causal-LM object (GPT-2, Llama, Qwen2, Mistral), saved for the peers to read in
    ``model_dir`` (default: a new temporary directory). ``data``: a text file, a folder of them,
    ``.jsonl``, ``.parquet`` (with pyarrow), a ``datasets`` dataset saved with ``save_to_disk`` (its
    folder), ``"stdlib"``, or None for a generated corpus.
    ``tokenizer``: ``"bytes"`` (default), a tokenizer.json or a transformers tokenizer folder.
    """

    def __init__(self, model: ModelLike = "transformer", *, steps: int, data: Optional[str] = None,
                 tokenizer: Optional[str] = None, model_dir: Optional[str] = None, **options: Any):
        self.model = model_spec(model, model_dir)
        values = {**options, "model": self.model, "steps": steps}
        for name, v in (("data", data), ("tokenizer", tokenizer)):
            if v is not None:
                values[name] = os.fspath(v)
        self.values = values
        self.namespace = python_namespace(values)  # unknown names and ill-typed values stop here
        if not isinstance(steps, int) or steps < 1:
            raise ValueError(f"steps must be a positive int, not {steps!r}")

    @staticmethod
    def option_names() -> list[str]:
        """The keyword arguments a job takes (its ``spantrain-peer`` flags, with underscores)."""
        return [o.dest for o in JOB_OPTIONS]

    def replace(self, **options: Any) -> "Job":
        """This job with some options changed."""
        values = {**self.values, **options}
        steps = values.pop("steps")
        return Job(values.pop("model"), steps=steps, **values)

    def train_options(self):
        """The options of the peer that defines this job (the built and fingerprinted job in them)."""
        return train_options(self.namespace, defines_job=True)

    def __repr__(self) -> str:
        said = {k: v for k, v in self.values.items() if k not in ("model", "steps")}
        return f"Job({self.model!r}, steps={self.values['steps']}" + "".join(f", {k}={v!r}" for k, v in said.items()) + ")"


def joiner_options(accept: tuple[str, ...] = (), **options: Any):
    """The trainer's options of a peer that joins a swarm's job: ``accept``, the user models or model
    directories it agrees to run (``--model`` on a joiner), and this peer's own options (``data``,
    ``tokenizer``, ``data_cache``, ``device``, ``no_measure``, ``checkpoint_dir``, ``resume``, ...);
    the job's options come from the swarm."""
    theirs = sorted(set(options) - PEER_OWN)
    if theirs:
        raise TypeError(f"{theirs[0]!r} is the job's: a joiner takes the job from the swarm (its own options: "
                        f"{', '.join(sorted(PEER_OWN))})")
    accept = (accept,) if isinstance(accept, str) else tuple(accept)
    values = {k: (os.fspath(v) if k in ("data", "tokenizer", "data_cache", "checkpoint_dir", "resume") and v is not None
                  else v) for k, v in options.items()}
    ns = python_namespace({**values, **({"model": accept[0]} if accept else {})})
    opts = train_options(ns, defines_job=False)
    if len(accept) > 1:
        from dataclasses import replace

        opts = replace(opts, allowed_models=tuple(dict.fromkeys(opts.allowed_models + accept)))
    return opts


def model_spec(model: ModelLike, model_dir: Optional[str] = None) -> str:
    """``--model``'s spec for a model given in Python (see ``Job``)."""
    if isinstance(model, str):
        return model
    if hasattr(model, "save_pretrained") and hasattr(model, "config"):
        out = model_dir or tempfile.mkdtemp(prefix="spantrain-model-")
        model.save_pretrained(out)  # config.json and model.safetensors: what hf:DIR reads
        return f"hf:{os.path.abspath(out)}"
    if callable(model):
        mod, name = getattr(model, "__module__", None), getattr(model, "__qualname__", "")
        if not mod or not name or "<" in name or "." in name:
            raise ValueError(f"a model function must be defined at the top level of a module (peers import it "
                             f"by name), not {model!r}")
        return f"{mod}:{name}"  # (a script's own function: "__main__:name", importable by its own peers)
    raise TypeError(f"model must be a spec string, a function returning layers or a transformers model, "
                    f"not {type(model).__name__}")
