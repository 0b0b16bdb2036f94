"""The command line: `tinygw serve | check | version | demo | fake` (docs/design.md section 1).

`--help`/`-h` and `--version` work everywhere (`tinygw serve --help` prints the help
and serves nothing); any other argument is a usage error, exit 2.
"""

from __future__ import annotations

import hashlib
import multiprocessing
import sys

from tinygw import __version__

# command -> (arguments it takes, one line, more help)
COMMANDS = {
    "serve": (
        "",
        "serve the gateway (configuration from the environment)",
        "Serves on Granian at TINYGW_HOST:TINYGW_PORT (127.0.0.1:8080) with TINYGW_WORKERS\n"
        "workers (auto, the default: one per CPU it may use); SIGTERM drains for up to\n"
        "TINYGW_DRAIN_SECONDS. Every variable is in docs/configuration.md; a bad value\n"
        "exits 2 naming it.",
    ),
    "check": (
        "",
        "validate the configuration, print it with secrets redacted, and its hash",
        "Prints the effective configuration (keys as variable names only), the number of\n"
        "workers and where it came from, and the config_sha256; exit 0 when valid, 2 with\n"
        "the offending variable or JSON path.",
    ),
    "version": ("", "print the version (and the sha256 of this executable when frozen)", ""),
    "demo": (
        "",
        "run a scripted outage against built-in fake upstreams and narrate it",
        "Starts two fake providers and a gateway, sends traffic through an outage and\n"
        "prints what the gateway did; exit 0 when the scripted story happened.",
    ),
    "fake": (
        "[PORT]",
        "run the built-in fake provider (OpenAI, Anthropic, Bedrock and Vertex) on 127.0.0.1",
        "A well-behaved stand-in provider for trying tinygw without keys: chat, completions,\n"
        "embeddings (base64 when encoding_format says so), responses, messages,\n"
        "count_tokens and model listings, every route streamed when asked; it calls the\n"
        "first function tool once when a request has tools, and answers text once the\n"
        "request carries the tool's result. It plays the clouds too: Claude on Bedrock\n"
        "(/model/{model}/invoke, /model/{model}/invoke-with-response-stream), Claude on\n"
        "Vertex (.../models/{model}:rawPredict, :streamRawPredict) and Google's token\n"
        "endpoint (/token, for a service-account key's token_uri), checking no signature\n"
        "and no token. Prints its port (a free one without PORT), then serves until\n"
        "interrupted. Point a provider at it:\n"
        '  {"base_url": "http://127.0.0.1:PORT/v1", "api": "openai"}\n'
        '  {"base_url": "http://127.0.0.1:PORT", "api": "anthropic"}\n'
        '  {"base_url": "http://127.0.0.1:PORT", "api": "bedrock", "region": ..., "aws_..._env": ...}\n'
        '  {"base_url": "http://127.0.0.1:PORT", "api": "vertex", "project": ..., "region": ...,\n'
        '   "credentials_env": ...} with "token_uri": "http://127.0.0.1:PORT/token" in the key\n'
        "(docs/clients.md: the cloud modes on tinygw fake, step by step).",
    ),
}

USAGE = (
    "usage: tinygw COMMAND [--help] [--version]\n\n"
    + "".join(f"  {name:<9} {summary}\n" for name, (_, summary, _) in COMMANDS.items())
    + "\nRun `tinygw COMMAND --help` for a command's own help.\n"
)


def command_help(name: str) -> str:
    arguments, summary, more = COMMANDS[name]
    return f"usage: tinygw {name}{' ' + arguments if arguments else ''}\n\n{summary}\n" + (
        f"\n{more}\n" if more else ""
    )


EXIT_CONFIG = 2
EXIT_USAGE = 2  # as argparse and most Unix tools


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
    from tinygw.config import environment
    from tinygw.errors import ConfigError

    environment.forget_inherited()  # serve sets those for its workers; nobody else may
    try:
        return environment.from_environ()
    except ConfigError as e:
        print(f"tinygw: configuration error: {e}", file=sys.stderr)
        sys.exit(EXIT_CONFIG)


def _key_seed_or_exit(settings) -> None:
    """Read the key seed as serve will (and forget it): exit 2 when serve could not."""
    from tinygw.config import sealing
    from tinygw.errors import ConfigError

    if settings.key_seed_file:
        try:
            sealing.read_key_seed(settings.key_seed_file)
        except ConfigError as e:
            print(f"tinygw: configuration error: {e}", file=sys.stderr)
            sys.exit(EXIT_CONFIG)


def _usage_error(message: str, usage: str = USAGE) -> None:
    print(f"tinygw: {message}\n{usage}", end="", file=sys.stderr)
    sys.exit(EXIT_USAGE)


def _version() -> None:
    digest = artifact_sha256()
    print(f"tinygw {__version__}" + (f" sha256:{digest}" if digest else ""))


def main(argv: list[str] | None = None) -> None:
    multiprocessing.freeze_support()
    args = sys.argv[1:] if argv is None else argv
    command, rest = (args[0], args[1:]) if args else ("", [])
    if command in ("-h", "--help", "help"):
        print(USAGE, end="")
        return
    if command == "--version":
        _version()
        return
    if command not in COMMANDS:
        _usage_error(f"unknown command {command!r}" if command else "no command given")
    if "-h" in rest or "--help" in rest:
        print(command_help(command), end="")
        return
    if "--version" in rest:
        _version()
        return
    port_given = command == "fake" and rest and rest[0].isascii() and rest[0].isdigit() and int(rest[0]) <= 65535
    extra = rest[1:] if port_given else rest
    if extra:
        _usage_error(f"unexpected argument {extra[0]!r}", command_help(command))
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

        from tinygw.config import environment

        settings = _settings_or_exit()
        _key_seed_or_exit(settings)  # a green check is a start: serve reads it too
        for warning in environment.start_warnings(settings):
            print(f"tinygw: warning: {warning}", file=sys.stderr)
        effective = settings.effective()
        print(msgspec.json.format(msgspec.json.encode(effective, order="sorted"), indent=2).decode())
        print(f"workers: {settings.workers} ({settings.workers_from})")
        print(f"config_sha256: {settings.config_sha256()}")
    elif command == "version":
        _version()
    elif command == "demo":
        from tinygw.fake import demo

        sys.exit(demo.main(rest))
    elif command == "fake":
        from tinygw.fake import upstream as fake_upstream

        fake_upstream.main(rest)
