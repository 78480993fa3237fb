"""The OpenAI request and response shapes, as plain functions over dicts: a request body becomes a
Request (or ApiError naming the field that is wrong), and the pipeline's messages become
completion bodies and stream chunks.

What a body may hold (anything else is a 400 that names it):
- chat: model, messages, stream, stream_options, max_tokens / max_completion_tokens, temperature,
  top_p, seed, stop, n (1 only), user; and the extensions sot (auto|always|never), timeout
  (seconds), repeat_stop (tokens; 0 = off), top_k and min_p (as llama-server and vLLM take them).
- completions: the same with prompt (a string, or a list of one string) instead of messages. The
  prompt is answered as a question (the chat template applies): every request goes through the
  same plan-and-expand pipeline.
- fields that OpenAI clients send at their no-effect value (NEUTRAL: presence_penalty 0,
  logprobs false, tools [], response_format {"type": "text"}, ...) are taken at that value or
  null, and any other value of theirs is a 400 that says what to send. Any field taken may be null
  (its default), and a message may carry null fields beside role, content and name (a response's
  message sent back as it came).

The extension field `specsot` of a response body, and of the last stream chunk, says how the
answer was made: mode, reason, skeleton, points [{index, title, text}], phases {name: {tokens,
steps, seconds, tau}} and seconds. Stream chunks before it carry the pipeline's progress in the
same field: {"skeleton": text}, {"plan": {...}}, {"point": {"index", "text"}}, {"point_end":
{"index", "finish", "tokens"}}, and {"restart": {"indices", "stage"}} when points start again on
another stage (theirs died).
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import dataclass, field

from specsot_mq.messages import Again, Answer, MergePlan, PointEnd, PointText, Reassign, SkeletonText
from specsot_mq.sampling_params import SamplingParams
from specsot_mq.sot.router import MODES

COMMON = {"model", "stream", "stream_options", "max_tokens", "max_completion_tokens", "temperature", "top_p", "seed",
          "stop", "n", "user", "sot", "timeout", "repeat_stop", "top_k", "min_p"}  # fmt: skip
CHAT = COMMON | {"messages"}
COMPLETION = COMMON | {"prompt"}


def _zero(v) -> bool:
    return type(v) in (int, float) and v == 0


# Fields a client may send at the value that asks for nothing (OpenAI's default): whether a value
# is that, what to send, and why no other value is taken.
NEUTRAL = {
    "presence_penalty": (_zero, "0", "no penalties are applied"),
    "frequency_penalty": (_zero, "0", "no penalties are applied"),
    "logit_bias": (lambda v: v == {}, "{}", "no biases are applied"),
    "logprobs": (lambda v: v is False, "false", "no log probabilities are returned"),
    "top_logprobs": (_zero, "0", "no log probabilities are returned"),
    "response_format": (lambda v: v == {"type": "text"}, '{"type": "text"}', "answers are plain text"),
    "tools": (lambda v: v == [], "[]", "tools are not supported"),
    "tool_choice": (lambda v: v in ("none", "auto"), '"none"', "tools are not supported"),
    "parallel_tool_calls": (lambda v: isinstance(v, bool), "a bool", "tools are not supported"),
}
COMPLETION_NEUTRAL = NEUTRAL | {
    "echo": (lambda v: v is False, "false", "the prompt is not echoed"),
    "best_of": (lambda v: v == 1 and type(v) is int, "1", "one choice per request"),
    "suffix": (lambda v: False, "", "no suffix is taken"),
}


class ApiError(Exception):
    """An error the client gets in OpenAI's shape: {"error": {"message", "type", "param", "code"}}."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 kind: str = "invalid_request_error", headers: dict | None = None):  # fmt: skip
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.kind = status, message, param, code, kind
        self.headers = headers or {}

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}


@dataclass(slots=True)
class Request:
    """One completion request as the pipeline takes it."""

    chat: bool  # /v1/chat/completions (else /v1/completions)
    model: str
    question: str
    history: list[dict]  # the earlier turns, [{"role", "content"}]
    params: SamplingParams
    sot: str = "auto"
    stream: bool = False
    include_usage: bool = False
    timeout: float | None = None
    created: int = field(default_factory=lambda: int(time.time()))


