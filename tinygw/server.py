"""Serving the ASGI app on Granian, with the Settings already validated."""

from __future__ import annotations

import os
import shutil
import tempfile

from granian import Granian
from granian.constants import HTTPModes, Interfaces
from granian.http import HTTP1Settings
from granian.log import LogLevels

from tinygw import config, logs
from tinygw.settings import Settings

APP_TARGET = "tinygw.app:app"


def serve(settings: Settings) -> None:
    """Run until SIGTERM or SIGINT; in-flight requests get `drain_seconds` to end."""
    try:  # this run's workers' counts, in memory (tmpfs) where the system has it
        metrics_dir = tempfile.mkdtemp(prefix="tinygw-metrics-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
    except OSError:
        metrics_dir = None  # each worker then counts its own traffic only
    if metrics_dir:
        config.share_metrics_dir(metrics_dir)
    try:
        _granian(settings).serve()
    finally:
        if metrics_dir:
            shutil.rmtree(metrics_dir, ignore_errors=True)


def _granian(settings: Settings) -> Granian:
    return Granian(
        APP_TARGET,
        address=settings.host,
        port=settings.port,
        interface=Interfaces.ASGI,
        workers=settings.workers,
        http=HTTPModes.http1,
        websockets=False,
        http1_settings=HTTP1Settings(keep_alive=True),
        log_level=LogLevels(settings.log_level),
        log_dictconfig=logs.granian_log_config(settings.log_level),
        # Granian reads 0 as "wait forever"; a zero drain means stop at once.
        workers_kill_timeout=settings.drain_seconds or 0.001,
    )
