"""Serving the ASGI app on Granian, with the Settings already validated.

Before Granian starts: the open-file limit is raised, the port is checked to be free
(Granian binds with SO_REUSEPORT, so a second gateway would otherwise share the port
silently), and a directory for the workers' shared metrics is made. Granian's own
limits on clients are set here, deliberately (docs/design.md section 10).
"""

from __future__ import annotations

import datetime
import functools
import logging
import os
import resource
import shutil
import signal
import socket
import sys
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

from granian import Granian
from granian._internal import load_target
from granian.constants import HTTPModes, Interfaces, Loops
from granian.http import HTTP1Settings
from granian.log import LogLevels
from granian.server import MPServer, MTServer

from tinygw import lifecycle, logs
from tinygw.config import environment, sealing
from tinygw.config.settings import Settings
from tinygw.errors import ConfigError
from tinygw.upstream.pool import connection_budget

if TYPE_CHECKING:
    from tinygw.trust.confidential import Made
    from tinygw.trust.tls import Served

APP_TARGET = "tinygw.api.app:app"

# Connections a worker holds open at once (Granian's `backpressure`: a connection
# takes a permit from accept to close, idle keep-alive ones included). Bounded by the
# clients' half of the open-file limit (client_connections); and at most this many,
# since every connection costs some memory.
MAX_CLIENT_CONNECTIONS = 32768

# Connections waiting to be accepted (the kernel's listen backlog; it caps it at
# net.core.somaxconn).
LISTEN_BACKLOG = 4096

# Granian's buffer per client connection: its HTTP writer queues at most this much of an
# answer the client has not taken (its default, 400 KiB, was most of what a client that
# never reads cost; docs/design.md section 17). It bounds a request head as well: Granian
# answers 431 to one past about 112 KiB here (measured; 400 KiB before).
CLIENT_BUFFER_BYTES = 64 * 1024


def serve(settings: Settings) -> None:
    """Run until SIGTERM or SIGINT; in-flight requests get `drain_seconds` to end.
    Raises ConfigError when the port is taken."""
    logs.configure(settings.log_level)
    logs.log(
        logging.INFO,
        "gateway starting",
        host=settings.host,
        port=settings.port,
        workers=settings.workers,
        workers_from=settings.workers_from,
    )
    for warning in environment.start_warnings(settings):
        logs.log(logging.WARNING, warning)
    refuse_taken_port(settings.host, settings.port)
    remove_leftovers(settings)
    open_files = raise_open_file_limit()
    served = metrics_dir = keys = None
    locks: list[int] = []  # held for this process's life: tinygw.lifecycle tells dead gateways' directories by them
    try:
        served = _tls(settings)  # before the workers start: they all serve this one key
        if served is not None and served.lock is not None:
            locks.append(served.lock)
        metrics = _metrics_dir(settings.workers)
        if metrics is not None:
            metrics_dir, lock = metrics
            locks.append(lock)
            environment.share_metrics_dir(metrics_dir)
        if served is not None:
            environment.share_served_cert(served.cert_path, served.spki_sha256, served.not_after)
        environment.share_workers(settings.workers)  # `auto` resolved once, here: every worker splits by it
        keys = _confidential_keys(settings)  # EHBP's and receipts', made once as the TLS key is
        if keys is not None:
            locks.append(keys.lock)
            environment.share_confidential_keys(keys.directory)
        # Each worker dies with this process (tinygw.lifecycle), whatever kills it.
        _granian(settings, open_files, served).serve(target_loader=functools.partial(_load_app, os.getpid()))
    finally:
        if metrics_dir:
            shutil.rmtree(metrics_dir, ignore_errors=True)
        if served is not None:
            from tinygw.trust import tls

            tls.remove(served)
        if keys is not None:
            from tinygw.trust import confidential

            confidential.remove(keys)
        for fd in locks:
            lifecycle.release(fd)


