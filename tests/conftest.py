"""Test fixtures: fake upstreams in this process, real tinygw processes on loopback."""

from __future__ import annotations

import contextlib
import functools
import io
import json
import os
import resource
import signal
import socket
import ssl
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import pytest
from hypothesis import HealthCheck, settings

from tinygw.fake.upstream import FakeUpstream, well_behaved
from tinygw.lifecycle import adopt_orphans

# Hypothesis: a few derandomized examples a test in `make test` (reproducible, fast), many
# random ones in `make fuzz` (HYPOTHESIS_PROFILE=long). No example database in the tree.
_NOT_CHECKED = [HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.large_base_example]
settings.register_profile(
    "default",
    max_examples=100,
    deadline=None,
    derandomize=True,
    database=None,
    print_blob=True,
    suppress_health_check=_NOT_CHECKED,
)
settings.register_profile(
    "long", max_examples=5_000, deadline=None, database=None, print_blob=True, suppress_health_check=_NOT_CHECKED
)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "default"))

ROOT = Path(__file__).resolve().parent.parent
START_SECONDS = 20  # a gateway that is not answering /healthz by then has failed


# For readiness polls and plain calls to a gateway serving TLS: the tests that are about
# TLS check the certificate themselves (attest/verify, a pinned certificate).
UNVERIFIED_TLS = ssl.create_default_context()
UNVERIFIED_TLS.check_hostname = False
UNVERIFIED_TLS.verify_mode = ssl.CERT_NONE


# Ports: other test suites may run on this host at the same time, and a gateway binds its
# port with SO_REUSEPORT (Granian), which lets another process of this user bind it too.
# A port picked by binding port 0 and closing the socket could be picked again, by another
# suite, before the gateway binds it: the two gateways would then share its connections.
# So the socket that picked a port stays open, bound and never listening, as long as the
# port is the test's. The kernel gives a bind to port 0 only a port where no socket is
# bound (while one is left), nor does a connect() take it as its own port; a gateway binds
# beside it: both have SO_REUSEADDR, and it does not listen (nor does a gateway's own check
# that the port is free, docs/design.md "One port, one gateway").


def reserve_port() -> socket.socket:
    """A socket that holds a loopback port for a gateway the caller starts there (its
    `getsockname()[1]`) until it is closed."""
    reservation = socket.socket()
    reservation.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    reservation.bind(("127.0.0.1", 0))
    return reservation


HELD_PORTS: list[socket.socket] = []  # free_port()'s reservations, closed after each test


@pytest.fixture(autouse=True)
def _held_ports():
    """The ports free_port() gave this test, held until its end."""
    yield
    while HELD_PORTS:
        HELD_PORTS.pop().close()


def free_port() -> int:
    """A loopback port for a process this test starts there: nothing else on the host
    (another suite's gateway) gets it until the test ends."""
    HELD_PORTS.append(reserve_port())
    return HELD_PORTS[-1].getsockname()[1]


@functools.cache
def _never_listening() -> socket.socket:
    bound = socket.socket()  # without SO_REUSEADDR: no other socket can bind there at all
    bound.bind(("127.0.0.1", 0))
    return bound


def closed_port() -> int:
    """A loopback port nothing listens on, for the whole session: connecting to it is
    refused (the kernel answers a SYN to a socket that does not listen with a reset)."""
    return _never_listening().getsockname()[1]


def wait_until(predicate, seconds: float = 5.0, what: str = "condition"):
    """Poll `predicate` until it returns a true value, or fail after `seconds`."""
    deadline = time.monotonic() + seconds
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.02)


def read_request(conn: socket.socket, received: bytes = b"") -> bytes | None:
    """Read one request (its head and content-length body) from a raw socket that fakes a
    provider, `received` being what was read of it already; what was read past it, or None
    when the client closed first."""
    while b"\r\n\r\n" not in received:
        if not (more := conn.recv(65536)):
            return None
        received += more
    head, received = received.split(b"\r\n\r\n", 1)
    length = next(
        int(line.split(b":")[1]) for line in head.split(b"\r\n") if line.lower().startswith(b"content-length")
    )
    while len(received) < length:
        received += conn.recv(65536)
    return received[length:]


