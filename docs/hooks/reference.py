"""mkdocs hook: the reference pages are generated from the code when the site is built, never kept by hand.

    reference/configuration.md    every command's flags and variables, from the typed configs (services/common/config.py)
    reference/metrics.md          every metric, from kvshuttle.services.common.metrics.CATALOGUE
    reference/span-attributes.md  every kvshuttle.* span attribute, from kvshuttle.services.common.span_attributes
    reference/reason-codes.md     every reason code, from kvshuttle.control_plane.reasons

It also puts files that live next to the code into the site as they are (the deploy guides, the component READMEs),
so they have one copy. Nothing generated is written into the repository. tests/unit/test_docs_reference.py checks
the generators against the code; tests/deploy/test_docs.py builds the site with --strict.
"""

from __future__ import annotations

import argparse
import dataclasses
import html
import importlib
import re
import typing
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

# command -> its typed config (services/common/config.py `load`); every `kvshuttle` command is here or in ARGPARSE.
CONFIGS: dict[str, str] = {
    "registry": "kvshuttle.services.registry.server:RegistryConfig",
    "scheduler": "kvshuttle.services.scheduler.server:SchedulerConfig",
    "gateway": "kvshuttle.services.gateway.server:GatewayConfig",
    "worker": "kvshuttle.workers.vllm_process:WorkerConfig",
    "smoke-test": "kvshuttle.services.commands.smoke_test:SmokeTestConfig",
    "health-check": "kvshuttle.services.commands.health_check:HealthCheckConfig",
    "traces": "kvshuttle.services.commands.trace_view:TraceViewConfig",
    "up": "kvshuttle.services.devtools.stack:StackConfig",
    "demo": "kvshuttle.services.devtools.stack:DemoConfig",
    "bench": "kvshuttle.services.devtools.bench.multiturn:BenchConfig",
    "bench-services": "kvshuttle.services.devtools.bench.services_bench:ServicesBenchConfig",
    "bench-clients": "kvshuttle.services.devtools.bench.client_styles:ClientStylesConfig",
    "bench-policies": "kvshuttle.services.devtools.bench.policy_sweep:PolicySweepConfig",
    "bench-eviction": "kvshuttle.services.devtools.bench.eviction_sim:EvictionSimConfig",
    "bench-kv-feed": "kvshuttle.services.devtools.bench.kv_feed_load:KvFeedBenchConfig",
    "bench-gateway": "kvshuttle.services.devtools.bench.gateway_capacity:GatewayBenchConfig",
    "simulate": "kvshuttle.services.devtools.simulator.main:SimulateConfig",
    "soak": "kvshuttle.services.devtools.bench.soak:SoakConfig",
}
# Commands that parse plain argparse flags: their parser is read from the command itself.
ARGPARSE: tuple[str, ...] = ("hash-key", "make-model", "bench-agent")

# Settings several commands share, with the same variable everywhere: listed once, below the commands.
SHARED: list[tuple[str, str, str]] = [
    ("tracing", "kvshuttle.services.common.config:TelemetryConfig", "Tracing"),
    ("tls-client", "kvshuttle.services.common.tls:TlsClientConfig", "TLS towards the kvshuttle services"),
    ("tls-server", "kvshuttle.services.common.tls:TlsConfig", "TLS of a service's gRPC server, message size"),
    ("etcd-security", "kvshuttle.services.common.tls:EtcdSecurityConfig", "etcd TLS and authentication"),
]

# Files kept next to the code, shown in the site as they are: site path -> repository path.
INCLUDED: dict[str, str] = {
    "deploying/kubernetes.md": "deploy/README.md",
    "deploying/images.md": "deploy/docker/README.md",
    "components/control-plane.md": "control_plane/README.md",
    "components/services.md": "services/README.md",
    "components/workers.md": "workers/README.md",
    "components/protos.md": "protos/README.md",
    "components/tests.md": "tests/README.md",
}


def _load(path: str) -> type:
    module, name = path.split(":")
    return getattr(importlib.import_module(module), name)


