"""`tinyloop gateway`: the OpenAI-compatible HTTP gateway in front of a running broker.

Registered on the `tinyloop` group by scripts/cli.py; `tinyloop serve --http-port` starts it
as a child process with `python -m scripts.gateway_cli` (scripts/service_cli.py gateway_args). Imports no torch.
"""
from __future__ import annotations

import socket
import sys
from pathlib import Path

import click

from broker.openai_schema import WorkLimits  # torch-free, and cheap: no Starlette
from scripts.service_cli import DEFAULT_FRONTEND, DIRECTORY, FILE, PORT, SECONDS, log_level_option, setup_logging


@click.command("gateway")
@click.option("--connect", default=DEFAULT_FRONTEND, show_default=True, help="The broker's frontend endpoint.")
@click.option("--host", default="127.0.0.1", show_default=True, help="HTTP address to listen on.")
@click.option("--port", default=8000, show_default=True, type=PORT, help="HTTP port (0: any free port).")
@click.option("--api-key", "api_keys", multiple=True,
              help="Require 'Authorization: Bearer KEY' on /v1/* (repeatable; default: no auth).")
@click.option("--api-key-file", default=None, type=FILE,
              help="File with accepted keys, one per line (# comments allowed).")
@click.option("--model-name", default=None,
              help="Model id to serve under (default: from the workers: tinyloop-default for the bundled model, "
                   "else the artifact's file name without .tinyloop; /v1/models is 503 until a worker has said which).")
@click.option("--max-body-bytes", default=1 << 20, show_default=True, type=click.IntRange(1),
              help="Larger request bodies get 413.")
@click.option("--timeout", default=300.0, show_default=True, type=SECONDS,
              help="Deadline (s) of a request that sets no 'timeout' field; past it: 504.")
@click.option("--max-fanout", default=WorkLimits.max_requests, show_default=True, type=click.IntRange(1),
              help="Broker requests one HTTP call may make (prompts x n); more is a 400 before any is sent.")
@click.option("--max-work-tokens", default=WorkLimits.max_tokens, show_default=True, type=click.IntRange(1),
              help="Tokens one HTTP call may ask to generate (prompts x n x max_tokens); more is a 400.")
@click.option("--max-prompt-size", default=WorkLimits.max_prompt, show_default=True, type=click.IntRange(1),
              help="Prompt characters (text) or token ids one HTTP call may send (prompts x n x length); more is a 400.")
@click.option("--curve-dir", default=None, type=DIRECTORY,
              help="CURVE key directory to reach a broker started with --curve-dir.")
@click.option("--metrics-port", default=None, type=PORT,
              help="Serve /metrics on this port (same --host) instead of the API port, so a public Service of the "
                   "API port does not expose it.")
@log_level_option
@click.option("--ready-file", default=None, type=click.Path(dir_okay=False, resolve_path=True),
              help="Write the gateway's URL here as JSON once it listens (for the process that started it).")
def gateway_command(connect, host, port, api_keys, api_key_file, model_name, max_body_bytes, timeout, max_fanout,
                    max_work_tokens, max_prompt_size, curve_dir, metrics_port, log_level, ready_file) -> None:
    """Serve the OpenAI HTTP API (completions, chat, models, health, metrics) in front of a broker."""
    from broker.client import BadEndpoint, check_endpoint
    from broker.gateway import listen, load_api_keys, run_gateway
    from broker.security import CLIENT, KeyDirectoryError, make_client

    setup_logging(log_level)
    try:  # before the banner: a typo in --connect or a key directory without the client's keys is one error line
        check_endpoint(connect)
    except BadEndpoint as exc:
        raise click.BadParameter(str(exc), param_hint=exc.option) from None
    if curve_dir is not None:
        import zmq

        probe = zmq.Context.instance().socket(zmq.DEALER)
        try:
            make_client(probe, curve_dir, CLIENT)
        except KeyDirectoryError as exc:
            raise click.BadParameter(str(exc), param_hint="--curve-dir") from None
        finally:
            probe.close()
    keys = load_api_keys(api_keys, api_key_file)
    if (api_keys or api_key_file) and not keys:
        raise click.BadParameter("no API key found in --api-key / --api-key-file")
    if metrics_port is not None:  # taken? say so now, in one line, before anything is announced
        try:
            with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as probe:
                probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                probe.bind((host, metrics_port))
        except OSError as exc:
            click.echo(f"error: --metrics-port {metrics_port}: cannot listen on {host}:{metrics_port}: "
                       f"{exc.strerror or exc}", err=True)
            sys.exit(2)
    try:
        sock = listen(host, port)
    except OSError as exc:
        click.echo(f"error: the gateway cannot listen on {host}:{port}: {exc.strerror or exc}", err=True)
        sys.exit(1)
    if not ready_file:  # else the process that started it announces it (`serve` does, once)
        click.echo(f"gateway: http://{host}:{sock.getsockname()[1]}/v1 -> broker {connect}"
                   + (" (API key required)" if keys else ""), err=True)
    run_gateway(connect, sock, ready_file, metrics_port=metrics_port, api_keys=keys, model_name=model_name,
                max_body_bytes=max_body_bytes, timeout=timeout, curve_dir=curve_dir,
                limits=WorkLimits(max_requests=max_fanout, max_tokens=max_work_tokens, max_prompt=max_prompt_size))


@click.command("gateway-loadtest")
@click.option("--workers", default=2, show_default=True, type=click.IntRange(1), help="Workers of the service it starts.")
@click.option("--threads", type=click.IntRange(1), default=None, help="torch threads per worker (default: cores / workers).")
@click.option("--rounds", default=4, show_default=True, help="Alternating rounds per path.")
@click.option("--requests", "n_requests", default=16, show_default=True, help="Requests per round.")
@click.option("--concurrency", default=4, show_default=True, type=click.IntRange(1), help="Requests in flight at once.")
@click.option("--max-tokens", default=16, show_default=True, type=click.IntRange(1), help="Tokens per request.")
@click.option("--model", "model_path", default=None, type=click.Path(exists=True, dir_okay=False, resolve_path=True),
              help="Path to a .tinyloop artifact (default: the bundled model).")
@click.option("--json", "json_path", default=None, help="Write the results here as JSON.")
def gateway_loadtest_command(workers, threads, rounds, n_requests, concurrency, max_tokens, model_path,
                             json_path) -> None:
    """Same load through the HTTP gateway and the msgpack client, side by side (starts its own service)."""
    import json

    from scripts.load.gateway import gateway_side_by_side

    results = gateway_side_by_side(workers=workers, threads=threads, rounds=rounds, n_requests=n_requests,
                                   concurrency=concurrency, max_tokens=max_tokens, model_path=model_path,
                                   echo=click.echo)
    if json_path:
        Path(json_path).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    gateway_command()
