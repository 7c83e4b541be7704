"""Training sequences: ShareGPT conversations in the target's chat template, with a loss
mask over the assistant's tokens.

Only the first TRAINING_CONVERSATIONS usable conversations may be used (docs/architecture.md,
held-out rule); `training_conversations` asserts it.

Which tokens are the assistant's is read off the rendered text, not guessed per template:
for assistant message k, the template rendered up to message k-1 with a generation
prompt is a prefix of the template rendered up to message k; the characters between
them (trailing whitespace dropped, end-of-turn token kept) are the reply. Tokens whose
character span lies inside a reply get loss_mask True.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Sequence

from eaglesrv.data import TRAINING_CONVERSATIONS, Conversation, to_chat_messages, training_split, usable_conversations

Messages = list[dict[str, Any]]  # role, content; a regenerated reply also its REPLY_IDS
REPLY_IDS = "token_ids"  # the target's own ids of a regenerated reply (distill.py)


@dataclass(frozen=True)
class TrainingSequence:
    token_ids: list[int]
    loss_mask: list[bool]  # True where the token belongs to an assistant reply


def training_conversations(
    num: int | None, path: str | Path | None = None, offset: int = 0, reserved: int = 0
) -> list[Conversation]:
    """Usable conversations [offset, offset + num) in file order, never past the training
    split, nor into its last `reserved` (the validation conversations)."""
    usable = usable_conversations(path)
    split = training_split(path)
    limit = len(split) - reserved
    end = limit if num is None else offset + num
    if end > TRAINING_CONVERSATIONS:
        raise ValueError(f"conversations [{offset}, {end}) cross into the held-out ones: only the first "
                         f"{TRAINING_CONVERSATIONS} may be trained on")
    if reserved and end > limit:
        raise ValueError(f"conversations [{offset}, {end}) overlap the {reserved} validation conversations "
                         f"[{limit}, {len(split)}): lower --num-conversations or --val-conversations")
    chosen = split[offset:end]
    # The held-out rule, checked here rather than trusted: a slice of the usable list that
    # ends within the first TRAINING_CONVERSATIONS.
    assert offset + len(chosen) <= TRAINING_CONVERSATIONS, "training data crosses into the held-out ones"
    assert all(a == b for a, b in zip(chosen, usable[offset:])), "training data is not the usable conversations"
    return chosen


def validation_conversations(count: int, path: str | Path | None = None) -> tuple[int, list[Conversation]]:
    """(index of the first, conversations): the training split's last `count`, which a run
    validating on them does not train on. Never held-out ones: those are for evaluation."""
    split = training_split(path)
    if count > len(split):
        raise ValueError(f"--val-conversations {count}: the training split has only {len(split)}")
    return len(split) - count, split[len(split) - count:]


def conversation_messages(conversations: Iterable[Conversation], max_turns: int | None = None) -> list[Messages]:
    """Chat messages that end on an assistant turn (trailing user turns have no reply),
    cut after the `max_turns`-th assistant turn when given."""
    result = []
    for conversation in conversations:
        messages = to_chat_messages(conversation)
        replies = [k for k, m in enumerate(messages) if m["role"] == "assistant"]
        if max_turns is not None and len(replies) > max_turns:
            messages = messages[: replies[max_turns - 1] + 1]
        while messages and messages[-1]["role"] != "assistant":
            messages.pop()
        result.append(messages)
    return result


def render(tokenizer: Any, messages: Messages, generation_prompt: bool = False) -> str:
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt)


def prompt_ids(tokenizer: Any, messages: Messages) -> list[int]:
    """Token ids of `messages` ready for the assistant's reply.

    The template writes any BOS it wants, so special tokens are not added again (as
    the benchmarks and eval_acceptance do: the draft must see what it will be served).
    """
    return list(tokenizer(render(tokenizer, messages, True), add_special_tokens=False)["input_ids"])


def assistant_spans(tokenizer: Any, messages: Messages) -> tuple[str, list[tuple[int, int]]]:
    """The rendered conversation and the character span of every assistant reply."""
    text = render(tokenizer, messages)
    spans = []
    for k, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        before = render(tokenizer, messages[:k], True)
        upto = render(tokenizer, messages[: k + 1]).rstrip()
        if not (upto.startswith(before) and text.startswith(upto)):
            raise ValueError("chat template is not prefix-consistent; cannot locate assistant replies")
        spans.append((len(before), len(upto)))
    return text, spans


def encode(tokenizer: Any, messages: Messages, max_seq_len: int) -> TrainingSequence | None:
    """Tokenize one conversation, cut at max_seq_len; None when no reply token survives.

    A last reply that carries the target's own ids (self-distillation's `REPLY_IDS`) is
    taken as those ids, after the tokens of the prompt it was generated from: exactly
    what the target read and wrote. Earlier turns are the prompt's text, as a chat client
    would send them back."""
    if not messages:
        return None
    text, spans = assistant_spans(tokenizer, messages)
    generated = messages[-1].get(REPLY_IDS)
    if generated is not None:
        text = render(tokenizer, messages[:-1], True)  # a prefix of the whole (assistant_spans checked)
    encoding = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    ids = list(encoding["input_ids"])
    mask = [any(start <= a and b <= end for start, end in spans) and b > a for a, b in encoding["offset_mapping"]]
    if generated is not None:
        ids += generated
        mask += [True] * len(generated)
    ids, mask = ids[:max_seq_len], mask[:max_seq_len]
    # The draft predicts token t from position t - 2 on (see ttt.py): masks before that are moot.
    if not any(mask[2:]):
        return None
    return TrainingSequence(ids, mask)


def encode_all(tokenizer: Any, conversations: Sequence[Messages], max_seq_len: int) -> list[TrainingSequence]:
    encoded = (encode(tokenizer, messages, max_seq_len) for messages in conversations)
    return [sequence for sequence in encoded if sequence is not None]


def sequences_digest(sequences: Sequence[TrainingSequence]) -> str:
    """A content hash of the training sequences: caches built from them check it."""
    digest = hashlib.sha256()
    for sequence in sequences:
        digest.update(json.dumps([sequence.token_ids, sequence.loss_mask]).encode())
    return digest.hexdigest()[:16]


def data_summary(sequences: Sequence[TrainingSequence]) -> dict[str, int]:
    return {
        "sequences": len(sequences),
        "tokens": sum(len(s.token_ids) for s in sequences),
        "loss_tokens": sum(sum(s.loss_mask) for s in sequences),
    }
