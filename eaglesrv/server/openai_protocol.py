"""Request bodies of the OpenAI-compatible endpoints, as pydantic models.

Only the request side is modelled: the shapes of responses are built as plain dicts in
the endpoint modules, next to the code that fills them. Unknown fields are ignored (as
OpenAI's own server does for forward compatibility); fields we know but cannot honour
(`unsupported.py`) are
refused with 400 by `refuse_unsupported`, never dropped.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from eaglesrv.server.errors import bad_request
from eaglesrv.server.unsupported import OPENAI_BODY_FIELDS, refuse_known_unsupported

MAX_N = 128


class _Request(BaseModel):
    # NaN and Infinity parse as JSON numbers in Python; no sampling field means anything with them.
    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)


class StreamOptions(_Request):
    include_usage: bool = False


class SamplingFields(_Request):
    """Fields chat and completions share. None means "the default" throughout."""

    model_config = ConfigDict(extra="allow", allow_inf_nan=False)  # kept, so that refuse_unsupported sees them

    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None  # extension (vLLM, SGLang)
    min_p: float | None = None  # extension
    n: int = Field(1, ge=1, le=MAX_N)
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None  # extension
    seed: int | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None  # extension (vLLM, SGLang): over prompt and output tokens
    ignore_eos: bool = False  # extension
    min_tokens: int = Field(0, ge=0)  # extension
    skip_special_tokens: bool = True  # extension
    logit_bias: dict[str, float] | None = None  # token id (as a string) -> bias in [-100, 100]
    user: str | None = None
    prompt_logprobs: int | None = Field(None, ge=0)  # extension (vLLM): score the prompt, n alternatives a token

    @property
    def stop_strings(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    @property
    def prompt_scores(self) -> int | None:
        """Alternatives per prompt token to compute when the prompt is scored, else None."""
        return self.prompt_logprobs


class TextPart(_Request):
    type: Literal["text"]
    text: str


class FunctionCall(_Request):
    name: str
    arguments: str | dict[str, Any] = "{}"  # a JSON object's text (OpenAI); an object is taken too


class AssistantToolCall(_Request):
    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(_Request):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None  # None: an assistant turn that only calls tools
    name: str | None = None
    tool_calls: list[AssistantToolCall] | None = None  # assistant
    tool_call_id: str | None = None  # tool: the call this is the result of

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)

    def for_template(self) -> dict[str, Any]:
        """The message as the chat template (through server/tools/prompting.py) takes it."""
        message: dict[str, Any] = {"role": "system" if self.role == "developer" else self.role,
                                   "content": self.text()}
        if self.tool_calls:
            message["tool_calls"] = [call.model_dump(exclude_none=True) for call in self.tool_calls]
        if self.tool_call_id is not None:
            message["tool_call_id"] = self.tool_call_id
        return message


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0)
    tools: list[Any] | None = None  # checked with tool_choice by server/tools (400 naming the field)
    tool_choice: Any = None
    parallel_tool_calls: bool = True
    response_format: dict[str, Any] | None = None
    chat_template_kwargs: dict[str, Any] | None = None  # extension (vLLM, SGLang): the template's own options

    @property
    def output_limit(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def refuse_unsupported(self) -> None:
        _refuse_common(self)
        if self.top_logprobs is not None and not self.logprobs:
            raise bad_request("top_logprobs needs logprobs: true", param="top_logprobs")


PromptInput = str | list[str] | list[int] | list[list[int]]


class CompletionRequest(SamplingFields):
    prompt: PromptInput
    echo: bool = False
    logprobs: int | None = Field(None, ge=0)
    suffix: str | None = None
    best_of: int | None = None
    response_format: dict[str, Any] | None = None  # extension (vLLM): JSON mode and schemas on completions

    @property
    def output_limit(self) -> int | None:
        return self.max_tokens

    def refuse_unsupported(self) -> None:
        _refuse_common(self)
        if self.suffix:
            raise bad_request("suffix is not supported by this server", param="suffix")
        if self.best_of is not None and self.best_of != self.n:
            raise bad_request("best_of other than n is not supported by this server", param="best_of")

    @property
    def prompt_scores(self) -> int | None:
        """Alternatives per prompt token to compute (echo with logprobs, prompt_logprobs), or None."""
        asked = [n for n in (self.logprobs if self.echo else None, self.prompt_logprobs) if n is not None]
        return max(asked) if asked else None


def _refuse_common(request: SamplingFields) -> None:
    refuse_known_unsupported(request, OPENAI_BODY_FIELDS)
    if request.output_limit == 0 and request.prompt_scores is None:
        param = "max_completion_tokens" if getattr(request, "max_completion_tokens", None) == 0 else "max_tokens"
        raise bad_request(f"{param} must be at least 1 (0 only scores the prompt: with echo and logprobs, or "
                          "prompt_logprobs)", param=param)
