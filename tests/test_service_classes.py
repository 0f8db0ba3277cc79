"""Service classes: a more urgent class's prompts prefill first and its requests are preempted
last; within a class, tenants share prompt tokens fairly; and neither changes a token of any
request."""

from __future__ import annotations

import pytest
from helpers import greedy, prompt

from gapless import Engine, EngineConfig, SamplingParams
from gapless.engine.events import FinishedEvent, TokenEvent
from gapless.engine.observability import summary
from gapless.engine.plan import StepOutcome
from gapless.engine.request import Request
from gapless.engine.sampling_params import SamplingParamsError
from gapless.engine.scheduler import Scheduler, SchedulerConfig
from gapless.kv.block_pool import BlockPool
from gapless.kv.manager import KVManager


def request(rid: str, prompt_len: int, service_class: str) -> Request:
    params = SamplingParams(max_tokens=100, service_class=service_class)
    return Request(rid, prompt(prompt_len, seed=len(rid)), params)


def step(scheduler: Scheduler) -> list[tuple[str, int]]:
    """Schedules a step and books it as the engine would, each finished prompt sampling a
    token; returns its chunks as (request id, tokens), in the plan's order."""
    plan = scheduler.schedule()
    sampled = []
    for chunk in plan.chunks:
        if chunk.request.num_computed + chunk.num_tokens == chunk.request.num_tokens:
            chunk.request.output_ids.append(7)
            sampled.append(chunk.request)
    scheduler.update(plan, StepOutcome(computed=plan.chunks, sampled=sampled))
    return [(c.request.request_id, c.num_tokens) for c in plan.chunks]


@pytest.mark.parametrize("policy", ["fcfs", "shortest"])
def test_a_later_interactive_prompt_prefills_before_a_waiting_batch_one(policy):
    config = SchedulerConfig(prefill_chunk=16, idle_prefill_chunk=16, prefill_policy=policy)
    scheduler = Scheduler(config, KVManager(BlockPool(64, 16)))
    # Without classes the batch prompt goes first by either policy: it came first and is the
    # shorter one.
    scheduler.add(request("batch", 40, "batch"))
    scheduler.add(request("chat", 50, "interactive"))
    assert step(scheduler) == [("chat", 16)]
    assert step(scheduler) == [("chat", 16)]


def test_preemption_takes_the_batch_request_before_a_newer_interactive_one():
    # The two prompts fill the four blocks. The batch request's next token fits in its
    # blocks; the interactive request's needs a fifth block, which only preempting frees.
    scheduler = Scheduler(SchedulerConfig(), KVManager(BlockPool(4, 16), prefix_cache=False))
    batch, chat = request("batch", 20, "batch"), request("chat", 32, "interactive")
    scheduler.add(batch)
    step(scheduler)
    scheduler.add(chat)  # admitted after the batch request: the newer one
    step(scheduler)
    plan = scheduler.schedule()
    assert plan.preempted == [batch]
    # The chat's token, and the batch request starting over (no decode of its, already
    # scheduled when it lost its blocks) in the block the chat's token left free.
    assert [(c.request, c.num_tokens) for c in plan.chunks] == [(chat, 1), (batch, 16)]


def test_an_unknown_class_is_refused_by_name():
    with pytest.raises(SamplingParamsError, match="service_class must be one of") as e:
        SamplingParams(service_class="urgent")
    assert e.value.param == "service_class"


@pytest.mark.parametrize("n,service_class", [(1, "standard"), (4, "standard"), (5, "batch")])
def test_the_python_api_default_class(n, service_class):
    assert SamplingParams(n=n).service_class == service_class


def test_classes_and_tenants_change_no_token(checkpoint):
    """Classes and tenants' fair shares reorder prompts and choose who is preempted under a
    small KV pool; the greedy tokens are those of the same requests without either."""

    def run(classes: list[str | None], tenants: list[str | None]) -> list[list[int]]:
        config = EngineConfig.of(dtype="float32", prefill_chunk=16, kv_cache_tokens=12 * 16)
        engine = Engine.from_pretrained(checkpoint("llama"), config)
        ids = [
            engine.add_request(prompt(20 + 9 * i, i), greedy(40, service_class=c, tenant=t))
            for i, (c, t) in enumerate(zip(classes, tenants, strict=True))
        ]
        # The live page's rows name each request's class and tenant.
        rows = summary(engine)["requests"]
        assert [(r["class"], r["tenant"]) for r in rows] == [
            (c or "standard", t) for c, t in zip(classes, tenants, strict=True)
        ]
        out: dict[str, list[int]] = {}
        preempted = 0
        while engine.has_work:
            for e in engine.step():
                if isinstance(e, TokenEvent):
                    out.setdefault(e.request_id, []).extend(e.token_ids)
                if isinstance(e, FinishedEvent):
                    preempted += e.preempted
        assert preempted, "the pool is meant to be too small for all four at once"
        return [out[i] for i in ids]

    plain = run([None] * 4, [None] * 4)
    assert run(["batch", "interactive", "batch", "standard"], [None] * 4) == plain
    assert run(["batch", "batch", "batch", "standard"], ["a", "b", "b", "a"]) == plain


