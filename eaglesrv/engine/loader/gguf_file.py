"""GGUF files (llama.cpp's format): rebuild an HF config, dequantize, rename and un-permute.

GGUF stores tensor shapes in ggml order (fastest axis first), so a [576, 49152] GGUF tensor
is a [49152, 576] HF tensor. llama.cpp's converter also reorders the rows of q/k projections
of llama-arch models for its interleaved rotary embedding; HF rotates split halves, so we
undo that (see unpermute_rotary).
"""

from __future__ import annotations

import logging
import re
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch

from .errors import ModelLoadError
from .source import ModelSource, SliceChooser, TensorSlice, WeightStream, choose_slice

logger = logging.getLogger(__name__)

# general.architecture -> (HF model_type, HF architecture class, q/k rows permuted by llama.cpp?)
# qwen2/qwen3 use NEOX-style rope in llama.cpp, which is HF's layout, so no permutation.
ARCHITECTURES = {
    "llama": ("llama", "LlamaForCausalLM", True),
    "qwen2": ("qwen2", "Qwen2ForCausalLM", False),
    "qwen3": ("qwen3", "Qwen3ForCausalLM", False),
}

_TOP_LEVEL = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_PER_LAYER = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}
_BLOCK_NAME = re.compile(r"^blk\.(\d+)\.(\w+)\.(weight|bias)$")
# Tensors llama.cpp computes from the config (llama-3 rope factors); HF recomputes them.
_SKIPPED = {"rope_freqs.weight"}


def hf_tensor_name(gguf_name: str) -> str | None:
    """HF parameter name for a GGUF tensor name, or None when it has no HF counterpart."""
    if gguf_name in _SKIPPED:
        return None
    match = _BLOCK_NAME.match(gguf_name)
    if match and match.group(2) in _PER_LAYER:
        layer, part, kind = match.groups()
        return f"model.layers.{layer}.{_PER_LAYER[part]}.{kind}"
    base, _, kind = gguf_name.rpartition(".")
    if base in _TOP_LEVEL and kind in ("weight", "bias"):
        return f"{_TOP_LEVEL[base]}.{kind}"
    raise ModelLoadError(f"GGUF tensor '{gguf_name}' has no Hugging Face equivalent that eaglesrv knows")