def tcp_queues() -> dict[tuple[int, int], tuple[int, int]]:
    """(local port, remote port) -> (bytes queued to send, bytes received and not read) of
    every IPv4 TCP socket on this machine: the kernel's share of a relayed answer."""
    queues = {}
    with open("/proc/net/tcp") as table:
        next(table)
        for line in table:
            fields = line.split()
            local, remote = (int(a.split(":")[1], 16) for a in fields[1:3])
            tx, rx = (int(q, 16) for q in fields[4].split(":"))
            queues[local, remote] = (tx, rx)
    return queues


def wait_until_client_left(gateway, fake) -> None:
    """A client left a request whose provider hangs: the provider's connection is closed
    and the request is logged as 499."""
    wait_until(lambda: fake.peer_closed >= 1, seconds=3, what="the upstream connection to be closed")
    wait_until(
        lambda: any(r.get("msg") == "request" and r.get("status") == 499 for r in gateway.log_records()),
        seconds=3,
        what="the request to be logged as 499",
    )


def gateway_command() -> list[str]:
    """`TINYGW_BINARY` runs the tests against a frozen build instead of the source."""
    binary = os.environ.get("TINYGW_BINARY")
    return [binary] if binary else [sys.executable, "-m", "tinygw"]


def run_tinygw(
    args: list[str], environ: dict[str, str], seconds: float = 30, prefix: list[str] | None = None
) -> subprocess.CompletedProcess:
    """One run of the command line to its end, with `environ` as its whole environment."""
    full = {"PATH": os.environ.get("PATH", ""), "PYTHONPATH": str(ROOT), **environ}
    return subprocess.run(
        [*(prefix or []), *gateway_command(), *args],
        env=full,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=seconds,
    )


class LoopbackServer:
    """A listening socket on loopback whose every connection is handed to `connected`
    in a thread of its own (a test's relay or balancer); `close()` stops it."""

    def __init__(self) -> None:
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            threading.Thread(target=self.connected, args=(client,), daemon=True).start()

    def connected(self, client: socket.socket) -> None:
        raise NotImplementedError

    def close(self) -> None:
        self.listener.close()


def check_in_process(environ: dict[str, str]) -> subprocess.CompletedProcess:
    """`tinygw check` run in this process (tinygw.cli.main), with `environ` as its whole
    environment: what run_tinygw(["check"], environ) gives, without starting a Python.
    The command line's own exit codes stay tested as processes."""
    from tinygw import cli

    saved = dict(os.environ)
    out, err = io.StringIO(), io.StringIO()
    code = 0
    os.environ.clear()
    os.environ.update({"PATH": saved.get("PATH", ""), **environ})
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                cli.main(["check"])
            except SystemExit as e:
                code = e.code if isinstance(e.code, int) else int(e.code is not None)
    finally:
        os.environ.clear()
        os.environ.update(saved)
    return subprocess.CompletedProcess(["tinygw", "check"], code, out.getvalue(), err.getvalue())


def run_command(command: str, environ: dict[str, str]) -> subprocess.CompletedProcess:
    """`tinygw check` in this process, any other command as a process of its own."""
    return check_in_process(environ) if command == "check" else run_tinygw([command], environ)


