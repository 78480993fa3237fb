"""`specsot launch`, `specsot chat` and `specsot run`: the stage topology and its two clients."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import signal
import sys
import uuid
from contextlib import contextmanager
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.live import Live
from rich.table import Table

from specsot_mq.cli.options import AnswerOptions, LaunchFlags, ModelOptions, TopologyOptions, err, with_options
from specsot_mq.errors import SpecSotError
from specsot_mq.prompts import with_system


def _run_file(name: str) -> Path:
    from specsot_mq.stages.launch import runs_folder

    return Path(name) if name.endswith(".json") else runs_folder() / f"{name}.json"


def _launch_options(topo: TopologyOptions, model: ModelOptions, launch: LaunchFlags | None = None):
    """The LaunchOptions of these flags (the tree checked now); `launch`: launch's own flags."""
    from specsot_mq.stages.launch import LaunchOptions

    return LaunchOptions(devices=topo.devices, topology=topo.topology, split=topo.split, replicas=topo.replicas, prefill_chunk=topo.prefill_chunk, model=model.model, dtype=model.dtype, quantize=model.quantize,
                         draft=model.draft, tree=model.tree(), **(launch.options() if launch else {}))  # fmt: skip


def _table(status, launcher) -> Table:
    table = Table(title=f"SpecSoT-MQ · {launcher.spec.topology} · clients at {launcher.spec.client_address}")
    for col in ("stage", "host", "device", "pid", "state", "in flight", "tok/s", "memory MB"):
        table.add_column(col, justify="right" if col in ("pid", "in flight", "tok/s", "memory MB") else "left")
    rows = {s["stage"]: s for s in (status.stages if status else [])}
    for name, proc in launcher.stages.items():
        s = rows.get(name, {})
        alive = proc.proc is not None and proc.proc.poll() is None
        state = (s.get("state", "ready") if s.get("up") else "starting" if not s.get("ever_up") else "down") if alive else "dead"
        if name in launcher.spec.ranges and alive:  # a range server (--split layers) sends no heartbeat
            state = "layers {}:{}".format(*launcher.spec.ranges[name]["layers"])
        color = {"busy": "green", "idle": "cyan", "ready": "cyan", "starting": "yellow"}.get(state, "cyan" if state.startswith("layers") else "red")
        table.add_row(name, launcher.spec.hosts[name], launcher.spec.devices.get(name) or launcher.spec.ranges.get(name, {}).get("device", "-"),
                      str(proc.proc.pid if proc.proc else "-"), f"[{color}]{state}[/]", str(s.get("inflight", 0)),
                      f"{s.get('tokens_per_s', 0.0):.1f}", f"{s.get('rss_mb', 0.0):.0f}")  # fmt: skip
    return table


def _say_dim(line: str) -> None:
    """A progress line (wait_ready's: which stages it still waits for), dimmed on stderr."""
    err.print(f"[dim]{line}[/]")


@contextmanager
def _sigterm_as_interrupt():
    def handler(signum, frame):
        raise KeyboardInterrupt

    old = signal.signal(signal.SIGTERM, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, old)


@with_options
def launch(topo: TopologyOptions, model: ModelOptions, flags: LaunchFlags):
    """Start every stage process, show them live, and stop them all on Ctrl-C or SIGTERM."""
    from specsot_mq.client import Client
    from specsot_mq.stages.launch import read_run_file, start_topology, wait_ready

    run_file = _run_file(topo.run)
    if (info := read_run_file(run_file)) is not None:  # its clients would lose it to this one's run file
        raise SpecSotError(f"a launch named {topo.run!r} is already running (launcher pid {info['launcher_pid']}, "
                           f"run file {run_file}): stop it first, or name this one with --run")  # fmt: skip
    with _sigterm_as_interrupt():
        launcher, spec = start_topology(_launch_options(topo, model, flags))
        tty = sys.stdout.isatty()
        try:
            asyncio.run(wait_ready(launcher, say=_say_dim))
            launcher.write_run_file(run_file)
            ranges = "".join(f", layers {a}:{b} on {r['device']}" for r in spec.ranges.values() for a, b in [r["layers"]])
            print(f"ready: {len(spec.kinds)} stages{ranges}, {topo.topology}; clients attach with --run {topo.run} "
                  f"(run file {run_file})", flush=True)  # fmt: skip

            async def watch(live):
                async with Client(spec.client_address, keys=launcher.keys) as client:
                    while True:
                        for report in launcher.check():
                            if live:
                                live.console.print(f"[red]{report}[/]")
                            else:
                                print(report, flush=True)
                            launcher.write_run_file(run_file)
                        try:
                            status = await client.status(timeout=1.0)
                        except SpecSotError:
                            status = None
                        if live:
                            live.update(_table(status, launcher))
                        await asyncio.sleep(0.5)

            if tty:
                with Live(_table(None, launcher), refresh_per_second=4) as live:
                    asyncio.run(watch(live))
            else:
                asyncio.run(watch(None))
        except KeyboardInterrupt:
            err.print("stopping every stage…")
        finally:
            launcher.stop()
            run_file.unlink(missing_ok=True)


