"""Service commands of the `tinyloop` CLI: serve, broker, worker, submit, status, loadtest.

scripts/cli.py calls add_service_commands(main) to put them on the `tinyloop` group. This
module can also run on its own (`python -m scripts.service_cli broker ...`); that is how
`tinyloop serve` starts its child processes.

Nothing here imports torch at import time: only the `worker` command (and the direct
in-process baseline of `loadtest --side-by-side`) loads the runtime.
"""

from __future__ import annotations

import json
import logging
import re
import sys
from pathlib import Path

import click

from tinyloop.fields import EXIT_RULES, GENERATE_FIELDS

DEFAULT_FRONTEND = "tcp://127.0.0.1:5555"
DEFAULT_BACKEND = "tcp://127.0.0.1:5556"
LOG_LEVELS = ["debug", "info", "warning", "error", "critical"]
# Option types that refuse what cannot work before anything starts (click prints "Invalid value", exit 2).
PORT = click.IntRange(0, 65535)
SECONDS = click.FloatRange(0, 24 * 3600, min_open=True)
HEARTBEAT_S = click.FloatRange(0.01, 3600)  # 0 would spin the loops and declare every peer dead at once
# Paths are resolved against the caller's directory: the children run in the repository root.
FILE = click.Path(exists=True, dir_okay=False, resolve_path=True)
DIRECTORY = click.Path(exists=True, file_okay=False, resolve_path=True)


def log_level_option(fn):
    return click.option("--log-level", default="info", show_default=True,
                        type=click.Choice(LOG_LEVELS, case_sensitive=False), help="Log level of this process.")(fn)


def setup_logging(level: str) -> None:
    logging.basicConfig(level=getattr(logging, level.upper()), stream=sys.stderr,
                        format="%(asctime)s %(name)s %(levelname)s %(message)s")


def byte_size(ctx, param, value):  # click callback
    if value is None:
        return None
    from tinyloop.env import parse_bytes  # torch-free: the broker process reads this module too

    try:
        return parse_bytes(value)
    except ValueError as exc:
        raise click.BadParameter(str(exc))


def depth_options(fn):
    """A request's exit rule and depth range, shared by `generate` (in process) and `submit` (to a service)."""
    options = [
        click.option("--exit-rule", type=click.Choice(EXIT_RULES), default=None,
                     help="What early exit compares: latent change, Ouro's cdf gate, Huginn's entropy / kl / argmax "
                          "(default: the model's own)."),
        click.option("--min-loops", type=click.IntRange(1), default=None,
                     help="No token runs fewer loops: early exit's floor; at a fixed depth, a depth range a "
                          "service's load controller may use under load (elastic depth: serve --tpot-slo / "
                          "--ttft-slo; in process no controller runs and every token runs at --loops)."),
        click.option("--max-loss-increase", type=click.FloatRange(0), default=None,
                     help="Elastic depth's quality floor: the most the expected loss per token may rise below "
                          "--loops (nats, the model's loss-by-loops table)."),
    ]
    for option in reversed(options):
        fn = option(fn)
    return fn


