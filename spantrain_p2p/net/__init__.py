"""The network between peers: the data plane, its emulated links, and measuring them.

- ``framing``: framed messages (a msgpack header, then raw buffers), and checks of untrusted
  fields and maps (``check_fields``, ``strict_from_dict``);
- ``dataplane``: each peer's data-plane server (framed TCP and HTTP on one port) and its client;
- ``emulator``: the link emulator that makes loopback traffic behave like a scenario's links;
- ``probe_messages``: the probe's messages, its server-side handler and its client-side sender;
- ``ping``: pings, the round-trip time of one link or of many at once;
- ``prober``: the bulk probe of one link (RTT and bandwidth) into a ``LinkMeasurement``;
- ``passive``: the bandwidth of a link estimated from the real transfers on it.
"""
