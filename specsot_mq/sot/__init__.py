"""Skeleton-of-Thought logic: parse a skeleton into points worth reading, decide whether a question
gets a skeleton at all, spread the points over devices and merge them. Only learned_router.py (the
router's features, one forward of the model) and engine.py import torch."""