def worker_options(fn):
    """Options shared by `worker` and `serve` (the latter passes them on to each worker)."""
    options = [
        click.option("--model", "model_path", default=None, type=click.Path(exists=True, resolve_path=True),
                     help="A .tinyloop artifact or a Hugging Face model directory (default: the bundled model)."),
        click.option("--max-seq-len", default=2048, show_default=True, type=click.IntRange(2, 1 << 20),
                     help="Longest sequence a request may reach."),
        click.option("--cache-mode", type=click.Choice(["fp16", "int8", "int4"]), default=None,
                     help="KV cache mode (default: $TINYLOOP_CACHE_MODE or fp16)."),
        click.option("--device", default=None, help="cpu, cuda, cuda:1 ... (default: cuda when present)."),
        click.option("--max-handles", default=8, show_default=True, type=click.IntRange(0, 1 << 20),
                     help="Live-handle cap per worker (LRU eviction at the cap; prefix-file scaffolds count too; "
                          "0: no warm-start handles, build_handle is refused)."),
        click.option("--vram-budget", default=None, callback=byte_size,
                     help="Memory budget per worker, e.g. 2GiB (default: free VRAM on CUDA, available RAM on CPU)."),
        click.option("--prefix-file", default=None, type=FILE,
                     help='JSON list of scaffolds for the prefix pool: [{"prefix": "...", "loops": 8}, ...].'),
        click.option("--heartbeat-interval", default=1.0, show_default=True, type=HEARTBEAT_S,
                     help="Seconds between heartbeats."),
        click.option("--threads", type=click.IntRange(1, 4096), default=None,
                     help="torch CPU threads per worker (serve default: cores / workers, so workers do not fight)."),
        click.option("--curve-dir", default=None, type=DIRECTORY,
                     help="CURVE key directory from `tinyloop keys` (encrypt and authenticate; needed across hosts)."),
        click.option("--max-lanes", default=16, show_default=True, type=click.IntRange(1, 4096),
                     help="Requests a worker batches at once (continuous batching; more wait on the broker)."),
        click.option("--weights", default=None, metavar="FORMAT",
                     help="Weight format: fp32, bf16, int8, int4 or int4:GROUP (default: the artifact's own). On the "
                          "CPU int8 / int4 products quantise activations to int8 (TINYLOOP_ACT_QUANT=off: weight-only)."),
        click.option("--prefill-chunk", type=click.IntRange(0), default=None,
                     help="Prompt tokens per prefill forward, interleaved with decode steps (0: a prompt in one "
                          "forward; default $TINYLOOP_PREFILL_CHUNK or 256)."),
        click.option("--kv-events-endpoint", default=None, metavar="ENDPOINT",
                     help="Publish KV-cache events in vLLM's format on this ZeroMQ endpoint (off by default): "
                          "tcp://*:5557 binds (serve: worker i on port + i), tcp://host:5557 connects (llm-d's "
                          "endpoint picker). docs/deploy.md, 'Routed by llm-d / the Inference Extension / Dynamo'."),
        click.option("--kv-events-replay-endpoint", default=None, metavar="ENDPOINT",
                     help="Also bind a ROUTER here that resends event batches from a sequence number."),
        click.option("--kv-events-topic", default=None,
                     help="Topic of the events (default kv@<worker name>@<model name>; llm-d: kv@<pod IP>@<model>)."),
        click.option("--kv-events-seed", default="", show_default=True,
                     help="Seed of the block hashes (llm-d's HashSeed, vLLM's PYTHONHASHSEED): the same on every "
                          "replica and across restarts."),
        click.option("--tpot-slo", default=None, callback=latency, metavar="TIME",
                     help="Elastic depth: target time per output token, e.g. 40ms; over it, requests with a depth "
                          "range (min_loops, max_loss_increase) run fewer loops (docs/engine.md, 'Elastic depth')."),
        click.option("--ttft-slo", default=None, callback=latency, metavar="TIME",
                     help="Elastic depth: target time to first token (broker queue included), e.g. 2s."),
        click.option("--queue-slo", default=None, callback=latency, metavar="TIME",
                     help="Elastic depth: target time a request waits for a lane (default: --ttft-slo)."),
    ]
    for option in reversed(options):
        fn = option(fn)
    return fn


def latency(ctx, param, value):
    """A latency target ('40ms', '0.04s', '0.04') in seconds (tinyloop/engine/elastic.py's parse_seconds)."""
    if value is None:
        return None
    from tinyloop.engine.elastic import parse_seconds  # (no torch)

    try:
        return parse_seconds(value)
    except ValueError as exc:
        raise click.BadParameter(str(exc)) from None


def worker_args(model_path, max_seq_len, cache_mode, device, max_handles, vram_budget, prefix_file,
                heartbeat_interval, threads, curve_dir, max_lanes=16, weights=None, prefill_chunk=None,
                kv_events_endpoint=None, kv_events_replay_endpoint=None, kv_events_topic=None,
                kv_events_seed="", tpot_slo=None, ttft_slo=None, queue_slo=None) -> list[str]:
    """The same options as command-line arguments, for child processes."""
    args = ["--max-seq-len", str(max_seq_len), "--max-handles", str(max_handles),
            "--heartbeat-interval", str(heartbeat_interval), "--max-lanes", str(max_lanes)]
    for flag, value in (("--model", model_path), ("--cache-mode", cache_mode), ("--device", device),
                        ("--vram-budget", vram_budget), ("--prefix-file", prefix_file), ("--threads", threads),
                        ("--curve-dir", curve_dir), ("--weights", weights), ("--prefill-chunk", prefill_chunk),
                        ("--kv-events-endpoint", kv_events_endpoint),
                        ("--kv-events-replay-endpoint", kv_events_replay_endpoint),
                        ("--kv-events-topic", kv_events_topic), ("--kv-events-seed", kv_events_seed or None),
                        ("--tpot-slo", tpot_slo), ("--ttft-slo", ttft_slo), ("--queue-slo", queue_slo)):
        if value is not None:
            args += [flag, str(value)]
    return args


# ------------------------------------------------------------------------------------ broker


@click.command("broker")
@click.option("--frontend", default=DEFAULT_FRONTEND, show_default=True, help="Endpoint clients connect to.")
@click.option("--backend", default=DEFAULT_BACKEND, show_default=True, help="Endpoint workers connect to.")
@click.option("--max-queue", default=64, show_default=True, type=click.IntRange(1),
              help="Waiting requests before new ones get 'busy'.")
@click.option("--heartbeat-interval", default=1.0, show_default=True, type=HEARTBEAT_S,
              help="Seconds between heartbeats to workers (one missed 3 times in a row is dropped).")
@click.option("--default-timeout", default=300.0, show_default=True, type=SECONDS,
              help="Deadline (s) of requests that set none.")
@click.option("--max-message-bytes", default=1 << 20, show_default=True, type=click.IntRange(4096, 1 << 30),
              help="Larger client messages get the error too_large.")
@click.option("--max-worker-memory", default=None, callback=byte_size,
              help="Refuse workers whose announced memory plan exceeds this, e.g. 4GiB.")
