"""What the HTTP benchmarks share (`bench.webhook`, `bench.ingest_http`, `bench.sync`): gunicorn
started and stopped as deployed, the CPU of processes measured from /proc, and an asyncio load
generator that drives one endpoint, or two in alternate turns, and times each answer."""

from __future__ import annotations

import asyncio
import functools
import gc
import math
import os
import signal
import socket
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import IO

from bench.inventory import REPO

REQUEST_TIMEOUT_S = 10.0


def wait_until_idle(limit_s: float = 120.0) -> None:
    """Wait until no other session on the bench database is inside a statement or transaction
    (requests a phase gave up on may still be running in the workers)."""
    from django.db import connection

    deadline = time.monotonic() + limit_s
    with connection.cursor() as cursor:
        while True:
            cursor.execute(
                "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() "
                "AND pid <> pg_backend_pid() AND state <> 'idle'"
            )
            row = cursor.fetchone()
            if not row or not row[0] or time.monotonic() > deadline:
                return
            time.sleep(0.2)


def wait_until_settled(table: str, *, quiet_s: float = 1.0, limit_s: float = 120.0) -> None:
    """Wait until the bench database is idle (`wait_until_idle`) and `table`'s row count has
    not changed for `quiet_s`: requests a run cut short by its time limit may still be queued
    in gunicorn, not yet in PostgreSQL, and would otherwise be served while the run's checks
    read the tables (or after the reset that follows)."""
    from django.db import connection

    deadline = time.monotonic() + limit_s
    counted = None
    while time.monotonic() < deadline:
        wait_until_idle(max(deadline - time.monotonic(), 0.0))
        with connection.cursor() as cursor:
            cursor.execute(f"SELECT count(*) FROM {connection.ops.quote_name(table)}")
            row = cursor.fetchone()
        if row is not None and row[0] == counted:
            return
        counted = row[0] if row is not None else None
        time.sleep(quiet_s)


# --- gunicorn ----------------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
        return port


def start_gunicorn(
    url: str,
    *,
    workers: int,
    threads: int,
    port: int,
    app: str,
    settings: str = "bench.settings",
    deployed: bool = False,
    environ: dict[str, str] | None = None,
    log: IO[bytes] | None = None,
) -> subprocess.Popen[bytes]:
    """gunicorn serving `app` with `settings` on `port`; `deployed`: with the image's
    configuration (deploy/gunicorn.conf.py: its worker class, timeouts, hooks), only the
    address, workers and threads given here. `environ` is added to the environment; its
    output goes to `log` (None: this process's)."""
    env = {
        **os.environ,
        "DJANGO_SETTINGS_MODULE": settings,
        "DATABASE_URL": url,
        "DEBUG": "false",
        "ALLOWED_HOSTS": "127.0.0.1",
        "SECRET_KEY": os.environ.get("SECRET_KEY") or "bench-only-secret-key",
        **(environ or {}),
    }
    command = [
        sys.executable, "-m", "gunicorn", app,
        "--bind", f"127.0.0.1:{port}", "--workers", str(workers), "--threads", str(threads),
        "--log-level", "warning",
    ]  # fmt: skip
    if deployed:
        command += ["--config", str(REPO / "deploy" / "gunicorn.conf.py")]
        kind = f"workers of {threads} threads as deployed (deploy/gunicorn.conf.py)"
    else:
        command += [
            "--worker-class", "gthread" if threads > 1 else "sync", "--backlog", "2048",
            "--timeout", "60", "--graceful-timeout", "5", "--worker-tmp-dir", "/dev/shm",
        ]  # fmt: skip
        kind = f"gthread workers of {threads} threads" if threads > 1 else "sync workers"
    print(f"gunicorn: {workers} {kind} on 127.0.0.1:{port}", flush=True)
    # Its own process group, so that the master and its workers can be stopped together.
    process = subprocess.Popen(
        command, cwd=REPO, env=env, start_new_session=True, stdout=log, stderr=log
    )
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise SystemExit(f"gunicorn exited with status {process.returncode}")
        try:
            if http_get(port, "/healthz") == 200:
                return process
        except OSError:
            pass
        time.sleep(0.2)
    stop(process)
    raise SystemExit("gunicorn did not answer /healthz within 60 s")


