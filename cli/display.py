"""Terminal views of a streamed answer (the events of messages.ClientEvent, from the in-process
engine or the stages alike): a live skeleton and one row per point on a terminal; plain text when
stdout is a pipe (the skeleton and progress to stderr, the answer alone on stdout, streamed)."""

from __future__ import annotations

import sys

from rich.console import Console, Group
from rich.live import Live
from rich.panel import Panel
from rich.table import Table
from rich.text import Text

from specsot_mq.messages import Answer, AnswerText, MergePlan, PointEnd, PointText, Reassign, SkeletonText
from specsot_mq.sot.flow import summary


class AnswerView:
    """Feed it a request's events (`view(event)`); it draws them."""

    def __init__(self, out: Console, err: Console):
        self.out, self.err = out, err
        self.skeleton = ""
        self.mode = None  # the plan's, once it came
        self.points: dict[int, list] = {}  # index -> [text, done]
        self.streamed = False  # answer text went to stdout (piped)
        self.live = Live(console=out, refresh_per_second=8, transient=True) if out.is_terminal else None

    def __call__(self, event) -> None:
        if isinstance(event, SkeletonText):
            self.skeleton += event.text
            if not self.live:
                self.err.out(event.text, end="", highlight=False)
        elif isinstance(event, MergePlan):
            self.mode = event.mode
            if self.skeleton and not self.live:  # the streamed skeleton's line ends first
                self.err.print()
        elif isinstance(event, (PointText, PointEnd)) and self.mode == "sot":
            point = self.points.setdefault(event.index, ["", False])
            if isinstance(event, PointText):
                point[0] += event.text
            else:  # (piped, the answer streaming on stdout is the progress: no lines in between)
                point[1] = True
        elif isinstance(event, Reassign):  # their stage died: these points start again elsewhere
            for index in event.indices:
                self.points[index] = ["", False]
        elif isinstance(event, AnswerText) and self.live is None:
            self.streamed = True
            sys.stdout.write(event.text)
            sys.stdout.flush()
        elif isinstance(event, Answer):
            self._finish(event)
            return
        if self.live is not None:
            if not self.live.is_started:
                self.live.start()
            self.live.update(self._render())

    def _render(self):
        parts = [Panel(Text(self.skeleton.strip()), title="skeleton", border_style="cyan")]
        if self.points:
            table = Table(show_header=True, expand=True, box=None)
            table.add_column("#", width=3)
            table.add_column("point", ratio=1)
            for index in sorted(self.points):
                text, done = self.points[index]
                table.add_row(f"{index}{'✓' if done else '…'}", text.strip()[-400:])
            parts.append(table)
        return Group(*parts)

    def close(self) -> None:
        """Stop drawing (an answer that ended, or was stopped)."""
        if self.live is not None and self.live.is_started:
            self.live.stop()

    def _finish(self, answer: Answer) -> None:
        self.close()
        if self.streamed:
            sys.stdout.write("\n")
        else:
            self.out.print(answer.answer, highlight=False, markup=False)
        self.err.print(f"[dim]{summary(answer)} · {answer.reason}[/]")
