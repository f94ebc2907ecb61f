"""SpanTrain-P2P: train one model across heterogeneous peers joined by slow, unstable links."""

__version__ = "0.1.0"
PROTOCOL_VERSION = 1  # bumped when wire records or messages change incompatibly
