"""`tinyloop gateway`: the OpenAI-compatible HTTP gateway in front of a running broker.

Registered on the `tinyloop` group by scripts/cli.py; `tinyloop serve --http-port` starts it
as a child process with `python -m scripts.gateway_cli` (start_gateway below). Imports no torch.
"""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import click

DEFAULT_FRONTEND = "tcp://127.0.0.1:5555"


@click.command("gateway")
@click.option("--connect", default=DEFAULT_FRONTEND, show_default=True, help="The broker's frontend endpoint.")
@click.option("--host", default="127.0.0.1", show_default=True, help="HTTP address to listen on.")
@click.option("--port", default=8000, show_default=True, help="HTTP port.")
@click.option("--api-key", "api_keys", multiple=True,
              help="Require 'Authorization: Bearer KEY' on /v1/* (repeatable; default: no auth).")
@click.option("--api-key-file", default=None, type=click.Path(exists=True, dir_okay=False),
              help="File with accepted keys, one per line (# comments allowed).")
@click.option("--model-name", default=None,
              help="Model id to serve under (default: from the workers: tinyloop-default for the bundled model, "
                   "else the artifact's file name without .tinyloop).")
@click.option("--max-body-bytes", default=1 << 20, show_default=True, help="Larger request bodies get 413.")
@click.option("--timeout", default=300.0, show_default=True,
              help="Deadline (s) of a request that sets no 'timeout' field; past it: 504.")
@click.option("--curve-dir", default=None, type=click.Path(exists=True, file_okay=False),
              help="CURVE key directory to reach a broker started with --curve-dir.")
@click.option("--log-level", default="info", show_default=True)
def gateway_command(connect, host, port, api_keys, api_key_file, model_name, max_body_bytes, timeout, curve_dir,
                    log_level) -> None:
    """Serve the OpenAI HTTP API (completions, chat, models, health, metrics) in front of a broker."""
    import logging

    from broker.gateway import load_api_keys, run_gateway

    logging.basicConfig(level=getattr(logging, log_level.upper()), stream=sys.stderr,
                        format="%(asctime)s %(name)s %(levelname)s %(message)s")
    keys = load_api_keys(api_keys, api_key_file)
    if (api_keys or api_key_file) and not keys:
        raise click.BadParameter("no API key found in --api-key / --api-key-file")
    click.echo(f"gateway: http://{host}:{port}/v1 -> broker {connect}" + (" (API key required)" if keys else ""),
               err=True)
    run_gateway(connect, host, port, api_keys=keys, model_name=model_name, max_body_bytes=max_body_bytes,
                timeout=timeout, curve_dir=curve_dir)


@click.command("gateway-loadtest")
@click.option("--workers", default=2, show_default=True)
@click.option("--threads", type=int, default=None, help="torch threads per worker (default: cores / workers).")
@click.option("--rounds", default=4, show_default=True, help="Alternating rounds per path.")
@click.option("--requests", "n_requests", default=16, show_default=True, help="Requests per round.")
@click.option("--concurrency", default=4, show_default=True)
@click.option("--max-tokens", default=16, show_default=True)
@click.option("--model", "model_path", default=None, help="Path to a .tinyloop artifact (default: the bundled model).")
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


def start_gateway(frontend: str, host: str, port: int, *, api_key_file: str | None = None,
                  curve_dir: str | None = None, log_path: str | Path | None = None,
                  log_level: str = "info") -> subprocess.Popen:
    """Start the gateway as a child process the way `tinyloop serve` starts its broker and workers."""
    from broker import launcher

    if "*" in frontend:
        raise click.BadParameter("--http-port needs a fixed --frontend endpoint (no '*' port)")
    args = ["--connect", frontend, "--host", host, "--port", str(port), "--log-level", log_level]
    args += ["--api-key-file", api_key_file] if api_key_file else []
    args += ["--curve-dir", curve_dir] if curve_dir else []
    out = open(log_path, "ab") if log_path else None
    try:
        return subprocess.Popen([sys.executable, "-m", "scripts.gateway_cli", *args], env=launcher.child_env(),
                                cwd=str(launcher.REPO_ROOT), stdout=out, stderr=subprocess.STDOUT if out else None,
                                start_new_session=True, preexec_fn=launcher._die_with_parent)
    finally:
        if out:
            out.close()


if __name__ == "__main__":
    gateway_command()
