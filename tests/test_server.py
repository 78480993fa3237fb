"""`specsot serve`: the OpenAI API over a launched topology of a tiny random model (the answers'
content does not matter; that the HTTP layer carries exactly what the pipeline answers does),
driven by the official `openai` client and by raw HTTP where the framing itself is checked."""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time

import httpx
import openai
import pytest

from pipeline_helpers import launched, make_tiny_model
from specsot_mq.client import Client
from specsot_mq.devices import parse_devices
from specsot_mq.messages import Answer
from specsot_mq.sampling_params import SamplingParams
from specsot_mq.server.api import ApiError, parse
from specsot_mq.sot.scheduler import default_profiles_path, load_profiles
from specsot_mq.stages.launch import plan_run

KEY = "sk-test"
MODEL = "tiny"
LONG = {"max_tokens": 400, "sot": "never"}  # a random model rarely ends by itself
# Seconds of decoding for the requests that must outlast a timeout: sampled, so no prompt lookup
# (greedy, a question asked again copies its earlier answer from the History several tokens a step)
SLOW = {"max_tokens": 900, "temperature": 1.0, "seed": 0}
PARAMS = SamplingParams(max_tokens=12)  # the server's defaults: 12 tokens per phase, no loop stop


# -- request parsing (no server) ---------------------------------------------------------------


def test_a_body_becomes_the_pipelines_request_and_every_bad_field_is_named():
    defaults = SamplingParams(max_tokens=256, repeat_stop=16)
    req = parse({"model": MODEL, "messages": [{"role": "system", "content": "Be brief."},
                                              {"role": "user", "content": "Hi"},
                                              {"role": "assistant", "content": [{"type": "text", "text": "Hello."}]},
                                              {"role": "user", "content": " Name two colors. "}],
                 "max_completion_tokens": 40, "temperature": 0.5, "top_p": 0.9, "top_k": 40, "min_p": 0.05, "seed": 3, "stop": "END",
                 "sot": "always", "stream": True, "stream_options": {"include_usage": True}}, True, MODEL, defaults)  # fmt: skip
    assert req.question == "Name two colors."
    assert req.history == [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
                           {"role": "assistant", "content": "Hello."}]  # fmt: skip
    p = req.params
    assert (p.max_tokens, p.temperature, p.top_p, p.seed, p.stop, p.repeat_stop) == (40, 0.5, 0.9, 3, ("END",), 16)
    assert (p.top_k, p.min_p) == (40, 0.05)
    assert req.sot == "always" and req.stream and req.include_usage
    assert parse({"model": MODEL, "prompt": ["Why?"]}, False, MODEL, defaults).question == "Why?"
    # what OpenAI clients send at its no-effect value (or null) is taken; a message sent back as a
    # response gave it carries null fields
    sent = {"presence_penalty": 0, "frequency_penalty": 0.0, "logprobs": False, "top_logprobs": None, "logit_bias": {},
            "response_format": {"type": "text"}, "tools": [], "tool_choice": "none", "parallel_tool_calls": True,
            "n": None, "max_tokens": None, "sot": None, "messages": [{"role": "user", "content": "Hi"},
                                                        {"role": "assistant", "content": "Hello.", "refusal": None,
                                                         "tool_calls": None}, {"role": "user", "content": "Why?"}]}  # fmt: skip
    req = parse({"model": MODEL} | sent, True, MODEL, defaults)
    assert req.question == "Why?" and req.params.max_tokens == 256 and len(req.history) == 2 and req.sot == "auto"
    assert parse({"model": MODEL, "prompt": "Why?", "echo": False, "best_of": 1, "suffix": None}, False, MODEL,
                 defaults).question == "Why?"  # fmt: skip
    for caps in ({"max_tokens": 5, "max_completion_tokens": None}, {"max_tokens": None, "max_completion_tokens": 5}):
        assert parse({"model": MODEL, "prompt": "Why?"} | caps, False, MODEL, defaults).params.max_tokens == 5
    bad = [
        ({"logprobs": True}, 400, "send false, null or leave it out, not true"),
        ({"presence_penalty": 0.5}, 400, "no penalties are applied"),
        ({"response_format": {"type": "json_object"}}, 400, "plain text"),
        ({"tools": [{"type": "function", "function": {"name": "f"}}]}, 400, "tools are not supported"),
        ({"messages": [{"role": "user", "content": "x", "tool_calls": []}]}, 400, "tool_calls is not supported"),
        ({"echo": True}, 400, "'echo' is not supported"),  # a completions field, not a chat one
        ({"n": True}, 400, "n=True"),
        ({"n": 2}, 400, "n=2"),
        ({"temperature": 3}, 400, "temperature"),
        ({"top_k": -1}, 400, "top_k"),
        ({"min_p": 2}, 400, "min_p"),
        ({"max_tokens": 0}, 400, "max_tokens"),
        ({"stop": ["a", "b", "c", "d", "e"]}, 400, "stop"),
        ({"sot": "maybe"}, 400, "sot"),
        ({"model": "gpt-4"}, 404, "not served"),
        ({"messages": []}, 400, "messages"),
        ({"messages": [{"role": "tool", "content": "x"}]}, 400, "role"),
        ({"messages": [{"role": "user", "content": "x"}, {"role": "assistant", "content": "y"}]}, 400, "last message"),
        ({"stream_options": {"include_usage": True}}, 400, "stream true"),
    ]
    for change, status, words in bad:
        body = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}]} | change
        with pytest.raises(ApiError) as caught:
            parse(body, True, MODEL, defaults)
        assert caught.value.status == status and words in caught.value.message, (change, caught.value.message)


