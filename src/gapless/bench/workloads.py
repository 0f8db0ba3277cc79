"""Seeded request lists: the same arguments and seed always give the same requests."""

from __future__ import annotations

from dataclasses import dataclass, replace
from statistics import NormalDist

import numpy as np

# Low ids are often special or control tokens; random prompts stay clear of them.
MIN_TOKEN_ID = 100


def lognormal_fit(median: float, p90: float) -> tuple[float, float]:
    """(mu, sigma) of the log-normal with this median and 90th percentile."""
    mu = float(np.log(median))
    return mu, (float(np.log(p90)) - mu) / NormalDist().inv_cdf(0.9)


# Synthetic chat traffic: log-normal fits to ShareGPT-style prompt and output lengths (tokens).
CHAT_PROMPT_LOGNORMAL = lognormal_fit(1730, 5696)
CHAT_OUTPUT_LOGNORMAL = lognormal_fit(415, 834)


@dataclass(frozen=True)
class BenchRequest:
    rid: int
    arrival_s: float  # offset from bench start
    prompt: list[int] | str  # token ids, or a text (the input-grounded workload's)
    max_tokens: int
    tag: str = ""  # "long" marks the stall workload's long prompt
    # Disconnect after this many output tokens (decode-phase cancel) ...
    cancel_after_tokens: int | None = None
    # ... or this long after sending, whatever has arrived (aimed at the prefill phase).
    cancel_after_s: float | None = None
    service_class: str | None = None  # the mix workload's: its shape, and what it sends
    send_class: bool = True  # False: the request names no class (every request equal)
    tenant: str | None = None  # sends its key, tenant_key(tenant)
    # A conversation's next turn: sent arrival_s seconds (its user's think time) after the
    # request with this rid has finished, not at an offset from the start.
    after: int | None = None


@dataclass(frozen=True)
class WorkloadSpec:
    name: str
    seed: int = 0
    vocab_size: int = 32000
    # stall, grounded, context
    num_streams: int = 4
    stream_prompt_tokens: int = 64
    stream_tokens: int = 256
    long_tokens: int = 8192
    long_at: float = 3.0
    long_max_tokens: int = 16
    # mixed / prefix / cancel / chat
    rate: float = 1.0
    num_requests: int = 32
    duration: float | None = None  # caps arrivals at this offset
    # chat, mix: the length distributions are scaled by this, then clipped to the context
    length_scale: float = 1.0
    max_model_len: int | None = None
    # prefix; multiturn: each conversation's document, each user turn, each reply
    prefix_tokens: int = 2000
    suffix_tokens: int = 64
    answer_tokens: int = 64
    # multiturn: conversations (starting at `rate`), turns each, mean think time (s)
    conversations: int = 20
    turns: int = 8
    think_s: float = 1.0
    # mix: each arrival's service class and tenant, drawn by these shares, (name, weight)
    mix: tuple[tuple[str, float], ...] = (("interactive", 0.2), ("batch", 0.8))
    tenants: tuple[tuple[str, float], ...] = ()
    only_class: str | None = None  # keep this class's requests alone (the same ones)
    only_tenant: str | None = None  # keep this tenant's requests alone (the same ones)
    send_classes: bool = True  # False: shaped by class, but sent naming none


def _ids(rng: np.random.Generator, n: int, vocab: int) -> list[int]:
    return rng.integers(MIN_TOKEN_ID, vocab, size=n).tolist()


def _poisson_arrivals(rng: np.random.Generator, spec: WorkloadSpec) -> list[float]:
    gaps = rng.exponential(1.0 / spec.rate, size=spec.num_requests)
    # The first request goes at t=0 so the run never starts with dead time.
    times = np.concatenate([[0.0], np.cumsum(gaps[1:])])
    if spec.duration is not None:
        times = times[times <= spec.duration]
    return times.tolist()


def stall(spec: WorkloadSpec, rng: np.random.Generator) -> list[BenchRequest]:
    reqs = [
        BenchRequest(
            i, 0.0, _ids(rng, spec.stream_prompt_tokens, spec.vocab_size), spec.stream_tokens
        )
        for i in range(spec.num_streams)
    ]
    long_prompt = _ids(rng, spec.long_tokens, spec.vocab_size)
    reqs.append(
        BenchRequest(spec.num_streams, spec.long_at, long_prompt, spec.long_max_tokens, tag="long")
    )
    return reqs


