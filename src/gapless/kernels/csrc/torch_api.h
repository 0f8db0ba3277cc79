// What our kernels use of torch. Not <torch/extension.h>: that brings torch's whole C++
// frontend, ~21 s of every file's compile on 2 Zen 4 cores against ~9 s for these, and the
// install compiles each file once per ISA level (kernels/extensions.py).
#pragma once

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/mm.h>
#include <ATen/ops/silu.h>
#include <c10/core/InferenceMode.h>
#include <torch/csrc/utils/pybind.h>
