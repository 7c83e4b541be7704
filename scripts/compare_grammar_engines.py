"""Measure xgrammar against llguidance on the JSON-schema corpus (tests/data/json_schemas/).

For each engine and each corpus schema: does it compile (or is it refused, and why), and for each
hand-labelled document, is it accepted? A document is spelled as the server generates JSON: one
line, json.dumps with separators (", ", ": "), keys in the schema's property order (the corpus
stores them so). Its token ids (the default model's tokenizer, no special tokens) are fed one by
one; "accepted" means every token was taken and the matcher may then end (it takes the stop token
and terminates, for xgrammar; is_accepting(), for llguidance). Valid documents should be accepted,
invalid ones rejected.

Engines, all on the same tokenizer:
  llguidance           as the server configures it (eaglesrv.grammar.build.json_schema_grammar)
  xgrammar strict      as SGLang calls it (strict_mode=True), any_whitespace=False and
                       separators=(", ", ": "), so its one accepted spelling is the one fed
  xgrammar non-strict  the same with strict_mode=False

Prints a markdown table, then the wrong verdicts one per line. xgrammar is not a dependency of
the project: install it by hand first.

    pip install xgrammar
    python scripts/compare_grammar_engines.py [--threads N]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from importlib.metadata import version
from pathlib import Path
from typing import Any, Callable

CORPUS_DIR = Path(__file__).resolve().parent.parent / "tests" / "data" / "json_schemas"
SEPARATORS = (", ", ": ")
KINDS = ("valid", "invalid")

# compile(schema) -> accepts(token_ids) -> bool; compile raises when the engine refuses the schema
Accepts = Callable[[list[int]], bool]
Compile = Callable[[Any], Accepts]


@dataclass
class Result:
    """One engine's verdicts on the corpus."""

    refused: dict[str, str] = field(default_factory=dict)  # schema -> reason
    warnings: dict[str, list[str]] = field(default_factory=dict)  # schema -> what the compiler said it ignored
    compile_ms: list[float] = field(default_factory=list)
    verdicts: dict[str, dict[str, list[bool]]] = field(default_factory=dict)  # schema -> kind -> accepted?


def load_corpus() -> dict[str, dict]:
    return {path.stem: json.loads(path.read_text(encoding="utf-8")) for path in sorted(CORPUS_DIR.glob("*.json"))}


def spelling(doc) -> str:
    return json.dumps(doc, separators=SEPARATORS, ensure_ascii=False)


def load_tokenizer():
    from transformers import AutoTokenizer

    from eaglesrv.engine.loader import default_model_path

    path = default_model_path()
    return AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)


def llguidance_engine(tokenizer) -> Compile:
    import llguidance
    import llguidance.hf

    from eaglesrv.grammar.build import json_schema_grammar

    llg_tokenizer = llguidance.hf.from_tokenizer(tokenizer, n_vocab=len(tokenizer))

    def compile_schema(schema) -> Accepts:
        matcher = llguidance.LLMatcher(llg_tokenizer, json_schema_grammar(schema), log_level=0)
        if matcher.is_error():
            raise ValueError(matcher.get_error())

        def accepts(ids: list[int]) -> bool:
            copy = matcher.deep_copy()
            return copy.consume_tokens(ids) and copy.is_accepting()

        return accepts

    return compile_schema


def xgrammar_engine(tokenizer, strict: bool, threads: int) -> Compile:
    import xgrammar

    info = xgrammar.TokenizerInfo.from_huggingface(tokenizer, vocab_size=len(tokenizer))
    compiler = xgrammar.GrammarCompiler(info, max_threads=threads)
    stop = info.stop_token_ids[0]

    def compile_schema(schema) -> Accepts:
        compiled = compiler.compile_json_schema(json.dumps(schema), any_whitespace=False,
                                                separators=SEPARATORS, strict_mode=strict)

        def accepts(ids: list[int]) -> bool:
            matcher = xgrammar.GrammarMatcher(compiled)
            return all(matcher.accept_token(i) for i in ids) and matcher.accept_token(stop) \
                and matcher.is_terminated()

        return accepts

    return compile_schema