@click.option("--max-handles-limit", type=click.IntRange(0), default=None,
              help="Refuse workers whose handle cap exceeds this.")
@click.option("--max-attempts", default=3, show_default=True, type=click.IntRange(1),
              help="Workers a request may lose (each loss re-queues or continues it) before it fails with worker_lost.")
@click.option("--metrics-port", type=PORT, default=None,
              help="Serve /metrics, /healthz and /readyz on this port (0: any free port).")
@click.option("--metrics-host", default="127.0.0.1", show_default=True, help="Address of the metrics endpoint.")
@click.option("--ready-file", default=None, type=click.Path(dir_okay=False, resolve_path=True),
              help="Write the bound endpoints here as JSON once listening, instead of printing them (for the "
                   "process that started this broker).")
@click.option("--ready-max-error-rate", default=0.5, show_default=True, type=click.FloatRange(0, 1),
              help="/readyz fails while this share of recent requests failed on the service's side.")
@click.option("--ready-window", default=60.0, show_default=True, type=SECONDS,
              help="Seconds of requests the error rate looks at.")
@click.option("--ready-min-deadline", default=30.0, show_default=True, type=SECONDS,
              help="A timeout counts against /readyz only when the request was given at least this many seconds "
                   "(a shorter deadline that passes is the client's own).")
@click.option("--curve-dir", default=None, type=DIRECTORY,
              help="CURVE key directory from `tinyloop keys` (encrypt and authenticate; needed across hosts).")
@click.option("--affinity/--no-affinity", default=True, show_default=True,
              help="Cache-aware routing: a request goes to the worker whose prefix cache holds its prompt's prefix.")
@click.option("--affinity-wait", default=0.5, show_default=True, type=click.FloatRange(0, 3600),
              help="Seconds a request may wait for the busy worker holding its prompt prefix (when no other waits).")
@log_level_option
def broker_command(frontend, backend, max_queue, heartbeat_interval, default_timeout, max_message_bytes,
                   max_worker_memory, max_handles_limit, max_attempts, metrics_port, metrics_host, ready_file,
                   ready_max_error_rate, ready_window, ready_min_deadline, curve_dir, affinity, affinity_wait,
                   log_level) -> None:
    """Run the broker: clients connect to FRONTEND, workers to BACKEND."""
    import zmq

    from broker.broker import Broker
    from broker.metrics import serve_http
    from broker.security import KeyDirectoryError

    setup_logging(log_level)
    try:
        broker = Broker(frontend, backend, max_queue=max_queue, heartbeat_interval=heartbeat_interval,
                        default_timeout_s=default_timeout, max_message_bytes=max_message_bytes,
                        max_worker_plan_bytes=max_worker_memory, max_handles_per_worker=max_handles_limit,
                        max_attempts=max_attempts, ready_max_error_rate=ready_max_error_rate,
                        ready_window_s=ready_window, ready_min_deadline_s=ready_min_deadline, curve_dir=curve_dir,
                        affinity=affinity, affinity_wait_s=affinity_wait)
    except zmq.ZMQError as exc:  # an endpoint in use or malformed: one line, not a traceback (serve names it)
        click.echo(f"error: the broker cannot listen on {frontend} / {backend}: {exc}", err=True)
        sys.exit(1)
    except KeyDirectoryError as exc:
        click.echo(f"error: --curve-dir: {exc}", err=True)
        sys.exit(2)
    info = {"frontend": broker.frontend_endpoint, "backend": broker.backend_endpoint, "metrics": None}
    if metrics_port is not None:
        try:
            server = serve_http(broker.metrics, metrics_host, metrics_port)
        except OSError as exc:  # the port is taken (or the host is not ours): one line, not a traceback
            click.echo(f"error: --metrics-port {metrics_port}: cannot listen on {metrics_host}:{metrics_port}: "
                       f"{exc.strerror or exc}", err=True)
            sys.exit(2)
        info["metrics"] = f"http://{metrics_host}:{server.server_address[1]}"
    broker.install_signal_handlers()
    if ready_file:  # the process that started it announces the endpoints (`serve` does, once)
        tmp = Path(ready_file + ".tmp")
        tmp.write_text(json.dumps(info))
        tmp.rename(ready_file)  # atomic: readers never see half a file
    else:
        click.echo(f"broker: clients connect to {info['frontend']}, workers to {info['backend']}"
                   + (f", metrics at {info['metrics']}/metrics" if info["metrics"] else ""), err=True)
    broker.run()


# ------------------------------------------------------------------------------------ worker


@click.command("worker")
@click.option("--connect", default=DEFAULT_BACKEND, show_default=True, help="The broker's backend endpoint.")
@click.option("--name", default=None, help="Worker name in logs and status (default: worker-PID).")
@worker_options
@click.option("--kv-events-rank", default=0, show_default=True, type=click.IntRange(0, 4095),
              help="data_parallel_rank of the events; a bound --kv-events-endpoint's port moves up by it "
                   "(serve sets it).")
