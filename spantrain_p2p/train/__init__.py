"""Training workload: the reference model as a list of cuttable layers, and its deterministic data."""
