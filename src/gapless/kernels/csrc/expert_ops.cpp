// The linears of a mixture's chosen experts, all in one parallel region, each expert's on one
// thread. Called one after another, each small linear is a parallel region of its own, whose
// fork, join and oneDNN set-up cost more than its few hundred rows take to read: Qwen3-MoE's 8
// chosen experts make 16 such calls a layer where a dense MLP of the same bytes makes 2.
#include "torch_api.h"

#include <ATen/core/dispatch/Dispatcher.h>

#include <optional>
#include <string>
#include <vector>

namespace {

// xs[i] [rows_i, K_i] times weights[i] (oneDNN-packed, as PackedLinear holds them), plus
// biases[i] where given: the op PackedLinear calls, called here inside one parallel region
// (where it runs single-threaded).
std::vector<at::Tensor> packed_linears(const std::vector<at::Tensor>& xs,
                                       const std::vector<at::Tensor>& weights,
                                       const std::vector<std::optional<at::Tensor>>& biases) {
  TORCH_CHECK(xs.size() == weights.size() && xs.size() == biases.size(),
              "packed_linears takes as many inputs, weights and biases");
  static const c10::OperatorHandle op =
      c10::Dispatcher::singleton().findSchemaOrThrow("mkldnn::_linear_pointwise", "");
  std::vector<at::Tensor> out(xs.size());
  // Worker threads do not inherit the caller's inference mode (gguf_ops.cpp's mm says why).
  const bool inference = c10::InferenceMode::is_enabled();
  at::parallel_for(0, static_cast<int64_t>(xs.size()), 1, [&](int64_t i0, int64_t i1) {
    c10::InferenceMode guard(inference);
    for (int64_t i = i0; i < i1; ++i) {
      c10::IValue bias = biases[i].has_value() ? c10::IValue(*biases[i]) : c10::IValue();
      torch::jit::Stack stack{xs[i],        weights[i], bias, std::string("none"),
                              c10::List<std::optional<at::Scalar>>(), c10::IValue()};
      op.callBoxed(stack);
      out[i] = stack[0].toTensor();
    }
  });
  return out;
}

}  // namespace

// Registered by gguf_ops.cpp's module, which is this extension's one.
void register_expert_ops(pybind11::module_& m) {
  m.def("packed_linears", &packed_linears,
        "each input times its oneDNN-packed weight (plus bias), in one parallel region");
}
