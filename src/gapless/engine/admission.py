"""What a request must pass to be admitted: each check once, for the engine and the server.

Engine.add_request runs them, so the Python API refuses what the server refuses. The server's
dialects run them while they parse a request, off the event loop, and hand the engine a
CheckedPrompt, which add_request does not scan again. Every refusal is a RequestError naming
the field in the engine's terms (prompt, max_tokens, top_k, stop_token_ids, images); the server
renames it to the request's field (server/endpoint.py, admission_errors).

Images (a vision-language model's): each is decoded and checked here once (its bytes, its
size, the pixel cap, the count per prompt), preprocessed, and its placeholder token in the
prompt expanded to the run of tokens the encoder fills (docs/vision.md). The encoder runs
later, in the step whose chunk first reaches the image.
"""

from __future__ import annotations

import io
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from PIL import Image

from gapless.engine.sampling_params import SamplingParams
from gapless.model.images import PreparedImage
from gapless.model.tokenizer import Tokenizer
from gapless.model.vision import VisionLanguageModel, image_key


class RequestError(ValueError):
    """A request that can never run; `param` names the offending field."""

    def __init__(
        self, message: str, param: str | None = None, code: str | None = "invalid_request"
    ) -> None:
        super().__init__(message)
        self.param = param
        self.code = code


CONTEXT_LENGTH_EXCEEDED = "context_length_exceeded"
GENERATES_NOTHING = (
    "this model is a sequence classifier: it scores pairs (/v1/rerank, /v1/score) and "
    "generates no text"
)


@dataclass(frozen=True)
class PromptImage:
    """An image in a prompt: its run of placeholder tokens start..end-1, what its encoder
    takes, and its content key (the prefix cache's name for those rows)."""

    start: int
    length: int
    image: PreparedImage
    key: str
    # Its tokens attend to each other both ways (Gemma 3), so the run is computed in one
    # chunk (the scheduler's rule) and attends up to its end (kernels/plans.py).
    bidirectional: bool = False
    # The units its encode is cut into (VisionEncoder.encode_units): the scheduler gives a
    # step's encode work as a number of them.
    units: int = 1

    @property
    def end(self) -> int:
        return self.start + self.length


class CheckedImages(list[PreparedImage]):
    """Images that passed Admission.check_images, preprocessed: check_prompt takes them as they
    are."""


class CheckedPrompt(list[int]):
    """Prompt ids that passed Admission.check_prompt: add_request takes them as they are, with
    their images and (M-RoPE) positions."""

    images: tuple[PromptImage, ...] = ()
    rope_positions: torch.Tensor | None = None


# What Engine.add_request takes as an image: its file's bytes (PNG, JPEG, ...) or a Pillow image.
ImageInput = bytes | Image.Image