def cell(text: str) -> str:
    """Text for a Markdown table cell, on one line: `<`, `>`, `&` and `|` escaped outside code spans (a pipe inside
    a code span does not end the cell)."""
    parts = str(text).replace("\n", " ").split("`")
    for i in range(0, len(parts), 2):  # even parts are outside code spans
        parts[i] = html.escape(parts[i], quote=False).replace("|", "\\|")
    return "`".join(parts)


def code(value: str) -> str:
    return f"`{value}`" if "`" not in value else f"`` {value} ``"


def table(header: list[str], rows: list[list[str]]) -> list[str]:
    return ["| " + " | ".join(header) + " |", "|" + "---|" * len(header),
            *("| " + " | ".join(row) + " |" for row in rows), ""]


# -- configuration ------------------------------------------------------------------------------------------------

def _default(kind: type, value: object) -> str:
    if kind is bool:
        return code("true" if value else "false")
    if value == "":
        return "empty"
    return code(str(value))


def _shared_fields() -> dict[str, tuple[str, dataclasses.Field]]:
    """field name -> (shared group, field) for the fields each shared class declares itself."""
    out: dict[str, tuple[str, dataclasses.Field]] = {}
    for group, path, _ in SHARED:
        cls = _load(path)
        inherited = {f.name for base in cls.__mro__[1:] if dataclasses.is_dataclass(base)
                     for f in dataclasses.fields(base)}
        for f in dataclasses.fields(cls):
            if f.name not in inherited:
                out[f.name] = (group, f)
    return out


def _same(a: dataclasses.Field, b: dataclasses.Field) -> bool:
    return a.default == b.default and dict(a.metadata) == dict(b.metadata)


def _row(cls: type, f: dataclasses.Field, kind: type) -> list[str]:
    from kvshuttle.services.common.config import env_name, flag_name

    flag = flag_name(f)
    flags = f"{code(flag)} / {code('--no-' + flag[2:])}" if kind is bool else code(flag)
    meaning = f.metadata.get("help", "")
    if f.metadata.get("choices"):
        meaning += "; one of " + ", ".join(code(str(c)) for c in f.metadata["choices"])
    if f.metadata.get("secret"):
        meaning += " (secret: never printed)"
    return [flags, code(env_name(cls, f)), kind.__name__, _default(kind, f.default), cell(meaning)]


def config_rows(cls: type, shared: dict[str, tuple[str, dataclasses.Field]]) -> tuple[list[list[str]], list[str]]:
    """(rows of the fields of ``cls`` that are not shared settings, the shared groups it takes)."""
    hints = typing.get_type_hints(cls)
    rows, groups = [], set()
    for f in dataclasses.fields(cls):
        if f.name in shared and f.metadata.get("env") and _same(f, shared[f.name][1]):
            groups.add(shared[f.name][0])
        else:
            rows.append(_row(cls, f, hints[f.name]))
    return rows, [g for g, _, _ in SHARED if g in groups]


def shared_rows(group: str, shared: dict[str, tuple[str, dataclasses.Field]]) -> list[list[str]]:
    cls = _load(next(path for g, path, _ in SHARED if g == group))
    hints = typing.get_type_hints(cls)
    return [_row(cls, f, hints[f.name]) for name, (g, f) in shared.items() if g == group]


def argparse_parser(command: str) -> argparse.ArgumentParser:
    """The parser a plain-argparse command builds, caught when it parses (the command does nothing else)."""
    from kvshuttle.services.commands import cli

    class Caught(Exception):
        def __init__(self, parser: argparse.ArgumentParser) -> None:
            self.parser = parser

    def catch(self, *args, **kwargs):
        raise Caught(self)

    module = importlib.import_module(cli.COMMANDS[command][0])
    original = argparse.ArgumentParser.parse_args
    argparse.ArgumentParser.parse_args = catch  # type: ignore[method-assign]
    try:
        module.main([])
    except Caught as caught:
        return caught.parser
    finally:
        argparse.ArgumentParser.parse_args = original  # type: ignore[method-assign]
    raise RuntimeError(f"kvshuttle {command} parsed no arguments")


