"""Starting a worker: measure the memory budget, load the model, check the plan, then serve.

Order matters: the budget (free VRAM on CUDA, available RAM on CPU, or --vram-budget) is
measured first, and the plan (weights + KV block pool + workspace + handle states, from the
artifact's header alone) is compared with it before any weights are loaded, so an over-budget
worker never accepts a request. It exits with WorkerExit.OVER_BUDGET and prints the itemised plan.
The model is then loaded with exactly the planned block pool.
"""

from __future__ import annotations

import importlib
import json
import logging
import sys
import time
from dataclasses import dataclass

from broker.protocol import WorkerExit

log = logging.getLogger("tinyloop.worker")

@dataclass
class WorkerOptions:
    connect: str
    name: str = "worker"
    model_path: str | None = None
    max_seq_len: int = 2048
    cache_mode: str | None = None
    device: str | None = None
    max_handles: int = 8
    vram_budget: int | None = None
    prefix_file: str | None = None
    heartbeat_interval: float = 1.0
    heartbeat_liveness: int = 3
    threads: int | None = None  # torch CPU threads (None: torch's default)
    curve_dir: str | None = None  # CURVE key directory (see broker/security.py)
    plan_only: bool = False  # print the memory plan as JSON and exit (used by `tinyloop serve`)
    max_lanes: int = 16  # requests batched at once (tinyloop.Scheduler lanes)
    prefill_chunk: int | None = None  # prompt tokens per prefill forward (None: the model's default)
    weights: str | None = None  # weight format, 'int8' or 'int4:64' (None: the artifact's own; tinyloop/formats.py)
    # KV-cache events for cluster routers (workers/kv_events.py; docs/deploy.md): off without an endpoint
    kv_events_endpoint: str | None = None
    kv_events_replay: str | None = None  # a ROUTER endpoint that resends batches from a sequence number
    kv_events_topic: str | None = None  # default kv@<name>@<model>
    kv_events_seed: str = ""  # the block hashes' seed (llm-d's HashSeed, vLLM's PYTHONHASHSEED)
    kv_events_rank: int = 0  # data_parallel_rank in each batch; bound endpoints' ports move up by it
    # elastic depth's latency targets in seconds (tinyloop/engine/elastic.py); none: every lane at its asked depth
    tpot_slo: float | None = None
    ttft_slo: float | None = None
    queue_slo: float | None = None


def refuse(opts: WorkerOptions, why: BaseException) -> int:
    """A configuration no restart can fix: say why on stderr (serve names the last line) and exit fatally."""
    print(f"worker {opts.name}: refusing to start: {why}", file=sys.stderr, flush=True)
    return WorkerExit.BAD_CONFIG


# Shorter than one cache block (16 tokens), so the prefix cache keeps nothing of it.
WARM_UP_PROMPT = "def warm_up(x):"


def warm_up(model) -> None:
    """One short generate before "ready", in the thread that will compute (workers/worker.py: run): it builds the
    C kernels or finds them in the cache (tinyloop/kernels/cpu.py; a cold build takes 10-20 s), starts the OpenMP
    threads and pays the first forward's one-time costs, so the first request after ready runs at full speed."""
    import tinyloop

    t0 = time.perf_counter()
    tinyloop.generate(model, WARM_UP_PROMPT, tinyloop.GenerateConfig(max_tokens=2))
    log.info("warmed up in %.2f s", time.perf_counter() - t0)


def pool_budget(plan, vram_budget: int | None) -> int:
    """load_model's memory_budget (weights, workspace and the block pool, which gets the rest): with --vram-budget,
    what the budget leaves after the process baseline and the handle states, so the pool takes the worker's whole
    share; without one, exactly the planned pool."""
    outside = plan.bytes_of("process baseline") + plan.bytes_of("handle states")
    return (vram_budget if vram_budget is not None else plan.total_bytes) - outside


