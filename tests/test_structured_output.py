"""Constrained decoding and n > 1 in the engine: outputs match their grammar, a constrained
row changes no other row's tokens, a grammar failure fails only its request, and n choices
share their prompt's KV blocks."""

from __future__ import annotations

import json

import jsonschema
import pytest
from helpers import prompt

from gapless.engine.config import EngineConfig
from gapless.engine.engine import Engine
from gapless.engine.events import FinishedEvent, TokenEvent
from gapless.engine.sampling_params import SamplingParams
from gapless.engine.structured import GrammarError, choice_grammar, json_schema_grammar

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 3},
    },
    "required": ["name", "age", "tags"],
    "additionalProperties": False,
}


@pytest.fixture
def engine(checkpoint) -> Engine:
    # Small chunks, also when idle: a long prompt prefills over many steps.
    config = EngineConfig.of(
        dtype="float32",
        device="cpu",
        prefill_chunk=16,
        idle_prefill_chunk=16,
        enable_prefix_cache=False,
    )
    return Engine.from_pretrained(checkpoint("llama"), config)


def collect(out: dict[tuple[str, int], dict], events: list) -> None:
    """Per (request id, choice index): tokens, text and finish."""
    for event in events:
        if isinstance(event, TokenEvent | FinishedEvent):
            entry = out.setdefault((event.request_id, event.index), {"tokens": [], "text": ""})
        if isinstance(event, TokenEvent):
            entry["tokens"] += event.token_ids
            entry["text"] += event.text
        elif isinstance(event, FinishedEvent):
            entry["finish"] = event


def run(engine: Engine, out: dict | None = None) -> dict[tuple[str, int], dict]:
    """Steps until idle, collecting into `out`; every KV block is free at the end."""
    out = {} if out is None else out
    while engine.has_work:
        collect(out, engine.step())
    assert engine.kv.pool.num_used == 0
    return out


def free_params() -> list[SamplingParams]:
    return [
        SamplingParams(max_tokens=24, temperature=0, ignore_eos=True),
        SamplingParams(max_tokens=24, temperature=0.9, top_p=0.9, seed=11, ignore_eos=True),
    ]


def test_json_schema_outputs_validate_and_leave_other_rows_unchanged(engine):
    alone = [engine.add_request(prompt(9, i), p) for i, p in enumerate(free_params())]
    want = run(engine)

    free = [engine.add_request(prompt(9, i), p) for i, p in enumerate(free_params())]
    grammar = json_schema_grammar(PERSON)
    constrained = [
        engine.add_request(
            prompt(7, 5), SamplingParams(max_tokens=80, temperature=0, grammar=grammar)
        ),
        engine.add_request(
            prompt(7, 6),
            SamplingParams(max_tokens=80, temperature=1.0, seed=3, n=2, grammar=grammar),
        ),
    ]
    long_prompt = engine.add_request(prompt(200, 9), SamplingParams(max_tokens=4))
    got = run(engine)

    for before, after in zip(alone, free, strict=True):
        assert got[after, 0]["tokens"] == want[before, 0]["tokens"]
    outputs = [got[rid, 0] for rid in constrained] + [got[constrained[1], 1]]
    for output in outputs:
        assert output["finish"].finish_reason == "stop"  # the grammar completed
        jsonschema.validate(json.loads(output["text"]), PERSON)
    assert got[long_prompt, 0]["finish"].finish_reason == "length"


def test_choice_grammar_ends_when_the_choice_is_complete(engine):
    grammar = choice_grammar(["yes", "no", "maybe later"])
    rid = engine.add_request(
        prompt(5), SamplingParams(max_tokens=50, temperature=1.0, seed=1, n=4, grammar=grammar)
    )
    got = run(engine)
    for i in range(4):
        assert got[rid, i]["text"] in ("yes", "no", "maybe later")
        assert got[rid, i]["finish"].finish_reason == "stop"


def test_a_failing_grammar_fails_only_its_request(engine):
    free = engine.add_request(prompt(9), free_params()[0])
    bad = engine.add_request(
        prompt(7), SamplingParams(max_tokens=20, grammar=json_schema_grammar(PERSON))
    )

    def broken():
        raise GrammarError("the matcher broke")

    engine.intake.sequences(bad)[0].sampling.matcher.allowed = broken
    got = run(engine)
    assert got[bad, 0]["finish"].finish_reason == "error"
    assert "the matcher broke" in got[bad, 0]["finish"].error
    assert got[free, 0]["finish"].finish_reason == "length"
    assert len(got[free, 0]["tokens"]) == 24


def test_n_choices_share_the_prompt_blocks_and_draw_from_seed_plus_index(engine):
    bs = engine.kv.pool.block_size
    ids = prompt(2 * bs + 8)  # two full blocks and a partly filled one
    params = SamplingParams(max_tokens=6, temperature=1.0, seed=40, n=3, ignore_eos=True)
    rid = engine.add_request(ids, params)
    got: dict = {}
    while not all(r.output_ids for r in engine.intake.sequences(rid)):
        collect(got, engine.step())
    # The first choice's 3 blocks; each other choice adds only its copy of the partial block.
    assert engine.kv.pool.num_used == 3 + 2
    run(engine, got)
    assert got[rid, 0]["finish"].prompt_tokens == len(ids)

    for i in range(3):
        alone = engine.add_request(
            ids, SamplingParams(max_tokens=6, temperature=1.0, seed=40 + i, ignore_eos=True)
        )
        assert run(engine)[alone, 0]["tokens"] == got[rid, i]["tokens"]
    assert len({tuple(got[rid, i]["tokens"]) for i in range(3)}) > 1


def test_cancelling_a_request_for_n_frees_every_choice(engine):
    rid = engine.add_request(prompt(40), SamplingParams(max_tokens=100, n=4, ignore_eos=True))
    while not all(r.output_ids for r in engine.intake.sequences(rid)):
        engine.step()
    engine.cancel(rid)
    got = run(engine)
    assert [got[rid, i]["finish"].finish_reason for i in range(4)] == ["cancelled"] * 4
    assert engine.kv.pool.num_used == 0


def test_cancelled_before_the_fork_ends_the_waiting_choices_too(engine):
    rid = engine.add_request(prompt(100), SamplingParams(max_tokens=5, n=3))
    got: dict = {}
    collect(got, engine.step())  # one chunk of the prompt: the other choices wait to fork
    assert [len(r.forks) for r in engine.intake.sequences(rid)] == [2, 0, 0]
    engine.cancel(rid)
    run(engine, got)
    assert sorted(i for r, i in got if r == rid) == [0, 1, 2]
    assert all(got[rid, i]["finish"].finish_reason == "cancelled" for i in range(3))
