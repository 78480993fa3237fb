"""The peer comparison: llama.cpp as its users run it (its own llama-server) on the same GGUF file,
beside our plain, EAGLE and SpecSoT decoding.

Every engine answers the same chat prompts (MT-bench first turns by default) greedily, up to
--max-tokens per phase, with the CLI's loop rule (an output ends when its last --repeat-stop tokens
already ran earlier in it), on --threads threads each. llama.cpp is llama-server, the C++ server
(benchmarks/setup_llamacpp.sh builds it from the llama.cpp source in the llama-cpp-python 0.3.36
sdist: about 5 minutes), started here with its defaults (one slot, prompt caching on) and fed our
chat prompt's token ids, so both read the same prompt; its time to an answer is its own timings
(prompt_ms, and predicted_ms up to the token where the loop rule ends the answer, as ours would
end it), not the HTTP round trip. Ours is timed from the question to its last token. Prints a table
per question, the medians of the time to a complete answer and of tok/s, and ends with one JSON
line: `plain_vs_llamacpp`, `eagle_vs_llamacpp`, `specsot_vs_llamacpp` and
`specsot_vs_llamacpp_sot_routed` (median over questions of llama.cpp's seconds over ours: above 1
is faster than llama.cpp), tok/s per engine, the CPU flags seen, `ways`: how the EAGLE and
SpecSoT steps speculated (steps per way until the head was retired, if it was; recent ms per
token by batch size), and
`planned_phase_shares`: where the planned answers' time went (PHASES).

    benchmarks/setup_llamacpp.sh        # once
    python benchmarks/peer.py [--limit 16] [--per-category 2] [--max-tokens 256] [--threads 2] [--llamacpp DIR]

Both engines name the instruction set they ran (`kernel_isa`, our kernels' path; `llamacpp_isa`,
from llama-server's system info). On an AVX-512 machine, `SPECSOT_KERNEL_ISA=avx2` holds our
kernels to their AVX2 path and `--llamacpp DIR` runs another llama.cpp build, e.g. one built for
AVX2 only (benchmarks/README.md), so both run the code an AVX2-only CPU would.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table

sys.path.insert(0, str(Path(__file__).resolve().parent))
from decode import add_dtype_option, chosen_dtype, cpu_name, load_prompts, load_with_draft, run_script  # noqa: E402
from sot import time_answers  # noqa: E402

from specsot_mq.generate import Generator  # noqa: E402
from specsot_mq.lookup import History  # noqa: E402
from specsot_mq.messages import MergePlan, PointText, SkeletonText  # noqa: E402
from specsot_mq.stopping import LoopWatch  # noqa: E402
from specsot_mq.pull import DEFAULT_MODEL, download_gguf, known_model, specsot_home  # noqa: E402
from specsot_mq.quant import native  # noqa: E402
from specsot_mq.sampling import REPEAT_STOP, SamplingParams  # noqa: E402
from specsot_mq.sot.engine import SoTEngine  # noqa: E402
from specsot_mq.sot.flow import SoTConfig, answer_tokens  # noqa: E402
from specsot_mq.tokenizer import chat_prompt_ids  # noqa: E402

ENGINES = ("llamacpp", "plain", "eagle", "specsot")
# A planned answer's phases, each from the first event of the next: routing and the skeleton's
# prefill (to its first token), its decode (to the plan), the points' prefill and first step (to
# their first text), their decode and the merge (to the answer)
PHASES = ("route + skeleton prefill", "skeleton decode", "points prefill", "points decode")


def cpu_flags() -> dict:
    flags = set()
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("flags"):
            flags = set(line.split(":", 1)[1].split())
            break
    return {"avx2": "avx2" in flags, "avx512_bf16": "avx512_bf16" in flags, "avx512_vnni": "avx512_vnni" in flags,
            "amx": any(f.startswith("amx") for f in flags)}  # fmt: skip


class LlamaServer:
    """llama.cpp's own llama-server on a GGUF file, started on a free local port, with `slots`
    sequences decoded together (one: a request at a time), sharing `ctx` cache entries."""

    def __init__(self, folder: Path, gguf: Path, threads: int, ctx: int = 4096, slots: int = 1):
        import socket

        self.folder = folder
        binary = folder / "bin" / "llama-server"
        if not binary.exists():
            sys.exit(f"llama-server is not in {folder / 'bin'}: run benchmarks/setup_llamacpp.sh first (about 5 minutes)")
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.log = tempfile.TemporaryFile()
        self.process = subprocess.Popen([str(binary), "-m", str(gguf), "-t", str(threads), "-tb", str(threads), "-c",
                                         str(ctx), "-np", str(slots), "--host", "127.0.0.1", "--port", str(self.port)],
                                        stdout=self.log, stderr=subprocess.STDOUT)  # fmt: skip
        deadline = time.time() + 120
        while self.request("GET", "/health") is None:
            if self.process.poll() is not None or time.time() > deadline:
                sys.exit(f"llama-server did not start: {self.log_text()[-1500:]}")
            time.sleep(0.2)

    def request(self, method: str, path: str, body: dict | None = None) -> dict | None:
        import http.client

        try:
            conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=600)
            conn.request(method, path, None if body is None else json.dumps(body), {"Content-Type": "application/json"})
            reply = conn.getresponse()
            data = reply.read()
            return json.loads(data) if reply.status == 200 else None
        except OSError:
            return None

    def log_text(self) -> str:
        self.log.seek(0)
        return self.log.read().decode(errors="replace")

    def isa(self) -> str:
        """The vector instruction sets it was built for (its build's cmake cache: GGML_AVX2=ON, ...)."""
        cache = self.folder / "build" / "CMakeCache.txt"
        flags = re.findall(r"^GGML_(AVX\w*|FMA|F16C|AMX\w*|NATIVE):BOOL=ON$", cache.read_text(), re.M) if cache.exists() else []
        return " ".join(flags) or "?"

    def answer(self, ids: list[int], max_tokens: int, repeat_stop: int) -> tuple[float, int]:
        """Its greedy answer to prompt ids, ended as ours are: (its own seconds, tokens)."""
        reply = self.request("POST", "/completion", {"prompt": ids, "n_predict": max_tokens, "temperature": 0.0,
                                                     "top_k": 1, "return_tokens": True, "stream": False})  # fmt: skip
        if reply is None:
            sys.exit(f"llama-server failed a request: {self.log_text()[-1500:]}")
        tokens, t = reply["tokens"], reply["timings"]
        watch = LoopWatch(repeat_stop) if repeat_stop else None
        n = len(tokens)
        for i, token in enumerate(tokens):
            if watch is not None and watch.add(token):
                n = i + 1
                break
        predicted = t["predicted_ms"] * n / max(t["predicted_n"], 1)
        return (t["prompt_ms"] + predicted) / 1e3, n

    def close(self) -> None:
        self.process.terminate()
        self.process.wait(timeout=30)


def gguf_file(name: str) -> Path:
    """The known model's GGUF, kept under the cache (pull converts it and drops it)."""
    entry = known_model(name)
    path = specsot_home() / "gguf" / Path(entry.member).name
    if not path.exists():
        download_gguf(name, path.parent)
    return path


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--questions", type=Path, default=None)
    p.add_argument("--limit", type=int, default=16)
    p.add_argument("--per-category", type=int, default=2)
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--repeat-stop", type=int, default=REPEAT_STOP)
    p.add_argument("--threads", type=int, default=torch.get_num_threads())
    p.add_argument("--draft", default="auto")
    p.add_argument("--max-parallel", type=int, default=8)
    p.add_argument("--engines", default=",".join(ENGINES))
    p.add_argument("--json-only", action="store_true")
    p.add_argument("--llamacpp", type=Path, default=None,
                   help="the folder benchmarks/setup_llamacpp.sh built (default $SPECSOT_HOME/llamacpp)")
    add_dtype_option(p)
    args = p.parse_args(argv)
    args.model = None
    engines = [e for e in ENGINES if e in args.engines.split(",")]
    torch.set_num_threads(args.threads)
    out = Console(quiet=args.json_only, soft_wrap=True)
    dtype = chosen_dtype(args)
    questions, source = load_prompts(args.questions, args.limit, args.per_category)
    folder, tokenizer, model, head, draft_path = load_with_draft(None, args.draft, dtype, args.quantize)
    server = None
    if "llamacpp" in engines:
        server = LlamaServer(args.llamacpp or specsot_home() / "llamacpp", gguf_file(DEFAULT_MODEL), args.threads)
    plain = Generator(model, tokenizer, max_len=2048)
    eagle = Generator(model, tokenizer, max_len=2048, num_slots=args.max_parallel, draft=head)
    specsot = SoTEngine(eagle, SoTConfig(max_parallel=args.max_parallel))
    specsot.keep_heads()  # as a server answers: the shared prompt beginnings computed already
    params = SamplingParams(max_tokens=args.max_tokens, repeat_stop=args.repeat_stop)
    # EAGLE and SpecSoT share one generator: each keeps its own History of outputs (prompt lookup's
    # guesses from earlier answers), or SpecSoT's direct answers would copy EAGLE's to the same question
    histories = {"eagle": History(), "specsot": History()}
    phases: list[dict] = []  # each planned answer's seconds per phase (PHASES)

    def run(engine: str, question: str) -> tuple[float, int, str]:
        ids = chat_prompt_ids(tokenizer, question)
        eagle.history = histories.get(engine, eagle.history)
        start = time.perf_counter()
        if engine == "llamacpp":  # its own timings
            seconds, n = server.answer(ids, args.max_tokens, args.repeat_stop)
            return seconds, n, "direct"
        if engine in ("plain", "eagle"):
            done = (plain if engine == "plain" else eagle).generate(ids, params)
            return time.perf_counter() - start, len(done.token_ids), "direct"
        marks = {}  # when each phase of a planned answer began, from the events as they came

        def mark(event) -> None:
            now = time.perf_counter() - start
            if isinstance(event, SkeletonText) and len(event.token_ids):
                marks.setdefault("skeleton decode", now)
            elif isinstance(event, MergePlan):
                marks["points prefill"] = now
            elif isinstance(event, PointText):
                marks.setdefault("points decode", now)

        answer = specsot.generate(question, params, on_event=mark)
        seconds = time.perf_counter() - start
        if answer.mode == "sot" and len(marks) == 3:
            phases.append(dict(zip(PHASES, (b - a for a, b in zip([0.0, *marks.values()], [*marks.values(), seconds])))))
        return seconds, answer_tokens(answer), answer.mode

    flags = cpu_flags()
    kernel_isa = native().isa() if native() is not None else "none (dequantized weights)"
    llama_isa = server.isa() if server is not None else "-"
    out.print(f"CPU {cpu_name()} | {' '.join(k for k, v in flags.items() if v)} | threads {args.threads} | "
              f"our kernels {kernel_isa} | llama.cpp {llama_isa} | "
              f"ours: {args.dtype} | {len(questions)} questions ({source}) | max tokens {args.max_tokens} | "
              f"repeat stop {args.repeat_stop} | draft {draft_path.name}")  # fmt: skip
    try:
        rows = time_answers(engines, questions, run, args.json_only)
    finally:
        if server is not None:
            server.close()

    ref = "llamacpp" if "llamacpp" in engines else engines[0]
    table = Table(title=f"seconds to a complete answer (tokens, tok/s) and speed against {ref}")
    table.add_column("question", max_width=26, no_wrap=True, overflow="ellipsis")
    table.add_column("mode")
    for engine in engines:
        table.add_column(engine, justify="right")
    for r in rows:
        cells = []
        for e in engines:
            s, n, _ = r[e]
            cells.append(f"{s:.2f}s ({n}, {n / s:.0f}/s)" + ("" if e == ref else f" {r[ref][0] / s:.2f}x"))
        table.add_row(r["question"], r.get("specsot", (0, 0, "-"))[2], *cells)
    out.print(table)

    def median_vs(engine: str, subset) -> float | None:
        values = [r[ref][0] / r[engine][0] for r in subset]
        return round(statistics.median(values), 3) if values else None

    routed = [r for r in rows if r.get("specsot", (0, 0, ""))[2] == "sot"]
    result = {}
    for engine in engines:
        if engine != ref:
            result[f"{engine}_vs_{ref}"] = median_vs(engine, rows)
    if "specsot" in engines and ref != "specsot":
        result[f"specsot_vs_{ref}_sot_routed"] = median_vs("specsot", routed)
    summary = Table(title="medians over questions")
    for col in ("engine", "seconds to answer", "tok/s", f"vs {ref} (all)", f"vs {ref} (routed to SoT)"):
        summary.add_column(col, justify="left" if col == "engine" else "right")
    result["median_seconds"], result["median_tok_s"] = {}, {}
    for engine in engines:
        secs = statistics.median(r[engine][0] for r in rows)
        rate = statistics.median(r[engine][1] / r[engine][0] for r in rows)
        result["median_seconds"][engine], result["median_tok_s"][engine] = round(secs, 3), round(rate, 1)
        vs = "-" if engine == ref else str(result[f"{engine}_vs_{ref}"])
        vs_routed = str(result.get(f"specsot_vs_{ref}_sot_routed")) if engine == "specsot" else "-"
        summary.add_row(engine, f"{secs:.2f}", f"{rate:.1f}", vs, vs_routed)
    out.print(summary)
    # How the EAGLE and SpecSoT steps speculated (their generator's SpeedChooser): steps per way, and
    # each way's recent ms per decided token by batch size.
    chooser = eagle.chooser
    result["ways"] = {"steps": dict(chooser.counts), "head_retired": eagle.head_retired, "ms_per_token": {
        size: {w: None if v is None else round(v * 1e3, 2) for w, v in chooser.seconds_per_token(size).items()}
        for size in sorted(chooser.by_size)}}  # fmt: skip
    out.print(f"ways the EAGLE and SpecSoT steps took: {result['ways']['steps']} (then the head "
              f"{'retired: plain decoders with prompt lookup' if eagle.head_retired else 'kept'}); recent ms per "
              f"token at 1 sequence: {result['ways']['ms_per_token'].get(1)}")  # fmt: skip
    if phases:  # where a planned answer's time goes: each phase's share of their summed seconds
        total = sum(sum(p.values()) for p in phases)
        result["planned_phase_shares"] = {k: round(sum(p[k] for p in phases) / total, 3) for k in PHASES}
        out.print(f"planned answers' time by phase ({len(phases)} answers): {result['planned_phase_shares']}")
    result.update(questions=len(rows), sot_routed=len(routed), cpu=cpu_name(), cpu_flags=flags, kernel_isa=kernel_isa,
                  llamacpp_isa=llama_isa, threads=args.threads,
                  dtype=args.dtype, max_tokens=args.max_tokens, repeat_stop=args.repeat_stop, draft=draft_path.name,
                  per_question=[{"question": r["question"], "mode": r.get("specsot", (0, 0, None))[2],
                                 **{e: {"s": round(r[e][0], 3), "tokens": r[e][1]} for e in engines}}
                                for r in rows])  # fmt: skip
    print(json.dumps(result), flush=True)
    return result


if __name__ == "__main__":
    run_script(main)
