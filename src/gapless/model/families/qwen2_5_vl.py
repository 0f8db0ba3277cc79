"""Qwen2.5-VL: `Qwen2_5_VLForConditionalGeneration`: a windowed ViT with a patch merger before
Qwen2's layers (our llama family) rotated by M-RoPE.

M-RoPE: each position has (t, h, w) ids (mrope_positions: an image's tokens on its merged grid,
text counting on from the largest id before it + 1) and the rope's frequencies rotate in runs
of `mrope_section` by t, h and w in turn (decoder.Rope.sections, BatchInput.rope_positions);
text alone has t = h = w = its index, plain rope.

As transformers' modeling_qwen2_5_vl.py computes an image's features, from the patches the
image processor flattened merge window by merge window (model/images.py):
- a linear patch embedding (its Conv3d, whose stride is its kernel);
- 2-D rotary embeddings: a head's first half rotated by the patch's row, the second by its
  column, each over head_dim / 4 frequencies;
- blocks (RMSNorm, attention with qkv bias, a gated SiLU MLP with biases) that attend within
  windows of `window_size` pixels (patches reordered window by window), all but the
  `fullatt_block_indexes`, which attend over the whole image;
- the merger: RMSNorm, each merge_size x merge_size square of patches concatenated, a GELU MLP
  to the text hidden size, then back in the image's order.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from gapless.kernels import Linear
from gapless.model.config import check_activation
from gapless.model.decoder import Decoder, RMSNorm
from gapless.model.encode_steps import EncodeWork, SteppedEncoder
from gapless.model.families.common import Shapes, linear_shapes
from gapless.model.images import PreparedImage

if TYPE_CHECKING:
    from gapless.model.weights import Weights

ARCHITECTURES = ("Qwen2_5_VLForConditionalGeneration",)
VISUAL = "visual."
NORM_EPS = 1e-6  # transformers' blocks and merger fix it


def text_config(raw: dict) -> dict:
    """The language model's config.json keys, for Qwen2's layers: transformers 5 nests them in
    text_config, 4.x kept them at the top; the rope without its M-RoPE sections."""
    text = dict(raw.get("text_config") or raw)
    rope = dict(text.pop("rope_parameters", None) or text.pop("rope_scaling", None) or {})
    theta = rope.get("rope_theta", text.get("rope_theta", 1_000_000.0))
    tied = raw.get("tie_word_embeddings") or text.get("tie_word_embeddings")
    return text | {
        "architectures": ["Qwen2ForCausalLM"],
        "rope_parameters": {"rope_type": "default", "rope_theta": theta},
        "tie_word_embeddings": bool(tied),
    }


def mrope_section(raw: dict) -> tuple[int, ...]:
    text = raw.get("text_config") or raw
    rope = text.get("rope_parameters") or text.get("rope_scaling") or {}
    return tuple(rope.get("mrope_section", (16, 24, 24)))


@dataclass(frozen=True)
class QwenVisionConfig:
    hidden_size: int
    intermediate_size: int
    depth: int
    num_heads: int
    patch_size: int
    temporal_patch_size: int
    merge_size: int
    window_size: int  # pixels
    full_attention: tuple[int, ...]  # blocks that attend over the whole image
    text_hidden: int
    rope_theta: float
    image_token_id: int
    mrope_section: tuple[int, ...]  # the language model's

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads


def config(raw: dict, text_hidden: int) -> QwenVisionConfig:
    v = raw.get("vision_config") or {}
    check_activation(v, "hidden_act", "silu")
    return QwenVisionConfig(
        hidden_size=v.get("hidden_size", 3584),
        intermediate_size=v.get("intermediate_size", 3420),
        depth=v.get("depth", 32),
        num_heads=v.get("num_heads", 16),
        patch_size=v.get("patch_size", 14),
        temporal_patch_size=v.get("temporal_patch_size", 2),
        merge_size=v.get("spatial_merge_size", 2),
        window_size=v.get("window_size", 112),
        full_attention=tuple(v.get("fullatt_block_indexes", (7, 15, 23, 31))),
        text_hidden=v.get("out_hidden_size", text_hidden),
        rope_theta=(v.get("rope_parameters") or {}).get("rope_theta", 10000.0),
        image_token_id=raw.get("image_token_id", 151655),
        mrope_section=mrope_section(raw),
    )


def tensor_shapes(cfg: QwenVisionConfig) -> Shapes:
    d, inter, t, p = cfg.hidden_size, cfg.intermediate_size, cfg.temporal_patch_size, cfg.patch_size
    merged = d * cfg.merge_size**2
    block = {"norm1.weight": (d,), "norm2.weight": (d,)}
    block |= linear_shapes({"attn.qkv": (3 * d, d), "attn.proj": (d, d)}, bias=True)
    mlp = {"mlp.gate_proj": (inter, d), "mlp.up_proj": (inter, d), "mlp.down_proj": (d, inter)}
    block |= linear_shapes(mlp, bias=True)
    shapes: Shapes = {"patch_embed.proj.weight": (d, 3, t, p, p), "merger.ln_q.weight": (d,)}
    merger = {"merger.mlp.0": (merged, merged), "merger.mlp.2": (cfg.text_hidden, merged)}
    shapes |= linear_shapes(merger, bias=True)
    for i in range(cfg.depth):
        shapes |= {f"blocks.{i}.{name}": shape for name, shape in block.items()}
    return {VISUAL + name: shape for name, shape in shapes.items()}


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding over all of x's last dim (pairs i, i + D/2), in float32."""
    half = x.shape[-1] // 2
    xf = x.float()
    rotated = torch.cat((-xf[..., half:], xf[..., :half]), dim=-1)
    return (xf * cos + rotated * sin).to(x.dtype)


