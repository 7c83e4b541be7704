"""Continuous batching on held-out ShareGPT prompts, a fixed number in flight.

Built like SGLang's bench_serving: the first human turn is the prompt (chat template
applied here), and the token length of the first reply sets the output length.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import asdict, dataclass
from typing import Any

from eaglesrv import SamplingParams
from eaglesrv.data import heldout_split, prompt_reply_pairs


@dataclass(frozen=True)
class BenchRequest:
    prompt_ids: list[int]
    output_len: int


@dataclass(frozen=True)
class BatchResult:
    num_requests: int
    input_tokens: int
    output_tokens: int
    total_s: float
    steps: int
    mean_running: float  # mean number of requests that got a token per step
    mean_ttft_ms: float  # from a request's submission (when a slot freed) to its first token

    @property
    def output_tok_s(self) -> float:
        return self.output_tokens / self.total_s

    def to_json(self) -> dict[str, Any]:
        return {**asdict(self), "output_tok_s": self.output_tok_s, "req_s": self.num_requests / self.total_s}


def chat_prompt_ids(tokenizer, text: str) -> list[int]:
    """Token ids of one user turn in the model's chat template, ready for the reply."""
    rendered = tokenizer.apply_chat_template(
        [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=False
    )
    # The template already writes any BOS it wants; adding special tokens would double it.
    return list(tokenizer(rendered, add_special_tokens=False)["input_ids"])


def sharegpt_workload(tokenizer, num_prompts: int, max_input_len: int, max_output_len: int,
                      min_output_len: int = 4) -> list[BenchRequest]:
    """The first num_prompts held-out conversations whose prompt fits, in file order."""
    requests: list[BenchRequest] = []
    for prompt, reply in prompt_reply_pairs(heldout_split()):
        prompt_ids = chat_prompt_ids(tokenizer, prompt)
        if len(prompt_ids) > max_input_len:
            continue
        reply_len = len(tokenizer(reply, add_special_tokens=False)["input_ids"])
        requests.append(BenchRequest(prompt_ids, min(max(reply_len, min_output_len), max_output_len)))
        if len(requests) == num_prompts:
            return requests
    raise ValueError(f"only {len(requests)} held-out prompts fit in {max_input_len} tokens; asked for {num_prompts}")


def run_continuous(engine, requests: list[BenchRequest], concurrency: int,
                   prompt_logprobs: int | None = None) -> BatchResult:
    """Keep `concurrency` requests in flight: each one that finishes is replaced at once.
    `prompt_logprobs`: score every prompt too (what an evaluation harness's loglikelihood asks)."""
    waiting = deque(requests)
    produced: dict[str, int] = {}
    planned: dict[str, int] = {}
    submitted: dict[str, float] = {}
    ttft: dict[str, float] = {}

    def submit() -> None:
        request = waiting.popleft()
        params = SamplingParams(max_tokens=request.output_len, temperature=0.0, ignore_eos=True,
                                prompt_logprobs=prompt_logprobs)
        request_id = engine.add_request(request.prompt_ids, params)
        planned[request_id], produced[request_id] = request.output_len, 0
        submitted[request_id] = time.perf_counter()

    start = time.perf_counter()
    while waiting and len(planned) < concurrency:
        submit()
    in_flight, steps, running_sum = len(planned), 0, 0
    while in_flight:
        outputs = engine.step()
        steps += 1
        running_sum += sum(1 for out in outputs if out.new_token_ids)
        now = time.perf_counter()
        for out in outputs:
            if out.new_token_ids and out.request_id not in ttft:
                ttft[out.request_id] = now - submitted[out.request_id]
            produced[out.request_id] += len(out.new_token_ids)
            if out.finished:
                in_flight -= 1
                if waiting:
                    submit()
                    in_flight += 1
    total_s = time.perf_counter() - start
    short = [rid for rid, n in produced.items() if n != planned[rid]]
    if short:
        raise RuntimeError(f"{len(short)} requests did not produce their planned length (ignore_eos should hold)")
    return BatchResult(
        len(requests), sum(len(r.prompt_ids) for r in requests), sum(produced.values()),
        total_s, steps, running_sum / max(steps, 1), 1000 * sum(ttft.values()) / max(len(ttft), 1),
    )

