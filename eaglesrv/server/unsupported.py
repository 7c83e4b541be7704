"""Fields other servers (OpenAI, SGLang, vLLM) take that this one cannot honour.

A request that sets one gets a 400 naming it, never a 200 that silently ignores it. Fields
nobody here has heard of are still ignored (OpenAI's own forward compatibility), and a
known field sent with an empty value (`"lora_path": null`, as SGLang's bench_serving
sends) is accepted: it asks for nothing.
"""

from __future__ import annotations

from pydantic import BaseModel

from eaglesrv.server.errors import bad_request

_STRUCTURAL_TAG = "structural tags are not supported by this server (response_format json_schema, regex, ebnf are)"
_TOOLS = "the deprecated functions and function_call are not supported: use tools and tool_choice"

# Chat and completions bodies: OpenAI's, vLLM's and SGLang's extensions.
OPENAI_BODY_FIELDS = {
    "functions": _TOOLS, "function_call": _TOOLS,
    "structural_tag": _STRUCTURAL_TAG,
    "guided_decoding_backend": "the grammar backend cannot be chosen: this server enforces grammars with llguidance",
    "guided_whitespace_pattern": "guided_whitespace_pattern is not supported: JSON is generated on one line",
    "use_beam_search": "beam search is not supported by this server",
    "length_penalty": "length_penalty applies to beam search, which this server does not do",
    "logits_processors": "custom logits processors are not supported by this server",
    "allowed_token_ids": "allowed_token_ids is not supported by this server",
    "bad_words": "bad_words is not supported by this server",
    "lora_path": "LoRA adapters are not supported by this server",
    "prediction": "predicted outputs are not supported by this server",
    "audio": "audio output is not supported by this server",
    "return_hidden_states": "hidden states are not returned by this server",
}

# /generate's sampling_params (SGLang's names).
NATIVE_SAMPLING_FIELDS = {
    "structural_tag": _STRUCTURAL_TAG,
    "custom_params": "custom logit processors are not supported by this server",
}

# /generate's body (SGLang's names).
NATIVE_BODY_FIELDS = {
    "lora_path": "LoRA adapters are not supported by this server",
    "image_data": "image inputs are not supported by this server",
    "audio_data": "audio inputs are not supported by this server",
    "custom_logit_processor": "custom logit processors are not supported by this server",
    "return_hidden_states": "hidden states are not returned by this server",
}


def refuse_known_unsupported(body: BaseModel, known: dict[str, str], prefix: str = "") -> None:
    """400 for the first field of `known` that `body` sets (its model must keep extra fields)."""
    for name, value in (body.model_extra or {}).items():
        if name in known and value not in (None, False, "", [], {}):
            raise bad_request(f"{prefix}{name}: {known[name]}", param=prefix + name)
