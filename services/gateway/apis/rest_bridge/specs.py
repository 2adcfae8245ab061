"""The REST bridge's bindings: the ``google.api.http`` annotations of gRPC methods, read from the generated modules'
descriptors, as compiled path templates (PathTemplate: ``{session_id}``, nested ``{a.b}``, ``{name=shelves/*}``,
``**``, ``:verb``) and one RouteSpec per binding (additional_bindings included), checked against the method's
messages.
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass

from google.api import annotations_pb2, http_pb2
from google.protobuf import descriptor_pool, message_factory
from google.protobuf.descriptor import Descriptor, FieldDescriptor, MethodDescriptor, ServiceDescriptor
from google.protobuf.message import Message

# Importing the generated modules registers kvshuttle's services in the default descriptor pool.
from kvshuttle.v1 import gateway_pb2, registry_pb2, scheduler_pb2  # noqa: F401

log = logging.getLogger(__name__)

NDJSON = "application/x-ndjson"  # what a server-streaming method answers: one JSON message per line
# Message types whose JSON form is a string or number, so a path or query parameter can fill them.
STRING_LIKE_WKT = {
    "google.protobuf.Timestamp", "google.protobuf.Duration", "google.protobuf.FieldMask",
    "google.protobuf.DoubleValue", "google.protobuf.FloatValue", "google.protobuf.Int64Value",
    "google.protobuf.UInt64Value", "google.protobuf.Int32Value", "google.protobuf.UInt32Value",
    "google.protobuf.BoolValue", "google.protobuf.StringValue", "google.protobuf.BytesValue",
}


@dataclass(frozen=True)
class PathTemplate:
    """A compiled google.api.http path template.

    ``variables`` pairs each regex group name with the request field path it fills; ``openapi_path`` is the template
    with every variable written ``{field.path}``.
    """

    template: str
    regex: re.Pattern[str]
    variables: tuple[tuple[str, tuple[str, ...]], ...]
    openapi_path: str

    @classmethod
    def parse(cls, template: str) -> PathTemplate:
        if not template.startswith("/"):
            raise ValueError(f"path template {template!r} must start with '/'")
        path, verb = _split_verb(template)
        regex_parts: list[str] = []
        openapi_parts: list[str] = []
        variables: list[tuple[str, tuple[str, ...]]] = []
        for segment in _split_top(path[1:], "/"):
            if segment.startswith("{"):
                if not segment.endswith("}"):
                    raise ValueError(f"bad variable {segment!r} in {template!r}")
                name, _, pattern = segment[1:-1].partition("=")
                field_path = tuple(name.split("."))
                if not all(re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", p) for p in field_path):
                    raise ValueError(f"bad field path {name!r} in {template!r}")
                group = f"v{len(variables)}"
                inner = "/".join(_segment_regex(s, template) for s in pattern.split("/")) if pattern else "[^/]+"
                regex_parts.append(f"(?P<{group}>{inner})")
                openapi_parts.append("{" + name + "}")
                variables.append((group, field_path))
            else:
                regex_parts.append(_segment_regex(segment, template))
                openapi_parts.append(segment)
        suffix = ":" + verb if verb else ""
        regex = re.compile("^/" + "/".join(regex_parts) + re.escape(suffix) + "$")
        return cls(template, regex, tuple(variables), "/" + "/".join(openapi_parts) + suffix)


def _split_top(text: str, sep: str) -> list[str]:
    """Split on ``sep`` outside braces."""
    parts, depth, start = [], 0, 0
    for i, ch in enumerate(text):
        depth += ch == "{"
        depth -= ch == "}"
        if ch == sep and depth == 0:
            parts.append(text[start:i])
            start = i + 1
    parts.append(text[start:])
    return parts


def _split_verb(template: str) -> tuple[str, str]:
    """``/v1/x/{id}:cancel`` -> (``/v1/x/{id}``, ``cancel``)."""
    depth, last_slash, colon = 0, -1, -1
    for i, ch in enumerate(template):
        depth += ch == "{"
        depth -= ch == "}"
        if depth == 0 and ch == "/":
            last_slash, colon = i, -1
        elif depth == 0 and ch == ":":
            colon = i
    if colon > last_slash >= 0:
        return template[:colon], template[colon + 1:]
    return template, ""


def _segment_regex(segment: str, template: str) -> str:
    if segment == "*":
        return "[^/]+"
    if segment == "**":
        return ".+"
    if not segment or any(c in segment for c in "{}*"):
        raise ValueError(f"bad segment {segment!r} in {template!r}")
    return re.escape(segment)


# ------------------------------------------------------------------------------------------------------------- specs

@dataclass(frozen=True)
class RouteSpec:
    """One HTTP binding of one gRPC method (a method has one per HttpRule, plus its additional_bindings)."""

    method: MethodDescriptor
    http_method: str
    template: PathTemplate
    body: str = ""
    response_body: str = ""

    @property
    def full_method(self) -> str:
        return f"/{self.method.containing_service.full_name}/{self.method.name}"

    @property
    def server_streaming(self) -> bool:
        return bool(self.method.server_streaming)

    @property
    def request_class(self) -> type[Message]:
        return message_factory.GetMessageClass(self.method.input_type)

    @property
    def response_class(self) -> type[Message]:
        return message_factory.GetMessageClass(self.method.output_type)

    def bound_paths(self) -> list[tuple[str, ...]]:
        """Field paths filled by the path and the body (query parameters may not name these)."""
        paths = [fp for _, fp in self.template.variables]
        if self.body and self.body != "*":
            paths.append((self.body,))
        return paths

    def validate(self) -> None:
        if self.method.client_streaming:
            raise ValueError(f"{self.full_method}: client-streaming methods cannot be bridged to REST")
        if self.http_method in ("GET", "DELETE", "HEAD") and self.body:
            # Allowed by the spec for DELETE, but a body on these methods is rarely sent by clients.
            log.warning("%s: %s binding with a body", self.full_method, self.http_method)
        for _, field_path in self.template.variables:
            leaf = resolve_field_path(self.method.input_type, field_path)[-1]
            if leaf.is_repeated or (leaf.type == FieldDescriptor.TYPE_MESSAGE
                                    and leaf.message_type.full_name not in STRING_LIKE_WKT):
                raise ValueError(f"{self.full_method}: path variable {'.'.join(field_path)} must be a singular scalar")
        if self.body and self.body != "*":
            resolve_field_path(self.method.input_type, (self.body,))
        if self.response_body:
            resolve_field_path(self.method.output_type, (self.response_body,))


def http_rule(method: MethodDescriptor) -> http_pb2.HttpRule | None:
    """The method's ``google.api.http`` option, or None."""
    options = method.GetOptions()
    if not options.HasExtension(annotations_pb2.http):
        return None
    return options.Extensions[annotations_pb2.http]