def argparse_rows(parser: argparse.ArgumentParser) -> list[list[str]]:
    rows = []
    for action in parser._actions:
        if isinstance(action, argparse._HelpAction):
            continue
        name = " / ".join(code(s) for s in action.option_strings) or code(action.dest.upper()) + " (positional)"
        meaning = action.help or ""
        if action.choices:
            meaning += ("; " if meaning else "") + "one of " + ", ".join(code(str(c)) for c in action.choices)
        if action.required:
            meaning += " (required)"
        if isinstance(action, argparse._StoreTrueAction):
            default = code("false")
        elif action.required:
            default = "-"
        elif action.default in (None, "", argparse.SUPPRESS):
            default = "empty"
        else:
            default = code(str(action.default))
        rows.append([name, default, cell(meaning)])
    return rows


def config_page() -> str:
    from kvshuttle.services.commands import cli

    shared = _shared_fields()
    titles = {group: title for group, _, title in SHARED}
    out = ["# Configuration reference", "",
           "Generated from the code when this site is built: each command's typed config (a dataclass whose fields "
           "use `setting()`, `services/common/config.py`) and, for the two plain-argparse commands, their parsers. "
           "`kvshuttle <command> --help` prints the same.", "",
           "Every flag of a typed config is also an environment variable. Flags win over variables, variables over "
           "defaults; bad values stop the process with a message naming both. Booleans are `--flag` / `--no-flag`, "
           "and their variables take `true`/`false` (also `1`/`0`, `yes`/`no`, `on`/`off`). What the settings mean "
           "in context: [Configuration](../configuration.md).", "",
           "| Command | What it does | Variables |", "|---|---|---|"]
    for command, (_, text) in cli.COMMANDS.items():
        if command in CONFIGS:
            prefix = getattr(_load(CONFIGS[command]), "ENV_PREFIX", "KVSHUTTLE_")
            variables = code(prefix + "*")
        else:
            variables = "flags only"
        out.append(f"| [`kvshuttle {command}`](#kvshuttle-{command}) | {cell(text)} | {variables} |")
    out.append("")
    for command in cli.COMMANDS:
        out += [f"## kvshuttle {command}", ""]
        if command in CONFIGS:
            cls = _load(CONFIGS[command])
            if cls.__doc__:
                out += [cell(" ".join(cls.__doc__.split())), ""]
            rows, groups = config_rows(cls, shared)
            out += table(["Flag", "Variable", "Type", "Default", "Meaning"], rows)
            if groups:
                links = ", ".join(f"[{titles[g]}](#shared-{g})" for g in groups)
                out += [f"Also the shared settings: {links}.", ""]
        else:
            out += table(["Argument", "Default", "Meaning"], argparse_rows(argparse_parser(command)))
    out += ["## Shared settings", "",
            "These take the same variable in every command that has them.", ""]
    for group, path, title in SHARED:
        cls = _load(path)
        users = [f"`kvshuttle {c}`" for c in CONFIGS if issubclass(_load(CONFIGS[c]), cls)]
        out += [f"### {title} {{#shared-{group}}}", "", f"{cell(' '.join((cls.__doc__ or '').split()))} Taken by "
                f"{', '.join(users)}.", ""]
        out += table(["Flag", "Variable", "Type", "Default", "Meaning"], shared_rows(group, shared))
    return "\n".join(out)


# -- metrics ------------------------------------------------------------------------------------------------------

def etcd_operations() -> list[str]:
    """The `op` label's values: the operation names the etcd store (services/store/) passes to its `call`."""
    ops = {op.replace(" ", "_").replace("-", "_") for path in sorted((ROOT / "services/store").glob("*.py"))
           for op in re.findall(r'\b_?call\(\s*"([a-z -]+)"', path.read_text())}
    return sorted(ops)


