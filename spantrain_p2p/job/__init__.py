"""The job: what the swarm trains and how, defined by the peer that starts it, checked by every joiner.

- ``spec``: the job record (``JobSpec``: model, data, batch shape, optimizer, precision, sync), from
  the DHT as untrusted input; ``optim``: its optimizer, the same on every stage;
- ``dataset``: the job's data (generated or a local data set with its tokenizer) behind one ``batch``;
- ``reference``: single-process training of a job, the reference the swarm's losses must match;
- ``export``: a checkpoint of the job as a transformers directory.
"""
