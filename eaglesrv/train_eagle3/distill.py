"""Self-distillation: the target rewrites every assistant turn of the training data.

The draft is scored on how often it guesses what the *target* will say, so training on
the target's own replies (rather than ChatGPT's) gives the best acceptance (EAGLE-3 and
SpecForge both regenerate their data). Turns are rewritten in order: reply k is generated
from the user turns and the target's own replies 1 .. k-1, until the conversation fills
max_seq_len tokens. Conversations are generated in batches through Engine.generate.

Results are appended to a JSONL cache one batch at a time, each under its conversation's
index in the file, so an interrupted run picks up where it stopped and a run over another
slice of the data reuses what overlaps; the first line holds the settings fingerprint the
cache belongs to.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Sequence

from tqdm.auto import tqdm

from eaglesrv.engine.llm_engine import Engine
from eaglesrv.sampling_params import SamplingParams
from eaglesrv.train_eagle3.data import Messages, prompt_ids

MIN_REPLY_TOKENS = 8  # a reply shorter than this budget is not worth generating


def regenerate(
    engine: Engine,
    conversations: Sequence[Messages],
    indices: Sequence[int],  # each conversation's index among the usable ones (cache key, seed)
    cache_file: Path,
    fingerprint: str,
    max_seq_len: int,
    temperature: float,
    seed: int,
    batch_size: int,
    max_new_tokens: int | None = None,
    progress: bool = True,
) -> list[Messages]:
    """The conversations with every assistant turn replaced by the target's reply."""
    done = _read_cache(cache_file, fingerprint)
    # Rewrite what survived, so that a line cut by an interruption is not left mid-file.
    cache_file.parent.mkdir(parents=True, exist_ok=True)
    lines = [json.dumps({"fingerprint": fingerprint})]
    lines += [json.dumps({"index": i, "messages": m}) for i, m in sorted(done.items())]
    cache_file.write_text("\n".join(lines) + "\n")
    if len(indices) != len(conversations):
        raise ValueError("one index per conversation")
    todo = [k for k, index in enumerate(indices) if index not in done]
    bar = tqdm(total=len(conversations), initial=len(conversations) - len(todo), desc="self-distill",
               unit="conv", disable=not progress)
    for start in range(0, len(todo), batch_size):
        chunk = todo[start : start + batch_size]
        chunk_indices = [indices[k] for k in chunk]
        rewritten = _rewrite_batch(engine, [conversations[k] for k in chunk], chunk_indices, max_seq_len,
                                   max_new_tokens, temperature, seed)
        with cache_file.open("a") as f:
            for index, messages in zip(chunk_indices, rewritten):
                f.write(json.dumps({"index": index, "messages": messages}) + "\n")
                done[index] = messages
        bar.update(len(chunk))
    bar.close()
    return [done[index] for index in indices]


def _rewrite_batch(
    engine: Engine,
    batch: Sequence[Messages],
    indices: Sequence[int],
    max_seq_len: int,
    max_new_tokens: int | None,
    temperature: float,
    seed: int,
) -> list[Messages]:
    tokenizer = engine.tokenizer
    rewritten: list[Messages] = [[] for _ in batch]
    cursor = [0] * len(batch)  # next original message to take, per conversation
    active = [b for b, messages in enumerate(batch) if messages]
    round_index = 0
    while active:
        requests, params, owners = [], [], []
        for b in active:
            messages = batch[b]
            while cursor[b] < len(messages) and messages[cursor[b]]["role"] != "assistant":
                rewritten[b].append(messages[cursor[b]])  # user / system turns are kept as they are
                cursor[b] += 1
            if cursor[b] >= len(messages):
                continue
            ids = prompt_ids(tokenizer, rewritten[b])
            room = max_seq_len - len(ids)
            if room < MIN_REPLY_TOKENS:
                continue
            budget = room if max_new_tokens is None else min(room, max_new_tokens)
            requests.append(ids)
            # One seed per (run, conversation, turn): sampled replies do not depend on batching.
            params.append(SamplingParams(temperature=temperature, max_tokens=budget,
                                         seed=(seed * 1_000_003 + indices[b] * 1_009 + round_index) % 2**63))
            owners.append(b)
        if not requests:
            break
        results = engine.generate(requests, params)
        active = []
        for b, result in zip(owners, results):
            rewritten[b].append({"role": "assistant", "content": result.text or ""})
            cursor[b] += 1
            if result.finish_reason != "length":  # a reply cut short ends the conversation
                active.append(b)
        round_index += 1
    # Keep only complete exchanges: drop user turns left without a reply.
    for messages in rewritten:
        while messages and messages[-1]["role"] != "assistant":
            messages.pop()
    return rewritten


def _read_cache(cache_file: Path, fingerprint: str) -> dict[int, Messages]:
    if not cache_file.exists():
        return {}
    lines = cache_file.read_text().splitlines()
    if not lines or json.loads(lines[0]).get("fingerprint") != fingerprint:
        return {}  # built under other settings: start over
    done = {}
    for line in lines[1:]:
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            break  # a line cut by an interruption: regenerate from there
        done[record["index"]] = record["messages"]
    return done
