"""The HTTP server's own settings (address, auth, limits, shutdown), with SGLang's flag names
where SGLang has the flag.

The engine's flags live in cli.py; `python -m eaglesrv.launch` adds both sets.
"""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass
from typing import Any

from eaglesrv.configs.errors import require

LOG_LEVELS = ("debug", "info", "warning", "error", "critical")
DEFAULT_MAX_QUEUED_REQUESTS = 1024
# SGLang's --tool-call-parser names (eaglesrv/server/tools/formats.py; a test keeps the two equal).
TOOL_CALL_PARSERS = ("qwen25", "hermes", "llama3")


@dataclass(frozen=True)
class ServerConfig:
    """How the API process listens, whom it admits, and how it shuts down.

    max_queued_requests: requests allowed to wait beyond the engine's running cap
        (--max-running-requests); further ones are answered 503 with Retry-After. None: no
        limit (not reachable from the command line).
    max_stop_strings, max_stop_string_length, max_stop_token_ids: per request; stop strings
        are scanned at every token of every choice, so their size is bounded.
    max_choices_per_request: prompts x n of one request (each is an engine request).
    max_logprobs: the most alternatives a request may ask for per token (logprobs,
        top_logprobs, prompt_logprobs, top_logprobs_num), as vLLM's --max-logprobs.
    tool_call_parser: the format the model writes tool calls in (TOOL_CALL_PARSERS); None:
        judged from the model's chat template.
    allowed_origins: web origins whose browser requests are served (with CORS headers);
        "*" allows any. Requests with any other Origin header get 403.
    watchdog_timeout_s: an engine silent this long (not even answering a ping between two
        steps) is reported stalled: /health says 503, its open requests fail with 503.
    shutdown_timeout_s: on SIGTERM, how long in-flight requests may take to finish
        before they are cut off.
    """

    host: str = "127.0.0.1"
    port: int = 30000
    api_key: str | None = None
    log_level: str = "info"
    enable_metrics: bool = False
    max_queued_requests: int | None = DEFAULT_MAX_QUEUED_REQUESTS
    max_request_bytes: int = 32 << 20
    max_stop_strings: int = 64
    max_stop_string_length: int = 1024
    max_stop_token_ids: int = 256
    max_choices_per_request: int = 1024
    max_logprobs: int = 20
    tool_call_parser: str | None = None
    watchdog_timeout_s: float = 300.0
    allowed_origins: tuple[str, ...] = ()
    shutdown_timeout_s: float = 30.0

    def __post_init__(self) -> None:
        require(0 <= self.port <= 65535, f"--port must be in [0, 65535], got {self.port}")
        require(self.log_level in LOG_LEVELS,
                f"--log-level must be one of {', '.join(LOG_LEVELS)}, got {self.log_level!r}")
        require(self.api_key is None or self.api_key != "", "--api-key must not be empty")
        require(
            self.max_queued_requests is None or self.max_queued_requests >= 0,
            f"--max-queued-requests must be >= 0, got {self.max_queued_requests}",
        )
        require(self.max_request_bytes >= 1024,
                f"--max-request-bytes must be at least 1024, got {self.max_request_bytes}")
        for flag, value in (("--max-stop-strings", self.max_stop_strings),
                            ("--max-stop-string-length", self.max_stop_string_length),
                            ("--max-stop-token-ids", self.max_stop_token_ids),
                            ("--max-choices-per-request", self.max_choices_per_request)):
            require(value >= 1, f"{flag} must be at least 1, got {value}")
        require(self.max_logprobs >= 0, f"--max-logprobs must be >= 0, got {self.max_logprobs}")
        require(self.tool_call_parser is None or self.tool_call_parser in TOOL_CALL_PARSERS,
                f"--tool-call-parser must be one of {', '.join(TOOL_CALL_PARSERS)}, got {self.tool_call_parser!r}")
        require(self.watchdog_timeout_s > 0, f"--watchdog-timeout must be > 0, got {self.watchdog_timeout_s}")
        require(self.shutdown_timeout_s >= 0,
                f"--graceful-shutdown-timeout must be >= 0, got {self.shutdown_timeout_s}")