@dataclass
class Block:
    norm1: RMSNorm
    qkv: Linear
    proj: Linear
    norm2: RMSNorm
    gate: Linear
    up: Linear
    down: Linear
    num_heads: int

    def forward(
        self, x: torch.Tensor, rotation: tuple[torch.Tensor, torch.Tensor], windows: list[int]
    ) -> torch.Tensor:
        """x [N, hidden] in window order; windows: the lengths of the runs that attend among
        themselves."""
        n, d = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(n, 3, self.num_heads, -1).unbind(1)
        q, k = rotate(q, *rotation), rotate(k, *rotation)
        attn = windowed_attention(q, k, v, windows)
        x = x + self.proj(attn.reshape(n, d))
        h = self.norm2(x)
        return x + self.down(self.up.times(h, F.silu(self.gate(h))))


def windowed_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, windows: list[int]
) -> torch.Tensor:
    """Attention [N, heads, head_dim] of q, k, v [N, heads, head_dim] within each run of
    `windows` rows. Windows of one size go to SDPA as one batch: a call per window cost more
    than its work (a 4,000-patch image has ~70 windows a block)."""
    out = torch.empty_like(q)
    starts: dict[int, list[int]] = {}
    at = 0
    for size in windows:
        starts.setdefault(size, []).append(at)
        at += size
    for size, firsts in starts.items():
        rows = (
            torch.tensor(firsts, device=q.device)[:, None] + torch.arange(size, device=q.device)
        ).flatten()
        # [windows, heads, size, head_dim]; 4-D, as a 3-D input takes the CPU's unfused path.
        batch = [t[rows].view(len(firsts), size, *t.shape[1:]).transpose(1, 2) for t in (q, k, v)]
        attn = F.scaled_dot_product_attention(*batch)
        out[rows] = attn.transpose(1, 2).reshape(len(rows), *q.shape[1:])
    return out


