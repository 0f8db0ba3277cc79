"""Images through the engine (issue 28): a request's image tokens prefill in chunks like text,
its encoder runs once per image in a step whose budget it is charged against, and the tokens
equal transformers' generate; chunks of 16 that cut the regions give the same tokens (Gemma 3's,
whose tokens attend to each other both ways, are never cut: chunks end before them or run to
their end); the prefix cache shares blocks only for the same image; cancelling frees blocks and
embeddings; and each bad image is refused at admission with a message naming its limit."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from helpers import bomb, png
from PIL import Image
from test_model import prompt
from test_vision import (
    IMAGE_TOKEN,
    IMAGES,
    hf_inputs,
    hf_vlm,
)

from gapless.engine.admission import RequestError
from gapless.engine.config import EngineConfig
from gapless.engine.engine import Engine
from gapless.engine.events import FinishedEvent, TokenEvent
from gapless.engine.sampling_params import SamplingParams

MODELS = ["llava-clip", "qwen2_5_vl", "gemma3"]  # conftest's vlm builds them
NEW_TOKENS = 6


def engine_of(path: Path, chunk: int = 512, **options) -> Engine:
    config = EngineConfig.of(
        dtype="float32",
        kv_cache_dtype="float32",  # compared with transformers' float32
        kv_cache_tokens=2048,
        speculate="none",
        prefill_chunk=chunk,
        idle_prefill_chunk=chunk,
        **options,
    )
    return Engine.from_pretrained(path, config)


def two_image_prompt() -> list[int]:
    """Text, an image's placeholder, text, the next image's, text."""
    return prompt(13, seed=1) + [IMAGE_TOKEN] + prompt(9, seed=2) + [IMAGE_TOKEN] + prompt(5)


def run(engine: Engine, ids: list[int], images: list, max_tokens: int = NEW_TOKENS) -> list[int]:
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    request_id = engine.add_request(ids, params, images=[png(i) for i in images])
    tokens = []
    while engine.has_work:
        events = engine.step()
        assert {e.request_id for e in events} <= {request_id}  # the only request here
        tokens += [t for e in events if isinstance(e, TokenEvent) for t in e.token_ids]
    return tokens


def expected(path: Path, engine: Engine, ids: list[int], images: list) -> list[int]:
    """transformers' greedy tokens for the prompt with each placeholder expanded."""
    expanded = list(engine.admission.check_prompt(ids, images=[png(i) for i in images]))
    hf, hf_processor = hf_vlm(path)
    inputs = hf_inputs(hf_processor, images, expanded)
    with torch.no_grad():
        out = hf.generate(
            torch.tensor([expanded]),
            **inputs,
            max_new_tokens=NEW_TOKENS,
            min_new_tokens=NEW_TOKENS,
            do_sample=False,
        )
    return out[0, len(expanded) :].tolist()


@pytest.mark.parametrize("name", MODELS)
def test_greedy_tokens_with_two_images_equal_transformers_whole_and_in_16_token_chunks(
    vlm, name: str
) -> None:
    path = vlm(name)
    whole = engine_of(path)
    ids, images = two_image_prompt(), IMAGES[:2]
    want = expected(path, whole, ids, images)
    assert run(whole, ids, images) == want
    chunked = engine_of(path, chunk=16, enable_prefix_cache=False)
    placed = chunked.admission.check_prompt(ids, images=[png(i) for i in images]).images
    assert any(p.start % 16 and p.length > 16 - p.start % 16 for p in placed)  # a chunk cuts one
    assert run(chunked, ids, images) == want
    assert chunked.kv.pool.num_used == 0


@pytest.mark.parametrize("name", ["llava-clip", "gemma3"])
def test_image_request_beside_decodes_keeps_one_token_per_step(vlm, name: str) -> None:
    engine = engine_of(vlm(name), chunk=16)
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    streams = [engine.add_request(prompt(7, seed=10 + i), params) for i in range(3)]
    for _ in range(3):
        engine.step()  # the streams' prompts are done; they decode from here
    engine.add_request(two_image_prompt(), params, images=[png(i) for i in IMAGES[:2]])
    for _ in range(6):
        tokens = {e.request_id for e in engine.step() if isinstance(e, TokenEvent)}
        assert set(streams) <= tokens