@dataclass(frozen=True)
class _ServerFlag:
    names: tuple[str, ...]
    field: str  # field of ServerConfig
    help: str
    type: Any = None
    choices: tuple | None = None
    store_true: bool = False
    metavar: str | None = None


SERVER_FLAGS: tuple[_ServerFlag, ...] = (
    _ServerFlag(("--host",), "host", "Address to listen on.", str, metavar="HOST"),
    _ServerFlag(("--port",), "port", "Port to listen on.", int, metavar="PORT"),
    _ServerFlag(("--api-key",), "api_key",
                "Require 'Authorization: Bearer <key>' on every endpoint but /health and /metrics.", str,
                metavar="KEY"),
    _ServerFlag(("--log-level",), "log_level", "Logging level of both processes.", str.lower, LOG_LEVELS),
    _ServerFlag(("--enable-metrics",), "enable_metrics", "Serve Prometheus metrics at /metrics.", store_true=True),
    _ServerFlag(("--max-queued-requests",), "max_queued_requests",
                "Requests allowed to queue beyond --max-running-requests; more are refused with 503 and "
                "Retry-After.", int, metavar="N"),
    _ServerFlag(("--max-stop-strings",), "max_stop_strings", "Most stop strings per request.", int, metavar="N"),
    _ServerFlag(("--max-stop-string-length",), "max_stop_string_length", "Longest stop string, in characters.",
                int, metavar="CHARS"),
    _ServerFlag(("--max-stop-token-ids",), "max_stop_token_ids", "Most stop token ids per request.", int,
                metavar="N"),
    _ServerFlag(("--max-choices-per-request",), "max_choices_per_request",
                "Most generations one request may ask for: prompts x n.", int, metavar="N"),
    _ServerFlag(("--max-logprobs",), "max_logprobs",
                "Most alternatives per token a request may ask for (logprobs, top_logprobs, prompt_logprobs, "
                "top_logprobs_num).", int, metavar="N"),
    _ServerFlag(("--tool-call-parser",), "tool_call_parser",
                "The format the model writes tool calls in, for tools on /v1/chat/completions. Default: judged "
                "from the chat template (qwen25 for templates that render no tools).", str, TOOL_CALL_PARSERS),
    _ServerFlag(("--max-request-bytes",), "max_request_bytes", "Largest request body; larger ones get 413.", int,
                metavar="BYTES"),
    _ServerFlag(("--watchdog-timeout",), "watchdog_timeout_s",
                "Seconds without a sign of life from a busy or idle engine before /health says 503 and its "
                "requests fail with 503 (until it answers again).", float, metavar="SECONDS"),
    _ServerFlag(("--allowed-origins",), "allowed_origins",
                "Comma-separated web origins (e.g. https://app.example.com) whose browser requests are served, "
                "with CORS headers; '*' allows any. Requests from other origins get 403.", lambda text: tuple(
                    origin.strip() for origin in text.split(",") if origin.strip()), metavar="ORIGINS"),
    _ServerFlag(("--graceful-shutdown-timeout",), "shutdown_timeout_s",
                "Seconds in-flight requests may take to finish after SIGTERM.", float, metavar="SECONDS"),
)


def add_server_args(parser: argparse.ArgumentParser) -> None:
    """Add the server flags to `parser` as one argument group."""
    group = parser.add_argument_group("server options")
    defaults = {f.name: f.default for f in dataclasses.fields(ServerConfig)}
    for flag in SERVER_FLAGS:
        dest = f"server__{flag.field}"
        if flag.store_true:
            group.add_argument(*flag.names, dest=dest, action="store_true", help=flag.help)
            continue
        default = defaults[flag.field]
        shown = f" (default: {default})" if default not in (None, ()) else ""
        group.add_argument(
            *flag.names, dest=dest, type=flag.type, choices=flag.choices, default=default, help=flag.help + shown,
            metavar=flag.metavar,
        )


def server_config_from_args(args: argparse.Namespace) -> ServerConfig:
    """Build the validated ServerConfig from parsed flags (raises ConfigError)."""
    return ServerConfig(**{flag.field: getattr(args, f"server__{flag.field}") for flag in SERVER_FLAGS})
