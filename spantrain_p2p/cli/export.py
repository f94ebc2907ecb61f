"""``spantrain export CHECKPOINT_DIR --out DIR``: a checkpoint as a transformers directory."""
from __future__ import annotations

import json


def add_export_arguments(p) -> None:
    p.add_argument("checkpoint", metavar="CHECKPOINT_DIR", help="a directory --checkpoint-every wrote")
    p.add_argument("--out", required=True, metavar="DIR", help="where to write config.json and model.safetensors")
    p.add_argument("--step", type=int, default=None, help="the step to export (default: the latest complete one)")
    p.add_argument("--json", action="store_true", help="print one JSON line")


def export_command(args) -> int:
    from ..job.export import export

    done = export(args.checkpoint, args.out, args.step)
    if args.json:
        print(json.dumps(done), flush=True)
    else:
        print(f"exported {done['model']} at step {done['step']} ({done['parameters']:,} parameters) to {done['out']}: "
              f"transformers.AutoModelForCausalLM.from_pretrained({done['out']!r})", flush=True)
    return 0