# -- the server over a topology ----------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def served(tmp_path_factory, default_model_dir):
    """A launched one-device topology of a tiny model, and the HTTP server over it in a thread:
    (base URL, gateway address)."""
    import tempfile
    from pathlib import Path

    import uvicorn

    from specsot_mq.server.app import ServerConfig, create_app

    model, draft = make_tiny_model(tmp_path_factory.mktemp("tiny"), default_model_dir)
    run_dir = Path(tempfile.mkdtemp(prefix="specsot-srv-"))
    spec = plan_run(parse_devices("127.0.0.1#cpu"), load_profiles(default_profiles_path()), "p2p", run_dir,
                    model=str(model), dtype="fp32", draft=str(draft), max_len=1024,
                    sot={"point_tokens": 12, "skeleton_tokens": 16}, heartbeat_s=0.25, dead_after_s=5.0,
                    overrides={"parse": "pipeline_helpers:FixedPlanParse"})  # fmt: skip
    with launched(spec, run_dir):
        config = ServerConfig(spec.client_address, MODEL, [KEY], max_concurrency=2, max_queue=1, timeout=120,
                              max_tokens=12, repeat_stop=0, max_body_mb=1)  # fmt: skip
        port = _free_port()
        server = uvicorn.Server(uvicorn.Config(create_app(config), host="127.0.0.1", port=port, log_level="warning"))
        thread = threading.Thread(target=server.run, daemon=True)
        thread.start()
        deadline = time.monotonic() + 30
        while not server.started and time.monotonic() < deadline:
            time.sleep(0.05)
        assert server.started
        try:
            yield f"http://127.0.0.1:{port}", spec.client_address
        finally:
            server.should_exit = True
            thread.join(10)


def _client(base: str, key: str = KEY) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{base}/v1", api_key=key, max_retries=0, timeout=120)


def _direct(address: str, question: str, params: SamplingParams, sot: str, history=()) -> Answer:
    async def go():
        async with Client(address) as client:
            return await client.answer(question, params, sot, timeout=120, history=history)

    return asyncio.run(go())