@click.option("--plan-only", is_flag=True, help="Print the memory plan as JSON and exit.")
@log_level_option
def worker_command(connect, name, model_path, max_seq_len, cache_mode, device, max_handles, vram_budget,
                   prefix_file, heartbeat_interval, threads, curve_dir, max_lanes, weights, prefill_chunk,
                   kv_events_endpoint, kv_events_replay_endpoint, kv_events_topic, kv_events_seed, tpot_slo,
                   ttft_slo, queue_slo, kv_events_rank, plan_only, log_level) -> None:
    """Run one worker: load the model, check its memory plan, serve requests from the broker."""
    import os

    from workers.startup import WorkerOptions, run_worker

    setup_logging(log_level)
    opts = WorkerOptions(connect=connect, name=name or f"worker-{os.getpid()}", model_path=model_path,
                         max_seq_len=max_seq_len, cache_mode=cache_mode, device=device, max_handles=max_handles,
                         vram_budget=vram_budget, prefix_file=prefix_file, heartbeat_interval=heartbeat_interval,
                         threads=threads, curve_dir=curve_dir, plan_only=plan_only, max_lanes=max_lanes,
                         weights=weights, prefill_chunk=prefill_chunk, kv_events_endpoint=kv_events_endpoint,
                         kv_events_replay=kv_events_replay_endpoint, kv_events_topic=kv_events_topic,
                         kv_events_seed=kv_events_seed, kv_events_rank=kv_events_rank, tpot_slo=tpot_slo,
                         ttft_slo=ttft_slo, queue_slo=queue_slo)
    sys.exit(run_worker(opts))


# ------------------------------------------------------------------------------------ serve


@click.command("serve")
@click.option("--workers", "n_workers", default=2, show_default=True, type=click.IntRange(1, 256),
              help="Worker processes (one model each).")
@click.option("--frontend", default=DEFAULT_FRONTEND, show_default=True, help="Endpoint clients connect to.")
@click.option("--backend", default=DEFAULT_BACKEND, show_default=True, help="Endpoint workers connect to.")
@click.option("--max-queue", default=64, show_default=True, type=click.IntRange(1),
              help="Waiting requests before new ones get 'busy'.")
@click.option("--metrics-port", type=PORT, default=None, help="Serve /metrics, /healthz and /readyz on this port.")
@click.option("--metrics-host", default="127.0.0.1", show_default=True,
              help="Address of the metrics endpoint (0.0.0.0 where a cluster router scrapes it).")
@click.option("--max-attempts", default=3, show_default=True, type=click.IntRange(1),
              help="Workers a request may lose before it fails.")
@worker_options
@click.option("--device-budget", default=None, callback=byte_size,
              help="Memory all workers on the device may use together (default: free VRAM on CUDA, available RAM on CPU).")
@click.option("--skip-plan-check", is_flag=True, help="Do not check the summed memory plans of all workers first.")
@click.option("--log-dir", default=None, type=click.Path(file_okay=False, resolve_path=True),
              help="Write broker and worker logs here (default: inherit the terminal).")
@click.option("--startup-timeout", default=300.0, show_default=True, type=SECONDS,
              help="Seconds the workers may take to load their model and report ready.")
@log_level_option
@click.option("--http-port", type=PORT, default=None,
              help="Also start the OpenAI HTTP gateway on this port (0: any free port; docs/gateway.md).")
@click.option("--http-host", default="127.0.0.1", show_default=True, help="Address the gateway listens on.")
@click.option("--api-key-file", default=None, type=FILE, help="Gateway API keys, one per line.")
def serve_command(n_workers, frontend, backend, max_queue, metrics_port, metrics_host, model_path, max_seq_len,
                  cache_mode, device, max_handles, vram_budget, prefix_file, heartbeat_interval, threads, curve_dir,
                  max_lanes, weights, prefill_chunk, kv_events_endpoint, kv_events_replay_endpoint, kv_events_topic,
                  kv_events_seed, tpot_slo, ttft_slo, queue_slo, device_budget, max_attempts, skip_plan_check, log_dir,
                  startup_timeout, log_level, http_port, http_host, api_key_file) -> None:
    """Start the broker and N workers; restart workers that die; stop cleanly on Ctrl-C or SIGTERM."""
    from broker.launcher import threads_per_worker
    from broker.supervisor import Supervisor

    setup_logging(log_level)
    if threads is None and (device or "cpu").startswith("cpu"):
        threads = threads_per_worker(n_workers)  # N workers share the cores instead of oversubscribing
    wargs = worker_args(model_path, max_seq_len, cache_mode, device, max_handles, vram_budget, prefix_file,
                        heartbeat_interval, threads, curve_dir, max_lanes, weights, prefill_chunk, kv_events_endpoint,
                        kv_events_replay_endpoint, kv_events_topic, kv_events_seed, tpot_slo, ttft_slo, queue_slo)
    gateway = None
    if http_port is not None:  # the gateway waits for the broker by itself (its /health says when it is ready)
        if "*" in frontend:
            raise click.BadParameter("--http-port needs a fixed --frontend endpoint (no '*' port)",
                                     param_hint="--frontend")
        gateway = gateway_args(frontend, http_host, http_port, api_key_file=api_key_file, curve_dir=curve_dir)
    supervisor = Supervisor(n_workers=n_workers, frontend=frontend, backend=backend, worker_args=wargs,
                            broker_args=["--max-queue", str(max_queue), "--heartbeat-interval", str(heartbeat_interval),
                                         "--max-attempts", str(max_attempts)]
                            + (["--metrics-port", str(metrics_port), "--metrics-host", metrics_host]
                               if metrics_port is not None else [])
                            + (["--curve-dir", curve_dir] if curve_dir else []),
                            curve_dir=curve_dir, gateway_args=gateway,
                            log_dir=log_dir, log_level=log_level)
    sys.exit(supervisor.run(check_plan=not skip_plan_check, device_budget=device_budget,
                            startup_timeout=startup_timeout))


