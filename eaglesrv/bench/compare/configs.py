"""The server configurations `bench_compare` runs side by side.

Each is a name and the launch flags that make it. A new mode is one more line in
`build_configs` (or, with no code at all, `--config "NAME=FLAGS"` on the command line).
`--config-source NAME=DIR` runs one of them from another eaglesrv source tree, so two code
revisions can be compared in one run. The ratios are to the baseline: the built-in plain
server, or with `--baseline NAME` another configuration, and then plain does not run (so
`--config "radix=" --config "no-radix=--disable-radix-cache" --baseline radix` runs two
servers, not a third one identical to radix).
"""

from __future__ import annotations

import shlex
import sys
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Sequence

BASELINE = "plain"


@dataclass(frozen=True)
class ServerVariant:
    """A named set of launch flags for `python -m eaglesrv.launch`: one server of the comparison."""

    name: str  # a column of the table and a line of the plot
    server_args: tuple[str, ...]  # added to `python -m eaglesrv.launch`
    source_dir: Path | None = None  # the eaglesrv source tree it runs from; None: the installed one


@dataclass(frozen=True)
class EagleTree:
    """SGLang's three speculation settings: tree depth, branching, nodes verified per request."""

    num_steps: int
    eagle_topk: int
    num_draft_tokens: int

    @classmethod
    def parse(cls, text: str) -> "EagleTree":
        """"5,8,32" -> steps 5, topk 8, 32 draft tokens."""
        try:
            steps, topk, tokens = (int(part) for part in text.split(","))
        except ValueError:
            raise ValueError(f"an EAGLE-3 setting is STEPS,TOPK,DRAFT_TOKENS such as 5,8,32, not {text!r}") from None
        return cls(steps, topk, tokens)

    def __str__(self) -> str:
        return f"{self.num_steps},{self.eagle_topk},{self.num_draft_tokens}"


def plain() -> ServerVariant:
    return ServerVariant(BASELINE, ())


def _speculative_flags(draft_model_path: str | None, tree: EagleTree) -> tuple[str, ...]:
    head = ("--speculative-draft-model-path", draft_model_path) if draft_model_path else ()
    return ("--speculative-algorithm", "EAGLE3", *head, "--speculative-num-steps", str(tree.num_steps),
            "--speculative-eagle-topk", str(tree.eagle_topk), "--speculative-num-draft-tokens",
            str(tree.num_draft_tokens))


def eagle3(draft_model_path: str | None, tree: EagleTree) -> ServerVariant:
    """The static tree at every step, as SGLang runs it; draft_model_path None: the head
    eaglesrv ships for the default model."""
    return ServerVariant(f"eagle3 ({tree})", _speculative_flags(draft_model_path, tree)
                         + ("--disable-speculative-adaptive",))


def adaptive(draft_model_path: str | None, largest: EagleTree) -> ServerVariant:
    """Adaptive speculation (eaglesrv's default) with `largest` as the biggest tree a step may use."""
    return ServerVariant(f"adaptive (<={largest})", _speculative_flags(draft_model_path, largest))


def custom(spec: str) -> ServerVariant:
    """--config "NAME=FLAGS": any other configuration, e.g. "adaptive=--speculative-algorithm EAGLE3 ..."."""
    name, sep, flags = spec.partition("=")
    if not sep or not name.strip():
        raise ValueError(f'--config takes "NAME=SERVER FLAGS", not {spec!r}')
    return ServerVariant(name.strip(), tuple(shlex.split(flags)))


def build_configs(draft_model_path: str | None, trees: Sequence[EagleTree],
                  extra: Sequence[str] = (), adaptive_trees: Sequence[EagleTree] = (),
                  default_model: bool = False, baseline: str = BASELINE) -> list[ServerVariant]:
    """The baseline first (the ratios' denominator: plain, unless `baseline` names another
    configuration, and then plain is left out), then one EAGLE-3 server per tree, one
    adaptive server per largest tree, then --config ones. Without a draft path the servers
    use the head shipped for the default model, so that needs `default_model`."""
    if (trees or adaptive_trees) and not draft_model_path and not default_model:
        raise ValueError("EAGLE-3 settings need --speculative-draft-model-path "
                         "(only the default model has a head shipped with eaglesrv)")
    configs = [plain()] if baseline == BASELINE else []
    configs += [eagle3(draft_model_path, tree) for tree in trees]
    configs += [adaptive(draft_model_path, tree) for tree in adaptive_trees]
    configs += [custom(spec) for spec in extra]
    names = [c.name for c in configs]
    if len(set(names)) != len(names):
        raise ValueError(f"configuration names must differ: {names}")
    if baseline not in names:
        raise ValueError(f"--baseline {baseline}: no configuration has that name (they are: {', '.join(names)})")
    return sorted(configs, key=lambda c: c.name != baseline)  # the baseline first, the rest in order


def with_sources(variants: Sequence[ServerVariant], specs: Sequence[str]) -> list[ServerVariant]:
    """--config-source NAME=DIR (repeatable): configuration NAME's server imports eaglesrv from
    DIR (DIR/eaglesrv/__init__.py) instead of the installed package. Checked here, before any
    server starts: a typo found after the first configuration's hour of runs costs that hour."""
    names = [v.name for v in variants]
    sources: dict[str, Path] = {}
    for spec in specs:
        # Names may hold "=" (the adaptive configurations' do: "adaptive (<=5,8,32)"): the
        # longest name that is a configuration wins.
        name, sep, directory = next(((n, "=", spec[len(n) + 1:]) for n in sorted(names, key=len, reverse=True)
                                     if spec.startswith(n + "=")), spec.partition("="))
        name, directory = name.strip(), directory.strip()
        if not sep or not name or not directory:
            raise ValueError(f'--config-source takes "NAME=DIR", not {spec!r}')
        if name not in names:
            raise ValueError(f"--config-source {name}: no configuration has that name (they are: {', '.join(names)})")
        if name in sources:
            raise ValueError(f"--config-source {name}: given twice")
        root = Path(directory).expanduser().resolve()
        if not (root / "eaglesrv" / "__init__.py").is_file():
            raise ValueError(f"--config-source {name}={directory}: {root} has no eaglesrv/__init__.py "
                             "(DIR is the root of a source tree, e.g. a `git worktree add` directory)")
        sources[name] = root
    if sources and sys.version_info < (3, 11) and (Path.cwd() / "eaglesrv" / "__init__.py").is_file():
        # Without PYTHONSAFEPATH (3.11+), `python -m` puts the working directory ahead of
        # PYTHONPATH, and this directory's eaglesrv/ would be the one imported.
        raise ValueError("--config-source needs Python 3.11+ when run from a directory that holds eaglesrv/; "
                         "run bench_compare from another directory")
    return [replace(v, source_dir=sources.get(v.name)) for v in variants]
