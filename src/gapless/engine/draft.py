"""The draft model: a second, small decoder that proposes a request's next tokens greedily.

It must share the target's tokenizer (check_same_tokenizer), since its token ids are the
target's. Its K/V lives in its own block pool, with its own block table per request. Before
proposing, it reads the request's tokens it has not seen (the prompt, then the accepted
output), in chunks that the scheduler takes out of the step's token budget as it does prompt
chunks (proposals.py), so that a long prompt's catch-up stalls no stream; then it
proposes k tokens with k greedy (argmax) forwards. Each forward is batched over all the
requests the step speculates for, as the target's are.

It never needs rolling back explicitly: the tokens it has seen are valid up to the target's
num_computed, which after a verification covers the accepted proposals and nothing past them
(a rejected proposal's K/V, past that point, is overwritten before anything reads it).
"""

from __future__ import annotations

import torch

from gapless.engine.plan import DraftPlan
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
    def __init__(
        self,
        decoder: Decoder,
        num_blocks: int,
        block_size: int,
        kv_cache_dtype: torch.dtype | None = None,
    ) -> None:
        """kv_cache_dtype: its cache's storage type, as ModelRunner's."""
        self.runner = ModelRunner(decoder, num_blocks, block_size, kv_cache_dtype=kv_cache_dtype)
        self.pool = BlockPool(num_blocks, block_size)
        self._tables: dict[Request, list[int]] = {}
        self._seen: dict[Request, int] = {}  # leading tokens whose K/V the draft wrote

    def unseen(self, request: Request) -> int:
        """How many of the request's tokens the draft has yet to read before it can propose:
        those past the last one it read that the target kept (at least the last sampled)."""
        return request.num_tokens - self._valid(request)

    def _valid(self, request: Request) -> int:
        return min(self._seen.get(request, 0), request.num_computed)

    def propose(self, plans: list[DraftPlan]) -> dict[Request, list[int]]:
        """Reads each plan's next catch_up unseen tokens and, for a plan that has then read
        them all, proposes its k tokens, the draft's argmax after each: one ragged forward
        over every plan's tokens, then one per further proposal position over the requests
        still proposing, as the target's runner batches a step. A request whose blocks the
        pool cannot hold reads and proposes nothing this time."""
        reads: list[ChunkInput] = []
        proposing: list[tuple[Request, int, int]] = []  # request, its row in reads, k
        for plan in plans:
            request, start = plan.request, self._valid(plan.request)
            end = start + plan.catch_up
            k = plan.k if end == request.num_tokens else 0
            if not self._hold(request, end + max(k - 1, 0)):
                continue
            if k:
                proposing.append((request, len(reads), k))
            reads.append(self._input(request, request.tokens(start, end), start))
            self._seen[request] = end
        if not reads:
            return {}
        logits, _ = self.runner.run(reads)
        tops = logits.argmax(-1).tolist()
        proposals = {req: [tops[row]] for req, row, _ in proposing}
        for position in range(1, max((k for *_, k in proposing), default=0)):
            live = [req for req, _, k in proposing if k > position]
            start = [req.num_tokens + position - 1 for req in live]
            inputs = [
                self._input(req, proposals[req][-1:], at)
                for req, at in zip(live, start, strict=True)
            ]
            logits, _ = self.runner.run(inputs)
            for req, at, top in zip(live, start, logits.argmax(-1).tolist(), strict=True):
                proposals[req].append(top)
                self._seen[req] = at + 1
        return proposals

    def _hold(self, request: Request, num_tokens: int) -> bool:
        """Makes room in the request's draft blocks for its first num_tokens tokens."""
        table = self._tables.setdefault(request, [])
        need = -(-num_tokens // self.pool.block_size) - len(table)
        if need > self.pool.num_available:
            return False
        if need > 0:
            table += self.pool.allocate(need)
        return True

    def _input(self, request: Request, tokens: list[int], start: int) -> ChunkInput:
        last_block = -(-(start + len(tokens)) // self.pool.block_size)
        return ChunkInput(tokens, start, self._tables[request][:last_block], False)

    def release(self, request: Request) -> None:
        """Frees the request's draft blocks (it finished, was cancelled or preempted)."""
        self.pool.release(self._tables.pop(request, []))
        self._seen.pop(request, None)
