"""From a request to what the engine takes: prompt token ids and SamplingParams.

Every check that can fail for a bad request happens here, before anything reaches the
engine, so that the client gets a 400 naming the problem and the engine never sees it:
token ids outside the vocabulary, empty prompts, prompts or outputs beyond the context.
"""

from __future__ import annotations

from typing import Any, Sequence

from eaglesrv.configs import ServerConfig
from eaglesrv.engine.protocol import EngineInfo
from eaglesrv.sampling_params import InvalidSamplingParams, SamplingParams
from eaglesrv.server.errors import bad_request
from eaglesrv.server.state import ServerState


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
    repetition_penalty: float | None = None,
    logit_bias: dict[str, float] | None = None,
    seed: int | None = None,
    stop_token_ids: Sequence[int] | None = None,
    ignore_eos: bool = False,
    logprobs: int | None = None,
    min_tokens: int = 0,
    prompt_logprobs: int | None = None,
    logprob_start_len: int = 0,
    grammar: str | None = None,
) -> SamplingParams:
    """SamplingParams with None meaning "the default"; 400 naming the field on bad values."""
    if top_k is not None and top_k >= info.vocab_size:
        top_k = -1  # keeps every token anyway; and a huge int would overflow the sampler's int64 tensors
    given: dict[str, Any] = dict(
        temperature=temperature, top_p=top_p, top_k=top_k, min_p=min_p,
        presence_penalty=presence_penalty, frequency_penalty=frequency_penalty, repetition_penalty=repetition_penalty,
        logit_bias=_token_biases(logit_bias, info.vocab_size) if logit_bias else None,
    )
    values = {name: value for name, value in given.items() if value is not None}
    try:
        return SamplingParams(
            max_tokens=max_tokens, seed=seed, stop_token_ids=tuple(stop_token_ids or ()), ignore_eos=ignore_eos,
            logprobs=logprobs, min_tokens=min_tokens, prompt_logprobs=prompt_logprobs,
            logprob_start_len=logprob_start_len, grammar=grammar, **values,
        )
    except InvalidSamplingParams as exc:
        raise bad_request(str(exc), param=str(exc).split(" ", 1)[0]) from None


def _token_biases(logit_bias: dict[str, float], vocab_size: int) -> tuple[tuple[int, float], ...]:
    """OpenAI's {"token id": bias} as (id, bias) pairs; 400 for a key that is not a token id."""
    pairs = []
    for key, bias in logit_bias.items():
        token_id = int(key) if str(key).strip().lstrip("-").isdigit() else None
        if token_id is None or not 0 <= token_id < vocab_size:
            raise bad_request(f"logit_bias: {key!r} is not a token id of this model (0 to {vocab_size - 1})",
                              param="logit_bias")
        pairs.append((token_id, float(bias)))
    return tuple(sorted(pairs))


def openai_sampling_params(info, body, logprobs: int | None, grammar: str | None = None) -> SamplingParams:
    """build_sampling_params from the sampling fields chat and completions share."""
    return build_sampling_params(
        info, max_tokens=body.output_limit, temperature=body.temperature, top_p=body.top_p, top_k=body.top_k,
        min_p=body.min_p, presence_penalty=body.presence_penalty, frequency_penalty=body.frequency_penalty,
        repetition_penalty=body.repetition_penalty, logit_bias=body.logit_bias, seed=body.seed,
        stop_token_ids=body.stop_token_ids, ignore_eos=body.ignore_eos, logprobs=logprobs,
        min_tokens=body.min_tokens, prompt_logprobs=body.prompt_scores, grammar=grammar,
    )


def check_logprob_counts(config: ServerConfig, **counts: int | None) -> None:
    """400 naming the field that asks for more alternatives per token than --max-logprobs."""
    for name, count in counts.items():
        if count is not None and count > config.max_logprobs:
            raise bad_request(f"{name} must be at most {config.max_logprobs} (the server's --max-logprobs), "
                              f"got {count}", param=name)


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


