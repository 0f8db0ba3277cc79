"""The draft model: a second, small decoder that proposes a request's next tokens greedily.

It must share the target's tokenizer (check_same_tokenizer), since its token ids are the
target's. Its K/V lives in its own block pool, with its own block table per request. Before
proposing, it catches up on the request's tokens it has not seen (the prompt, then the
accepted output) in one chunk, then proposes k tokens with k greedy (argmax) forwards.

It never needs rolling back explicitly: the tokens it has seen are valid up to the target's
num_computed, which after a verification covers the accepted proposals and nothing past them
(a rejected proposal's K/V, past that point, is overwritten before anything reads it).
"""

from __future__ import annotations

import torch

from gapless.engine.request import Request
from gapless.engine.runner import ChunkInput, ModelRunner
from gapless.kv.block_pool import BlockPool
from gapless.model.decoder import Decoder
from gapless.model.tokenizer import Tokenizer

# Texts whose token ids the two tokenizers must agree on, besides their vocabularies' sizes
# and special tokens.
_PROBES = ("Hello, world! 123", "def f(x):\n    return x  # café 日本語")


def check_same_tokenizer(target: Tokenizer, draft: Tokenizer) -> None:
    """Raises ValueError naming the first difference that would make the draft's token ids
    mean other tokens than the target's."""
    pairs = [
        ("vocabulary size", target.vocab_size, draft.vocab_size),
        ("special token ids", sorted(target.special_ids), sorted(draft.special_ids)),
        ("end-of-sequence ids", sorted(target.eos_token_ids), sorted(draft.eos_token_ids)),
        ("beginning-of-sequence id", target.bos_token_id, draft.bos_token_id),
    ]
    pairs += [
        (f"token ids of {text!r}", target.encode(text), draft.encode(text)) for text in _PROBES
    ]
    for what, mine, theirs in pairs:
        if mine != theirs:
            raise ValueError(
                f"the draft model's tokenizer differs from the target's: {what} "
                f"{theirs!r} against {mine!r}"
            )


def check_draft(target: tuple[Decoder, Tokenizer], draft: tuple[Decoder, Tokenizer]) -> None:
    """Raises ValueError unless the draft can propose the target's tokens: the same tokenizer,
    and as many vocabulary rows (its logits index the target's ids)."""
    check_same_tokenizer(target[1], draft[1])
    rows, draft_rows = target[0].config.vocab_size, draft[0].config.vocab_size
    if draft_rows != rows:
        raise ValueError(f"the draft model's vocabulary has {draft_rows} rows, the target's {rows}")


class DraftModel:
    def __init__(self, decoder: Decoder, num_blocks: int, block_size: int) -> None:
        self.runner = ModelRunner(decoder, num_blocks, block_size)
        self.pool = BlockPool(num_blocks, block_size)
        self._tables: dict[Request, list[int]] = {}
        self._seen: dict[Request, int] = {}  # leading tokens whose K/V the draft wrote

    def propose(self, request: Request, k: int) -> list[int]:
        """The k tokens the draft's argmax picks after the request's tokens, or none when its
        pool cannot hold them."""
        end = request.num_tokens
        seen = min(self._seen.get(request, 0), request.num_computed)
        table = self._tables.setdefault(request, [])
        need = -(-(end + k - 1) // self.pool.block_size) - len(table)
        if need > self.pool.num_available:
            return []
        if need > 0:
            table += self.pool.allocate(need)
        proposals: list[int] = []
        tokens, start = request.tokens(seen, end), seen
        for position in range(end, end + k):
            last_block = -(-(start + len(tokens)) // self.pool.block_size)
            logits, _ = self.runner.run([ChunkInput(tokens, start, table[:last_block], False)])
            proposals.append(int(torch.argmax(logits[-1])))
            tokens, start = proposals[-1:], position
        self._seen[request] = end + k - 1
        return proposals

    def release(self, request: Request) -> None:
        """Frees the request's draft blocks (it finished, was cancelled or preempted)."""
        self.pool.release(self._tables.pop(request, []))
        self._seen.pop(request, None)
