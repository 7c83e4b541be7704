"""Which tokens a grammar allows next, per request: the engine's side of structured output.

The runner owns one `GrammarMatchers`; it keeps an llguidance matcher per request that
asks for a grammar (SamplingParams.grammar, built and checked by eaglesrv/grammar/), and
drops it in StepRunner.release. A matcher's state is derived from the sequence, never
pushed: before each use it consumes the request's output tokens it has not seen (the
scheduler only ever appends to them), so preemption, speculation and aborts need no hooks.

    allowed_now(seqs)         the mask after each request's committed tokens: plain
                              sampling and the bonus token after a tree
    tree_masks(seq, tree)     the mask after every node's path through a draft tree:
                              verification masks the target's distribution at each node
                              the same way, so greedy output equals plain decoding's
                              and sampling keeps the masked distribution exactly
    path_masks(seq, paths)    the same for the draft's frontier, to mask what it proposes

A mask is bool [vocab] (True: allowed). When the grammar is complete only EOS is allowed,
so the request stops with finish_reason "stop".
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch

from eaglesrv.grammar.build import checked

logger = logging.getLogger(__name__)

_COMPILED_GRAMMARS = 64  # distinct grammars kept compiled (a request copies one: microseconds)


class _Broken:
    """The matcher of a request whose grammar failed to compile: it allows EOS only."""

    def is_error(self) -> bool:
        return True

    def consume_token(self, token: int) -> bool:
        return False

    def consume_tokens(self, tokens) -> bool:
        return False

    def validate_tokens(self, tokens) -> int:
        return 0


_BROKEN = _Broken()


@dataclass
class _RequestMatcher:
    matcher: Any  # llguidance.LLMatcher
    consumed: int = 0  # output tokens the matcher has consumed


class GrammarMatchers:
    def __init__(self, load_tokenizer: Callable[[], Any], vocab_size: int, eos_token_ids: Sequence[int]) -> None:
        # A transformers fast tokenizer, asked for at the first grammar: a tensor-parallel
        # follower needs it for nothing else, and loading one can take seconds.
        self._load_tokenizer = load_tokenizer
        self.vocab_size = vocab_size  # the width of the logits the masks apply to
        self.eos_token_ids = sorted(eos_token_ids)
        self._eos = frozenset(eos_token_ids)
        self._lltokenizer = None  # built at the first grammar (about 0.4 s for a 49k vocabulary)
        self._scratch: torch.Tensor | None = None  # one row at llguidance's width, made with it
        self._compiled: OrderedDict[str, Any] = OrderedDict()  # grammar -> a fresh matcher, LRU
        self._requests: dict[str, _RequestMatcher] = {}
        self._words = (vocab_size + 31) // 32
        self._bits = torch.arange(32, dtype=torch.int32)

    # ---- compiling ----------------------------------------------------------------------
    def check(self, grammar: str) -> None:
        """GrammarError (a ValueError) naming the problem if `grammar` cannot be enforced: the
        server's own check, cached per grammar. Touches none of this object's state, so any
        thread may call it (Engine.add_request); the step compiles it."""
        checked(grammar)

    def _compile(self, grammar: str):
        template = self._compiled.get(grammar)
        if template is not None:
            self._compiled.move_to_end(grammar)
            return template
        import llguidance

        template = llguidance.LLMatcher(self._ll_tokenizer(), grammar, log_level=0)
        if template.is_error():
            raise ValueError(f"the grammar cannot be enforced: {template.get_error()}")
        self._compiled[grammar] = template
        if len(self._compiled) > _COMPILED_GRAMMARS:
            self._compiled.popitem(last=False)
        return template

    def _ll_tokenizer(self):
        if self._lltokenizer is None:
            import llguidance.hf

            tokenizer = self._load_tokenizer()
            vocab = max(self.vocab_size, len(tokenizer))
            self._lltokenizer = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab,
                                                             eos_token=self.eos_token_ids)
            # llguidance fills the tokenizer's width; the masks keep the logits' part
            self._scratch = torch.empty(1, (vocab + 31) // 32, dtype=torch.int32)
        return self._lltokenizer

    # ---- per request --------------------------------------------------------------------
    def release(self, request_ids) -> None:
        for request_id in request_ids:
            self._requests.pop(request_id, None)

    def _synced(self, seq):
        """The request's matcher, having consumed exactly its committed output tokens."""
        state = self._requests.get(seq.request_id)
        if state is None:
            state = self._requests[seq.request_id] = _RequestMatcher(self._new_matcher(seq))
        output = seq.output_token_ids
        if state.consumed < len(output) and not state.matcher.is_error():  # an error is logged once
            if not state.matcher.consume_tokens(list(output[state.consumed:])):
                logger.warning("request %s: an output token broke its grammar (%s); only EOS is allowed now",
                               seq.request_id, state.matcher.get_error())
            state.consumed = len(output)
        return state.matcher

    def _new_matcher(self, seq):
        try:
            return self._compile(seq.params.grammar).deep_copy()
        except ValueError as exc:  # checked at admission, so only a tokenizer-specific failure gets here
            logger.warning("request %s: %s; only EOS is allowed", seq.request_id, exc)
            return _BROKEN

    def allowed_now(self, seqs) -> dict[int, torch.Tensor]:
        """Row -> bool [vocab] mask for the sequences that have a grammar."""
        rows = [i for i, seq in enumerate(seqs) if seq.params.grammar]
        if not rows:
            return {}
        bitmask = self._bitmask(len(rows))
        for k, i in enumerate(rows):
            self._fill(self._synced(seqs[i]), bitmask, k)
        return dict(zip(rows, self._unpack(bitmask)))

    def tree_masks(self, seq, node_tokens: list[int], parents: list[int]) -> torch.Tensor:
        """bool [nodes, vocab]: row i allows what the grammar allows after the path root .. i
        (the root token is the last committed one). A node whose own token the grammar
        forbids can never be accepted, and nothing after an EOS node is kept: their
        subtrees' rows are left all-allowed."""
        matcher = self._synced(seq)
        children: list[list[int]] = [[] for _ in node_tokens]
        for node, parent in enumerate(parents):
            if parent >= 0:
                children[parent].append(node)
        bitmask = self._bitmask(len(node_tokens))
        self._fill(matcher, bitmask, 0)
        stack = [(child, False) for child in reversed(children[0])]
        while stack:  # depth first: consume a node's token on entering it, roll it back on leaving its subtree
            node, leaving = stack.pop()
            if leaving:
                matcher.rollback(1)
            elif self._descends(bitmask[parents[node]], node_tokens[node]) and matcher.consume_token(node_tokens[node]):
                self._fill(matcher, bitmask, node)
                stack.append((node, True))
                stack += [(child, False) for child in reversed(children[node])]
        return self._unpack(bitmask)

    def path_masks(self, seq, paths: list[list[int]]) -> torch.Tensor:
        """bool [len(paths), vocab]: what the grammar allows after each path of tokens past
        the committed ones (all-allowed for a path it forbids)."""
        matcher = self._synced(seq)
        bitmask = self._bitmask(len(paths))
        for row, path in enumerate(paths):
            valid = self._eos.isdisjoint(path) and matcher.validate_tokens(path) == len(path)
            if valid and matcher.consume_tokens(path):
                self._fill(matcher, bitmask, row)
                matcher.rollback(len(path))
        return self._unpack(bitmask)

    # ---- masks ---------------------------------------------------------------------------
    def _bitmask(self, rows: int) -> torch.Tensor:
        """int32 [rows, words], every token allowed until a row is filled."""
        return torch.full((rows, self._words), -1, dtype=torch.int32)

    def _fill(self, matcher, bitmask: torch.Tensor, row: int) -> None:
        """The matcher's next-token mask into bitmask[row]; EOS only for a broken matcher."""
        if matcher.is_error():  # a broken matcher too
            bitmask[row] = 0
            for eos in self.eos_token_ids:
                bitmask[row, eos // 32] |= _bit(eos % 32)
            return
        import llguidance.torch

        llguidance.torch.fill_next_token_bitmask(matcher, self._scratch, 0)
        bitmask[row] = self._scratch[0, : self._words]

    def _descends(self, words: torch.Tensor, token: int) -> bool:
        """Whether the tree walk enters a node with this token: the parent's mask allows
        it, and it is not EOS (the request ends there; and a stopped matcher takes EOS
        again without recording it, so rolling it back would undo a real token)."""
        return (token < self.vocab_size and token not in self._eos
                and bool((int(words[token // 32]) >> (token % 32)) & 1))

    def _unpack(self, bitmask: torch.Tensor) -> torch.Tensor:
        """int32 [rows, words] bitmask -> bool [rows, vocab]."""
        bits = (bitmask.unsqueeze(-1) >> self._bits) & 1
        return bits.view(bitmask.shape[0], -1)[:, : self.vocab_size].bool()


def _bit(index: int) -> int:
    """The int32 value with bit `index` set (bit 31 is the sign bit)."""
    return -(1 << 31) if index == 31 else 1 << index