def context(spec: WorkloadSpec, rng: np.random.Generator) -> list[BenchRequest]:
    """Decode at a long context: num_streams distinct prompts of long_tokens tokens, sent at
    once, each generating stream_tokens. Their ITL after the prefills is the step with a
    history of long_tokens each, where the KV cache, not the weights, sets the cost."""
    return [
        BenchRequest(i, 0.0, _ids(rng, spec.long_tokens, spec.vocab_size), spec.stream_tokens)
        for i in range(spec.num_streams)
    ]


def _mixed_lengths(rng: np.random.Generator, n: int) -> tuple[np.ndarray, np.ndarray]:
    # Log-normal with median 512 (mu = ln 512); sigma 1 spans short chats to long documents.
    prompt_lens = np.clip(rng.lognormal(np.log(512), 1.0, size=n), 16, 8192).astype(int)
    output_lens = rng.integers(32, 257, size=n)
    return prompt_lens, output_lens


def mixed(spec: WorkloadSpec, rng: np.random.Generator) -> list[BenchRequest]:
    arrivals = _poisson_arrivals(rng, spec)
    prompt_lens, output_lens = _mixed_lengths(rng, len(arrivals))
    return [
        BenchRequest(i, t, _ids(rng, int(p), spec.vocab_size), int(o))
        for i, (t, p, o) in enumerate(zip(arrivals, prompt_lens, output_lens, strict=True))
    ]


def prefix(spec: WorkloadSpec, rng: np.random.Generator) -> list[BenchRequest]:
    shared = _ids(rng, spec.prefix_tokens, spec.vocab_size)
    arrivals = _poisson_arrivals(rng, spec)
    return [
        BenchRequest(
            i, t, shared + _ids(rng, spec.suffix_tokens, spec.vocab_size), spec.answer_tokens
        )
        for i, t in enumerate(arrivals)
    ]


def multiturn(spec: WorkloadSpec, rng: np.random.Generator) -> list[BenchRequest]:
    """Conversations: each starts with a document of prefix_tokens and a question of
    suffix_tokens; each next turn, sent a think time after the one before has finished,
    is the whole conversation so far, a reply of answer_tokens, and a new question.
    The replies in the history are drawn, not the server's (the prompts are fixed ahead),
    so a turn's reusable prefix is the turn before's prompt. With the KV cache too small
    for every conversation, only a tier under RAM keeps the earlier turns' prefixes."""
    starts = np.concatenate(
        [[0.0], np.cumsum(rng.exponential(1 / spec.rate, spec.conversations - 1))]
    )
    reqs: list[BenchRequest] = []
    for start in starts.tolist():
        history = _ids(rng, spec.prefix_tokens, spec.vocab_size)
        before = None
        for turn in range(spec.turns):
            if turn:
                history += _ids(rng, spec.answer_tokens, spec.vocab_size)  # the reply
            history += _ids(rng, spec.suffix_tokens, spec.vocab_size)
            wait = start if before is None else float(rng.exponential(spec.think_s))
            rid = len(reqs)
            reqs.append(BenchRequest(rid, wait, list(history), spec.answer_tokens, after=before))
            before = rid
    return reqs


def cancel(spec: WorkloadSpec, rng: np.random.Generator) -> list[BenchRequest]:
    out = []
    for req in mixed(spec, rng):
        if rng.random() < 0.5:
            # A prefill of a few hundred tokens takes tens to hundreds of ms on most servers;
            # whether the client really left during prefill is recorded, not assumed.
            out.append(replace(req, cancel_after_s=float(rng.uniform(0.01, 0.3))))
        else:
            out.append(replace(req, cancel_after_tokens=int(rng.integers(1, req.max_tokens))))
    return out


