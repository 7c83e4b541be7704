"""Reading part of each checkpoint tensor (a tensor-parallel shard): safetensors, .bin and GGUF."""

from __future__ import annotations

import re

import numpy as np
import pytest
import torch
from test_loader import TINY, tiny_model, write_tiny_gguf

from eaglesrv.engine.loader import ModelLoadError, ModelSource, SliceChooser, TensorSlice, resolve_model

# Q8_0 packs 32 values a block; every 2-D weight of the tiny model has 64 or 128 columns.
Q8_BLOCK = 32


def half(rank: int, size: int, dim: int) -> TensorSlice:
    return dim, rank * size // 2, size // 2


def rows_half(name: str, shape: tuple[int, ...]) -> TensorSlice:
    """Rank 1 of 2 along dim 0: whole heads of q/k (2 of 4 q heads, 1 of 2 kv heads), half of a norm."""
    return half(1, shape[0], 0)


def cols_aligned(name: str, shape: tuple[int, ...]) -> TensorSlice:
    """Rank 1 of 2 along dim 1 (a multiple of the Q8_0 block); 1-D tensors whole."""
    return half(1, shape[1], 1) if len(shape) == 2 else None


def cols_unaligned(name: str, shape: tuple[int, ...]) -> TensorSlice:
    """Columns that cut through quant blocks; norms sliced at odd offsets too (q/k biases hold whole heads)."""
    if len(shape) == 2:
        return 1, 5, 40
    return None if "_proj" in name else (0, 3, 7)


def mixed(name: str, shape: tuple[int, ...]) -> TensorSlice:
    """None, rows or columns, depending on the tensor: a chooser need not treat them alike."""
    if "layers.0." in name or "norm" in name:
        return None
    if "q_proj" in name or "k_proj" in name or "gate_proj" in name or len(shape) == 1:
        return half(0, shape[0], 0)
    return 1, Q8_BLOCK, Q8_BLOCK


CHOOSERS = [rows_half, cols_aligned, cols_unaligned, mixed]


def sliced(tensor: torch.Tensor, chosen: TensorSlice) -> torch.Tensor:
    return tensor if chosen is None else tensor.narrow(*chosen)


def assert_slices_match(source: ModelSource, choose: SliceChooser) -> None:
    """Every tensor read with `choose` is the whole tensor (read with no chooser) sliced alike."""
    whole = dict(source.iter_weights())
    calls: list[tuple[str, tuple[int, ...]]] = []

    def recording(name: str, shape: tuple[int, ...]) -> TensorSlice:
        calls.append((name, shape))
        return choose(name, shape)

    got = dict(source.iter_weights(recording))
    assert sorted(calls) == sorted((name, tuple(t.shape)) for name, t in whole.items())  # once each, HF shapes
    assert set(got) == set(whole)
    for name, tensor in got.items():
        expected = sliced(whole[name], choose(name, tuple(whole[name].shape)))
        assert tensor.dtype == expected.dtype and tensor.is_contiguous(), name
        assert torch.equal(tensor, expected), name


def assert_bad_slices_raise(source: ModelSource, name: str, shape: tuple[int, ...]) -> None:
    for bad in [(len(shape), 0, 1), (-1, 0, 1), (0, -1, 2), (0, 0, 0), (0, shape[0] - 1, 2), (0, 1)]:
        with pytest.raises(ModelLoadError, match=re.escape(name)):
            list(source.iter_weights(lambda n, s, bad=bad: bad if n == name else None))


# --- Hugging Face directories -------------------------------------------------------------


@pytest.fixture(scope="module")
def safetensors_source(tmp_path_factory: pytest.TempPathFactory) -> ModelSource:
    directory = tmp_path_factory.mktemp("st")
    tiny_model().to(torch.bfloat16).save_pretrained(directory, safe_serialization=True, max_shard_size="40KB")
    return resolve_model(str(directory))


@pytest.fixture(scope="module")
def bin_source(tmp_path_factory: pytest.TempPathFactory) -> ModelSource:
    directory = tmp_path_factory.mktemp("bin")
    model = tiny_model()
    model.config.save_pretrained(directory)
    torch.save(model.state_dict(), directory / "pytorch_model.bin")
    return resolve_model(str(directory), load_format="pt")


@pytest.mark.parametrize("choose", CHOOSERS)
@pytest.mark.parametrize("fmt", ["safetensors", "bin"])
def test_hf_dir_slices(request: pytest.FixtureRequest, fmt: str, choose: SliceChooser) -> None:
    source = request.getfixturevalue(f"{fmt}_source")
    assert_slices_match(source, choose)
    for name, tensor in source.iter_weights(cols_aligned):
        if len(tensor.shape) == 2:  # a copy of the slice alone, not a view pinning the file's mapping
            assert tensor.untyped_storage().nbytes() == tensor.numel() * tensor.element_size(), name


