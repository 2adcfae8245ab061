"""Typed configuration: every field is a command-line flag and also an environment variable.

Declare a dataclass whose fields use :func:`setting`; :func:`load` fills it from (in order of precedence)
command-line flags, environment variables, then defaults, converts types and runs the class's ``validate``.
The env var of a field is ``<ENV_PREFIX><FIELD_NAME upper>`` unless the field names its own (shared settings such
as ``KVSHUTTLE_ETCD_ENDPOINTS``).

No flag silently does nothing: a ``validate`` calls :func:`require_effect` for each setting whose effect depends on
another one, and a setting that was *given* a value other than its default while the other makes it a no-op is
a :class:`ConfigError` naming both (``load`` turns it into argparse's usage error, exit status 2). Given means: on
the command line, or in the command's own (prefixed) env var. A shared env var (a field's own ``env``: set for a
whole group of processes, as the local stack and the chart set ``KVSHUTTLE_OTLP_ENDPOINT``) and a config built in
code count as not given.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import typing
from collections.abc import Sequence
from typing import Any, TypeVar

T = TypeVar("T")


class ConfigError(ValueError):
    """A setting with a wrong type or value; the message names the flag and the env var."""


def setting(default: Any, help: str, *, env: str | None = None, choices: Sequence[Any] | None = None,
            secret: bool = False) -> Any:
    """A config field; ``secret`` ones (passwords) are left out of the config's repr."""
    return dataclasses.field(default=default, repr=not secret,
                             metadata={"help": help, "env": env, "choices": choices, "secret": secret})


def env_name(cls: type, f: dataclasses.Field) -> str:
    return f.metadata.get("env") or f"{getattr(cls, 'ENV_PREFIX', 'KVSHUTTLE_')}{f.name.upper()}"


def flag_name(f: dataclasses.Field) -> str:
    return "--" + f.name.replace("_", "-")


def _convert(kind: type, raw: str, where: str) -> Any:
    if kind is bool:
        low = raw.strip().lower()
        if low in ("1", "true", "yes", "on"):
            return True
        if low in ("0", "false", "no", "off", ""):
            return False
        raise ConfigError(f"{where}: expected a boolean, got {raw!r}")
    try:
        return kind(raw)
    except ValueError:
        raise ConfigError(f"{where}: expected {kind.__name__}, got {raw!r}") from None


def add_arguments(cls: type, parser: argparse.ArgumentParser) -> None:
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        kind = hints[f.name]
        help_text = f"{f.metadata.get('help', '')} [env {env_name(cls, f)}; default {f.default!r}]"
        if kind is bool:
            parser.add_argument(flag_name(f), dest=f.name, default=None, help=help_text,
                                action=argparse.BooleanOptionalAction)
        else:
            parser.add_argument(flag_name(f), dest=f.name, default=None, help=help_text, metavar=f.name.upper(),
                                choices=f.metadata.get("choices"), type=lambda s, k=kind, n=flag_name(f): _convert(k, s, n))


def from_namespace(cls: type[T], ns: argparse.Namespace | None = None, environ: dict[str, str] | None = None) -> T:
    environ = os.environ if environ is None else environ
    hints = typing.get_type_hints(cls)
    values: dict[str, Any] = {}
    given_at: dict[str, str] = {}  # field -> the flag or env var it was given by (require_effect)
    for f in dataclasses.fields(cls):
        cli = getattr(ns, f.name, None) if ns is not None else None
        if cli is not None:
            values[f.name] = cli
            given_at[f.name] = flag_name(f)
            continue
        env = env_name(cls, f)
        if env in environ:
            value = _convert(hints[f.name], environ[env], env)
            choices = f.metadata.get("choices")
            if choices and value not in choices:
                raise ConfigError(f"{env}: {value!r} is not one of {list(choices)}")
            values[f.name] = value
            if not f.metadata.get("env"):  # the command's own env var, not one shared by a group of processes
                given_at[f.name] = env
    obj = cls(**values)
    object.__setattr__(obj, _GIVEN, given_at)
    validate = getattr(obj, "validate", None)
    if validate is not None:
        validate()
    return obj


def load(cls: type[T], argv: Sequence[str] | None = None, prog: str | None = None,
         description: str | None = None) -> T:
    parser = argparse.ArgumentParser(prog=prog, description=description or cls.__doc__)
    add_arguments(cls, parser)
    ns = parser.parse_args(argv)
    try:
        return from_namespace(cls, ns)
    except ConfigError as exc:
        parser.error(str(exc))
        raise  # unreachable


def require(condition: bool, message: str) -> None:
    if not condition:
        raise ConfigError(message)


_GIVEN = "_config_given"  # the attribute from_namespace leaves on a config: {field: flag or env var it came from}


def given(cfg: object) -> dict[str, str]:
    """The fields of ``cfg`` given on its command line or in its own env var, each with where it came from (the flag
    or the env var); empty for a config built in code."""
    return dict(getattr(cfg, _GIVEN, {}))


def require_effect(cfg: object, name: str, effective: bool, why: str) -> None:
    """Refuse field ``name`` when it was given (see :func:`given`) but has no effect (``effective`` false) because of
    another setting: ``why`` completes "--flag has no effect ..." and names that other flag, e.g. "without
    record_turn in --operations". A setting not given, given only by a shared env var, or given its default value
    (``--history-store ''``: what a caller passes to say "none") passes."""
    source = given(cfg).get(name)
    if effective or source is None:
        return
    f = next(f for f in dataclasses.fields(cfg) if f.name == name)  # type: ignore[arg-type]
    if getattr(cfg, name) == f.default:
        return
    origin = "" if source == flag_name(f) else f" (set by {source})"
    raise ConfigError(f"{flag_name(f)}{origin} has no effect {why}: drop it, or change the other setting")


@dataclasses.dataclass
class TelemetryConfig:
    """Where traces go."""

    ENV_PREFIX = "KVSHUTTLE_"
    traces_exporter: str = setting("none", "Trace exporter: otlp, console or none", choices=("otlp", "console", "none"),
                                   env="KVSHUTTLE_TRACES_EXPORTER")
    otlp_endpoint: str = setting("http://127.0.0.1:4317", "OTLP/gRPC endpoint when the exporter is otlp",
                                 env="KVSHUTTLE_OTLP_ENDPOINT")