def gemma3_steps(
    engine: Engine, ids: list[int], images: list, prompt_logprobs: int | None = None
) -> tuple[list[int], list[int], list | None]:
    """Runs the request alone: its greedy tokens, how far its prompt was computed after each
    step, and its prompt logprobs."""
    params = SamplingParams(
        max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True, prompt_logprobs=prompt_logprobs
    )
    engine.add_request(ids, params, images=[png(i) for i in images])
    engine.step()
    [req] = engine.scheduler.running
    computed, tokens, finished = [req.num_computed], [], []
    while engine.has_work:
        events = engine.step()
        tokens += [t for e in events if isinstance(e, TokenEvent) for t in e.token_ids]
        finished += [e for e in events if isinstance(e, FinishedEvent)]
        computed.append(min(req.num_computed, len(req.prompt_ids)))
    return tokens, computed, finished[0].prompt_logprobs


def test_gemma3_images_are_never_cut_by_a_chunk(vlm) -> None:
    """With 8-token chunks, shorter than an image (16 tokens): each chunk that would end inside
    one ends before it, and the image then runs whole in the next; the prompt logprobs and
    tokens equal transformers'. Then a prompt whose prefix-cache hit ends inside an image: the
    rest of the image runs whole."""
    path = vlm("gemma3")
    engine = engine_of(path, chunk=8)
    ids, images = two_image_prompt(), IMAGES[:2]
    checked = engine.admission.check_prompt(ids, images=[png(i) for i in images])
    hf, hf_processor = hf_vlm(path)
    with torch.no_grad():
        inputs = hf_inputs(hf_processor, images, checked)
        logits = hf(input_ids=torch.tensor([checked]), **inputs).logits[0]
    want = logits[:-1].log_softmax(-1).gather(1, torch.tensor(checked[1:])[:, None])[:, 0]
    tokens, computed, logprobs = gemma3_steps(engine, ids, images, prompt_logprobs=0)
    assert logprobs[0] is None
    got = torch.tensor([logprob for _, logprob, _ in logprobs[1:]])
    assert (got - want).abs().max().item() < 1e-4
    assert tokens == expected(path, engine, ids, images)
    steps = sorted(set(computed))
    for image in checked.images:
        assert image.length > 8
        assert not any(image.start < c < image.end for c in steps)
        assert steps[steps.index(image.start) + 1] == image.end  # one step, past the budget

    # The same text and first image, then other text: the cache holds the first block only,
    # which ends 3 tokens into the image; once the image is encoded (two steps of 8 tokens'
    # budget: 4 units of 4), the 13 after it, more than a chunk, run in one step.
    other = prompt(13, seed=1) + [IMAGE_TOKEN] + prompt(20, seed=7)
    hit = engine.scheduler.prefix_hit_tokens
    tokens, computed, _ = gemma3_steps(engine, other, images[:1])
    assert engine.scheduler.prefix_hit_tokens - hit == 16
    first = checked.images[0]
    assert first.start < 16 and sorted(set(computed))[:2] == [16, first.end]
    assert tokens == expected(path, engine, other, images[:1])


def test_cancel_during_prefill_frees_blocks_and_embeddings(vlm) -> None:
    engine = engine_of(vlm("llava-clip"), chunk=16)
    request_id = engine.add_request(
        two_image_prompt(), SamplingParams(max_tokens=4), images=[png(IMAGES[0]), png(IMAGES[1])]
    )
    engine.step()  # the text before the first image: no unit of its encode (12 tokens) fits
    [req] = engine.scheduler.running
    assert not req.image_encodes
    engine.step()  # one unit of its encode (of 3)
    assert list(req.image_encodes) == [0] and not req.image_embeds
    engine.cancel(request_id)  # mid-encode
    engine.step()
    assert not req.image_encodes and not req.image_embeds
    assert engine.kv.pool.num_used == 0
    assert not engine.has_work