def _events(response: httpx.Response) -> list[str]:
    """The SSE payloads of a streamed response, checking the framing: every event one `data:` line."""
    text = response.read().decode()
    assert text.endswith("\n\n")
    blocks = text[:-2].split("\n\n")
    assert all(b.startswith("data: ") and "\n" not in b for b in blocks), blocks
    return [b[6:] for b in blocks]


def test_the_openai_client_gets_what_the_gateway_answers(served):
    base, address = served
    client = _client(base)
    assert [m.id for m in client.models.list().data] == [MODEL] and client.models.retrieve(MODEL).id == MODEL
    with pytest.raises(openai.NotFoundError) as caught:
        client.models.retrieve("gpt-4")
    assert caught.value.body["code"] == "model_not_found"
    want = _direct(address, "How do I start running?", PARAMS, "always")
    got = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "How do I start running?"}],
                                         extra_body={"sot": "always"})  # fmt: skip
    assert got.choices[0].message.content == want.answer
    assert got.choices[0].finish_reason in ("stop", "length")
    how = got.model_extra["specsot"]
    assert how["mode"] == "sot" and [p["index"] for p in how["points"]] == [1, 2, 3, 4, 5]
    assert [p["text"] for p in how["points"]] == [p[2] for p in want.points]
    assert set(how["phases"]) == {"skeleton", "points"}
    assert got.usage.completion_tokens == sum(p["tokens"] for p in how["phases"].values()) > 0
    assert got.usage.prompt_tokens > 0 and got.usage.total_tokens == got.usage.prompt_tokens + got.usage.completion_tokens
    # the no-effect values a client may send with every request are taken
    text = client.completions.create(model=MODEL, prompt="What is 17 * 23?", presence_penalty=0, frequency_penalty=0,
                                     logit_bias={}, echo=False, best_of=1)  # fmt: skip
    want = _direct(address, "What is 17 * 23?", PARAMS, "auto")
    assert text.choices[0].text == want.answer and text.model_extra["specsot"]["mode"] == "direct"


def test_a_stream_is_sse_chunks_whose_text_is_the_answer_then_usage_then_done(served):
    base, _ = served
    body = {"model": MODEL, "messages": [{"role": "user", "content": "How do I start running?"}], "sot": "always"}
    whole = httpx.post(f"{base}/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {KEY}"}, timeout=120).json()
    with httpx.stream("POST", f"{base}/v1/chat/completions", headers={"Authorization": f"Bearer {KEY}"}, timeout=120,
                      json=body | {"stream": True, "stream_options": {"include_usage": True}}) as response:  # fmt: skip
        assert response.status_code == 200 and response.headers["content-type"].startswith("text/event-stream")
        events = _events(response)
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    usage = chunks.pop()
    assert usage["choices"] == [] and usage["usage"] == whole["usage"]
    assert all(c["object"] == "chat.completion.chunk" and c["id"] == chunks[0]["id"] for c in chunks)
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant"}
    content = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks)
    assert content == whole["choices"][0]["message"]["content"]
    finishes = [c["choices"][0]["finish_reason"] for c in chunks]
    assert finishes[-1] == whole["choices"][0]["finish_reason"] and not any(finishes[:-1])
    assert chunks[-1]["specsot"] == whole["specsot"] | {"phases": chunks[-1]["specsot"]["phases"],
                                                         "seconds": chunks[-1]["specsot"]["seconds"]}  # fmt: skip
    ext = [c.get("specsot", {}) for c in chunks[:-1]]
    skeleton = "".join(e.get("skeleton", "") for e in ext)
    assert skeleton == whole["specsot"]["skeleton"]
    assert [e["plan"]["points"] for e in ext if "plan" in e] == [[{"index": p["index"], "title": p["title"]}
                                                                  for p in whole["specsot"]["points"]]]  # fmt: skip
    for point in whole["specsot"]["points"]:
        assert "".join(e["point"]["text"] for e in ext if e.get("point", {}).get("index") == point["index"]) == point["text"]
    # The official client reads the same stream.
    streamed = _client(base).chat.completions.create(model=MODEL, stream=True, extra_body={"sot": "always"},
                                                     messages=body["messages"])  # fmt: skip
    assert "".join(c.choices[0].delta.content or "" for c in streamed if c.choices) == content


