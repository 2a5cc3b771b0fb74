"""The bounds a JSON schema that a request brings (response_format's, a tool's parameters) must keep, checked
before any grammar compiler meets it."""

from __future__ import annotations

import json

from .errors import FieldError

MAX_SCHEMA_CHARS = 32_768  # a schema (or a list of choices) is a request's input: bounded before it reaches a compiler
MAX_SCHEMA_DEPTH = 32
JSON_TYPES = {"object", "array", "string", "number", "integer", "boolean", "null"}


def check_schema(schema, where: str = "response_format") -> None:
    """Bounds and names what a compiler would otherwise meet first: size, depth, and the `type` keywords.
    where: the field the schema came in, which the errors (FieldError) name."""
    if not isinstance(schema, (dict, bool)):
        raise FieldError(where, f"the schema must be an object, not {type(schema).__name__}")
    try:
        text = json.dumps(schema)
    except (TypeError, ValueError, RecursionError) as e:
        raise FieldError(where, f"not JSON ({e})") from None
    if len(text) > MAX_SCHEMA_CHARS:
        raise FieldError(where, f"{len(text)} characters, more than {MAX_SCHEMA_CHARS}")

    def walk(node, path: str, depth: int) -> None:
        if depth > MAX_SCHEMA_DEPTH:
            raise FieldError(where, f"nested deeper than {MAX_SCHEMA_DEPTH} at {path}")
        if isinstance(node, dict):
            kind = node.get("type")  # a dict here is a property named "type", walked below
            for t in kind if isinstance(kind, list) else [kind] if isinstance(kind, str) else []:
                if t not in JSON_TYPES:
                    raise FieldError(where, f"unknown type {t!r} at {path}")
            for k, v in node.items():
                if k not in ("enum", "const", "default", "examples"):  # values there are data, not schemas
                    walk(v, f"{path}/{k}", depth + 1)
        elif isinstance(node, list):
            for i, v in enumerate(node):
                walk(v, f"{path}/{i}", depth + 1)

    walk(schema, "#", 0)
