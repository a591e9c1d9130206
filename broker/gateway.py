"""The OpenAI-compatible HTTP gateway: Starlette on uvicorn, in front of the broker.

    POST /v1/completions        POST /v1/chat/completions   (stream: server-sent events, then [DONE])
    GET  /v1/models             GET  /health                GET  /metrics

Each HTTP request becomes one broker request per choice (n) and prompt, sent through the
asyncio client (broker/client.py), so many requests are in flight at once on one event loop
and the gateway never imports torch. What is translated how is in broker/openai_schema.py;
the decisions are written down in docs/gateway.md.

Readiness comes from a background task that asks the broker for its status twice a second:
with no ready worker every generation request gets 503 at once instead of waiting in the
broker's queue until its deadline.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import re
import socket
import time
import uuid
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any, AsyncIterator, Sequence

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from broker import client as bc
from broker.metrics import LATENCY_BUCKETS
from broker.openai_schema import (APIError, Plan, WorkLimits, chat_choice, chat_plan,
                                  completion_choice, completion_plan, finish_reason, running_usage, usage)

log = logging.getLogger("tinyloop.gateway")

DEFAULT_MAX_BODY_BYTES = 1 << 20
STATUS_INTERVAL_S = 0.5
STATUS_STALE_S = 3.0  # a status older than this counts as "no worker ready" (broker unreachable)
# /livez fails when a task that wakes every LOOP_TICK_S has not run for LOOP_STALL_S: the event loop is stalled, and
# a restart is the cure. A stalled loop does not answer /livez at all, which the probe's timeout counts too.
LOOP_TICK_S = 1.0
LOOP_STALL_S = 10.0
BUNDLED_MODEL_ID = "tinyloop-default"

# Broker error codes -> HTTP status (docs/gateway.md). Anything not listed is a 500.
STATUS_FOR_CODE = {
    "invalid_field": 400, "config_error": 400, "mode_error": 400, "too_large": 413, "unknown_op": 400,
    "unsupported_op": 400, "busy": 429, "timeout": 504, "shutting_down": 503, "worker_lost": 502,
    "forward_failed": 502, "cancelled": 499,
}


# The status a request whose client hung up is counted under (nginx's "client closed request"): every request lands
# in exactly one tinyloop_gateway_requests_total series, so the series sum to the requests received.
CLIENT_CLOSED = "499"
ENDPOINTS = ("/v1/completions", "/v1/chat/completions", "/v1/models", "/health", "/livez", "/metrics")


def endpoint_label(request: Request) -> str:
    """The metrics label of a request's path: its endpoint (a trailing slash dropped), "/v1/models/{name}", or "other"
    for paths that are none of ours (so a scan of random paths cannot grow the metrics without bound)."""
    path = request.url.path.rstrip("/") or "/"
    if path in ENDPOINTS:
        return path
    return "/v1/models/{name}" if path.startswith("/v1/models/") else "other"


def model_id(announced: str) -> str:
    """The OpenAI model id of what a worker announced: the bundled model, or a file's stem."""
    return BUNDLED_MODEL_ID if announced == "bundled default model" else Path(announced).stem or announced


def load_api_keys(keys: tuple[str, ...] | list[str], key_file: str | None) -> list[str]:
    """--api-key values plus one key per non-empty, non-# line of --api-key-file."""
    found = [k for k in keys if k]
    if key_file:
        lines = Path(key_file).read_text().splitlines()
        found += [line.strip() for line in lines if line.strip() and not line.lstrip().startswith("#")]
    return found


# The runtime's words for a prompt that does not fit (tinyloop/engine/calls.py check_length), said as OpenAI says it.
CONTEXT_LENGTH = re.compile(r"length (\d+) \+ max_tokens (\d+) exceeds max_seq_len (\d+)")


