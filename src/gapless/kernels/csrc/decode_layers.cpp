// A decode step's layers in one call. Torch runs a layer as ~27 ops (norms, casts, slices,
// views, the products, rope, the cache write, attention, the residual adds), and each op's
// dispatch costs microseconds however few values a decode row has: on the default model that
// was ~800 dispatches and about a third of a batch-1 step. Here each layer is the same row
// loops and products, called from C++ on buffers of our own: the step's rows go through
// every layer with no torch op at all. Attention is the paged kernel's, called by address
// (paged_entry.h). A layer's quirks come as data (biases, q/k norms, stacked products of
// several block types, a window); what this does not cover runs on the ops
// (kernels/decode_layers.py says which).
#include <ATen/ops/from_blob.h>

#include <array>
#include <cmath>
#include <optional>
#include <vector>

#include "gguf_weight.h"
#include "paged_entry.h"
#include "step_rows.h"

namespace {

namespace gg = gapless_gguf;
namespace st = gapless_step;

at::Tensor view_of(void* data, at::IntArrayRef sizes, at::IntArrayRef strides,
                   at::ScalarType dtype) {
  return at::from_blob(data, sizes, strides, at::TensorOptions().dtype(dtype));
}

at::Tensor view_of(float* data, at::IntArrayRef sizes) {
  return at::from_blob(data, sizes, at::TensorOptions().dtype(at::kFloat));
}

// torch's float32 silu computes x / (1 + exp(-x)) on SLEEF's exp (which libtorch exports) at
// its CPU capability, and on std::exp without one: the same here, bit for bit where our build's
// level is torch's, so that a decode row's 8-bit quantization before `down` rounds as the
// ops' does (a unit in the last place moves a code, and the step's logits by ~1e-2).
#if defined(__AVX512F__)
extern "C" __m512 Sleef_expf16_u10(__m512);
#elif defined(__AVX2__)
extern "C" __m256 Sleef_expf8_u10(__m256);
#endif

// up[i] *= silu(gate[i]), for n values.
void silu_times(const float* gate, float* up, int64_t n) {
  int64_t i = 0;
#if defined(__AVX512F__)
  const __m512 one = _mm512_set1_ps(1.0f);
  for (; i + 16 <= n; i += 16) {
    const __m512 g = _mm512_loadu_ps(gate + i);
    const __m512 e = Sleef_expf16_u10(_mm512_sub_ps(_mm512_setzero_ps(), g));
    const __m512 s = _mm512_div_ps(g, _mm512_add_ps(one, e));
    _mm512_storeu_ps(up + i, _mm512_mul_ps(_mm512_loadu_ps(up + i), s));
  }
#elif defined(__AVX2__)
  const __m256 one = _mm256_set1_ps(1.0f);
  for (; i + 8 <= n; i += 8) {
    const __m256 g = _mm256_loadu_ps(gate + i);
    const __m256 e = Sleef_expf8_u10(_mm256_sub_ps(_mm256_setzero_ps(), g));
    const __m256 s = _mm256_div_ps(g, _mm256_add_ps(one, e));
    _mm256_storeu_ps(up + i, _mm256_mul_ps(_mm256_loadu_ps(up + i), s));
  }
#endif
  for (; i < n; ++i) up[i] *= gate[i] / (1.0f + std::exp(-gate[i]));
}

// torch's float32 tanh-approximated GELU, the same way (and SLEEF's tanh): 0.5 x (1 +
// tanh(beta (x + kappa x^3))), in its order of operations, x + kappa x^3 as one fused
// multiply-add (without it, 0.6% of values differed by a unit in the last place).
#if defined(__AVX512F__)
extern "C" __m512 Sleef_tanhf16_u10(__m512);
#elif defined(__AVX2__)
extern "C" __m256 Sleef_tanhf8_u10(__m256);
#endif

// up[i] *= gelu_tanh(gate[i]), for n values.
void gelu_times(const float* gate, float* up, int64_t n) {
  const float beta = static_cast<float>(M_SQRT2 * M_2_SQRTPI * 0.5), kappa = 0.044715f;
  int64_t i = 0;
#if defined(__AVX512F__)
  const __m512 b = _mm512_set1_ps(beta), k = _mm512_set1_ps(kappa);
  const __m512 one = _mm512_set1_ps(1.0f), half = _mm512_set1_ps(0.5f);
  for (; i + 16 <= n; i += 16) {
    const __m512 x = _mm512_loadu_ps(gate + i);
    const __m512 cube = _mm512_mul_ps(_mm512_mul_ps(x, x), x);
    const __m512 inner = _mm512_mul_ps(b, _mm512_fmadd_ps(k, cube, x));
    const __m512 g = _mm512_mul_ps(_mm512_mul_ps(half, x),
                                   _mm512_add_ps(one, Sleef_tanhf16_u10(inner)));
    _mm512_storeu_ps(up + i, _mm512_mul_ps(_mm512_loadu_ps(up + i), g));
  }
#elif defined(__AVX2__)
  const __m256 b = _mm256_set1_ps(beta), k = _mm256_set1_ps(kappa);
  const __m256 one = _mm256_set1_ps(1.0f), half = _mm256_set1_ps(0.5f);
  for (; i + 8 <= n; i += 8) {
    const __m256 x = _mm256_loadu_ps(gate + i);
    const __m256 cube = _mm256_mul_ps(_mm256_mul_ps(x, x), x);
    const __m256 inner = _mm256_mul_ps(b, _mm256_fmadd_ps(k, cube, x));
    const __m256 g = _mm256_mul_ps(_mm256_mul_ps(half, x),
                                   _mm256_add_ps(one, Sleef_tanhf8_u10(inner)));
    _mm256_storeu_ps(up + i, _mm256_mul_ps(_mm256_loadu_ps(up + i), g));
  }
#endif
  for (; i < n; ++i) {
    const float x = gate[i];
    up[i] *= 0.5f * x * (1.0f + std::tanh(beta * std::fma(kappa, x * x * x, x)));
  }
}

// A linear on GGUF blocks: parts whose output columns lie side by side (StackedLinear's, for
// weights of several block types), plus a float32 bias.
struct Product {
  std::vector<at::Tensor> blocks;  // what parts point into, [part rows, row bytes] each
  std::vector<gg::Weight> parts;
  std::optional<at::Tensor> bias;
  int64_t cols, rows = 0;

