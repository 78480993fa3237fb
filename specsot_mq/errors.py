"""The one exception type a user can cause (PromptTooLong is one kind of it); the CLI prints its
message as a single line."""

from __future__ import annotations


class SpecSotError(Exception):
    """A problem the user can fix (bad flag, missing model, no network); the message says how."""


RAISE_MAX_LEN = "raise the cache length (--max-len)"  # how a prompt too long is fixed in-process


class PromptTooLong(SpecSotError):
    """A prompt longer than a cache slot holds (a chat may leave out its oldest turns and ask again)."""

    @classmethod
    def of(cls, size: int, capacity: int, fix: str = RAISE_MAX_LEN) -> PromptTooLong:
        return cls(f"the prompt is {size} tokens and the KV cache holds {capacity} per sequence: shorten the prompt or {fix}")
