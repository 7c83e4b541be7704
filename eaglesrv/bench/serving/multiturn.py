"""Multi-turn ShareGPT conversations, replayed turn by turn ("sharegpt-multiturn").

SGLang's bench_serving has no such dataset (its multi-turn workloads are synthetic), so
the flags are ours: --num-prompts counts conversations, --multiturn-max-turns caps their
turns, and the ShareGPT flags apply to every turn.

Dataset: conversations are shuffled with the seed, as the single-turn ShareGPT prompts
are, and each keeps its alternating user and assistant turns from the start, up to the
first of: a turn out of that order, --multiturn-max-turns, a user turn that is empty or
over 1,024 tokens, a reply under 4 tokens, or a turn whose prompt (the conversation so
far in the chat template) plus its output would pass --sharegpt-context-len (default
2,048). A turn's output length is its recorded reply's token length, or
--sharegpt-output-len, capped by --sharegpt-max-output-len. Conversations left with fewer
than two turns are skipped: they would be single-turn requests.

Replay: each conversation sends its turns in order, each once the previous answer is
complete, and each turn's request carries the whole conversation so far: the earlier
user turns and the model's own answers to them (not the recorded replies), so a server
with a prefix cache finds the previous turn's prompt and answer cached. The chat
backends send the messages; the text backends send them in the tokenizer's chat template.
Conversations start at --request-rate (Poisson arrivals; all at once by default), and at
most --max-concurrency of them run at once, a conversation keeping its slot from its
first turn to its last. A turn that fails ends its conversation (the later turns need its
answer). Each turn is one request in the report; the section after it gives TTFT by turn.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import statistics
from collections import defaultdict
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Sequence

import httpx

from eaglesrv.bench.serving.client import (
    CHAT_BACKENDS,
    RequestInput,
    RequestRecord,
    request_func,
    start_spaced,
)
from eaglesrv.bench.serving.dataset import (
    MAX_PROMPT_TOKENS,
    MAX_TOTAL_TOKENS,
    MIN_TOKENS,
    DatasetRow,
    Split,
    render_chat,
)
from eaglesrv.data import Conversation, load_conversations, split_usable, to_chat_messages, usable_conversations

if TYPE_CHECKING:
    from tqdm import tqdm

    from eaglesrv.bench.serving.run import BenchSettings

MIN_TURNS = 2
Message = dict[str, str]


@dataclass(frozen=True)
class ConversationRow:
    """One conversation to replay: its user turns and the output length of each turn's request."""

    user_turns: tuple[str, ...]
    output_lens: tuple[int, ...]  # max_new_tokens of each turn's request
    user_lens: tuple[int, ...]  # each user turn's own tokens (without the history it is sent with)

    @property
    def num_turns(self) -> int:
        return len(self.user_turns)

    @property
    def prompt_len(self) -> int:
        """The tokens the user writes, over all turns (the requests resend the history too)."""
        return sum(self.user_lens)

    @property
    def output_len(self) -> int:
        return sum(self.output_lens)


def exchanges(conversation: Conversation) -> list[tuple[str, str]]:
    """(user turn, recorded reply) pairs from the start, up to the first turn out of that order."""
    messages = to_chat_messages(conversation)
    pairs = []
    for user, reply in zip(messages[::2], messages[1::2]):
        if (user["role"], reply["role"]) != ("user", "assistant"):
            break
        pairs.append((user["content"], reply["content"]))
    return pairs


def sharegpt_conversations(dataset_path: str | None, split: Split) -> list[Conversation]:
    if split == "heldout":
        return split_usable(usable_conversations(dataset_path))[1]
    if split == "all":
        return load_conversations(dataset_path)
    raise ValueError(f"unknown split {split!r}")


def _fit_turns(tokenizer: Any, pairs: Sequence[tuple[str, str]], fixed_output_len: int | None,
               max_output_len: int | None, max_total: int) -> ConversationRow:
    """The turns from the start that pass the filters of the module docstring."""
    history: list[Message] = []
    users, output_lens, user_lens = [], [], []
    drift = 0  # how many tokens longer the answers so far will be than the recorded replies
    for user, reply in pairs:
        user_len = len(tokenizer.encode(user, add_special_tokens=False))
        reply_len = len(tokenizer.encode(reply))  # counted as the single-turn ShareGPT requests count it
        output_len = reply_len if fixed_output_len is None else fixed_output_len
        if max_output_len is not None:
            output_len = min(output_len, max_output_len)
        if not 0 < user_len <= MAX_PROMPT_TOKENS or output_len < MIN_TOKENS:
            break
        prompt = render_chat(tokenizer, [*history, {"role": "user", "content": user}])
        if len(tokenizer.encode(prompt)) + drift + output_len > max_total:
            break
        users.append(user)
        output_lens.append(output_len)
        user_lens.append(user_len)
        history += [{"role": "user", "content": user}, {"role": "assistant", "content": reply}]
        drift += output_len - reply_len
    return ConversationRow(tuple(users), tuple(output_lens), tuple(user_lens))