def test_keys_fields_and_ids_are_checked_with_openai_shaped_errors(served):
    base, _ = served
    with pytest.raises(openai.AuthenticationError) as caught:
        _client(base, "sk-wrong").models.list()
    assert caught.value.status_code == 401 and caught.value.body["code"] == "invalid_api_key"
    r = httpx.post(f"{base}/v1/chat/completions", json={"model": MODEL, "messages": []}, timeout=30)
    assert r.status_code == 401 and "Authorization: Bearer" in r.json()["error"]["message"]
    with pytest.raises(openai.BadRequestError) as caught:
        _client(base).chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], logprobs=True)
    assert "'logprobs' is not supported" in caught.value.body["message"] and caught.value.body["param"] == "logprobs"
    r = httpx.post(f"{base}/v1/completions", content=b"{not json", headers={"Authorization": f"Bearer {KEY}"}, timeout=30)
    assert r.status_code == 400 and "not valid JSON" in r.json()["error"]["message"]
    r = httpx.get(f"{base}/v1/models", headers={"Authorization": f"Bearer {KEY}", "x-request-id": "my-id-1"})
    assert r.headers["x-request-id"] == "my-id-1"
    assert len(httpx.get(f"{base}/v1/models", headers={"Authorization": f"Bearer {KEY}"}).headers["x-request-id"]) >= 12


def test_a_body_over_the_limit_is_413_at_once_and_a_prompt_over_the_cache_is_400(served):
    """--max-body-mb (1 MB here): by Content-Length before any of the body is read, and by the
    bytes of a chunked body as they come; a prompt longer than the stages' cache (1024 tokens
    here) is refused by the gateway before any stage sees it."""
    base, _ = served
    headers = {"Authorization": f"Bearer {KEY}"}
    big = json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "x" * (1 << 20)}]}).encode()
    r = httpx.post(f"{base}/v1/chat/completions", content=big, headers=headers, timeout=30)
    assert r.status_code == 413 and r.json()["error"]["code"] == "body_too_large", r.text
    assert "1 MB" in r.json()["error"]["message"] and "--max-body-mb" in r.json()["error"]["message"]

    def chunks():  # no Content-Length: the server counts what arrives
        for _ in range(40):
            yield b" " * 65536

    r = httpx.post(f"{base}/v1/chat/completions", content=chunks(), headers=headers, timeout=30)
    assert r.status_code == 413 and r.json()["error"]["code"] == "body_too_large", r.text
    with pytest.raises(openai.BadRequestError) as caught:
        _client(base).chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "word " * 1200}])
    message = caught.value.body["message"]  # the gateway's: a device stage's would begin "stage skeleton failed"
    assert message.startswith("the prompt is") and "KV cache holds 1024" in message and "--max-len" in message
    assert caught.value.code == "context_length_exceeded"  # OpenAI's code for it (the web chat acts on it)


def _stage_slots(base: str) -> float:
    """Cache slots decoding now over every device stage, from /metrics."""
    text = httpx.get(f"{base}/metrics", timeout=30).text
    lines = [line for line in text.splitlines() if line.startswith("specsot_stage_cache_slots_used{")]
    assert lines, text
    return sum(float(line.rsplit(" ", 1)[1]) for line in lines)


def _cancelled(base: str) -> float:
    """Chat requests the server counts as cancelled (their client went away)."""
    for line in httpx.get(f"{base}/metrics", timeout=30).text.splitlines():
        if line.startswith('specsot_requests_total{route="chat",status="cancelled"}'):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def _wait_slots_free(base: str, timeout: float = 30) -> float:
    deadline = time.monotonic() + timeout
    while (used := _stage_slots(base)) and time.monotonic() < deadline:
        time.sleep(0.25)
    return used