class Gateway:
    """A real `tinygw serve` process on a free loopback port."""

    def __init__(
        self,
        config: dict,
        env: dict[str, str],
        log_path: Path,
        soft_open_files: int | None = None,
        prefix: list[str] | None = None,
        port: int | None = None,
    ) -> None:
        # held until stop(): a gateway started again on this port (port=) finds it still ours
        self._reservation = None if port else reserve_port()
        self.port = port or self._reservation.getsockname()[1]
        self.log_path = log_path
        self.env = {
            "PATH": os.environ.get("PATH", ""),
            "PYTHONPATH": str(ROOT),
            "TINYGW_CONFIG": json.dumps(config),
            "TINYGW_PORT": str(self.port),
            "TINYGW_WORKERS": "1",  # the default is one per CPU: a test that wants more says so
            **env,
        }
        self._log = open(log_path, "wb")

        def limit_open_files() -> None:  # as on hosts whose default soft limit is low
            if soft_open_files is not None:
                hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
                resource.setrlimit(resource.RLIMIT_NOFILE, (soft_open_files, hard))

        self.process = subprocess.Popen(
            [*(prefix or []), *gateway_command(), "serve"],
            env=self.env,
            cwd=ROOT,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            preexec_fn=limit_open_files,
        )
        try:
            wait_until(self._ready, START_SECONDS, "the gateway to answer /healthz")
        except AssertionError:
            self.stop()
            raise AssertionError(f"gateway did not start:\n{self.logs()}") from None

    @property
    def scheme(self) -> str:
        return "https" if self.env.get("TINYGW_TLS", "off") != "off" else "http"

    @property
    def url(self) -> str:
        return f"{self.scheme}://127.0.0.1:{self.port}"

    def _ready(self) -> bool:
        if self.process.poll() is not None:
            raise AssertionError(f"gateway exited with {self.process.returncode}:\n{self.logs()}")
        try:
            with urllib.request.urlopen(f"{self.url}/healthz", timeout=1, context=UNVERIFIED_TLS) as r:
                return r.status == 200
        except OSError:
            return False

    def logs(self) -> str:
        if not self._log.closed:  # stopped: all of it is in the file
            self._log.flush()
        return self.log_path.read_text(errors="replace")

    def log_records(self) -> list[dict]:
        """The JSON lines logged so far: the complete ones (a line being written may be
        read in part: the kernel can show the reader a write's first page before its last)."""
        text = self.logs()
        records = []
        for line in text[: text.rfind("\n") + 1].splitlines():
            if line.startswith("{"):
                records.append(json.loads(line))
        return records

    @property
    def server_pid(self) -> int:
        """The gateway's own process, whose children are its workers: the process started,
        or under a frozen build (`TINYGW_BINARY`) its only child: a PyInstaller onefile
        executable unpacks itself and runs the program in a child it waits for."""
        if not os.environ.get("TINYGW_BINARY"):
            return self.process.pid
        (pid,) = wait_until(lambda: children(self.process.pid), 10, "the frozen build's program")
        return pid

    def held_directories(self, prefix: str) -> set[Path]:
        """The directories named `prefix`* that the gateway's process holds open: the ones
        it made (tinygw.lifecycle locks each for the process's life), whatever other
        gateways on the host make meanwhile."""
        held = set()
        for fd in Path(f"/proc/{self.server_pid}/fd").iterdir():
            try:
                target = Path(os.readlink(fd))
            except OSError:  # closed meanwhile
                continue
            if target.name.startswith(prefix) and target.is_dir():
                held.add(target)
        return held

    def stop(self, sig=signal.SIGTERM, seconds: float = 15) -> int:
        if self.process.poll() is None:
            self.process.send_signal(sig)
            try:
                self.process.wait(seconds)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self._log.close()
        if self._reservation is not None:
            self._reservation.close()
        return self.process.returncode


@pytest.fixture
def fake():
    upstream = FakeUpstream().start_in_thread()
    yield upstream
    upstream.stop_thread()


def module_fake():
    """A module's `fake` (one fake provider for the module's gateway, replacing the
    per-test one above) and `fresh_fake`, which resets it before each test of the
    module: well-behaved, no requests recorded, no connections counted. In the module:
    `fake, fresh_fake = module_fake()`."""

    @pytest.fixture(scope="module")
    def fake():
        upstream = FakeUpstream().start_in_thread()
        yield upstream
        upstream.stop_thread()

    @pytest.fixture(autouse=True)
    def fresh_fake(fake):
        fake.script = well_behaved("fake")
        fake.requests.clear()
        fake.peer_closed = fake.accepted = 0
        yield

    return fake, fresh_fake


@pytest.fixture(scope="module")
def fake_port():
    """`tinygw fake` as the docs start it: a process of its own, its port on stdout."""
    process = subprocess.Popen(
        [*gateway_command(), "fake"],
        env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"},
        cwd=ROOT,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        yield int(process.stdout.readline())  # its first line, once it listens
    finally:
        process.terminate()
        process.wait(10)


@pytest.fixture
def start_gateway(tmp_path):
    started: list[Gateway] = []

    def start(
        config: dict,
        soft_open_files: int | None = None,
        prefix: list[str] | None = None,
        port: int | None = None,
        **env: str,
    ) -> Gateway:
        gateway = Gateway(config, env, tmp_path / f"gateway-{len(started)}.log", soft_open_files, prefix, port)
        started.append(gateway)
        return gateway

    yield start
    for gateway in started:
        gateway.stop()


def call(method: str, url: str, body=None, headers: dict | None = None, timeout: float = 10):
    """(status, headers (case-insensitive), body bytes) of one request; errors are answers too."""
    data = body if isinstance(body, (bytes, type(None))) else json.dumps(body).encode()
    request = urllib.request.Request(url, data=data, method=method, headers=headers or {})
    if data is not None and "Content-Type" not in (headers or {}):
        request.add_header("Content-Type", "application/json")
    try:
        with urllib.request.urlopen(request, timeout=timeout, context=UNVERIFIED_TLS) as r:
            return r.status, r.headers, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.headers, e.read()


def metric_value(gateway: Gateway, name: str, **labels: str) -> float | None:
    """The sum of the samples of `name` whose labels include `labels` (other labels,
    such as `worker`, are summed over), parsed by Prometheus' own parser; None if none."""
    return metric_in(call("GET", f"{gateway.url}/metrics")[2].decode(), name, **labels)


def metric_in(text: str, name: str, **labels: str) -> float | None:
    """metric_value's sum, of a scrape's `text`."""
    from prometheus_client.parser import text_string_to_metric_families

    values = [
        sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items())
    ]
    return sum(values) if values else None