  Product(const std::vector<std::tuple<at::Tensor, int64_t, bool>>& weights,
          const std::optional<at::Tensor>& bias_in, int64_t cols_in)
      : bias(bias_in), cols(cols_in) {
    for (const auto& [b, qtype, interleaved] : weights) {
      blocks.push_back(b);
      parts.emplace_back(gg::block_type(qtype), b, cols, interleaved);
      rows += b.size(0);
    }
    TORCH_CHECK(!bias || (bias->scalar_type() == at::kFloat && bias->is_contiguous() &&
                          bias->numel() == rows),
                "a product's bias must be a contiguous float32 [rows]");
  }

  // y [m, rows] = x [m, cols] times the weight, transposed, plus the bias.
  void run(const float* x, int64_t m, float* y) const {
    int64_t first = 0;
    for (size_t i = 0; i < parts.size(); ++i) {
      gg::gemv_rows(x, m, cols, parts[i], blocks[i].size(0), y + first, rows);
      first += blocks[i].size(0);
    }
    if (!bias) return;
    const float* b = bias->data_ptr<float>();
    for (int64_t i = 0; i < m; ++i)
      for (int64_t r = 0; r < rows; ++r) y[i * rows + r] += b[r];
  }
};

// One pre-norm layer with a gated MLP, float32 activations: Llama's (and Mistral's, Qwen2's,
// Qwen3's) or Gemma 3's, whose quirks are the optional norms and the GELU.
struct DecodeLayer {
  at::Tensor input_norm, mlp_norm;  // before attention, before the MLP
  std::optional<at::Tensor> q_norm, k_norm;
  // Gemma's norms of attention's and the MLP's outputs, before each residual add.
  std::optional<at::Tensor> attention_out_norm, mlp_out_norm;
  Product qkv, o, gate, up, down;
  int64_t heads, kv_heads, head_dim, window;
  double eps;
  bool gelu;      // the gate's activation: tanh-approximated GELU (Gemma's), else silu
  int64_t rotation, group;  // which of the step's rotations and attention groups it takes
};

// Where a group of layers' rows attend (a KV group: kv/groups.py): the slots their K/V go to,
// and the paged plan of decodes (plans.py's PagedPlan).
struct Group {
  at::Tensor slots;       // [T] int64
  at::Tensor key_blocks;  // [T, width] int64
  at::Tensor num_keys;    // [T] int64
};

struct Rotation {
  at::Tensor cos, signed_sin;  // [T, 1, R] float32
};

struct DecodeStack {
  std::vector<DecodeLayer> layers;
  PagedAttentionInto attend;
  at::ScalarType attention_dtype;  // what the queries are cast to: float32 or bf16

