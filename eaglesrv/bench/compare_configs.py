"""The server configurations `bench_compare` runs side by side.

Each is a name and the launch flags that make it. A new mode is one more line in
`build_configs` (or, with no code at all, `--config "NAME=FLAGS"` on the command line).
"""

from __future__ import annotations

import shlex
from dataclasses import dataclass
from typing import Sequence

BASELINE = "plain"


@dataclass(frozen=True)
class ServerConfig:
    name: str  # a column of the table and a line of the plot
    server_args: tuple[str, ...]  # added to `python -m eaglesrv.launch`


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


def plain() -> ServerConfig:
    return ServerConfig(BASELINE, ())


def eagle3(draft_model_path: str | None, tree: EagleTree) -> ServerConfig:
    """draft_model_path None: the head eaglesrv ships for the default model."""
    head = ("--speculative-draft-model-path", draft_model_path) if draft_model_path else ()
    return ServerConfig(f"eagle3 ({tree})", ("--speculative-algorithm", "EAGLE3", *head,
        "--speculative-num-steps", str(tree.num_steps), "--speculative-eagle-topk", str(tree.eagle_topk),
        "--speculative-num-draft-tokens", str(tree.num_draft_tokens),
    ))


def adaptive(draft_model_path: str | None, largest: EagleTree) -> ServerConfig:
    """--speculative-adaptive with `largest` as the biggest tree a step may use."""
    static = eagle3(draft_model_path, largest)
    return ServerConfig(f"adaptive (<={largest})", static.server_args + ("--speculative-adaptive",))


def custom(spec: str) -> ServerConfig:
    """--config "NAME=FLAGS": any other configuration, e.g. "adaptive=--speculative-algorithm EAGLE3 ..."."""
    name, sep, flags = spec.partition("=")
    if not sep or not name.strip():
        raise ValueError(f'--config takes "NAME=SERVER FLAGS", not {spec!r}')
    return ServerConfig(name.strip(), tuple(shlex.split(flags)))


def build_configs(draft_model_path: str | None, trees: Sequence[EagleTree],
                  extra: Sequence[str] = (), adaptive_trees: Sequence[EagleTree] = (),
                  default_model: bool = False) -> list[ServerConfig]:
    """plain first (the ratios' baseline), then one EAGLE-3 server per tree, one adaptive
    server per largest tree, then --config ones. Without a draft path the servers use the
    head shipped for the default model, so that needs `default_model`."""
    if (trees or adaptive_trees) and not draft_model_path and not default_model:
        raise ValueError("EAGLE-3 settings need --speculative-draft-model-path "
                         "(only the default model has a head shipped with eaglesrv)")
    configs = [plain()]
    configs += [eagle3(draft_model_path, tree) for tree in trees]
    configs += [adaptive(draft_model_path, tree) for tree in adaptive_trees]
    configs += [custom(spec) for spec in extra]
    names = [c.name for c in configs]
    if len(set(names)) != len(names):
        raise ValueError(f"configuration names must differ: {names}")
    return configs
