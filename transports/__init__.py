"""How stage processes reach each other over ZeroMQ: `p2p` (a sender connects straight to the
receiver) or `ring` (each process sends only to its successor; a message carries its destination and
is forwarded until it arrives). Both give a stage the same two calls, send(dst, msg) and recv()."""

from specsot_mq.transports.links import TOPOLOGIES, P2P, Ring, Transport, make_transport

__all__ = ["TOPOLOGIES", "P2P", "Ring", "Transport", "make_transport"]