class Admission:
    """The checks of one engine's requests against its tokenizer, context and vocabulary."""

    def __init__(
        self,
        tokenizer: Tokenizer,
        max_model_len: int,
        vocab_size: int,
        vision: VisionLanguageModel | None = None,
        limit_mm_per_prompt: int = 0,
        max_image_pixels: int = 0,
        generates: bool = True,
        adapters: tuple[str, ...] = (),
    ) -> None:
        """generates: False for a sequence classifier, which has no lm_head. adapters: the
        names of the LoRA adapters a request may run on (--lora)."""
        self.tokenizer = tokenizer
        self.adapters = adapters
        self.generates = generates
        self.vision = vision
        self.limit_mm_per_prompt = limit_mm_per_prompt
        self.max_image_pixels = max_image_pixels
        self.max_model_len = max_model_len
        # The model's: the width of its logits, so what top_k and sampled ids range over.
        self.vocab_size = vocab_size
        # A prompt's ids must be ones the model embeds and the tokenizer spells (echo and
        # prompt logprobs show them as text).
        self.token_vocab_size = min(vocab_size, tokenizer.vocab_size)

    def check_length(self, num_chars: int) -> None:
        """Refuses, before tokenizing, a text too long to fit the context with any tokenization:
        a 15 MB prompt costs nothing, instead of seconds of tokenizing and gigabytes of memory."""
        if self.tokenizer.surely_exceeds(num_chars, self.max_model_len):
            raise RequestError(
                f"the prompt has {num_chars} characters, more than this model's maximum context "
                f"length of {self.max_model_len} tokens can hold",
                "prompt",
                CONTEXT_LENGTH_EXCEEDED,
            )

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """A text's ids, unless its length alone refuses it."""
        self.check_length(len(text))
        return self._encode(text, add_special_tokens)

    def _encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        try:
            return self.tokenizer.encode(text, add_special_tokens)
        except ValueError as e:  # text that is not valid Unicode
            raise RequestError(str(e), "prompt", None) from e

    def encode_chat(self, messages: list[dict[str, Any]], /, **template_kwargs: Any) -> list[int]:
        """A conversation's ids through the checkpoint's chat template, unless the length of
        its contents alone refuses it. Messages are in the shape transformers'
        apply_chat_template takes; template_kwargs (tools, ...) are the template's variables,
        whatever their names (`self` too)."""
        # The rendered prompt holds every message's content.
        self.check_length(sum(_content_chars(m.get("content")) for m in messages))
        expand = getattr(self.vision.encoder, "expand_markup", None) if self.vision else None
        try:
            if expand is None or not any(_has_image(m.get("content")) for m in messages):
                return self.tokenizer.encode_chat(messages, **template_kwargs)
            # Gemma 3: the template marks an image, and its processor rewrites the mark in the
            # text before tokenizing (gemma3_vision.py).
            text = self.tokenizer.apply_chat_template(messages, **template_kwargs)
            return self.tokenizer.encode(expand(text, self.tokenizer.token_text), False)
        except ValueError as e:  # no template, or the template rejected the conversation
            raise RequestError(str(e), "prompt", None) from e

    def check_prompt(
        self,
        prompt: str | list[int],
        output: bool = True,
        truncate: bool = False,
        images: Sequence[ImageInput] | CheckedImages = (),
    ) -> CheckedPrompt:
        """A prompt's ids (a text is encoded), refused if empty, if they leave no room for
        output in the context, or if one is outside the vocabulary.

        An embedding's prompt (output=False) has no output, so it may fill the context; with
        truncate, one longer than the context keeps its first tokens that fit instead.

        With images, the prompt holds one image placeholder token (the model's image token,
        as its chat template writes it) per image, in order; each becomes the image's run."""
        if isinstance(prompt, CheckedPrompt):
            return prompt
        prepared = images if isinstance(images, CheckedImages) else self.check_images(images)
        most = self.max_model_len - 1 if output else self.max_model_len
        ids = prompt
        if isinstance(prompt, str) and truncate:
            # Only the text's start is encoded: a cut that surely holds about twice the tokens
            # kept, so that those lie far from the cut, where it encodes as the whole text.
            cut = prompt[: 4 * self.tokenizer.max_token_chars * most]
            ids = self._encode(cut) if cut else []
        elif isinstance(prompt, str):
            # An empty text is an empty prompt, even where the tokenizer would add BOS to it.
            ids = self.encode(prompt) if prompt else []
        if not ids:
            raise RequestError("the prompt is empty", "prompt", None)
        if prepared:
            ids, placed = self.place_images(ids, prepared)
        if truncate:
            ids = ids[:most]
        if len(ids) > most:
            if output:
                context = (
                    f"{self.max_model_len} tokens, prompt and output together (at most "
                    f"{most} leave room for output)"
                )
            else:
                context = f"{self.max_model_len} tokens"
            raise RequestError(
                f"the prompt has {len(ids)} tokens, but this model's context is {context}",
                "prompt",
                CONTEXT_LENGTH_EXCEEDED,
            )
        self.check_token_ids(ids, "prompt")
        checked = CheckedPrompt(ids)
        if prepared:
            checked.images = placed
            checked.rope_positions = self.vision.encoder.rope_positions(ids, prepared)
        return checked

    def check_images(self, images: Sequence[ImageInput]) -> CheckedImages:
        """Each image decoded and checked once, then preprocessed for the encoder."""
        if not images:
            return CheckedImages()
        if self.vision is None:
            raise RequestError("this model takes no images: it is a text-only model", "images")
        if len(images) > self.limit_mm_per_prompt:
            raise RequestError(
                f"the prompt has {len(images)} images, more than the limit of "
                f"{self.limit_mm_per_prompt} per prompt (--limit-mm-per-prompt)",
                "images",
            )
        return CheckedImages(
            self.vision.processor(self._open(image, i)) for i, image in enumerate(images)
        )

    def _open(self, data: ImageInput, index: int) -> Image.Image:
        """The image decoded, refused if it is empty, unreadable, or over the pixel cap (which
        is checked on its header's size, before its pixels are decoded)."""
        image, param = data, f"images[{index}]"
        if isinstance(data, bytes):
            if not data:
                raise RequestError(f"image {index} is empty (0 bytes)", param)
            try:
                with warnings.catch_warnings():
                    warnings.simplefilter("error", Image.DecompressionBombWarning)
                    image = Image.open(io.BytesIO(data))
            except (Image.DecompressionBombError, Image.DecompressionBombWarning) as e:
                raise RequestError(
                    f"image {index} is a decompression bomb ({e}); the pixel cap is "
                    f"{self.max_image_pixels} pixels (--max-image-pixels)",
                    param,
                ) from e
            except (OSError, ValueError, SyntaxError) as e:
                raise RequestError(f"image {index} is not a readable image: {e}", param) from e
        width, height = image.size
        if width == 0 or height == 0:
            raise RequestError(f"image {index} has zero size ({width}x{height})", param)
        if width * height > self.max_image_pixels:
            raise RequestError(
                f"image {index} has {width}x{height} = {width * height} pixels, more than the "
                f"pixel cap of {self.max_image_pixels} (--max-image-pixels)",
                param,
            )
        try:
            image.load()
        except (OSError, ValueError, SyntaxError) as e:  # truncated or corrupt pixel data
            raise RequestError(f"image {index} is not a readable image: {e}", param) from e
        return image

    def expand_images(self, ids: list[int], images: CheckedImages) -> list[int]:
        """Prompt ids as the model takes them, each image's placeholder expanded to its run:
        what a count of the prompt's tokens counts."""
        return self.place_images(ids, images)[0] if images else ids

    def place_images(
        self, ids: list[int], images: CheckedImages
    ) -> tuple[list[int], tuple[PromptImage, ...]]:
        """The prompt with each image's placeholder token expanded to the image's run."""
        encoder = self.vision.encoder
        token = encoder.image_token_id
        slots = [i for i, t in enumerate(ids) if t == token]
        if len(slots) != len(images):
            raise RequestError(
                f"the prompt has {len(slots)} image placeholders (token {token}) for "
                f"{len(images)} images: it needs one per image",
                "images",
            )
        expanded: list[int] = []
        placed = []
        taken = 0
        for slot, image in zip(slots, images, strict=True):
            expanded += ids[taken:slot]
            n = encoder.tokens(image)
            placed.append(
                PromptImage(
                    len(expanded),
                    n,
                    image,
                    image_key(image),
                    self.vision.bidirectional_images,
                    encoder.encode_units,
                )
            )
            expanded += [token] * n
            taken = slot + 1
        return expanded + ids[taken:], tuple(placed)

    def check_token_ids(self, ids: list[int], param: str) -> None:
        """Token ids a client sent as text (a prompt, ids to detokenize) must be in the
        vocabulary."""
        _check_ids(ids, self.token_vocab_size, param)

    def output_budget(self, requested: int | None, prompt_len: int, least: int = 0) -> int:
        """max_tokens for a checked prompt of prompt_len tokens: `requested` if the context has
        room for it, all the room there is when None. `least`: the dialect's smallest (1 for
        Anthropic's and the Responses API's; else SamplingParams refuses a negative one)."""
        room = self.max_model_len - prompt_len
        if requested is None:
            return room
        if least and requested < least:
            raise RequestError(
                f"max_tokens must be at least {least}, got {requested}", "max_tokens"
            )
        if requested > room:
            raise RequestError(
                f"max_tokens can be at most {room}: this model's maximum context length is "
                f"{self.max_model_len} tokens, and the prompt has {prompt_len} of them "
                f"({prompt_len + requested} were requested)",
                "max_tokens",
                CONTEXT_LENGTH_EXCEEDED,
            )
        return requested

    def check_params(self, params: SamplingParams) -> None:
        """The sampling options bounded by the model's vocabulary: top_k and stop_token_ids.
        (SamplingParams checked the others when it was made.) A classifier refuses them all."""
        if not self.generates:
            raise RequestError(GENERATES_NOTHING, "model", "model_cannot_generate")
        if params.top_k > self.vocab_size:
            raise RequestError(
                f"top_k must be at most the vocabulary size {self.vocab_size}, got {params.top_k}",
                "top_k",
                None,
            )
        _check_ids(params.stop_token_ids, self.vocab_size, "stop_token_ids")
        if params.adapter is not None and params.adapter not in self.adapters:
            raise RequestError(
                f"no LoRA adapter {params.adapter!r}; adapters: {list(self.adapters)}",
                "model",
                "model_not_found",
            )


def _has_image(content: Any) -> bool:
    """Whether a message's content holds an image part (server/images.py writes them)."""
    return isinstance(content, list) and any(
        isinstance(part, dict) and part.get("type") == "image" for part in content
    )


def _content_chars(content: Any) -> int:
    """The characters of a message's content: a string, or a list of parts (text and images)."""
    if isinstance(content, str):
        return len(content)
    if isinstance(content, list):
        texts = (part.get("text") for part in content if isinstance(part, dict))
        return sum(len(text) for text in texts if isinstance(text, str))
    return 0


def _check_ids(ids: list[int], vocab_size: int, param: str) -> None:
    bad = next((t for t in ids if not 0 <= t < vocab_size), None)
    if bad is not None:
        raise RequestError(
            f"token id {bad} is outside the vocabulary [0, {vocab_size})", param, None
        )