def sample_sharegpt_conversations(
    tokenizer: Any, num_conversations: int, *, dataset_path: str | None = None, split: Split = "heldout",
    max_turns: int | None = None, fixed_output_len: int | None = None, max_output_len: int | None = None,
    context_len: int | None = None, seed: int = 1,
) -> list[ConversationRow]:
    """num_conversations multi-turn conversations (see the module docstring); ValueError if fewer pass."""
    if max_turns is not None and max_turns < 1:
        raise ValueError("--multiturn-max-turns must be at least 1")
    conversations = sharegpt_conversations(dataset_path, split)
    random.Random(seed).shuffle(conversations)
    min_turns = min(MIN_TURNS, max_turns or MIN_TURNS)
    rows: list[ConversationRow] = []
    for conversation in conversations:
        if len(rows) == num_conversations:
            break
        pairs = exchanges(conversation)[:max_turns]
        if len(pairs) < min_turns:
            continue
        row = _fit_turns(tokenizer, pairs, fixed_output_len, max_output_len, context_len or MAX_TOTAL_TOKENS)
        if row.num_turns >= min_turns:
            rows.append(row)
    if len(rows) < num_conversations:
        raise ValueError(f"only {len(rows)} of the {len(conversations)} {split} ShareGPT conversations keep "
                         f"{min_turns} turns or more; asked for {num_conversations} (try --sharegpt-split all "
                         "or a larger --sharegpt-context-len)")
    return rows


# ---- the replay ---------------------------------------------------------------------------
@dataclass(frozen=True)
class SentTurn:
    turn: int  # 1 for a conversation's first turn
    messages: tuple[Message, ...]  # the conversation so far, ending with this turn's user message
    record: RequestRecord


def first_turn_row(conversation: ConversationRow, tokenizer: Any, backend: str) -> DatasetRow:
    """The first turn as a single request (for the warm-up)."""
    text = conversation.user_turns[0]
    prompt = text if backend in CHAT_BACKENDS else render_chat(tokenizer, [{"role": "user", "content": text}])
    return DatasetRow(prompt, 0, conversation.output_lens[0])


async def replay_conversations(client: httpx.AsyncClient, settings: BenchSettings,
                               conversations: Sequence[ConversationRow], tokenizer: Any,
                               bar: tqdm | None) -> list[SentTurn]:
    """Every conversation, turn by turn (see the module docstring); the turns sent, by conversation.
    Prompt lengths are left at 0 for `count_prompt_tokens`, after the clock stops."""
    send = request_func(settings.backend)
    chat = settings.backend in CHAT_BACKENDS
    slots = asyncio.Semaphore(settings.max_concurrency) if settings.max_concurrency else None
    arrivals = random.Random(settings.seed)

    async def converse(conversation: ConversationRow) -> list[SentTurn]:
        sent: list[SentTurn] = []
        history: tuple[Message, ...] = ()
        async with slots if slots is not None else contextlib.nullcontext():
            for turn, (text, output_len) in enumerate(zip(conversation.user_turns, conversation.output_lens), 1):
                messages = (*history, {"role": "user", "content": text})
                inp = RequestInput(
                    prompt=text if chat else render_chat(tokenizer, messages), prompt_len=0, output_len=output_len,
                    model=settings.model, api_url=settings.api_url, stream=settings.stream,
                    ignore_eos=settings.ignore_eos, extra_body=settings.extra_request_body,
                    messages=messages if chat else None)
                out = await send(client, inp)
                sent.append(SentTurn(turn, messages, out))
                if bar is not None:
                    bar.update(1 if out.success else conversation.num_turns - turn + 1)
                if not out.success:
                    break
                history = (*messages, {"role": "assistant", "content": out.generated_text})
        return sent

    sent = await start_spaced(list(conversations), converse, settings.request_rate, arrivals)
    return [turn for turns in sent for turn in turns]


def count_prompt_tokens(sent: Sequence[SentTurn], tokenizer: Any) -> tuple[list[RequestRecord], list[int]]:
    """(records, turn numbers), each record's prompt length set to its conversation so far in the chat
    template (what the server prefilled, cached or not)."""
    for s in sent:
        s.record.prompt_len = len(tokenizer.encode(render_chat(tokenizer, s.messages)))
    return [s.record for s in sent], [s.turn for s in sent]


# ---- TTFT by turn ---------------------------------------------------------------------------
@dataclass(frozen=True)
class TurnStats:
    turn: int
    completed: int  # successful requests at this turn
    mean_input_tokens: float
    mean_ttft_ms: float
    median_ttft_ms: float


def turn_stats(outputs: Sequence[RequestRecord], turns: Sequence[int]) -> list[TurnStats]:
    """TTFT and prompt length by turn number, over the successful requests."""
    by_turn: dict[int, list[RequestRecord]] = defaultdict(list)
    for turn, out in zip(turns, outputs):
        if out.success:
            by_turn[turn].append(out)
    return [TurnStats(turn, len(outs), statistics.fmean(o.prompt_len for o in outs),
                      statistics.fmean(o.ttft for o in outs) * 1000.0,
                      statistics.median(o.ttft for o in outs) * 1000.0)
            for turn, outs in sorted(by_turn.items())]


def format_turn_report(stats: Sequence[TurnStats], conversations: int) -> str:
    lines = [f"{'TTFT by Turn':-^50}", f"{'Conversations:':<40} {conversations}",
             f"{'Turn':>4} {'Requests':>9} {'Input tokens':>13} {'Mean TTFT (ms)':>15} {'Median TTFT (ms)':>17}"]
    lines += [f"{s.turn:>4} {s.completed:>9} {s.mean_input_tokens:>13.1f} {s.mean_ttft_ms:>15.2f} "
              f"{s.median_ttft_ms:>17.2f}" for s in stats]
    return "\n".join(lines + ["=" * 50])
