"""`specsot serve`: the OpenAI-compatible HTTP API and the web chat over a stage topology (a
running launch, or a local one started here and stopped on exit)."""

from __future__ import annotations

import errno
import logging
import socket
from typing import Annotated, Optional

import typer

from specsot_mq.cli.options import LaunchFlags, ModelOptions, RepeatOpt, TopologyOptions, err, with_options
from specsot_mq.errors import SpecSotError
from specsot_mq.sampling_params import REPEAT_STOP


def parse_budget(text: str | None) -> int | None:
    """`--budget 20000` or `--budget 20000/hour` as tokens per hour."""
    if text is None:
        return None
    number = text.strip().lower().removesuffix("/hour").removesuffix("/h")
    if not number.isdigit() or int(number) < 1:
        raise SpecSotError(f"--budget {text!r}: give tokens per hour per API key, e.g. 20000/hour")
    return int(number)


def listen(host: str, port: int) -> socket.socket:
    """The server's listening socket, bound before anything starts (a launch, a model pull): a
    port out of range, taken or not allowed, or a host that is no address here, is one line at
    once instead of uvicorn's error after the stages came up."""
    if not 1 <= port <= 65535:
        raise SpecSotError(f"--port must be 1 to 65535, got {port}")
    try:
        family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0][0]
    except socket.gaierror as e:
        raise SpecSotError(f"--host {host!r} is not an address ({e.strerror}): give an address of this machine, "
                           "e.g. 127.0.0.1 or 0.0.0.0 for all") from None  # fmt: skip
    try:
        return socket.create_server((host, port), family=family)
    except OSError as e:
        fix = {errno.EADDRINUSE: f"port {port} on {host} is in use (another server?): stop it or pick another with --port",
               errno.EACCES: f"port {port} needs privileges to listen on: pick one above 1023 with --port",
               errno.EADDRNOTAVAIL: f"--host {host!r} is no address of this machine: use one it has, e.g. 127.0.0.1"}
        raise SpecSotError(fix.get(e.errno, f"cannot listen on {host}:{port}: {e.strerror}")) from None


@with_options
def serve(
    topo: TopologyOptions,
    model: ModelOptions,
    flags: LaunchFlags,
    host: Annotated[str, typer.Option(envvar="SPECSOT_HOST", help="Address to listen on (loopback by default).")] = "127.0.0.1",
    port: Annotated[int, typer.Option(envvar="SPECSOT_PORT", help="HTTP port.")] = 8000,
    api_key: Annotated[Optional[list[str]], typer.Option(
        envvar="SPECSOT_API_KEY", help="Require 'Authorization: Bearer KEY' (repeatable; the variable may hold several, comma-separated).")] = None,
    max_concurrency: Annotated[int, typer.Option(help="Requests in the pipeline at once.")] = 8,
    max_queue: Annotated[int, typer.Option(help="Requests waiting beyond those; more get 429.")] = 64,
    timeout: Annotated[float, typer.Option(help="Seconds a request may take (a request's own \"timeout\" overrides it).")] = 600.0,
    budget: Annotated[Optional[str], typer.Option(help="Tokens per hour per API key, e.g. 20000/hour (default: no limit).")] = None,
    max_tokens: Annotated[int, typer.Option(help="Most new tokens per phase when a request does not say.")] = 256,
    repeat_stop: RepeatOpt = REPEAT_STOP,
    max_body_mb: Annotated[float, typer.Option(help="Largest request body in MB; a larger one gets 413.")] = 4.0,
):
    """Serve the OpenAI-compatible API and a web chat, over a running launch or a local one.

    /v1/chat/completions, /v1/completions, /v1/models, /health, /metrics and the web chat at /; over the launch named by --run, else a local one started with launch's flags.
    """
    import uvicorn

    from specsot_mq.cli.serve import _launch_options, _run_file, _sigterm_as_interrupt
    from specsot_mq.server.app import ServerConfig, create_app
    from specsot_mq.stages.launch import model_id, read_run_file, start_topology

    keys = [k.strip() for item in (api_key or []) for k in item.split(",") if k.strip()]
    for flag, value, low in (("--max-concurrency", max_concurrency, 1), ("--max-queue", max_queue, 0),
                             ("--max-tokens", max_tokens, 1)):  # fmt: skip
        if value < low:
            raise SpecSotError(f"{flag} must be at least {low}, got {value}")
    for flag, value, unit in (("--timeout", timeout, "seconds"), ("--max-body-mb", max_body_mb, "MB")):
        if value <= 0:
            raise SpecSotError(f"{flag} must be above 0 {unit}, got {value}")
    per_hour = parse_budget(budget)
    sock = listen(host, port)
    info = read_run_file(_run_file(topo.run))
    launcher = None
    if info is not None:
        address, served, curve = info["client_address"], info.get("model") or model_id(model.model), info.get("keys")
        err.print(f"[dim]attached to the running launch {topo.run!r} ({address})[/]")
    else:
        launcher, spec = start_topology(_launch_options(topo, model, flags))
        curve = launcher.keys
        err.print("[dim]no running launch found: started a local one; /health says 503 until it is ready…[/]")
        address, served = spec.client_address, model_id(model.model)
    config = ServerConfig(address, served, keys, max_concurrency, max_queue, timeout, per_hour, max_tokens, repeat_stop,
                          watch=launcher.check if launcher else None, curve=curve, max_body_mb=max_body_mb)  # fmt: skip
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    shown = f"[{host}]" if ":" in host else host  # an IPv6 address, as a URL writes it
    err.print(f"serving {served} at http://{shown}:{port}/ (API at /v1, web chat at /)"
              + (" · API key required" if keys else ""))  # fmt: skip
    # uvicorn shuts down on SIGTERM, then raises the signal again: with the default handler that
    # ended this process before the finally below, and a local launch's stages were left running.
    try:
        with _sigterm_as_interrupt():
            uvicorn.Server(uvicorn.Config(create_app(config), log_level="info", loop="auto")).run(sockets=[sock])
    except KeyboardInterrupt:
        pass
    finally:
        sock.close()
        if launcher is not None:
            launcher.stop()
