"""The latency-target policy in the scheduler, driven by a fake cost model: which chunks a step
gets, not how long they take."""

from __future__ import annotations

import math
import re
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from helpers import run_step

from gapless.engine.admission import PromptImage
from gapless.engine.config import EngineConfig
from gapless.engine.request import Request, RequestState
from gapless.engine.runner import ModelRunner
from gapless.engine.sampling_params import SERVICE_CLASSES, SamplingParams
from gapless.engine.scheduler import Scheduler, SchedulerConfig
from gapless.kv.block_pool import BlockPool
from gapless.kv.manager import KVManager
from gapless.model.encode_steps import EncodeSteps, EncodeWork
from gapless.model.images import PreparedImage


class FakeCostModel:
    """Predicts `per_decode` per decode and `per_token` per prompt token; returns the largest
    chunk that fits the target, as StepCostModel does."""

    def __init__(self, target: float, per_decode: float, per_token: float) -> None:
        self.target, self.per_decode, self.per_token = target, per_decode, per_token
        self.calls: list[tuple[list[int], int]] = []

    @property
    def targets(self) -> dict[str, float]:
        """Its target for every class, as --target-itl-ms gives the scheduler."""
        return dict.fromkeys(SERVICE_CLASSES, self.target)

    def prefill_budget(self, decode_contexts: list[int], prefill_start: int, target: float) -> int:
        self.calls.append((decode_contexts, prefill_start))
        spare = target - self.per_decode * len(decode_contexts)
        return max(0, int(round(spare / self.per_token, 6)))


def request(rid: str, prompt_len: int) -> Request:
    return Request(rid, list(range(1, prompt_len + 1)), SamplingParams(max_tokens=10_000))


def decoding_scheduler(model: FakeCostModel, streams: int) -> Scheduler:
    config = SchedulerConfig(min_prefill_chunk=64, prefill_policy="shortest")
    scheduler = Scheduler(
        config,
        KVManager(BlockPool(2048, 16)),
        prefill_budget=model.prefill_budget,
        itl_targets=model.targets,
    )
    for i in range(streams):
        scheduler.add(request(f"s{i}", 8))
    run_step(scheduler)  # idle: every short prompt whole
    return scheduler


def test_budget_is_what_fits_in_the_target_beside_the_decodes():
    model = FakeCostModel(target=0.15, per_decode=0.01, per_token=0.001)
    scheduler = decoding_scheduler(model, streams=4)
    scheduler.add(request("long", 1000))
    sizes = run_step(scheduler)
    assert sizes == {"s0": 1, "s1": 1, "s2": 1, "s3": 1, "long": 110}  # (0.15 - 4 * 0.01) / 0.001
    assert model.calls[-1] == ([9, 9, 9, 9], 0)  # contexts after the token this step adds
    assert run_step(scheduler)["long"] == 110
    assert model.calls[-1][1] == 110  # the next chunk starts where the last ended


