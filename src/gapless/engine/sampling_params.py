"""Per-request sampling and stopping options, validated at construction."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: off
    min_p: float = 0.0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    min_tokens: int = 0
    logprobs: int | None = None  # top-k alternatives per sampled token
    prompt_logprobs: int | None = None  # logprob of each actual prompt token (+ top-k)
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop)
        self.stop_token_ids = list(self.stop_token_ids)
        checks = [
            (self.max_tokens >= 0, "max_tokens", "must be >= 0"),
            (self.temperature >= 0, "temperature", "must be >= 0"),
            (0 < self.top_p <= 1, "top_p", "must be in (0, 1]"),
            (self.top_k >= -1, "top_k", "must be -1, 0 (off) or positive"),
            (0 <= self.min_p <= 1, "min_p", "must be in [0, 1]"),
            (-2 <= self.presence_penalty <= 2, "presence_penalty", "must be in [-2, 2]"),
            (-2 <= self.frequency_penalty <= 2, "frequency_penalty", "must be in [-2, 2]"),
            (self.repetition_penalty > 0, "repetition_penalty", "must be > 0"),
            (self.min_tokens >= 0, "min_tokens", "must be >= 0"),
            (self.logprobs is None or 0 <= self.logprobs <= 20, "logprobs", "must be in [0, 20]"),
            (
                self.prompt_logprobs is None or 0 <= self.prompt_logprobs <= 20,
                "prompt_logprobs",
                "must be in [0, 20]",
            ),
            (all(s for s in self.stop), "stop", "stop strings must be non-empty"),
        ]
        for ok, name, why in checks:
            if not ok:
                raise SamplingParamsError(name, f"{name} {why}, got {getattr(self, name)!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


class SamplingParamsError(ValueError):
    """A sampling option is out of range; `param` names the field."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param