# ---- shared by several modules --------------------------------------------------------


def second_fake(name: str, scope: str = "function"):
    """A fixture of one more well-behaved fake provider that answers as model `name`
    (a fallback, a backup, a healthy provider beside a failing one). In the module:
    `backup = second_fake("backup", scope="module")`."""

    @pytest.fixture(scope=scope)
    def upstream_fixture():
        upstream = FakeUpstream(well_behaved(name)).start_in_thread()
        yield upstream
        upstream.stop_thread()

    return upstream_fixture


def provider(fake: FakeUpstream, **extra) -> dict:
    """A provider entry of the configuration for an OpenAI-shaped fake, without model listing."""
    return {"base_url": f"{fake.url}/v1", "api": "openai", "listing": False, **extra}


def sdk_clients(api_key: str):
    """`(openai_client, anthropic_client)`: the official SDKs pointed at a gateway with
    `api_key`, no retries of their own. In the module:
    `openai_client, anthropic_client = sdk_clients(GATEWAY_KEY)`."""
    import anthropic
    import openai

    def openai_client(gateway) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{gateway.url}/v1", api_key=api_key, max_retries=0, timeout=10)

    def anthropic_client(gateway) -> anthropic.Anthropic:
        return anthropic.Anthropic(base_url=gateway.url, api_key=api_key, max_retries=0, timeout=10)

    return openai_client, anthropic_client


# ---- the suite leaves no process behind (docs/design.md section 13) ---------------------


def pytest_configure(config):
    # Orphans of this session (a worker whose gateway died, say) become its children
    # rather than init's, so that the check below can find them.
    adopt_orphans()


def children(parent: int | None = None) -> dict[int, str]:
    """The children of `parent` (this process by default): pid -> state (R, S, Z ...) and
    command line."""
    parent = os.getpid() if parent is None else parent
    found = {}
    for pid in os.listdir("/proc"):
        try:
            with open(f"/proc/{pid}/stat", "rb") as f:
                fields = f.read().rpartition(b")")[2].split()
            if int(fields[1]) == parent:
                with open(f"/proc/{pid}/cmdline", "rb") as f:
                    command = f.read().replace(bytes(1), b" ").decode(errors="replace")
                found[int(pid)] = f"{fields[0].decode()} {command}"
        except (OSError, ValueError, IndexError):
            continue
    return found


def pytest_sessionfinish(session, exitstatus):
    """Fail the session when a process it started is still alive (and end that process,
    and then what it leaves: its own children come to this process as they are orphaned)."""

    def alive() -> dict[int, str]:
        for pid, state in children().items():
            if state.startswith("Z"):
                try:
                    os.waitpid(pid, os.WNOHANG)
                except ChildProcessError:
                    pass
        return {pid: state for pid, state in children().items() if not state.startswith("Z")}

    try:
        wait_until(lambda: not alive(), 5.0, "the session's processes to end")
        return
    except AssertionError:
        pass
    left: dict[int, str] = {}
    for _ in range(50):  # bounded: a tree a few levels deep
        found = alive()
        if not found:
            break
        left |= found
        for pid in found:
            os.kill(pid, signal.SIGKILL)
        time.sleep(0.1)
    listing = "".join(f"  {pid} {command}\n" for pid, command in left.items())
    sys.stderr.write(f"\nprocesses left behind by the tests:\n{listing}")
    session.exitstatus = 1