def http_get(port: int, path: str) -> int:
    with socket.create_connection(("127.0.0.1", port), timeout=2) as conn:
        conn.sendall(
            f"GET {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n".encode()
        )
        head = conn.recv(64)
    return int(head.split(b" ", 2)[1])


def stop(process: subprocess.Popen[bytes]) -> None:
    if process.poll() is not None:
        return
    os.killpg(process.pid, signal.SIGTERM)
    try:
        process.wait(timeout=10)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait()


def cpu_seconds(pids: list[int]) -> dict[int, float]:
    """User + system CPU seconds of each of `pids` still running."""
    ticks = os.sysconf("SC_CLK_TCK")
    seconds = {}
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat", "rb") as stat:
                fields = stat.read().rsplit(b")", 1)[1].split()
        except OSError:
            continue
        seconds[pid] = (int(fields[11]) + int(fields[12])) / ticks  # utime, stime
    return seconds


def processes(*, parent: int | None = None, cmdline: bytes | None = None) -> list[int]:
    """Children of `parent`, or processes whose command line contains `cmdline`."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            if parent is not None:
                with open(f"/proc/{entry}/stat", "rb") as stat:
                    if int(stat.read().rsplit(b")", 1)[1].split()[1]) == parent:
                        found.append(int(entry))
            elif cmdline is not None:
                with open(f"/proc/{entry}/cmdline", "rb") as command:
                    if cmdline in command.read():
                        found.append(int(entry))
        except (OSError, ValueError, IndexError):
            continue
    return found


class CpuMeter:
    """CPU the client, the gunicorn workers and the bench database's backends use meanwhile."""

    def __init__(self, master: int, database: str) -> None:
        self.master = master
        self.marker = f" {database} ".encode()  # "postgres: 15/main: user DATABASE host ..."

    def sample(self) -> dict[str, dict[int, float]]:
        return {
            "client": {0: time.process_time()},
            "gunicorn": cpu_seconds(processes(parent=self.master)),
            "postgres": cpu_seconds(processes(cmdline=self.marker)),
        }

    @staticmethod
    def spent(before: dict[str, dict[int, float]], after: dict[str, dict[int, float]]) -> dict:
        # A process that started meanwhile counts whole; one that ended is lost (rare: workers
        # live through the run and keep their database connections).
        return {
            name: sum(value - before[name].get(pid, 0.0) for pid, value in now.items())
            for name, now in after.items()
        }


# --- the load generator ------------------------------------------------------------------------


class Exchange(asyncio.Protocol):
    """One request on its own connection (`Connection: close`), read until the server closes.

    gunicorn's sync workers close every connection after one response anyway; a protocol
    rather than streams keeps the client's CPU per request low on a 2-core machine.
    """

    def __init__(self, payload: bytes, done: asyncio.Future[bytes]) -> None:
        self.payload = payload
        self.done = done
        self.chunks: list[bytes] = []

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        transport.write(self.payload)

    def data_received(self, data: bytes) -> None:
        self.chunks.append(data)

    def connection_lost(self, exc: Exception | None) -> None:
        if not self.done.done():
            if exc is not None:
                self.done.set_exception(exc)
            else:
                self.done.set_result(b"".join(self.chunks))


@dataclass
class Run:
    """What one driven phase measured."""

    label: str
    requests: int
    rate: float | None  # None: closed loop at full speed
    latencies: list[float] = field(default_factory=list)  # seconds, completed requests only
    responses: list[bytes | None] = field(default_factory=list)
    errors: Counter[str] = field(default_factory=Counter)
    wall: float = 0.0
    cpu: dict[str, float] = field(default_factory=dict)  # client, gunicorn, postgres seconds
    others: float = 0.0  # share of the machine's CPU other processes used meanwhile
    unfinished: int = 0  # requests the time limit cut off

    @property
    def completed(self) -> int:
        return len(self.latencies)

    @property
    def throughput(self) -> float:
        return self.completed / self.wall if self.wall else 0.0

    def percentile(self, share: float) -> float:
        """Milliseconds, nearest rank."""
        if not self.latencies:
            return math.inf
        ordered = sorted(self.latencies)
        return 1000 * ordered[max(0, math.ceil(share * len(ordered)) - 1)]


