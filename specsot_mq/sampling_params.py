"""How one request is decoded: its sampling settings and stop conditions, plain data that travels
in the wire messages (messages.py) and needs no torch (the stages without a model read it too)."""

from __future__ import annotations

from dataclasses import dataclass

from specsot_mq.errors import SpecSotError

# The CLI's repeat_stop (ask, run, chat) and the benchmarks': SmolLM2-135M often loops, and a run
# of 16 tokens seen twice in one output is a loop.
REPEAT_STOP = 16


@dataclass(slots=True)
class SamplingParams:
    """How one request is decoded. temperature 0 means greedy."""

    max_tokens: int = 256
    temperature: float = 0.0
    top_k: int = 0  # 0 = no limit
    top_p: float = 1.0
    min_p: float = 0.0  # drop tokens less likely than this share of the likeliest; 0 = off
    seed: int | None = None
    stop: tuple[str, ...] = ()  # stop strings; the output ends before the first one
    ignore_eos: bool = False
    repeat_stop: int = 0  # end the output when its last N tokens already ran earlier in it (a loop); 0 = off
    # Stop strings count only past the output's leading whitespace: with stop "\n\n", an output
    # that opens with a blank line runs on to the end of its first paragraph (a SoT point).
    stop_after_text: bool = False
    # End the output (finish "repeat") at the end of a line that repeats an earlier line, ignoring
    # case, a leading list number and punctuation: a SoT skeleton listing its points again.
    stop_repeated_line: bool = False
    # With stop_repeated_line: a list item that runs on inside a line ("1. a 2. b") starts a line
    # of its own, so a skeleton that lists its points again on one line ends too.
    stop_repeated_item: bool = False
    # End the output (finish "length") once one line of it runs past this many characters; 0 = off:
    # a SoT skeleton whose first "point" is a paragraph is no plan of short points.
    max_line_chars: int = 0

    def __post_init__(self):
        checks = [
            (self.max_tokens >= 1, f"max_tokens must be at least 1, got {self.max_tokens}"),
            (self.temperature >= 0, f"temperature must be >= 0 (0 = greedy), got {self.temperature}"),
            (self.top_k >= 0, f"top_k must be >= 0 (0 = off), got {self.top_k}"),
            (0 < self.top_p <= 1, f"top_p must be in (0, 1], got {self.top_p}"),
            (0 <= self.min_p <= 1, f"min_p must be in [0, 1] (0 = off), got {self.min_p}"),
            (self.repeat_stop >= 0, f"repeat_stop must be >= 0 (0 = off), got {self.repeat_stop}"),
            (self.max_line_chars >= 0, f"max_line_chars must be >= 0 (0 = off), got {self.max_line_chars}"),
        ]
        for ok, message in checks:
            if not ok:
                raise SpecSotError(message)
        self.stop = tuple(s for s in self.stop if s)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0