def context_length_error(message: str, kind: str) -> APIError | None:
    found = CONTEXT_LENGTH.search(message)
    if found is None:
        return None
    prompt, completion, limit = map(int, found.groups())
    where = "messages" if kind == "chat" else "prompt"
    return APIError(400, f"This model's maximum context length is {limit} tokens. However, you requested "
                         f"{prompt + completion} tokens ({prompt} in the {where}, {completion} in the completion). "
                         f"Please reduce the length of the {where} or the completion (max_tokens).",
                    param=where, code="context_length_exceeded")


# How the wire ("op 'generate': field 'loops' ...") and the runtime ("GenerateConfig.loops ...", "prompt is empty")
# name the field they refuse.
NAMED_FIELD = re.compile(r"field '(\w+)'|GenerateConfig\.(\w+)|SpeculativeConfig\.(\w+)|"
                         r"(?:^|^op '\w+': )(chat_template_kwargs|prompt)\b")
OP_PREFIX = re.compile(r"(?:op '\w+': )?")


def service_error(err: bc.ServiceError, kind: str = "completion") -> APIError:
    status = STATUS_FOR_CODE.get(err.code, 500)
    message = err.message.split(": ", 1)[1] if ": " in err.message else err.message
    if err.code == "config_error":
        too_long = context_length_error(message, kind)
        if too_long is not None:
            return too_long
    # Name the field when the wire schema or the runtime did ("field 'loops'", "GenerateConfig.loops", "prompt is
    # empty"), and say it in the gateway's own words ("'loops' must be ..."): one dialect, whoever refused it.
    found = NAMED_FIELD.search(message)
    param = next((g for g in found.groups() if g), None) if found else None
    prefix = OP_PREFIX.match(message)  # (it matches any message: its one group is optional)
    if found and prefix is not None and found.start() == len(prefix.group()):  # the message starts with the field's name
        message = f"'{param}'{message[found.end():]}"
    headers = {"Retry-After": "1"} if status in (429, 503) else None
    return APIError(status, message, param=param, code=err.code, headers=headers)


class GatewayMetrics:
    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.requests = Counter("tinyloop_gateway_requests", "HTTP requests answered, by endpoint and status",
                                ["endpoint", "status"], registry=r)
        self.latency = Histogram("tinyloop_gateway_request_seconds", "HTTP request latency (to the last byte)",
                                 ["endpoint"], buckets=LATENCY_BUCKETS, registry=r)
        self.ttft = Histogram("tinyloop_gateway_time_to_first_token_seconds", "Streams: time to the first token",
                              buckets=LATENCY_BUCKETS, registry=r)
        self.in_flight = Gauge("tinyloop_gateway_in_flight", "HTTP generation requests being served", registry=r)
        self.ready_workers = Gauge("tinyloop_gateway_ready_workers", "Ready workers as last seen by the gateway",
                                   registry=r)
        self.tokens = Counter("tinyloop_gateway_tokens", "Tokens, by kind (prompt|completion)", ["kind"], registry=r)
        self.disconnects = Counter("tinyloop_gateway_client_disconnects",
                                   "Requests whose client went away (their broker requests were cancelled)",
                                   registry=r)