  // x [T, hidden] float32 through every layer, in place; caches[i]: layer i's (k, v).
  void run(at::Tensor& x, const std::vector<std::tuple<at::Tensor, at::Tensor>>& caches,
           const std::vector<std::tuple<at::Tensor, at::Tensor, at::Tensor>>& group_rows,
           const std::vector<std::tuple<at::Tensor, at::Tensor>>& rotation_rows) const {
    TORCH_CHECK(x.scalar_type() == at::kFloat && x.dim() == 2 && x.is_contiguous(),
                "decode layers take float32 rows [T, hidden], contiguous");
    TORCH_CHECK(caches.size() == layers.size(), "one (k, v) cache a layer");
    const int64_t t = x.size(0);
    std::vector<Group> groups;
    for (const auto& [slots, key_blocks, num_keys] : group_rows) {
      TORCH_CHECK(slots.scalar_type() == at::kLong && slots.is_contiguous() &&
                      slots.numel() == t && key_blocks.size(0) == t && num_keys.size(0) == t,
                  "decode layers take one slot, block row and key count a row");
      groups.push_back({slots, key_blocks, num_keys});
    }
    std::vector<Rotation> rotations;
    for (const auto& [cos, signed_sin] : rotation_rows) {
      for (const at::Tensor* r : {&cos, &signed_sin})
        TORCH_CHECK(r->scalar_type() == at::kFloat && r->is_contiguous() && r->dim() == 3 &&
                        r->size(0) == t && r->size(1) == 1,
                    "decode layers take float32 rotations [T, 1, R], contiguous");
      rotations.push_back({cos, signed_sin});
    }
    for (const DecodeLayer& l : layers)
      TORCH_CHECK(l.group < static_cast<int64_t>(groups.size()) &&
                      l.rotation < static_cast<int64_t>(rotations.size()),
                  "a decode layer's group or rotation is missing");
    for (size_t i = 0; i < layers.size(); ++i) {
      const DecodeLayer& l = layers[i];
      run_layer(l, x, std::get<0>(caches[i]), std::get<1>(caches[i]), groups[l.group],
                rotations[l.rotation]);
    }
  }

