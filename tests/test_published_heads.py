"""Heads in the published layouts, on a tiny target: they load, speculate exactly, and run at
positions past the max_position_embeddings they declare; bad layer ids are refused at load.
The same layouts on the default model with the shipped head's weights, and a long prompt
through the server, are in test_published_heads_e2e.py."""

from __future__ import annotations

import dataclasses
import json
import logging
from pathlib import Path

import pytest
import torch
from conftest import engine_config, save_tiny_llama
from eagle3_helpers import save_random_head, spec_config
from engine_helpers import assert_pages_returned, random_prompts
from published_heads import LAYOUTS, write_layout

from eaglesrv.engine.eagle3.draft_model import DraftHeadError, Eagle3Config, Eagle3DraftModel
from eaglesrv.engine.llm_engine import Engine
from eaglesrv.engine.model.rope import RotaryEmbedding
from eaglesrv.sampling_params import SamplingParams

DECLARED = 64  # the head's max_position_embeddings; the target has 512
IDS = [1, 2, 3]  # layer outputs of the 7-layer target: SGLang's default layers for it, (2, 3, 4)
GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
PROMPTS = random_prompts((9, 300, 40), 256, seed=11)  # 300 + 24 positions run far past 64


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory):
    return save_tiny_llama(tmp_path_factory.mktemp("tiny5"), num_hidden_layers=7)


@pytest.fixture(scope="module")
def source_head(target_dir, tmp_path_factory):
    return save_random_head(target_dir, tmp_path_factory.mktemp("source-head"))


@pytest.fixture(scope="module")
def embedding(target_dir):
    from safetensors.torch import load_file

    return load_file(f"{target_dir}/model.safetensors")["model.embed_tokens.weight"]


@pytest.fixture(scope="module")
def plain_outputs(target_dir):
    return [r.output_token_ids for r in Engine(engine_config(target_dir)).generate(PROMPTS, GREEDY)]


@pytest.fixture(autouse=True)
def private_cost_cache(tmp_path_factory, monkeypatch):
    monkeypatch.setenv("EAGLESRV_CACHE", str(tmp_path_factory.getbasetemp() / "eaglesrv-cache"))


def layout_dir(source_head, embedding, tmp_path, layout, **kwargs) -> str:
    ids = None if layout == "eagle_bin_fp16" else IDS
    return write_layout(source_head, layout, tmp_path / layout, embedding, ids, DECLARED, **kwargs)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_each_layout_speculates_exactly_past_its_declared_positions(target_dir, source_head, embedding,
                                                                    plain_outputs, tmp_path, layout, caplog):
    head = layout_dir(source_head, embedding, tmp_path, layout)
    with caplog.at_level(logging.INFO, logger="eaglesrv.engine.eagle3.head_io"):
        engine = Engine(spec_config(target_dir, head, 3, 2, 6))
    assert f"declares max_position_embeddings {DECLARED}; using the target's 512" in caplog.text
    assert engine.runner.capture_layers == tuple(i + 1 for i in IDS)
    assert engine.max_context_len == 512 and engine.runner.draft.rotary_emb.cos.shape[0] == 512
    assert [r.output_token_ids for r in engine.generate(PROMPTS, GREEDY)] == plain_outputs
    assert engine.spec_stats["spec_verifications"] > 0
    assert_pages_returned(engine)


def test_adaptive_engine_serves_past_the_declared_positions(target_dir, source_head, embedding, plain_outputs,
                                                            tmp_path):
    head = layout_dir(source_head, embedding, tmp_path, "specforge_top_level_ids")
    config = spec_config(target_dir, head, 3, 2, 6)
    engine = Engine(dataclasses.replace(config, speculative=dataclasses.replace(config.speculative, adaptive=True)))
    assert [r.output_token_ids for r in engine.generate(PROMPTS, GREEDY)] == plain_outputs


