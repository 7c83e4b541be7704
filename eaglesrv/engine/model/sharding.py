"""How tensor parallelism splits the Llama-family model, as Megatron does:

    column-parallel  q/k/v by heads, gate/up by intermediate rows: each rank computes its
                     own heads and rows, no communication
    row-parallel     o_proj and down_proj by input columns: each rank's partial output is
                     summed over the ranks (one all-reduce per projection)
    vocab-parallel   embed_tokens and lm_head by vocabulary rows: a lookup outside a rank's
                     rows gives zeros (one all-reduce), and the logits are gathered
    replicated       the norms, and the biases of row-parallel projections (held by rank 0
                     only, zeros elsewhere, so the all-reduce adds them once)

Every rank's attention heads and KV heads are its own, so its KV pages hold only those.
checkpoint_slice() tells the loader which part of each checkpoint tensor a rank reads, so
no rank ever holds a whole weight.
"""

from __future__ import annotations

from dataclasses import replace

from eaglesrv.engine.model.arch import ModelArch, UnsupportedModel
from eaglesrv.engine.parallel.group import TensorParallel

# checkpoint projection -> (dimension split, what is split): see the module docstring
_COLUMN_PARALLEL = {"q_proj": "q", "k_proj": "kv", "v_proj": "kv", "gate_proj": "mlp", "up_proj": "mlp"}
_ROW_PARALLEL = {"o_proj": "q", "down_proj": "mlp"}
_VOCAB_PARALLEL = ("embed_tokens.weight", "lm_head.weight")


def check_divisible(arch: ModelArch, tp_size: int) -> None:
    """Refuse a split that does not divide the model's heads and rows evenly."""
    sizes = {"attention heads": arch.num_heads, "KV heads": arch.num_kv_heads,
             "intermediate size": arch.intermediate_size}
    uneven = [f"{what} {count}" for what, count in sizes.items() if count % tp_size]
    if uneven:
        counts = [arch.num_heads, arch.num_kv_heads, arch.intermediate_size]
        fits = [n for n in range(1, arch.num_heads + 1) if all(c % n == 0 for c in counts)]
        raise UnsupportedModel(
            f"--tp-size {tp_size} does not divide this model's {', '.join(uneven)}; "
            f"tensor-parallel sizes that do: {', '.join(map(str, fits))}")


def per_rank(arch: ModelArch, tp_size: int) -> ModelArch:
    """The shapes one rank holds: its share of the heads and intermediate rows (the KV
    pool and the attention kernels are sized from this; the vocabulary stays whole)."""
    if tp_size == 1:
        return arch
    check_divisible(arch, tp_size)
    return replace(arch, num_heads=arch.num_heads // tp_size, num_kv_heads=arch.num_kv_heads // tp_size,
                   intermediate_size=arch.intermediate_size // tp_size)


def checkpoint_slice(name: str, shape: tuple[int, ...], arch: ModelArch,
                     tp: TensorParallel) -> tuple[int, int, int] | None:
    """(dim, start, length) of checkpoint tensor `name` (Hugging Face names and shapes)
    that this rank holds, or None for all of it."""
    if tp.size == 1:
        return None
    if vocab_parallel(name):
        start, length, _ = tp.vocab_part(shape[0])
        return 0, start, length
    projection, kind = name.split(".")[-2], name.split(".")[-1]
    if projection in _COLUMN_PARALLEL:
        start, length = tp.part(shape[0])
        return 0, start, length
    if projection in _ROW_PARALLEL and kind == "weight":
        start, length = tp.part(shape[1])
        return 1, start, length
    return None  # norms; row-parallel biases (rank 0 keeps them, see LlamaForCausalLM.load_weights)


def vocab_parallel(name: str) -> bool:
    """Split by vocabulary rows: the embedding and the output layer (checkpoint or parameter name)."""
    return name.endswith(_VOCAB_PARALLEL)


def held_by_leader_only(name: str) -> bool:
    """A replicated bias added after an all-reduce: only rank 0 adds it."""
    projection, kind = name.split(".")[-2], name.split(".")[-1]
    return projection in _ROW_PARALLEL and kind == "bias"