def check_stop_rules(limits: ServerConfig, info: EngineInfo, stop_strings: Sequence[str],
                     stop_token_ids: Sequence[int] | None, prefix: str = "") -> None:
    """400 for stop strings or stop token ids beyond the server's limits or the vocabulary
    (`prefix`: where the fields sit in the body, e.g. "sampling_params.")."""
    if len(stop_strings) > limits.max_stop_strings:
        raise bad_request(f"{len(stop_strings)} stop strings; at most {limits.max_stop_strings} are allowed "
                          "(--max-stop-strings)", param=f"{prefix}stop")
    longest = max(map(len, stop_strings), default=0)
    if longest > limits.max_stop_string_length:
        raise bad_request(f"a stop string of {longest} characters; at most {limits.max_stop_string_length} are "
                          "allowed (--max-stop-string-length)", param=f"{prefix}stop")
    if any(not stop for stop in stop_strings):
        raise bad_request("stop strings must not be empty", param=f"{prefix}stop")
    stop_token_ids = stop_token_ids or ()
    if len(stop_token_ids) > limits.max_stop_token_ids:
        raise bad_request(f"{len(stop_token_ids)} stop token ids; at most {limits.max_stop_token_ids} are allowed "
                          "(--max-stop-token-ids)", param=f"{prefix}stop_token_ids")
    for token in stop_token_ids:
        if not 0 <= token < info.vocab_size:
            raise bad_request(f"stop token id {token} is outside the vocabulary", param=f"{prefix}stop_token_ids")


def check_choices(limits: ServerConfig, num_prompts: int, n: int, param: str = "n") -> None:
    """400 when prompts x n is beyond --max-choices-per-request; checked before any tokenizing."""
    if num_prompts * n > limits.max_choices_per_request:
        raise bad_request(f"the request asks for {num_prompts} x {n} = {num_prompts * n} generations (prompts x n); "
                          f"at most {limits.max_choices_per_request} are allowed (--max-choices-per-request)",
                          param=param)


def encode_text(tokenizer, text: str, add_special_tokens: bool = True) -> list[int]:
    return list(tokenizer.encode(text, add_special_tokens=add_special_tokens))


_TEMPLATE_CALL_ARGS = {"conversation", "messages", "tokenize", "add_generation_prompt", "chat_template", "tools",
                       "documents", "return_dict", "return_tensors", "continue_final_message"}


def chat_prompt_ids(tokenizer, messages: list[dict[str, Any]], template_kwargs: dict[str, Any] | None = None,
                    tools: list[dict[str, Any]] | None = None) -> list[int]:
    """Apply the model's chat template (with the request's chat_template_kwargs, e.g.
    enable_thinking, passed to it as variables, and `tools` for a template that renders them:
    server/tools/prompting.py decides); the template writes the special tokens itself."""
    if not getattr(tokenizer, "chat_template", None):
        raise bad_request("this model has no chat template; use /v1/completions", param="messages")
    taken = sorted(set(template_kwargs or {}) & _TEMPLATE_CALL_ARGS)
    if taken:
        raise bad_request(f"chat_template_kwargs may not set {', '.join(taken)}", param="chat_template_kwargs")
    try:
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False,
                                             **({"tools": tools} if tools else {}), **(template_kwargs or {}))
    except Exception as exc:  # noqa: BLE001 - a template's own checks (e.g. role order) raise anything
        raise bad_request(f"the chat template rejected the messages: {exc}", param="messages") from None
    return encode_text(tokenizer, text, add_special_tokens=False)


def prompt_list(prompt: str | list) -> list:
    """OpenAI's prompt forms (a string, strings, token ids, lists of token ids) as a list of
    prompts, each a string or token ids, not yet encoded."""
    if isinstance(prompt, str):
        return [prompt]
    if prompt and all(isinstance(p, int) for p in prompt):
        return [prompt]
    return list(prompt)


def completion_prompts(prompts: list, state: ServerState, param: str = "prompt") -> list[list[int]]:
    """prompt_list's prompts as id lists; text too long for the context is refused before
    it is tokenized."""
    if not prompts:
        raise bad_request("the prompt is empty", param=param)
    encoded = []
    for p in prompts:
        if isinstance(p, str):
            state.check_prompt_chars(len(p), param)
            if state.tokenizer is None:
                raise bad_request("text prompts need a tokenizer (--skip-tokenizer-init is set)", param=param)
            encoded.append(encode_text(state.tokenizer, p))
        else:
            encoded.append([int(t) for t in p])
    return encoded
