"""From a request to what the engine takes: prompt token ids and SamplingParams.

Every check that can fail for a bad request happens here, before anything reaches the
engine, so that the client gets a 400 naming the problem and the engine never sees it:
token ids outside the vocabulary, empty prompts, prompts or outputs beyond the context.
"""

from __future__ import annotations

from typing import Any, Sequence

from eaglesrv.engine.protocol import EngineInfo
from eaglesrv.sampling_params import InvalidSamplingParams, SamplingParams
from eaglesrv.server.errors import bad_request


def build_sampling_params(
    info: EngineInfo,
    *,
    max_tokens: int | None,
    temperature: float | None = None,
    top_p: float | None = None,
    top_k: int | None = None,
    min_p: float | None = None,
    presence_penalty: float | None = None,
    frequency_penalty: float | None = None,
    seed: int | None = None,
    stop_token_ids: Sequence[int] | None = None,
    ignore_eos: bool = False,
    logprobs: int | None = None,
    min_tokens: int = 0,
) -> SamplingParams:
    """SamplingParams with None meaning "the default"; 400 naming the field on bad values."""
    if top_k is not None and top_k >= info.vocab_size:
        top_k = -1  # keeps every token anyway; and a huge int would overflow the sampler's int64 tensors
    given: dict[str, Any] = dict(
        temperature=temperature, top_p=top_p, top_k=top_k, min_p=min_p,
        presence_penalty=presence_penalty, frequency_penalty=frequency_penalty,
    )
    values = {name: value for name, value in given.items() if value is not None}
    try:
        return SamplingParams(
            max_tokens=max_tokens, seed=seed, stop_token_ids=tuple(stop_token_ids or ()), ignore_eos=ignore_eos,
            logprobs=logprobs, min_tokens=min_tokens, **values,
        )
    except InvalidSamplingParams as exc:
        raise bad_request(str(exc), param=str(exc).split(" ", 1)[0]) from None


def openai_sampling_params(info, body, logprobs: int | None) -> SamplingParams:
    """build_sampling_params from the sampling fields chat and completions share."""
    return build_sampling_params(
        info, max_tokens=body.output_limit, temperature=body.temperature, top_p=body.top_p, top_k=body.top_k,
        min_p=body.min_p, presence_penalty=body.presence_penalty, frequency_penalty=body.frequency_penalty,
        seed=body.seed, stop_token_ids=body.stop_token_ids, ignore_eos=body.ignore_eos, logprobs=logprobs,
        min_tokens=body.min_tokens,
    )


def with_choice_seed(params: SamplingParams, choice_index: int) -> SamplingParams:
    """The params of choice i of n: a given seed is shifted so choices differ but repeat."""
    if params.seed is None or choice_index == 0:
        return params
    return params.replace(seed=params.seed + choice_index)


def check_prompt(token_ids: Sequence[int], info: EngineInfo, max_tokens: int | None, param: str) -> None:
    """400 for an empty prompt, unknown token ids, or a prompt/output beyond the context."""
    if not token_ids:
        raise bad_request("the prompt is empty", param=param)
    bad = next((t for t in token_ids if not 0 <= t < info.vocab_size), None)
    if bad is not None:
        raise bad_request(f"token id {bad} is outside the vocabulary [0, {info.vocab_size})", param=param)
    limit = info.max_context_len
    if len(token_ids) >= limit:
        raise bad_request(
            f"This model's maximum context length is {limit} tokens, and the prompt has {len(token_ids)} tokens "
            "(at least one token must be left for the output)",
            param=param, code="context_length_exceeded",
        )
    if max_tokens is not None and len(token_ids) + max_tokens > limit:
        raise bad_request(
            f"This model's maximum context length is {limit} tokens. However, you requested "
            f"{len(token_ids) + max_tokens} tokens ({len(token_ids)} in the prompt, {max_tokens} for the output)",
            param="max_tokens", code="context_length_exceeded",
        )


def check_stop_token_ids(stop_token_ids: Sequence[int] | None, info: EngineInfo) -> None:
    for token in stop_token_ids or ():
        if not 0 <= token < info.vocab_size:
            raise bad_request(f"stop token id {token} is outside the vocabulary", param="stop_token_ids")


def encode_text(tokenizer, text: str, add_special_tokens: bool = True) -> list[int]:
    return list(tokenizer.encode(text, add_special_tokens=add_special_tokens))


def chat_prompt_ids(tokenizer, messages: list[dict[str, str]]) -> list[int]:
    """Apply the model's chat template; the template writes the special tokens itself."""
    if not getattr(tokenizer, "chat_template", None):
        raise bad_request("this model has no chat template; use /v1/completions", param="messages")
    try:
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    except Exception as exc:  # noqa: BLE001 - a template's own checks (e.g. role order) raise anything
        raise bad_request(f"the chat template rejected the messages: {exc}", param="messages") from None
    return encode_text(tokenizer, text, add_special_tokens=False)


def completion_prompts(prompt: str | list, tokenizer) -> list[list[int]]:
    """OpenAI's prompt forms (a string, strings, token ids, lists of token ids) as id lists."""
    if isinstance(prompt, str):
        prompts: list = [prompt]
    elif prompt and all(isinstance(p, int) for p in prompt):
        prompts = [prompt]
    else:
        prompts = list(prompt)
    if not prompts:
        raise bad_request("the prompt is empty", param="prompt")
    encoded = []
    for p in prompts:
        if isinstance(p, str):
            if tokenizer is None:
                raise bad_request("text prompts need a tokenizer (--skip-tokenizer-init is set)", param="prompt")
            encoded.append(encode_text(tokenizer, p))
        else:
            encoded.append([int(t) for t in p])
    return encoded