def gateway_args(frontend: str, host: str, port: int, *, api_key_file: str | None = None,
                 curve_dir: str | None = None) -> list[str]:
    """The `tinyloop gateway` arguments of `serve --http-port`'s gateway child (broker/supervisor.py starts and
    restarts it, as it does the broker)."""
    args = ["--connect", frontend, "--host", host, "--port", str(port)]
    args += ["--api-key-file", api_key_file] if api_key_file else []
    args += ["--curve-dir", curve_dir] if curve_dir else []
    return args


# ------------------------------------------------------------------------------------ submit / status


def parse_speculative_option(value: str | None) -> dict:
    """--speculative D:V:A[:W] -> the speculative op's params (parsed here: `submit` never imports torch)."""
    if value is None:
        return {}
    try:
        nums = [int(x) for x in value.split(":")]
    except ValueError:
        nums = []
    if len(nums) not in (3, 4) or min(nums) < 1:
        raise click.BadParameter(f"{value!r} must be draft:verify:ahead[:width] with positive integers, e.g. 2:8:4",
                                 param_hint="--speculative")
    return dict(zip(("draft_loops", "verify_loops", "draft_ahead", "tree_width"), nums))


@click.command("submit")
@click.argument("prompt")
@click.option("--connect", default=DEFAULT_FRONTEND, show_default=True, help="The broker's frontend endpoint.")
@click.option("--op", default="generate", show_default=True,
              type=click.Choice(["generate", "generate_pool", "speculative"]),
              help="generate_pool: through the workers' prefix pool (--prefix-file).")
@click.option("--max-tokens", default=64, show_default=True, help="Tokens to generate at most.")
@click.option("--loops", type=int, default=None, help="Loop count (default: the model's).")
@click.option("--temperature", default=0.0, show_default=True, help="Sampling temperature (0: greedy).")
@click.option("--top-k", default=0, show_default=True, help="Sample among the k likeliest tokens (0: all).")
@click.option("--top-p", default=1.0, show_default=True, help="Nucleus sampling: the smallest set of this mass.")
@click.option("--repetition-penalty", type=float, default=None, help="CTRL-style penalty for repeated tokens (1 = off).")
@click.option("--seed", type=int, default=None, help="Sampler seed: the same seed gives the same output.")
@click.option("--stop", multiple=True, help="Stop sequence (repeatable).")
@click.option("--grammar", default=None, help="Constrain output: EBNF (contains ::=), a JSON schema, or a regex.")
@click.option("--beam-size", type=int, default=None, help="Beam search width (greedy only).")
@click.option("--cache-window", type=int, default=None, help="Sliding attention window in tokens (0 = off).")
@click.option("--early-exit", type=float, default=None, help="Early-exit threshold of the exit rule (0 = off).")
@depth_options
@click.option("--priority", type=int, default=None,
              help="Lower is more important (vLLM's convention, default 0): a worker admits waiting requests by it, and "
                   "under load takes depth from the least important ranged requests first.")
@click.option("--speculative", default=None, metavar="D:V:A[:W]",
              help="Self-speculative decode (op speculative): draft loops, verify loops, draft-ahead, tree width.")
@click.option("--chat", is_flag=True, help="PROMPT is a user message: the worker renders it with the model's chat "
              "template (the chat op).")
@click.option("--system", default=None, help="With --chat: a system message before the user's.")
@click.option("--timeout", default=120.0, show_default=True, help="Request deadline in seconds.")
@click.option("--no-stream", is_flag=True, help="Wait for the whole answer instead of streaming tokens.")
@click.option("--json", "as_json", is_flag=True, help="Print the final reply as JSON.")
@click.option("--curve-dir", default=None, type=click.Path(exists=True, file_okay=False),
              help="CURVE key directory from `tinyloop keys` (encrypt and authenticate; needed across hosts).")