def chat(spec: WorkloadSpec, rng: np.random.Generator) -> list[BenchRequest]:
    arrivals = _poisson_arrivals(rng, spec)
    # Lengths are drawn for every request before `duration` drops some, so a request's lengths
    # depend on the seed alone: trials at different rates send the same shapes of work. The
    # prompts' tokens are drawn afresh per rate: a server's prefix cache must not turn one
    # trial's prompts into free prefills in the next (vLLM's is on by default, and ours).
    scale = np.log(spec.length_scale)
    prompt_mu, prompt_sigma = CHAT_PROMPT_LOGNORMAL
    output_mu, output_sigma = CHAT_OUTPUT_LOGNORMAL
    prompt_lens = np.rint(rng.lognormal(prompt_mu + scale, prompt_sigma, spec.num_requests))
    # At least 2 output tokens, so every stream has a time between tokens.
    output_lens = np.maximum(
        2, np.rint(rng.lognormal(output_mu + scale, output_sigma, spec.num_requests))
    )
    if spec.max_model_len is not None:
        output_lens = np.minimum(output_lens, spec.max_model_len // 2)
        prompt_lens = np.minimum(prompt_lens, spec.max_model_len - output_lens)
    prompt_lens = np.maximum(1, prompt_lens)
    tokens = np.random.default_rng([spec.seed, round(spec.rate * 1e6)])
    return [
        BenchRequest(i, t, _ids(tokens, int(p), spec.vocab_size), int(o))
        for i, (t, p, o) in enumerate(zip(arrivals, prompt_lens, output_lens, strict=False))
    ]


# The mix workload's request shapes by service class: log-normal (median, p90) prompt and
# output lengths. Interactive: a chat turn, read as it streams. Batch: a document to
# summarize, long in and long out. Standard: between them.
CLASS_SHAPES = {
    "interactive": ((256, 768), (96, 192)),
    "standard": ((512, 1536), (192, 384)),
    "batch": ((1024, 2048), (256, 512)),
}


def parse_shares(text: str) -> tuple[tuple[str, float], ...]:
    """`interactive=0.2,batch=0.8` as ((name, weight), ...); weights need not sum to 1."""
    shares = []
    for item in filter(None, (part.strip() for part in text.split(","))):
        name, _, weight = item.partition("=")
        try:
            value = float(weight)
        except ValueError:
            raise ValueError(f"{item!r} is not NAME=WEIGHT") from None
        if not value > 0:
            raise ValueError(f"{item!r}: the weight must be positive")
        shares.append((name.strip(), value))
    if not shares:
        raise ValueError("no NAME=WEIGHT given")
    return tuple(shares)


def tenant_key(tenant: str) -> str:
    """The API key the bench sends for a tenant: a key file that maps it (bench writes one
    for the servers it starts) lets the server tell tenants apart."""
    return f"bench-{tenant}"


def _draw(rng: np.random.Generator, shares: tuple[tuple[str, float], ...], n: int) -> list:
    names = [name for name, _ in shares]
    weights = np.array([w for _, w in shares])
    return [names[i] for i in rng.choice(len(names), size=n, p=weights / weights.sum())]


def mix(spec: WorkloadSpec, rng: np.random.Generator) -> list[BenchRequest]:
    """Poisson arrivals whose service class (and tenant) are drawn by the spec's shares, each
    class's lengths from CLASS_SHAPES (times length_scale), clipped to the context."""
    arrivals = _poisson_arrivals(rng, spec)
    n = len(arrivals)
    unknown = {name for name, _ in spec.mix} - CLASS_SHAPES.keys()
    if unknown:
        raise ValueError(
            f"unknown service classes {sorted(unknown)}; choose from {list(CLASS_SHAPES)}"
        )
    classes = _draw(rng, spec.mix, n)
    tenants = _draw(rng, spec.tenants, n) if spec.tenants else [None] * n
    reqs = []
    for i, (t, service_class, tenant) in enumerate(zip(arrivals, classes, tenants, strict=True)):
        (prompt_median, prompt_p90), (out_median, out_p90) = CLASS_SHAPES[service_class]
        scale = spec.length_scale
        prompt_len = int(rng.lognormal(*lognormal_fit(prompt_median * scale, prompt_p90 * scale)))
        output_len = max(2, int(rng.lognormal(*lognormal_fit(out_median * scale, out_p90 * scale))))
        if spec.max_model_len is not None:
            output_len = min(output_len, spec.max_model_len // 2)
            prompt_len = min(prompt_len, spec.max_model_len - output_len)
        prompt = _ids(rng, max(1, prompt_len), spec.vocab_size)
        reqs.append(
            BenchRequest(
                i,
                t,
                prompt,
                output_len,
                service_class=service_class,
                send_class=spec.send_classes,
                tenant=tenant,
            )
        )
    if spec.only_tenant is not None and spec.only_tenant not in {n for n, _ in spec.tenants}:
        raise ValueError(f"--only-tenant {spec.only_tenant!r} is none of --tenants")
    return [
        r
        for r in reqs
        if spec.only_class in (None, r.service_class) and spec.only_tenant in (None, r.tenant)
    ]


# The input-grounded workload's document: a Python module of about 300 tokens, which each
# request asks to be copied. Its names come from the seed, so no two requests share a prefix
# that a prefix cache could serve.
_MODULE = '''"""Reading {thing} records from a text file, one per line."""

from dataclasses import dataclass


@dataclass
class {Thing}:
    name: str
    weight: float
    tags: list[str]


def parse_{thing}(line: str) -> {Thing}:
    """A line such as "anchor; 12.5; iron, heavy" as a {Thing}."""
    name, weight, tags = (part.strip() for part in line.split(";"))
    if not name:
        raise ValueError(f"a {thing} needs a name: {{line!r}}")
    return {Thing}(name, float(weight), [t.strip() for t in tags.split(",") if t.strip()])


def load_{thing}s(path: str, limit: int = {limit}) -> list[{Thing}]:
    """Every {thing} in the file, skipping blank lines and comments, at most limit."""
    found = []
    with open(path, encoding="utf-8") as lines:
        for number, line in enumerate(lines, 1):
            if not line.strip() or line.startswith("#"):
                continue
            try:
                found.append(parse_{thing}(line))
            except ValueError as error:
                raise ValueError(f"line {{number}}: {{error}}") from None
            if len(found) == limit:
                break
    return found


def heaviest(items: list[{Thing}], count: int = {count}) -> list[str]:
    """The names of the count heaviest, heaviest first."""
    ranked = sorted(items, key=lambda item: item.weight, reverse=True)
    return [item.name for item in ranked[:count]]
'''
_THINGS = ("parcel", "crate", "sample", "ingot", "barrel", "bundle", "canister", "satchel")


def grounded(spec: WorkloadSpec, rng: np.random.Generator) -> list[BenchRequest]:
    """Input-grounded requests, all at once: copy a given module (text prompts). `num_streams`
    of them, each a different module, `stream_tokens` output tokens each."""
    reqs = []
    for i in range(spec.num_streams):
        thing = f"{_THINGS[rng.integers(len(_THINGS))]}{i}"
        module = _MODULE.format(
            thing=thing,
            Thing=thing.capitalize(),
            limit=int(rng.integers(100, 1000)),
            count=int(rng.integers(3, 10)),
        )
        prompt = (
            f"Copy the file below exactly.\n\n### {thing}.py\n```python\n{module}```\n\n"
            f"### {thing}.py (copy)\n```python\n"
        )
        reqs.append(BenchRequest(i, 0.0, prompt, spec.stream_tokens))
    return reqs


# The free-generation workload's openings: stories that no prompt text can predict, the case
# where speculation must cost nothing.
_NAMES = ("Mira", "Tobias", "Anouk", "Felix", "Ines", "Osei", "Katja", "Ravi")
_QUESTS = (
    "keeps a lighthouse on an island that is slowly sinking",
    "repairs clocks in a town where time runs backwards on Sundays",
    "sails a cargo of seeds to a continent without trees",
    "teaches a crow to read the letters it steals",
)


def story(spec: WorkloadSpec, rng: np.random.Generator) -> list[BenchRequest]:
    """Free generation, all at once: `num_streams` different story openings (text prompts),
    `stream_tokens` output tokens each."""
    reqs = []
    for i in range(spec.num_streams):
        name = _NAMES[rng.integers(len(_NAMES))]
        quest = _QUESTS[rng.integers(len(_QUESTS))]
        prompt = f"Here is a long story about {name}, who {quest}.\n\nChapter 1\n\n"
        reqs.append(BenchRequest(i, 0.0, prompt, spec.stream_tokens))
    return reqs


_BUILDERS = {
    "stall": stall,
    "context": context,
    "mixed": mixed,
    "prefix": prefix,
    "multiturn": multiturn,
    "cancel": cancel,
    "chat": chat,
    "grounded": grounded,
    "story": story,
    "mix": mix,
}


def build_workload(spec: WorkloadSpec) -> list[BenchRequest]:
    """The request list for `spec`, sorted by arrival (a follow-up turn's offset counts from
    the turn before it)."""
    if spec.name not in _BUILDERS:
        raise ValueError(f"unknown workload {spec.name!r}; choose from {', '.join(_BUILDERS)}")
    rng = np.random.default_rng(spec.seed)
    reqs = _BUILDERS[spec.name](spec, rng)
    return sorted(reqs, key=lambda r: (r.arrival_s, r.rid))


# `gapless bench --workload` choices. Chat's lengths must be clipped to the server's context,
# which `gapless bench capacity` looks up; plain `bench` does not.
WORKLOADS = tuple(name for name in _BUILDERS if name != "chat")
