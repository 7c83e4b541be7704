"""The grammar a request asks for, from OpenAI's, vLLM's and SGLang's fields.

    OpenAI   response_format: {"type": "json_object"} or {"type": "json_schema",
             "json_schema": {"name": ..., "schema": {...}}} (chat and completions)
    vLLM     guided_json, guided_regex, guided_choice, guided_grammar; structured_outputs
             {"json" | "regex" | "choice" | "grammar": ...}
    SGLang   json_schema (a JSON string), regex, ebnf: in the OpenAI bodies and in
             /generate's sampling_params

A request gives at most one. A grammar that cannot be enforced exactly is a 400 naming
the field and the keyword (eaglesrv/grammar/build.py); it is checked here, in the handler's
preparation, which runs off the event loop.
"""

from __future__ import annotations

import json
from typing import Any, Callable

from eaglesrv.grammar import (
    GrammarError,
    ebnf_grammar,
    json_object_grammar,
    json_schema_grammar,
    lark_grammar,
    regex_grammar,
)
from eaglesrv.server.errors import bad_request


def openai_grammar(body, state) -> str | None:
    """The grammar of a chat or completions request, or None."""
    fields, response_format = body.model_extra or {}, body.response_format
    asked: list[tuple[str, Callable[[], str]]] = []
    if response_format is not None:
        asked += _response_format(response_format)
    for name, build in _FIELD_BUILDERS.items():
        value = fields.get(name)
        if value not in (None, "", [], {}):
            asked.append((name, lambda build=build, value=value: build(value)))
    structured = fields.get("structured_outputs")
    if structured:
        asked += _structured_outputs(structured)
    return _one(asked, state)


def native_grammar(sampling_params, state) -> str | None:
    """The grammar of /generate's sampling_params (SGLang's json_schema, regex, ebnf), or None."""
    sampling_fields = sampling_params.model_extra or {}
    asked = [(f"sampling_params.{name}", lambda build=_FIELD_BUILDERS[name], value=value: build(value))
             for name in ("json_schema", "regex", "ebnf")
             if (value := sampling_fields.get(name)) not in (None, "")]
    return _one(asked, state)


def _one(asked: list[tuple[str, Callable[[], str]]], state) -> str | None:
    if not asked:
        return None
    if state.tokenizer is None:
        raise bad_request(f"{asked[0][0]}: structured output needs the tokenizer (--skip-tokenizer-init is set)",
                          param=asked[0][0])
    if len(asked) > 1:
        names = ", ".join(name for name, _ in asked)
        raise bad_request(f"a request may ask for one structured output constraint, got {names}", param=asked[1][0])
    name, build = asked[0]
    try:
        return build()
    except GrammarError as exc:
        raise bad_request(f"{name}: {exc}", param=name) from None


def _response_format(response_format: dict[str, Any]) -> list[tuple[str, Callable[[], str]]]:
    kind = response_format.get("type", "text")
    if kind == "text":
        return []
    if kind == "json_object":
        return [("response_format", json_object_grammar)]
    if kind == "json_schema":
        spec = response_format.get("json_schema")
        if not isinstance(spec, dict) or "schema" not in spec:
            raise bad_request("response_format: json_schema needs {\"name\": ..., \"schema\": {...}}",
                              param="response_format")
        return [("response_format.json_schema.schema", lambda: json_schema_grammar(spec["schema"]))]
    raise bad_request(f"response_format: type {kind!r} is not supported (text, json_object, json_schema)",
                      param="response_format")


def _structured_outputs(spec: Any) -> list[tuple[str, Callable[[], str]]]:
    if not isinstance(spec, dict):
        raise bad_request("structured_outputs must be an object", param="structured_outputs")
    builders = {key: _FIELD_BUILDERS[field] for key, field in _STRUCTURED_OUTPUTS_KEYS.items()}
    unknown = sorted(k for k, v in spec.items() if k not in builders and v not in (None, False, "", [], {}))
    if unknown:
        raise bad_request(f"structured_outputs: {', '.join(unknown)} is not supported ({', '.join(builders)})",
                          param="structured_outputs")
    return [(f"structured_outputs.{key}", lambda build=builders[key], value=spec[key]: build(value))
            for key in builders if spec.get(key) not in (None, "", [], {})]


def _text(build: Callable[[str], str]) -> Callable[[Any], str]:
    def checked(value: Any) -> str:
        if not isinstance(value, str):
            raise GrammarError(f"must be a string, got {type(value).__name__}")
        return build(value)

    return checked


def _choice(choices: Any) -> str:
    """Exactly one of the given strings."""
    if not isinstance(choices, list) or not choices or not all(isinstance(c, str) and c for c in choices):
        raise GrammarError("must be a non-empty list of non-empty strings")
    return lark_grammar("start: " + " | ".join(json.dumps(choice) for choice in choices))


_FIELD_BUILDERS: dict[str, Callable[[Any], str]] = {
    "json_schema": json_schema_grammar,  # SGLang: the schema as a JSON string (an object is taken too)
    "regex": _text(regex_grammar),
    "ebnf": _text(ebnf_grammar),
    "guided_json": json_schema_grammar,  # vLLM
    "guided_regex": _text(regex_grammar),
    "guided_choice": _choice,
    "guided_grammar": _text(ebnf_grammar),
}
# vLLM's structured_outputs keys: the same constraints as its guided_* fields
_STRUCTURED_OUTPUTS_KEYS = {"json": "guided_json", "regex": "guided_regex", "choice": "guided_choice",
                            "grammar": "guided_grammar"}
