"""Starting and supervising service processes (used by `tinyloop serve`, the load test and tests).

Every part runs as its own OS process started from this Python's `scripts.service_cli`,
so `tinyloop serve` behaves exactly like `tinyloop broker` plus N `tinyloop worker` run by hand.

Children get their own session (a terminal's Ctrl-C reaches only the launcher, which then
shuts them down in order: broker first so in-flight requests get their replies, then
workers) and die with the launcher (PR_SET_PDEATHSIG), so nothing is left orphaned.
This module imports no torch.
"""

from __future__ import annotations

import ctypes
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from broker.protocol import WorkerExit

REPO_ROOT = Path(__file__).resolve().parent.parent


def child_env(root: Path = REPO_ROOT) -> dict:
    env = dict(os.environ)
    paths = [str(root)] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    env["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(paths))
    env.setdefault("PYTHONUNBUFFERED", "1")
    return env


def physical_cores() -> int:
    """Physical cores this process may run on (its CPU affinity, SMT siblings counted once): a decode step is bound
    by memory reads and FMA units, which two hyperthreads of one core share, so threads beyond cores only contend."""
    cpus = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else range(os.cpu_count() or 1)
    cores = set()
    for cpu in cpus:
        topology = Path(f"/sys/devices/system/cpu/cpu{cpu}/topology")
        try:
            cores.add(((topology / "physical_package_id").read_text().strip(), (topology / "core_id").read_text().strip()))
        except OSError:
            cores.add(("cpu", str(cpu)))  # no topology (not Linux, or hidden): count the logical CPU
    return max(1, len(cores))


def threads_per_worker(workers: int) -> int:
    """The default torch threads of each of N CPU workers on one machine: its physical cores divided between them."""
    return max(1, physical_cores() // max(1, workers))


def _die_with_parent() -> None:
    # Linux only; elsewhere children simply outlive a killed launcher.
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG = 1
    except OSError:
        pass


def service_command(*args: str, module: str = "scripts.service_cli") -> list[str]:
    return [sys.executable, "-m", module, *args]


def spawn(args: list[str], log_path: str | Path | None = None, root: Path = REPO_ROOT,
          module: str = "scripts.service_cli") -> subprocess.Popen:
    """Start `python -m MODULE ARGS...` of the tree at `root`; output goes to log_path (or is inherited). Paths in
    ARGS must be absolute (the child runs in `root`): the CLI resolves them against the caller's directory."""
    out = open(log_path, "ab") if log_path else None
    try:
        return subprocess.Popen(
            service_command(*args, module=module),
            env=child_env(root),
            cwd=str(root),
            stdout=out,
            stderr=subprocess.STDOUT if out else None,
            start_new_session=True,
            preexec_fn=_die_with_parent,
        )
    finally:
        if out:
            out.close()


def last_words(log_path: str | Path | None) -> str:
    """The last non-empty line of a child's log (what it said as it exited), or "" without one."""
    if log_path is None or not Path(log_path).exists():
        return ""
    with open(log_path, "rb") as f:
        f.seek(max(0, f.seek(0, os.SEEK_END) - 4096))  # the tail is enough; a log may be large
        lines = [line.strip() for line in f.read().decode(errors="replace").splitlines() if line.strip()]
    return lines[-1] if lines else ""


def exit_reason(name: str, code: int, log_path: str | Path | None = None, when: str = "") -> str:
    """'worker w1 exited with code 5 (bad_config) during startup: <its last log line>' (a worker's code is a
    WorkerExit; `when` says when it exited)."""
    if code < 0:  # Popen's way of saying a signal ended it
        how = f"was killed by {signal.Signals(-code).name}"
    else:
        meaning = f" ({WorkerExit(code).name.lower()})" if name.startswith("worker") and code in set(WorkerExit) else ""
        how = f"exited with code {code}{meaning}"
    words = last_words(log_path)
    return f"{name} {how}{when}" + (f": {words}" if words else "")


def wait_for_file(path: str | Path, proc: subprocess.Popen, timeout: float, name: str = "the process",
                  log_path: str | Path | None = None) -> dict:
    """Wait for a JSON file a child writes when it is up (e.g. the broker's --ready-file)."""
    deadline = time.monotonic() + timeout
    path = Path(path)
    while time.monotonic() < deadline:
        if path.exists():
            try:
                return json.loads(path.read_text())
            except ValueError:
                pass  # half-written; try again
        if proc.poll() is not None:
            raise RuntimeError(exit_reason(name, proc.returncode, log_path, " before it was ready"))
        time.sleep(0.02)
    raise TimeoutError(f"{path} did not appear within {timeout}s")


def wait_for_workers(frontend: str, count: int, timeout: float,
                     procs: dict[str, subprocess.Popen] | list[subprocess.Popen] | None = None,
                     curve_dir: str | None = None, logs: dict[str, Path | None] | None = None) -> dict:
    """Poll the broker's status until `count` workers are ready; returns the last status. A process of `procs` (by
    name, with its log in `logs`) that exits meanwhile fails the wait at once: whatever its exit code, it did not
    start, and waiting longer cannot help."""
    from broker.client import Client, RequestTimeout

    named = procs if isinstance(procs, dict) else {f"process {p.pid}": p for p in procs or []}
    deadline = time.monotonic() + timeout
    with Client(frontend, curve_dir=curve_dir) as client:
        while True:
            try:
                status = client.status(timeout=2.0)
                if len([w for w in status["workers"] if w["state"] != "leaving"]) >= count:
                    return status
            except RequestTimeout:
                pass
            for name, proc in named.items():
                if proc.poll() is not None:
                    log_path = (logs or {}).get(name)
                    raise RuntimeError(exit_reason(name, proc.returncode, log_path, " during startup"))
            if time.monotonic() > deadline:
                raise TimeoutError(f"{count} worker(s) did not become ready within {timeout}s")
            time.sleep(0.1)


def stop(proc: subprocess.Popen, timeout: float = 10.0) -> int | None:
    """SIGTERM, wait, then SIGKILL if needed. Returns the exit code."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)
    return proc.returncode


class LocalService:
    """A broker and N model workers on private ipc endpoints, for the load test and the tests.

        with LocalService(n_workers=2, worker_args=["--max-seq-len", "256"]) as svc:
            Client(svc.frontend).generate("x = ")
    """

    def __init__(self, n_workers: int = 1, worker_args: Sequence[str] = (), broker_args: Sequence[str] = (),
                 heartbeat_interval: float = 1.0, startup_timeout: float = 180.0, log_dir: str | Path | None = None,
                 root: Path = REPO_ROOT):
        """root: the source tree whose broker and workers run (benchmarks compare an older revision)."""
        import tempfile

        self.root = Path(root)
        self.dir = Path(tempfile.mkdtemp(prefix="tl-", dir="/tmp"))  # ipc paths must stay short
        self.log_dir = Path(log_dir) if log_dir else self.dir
        self.frontend = f"ipc://{self.dir}/front"
        self.backend = f"ipc://{self.dir}/back"
        self.n_workers = n_workers
        self.worker_args = list(worker_args)
        self.broker_args = list(broker_args)
        self.heartbeat_interval = heartbeat_interval
        self.startup_timeout = startup_timeout
        self.broker: subprocess.Popen | None = None
        self.workers: dict[str, subprocess.Popen] = {}
        self.info: dict = {}

    def __enter__(self) -> "LocalService":
        try:
            self.start()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def start(self) -> None:
        ready = self.dir / "broker.json"
        self.broker = spawn(["broker", "--frontend", self.frontend, "--backend", self.backend, "--ready-file", str(ready),
                             "--heartbeat-interval", str(self.heartbeat_interval), *self.broker_args],
                            self.log_dir / "broker.log", self.root)
        self.info = wait_for_file(ready, self.broker, 30, "the broker", self.log_dir / "broker.log")
        for i in range(1, self.n_workers + 1):
            self.start_worker(f"w{i}")
        wait_for_workers(self.frontend, self.n_workers, self.startup_timeout,
                         {f"worker {name}": proc for name, proc in self.workers.items()},
                         logs={f"worker {name}": self.log_dir / f"{name}.log" for name in self.workers})

    def start_worker(self, name: str, *extra: str) -> subprocess.Popen:
        self.workers[name] = spawn(["worker", "--connect", self.backend, "--name", name,
                                    "--heartbeat-interval", str(self.heartbeat_interval), *self.worker_args, *extra],
                                   self.log_dir / f"{name}.log", self.root)
        return self.workers[name]

    def log(self, name: str) -> str:
        path = self.log_dir / f"{name}.log"
        return path.read_text(errors="replace") if path.exists() else ""

    def close(self) -> None:
        import shutil

        procs = [p for p in [self.broker, *self.workers.values()] if p is not None]
        for proc in procs:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in procs:
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(5)
        if self.log_dir == self.dir:
            shutil.rmtree(self.dir, ignore_errors=True)
