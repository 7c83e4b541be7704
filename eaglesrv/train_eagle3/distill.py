"""Self-distillation: the target rewrites every assistant turn of the training data.

The draft is scored on how often it guesses what the *target* will say, so training on
the target's own replies (rather than ChatGPT's) gives the best acceptance (EAGLE-3 and
SpecForge both regenerate their data). Turns are rewritten in order: reply k is generated
from the user turns and the target's own replies 1 .. k-1, until the conversation fills
max_seq_len tokens. Up to `batch_size` conversations are in flight at once, on the engine's
continuous batching: when a reply ends, that conversation's next turn (or the next
conversation) takes its place, so the batch stays full instead of waiting for the
longest reply of a fixed group.

Each regenerated turn keeps the target's token ids beside its text (`REPLY_IDS`): the
text, tokenized again, does not always give them back, and the training sequence should
hold what the target generated. Results are appended to a JSONL cache one conversation
at a time, each under its index in the file, so an interrupted run picks up where it
stopped and a run over another slice of the data reuses what overlaps; the first line
holds the settings fingerprint the cache belongs to.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

from tqdm.auto import tqdm

from eaglesrv.engine.llm_engine import Engine
from eaglesrv.sampling_params import SamplingParams
from eaglesrv.train_eagle3.data import REPLY_IDS, Messages, prompt_ids

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
    if len(indices) != len(conversations):
        raise ValueError("one index per conversation")
    done = read_cache(cache_file, fingerprint)
    # Rewrite what survived, so that a line cut by an interruption is not left mid-file.
    cache_file.parent.mkdir(parents=True, exist_ok=True)
    lines = [json.dumps({"fingerprint": fingerprint})]
    lines += [json.dumps({"index": i, "messages": m}) for i, m in sorted(done.items())]
    cache_file.write_text("\n".join(lines) + "\n")
    todo = [_Rewrite(index, conversations[k]) for k, index in enumerate(indices) if index not in done]
    todo.reverse()  # popped from the end: file order
    budget = _ReplyBudget(engine, max_seq_len, max_new_tokens, temperature, seed)
    in_flight: dict[str, _Rewrite] = {}
    bar = tqdm(total=len(conversations), initial=len(conversations) - len(todo), desc="self-distill",
               unit="conv", disable=not progress)
    with cache_file.open("a") as cache:
        while todo or in_flight:
            while todo and len(in_flight) < batch_size:
                _advance(todo.pop(), budget, in_flight, cache, done, bar)
            for out in engine.step():
                rewrite = in_flight.get(out.request_id)
                if rewrite is None:
                    continue
                rewrite.reply_ids.extend(out.new_token_ids)
                if out.finished:
                    del in_flight[out.request_id]
                    rewrite.take_reply(engine.decode(rewrite.reply_ids), cut=out.finish_reason == "length")
                    _advance(rewrite, budget, in_flight, cache, done, bar)
    bar.close()
    return [done[index] for index in indices]


@dataclass
class _Rewrite:
    """One conversation being rewritten: user turns as they are, assistant turns regenerated."""

    index: int
    original: Messages
    rewritten: Messages = field(default_factory=list)
    cursor: int = 0  # next original message to take
    turn: int = 0  # assistant turns generated so far
    ended: bool = False  # a reply was cut by its budget: the conversation stops there
    reply_ids: list[int] = field(default_factory=list)

    def next_history(self) -> Messages | None:
        """The history the next reply continues, or None when the conversation is complete."""
        while self.cursor < len(self.original) and self.original[self.cursor]["role"] != "assistant":
            self.rewritten.append(self.original[self.cursor])  # user / system turns are kept as they are
            self.cursor += 1
        if self.ended or self.cursor >= len(self.original):
            return None
        return self.rewritten

    def take_reply(self, text: str, cut: bool) -> None:
        # The ids too: text does not always tokenize back to them (data.encode uses them).
        self.rewritten.append({"role": "assistant", "content": text or "", REPLY_IDS: self.reply_ids})
        self.cursor += 1
        self.turn += 1
        self.ended = cut
        self.reply_ids = []

    def finished_messages(self) -> Messages:
        """Complete exchanges only: user turns left without a reply are dropped."""
        messages = list(self.rewritten)
        while messages and messages[-1]["role"] != "assistant":
            messages.pop()
        return messages


@dataclass(frozen=True)
class _ReplyBudget:
    engine: Engine
    max_seq_len: int
    max_new_tokens: int | None
    temperature: float
    seed: int

    def request(self, rewrite: _Rewrite, history: Messages) -> tuple[list[int], SamplingParams] | None:
        """The next reply's prompt and sampling settings, or None when too little room is left."""
        ids = prompt_ids(self.engine.tokenizer, history)
        room = self.max_seq_len - len(ids)
        if room < MIN_REPLY_TOKENS:
            return None
        tokens = room if self.max_new_tokens is None else min(room, self.max_new_tokens)
        # One seed per (run, conversation, turn): sampled replies do not depend on batching.
        seed = (self.seed * 1_000_003 + rewrite.index * 1_009 + rewrite.turn) % 2**63
        return ids, SamplingParams(temperature=self.temperature, max_tokens=tokens, seed=seed)


def _advance(rewrite: _Rewrite, budget: _ReplyBudget, in_flight: dict, cache, done: dict, bar) -> None:
    """Queue the conversation's next reply, or record it as finished."""
    history = rewrite.next_history()
    request = budget.request(rewrite, history) if history is not None else None
    if request is not None:
        in_flight[budget.engine.add_request(*request)] = rewrite
        return
    messages = rewrite.finished_messages()
    cache.write(json.dumps({"index": rewrite.index, "messages": messages}) + "\n")
    cache.flush()
    done[rewrite.index] = messages
    bar.update(1)


def read_cache(cache_file: Path, fingerprint: str | None = None) -> dict[int, Messages]:
    """The conversations a cache holds, by index: none when it was built under another
    fingerprint than the one given (None: whatever settings it was built under)."""
    if not cache_file.exists():
        return {}
    lines = cache_file.read_text().splitlines()
    if not lines or (fingerprint is not None and json.loads(lines[0]).get("fingerprint") != fingerprint):
        return {}  # built under other settings: start over
    done = {}
    for line in lines[1:]:
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            break  # a line cut by an interruption: regenerate from there
        done[record["index"]] = record["messages"]
    return done
