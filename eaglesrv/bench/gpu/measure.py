"""What bench_gpu measures, one function each: the weight-streaming floor, batch-1 step
times, and the workload of many concurrent requests with random token ids.

Every figure comes from the in-process Engine. engine.step() hands its tokens back to the
host, so a step's wall time includes its device work; the timers still synchronize the
device before reading the clock.
"""

from __future__ import annotations

import random
import statistics
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from eaglesrv import SamplingParams
from eaglesrv.bench.offline.workload import BenchRequest

# Memory bandwidth by GPU, matched against torch.cuda.get_device_name() (first match wins):
# bytes per second, and where the number comes from. H200: a device-to-device copy through
# PyTorch, bytes read plus written (../shared/DESIGN.md); H100: NVIDIA's SXM figure.
BANDWIDTHS = (
    ("H200", 4.26e12, "H200, measured copy"),
    ("H100", 3.35e12, "H100, nominal"),
)


@dataclass(frozen=True)
class Floor:
    """Batch-1 decode reads every weight once per token: the rate memory bandwidth allows."""

    weight_bytes: int
    bandwidth: float  # bytes per second
    source: str  # where the bandwidth comes from

    @property
    def tok_s(self) -> float:
        return self.bandwidth / self.weight_bytes

    def to_json(self) -> dict[str, Any]:
        return {**asdict(self), "tok_s": self.tok_s}


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    from eaglesrv.bench.machine import machine_info

    return f"CPU: {machine_info()['cpu']}"


def table_bandwidth(name: str) -> tuple[float, str] | None:
    """(bytes per second, source) for a GPU in BANDWIDTHS, or None."""
    for key, bandwidth, source in BANDWIDTHS:
        if key in name:
            return bandwidth, source
    return None


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def copy_bandwidth(device: torch.device, nbytes: int, repeats: int = 5) -> float:
    """Bytes read plus written per second by a plain tensor copy (for devices not in the table)."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=device).fill_(1)
    dst = torch.empty_like(src)
    dst.copy_(src)
    synchronize(device)
    start = time.perf_counter()
    for _ in range(repeats):
        dst.copy_(src)
    synchronize(device)
    return 2 * nbytes * repeats / (time.perf_counter() - start)


def weight_bytes(arch, dtype: torch.dtype) -> int:
    """The target's parameter bytes at this shape, counted on the meta device (nothing allocated)."""
    from eaglesrv.engine.model.llama import LlamaForCausalLM

    with torch.device("meta"):
        model = LlamaForCausalLM(arch)
    return sum(p.numel() for p in model.parameters()) * torch.empty((), dtype=dtype).element_size()


def streaming_floor(arch, dtype: torch.dtype, device: torch.device) -> Floor:
    """The floor from BANDWIDTHS for a known GPU, else from a copy measured here."""
    known = table_bandwidth(device_name(device)) if device.type == "cuda" else None
    if known is None:
        nbytes = 1 << 30 if device.type == "cuda" else 32 << 20
        known = copy_bandwidth(device, nbytes), f"{device.type}, measured copy here"
    return Floor(weight_bytes(arch, dtype), *known)


def random_prompts(vocab_size: int, count: int, length: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(vocab_size) for _ in range(length)] for _ in range(count)]


# The draft vocabulary of the EAGLE-3 heads published for Llama-3.1-8B-Instruct. The
# builder's own random head (no --speculative-draft-model-path) predicts over the whole
# target vocabulary instead, and each draft step reads its lm_head: at 128,256 ids that is
# 4x the bytes, about 0.9 ms more per round on an H200 over five steps.
PUBLISHED_DRAFT_VOCAB = 32_000


def write_random_head(arch, draft_vocab_size: int, directory: Path, seed: int = 0) -> Path:
    """A random EAGLE-3 head for `arch` predicting its first draft_vocab_size ids, in the
    published format (fp32), built on the CPU."""
    from eaglesrv.engine.eagle3.draft_model import Eagle3Config, Eagle3DraftModel
    from eaglesrv.engine.eagle3.head_io import head_config_for, save_head

    hf_config = head_config_for(arch, draft_vocab_size)
    with torch.device("meta"):
        head = Eagle3DraftModel(Eagle3Config.from_hf_config(hf_config))
    head = head.to_empty(device=torch.device("cpu"))
    head.init_random_weights(seed, torch.zeros(arch.vocab_size, arch.hidden_size))  # the embedding is not saved
    return save_head(head, hf_config, directory)


@dataclass(frozen=True)
class StepTiming:
    """Decode steps of one request alone in the engine, after its prefill and a warm-up."""

    step_ms: list[float]
    tokens: list[int]  # tokens each timed step produced (1 for plain decoding)

    @property
    def median_ms(self) -> float:
        return statistics.median(self.step_ms)

    def to_json(self) -> dict[str, Any]:
        return {"median_ms": self.median_ms, "mean_ms": statistics.fmean(self.step_ms),
                "tokens_per_step": statistics.fmean(self.tokens), "steps": len(self.step_ms)}


def time_steps(engine, prompt_ids: list[int], warmup: int, timed: int, max_tokens_per_step: int = 1) -> StepTiming:
    """Wall time of each of `timed` steps of a greedy request (EOS ignored), which is then
    aborted. max_tokens_per_step: the most a step can produce (EAGLE-3: its depth + 1),
    so that the request outlives the timing."""
    device = engine.device
    params = SamplingParams(max_tokens=(warmup + timed + 2) * max_tokens_per_step + 8, temperature=0.0,
                            ignore_eos=True)
    request_id = engine.add_request(prompt_ids, params)
    produced = 0
    while produced == 0:  # prefill, up to the first token
        produced += _tokens_of(engine.step(), request_id)
    for _ in range(warmup):
        _tokens_of(engine.step(), request_id)
    times, tokens = [], []
    for _ in range(timed):
        synchronize(device)
        start = time.perf_counter()
        outputs = engine.step()
        synchronize(device)
        times.append(1000 * (time.perf_counter() - start))
        tokens.append(_tokens_of(outputs, request_id))
    engine.abort(request_id)
    while engine.has_unfinished:
        engine.step()
    if min(tokens) < 1:
        raise RuntimeError(f"a timed step produced no token ({tokens}): the request was not decoding alone")
    return StepTiming(times, tokens)


def _tokens_of(outputs, request_id: str) -> int:
    return sum(len(out.new_token_ids) for out in outputs if out.request_id == request_id)


def fixed_requests(vocab_size: int, count: int, input_len: int, output_len: int, seed: int) -> list[BenchRequest]:
    """`count` requests of random token ids, each to produce exactly output_len tokens."""
    return [BenchRequest(ids, output_len) for ids in random_prompts(vocab_size, count, input_len, seed)]


def shared_prefix_requests(vocab_size: int, num_groups: int, per_group: int, system_len: int, question_len: int,
                           output_len: int, seed: int) -> list[BenchRequest]:
    """SGLang's generated-shared-prefix workload in token ids: `num_groups` random system
    prompts, each followed by `per_group` random questions of its own, shuffled so that a
    group's requests arrive spread over the run."""
    rng = random.Random(seed)

    def draw(length: int) -> list[int]:
        return [rng.randrange(vocab_size) for _ in range(length)]

    systems = [draw(system_len) for _ in range(num_groups)]
    requests = [BenchRequest(systems[i // per_group] + draw(question_len), output_len)
                for i in range(num_groups * per_group)]
    rng.shuffle(requests)
    return requests
