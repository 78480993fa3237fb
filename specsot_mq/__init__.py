"""SpecSoT-MQ: Skeleton-of-Thought + EAGLE speculative decoding."""

__version__ = "0.1.0"
