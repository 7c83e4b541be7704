"""Datasets: ShareGPT conversations for benchmarks and EAGLE-3 training.

The held-out rule lives in `eaglesrv.data.sharegpt` (TRAINING_CONVERSATIONS).
"""

from eaglesrv.data.sharegpt import (
    TRAINING_CONVERSATIONS,
    Conversation,
    Turn,
    filter_usable,
    heldout_split,
    is_usable,
    iter_records,
    load_conversations,
    prompt_reply_pairs,
    sharegpt_path,
    split_usable,
    to_chat_messages,
    training_split,
    usable_conversations,
)

__all__ = [
    "TRAINING_CONVERSATIONS",
    "Conversation",
    "Turn",
    "filter_usable",
    "heldout_split",
    "is_usable",
    "iter_records",
    "load_conversations",
    "prompt_reply_pairs",
    "sharegpt_path",
    "split_usable",
    "to_chat_messages",
    "training_split",
    "usable_conversations",
]