def test_when_decodes_use_the_target_the_prompt_still_moves_at_the_guaranteed_rate():
    model = FakeCostModel(target=0.15, per_decode=0.05, per_token=0.001)  # 4 decodes: 0.2 s
    scheduler = decoding_scheduler(model, streams=4)
    long = request("long", 1000)
    scheduler.add(long)
    steps = 0
    first_chunk_step = None
    while long.state is not RequestState.DECODING:
        sizes = run_step(scheduler)
        steps += 1
        if "long" in sizes and first_chunk_step is None:
            first_chunk_step = steps
        assert sizes.get("long") == min(64, 1000 - 64 * (steps - 1))
    assert first_chunk_step == 1
    assert steps == -(-1000 // 64)  # its first token comes within prompt / min_prefill_chunk


def test_few_decodes_leave_room_for_a_larger_chunk():
    one = decoding_scheduler(FakeCostModel(0.15, 0.01, 0.001), streams=1)
    many = decoding_scheduler(FakeCostModel(0.15, 0.01, 0.001), streams=8)
    for scheduler in (one, many):
        scheduler.add(request("long", 1000))
    assert run_step(one)["long"] == 140
    assert run_step(many)["long"] == 70


def classed(rid: str, n: int, service_class: str) -> Request:
    params = SamplingParams(max_tokens=10_000, service_class=service_class)
    return Request(rid, list(range(1, n + 1)), params)


def test_the_strictest_class_decoding_sizes_the_step():
    """--class-itl-ms interactive=150,batch=1000: while only batch requests decode, a prompt
    takes what fits in 1 s; once an interactive stream decodes beside them, what fits in
    150 ms; a class without a target decoding alone gets the static chunk."""
    model = FakeCostModel(target=0, per_decode=0.01, per_token=0.001)

    def scheduler_for(*streams: str) -> Scheduler:
        scheduler = Scheduler(
            SchedulerConfig(min_prefill_chunk=64, prefill_chunk=300),
            KVManager(BlockPool(4096, 16)),
            prefill_budget=model.prefill_budget,
            itl_targets={"interactive": 0.15, "batch": 1.0},
        )
        for i, service_class in enumerate(streams):
            scheduler.add(classed(f"s{i}", 8, service_class))
        run_step(scheduler)
        return scheduler

    scheduler = scheduler_for(*["batch"] * 4)
    scheduler.add(classed("long", 5000, "batch"))
    assert run_step(scheduler)["long"] == 960  # (1.0 - 4 x 0.01) / 0.001
    scheduler.add(classed("chat", 8, "interactive"))
    assert run_step(scheduler)["chat"] == 8  # its prompt first: a more urgent class
    assert run_step(scheduler)["long"] == 100  # (0.15 - 5 x 0.01) / 0.001
    scheduler = scheduler_for("standard", "standard")
    scheduler.add(classed("long", 5000, "standard"))
    assert run_step(scheduler)["long"] == 300


def test_a_long_prompt_behind_a_stream_of_short_ones_gets_its_first_chunk_within_a_bound():
    model = FakeCostModel(target=0.15, per_decode=0.05, per_token=0.001)  # floor only
    scheduler = decoding_scheduler(model, streams=2)
    scheduler.add(request("long", 4000))
    for step in range(1, 200):
        scheduler.add(request(f"short{step}", 48))  # always shorter than what the long one has left
        if "long" in run_step(scheduler):
            break
    # Aging counts each waited step as 64 fewer prompt tokens: 4000 vs 48 meet within ~62 steps.
    assert step <= 4000 // 64 + 1


# Images: what an encode takes of a step's prompt budget.


def image_request(rid: str, text: list[int], image_tokens: list[int], units: int = 1) -> Request:
    """text[i] prompt tokens, then an image of image_tokens[i] placeholders, for each i, then
    8 tokens of text; each image's encode is `units` units (tower blocks + 1)."""
    ids: list[int] = []
    images = []
    for i, (n, length) in enumerate(zip(text, image_tokens, strict=True)):
        ids += range(1, n + 1)
        pixels = np.zeros(units)  # FakeEncoder's encode is this many units
        image = PromptImage(len(ids), length, PreparedImage(pixels), f"image{i}", False, units)
        images.append(image)
        ids += [999] * length
    ids += range(1, 9)
    req = Request(rid, ids, SamplingParams(max_tokens=10_000), images=tuple(images))
    return req


class FakeEncoder:
    """An encoder whose encode of an image is len(image.pixels) units of no work."""

    def encode_steps(self, image: PreparedImage) -> EncodeSteps:
        units = len(image.pixels)

        def work() -> EncodeWork:
            for _ in range(units - 1):
                yield
            return torch.zeros(1)

        return EncodeSteps(work(), units)


RUNNER = SimpleNamespace(encoder=FakeEncoder())  # all ModelRunner.encode reads of a runner


def run_image_step(scheduler: Scheduler) -> dict[str, tuple[int, list[tuple[int, int]]]]:
    """run_step, and what each chunk encodes, run by the runner's own code: an image's encode
    in progress, then its embeddings, kept until the prompt passes them."""
    chunks = {}
    for chunk in scheduler.schedule().chunks:
        req = chunk.request
        encodes = list(chunk.encodes)
        ModelRunner.encode(RUNNER, chunk)  # type: ignore[arg-type]
        req.num_computed += chunk.num_tokens
        req.drop_images_before(req.num_computed)
        if req.num_uncomputed == 0:
            req.state = RequestState.DECODING
            req.output_ids.append(7)
        chunks[req.request_id] = (chunk.num_tokens, encodes)
    return chunks


def static_scheduler(streams: int, **options) -> Scheduler:
    """A scheduler without a latency target, `streams` requests decoding."""
    config = SchedulerConfig(prefill_chunk=512, idle_prefill_chunk=512, **options)
    scheduler = Scheduler(config, KVManager(BlockPool(2048, 16)))
    for i in range(streams):
        scheduler.add(request(f"s{i}", 8))
    run_image_step(scheduler)
    return scheduler


def test_without_a_target_an_encode_takes_its_placeholder_tokens_of_the_budget():
    scheduler = static_scheduler(streams=4)
    scheduler.add(image_request("img", [100], [300]))
    steps = run_image_step(scheduler)
    assert steps["img"] == (512 - 300, [(0, 1)])  # the text, and 112 of the image's tokens
    assert all(steps[f"s{i}"] == (1, []) for i in range(4))
    assert run_image_step(scheduler)["img"] == (196, [])  # the rest, encoded already


def test_an_image_the_budget_cannot_afford_is_encoded_in_a_step_of_its_own():
    scheduler = static_scheduler(streams=4)
    req = image_request("img", [100], [1000])
    scheduler.add(req)
    # The text before it; then its encode of one unit (1,000 > 512) alone; then chunks.
    assert run_image_step(scheduler)["img"] == (100, [])
    assert run_image_step(scheduler)["img"] == (0, [(0, 1)])
    assert run_image_step(scheduler)["img"] == (512, [])
    assert run_image_step(scheduler)["img"] == (488 + 8, [])  # the image's last, the text
    assert req.state is RequestState.DECODING


def test_a_second_prompt_in_the_step_encodes_only_what_the_budget_leaves_room_for():
    scheduler = static_scheduler(streams=2, prefill_policy="fcfs")
    scheduler.add(request("text", 200))
    scheduler.add(image_request("img", [0], [400]))
    scheduler.add(image_request("late", [0], [100]))
    steps = run_image_step(scheduler)
    # 312 left after the text: the image of 400 waits (it would be forced only as the step's
    # first prompt chunk), and the one of 100 behind it is encoded.
    assert steps["text"] == (200, [])
    assert "img" not in steps
    assert steps["late"] == (108, [(0, 1)])
    assert run_image_step(scheduler)["img"] == (112, [(0, 1)])


class FakeEncodeCost(FakeCostModel):
    """FakeCostModel whose encodes cost `per_image_token` each of their placeholder tokens."""

    def __init__(self, *costs: float, per_image_token: float) -> None:
        super().__init__(*costs)
        self.per_image_token = per_image_token

    def encode_cost(self, image_tokens: int, prefill_start: int) -> int:
        return math.ceil(self.per_image_token * image_tokens / self.per_token)


def test_under_a_target_the_chunk_shrinks_by_the_encodes_predicted_time():
    model = FakeEncodeCost(0.15, 0.01, 0.001, per_image_token=0.0002)
    config = SchedulerConfig(min_prefill_chunk=64)
    scheduler = Scheduler(
        config,
        KVManager(BlockPool(2048, 16)),
        prefill_budget=model.prefill_budget,
        encode_cost=model.encode_cost,
        itl_targets=model.targets,
    )
    for i in range(4):
        scheduler.add(request(f"s{i}", 8))
    run_image_step(scheduler)
    scheduler.add(image_request("img", [20], [200]))
    # 110 tokens fit beside the decodes; the encode takes 200 x 0.2 ms = 40 ms of them.
    assert run_image_step(scheduler)["img"] == (110 - 40, [(0, 1)])
    while scheduler.running[-1].state is RequestState.PREFILLING:
        assert run_image_step(scheduler)["img"][1] == []
    # An encode of one unit longer than the whole target: a step of its own.
    model.per_image_token = 0.001
    scheduler.add(image_request("big", [0], [300]))
    assert run_image_step(scheduler)["big"] == (0, [(0, 1)])
    assert run_image_step(scheduler)["big"] == (100, [])  # then what fits beside 5 decodes


def test_an_encode_is_cut_into_the_units_the_budget_affords_and_the_prompt_waits_for_it():
    """An image of 1,000 tokens whose encode is 41 units costs 25 prompt tokens a unit: each
    step runs what the 512-token budget leaves room for, the streams decode every step, and
    the image's tokens wait until its encode is complete."""
    scheduler = static_scheduler(streams=4)
    req = image_request("img", [100], [1000], units=41)
    scheduler.add(req)
    per_unit = -(-1000 // 41)
    steps = []
    while 0 not in req.image_embeds:
        before = req.num_computed
        step = run_image_step(scheduler)
        assert all(step[f"s{i}"] == (1, []) for i in range(4))
        tokens, [(_, units)] = step["img"]
        text = max(0, min(tokens, 100 - before))  # the step's tokens before the image
        assert units <= (512 - text) // per_unit
        if 0 not in req.image_embeds:
            assert tokens == text  # none of the image's tokens before its encode completes
            assert req.image_encodes[0].done == sum(e[0][1] for _, e in steps) + units
        steps.append(step["img"])
    assert steps == [(100, [(0, 16)]), (0, [(0, 20)]), (512 - 5 * per_unit, [(0, 5)])]
    assert not req.image_encodes


def test_under_a_target_an_encode_unit_costs_its_share_of_the_encodes_predicted_time():
    model = FakeEncodeCost(0.15, 0.01, 0.001, per_image_token=0.001)
    scheduler = Scheduler(
        SchedulerConfig(min_prefill_chunk=64),
        KVManager(BlockPool(2048, 16)),
        prefill_budget=model.prefill_budget,
        encode_cost=model.encode_cost,
        itl_targets=model.targets,
    )
    for i in range(4):
        scheduler.add(request(f"s{i}", 8))
    run_image_step(scheduler)
    req = image_request("img", [0], [300], units=11)
    scheduler.add(req)
    # 110 prompt tokens fit beside the decodes; the encode takes 300 of them, 28 a unit.
    assert run_image_step(scheduler)["img"] == (0, [(0, 110 // 28)])
    while 0 not in req.image_embeds:
        assert run_image_step(scheduler)["img"][1][0][1] <= 110 // 28


def test_cancel_mid_encode_frees_the_encode_and_the_blocks():
    scheduler = static_scheduler(streams=1)
    used = scheduler.kv.pool.num_used
    req = image_request("img", [100], [1000], units=41)
    scheduler.add(req)
    run_image_step(scheduler)
    assert 0 in req.image_encodes and scheduler.kv.pool.num_used > used
    scheduler.remove(req)
    assert not req.image_encodes and not req.image_embeds
    assert scheduler.kv.pool.num_used == used


def test_class_targets_parse_and_target_itl_ms_fills_the_rest():
    config = EngineConfig.of(class_itl_ms="interactive=150, batch=2000", target_itl_ms=400)
    config.class_ttft_ms = "interactive=1500"
    assert config.latency_targets() == (
        {"interactive": 1.5},
        {"interactive": 0.15, "standard": 0.4, "batch": 2.0},
    )
    for bad, says in [
        ("urgent=100", "'urgent' is not a service class"),
        ("interactive", "'interactive' is not CLASS=MILLISECONDS"),
        ("interactive=fast", "'interactive=fast' is not CLASS=MILLISECONDS"),
        ("interactive=0", "interactive's target must be positive"),
        ("interactive=nan", "interactive's target must be positive"),
    ]:
        with pytest.raises(ValueError, match=re.escape(f"class_itl_ms: {says}")):
            EngineConfig.of(class_itl_ms=bad)


def test_a_stricter_class_defers_looser_decodes_in_turns_to_meet_its_target():
    """20 batch streams and 1 interactive stream decode, under interactive=150 ms, with 10 ms
    a decode: all 21 would take 210 ms. Batch decodes wait a step, as few as keep the step
    within the target (14 decodes), the interactive one never; they take turns, so each batch
    stream still gets a token every few steps. A waiting batch prompt gets what the target
    leaves and no batch decode waits for it; an interactive prompt gets 64 tokens at least, as
    many batch decodes waiting for it as that takes. Without the interactive stream nothing
    waits (batch has no target)."""
    model = FakeCostModel(target=0, per_decode=0.01, per_token=0.001)
    scheduler = Scheduler(
        SchedulerConfig(min_prefill_chunk=64, max_num_seqs=64),
        KVManager(BlockPool(4096, 16)),
        prefill_budget=model.prefill_budget,
        itl_targets={"interactive": 0.15},
    )
    for i in range(20):
        scheduler.add(classed(f"b{i}", 8, "batch"))
    run_step(scheduler)
    assert len(run_step(scheduler)) == 20  # batch alone: every stream, every step
    scheduler.add(classed("chat", 8, "interactive"))
    run_step(scheduler)  # its prompt
    scheduler.add(classed("long", 5000, "batch"))
    for req in scheduler.running:
        req.last_token_time = 0.0
    given: dict[str, int] = {}
    clock = iter(range(1, 100))

    def steps(count: int, decodes: int, prompt: str, prompt_tokens: int) -> None:
        for _ in range(count):
            sizes, now = run_step(scheduler), next(clock)
            assert sizes["chat"] == 1
            assert sum(n == 1 for n in sizes.values()) == decodes
            assert sizes[prompt] == prompt_tokens
            for rid in sizes:
                given[rid] = given.get(rid, 0) + 1
            for req in scheduler.running:  # the engine stamps each token's time
                if req.request_id in sizes:
                    req.last_token_time = float(now)

    steps(3, 14, "long", 10)  # 1 interactive + 13 batch decodes, (0.15 - 14 x 0.01) / 0.001
    batch = [n for rid, n in given.items() if rid.startswith("b")]
    assert len(batch) == 20 and max(batch) == 2  # 39 turns over 20 streams: in turn
    scheduler.add(classed("question", 5000, "interactive"))
    steps(2, 8, "question", 70)  # 1 + 7 batch decodes, (0.15 - 8 x 0.01) / 0.001
