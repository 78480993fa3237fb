"""The peer under load: llama.cpp's own llama-server, with a slot per client (its continuous
batching), against `specsot serve` over a local launch, on the same GGUF file and the same
questions, at 1, 4 and 8 concurrent clients, one engine at a time on the same cores: at each client
count llama-server, then ours, each a fresh server. Fresh, because ours remembers what it wrote
lately (prompt lookup's History) and would copy its greedy answers to questions asked at the
client count before; in turns, because a shared VM's memory bandwidth moves for seconds at a time,
and an engine measured minutes after the other would draw the difference.

    benchmarks/setup_llamacpp.sh        # once
    python benchmarks/peer_serve.py [--model FILE.gguf] [--clients 1,4,8] [--limit 24] [--max-tokens 256]

Each client streams greedy answers over HTTP, one question after another, and times each from its
request to its last token. llama-server gets our chat prompt's token ids (/completion), so both
read the same prompt; ours gets the question (/v1/chat/completions) and answers it as it would
any client: routed, planned or direct. Both end an answer at the same loop rule (an output ends
once its last --repeat-stop tokens already ran earlier in it): ours by the request's
`repeat_stop`; llama-server's when the client, reading its streamed tokens, sees the loop and
hangs up (the server then frees the slot), so neither decodes a loop the other would not.
`--repeat-stop 0` turns it off for both, as a random-weight model wants (its greedy text is noise,
and where two engines' noise parts they stop at different places): every answer then runs to
--max-tokens unless the model ends it.

Prints, per engine and client count: answers per minute (answers over the wall time of the whole
set), median and p95 seconds to a complete answer, output tokens per second (every answer's
tokens over the wall time; ours counts every phase's: a planned answer's skeleton and points),
and ours over llama-server. Last line: one JSON object, `answers_per_min_vs_llamacpp_N` for each
client count N among its keys.
"""

from __future__ import annotations

import argparse
import asyncio
import json
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

sys.path.insert(0, str(Path(__file__).resolve().parent))
from decode import cpu_name, load_prompts, run_script  # noqa: E402  (sibling scripts)
from peer import LlamaServer, cpu_flags, gguf_file  # noqa: E402
from serve import free_port, pct, wait_up  # noqa: E402

from specsot_mq.pull import DEFAULT_MODEL, resolve_model, specsot_home  # noqa: E402
from specsot_mq.sampling_params import REPEAT_STOP  # noqa: E402
from specsot_mq.stopping import LoopWatch  # noqa: E402
from specsot_mq.tokenizer import chat_prompt_ids, load_tokenizer  # noqa: E402

WARMUP = "Say hello."  # one answer each before the timed ones: kernels, caches and the router ready


class Ours:
    """`specsot serve --model M` (a local launch of its own) on a free port."""

    name = "specsot"

    def __init__(self, args):
        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        self.log = tempfile.TemporaryFile()
        command = [sys.executable, "-c", "from specsot_mq.cli.app import main; main()", "serve", "--model", args.model,
                   "--port", str(self.port), "--max-concurrency", str(max(args.clients)), "--max-tokens",
                   str(args.max_tokens), "--point-tokens", str(args.max_tokens), "--skeleton-tokens",
                   str(args.max_tokens), "--repeat-stop", str(args.repeat_stop), "--max-len", str(args.max_len),
                   "--draft", args.draft]  # fmt: skip
        self.process = subprocess.Popen(command, stdout=self.log, stderr=subprocess.STDOUT)
        if not wait_up(self.base, self.process, 900):  # a new GGUF is converted first
            self.close()
            sys.exit(f"specsot serve did not come up: {self.log_text()[-1500:]}")
        self.model = httpx.get(f"{self.base}/v1/models", timeout=10).json()["data"][0]["id"]

    def log_text(self) -> str:
        self.log.seek(0)
        return self.log.read().decode(errors="replace")

    async def answer(self, http: httpx.AsyncClient, question: str, args) -> tuple[float, int]:
        """(seconds to its last token, output tokens) of one streamed answer."""
        body = {"model": self.model, "messages": [{"role": "user", "content": question}], "stream": True,
                "stream_options": {"include_usage": True}, "temperature": 0, "max_tokens": args.max_tokens,
                "repeat_stop": args.repeat_stop, "sot": args.sot}  # fmt: skip
        start, tokens = time.monotonic(), None
        async with http.stream("POST", f"{self.base}/v1/chat/completions", json=body) as r:
            if r.status_code != 200:
                sys.exit(f"specsot serve answered HTTP {r.status_code}: {(await r.aread()).decode()[:500]}")
            async for line in r.aiter_lines():
                if line == "data: [DONE]":
                    break
                if line.startswith("data: "):
                    chunk = json.loads(line[6:])
                    if "error" in chunk:
                        sys.exit(f"specsot serve failed a request: {chunk['error']['message']}")
                    if chunk.get("usage"):
                        tokens = chunk["usage"]["completion_tokens"]
        if tokens is None:
            sys.exit("specsot serve's stream ended without its usage")
        return time.monotonic() - start, tokens

    def close(self) -> None:
        self.process.terminate()
        try:
            self.process.wait(60)
        except subprocess.TimeoutExpired:
            self.process.kill()