  void run_layer(const DecodeLayer& l, at::Tensor& x_tensor, const at::Tensor& k_cache,
                 const at::Tensor& v_cache, const Group& group, const Rotation& rotation) const {
    float* x = x_tensor.data_ptr<float>();
    const int64_t t = x_tensor.size(0), hidden = x_tensor.size(1), d = l.head_dim;
    const int64_t q_size = l.heads * d, kv_size = l.kv_heads * d, qkv_size = l.qkv.rows;
    std::vector<float> h(t * hidden), qkv(t * qkv_size), q(t * q_size), k(t * kv_size);
    std::vector<float> normed_q, normed_k, attended(t * q_size), sum(t * hidden);
    const at::Tensor x_rows = view_of(x, {t, hidden});
    at::Tensor h_rows = view_of(h.data(), {t, hidden});
    at::Tensor sum_rows = view_of(sum.data(), {t, hidden});
    // x += sum, normed first where the layer norms its outputs (into h, free by then).
    const auto add = [&](const std::optional<at::Tensor>& out_norm) {
      const float* y = sum.data();
      if (out_norm) {
        st::rms_norm_rows<float>(sum_rows, *out_norm, l.eps, h_rows);
        y = h.data();
      }
      for (int64_t i = 0; i < t * hidden; ++i) x[i] += y[i];
    };

    // Attention: RMSNorm, q/k/v, q/k norms, rope, the cache write, the paged kernel, o.
    st::rms_norm_rows<float>(x_rows, l.input_norm, l.eps, h_rows);
    l.qkv.run(h.data(), t, qkv.data());
    at::Tensor q_in = view_of(qkv.data(), {t, l.heads, d}, {qkv_size, d, 1}, at::kFloat);
    at::Tensor k_in = view_of(qkv.data() + q_size, {t, l.kv_heads, d}, {qkv_size, d, 1}, at::kFloat);
    const at::Tensor v_in =
        view_of(qkv.data() + q_size + kv_size, {t, l.kv_heads, d}, {qkv_size, d, 1}, at::kFloat);
    if (l.q_norm) {
      normed_q.resize(t * q_size), normed_k.resize(t * kv_size);
      at::Tensor nq = view_of(normed_q.data(), {t, l.heads, d});
      at::Tensor nk = view_of(normed_k.data(), {t, l.kv_heads, d});
      st::rms_norm_rows<float>(q_in, *l.q_norm, l.eps, nq);
      st::rms_norm_rows<float>(k_in, *l.k_norm, l.eps, nk);
      q_in = nq, k_in = nk;
    }
    at::Tensor q_rows = view_of(q.data(), {t, l.heads, d});
    at::Tensor k_rows = view_of(k.data(), {t, l.kv_heads, d});
    st::rope_rows<float>(q_in, rotation.cos, rotation.signed_sin, q_rows);
    st::rope_rows<float>(k_in, rotation.cos, rotation.signed_sin, k_rows);
    at::Tensor kc = k_cache, vc = v_cache;
    st::write_from<float>(k_rows, kc, group.slots.data_ptr<int64_t>());
    st::write_from<float>(v_in, vc, group.slots.data_ptr<int64_t>());
    attend_rows(l, q, attended, t, k_cache, v_cache, group);
    l.o.run(attended.data(), t, sum.data());
    add(l.attention_out_norm);

    // The MLP: RMSNorm, act(gate) * up, down.
    st::rms_norm_rows<float>(x_rows, l.mlp_norm, l.eps, h_rows);
    const int64_t inner = l.gate.rows;
    std::vector<float> gated(t * inner), up(t * inner);
    l.gate.run(h.data(), t, gated.data());
    l.up.run(h.data(), t, up.data());
    if (l.gelu)
      gelu_times(gated.data(), up.data(), t * inner);
    else
      silu_times(gated.data(), up.data(), t * inner);
    l.down.run(up.data(), t, sum.data());
    add(l.mlp_out_norm);
  }

  // q [T, H * D] float32 attended over the caches into out [T, H * D] float32, the queries
  // cast to the attention dtype first as Kernels.attention casts them; scores scaled by
  // D ** -0.5, as paged.paged_attention scales them.
  void attend_rows(const DecodeLayer& l, std::vector<float>& q, std::vector<float>& out,
                   int64_t t, const at::Tensor& k_cache, const at::Tensor& v_cache,
                   const Group& group) const {
    const int64_t d = l.head_dim, n = t * l.heads * d;
    const double scale = std::pow(static_cast<double>(d), -0.5);
    if (attention_dtype == at::kFloat) {
      const at::Tensor queries = view_of(q.data(), {t, l.heads, d});
      at::Tensor result = view_of(out.data(), {t, l.heads, d});
      attend(queries, k_cache, v_cache, group.key_blocks, group.num_keys, 1, l.window, scale,
             std::nullopt, result);
      return;
    }
    std::vector<uint16_t> narrow_q(n), narrow_out(n);
    gg::to_bf16(q.data(), narrow_q.data(), n);
    const std::array<int64_t, 3> sizes{t, l.heads, d}, strides{l.heads * d, d, 1};
    const at::Tensor queries = view_of(narrow_q.data(), sizes, strides, at::kBFloat16);
    at::Tensor result = view_of(narrow_out.data(), sizes, strides, at::kBFloat16);
    attend(queries, k_cache, v_cache, group.key_blocks, group.num_keys, 1, l.window, scale,
           std::nullopt, result);
    for (int64_t i = 0; i < n; ++i)
      out[i] = static_cast<float>(c10::BFloat16(narrow_out[i], c10::BFloat16::from_bits()));
  }
};

}  // namespace

