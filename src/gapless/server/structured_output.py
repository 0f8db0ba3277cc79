"""The request fields that constrain the output's shape, as one grammar for the engine.

OpenAI's `response_format` ({"type": "json_object"} or {"type": "json_schema", ...}) and the
Responses API's `text.format` (the same, with the schema's fields flat), vLLM's
`structured_outputs` ({"json": ...}, {"regex": ...}, {"choice": [...]}, {"json_object":
true}), vLLM's older `guided_json`, `guided_regex` and `guided_choice`, and Ollama's `format`
("json" or a schema). A request may use
one of them; each is compiled here, so a schema or regex that cannot work is a 400 naming the
field, before the request is admitted.
"""

from __future__ import annotations

import json
import re
from typing import Any

from gapless.engine.structured import (
    GrammarCompiler,
    GrammarError,
    choice_grammar,
    json_schema_grammar,
    regex_grammar,
)
from gapless.server.protocol import invalid

_SCHEMA_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
_ANY_OBJECT = {"type": "object"}
_LEGACY = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice"}


def output_grammar(body: dict[str, Any], grammars: GrammarCompiler) -> str | None:
    """The grammar the request's output must match, or None when it asks for none."""
    given = [name for name in ("response_format", "structured_outputs", *_LEGACY) if name in body]
    given = [name for name in given if body[name] is not None]
    if len(given) > 1:
        raise invalid(f"send one of {' and '.join(given)}, not both", given[1])
    if not given:
        return None
    name = given[0]
    if name == "response_format":
        return _response_format(body[name], grammars)
    if name == "structured_outputs":
        spec = body[name]
        if not isinstance(spec, dict):
            raise invalid("structured_outputs must be an object", name)
        kinds = [k for k in ("json", "regex", "choice", "json_object") if spec.get(k) is not None]
        if len(kinds) != 1:
            raise invalid("structured_outputs needs exactly one of json, regex, choice", name)
        if kinds[0] == "json_object":
            return _compile(json_schema_grammar, _ANY_OBJECT, grammars, name)
        return _guided(kinds[0], spec[kinds[0]], grammars, f"{name}.{kinds[0]}")
    return _guided(_LEGACY[name], body[name], grammars, name)


def _response_format(spec: Any, grammars: GrammarCompiler) -> str | None:
    return _format(spec, grammars, "response_format", nested="json_schema")


def text_format_grammar(spec: Any, grammars: GrammarCompiler) -> str | None:
    """The Responses API's `text.format`: {"type": "text"}, {"type": "json_object"} or
    {"type": "json_schema", "name", "schema", "strict"}, the schema's fields flat in it."""
    return _format(spec, grammars, "text.format", nested=None)


def _format(spec: Any, grammars: GrammarCompiler, param: str, nested: str | None) -> str | None:
    """An OpenAI output format at `param`; a json_schema one holds its name, schema and
    strict under `nested` (chat's response_format.json_schema), or flat when None."""
    if not isinstance(spec, dict):
        raise invalid(f"{param} must be an object", param)
    kind = spec.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return _compile(json_schema_grammar, _ANY_OBJECT, grammars, param)
    if kind != "json_schema":
        raise invalid(f"{param}.type must be text, json_object or json_schema", param)
    json_schema = spec
    if nested is not None:
        json_schema = spec.get(nested)
        param = f"{param}.{nested}"
        if not isinstance(json_schema, dict):
            raise invalid(f"{nested} must be an object", param)
    name = json_schema.get("name")
    if not isinstance(name, str) or not _SCHEMA_NAME.match(name):
        raise invalid(f"{param}.name must be 1 to 64 letters, digits, '_' or '-'", f"{param}.name")
    if not isinstance(json_schema.get("strict", False), bool | None):
        raise invalid(f"{param}.strict must be a boolean", f"{param}.strict")
    schema = json_schema.get("schema", _ANY_OBJECT)
    if not isinstance(schema, dict):
        raise invalid(f"{param}.schema must be an object", f"{param}.schema")
    return _compile(json_schema_grammar, schema, grammars, f"{param}.schema")


def ollama_format_grammar(value: Any, grammars: GrammarCompiler) -> str | None:
    """Ollama's `format`: "json" (one JSON object) or a JSON schema object; "" or null: none."""
    if value is None or value == "":
        return None
    if value == "json":
        return _compile(json_schema_grammar, _ANY_OBJECT, grammars, "format")
    if not isinstance(value, dict):
        raise invalid('format must be "json" or a JSON schema object', "format")
    return _compile(json_schema_grammar, value, grammars, "format")


def _guided(kind: str, value: Any, grammars: GrammarCompiler, param: str) -> str:
    if kind == "json":
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as e:
                raise invalid(f"{param} is not valid JSON: {e}", param) from e
        if not isinstance(value, dict):
            raise invalid(f"{param} must be a JSON schema object", param)
        return _compile(json_schema_grammar, value, grammars, param)
    if kind == "regex":
        if not isinstance(value, str) or not value:
            raise invalid(f"{param} must be a non-empty string", param)
        return _compile(regex_grammar, value, grammars, param)
    if not (isinstance(value, list) and value and all(isinstance(c, str) and c for c in value)):
        raise invalid(f"{param} must be a non-empty list of non-empty strings", param)
    return _compile(choice_grammar, value, grammars, param)


def _compile(build: Any, spec: Any, grammars: GrammarCompiler, param: str) -> str:
    try:
        grammar = build(spec)
        grammars.check(grammar)
    except GrammarError as e:
        raise invalid(f"{param} cannot be used: {e}", param) from e
    return grammar


def checked_schema_grammar(schema: dict[str, Any], grammars: GrammarCompiler, param: str) -> str:
    """A JSON schema's grammar, or a 400 naming `param`."""
    return _compile(json_schema_grammar, schema, grammars, param)
