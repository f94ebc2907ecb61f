"""``spantrain``, the operator's tool, and its subcommands.

    main.py             the parser and the dispatch of ``spantrain <command>``
    plan.py             ``spantrain plan``: plan a swarm offline, compare with the baselines
    plan_figures.py     the planner's figures (``python -m spantrain_p2p.cli.plan_figures``)
    status.py           ``spantrain status``: the live members of a running swarm
    dataplane_bench.py  data plane against raw asyncio TCP (``python -m spantrain_p2p.cli.dataplane_bench``)

``spantrain swarm`` and ``spantrain bench`` are ``spantrain_p2p.launch``'s.
"""
