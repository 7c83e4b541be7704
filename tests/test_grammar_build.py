"""Request grammars (eaglesrv/grammar/build.py): what compiles, what is refused and how the
refusal names it, that a schema cannot relax its own enforcement, and the compile cache."""

from __future__ import annotations

import pytest

from eaglesrv.grammar import (
    GrammarError,
    ebnf_grammar,
    json_object_grammar,
    json_schema_grammar,
    lark_grammar,
    regex_grammar,
)
from eaglesrv.grammar.build import checked


def test_each_kind_of_grammar_compiles():
    assert '"json_schema"' in json_schema_grammar({"type": "object", "properties": {"a": {"type": "integer"}}})
    assert json_schema_grammar('{"type": "string"}') == json_schema_grammar({"type": "string"})
    assert json_schema_grammar(True) == json_schema_grammar({})
    assert json_object_grammar() == json_schema_grammar({"type": "object"})
    assert "lark_grammar" in regex_grammar(r"\d{3}-\d{4}")
    assert ebnf_grammar('root ::= "yes" | "no"').startswith("%llguidance")  # Lark text, as llguidance takes it
    assert "%json" in lark_grammar('start: "<a>" %json{"type": "integer"} "</a>"')


@pytest.mark.parametrize("build,argument,named", [
    (json_schema_grammar, {"type": "array", "uniqueItems": True}, "uniqueItems"),
    (json_schema_grammar, {"not": {"type": "string"}}, "not"),
    (json_schema_grammar, {"type": "string", "format": "no-such-format"}, "no-such-format"),
    (json_schema_grammar, {"oneOf": [{"type": "integer"}, {"type": "number"}]}, "oneOf"),
    (json_schema_grammar, "{not json", "not valid JSON"),
    (json_schema_grammar, [1, 2], "must be an object"),
    (regex_grammar, "[a-", "unclosed character class"),
    (ebnf_grammar, "root ::= missing", "missing"),
    (lark_grammar, "start: nothing_here", "nothing_here"),
])
def test_refusals_name_the_problem(build, argument, named):
    with pytest.raises(GrammarError, match=named):
        build(argument)


def test_a_schema_cannot_relax_its_own_enforcement():
    """llguidance reads options from the schema's "x-guidance" key; ours override them."""
    with pytest.raises(GrammarError, match="uniqueItems"):
        json_schema_grammar({"type": "array", "uniqueItems": True, "x-guidance": {"lenient": True}})
    with pytest.raises(GrammarError, match="oneOf"):
        json_schema_grammar({"oneOf": [{"type": "integer"}, {"type": "number"}], "x-guidance": {"coerce_one_of": True}})
    flexible = json_schema_grammar({"type": "object", "x-guidance": {"whitespace_flexible": True}})
    assert '"whitespace_flexible":false' in flexible.replace(" ", "")


def test_a_grammar_is_compiled_once():
    schema = {"type": "object", "properties": {"only_here": {"type": "boolean"}}}
    json_schema_grammar(schema)
    hits = checked.cache_info().hits
    json_schema_grammar(dict(schema))
    assert checked.cache_info().hits == hits + 1
