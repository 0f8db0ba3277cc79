"""Scoring (query, document) pairs, for rerank and score requests: a pair is one prompt,
prefilled in chunks like an embedding's, whose last token gives one relevance score in (0, 1).

Two kinds of model score, and the engine knows which it serves when it is built:
- a sequence classifier (`LlamaForSequenceClassification`, `Qwen2ForSequenceClassification`,
  `Qwen3ForSequenceClassification`, one label): its head `score.weight` applied to the last
  token's hidden state after the final norm gives the pair's logit, and the score is its
  sigmoid, as vLLM and sentence-transformers' CrossEncoder read a one-label head. The pair's
  prompt is the tokenizer's encoding of the two texts as a pair. Its chunks compute no logits.
- a causal LM trained to answer "yes" or "no" (Qwen3-Reranker), served with `--reranker`:
  the pair goes into the recipe's prompt, and the score is P(yes) of the softmax over the last
  token's logits of "no" and "yes", that is sigmoid(logit(yes) - logit(no)). Those logits
  come from the forward's last-token row, as a prompt's first token's would: lm_head's weight
  may be stored packed (oneDNN's layout) where two of its rows cannot be read alone, and one
  row of the vocabulary product costs a 200-token pair of a 0.6B model about 0.2% of its
  prefill's multiply-adds.

Either way the query comes before the document, so the pairs of one query share its prefix
and the prefix cache serves it to all but the first (Intake.add_score).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from gapless.model.decoder import Decoder
from gapless.model.tokenizer import Tokenizer

# Qwen3-Reranker's prompt: a system turn that asks for "yes" or "no", the pair in the user
# turn, and an assistant turn opened with an empty think block, where the answer would go.
YES_NO_PREFIX = (
    "<|im_start|>system\nJudge whether the Document meets the requirements based on the Query "
    'and the Instruct provided. Note that the answer can only be "yes" or "no".<|im_end|>\n'
    "<|im_start|>user\n"
)
YES_NO_PAIR = "<Instruct>: {instruction}\n<Query>: {query}\n<Document>: {document}"
YES_NO_SUFFIX = "<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
DEFAULT_INSTRUCTION = "Given a web search query, retrieve relevant passages that answer the query"


class ScoringError(ValueError):
    """The model cannot score pairs as asked."""


@dataclass(frozen=True)
class ClassifierScorer:
    """A one-label classifier's head, [hidden] float32: sigmoid of its dot product with the
    last token's final-normed hidden state."""

    weight: torch.Tensor
    pooling = "last"  # what its pairs' chunks return: that hidden state, no logits

    def pair(self, tokenizer: Tokenizer, query: str, document: str) -> list[int]:
        """The pair's prompt ids, the query's first, as the tokenizer encodes a pair."""
        return tokenizer.backend.encode(query, document).ids

    def score(self, hidden: torch.Tensor) -> float:
        return torch.sigmoid(hidden.reshape(-1) @ self.weight).item()


@dataclass(frozen=True)
class YesNoScorer:
    """The yes/no recipe: P(yes) from the last token's logits of "yes" and "no"."""

    yes: int
    no: int
    pooling = None  # its pairs' chunks return logits, as any prompt's

    def pair(self, tokenizer: Tokenizer, query: str, document: str) -> list[int]:
        """The pair's prompt ids: the recipe's three parts, each encoded alone, as its
        reference code does."""
        text = YES_NO_PAIR.format(instruction=DEFAULT_INSTRUCTION, query=query, document=document)
        parts = (YES_NO_PREFIX, text, YES_NO_SUFFIX)
        return [i for part in parts for i in tokenizer.encode(part, add_special_tokens=False)]

    def score(self, logits: torch.Tensor) -> float:
        logits = logits.reshape(-1)
        return torch.sigmoid(logits[self.yes] - logits[self.no]).item()


Scorer = ClassifierScorer | YesNoScorer


def scorer_of(decoder: Decoder, tokenizer: Tokenizer, reranker: bool) -> Scorer | None:
    """The decoder's scorer: a classifier's head, or with `reranker` (a causal LM) the yes/no
    recipe's; None where the model does not score."""
    if decoder.classifier is not None:
        return ClassifierScorer(decoder.classifier[0])
    if not reranker:
        return None
    yes, no = (_token_id(tokenizer, word) for word in ("yes", "no"))
    return YesNoScorer(yes, no)


def _token_id(tokenizer: Tokenizer, word: str) -> int:
    """The token that is exactly `word`, as the recipe looks it up (no leading space)."""
    token_id = tokenizer.backend.token_to_id(word)
    if token_id is None:
        raise ScoringError(f"--reranker: the tokenizer has no token {word!r}, so it cannot score")
    return token_id
