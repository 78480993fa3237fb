"""`specsot serve` under load: streamed requests through the HTTP API at N concurrent clients with
random client disconnects, side by side with the same questions sent straight to the gateway,
then a conversation benchmark: time to the first answer text of turns 1-3 with the prefix store
and without it.

    python benchmarks/serve.py --requests 200 --concurrency 8 --max-tokens 64

Requests alternate between the two paths (HTTP stream, gateway client), so both run under the
same load; a disconnected request closes its HTTP stream after its first answer text. Reports
answers per minute, p50/p95 latency and TTFT per path, how requests ended ([DONE], disconnected,
failed), the RSS of each stage and of the HTTP server before and after (taken idle) with their total
(what `specsot serve` with a local launch holds), and the cache slots in use once idle (they must
return to 0). Last line: one JSON object, with `http_vs_gateway_p50` (HTTP's median
latency over the gateway client's) and the turns' TTFT ratios.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

sys.path.insert(0, str(Path(__file__).parent))
from decode import cpu_name, load_prompts  # noqa: E402  (a sibling script)

from specsot_mq.client import Client  # noqa: E402
from specsot_mq.messages import AnswerText, Answer  # noqa: E402
from specsot_mq.sampling_params import REPEAT_STOP, SamplingParams  # noqa: E402
from specsot_mq.stages.launch import LaunchOptions, model_id, start_topology, wait_ready  # noqa: E402

CONVERSATIONS = [
    ("Tell me about the city of Rome.", "Which of those places should I see first?", "How many days do I need?"),
    ("How do I bake bread at home?", "How long does the dough rise?", "What if it does not rise?"),
    ("What are the benefits of learning Python?", "What about Java?", "Which should a beginner pick?"),
    ("How can I sleep better?", "Is coffee in the afternoon a problem?", "What about naps?"),
    ("Give me tips for a job interview.", "What should I wear?", "How do I answer salary questions?"),
    ("How do solar panels work?", "Are they worth it in a cloudy country?", "How long do they last?"),
]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_up(base: str, process: subprocess.Popen, seconds: float) -> bool:
    """Whether the server at `base` answers /health within `seconds` (False at once if its process ends)."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline and process.poll() is None:
        try:
            if httpx.get(f"{base}/health", timeout=2).status_code == 200:
                return True
        except httpx.HTTPError:
            pass
        time.sleep(0.3)
    return False


