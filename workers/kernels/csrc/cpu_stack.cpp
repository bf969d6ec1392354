// A decode-only step's layers in one call (the CPU fp32 worker's `worker.cpu_decode_stack`):
// per layer the same kernels the Python layer loop calls (cpu_layers.cpp's norm, rotary and
// SiLU passes, cpu_gemm.cpp's decode GEMM, cpu_decode.cpp's attention), in the same order
// on the same inputs, so its output is bit-equal to that loop's.
//
// Why: at a decode step's 32 rows each of builtin:bench's 8 layers is ~15 kernel calls of
// 2-250 us plus the views, slices and KV writes between them; from Python every one is a
// dispatch of a few microseconds during which torch's other thread waits. Here the step is
// one call, the KV write a row copy, and the GIL is released for its length.
#include <torch/extension.h>

#include <cstring>
#include <optional>
#include <vector>

// The kernels it runs (defined in the other sources of this extension).
torch::Tensor add_rms_norm(torch::Tensor residual, c10::optional<torch::Tensor> delta,
                           torch::Tensor weight, double eps);
void rotary_(torch::Tensor qkv, torch::Tensor cos, torch::Tensor sin, int64_t num_heads,
             int64_t head_dim);
torch::Tensor silu_mul_(torch::Tensor gate, torch::Tensor up);
torch::Tensor decode_linear_then(torch::Tensor x, torch::Tensor packed,
                                 std::optional<torch::Tensor> bias, const torch::Tensor* next);
void decode_attention(torch::Tensor out, torch::Tensor q, torch::Tensor k_cache,
                      torch::Tensor v_cache, torch::Tensor block_table, torch::Tensor seq_lens,
                      double scale);

namespace {

// One layer's weights (decode-packed, cpu_gemm.cpp's layout) and its K/V cache.
struct Layer {
  torch::Tensor input_norm, post_norm;
  torch::Tensor qkv, o, gate, up, down;  // packed [N / block, K, block]
  std::optional<torch::Tensor> qkv_bias, o_bias, gate_bias, up_bias, down_bias;
  torch::Tensor k_cache, v_cache;  // [num_blocks, block_size, Hkv, hd] fp32, contiguous
};

std::optional<torch::Tensor> bias_of(const torch::Tensor& t) {
  if (t.numel() == 0) return std::nullopt;  // the caller's "no bias"
  return t;
}

}  // namespace

class DecodeStack {
 public:
  // `layers`: per layer [input_norm, post_norm, qkv, qkv_bias, o, o_bias, gate, gate_bias,
  // up, up_bias, down, down_bias, k_cache, v_cache], an empty tensor where a bias is absent.
  DecodeStack(const std::vector<std::vector<torch::Tensor>>& layers, torch::Tensor final_norm,
              double eps, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
              double scale)
      : final_norm_(std::move(final_norm)), eps_(eps), num_heads_(num_heads),
        num_kv_heads_(num_kv_heads), head_dim_(head_dim), scale_(scale) {
    TORCH_CHECK(!layers.empty(), "no layers");
    for (const auto& t : layers) {
      TORCH_CHECK(t.size() == 14, "a layer is 14 tensors");
      // Every cache one shape: a slot valid in the first is valid in all (`forward`).
      TORCH_CHECK(t[12].is_contiguous() && t[13].is_contiguous() &&
                  t[12].scalar_type() == at::kFloat && t[13].scalar_type() == at::kFloat &&
                  t[12].sizes() == layers[0][12].sizes() &&
                  t[13].sizes() == layers[0][12].sizes() &&
                  t[12].size(2) == num_kv_heads && t[12].size(3) == head_dim,
                  "the caches must be contiguous fp32 [blocks, block_size, Hkv, hd], all one "
                  "shape");
      layers_.push_back(Layer{t[0], t[1], t[2], t[4], t[6], t[8], t[10], bias_of(t[3]),
                              bias_of(t[5]), bias_of(t[7]), bias_of(t[9]), bias_of(t[11]),
                              t[12], t[13]});
    }
  }

