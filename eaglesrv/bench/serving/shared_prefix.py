"""SGLang's "generated-shared-prefix" dataset: groups of requests that share a long system prompt.

The workload a prefix cache is for. Each of --gsp-num-groups groups has one random system
prompt (--gsp-system-prompt-len tokens), and each of its --gsp-prompts-per-group requests
is that system prompt, a blank line, and a random question of its own (--gsp-question-len
tokens), with --gsp-output-len output tokens. As in SGLang:
- the text is random token ids of the served model's vocabulary, decoded; a request's
  prompt length is its text's token count (which decoding and encoding again can move a
  little from the lengths asked for);
- the lengths are drawn from [max(int(len * ratio), 1), len] with --gsp-range-ratio,
  whose default 1.0 makes every length the one asked for; one system prompt length per
  group, a question and an output length per request;
- the requests are shuffled, so a group's requests arrive spread over the run, not one
  after another; --num-prompts does not apply (there are groups x prompts per group).
Unlike SGLang, special tokens (BOS, EOS, chat markers) are left out of the random text,
so that no prompt holds an end-of-text marker the server would read as one. The draws
come from --seed alone, so every run and every configuration gets the same requests.
"""

from __future__ import annotations

import random
from typing import Any

from eaglesrv.bench.serving.dataset import DatasetRow, apply_chat_template, random_lengths

# SGLang's defaults: 64 x 16 = 1,024 requests of a 2,048-token system prompt and a 128-token question.
GSP_DEFAULTS = {"gsp_num_groups": 64, "gsp_prompts_per_group": 16, "gsp_system_prompt_len": 2048,
                "gsp_question_len": 128, "gsp_output_len": 256}


def plain_token_ids(tokenizer: Any) -> list[int]:
    """Every id of the vocabulary except the special tokens', in id order."""
    special = set(getattr(tokenizer, "all_special_ids", None) or ())
    return sorted({i for i in tokenizer.get_vocab().values() if isinstance(i, int)} - special)


def _lengths(rng: random.Random, length: int, count: int, range_ratio: float) -> list[int]:
    # A length of 0 stays 0 (an empty question), where random_lengths would draw at least 1.
    return [0] * count if length <= 0 else random_lengths(rng, length, count, range_ratio)


def sample_generated_shared_prefix_requests(
    tokenizer: Any, num_groups: int, prompts_per_group: int, system_prompt_len: int, question_len: int,
    output_len: int, range_ratio: float = 1.0, *, chat_template: bool = False, seed: int = 1,
) -> list[DatasetRow]:
    """num_groups * prompts_per_group requests, shuffled (see the module docstring)."""
    if num_groups < 1 or prompts_per_group < 1:
        raise ValueError("--gsp-num-groups and --gsp-prompts-per-group must be at least 1")
    if output_len < 1 or system_prompt_len < 0 or question_len < 0:
        raise ValueError("--gsp-output-len must be at least 1, and the prompt lengths at least 0")
    if not 0.0 <= range_ratio <= 1.0:
        raise ValueError("--gsp-range-ratio must be in [0, 1]")
    rng = random.Random(seed)
    count = num_groups * prompts_per_group
    system_lens = _lengths(rng, system_prompt_len, num_groups, range_ratio)
    question_lens = _lengths(rng, question_len, count, range_ratio)
    output_lens = _lengths(rng, output_len, count, range_ratio)
    vocab = plain_token_ids(tokenizer)

    def random_text(length: int) -> str:
        return tokenizer.decode(rng.choices(vocab, k=length)) if length else ""

    system_prompts = [random_text(n) for n in system_lens]
    questions = [random_text(n) for n in question_lens]
    rows = []
    for index, question in enumerate(questions):  # group by group: request i is in group i // prompts_per_group
        prompt = f"{system_prompts[index // prompts_per_group]}\n\n{question}"
        if chat_template:
            prompt = apply_chat_template(tokenizer, prompt)
        rows.append(DatasetRow(prompt, len(tokenizer.encode(prompt)), output_lens[index]))
    rng.shuffle(rows)
    return rows