def test_a_client_that_goes_away_mid_stream_frees_its_slots_and_a_timeout_is_504(served):
    base, _ = served
    headers = {"Authorization": f"Bearer {KEY}"}
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Tell me a long story."}], "stream": True} | LONG
    with httpx.stream("POST", f"{base}/v1/chat/completions", json=body, headers=headers, timeout=120) as response:
        lines = response.iter_lines()
        seen = [next(lines) for _ in range(8)]  # the answer is under way
    assert any('"content"' in line for line in seen), seen
    assert _wait_slots_free(base) == 0
    cancelled = _cancelled(base)
    assert cancelled >= 1
    with pytest.raises(httpx.ReadTimeout):  # not streamed: the client gives up waiting and hangs up
        long = body | {"stream": False} | SLOW  # far longer than the wait, however fast decoding is
        httpx.post(f"{base}/v1/chat/completions", json=long, headers=headers, timeout=0.5)
    assert _wait_slots_free(base) == 0
    deadline = time.monotonic() + 10
    while _cancelled(base) == cancelled and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _cancelled(base) == cancelled + 1
    r = httpx.post(f"{base}/v1/chat/completions", headers=headers, timeout=120,
                   json={"model": MODEL, "messages": body["messages"]} | LONG | SLOW | {"timeout": 0.3})  # fmt: skip
    assert r.status_code == 504 and r.json()["error"]["code"] == "timeout"
    assert _wait_slots_free(base) == 0
    # A stream past its timeout: finish reason abort, the error, then [DONE].
    with httpx.stream("POST", f"{base}/v1/chat/completions", headers=headers, timeout=120,
                      json=body | SLOW | {"timeout": 0.5}) as response:  # fmt: skip
        assert response.status_code == 200
        events = _events(response)
    assert events[-1] == "[DONE]" and json.loads(events[-2])["error"]["code"] == "timeout"
    assert json.loads(events[-3])["choices"][0]["finish_reason"] == "abort"
    assert _wait_slots_free(base) == 0


def test_beyond_the_queue_a_request_gets_429_with_retry_after(served):
    base, _ = served
    headers = {"Authorization": f"Bearer {KEY}"}
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Tell me a long story."}]} | LONG

    async def burst():
        async with httpx.AsyncClient(timeout=120, headers=headers) as http:
            return await asyncio.gather(*(http.post(f"{base}/v1/chat/completions", json=body) for _ in range(5)))

    codes = sorted(r.status_code for r in asyncio.run(burst()))
    assert codes == [200, 200, 200, 429, 429], codes  # 2 run, 1 waits, 2 are refused
    refused = next(r for r in asyncio.run(burst()) if r.status_code == 429)
    assert refused.headers["retry-after"] and refused.json()["error"]["type"] == "rate_limit_error"


def test_two_users_with_different_conversations_get_their_own_answers(served):
    base, address = served
    a = [{"role": "user", "content": "Tell me about Rome."}, {"role": "assistant", "content": "Rome is in Italy."},
         {"role": "user", "content": "Name two colors."}]  # fmt: skip
    b = [{"role": "system", "content": "You answer in French."}, {"role": "user", "content": "Name two colors."}]
    alone = [_direct(address, m[-1]["content"], PARAMS, "never", m[:-1]).answer
             for m in (a, b)]  # fmt: skip
    assert alone[0] != alone[1]  # the earlier turns reach the prompt

    async def both():
        client = openai.AsyncOpenAI(base_url=f"{base}/v1", api_key=KEY, max_retries=0, timeout=120)
        return await asyncio.gather(*(client.chat.completions.create(model=MODEL, messages=m, extra_body={"sot": "never"})
                                      for m in (a, b)))  # fmt: skip

    assert [r.choices[0].message.content for r in asyncio.run(both())] == alone