def parse(body, chat: bool, model: str, defaults: SamplingParams) -> Request:
    """A request body, checked; `defaults`: the server's max_tokens and repeat_stop."""
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    allowed, neutral = (CHAT, NEUTRAL) if chat else (COMPLETION, COMPLETION_NEUTRAL)
    for name, value in body.items():
        if name in neutral:
            takes, ok, why = neutral[name]
            if value is not None and not takes(value):
                raise ApiError(400, f"'{name}' is not supported by this server ({why}): send {ok + ', ' if ok else ''}"
                                    f"null or leave it out, not {json.dumps(value)}", name, "unsupported_parameter")  # fmt: skip
        elif name not in allowed:
            raise ApiError(400, f"'{name}' is not supported by this server; the fields it takes are "
                                f"{', '.join(sorted(allowed))}", name, "unsupported_parameter")  # fmt: skip
    check_model(body.get("model"), model)
    if chat:
        question, history = messages(body.get("messages"))
    else:
        question, history = _prompt(body.get("prompt")), []
    if body.get("n") not in (None, 1) or isinstance(body.get("n"), bool):
        raise ApiError(400, f"n={body['n']!r}: this server writes one choice per request (n=1)", "n")
    stream = _typed(body, "stream", bool, False)
    options = body.get("stream_options")
    if options is not None and (not stream or not isinstance(options, dict) or set(options) - {"include_usage"}):
        raise ApiError(400, "stream_options takes only {\"include_usage\": bool}, with stream true", "stream_options")
    if body.get("max_tokens") is not None and body.get("max_completion_tokens") is not None:
        raise ApiError(400, "give max_tokens or max_completion_tokens, not both", "max_completion_tokens")
    cap = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    max_tokens = _number(body, cap, int, 1, 1 << 20, defaults.max_tokens)
    temperature = _number(body, "temperature", float, 0.0, 2.0, 0.0)
    top_p = _number(body, "top_p", float, 0.0, 1.0, 1.0)
    if top_p == 0.0:
        raise ApiError(400, "top_p must be above 0 (1 keeps every token)", "top_p")
    top_k = _number(body, "top_k", int, 0, 1 << 31, 0)
    min_p = _number(body, "min_p", float, 0.0, 1.0, 0.0)
    seed = _number(body, "seed", int, -(1 << 63), (1 << 63) - 1, None)
    repeat_stop = _number(body, "repeat_stop", int, 0, 1 << 20, defaults.repeat_stop)
    stop = body.get("stop")
    stop = [stop] if isinstance(stop, str) else stop if stop is not None else []
    if not isinstance(stop, list) or len(stop) > 4 or not all(isinstance(s, str) and s for s in stop):
        raise ApiError(400, "stop must be a non-empty string or a list of up to 4 of them", "stop")
    sot = "auto" if body.get("sot") is None else body["sot"]
    if sot not in MODES:
        raise ApiError(400, f"sot must be auto, always or never, not {sot!r}", "sot")
    timeout = _number(body, "timeout", float, 0.001, 86400.0, None)
    _typed(body, "user", str, None)
    params = SamplingParams(max_tokens=max_tokens, temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p,
                            seed=seed, stop=tuple(stop), repeat_stop=repeat_stop)  # fmt: skip
    return Request(chat, model, question, history, params, sot, stream, bool(options and options.get("include_usage")),
                   timeout)  # fmt: skip


def check_model(given, model: str) -> None:
    """ApiError 404 where a request names a model other than the one served (`model`)."""
    if given != model:
        raise ApiError(404, f"model {given!r} is not served here: use {model!r} (GET /v1/models)", "model",
                       "model_not_found")  # fmt: skip


def _typed(body: dict, name: str, kind: type, default):
    value = body.get(name, default)
    if value is not None and not isinstance(value, kind):
        raise ApiError(400, f"{name} must be a {kind.__name__}", name)
    return value


def _number(body: dict, name: str, kind: type, low, high, default):
    value = body.get(name)
    if value is None:
        return default
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    if ok and kind is int:
        ok = float(value).is_integer()
    if not ok or not low <= value <= high:
        what = "a whole number" if kind is int else "a number"
        raise ApiError(400, f"{name} must be {what} from {low} to {high}, got {value!r}", name)
    return kind(value)


def _text(content, where: str) -> str:
    """A message's content: a string, or a list of text parts."""
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
                                         for p in content):  # fmt: skip
        return "".join(p["text"] for p in content)
    raise ApiError(400, f"{where}.content must be a string or a list of text parts (no images here)", where)


def messages(given) -> tuple[str, list[dict]]:
    """(the question, the turns before it) from a chat request's messages (and an OpenAI batch line's:
    `specsot run`); ApiError names what is wrong."""
    if not isinstance(given, list) or not given:
        raise ApiError(400, "messages must be a non-empty list of {role, content}", "messages")
    turns = []
    for n, m in enumerate(given):
        where = f"messages[{n}]"
        if not isinstance(m, dict):
            raise ApiError(400, f"{where} must be an object with role and content", where)
        role = {"developer": "system"}.get(m.get("role"), m.get("role"))
        if role not in ("system", "user", "assistant"):
            raise ApiError(400, f"{where}.role must be system, user or assistant (tools are not supported), "
                                f"got {m.get('role')!r}", where)  # fmt: skip
        extra = {k for k, v in m.items() if v is not None} - {"role", "content", "name"}
        if extra:
            raise ApiError(400, f"{where}.{sorted(extra)[0]} is not supported by this server", where)
        turns.append({"role": role, "content": _text(m.get("content"), where)})
    if turns[-1]["role"] != "user" or not turns[-1]["content"].strip():
        raise ApiError(400, "the last message must be the user's question, with text", f"messages[{len(turns) - 1}]")
    return turns[-1]["content"].strip(), turns[:-1]


