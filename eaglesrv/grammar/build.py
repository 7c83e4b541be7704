"""From what a request asks (a JSON schema, JSON mode, a regex, an EBNF or Lark grammar) to
one grammar string that the engine enforces token by token (llguidance's format).

Why llguidance: on real-world schemas it enforces what it compiles exactly and refuses
the rest with a message naming the keyword it lacks, where xgrammar silently forbids
outputs the schema allows (docs/structured_output.md; tests/test_grammar_schemas.py
keeps the measurement). A schema is enforced exactly or refused with a 400: the compile
options never relax a keyword (no `lenient`, no `coerce_one_of`).

JSON is generated on one line with Python's separators (", " and ": "), and an object's
properties in the schema's order: whitespace is not free, so a small model cannot wander
into endless newlines, and every document the schema allows has exactly one spelling the
grammar accepts (json.dumps(doc, separators=JSON_SEPARATORS) with keys in schema order).

The grammar string is plain text, so it travels in SamplingParams to the engine process;
checking it here (once per distinct grammar, cached) turns a bad schema into a 400 before
the engine sees it. The check compiles the grammar: call it off the event loop.
"""

from __future__ import annotations

import functools
import json
from typing import Any

JSON_SEPARATORS = (", ", ": ")  # item, key: json.dumps(doc, separators=JSON_SEPARATORS) is the accepted form
# Overrides, applied after any "x-guidance" options in the schema itself: a schema cannot
# relax its own enforcement (lenient, coerce_one_of) or the spelling.
_JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": JSON_SEPARATORS[0],
                 "key_separator": JSON_SEPARATORS[1], "lenient": False, "coerce_one_of": False}


class GrammarError(ValueError):
    """The grammar cannot be enforced; the message names the problem."""


def json_schema_grammar(schema: dict[str, Any] | bool | str) -> str:
    """The grammar of the JSON documents `schema` allows (a dict, true, or its JSON text)."""
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except json.JSONDecodeError as exc:
            raise GrammarError(f"the JSON schema is not valid JSON: {exc}") from None
    if schema is True:
        schema = {}
    if not isinstance(schema, dict):
        raise GrammarError(f"a JSON schema must be an object or true, got {type(schema).__name__}")
    import llguidance

    text = json.dumps(schema)
    return checked(llguidance.LLMatcher.grammar_from_json_schema(text, overrides=_JSON_OPTIONS))


def json_object_grammar() -> str:
    """OpenAI's JSON mode: any JSON object."""
    return json_schema_grammar({"type": "object"})


def regex_grammar(pattern: str) -> str:
    """Text that matches `pattern` whole (Rust regex syntax, as SGLang's and vLLM's backends)."""
    import llguidance

    return checked(llguidance.LLMatcher.grammar_from_regex(pattern))


def ebnf_grammar(ebnf: str) -> str:
    """A GBNF grammar (SGLang's `ebnf`, llama.cpp's format, root rule `root`) or a Lark one."""
    from llguidance.gbnf_to_lark import any_to_lark

    try:
        lark = any_to_lark(ebnf)
    except Exception as exc:  # noqa: BLE001 - the converter raises whatever its parser meets
        raise GrammarError(f"the grammar could not be read: {exc}") from None
    return lark_grammar(lark)


def lark_grammar(lark: str) -> str:
    """A Lark grammar (llguidance's dialect, which may embed %json{...} schemas)."""
    import llguidance

    return checked(llguidance.LLMatcher.grammar_from_lark(lark))


@functools.lru_cache(maxsize=256)
def checked(grammar: str) -> str:
    """`grammar` if llguidance compiles it, else GrammarError with its message (the keyword
    or rule it could not enforce). Cached: a schema sent again is not compiled again."""
    import llguidance

    is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar)
    if is_error:
        raise GrammarError(_one_line(messages[0]))
    return grammar


def _one_line(message: str, limit: int = 400) -> str:
    text = " ".join(line.strip() for line in message.splitlines() if line.strip()) or "the grammar is invalid"
    return text if len(text) <= limit else text[: limit - 3] + "..."