def test_health_and_metrics(served):
    base, _ = served
    r = httpx.get(f"{base}/health")
    assert r.status_code == 200 and r.json()["status"] == "ok"
    text = httpx.get(f"{base}/metrics").text
    for name in ("specsot_requests_total", "specsot_request_seconds_bucket", "specsot_time_to_first_token_seconds_bucket",
                 "specsot_prompt_tokens_total", "specsot_completion_tokens_total", "specsot_queue_depth",
                 "specsot_stage_cache_slots_used", "specsot_stage_resident_memory_bytes", "specsot_spec_drafts_total",
                 "specsot_spec_draft_tokens_total", "specsot_spec_accepted_tokens_total", "specsot_sot_routed_total",
                 "specsot_sot_planned_total", "specsot_sot_fell_back_total", "specsot_sot_points_total"):  # fmt: skip
        assert name in text, name
    drafted = [float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith("specsot_spec_drafts_total{")]
    assert sum(drafted) > 0  # the tests before decoded with the draft head


def test_the_web_chat_in_a_real_browser(served, tmp_path):
    """Debian's chromium, driven by selenium: the page loads from the server alone, a question's
    skeleton and point rows appear and its answer completes; Stop ends a second answer, whose
    slots are freed. The screenshot goes to $SPECSOT_SCREENSHOT when set (the README's)."""
    import os
    import shutil

    browser, driver_path = shutil.which("chromium"), shutil.which("chromedriver")
    if not browser or not driver_path:
        pytest.skip("no chromium here: apt-get install chromium chromium-driver (Debian), as .ci/run does")
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service
    from selenium.webdriver.common.by import By
    from selenium.webdriver.common.keys import Keys
    from selenium.webdriver.support.ui import WebDriverWait

    base, _ = served
    options = webdriver.ChromeOptions()
    options.binary_location = browser
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--window-size=1200,900"):
        options.add_argument(arg)
    driver = webdriver.Chrome(service=Service(driver_path), options=options)
    wait = WebDriverWait(driver, 120)
    try:
        driver.get(base + "/")
        driver.execute_script("localStorage.setItem('specsot.api-key', arguments[0]);"
                              "localStorage.setItem('specsot.sot', 'always');", KEY)  # fmt: skip
        driver.refresh()
        wait.until(lambda d: "model: tiny" in d.find_element(By.ID, "model").text)
        box = driver.find_element(By.ID, "input")
        box.send_keys("How do I start running?", Keys.ENTER)
        wait.until(lambda d: d.find_element(By.CSS_SELECTOR, ".assistant .skeleton").text.startswith("1."))
        wait.until(lambda d: len(d.find_elements(By.CSS_SELECTOR, ".assistant .point")) == 5)
        wait.until(lambda d: "mode sot" in d.find_element(By.CSS_SELECTOR, ".assistant .stats").text)
        skeleton = driver.find_element(By.CSS_SELECTOR, ".assistant .skeleton").text
        assert skeleton.count("1.") == 1, skeleton  # streamed once, not again from the final record
        answer = driver.find_element(By.CSS_SELECTOR, ".assistant .answer").text
        titles = [e.text for e in driver.find_elements(By.CSS_SELECTOR, ".assistant .point .title")]
        assert titles[0] == "1. Warm up" and "Warm up:" in answer, (titles, answer)
        if os.environ.get("SPECSOT_SCREENSHOT"):
            driver.save_screenshot(os.environ["SPECSOT_SCREENSHOT"])
        # A long direct answer, stopped mid-way.
        driver.execute_script("localStorage.setItem('specsot.sot', 'never');"
                              "localStorage.setItem('specsot.max-tokens', '900');")  # fmt: skip
        driver.refresh()
        wait.until(lambda d: len(d.find_elements(By.CSS_SELECTOR, ".assistant")) == 1)  # the conversation was kept
        driver.find_element(By.ID, "input").send_keys("Tell me a long story.", Keys.ENTER)
        wait.until(lambda d: len(d.find_elements(By.CSS_SELECTOR, ".assistant")) == 2
                   and d.find_elements(By.CSS_SELECTOR, ".assistant")[1].find_element(By.CSS_SELECTOR, ".answer").text)  # fmt: skip
        driver.find_element(By.ID, "stop").click()
        wait.until(lambda d: d.find_elements(By.CSS_SELECTOR, ".assistant")[1].find_element(By.CSS_SELECTOR, ".error").text == "stopped")
        assert _wait_slots_free(base) == 0
        assert driver.find_element(By.ID, "send").is_displayed()
        # A question that fits the cache (1024 tokens) alone, but not after the first turn: the
        # server says context_length_exceeded, and the chat asks again without that turn, keeping
        # the system message the settings give (the requests the page sends are recorded).
        driver.execute_script("document.getElementById('system').value = 'Be brief.';"
                              "window.sent = []; const send = window.fetch;"
                              "window.fetch = (url, o) => { if (o && o.body) window.sent.push(JSON.parse(o.body)); return send(url, o); };"
                              "document.getElementById('input').value = arguments[0];", "word " * 960)  # fmt: skip
        driver.find_element(By.ID, "input").send_keys(Keys.ENTER)
        third = lambda d: d.find_elements(By.CSS_SELECTOR, ".assistant")[2]  # noqa: E731
        wait.until(lambda d: len(d.find_elements(By.CSS_SELECTOR, ".assistant")) == 3
                   and "mode direct" in third(d).find_element(By.CSS_SELECTOR, ".stats").text)  # fmt: skip
        stats = third(driver).find_element(By.CSS_SELECTOR, ".stats").text
        assert "1 earliest turn left out (the conversation outgrew the model's cache)" in stats, stats
        sent = [[m["role"] for m in body["messages"]] for body in driver.execute_script("return window.sent;")]
        assert sent == [["system", "user", "assistant", "user"], ["system", "user"]], sent
        assert driver.execute_script("return window.sent[1].messages[0].content;") == "Be brief."
    finally:
        driver.quit()


