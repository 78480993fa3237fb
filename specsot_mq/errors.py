"""The one exception type a user can cause; the CLI prints its message as a single line."""


class SpecSotError(Exception):
    """A problem the user can fix (bad flag, missing model, no network); the message says how."""


class PromptTooLong(SpecSotError):
    """A prompt longer than a cache slot holds (a chat may leave out its oldest turns and ask again)."""
