"""Rerank and score: the engine scores (query, document) pairs by prefill alone, as transformers
computes them, on a *ForSequenceClassification head and on a yes/no reranker (Qwen3-Reranker's
recipe); a query's pairs share its prefix through the prefix cache; the Cohere/Jina rerank and
vLLM score endpoints serve them over HTTP, and refuse bad requests with nothing left behind."""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import tokenizers
import torch
from checkpoints import make_checkpoint, shared_tokenizer
from server_fixture import RunningServer, running_server
from test_engine import run

from gapless import Engine, EngineConfig
from gapless.engine.admission import RequestError
from gapless.engine.events import FinishedEvent
from gapless.engine.scoring import YES_NO_PAIR, YES_NO_PREFIX, YES_NO_SUFFIX
from gapless.model.demo import write_tokenizer_files
from gapless.server.settings import ServerSettings

# Float32 throughout, the KV cache too: scores are compared with transformers' float32 ones.
EXACT = {"dtype": "float32", "kv_cache_dtype": "float32"}
CHUNK = 8  # pairs prefill over several chunks
QUERY = "how do I read a file line by line in python"
DOCUMENTS = [
    "with open(path) as f:\n    for line in f:\n        print(line)",
    "import os\nprint(os.getcwd())",
    "def fibonacci(n):\n    return n if n < 2 else fibonacci(n - 1) + fibonacci(n - 2)",
    "for line in open(path).readlines(): print(line)",
]
MODEL = "reranker"
# The test checkpoints' decoders that transformers has a sequence classifier of.
CLASSIFIERS = {"qwen3": "Qwen3", "qwen2": "Qwen2", "llama": "Llama"}


def classifier(tmp: Path, arch: str) -> Path:
    """A tiny one-label *ForSequenceClassification checkpoint on the `arch` decoder: the test
    causal LM's layers, and a random `score` head."""
    import transformers

    base = make_checkpoint(tmp / "base", arch)
    cls = getattr(transformers, f"{CLASSIFIERS[arch]}ForSequenceClassification")
    torch.manual_seed(1)
    model = cls.from_pretrained(base, num_labels=1, dtype=torch.float32)
    out = tmp / "classifier"
    model.save_pretrained(out)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(base / name, out / name)
    return out


def yes_no_reranker(tmp: Path) -> Path:
    """A tiny Qwen3 causal LM whose tokenizer has the tokens "yes" and "no"."""
    tok = tokenizers.Tokenizer.from_str(shared_tokenizer().to_str())
    tok.add_tokens(["yes", "no"])
    out = make_checkpoint(tmp, "qwen3", vocab_size=tok.get_vocab_size(with_added_tokens=True))
    write_tokenizer_files(tok, out)
    return out


@pytest.fixture(scope="module", params=list(CLASSIFIERS))
def classifier_dir(request: pytest.FixtureRequest, tmp_path_factory: Any) -> Path:
    return classifier(tmp_path_factory.mktemp(f"cls-{request.param}"), request.param)


@pytest.fixture(scope="module")
def qwen3_classifier(tmp_path_factory: Any) -> Path:
    return classifier(tmp_path_factory.mktemp("cls-server"), "qwen3")


@pytest.fixture(scope="module")
def yes_no_dir(tmp_path_factory: Any) -> Path:
    return yes_no_reranker(tmp_path_factory.mktemp("yes-no"))


def engine(path: Path, **fields: Any) -> Engine:
    chunks = {"prefill_chunk": CHUNK, "idle_prefill_chunk": CHUNK}
    return Engine.from_pretrained(path, EngineConfig.of(**(EXACT | chunks | fields)))


def pairs(e: Engine, query: str, documents: list[str]) -> list[list[int]]:
    assert e.scorer is not None
    return [e.scorer.pair(e.tokenizer, query, d) for d in documents]


def scores(e: Engine, prompts: list[list[int]]) -> list[float]:
    """The engine's score of each pair prompt, by index, and its KV all returned."""
    rid = e.add_score(prompts)
    events = [ev for ev in run(e)[rid] if isinstance(ev, FinishedEvent)]
    assert len(events) == len(prompts) and all(ev.finish_reason == "stop" for ev in events)
    assert e.kv.pool.num_used == 0
    return [ev.score for ev in sorted(events, key=lambda ev: ev.index)]


def hf_classifier_scores(path: Path, prompts: list[list[int]]) -> list[float]:
    from transformers import AutoModelForSequenceClassification

    hf = AutoModelForSequenceClassification.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        return [torch.sigmoid(hf(torch.tensor([p])).logits[0, 0]).item() for p in prompts]


