"""A tiny chat model (tiny Llama + byte-level tokenizer with a ChatML template) and a tiny
ShareGPT file, so the EAGLE-3 training and evaluation CLIs run end to end in seconds."""

from __future__ import annotations

import json
from pathlib import Path

from conftest import save_tiny_llama

CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
TOPICS = ["cats", "rain", "maps", "tea", "bikes", "stars", "owls", "salt"]


def save_tiny_chat_model(path: Path) -> str:
    """Byte tokens 0..255, <|im_start|> = 256, <|im_end|> = 257 (EOS); vocab padded to 260."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    save_tiny_llama(path, vocab_size=260, bos_token_id=256, eos_token_id=257)
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    backend = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(alphabet)}, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    backend.decoder = decoders.ByteLevel()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<|im_start|>", eos_token="<|im_end|>")
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.save_pretrained(path)
    return str(path)


def write_tiny_sharegpt(path: Path, count: int = 48) -> str:
    """`count` usable two- or four-turn conversations in ShareGPT's format."""
    records = []
    for k in range(count):
        topic, other = TOPICS[k % len(TOPICS)], TOPICS[(k * 3 + 1) % len(TOPICS)]
        turns = [
            {"from": "human", "value": f"tell me about {topic}"},
            {"from": "gpt", "value": f"{topic} are nice. {topic} and {other}."},
        ]
        if k % 3 == 0:
            turns += [{"from": "human", "value": f"and {other}?"}, {"from": "gpt", "value": f"{other} too."}]
        records.append({"id": f"c{k}", "conversations": turns})
    path.write_text(json.dumps(records))
    return str(path)


def train_argv(model_dir: str, data_path: str, output_dir: Path, *extra: str) -> list[str]:
    return [
        "--model-path", model_dir, "--data-path", data_path, "--output-dir", str(output_dir),
        "--num-conversations", "32", "--max-seq-len", "96", "--draft-vocab-size", "192",
        "--ttt-steps", "3", "--batch-tokens", "384", "--epochs", "6", "--lr", "3e-3",
        "--warmup-steps", "5", "--checkpoint-every", "8", "--device", "cpu", "--no-progress",
        "--target-dtype", "float32",  # the tests' oracle; auto picks bfloat16 on CPUs with bf16 units
        *extra,
    ]