def test_a_budget_refuses_a_key_past_its_tokens_for_the_hour(monkeypatch):
    """--budget TOKENS/hour: tokens count against the key that spent them, over a sliding hour."""
    from specsot_mq.cli.http import parse_budget
    from specsot_mq.server import app

    assert parse_budget("20000/hour") == parse_budget("20000") == 20000 and parse_budget(None) is None
    now = [1000.0]
    monkeypatch.setattr(app.time, "monotonic", lambda: now[0])
    budget = app.Budget(100)
    budget.check("a")
    budget.add("a", 60)
    budget.add("a", 50)
    budget.check("b")  # another key has its own
    with pytest.raises(ApiError) as caught:
        budget.check("a")
    assert caught.value.status == 429 and caught.value.headers["Retry-After"] == "3601"
    now[0] += 3601  # an hour on, the spending has expired
    budget.check("a")


def test_a_streams_progress_names_points_written_again_and_restarted():
    """The `specsot` extension of a stream chunk for the pipeline's Again (points a counted answer
    writes again, under new indices) and Reassign (points that start again on another stage)."""
    from server.api import progress
    from specsot_mq.messages import Again, Reassign

    assert progress(Again("r", [(6, 2, "Water"), (7, 4, "Maps")], "branch@b")) == {
        "again": {"points": [{"index": 6, "of": 2, "title": "Water"}, {"index": 7, "of": 4, "title": "Maps"}]}}
    assert progress(Reassign("r", [1, 3], "branch@b", "branch@a")) == {"restart": {"indices": [1, 3], "stage": "branch@b"}}
