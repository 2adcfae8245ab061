"""The REST bridge's routes in OpenAPI 3: ``paths`` and ``components.schemas`` from the bindings and the proto
messages (protobuf's JSON mapping, ``null`` taken for any request field), merged into a FastAPI app's document by
``install_openapi``; ``constraints`` add what the server checks beyond the proto's types."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

from google.protobuf import descriptor_pool
from google.protobuf.descriptor import Descriptor, FieldDescriptor
from kvshuttle.services.gateway.apis.rest_bridge.specs import (
    NDJSON,
    STRING_LIKE_WKT,
    RouteSpec,
    find_service,
    resolve_field_path,
    service_specs,
)

_SCALAR_SCHEMAS: dict[int, dict[str, Any]] = {
    FieldDescriptor.TYPE_DOUBLE: {"type": "number", "format": "double"},
    FieldDescriptor.TYPE_FLOAT: {"type": "number", "format": "float"},
    FieldDescriptor.TYPE_INT64: {"type": "string", "format": "int64"},
    FieldDescriptor.TYPE_UINT64: {"type": "string", "format": "uint64"},
    FieldDescriptor.TYPE_SINT64: {"type": "string", "format": "int64"},
    FieldDescriptor.TYPE_FIXED64: {"type": "string", "format": "uint64"},
    FieldDescriptor.TYPE_SFIXED64: {"type": "string", "format": "int64"},
    FieldDescriptor.TYPE_INT32: {"type": "integer", "format": "int32"},
    FieldDescriptor.TYPE_SINT32: {"type": "integer", "format": "int32"},
    FieldDescriptor.TYPE_SFIXED32: {"type": "integer", "format": "int32"},
    FieldDescriptor.TYPE_UINT32: {"type": "integer", "format": "int64", "minimum": 0},
    FieldDescriptor.TYPE_FIXED32: {"type": "integer", "format": "int64", "minimum": 0},
    FieldDescriptor.TYPE_BOOL: {"type": "boolean"},
    FieldDescriptor.TYPE_STRING: {"type": "string"},
    FieldDescriptor.TYPE_BYTES: {"type": "string", "format": "byte"},
}
_WKT_SCHEMAS: dict[str, dict[str, Any]] = {
    "google.protobuf.Timestamp": {"type": "string", "format": "date-time"},
    "google.protobuf.Duration": {"type": "string", "example": "1.5s"},
    "google.protobuf.FieldMask": {"type": "string"},
    "google.protobuf.Empty": {"type": "object"},
    "google.protobuf.Struct": {"type": "object", "additionalProperties": True},
    "google.protobuf.Value": {},
    "google.protobuf.ListValue": {"type": "array", "items": {}},
    "google.protobuf.Any": {"type": "object", "properties": {"@type": {"type": "string"}},
                            "additionalProperties": True},
    "google.protobuf.DoubleValue": {"type": "number", "format": "double"},
    "google.protobuf.FloatValue": {"type": "number", "format": "float"},
    "google.protobuf.Int64Value": {"type": "string", "format": "int64"},
    "google.protobuf.UInt64Value": {"type": "string", "format": "uint64"},
    "google.protobuf.Int32Value": {"type": "integer", "format": "int32"},
    "google.protobuf.UInt32Value": {"type": "integer", "format": "int64", "minimum": 0},
    "google.protobuf.BoolValue": {"type": "boolean"},
    "google.protobuf.StringValue": {"type": "string"},
    "google.protobuf.BytesValue": {"type": "string", "format": "byte"},
}
ERROR_SCHEMA_NAME = "kvshuttle.bridge.Error"
_ERROR_SCHEMA = {
    "type": "object", "required": ["error"],
    "properties": {"error": {"type": "object", "required": ["code", "status", "message"], "properties": {
        "code": {"type": "integer", "description": "HTTP status"},
        "status": {"type": "string", "description": "gRPC status code name, e.g. NOT_FOUND"},
        "message": {"type": "string"}}}},
}


def _ref(name: str) -> dict[str, str]:
    return {"$ref": f"#/components/schemas/{name}"}


class _SchemaCollector:
    """``constraints``: extra JSON Schema keywords by full proto name, merged into that message's or field's schema
    (a repeated field's: into the array; an ``items`` entry into its items) for what the server checks beyond types."""

    def __init__(self, constraints: Mapping[str, Mapping[str, Any]] | None = None) -> None:
        self.schemas: dict[str, Any] = {}
        self.constraints = constraints or {}

    def message(self, desc: Descriptor) -> dict[str, Any]:
        if desc.full_name in _WKT_SCHEMAS:
            return dict(_WKT_SCHEMAS[desc.full_name])
        if desc.full_name not in self.schemas:
            self.schemas[desc.full_name] = {}  # placeholder first: recursive messages terminate
            self.schemas[desc.full_name] = {
                "type": "object",
                "properties": {fd.json_name: self.field(fd) for fd in desc.fields},
                **self.constraints.get(desc.full_name, {}),
            }
        return _ref(desc.full_name)

    def field(self, fd: FieldDescriptor) -> dict[str, Any]:
        if fd.type == FieldDescriptor.TYPE_MESSAGE and fd.message_type.GetOptions().map_entry:
            return {"type": "object", "additionalProperties": self.single(fd.message_type.fields_by_name["value"])}
        single = self.single(fd)
        schema = {"type": "array", "items": single} if fd.is_repeated else single
        extra = dict(self.constraints.get(fd.full_name, {}))
        if isinstance(extra.get("items"), Mapping) and fd.is_repeated:
            schema["items"] = {**single, **extra.pop("items")}
        return {**schema, **extra}

    def single(self, fd: FieldDescriptor) -> dict[str, Any]:
        if fd.type in (FieldDescriptor.TYPE_MESSAGE, FieldDescriptor.TYPE_GROUP):
            return self.message(fd.message_type)
        if fd.type == FieldDescriptor.TYPE_ENUM:  # protobuf's JSON parser takes a value's name or its number
            values = fd.enum_type.values
            return {"type": ["string", "integer"], "enum": [v.name for v in values] + [v.number for v in values]}
        return dict(_SCALAR_SCHEMAS[fd.type])


def _query_parameters(spec: RouteSpec, collector: _SchemaCollector) -> list[dict[str, Any]]:
    if spec.body == "*":
        return []
    bound = spec.bound_paths()
    params: list[dict[str, Any]] = []

    def walk(desc: Descriptor, prefix: tuple[str, ...], json_prefix: tuple[str, ...], seen: frozenset[str]) -> None:
        for fd in desc.fields:
            names = (*prefix, fd.name)
            if any(names[:len(b)] == b for b in bound):
                continue
            is_message = fd.type == FieldDescriptor.TYPE_MESSAGE
            if is_message and fd.message_type.full_name not in STRING_LIKE_WKT:
                if not fd.is_repeated and fd.message_type.full_name not in seen:
                    walk(fd.message_type, names, (*json_prefix, fd.json_name),
                         seen | {fd.message_type.full_name})
                continue
            params.append({"name": ".".join((*json_prefix, fd.json_name)), "in": "query", "required": False,
                           "schema": collector.field(fd), **({"explode": True} if fd.is_repeated else {})})

    walk(spec.method.input_type, (), (), frozenset({spec.method.input_type.full_name}))
    return params


def openapi_parts(service_names: Iterable[str], pool: descriptor_pool.DescriptorPool | None = None,
                  constraints: Mapping[str, Mapping[str, Any]] | None = None
                  ) -> tuple[dict[str, Any], dict[str, Any]]:
    """OpenAPI 3 ``paths`` and ``components.schemas`` for the bridged routes of ``service_names``.

    ``constraints``: extra JSON Schema keywords by full proto message or field name (``pkg.Msg.field``), e.g. the
    ``pattern`` of an id the server validates; without them the document only knows the proto's types."""
    collector = _SchemaCollector(constraints)
    collector.schemas[ERROR_SCHEMA_NAME] = _ERROR_SCHEMA
    paths: dict[str, Any] = {}
    request_roots: set[str] = set()
    for name in service_names:
        service = find_service(name, pool)
        per_method: dict[str, int] = {}
        for spec in service_specs(service):
            method = spec.method
            index = per_method[method.name] = per_method.get(method.name, -1) + 1
            parameters = []
            for _, field_path in spec.template.variables:
                leaf = resolve_field_path(method.input_type, field_path)[-1]
                parameters.append({"name": ".".join(field_path), "in": "path", "required": True,
                                   "schema": collector.field(leaf)})
            parameters += _query_parameters(spec, collector)
            response_schema = collector.message(method.output_type)
            if spec.response_body:
                response_schema = collector.field(method.output_type.fields_by_name[spec.response_body])
            media = NDJSON if spec.server_streaming else "application/json"
            operation: dict[str, Any] = {
                "operationId": f"{service.name}_{method.name}" + (f"_{index}" if index else ""),
                "tags": [service.name],
                "summary": f"{service.full_name}/{method.name} (gRPC)",
                "parameters": parameters,
                "responses": {
                    "200": {"description": "OK" + (" (one JSON message per line)" if spec.server_streaming else ""),
                            "content": {media: {"schema": response_schema}}},
                    "default": {"description": "Error",
                                "content": {"application/json": {"schema": _ref(ERROR_SCHEMA_NAME)}}},
                },
            }
            if spec.body:
                body_schema = (collector.message(method.input_type) if spec.body == "*"
                               else collector.field(method.input_type.fields_by_name[spec.body]))
                operation["requestBody"] = {"required": spec.body != "*",
                                            "content": {"application/json": {"schema": body_schema}}}
                request_roots.update(_refs_in(body_schema))
            paths.setdefault(spec.template.openapi_path, {})[spec.http_method.lower()] = operation
    _null_in_requests(collector.schemas, request_roots)
    return paths, collector.schemas


def _refs_in(schema: Any) -> Iterator[str]:
    if isinstance(schema, dict):
        ref = schema.get("$ref")
        if isinstance(ref, str) and ref.startswith("#/components/schemas/"):
            yield ref.rsplit("/", 1)[1]
        for value in schema.values():
            yield from _refs_in(value)
    elif isinstance(schema, list):
        for value in schema:
            yield from _refs_in(value)


def _null_in_requests(schemas: dict[str, Any], roots: Iterable[str]) -> None:
    """protobuf's JSON parser takes ``null`` for any field (the default value): say so in the messages a request body
    may hold, except for the fields a constraint requires."""
    seen: set[str] = set()
    stack = list(roots)
    while stack:
        name = stack.pop()
        if name not in seen and name in schemas:
            seen.add(name)
            stack.extend(_refs_in(schemas[name]))
    for name in seen:
        schema = schemas[name]
        required = set(schema.get("required", ()))
        schema["properties"] = {key: value if key in required else _or_null(value)
                                for key, value in schema.get("properties", {}).items()}


def _or_null(schema: dict[str, Any]) -> dict[str, Any]:
    if "$ref" in schema:
        return {"anyOf": [schema, {"type": "null"}]}
    if "type" not in schema:
        return schema
    types = schema["type"] if isinstance(schema["type"], list) else [schema["type"]]
    nullable = {**schema, "type": [*types, "null"]}
    if "enum" in schema:
        nullable["enum"] = [*schema["enum"], None]
    return nullable


def openapi_paths(service_names: Iterable[str], pool: descriptor_pool.DescriptorPool | None = None) -> dict[str, Any]:
    """The OpenAPI ``paths`` object for the bridged routes (schemas: see :func:`openapi_parts`)."""
    return openapi_parts(service_names, pool)[0]


def install_openapi(app: Any, service_names: Iterable[str],
                    pool: descriptor_pool.DescriptorPool | None = None,
                    constraints: Mapping[str, Mapping[str, Any]] | None = None) -> None:
    """Merge the bridged routes into a FastAPI app's generated OpenAPI document (``app.openapi()``); ``constraints``:
    see :func:`openapi_parts`."""
    names = list(service_names)
    original: Callable[[], dict[str, Any]] = app.openapi

    def openapi() -> dict[str, Any]:
        if getattr(app, "_bridge_openapi", None) is None:
            document = dict(original())
            paths, schemas = openapi_parts(names, pool, constraints)
            merged_paths = dict(document.get("paths", {}))
            for path, operations in paths.items():
                merged_paths.setdefault(path, {}).update(operations)
            document["paths"] = merged_paths
            components = dict(document.get("components", {}))
            components["schemas"] = {**components.get("schemas", {}), **schemas}
            document["components"] = components
            app._bridge_openapi = document
        return app._bridge_openapi

    app.openapi = openapi