// Registered by gguf_ops.cpp's module, which is this extension's one.
void register_decode_layers(pybind11::module_& m) {
  namespace py = pybind11;
  py::class_<Product>(m, "Product", "a linear on GGUF blocks: (blocks, qtype, interleaved) parts side by side, a bias")
      .def(py::init<const std::vector<std::tuple<at::Tensor, int64_t, bool>>&,
                    const std::optional<at::Tensor>&, int64_t>());
  py::class_<DecodeLayer>(m, "DecodeLayer", "a pre-norm gated layer's weights, shape and quirks")
      .def(py::init([](at::Tensor input_norm, at::Tensor mlp_norm, std::optional<at::Tensor> q_norm,
                       std::optional<at::Tensor> k_norm,
                       std::optional<at::Tensor> attention_out_norm,
                       std::optional<at::Tensor> mlp_out_norm, const Product& qkv,
                       const Product& o, const Product& gate, const Product& up,
                       const Product& down, int64_t heads, int64_t kv_heads, int64_t head_dim,
                       int64_t window, double eps, bool gelu, int64_t rotation, int64_t group) {
             for (const auto* w : {&q_norm, &k_norm, &attention_out_norm, &mlp_out_norm})
               TORCH_CHECK(!*w || ((*w)->scalar_type() == at::kFloat && (*w)->is_contiguous()),
                           "decode layers' norms are contiguous float32");
             for (const at::Tensor* w : {&input_norm, &mlp_norm})
               TORCH_CHECK(w->scalar_type() == at::kFloat && w->is_contiguous(),
                           "decode layers' norms are contiguous float32");
             TORCH_CHECK(!q_norm == !k_norm, "q and k norms come together");
             TORCH_CHECK(qkv.rows == (heads + 2 * kv_heads) * head_dim &&
                             o.cols == heads * head_dim && gate.rows == up.rows &&
                             down.cols == gate.rows,
                         "a decode layer's products do not fit its heads");
             return DecodeLayer{input_norm, mlp_norm, q_norm, k_norm, attention_out_norm,
                                mlp_out_norm, qkv, o, gate, up, down, heads, kv_heads, head_dim,
                                window, eps, gelu, rotation, group};
           }),
           py::arg("input_norm"), py::arg("mlp_norm"), py::arg("q_norm"), py::arg("k_norm"),
           py::arg("attention_out_norm"), py::arg("mlp_out_norm"), py::arg("qkv"), py::arg("o"),
           py::arg("gate"), py::arg("up"), py::arg("down"), py::arg("heads"),
           py::arg("kv_heads"), py::arg("head_dim"), py::arg("window"), py::arg("eps"),
           py::arg("gelu"), py::arg("rotation"), py::arg("group"));
  py::class_<DecodeStack>(m, "DecodeStack", "a decode step's layers, run in one call")
      .def(py::init([](std::vector<DecodeLayer> layers, intptr_t attend, at::ScalarType dtype) {
        TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16,
                    "decode layers attend in float32 or bfloat16");
        return DecodeStack{std::move(layers), reinterpret_cast<PagedAttentionInto>(attend), dtype};
      }))
      .def("run", &DecodeStack::run,
           "rows x [T, hidden] through every layer, in place: their K/V written, attended;"
           " each layer takes its group's (slots, key blocks, key counts) and its rotation's"
           " (cos, signed sin)");
}
