"""Islands: region groups that train on their own and meet once a round (DiLoCo-style).

- ``outer``: the outer optimizer for the layers one peer holds (pure tensor arithmetic);
- ``exchange``: the round's pseudo-gradients between islands, on the wire;
- ``members``: who takes part in each round's merge (the keeper), so a silent island is left out.
"""