def metrics_page() -> str:
    from kvshuttle.services.common import metrics

    out = ["# Metrics reference", "",
           "Generated from `kvshuttle.services.common.metrics.CATALOGUE` when this site is built. Counters are shown "
           "with their `_total`. Which process serves which group, the label values and what to do with the "
           "numbers: [Metrics](../metrics.md).", ""]
    rows = [[code(m.name), m.type, ", ".join(code(label) for label in m.labels), m.group, cell(m.help)]
            for m in metrics.CATALOGUE]
    out += table(["Metric", "Type", "Labels", "Group", "Meaning"], rows)
    out += ["## etcd operations", "",
            "The values of the `op` label of `kvshuttle_etcd_request_seconds` and `kvshuttle_etcd_errors_total` "
            "(read from the store's code, `services/store/`): " + ", ".join(code(op) for op in etcd_operations()) + ".",
            "", "## Reason codes", "",
            "The `reason` label takes the [reason codes](reason-codes.md).", ""]
    return "\n".join(out)


# -- span attributes ------------------------------------------------------------------------------------------------

def span_attributes_page() -> str:
    from kvshuttle.services.common.span_attributes import SPAN_ATTRIBUTES

    out = ["# Span attributes reference", "",
           "Every `kvshuttle.*` attribute the services put on their spans, generated from "
           "`kvshuttle.services.common.span_attributes.SPAN_ATTRIBUTES` when this site is built. Which span carries "
           "which: [Tracing](../tracing.md#span-attributes).", ""]
    out += table(["Attribute", "Meaning"], [[code(name), cell(text)] for name, text in SPAN_ATTRIBUTES.items()])
    return "\n".join(out)


# -- reason codes -------------------------------------------------------------------------------------------------

def reasons_page() -> str:
    from kvshuttle.control_plane import reasons

    def decision(code_: str) -> str:
        return ("pull" if code_ in reasons.PULL_CODES else "local" if code_ in reasons.LOCAL_CODES
                else "recompute" if code_ in reasons.RECOMPUTE_CODES else "-")

    out = ["# Reason codes", "",
           "Why a turn pulls, recomputes or continues on its decode worker (local), as one code of a small fixed vocabulary, generated from "
           "`kvshuttle.control_plane.reasons` when this site is built. The code is `reason_code` in "
           "`PlanTurnResponse` and the gateway's `KvReport`, the `X-KV-Reason-Code` header and "
           "`kvshuttle.reason_code` in HTTP responses (next to the free-text `reason`), and the `reason` label of "
           "the [metrics](metrics.md).", ""]
    order = [*reasons.PULL_CODES, *reasons.LOCAL_CODES, *reasons.RECOMPUTE_CODES, reasons.UNKNOWN]
    out += table(["Code", "Decision", "Meaning"],
                 [[code(c), decision(c), cell(reasons.DESCRIPTIONS[c])] for c in order])
    out += ["", "## Record outcomes", "",
            "What became of a turn's record (its KV handle and exact ids, which the next turn pulls): `record` in the "
            "gateway's `KvReport`, `kvshuttle.record` (with `record_error`) in HTTP bodies (a stream's last chunk), "
            "the `X-KV-Record` header of whole answers, and the `outcome` label of `kvshuttle_turn_records_total`. "
            "Any outcome but `recorded` and `unrecorded` means the next turn recomputes; the chart's "
            "`KvshuttleTurnsNotRecorded` alert fires on them.", ""]
    out += table(["Outcome", "Meaning"], [[code(c), cell(reasons.RECORD_DESCRIPTIONS[c])]
                                          for c in reasons.RECORD_OUTCOMES])
    return "\n".join(out)


PAGES: dict[str, Callable[[], str]] = {
    "reference/configuration.md": config_page,
    "reference/metrics.md": metrics_page,
    "reference/span-attributes.md": span_attributes_page,
    "reference/reason-codes.md": reasons_page,
}


def on_files(files, config):
    from mkdocs.structure.files import File

    for uri, make in PAGES.items():
        files.append(File.generated(config, uri, content=make()))
    for uri, source in INCLUDED.items():
        files.append(File.generated(config, uri, abs_src_path=str(ROOT / source)))
    return files