def _load_app(parent_pid: int, target: str):
    """A worker's first step (Granian's target loader): die with its parent, then load the app.
    Until Granian sets the worker's own handlers, SIGTERM and SIGINT end it at once: the
    handlers it inherited from its parent would swallow them (a gateway stopped while a
    worker starts would wait for it for the whole drain)."""
    lifecycle.die_with_parent(parent_pid)
    inherited = signal.getsignal(signal.SIGTERM)
    for number in (signal.SIGTERM, signal.SIGINT):
        signal.signal(number, signal.SIG_DFL)
    # One that came before this step ran the parent's handler, on the parent's Granian
    # server as this process copied it at the fork: that copy says so.
    if getattr(getattr(inherited, "__self__", None), "interrupt_signal", False):
        os._exit(0)
    return load_target(target)


def remove_leftovers(settings: Settings) -> None:
    """Remove what dead gateways of this user left: key, metrics and unpack directories."""
    temporary = tempfile.gettempdir()
    unpack_parent = os.path.dirname(getattr(sys, "_MEIPASS", "")) or temporary
    parents = [*settings.tls_key_dirs, "/dev/shm", temporary, unpack_parent]  # noqa: S108 -- searched for our own leftovers
    if os.path.basename(temporary).startswith(lifecycle.LAUNCH_PREFIX):  # attest/launch's TMPDIR: its siblings
        parents.append(os.path.dirname(temporary))
    for path in lifecycle.remove_leftovers(parents, keep=temporary):
        logs.log(logging.INFO, "removed what a dead gateway left", path=path)


def _tls(settings: Settings) -> Served | None:
    """The certificate and key to serve, or None with TLS off."""
    if settings.tls_mode == "off":
        return None
    from tinygw.trust import tls  # cryptography is imported only when TLS is on

    if settings.tls_mode == "files":
        cert_file, key_file = settings.tls_cert_file, settings.tls_key_file
        if not cert_file or not key_file:  # tinygw.config.tlsmode refuses this already
            raise ConfigError("TINYGW_TLS", "'files' needs TINYGW_TLS_CERT_FILE and TINYGW_TLS_KEY_FILE")
        served = tls.served_files(cert_file, key_file)
        warn_of_expiry(served.not_after, datetime.datetime.now(datetime.UTC).timestamp())
        return served
    served = tls.write_attested(settings.tls_names, list(settings.tls_key_dirs), datetime.datetime.now(datetime.UTC))
    logs.log(logging.INFO, "attested TLS key made", names=list(settings.tls_names), tls_spki_sha256=served.spki_sha256)
    return served


def _confidential_keys(settings: Settings) -> Made | None:
    """The EHBP and receipt keys for the workers (from the key seed, when there is one), or
    None with both off (docs/confidential.md). The seed is read here, once, even with both
    off (a seed that cannot be read stops the start), and held in this frame only."""
    seed = sealing.read_key_seed(settings.key_seed_file) if settings.key_seed_file else None
    if settings.ehbp == "off" and not settings.receipts:
        return None
    from tinygw.trust import confidential  # cryptography only when one is on

    made = confidential.make(settings.ehbp != "off", settings.receipts, list(settings.tls_key_dirs), seed)
    logs.log(
        logging.INFO,
        "confidential keys made",
        ehbp=settings.ehbp,
        receipts=settings.receipts,
        from_seed=seed is not None,
    )
    return made


# A certificate that expires within this many days is said at start (and its expiry is
# the metric tinygw_tls_certificate_expiry_seconds, for alerts).
EXPIRY_WARNING_DAYS = 14


def warn_of_expiry(not_after: float, now: float) -> None:
    """Say at start when the served certificate has expired, or soon will."""
    when = datetime.datetime.fromtimestamp(not_after, datetime.UTC).isoformat()
    if not_after <= now:
        logs.log(
            logging.ERROR,
            "the served TLS certificate has EXPIRED: clients will refuse it",
            not_after=when,
            expired_days_ago=round((now - not_after) / 86400, 1),
        )
    elif not_after - now < EXPIRY_WARNING_DAYS * 86400:
        logs.log(
            logging.WARNING,
            "the served TLS certificate expires soon",
            not_after=when,
            days_left=round((not_after - now) / 86400, 1),
        )