def one_line(message: str, limit: int = 90) -> str:
    text = " ".join(message.split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


@contextlib.contextmanager
def native_stderr(lines: list[str]):
    """Collect what native code writes to file descriptor 2 (xgrammar logs the keywords it ignores there)."""
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile(mode="w+b") as sink:
        os.dup2(sink.fileno(), 2)
        try:
            yield
        finally:
            os.dup2(saved, 2)
            os.close(saved)
            sink.seek(0)
            lines += sink.read().decode(errors="replace").splitlines()


def warning_text(line: str) -> str:
    """'[time] file.cc:123: Warning: text' -> 'text'."""
    return one_line(line.split("Warning:", 1)[-1])


def measure(compile_schema: Compile, corpus: dict[str, dict], tokenizer) -> Result:
    result = Result()
    for name, entry in corpus.items():
        logged: list[str] = []
        start = time.perf_counter()
        try:
            with native_stderr(logged):
                accepts = compile_schema(entry["schema"])
        except Exception as exc:  # noqa: BLE001 - each engine raises its own kinds of refusal
            result.refused[name] = one_line(str(exc) or type(exc).__name__)
            continue
        result.compile_ms.append(1000 * (time.perf_counter() - start))
        if logged:
            result.warnings[name] = sorted({warning_text(line) for line in logged})
        result.verdicts[name] = {kind: [accepts(tokenizer.encode(spelling(doc), add_special_tokens=False))
                                        for doc in entry[kind]] for kind in KINDS}
    return result


def wrong(result: Result, names=None) -> list[tuple[str, str, int]]:
    """(schema, kind, index) of every valid document rejected and invalid document accepted."""
    return [(name, kind, index) for name, got in result.verdicts.items() if names is None or name in names
            for kind in KINDS for index, accepted in enumerate(got[kind]) if accepted != (kind == "valid")]


def rate(result: Result, kind: str, names=None) -> str:
    """How many `kind` documents got the right verdict, over the schemas in `names` (all compiled)."""
    got = [ok for name, verdict in result.verdicts.items() if names is None or name in names for ok in verdict[kind]]
    right = sum(ok == (kind == "valid") for ok in got)
    return f"{right}/{len(got)} ({100 * right / max(len(got), 1):.1f}%)"


def refusals(result: Result) -> str:
    if not result.refused:
        return "0"
    groups = Counter(result.refused.values()).most_common()
    return f"{len(result.refused)}: " + "; ".join(f"{reason} ×{count}" for reason, count in groups)


def compile_warnings(result: Result) -> str:
    if not result.warnings:
        return "0"
    groups = Counter(text for texts in result.warnings.values() for text in texts).most_common()
    return f"{len(result.warnings)}: " + "; ".join(f"{text} ×{count}" for text, count in groups)


def wrong_schemas(result: Result) -> str:
    by_schema = Counter(name for name, _, _ in wrong(result))
    return ", ".join(f"{name} ({count})" for name, count in sorted(by_schema.items())) or "none"


def table(results: dict[str, Result], total: int) -> str:
    common = set.intersection(*(set(result.verdicts) for result in results.values()))
    rows = {
        "schemas compiled": lambda r: f"{len(r.verdicts)}/{total}",
        "refused (reasons grouped)": refusals,
        "compiled with a logged warning (schemas; warnings grouped)": compile_warnings,
        "valid documents accepted": lambda r: rate(r, "valid"),
        "invalid documents rejected": lambda r: rate(r, "invalid"),
        f"valid accepted, on the {len(common)} schemas every engine compiles": lambda r: rate(r, "valid", common),
        f"invalid rejected, on the {len(common)} schemas every engine compiles": lambda r: rate(r, "invalid", common),
        "schemas with a wrong verdict (count of documents)": wrong_schemas,
        "compile time, median ms per schema": lambda r: f"{statistics.median(r.compile_ms):.1f}",
    }
    lines = ["| | " + " | ".join(results) + " |", "|---" * (len(results) + 1) + "|"]
    lines += [f"| {label} | " + " | ".join(cell(r) for r in results.values()) + " |" for label, cell in rows.items()]
    return "\n".join(lines)


def mistakes(results: dict[str, Result], corpus: dict[str, dict]) -> list[str]:
    """One line per wrong verdict; '(schema warned)' when the compiler logged a warning for that schema."""
    return [f"- {engine}: {name} {kind}#{index} {'rejected' if kind == 'valid' else 'accepted'}"
            f"{' (schema warned)' if name in result.warnings else ''}: "
            f"{one_line(spelling(corpus[name][kind][index]), 140)}"
            for engine, result in results.items() for name, kind, index in wrong(result)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=1, help="xgrammar compiler threads (SGLang uses 8)")
    args = parser.parse_args()
    corpus = load_corpus()
    tokenizer = load_tokenizer()
    engines = {
        f"llguidance {version('llguidance')}": llguidance_engine(tokenizer),
        f"xgrammar {version('xgrammar')} strict": xgrammar_engine(tokenizer, True, args.threads),
        f"xgrammar {version('xgrammar')} non-strict": xgrammar_engine(tokenizer, False, args.threads),
    }
    results = {label: measure(engine, corpus, tokenizer) for label, engine in engines.items()}
    print(f"JSON-schema corpus: {len(corpus)} schemas, tokenizer {tokenizer.name_or_path} ({len(tokenizer)} tokens)\n")
    print(table(results, len(corpus)))
    print("\nWrong verdicts:")
    print("\n".join(mistakes(results, corpus)) or "none")


if __name__ == "__main__":
    main()
