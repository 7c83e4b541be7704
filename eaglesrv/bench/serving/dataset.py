"""Requests for `bench_serving`: ShareGPT prompts or random-length ones, sampled as SGLang does.
(SGLang's generated-shared-prefix dataset: shared_prefix.py; multi-turn conversations: multiturn.py.)

ShareGPT: conversations are shuffled with the seed; the first human turn is the prompt
and the token length of the first reply is the output length (or --sharegpt-output-len);
pairs that are too short (prompt or output under 4 tokens) or too long (prompt over 1024
tokens, or prompt plus output over 2048, or over --sharegpt-context-len) are skipped,
and the first num_prompts that pass are kept. --sharegpt-max-output-len (ours) caps the
reply's length instead of replacing it, keeping ShareGPT's spread of output lengths.
Unlike SGLang, which samples the whole file, we draw from the held-out conversations by
default (the project's rule: anything trained may have seen the first 8,000; see
eaglesrv/data/sharegpt.py).

Random: SGLang's "random" dataset. Lengths are drawn uniformly from
[max(int(len * ratio), 1), len]; each prompt is a ShareGPT prompt's token ids repeated or
cut to its length, decoded back to text.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any, Literal, Sequence

from eaglesrv.data import load_conversations, prompt_reply_pairs, split_usable, usable_conversations

Split = Literal["heldout", "all"]
SPLITS: tuple[str, ...] = ("heldout", "all")

# The usual ShareGPT filter of SGLang's and vLLM's benchmarks.
MIN_TOKENS = 4
MAX_PROMPT_TOKENS = 1024
MAX_TOTAL_TOKENS = 2048


@dataclass(frozen=True)
class DatasetRow:
    prompt: str  # sent as is (or as the user message, for chat backends)
    prompt_len: int  # the prompt's length in the served model's tokens, counted here
    output_len: int  # max_new_tokens of the request


def sharegpt_pairs(dataset_path: str | None, split: Split) -> list[tuple[str, str]]:
    """(first human turn, first reply) of the split's usable conversations, in file order."""
    if split == "heldout":
        return prompt_reply_pairs(split_usable(usable_conversations(dataset_path))[1])
    if split == "all":
        return prompt_reply_pairs(load_conversations(dataset_path))
    raise ValueError(f"unknown split {split!r}; valid: {', '.join(SPLITS)}")


def render_chat(tokenizer: Any, messages: Sequence[dict[str, str]]) -> str:
    """The messages in the tokenizer's chat template, ready for the assistant's reply, without
    the BOS the server would add again."""
    text = tokenizer.apply_chat_template(list(messages), add_generation_prompt=True, tokenize=False)
    return text.replace(tokenizer.bos_token, "") if tokenizer.bos_token else text


def apply_chat_template(tokenizer: Any, prompt: str) -> str:
    """The prompt as one user turn ready for the reply (see `render_chat`)."""
    return render_chat(tokenizer, [{"role": "user", "content": prompt}])


def sample_sharegpt_requests(
    tokenizer: Any, num_prompts: int, *, dataset_path: str | None = None, split: Split = "heldout",
    fixed_output_len: int | None = None, max_output_len: int | None = None, context_len: int | None = None,
    chat_template: bool = False, seed: int = 1,
) -> list[DatasetRow]:
    """num_prompts ShareGPT requests (see the module docstring); ValueError if fewer pass."""
    for flag, value in (("--sharegpt-output-len", fixed_output_len), ("--sharegpt-max-output-len", max_output_len)):
        if value is not None and value < MIN_TOKENS:
            raise ValueError(f"{flag} must be at least {MIN_TOKENS}")
    pairs = sharegpt_pairs(dataset_path, split)
    random.Random(seed).shuffle(pairs)
    max_total = context_len or MAX_TOTAL_TOKENS
    rows: list[DatasetRow] = []
    for prompt, reply in pairs:
        if len(rows) == num_prompts:
            break
        if chat_template:
            prompt = apply_chat_template(tokenizer, prompt)
        # Counted as SGLang counts them: encode() with the tokenizer's special tokens.
        prompt_len = len(tokenizer.encode(prompt))
        output_len = len(tokenizer.encode(reply)) if fixed_output_len is None else fixed_output_len
        if max_output_len is not None:
            output_len = min(output_len, max_output_len)
        if prompt_len < MIN_TOKENS or output_len < MIN_TOKENS:
            continue
        if prompt_len > MAX_PROMPT_TOKENS or prompt_len + output_len > max_total:
            continue
        rows.append(DatasetRow(prompt, prompt_len, output_len))
    if len(rows) < num_prompts:
        raise ValueError(f"only {len(rows)} of the {len(pairs)} {split} ShareGPT conversations pass the length "
                         f"filter; asked for {num_prompts} (try --sharegpt-split all)")
    return rows


def random_lengths(rng: random.Random, length: int, count: int, range_ratio: float) -> list[int]:
    """count lengths drawn uniformly from [max(int(length * range_ratio), 1), length]."""
    low = max(int(length * range_ratio), 1)
    return [rng.randint(low, max(length, low)) for _ in range(count)]


def sample_random_requests(
    tokenizer: Any, num_prompts: int, input_len: int, output_len: int, range_ratio: float, *,
    dataset_path: str | None = None, split: Split = "heldout", seed: int = 1,
) -> list[DatasetRow]:
    """Random-length requests whose text comes from ShareGPT prompts (SGLang's "random")."""
    if not 0.0 <= range_ratio <= 1.0:
        raise ValueError("--random-range-ratio must be in [0, 1]")
    rng = random.Random(seed)
    input_lens = random_lengths(rng, input_len, num_prompts, range_ratio)
    output_lens = random_lengths(rng, output_len, num_prompts, range_ratio)
    pairs = sharegpt_pairs(dataset_path, split)
    rng.shuffle(pairs)
    rows: list[DatasetRow] = []
    for prompt, _ in pairs:
        if len(rows) == num_prompts:
            break
        ids = tokenizer.encode(prompt, add_special_tokens=False)
        if not ids:
            continue
        want = input_lens[len(rows)]
        ids = (ids * (want // len(ids) + 1))[:want]  # repeated, then cut to the drawn length
        rows.append(DatasetRow(tokenizer.decode(ids), want, output_lens[len(rows)]))
    if len(rows) < num_prompts:
        raise ValueError(f"only {len(rows)} non-empty ShareGPT prompts to build random requests from")
    return rows


def summarize(rows: Sequence[Any]) -> str:
    """The workload's tokens; for multi-turn conversations (rows with num_turns), the user turns' own."""
    text = (f"#Input tokens: {sum(r.prompt_len for r in rows)}\n"
            f"#Output tokens: {sum(r.output_len for r in rows)}")
    if rows and hasattr(rows[0], "num_turns"):
        text = (f"#Conversations: {len(rows)}, #Turns: {sum(r.num_turns for r in rows)} "
                "(input tokens: the user turns', without the history each turn resends)\n" + text)
    return text
