// The paged kernel (paged_attention.cpp) as the block kernels' one call a step
// (decode_layers.cpp) calls it: by address, from the other extension's module
// (`paged_attention_entry()`), so that the step's attention is a C++ call with no torch
// dispatch. Both extensions are built against the same torch, so they share its Tensor ABI.
#pragma once

#include "torch_api.h"

// paged_attention()'s arguments and checks, into `out` (q's shape and dtype).
using PagedAttentionInto = void (*)(const at::Tensor& q, const at::Tensor& k_cache,
                                    const at::Tensor& v_cache, const at::Tensor& block_tables,
                                    const at::Tensor& num_keys, int64_t n, int64_t window,
                                    double scale, const c10::optional<at::Tensor>& last_keys,
                                    at::Tensor& out);
