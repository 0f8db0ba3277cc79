"""An online model of step time, used to size prefill chunks for a latency target.

A step's time is modelled as linear in the costs it is made of:
    t = base + a * decodes + b * prefill_tokens + c * attention_pairs + d * encoded_tokens
        + e * has_prompt_tokens
where attention_pairs counts query-key pairs: each decode's context, plus each prompt
chunk's tokens x the keys they see, and encoded_tokens is the share of images' placeholder
tokens whose encode the step's vision encoder runs: each image's tokens times the fraction of
its encode's units (tower blocks + 1) run in the step, as the scheduler cuts an encode across
steps (a vision-language model's; one family's tower does work in proportion to them:
Qwen2.5-VL 4 patches a token, LLaVA one). (Separate terms for decode and prefill attention were
collinear with the base cost in practice and overestimated decodes.) has_prompt_tokens is what
a step pays once for holding prompt rows at all, whatever their number: on quantized weights
every linear dequantizes and packs its weight for them (~45 ms a step on SmolLM2's GGUF file
on 2 Zen 4 cores, as much as 80 prompt tokens); without it the fit spreads that cost over the
tokens and underestimates the small chunks a tight target leaves. The coefficients are refitted by
least squares on recent steps, so the model follows the machine it runs on, its load and its
thread count. With `--target-itl-ms X`, each step with decodes gets the largest prefill budget
whose predicted step time, times the model's recent underestimate, stays under X. How much a
step may take below that is the scheduler's policy (scheduler.py), and so is what an image's
encode takes of it: encode_cost gives the encode as the prompt tokens it costs as much as.
"""

from __future__ import annotations

import math
from collections import deque

import torch

from gapless.engine.plan import StepPlan

# Chunk size while the model has not yet timed enough chunks: small, so a step stays short
# whatever the machine, and the fit learns what chunks cost.
LEARNING_CHUNK = 64
MIN_SAMPLES = 8
WINDOW = 256
# A least-squares fit is right on average, so about half the steps it sizes overrun the target;
# a P99 target needs the fit's upper error. Budgets are sized for the target divided by this
# quantile of actual/predicted over the last CALIBRATION_WINDOW steps that carried a chunk.
CALIBRATION_QUANTILE = 0.9
CALIBRATION_WINDOW = 64


def step_features(
    decode_contexts: list[int], prefill_chunks: list[tuple[int, int]], encoded_tokens: float = 0
) -> list[float]:
    """Features of a step: decode contexts, (tokens, tokens already computed) per chunk, and
    the placeholder tokens of the images it encodes, each image's times the share of its
    encode the step runs."""
    pairs = sum(decode_contexts) + sum(n * (start + n / 2) for n, start in prefill_chunks)
    tokens = sum(n for n, _ in prefill_chunks)
    return [
        1.0,
        float(len(decode_contexts)),
        float(tokens),
        float(pairs),
        float(encoded_tokens),
        float(tokens > 0),
    ]


def plan_features(plan: StepPlan) -> list[float]:
    """The features of a planned step, before it launches (Request.num_scheduled)."""
    prompts = [c for c in plan.chunks if not c.request.is_decoding]
    # A draft's tokens attend as decodes do (runner), and cost as much.
    return step_features(
        [c.request.num_scheduled + 1 + i for c in plan.decodes for i in range(c.num_tokens)],
        [(c.num_tokens, c.request.num_scheduled) for c in prompts],
        sum(
            c.request.images[i].length * units / c.request.images[i].units
            for c in plan.chunks
            for i, units in c.encodes
        ),
    )


