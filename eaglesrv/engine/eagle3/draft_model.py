"""The EAGLE-3 draft head, in the checkpoint format published for SGLang, vLLM and SpecForge.

One decoder layer that reads the target's features instead of only tokens:

    features  = fc([h_low; h_mid; h_high])             3 x target hidden -> H  (first step;
                                                        SpecForge's fc_norm heads RMS-normalize
                                                        each of the three first)
              | previous draft output (pre-norm)        H                       (later steps)
    x         = [input_layernorm(embed(token)); hidden_norm(features)]   width 2H
    h         = features + o_proj(attention(q/k/v(x)))
    out       = h + mlp(post_attention_layernorm(h))   (pre-norm: fed to the next draft step)
    logits    = lm_head(norm(out))                     over the draft vocabulary (no norm when
                                                        the config says norm_output: false)
    target id = draft id + d2t[draft id]

Checkpoint tensors: fc, midlayer.{input_layernorm, hidden_norm, post_attention_layernorm},
midlayer.self_attn.{q,k,v,o}_proj, midlayer.mlp.{gate,up,down}_proj, norm, lm_head, d2t,
t2d (unused here), optionally embed_tokens (else the target's is used), and fc_norm.{0,1,2}
when the config sets fc_norm (SpecForge's "eagle3.1" heads).

Which target layers feed the draft: eagle_aux_hidden_state_layer_ids, inside eagle_config
(where SGLang reads it) or at the top level (where vLLM does); the ids name layer outputs.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Iterable

import torch
import torch.nn.functional as F
from torch import nn

from eaglesrv.engine.forward_context import ForwardContext
from eaglesrv.engine.model.arch import ModelArch
from eaglesrv.engine.model.llama import MLP, Attention, RMSNorm, fused_target, part_view
from eaglesrv.engine.model.rope import RotaryEmbedding


class DraftHeadError(ValueError):
    """The draft checkpoint is malformed or does not fit the target; the message says what."""


AUX_IDS_KEY = "eagle_aux_hidden_state_layer_ids"


@dataclass(frozen=True)
class Eagle3Config:
    arch: ModelArch  # shape of the draft's single layer (num_layers = 1)
    target_hidden_size: int
    draft_vocab_size: int
    aux_layer_ids: tuple[int, ...] | None  # layer *outputs* named by the checkpoint, or None
    fc_norm: bool = False  # RMSNorm each target layer's features before fc (SpecForge "eagle3.1")
    norm_output: bool = True  # final norm before lm_head (SpecForge lets a head drop it)

    @classmethod
    def from_hf_config(cls, config: dict[str, Any]) -> "Eagle3Config":
        architectures = config.get("architectures") or []
        if architectures and architectures[0] not in ("LlamaForCausalLMEagle3", "LlamaForCausalLM"):
            raise DraftHeadError(f"draft architecture {architectures[0]!r} is not an EAGLE-3 Llama head")
        arch = ModelArch.from_hf_config({**config, "architectures": ["LlamaForCausalLM"], "num_hidden_layers": 1})
        return cls(
            arch=arch,
            target_hidden_size=int(config.get("target_hidden_size") or arch.hidden_size),
            draft_vocab_size=int(config.get("draft_vocab_size") or arch.vocab_size),
            aux_layer_ids=_aux_layer_ids(config),
            fc_norm=bool(config.get("fc_norm", False)),
            norm_output=bool(config.get("norm_output", True)),
        )

    def capture_layers(self, target_num_layers: int) -> tuple[int, ...]:
        """Target layers whose *inputs* feed the draft (SGLang's convention); refuses ids
        the target does not have. The output of layer i is the input of layer i + 1, so an
        id may name layers -1 (the embeddings) .. L - 2 of an L-layer target."""
        if self.aux_layer_ids is None:
            return (2, target_num_layers // 2, target_num_layers - 3)
        outside = [i for i in self.aux_layer_ids if not -1 <= i <= target_num_layers - 2]
        if outside:
            raise DraftHeadError(
                f"the head takes features from target layers {list(self.aux_layer_ids)} ({AUX_IDS_KEY}), but "
                f"the target has {target_num_layers} layers: ids must lie in -1..{target_num_layers - 2}"
            )
        return tuple(i + 1 for i in self.aux_layer_ids)

    def with_max_positions(self, max_positions: int) -> "Eagle3Config":
        return dataclasses.replace(self, arch=dataclasses.replace(self.arch, max_position_embeddings=max_positions))


def _aux_layer_ids(config: dict[str, Any]) -> tuple[int, ...] | None:
    """The ids from eagle_config or the top level; both given and different is refused."""
    nested = (config.get("eagle_config") or {}).get(AUX_IDS_KEY)
    top = config.get(AUX_IDS_KEY)
    if nested and top and list(nested) != list(top):
        raise DraftHeadError(
            f"the head's config gives two different {AUX_IDS_KEY}: {list(nested)} in eagle_config and "
            f"{list(top)} at the top level"
        )
    ids = nested or top
    if not ids:
        return None
    if len(ids) != 3 or not all(isinstance(i, int) for i in ids):
        raise DraftHeadError(f"{AUX_IDS_KEY} must be three layer ids, got {ids!r}")
    return tuple(ids)


class DraftLayer(nn.Module):
    def __init__(self, arch: ModelArch, rope: RotaryEmbedding) -> None:
        super().__init__()
        wide = dataclasses.replace(arch, hidden_size=2 * arch.hidden_size)
        self.input_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)
        self.hidden_norm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)
        self.self_attn = Attention(wide, 0, rope)  # q/k/v read 2H; o_proj writes 2H, fixed below
        self.self_attn.o_proj = nn.Linear(arch.num_heads * arch.head_dim, arch.hidden_size, bias=arch.o_bias)
        self.post_attention_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)
        self.mlp = MLP(arch)

    def forward(self, positions, embeds, features, ctx: ForwardContext) -> torch.Tensor:
        x = torch.cat([self.input_layernorm(embeds), self.hidden_norm(features)], dim=-1)
        h = features + self.self_attn(positions, x, ctx)
        return h + self.mlp(self.post_attention_layernorm(h))


class Eagle3DraftModel(nn.Module):
    def __init__(self, config: Eagle3Config) -> None:
        super().__init__()
        arch = config.arch
        self.config = config
        self.embed_tokens = nn.Embedding(arch.vocab_size, arch.hidden_size)
        self.fc = nn.Linear(3 * config.target_hidden_size, arch.hidden_size, bias=False)
        self.fc_norm = nn.ModuleList(
            [RMSNorm(config.target_hidden_size, arch.rms_norm_eps) for _ in range(3)]) if config.fc_norm else None
        self.rotary_emb = RotaryEmbedding(
            arch.head_dim, arch.max_position_embeddings, arch.rope_theta, arch.rope_scaling)
        self.midlayer = DraftLayer(arch, self.rotary_emb)
        self.norm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)
        self.lm_head = nn.Linear(arch.hidden_size, config.draft_vocab_size, bias=False)
        # draft id -> target id; a buffer so that it moves with the model
        self.register_buffer("draft_to_target", torch.arange(config.draft_vocab_size), persistent=False)

    def forward(
        self,
        input_ids: torch.Tensor,  # [num_tokens]
        features: torch.Tensor,  # [num_tokens, 3 * target_hidden] or [num_tokens, hidden]
        positions: torch.Tensor,  # [num_tokens]
        ctx: ForwardContext,
        logit_rows: torch.Tensor | None = None,  # rows that need logits (default: all)
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns draft logits [num_tokens or len(logit_rows), draft_vocab] (float32) and the
        pre-norm output [num_tokens, hidden] that feeds the next draft step. An extend needs
        logits at one row per request only; the output layer is the dearest part of a row."""
        if features.shape[-1] != self.config.arch.hidden_size:  # the target's three layers
            features = self.project_features(features)
        out = self.midlayer(positions, self.embed_tokens(input_ids), features, ctx)
        wanted = out if logit_rows is None else out[logit_rows]
        return self.logits(wanted).float(), out

    def project_features(self, target_features: torch.Tensor) -> torch.Tensor:
        """[..., 3 * target hidden] -> [..., H]: the first draft step's input features."""
        if self.fc_norm is not None:
            chunks = target_features.chunk(3, dim=-1)
            target_features = torch.cat([norm(chunk) for norm, chunk in zip(self.fc_norm, chunks)], dim=-1)
        return self.fc(target_features)

    def logits(self, out: torch.Tensor) -> torch.Tensor:
        """[..., H] pre-norm output -> [..., draft_vocab] logits, in the model's dtype."""
        return F.linear(self.norm(out) if self.config.norm_output else out, self.lm_head.weight)

    # ---- weights ---------------------------------------------------------------------
    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]], target_embedding: torch.Tensor) -> None:
        """Load a checkpoint; refuse missing or mis-shaped tensors, naming them."""
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        d2t = None
        for name, tensor in weights:
            name = name.removeprefix("model.")
            if name == "t2d":
                continue
            if name == "d2t":
                d2t = tensor
                continue
            target, part = fused_target(name)
            if target not in params:
                hint = " (an fc_norm head whose config lacks \"fc_norm\": true)" if name.startswith("fc_norm.") else ""
                raise DraftHeadError(f"draft checkpoint has an unexpected tensor {name!r}{hint}")
            destination = params[target] if part is None else part_view(params[target], target, part, self.config.arch)
            if tuple(destination.shape) != tuple(tensor.shape):
                raise DraftHeadError(
                    f"draft tensor {name!r} has shape {tuple(tensor.shape)}, expected {tuple(destination.shape)}"
                )
            destination.copy_(tensor)
            loaded.add(name)
        if "embed_tokens.weight" not in loaded:
            if tuple(target_embedding.shape) != tuple(self.embed_tokens.weight.shape):
                raise DraftHeadError(
                    f"draft has no embed_tokens and the target's {tuple(target_embedding.shape)} does not fit "
                    f"{tuple(self.embed_tokens.weight.shape)}"
                )
            self.embed_tokens.weight.copy_(target_embedding)
            loaded.add("embed_tokens.weight")
        required = set(_REQUIRED) | ({f"fc_norm.{i}.weight" for i in range(3)} if self.fc_norm is not None else set())
        missing = sorted(required - loaded)
        if missing:
            raise DraftHeadError(f"draft checkpoint lacks {', '.join(missing)}")
        self._set_vocab_map(d2t)

    @torch.no_grad()
    def init_random_weights(self, seed: int, target_embedding: torch.Tensor) -> None:
        """A random head (tests, speed runs): correct shapes, identity vocabulary map."""
        device = self.fc.weight.device  # drawn there, as the target's dummy weights are
        generator = torch.Generator(device=device).manual_seed(seed)
        for name, param in self.named_parameters():
            if "norm" in name:
                param.fill_(1.0)
            else:
                param.copy_((torch.randn(param.shape, generator=generator, device=device) * 0.05).to(param.dtype))
        self.embed_tokens.weight.copy_(target_embedding)
        self._set_vocab_map(None)

    def _set_vocab_map(self, d2t: torch.Tensor | None) -> None:
        size = self.config.draft_vocab_size
        offsets = torch.zeros(size, dtype=torch.long) if d2t is None else d2t.to(torch.long).cpu()
        if offsets.shape != (size,):
            raise DraftHeadError(f"d2t has shape {tuple(offsets.shape)}, expected ({size},)")
        mapped = torch.arange(size) + offsets
        if mapped.min() < 0 or mapped.max() >= self.config.arch.vocab_size:
            raise DraftHeadError("d2t maps draft tokens outside the target vocabulary")
        self.draft_to_target = mapped.to(self.draft_to_target.device)


_REQUIRED = (
    "fc.weight", "norm.weight", "lm_head.weight", "embed_tokens.weight",
    "midlayer.input_layernorm.weight", "midlayer.hidden_norm.weight", "midlayer.post_attention_layernorm.weight",
    "midlayer.self_attn.q_proj.weight", "midlayer.self_attn.k_proj.weight", "midlayer.self_attn.v_proj.weight",
    "midlayer.self_attn.o_proj.weight", "midlayer.mlp.gate_proj.weight", "midlayer.mlp.up_proj.weight",
    "midlayer.mlp.down_proj.weight",
)
