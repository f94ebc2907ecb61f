"""Models: what the swarm trains, as a list of cuttable layers, and what the planner knows of them.

- ``model``: the layer contract, the built-in transformer, user models (``package.module:function``);
- ``hf_model``, ``hf_presets``, ``hf_profile``: transformers causal LMs (``hf:PRESET|hf:DIR``), their
  named configs and their FLOPs and bytes per layer; ``example_user_model``: a user model to copy;
- ``workload``: emulating a real model's compute and bytes with a small proxy (``--workload``);
- ``precision``: compute and wire dtypes; ``devices``: where a peer's layers run, and their peak FLOP/s;
- ``state``: one layer's state (weights and optimizer), its wire form; ``checkpoint``: those states on disk.
"""