class Served:
    """A local topology and `specsot serve` attached to it (a process of its own)."""

    def __init__(self, args, prefix_cache_mb: int):
        options = LaunchOptions(devices=args.devices, topology=args.topology, model=args.model, draft=args.draft,
                                point_tokens=args.max_tokens, skeleton_tokens=args.max_tokens,
                                prefix_cache_mb=prefix_cache_mb)  # fmt: skip
        self.launcher, self.spec = start_topology(options)
        asyncio.run(wait_ready(self.launcher))
        self.run_file = Path(tempfile.mkdtemp(prefix="specsot-bench-")) / "run.json"
        self.launcher.write_run_file(self.run_file)
        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        self.model = model_id(args.model)
        self.server = subprocess.Popen([sys.executable, "-c", "from specsot_mq.cli.app import main; main()", "serve",
                                        "--run", str(self.run_file), "--port", str(self.port), "--max-concurrency",
                                        str(args.concurrency), "--max-tokens", str(args.max_tokens)],
                                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # fmt: skip
        if not wait_up(self.base, self.server, 60):
            self.close()
            raise SystemExit("the server did not come up within 60 s")

    def stages(self) -> dict[str, dict]:
        async def go():
            async with Client(self.spec.client_address) as client:
                return await client.status()

        return {s["stage"]: s for s in asyncio.run(go()).stages}

    def idle_stages(self, timeout: float = 60) -> dict[str, dict]:
        """Every stage once nothing is in flight (RSS read after its memory is handed back)."""
        deadline = time.monotonic() + timeout
        while True:
            stages = self.stages()
            if not any(s.get("inflight") or s.get("slots_used") for s in stages.values()) or time.monotonic() > deadline:
                time.sleep(1.5)  # a beat or two more: the stage trims its heap when it goes idle
                return self.stages()
            time.sleep(0.5)

    def server_rss_mb(self) -> float:
        """Resident memory of the server process now."""
        import os

        return int(Path(f"/proc/{self.server.pid}/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20

    def cpu_seconds(self) -> float:
        """CPU time the server process has used (user + system)."""
        import os

        fields = Path(f"/proc/{self.server.pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    def close(self) -> None:
        self.server.terminate()
        self.server.wait(10)
        self.launcher.stop()


async def http_stream(http: httpx.AsyncClient, base: str, model: str, messages: list, disconnect: bool) -> dict:
    """One streamed chat request: its outcome, latency and time to first answer text."""
    start = time.monotonic()
    ttft, text = None, ""
    body = {"model": model, "messages": messages, "stream": True}
    try:
        async with http.stream("POST", f"{base}/v1/chat/completions", json=body) as r:
            if r.status_code != 200:
                return {"path": "http", "outcome": "failed", "why": f"HTTP {r.status_code}"}
            async for line in r.aiter_lines():
                if not line.startswith("data: "):
                    continue
                if line == "data: [DONE]":
                    return {"path": "http", "outcome": "done", "seconds": time.monotonic() - start, "ttft": ttft, "text": text}
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    return {"path": "http", "outcome": "failed", "why": chunk["error"]["message"]}
                piece = chunk["choices"][0]["delta"].get("content") if chunk["choices"] else None
                if piece:
                    ttft = ttft or time.monotonic() - start
                    text += piece
                    if disconnect:
                        return {"path": "http", "outcome": "disconnected"}
    except httpx.HTTPError as exc:
        return {"path": "http", "outcome": "failed", "why": type(exc).__name__}
    return {"path": "http", "outcome": "failed", "why": "stream ended without [DONE]"}


async def gateway(client: Client, question: str, params: SamplingParams) -> dict:
    start = time.monotonic()
    ttft = None
    async for msg in client.ask(question, params, "auto", timeout=600):
        if isinstance(msg, AnswerText) and ttft is None:
            ttft = time.monotonic() - start
        last = msg
    if not isinstance(last, Answer):
        return {"path": "gateway", "outcome": "failed", "why": last.error}
    return {"path": "gateway", "outcome": "done", "seconds": time.monotonic() - start, "ttft": ttft, "text": last.answer}


def load(served: Served, questions: list[str], args, progress) -> tuple[list[dict], float]:
    rng = random.Random(args.seed)
    params = SamplingParams(max_tokens=args.max_tokens, repeat_stop=REPEAT_STOP)
    plan = [(i, questions[(i // 2) % len(questions)], rng.random() < args.disconnect) for i in range(args.requests)]
    task = progress.add_task("requests", total=len(plan))

    async def go():
        gate = asyncio.Semaphore(args.concurrency)
        async with Client(served.spec.client_address) as client, httpx.AsyncClient(timeout=600) as http:

            async def one(i, question, cut):
                async with gate:
                    if i % 2 == 0:
                        row = await http_stream(http, served.base, served.model, [{"role": "user", "content": question}], cut)
                    else:
                        row = await gateway(client, question, params)
                progress.advance(task)
                return row | {"question": question}

            start = time.monotonic()
            rows = await asyncio.gather(*(one(*p) for p in plan))
            return rows, time.monotonic() - start

    return asyncio.run(go())


def turns(served: Served, progress) -> list[list[float]]:
    """TTFT of each turn of each conversation, one conversation at a time."""
    task = progress.add_task("conversations", total=len(CONVERSATIONS))

    async def go():
        out = []
        async with httpx.AsyncClient(timeout=600) as http:
            for conversation in CONVERSATIONS:
                messages, ttfts = [], []
                for question in conversation:
                    messages.append({"role": "user", "content": question})
                    row = await http_stream(http, served.base, served.model, messages, False)
                    if row["outcome"] != "done":
                        raise SystemExit(f"a conversation turn failed: {row}")
                    ttfts.append(row["ttft"] or row["seconds"])
                    messages.append({"role": "assistant", "content": row["text"]})
                out.append(ttfts)
                progress.advance(task)
        return out

    return asyncio.run(go())


def pct(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))] if values else float("nan")


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None)
    p.add_argument("--draft", default="auto")
    p.add_argument("--devices", default="127.0.0.1#cpu")
    p.add_argument("--topology", default="p2p")
    p.add_argument("--questions", type=Path, default=None)
    p.add_argument("--limit", type=int, default=40, help="distinct questions (cycled over the requests)")
    p.add_argument("--requests", type=int, default=200)
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=64, help="cap on every phase (skeleton, each point, direct)")
    p.add_argument("--disconnect", type=float, default=0.1, help="share of HTTP requests that hang up mid-answer")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--skip-turns", action="store_true", help="no conversation benchmark")
    args = p.parse_args(argv)
    console = Console(stderr=True)
    questions, source = load_prompts(args.questions, args.limit)
    progress = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                        console=console)  # fmt: skip
    result = {"cpu": cpu_name(), "requests": args.requests, "concurrency": args.concurrency, "max_tokens": args.max_tokens,
              "questions": source}  # fmt: skip
    served = Served(args, prefix_cache_mb=256)
    try:
        with progress:
            load(served, questions[:4], argparse.Namespace(**{**vars(args), "requests": 8, "disconnect": 0.0}), progress)
            before = served.idle_stages() | {"serve": {"rss_mb": served.server_rss_mb()}}
            cpu = served.cpu_seconds()
            rows, seconds = load(served, questions, args, progress)
            result["server_cpu_s_per_http_request"] = (served.cpu_seconds() - cpu) / max(1, (args.requests + 1) // 2)
            after = served.idle_stages() | {"serve": {"rss_mb": served.server_rss_mb()}}
            ttft_on = None if args.skip_turns else turns(served, progress)
            talked = served.stages()
    finally:
        served.close()
    ttft_off = None
    if not args.skip_turns:
        served = Served(args, prefix_cache_mb=0)
        try:
            with progress:
                ttft_off = turns(served, progress)
        finally:
            served.close()

    table = Table(title=f"specsot serve · {args.requests} requests · {args.concurrency} clients · {cpu_name()}")
    for col in ("path", "done", "disconnected", "failed", "p50 s", "p95 s", "p50 TTFT s", "p95 TTFT s"):
        table.add_column(col, justify="left" if col == "path" else "right")
    for path in ("http", "gateway"):
        mine = [r for r in rows if r["path"] == path]
        done = [r for r in mine if r["outcome"] == "done"]
        lat, ttft = [r["seconds"] for r in done], [r["ttft"] for r in done if r["ttft"] is not None]
        counts = {k: sum(r["outcome"] == k for r in mine) for k in ("done", "disconnected", "failed")}
        result[path] = counts | {"p50": statistics.median(lat) if lat else None, "p95": pct(lat, 0.95),
                                 "ttft_p50": statistics.median(ttft) if ttft else None, "ttft_p95": pct(ttft, 0.95)}  # fmt: skip
        table.add_row(path, *(str(counts[k]) for k in ("done", "disconnected", "failed")),
                      *(f"{result[path][k]:.2f}" for k in ("p50", "p95", "ttft_p50", "ttft_p95")))  # fmt: skip
    console.print(table)
    failures = [r["why"] for r in rows if r["outcome"] == "failed"]
    if failures:
        console.print(f"[red]failures:[/] {sorted(set(failures))[:5]}")
    result["answers_per_minute"] = sum(r["outcome"] == "done" for r in rows) / seconds * 60
    result["http_vs_gateway_p50"] = result["http"]["p50"] / result["gateway"]["p50"]
    # The same question both ways (requests 2k and 2k+1): the median of their latency ratios.
    by_pair: dict[int, dict] = {}
    for i, r in enumerate(rows):
        if r["outcome"] == "done":
            by_pair.setdefault(i // 2, {})[r["path"]] = r["seconds"]
    ratios = [p["http"] / p["gateway"] for p in by_pair.values() if len(p) == 2]
    result["http_vs_gateway_paired"] = statistics.median(ratios) if ratios else None
    result["rss_mb"] = {name: [round(before[name].get("rss_mb", 0)), round(after[name].get("rss_mb", 0))] for name in before}
    # The prefix store grows up to its budget by design (each direct answer's prompt is kept for a next turn).
    result["prefix_store_mb"] = {name: [round(before[name].get("prefix_bytes", 0) / 2**20),
                                        round(after[name].get("prefix_bytes", 0) / 2**20)] for name in before}  # fmt: skip
    result["slots_used_after"] = sum(s.get("slots_used", 0) for s in after.values())
    result["inflight_after"] = sum(s.get("inflight", 0) for s in after.values())
    mem = Table(title="stage memory (idle), MB")
    for col in ("stage", "RSS before", "RSS after", "prefix store before", "prefix store after", "growth besides the store"):
        mem.add_column(col, justify="left" if col == "stage" else "right")
    for name, (a, b) in result["rss_mb"].items():
        sa, sb = result["prefix_store_mb"][name]
        mem.add_row(name, str(a), str(b), str(sa), str(sb), str((b - a) - (sb - sa)))
    result["total_rss_mb"] = [sum(v[i] for v in result["rss_mb"].values()) for i in (0, 1)]
    mem.add_row("total", *map(str, result["total_rss_mb"]), "", "", "")
    console.print(mem)
    console.print(f"answers per minute {result['answers_per_minute']:.1f} · HTTP/gateway median latency "
                  f"{result['http_vs_gateway_p50']:.3f} (paired by question: {result['http_vs_gateway_paired']:.3f}) · "
                  f"server CPU {result['server_cpu_s_per_http_request'] * 1000:.0f} ms per HTTP request · slots in use "
                  f"after {result['slots_used_after']} · requests held after {result['inflight_after']}")  # fmt: skip
    if ttft_on is not None:
        turn_table = Table(title="conversations: median time to first answer text per turn, s")
        for col in ("turn", "prefix store", "none", "none / store"):
            turn_table.add_column(col, justify="right")
        for t in range(3):
            on, off = statistics.median(c[t] for c in ttft_on), statistics.median(c[t] for c in ttft_off)
            result[f"turn{t + 1}_ttft"] = {"store": on, "none": off, "none_vs_store": off / on}
            turn_table.add_row(str(t + 1), f"{on:.2f}", f"{off:.2f}", f"{off / on:.2f}x")
        console.print(turn_table)
        # The conversations' own lookups (the load's subtracted): hits and the prompt tokens they skipped.
        keys = ("prefix_lookups", "prefix_hits", "prefix_tokens")
        result["prefix_store"] = {n: {k: s.get(k, 0) - after[n].get(k, 0) for k in keys}
                                  for n, s in talked.items() if s.get("slots")}  # fmt: skip
        for n, s in result["prefix_store"].items():
            console.print(f"{n}: {s['prefix_hits']} of {s['prefix_lookups']} prompts started from the store, "
                          f"{s['prefix_tokens']} prompt tokens not computed")  # fmt: skip
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