def hf_yes_no_scores(path: Path, prompts: list[list[int]], yes: int, no: int) -> list[float]:
    """Qwen3-Reranker's reference: the softmax over the last token's [no, yes] logits."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        last = [hf(torch.tensor([p])).logits[0, -1] for p in prompts]
    return [torch.stack([x[no], x[yes]]).softmax(-1)[1].item() for x in last]


def close(got: list[float], want: list[float], tol: float = 1e-4) -> bool:
    return max(abs(g - w) for g, w in zip(got, want, strict=True)) < tol


# -- the engine -----------------------------------------------------------------------------


def test_classifier_scores_are_transformers_sigmoid_of_its_head(classifier_dir):
    e = engine(classifier_dir)
    e.reserve_peak_memory()  # the start-up step, on a model with no lm_head
    prompts = pairs(e, QUERY, DOCUMENTS)
    # The tokenizer's pair encoding (its post-processor's pair template): bos query bos
    # document, the query first.
    assert prompts[0] == e.tokenizer.encode(QUERY) + e.tokenizer.encode(DOCUMENTS[0])
    got = scores(e, prompts)
    assert close(got, hf_classifier_scores(classifier_dir, prompts))
    assert len(set(got)) == len(got)  # the head tells the documents apart

    # It has no lm_head: generation is refused, not crashed into.
    with pytest.raises(RequestError) as refused:
        e.add_request("def f():")
    assert refused.value.param == "model" and "classifier" in str(refused.value)


def test_yes_no_reranker_scores_are_qwen3_rerankers_recipe(yes_no_dir):
    from transformers import AutoTokenizer

    e = engine(yes_no_dir, reranker=True)
    prompts = pairs(e, QUERY, DOCUMENTS)
    hf_tok = AutoTokenizer.from_pretrained(yes_no_dir)
    text = YES_NO_PAIR.format(
        instruction="Given a web search query, retrieve relevant passages that answer the query",
        query=QUERY,
        document=DOCUMENTS[0],
    )
    parts = [
        hf_tok.encode(p, add_special_tokens=False) for p in (YES_NO_PREFIX, text, YES_NO_SUFFIX)
    ]
    assert prompts[0] == [i for part in parts for i in part]
    yes, no = hf_tok.convert_tokens_to_ids("yes"), hf_tok.convert_tokens_to_ids("no")
    assert close(scores(e, prompts), hf_yes_no_scores(yes_no_dir, prompts, yes, no))


def test_a_causal_lm_scores_only_as_a_reranker(llama_dir):
    e = engine(llama_dir)
    assert e.scorer is None
    with pytest.raises(RequestError) as refused:
        e.add_score([[1, 2, 3]])
    assert refused.value.code == "model_cannot_score"


def test_a_querys_pairs_share_its_prefill_through_the_prefix_cache(yes_no_dir):
    # One step could prefill every pair at once: the others wait for the first's prefix.
    e = engine(yes_no_dir, reranker=True, idle_prefill_chunk=4096)
    prompts = pairs(e, QUERY, DOCUMENTS)
    shared = min(
        next(i for i, (a, b) in enumerate(zip(prompts[0], p, strict=False)) if a != b)
        for p in prompts[1:]
    )
    block = e.kv.block_size
    assert shared >= 4 * block  # the recipe's preamble and the query

    rid = e.add_score(prompts)
    events = {ev.index: ev for ev in run(e)[rid] if isinstance(ev, FinishedEvent)}
    # The first pair computes the shared blocks; every other is served them.
    assert events[0].cached_prompt_tokens == 0
    for i in range(1, len(prompts)):
        assert events[i].cached_prompt_tokens == shared // block * block
    assert e.scheduler.prefix_hit_tokens == (len(prompts) - 1) * (shared // block * block)
    # Served from the cache, a pair scores as it does alone.
    alone = [scores(engine(yes_no_dir, reranker=True), [p])[0] for p in prompts[1:]]
    assert close([events[i].score for i in range(1, len(prompts))], alone, 1e-5)


# -- the endpoints --------------------------------------------------------------------------


@pytest.fixture(scope="module")
def server(qwen3_classifier: Path) -> Iterator[RunningServer]:
    with running_server(
        qwen3_classifier, ServerSettings(MODEL), kv_cache_dtype="float32", max_model_len=96
    ) as s:
        yield s


@pytest.fixture(scope="module")
def want(qwen3_classifier: Path, server: RunningServer) -> list[float]:
    """transformers' score of each (QUERY, document) pair."""
    return hf_classifier_scores(qwen3_classifier, pairs(server.engine, QUERY, DOCUMENTS))


def test_rerank_sorts_by_score_and_keeps_top_n(server, want):
    order = sorted(range(len(DOCUMENTS)), key=lambda i: -want[i])
    tokens = sum(map(len, pairs(server.engine, QUERY, DOCUMENTS)))
    with server.client() as client:
        for path in ("/v1/rerank", "/rerank", "/v2/rerank"):
            body = {"model": MODEL, "query": QUERY, "documents": DOCUMENTS}
            r = client.post(path, json=body)
            assert r.status_code == 200, r.text
            out = r.json()
            assert out["model"] == MODEL and out["id"].startswith("rerank-")
            assert [x["index"] for x in out["results"]] == order
            assert close([x["relevance_score"] for x in out["results"]], [want[i] for i in order])
            assert all("document" not in x for x in out["results"])
            assert out["usage"] == {"total_tokens": tokens}

        # Jina's documents as objects, the texts returned, the best two only.
        objects = [{"text": d} for d in DOCUMENTS]
        body = {"query": QUERY, "documents": objects, "top_n": 2, "return_documents": True}
        out = client.post("/v1/rerank", json=body).json()
        assert [x["index"] for x in out["results"]] == order[:2]
        assert [x["document"] for x in out["results"]] == [objects[i] for i in order[:2]]
    assert server.engine.kv.pool.num_used == 0


