"""Per-request sampling and stopping options, validated at construction.

Every option a client controls is bounded here, or by the model's vocabulary in admission.py,
so the work a request can make the engine do per step is bounded before the request is
admitted (see docs/server.md, Limits).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

# The stop-string filter checks every string against the held-back text at each token: these
# bound that work (and the text held back) per request.
MAX_STOP_STRINGS = 32
MAX_STOP_STRING_CHARS = 256
MAX_STOP_TOKEN_IDS = 1024
MAX_LOGPROBS = 20
MAX_N = 16  # choices per request: each holds its own KV for its output
SEED_RANGE = (-(2**63), 2**63 - 1)

# The service classes, most urgent first: the scheduler prefills a more urgent class's prompts
# first and preempts the least urgent class first (docs/server.md, Service classes).
SERVICE_CLASSES = ("interactive", "standard", "batch")
# A request for more choices than this is bulk work, batch unless it names its class.
BATCH_CHOICES = 4


def default_service_class(n: int, streamed: bool) -> str:
    """The class of a request that names none: batch for more than BATCH_CHOICES choices, else
    interactive when its tokens are streamed (someone is reading them as they come), else
    standard. (An embedding is batch: Intake.add_embedding.)"""
    if n > BATCH_CHOICES:
        return "batch"
    return "interactive" if streamed else "standard"


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
    n: int = 1  # choices sampled from one prompt; choice i seeds its draws with seed + i
    # The output must match this grammar (llguidance's serialized form, engine/structured.py).
    grammar: str | None = None
    # False: this request decodes one token a step even where the engine speculates.
    speculate: bool = True
    # One of SERVICE_CLASSES; None: default_service_class(n, streamed=False), as the Python API
    # returns whole outputs (the server names the class of every request it makes).
    service_class: str | None = None
    # Who the request is for (an API key's tenant: server/tenants.py); within a class the
    # scheduler shares prompt tokens fairly between tenants. None: the anonymous tenant.
    tenant: str | None = None
    # The LoRA adapter it runs on, by its --lora name; None: the base model.
    adapter: str | None = None

    def __post_init__(self) -> None:
        if self.service_class is None:
            self.service_class = default_service_class(self.n, streamed=False)
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop)
        self.stop_token_ids = list(self.stop_token_ids)
        lo, hi = SEED_RANGE
        checks = [
            (self.max_tokens >= 0, "max_tokens", "must be >= 0"),
            (0 <= self.temperature < math.inf, "temperature", "must be >= 0 and finite"),
            (0 < self.top_p <= 1, "top_p", "must be in (0, 1]"),
            (self.top_k >= -1, "top_k", "must be -1, 0 (off) or positive"),
            (
                self.seed is None or lo <= self.seed <= hi,
                "seed",
                "must fit in a signed 64-bit integer",
            ),
            (1 <= self.n <= MAX_N, "n", f"must be in [1, {MAX_N}]"),
            (
                self.service_class in SERVICE_CLASSES,
                "service_class",
                f"must be one of {', '.join(SERVICE_CLASSES)}",
            ),
            (0 <= self.min_p <= 1, "min_p", "must be in [0, 1]"),
            (-2 <= self.presence_penalty <= 2, "presence_penalty", "must be in [-2, 2]"),
            (-2 <= self.frequency_penalty <= 2, "frequency_penalty", "must be in [-2, 2]"),
            (self.repetition_penalty > 0, "repetition_penalty", "must be > 0"),
            (self.min_tokens >= 0, "min_tokens", "must be >= 0"),
            (_in_range(self.logprobs, MAX_LOGPROBS), "logprobs", f"must be in [0, {MAX_LOGPROBS}]"),
            (
                _in_range(self.prompt_logprobs, MAX_LOGPROBS),
                "prompt_logprobs",
                f"must be in [0, {MAX_LOGPROBS}]",
            ),
            (all(s for s in self.stop), "stop", "stop strings must be non-empty"),
            (
                len(self.stop) <= MAX_STOP_STRINGS,
                "stop",
                f"may hold at most {MAX_STOP_STRINGS} strings",
            ),
            (
                all(len(s) <= MAX_STOP_STRING_CHARS for s in self.stop),
                "stop",
                f"strings may be at most {MAX_STOP_STRING_CHARS} characters long",
            ),
            (
                len(self.stop_token_ids) <= MAX_STOP_TOKEN_IDS,
                "stop_token_ids",
                f"may hold at most {MAX_STOP_TOKEN_IDS} ids",
            ),
        ]
        for ok, name, why in checks:
            if not ok:
                value = repr(getattr(self, name))
                shown = value if len(value) <= 80 else f"{value[:60]}... ({len(value)} characters)"
                raise SamplingParamsError(name, f"{name} {why}, got {shown}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def _in_range(value: int | None, high: int) -> bool:
    return value is None or 0 <= value <= high


class SamplingParamsError(ValueError):
    """A sampling option is out of range; `param` names the field."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param
