"""Training: a peer's part in the job, its life cycle and step loop, and the trainer's components.

What is trained lives below: ``models`` (layers, transformers models, workloads, layer state and
checkpoints), ``data`` (text, tokenizers, corpus, shards), ``job`` (the job record, its optimizer,
data, single-process reference and export) and ``islands`` (the outer loop of islands).

A peer's trainer (``trainer``: its life cycle and step loop) and its components:
- ``measuring``: the device profile, pings, bandwidth probes, passive estimate;
- ``run_records``: the job, the stage maps and their news, in the DHT;
- ``coordinator``: the planner's role (groups, quorum, election, planning, re-planning);
- ``held_measurements``: the planner's copy of the members' profiles and links (entries, versions);
- ``planning``: from measurements to the planner's snapshot and from a plan to a stage map;
- ``transport``: activations and gradients between stages (codecs, retries, deadlines);
- ``gradsum``: the replicas of a stage sum their gradients, layer by layer;
- ``overflow``: fp16's "skip this step?" decision, the same on every peer;
- ``liveness``: is a peer alive (asked when a receive or a record is late)?
- ``recovery``: snapshots, the buddy's copies, fetching layers taken over;
- ``report``: ``/status`` and ``/report``;
- ``decide``: the decisions above as pure functions (re-plan? broken epoch? resume where? buddy?
  ping slots).
"""
