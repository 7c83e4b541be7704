"""Structured output: the grammars requests ask for (build.py), checked before the engine
enforces them (engine/grammar_masks.py)."""

from eaglesrv.grammar.build import (
    JSON_SEPARATORS,
    GrammarError,
    ebnf_grammar,
    json_object_grammar,
    json_schema_grammar,
    lark_grammar,
    regex_grammar,
)

__all__ = ["JSON_SEPARATORS", "GrammarError", "ebnf_grammar", "json_object_grammar", "json_schema_grammar",
           "lark_grammar", "regex_grammar"]