def submit_command(prompt, connect, op, max_tokens, loops, temperature, top_k, top_p, repetition_penalty, seed, stop,
                   grammar, beam_size, cache_window, early_exit, exit_rule, min_loops, max_loss_increase, priority,
                   speculative, chat, system, timeout, no_stream, as_json, curve_dir) -> None:
    """Send one request to a running service and stream the answer.

    stdout carries the prompt and the answer only (printed from the first token on, so a rejected request
    prints nothing there); the stats line and errors go to stderr."""
    from broker.client import BadEndpoint, Client, InvalidRequest, ServiceError, build_request, generate_params

    config = dict(max_tokens=max_tokens, loops=loops, temperature=temperature, top_k=top_k, top_p=top_p, seed=seed,
                  repetition_penalty=repetition_penalty, grammar=grammar, beam_size=beam_size,
                  cache_window=cache_window, early_exit_threshold=early_exit, exit_rule=exit_rule, min_loops=min_loops,
                  max_loss_increase=max_loss_increase, priority=priority)
    config = {k: v for k, v in config.items() if v is not None}
    if stop:
        config["stop_sequences"] = list(stop)
    spec = parse_speculative_option(speculative)
    if spec:
        if op not in ("generate", "speculative"):
            raise click.BadParameter("--speculative runs the speculative op; it cannot go with --op " + op,
                                     param_hint="--speculative")
        op = "speculative"
    params = {**generate_params(prompt, config), **spec}
    if chat:  # the same settings, with the messages in place of the prompt; the user's message is printed above the answer
        if op not in ("generate", "speculative"):
            raise click.BadParameter("--chat sends the chat op; it cannot go with --op " + op, param_hint="--chat")
        params.pop("prompt")
        params["messages"] = ([{"role": "system", "content": system}] if system else []) + \
            [{"role": "user", "content": prompt}]
        op, prompt = "chat", f"{prompt}\n"
    printed = False
    try:
        build_request(op, params, not (no_stream or as_json), timeout, None)  # schema errors before any output
        with Client(connect, timeout=timeout, curve_dir=curve_dir) as client:
            if no_stream or as_json:
                reply = client.submit(op, params, timeout=timeout).result()
                if as_json:
                    click.echo(json.dumps(reply.result))
                    return
                click.echo(prompt + reply.text)
            else:
                with client.submit(op, params, stream=True, timeout=timeout) as pending:
                    for event in pending:
                        if not printed:
                            click.echo(prompt, nl=False)
                            printed = True
                        click.echo(event.text, nl=False)
                reply = pending.result()
                click.echo(("" if printed else prompt + reply.text))
                printed = False
            click.echo(stats_line(reply), err=True)
    except ServiceError as exc:
        if printed:
            click.echo()  # end the partial answer's line; the error gets its own line on stderr
        hint = ""
        if exc.code == "config_error" and "max_seq_len" in str(exc):  # the runtime's wording names load_model
            hint = " (for the service: lower --max-tokens, or start `tinyloop serve` with a larger --max-seq-len)"
        if isinstance(exc, BadEndpoint):  # a bad option, said as click says it (exit 2)
            raise click.BadParameter(str(exc), param_hint=exc.option) from None
        click.echo(f"error: {in_option_words(str(exc))}{hint}", err=True)
        sys.exit(2 if isinstance(exc, InvalidRequest) else 1)  # 2: the request itself is wrong, as for `generate`


# The request fields whose command-line option is not --<the field's name, with dashes>.
OPTION_FOR_FIELD = {"stop_sequences": "--stop", "early_exit_threshold": "--early-exit"}
REFUSED_FIELD = re.compile(r"^(?:[a-z_]+: )?(?:op '\w+': )?(?:field '(\w+)'|GenerateConfig\.(\w+))")  # [code: ]


def in_option_words(message: str) -> str:
    """An error the wire or the runtime gave, said with the option the value came from: "invalid_field: op 'generate':
    field 'loops' must be ..." and "GenerateConfig.loops must be ..." both become "--loops must be ..."."""
    found = REFUSED_FIELD.match(message)
    name = found and (found.group(1) or found.group(2))
    if not name or name not in GENERATE_FIELDS:
        return message
    return OPTION_FOR_FIELD.get(name, "--" + name.replace("_", "-")) + message[found.end():]


def stats_line(reply: "Reply") -> str:  # noqa: F821 - broker.client.Reply, imported lazily (no zmq at import)
    """The stats line `submit` prints on stderr."""
    stats = reply.stats
    line = (f"[worker {reply.worker}: {stats.get('generated_tokens')} tokens, stop={stats.get('stop_reason')}, "
            f"prefill {stats.get('prefill_ms') or 0:.1f} ms, first token {stats.get('first_token_ms') or 0:.1f} ms, "
            f"decode {stats.get('decode_ms') or 0:.1f} ms, loops {stats.get('loops_mean') or 0:.2f}")
    if stats.get("drafted") is not None:
        drafted, accepted = stats["drafted"], stats.get("accepted") or 0
        line += (f", speculative {accepted}/{drafted} drafted tokens accepted ({accepted / drafted if drafted else 0:.0%}), "
                 f"{stats.get('tokens_per_verify') or 0:.2f} tokens per verify step")
    if stats.get("tokens_below_loops"):  # elastic depth (or early exit) gave up depth: say what was traded
        line += (f" (min {stats.get('loops_min')}, {stats['tokens_below_loops']} tokens below the asked loops, "
                 f"estimated loss +{stats.get('loss_increase') or 0:.4f} nats/token)")
    if stats.get("continued_after"):
        line += f", continued after {stats['continued_after']} tokens on another worker"
    return line + "]"


