"""EAGLE-3 heads rewritten in the on-disk layouts that published heads use, from one head's
weights: the EAGLE repo's (pytorch_model.bin in fp16, its config keys, no layer ids) and
SpecForge's (model.safetensors in bf16, with or without embed_tokens, layer ids in
eagle_config or at the top level, fc_norm). All of them declare max_position_embeddings
2,048 unless told otherwise, as the published Llama-3.1 heads do."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from eaglesrv.engine.eagle3.draft_model import AUX_IDS_KEY

LAYOUTS = ("eagle_bin_fp16", "specforge_embed_bf16", "specforge_top_level_ids", "specforge_fc_norm")


def write_layout(head_dir: str, layout: str, out_dir: Path, embedding: torch.Tensor,
                 aux_layer_ids: list[int] | None = None, declared_positions: int = 2048) -> str:
    """`head_dir` (our own published-format head) rewritten as `layout` in `out_dir`;
    `embedding` is the target's, stored in the layout that carries embed_tokens."""
    tensors = load_file(f"{head_dir}/model.safetensors")
    source = json.loads(Path(head_dir, "config.json").read_text())
    ids = aux_layer_ids or (source.get("eagle_config") or {}).get(AUX_IDS_KEY)
    config = {key: value for key, value in source.items() if key != "eagle_config"}
    config["max_position_embeddings"] = declared_positions
    out_dir.mkdir(parents=True, exist_ok=True)
    if layout == "eagle_bin_fp16":
        # The EAGLE repo's config has no target_hidden_size when it equals hidden_size, and
        # no layer ids: such heads use SGLang's default layers.
        if config.get("target_hidden_size") == config["hidden_size"]:
            del config["target_hidden_size"]
        config["torch_dtype"] = "float16"
        weights = {name: t.half() if t.is_floating_point() else t for name, t in tensors.items()}
        weights.pop("embed_tokens.weight", None)
        torch.save(weights, out_dir / "pytorch_model.bin")
    else:
        config["torch_dtype"] = "bfloat16"
        weights = {name: t.bfloat16() if t.is_floating_point() else t for name, t in tensors.items()}
        if layout == "specforge_embed_bf16":
            config["eagle_config"] = {AUX_IDS_KEY: ids, "use_aux_hidden_state": True}
        else:
            config[AUX_IDS_KEY] = ids
        weights.pop("embed_tokens.weight", None)
        if layout == "specforge_embed_bf16":
            weights["embed_tokens.weight"] = embedding.bfloat16()
        if layout == "specforge_fc_norm":
            config["fc_norm"] = True
            width = weights["fc.weight"].shape[1] // 3
            generator = torch.Generator().manual_seed(3)
            for i in range(3):  # trained norms are not all ones; these scale each feature differently
                weights[f"fc_norm.{i}.weight"] = (0.5 + torch.rand(width, generator=generator)).bfloat16()
        save_file({name: t.contiguous() for name, t in weights.items()}, str(out_dir / "model.safetensors"))
    (out_dir / "config.json").write_text(json.dumps(config, indent=2))
    return str(out_dir)
