"""The kernels seam: everything device-specific, chosen once per (device, dtype) by a probe.

`select(device, dtype)` tries the private ops this machine might run fast (see probe.py) and
returns a `Kernels` that the loader builds its linears from and the decoder attends with.
Every private op has a public fallback. `GAPLESS_KERNELS=fallback` forces the public ops
everywhere (F.linear, F.scaled_dot_product_attention), e.g. to rule the fast paths out;
`GAPLESS_KERNELS=avx2` (or another level) runs this CPU as a lesser one would (machine.py).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch

from gapless.kernels import paged
from gapless.kernels.kv_format import KV_CACHE_DTYPES, Q8_GROUP, kv_cache_name, kv_cache_row
from gapless.kernels.linear import (
    DECODE_ROWS,
    BlockLinear,
    Int4Linear,
    Int8Linear,
    Linear,
    NarrowLinear,
    PackedLinear,
    PlainLinear,
    as_dtype,
)
from gapless.kernels.machine import kernels_setting, machine
from gapless.kernels.plans import AttentionLayout, AttentionPlan, KVCache, Planner, Span
from gapless.kernels.probe import (
    cpu_flash_works,
    gguf_blocks_work,
    int4_mm_works,
    int8_mm_works,
    packed_linear_works,
    paged_decode_works,
    paged_prefill_works,
)
from gapless.kernels.quant import BlockQuant, GroupQuant

__all__ = [
    "AttentionLayout",
    "AttentionPlan",
    "DECODE_ROWS",
    "KV_CACHE_DTYPES",
    "Kernels",
    "kv_cache_name",
    "kv_cache_row",
    "Linear",
    "Span",
    "resolve_dtype",
    "select",
]

log = logging.getLogger("gapless.kernels")

# The run's dtypes, by --dtype name (the KV cache's storage types are kv_format's).
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class Kernels:
    device: torch.device
    dtype: torch.dtype
    packed_linear: bool  # oneDNN-packed weights with fused epilogues (PackedLinear)
    in_place_attention: bool  # attention.in_place; else attention.gathered only
    # Prompt chunks up to this many tokens run attention with GQA heads folded into query
    # rows (see plans.GatheredPlan); above it the plain kernel was as fast or faster here.
    fold_max_queries: int = 128
    # A history in more runs of consecutive cache slots than this is gathered instead:
    # each run costs one more attention call.
    max_history_runs: int = 8
    # Activations' dtype for the int8 / int4 weight-only kernels; None: dequantize instead.
    int8_dtype: torch.dtype | None = None
    int4_dtype: torch.dtype | None = None
    # Batches of more rows than this dequantize a quantized weight and run the dense matmul
    # (linear.DECODE_ROWS says why).
    int_kernel_max_rows: int = DECODE_ROWS
    # The same for GGUF blocks on our block kernels (BlockLinear): above it, the dense copies
    # or the dequantizing path (AMX_GEMV_ROWS says why it may be more).
    gguf_gemv_max_rows: int = DECODE_ROWS
    # GGUF files' quantized weights stay in their blocks, on our block kernels (blocks.py);
    # else Q4_0/Q4_1 unpack for torch's int4 op and other types are dequantized at load.
    gguf_blocks: bool = False
    paged_decode: bool = False  # decodes on our kernel (paged.py), else on SDPA
    paged_prefill: bool = False  # prompt chunks attend on it too, else on attention.py
    # A float32 run of quantized weights on a CPU that multiplies bf16 fast computes in bf16
    # where that costs little accuracy (the quantized linears' larger batches, a dense
    # lm_head's reads, and attention where our kernel runs it: attention_dtype),
    # and keeps the residual stream and norms in float32 (see resolve_dtype).
    # None: the run dtype everywhere.
    reduced_dtype: torch.dtype | None = None
    # GGUF linears' prompt chunks multiply a dense copy of the weight, made at load and kept
    # beside its blocks, instead of dequantizing the blocks every step (BlockLinear): the
    # loader sets it where the copies fit (model/gguf.py).
    gguf_prompt_copies: bool = False
    # --kv-cache-dtype auto keeps the KV cache in the run dtype (vLLM's rule): a safetensors
    # checkpoint's weights run as stored, and a narrower cache would round what they compute
    # (a float32 Llama's prompt logprobs moved 1.2e-3 on a bf16 cache). GGUF files and
    # --quantize keep the fast pick: their weights are rounded already.
    exact_kv: bool = False

    @property
    def attention_dtype(self) -> torch.dtype:
        """The dtype attention computes in, whatever the KV cache stores (see
        _attention_dtype)."""
        return _attention_dtype(self.dtype, self.reduced_dtype, self.paged_prefill)

    def kv_cache_dtype(self, name: str, head_dim: int) -> torch.dtype:
        """The KV cache's storage type for --kv-cache-dtype `name` and a model of this head
        size. auto is the attention dtype where exact_kv says so, on CUDA, and where it is
        bfloat16 already; else (quantized float32 runs) the smallest that kept the default
        model's greedy answers: float16 on CPUs that convert it in hardware (F16C), else
        float32."""
        if name == "auto":
            narrow = self.device.type == "cuda" or self.attention_dtype == torch.bfloat16
            if self.exact_kv or narrow or "f16c" not in machine().cpu_isa:
                return self.attention_dtype
            return torch.float16
        if name not in KV_CACHE_DTYPES:
            raise ValueError(
                f"unknown KV cache dtype {name!r}; choose auto, {', '.join(KV_CACHE_DTYPES)}"
            )
        if name == "int8" and head_dim % Q8_GROUP:
            raise ValueError(
                f"--kv-cache-dtype int8 needs a head size that is a multiple of {Q8_GROUP};"
                f" this model's is {head_dim}"
            )
        return KV_CACHE_DTYPES[name]

    def linear(
        self, weight: torch.Tensor | GroupQuant | BlockQuant, bias: torch.Tensor | None = None
    ) -> Linear:
        rows, dense = self.int_kernel_max_rows, self.reduced_dtype
        if isinstance(weight, BlockQuant):
            copy = None
            if self.gguf_prompt_copies:
                w = weight.dequantize(dense or self.dtype)
                packed = self.packed_linear and packed_linear_works(w.dtype)
                copy = PackedLinear(w) if packed else PlainLinear(w)
            return BlockLinear(weight, bias, self.gguf_gemv_max_rows, dense, copy)
        if isinstance(weight, GroupQuant) and weight.codes.dtype == torch.int8:
            return Int8Linear(weight, bias, self.int8_dtype, rows, dense)
        if isinstance(weight, GroupQuant):
            return Int4Linear(weight, bias, self.int4_dtype, rows, dense)
        if self.packed_linear:
            return PackedLinear(weight, bias)
        return PlainLinear(weight, bias)

    def lm_head(self, weight: torch.Tensor | GroupQuant | BlockQuant) -> Linear:
        """The vocabulary projection. GGUF blocks, and a dense one in a run with reduced_dtype,
        are read narrow and their best logits made exact (see NarrowLinear): every decode step
        reads all of it, and in float32 it took a quarter of the default model's step."""
        if isinstance(weight, BlockQuant):  # interleaved where it can be: see Decoder
            narrow = BlockLinear(weight, None, self.gguf_gemv_max_rows, self.reduced_dtype)
            return NarrowLinear(narrow.weight, narrow, None)
        if self.reduced_dtype is None or isinstance(weight, GroupQuant):
            return self.linear(weight)
        narrow = self.linear(weight.to(self.reduced_dtype))
        return NarrowLinear(weight, narrow, self.reduced_dtype)  # type: ignore[arg-type]

    def decodes_paged(self, head_dim: int, cache_dtype: torch.dtype) -> bool:
        """Whether decodes of a model with this head size, over a KV cache of this storage
        type, run on our paged kernel."""
        return (
            self.paged_decode
            and head_dim in paged.HEAD_DIMS
            and paged_decode_works(self.attention_dtype, cache_dtype)
        )

    def prefills_paged(self, head_dim: int, cache_dtype: torch.dtype) -> bool:
        """Whether prompt chunks of such a model do."""
        return (
            self.paged_prefill
            and head_dim in paged.PREFILL_HEAD_DIMS
            and paged_prefill_works(self.attention_dtype, cache_dtype)
        )

    def plan_attention(self, layout: AttentionLayout, spans: list[Span]) -> list[AttentionPlan]:
        """How the step's batch of these spans attends: the path of each part, as its plan
        (see plans.py)."""
        return Planner(self, layout).plan(spans)

    def attention(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: KVCache,
        plans: list[AttentionPlan],
        window: int | None,
        softcap: float | None = None,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Attention of the batch's queries q [T, H, D], whose own keys and values k, v
        [T, Hkv, D] (as write_kv returns them) are already in kv_cache, for a layer with
        this window, each part as its plan says; softcap: its scores soft-capped; sinks [H]:
        a logit per head that joins the softmax (plans.py). Computes in attention_dtype,
        whatever the cache stores. Returns [T, H * D] in q's dtype."""
        run_dtype, dtype = q.dtype, self.attention_dtype
        q, k, v = as_dtype(q, dtype), as_dtype(k, dtype), as_dtype(v, dtype)
        if len(plans) == 1:
            return as_dtype(plans[0].attend(q, k, v, kv_cache, window, softcap, sinks), run_dtype)
        out = q.new_empty(q.shape[0], q.shape[1] * q.shape[2])
        for plan in plans:
            out[plan.rows] = plan.attend(q, k, v, kv_cache, window, softcap, sinks)
        return as_dtype(out, run_dtype)

    def describe(self) -> str:
        m = machine()
        where = m.cuda if self.device.type == "cuda" else f"cpu {' '.join(m.cpu_isa) or 'base'}"
        linear = "onednn-packed" if self.packed_linear else "F.linear"
        attn = "in-place paged" if self.in_place_attention else "gathered sdpa"
        decode = "decodes on our paged kernel" if self.paged_decode else "decodes on sdpa"
        if self.paged_prefill:
            decode = "decodes and prompt chunks on our paged kernel"
        dtype = _name(self.dtype)
        quant = ", ".join(
            f"{name} kernel on {_name(dt)}" if dt else f"{name} dequantized"
            for name, dt in (("int8", self.int8_dtype), ("int4", self.int4_dtype))
        )
        if self.gguf_blocks:
            quant += f", GGUF blocks on our kernels up to {self.gguf_gemv_max_rows} rows"
        if self.reduced_dtype:
            quant += f", quantized prefill and dense lm_head on {_name(self.reduced_dtype)}"
        if self.gguf_prompt_copies:
            quant += ", GGUF prompt chunks on dense copies"
        if self.attention_dtype != self.dtype:
            decode += f", {_name(self.attention_dtype)} attention"
        kv = "the run dtype, as a checkpoint's" if self.exact_kv else "the fast pick"
        return (
            f"kernels: {where}, {dtype} {linear} linear, {attn} attention, {decode}, {quant};"
            f" KV cache auto: {kv}"
        )


# With AMX, GGUF linears keep batches of up to 32 rows on the block kernels: oneDNN's bf16
# matmul costs ~90-210 us a call at 4-68 rows there, and the dense copies read 2 bytes a
# weight where Q4_1's blocks read 0.6. A step of 17 decode rows of the default model took 42
# ms on the blocks against 71 on the copies, 24 rows 49 against 74, 32 rows 63 against 81, 48
# rows 88 against 88, 4 decodes beside a 16-token chunk 50 against 64 (a Sapphire Rapids, 2
# vCPUs, runner only, median of 6). Without AMX the crossing was not measured: 16 stays.
AMX_GEMV_ROWS = 32


def _attention_dtype(
    dtype: torch.dtype, reduced: torch.dtype | None, paged_prefill: bool
) -> torch.dtype:
    """A reduced dtype only where prompt chunks attend in it fast: on our bf16 kernel (its
    AVX512-BF16 build, or its AMX one, on the tiles), or on the flash op with AMX, whose bf16
    products run on the tiles too (2.7-3.1x its float32 speed on a Sapphire Rapids).
    Elsewhere the flash op computes bf16 at the float32 rate, so it
    would cost accuracy for nothing. In a run whose linears take bf16 activations, bf16
    attention drifts from float32 attention about as much as a float16 cache alone does
    (docs/server.md, "The KV cache")."""
    fast = paged_prefill or "amx" in machine().cpu_isa
    return reduced if reduced and fast else dtype


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _forced_fallback() -> bool:
    return kernels_setting() == "fallback"


def _fast_cpu_half(dtype: torch.dtype) -> bool:
    """The CPU has the instructions, and oneDNN packs this dtype: it may be capped below
    what the CPU has (ONEDNN_MAX_CPU_ISA), and then refuses."""
    return machine().fast_cpu_bf16 and packed_linear_works(dtype)


def select(
    device: torch.device, dtype: torch.dtype, quantized: bool = False, exact_kv: bool = False
) -> Kernels:
    """The fastest kernels the probe finds working for this device and dtype, for a model
    with quantized weights or not (exact_kv: Kernels'); logs them."""
    fallback = _forced_fallback()
    cpu = device.type == "cpu" and not fallback
    fast_bf16 = cpu and quantized and dtype == torch.float32 and _fast_cpu_half(torch.bfloat16)
    reduced = torch.bfloat16 if fast_bf16 else None
    chunk_dtype = reduced or dtype
    paged_prefill = cpu and paged_prefill_works(chunk_dtype, chunk_dtype)
    amx = cpu and "amx" in machine().cpu_isa
    attention_dtype = _attention_dtype(dtype, reduced, paged_prefill)  # before the Kernels
    kernels = Kernels(
        device,
        dtype,
        packed_linear=cpu and packed_linear_works(dtype),
        in_place_attention=cpu and cpu_flash_works(attention_dtype),
        gguf_blocks=cpu and quantized and gguf_blocks_work(),
        paged_decode=cpu and paged_decode_works(attention_dtype, attention_dtype),
        paged_prefill=paged_prefill,
        gguf_gemv_max_rows=AMX_GEMV_ROWS if amx else DECODE_ROWS,
        int8_dtype=None if fallback else _int_kernel_dtype(int8_mm_works, device, dtype),
        int4_dtype=None if fallback else _int_kernel_dtype(int4_mm_works, device, dtype),
        reduced_dtype=reduced,
        exact_kv=exact_kv,
    )
    log.info(kernels.describe())
    if device.type == "cpu" and dtype != torch.float32 and not _fast_cpu_half(dtype):
        log.warning(
            "%s is slow on this CPU (no AMX or AVX512-BF16 that oneDNN may use);"
            " --dtype float32 runs faster",
            _name(dtype),
        )
    return kernels


def _int_kernel_dtype(
    works: Callable[[str, torch.dtype], bool], device: torch.device, dtype: torch.dtype
) -> torch.dtype | None:
    """bfloat16 activations where the kernel takes them, even in a float32 run: on the CPU
    the int8 kernel ran ~8x faster on them (docs/benchmarks.md); the CUDA int4 kernel takes
    nothing else. Else the run dtype, or None where the kernel is missing."""
    for candidate in (torch.bfloat16, dtype):
        if works(device.type, candidate):
            return candidate
    return None


def resolve_dtype(
    name: str, device: torch.device, quantized: bool = False, stored: torch.dtype | None = None
) -> torch.dtype:
    """`auto` for a safetensors checkpoint (`stored`: its own dtype, config.json's
    torch_dtype) is that dtype wherever this device computes in it fast, so that a float32
    checkpoint matches transformers by default: on CPUs, bfloat16 where it is fast
    (AMX/AVX512-BF16), else float32, and float16 checkpoints float32 (both exact upcasts); on
    CUDA, float32 checkpoints bfloat16. Without `stored` (GGUF files, --quantize): bfloat16
    on CUDA, and on CPUs with AMX/AVX512-BF16 where the packed bf16 linear works; float32
    elsewhere, and for quantized weights on every CPU.

    Quantized weights already round activations to bfloat16 where that is fast (the int
    kernels), so their float32 runs compute in bf16 wherever it costs little accuracy: the
    linears, attention where our kernel runs it, and a dense lm_head (Kernels.reduced_dtype).
    What stays float32 is the residual stream and the norms: in bfloat16 they changed the
    default model's greedy answers ("What is the capital of France?" got "L'Étoile, la
    Marseillaise, ...", float32 "Paris").
    """
    if name == "auto":
        half = (torch.bfloat16, torch.float16)
        if device.type == "cuda":
            return stored if stored in half else torch.bfloat16
        if quantized:
            return torch.float32
        fast = _fast_cpu_half(torch.bfloat16) and not _forced_fallback()
        if stored is not None:
            return torch.bfloat16 if fast and stored == torch.bfloat16 else torch.float32
        return torch.bfloat16 if fast else torch.float32
    if name not in DTYPES:
        raise ValueError(f"unknown dtype {name!r}; choose auto, {', '.join(DTYPES)}")
    return DTYPES[name]
