"""`tinyloop serve`: one broker and N workers as child processes, kept alive until stopped.

* Before starting anything it checks that N copies of the model fit on the device: one
  `worker --plan-only` run reports the per-worker memory plan and the memory available,
  and the launcher refuses to start (exit 3, itemised table) when N plans do not fit.
* A worker that dies (crash, OOM killer, SIGKILL) is restarted; one that exits because
  it was refused (over budget, broker limits, unloadable model) is not, since it would
  only be refused again.
* A broker that dies is restarted on the same endpoints (at most MAX_RESTARTS_IN_WINDOW
  times a minute, like workers). Workers reconnect and re-register by themselves; clients
  re-send what had no final reply (broker/client.py), so a broker restart costs latency.
  The HTTP gateway (`--http-port`) is restarted the same way.
* Start-up fails fast: a broker, gateway or worker that exits before the service is ready
  stops `serve` at once (exit 1), naming it, its exit code and its last log line. Only
  after start-up are crashed workers restarted.
* Ctrl-C or SIGTERM stops the gateway first, then the broker, which lets in-flight requests
  finish (or answers them with an error), then the workers.
"""

from __future__ import annotations

import json
import logging
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable

from broker import launcher
from broker.protocol import FATAL_WORKER_EXITS, WorkerExit

log = logging.getLogger("tinyloop.serve")

RESTART_WINDOW_S = 60.0
MAX_RESTARTS_IN_WINDOW = 5


