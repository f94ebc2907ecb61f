"""The swarm: who is in it, what they publish in the DHT, and the decisions every peer makes alike.

- ``identity``: a peer's libp2p key, its peer id, and signatures made with it;
- ``records``: signed, versioned peer records and the signed payloads of other DHT entries;
- ``keys``: every DHT key and subkey of a swarm, built in one place;
- ``membership``: announcing our record on a heartbeat, reading everybody's;
- ``discovery``: finding a swarm (checked ``--join`` multiaddrs, or mDNS on a LAN);
- ``measure``: publishing and reading profiles, link probes, pings and grouping votes;
- ``probe_plan``: which pairs of peers to probe (the full mesh, or sparse at scale);
- ``grouping``: network groups and compute classes from one measurement snapshot;
- ``election``: the planner's lease, with a term number;
- ``daemon``: hivemind's p2pd tied to the life of its peer.
"""