def run_worker(opts: WorkerOptions) -> int:
    """Run a worker until it is stopped; returns the process exit code."""
    import torch

    import tinyloop
    from tinyloop.artifact import DEFAULT_ARTIFACT
    from tinyloop.env import env_choice
    from tinyloop.formats import parse_spec
    from tinyloop.hf import config_and_dtype  # an artifact's header or a Hugging Face directory's config.json
    from tinyloop.memory import available_bytes, available_what, baseline_what, blocks_for, process_bytes
    from tinyloop.loader import default_device, weight_format_for

    from workers.engine import ModelEngine, load_prefix_file
    from workers.worker import WorkerProcess

    if opts.threads:
        torch.set_num_threads(opts.threads)
    device = opts.device or str(default_device())
    available = available_bytes(device)  # measured before the model takes its share
    # A grammar request needs xgrammar (it imports transformers: ~1 s, ~50 MiB). Import it now, so that the first
    # such request does not stall every lane of the batch while it loads, and so that the baseline counts it.
    importlib.import_module("tinyloop.grammar")
    baseline = process_bytes(device)  # the process itself, before any weights: part of what the budget covers
    if opts.vram_budget is not None:
        budget, budget_what = opts.vram_budget, "--vram-budget"
    else:
        budget, budget_what = available, available_what(device)
    try:
        prefixes = load_prefix_file(opts.prefix_file) if opts.prefix_file else []
    except SystemExit as exc:  # it says what is wrong with the file
        return refuse(opts, exc)
    # The plan comes from the artifact's header before anything large is loaded; the model then gets exactly the
    # planned block pool (weights + pool + workspace: load_model's memory_budget).
    try:
        path = opts.model_path or DEFAULT_ARTIFACT
        cfg, dtype, stored = config_and_dtype(path)
        # --weights, else TINYLOOP_WEIGHTS, else the stored format: load_model's own rule, so plan and load agree
        fmt, group = weight_format_for(path, stored, *(parse_spec(opts.weights) if opts.weights else (None, None)))
        cache_mode = opts.cache_mode or env_choice("TINYLOOP_CACHE_MODE", tinyloop.CACHE_MODES, "fp16")
        dtype = torch.bfloat16 if device.startswith("cuda") else dtype
        def plan_for(lanes: int):
            plan = tinyloop.plan_memory(cfg, max_seq_len=opts.max_seq_len, cache_mode=cache_mode, lanes=lanes,
                                        max_handles=opts.max_handles, dtype=dtype, weights=fmt, group=group)
            plan.items.insert(0, (f"process baseline ({baseline_what(device)}; measured at start)", baseline))
            return plan

        # the pool holds every lane the batch runs at once at full length and deepest loops (--max-lanes); under a
        # --vram-budget too small for that, the budget decides: the pool takes what it leaves, one lane at least
        plan = plan_for(opts.max_lanes)
        if opts.vram_budget is not None and plan.total_bytes > budget:
            plan = plan_for(1)
    except tinyloop.TinyLoopError as exc:
        print(f"worker {opts.name}: cannot load the model: {exc}", file=sys.stderr)
        return WorkerExit.LOAD_FAILED
    model_name = str(opts.model_path or "bundled default model")
    if opts.plan_only:
        print(json.dumps({"total_bytes": plan.total_bytes, "items": plan.items, "device": device, "table": plan.table(),
                          "available_bytes": available, "available_what": available_what(device),
                          "budget_bytes": opts.vram_budget}))
        return 0
    if plan.total_bytes > budget:
        # the table first and the verdict last: `serve` quotes a worker's last line as the reason it stopped
        print(
            f"worker {opts.name}: memory plan\n{plan.table()}\nworker {opts.name}: refusing to start: the memory plan "
            f"({plan.total_bytes / 2**20:.1f} MiB) exceeds the budget ({budget_what}: {budget / 2**20:.1f} MiB)",
            file=sys.stderr,
        )
        return WorkerExit.OVER_BUDGET
    try:
        # Prefix caching is on in a worker (TINYLOOP_PREFIX_CACHE=off turns it off): requests reuse what earlier ones
        # left in the pool, and the heartbeat tells the broker what that is.
        caching = env_choice("TINYLOOP_PREFIX_CACHE", ("on", "off"), "on") == "on"
        model = tinyloop.load_model(opts.model_path, opts.max_seq_len, device=device, cache_mode=cache_mode,
                                    memory_budget=pool_budget(plan, opts.vram_budget),
                                    prefix_caching=caching, weights=fmt, group=group)
    except tinyloop.TinyLoopError as exc:
        print(f"worker {opts.name}: cannot load the model: {exc}", file=sys.stderr)
        return WorkerExit.LOAD_FAILED
    if opts.prefill_chunk is not None:
        model.prefill_chunk = opts.prefill_chunk
    events = publish_kv_events(opts, model, path) if opts.kv_events_endpoint else None  # before any scaffold is kept
    warm_up(model)
    try:
        from tinyloop.engine.elastic import Targets

        targets = Targets(opts.tpot_slo, opts.ttft_slo, opts.queue_slo)
        engine = ModelEngine(model, max_handles=opts.max_handles, plan_bytes=plan.total_bytes, model_name=model_name,
                             prefixes=prefixes, lanes=opts.max_lanes, targets=targets if targets else None)
    except (SystemExit, tinyloop.TinyLoopError) as exc:  # scaffolds past --max-handles, a scaffold's loops, lanes
        return refuse(opts, exc)
    process = WorkerProcess(engine, opts.connect, name=opts.name, heartbeat_interval=opts.heartbeat_interval,
                            heartbeat_liveness=opts.heartbeat_liveness, curve_dir=opts.curve_dir)
    engine.set_identity(process.identity)
    process.install_signal_handlers()
    full = model.pool.num_blocks // blocks_for(cfg, opts.max_seq_len, cfg.max_loops)
    # full: sequences of max_seq_len tokens at max_loops the block pool holds at once; it may be more than the lanes
    # (a budget larger than --max-lanes needs: prefix caching keeps the rest) or fewer (lanes share what shorter
    # requests leave)
    log.info("worker %s ready on %s: plan %.1f MiB of %.1f MiB (%s); %d lanes; the pool holds %d sequence(s) of %d "
             "tokens at %d loops; ops %s", opts.name, device, plan.total_bytes / 2**20, budget / 2**20, budget_what,
             opts.max_lanes, full, opts.max_seq_len, cfg.max_loops, engine.ops)
    try:
        return process.run()
    finally:
        if events is not None:
            events.close()


