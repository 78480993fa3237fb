"""Skeleton-of-Thought logic with no model in it: parse a skeleton into points, decide whether a
question gets a skeleton at all, and spread the points over devices."""