JSON_HEADERS = {"Content-Type": "application/json", "Accept": "application/json"}


def payload(path: str, body: bytes, headers: Mapping[str, str] = JSON_HEADERS) -> bytes:
    fields = "".join(f"{name}: {value}\r\n" for name, value in headers.items())
    head = (
        f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\n{fields}"
        f"Connection: close\r\nContent-Length: {len(body)}\r\n\r\n"
    )
    return head.encode() + body


async def _drive(
    port: int, payloads: list[bytes], *, clients: int, rate: float | None, limit_s: float, run: Run
) -> None:
    loop = asyncio.get_running_loop()
    run.responses = [None] * len(payloads)
    indexes: Iterator[int] = iter(range(len(payloads)))
    # Paced, the first request is due a little later, once every client waits; at full speed
    # the clients start at once, and so does the clock (an offset here would leave it out of
    # the wall time: a short turn's throughput overstated, a very short one's infinite).
    start = loop.time() + (0.05 if rate else 0.0)
    finished = start

    async def client() -> None:
        nonlocal finished
        for index in indexes:  # shared: each index goes to the next free client
            if rate:
                due = start + index / rate
                delay = due - loop.time()
                if delay > 0:
                    await asyncio.sleep(delay)
                began = due  # open loop: a request that waits for a free client counts it
            else:
                began = loop.time()
            done: asyncio.Future[bytes] = loop.create_future()
            try:
                transport, _ = await loop.create_connection(
                    functools.partial(Exchange, payloads[index], done),
                    "127.0.0.1",
                    port,
                )
                try:
                    raw = await asyncio.wait_for(done, REQUEST_TIMEOUT_S)
                finally:
                    transport.close()
            except (OSError, TimeoutError) as exc:
                run.errors[type(exc).__name__] += 1
                continue
            now = loop.time()
            finished = max(finished, now)
            run.latencies.append(now - began)
            run.responses[index] = raw

    tasks = [asyncio.ensure_future(client()) for _ in range(clients)]
    _, pending = await asyncio.wait(tasks, timeout=limit_s)
    for task in pending:
        task.cancel()
    if pending:
        run.unfinished = len(payloads) - run.completed - sum(run.errors.values())
        await asyncio.gather(*pending, return_exceptions=True)
    run.wall = finished - start


def machine_cpu() -> tuple[float, float]:
    """(busy, total) CPU seconds of the whole machine so far, all cores, from /proc/stat."""
    with open("/proc/stat") as stat:
        values = [int(v) for v in stat.readline().split()[1:8]]
    ticks = os.sysconf("SC_CLK_TCK")
    idle = values[3] + values[4]  # idle, iowait
    return (sum(values) - idle) / ticks, sum(values) / ticks


@dataclass
class Leg:
    """One side of runs that take turns: what it sends, where, and whose CPU it meters."""

    label: str
    port: int
    path: str
    bodies: list[bytes]
    meter: CpuMeter
    turns: list[Run] = field(default_factory=list)  # each turn's own run, in order
    headers: list[Mapping[str, str]] | None = None  # each body's, else JSON_HEADERS