def tenant_request(rid: str, prompt_len: int, tenant: str, seed: int) -> Request:
    """A prompt of its own (no prefix cache hits between them)."""
    return Request(rid, prompt(prompt_len, seed=seed), SamplingParams(tenant=tenant))


@pytest.mark.parametrize("policy", ["fcfs", "shortest"])
def test_a_tenant_with_50_queued_requests_gets_one_share_of_prompt_tokens(policy):
    config = SchedulerConfig(
        prefill_chunk=64, idle_prefill_chunk=64, max_num_seqs=64, prefill_policy=policy
    )
    scheduler = Scheduler(config, KVManager(BlockPool(4096, 16)))
    heavy = [tenant_request(f"heavy-{i}", 300, "heavy", i) for i in range(50)]
    for req in heavy:
        scheduler.add(req)
    light = tenant_request("light", 4000, "light", 50)
    scheduler.add(light)
    tokens = {"heavy": 0, "light": 0}
    for _ in range(40):  # both backlogged throughout: 40 x 64 tokens < the light prompt
        for rid, n in step(scheduler):
            if n > 1:  # a prompt chunk, not a decode
                tokens[rid.split("-")[0]] += n
    assert light.num_uncomputed > 0 and any(r.num_uncomputed for r in heavy)
    total = sum(tokens.values())
    assert total == 40 * 64
    assert min(tokens.values()) >= 0.45 * total, tokens


def test_a_tenant_that_comes_back_is_not_owed_its_idle_time():
    """A tenant whose prompts arrive after another's have had the budget to themselves for a
    while shares from then on; it does not take every step until it has caught up."""
    config = SchedulerConfig(prefill_chunk=64, idle_prefill_chunk=64)
    scheduler = Scheduler(config, KVManager(BlockPool(4096, 16)))
    scheduler.add(tenant_request("a", 4000, "a", 0))
    for _ in range(20):
        step(scheduler)
    scheduler.add(tenant_request("bb", 4000, "b", 1))
    owners = [step(scheduler)[0][0] for _ in range(10)]
    assert owners.count("a") >= 4 and owners.count("bb") >= 4, owners


def test_an_interactive_request_takes_a_batch_requests_place_in_a_full_batch():
    """max_num_seqs 2, both slots held by decoding batch requests: a chat arriving preempts
    the newer of them at once, instead of waiting for one to end; the batch request resumes
    once the chat ends, from its cached prefix."""
    config = SchedulerConfig(max_num_seqs=2, prefill_chunk=64, idle_prefill_chunk=64)
    scheduler = Scheduler(config, KVManager(BlockPool(64, 16)))
    old, new = request("old", 20, "batch"), request("new", 20, "batch")
    for r in (old, new):
        scheduler.add(r)
        step(scheduler)
    chat = request("chat", 20, "interactive")
    scheduler.add(chat)
    plan = scheduler.schedule()
    assert plan.preempted == [new]
    assert [(c.request.request_id, c.num_tokens) for c in plan.chunks] == [("old", 1), ("chat", 20)]
    scheduler.update(plan, StepOutcome(computed=plan.chunks, sampled=[old, chat]))
    assert scheduler.waiting == [new]
    assert step(scheduler) == [("chat", 1), ("old", 1)]  # a batch request never preempts
    scheduler.finish([chat])
    # Its prompt and token again, 21, less the full block its prefix cache kept.
    assert step(scheduler) == [("old", 1), ("new", 5)]


def test_a_request_of_the_same_class_waits_for_a_slot():
    config = SchedulerConfig(max_num_seqs=1)
    scheduler = Scheduler(config, KVManager(BlockPool(64, 16)))
    scheduler.add(request("first", 20, "interactive"))
    step(scheduler)
    scheduler.add(request("second", 20, "interactive"))
    plan = scheduler.schedule()
    assert plan.preempted == [] and [c.request.request_id for c in plan.chunks] == ["first"]


def test_within_a_class_a_tenant_running_more_than_its_share_gives_up_a_slot():
    """max_num_seqs 4, all held by tenant heavy: light's first request takes the place of
    heavy's latest, and its second another (heavy 3 against light 1); its third waits, as
    heavy then runs no more than light (2 and 2). Without tenants nothing is preempted."""
    config = SchedulerConfig(max_num_seqs=4, prefill_chunk=64, idle_prefill_chunk=64)
    scheduler = Scheduler(config, KVManager(BlockPool(256, 16)))

    def tenant_request(rid: str, tenant: str) -> Request:
        req = request(rid, 20, "standard")
        req.params.tenant = tenant
        return req

    heavy = [tenant_request(f"h{i}", "heavy") for i in range(4)]
    for req in heavy:
        scheduler.add(req)
    step(scheduler)
    assert scheduler.running == heavy
    preempted = []
    for i in range(3):
        scheduler.add(tenant_request(f"l{i}", "light"))
        plan = scheduler.schedule()
        preempted.append([r.request_id for r in plan.preempted])
        scheduler.update(plan, StepOutcome(computed=plan.chunks, sampled=[]))
    assert preempted == [["h3"], ["h2"], []]
    assert sorted(r.request_id for r in scheduler.running) == ["h0", "h1", "l0", "l1"]
