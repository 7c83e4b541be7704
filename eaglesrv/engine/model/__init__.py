"""The Llama-family model (Llama 2/3/3.1/3.2, Mistral, Qwen2, SmolLM) on a paged KV cache."""

from eaglesrv.engine.model.arch import ModelArch, UnsupportedModel
from eaglesrv.engine.model.llama import LlamaForCausalLM

__all__ = ["LlamaForCausalLM", "ModelArch", "UnsupportedModel"]