class StepCostModel:
    def __init__(self, fallback_chunk: int, max_chunk: int = 8192) -> None:
        self.fallback_chunk = fallback_chunk  # used until enough steps have been seen
        self.max_chunk = max_chunk
        self._samples: deque[tuple[list[float], float]] = deque(maxlen=WINDOW)
        self.coef: torch.Tensor | None = None
        self._since_fit = 0
        # Steps with prompt chunks in the fitted window: without enough of them the fit knows
        # nothing of a chunk's cost (a server that has only decoded would allow any chunk).
        self._prefill_steps = 0
        # Steps that encoded an image, in the fitted window: without one the fit knows nothing
        # of an encode's cost (its coefficient is the ridge's 0).
        self._encode_steps = 0
        self._ratios: deque[float] = deque(maxlen=CALIBRATION_WINDOW)

    @property
    def trained(self) -> bool:
        return self.coef is not None and self._prefill_steps >= MIN_SAMPLES

    def observe(self, features: list[float], seconds: float) -> None:
        # Calibrated on chunk steps that encode nothing: an encode's cost is fitted from the
        # few steps that had one, and its error would shrink every chunk after it.
        if self.trained and features[2] > 0 and not features[4]:
            self._ratios.append(seconds / max(self.predict(features), 1e-9))
        self._samples.append((features, seconds))
        self._since_fit += 1
        if len(self._samples) >= MIN_SAMPLES and (not self.trained or self._since_fit >= 16):
            self._fit()

    def _fit(self) -> None:
        x = torch.tensor([f for f, _ in self._samples], dtype=torch.float64)
        y = torch.tensor([t for _, t in self._samples], dtype=torch.float64)
        self._prefill_steps = int((x[:, 2] > 0).sum())
        self._encode_steps = int((x[:, 4] > 0).sum())
        # Scale columns so the tiny per-key and large per-step costs are fitted alike; a light
        # ridge keeps unexcited columns (e.g. no prefill seen yet) from exploding.
        scale = x.abs().amax(0).clamp(min=1e-9)
        xs = x / scale
        ridge = 1e-6 * torch.eye(xs.shape[1], dtype=torch.float64)
        coef = torch.linalg.solve(xs.T @ xs + ridge, xs.T @ y) / scale
        self.coef = coef.clamp(min=0)  # no cost is negative
        self._since_fit = 0

    def predict(self, features: list[float]) -> float:
        assert self.coef is not None
        return float(torch.tensor(features, dtype=torch.float64) @ self.coef)

    @property
    def underestimate(self) -> float:
        """How much longer than predicted recent chunk steps took, at the calibration quantile
        (1 when the fit has been accurate or pessimistic)."""
        if not self._ratios:
            return 1.0
        ratios = torch.tensor(list(self._ratios), dtype=torch.float64)
        return max(1.0, float(torch.quantile(ratios, CALIBRATION_QUANTILE)))

    def prefill_budget(
        self, decode_contexts: list[int], prefill_start: int, target_s: float
    ) -> int:
        """Prompt tokens this step can take within target_s seconds, given its decodes and where
        the next chunk starts: 0 when the decodes alone are predicted to use the target."""
        if not self.trained:
            return self.fallback_chunk
        target = target_s / self.underestimate
        lo, hi = 0, self.max_chunk
        while lo < hi:  # largest n whose predicted step time meets the target
            mid = (lo + hi + 1) // 2
            t = self.predict(step_features(decode_contexts, [(mid, prefill_start)]))
            if t <= target:
                lo = mid
            else:
                hi = mid - 1
        return lo

    def encode_cost(self, encoded_tokens: int, prefill_start: int) -> int:
        """The prompt tokens at prefill_start that take as long as encoding images of
        encoded_tokens placeholder tokens: what the scheduler charges an encode against the
        step's prompt budget. Until the fit has seen an encode (and a chunk), the encode counts
        as its placeholder tokens, the rule without a latency target."""
        if not self.trained or not self._encode_steps:
            return encoded_tokens
        assert self.coef is not None
        # A prompt token's cost at the chunk's start: its own, and its keys'.
        per_token = float(self.coef[2] + self.coef[3] * prefill_start)
        seconds = float(self.coef[4]) * encoded_tokens
        if per_token <= 0:
            return self.max_chunk if seconds > 0 else 0
        return math.ceil(seconds / per_token)