@pytest.mark.parametrize("fmt", ["safetensors", "bin"])
def test_hf_dir_bad_slice_names_the_tensor(request: pytest.FixtureRequest, fmt: str) -> None:
    source = request.getfixturevalue(f"{fmt}_source")
    assert_bad_slices_raise(source, "model.layers.1.mlp.up_proj.weight", (128, 64))


# --- GGUF: F32 and Q8_0, with llama.cpp's q/k row permutation -----------------------------


@pytest.fixture(scope="module", params=["F32", "Q8_0"])
def gguf_source(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> ModelSource:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    # With biases, so that the permuted q/k biases (1-D) are sliced and un-permuted too.
    model = LlamaForCausalLM(LlamaConfig(**TINY, attention_bias=True)).eval()
    path = tmp_path_factory.mktemp("gguf") / f"tiny-{request.param}.gguf"
    write_tiny_gguf(path, model, "llama", q8="weights" if request.param == "Q8_0" else None)
    source = resolve_model(str(path))
    if request.param == "F32":  # the whole tensors are the model's: names, un-permutation and values
        weights = dict(source.iter_weights())
        assert set(weights) == set(model.state_dict())
        assert all(torch.equal(weights[n], t) for n, t in model.state_dict().items())
    return source


@pytest.mark.parametrize("choose", CHOOSERS)
def test_gguf_slices(gguf_source: ModelSource, choose: SliceChooser) -> None:
    assert_slices_match(gguf_source, choose)


def test_gguf_head_slices_are_unpermuted_per_head(gguf_source: ModelSource) -> None:
    """Every head-aligned row range of q/k, weight and bias, equals the un-permuted whole sliced."""
    whole = dict(gguf_source.iter_weights())
    head_dim = TINY["hidden_size"] // TINY["num_attention_heads"]
    for name in ("model.layers.1.self_attn.q_proj.weight", "model.layers.1.self_attn.q_proj.bias",
                 "model.layers.0.self_attn.k_proj.weight", "model.layers.0.self_attn.k_proj.bias"):
        n_heads = whole[name].shape[0] // head_dim
        for start in range(n_heads):
            for length in range(1, n_heads - start + 1):
                chosen = (0, start * head_dim, length * head_dim)
                got = dict(gguf_source.iter_weights(lambda n, s, c=chosen: c if n == name else None))
                assert torch.equal(got[name], whole[name].narrow(*chosen)), (name, chosen)


def test_gguf_reads_only_the_chosen_rows_and_blocks(gguf_source: ModelSource, monkeypatch: pytest.MonkeyPatch) -> None:
    """Row slices and block-aligned column slices are cut from the raw data before dequantizing."""
    import gguf.quants

    name = "model.layers.0.mlp.down_proj.weight"  # [64, 128] in HF order
    quantized = "Q8_0" in gguf_source.description
    raw_per_col = 34 / Q8_BLOCK if quantized else 1  # Q8_0: 34 bytes a block; F32: 1 value
    raw_shapes: list[tuple[int, ...]] = []
    reading = []  # set by the chooser: the next dequantize is of `name`
    dequantize = gguf.quants.dequantize

    def recording_dequantize(data: np.ndarray, qtype):
        if reading:
            raw_shapes.append(data.shape)
            reading.clear()
        return dequantize(data, qtype)

    monkeypatch.setattr(gguf.quants, "dequantize", recording_dequantize)
    # Columns that cut Q8_0 blocks are dequantized whole; F32 has blocks of one value.
    cases = [((0, 16, 32), 32, 128), ((1, 32, 64), 64, 64), ((1, 5, 40), 64, 128 if quantized else 40)]
    for chosen, rows, cols in cases:
        def choose(n: str, shape: tuple[int, ...], chosen=chosen) -> TensorSlice:
            if n == name:
                reading.append(True)
                return chosen
            return None

        raw_shapes.clear()
        got = dict(gguf_source.iter_weights(choose))
        assert raw_shapes == [(rows, int(cols * raw_per_col))], chosen
        assert got[name].shape[chosen[0]] == chosen[2]


def test_gguf_bad_slices(gguf_source: ModelSource) -> None:
    assert_bad_slices_raise(gguf_source, "model.layers.0.mlp.up_proj.weight", (128, 64))
    for name in ("model.layers.0.self_attn.q_proj.weight", "model.layers.0.self_attn.k_proj.bias"):
        for bad in [(0, 8, 16), (0, 0, 24)]:  # not whole heads of 16 rows
            with pytest.raises(ModelLoadError, match=re.escape(name) + ".*head_dim 16"):
                list(gguf_source.iter_weights(lambda n, s, bad=bad: bad if n == name else None))
