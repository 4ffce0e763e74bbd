"""Typed settings from command-line flags and environment variables.

A service declares a frozen dataclass (usually extending `CommonSettings`) whose fields carry help
text via `setting(...)`. `load_settings` builds the command line from it: field `max_queue` becomes
flag `--max-queue` and environment variable `EPD_MAX_QUEUE`. Precedence: flag, then environment,
then the field's default. A bad value, from either source, is reported naming the flag or variable.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import types
import typing
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Literal, TypeVar

ENV_PREFIX = "EPD_"
_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off"}

T = TypeVar("T")


class SettingsError(ValueError):
    """A setting has a value that cannot be used; the message names its flag or variable."""


def setting(default: Any, help: str) -> Any:
    """A dataclass field with help text (shown by `--help`, with its variable and default)."""
    if isinstance(default, list | dict | set):
        raise TypeError("mutable defaults are not allowed; use a tuple")
    return dataclasses.field(default=default, metadata={"help": help})


@dataclasses.dataclass(frozen=True)
class CommonSettings:
    """Settings every EPD process has."""

    host: str = setting("127.0.0.1", "address to listen on (loopback by default)")
    port: int = setting(0, "port to listen on; 0 picks a free one")
    log_level: Literal["debug", "info", "warning", "error"] = setting("info", "log level")
    log_format: Literal["json", "console"] = setting("json", "log line format")
    trace_exporter: Literal["none", "jsonl", "otlp", "console"] = setting(
        "none", "where spans go: nowhere, a JSONL file, an OTLP/gRPC collector, or stdout"
    )
    trace_file: Path = setting(Path("var/traces/spans.jsonl"), "JSONL span file (trace_exporter=jsonl)")
    otlp_endpoint: str = setting("127.0.0.1:4317", "OTLP/gRPC collector address (trace_exporter=otlp)")
    metrics_port: int = setting(0, "serve Prometheus /metrics on HOST:PORT (the --host address); 0 disables it")
    health_port: int = setting(
        0, "also serve grpc.health.v1 alone, plaintext, on HOST:PORT (probes that cannot speak TLS); 0: none"
    )
    tls_ca: Path | None = setting(None, "cluster CA (PEM); with --tls-cert and --tls-key, every connection is TLS")
    tls_cert: Path | None = setting(None, "this process's certificate chain (PEM), CN epd-<role>")
    tls_key: Path | None = setting(None, "this process's private key (PEM)")


@dataclasses.dataclass(frozen=True)
class ClientAuthSettings:
    """Settings of a server that clients call (router, colocated): who may call Generate."""

    auth_tokens_file: Path | None = setting(
        None, "file of bearer tokens clients must present, one per line (needs TLS); none: no token needed"
    )
    auth_tokens: tuple[str, ...] = setting(
        (), "bearer tokens clients must present, comma-separated (prefer the file: flags show in ps)"
    )


def env_name(field: str) -> str:
    """The environment variable of a field."""
    return ENV_PREFIX + field.upper()


def flag_name(field: str) -> str:
    """The command-line flag of a field."""
    return "--" + field.replace("_", "-")


def _convert(raw: str, kind: Any, source: str) -> Any:
    origin = typing.get_origin(kind)
    if origin is Literal:
        choices = typing.get_args(kind)
        if raw not in choices:
            raise SettingsError(f"{source}: {raw!r} is not one of {', '.join(map(str, choices))}")
        return raw
    if origin is tuple:
        (item,) = {a for a in typing.get_args(kind) if a is not Ellipsis}
        return tuple(_convert(part.strip(), item, source) for part in raw.split(",") if part.strip())
    if origin in (typing.Union, types.UnionType):
        inner = [a for a in typing.get_args(kind) if a is not type(None)]
        return None if raw == "" else _convert(raw, inner[0], source)
    if kind is bool:
        lowered = raw.strip().lower()
        if lowered in _TRUE:
            return True
        if lowered in _FALSE:
            return False
        raise SettingsError(f"{source}: {raw!r} is not a boolean (use true/false)")
    try:
        return kind(raw)
    except (TypeError, ValueError):
        raise SettingsError(f"{source}: {raw!r} is not a valid {getattr(kind, '__name__', kind)}") from None


def build_parser(cls: type[Any], prog: str | None = None, description: str | None = None) -> argparse.ArgumentParser:
    """The argparse parser of a settings class (defaults suppressed so precedence can be applied)."""
    parser = argparse.ArgumentParser(
        prog=prog, description=description or (cls.__doc__ or "").strip(), argument_default=argparse.SUPPRESS
    )
    hints = typing.get_type_hints(cls, include_extras=True)
    for field in dataclasses.fields(cls):
        kind = hints[field.name]
        default = field.default
        help_text = f"{field.metadata.get('help', '')} (env {env_name(field.name)}; default: {default!r})"
        if kind is bool:
            parser.add_argument(flag_name(field.name), action=argparse.BooleanOptionalAction, help=help_text)
        else:
            parser.add_argument(flag_name(field.name), dest=field.name, metavar=field.name.upper(), help=help_text)
    return parser


def load_settings(
    cls: type[T],
    argv: Sequence[str] | None = None,
    env: Mapping[str, str] | None = None,
    prog: str | None = None,
) -> T:
    """Fill `cls` from flags (`argv`, default sys.argv[1:]), then `env` (default os.environ).

    Raises `SettingsError` for a bad value; argparse exits with status 2 on unknown flags.
    """
    if not dataclasses.is_dataclass(cls):
        raise TypeError(f"{cls!r} is not a dataclass")
    env = os.environ if env is None else env
    args = vars(build_parser(cls, prog=prog).parse_args(sys.argv[1:] if argv is None else argv))
    hints = typing.get_type_hints(cls)
    values: dict[str, Any] = {}
    for field in dataclasses.fields(cls):
        kind = hints[field.name]
        if field.name in args:
            raw = args[field.name]
            values[field.name] = raw if kind is bool else _convert(raw, kind, flag_name(field.name))
        elif env_name(field.name) in env:
            values[field.name] = _convert(env[env_name(field.name)], kind, env_name(field.name))
    settings = cls(**values)
    _check_ranges(settings)
    return settings


def _check_ranges(settings: Any) -> None:
    for name in ("port", "metrics_port", "health_port", "openai_port"):
        port = getattr(settings, name, 0)
        if not (0 <= port <= 65535 or (name == "openai_port" and port == -1)):
            raise SettingsError(f"{flag_name(name)}: {port} is not a TCP port")
    chunk = getattr(settings, "prefill_chunk_tokens", 1)
    if chunk < 1:
        raise SettingsError(f"{flag_name('prefill_chunk_tokens')}: {chunk} is not a positive number of tokens")
    if getattr(settings, "prefill_batch_steps", 0) < 0:
        raise SettingsError(f"{flag_name('prefill_batch_steps')}: {settings.prefill_batch_steps} is below 0")
    _check_engine_life(settings)
    _check_engine_device(settings)


def _check_engine_life(settings: Any) -> None:
    """The vLLM engine-life settings (libs/backends/settings.py), where a service has them."""
    if not hasattr(settings, "engine_start_timeout_s"):
        return
    positive = ("engine_start_timeout_s", "engine_restart_window_s", "engine_backoff_start_s")
    for name in positive:
        if not getattr(settings, name) > 0:
            raise SettingsError(f"{flag_name(name)}: {getattr(settings, name)} is not a positive number of seconds")
    if settings.engine_hang_timeout_s < 0:
        raise SettingsError(f"{flag_name('engine_hang_timeout_s')}: {settings.engine_hang_timeout_s} is negative")
    if settings.engine_max_restarts < 0:
        raise SettingsError(f"{flag_name('engine_max_restarts')}: {settings.engine_max_restarts} is negative")
    if settings.engine_backoff_max_s < settings.engine_backoff_start_s:
        raise SettingsError(
            f"{flag_name('engine_backoff_max_s')}: {settings.engine_backoff_max_s} is less than "
            f"{flag_name('engine_backoff_start_s')} {settings.engine_backoff_start_s}"
        )


_DTYPES = ("auto", "float32", "float16", "bfloat16")
_WILDCARDS = ("", "0.0.0.0", "::", "[::]")


def _check_engine_device(settings: Any) -> None:
    """vLLM's device and host settings (libs/backends/settings.py), where a service has them."""
    if not hasattr(settings, "gpu_memory_utilization"):
        return
    if not 0.0 <= settings.gpu_memory_utilization <= 1.0:
        raise SettingsError(
            f"{flag_name('gpu_memory_utilization')}: {settings.gpu_memory_utilization} is not a fraction in [0, 1]"
        )
    if settings.gpu_memory_utilization == 0 and settings.kv_cache_mib < 1:
        raise SettingsError(
            f"{flag_name('kv_cache_mib')}: {settings.kv_cache_mib} MiB with no {flag_name('gpu_memory_utilization')}"
        )
    if not settings.device.strip():
        raise SettingsError(f"{flag_name('device')}: empty (cpu, cuda, xpu, ...)")
    # Any CPU of the host: the service itself may run elsewhere (libs/launch/placement.py).
    if missing := [cpu for cpu in settings.engine_cpus if not 0 <= cpu < (os.cpu_count() or 1)]:
        raise SettingsError(
            f"{flag_name('engine_cpus')}: CPU {missing[0]} is not on this host (0-{(os.cpu_count() or 1) - 1})"
        )
    if settings.dtype not in _DTYPES:
        raise SettingsError(f"{flag_name('dtype')}: {settings.dtype!r} is not one of {', '.join(_DTYPES)}")
    if settings.tensor_parallel_size < 1:
        raise SettingsError(f"{flag_name('tensor_parallel_size')}: {settings.tensor_parallel_size} is not >= 1")
    if settings.max_num_batched_tokens < 0:
        budget = settings.max_num_batched_tokens
        raise SettingsError(f"{flag_name('max_num_batched_tokens')}: {budget} is not >= 0 (0: vLLM's default)")
    if not 0 <= settings.nixl_side_channel_port <= 65535:
        port = settings.nixl_side_channel_port
        raise SettingsError(f"{flag_name('nixl_side_channel_port')}: {port} is not a TCP port")
    # Peers dial the address the engine advertises: a wildcard listen address names no host.
    if settings.engine == "vllm" and not settings.engine_host_ip and settings.host in _WILDCARDS:
        raise SettingsError(
            f"{flag_name('engine_host_ip')}: needed with --host {settings.host!r} (peers must dial the engine's "
            "NIXL side channel at a real address)"
        )


def main_settings(cls: type[T], prog: str) -> T:
    """`load_settings` for a program's main: a bad value prints a usage error and exits 2."""
    try:
        return load_settings(cls, prog=prog)
    except SettingsError as exc:
        build_parser(cls, prog=prog).error(str(exc))
        raise  # unreachable: error() exits