@contextmanager
def _topology(run: str, options):
    """(client address, CURVE keys or None) of the run named `run` if one is live, else of a local
    one started now with these LaunchOptions (and stopped on exit)."""
    from specsot_mq.stages.launch import read_run_file, start_topology, wait_ready

    info = read_run_file(_run_file(run))
    if info is not None:
        yield info["client_address"], info.get("keys")
        return
    err.print("[dim]no running launch found: starting a local one (specsot launch starts one to share)…[/]")
    launcher, spec = start_topology(options)
    try:
        with _sigterm_as_interrupt():
            asyncio.run(wait_ready(launcher, say=_say_dim))
            yield spec.client_address, launcher.keys
    finally:
        launcher.stop()


class BadLine(SpecSotError):
    """A batch line that cannot be answered; `rid` is the id its output line gets (its own where
    it gave one)."""

    def __init__(self, message: str, rid: str):
        super().__init__(message)
        self.rid = rid


def parse_batch_line(line: str, number: int) -> tuple[str, str | list[str], list[dict]]:
    """(id, question, earlier turns) from one input line: a plain question, JSONL {"id", "question"},
    the OpenAI batch format {"custom_id", "body": {"messages"}}, whose messages before the last are
    the conversation so far (read as the server reads them), or MT-bench's {"question_id", "turns"}:
    its list of questions, each asked after the answers to those before it. BadLine says what is
    wrong."""
    text = line.strip()
    rid = f"line-{number}"
    if not text.startswith("{"):
        return rid, text, []
    try:
        row = json.loads(text)
    except json.JSONDecodeError as exc:
        raise BadLine(f"line {number} is not valid JSON ({exc.msg} at column {exc.colno})", rid) from None
    if not isinstance(row, dict):
        raise BadLine(f"line {number} must be a JSON object", rid)
    rid = str(row.get("id", row.get("custom_id", row.get("question_id", rid))))
    if "turns" in row:
        turns = row["turns"]
        if not isinstance(turns, list) or not turns or not all(isinstance(t, str) and t.strip() for t in turns):
            raise BadLine(f"line {number}: turns must be a non-empty list of non-empty strings (the questions)", rid)
        return rid, turns, []
    if "question" in row:
        question = row["question"]
        if not isinstance(question, str) or not question.strip():
            raise BadLine(f"line {number}: the question must be a non-empty string", rid)
        return rid, question, []
    if isinstance(row.get("body"), dict) and "messages" in row["body"]:
        from specsot_mq.server.api import ApiError, messages

        try:
            return rid, *messages(row["body"]["messages"])
        except ApiError as exc:
            raise BadLine(f"line {number}: {exc.message}", rid) from None
    raise BadLine(f'line {number} has none of "question", "turns" or "body": {{"messages": [...]}}', rid)


