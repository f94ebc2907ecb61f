"""What a pipeline stage runs in one step, and how it runs it.

- ``schedule``: schedules as data (GPipe, 1F1B, ZB-H1 action lists; ``SCHEDULE_NAMES``,
  ``resolve_schedule``), with a checker and a timing model;
- ``assignment``: which peer of a stage runs which micro-batch, and each peer's action list
  (the runtime's rule; the cost model and the simulator call the same functions);
- ``executor``: runs one stage's list for one step; ``messages``: the tensor messages between
  stages; ``deadlines``: receive deadlines that follow the swarm's pace; ``loss_scale``: fp16's
  dynamic loss scale, decided swarm-wide.
"""
