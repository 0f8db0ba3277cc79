"""The latency-target budget: fitted from step timings, it keeps predicted steps under target."""

from __future__ import annotations

import random

from gapless import Engine, EngineConfig, SamplingParams
from gapless.engine.cost_model import CALIBRATION_WINDOW, StepCostModel, step_features

TRUE = [0.02, 0.001, 2e-4, 3e-8]  # seconds: base, per decode, per prompt token, per pair


def true_time(features: list[float]) -> float:
    return sum(c * f for c, f in zip(TRUE, features, strict=True))


def trained_model(target_s: float) -> StepCostModel:
    model = StepCostModel(target_s, fallback_chunk=512)
    rng = random.Random(0)
    for _ in range(200):
        decodes = [rng.randint(10, 4000) for _ in range(rng.randint(0, 16))]
        chunks = [(rng.randint(16, 2048), rng.randint(0, 8000))] if rng.random() < 0.7 else []
        features = step_features(decodes, chunks)
        model.observe(features, true_time(features) * rng.uniform(0.97, 1.03))
    return model


def test_budget_meets_the_target_and_is_near_the_largest_that_does():
    model = trained_model(target_s=0.15)
    for decodes, start in [([100] * 4, 0), ([3000] * 8, 6000), ([500], 2000)]:
        budget = model.prefill_budget(decodes, start)
        assert true_time(step_features(decodes, [(budget, start)])) <= 0.15 * 1.05
        assert true_time(step_features(decodes, [(int(budget * 1.1) + 16, start)])) > 0.15


def test_longer_context_gets_a_smaller_budget():
    model = trained_model(target_s=0.15)
    assert model.prefill_budget([100] * 4, 7000) < model.prefill_budget([100] * 4, 0)


def test_untrained_model_uses_the_static_chunk_and_overload_allows_no_prompt_tokens():
    assert StepCostModel(0.1, fallback_chunk=384).prefill_budget([10], 0) == 384
    model = trained_model(target_s=0.005)  # decodes alone take longer than this
    assert model.prefill_budget([100] * 8, 0) == 0


def test_steps_slower_than_predicted_shrink_the_budget_until_they_meet_the_target():
    """A fit that is right on average overruns the target on half its steps; chunk steps
    running 30% over the fit (e.g. the HTTP side taking CPU) must still meet it."""
    model = trained_model(target_s=0.15)
    decodes, start = [100] * 4, 2000
    unslowed = model.prefill_budget(decodes, start)
    rng = random.Random(1)
    slower = []
    for _ in range(64):
        features = step_features(decodes, [(model.prefill_budget(decodes, start), start)])
        slower.append(true_time(features) * rng.uniform(1.2, 1.3))
        model.observe(features, slower[-1])
    assert model.prefill_budget(decodes, start) < unslowed
    # Once a tenth of the calibration window has seen it, every step is within the SLO (1.1x).
    assert max(slower[CALIBRATION_WINDOW // 10 + 1 :]) <= 0.15 * 1.1


def test_engine_with_a_latency_target_gives_the_same_tokens(checkpoint):
    path = checkpoint("llama")
    params = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)
    want = Engine.from_pretrained(path, EngineConfig.of(dtype="float32"))
    outs = []
    for engine in (
        want,
        Engine.from_pretrained(path, EngineConfig.of(dtype="float32", target_itl_ms=5)),
    ):
        ids = [engine.add_request([5 + i] * (30 + 40 * i), params) for i in range(4)]
        tokens: dict[str, list[int]] = {i: [] for i in ids}
        while engine.has_work:
            for e in engine.step():
                tokens[e.request_id] += getattr(e, "token_ids", [])
        outs.append([tokens[i] for i in ids])
    assert outs[0] == outs[1]


def test_a_model_that_has_only_seen_decodes_keeps_the_static_chunk():
    model = StepCostModel(0.15, fallback_chunk=512)
    for n in range(40):
        features = step_features([100 + n] * 4, [])
        model.observe(features, true_time(features))
    assert model.coef is not None
    assert model.prefill_budget([200] * 4, 0) == 512