@with_options
def run_batch(
    topo: TopologyOptions,
    model: ModelOptions,
    answers: AnswerOptions,
    input: Annotated[str, typer.Option("-i", "--input", help="Questions file, '-' for stdin.")] = "-",
    output: Annotated[str, typer.Option("-o", "--output", help="Answers file (JSONL), '-' for stdout.")] = "-",
    concurrency: Annotated[int, typer.Option(help="Requests in flight at once.")] = 4,
    timeout: Annotated[float, typer.Option(help="Seconds a request may stay silent.")] = 600.0,
):
    """Answer questions in batch: one line in, one JSON line out, in input order.

    A line is a plain question, JSONL {"id", "question"}, or an MT-bench line (then its answer to each of its turns).
    """
    from specsot_mq.client import Client
    from specsot_mq.messages import Failed

    if concurrency < 1:
        raise SpecSotError(f"--concurrency must be at least 1, got {concurrency}")
    params, sot = answers.params(), answers.sot
    options = _launch_options(topo, model)
    try:
        text = sys.stdin.read() if input == "-" else Path(input).read_text(encoding="utf-8")
    except OSError as e:
        raise SpecSotError(f"cannot read --input {input}: {e.strerror}: give a questions file, or '-' for stdin") from None
    except UnicodeDecodeError:
        raise SpecSotError(f"--input {input} is not UTF-8 text: give a file of questions, one a line") from None
    lines = [(n, line) for n, line in enumerate(text.splitlines(), 1) if line.strip()]
    try:  # before any work: a path that cannot be written fails now, not after the answers
        dst = sys.stdout if output == "-" else open(output, "w", encoding="utf-8")
    except OSError as e:
        raise SpecSotError(f"cannot write --output {output}: {e.strerror}: give a file in a folder that exists, "
                           "or '-' for stdout") from None  # fmt: skip

    async def answer_all(address: str, keys: dict | None) -> int:
        gate = asyncio.Semaphore(concurrency)
        failures = 0

        async def one(client, number, line):
            nonlocal failures
            try:
                rid, asked, history = parse_batch_line(line, number)
            except BadLine as exc:
                failures += 1
                return {"id": exc.rid, "line": number, "error": str(exc)}
            many, turns = not isinstance(asked, str), []  # an MT-bench line: each turn asked after those before it
            history = with_system(history, answers.system)
            for question in asked if many else [asked]:
                async with gate:
                    msg = await client.answer(question, params, sot, timeout=timeout, history=history)
                if isinstance(msg, Failed):
                    failures += 1
                    return {"id": rid, "line": number, "error": msg.error} | ({"turns": turns} if many else {})
                turns.append({"answer": msg.answer, "mode": msg.mode, "reason": msg.reason, "skeleton": msg.skeleton,
                              "points": [{"index": i, "title": t, "text": x} for i, t, x in msg.points], "stats": msg.stats})  # fmt: skip
                history = [*history, {"role": "user", "content": question}, {"role": "assistant", "content": msg.answer}]
            return {"id": rid, "line": number} | ({"turns": turns} if many else turns[0])

        async with Client(address, keys=keys) as client:
            tasks = [asyncio.create_task(one(client, n, line)) for n, line in lines]
            for task in tasks:  # in input order, each written as soon as it and those before it are done
                dst.write(json.dumps(await task, ensure_ascii=False) + "\n")
                dst.flush()
        return failures

    with _topology(topo.run, options) as (address, keys):
        failures = asyncio.run(answer_all(address, keys))
    if failures:
        err.print(f"[yellow]{failures} of {len(lines)} lines failed (see their \"error\")[/]")


CHAT_HELP = """/? help · /bye or /exit quit · /clear forget the conversation · /set mode auto|always|never ·
/set temperature T · /set top_k K · /set top_p P · /set min_p P · /set seed N|none · /set max_tokens N ·
/set repeat_stop N (0 = off) · /set system TEXT (alone: none) ·
\"\"\" begins and ends a question of several lines · Ctrl+C stops an answer · Ctrl+D quits"""


def _read(console: Console) -> str:
    """A question or command from the terminal: one line, or (a pasted text) the lines from one
    that begins with \"\"\" to one that ends with it, without the quotes. EOFError at the end."""
    line = console.input("[bold]>>> [/]")
    if not line.lstrip().startswith('"""'):
        return line.strip()
    lines, rest = [], line.lstrip()[3:]
    while not rest.rstrip().endswith('"""'):
        lines.append(rest)
        rest = console.input("[dim]... [/]")
    lines.append(rest.rstrip()[:-3])
    return "\n".join(lines).strip()


@with_options
def chat(topo: TopologyOptions, model: ModelOptions, answers: AnswerOptions):
    """Chat in the terminal: the skeleton streams, then one live row per point, then the answer."""
    console = Console(highlight=False)
    conversation = Conversation(system=answers.system)
    options = _launch_options(topo, model)
    with _topology(topo.run, options) as (address, keys):
        console.print(f"[dim]connected to {address} · {CHAT_HELP}[/]")
        while True:
            try:
                line = _read(console)
            except EOFError:
                break
            except KeyboardInterrupt:
                console.print()
                continue
            if not line:
                continue
            if line.startswith("/"):
                if line in ("/bye", "/exit"):
                    break
                answers = _slash(line, answers, conversation, console)
                continue
            rid = uuid.uuid4().hex[:12]
            stopped, answer = asyncio.run(_stoppable(_chat_turn((address, keys), line, conversation.messages(), answers.params(),
                                                                answers.sot, rid, console)))  # fmt: skip
            if stopped:
                asyncio.run(_cancel((address, keys), rid))
                console.print("[yellow]stopped[/]")
                continue
            if answer is not None:
                conversation.turns.append((line, answer))


# What /set changes: its name -> (the AnswerOptions field, how its value is read)
def _seed(value: str) -> int | None:
    return None if value.lower() == "none" else int(value)