class Gateway:
    """One gateway: a broker connection, readiness, auth and the ASGI app (`self.app`)."""

    def __init__(self, connect: str, *, api_keys: Sequence[str] = (), model_name: str | None = None,
                 max_body_bytes: int = DEFAULT_MAX_BODY_BYTES, timeout: float = 300.0, curve_dir: str | None = None,
                 limits: WorkLimits = WorkLimits(), metrics_on_api_port: bool = True):
        self.connect = connect
        self.limits = limits
        self.api_keys = [k.encode() for k in api_keys]
        self.model_name = model_name
        self.max_body_bytes = max_body_bytes
        self.timeout = timeout
        self.curve_dir = curve_dir
        self.client: bc.AsyncClient | None = None
        self.status: dict = {}
        self.status_at = 0.0
        self.seen_models: set[str] = set()
        self.metrics = GatewayMetrics()
        self.created = int(time.time())
        self.loop_tick = time.monotonic()  # when the loop's ticker last ran (/livez)
        endpoints = [("/v1/completions", self.completions, "POST"),
                     ("/v1/chat/completions", self.chat_completions, "POST"), ("/v1/models", self.models, "GET"),
                     ("/health", self.health, "GET"), ("/livez", self.livez, "GET")]
        if metrics_on_api_port:  # else served on --metrics-port only (run_gateway), off the public port
            endpoints.append(("/metrics", self.prometheus, "GET"))
        # "/v1/completions/" is served as "/v1/completions": Starlette would answer a 307 with an empty body, which
        # an HTTP client posting JSON does not follow. (/v1/models/{name:path} takes any tail already.)
        routes = [Route(path + tail, handler, methods=[method])
                  for path, handler, method in endpoints for tail in ("", "/")]
        self.app = Starlette(routes=[
            *routes, Route("/v1/models/{name:path}", self.model, methods=["GET"]),
        ], lifespan=self.lifespan, exception_handlers=self.exception_handlers())

    def exception_handlers(self) -> dict[Any, Any]:
        """The answer to each kind of error (Starlette calls each handler with its own exception type, narrower than
        the Exception its annotations take)."""
        return {APIError: self.on_api_error, ClientDisconnect: self.on_gone, HTTPException: self.on_http_error,
                Exception: self.on_crash}

    # ------------------------------------------------------------------ lifecycle and readiness

    @asynccontextmanager
    async def lifespan(self, app: Starlette) -> AsyncIterator[None]:
        self.client = bc.AsyncClient(self.connect, timeout=self.timeout, curve_dir=self.curve_dir)
        poller, ticker = asyncio.create_task(self.poll_status()), asyncio.create_task(self.tick())
        try:
            yield
        finally:
            poller.cancel()
            ticker.cancel()
            await self.client.close()

    @property
    def broker(self) -> bc.AsyncClient:
        """The broker connection (made when the app starts: lifespan)."""
        assert self.client is not None
        return self.client

    async def poll_status(self) -> None:
        while True:
            try:
                self.status = await self.broker.status(timeout=2.0)
                self.status_at = time.monotonic()
                self.seen_models.update(model_id(w["model"]) for w in self.status.get("workers", []) if w.get("model"))
            except bc.ServiceError:
                pass  # stays stale; ready_workers() turns 0 after STATUS_STALE_S
            except Exception:  # never let the poller die: readiness would freeze
                log.exception("status poll failed")
            self.metrics.ready_workers.set(self.ready_workers())
            await asyncio.sleep(STATUS_INTERVAL_S)

    async def tick(self) -> None:
        """Mark that the event loop runs (/livez)."""
        while True:
            self.loop_tick = time.monotonic()
            await asyncio.sleep(LOOP_TICK_S)

    def ready_workers(self) -> int:
        if time.monotonic() - self.status_at > STATUS_STALE_S or self.status.get("stopping"):
            return 0
        return sum(1 for w in self.status.get("workers", []) if w.get("state") != "leaving")

    def served_models(self) -> list[str]:
        """The model ids served: --model-name, else every id a worker has announced since the gateway started. An id
        stays listed once seen (a client that read the list early keeps a name that works while its workers
        restart); before any worker has announced one the list is empty and /v1/models answers 503."""
        if self.model_name:
            return [self.model_name]
        return sorted(self.seen_models)

    def known_models(self) -> list[str]:
        """served_models(), or a 503 while no worker has said what it serves (rather than a guess that changes)."""
        names = self.served_models()
        if not names:
            raise APIError(503, "no worker has announced its model yet (the service is starting)",
                           code="no_worker_ready", headers={"Retry-After": "1"})
        return names

    # ------------------------------------------------------------------ small endpoints

    async def health(self, request: Request) -> Response:
        ready = self.ready_workers()
        body = {"status": "ok" if ready else "unavailable", "ready_workers": ready,
                "queue": self.status.get("queue"), "models": self.served_models()}
        return JSONResponse(body, status_code=200 if ready else 503)

    async def livez(self, request: Request) -> Response:
        """Liveness: 200 while the event loop runs its ticker; 503 when it stalled past LOOP_STALL_S."""
        lag = time.monotonic() - self.loop_tick
        alive = lag < LOOP_STALL_S
        return JSONResponse({"status": "alive" if alive else "stalled", "loop_lag_s": round(lag, 3)},
                            status_code=200 if alive else 503)

    async def prometheus(self, request: Request) -> Response:
        return Response(generate_latest(self.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    def model_card(self, name: str) -> dict:
        return {"id": name, "object": "model", "created": self.created, "owned_by": "tinyloop"}

    async def models(self, request: Request) -> Response:
        self.authorize(request)
        return JSONResponse({"object": "list", "data": [self.model_card(m) for m in self.known_models()]})

    async def model(self, request: Request) -> Response:
        self.authorize(request)
        name = request.path_params["name"]
        if name not in self.known_models():
            raise APIError(404, f"The model '{name}' does not exist", param="model", code="model_not_found")
        return JSONResponse(self.model_card(name))

    async def on_api_error(self, request: Request, err: APIError) -> Response:
        self.metrics.requests.labels(endpoint_label(request), str(err.status)).inc()
        return JSONResponse(err.body(), status_code=err.status, headers=err.headers)

    async def on_http_error(self, request: Request, exc: HTTPException) -> Response:
        """Starlette's own errors (404 no such path, 405 wrong method) in OpenAI's shape, not plain text."""
        what = {404: f"no such endpoint: {request.url.path} (see docs/gateway.md)",
                405: f"method {request.method} is not allowed on {request.url.path}"}.get(exc.status_code, exc.detail)
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
        return await self.on_api_error(request, APIError(exc.status_code, what, code=code, headers=exc.headers))

    async def on_crash(self, request: Request, exc: Exception) -> Response:
        """A bug in the gateway: the client still gets an OpenAI error (Starlette re-raises it; uvicorn logs it)."""
        return await self.on_api_error(request, APIError(500, f"internal error in the gateway: {type(exc).__name__}",
                                                         code="internal_error"))

    async def on_gone(self, request: Request, exc: ClientDisconnect) -> Response:
        # Nobody is listening any more; 499 (nginx's "client closed request") only shows in logs and metrics.
        self.metrics.requests.labels(endpoint_label(request), CLIENT_CLOSED).inc()
        return Response(status_code=499)

    # ------------------------------------------------------------------ request intake

    def authorize(self, request: Request) -> None:
        if not self.api_keys:
            return
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not any(hmac.compare_digest(token.strip().encode(), k) for k in self.api_keys):
            raise APIError(401, "Incorrect or missing API key (send Authorization: Bearer <key>)",
                           code="invalid_api_key")

    async def read_json(self, request: Request) -> dict:
        declared = request.headers.get("content-length")
        if declared and declared.isdigit() and int(declared) > self.max_body_bytes:
            raise APIError(413, f"request body of {declared} bytes exceeds the limit of {self.max_body_bytes}",
                           code="request_too_large")
        chunks, size = [], 0
        async for chunk in request.stream():  # also caps bodies sent without a Content-Length
            size += len(chunk)
            if size > self.max_body_bytes:
                raise APIError(413, f"request body exceeds the limit of {self.max_body_bytes} bytes",
                               code="request_too_large")
            chunks.append(chunk)
        try:
            body = json.loads(b"".join(chunks))
        except ValueError as exc:
            raise APIError(400, f"request body is not valid JSON: {exc}", code="invalid_json") from None
        except RecursionError:
            raise APIError(400, "request body is nested too deeply to be read as JSON", code="invalid_json") from None
        if not isinstance(body, dict):
            raise APIError(400, "request body must be a JSON object", code="invalid_json")
        # A "\\ud800" escape is valid JSON but no text: nothing downstream (msgpack, the tokenizer, this error's own
        # JSON reply) could encode it. One pass over the body, before any field echoes it back.
        try:
            json.dumps(body, ensure_ascii=False).encode("utf-8")
        except UnicodeEncodeError as exc:
            raise APIError(400, f"request body holds invalid Unicode: a lone surrogate {exc.object[exc.start]!r} "
                                "(half of a UTF-16 pair) in a string; send UTF-8 text", code="invalid_unicode") from None
        except RecursionError:
            raise APIError(400, "request body is nested too deeply", code="invalid_json") from None
        return body

    async def intake(self, request: Request, make_plan) -> Plan:
        self.authorize(request)
        plan = make_plan(await self.read_json(request))
        plan.check_work(self.limits)
        served = self.known_models()
        if plan.model is not None and plan.model not in served:
            raise APIError(404, f"The model '{plan.model}' does not exist (served: {served})",
                           param="model", code="model_not_found")
        if self.ready_workers() == 0:
            raise APIError(503, "no worker is ready to serve (starting, stopping, or the broker is unreachable)",
                           code="no_worker_ready", headers={"Retry-After": "1"})
        return plan

    async def completions(self, request: Request) -> Response:
        return await self.serve(request, await self.intake(request, completion_plan))

    async def chat_completions(self, request: Request) -> Response:
        return await self.serve(request, await self.intake(request, chat_plan))

    # ------------------------------------------------------------------ running a plan

    def base(self, plan: Plan, rid: str) -> dict:
        obj = "text_completion" if plan.kind == "completion" else "chat.completion"
        return {"id": rid, "object": obj, "created": int(time.time()), "model": plan.model or self.served_models()[0]}

    async def serve(self, request: Request, plan: Plan) -> Response:
        rid = ("cmpl-" if plan.kind == "completion" else "chatcmpl-") + uuid.uuid4().hex
        if plan.stream:
            return await self.serve_stream(request, plan, rid)
        t0 = time.perf_counter()
        self.metrics.in_flight.inc()
        try:
            results = await self.until_disconnect(request, self.run_all(plan))
        finally:
            self.metrics.in_flight.dec()
        choices = []
        for index, p, result in results:
            prompt = plan.prompts[p]
            choices.append(completion_choice(index, result, plan, prompt) if plan.kind == "completion"
                           else chat_choice(index, result, plan))
        body = {**self.base(plan, rid), "choices": choices, "usage": usage(results, plan)}
        self.count(request, plan, results, t0)
        return JSONResponse(body)

    def count(self, request: Request, plan: Plan, results: list, t0: float) -> None:
        u = usage(results, plan)
        self.metrics.tokens.labels("prompt").inc(u["prompt_tokens"])
        self.metrics.tokens.labels("completion").inc(u["completion_tokens"])
        self.metrics.requests.labels(endpoint_label(request), "200").inc()
        self.metrics.latency.labels(endpoint_label(request)).observe(time.perf_counter() - t0)

    async def run_all(self, plan: Plan) -> list[tuple[int, int, dict]]:
        """Every choice of every prompt as its own broker request, at most BATCH_WINDOW of them on the service at
        once, so that one call never fills the broker's queue with its own choices (and gets 429 for its own load)."""
        gate = asyncio.Semaphore(bc.BATCH_WINDOW)

        async def one(index: int, p: int, params: dict) -> tuple[int, int, dict]:
            async with gate:
                reply = await self.broker.submit(plan.op, params, timeout=plan.timeout or self.timeout)
            return index, p, reply.result

        try:
            tasks = [asyncio.ensure_future(one(*r)) for r in plan.requests()]
            try:
                return list(await asyncio.gather(*tasks))
            finally:
                for t in tasks:  # one failed: stop the others on the service as well
                    t.cancel()
        except bc.ServiceError as err:
            raise service_error(err, plan.kind) from None

    async def until_disconnect(self, request: Request, work):
        """Await `work` unless the client hangs up first; then cancel it (and so its broker requests)."""
        async def disconnected() -> None:
            while (await request.receive())["type"] != "http.disconnect":
                pass

        job, watch = asyncio.ensure_future(work), asyncio.ensure_future(disconnected())
        try:
            await asyncio.wait({job, watch}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            watch.cancel()
            if not job.done():
                job.cancel()
        if not job.done() or job.cancelled():
            self.metrics.disconnects.inc()
            raise ClientDisconnect()
        return job.result()

    # ------------------------------------------------------------------ streams

    async def serve_stream(self, request: Request, plan: Plan, rid: str) -> Response:
        """SSE. The first event is awaited before answering, so an error that comes at once (busy,
        invalid config) still gets its HTTP status; later errors arrive as an `error` event."""
        events: asyncio.Queue = asyncio.Queue()
        # With logprobs (scored after generation) or echo a choice is sent whole when it is done.
        token_stream = not plan.logprobs and not plan.echo
        gate = asyncio.Semaphore(bc.BATCH_WINDOW)
        jobs = [asyncio.ensure_future(self.pump(plan, index, params, token_stream, events, gate))
                for index, _p, params in plan.requests()]
        t0 = time.perf_counter()
        try:
            first = await self.until_disconnect(request, events.get())
        except BaseException:
            for job in jobs:
                job.cancel()
            raise
        if first[1] == "error":
            for job in jobs:
                job.cancel()
            raise service_error(first[2], plan.kind)
        gen = self.sse(request, plan, rid, jobs, events, first, t0)
        return StreamingResponse(gen, media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    async def pump(self, plan: Plan, index: int, params: dict, token_stream: bool, events: asyncio.Queue,
                   gate: asyncio.Semaphore) -> None:
        """One broker request -> (index, kind, payload) events: token, done or error; it waits for the call's gate."""
        try:
            async with gate:
                if token_stream:
                    messages = self.broker._messages(plan.op, params, True, plan.timeout or self.timeout)
                    try:
                        async for msg in messages:
                            if msg.type == "error":
                                raise bc.error_from_reply(msg.fields)
                            if msg.type == "token":
                                await events.put((index, "token", bc.TokenEvent(msg["token"], msg["pos"], msg["text"])))
                            else:
                                await events.put((index, "done", msg["result"]))
                    finally:
                        await messages.aclose()  # a cancelled pump cancels its broker request
                else:
                    reply = await self.broker.submit(plan.op, params, timeout=plan.timeout or self.timeout)
                    await events.put((index, "done", reply.result))
        except bc.ServiceError as err:
            await events.put((index, "error", err))

    def chunk(self, plan: Plan, rid: str, choice: dict, usage_so_far: dict | None = None) -> str:
        body = self.base(plan, rid)
        body["object"] = "text_completion" if plan.kind == "completion" else "chat.completion.chunk"
        body["choices"] = [choice]
        if usage_so_far is not None:
            body["usage"] = usage_so_far
        return f"data: {json.dumps(body)}\n\n"

    def piece(self, plan: Plan, index: int, text: str, *, first: bool = False, logprobs: Any = None,
              finish: str | None = None) -> dict:
        if plan.kind == "completion":
            return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish}
        delta = {} if finish and not text else {"content": text}
        if first:
            delta["role"] = "assistant"
        return {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish}

    async def sse(self, request: Request, plan: Plan, rid: str, jobs: list, events: asyncio.Queue, first: tuple,
                  t0: float) -> AsyncIterator[str]:
        started: set[int] = set()
        results: list[tuple[int, int, dict]] = []
        streamed: dict[int, int] = {}  # tokens streamed so far, per choice (continuous usage stats)
        open_choices = len(jobs)
        event, failed = first, False
        self.metrics.in_flight.inc()

        def chunk(choice: dict) -> str:
            so_far = running_usage(results, streamed, plan) if plan.continuous_usage else None
            return self.chunk(plan, rid, choice, so_far)

        try:
            while True:
                index, kind, payload = event
                if kind == "error":
                    err, failed = service_error(payload, plan.kind), True
                    self.metrics.requests.labels(endpoint_label(request), str(err.status)).inc()
                    yield f"data: {json.dumps(err.body())}\n\n"
                    break
                if kind == "token":
                    if not started:
                        self.metrics.ttft.observe(time.perf_counter() - t0)
                    streamed[index] = streamed.get(index, 0) + 1
                    if payload.text or index not in started:
                        yield chunk(self.piece(plan, index, payload.text, first=index not in started))
                    started.add(index)
                else:  # done: what was not streamed yet, then the finish reason
                    prompt = plan.prompts[index // plan.n]
                    results.append((index, index // plan.n, payload))
                    if index not in started:  # a whole choice (logprobs, echo, or nothing streamed)
                        chat = plan.kind == "chat"
                        whole = chat_choice(index, payload, plan) if chat else completion_choice(index, payload, plan,
                                                                                                  prompt)
                        text = whole["message"]["content"] if chat else whole["text"]
                        yield chunk(self.piece(plan, index, text, first=True, logprobs=whole["logprobs"]))
                        started.add(index)
                    yield chunk(self.piece(plan, index, "", finish=finish_reason(payload)))
                    open_choices -= 1
                    if open_choices == 0:
                        if plan.include_usage:
                            body = {**self.base(plan, rid), "choices": [], "usage": usage(results, plan)}
                            if plan.kind == "chat":
                                body["object"] = "chat.completion.chunk"
                            yield f"data: {json.dumps(body)}\n\n"
                        self.count(request, plan, results, t0)
                        break
                event = await events.get()
            yield "data: [DONE]\n\n"
        finally:
            self.metrics.in_flight.dec()
            if open_choices and not failed:  # the client went away mid-stream
                self.metrics.disconnects.inc()
                self.metrics.requests.labels(endpoint_label(request), CLIENT_CLOSED).inc()
            for job in jobs:  # stop whatever still runs on the service
                job.cancel()


def listen(host: str, port: int) -> socket.socket:
    """The gateway's listening socket, bound before anything else starts: a port in use fails here, at once, with
    the OSError naming it (uvicorn would log it and exit later)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # a restarted gateway takes its port back at once
    try:
        sock.bind((host, port))
    except OSError:
        sock.close()
        raise
    sock.listen(2048)
    return sock


def serve_metrics(gateway: Gateway, host: str, port: int) -> int:
    """Serve the gateway's /metrics on a port of its own (a thread: it answers even while the event loop is busy),
    so the API's public port need not expose it. Returns the port; OSError when it is taken."""
    from prometheus_client import start_http_server

    server, _thread = start_http_server(port, addr=host, registry=gateway.metrics.registry)
    return server.server_address[1]


def run_gateway(connect: str, sock: socket.socket, ready_file: str | None = None, *, metrics_port: int | None = None,
                **options: Any) -> None:
    """Serve on a bound socket (`listen`) until SIGINT/SIGTERM (uvicorn handles both and finishes open requests).
    `ready_file`: written (JSON: the URL) once the socket listens, for the process that started the gateway.
    `metrics_port`: /metrics there (on the API socket's address) instead of on the API port."""
    import uvicorn

    gateway = Gateway(connect, metrics_on_api_port=metrics_port is None, **options)
    if metrics_port is not None:
        serve_metrics(gateway, sock.getsockname()[0], metrics_port)
    host, port = sock.getsockname()[:2]
    if ready_file:  # connections made from now on wait in the socket's backlog until uvicorn takes them
        tmp = Path(ready_file + ".tmp")
        tmp.write_text(json.dumps({"url": f"http://{f'[{host}]' if ':' in host else host}:{port}"}))
        tmp.rename(ready_file)
    config = uvicorn.Config(gateway.app, log_level="warning", timeout_graceful_shutdown=30)
    uvicorn.Server(config).run(sockets=[sock])