def specs_from_rule(method: MethodDescriptor, rule: http_pb2.HttpRule) -> list[RouteSpec]:
    """The bindings of one HttpRule (additional_bindings included), validated against the method's messages."""
    kind = rule.WhichOneof("pattern")
    if kind is None:
        raise ValueError(f"{method.full_name}: google.api.http rule without a pattern")
    if kind == "custom":
        http_method, template = rule.custom.kind.upper(), rule.custom.path
    else:
        http_method, template = kind.upper(), getattr(rule, kind)
    spec = RouteSpec(method, http_method, PathTemplate.parse(template), rule.body, rule.response_body)
    spec.validate()
    specs = [spec]
    for extra in rule.additional_bindings:
        if extra.additional_bindings:
            raise ValueError(f"{method.full_name}: additional_bindings may not nest")
        specs.extend(specs_from_rule(method, extra))
    return specs


def service_specs(service: ServiceDescriptor) -> list[RouteSpec]:
    """Every HTTP binding of every annotated method of ``service``."""
    specs: list[RouteSpec] = []
    for method in service.methods:
        rule = http_rule(method)
        if rule is not None:
            specs.extend(specs_from_rule(method, rule))
    return specs


def find_service(name: str, pool: descriptor_pool.DescriptorPool | None = None) -> ServiceDescriptor:
    try:
        return (pool or descriptor_pool.Default()).FindServiceByName(name)
    except KeyError:
        raise ValueError(f"unknown gRPC service {name!r}: import its generated _pb2 module first") from None


def resolve_field_path(desc: Descriptor, path: tuple[str, ...]) -> list[FieldDescriptor]:
    """Field descriptors along ``path`` (proto or JSON names); every step but the last must be a singular message."""
    fields: list[FieldDescriptor] = []
    for i, name in enumerate(path):
        if desc is None:
            raise ValueError(f"{'.'.join(path[:i])} is not a message")
        fd = desc.fields_by_name.get(name) or next((f for f in desc.fields if f.json_name == name), None)
        if fd is None:
            raise ValueError(f"{desc.full_name} has no field {name!r}")
        if i < len(path) - 1 and (fd.is_repeated or fd.type != FieldDescriptor.TYPE_MESSAGE):
            raise ValueError(f"{'.'.join(path[:i + 1])} is not a singular message")
        fields.append(fd)
        desc = fd.message_type
    return fields
