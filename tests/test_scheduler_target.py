"""The latency-target policy in the scheduler, driven by a fake cost model: which chunks a step
gets, not how long they take."""

from __future__ import annotations

from gapless.engine.request import Request, RequestState
from gapless.engine.sampling_params import SamplingParams
from gapless.engine.scheduler import Scheduler, SchedulerConfig
from gapless.kv.block_pool import BlockPool


class FakeCostModel:
    """Predicts `per_decode` per decode and `per_token` per prompt token; returns the largest
    chunk that fits the target, as StepCostModel does."""

    def __init__(self, target: float, per_decode: float, per_token: float) -> None:
        self.target, self.per_decode, self.per_token = target, per_decode, per_token
        self.calls: list[tuple[list[int], int]] = []

    def prefill_budget(self, decode_contexts: list[int], prefill_start: int) -> int:
        self.calls.append((decode_contexts, prefill_start))
        spare = self.target - self.per_decode * len(decode_contexts)
        return max(0, int(round(spare / self.per_token, 6)))


def request(rid: str, prompt_len: int) -> Request:
    return Request(rid, list(range(1, prompt_len + 1)), SamplingParams(max_tokens=10_000))


def run_step(scheduler: Scheduler) -> dict[str, int]:
    """Schedules one step and plays the engine's part: computes the chunks, and a finished
    prompt starts decoding."""
    sizes = {}
    for chunk in scheduler.schedule():
        req = chunk.request
        req.num_computed += chunk.num_tokens
        if req.num_uncomputed == 0:
            req.state = RequestState.DECODING
            req.output_ids.append(7)
        sizes[req.request_id] = chunk.num_tokens
    return sizes


def decoding_scheduler(model: FakeCostModel, streams: int) -> Scheduler:
    config = SchedulerConfig(min_prefill_chunk=64, prefill_policy="shortest")
    scheduler = Scheduler(config, BlockPool(2048, 16), model.prefill_budget)
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
