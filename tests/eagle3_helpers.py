"""Helpers for EAGLE-3 tests: random heads on disk, an oracle draft, spec engine configs."""

from __future__ import annotations

import dataclasses

import torch
from conftest import engine_config

from eaglesrv.configs import EngineConfig, SpeculativeConfig
from eaglesrv.engine.eagle3.head_io import head_config_for, load_draft_head, save_head
from eaglesrv.engine.llm_engine import Engine
from eaglesrv.engine.loader import resolve_model
from eaglesrv.engine.model.arch import ModelArch


def save_random_head(target_dir: str, head_dir, seed: int = 0, draft_vocab_size: int | None = None) -> str:
    """A random EAGLE-3 head for the model in target_dir, written in the published format."""
    source = resolve_model(target_dir)
    arch = ModelArch.from_hf_config(source.hf_config)
    embedding = dict(source.iter_weights())["model.embed_tokens.weight"]
    head = load_draft_head(None, arch, embedding, torch.float32, torch.device("cpu"), random_seed=seed)
    config = head_config_for(arch, draft_vocab_size)
    if draft_vocab_size is not None:  # a reduced vocabulary: the head's first rows, most frequent ids
        from eaglesrv.engine.eagle3.draft_model import Eagle3Config, Eagle3DraftModel

        small = Eagle3DraftModel(Eagle3Config.from_hf_config(config))
        state = {k: v[:draft_vocab_size] if k == "lm_head.weight" else v for k, v in head.state_dict().items()}
        small.load_state_dict(state, strict=False)
        small._set_vocab_map(torch.arange(draft_vocab_size) * 0 + torch.arange(draft_vocab_size) % 7)
        head = small
    save_head(head, config, head_dir)
    return str(head_dir)


def spec_config(model_dir: str, head_dir: str | None, steps: int, topk: int, draft_tokens: int,
                adaptive: bool = False, **kwargs) -> EngineConfig:
    """EAGLE-3 with this tree at every step (static), or as the largest an adaptive step may use."""
    config = engine_config(model_dir, **kwargs)
    spec = SpeculativeConfig(
        algorithm="EAGLE3", draft_model_path=head_dir, num_steps=steps, eagle_topk=topk, num_draft_tokens=draft_tokens,
        adaptive=adaptive,
    )
    return dataclasses.replace(config, speculative=spec)


class OracleDraft(torch.nn.Module):
    """Predicts exactly what the greedy target will say, for one known token sequence.

    Draft position i reads token i + 1 and predicts token i + 2 of `sequence`.
    """

    def __init__(self, real_draft, sequence: list[int]) -> None:
        super().__init__()
        self.config = real_draft.config
        self.draft_to_target = torch.arange(real_draft.config.draft_vocab_size)
        self.sequence = sequence
        self.hidden_size = real_draft.config.arch.hidden_size

    def forward(self, input_ids, features, positions, ctx, logit_rows=None):
        vocab = self.config.draft_vocab_size
        logits = torch.full((len(input_ids), vocab), -30.0)
        for row, position in enumerate(positions.tolist()):
            if position + 2 < len(self.sequence):
                logits[row, self.sequence[position + 2]] = 30.0
        return logits if logit_rows is None else logits[logit_rows], torch.zeros(len(input_ids), self.hidden_size)


def use_oracle(engine: Engine, sequence: list[int]) -> None:
    engine.runner.draft = OracleDraft(engine.runner.draft, sequence)