@click.command("status")
@click.option("--connect", default=DEFAULT_FRONTEND, show_default=True, help="The broker's frontend endpoint.")
@click.option("--json", "as_json", is_flag=True, help="Print the broker's whole status as JSON.")
@click.option("--timeout", default=5.0, show_default=True, type=SECONDS, help="Seconds to wait for the answer.")
@click.option("--curve-dir", default=None, type=click.Path(exists=True, file_okay=False),
              help="CURVE key directory from `tinyloop keys` (encrypt and authenticate; needed across hosts).")
def status_command(connect, as_json, timeout, curve_dir) -> None:
    """Show the service's workers, queue and handles."""
    from broker.client import BadEndpoint, Client, ServiceError

    try:
        with Client(connect, curve_dir=curve_dir) as client:
            status = client.status(timeout=timeout)
    except BadEndpoint as exc:  # a bad option, said as click says it (exit 2)
        raise click.BadParameter(str(exc), param_hint=exc.option) from None
    except ServiceError as exc:
        click.echo(f"error: {exc}", err=True)
        sys.exit(1)
    if as_json:
        click.echo(json.dumps(status, indent=2))
        return
    click.echo(f"broker {status['frontend']} up {status['uptime_s']:.0f}s: {len(status['workers'])} worker(s), "
               f"queue {status['queue']}/{status['max_queue']}, in flight {status['in_flight']}"
               + (" (stopping)" if status["stopping"] else ""))
    ready = status.get("ready") or {}
    if ready.get("ready"):
        click.echo(f"ready: yes (error rate {ready['error_rate']:.0%} of {ready['finished']} requests in the last "
                   f"{ready['window_s']:.0f}s)")
    elif ready:
        click.echo("ready: NO: " + "; ".join(ready["problems"]))
    click.echo(f"  {'name':<16} {'pid':>7} {'device':<8} {'state':<8} {'handles':>9} {'plan MiB':>9} {'served':>7}")
    for w in status["workers"]:
        click.echo(f"  {w['name']:<16} {w['pid']:>7} {w['device']:<8} {w['state']:<8} "
                   f"{str(w['handles']) + '/' + str(w['max_handles']):>9} {w['plan_bytes'] / 2**20:>9.1f} {w['served']:>7}")


# ------------------------------------------------------------------------------------ loadtest


@click.command("loadtest")
@click.option("--connect", default=DEFAULT_FRONTEND, show_default=True, help="The broker's frontend endpoint.")
@click.option("--mode", type=click.Choice(["closed", "open"]), default="closed", show_default=True,
              help="closed: fixed concurrency; open: Poisson arrivals at --rate.")
@click.option("--concurrency", default="4", show_default=True,
              help="Clients of the closed loop; a list (1,2,4,8) runs one load per value, for --plot.")
@click.option("--rate", default=2.0, show_default=True, help="Requests per second (open loop).")
@click.option("--requests", "n_requests", type=int, default=None, help="Requests to send [default: 32; --soak: 10000].")
@click.option("--prompt", "prompts", multiple=True, help="Prompt (repeatable; default: a few code snippets).")
@click.option("--max-tokens", default=16, show_default=True, help="Tokens per request.")
@click.option("--op", default="generate", show_default=True, type=click.Choice(["generate", "generate_pool", "ping"]),
              help="ping: a round trip through a worker without the model (the broker's routing rate).")
@click.option("--timeout", default=120.0, show_default=True, help="Deadline (s) of each request.")
@click.option("--seed", default=0, show_default=True, help="Seed of the arrival process.")
@click.option("--json", "json_path", default=None, help="Write the results here as JSON.")
@click.option("--plot", "plot_path", default=None,
              help="Draw throughput and latency percentiles versus concurrency (PNG; needs matplotlib).")
@click.option("--soak", is_flag=True,
              help="Start a service itself and print the broker's and workers' memory every 1,000 requests, "
                   "with the growth per 1,000 requests (leak check).")
@click.option("--side-by-side", is_flag=True,
              help="Start services itself and compare: broker vs direct generate, 2 workers vs 1, routing rate.")
@click.option("--batching", is_flag=True,
              help="Start services itself and compare continuous batching: service vs in-process generate_batch vs "
                   "the service of --before; open-loop TTFT/TPOT with and without chunked prefill; mixed depth.")
@click.option("--before", default="517ca22", show_default=True, help="--batching, --behind-long: the revision to compare with.")
@click.option("--behind-long", is_flag=True,
              help="Start 1-worker services itself (this tree and --before) and time 4 short requests sent right after "
                   "one long beam / speculative / grammar request.")
@click.option("--prefix-routing", is_flag=True,
              help="Start services itself and compare cache-aware routing with and without affinity: 2 workers, "
                   "4 scaffolds x (--requests / 4) suffixes.")
@click.option("--kv-routing", is_flag=True,
              help="Start services itself and compare two 1-worker replicas behind a router fed by their KV-cache "
                   "events with round robin (8 shared prefixes x 8 suffixes), and the events' cost.")
@click.option("--elastic", is_flag=True,
              help="Start 1- and 2-worker services with latency targets and compare fixed depth with elastic depth "
                   "(loops 16, floor 4) under open-loop load at 0.5x-2x the fixed-depth capacity (docs/engine.md, "
                   "'Elastic depth').")
