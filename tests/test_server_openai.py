"""The OpenAI API through the official `openai` client, against a live server on the
default model (SmolLM2-135M-Instruct)."""

from __future__ import annotations

import openai
import pytest
from server_fixtures import API_KEY, CONTEXT_LENGTH, LiveServer, live_server  # noqa: F401 (fixture)

pytestmark = pytest.mark.slow

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def client(live_server: LiveServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{live_server.base_url}/v1", api_key=API_KEY, max_retries=0, timeout=180)


@pytest.fixture(scope="module")
def offline_engine():
    """The same model in-process, with the server's context length: the greedy oracle."""
    from eaglesrv.configs import CacheConfig, EngineConfig, ModelConfig
    from eaglesrv.engine.llm_engine import Engine

    # float32, as the server runs (LiveServer): --dtype auto picks bfloat16 on CPUs with bf16 units.
    config = EngineConfig(model=ModelConfig(context_length=CONTEXT_LENGTH, dtype="float32"),
                          cache=CacheConfig(max_total_tokens=4096))
    return Engine(config)


def _stream_texts(stream) -> tuple[dict[int, str], dict[int, str], list, object]:
    """Join streamed chunks per choice: (texts, finish reasons, all chunks, usage)."""
    texts: dict[int, str] = {}
    reasons: dict[int, str] = {}
    chunks, usage = [], None
    for chunk in stream:
        chunks.append(chunk)
        usage = chunk.usage or usage
        for choice in chunk.choices:
            piece = choice.delta.content if hasattr(choice, "delta") else choice.text
            texts[choice.index] = texts.get(choice.index, "") + (piece or "")
            if choice.finish_reason:
                reasons[choice.index] = choice.finish_reason
    return texts, reasons, chunks, usage


def test_greedy_chat_equals_offline_engine(client, offline_engine):
    from eaglesrv.sampling_params import SamplingParams

    conversations = [QUESTION, [{"role": "user", "content": "Name three colors."}]]
    tokenizer = offline_engine.tokenizer
    prompts = [
        tokenizer.encode(tokenizer.apply_chat_template(c, add_generation_prompt=True, tokenize=False),
                         add_special_tokens=False)
        for c in conversations
    ]
    expected = offline_engine.generate(prompts, SamplingParams(temperature=0, max_tokens=12))
    for conversation, prompt, want in zip(conversations, prompts, expected):
        got = client.chat.completions.create(model="SmolLM2-135M-Instruct", messages=conversation, temperature=0,
                                             max_tokens=12)
        assert got.choices[0].message.content == want.text
        assert got.choices[0].finish_reason == want.finish_reason
        assert got.usage.prompt_tokens == len(prompt)
        assert got.usage.completion_tokens == len(want.output_token_ids)
        assert got.usage.total_tokens == len(prompt) + len(want.output_token_ids)
    assert expected[0].text == "The capital of France is Paris."


def test_chat_stream_equals_non_stream_with_n_and_seed(client):
    story = [{"role": "user", "content": "Tell me a story."}]
    kwargs = dict(model="SmolLM2-135M-Instruct", messages=story, temperature=1.0, max_tokens=6, n=2, seed=1234)
    whole = client.chat.completions.create(**kwargs)
    texts, reasons, chunks, usage = _stream_texts(
        client.chat.completions.create(**kwargs, stream=True, stream_options={"include_usage": True})
    )
    assert [c.index for c in whole.choices] == [0, 1]
    assert texts == {c.index: c.message.content for c in whole.choices}
    assert reasons == {c.index: c.finish_reason for c in whole.choices}
    assert len(set(texts.values())) > 1, "choices of one request should be sampled differently"
    assert chunks[-1].choices == []
    counts = ("prompt_tokens", "completion_tokens", "total_tokens")
    assert [getattr(usage, key) for key in counts] == [getattr(whole.usage, key) for key in counts]
    assert usage.prompt_tokens_details.cached_tokens >= whole.usage.prompt_tokens_details.cached_tokens  # seen before
    assert whole.usage.completion_tokens <= 2 * 6
    again = client.chat.completions.create(**{**kwargs, "n": 1})  # same seed, same first choice
    assert again.choices[0].message.content == whole.choices[0].message.content


def test_completions_stream_equals_non_stream(client):
    kwargs = dict(model="SmolLM2-135M-Instruct", prompt=["Once upon a time", "The best way to learn is"],
                  temperature=0.8, max_tokens=6, n=2, seed=7)
    whole = client.completions.create(**kwargs)
    texts, reasons, _, usage = _stream_texts(
        client.completions.create(**kwargs, stream=True, stream_options={"include_usage": True})
    )
    assert sorted(c.index for c in whole.choices) == [0, 1, 2, 3]
    assert texts == {c.index: c.text for c in whole.choices}
    assert reasons == {c.index: c.finish_reason for c in whole.choices}
    assert usage == whole.usage and whole.usage.completion_tokens == 4 * 6


def test_stop_strings_cut_the_text_and_never_stream(client):
    # Greedy answer: "The capital of France is Paris." " of Fr" spans two tokens (" of", " France").
    kwargs = dict(model="SmolLM2-135M-Instruct", messages=QUESTION, temperature=0, max_tokens=24,
                  stop=[" of Fr", "Paris"])
    whole = client.chat.completions.create(**kwargs)
    assert whole.choices[0].message.content == "The capital"
    assert whole.choices[0].finish_reason == "stop"
    texts, reasons, chunks, _ = _stream_texts(client.chat.completions.create(**kwargs, stream=True))
    assert texts[0] == "The capital" and reasons[0] == "stop"
    assert not any(" of" in (c.choices[0].delta.content or "") for c in chunks if c.choices)

    completion = client.completions.create(model="SmolLM2-135M-Instruct", prompt="The capital of France is",
                                           temperature=0, max_tokens=12, stop=".")
    assert completion.choices[0].text == " Paris" and completion.choices[0].finish_reason == "stop"


def test_multibyte_text_streams_whole_characters(client):
    messages = [{"role": "user", "content": "Say hello in Chinese characters."}]
    kwargs = dict(model="SmolLM2-135M-Instruct", messages=messages, temperature=0, max_tokens=8)
    whole = client.chat.completions.create(**kwargs).choices[0].message.content
    texts, _, chunks, _ = _stream_texts(client.chat.completions.create(**kwargs, stream=True))
    assert texts[0] == whole
    assert any(ord(ch) > 0x2E80 for ch in whole), whole  # it does answer in CJK characters
    # Only the very end may hold a partial character (cut by max_tokens), as decode() shows it too.
    pieces = [c.choices[0].delta.content for c in chunks if c.choices and c.choices[0].delta.content]
    assert not any("\ufffd" in piece for piece in pieces[:-1])


def test_chat_logprobs(client):
    got = client.chat.completions.create(model="SmolLM2-135M-Instruct", messages=QUESTION, temperature=0,
                                         max_tokens=8, logprobs=True, top_logprobs=3)
    content = got.choices[0].logprobs.content
    assert len(content) == got.usage.completion_tokens
    for item in content:
        assert len(item.top_logprobs) == 3
        assert item.logprob <= 0.0
        assert item.top_logprobs[0].logprob == pytest.approx(item.logprob, abs=1e-4)  # greedy picks the top one
        assert item.token == item.top_logprobs[0].token
    assert "".join(item.token for item in content[:7]) == "The capital of France is Paris."

    texts, _, chunks, _ = _stream_texts(client.chat.completions.create(
        model="SmolLM2-135M-Instruct", messages=QUESTION, temperature=0, max_tokens=8, logprobs=True, top_logprobs=2,
        stream=True))
    streamed = [item for c in chunks if c.choices and c.choices[0].logprobs for item in c.choices[0].logprobs.content]
    assert [i.token for i in streamed] == [i.token for i in content]


def test_completion_logprobs_and_echo(client):
    got = client.completions.create(model="SmolLM2-135M-Instruct", prompt="The capital of France is", temperature=0,
                                    max_tokens=4, logprobs=2)
    lp = got.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 4
    assert "".join(lp.tokens) == got.choices[0].text
    assert all(len(top) == 2 for top in lp.top_logprobs)
    assert lp.text_offset[0] == 0 and lp.text_offset[1] == len(lp.tokens[0])

    echoed = client.completions.create(model="SmolLM2-135M-Instruct", prompt="The capital of France is",
                                       temperature=0, max_tokens=4, echo=True)
    assert echoed.choices[0].text == "The capital of France is" + got.choices[0].text


def test_token_id_prompts(client, live_server):
    ids = [504, 3575, 282, 4649, 314]  # "The capital of France is"
    by_ids = client.completions.create(model="SmolLM2-135M-Instruct", prompt=ids, temperature=0, max_tokens=3)
    by_text = client.completions.create(model="SmolLM2-135M-Instruct", prompt="The capital of France is",
                                        temperature=0, max_tokens=3)
    assert by_ids.choices[0].text == by_text.choices[0].text
    assert by_ids.usage.prompt_tokens == len(ids)


def test_models_endpoints(client):
    models = client.models.list().data
    assert [m.id for m in models] == ["SmolLM2-135M-Instruct"]
    assert client.models.retrieve("SmolLM2-135M-Instruct").id == "SmolLM2-135M-Instruct"
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("gpt-4o")