def test_score_pairs_one_to_one_one_to_many_and_zipped(server, want):
    with server.client() as client:

        def score(text_1: Any, text_2: Any) -> list[float]:
            r = client.post("/v1/score", json={"model": MODEL, "text_1": text_1, "text_2": text_2})
            assert r.status_code == 200, r.text
            out = r.json()
            assert out["object"] == "list" and out["model"] == MODEL
            assert isinstance(out["created"], int) and out["id"].startswith("score-")
            assert [d["index"] for d in out["data"]] == list(range(len(out["data"])))
            assert all(d["object"] == "score" for d in out["data"])
            assert out["usage"]["total_tokens"] == out["usage"]["prompt_tokens"] > 0
            return [d["score"] for d in out["data"]]

        assert close(score(QUERY, DOCUMENTS[1]), [want[1]])
        assert close(score(QUERY, DOCUMENTS), want)
        assert close(score([QUERY], DOCUMENTS), want)
        assert close(score([QUERY] * len(DOCUMENTS), DOCUMENTS), want)
        # N:N zips: each text_1 with its own text_2.
        swapped = score([DOCUMENTS[0], QUERY], [QUERY, DOCUMENTS[0]])
        assert close(swapped[1:], want[:1])
        r = client.post("/score", json={"text_1": [QUERY, QUERY], "text_2": DOCUMENTS})
        assert r.status_code == 400 and r.json()["error"]["param"] == "text_2"
    assert server.engine.kv.pool.num_used == 0


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"documents": DOCUMENTS}, "query"),
        ({"query": 3, "documents": DOCUMENTS}, "query"),
        ({"query": QUERY}, "documents"),
        ({"query": QUERY, "documents": []}, "documents"),
        ({"query": QUERY, "documents": ["a", 7]}, "documents[1]"),
        ({"query": QUERY, "documents": [{"txt": "a"}]}, "documents[0].text"),
        ({"query": QUERY, "documents": DOCUMENTS, "top_n": 0}, "top_n"),
        ({"query": QUERY, "documents": DOCUMENTS, "top_n": "2"}, "top_n"),
        ({"query": QUERY, "documents": DOCUMENTS, "return_documents": "yes"}, "return_documents"),
    ],
)
def test_bad_rerank_requests_are_400s(server, body, param):
    with server.client() as client:
        r = client.post("/v1/rerank", json=body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param
    assert server.engine.kv.pool.num_used == 0


def test_a_pair_longer_than_the_context_is_refused_with_nothing_left(server):
    body = {"query": QUERY, "documents": ["short", "x = 1\n" * 200]}
    with server.client() as client:
        r = client.post("/v1/rerank", json=body)
        assert r.status_code == 400
        error = r.json()["error"]
        assert error["param"] == "documents[1]" and error["code"] == "context_length_exceeded"
        # A classifier generates nothing: a clear 400, and the server goes on.
        chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
        r = client.post("/v1/chat/completions", json=chat)
        assert r.status_code == 400 and "classifier" in r.json()["error"]["message"]
        assert client.post("/v1/rerank", json={"query": QUERY, "documents": ["a"]}).is_success
    assert server.engine.kv.pool.num_used == 0


def test_a_model_that_cannot_score_answers_400(llama_dir):
    with running_server(llama_dir) as s, s.client() as client:
        r = client.post("/v1/rerank", json={"query": QUERY, "documents": DOCUMENTS})
        assert r.status_code == 400
        assert r.json()["error"]["code"] == "model_cannot_score"
        r = client.post("/v1/score", json={"text_1": QUERY, "text_2": DOCUMENTS})
        assert r.status_code == 400


def test_a_yes_no_reranker_over_http(yes_no_dir):
    # httpx, as a retrieval app calls it; the scores are the engine's own.
    with running_server(yes_no_dir, ServerSettings(MODEL), reranker=True, **EXACT) as s:
        want = scores(engine(yes_no_dir, reranker=True), pairs(s.engine, QUERY, DOCUMENTS))
        body = {"model": MODEL, "query": QUERY, "documents": DOCUMENTS, "top_n": 3}
        out = httpx.post(f"{s.url}/v1/rerank", json=body, timeout=60).json()
        assert [x["index"] for x in out["results"]] == sorted(range(4), key=lambda i: -want[i])[:3]
        assert close([x["relevance_score"] for x in out["results"]], sorted(want)[::-1][:3], 1e-5)
        assert s.engine.scheduler.prefix_hit_tokens > 0  # the query's prefix, served
        assert s.engine.kv.pool.num_used == 0