def _prompt(prompt) -> str:
    if isinstance(prompt, list) and len(prompt) == 1:
        prompt = prompt[0]
    if not isinstance(prompt, str) or not prompt.strip():
        raise ApiError(400, "prompt must be a non-empty string (one prompt per request)", "prompt")
    return prompt.strip()


# -- responses ---------------------------------------------------------------------------------


def usage(answer: Answer) -> dict:
    prompt = int(answer.stats.get("prompt_tokens", 0))
    completion = sum(p["tokens"] for p in answer.stats.values() if isinstance(p, dict))
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def how(answer: Answer) -> dict:
    """The `specsot` extension of a finished answer."""
    phases = {name: {"tokens": p["tokens"], "steps": p.get("steps", 0), "seconds": round(p["seconds"], 4),
                     "tau": round(p["tokens"] / p["steps"], 3) if p.get("steps") else None}
              for name, p in answer.stats.items() if isinstance(p, dict)}  # fmt: skip
    return {"mode": answer.mode, "reason": answer.reason, "skeleton": answer.skeleton,
            "points": [{"index": i, "title": t, "text": x} for i, t, x in answer.points], "phases": phases,
            "seconds": round(answer.stats.get("seconds", 0.0), 4)}  # fmt: skip


def progress(msg) -> dict | None:
    """The `specsot` extension of a stream chunk for a pipeline message, or None."""
    if isinstance(msg, SkeletonText):
        return {"skeleton": msg.text}
    if isinstance(msg, MergePlan):
        return {"plan": {"mode": msg.mode, "reason": msg.reason, "points": [{"index": i, "title": t} for i, t in msg.points]}}
    if isinstance(msg, PointText):
        return {"point": {"index": msg.index, "text": msg.text}}
    if isinstance(msg, PointEnd):
        return {"point_end": {"index": msg.index, "finish": msg.finish, "tokens": msg.tokens}}
    if isinstance(msg, Again):  # points a counted answer left out, written again under new indices
        return {"again": {"points": [{"index": i, "of": of, "title": t} for i, of, t in msg.points]}}
    if isinstance(msg, Reassign):  # their stage died: these points start again from nothing
        return {"restart": {"indices": msg.indices, "stage": msg.stage}}
    return None


def body(req: Request, rid: str, answer: Answer) -> dict:
    """A whole (non-streamed) response."""
    finish = answer.finish  # "stop" or "length" (the merge stage counts a loop stop as stop)
    if req.chat:
        choice = {"index": 0, "message": {"role": "assistant", "content": answer.answer}, "finish_reason": finish,
                  "logprobs": None}  # fmt: skip
    else:
        choice = {"index": 0, "text": answer.answer, "finish_reason": finish, "logprobs": None}
    return {"id": rid, "object": "chat.completion" if req.chat else "text_completion", "created": req.created,
            "model": req.model, "choices": [choice], "usage": usage(answer), "specsot": how(answer)}  # fmt: skip


def chunk(req: Request, rid: str, text: str | None = None, finish: str | None = None, ext: dict | None = None,
          role: bool = False) -> dict:  # fmt: skip
    """One stream chunk: new answer text and/or the finish reason, with a `specsot` extension."""
    if req.chat:
        delta = {"role": "assistant"} if role else {}
        if text:
            delta["content"] = text
        choice = {"index": 0, "delta": delta, "finish_reason": finish, "logprobs": None}
    else:
        choice = {"index": 0, "text": text or "", "finish_reason": finish, "logprobs": None}
    out = {"id": rid, "object": "chat.completion.chunk" if req.chat else "text_completion", "created": req.created,
           "model": req.model, "choices": [choice]}  # fmt: skip
    if ext is not None:
        out["specsot"] = ext
    return out


def usage_chunk(req: Request, rid: str, answer: Answer) -> dict:
    """The last chunk when stream_options.include_usage: no choices, the usage."""
    return {"id": rid, "object": "chat.completion.chunk" if req.chat else "text_completion", "created": req.created,
            "model": req.model, "choices": [], "usage": usage(answer)}  # fmt: skip
