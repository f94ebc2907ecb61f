"""What an open swarm does about members whose arithmetic it cannot trust: robust aggregation of
replicas' gradients and islands' pseudo-gradients (``aggregate``), and the verdicts drawn from it
(``verdicts``). Pure functions over tensors and plain data; no network."""