def drive_alternately(
    legs: list[Leg],
    *,
    rounds: int,
    clients: int,
    limit_s: float,
    rate: float | None = None,
) -> list[Run]:
    """Each of `legs` (paced at `rate`, else at full speed) in `rounds` turns: a slice of one,
    then of the next, and so on, in reverse order every other turn, each leg's slices added
    up. Drift in the machine's speed (other tenants, frequency) then weighs on every leg
    alike, and their ratio holds."""
    merged = [Run(leg.label, len(leg.bodies), rate) for leg in legs]
    for turn in range(rounds):
        order = list(zip(merged, legs, strict=True))
        for total, leg in order if turn % 2 == 0 else reversed(order):
            part = slice(turn * len(leg.bodies) // rounds, (turn + 1) * len(leg.bodies) // rounds)
            run = drive(leg.label, leg.port, leg.path, leg.bodies[part], clients=clients,
                        rate=rate, meter=leg.meter, limit_s=limit_s, quiet=True,
                        headers=leg.headers[part] if leg.headers else None)  # fmt: skip
            leg.turns.append(run)
            add_run(total, run)
    for total in merged:
        print_run(total, f"{'paced' if rate else 'full speed'}, {rounds} turns")
    return merged


def add_run(total: Run, run: Run) -> None:
    """Count `run`, the next slice of the same requests, into `total`."""
    total.latencies += run.latencies
    total.responses += run.responses
    total.errors += run.errors
    total.others = (total.others * total.wall + run.others * run.wall) / (
        (total.wall + run.wall) or 1
    )
    total.wall += run.wall
    total.unfinished += run.unfinished
    for name, seconds in run.cpu.items():
        total.cpu[name] = total.cpu.get(name, 0.0) + seconds


def drive(
    label: str,
    port: int,
    path: str,
    bodies: list[bytes],
    *,
    clients: int,
    rate: float | None,
    meter: CpuMeter,
    limit_s: float,
    quiet: bool = False,
    headers: list[Mapping[str, str]] | None = None,
) -> Run:
    """Send `bodies` to `path` (paced at `rate`, else at full speed), each with its
    `headers` (default JSON_HEADERS), and measure; print what was measured unless `quiet`."""
    payloads = [
        payload(path, body, *([headers[index]] if headers else []))
        for index, body in enumerate(bodies)
    ]
    run = Run(label, len(payloads), rate)
    if rate:
        limit_s = min(limit_s, len(payloads) / rate * 1.5 + 30)
    before = meter.sample()
    machine_before = machine_cpu()
    # The client must not stall while it measures: a full collection of this process's heap
    # took 120-200 ms here (one fell inside a measured run), and every request due meanwhile
    # would count the pause as the server's. A run's garbage is collected after it.
    gc.disable()
    try:
        asyncio.run(_drive(port, payloads, clients=clients, rate=rate, limit_s=limit_s, run=run))
    finally:
        gc.enable()
    machine_after = machine_cpu()
    run.cpu = meter.spent(before, meter.sample())
    cores = os.cpu_count() or 1
    elapsed = (machine_after[1] - machine_before[1]) / cores
    busy = (machine_after[0] - machine_before[0]) / cores / elapsed if elapsed else 0.0
    ours = sum(run.cpu.values()) / cores / elapsed if elapsed else 0.0
    run.others = max(0.0, busy - ours)
    if not quiet:
        print_run(run)
    return run


def print_run(run: Run, how: str = "") -> None:
    cores = os.cpu_count() or 1
    how = how or (f"paced at {run.rate:g}/s" if run.rate else "closed loop, full speed")
    cpu = ", ".join(
        f"{name} {1000 * seconds / max(run.completed, 1):.2f}" for name, seconds in run.cpu.items()
    )
    print(
        f"  {run.label:<8} {how:<24} {run.completed:>6}/{run.requests} ok  "
        f"p50 {run.percentile(0.5):7.1f} ms  p99 {run.percentile(0.99):7.1f} ms  "
        f"max {run.percentile(1.0):7.1f} ms  {run.throughput:7.0f} req/s\n"
        f"           CPU ms/request: {cpu}; "
        f"{100 * run.others:.0f}% of the {cores} cores used by other processes; "
        f"load average {os.getloadavg()[0]:.1f}"
        + (f"; errors {dict(run.errors)}" if run.errors else "")
        + (
            f"; {run.unfinished} not sent or unanswered at the time limit" if run.unfinished else ""
        ),
        flush=True,
    )