def refuse_taken_port(host: str, port: int) -> None:
    """Bind the address once without SO_REUSEPORT: Linux refuses that while any socket
    listens there, a gateway with SO_REUSEPORT included."""
    if port == 0:
        return
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except OSError:
        return  # Granian says what is wrong with the address
    family, kind, proto, _, address = infos[0]
    with socket.socket(family, kind, proto) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as Granian: TIME_WAIT is no obstacle
        try:
            probe.bind(address)
        except OSError as e:
            reason = os.strerror(e.errno) if e.errno else type(e).__name__
            raise ConfigError(
                "TINYGW_PORT", f"{host}:{port} is taken ({reason}): is a gateway already serving there?"
            ) from None


def raise_open_file_limit() -> int:
    """Raise the soft limit on open files to the hard one (the workers inherit it), so
    that thousands of idle clients cannot exhaust it; the limit now in force."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != soft:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
            soft = hard
        except (ValueError, OSError):
            pass
    return soft if soft != resource.RLIM_INFINITY else 1 << 20


def client_connections(settings: Settings, open_files: int) -> int:
    """Granian's `backpressure` for a worker with this open-file limit: its half of the
    files (tinygw.upstream.pool.connection_budget; the providers' connections take the
    other), at most MAX_CLIENT_CONNECTIONS."""
    return max(64, min(MAX_CLIENT_CONNECTIONS, connection_budget(open_files)))


def _metrics_dir(workers: int) -> tuple[str, int] | None:
    """This run's directory for the workers' counts, and the file descriptor that holds
    its lock: in memory (/dev/shm) where it can be made, else in the temporary
    directory; said in the log when it is not in memory, and when there is none (each
    worker then counts its own traffic only)."""
    for parent in ("/dev/shm", None):  # noqa: S108 -- a parent for mkdtemp's private directory
        if parent is not None and not os.path.isdir(parent):
            continue
        try:
            made = lifecycle.make_held(parent or tempfile.gettempdir(), "tinygw-metrics-")
        except OSError as e:
            logs.log(
                logging.WARNING,
                "cannot make the metrics directory",
                parent=parent or tempfile.gettempdir(),
                error=os.strerror(e.errno) if e.errno else type(e).__name__,
            )
            continue
        if parent is None:
            logs.log(logging.WARNING, "metrics directory is not in /dev/shm", path=made[0])
        return made
    if workers > 1:
        logs.log(logging.WARNING, "metrics kept per worker: a scrape counts one worker's traffic", workers=workers)
    return None


def _granian(settings: Settings, open_files: int, served: Served | None) -> MPServer | MTServer:
    """Granian's server (one process per worker, or one thread in a free-threaded Python)."""
    return Granian(
        APP_TARGET,
        address=settings.host,
        port=settings.port,
        interface=Interfaces.ASGI,
        # Explicit: Granian's `auto` takes rloop whenever it is installed. uvloop
        # nearly halves the gateway's CPU per request (docs/performance.md).
        loop=Loops.uvloop,
        workers=settings.workers,
        # A worker that dies (SIGKILL, a crash) is started again in its place while the others
        # serve on; it takes the slot it freed (tinygw.observe.metricstore), and the probes it
        # held are given back (tinygw.observe.circuittable). Granian stops the gateway if the
        # worker it started again dies within seconds (a crash loop).
        respawn_failed_workers=True,
        http=HTTPModes.http1,
        websockets=False,
        backlog=LISTEN_BACKLOG,
        backpressure=client_connections(settings, open_files),
        http1_settings=HTTP1Settings(
            keep_alive=True,
            max_buffer_size=CLIENT_BUFFER_BYTES,  # Granian's default: 400 KiB
            # A request head (and an idle keep-alive connection's next one) must arrive
            # within this; bodies are bounded between bytes by the app.
            header_read_timeout=int(settings.client_timeout_seconds * 1000),
        ),
        log_level=LogLevels(settings.log_level),
        log_dictconfig=logs.granian_log_config(settings.log_level),
        # Granian reads 0 as "wait forever"; a zero drain means stop at once. Granian
        # annotates an int, but uses it as join()'s timeout in seconds: a fraction is kept.
        workers_kill_timeout=settings.drain_seconds or 0.001,  # type: ignore[arg-type]
        ssl_cert=Path(served.cert_path) if served is not None else None,
        ssl_key=Path(served.key_path) if served is not None else None,
    )
