"""Images in the prompt (model/vision.py) compute what transformers computes, on tiny random
vision-language checkpoints built with transformers' own classes and images drawn here with
Pillow: preprocessing equal to transformers' image processors, image features equal to its
get_image_features, prompt logprobs over prompts with two image regions equal to its
forward, whole and in 16-token chunks that cut the regions (that end before or after Gemma
3's, whose tokens attend to each other both ways), and greedy tokens after them equal to its
generate; for LLaVA (CLIP and SigLIP towers), Gemma 3 and Qwen2.5-VL (M-RoPE).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import torch
from checkpoints import _perturb_constant_params
from PIL import Image, ImageDraw
from test_model import Seq, prompt

from gapless.engine.admission import PromptImage
from gapless.engine.runner import ModelRunner
from gapless.model.families import qwen2_5_vl
from gapless.model.images import ImageProcessor
from gapless.model.vision import (
    MediaRegion,
    VisionLanguageModel,
    chunk_embeds,
    image_key,
    load_vision_language,
)

VOCAB = 512
IMAGE_TOKEN = VOCAB - 1  # the prompts' text ids are below 500


def drawn(width: int, height: int, mode: str = "RGB", seed: int = 0) -> Image.Image:
    """Noise under shapes: every resize filter's and crop's mistakes show."""
    rng = np.random.default_rng(seed)
    image = Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8))
    draw = ImageDraw.Draw(image)
    draw.ellipse((width // 5, height // 4, width * 3 // 4, height * 4 // 5), fill=(250, 30, 90))
    draw.line((0, height - 1, width - 1, 0), fill=(10, 200, 40), width=3)
    if mode == "RGBA":  # half of it transparent: composited onto white
        image.putalpha(Image.fromarray(rng.integers(0, 256, (height, width), dtype=np.uint8)))
    return image.convert(mode)


IMAGES = [
    drawn(61, 45),
    drawn(40, 77, seed=1),
    drawn(50, 50, "RGBA", seed=2),
    drawn(90, 33, "L", seed=3),
    drawn(35, 52, "P", seed=4),
]


def pil_processor(name: str, **kwargs):
    import transformers.models as models

    module, cls = {
        "clip": ("clip.image_processing_pil_clip", "CLIPImageProcessorPil"),
        "llava": ("llava.image_processing_pil_llava", "LlavaImageProcessorPil"),
        "siglip": ("siglip.image_processing_pil_siglip", "SiglipImageProcessorPil"),
        "gemma3": ("gemma3.image_processing_pil_gemma3", "Gemma3ImageProcessorPil"),
        "qwen2_vl": ("qwen2_vl.image_processing_pil_qwen2_vl", "Qwen2VLImageProcessorPil"),
    }[name]
    mod = __import__(f"{models.__name__}.{module}", fromlist=[cls])
    return getattr(mod, cls)(**kwargs)


PROCESSORS = {
    "clip": ("clip", {"size": {"shortest_edge": 42}, "crop_size": {"height": 42, "width": 42}}),
    "llava-pad": (
        "llava",
        {"size": {"shortest_edge": 42}, "crop_size": {"height": 42, "width": 42}, "do_pad": True},
    ),
    "siglip": ("siglip", {"size": {"height": 35, "width": 35}}),
    "gemma3": ("gemma3", {"size": {"height": 56, "width": 56}}),
    "qwen2_vl": (
        "qwen2_vl",
        {"size": {"shortest_edge": 28 * 28 * 4, "longest_edge": 28 * 28 * 9}, "patch_size": 14},
    ),
}


@pytest.mark.parametrize("name", PROCESSORS)
def test_preprocessing_equals_transformers_processor(tmp_path: Path, name: str) -> None:
    kind, kwargs = PROCESSORS[name]
    reference = pil_processor(kind, **kwargs)
    reference.save_pretrained(tmp_path)
    ours = ImageProcessor.from_pretrained(tmp_path)
    for image in IMAGES:
        want = reference(image, return_tensors="np")
        got = ours(image)
        pixels = want["pixel_values"]  # Qwen2-VL's: one image's patches; else a batch of one
        if kind == "qwen2_vl":
            assert got.grid == tuple(want["image_grid_thw"][0])
        else:
            pixels = pixels[0]
        np.testing.assert_allclose(got.pixels, pixels, rtol=0, atol=1e-6)


def test_hub_style_qwen2_vl_config_preprocesses_as_transformers(tmp_path: Path) -> None:
    """As the Hub's Qwen2.5-VL checkpoints have it: the pixel bounds as min_pixels and
    max_pixels, no size, resample and rescale left to the defaults."""
    from transformers.image_utils import OPENAI_CLIP_MEAN, OPENAI_CLIP_STD

    hub = {
        "image_processor_type": "Qwen2VLImageProcessor",
        "min_pixels": 28 * 28 * 4,
        "max_pixels": 28 * 28 * 9,
        "patch_size": 14,
        "temporal_patch_size": 2,
        "merge_size": 2,
        "image_mean": list(OPENAI_CLIP_MEAN),
        "image_std": list(OPENAI_CLIP_STD),
    }
    (tmp_path / "preprocessor_config.json").write_text(json.dumps(hub))
    reference = type(pil_processor("qwen2_vl")).from_pretrained(tmp_path)
    ours = ImageProcessor.from_pretrained(tmp_path)
    for image in IMAGES:
        want = reference(image, return_tensors="np")
        got = ours(image)
        assert got.grid == tuple(want["image_grid_thw"][0])
        np.testing.assert_allclose(got.pixels, want["pixel_values"], rtol=0, atol=1e-6)


# ---- tiny vision-language checkpoints -------------------------------------------------------

TEXT = {
    "vocab_size": VOCAB,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "initializer_range": 0.2,  # as checkpoints.py: logits far from uniform
}
TOWER = {
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 3,
    "num_attention_heads": 4,
    "patch_size": 7,
    "initializer_range": 0.2,
}


def save(model, processor, out: Path) -> Path:
    _perturb_constant_params(model, 0)
    model.save_pretrained(out)
    processor.save_pretrained(out)
    return out


def make_llava(out: Path, tower: str) -> Path:
    """CLIP: states after the 2nd of 3 layers, class token dropped (llava-1.5's settings);
    SigLIP: two layers' states side by side, every token kept."""
    import transformers as tf

    torch.manual_seed(0)
    if tower == "clip":
        vision = tf.CLIPVisionConfig(**TOWER, image_size=42)
        settings = {"vision_feature_layer": -2, "vision_feature_select_strategy": "default"}
        processor = pil_processor("llava", **PROCESSORS["llava-pad"][1])
    else:
        vision = tf.SiglipVisionConfig(**TOWER, image_size=35)
        settings = {"vision_feature_layer": [-3, -1], "vision_feature_select_strategy": "full"}
        processor = pil_processor("siglip", **PROCESSORS["siglip"][1])
    config = tf.LlavaConfig(
        text_config=tf.LlamaConfig(**TEXT),
        vision_config=vision,
        image_token_index=IMAGE_TOKEN,
        projector_hidden_act="gelu",
        **settings,
    )
    model = tf.LlavaForConditionalGeneration(config).float().eval()
    return save(model, processor, out)


def make_gemma3(out: Path) -> Path:
    """64 patches pooled to 16 tokens; a sliding-window layer and a global one. The window, 10,
    is shorter than an image: its first tokens attend to its last, which cannot see them."""
    import transformers as tf

    torch.manual_seed(0)
    text = tf.Gemma3TextConfig(
        **TEXT,
        head_dim=32,
        query_pre_attn_scalar=48,
        sliding_window=10,
        layer_types=["sliding_attention", "full_attention"],
    )
    vision = tf.SiglipVisionConfig(**TOWER, image_size=56, vision_use_head=False)
    config = tf.Gemma3Config(
        text_config=text,
        vision_config=vision,
        mm_tokens_per_image=16,
        boi_token_index=IMAGE_TOKEN - 2,
        eoi_token_index=IMAGE_TOKEN - 1,
        image_token_index=IMAGE_TOKEN,
    )
    model = tf.Gemma3ForConditionalGeneration(config).float().eval()
    with torch.no_grad():  # transformers starts the projection at zero: every image would be 0
        model.model.multi_modal_projector.mm_input_projection_weight.normal_(0, 0.2)
    return save(model, pil_processor("gemma3", **PROCESSORS["gemma3"][1]), out)


def make_qwen2_5_vl(out: Path) -> Path:
    """3 blocks: the middle one over the whole image, the others in windows of 2x2 merge units
    that the test images' 2x2 and 3x2 unit grids fill and cut; M-RoPE over 8 frequencies."""
    import transformers as tf

    torch.manual_seed(0)
    config = tf.Qwen2_5_VLConfig(
        text_config={
            **TEXT,
            "rope_parameters": {
                "rope_type": "default",
                "rope_theta": 50_000.0,  # not the default: a config read wrong shows
                "mrope_section": [2, 3, 3],
            },
        },
        vision_config={
            "depth": 3,
            "hidden_size": 32,
            "intermediate_size": 48,
            "num_heads": 4,
            "patch_size": 14,
            "window_size": 56,
            "fullatt_block_indexes": [1],
            "out_hidden_size": TEXT["hidden_size"],
            "initializer_range": 0.2,
        },
        image_token_id=IMAGE_TOKEN,
        video_token_id=IMAGE_TOKEN - 1,
        vision_start_token_id=IMAGE_TOKEN - 2,
        vision_end_token_id=IMAGE_TOKEN - 3,
    )
    model = tf.Qwen2_5_VLForConditionalGeneration(config).float().eval()
    return save(model, pil_processor("qwen2_vl", **PROCESSORS["qwen2_vl"][1]), out)


CHECKPOINTS = {
    "llava-clip": lambda out: make_llava(out, "clip"),
    "llava-siglip": lambda out: make_llava(out, "siglip"),
    "gemma3": make_gemma3,
    "qwen2_5_vl": make_qwen2_5_vl,
}


def hf_vlm(path: Path):
    from transformers import AutoImageProcessor, AutoModelForImageTextToText

    model = AutoModelForImageTextToText.from_pretrained(path, dtype=torch.float32).eval()
    return model, AutoImageProcessor.from_pretrained(path)


def image_prompt(model: VisionLanguageModel, images: list[Image.Image]) -> list[int]:
    """Text, an image's placeholders, text, the next image's, text: regions that 16-token
    chunks cut."""
    ids = prompt(13, seed=1)
    for i, image in enumerate(images):
        n = model.encoder.tokens(model.processor(image))
        ids += [IMAGE_TOKEN] * n + prompt(9 + 4 * i, seed=2 + i)
    return ids


@dataclass
class PromptImages:
    """A prompt's images as its forwards take them: the regions, and M-RoPE's (t, h, w)
    positions [3, T] of its tokens (None: each token's index)."""

    regions: list[MediaRegion]
    rope_positions: torch.Tensor | None


@torch.inference_mode()
def prompt_images(
    model: VisionLanguageModel, token_ids: list[int], images: list[Image.Image]
) -> PromptImages:
    """The images' regions in an image_prompt, each image encoded once, and the positions the
    family rotates by: what admission and the runner give a request, without an engine."""
    prepared = [model.processor(image) for image in images]
    encoder = model.encoder
    lengths = [encoder.tokens(p) for p in prepared]
    placeholders = [i for i, t in enumerate(token_ids) if t == encoder.image_token_id]
    assert len(placeholders) == sum(lengths)
    starts = [placeholders[sum(lengths[:i])] for i in range(len(lengths))]
    regions = [
        MediaRegion(start, encoder.encode(image), image_key(image))
        for start, image in zip(starts, prepared, strict=True)
    ]
    return PromptImages(regions, encoder.rope_positions(token_ids, prepared))


def hf_inputs(hf_processor, images: list[Image.Image], ids: list[int]) -> dict:
    """What transformers' forward takes beside input_ids: the images as its processor gives
    them, and the token types its full processor gives (1 on image tokens): for Qwen2.5-VL
    its M-RoPE positions come from them, for Gemma 3 its attention both ways in an image."""
    inputs = dict(hf_processor(images, return_tensors="pt"))
    token_types = torch.tensor([[int(t == IMAGE_TOKEN) for t in ids]])
    if inputs.pop("num_crops", None) is not None:  # Gemma 3's
        inputs["token_type_ids"] = token_types
    if "image_grid_thw" in inputs:
        inputs["mm_token_type_ids"] = token_types
    return inputs


def with_images(seq: Seq, model: VisionLanguageModel, placed: PromptImages) -> Seq:
    """The request holding the prompt's images, encoded, and (Qwen2.5-VL) its M-RoPE positions,
    as admission gives them: the runner then puts the embeddings at the image regions' rows,
    and lets a Gemma 3 image's tokens attend to each other both ways."""
    seq.req.images = tuple(
        PromptImage(r.start, r.end - r.start, None, r.key, model.bidirectional_images)  # type: ignore[arg-type]
        for r in placed.regions
    )
    seq.req.image_embeds = {i: r.embeds for i, r in enumerate(placed.regions)}
    seq.req.rope_positions = placed.rope_positions
    return seq


def chunk_sizes(model: VisionLanguageModel, ids: list[int], placed: PromptImages) -> list[int]:
    """Chunks of 16 tokens, cut as the scheduler cuts them with that budget: anywhere in
    LLaVA's and Qwen2.5-VL's regions; before Gemma 3's, which then run whole."""
    whole = [r for r in placed.regions if model.bidirectional_images]
    sizes, start = [], 0
    while start < len(ids):
        end = min(start + 16, len(ids))
        for r in whole:
            if r.start < end < r.end:
                end = r.start if r.start > start else r.end
        sizes.append(end - start)
        start = end
    return sizes


def run_prompt(
    model: VisionLanguageModel, ids: list[int], placed: PromptImages, sizes: list[int]
) -> torch.Tensor:
    """Logits of every prompt position, the prompt run in chunks of these sizes."""
    runner, seq, out = (
        ModelRunner(model.decoder, 16, 16),
        with_images(Seq(ids, 0), model, placed),
        [],
    )
    for n in sizes:
        out.append(runner.execute([seq.chunk(n)], {0})[0])
        seq.req.num_computed += n
    return torch.cat(out)


@pytest.mark.parametrize("name", CHECKPOINTS)
def test_image_features_equal_transformers(vlm, name: str) -> None:
    path = vlm(name)
    hf, hf_processor = hf_vlm(path)
    ours = load_vision_language(path, "float32")
    images = IMAGES[:2]
    with torch.no_grad():
        inputs = hf_inputs(hf_processor, images, [])
        inputs.pop("mm_token_type_ids", None)
        want = list(hf.get_image_features(**inputs).pooler_output)
    for image, features in zip(images, want, strict=True):
        got = ours.encoder.encode(ours.processor(image))
        assert got.shape == features.shape
        assert (got - features).abs().max().item() < 1e-4


@pytest.mark.parametrize("name", CHECKPOINTS)
def test_two_images_prompt_and_greedy_tokens_equal_transformers(vlm, name: str) -> None:
    """Prompt logprobs whole and in 16-token chunks that cut the regions, then 8 greedy
    tokens (Qwen2.5-VL's decodes at their index plus the prompt's M-RoPE offset)."""
    path = vlm(name)
    hf, hf_processor = hf_vlm(path)
    ours = load_vision_language(path, "float32")
    images, n = IMAGES[:2], 8
    ids = image_prompt(ours, images)
    inputs = hf_inputs(hf_processor, images, ids)
    with torch.no_grad():
        want = hf(input_ids=torch.tensor([ids]), **inputs).logits[0]
        out = hf.generate(
            torch.tensor([ids]), **inputs, max_new_tokens=n, min_new_tokens=n, do_sample=False
        )
    placed = prompt_images(ours, ids, images)
    regions = placed.regions
    assert [r.end - r.start for r in regions] == [
        ours.encoder.tokens(ours.processor(i)) for i in images
    ]
    whole = run_prompt(ours, ids, placed, [len(ids)])
    assert (whole.log_softmax(-1) - want.log_softmax(-1)).abs().max().item() < 1e-4
    assert any(r.start % 16 and r.end - r.start > 16 - r.start % 16 for r in regions)  # cut
    chunked = run_prompt(ours, ids, placed, chunk_sizes(ours, ids, placed))
    assert (chunked - whole).abs().max().item() < 1e-4

    runner = ModelRunner(ours.decoder, 16, 16)
    seq = with_images(Seq(ids, 0), ours, placed)
    seq.req.kv.tables = [list(range(16))]
    logits, got = runner.execute([seq.chunk(len(ids))], set())[0], []
    seq.req.num_computed = len(ids)
    for _ in range(n):
        got.append(int(logits[-1].argmax()))
        seq.req.output_ids.append(got[-1])
        logits = runner.execute([seq.chunk(1)], set())[0]
        seq.req.num_computed += 1
    assert got == out[0, len(ids) :].tolist()


# transformers 5 saves the layout of 4.x without CLIP's and SigLIP's `vision_model.` level;
# Hub checkpoints have that level, and those saved by 4.52 on a `model.` prefix.
LAYOUTS = {
    "hub, before 4.52": (("vision_tower.", "vision_tower.vision_model."),),
    "4.52 on": (
        ("language_model.model.", "model.language_model."),
        ("language_model.lm_head.", "lm_head."),
        ("vision_tower.", "model.vision_tower.vision_model."),
        ("multi_modal_projector.", "model.multi_modal_projector."),
    ),
}


def relayout(path: Path, out: Path, prefixes: tuple[tuple[str, str], ...]) -> Path:
    """A copy of the checkpoint with its tensors' name prefixes replaced."""
    from safetensors.torch import load_file, save_file

    for file in ("config.json", "preprocessor_config.json"):
        (out / file).write_bytes((path / file).read_bytes())
    renamed = {}
    for name, tensor in load_file(path / "model.safetensors").items():
        old, new = next(((o, n) for o, n in prefixes if name.startswith(o)), ("", ""))
        renamed[new + name.removeprefix(old)] = tensor
    save_file(renamed, out / "model.safetensors", metadata={"format": "pt"})
    return out


def same_logits(a: Path, b: Path) -> bool:
    image = IMAGES[1]
    one, two = load_vision_language(a, "float32"), load_vision_language(b, "float32")
    ids = image_prompt(one, [image])
    want = run_prompt(one, ids, prompt_images(one, ids, [image]), [len(ids)])
    got = run_prompt(two, ids, prompt_images(two, ids, [image]), [len(ids)])
    return torch.equal(got, want)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_checkpoint_layouts_load_alike(vlm, tmp_path: Path, layout: str) -> None:
    path = vlm("llava-clip")
    assert same_logits(path, relayout(path, tmp_path, LAYOUTS[layout]))


def test_qwen2_5_vl_hub_config_loads_alike(vlm, tmp_path: Path) -> None:
    """As the Hub's Qwen2.5-VL checkpoints are: the text keys at the top, M-RoPE in rope_scaling
    as type mrope, and (saved by 4.52 on) the language model under model.language_model."""
    path = vlm("qwen2_5_vl")
    prefixes = (("model.", "model.language_model."), ("visual.", "model.visual."))
    out = relayout(path, tmp_path, prefixes)
    config = json.loads((path / "config.json").read_text())
    text = config.pop("text_config")
    rope = text.pop("rope_parameters")
    flat = text | config | {"rope_theta": rope["rope_theta"], "use_sliding_window": False}
    flat["rope_scaling"] = {"type": "mrope", "mrope_section": rope["mrope_section"]}
    (out / "config.json").write_text(json.dumps(flat))
    assert same_logits(path, out)


def test_gemma3_image_tokens_attend_both_ways_as_transformers(vlm) -> None:
    """transformers, given its processor's token_type_ids, lets an image's tokens attend to each
    other both ways, and so do we; attending causally instead matches it up to the first image
    token only (what the parity test above would catch)."""
    path = vlm("gemma3")
    hf, hf_processor = hf_vlm(path)
    ours = load_vision_language(path, "float32")
    images = IMAGES[:2]
    ids = image_prompt(ours, images)
    with torch.no_grad():
        inputs = hf_inputs(hf_processor, images, ids)
        want = hf(input_ids=torch.tensor([ids]), **inputs).logits[0].log_softmax(-1)
    placed = prompt_images(ours, ids, images)
    both_ways = run_prompt(ours, ids, placed, [len(ids)]).log_softmax(-1)
    ours.bidirectional_images = False
    causal = run_prompt(ours, ids, placed, [len(ids)]).log_softmax(-1)
    first = ids.index(IMAGE_TOKEN)
    assert (both_ways - want).abs().max().item() < 1e-4
    diff = (causal - want).abs().amax(-1)
    assert diff[:first].max().item() < 1e-4
    assert diff[first:].max().item() > 1e-2


def test_a_chunk_takes_the_slices_of_the_regions_it_cuts() -> None:
    a = MediaRegion(3, torch.arange(10.0)[:, None], "a")  # positions 3..12
    b = MediaRegion(14, torch.arange(10.0, 14.0)[:, None], "b")  # 14..17
    rows, embeds = chunk_embeds([a, b], 8, 16)
    assert rows.tolist() == [0, 1, 2, 3, 4, 6, 7]
    assert embeds[:, 0].tolist() == [5, 6, 7, 8, 9, 10, 11]
    assert chunk_embeds([a, b], 0, 3) is None


def test_qwen2_5_vl_mrope_positions_equal_transformers(vlm) -> None:
    hf, _ = hf_vlm(vlm("qwen2_5_vl"))
    grids = [(1, 6, 4), (1, 4, 8)]
    ids = prompt(5) + [IMAGE_TOKEN] * 6 + prompt(3, seed=1) + [IMAGE_TOKEN] * 8 + prompt(4)
    want, _ = hf.model.get_rope_index(
        torch.tensor([ids]),
        mm_token_type_ids=torch.tensor([[int(t == IMAGE_TOKEN) for t in ids]]),
        image_grid_thw=torch.tensor(grids),
    )
    assert qwen2_5_vl.mrope_positions(ids, IMAGE_TOKEN, grids, 2).tolist() == want[:, 0].tolist()


# Hub configs save a text_config's keys only where they differ from transformers' defaults,
# as llava-1.5's and Gemma 3 4B's do; LLaVA with Mistral as llava-v1.6-mistral's would.
BARE_TEXT_CONFIGS = {
    "llava-llama": (
        "LlavaConfig",
        {"model_type": "llama", "vocab_size": 32064, "max_position_embeddings": 4096},
    ),
    "llava-mistral": ("LlavaConfig", {"model_type": "mistral", "vocab_size": 32064}),
    "gemma3": (
        "Gemma3Config",
        {
            "model_type": "gemma3_text",
            "hidden_size": 2560,
            "intermediate_size": 10240,
            "num_hidden_layers": 34,
            "rope_scaling": {"factor": 8.0, "rope_type": "linear"},
            "sliding_window": 1024,
        },
    ),
}


@pytest.mark.parametrize("name", BARE_TEXT_CONFIGS)
def test_bare_text_configs_read_as_transformers_reads_them(name: str) -> None:
    import transformers as tf

    from gapless.model import families
    from gapless.model.vision import vision_family_of

    config_class, text = BARE_TEXT_CONFIGS[name]
    raw = {"architectures": [config_class.replace("Config", "ForConditionalGeneration")]}
    raw["text_config"] = text
    ours = families.model_config(vision_family_of(raw["architectures"][0]).text_config(raw))
    theirs = getattr(tf, config_class)(text_config=dict(text)).text_config
    kinds, window = getattr(theirs, "layer_types", None), getattr(theirs, "sliding_window", None)
    if kinds is None:  # Llama's: no window; Mistral's: its window on every layer
        kinds = ["sliding_attention"] * theirs.num_hidden_layers
    windows = tuple(window if kind == "sliding_attention" else None for kind in kinds)
    rope = theirs.rope_parameters  # Gemma 3's: one per layer type
    theta = rope.get("full_attention", rope)["rope_theta"]
    assert (
        ours.vocab_size,
        ours.hidden_size,
        ours.intermediate_size,
        ours.num_layers,
        ours.num_heads,
        ours.num_kv_heads,
        ours.head_dim,
        ours.rms_norm_eps,
        ours.max_position_embeddings,
        ours.layer_windows,
        ours.rope_theta,
    ) == (
        theirs.vocab_size,
        theirs.hidden_size,
        theirs.intermediate_size,
        theirs.num_hidden_layers,
        theirs.num_attention_heads,
        theirs.num_key_value_heads,
        theirs.head_dim,
        theirs.rms_norm_eps,
        theirs.max_position_embeddings,
        windows,
        theta,
    )
