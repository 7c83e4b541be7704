"""Flags become validated, frozen configs; bad values are refused with the flag's name."""

from __future__ import annotations

import dataclasses

import pytest

from eaglesrv.configs import EngineConfig, ModelConfig, SchedulerConfig
from eaglesrv.configs.cli import ENGINE_FLAGS, GROUPS, parse_engine_config
from eaglesrv.configs.errors import ConfigError
from eaglesrv.engine.model.arch import ModelArch, UnsupportedModel


def test_sglang_flag_names_parse_into_their_groups():
    config = parse_engine_config([
        "--model", "meta-llama/Llama-3.1-8B-Instruct", "--speculative-algorithm", "EAGLE3",
        "--speculative-num-steps", "5", "--speculative-eagle-topk", "8", "--speculative-num-draft-tokens", "32",
        "--mem-fraction", "0.6", "--cuda-graph-max-bs", "2", "--dtype", "float16", "--chunked-prefill-size", "-1",
    ])
    assert config.model.model_path == "meta-llama/Llama-3.1-8B-Instruct" and config.model.dtype == "float16"
    assert config.cache.mem_fraction_static == 0.6
    assert (config.speculative.algorithm, config.speculative.num_steps, config.speculative.eagle_topk,
            config.speculative.num_draft_tokens) == ("EAGLE3", 5, 8, 32)
    assert config.runtime.cuda_graph_max_bs == 2 and config.scheduler.token_budget is None


def test_defaults_equal_the_dataclass_defaults():
    assert parse_engine_config([]) == EngineConfig()


def test_every_flag_has_help_and_a_real_field():
    for flag in ENGINE_FLAGS:
        assert flag.help
        assert flag.field in {f.name for f in dataclasses.fields(GROUPS[flag.group])}


@pytest.mark.parametrize(
    "argv,message",
    [
        (["--page-size", "0"], "--page-size"),
        (["--max-running-requests", "0"], "--max-running-requests"),
        (["--chunked-prefill-size", "0"], "--chunked-prefill-size"),
        (["--mem-fraction-static", "1.5"], "--mem-fraction-static"),
        (["--speculative-algorithm", "MEDUSA"], "--speculative-algorithm"),
        (["--speculative-num-draft-tokens", "1"], "--speculative-num-draft-tokens"),
        (["--context-length", "1"], "--context-length"),
    ],
)
def test_bad_values_name_the_flag(argv, message):
    with pytest.raises(ConfigError, match=message):
        parse_engine_config(argv)


@pytest.mark.parametrize("argv", [["--dtype", "float64"], ["--schedule-policy", "lof"]])
def test_argparse_refuses_unknown_choices(argv):
    with pytest.raises(SystemExit):
        parse_engine_config(argv)


def test_schedule_policy():
    assert parse_engine_config([]).scheduler.schedule_policy == "fcfs"
    assert parse_engine_config(["--schedule-policy", "lpm"]).scheduler.schedule_policy == "lpm"
    with pytest.raises(ConfigError, match="--schedule-policy"):
        SchedulerConfig(schedule_policy="random")


def test_configs_are_frozen():
    with pytest.raises(dataclasses.FrozenInstanceError):
        ModelConfig().dtype = "float16"


def test_arch_reads_both_rope_spellings_and_refuses_unknown_models():
    base = dict(vocab_size=10, hidden_size=8, intermediate_size=16, num_hidden_layers=1, num_attention_heads=2)
    old = ModelArch.from_hf_config({**base, "rope_theta": 5e5, "rope_scaling": {"type": "linear", "factor": 2.0}})
    new = ModelArch.from_hf_config(
        {**base, "rope_parameters": {"rope_type": "linear", "factor": 2.0, "rope_theta": 5e5}})
    assert (old.rope_theta == new.rope_theta == 5e5
            and old.rope_scaling["rope_type"] == new.rope_scaling["rope_type"] == "linear")
    with pytest.raises(UnsupportedModel, match="GPT2LMHeadModel"):
        ModelArch.from_hf_config({**base, "architectures": ["GPT2LMHeadModel"]})
    with pytest.raises(UnsupportedModel, match="yarn"):
        ModelArch.from_hf_config({**base, "rope_scaling": {"rope_type": "yarn", "factor": 4.0}})


def test_adaptive_speculation_is_the_default_and_a_flag_pins_the_static_tree():
    assert parse_engine_config(["--speculative-algorithm", "EAGLE3"]).speculative.adaptive is True
    assert parse_engine_config(["--speculative-adaptive"]).speculative.adaptive is True  # accepted, as before
    assert parse_engine_config(["--disable-speculative-adaptive"]).speculative.adaptive is False


def test_dtype_auto_on_the_cpu_follows_its_bf16_units(monkeypatch):
    import torch

    from eaglesrv.engine import placement

    auto, cpu = ModelConfig(dtype="auto"), torch.device("cpu")
    monkeypatch.setattr(placement, "cpu_has_native_bf16", lambda: True)
    assert placement.resolve_dtype(auto, {}, cpu) == torch.bfloat16
    monkeypatch.setattr(placement, "cpu_has_native_bf16", lambda: False)
    assert placement.resolve_dtype(auto, {}, cpu) == torch.float32
    assert placement.resolve_dtype(ModelConfig(dtype="bfloat16"), {}, cpu) == torch.bfloat16  # given: kept