class Theirs(LlamaServer):
    """llama-server with a slot per client, answering streamed /completion requests."""

    name = "llamacpp"

    def __init__(self, args, gguf: Path, tokenizer):
        super().__init__(args.llamacpp or specsot_home() / "llamacpp", gguf, args.threads, args.max_len * max(args.clients),
                         slots=max(args.clients))  # fmt: skip
        self.base = f"http://127.0.0.1:{self.port}"
        self.tokenizer = tokenizer

    async def answer(self, http: httpx.AsyncClient, question: str, args) -> tuple[float, int]:
        ids = chat_prompt_ids(self.tokenizer, question)
        body = {"prompt": ids, "n_predict": args.max_tokens, "temperature": 0.0, "top_k": 1, "stream": True,
                "return_tokens": True}  # fmt: skip
        watch = LoopWatch(args.repeat_stop) if args.repeat_stop else None
        start, n = time.monotonic(), 0
        async with http.stream("POST", f"{self.base}/completion", json=body) as r:
            if r.status_code != 200:
                sys.exit(f"llama-server answered HTTP {r.status_code}: {self.log_text()[-1500:]}")
            async for line in r.aiter_lines():
                if not line.startswith("data: "):
                    continue
                chunk = json.loads(line[6:])
                for token in chunk.get("tokens", []):
                    n += 1
                    if watch is not None and watch.add(token):
                        return time.monotonic() - start, n  # hanging up ends its decoding
                if chunk.get("stop"):
                    break
        return time.monotonic() - start, n


async def measure(engine, questions: list[str], clients: int, args, progress) -> dict:
    """`clients` clients taking the questions in turn; the set's wall time and each answer's."""
    queue = list(questions)
    rows: list[tuple[float, int]] = []
    task = progress.add_task(f"{engine.name}, {clients} client{'s' * (clients > 1)}", total=len(questions))
    limits = httpx.Limits(max_connections=clients + 1)
    async with httpx.AsyncClient(timeout=httpx.Timeout(1800), limits=limits) as http:
        await engine.answer(http, WARMUP, args)

        async def client():
            while queue:
                rows.append(await engine.answer(http, queue.pop(0), args))
                progress.advance(task)

        start = time.monotonic()
        await asyncio.gather(*(client() for _ in range(clients)))
        wall = time.monotonic() - start
    seconds = [s for s, _ in rows]
    tokens = sum(n for _, n in rows)
    return {"answers_per_min": round(60 * len(rows) / wall, 2), "p50_s": round(statistics.median(seconds), 3),
            "p95_s": round(pct(seconds, 0.95), 3), "tok_s": round(tokens / wall, 1), "tokens": tokens,
            "wall_s": round(wall, 2)}  # fmt: skip


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="a .gguf file (default: the default model's own GGUF)")
    p.add_argument("--questions", type=Path, default=Path(__file__).parent / "general_questions.jsonl")
    p.add_argument("--limit", type=int, default=24)
    p.add_argument("--clients", default="1,4,8")
    p.add_argument("--max-tokens", type=int, default=256, help="most tokens per answer (ours: per phase)")
    p.add_argument("--repeat-stop", type=int, default=REPEAT_STOP, help="the loop rule of both; 0 = off")
    p.add_argument("--sot", default="auto", choices=("auto", "always", "never"), help="our requests' sot")
    p.add_argument("--draft", default="auto", help="ours: auto (the shipped head where there is one) or none")
    p.add_argument("--max-len", type=int, default=2048, help="KV cache entries per sequence (ours) and per slot (theirs)")
    p.add_argument("--threads", type=int, default=2, help="llama-server's threads (ours: the launch's share)")
    p.add_argument("--engines", default="llamacpp,specsot")
    p.add_argument("--llamacpp", type=Path, default=None,
                   help="the folder benchmarks/setup_llamacpp.sh built (default $SPECSOT_HOME/llamacpp)")
    args = p.parse_args(argv)
    args.clients = [int(c) for c in args.clients.split(",")]
    gguf = Path(args.model) if args.model else gguf_file(DEFAULT_MODEL)
    args.model = args.model or DEFAULT_MODEL
    out = Console(soft_wrap=True)
    questions, source = load_prompts(args.questions, args.limit)
    tokenizer = load_tokenizer(resolve_model(args.model))
    results: dict[str, dict[int, dict]] = {}
    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    with Progress(*columns, console=out, transient=True) as progress:
        for n in args.clients:
            for name in ("llamacpp", "specsot"):
                if name not in args.engines.split(","):
                    continue
                engine = Theirs(args, gguf, tokenizer) if name == "llamacpp" else Ours(args)
                try:
                    results.setdefault(name, {})[n] = asyncio.run(measure(engine, questions, n, args, progress))
                finally:
                    engine.close()
    table = Table(title=f"{len(questions)} questions from {source}, {gguf.name}, {cpu_name()}")
    for col in ("engine", "clients", "answers/min", "p50 s", "p95 s", "tok/s", "answers/min vs llama-server"):
        table.add_column(col, justify="left" if col == "engine" else "right")
    summary = {}
    for name, by_clients in results.items():
        for n, r in by_clients.items():
            theirs = results.get("llamacpp", {}).get(n)
            ratio = round(r["answers_per_min"] / theirs["answers_per_min"], 3) if theirs else None
            if name == "specsot" and ratio is not None:
                summary[f"answers_per_min_vs_llamacpp_{n}"] = ratio
            table.add_row(name, str(n), f"{r['answers_per_min']:.1f}", f"{r['p50_s']:.2f}", f"{r['p95_s']:.2f}",
                          f"{r['tok_s']:.1f}", "" if ratio is None else f"{ratio:.2f}x")  # fmt: skip
    out.print(table)
    result = {**summary, "results": results, "model": gguf.name, "questions": source, "n_questions": len(questions),
              "max_tokens": args.max_tokens, "repeat_stop": args.repeat_stop, "sot": args.sot, "cpu": cpu_name(),
              "cpu_flags": cpu_flags()}  # fmt: skip
    print(json.dumps(result), flush=True)
    return result


if __name__ == "__main__":
    run_script(main)