def test_the_longer_table_agrees_below_the_declared_length():
    """Drafting below the declared length is exactly as before: the same angles."""
    long, short = (RotaryEmbedding(16, n, 10000.0, None) for n in (512, DECLARED))
    assert torch.equal(long.cos[:DECLARED], short.cos) and torch.equal(long.sin[:DECLARED], short.sin)


def test_layer_ids_from_either_place_and_conflicts_refused(source_head):
    config = json.loads(Path(source_head, "config.json").read_text())
    nested = Eagle3Config.from_hf_config({**config, "eagle_config": {"eagle_aux_hidden_state_layer_ids": IDS}})
    top = Eagle3Config.from_hf_config({**config, "eagle_aux_hidden_state_layer_ids": IDS})
    both = Eagle3Config.from_hf_config({**config, "eagle_aux_hidden_state_layer_ids": IDS,
                                        "eagle_config": {"eagle_aux_hidden_state_layer_ids": IDS}})
    assert nested.capture_layers(7) == top.capture_layers(7) == both.capture_layers(7) == (2, 3, 4)
    with pytest.raises(DraftHeadError, match=r"\[1, 2, 3\] in eagle_config and \[0, 1, 3\] at the top level"):
        Eagle3Config.from_hf_config({**config, "eagle_aux_hidden_state_layer_ids": [0, 1, 3],
                                     "eagle_config": {"eagle_aux_hidden_state_layer_ids": IDS}})


def test_layer_ids_outside_the_target_are_refused_at_load(target_dir, source_head, embedding, tmp_path):
    head = write_layout(source_head, "specforge_top_level_ids", tmp_path / "h", embedding, [1, 39, 77])
    with pytest.raises(DraftHeadError, match=r"layers \[1, 39, 77\].*target has 7 layers: ids must lie in -1\.\.5"):
        Engine(spec_config(target_dir, head, 3, 1, 4))


def test_fc_norm_weights_missing_or_unexpected_are_named(target_dir, source_head, embedding, tmp_path):
    from safetensors.torch import load_file, save_file

    head = layout_dir(source_head, embedding, tmp_path, "specforge_fc_norm")
    config = json.loads(Path(head, "config.json").read_text())
    Path(head, "config.json").write_text(json.dumps({**config, "fc_norm": False}))
    with pytest.raises(DraftHeadError, match=r"unexpected tensor 'fc_norm.0.weight'.*lacks \"fc_norm\": true"):
        Engine(spec_config(target_dir, head, 3, 1, 4))
    Path(head, "config.json").write_text(json.dumps(config))
    tensors = load_file(f"{head}/model.safetensors")
    del tensors["fc_norm.2.weight"]
    save_file(tensors, f"{head}/model.safetensors")
    with pytest.raises(DraftHeadError, match="lacks fc_norm.2.weight"):
        Engine(spec_config(target_dir, head, 3, 1, 4))


def test_fc_norm_and_norm_output_against_a_reference_of_the_published_layer():
    """SpecForge's layer: each of the three target features RMS-normalized with its own
    weight, then fc; with norm_output false the logits skip the final norm."""
    from eaglesrv.engine.model.arch import ModelArch

    arch = ModelArch.from_hf_config(dict(
        vocab_size=50, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=1, rms_norm_eps=1e-5))
    head = Eagle3DraftModel(Eagle3Config(arch, target_hidden_size=24, draft_vocab_size=50, aux_layer_ids=None,
                                         fc_norm=True, norm_output=False))
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for param in head.parameters():
            param.copy_(torch.randn(param.shape, generator=generator))
    features = torch.randn(5, 72, generator=generator) * 3

    def rms_norm(x, weight, eps=1e-5):
        return x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight

    chunks = [rms_norm(features[:, 24 * i: 24 * (i + 1)], head.fc_norm[i].weight) for i in range(3)]
    expected = torch.cat(chunks, dim=-1) @ head.fc.weight.T
    torch.testing.assert_close(head.project_features(features), expected)
    out = torch.randn(5, 16, generator=generator)
    torch.testing.assert_close(head.logits(out), out @ head.lm_head.weight.T)