SETTABLE = {"mode": ("sot", str), "temperature": ("temperature", float), "top_k": ("top_k", int),
            "top_p": ("top_p", float), "min_p": ("min_p", float), "seed": ("seed", _seed),
            "max_tokens": ("max_tokens", int), "repeat_stop": ("repeat_stop", int)}  # fmt: skip


@dataclasses.dataclass
class Conversation:
    """What chat sends with each question: a system message (/set system) and the turns so far."""

    system: str | None = None
    turns: list[tuple[str, str]] = dataclasses.field(default_factory=list)

    def messages(self, keep: int = 3) -> list[dict]:
        """The system message and the last `keep` turns as chat messages: every phase's prompt
        shows them before its own request (prompts/__init__.py)."""
        turns = [{"role": role, "content": text} for q, a in self.turns[-keep:] for role, text in (("user", q), ("assistant", a))]
        return with_system(turns, self.system)


def _without_oldest_turn(history: list[dict]) -> list[dict] | None:
    """`history` without its oldest question and answer, its system message kept; None where no
    turn is left to leave out."""
    head = history[:1] if history and history[0]["role"] == "system" else []
    turns = history[len(head) :]
    return head + turns[2:] if turns else None


def _slash(line: str, answers: AnswerOptions, conversation: Conversation, console: Console) -> AnswerOptions:
    """A chat command; returns the settings it leaves (AnswerOptions checks a /set value)."""
    parts = line.split()
    if parts[0] in ("/?", "/help"):
        console.print(CHAT_HELP)
    elif parts[0] == "/clear":
        conversation.turns.clear()
        console.print(f"[dim]conversation cleared{' (the system message stays)' if conversation.system else ''}[/]")
    elif parts[:2] == ["/set", "system"]:
        conversation.system = line.split(None, 2)[2].strip() if len(parts) > 2 else None
        console.print(f"[dim]system = {conversation.system!r}[/]" if conversation.system else "[dim]no system message[/]")
    elif parts[0] == "/set" and len(parts) == 3 and parts[1] in SETTABLE:
        key, value = parts[1], parts[2]
        name, read = SETTABLE[key]
        try:
            answers = dataclasses.replace(answers, **{name: read(value)})
        except (ValueError, SpecSotError):
            console.print(f"[red]/set {key} does not take {value!r}[/]")
            return answers
        console.print(f"[dim]{key} = {getattr(answers, name)}[/]")
    else:
        console.print(f"[red]unknown command {line!r}[/]: {CHAT_HELP}")
    return answers


async def _stoppable(turn) -> tuple[bool, object]:
    """(stopped, result) of a chat turn that Ctrl+C stops: SIGINT cancels it from inside the event
    loop (loop.add_signal_handler), and the cancel is caught here, so no KeyboardInterrupt lands at
    an arbitrary line and a cancel that meets another (a timeout expiring at that moment) still
    reads as stopped."""
    loop, task = asyncio.get_running_loop(), asyncio.current_task()
    loop.add_signal_handler(signal.SIGINT, task.cancel)
    try:
        return False, await turn
    except asyncio.CancelledError:
        return True, None
    finally:
        loop.remove_signal_handler(signal.SIGINT)


async def _cancel(gateway: tuple, rid: str) -> None:
    from specsot_mq.client import Client

    async with Client(gateway[0], keys=gateway[1]) as client:
        await client.cancel(rid)
        await asyncio.sleep(0.1)


async def _chat_turn(gateway: tuple, question, history, params, mode, rid, console: Console) -> str | None:
    """One answer in chat, drawn as `ask` draws it; gateway: (client address, CURVE keys or None).
    A conversation too long for the stages' cache is asked again without its oldest turn, until
    it fits (or the question alone does not)."""
    from specsot_mq.cli.display import AnswerView
    from specsot_mq.client import Client
    from specsot_mq.messages import Answer, Failed

    async with Client(gateway[0], keys=gateway[1]) as client:
        while True:
            view, failed = AnswerView(console, console), None
            try:
                # (read to its end, the Failed last: a generator left open would later drop the
                # queue of the next try, which has the same request id)
                async for msg in client.ask(question, params, mode, rid=rid, timeout=600, history=history):
                    if isinstance(msg, Failed):
                        failed = msg
                        continue
                    view(msg)
                    if isinstance(msg, Answer):
                        return msg.answer
            finally:
                view.close()
            if failed is None:
                return None
            shorter = _without_oldest_turn(history) if failed.code == "too_long" else None
            if shorter is None:
                console.print(f"[red]error:[/] {failed.error}")
                return None
            history = shorter
            console.print("[dim]too long for the stages' cache: asking again without the oldest turn[/]")
