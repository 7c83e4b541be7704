"""ShareGPT parsing, the usable filter, the held-out split and the chat conversions."""

from __future__ import annotations

import json

import pytest

from eaglesrv.data import sharegpt
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
from eaglesrv.utils.package_fetch import PackageFetchError

# Records, odd whitespace between them, non-ASCII text, and a last record cut off
# mid-string, as in the shipped file.
TRUNCATED = (
    '[\n  {"id": "a_0", "conversations": [{"from": "human", "value": "Hi, caf\\u00e9 \u00e9\u00e8"},'
    ' {"from": "gpt", "value": "Hello!"}]},\n'
    '\t{"id": "b_0", "conversations": [{"from": "gpt", "value": "mid-chat [x], {y}"}]} ,\r\n'
    '  {"id": "c_0", "conversations": []},'
    '{"id": "d_0", "conversations": [{"from": "human", "value": "\u4f60\u597d"},'
    ' {"from": "gpt", "value": "\u4f60\u597d\uff01"}]},\n'
    '  {"id": "e_0", "conversations": [{"from": "human", "value": "cut off he'
)


def _write(tmp_path, text, name="data.json"):
    path = tmp_path / name
    path.write_text(text, encoding="utf-8")
    return path


@pytest.mark.parametrize("chunk", [3, 17, 1 << 20])
def test_parser_keeps_complete_records_and_drops_truncated_tail(tmp_path, monkeypatch, chunk):
    # Tiny chunks force records, escapes and separators across read boundaries.
    monkeypatch.setattr(sharegpt, "_CHUNK_CHARS", chunk)
    path = _write(tmp_path, TRUNCATED)
    records = list(iter_records(path))
    assert [r["id"] for r in records] == ["a_0", "b_0", "c_0", "d_0"]
    assert records[0]["conversations"][0]["value"] == "Hi, caf\u00e9 \u00e9\u00e8"
    assert records[1]["conversations"][0]["value"] == "mid-chat [x], {y}"


def test_parser_reads_a_complete_array_and_empty_ones(tmp_path):
    full = _write(tmp_path, '[{"id": "x", "conversations": []} , {"id": "y"}]\n')
    assert [r["id"] for r in iter_records(full)] == ["x", "y"]
    assert list(iter_records(_write(tmp_path, " [ ] ", "empty.json"))) == []
    assert list(iter_records(_write(tmp_path, "[", "open.json"))) == []
    with pytest.raises(ValueError, match="JSON array"):
        list(iter_records(_write(tmp_path, '{"id": "x"}', "obj.json")))
    with pytest.raises(ValueError, match="objects"):
        list(iter_records(_write(tmp_path, "[1, 2]", "nums.json")))


def test_parser_rejects_corruption_before_the_tail(tmp_path, monkeypatch):
    monkeypatch.setattr(sharegpt, "_CHUNK_CHARS", 64)
    monkeypatch.setattr(sharegpt, "_MAX_RECORD_CHARS", 100)
    good = '{"id": "ok", "conversations": []}'
    path = _write(tmp_path, "[" + good + ', {"id": oops}, ' + ", ".join([good] * 20) + "]")
    with pytest.raises(ValueError, match="corrupt"):
        list(iter_records(path))


def test_load_conversations_builds_turns(tmp_path):
    convs = load_conversations(_write(tmp_path, TRUNCATED))
    assert [c.id for c in convs] == ["a_0", "b_0", "c_0", "d_0"]
    assert convs[0].turns == (Turn("human", "Hi, caf\u00e9 \u00e9\u00e8"), Turn("gpt", "Hello!"))
    assert convs[2].turns == ()
    # Usable: a_0 and d_0 (b_0 opens with gpt, c_0 is empty).
    assert [c.id for c in usable_conversations(tmp_path / "data.json")] == ["a_0", "d_0"]


def _conv(cid: str, *roles: str) -> Conversation:
    return Conversation(cid, tuple(Turn(r, f"{cid}:{i}") for i, r in enumerate(roles)))


def test_usable_definition():
    assert is_usable(_conv("a", "human", "gpt"))
    assert is_usable(_conv("b", "user", "gpt"))
    assert is_usable(_conv("c", "human", "human", "gpt", "human"))  # reply need not be turn 1
    assert not is_usable(_conv("d", "human"))
    assert not is_usable(_conv("e", "human", "human"))  # no reply at all
    assert not is_usable(_conv("f", "gpt", "human", "gpt"))  # starts mid-conversation
    assert not is_usable(_conv("g", "system", "human", "gpt"))
    assert not is_usable(_conv("h", "human", "bard"))
    assert not is_usable(_conv("i"))


def test_split_is_first_training_conversations_in_order():
    good = [_conv(f"u{i}", "human", "gpt") for i in range(TRAINING_CONVERSATIONS + 5)]
    # Unusable ones interleaved must neither count towards nor appear in either side.
    mixed = []
    for i, conv in enumerate(good):
        mixed.append(conv)
        if i % 1000 == 0:
            mixed.append(_conv(f"x{i}", "gpt", "human"))
    usable = filter_usable(mixed)
    assert usable == good
    train, held = split_usable(usable)
    assert TRAINING_CONVERSATIONS == 8000
    assert train == good[:TRAINING_CONVERSATIONS]
    assert held == good[TRAINING_CONVERSATIONS:]
    assert held[0] not in train
    assert split_usable(good[:10]) == (good[:10], [])


def test_prompt_reply_pairs_and_chat_messages():
    conv = Conversation("z", (Turn("human", "q1"), Turn("human", "q1b"), Turn("gpt", "a1"),
                              Turn("human", "q2"), Turn("chatgpt", "other"), Turn("gpt", "a2")))
    assert prompt_reply_pairs([conv, _conv("f", "gpt", "human", "gpt")]) == [("q1", "a1")]
    sys_conv = Conversation("s", (Turn("system", "be nice"), Turn("user", "hi"), Turn("gpt", "yo")))
    assert to_chat_messages(sys_conv) == [
        {"role": "system", "content": "be nice"},
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "yo"},
    ]
    roles = [m["role"] for m in to_chat_messages(conv)]
    assert roles == ["user", "user", "assistant", "user", "assistant"]  # "chatgpt" dropped
    json.dumps(to_chat_messages(conv))  # plain JSON, ready for an OpenAI request


@pytest.fixture(scope="module")
def real_path():
    try:
        return sharegpt_path()
    except PackageFetchError as err:
        pytest.skip(f"ShareGPT data not available offline: {err}")


@pytest.mark.slow
def test_real_file_counts_and_split(real_path):
    convs = load_conversations(real_path)
    assert len(convs) == 17671
    usable = usable_conversations(real_path)
    assert len(usable) == 11142
    train, held = training_split(real_path), heldout_split(real_path)
    assert (len(train), len(held)) == (8000, 3142)
    assert train + held == usable
    assert held[0] not in train
    assert held[0].id not in {c.id for c in train}
    assert len(prompt_reply_pairs(convs)) == 11142
    assert to_chat_messages(train[0])[0]["role"] == "user"