def unpermute_rotary(rows: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Undo llama.cpp's q/k row order, per head: [r0, r(d/2), r1, r(d/2+1), ...] -> [r0..r(d/2-1), r(d/2)..].

    llama.cpp views each head's d rows as [2, d/2] and transposes to [d/2, 2] so that the two
    halves HF rotates together become adjacent pairs. Viewing as [d/2, 2] and transposing back
    restores HF's order. Works for weights [rows, cols] and biases [rows].
    """
    head_dim = rows.shape[0] // n_heads
    shaped = rows.reshape(n_heads, head_dim // 2, 2, *rows.shape[1:])
    return shaped.transpose(1, 2).reshape(rows.shape).contiguous()


def open_reader(path: Path) -> Any:
    import gguf

    try:
        return gguf.GGUFReader(str(path))
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"cannot read GGUF file {path}: {exc}") from exc


def metadata(reader: Any) -> dict[str, Any]:
    """Every scalar and string field; arrays (token lists, merges) are left out, they are large."""
    out: dict[str, Any] = {}
    for name, field in reader.fields.items():
        if len(field.types) == 1:
            out[name] = field.contents()
    return out


def gguf_config(reader: Any, path: Path) -> dict[str, Any]:
    """An HF config.json dict for the model described by the GGUF metadata."""
    meta = metadata(reader)
    arch = meta.get("general.architecture")
    if arch not in ARCHITECTURES:
        raise ModelLoadError(
            f"GGUF architecture '{arch}' in {path} is not supported (supported: {', '.join(ARCHITECTURES)})"
        )
    model_type, hf_arch, _ = ARCHITECTURES[arch]

    def need(key: str) -> Any:
        if f"{arch}.{key}" not in meta:
            raise ModelLoadError(f"GGUF file {path} lacks metadata key {arch}.{key}")
        return meta[f"{arch}.{key}"]

    hidden, heads = int(need("embedding_length")), int(need("attention.head_count"))
    tensor_names = {t.name for t in reader.tensors}
    vocab = meta.get(f"{arch}.vocab_size")
    if vocab is None and "tokenizer.ggml.tokens" in reader.fields:
        vocab = len(reader.fields["tokenizer.ggml.tokens"].data)
    if vocab is None:
        vocab = int(next(t.shape[1] for t in reader.tensors if t.name == "token_embd.weight"))
    head_dim = meta.get(f"{arch}.attention.key_length") or meta.get(f"{arch}.rope.dimension_count")
    config: dict[str, Any] = {
        "architectures": [hf_arch],
        "model_type": model_type,
        "hidden_size": hidden,
        "intermediate_size": int(need("feed_forward_length")),
        "num_hidden_layers": int(need("block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(meta.get(f"{arch}.attention.head_count_kv", heads)),
        "head_dim": int(head_dim or hidden // heads),
        "rms_norm_eps": float(need("attention.layer_norm_rms_epsilon")),
        "rope_theta": float(meta.get(f"{arch}.rope.freq_base", 10000.0)),
        "max_position_embeddings": int(meta.get(f"{arch}.context_length", 2048)),
        "vocab_size": int(vocab),
        "hidden_act": "silu",
        "tie_word_embeddings": "output.weight" not in tensor_names,
        "attention_bias": "blk.0.attn_q.bias" in tensor_names,
        "mlp_bias": False,
        # Weights are yielded dequantized to float32; "dtype" is the transformers 5 spelling.
        "torch_dtype": "float32",
        "dtype": "float32",
    }
    for gguf_key, hf_key in (("bos", "bos"), ("eos", "eos"), ("padding", "pad")):
        if f"tokenizer.ggml.{gguf_key}_token_id" in meta:
            config[f"{hf_key}_token_id"] = int(meta[f"tokenizer.ggml.{gguf_key}_token_id"])
    # transformers 5 writes rope settings as rope_parameters; older files use rope_theta.
    config["rope_parameters"] = {"rope_theta": config["rope_theta"], "rope_type": "default"}
    scaling = meta.get(f"{arch}.rope.scaling.type")
    if scaling and scaling != "none":
        config["rope_scaling"] = {
            "rope_type": scaling,
            "factor": float(meta.get(f"{arch}.rope.scaling.factor", 1.0)),
            "original_max_position_embeddings": int(
                meta.get(f"{arch}.rope.scaling.original_context_length", config["max_position_embeddings"])
            ),
        }
        config["rope_parameters"].update(config["rope_scaling"])
    if "rope_freqs.weight" in tensor_names:
        logger.warning("%s has llama-3 rope factors (rope_freqs.weight) that are ignored", path)
    return config


def read_values(tensor: Any, shape: tuple[int, ...], chosen: TensorSlice) -> np.ndarray:
    """The float32 values of a GGUF tensor in its HF shape, or of the `chosen` slice of them.

    tensor.data is a view of the memory-mapped file in HF axis order whose last axis counts
    raw units (bytes for quantized types), so slicing it before dequantizing reads only
    the rows (or whole blocks of columns) that are wanted.
    """
    from gguf.constants import GGML_QUANT_SIZES
    from gguf.quants import dequantize

    # cut_after: the slice still to take after dequantizing (None once the raw data was cut).
    data, out_shape, cut_after = tensor.data, list(shape), chosen
    if chosen is not None:
        dim, start, length = chosen
        block = GGML_QUANT_SIZES[tensor.tensor_type][0]
        if dim == 0 and len(shape) > 1:  # whole rows
            data, cut_after = data[start:start + length], None
        elif dim == len(shape) - 1 and start % block == 0 and length % block == 0:
            per_block = data.shape[-1] // (shape[-1] // block)  # raw units per quant block
            data, cut_after = data[..., start // block * per_block:(start + length) // block * per_block], None
        # Otherwise (columns that cut through quant blocks, or a middle axis) dequantize it all, then slice.
        if cut_after is None:
            out_shape[dim] = length
    try:
        values = dequantize(np.ascontiguousarray(data), tensor.tensor_type)
    except NotImplementedError as exc:
        raise ModelLoadError(f"cannot dequantize {tensor.name} ({tensor.tensor_type.name}): {exc}") from exc
    values = values.reshape(out_shape)
    if cut_after is not None:
        dim, start, length = cut_after
        values = values[(slice(None),) * dim + (slice(start, start + length),)]
    # F32 values are read-only views of the memory-mapped file, and a column slice is not contiguous.
    if not (values.flags.writeable and values.flags.c_contiguous):
        values = np.array(values, order="C")
    return values.astype(np.float32, copy=False)


def iter_gguf_weights(
    reader: Any, config: dict[str, Any], permuted: bool, choose: SliceChooser | None = None
) -> WeightStream:
    """Yield (HF name, float32 tensor) for every GGUF tensor, or the slice `choose` picks, one at a time."""
    heads = {"q_proj": config["num_attention_heads"], "k_proj": config["num_key_value_heads"]}
    for tensor in reader.tensors:
        name = hf_tensor_name(tensor.name)
        if name is None:
            continue
        shape = tuple(int(d) for d in reversed(tensor.shape))
        chosen = choose_slice(choose, name, shape)
        n_heads = heads.get(name.split(".")[-2]) if permuted else None
        if n_heads and chosen is not None and chosen[0] == 0:
            # The permutation is per head, so a row slice must hold whole heads to be undone.
            head_dim = shape[0] // n_heads
            _, start, length = chosen
            if start % head_dim or length % head_dim:
                raise ModelLoadError(
                    f"slice {chosen} of tensor {name}: rows must be whole heads (multiples of head_dim {head_dim})"
                )
            n_heads = length // head_dim
        weight = torch.from_numpy(read_values(tensor, shape, chosen))
        if n_heads:
            weight = unpermute_rotary(weight, n_heads)
        yield name, weight


# llama.cpp's `tokenizer.ggml.pre` values whose pre-tokenization isolates every digit
# before the GPT-2 byte-level split (llama.cpp gives all of them the same two regexes,
# `\p{N}` then GPT-2's; SmolLM's tokenizer.json says the same: Digits(individual_digits)
# then ByteLevel). transformers' GGUF conversion keeps only the byte-level split, which
# cuts whitespace before a digit differently: ":\n\n1." becomes ":", "\n", "\n", "1", "."
# where the original tokenizer, and the model's own replies, have ":", "\n\n", "1", ".".
DIGITS_FIRST_PRE_TOKENIZERS = frozenset(
    {"smollm", "starcoder", "refact", "command-r", "codeshell", "exaone", "minerva-7b"})


def gguf_tokenizer_loader(path: Path, reader: Any | None = None) -> Callable[[], Any]:
    """A deferred tokenizer built by transformers from the GGUF vocab, fixed up from the file."""
    path = Path(path)
    reader = reader if reader is not None else open_reader(path)
    meta = metadata(reader)
    template = meta.get("tokenizer.chat_template")
    eos_id = meta.get("tokenizer.ggml.eos_token_id")
    digits_first = meta.get("tokenizer.ggml.pre") in DIGITS_FIRST_PRE_TOKENIZERS

    def load() -> Any:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
        # Older transformers drop the embedded chat template; the file is the authority.
        if template and not getattr(tokenizer, "chat_template", None):
            tokenizer.chat_template = template
        if eos_id is not None and tokenizer.eos_token_id != int(eos_id):
            tokenizer.eos_token = tokenizer.convert_ids_to_tokens(int(eos_id))
        if digits_first:
            split_digits_first(tokenizer)
        return tokenizer

    return load


def split_digits_first(tokenizer: Any) -> None:
    """Put the individual-digit split in front of the tokenizer's pre-tokenizer (once)."""
    from tokenizers import pre_tokenizers

    backend = tokenizer.backend_tokenizer
    if "Digits(" in str(backend.pre_tokenizer):
        return  # a transformers that converts it already
    backend.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True),
                                                     backend.pre_tokenizer])


def load_gguf(path: Path, load_format: str) -> ModelSource:
    """Resolve a .gguf file: config from metadata, weights dequantized to float32 on demand."""
    reader = open_reader(path)
    config = gguf_config(reader, path)
    permuted = ARCHITECTURES[reader.fields["general.architecture"].contents()][2]
    for tensor in reader.tensors:  # fail now, not halfway through loading, on unknown tensors
        hf_tensor_name(tensor.name)
    iter_weights = None
    if load_format != "dummy":
        iter_weights = lambda choose=None: iter_gguf_weights(reader, config, permuted, choose)  # noqa: E731
    has_vocab = "tokenizer.ggml.tokens" in reader.fields
    generation = {k: config[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id") if k in config}
    return ModelSource(
        hf_config=config,
        iter_weights=iter_weights,
        load_tokenizer=gguf_tokenizer_loader(path, reader) if has_vocab else None,
        generation_config=generation,
        description=f"GGUF {path}",
    )