class Supervisor:
    def __init__(self, *, n_workers: int, frontend: str, backend: str, worker_args: list[str],
                 broker_args: list[str], log_dir: str | None = None, log_level: str = "info",
                 curve_dir: str | None = None, gateway_args: list[str] | None = None):
        self.n_workers = n_workers
        self.gateway_args = gateway_args  # None: no HTTP gateway
        self.gateway: subprocess.Popen | None = None
        self.frontend = frontend
        self.backend = backend
        self.worker_args = worker_args
        self.broker_args = broker_args
        self.log_dir = Path(log_dir) if log_dir else None
        self.log_level = log_level
        self.curve_dir = curve_dir
        self.broker: subprocess.Popen | None = None
        self.workers: dict[str, subprocess.Popen] = {}
        self.restarts: dict[str, list[float]] = {}
        self.state_dir: Path | None = None  # the broker's ready file lives here
        self.stopping = False

    def log_path(self, name: str) -> Path | None:
        if self.log_dir is None:
            return None
        self.log_dir.mkdir(parents=True, exist_ok=True)
        return self.log_dir / f"{name}.log"

    def say(self, text: str) -> None:
        print(f"tinyloop serve: {text}", file=sys.stderr, flush=True)

    # ------------------------------------------------------------------ startup checks

    def check_plan(self, device_budget: int | None = None) -> int | None:
        """Run one worker in --plan-only mode; refuse when N plans exceed the device's memory."""
        cmd = launcher.service_command("worker", "--plan-only", "--log-level", "warning", *self.worker_args)
        proc = subprocess.run(cmd, env=launcher.child_env(), cwd=str(launcher.REPO_ROOT), capture_output=True, text=True)
        if proc.returncode != 0:
            self.say(f"the memory plan check failed (exit {proc.returncode}):\n{proc.stderr.strip()}")
            return proc.returncode or 1
        plan = json.loads(proc.stdout.strip().splitlines()[-1])
        if device_budget is not None:
            plan["available_bytes"], plan["available_what"] = device_budget, "--device-budget"
        # Each worker may use its whole --vram-budget (its pool takes what the plan leaves of it), else its plan.
        per_worker = max(plan["total_bytes"], plan.get("budget_bytes") or 0)
        need = per_worker * self.n_workers
        if need > plan["available_bytes"]:
            self.say(
                f"refusing to start: {self.n_workers} workers on {plan['device']} need {need / 2**20:.1f} MiB "
                f"but {plan['available_what']} is {plan['available_bytes'] / 2**20:.1f} MiB. Plan of one worker:\n"
                f"{plan['table']}"
            )
            return WorkerExit.OVER_BUDGET  # as a worker over its budget exits
        self.say(f"memory plan: {self.n_workers} x {per_worker / 2**20:.1f} MiB fits in "
                 f"{plan['available_bytes'] / 2**20:.1f} MiB ({plan['available_what']})")
        return None

    # ------------------------------------------------------------------ processes

    def start_broker(self, timeout: float = 30.0) -> dict:
        if self.state_dir is None:
            self.state_dir = Path(tempfile.mkdtemp(prefix="tinyloop-serve-"))
        ready_file = self.state_dir / "broker.json"
        ready_file.unlink(missing_ok=True)  # a restart must not read the previous broker's file
        self.broker = launcher.spawn(
            ["broker", "--frontend", self.frontend, "--backend", self.backend, "--ready-file", str(ready_file),
             "--log-level", self.log_level, *self.broker_args],
            self.log_path("broker"),
        )
        info = launcher.wait_for_file(ready_file, self.broker, timeout, "the broker", self.log_path("broker"))
        self.frontend, self.backend = info["frontend"], info["backend"]
        return info

    def start_gateway(self, timeout: float = 30.0) -> dict:
        """The HTTP gateway, listening once this returns (it reaches the broker by itself)."""
        assert self.state_dir is not None and self.gateway_args is not None  # (start_broker ran; a gateway asked)
        ready_file = self.state_dir / "gateway.json"
        ready_file.unlink(missing_ok=True)
        self.gateway = launcher.spawn(["--ready-file", str(ready_file), "--log-level", self.log_level,
                                       *self.gateway_args], self.log_path("gateway"), module="scripts.gateway_cli")
        return launcher.wait_for_file(ready_file, self.gateway, timeout, "the gateway", self.log_path("gateway"))

    def start_worker(self, name: str) -> None:
        # worker wN publishes its KV-cache events as rank N-1 (a bound endpoint's port + N-1), as vLLM's DP ranks do
        rank = ["--kv-events-rank", str(int(name[1:]) - 1)] if "--kv-events-endpoint" in self.worker_args else []
        self.workers[name] = launcher.spawn(
            ["worker", "--connect", self.backend, "--name", name, "--log-level", self.log_level, *self.worker_args,
             *rank],
            self.log_path(name),
        )

    def restart_allowed(self, name: str) -> bool:
        now = time.monotonic()
        recent = [t for t in self.restarts.get(name, []) if now - t < RESTART_WINDOW_S]
        self.restarts[name] = recent + [now]
        return len(recent) < MAX_RESTARTS_IN_WINDOW

    def run(self, *, check_plan: bool = True, device_budget: int | None = None, startup_timeout: float = 300.0) -> int:
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, self._on_signal)
        try:
            if check_plan and self.n_workers > 1:  # a single worker checks its own plan at startup
                refused = self.check_plan(device_budget)
                if refused is not None:
                    return refused
            info = self.start_broker()
            self.say(f"broker listening for clients on {info['frontend']}, workers on {info['backend']}"
                     + (f", metrics {info['metrics']}/metrics" if info.get("metrics") else ""))
            if self.gateway_args is not None:  # before the workers: a gateway that cannot start fails in seconds
                self.say(f"gateway listening on {self.start_gateway()['url']}/v1")
            for i in range(1, self.n_workers + 1):
                self.start_worker(f"w{i}")
            launcher.wait_for_workers(info["frontend"], self.n_workers, startup_timeout,
                                      {f"worker {name}": proc for name, proc in self.workers.items()},
                                      curve_dir=self.curve_dir,
                                      logs={f"worker {name}": self.log_path(name) for name in self.workers})
            self.say(f"all {self.n_workers} workers ready; submit with: tinyloop submit --connect {info['frontend']} \"prompt\"")
            return self.supervise()
        except (RuntimeError, TimeoutError) as exc:
            self.say(f"startup failed: {exc}")
            return 1
        finally:
            self.shutdown()

    def supervise(self) -> int:
        while not self.stopping:
            time.sleep(0.2)
            if not (self.revive("broker", self.broker, self.start_broker, " on the same endpoints")
                    and self.revive("gateway", self.gateway, self.start_gateway)):
                return 1
            for name, proc in list(self.workers.items()):
                if proc.poll() is None or self.stopping:
                    continue
                code = proc.returncode
                if code in FATAL_WORKER_EXITS:
                    self.say(f"{launcher.exit_reason(f'worker {name}', code, self.log_path(name))}; not restarting it "
                             "(it would fail the same way)")
                    del self.workers[name]
                elif self.restart_allowed(name):
                    self.say(f"worker {name} (pid {proc.pid}) died with code {code}; restarting it")
                    self.start_worker(name)
                else:
                    self.say(f"worker {name} keeps dying ({MAX_RESTARTS_IN_WINDOW} restarts in {RESTART_WINDOW_S:.0f}s); giving up on it")
                    del self.workers[name]
            if not self.workers:
                self.say("no workers left; stopping")
                return 1
        return 0

    def revive(self, name: str, proc: subprocess.Popen | None, start: Callable[[], dict], where: str = "") -> bool:
        """Restart the broker or the gateway if it died (at most MAX_RESTARTS_IN_WINDOW times a minute); False when
        it cannot be, and `serve` stops."""
        if proc is None or proc.poll() is None or self.stopping:
            return True
        if not self.restart_allowed(name):
            self.say(f"the {name} keeps dying ({MAX_RESTARTS_IN_WINDOW} restarts in {RESTART_WINDOW_S:.0f}s); stopping")
            return False
        self.say(f"the {name} (pid {proc.pid}) died with code {proc.returncode}; restarting it{where}")
        try:
            start()
        except (RuntimeError, TimeoutError) as exc:
            self.say(f"the {name} could not be restarted: {exc}; stopping")
            return False
        return True

    def _on_signal(self, signum, frame) -> None:
        if not self.stopping:
            self.say(f"{signal.Signals(signum).name}: stopping (in-flight requests finish first)")
        self.stopping = True

    def shutdown(self) -> None:
        self.stopping = True
        if self.gateway is not None:
            launcher.stop(self.gateway, timeout=40.0)  # open HTTP requests finish while the broker still serves
        if self.broker is not None:
            launcher.stop(self.broker, timeout=40.0)  # the broker drains in-flight requests first
        for proc in self.workers.values():
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in self.workers.values():
            launcher.stop(proc, timeout=15.0)
        if self.state_dir is not None:
            shutil.rmtree(self.state_dir, ignore_errors=True)
        self.say("stopped")
