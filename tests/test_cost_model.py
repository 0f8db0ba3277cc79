"""The latency-target budget: fitted from step timings, it keeps predicted steps under target."""

from __future__ import annotations

import random

import pytest

from gapless import Engine, EngineConfig, SamplingParams
from gapless.engine.cost_model import CALIBRATION_WINDOW, StepCostModel, step_features

# Seconds: base, per decode, per prompt token, per pair, per placeholder token of an image
# encoded, once for a step with prompt tokens.
TRUE = [0.02, 0.001, 2e-4, 3e-8, 1e-3, 0.03]


def true_time(features: list[float]) -> float:
    return sum(c * f for c, f in zip(TRUE, features, strict=True))


def trained_model(encodes: bool = False) -> StepCostModel:
    """Fitted on 200 random steps; with `encodes`, one in 50 of the chunk steps encodes an
    image of 64 to 1,024 tokens."""
    model = StepCostModel(fallback_chunk=512)
    rng = random.Random(0)
    for _ in range(200):
        decodes = [rng.randint(10, 4000) for _ in range(rng.randint(0, 16))]
        chunks = [(rng.randint(16, 2048), rng.randint(0, 8000))] if rng.random() < 0.7 else []
        encoded = rng.randint(64, 1024) if encodes and chunks and rng.random() < 0.02 else 0
        features = step_features(decodes, chunks, encoded)
        model.observe(features, true_time(features) * rng.uniform(0.97, 1.03))
    return model


def test_budget_meets_the_target_and_is_near_the_largest_that_does():
    model = trained_model()
    for decodes, start in [([100] * 4, 0), ([3000] * 8, 6000), ([500], 2000)]:
        budget = model.prefill_budget(decodes, start, 0.15)
        assert true_time(step_features(decodes, [(budget, start)])) <= 0.15 * 1.05
        assert true_time(step_features(decodes, [(int(budget * 1.1) + 16, start)])) > 0.15


def test_the_fit_prices_a_chunk_steps_fixed_cost_apart_from_its_tokens():
    """Decode-only steps and steps with a few prompt tokens are both predicted within the
    timings' noise, and a tight target gets the small chunk that fits beside the fixed cost."""
    model = trained_model()
    decodes = [100] * 4  # 24 ms alone, 54 with any prompt token
    for chunks in ([], [(8, 0)], [(64, 0)], [(1024, 3000)]):
        features = step_features(decodes, chunks)
        assert model.predict(features) == pytest.approx(true_time(features), rel=0.03)
    budget = model.prefill_budget(decodes, 0, 0.07)
    assert budget > 0 and true_time(step_features(decodes, [(budget, 0)])) <= 0.07 * 1.03
    assert true_time(step_features(decodes, [(int(budget * 1.1) + 16, 0)])) > 0.07


def test_longer_context_gets_a_smaller_budget():
    model = trained_model()
    assert model.prefill_budget([100] * 4, 7000, 0.15) < model.prefill_budget([100] * 4, 0, 0.15)


def test_untrained_model_uses_the_static_chunk_and_overload_allows_no_prompt_tokens():
    assert StepCostModel(fallback_chunk=384).prefill_budget([10], 0, 0.1) == 384
    model = trained_model()  # decodes alone take longer than 5 ms
    assert model.prefill_budget([100] * 8, 0, 0.005) == 0


def test_steps_slower_than_predicted_shrink_the_budget_until_they_meet_the_target():
    """A fit that is right on average overruns the target on half its steps; chunk steps
    running 30% over the fit (e.g. the HTTP side taking CPU) must still meet it."""
    model = trained_model()
    decodes, start = [100] * 4, 2000
    unslowed = model.prefill_budget(decodes, start, 0.15)
    rng = random.Random(1)
    slower = []
    for _ in range(64):
        features = step_features(decodes, [(model.prefill_budget(decodes, start, 0.15), start)])
        slower.append(true_time(features) * rng.uniform(1.2, 1.3))
        model.observe(features, slower[-1])
    assert model.prefill_budget(decodes, start, 0.15) < unslowed
    # Once a tenth of the calibration window has seen it, every step is within the SLO (1.1x).
    assert max(slower[CALIBRATION_WINDOW // 10 + 1 :]) <= 0.15 * 1.1


@pytest.mark.parametrize("target", [{"target_itl_ms": 5}, {"class_itl_ms": "standard=5"}])
def test_engine_with_a_latency_target_gives_the_same_tokens(checkpoint, target):
    path = checkpoint("llama")
    params = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)
    want = Engine.from_pretrained(path, EngineConfig.of(dtype="float32"))
    outs = []
    for engine in (
        want,
        Engine.from_pretrained(path, EngineConfig.of(dtype="float32", **target)),
    ):
        ids = [engine.add_request([5 + i] * (30 + 40 * i), params) for i in range(4)]
        tokens: dict[str, list[int]] = {i: [] for i in ids}
        while engine.has_work:
            for e in engine.step():
                tokens[e.request_id] += getattr(e, "token_ids", [])
        outs.append([tokens[i] for i in ids])
    assert outs[0] == outs[1]


def test_a_model_that_has_only_seen_decodes_keeps_the_static_chunk():
    model = StepCostModel(fallback_chunk=512)
    for n in range(40):
        features = step_features([100 + n] * 4, [])
        model.observe(features, true_time(features))
    assert model.coef is not None
    assert model.prefill_budget([200] * 4, 0, 0.15) == 512


def test_an_encode_costs_the_prompt_tokens_that_take_as_long():
    model = trained_model(encodes=True)
    assert model._encode_steps >= 1  # the seed gives it a few to fit from
    for decodes, start in [([100] * 4, 0), ([500], 2000)]:
        budget = model.prefill_budget(decodes, start, 0.15)
        charge = model.encode_cost(40, start)
        # The chunk left beside a 40-token image's encode (40 ms) keeps the step in the target,
        # and is near the largest that does.
        assert true_time(step_features(decodes, [(budget - charge, start)], 40)) <= 0.15 * 1.05
        bigger = step_features(decodes, [(int((budget - charge) * 1.1) + 16, start)], 40)
        assert true_time(bigger) > 0.15
    # A prompt token later in the context costs more (its keys), so the same encode fewer.
    assert model.encode_cost(40, 8000) < model.encode_cost(40, 0)


def test_before_the_fit_has_seen_an_encode_it_costs_its_placeholder_tokens():
    assert trained_model().encode_cost(300, 0) == 300
    assert StepCostModel(fallback_chunk=512).encode_cost(300, 0) == 300


def test_encodes_the_fit_mispredicts_do_not_shrink_later_chunks():
    """Steps that encode are not calibrated on: encodes of equal images whose times vary
    sixfold (the fit takes their mean) leave the budget of chunk steps as it was."""
    model = trained_model()
    decodes, start = [100] * 4, 2000
    before = model.prefill_budget(decodes, start, 0.15)
    for i in range(CALIBRATION_WINDOW // 4):
        features = step_features(decodes, [(100, start)], 500)
        model.observe(features, true_time(features) * (3 if i % 2 else 0.5))
    # (Refitted on them, the other coefficients move a little.)
    assert model.prefill_budget(decodes, start, 0.15) >= before * 0.98
