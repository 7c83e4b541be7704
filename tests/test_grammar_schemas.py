"""The JSON-schema corpus (tests/data/json_schemas/): real-world-style schemas with hand-labelled
documents, kept as the measurement behind the structured-output design note: a schema is
enforced exactly or refused with a message naming the keyword.

Each file holds a schema, documents it allows ("valid") and documents it forbids for a schema
reason ("invalid"), and either refused: null (llguidance compiles it) or the text expected in the
GrammarError. The labels are checked against jsonschema; for every compiling schema each
document, spelled as the server generates JSON (json.dumps with JSON_SEPARATORS, keys in the
schema's property order), is fed token by token to an llguidance matcher on the default model's
tokenizer: valid documents must be accepted, invalid ones rejected. The few places where
llguidance is known to be wrong are listed in the file's "known_llguidance_mistakes" and run
here as strict xfails, so a fix (or a new mistake) shows up.

"bounded": true marks schemas whose documents stay short (every string limited, every array
capped, no extra keys), so that a small model sampling at temperature 1 under them finishes.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from jsonschema import Draft202012Validator

from eaglesrv.grammar.build import JSON_SEPARATORS, GrammarError, json_schema_grammar

CORPUS_DIR = Path(__file__).parent / "data" / "json_schemas"
CORPUS = {path.stem: json.loads(path.read_text(encoding="utf-8")) for path in sorted(CORPUS_DIR.glob("*.json"))}
COMPILING = [name for name, entry in CORPUS.items() if entry["refused"] is None]
REFUSED = [name for name, entry in CORPUS.items() if entry["refused"] is not None]
KINDS = ("valid", "invalid")


def known_mistakes(name: str, kind: str) -> set[int]:
    return set(CORPUS[name].get("known_llguidance_mistakes", {}).get(kind, []))


MISTAKES = [(name, kind, index) for name in COMPILING for kind in KINDS for index in sorted(known_mistakes(name, kind))]


def spelling(doc) -> str:
    """The one spelling of `doc` the grammar accepts (keys must already be in schema order)."""
    return json.dumps(doc, separators=JSON_SEPARATORS, ensure_ascii=False)


@pytest.fixture(scope="module")
def tokenizer(default_tokenizer):
    return default_tokenizer


@pytest.fixture(scope="module")
def llg_tokenizer(default_lltokenizer):
    return default_lltokenizer


def accepts(matcher, tokenizer, text: str) -> bool:
    """Whether a copy of `matcher` takes every token of `text` and may stop after them."""
    matcher = matcher.deep_copy()
    ids = tokenizer.encode(text, add_special_tokens=False)
    return matcher.consume_tokens(ids) and matcher.is_accepting()


def new_matcher(llg_tokenizer, schema):
    import llguidance

    matcher = llguidance.LLMatcher(llg_tokenizer, json_schema_grammar(schema), log_level=0)
    assert not matcher.is_error(), matcher.get_error()
    return matcher


@pytest.fixture(scope="module")
def verdict(tokenizer, llg_tokenizer):
    """verdict(name) -> {"valid": [accepted?...], "invalid": [accepted?...]}, computed once per schema."""
    cache: dict[str, dict[str, list[bool]]] = {}

    def get(name: str) -> dict[str, list[bool]]:
        if name not in cache:
            matcher = new_matcher(llg_tokenizer, CORPUS[name]["schema"])
            cache[name] = {kind: [accepts(matcher, tokenizer, spelling(doc)) for doc in CORPUS[name][kind]]
                           for kind in KINDS}
        return cache[name]

    return get


def test_corpus_shape():
    assert len(COMPILING) >= 60
    assert 6 <= len(REFUSED) <= 10
    assert sum(CORPUS[name]["bounded"] for name in COMPILING) >= 50
    for name, entry in CORPUS.items():
        assert {"description", "schema", "valid", "invalid", "refused", "bounded"} <= entry.keys(), name
        assert entry["description"], name
        assert not (entry["bounded"] and entry["refused"]), name
        for kind in KINDS:
            assert 2 <= len(entry[kind]) <= 4, (name, kind)


def _unbounded(node, where: str = "#") -> list[str]:
    """Places in a schema where a sampled document could grow without limit (recursion through
    $ref is not followed: a recursive schema is marked unbounded by hand)."""
    if not isinstance(node, dict):
        return []
    problems = []
    if not node or not {"type", "enum", "const", "$ref", "anyOf", "allOf"} & node.keys():
        problems.append(f"{where}: allows any value")
    types = node.get("type", [])
    types = [types] if isinstance(types, str) else types
    if "string" in types and not {"maxLength", "enum", "const", "pattern"} & node.keys() \
            and node.get("format") not in ("date", "uuid", "ipv4", "ipv6"):
        problems.append(f"{where}: string without maxLength")
    if "array" in types and not (node.get("maxItems", 99) <= 4 or node.get("items") is False):
        problems.append(f"{where}: array without maxItems <= 4")
    if "object" in types:
        if node.get("additionalProperties") is not False or "patternProperties" in node:
            problems.append(f"{where}: object open to extra keys")
        if len(node.get("properties", {})) > 12:
            problems.append(f"{where}: more than 12 properties")
    if "number" in types:
        problems.append(f"{where}: a number's fraction has no digit limit")
    if {"integer", "number"} & set(types) and not ({"minimum", "exclusiveMinimum"} & node.keys()
                                                   and {"maximum", "exclusiveMaximum"} & node.keys()):
        problems.append(f"{where}: number without both bounds")
    if "maxLength" in node and node["maxLength"] > 40:
        problems.append(f"{where}: maxLength over 40")
    children = [(f"{where}/properties/{k}", v) for k, v in node.get("properties", {}).items()]
    children += [(f"{where}/$defs/{k}", v) for k, v in node.get("$defs", {}).items()]
    children += [(f"{where}/{key}/{n}", v) for key in ("anyOf", "allOf", "prefixItems")
                 for n, v in enumerate(node.get(key, []))]
    if isinstance(node.get("items"), dict):
        children.append((f"{where}/items", node["items"]))
    for child_where, child in children:
        if key_only_constraint(child):
            continue
        problems += _unbounded(child, child_where)
    return problems


def key_only_constraint(node) -> bool:
    """An allOf/anyOf member that only adds constraints (required, a narrower property) to its parent."""
    return isinstance(node, dict) and "type" not in node and not {"enum", "const", "$ref"} & node.keys() \
        and {"required", "properties"} >= node.keys() and node.keys() != set()


@pytest.mark.parametrize("name", [name for name in COMPILING if CORPUS[name]["bounded"]])
def test_bounded_schemas_are_bounded(name):
    assert _unbounded(CORPUS[name]["schema"]) == []


@pytest.mark.parametrize("name", list(CORPUS))
def test_labels_agree_with_jsonschema(name):
    entry = CORPUS[name]
    Draft202012Validator.check_schema(entry["schema"])
    validator = Draft202012Validator(entry["schema"], format_checker=Draft202012Validator.FORMAT_CHECKER)
    for index, doc in enumerate(entry["valid"]):
        assert [e.message for e in validator.iter_errors(doc)] == [], ("valid", index)
    for index, doc in enumerate(entry["invalid"]):
        assert not validator.is_valid(doc), ("invalid", index, doc)


@pytest.mark.parametrize("name", COMPILING)
def test_llguidance_enforces_schema_exactly(name, verdict):
    got = verdict(name)
    wrong = [(kind, index, spelling(doc)) for kind in KINDS for index, doc in enumerate(CORPUS[name][kind])
             if got[kind][index] != (kind == "valid") and index not in known_mistakes(name, kind)]
    assert wrong == []


@pytest.mark.parametrize(("name", "kind", "index"), MISTAKES)
@pytest.mark.xfail(strict=True, reason="llguidance is known to be wrong here (known_llguidance_mistakes)")
def test_known_llguidance_mistakes(name, kind, index, verdict):
    assert verdict(name)[kind][index] == (kind == "valid"), CORPUS[name]["known_llguidance_mistakes"]["why"]


@pytest.mark.parametrize("name", REFUSED)
def test_refused_schema_names_the_keyword(name):
    with pytest.raises(GrammarError) as raised:
        json_schema_grammar(CORPUS[name]["schema"])
    assert CORPUS[name]["refused"] in str(raised.value)


def test_accepted_spelling(tokenizer, llg_tokenizer):
    """One spelling per document: keys in the schema's property order; with numeric bounds, no exponent."""
    schema = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "number", "minimum": 0}},
              "additionalProperties": False}
    matcher = new_matcher(llg_tokenizer, schema)
    assert accepts(matcher, tokenizer, '{"a": 1, "b": 0.000000001}')
    assert not accepts(matcher, tokenizer, '{"b": 0.5, "a": 1}')
    assert not accepts(matcher, tokenizer, '{"a": 1, "b": 1e-09}')


def test_summary(verdict, capsys):
    valid = [ok for name in COMPILING for ok in verdict(name)["valid"]]
    invalid = [ok for name in COMPILING for ok in verdict(name)["invalid"]]
    bounded = sum(CORPUS[name]["bounded"] for name in COMPILING)
    with capsys.disabled():
        print(f"\nJSON-schema corpus: {len(COMPILING)} compiled ({bounded} bounded), {len(REFUSED)} refused; "
              f"valid accepted {sum(valid)}/{len(valid)} ({100 * sum(valid) / len(valid):.1f}%), "
              f"invalid rejected {invalid.count(False)}/{len(invalid)} "
              f"({100 * invalid.count(False) / len(invalid):.1f}%)")
    assert len(COMPILING) >= 60 and bounded >= 50