def served_model_name(path) -> str:
    """The model's name as the gateway serves it: its file name without .tinyloop (default: `default`)."""
    from pathlib import Path

    name = Path(path).name
    return name[:-len(".tinyloop")] if name.endswith(".tinyloop") else name


def publish_kv_events(opts: WorkerOptions, model, path):
    """Start the KV-cache event publisher and hang it on the model's prefix cache; returns the publisher."""
    from tinyloop.cache import BLOCK_TOKENS
    from workers.kv_events import EventPublisher, PrefixCacheEvents, binds, offset_port

    topic = opts.kv_events_topic or f"kv@{opts.name}@{served_model_name(path)}"
    bound = lambda e: offset_port(e, opts.kv_events_rank) if binds(e) else e  # noqa: E731 - connected ones share
    publisher = EventPublisher(bound(opts.kv_events_endpoint), topic, rank=opts.kv_events_rank,
                               replay_endpoint=opts.kv_events_replay and offset_port(opts.kv_events_replay,
                                                                                     opts.kv_events_rank))
    model.prefixes.listener = PrefixCacheEvents(publisher, BLOCK_TOKENS, model.cfg.default_loops, opts.kv_events_seed)
    log.info("worker %s publishes KV-cache events on %s as %r (rank %d)", opts.name, opts.kv_events_endpoint, topic,
             opts.kv_events_rank)
    return publisher