@pytest.mark.parametrize("name", MODELS)
def test_an_encode_cut_unit_by_unit_gives_the_whole_encodes_embeddings(vlm, name: str) -> None:
    engine = engine_of(vlm(name))
    encoder = engine.runner.encoder
    units = encoder.encode_units
    for prepared in engine.admission.check_images([png(i) for i in IMAGES[:2]]):
        steps = encoder.encode_steps(prepared)
        assert [steps.advance(1) for _ in range(units)] == [False] * (units - 1) + [True]
        assert torch.equal(steps.embeds, encoder.encode(prepared))  # bit for bit


@pytest.mark.parametrize("name", MODELS)
def test_an_encode_cut_across_steps_beside_decodes_gives_the_same_tokens(vlm, name: str) -> None:
    """With 4-token chunks, each image's encode runs a unit or so a step while three streams
    decode, every step; no step runs more units than the rule allows (the encode's price over
    its units each, one at least when the image is first in line); the image's
    tokens wait for its encode; the tokens equal an uncut run's."""
    path = vlm(name)
    ids, images = two_image_prompt(), IMAGES[:2]
    want = run(engine_of(path), ids, images)
    engine = engine_of(path, chunk=4, enable_prefix_cache=False)
    params = SamplingParams(max_tokens=300, temperature=0.0, ignore_eos=True)
    streams = [engine.add_request(prompt(3, seed=10 + i), params) for i in range(3)]
    for _ in range(3):
        engine.step()  # the streams' prompts are done; they decode from here
    # Each encode priced at its placeholder tokens (the rule until the cost model has fitted
    # one): the fitted price follows the machine's timings, and this test the cutting.
    engine.scheduler.encode_cost = lambda tokens, start: tokens
    ran: list[tuple[int, int, int]] = []  # image, units run, the image's encode price
    encode, price = engine.runner.encode, engine.scheduler.encode_cost

    def spy(chunk):
        for i, units in chunk.encodes:
            length = chunk.request.images[i].length
            ran.append((i, units, price(length, chunk.request.num_computed)))
        return encode(chunk)

    engine.runner.encode = spy
    checked = engine.admission.check_prompt(ids, images=[png(i) for i in images])
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
    mine = engine.add_request(checked, params)
    tokens, cut, finished = [], 0, False
    while not finished:
        ran.clear()
        events = engine.step()
        assert set(streams) <= {e.request_id for e in events if isinstance(e, TokenEvent)}
        for e in events:
            if e.request_id == mine and isinstance(e, TokenEvent):
                tokens += e.token_ids
            finished |= e.request_id == mine and isinstance(e, FinishedEvent)
        for i, units, cost in ran:
            image = checked.images[i]
            assert units <= max(1, 4 // -(-cost // image.units))
            cut += units < image.units
        for req in engine.scheduler.running:
            for i in req.image_encodes:  # an encode in progress: none of its tokens computed
                assert req.num_computed <= req.images[i].start
    assert cut  # an encode ran over several steps
    assert tokens == want


def test_embeddings_are_freed_once_the_prompt_passes_the_image(vlm) -> None:
    engine = engine_of(vlm("llava-clip"), chunk=16)
    engine.add_request(
        two_image_prompt(), SamplingParams(max_tokens=8), images=[png(IMAGES[0]), png(IMAGES[1])]
    )
    engine.step()
    [req] = engine.scheduler.running
    seen = set()
    while req.num_computed < len(req.prompt_ids):
        seen |= set(req.image_embeds)
        for i in req.image_embeds:
            assert req.images[i].end > req.num_computed  # not yet passed
        engine.step()
    assert seen == {0, 1}
    assert not req.image_embeds


def test_prefix_cache_shares_blocks_for_the_same_image_only(vlm) -> None:
    engine = engine_of(vlm("llava-clip"))
    ids = prompt(40, seed=3) + [IMAGE_TOKEN] + prompt(20, seed=4)
    cached = []
    for image in (IMAGES[0], IMAGES[0], IMAGES[1]):
        run(engine, ids, [image], max_tokens=1)
        cached.append(engine.scheduler.prefix_hit_tokens)
    first, same, other = cached[0], cached[1] - cached[0], cached[2] - cached[1]
    placed = engine.admission.check_prompt(ids, images=[png(IMAGES[0])]).images[0]
    assert first == 0
    assert same >= placed.end // 16 * 16  # the image's blocks served again
    assert other == placed.start // 16 * 16  # only the text before it


def test_under_a_latency_target_each_encode_is_timed_as_its_own_cost(vlm) -> None:
    """With --target-itl-ms the tokens are the same, and the cost model is told each step's
    encoded placeholder tokens as the share of the encodes it runs: units of each image's
    tokens over its units, adding up to the two images' tokens, once each."""
    path = vlm("llava-clip")
    ids, images = two_image_prompt(), IMAGES[:2]
    want = run(engine_of(path, chunk=16), ids, images)
    engine = engine_of(path, chunk=16, target_itl_ms=1000)
    observed: list[float] = []
    observe = engine.cost_model.observe
    engine.cost_model.observe = lambda f, t: (observed.append(f[4]), observe(f, t))[1]
    assert run(engine, ids, images) == want
    placed = engine.admission.check_prompt(ids, images=[png(i) for i in images]).images
    per_unit = placed[0].length / placed[0].units  # the two images are alike
    assert all((n / per_unit).is_integer() for n in observed)
    assert sum(observed) == sum(p.length for p in placed)


def test_without_a_target_encodes_are_priced_by_the_cost_model(vlm) -> None:
    """A vision-language engine keeps a cost model without a latency target, and the
    scheduler charges encodes its price (placeholder tokens until it has fitted one); the
    chunk budget stays the fixed one, and the tokens are unchanged."""
    path = vlm("llava-clip")
    ids, images = two_image_prompt(), IMAGES[:2]
    want = run(engine_of(path, chunk=16), ids, images)
    engine = engine_of(path, chunk=16)
    model = engine.cost_model
    assert model is not None and engine.scheduler.encode_cost == model.encode_cost
    assert engine.scheduler.targets is None  # no target: chunks stay 16 tokens
    for _ in range(3):
        assert run(engine, ids, images) == want
    assert model.trained


def test_text_only_model_refuses_images(tmp_path: Path) -> None:
    from checkpoints import make_checkpoint

    engine = Engine.from_pretrained(make_checkpoint(tmp_path, "llama"), EngineConfig.of())
    with pytest.raises(RequestError, match="takes no images"):
        engine.add_request([1, 2, 3], images=[png(IMAGES[0])])


BAD = {
    "corrupt": (lambda: b"\x89PNG\r\n\x1a\nnot really", "not a readable image"),
    "truncated": (lambda: png(IMAGES[0])[:60], "not a readable image"),
    "empty": (lambda: b"", "empty"),
    "bomb": (lambda: bomb(20_000), "--max-image-pixels"),
    "too many pixels": (lambda: png(Image.new("RGB", (200, 200))), "--max-image-pixels"),
}


@pytest.mark.parametrize("case", BAD)
def test_bad_images_are_refused_naming_the_limit(vlm, case: str) -> None:
    engine = engine_of(vlm("llava-clip"), max_image_pixels=100 * 100)
    data, message = BAD[case]
    with pytest.raises(RequestError, match=message) as caught:
        engine.add_request(two_image_prompt(), images=[data(), png(IMAGES[0])])
    assert caught.value.param == "images[0]"


def test_too_many_images_and_placeholder_mismatch_are_refused(vlm) -> None:
    engine = engine_of(vlm("llava-clip"), limit_mm_per_prompt=1)
    with pytest.raises(RequestError, match="--limit-mm-per-prompt"):
        engine.add_request(two_image_prompt(), images=[png(IMAGES[0]), png(IMAGES[1])])
    with pytest.raises(RequestError, match="placeholders"):
        engine.add_request(two_image_prompt(), images=[png(IMAGES[0])])
