"""Training: what the swarm trains and how a peer takes part.

The workload:
- ``model``: the model as a list of cuttable layers (built-in transformer, user functions);
- ``data``: the deterministic corpus and its batches by (seed, step, micro-batch);
- ``job``: the job record (what is trained, how; checked by every joiner); ``optim``: its optimizer;
- ``state``: one layer's state (weights and optimizer), its wire form and the resume step;
- ``reference``: single-process training, the reference the swarm must match.

A peer's trainer (``trainer``: its life cycle and step loop) and its components:
- ``measuring``: the device profile, pings, bandwidth probes, passive estimate;
- ``run_records``: the job, the stage maps and their news, in the DHT;
- ``coordinator``: the planner's role (groups, quorum, election, planning, re-planning);
- ``planning``: from measurements to the planner's snapshot and from a plan to a stage map;
- ``transport``: activations and gradients between stages (codecs, retries, deadlines);
- ``gradsum``: the replicas of a stage sum their gradients, layer by layer;
- ``liveness``: is a peer alive (asked when a receive or a record is late)?
- ``recovery``: snapshots, the buddy's copies, fetching layers taken over;
- ``checkpoint``: checkpoints on disk; ``report``: ``/status`` and ``/report``;
- ``decide``: the decisions above as pure functions (re-plan? broken epoch? resume where? buddy?
  ping slots).
"""
