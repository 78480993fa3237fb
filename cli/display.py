"""Terminal views of a streamed answer: a live skeleton and one row per point on a terminal,
plain text when stdout is a pipe (progress to stderr, the answer alone on stdout)."""

from __future__ import annotations

import sys

from rich.console import Console, Group
from rich.live import Live
from rich.panel import Panel
from rich.table import Table
from rich.text import Text

from specsot_mq.sot.engine import AnswerDelta, Final, PointDelta, PointDone, SkeletonDelta


class AnswerView:
    """Feed it the engine's events (`view(event)`); it draws them."""

    def __init__(self, out: Console, err: Console):
        self.out, self.err = out, err
        self.skeleton = ""
        self.points: dict[int, list] = {}  # index -> [text, done]
        self.direct = False
        self.live = Live(console=out, refresh_per_second=8, transient=True) if out.is_terminal else None

    def __call__(self, event) -> None:
        if isinstance(event, SkeletonDelta):
            self.skeleton += event.text
            if not self.live:
                self.err.out(event.text, end="", highlight=False)
        elif isinstance(event, PointDelta):
            self._end_skeleton_line()
            self.points.setdefault(event.index, ["", False])[0] += event.text
        elif isinstance(event, PointDone):
            self._end_skeleton_line()
            self.points.setdefault(event.index, ["", False])[1] = True
            if not self.live:
                self.err.print(f"[dim]point {event.index} done ({len(event.token_ids)} tokens)[/]")
        elif isinstance(event, AnswerDelta):
            if self.skeleton and not self.direct:  # a skeleton that went direct: its line ends first
                self._end_skeleton_line()
            self.direct = True
            if self.live is None:
                sys.stdout.write(event.text)
                sys.stdout.flush()
        elif isinstance(event, Final):
            self._finish(event)
            return
        if self.live is not None:
            if not self.live.is_started:
                self.live.start()
            self.live.update(self._render())

    def _end_skeleton_line(self) -> None:
        """Piped output: the streamed skeleton ends with a line break before the point lines (or
        the direct answer it turned into)."""
        if not self.live and not self.points:
            self.err.print()

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

    def _finish(self, final: Final) -> None:
        if self.live is not None and self.live.is_started:
            self.live.stop()
        if final.mode == "sot" or self.live is not None:
            self.out.print(final.answer, highlight=False, markup=False)
        else:
            sys.stdout.write("\n")
        self.err.print(f"[dim]{final.summary()} · {final.reason}[/]")
