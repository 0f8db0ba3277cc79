"""Plain helpers that several test modules use (their shared fixtures are in conftest.py)."""

from __future__ import annotations

import importlib.util
import io
import os
import sys
import threading
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import torch
from PIL import Image

from gapless.engine.request import RequestState
from gapless.engine.sampling_params import SamplingParams
from gapless.engine.scheduler import Scheduler

SCRIPTS = Path(__file__).resolve().parent.parent / "scripts"

# Set on a machine without a C++ compiler: the tests of our kernels then skip where the
# kernels did not build, and the run's summary says so (conftest.py). Unset, they fail.
WITHOUT_KERNELS = os.environ.get("GAPLESS_TEST_WITHOUT_KERNELS") == "1"


def require_our_kernels(works: bool, what: str) -> None:
    """Fails the test where `what` (one of our C++ kernels) did not build or disagrees with
    torch here, so that a green suite means the fast path ran; skips it instead under
    GAPLESS_TEST_WITHOUT_KERNELS=1."""
    if works:
        return
    if WITHOUT_KERNELS:
        pytest.skip(f"{what} did not build here (GAPLESS_TEST_WITHOUT_KERNELS=1)")
    pytest.fail(
        f"{what} did not build, or disagrees with torch, on this machine (see the log for"
        " 'kernels:'); on a machine without a C++ compiler, GAPLESS_TEST_WITHOUT_KERNELS=1"
        " skips this",
        pytrace=False,
    )


def prompt(n: int, seed: int = 0, low: int = 10) -> list[int]:
    """n token ids in [low, 500), the same for the same seed. The default low is past the test
    tokenizer's special tokens (0-6: bos, eos, pad and the chat markers)."""
    return torch.randint(low, 500, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def greedy(max_tokens: int, **kw: Any) -> SamplingParams:
    """Greedy sampling of exactly max_tokens tokens: an eos token does not end it."""
    return SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True, **kw)


def png(image: Image.Image) -> bytes:
    out = io.BytesIO()
    image.save(out, "PNG")
    return out.getvalue()


def bomb(side: int) -> bytes:
    """A few kB of PNG whose header declares side x side one-bit pixels. Pillow warns when an
    image opened has more than Image.MAX_IMAGE_PIXELS (about 89 million: side 9,460 up) and
    refuses it past twice that (side 13,378 up); admission must refuse either."""
    return png(Image.new("1", (side, side)))


def load_script(name: str) -> ModuleType:
    """scripts/<name>.py as a module: scripts/ is not a package."""
    spec = importlib.util.spec_from_file_location(name, SCRIPTS / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def run_step(scheduler: Scheduler) -> dict[str, int]:
    """Schedules one step and plays the engine's part: computes the chunks, and a finished
    prompt starts decoding. Returns each scheduled request's chunk size."""
    sizes = {}
    for chunk in scheduler.schedule().chunks:
        req = chunk.request
        req.num_computed += chunk.num_tokens
        if req.num_uncomputed == 0:
            req.state = RequestState.DECODING
            req.output_ids.append(7)
        sizes[req.request_id] = chunk.num_tokens
    return sizes


def gate_forwards(engine: Any, monkeypatch: pytest.MonkeyPatch) -> threading.Semaphore:
    """Lets the engine run one forward pass, then one more for each release of the semaphore
    returned: its state holds still in between, however slow the machine is."""
    gate = threading.Semaphore(1)
    forward = engine.runner.execute

    def gated_forward(*args: Any, **kwargs: Any) -> Any:
        gate.acquire()
        return forward(*args, **kwargs)

    monkeypatch.setattr(engine.runner, "execute", gated_forward)
    return gate