@dataclass
class QwenVision(SteppedEncoder):
    cfg: QwenVisionConfig
    patch_embed: Linear
    blocks: list[Block]
    merger_norm: RMSNorm
    merger_fc1: Linear
    merger_fc2: Linear
    inv_freq: torch.Tensor  # [head_dim / 4]
    dtype: torch.dtype

    @property
    def image_token_id(self) -> int:
        return self.cfg.image_token_id

    def tokens(self, image: PreparedImage) -> int:
        _, rows, cols = image.grid  # type: ignore[misc]
        return rows * cols // self.cfg.merge_size**2

    @property
    def encode_units(self) -> int:
        return self.cfg.depth + 1

    def _encode(self, image: PreparedImage) -> EncodeWork:
        """The encode, yielding after each block (model/encode_steps.py)."""
        cfg, unit = self.cfg, self.cfg.merge_size**2
        _, rows, cols = image.grid  # type: ignore[misc]
        device = self.inv_freq.device
        x = self.patch_embed(torch.from_numpy(image.pixels).to(device, self.dtype))
        order, windows = window_order(rows // cfg.merge_size, cols // cfg.merge_size, self.window)
        order = order.to(device)
        # Patches move by merge units (unit consecutive rows): units in window order.
        by_unit = (order[:, None] * unit + torch.arange(unit, device=device)).flatten()
        x = x[by_unit]
        rotation = self.rotation(rows, cols, by_unit)
        whole = [len(x)]
        patch_windows = [n * unit for n in windows]
        for i, block in enumerate(self.blocks):
            x = block.forward(x, rotation, whole if i in cfg.full_attention else patch_windows)
            yield
        merged = self.merger_norm(x).view(-1, cfg.hidden_size * unit)
        out = self.merger_fc2(F.gelu(self.merger_fc1(merged)))
        return out[torch.argsort(order)]

    def rope_positions(self, token_ids: list[int], images: list[PreparedImage]) -> torch.Tensor:
        grids = [image.grid for image in images]
        return mrope_positions(token_ids, self.image_token_id, grids, self.cfg.merge_size)  # type: ignore[arg-type]

    @property
    def window(self) -> int:
        """A window's side in merge units."""
        return self.cfg.window_size // self.cfg.merge_size // self.cfg.patch_size

    def rotation(
        self, rows: int, cols: int, order: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin [N, 1, head_dim] of each patch (in `order`) by its row and column."""
        m, device = self.cfg.merge_size, self.inv_freq.device
        row, col = torch.meshgrid(
            torch.arange(rows, device=device), torch.arange(cols, device=device), indexing="ij"
        )
        # The processor's patch order: merge window by merge window.
        row, col = (
            t.reshape(rows // m, m, cols // m, m).transpose(1, 2).flatten() for t in (row, col)
        )
        freqs = torch.cat((row[:, None] * self.inv_freq, col[:, None] * self.inv_freq), dim=-1)
        freqs = torch.cat((freqs, freqs), dim=-1)[order][:, None, :]
        return freqs.cos(), freqs.sin()


def window_order(rows: int, cols: int, side: int) -> tuple[torch.Tensor, list[int]]:
    """The merge units of a rows x cols grid in window order (side x side windows, row by row,
    the last ones cut by the grid's edge), and each window's count of units."""
    index = torch.arange(rows * cols).view(rows, cols)
    order, sizes = [], []
    for top in range(0, rows, side):
        for left in range(0, cols, side):
            window = index[top : top + side, left : left + side].flatten()
            order.append(window)
            sizes.append(len(window))
    return torch.cat(order), sizes


def build(cfg: QwenVisionConfig, w: Weights) -> QwenVision:
    blocks = []
    for i in range(cfg.depth):
        p = f"{VISUAL}blocks.{i}."
        blocks.append(
            Block(
                norm1=RMSNorm(w.take(p + "norm1.weight"), NORM_EPS),
                qkv=w.linear(p + "attn.qkv"),
                proj=w.linear(p + "attn.proj"),
                norm2=RMSNorm(w.take(p + "norm2.weight"), NORM_EPS),
                gate=w.linear(p + "mlp.gate_proj"),
                up=w.linear(p + "mlp.up_proj"),
                down=w.linear(p + "mlp.down_proj"),
                num_heads=cfg.num_heads,
            )
        )
    patch = w.take(VISUAL + "patch_embed.proj.weight")
    half = cfg.head_dim // 2  # rows rotate one half of a head, columns the other
    inv_freq = 1.0 / cfg.rope_theta ** (torch.arange(0, half, 2, dtype=torch.float32) / half)
    return QwenVision(
        cfg=cfg,
        patch_embed=w.kernels.linear(patch.flatten(1)),
        blocks=blocks,
        merger_norm=RMSNorm(w.take(VISUAL + "merger.ln_q.weight"), NORM_EPS),
        merger_fc1=w.linear(VISUAL + "merger.mlp.0"),
        merger_fc2=w.linear(VISUAL + "merger.mlp.2"),
        inv_freq=inv_freq.to(w.device),
        dtype=w.kernels.dtype,
    )


def adapt_decoder(cfg: QwenVisionConfig, decoder: Decoder) -> None:
    """Qwen2's layers share one rope: it rotates by M-RoPE."""
    for layer in decoder.layers:
        layer.rope.sections = cfg.mrope_section  # type: ignore[attr-defined]


def mrope_positions(
    token_ids: list[int], image_token_id: int, grids: list[tuple[int, int, int]], merge_size: int
) -> torch.Tensor:
    """[3, T] (t, h, w) positions of a prompt whose images' placeholder runs have these grids
    (as the processor gives them): text positions count on from the largest before them + 1;
    an image's tokens sit on its merged grid, offset by where it starts."""
    out, pos, i, images = [], 0, 0, iter(grids)
    while i < len(token_ids):
        if token_ids[i] != image_token_id:
            out.append(torch.full((3, 1), pos))
            pos, i = pos + 1, i + 1
            continue
        t, rows, cols = next(images)
        rows, cols = rows // merge_size, cols // merge_size
        grid = torch.meshgrid(
            torch.arange(t), torch.arange(rows), torch.arange(cols), indexing="ij"
        )
        out.append(torch.stack(grid).reshape(3, -1) + pos)
        pos, i = pos + max(rows, cols), i + t * rows * cols
    return torch.cat(out, dim=1)