@click.option("--model", "model_path", default=None, type=click.Path(exists=True, resolve_path=True),
              help="Model for --side-by-side (default: bundled).")
@click.option("--threads", type=int, default=None,
              help="--side-by-side: torch threads per model (default: cores for one model, cores/2 for each of two).")
@click.option("--curve-dir", default=None, type=click.Path(exists=True, file_okay=False),
              help="CURVE key directory from `tinyloop keys` (encrypt and authenticate; needed across hosts).")
@click.option("--weights", default=None, metavar="FORMAT",
              help="Weight format of the models the load test starts, in its workers and in-process: fp32, bf16, "
                   "int8, int4 or int4:GROUP.")
def loadtest_command(connect, mode, concurrency, rate, n_requests, prompts, max_tokens, op, timeout, seed, json_path,
                     plot_path, soak, side_by_side, batching, before, behind_long, prefix_routing, kv_routing,
                     elastic, model_path, threads, curve_dir, weights) -> None:
    """Load a running service (or, with --side-by-side or --soak, services it starts) and report latency and throughput."""
    import os

    from scripts.bench.plots import PlotError, write_results
    from scripts.load import loadtest

    if weights:  # the workers inherit the environment; in-process models read it in load_model
        from tinyloop.formats import parse_spec

        try:
            parse_spec(weights)
        except ValueError as e:
            raise click.BadParameter(str(e), param_hint="--weights")
        os.environ["TINYLOOP_WEIGHTS"] = weights

    try:
        levels = [int(c) for c in str(concurrency).split(",")]
    except ValueError:
        raise click.BadParameter(f"{concurrency!r}: a number or a comma-separated list of numbers", param_hint="--concurrency")
    concurrency = levels[0]

    if soak:
        total = n_requests or 10_000
        results = loadtest.soak(n_requests=total, every=max(1, min(1000, total // 4)), max_tokens=max_tokens,
                                concurrency=concurrency,
                                model_path=model_path, threads=threads, echo=click.echo)
    elif batching:
        from scripts.load.batching import batching_side_by_side

        results = batching_side_by_side(before=before, n_requests=n_requests or 64, max_tokens=max_tokens,
                                        concurrency=concurrency, echo=click.echo)
    elif behind_long:
        from scripts.load.behind import behind_long_side_by_side

        results = behind_long_side_by_side(before=before, echo=click.echo)
    elif elastic:
        from scripts.load.elastic import elastic_side_by_side

        results = elastic_side_by_side(model_path=model_path, n_requests=n_requests or 160, max_tokens=max_tokens,
                                       threads=threads, echo=click.echo)
    elif kv_routing:
        from scripts.load.kv_routing import kv_routing_side_by_side

        results = kv_routing_side_by_side(model_path=model_path, max_tokens=max_tokens, concurrency=concurrency,
                                          threads=threads or 1, echo=click.echo)
    elif prefix_routing:
        results = loadtest.prefix_routing_side_by_side(model_path=model_path, n_suffixes=max(1, (n_requests or 64) // 4),
                                                       max_tokens=max_tokens, concurrency=concurrency,
                                                       threads=threads or 1, echo=click.echo)
    elif side_by_side:
        results = loadtest.side_by_side(model_path=model_path, n_requests=n_requests or 160, max_tokens=max_tokens,
                                        concurrency=concurrency, threads=threads, echo=click.echo)
    else:
        sweep = [loadtest.run_load(connect, mode=mode, concurrency=c, rate=rate, n_requests=n_requests or 32,
                                   prompts=list(prompts) or None, max_tokens=max_tokens, op=op, timeout=timeout,
                                   seed=seed, progress=True, curve_dir=curve_dir) for c in levels]
        for r in sweep:
            click.echo(loadtest.format_summary(r))
        results = sweep[0] if len(sweep) == 1 else {"sweep": sweep}
    try:
        write_results(results, json_path, plot_path, "loadtest")
    except PlotError as e:
        raise click.ClickException(str(e))


@click.command("keys")
@click.argument("directory", type=click.Path(file_okay=False))
def keys_command(directory) -> None:
    """Create CURVE keys in DIRECTORY: the broker's, one pair for clients and gateways, one for workers."""
    from broker.security import create_keys

    path = create_keys(directory)
    click.echo(f"keys written to {path}: give the broker --curve-dir {path}; clients and gateways need broker.key "
               f"and client.key_secret, workers broker.key and worker.key_secret (--curve-dir with those two files; "
               f"a client key is refused on the workers' socket and a worker key on the clients')")


SERVICE_COMMANDS = (serve_command, broker_command, worker_command, submit_command, status_command, loadtest_command,
                    keys_command)


def add_service_commands(group: click.Group) -> None:
    """Register serve, broker, worker, submit, status, loadtest and keys on a click group."""
    for command in SERVICE_COMMANDS:
        group.add_command(command)


@click.group()
def service_main() -> None:
    """TinyLoop service commands (also available as `tinyloop <command>`)."""


add_service_commands(service_main)

if __name__ == "__main__":
    service_main()