  // x [T, hidden] (the embeddings; used as the residual stream, overwritten), cos/sin
  // [T, hd/2] fp32, block_table [T, width], seq_lens [T], slots [T] (int64): every row one
  // decode query at the end of its context -> the final-normed hidden states [T, hidden].
  torch::Tensor forward(torch::Tensor x, torch::Tensor cos, torch::Tensor sin,
                        torch::Tensor block_table, torch::Tensor seq_lens,
                        torch::Tensor slots) const {
    TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && x.scalar_type() == at::kFloat,
                "x: contiguous [T, hidden] fp32");
    const int64_t rows = x.size(0), hd = head_dim_;
    const int64_t q_cols = num_heads_ * hd, kv_cols = num_kv_heads_ * hd;
    TORCH_CHECK(slots.scalar_type() == at::kLong && slots.is_contiguous() &&
                slots.numel() == rows, "slots: [T] int64");
    const int64_t* slot = slots.data_ptr<int64_t>();
    // Before any write: a bad slot fails the step whole (the caches share one shape).
    const int64_t num_slots = layers_[0].k_cache.numel() / kv_cols;
    for (int64_t r = 0; r < rows; ++r)
      TORCH_CHECK(slot[r] >= 0 && slot[r] < num_slots, "slot ", slot[r], " out of the cache");
    std::optional<torch::Tensor> delta;  // the MLP output not yet added to x
    for (size_t i = 0; i < layers_.size(); ++i) {
      const Layer& layer = layers_[i];
      // Each GEMM prefetches the first blocks of the one after it where only a short pass
      // (a norm, SiLU) comes between; not across the attention, whose KV reads would evict
      // them.
      const torch::Tensor* next_qkv = i + 1 < layers_.size() ? &layers_[i + 1].qkv : nullptr;
      auto h = add_rms_norm(x, delta, layer.input_norm, eps_);
      auto qkv = decode_linear_then(h, layer.qkv, layer.qkv_bias, nullptr);  // [T, (H+2Hkv) hd]
      rotary_(qkv, cos, sin, num_heads_ + num_kv_heads_, hd);
      // K and V rows into the cache first: each row's attention reads its own key back.
      const int64_t width = qkv.size(1);
      const float* src = qkv.data_ptr<float>();
      float* k_dst = layer.k_cache.data_ptr<float>();
      float* v_dst = layer.v_cache.data_ptr<float>();
      for (int64_t r = 0; r < rows; ++r) {
        std::memcpy(k_dst + slot[r] * kv_cols, src + r * width + q_cols, kv_cols * 4);
        std::memcpy(v_dst + slot[r] * kv_cols, src + r * width + q_cols + kv_cols, kv_cols * 4);
      }
      auto q = qkv.narrow(1, 0, q_cols).view({rows, num_heads_, hd});
      auto attn = torch::empty({rows, num_heads_, hd}, x.options());
      decode_attention(attn, q, layer.k_cache, layer.v_cache, block_table, seq_lens, scale_);
      auto o = decode_linear_then(attn.view({rows, q_cols}), layer.o, layer.o_bias, &layer.gate);
      h = add_rms_norm(x, o, layer.post_norm, eps_);
      auto gate = decode_linear_then(h, layer.gate, layer.gate_bias, &layer.up);
      silu_mul_(gate, decode_linear_then(h, layer.up, layer.up_bias, &layer.down));
      delta = decode_linear_then(gate, layer.down, layer.down_bias, next_qkv);
    }
    return add_rms_norm(x, delta, final_norm_, eps_);
  }

 private:
  std::vector<Layer> layers_;
  torch::Tensor final_norm_;
  double eps_;
  int64_t num_heads_, num_kv_heads_, head_dim_;
  double scale_;
};

void register_stack_ops(pybind11::module& m) {
  pybind11::class_<DecodeStack>(m, "DecodeStack")
      .def(pybind11::init<const std::vector<std::vector<torch::Tensor>>&, torch::Tensor, double,
                          int64_t, int64_t, int64_t, double>())
      .def("forward", &DecodeStack::forward, "a decode-only step's layers (CPU fp32)",
           pybind11::call_guard<pybind11::gil_scoped_release>());
}
