"""Batch-1 decode timing, done the same way for eaglesrv and for transformers.

Both sides are timed by the arrival time of each generated token: time to first token
is prefill plus one sampling step, and the decode rate is the tokens after the first
divided by the time from the first to the last. That excludes prefill without a
separate max_tokens=1 run, whose own noise would be subtracted in.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Sequence

import torch

from eaglesrv import SamplingParams


@dataclass(frozen=True)
class DecodeRun:
    """One batch-1 generation of exactly num_tokens tokens."""

    ttft_s: float  # prompt submitted -> first token back
    decode_s: float  # first token -> last token
    num_tokens: int
    token_ids: tuple[int, ...]

    @property
    def decode_tok_s(self) -> float:
        # Tokens after the first, over the time they took.
        return (self.num_tokens - 1) / self.decode_s


@dataclass(frozen=True)
class DecodeSummary:
    decode_tok_s: float  # median over repeats
    ttft_ms: float  # median over repeats
    runs_tok_s: list[float]

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def summarize(runs: Sequence[DecodeRun]) -> DecodeSummary:
    rates = [r.decode_tok_s for r in runs]
    return DecodeSummary(statistics.median(rates), 1000 * statistics.median(r.ttft_s for r in runs), rates)


def _run_from_times(start: float, token_times: list[float], token_ids: Sequence[int]) -> DecodeRun:
    if len(token_times) < 2:
        raise ValueError("a decode timing needs at least 2 generated tokens")
    return DecodeRun(token_times[0] - start, token_times[-1] - token_times[0], len(token_times), tuple(token_ids))


def time_eaglesrv(engine, prompt_ids: list[int], num_tokens: int) -> DecodeRun:
    """Greedy, EOS ignored, one request alone in the engine; step() is the clock."""
    params = SamplingParams(max_tokens=num_tokens, temperature=0.0, ignore_eos=True)
    token_times: list[float] = []
    token_ids: list[int] = []
    start = time.perf_counter()
    request_id = engine.add_request(prompt_ids, params)
    while engine.has_unfinished:
        for out in engine.step():
            if out.request_id != request_id:
                continue
            now = time.perf_counter()
            token_times += [now] * len(out.new_token_ids)  # several at once only when speculating
            token_ids += out.new_token_ids
    return _run_from_times(start, token_times, token_ids)


class _TokenClock:
    """A generate() streamer that notes when each new token comes out.

    generate calls put() once with the prompt before any forward pass, then once per token.
    Duck-typed rather than subclassing BaseStreamer: generate only calls put() and end().
    """

    def __init__(self) -> None:
        self.times: list[float] = []
        self._saw_prompt = False

    def put(self, value: torch.Tensor) -> None:
        if not self._saw_prompt:
            self._saw_prompt = True
            return
        self.times.append(time.perf_counter())

    def end(self) -> None:
        pass


def time_transformers(model, prompt_ids: list[int], num_tokens: int) -> DecodeRun:
    """model.generate as users call it (default dynamic cache), greedy, exactly num_tokens."""
    input_ids = torch.tensor([prompt_ids], dtype=torch.long)
    clock = _TokenClock()
    start = time.perf_counter()
    output = model.generate(
        input_ids, attention_mask=torch.ones_like(input_ids), max_new_tokens=num_tokens,
        min_new_tokens=num_tokens, do_sample=False, streamer=clock,
        pad_token_id=model.generation_config.eos_token_id,
    )
    return _run_from_times(start, clock.times, output[0, len(prompt_ids):].tolist())


def time_transformers_scoring(hf_model, prompts: Sequence[Sequence[int]]) -> float:
    """Seconds for transformers to score each prompt alone (one forward, every token's
    logprob and the best token at each position): lm-eval's hf model at batch size 1."""
    start = time.perf_counter()
    with torch.inference_mode():
        for prompt_ids in prompts:
            ids = torch.tensor([list(prompt_ids)])
            logprobs = torch.log_softmax(hf_model(ids).logits[0, :-1].float(), -1)
            logprobs.gather(1, ids[0, 1:, None]).sum().item()
            logprobs.argmax(-1).tolist()
    return time.perf_counter() - start


def load_transformers_model(model_path: str | None, dtype: str):
    """The same weights in transformers: the default GGUF, a .gguf, or an HF dir/id; dense, in dtype."""
    from transformers import AutoModelForCausalLM

    from eaglesrv.engine.loader import default_model_path

    torch_dtype = getattr(torch, dtype)
    path = default_model_path() if model_path is None else Path(model_path)
    if path.is_dir() and not (path / "config.json").exists():
        ggufs = sorted(path.glob("*.gguf"))
        path = ggufs[0] if len(ggufs) == 1 else path
    if path.suffix == ".gguf":
        model = AutoModelForCausalLM.from_pretrained(
            str(path.parent), gguf_file=path.name, dtype=torch_dtype, **_dequantize_gguf())
    else:
        model = AutoModelForCausalLM.from_pretrained(str(model_path), dtype=torch_dtype)
    # Newer transformers can keep GGUF blocks packed and compute through kernels; that would
    # time a different computation from ours, so insist on dense weights in the asked dtype.
    odd = {p.dtype for p in model.parameters()} - {torch_dtype}
    if odd:
        raise RuntimeError(
            f"transformers loaded weights in {odd}, not dense {torch_dtype}; cannot compare like for like"
        )
    return model.eval()


def _dequantize_gguf() -> dict[str, Any]:
    try:
        from transformers import GgufConfig
    except ImportError:  # older transformers: GGUF is always dequantized at load
        return {}
    return {"quantization_config": GgufConfig(dequantize=True)}
