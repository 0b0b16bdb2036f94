"""The command line: `tinygw serve | check | version | demo` (SPEC section 1)."""

from __future__ import annotations

import hashlib
import multiprocessing
import sys

from tinygw import __version__

USAGE = """usage: tinygw COMMAND

  serve     serve the gateway (configuration from the environment)
  check     validate the configuration, print it with secrets redacted, and its hash
  version   print the version (and the sha256 of this executable when frozen)
  demo      run a scripted outage against built-in fake upstreams and narrate it
"""

EXIT_CONFIG = 2


def artifact_sha256() -> str:
    """sha256 of the running executable when frozen, else an empty string."""
    if not getattr(sys, "frozen", False):
        return ""
    digest = hashlib.sha256()
    with open(sys.executable, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _settings_or_exit():
    from tinygw import config
    from tinygw.errors import ConfigError

    config.forget_inherited()  # serve sets those for its workers; nobody else may
    try:
        return config.from_environ()
    except ConfigError as e:
        print(f"tinygw: configuration error: {e}", file=sys.stderr)
        sys.exit(EXIT_CONFIG)


def main(argv: list[str] | None = None) -> None:
    multiprocessing.freeze_support()
    args = sys.argv[1:] if argv is None else argv
    command = args[0] if args else ""
    if command == "serve":
        from tinygw import server
        from tinygw.errors import ConfigError

        settings = _settings_or_exit()
        try:
            server.serve(settings)
        except ConfigError as e:
            print(f"tinygw: configuration error: {e}", file=sys.stderr)
            sys.exit(EXIT_CONFIG)
    elif command == "check":
        import msgspec

        settings = _settings_or_exit()
        effective = settings.effective()
        print(msgspec.json.format(msgspec.json.encode(effective, order="sorted"), indent=2).decode())
        print(f"config_sha256: {settings.config_sha256()}")
    elif command == "version":
        digest = artifact_sha256()
        print(f"tinygw {__version__}" + (f" sha256:{digest}" if digest else ""))
    elif command == "demo":
        from tinygw import demo

        sys.exit(demo.main(args[1:]))
    elif command in ("-h", "--help", "help"):
        print(USAGE, end="")
    else:
        print(USAGE, end="", file=sys.stderr)
        sys.exit(EXIT_CONFIG if command else 1)
