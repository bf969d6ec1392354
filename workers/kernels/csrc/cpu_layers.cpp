// The CPU layer's elementwise work in one pass each (fp32): residual add + RMSNorm, rotary in
// place on the q/k columns, SiLU(gate) * up. In torch each is 2-8 operators, every one a
// pass over [T, N] and a dispatch: 18 % of a 4,096-token prefill step on builtin:bench, and a
// few hundred dispatches in every decode step.
//
// Rounding: rotary is the torch path's operation for operation (products rounded, then the
// difference; no fused multiply-add: `rotate_row` is built with contraction off), so its
// results are bit-equal. The norm's sum of squares and SiLU's exp round differently from
// torch's (other summation order; a polynomial exp within ~2 ulp), as the C++ attention does.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

#include "cpu_vec.h"

namespace {

// Rows per task: enough elements that a thread's share is worth its wake-up (a decode step's
// 8 rows run on the calling thread).
int64_t grain_rows(int64_t width) { return std::max<int64_t>(1, 32768 / std::max<int64_t>(width, 1)); }

inline vecf silu_times(vecf g, vecf u) {
  const vecf silu = g / (1.0f + expv_clamped(-g));
  return silu * u;
}

void check_rows(const torch::Tensor& t, const char* name) {
  TORCH_CHECK(t.dim() == 2 && t.stride(1) == 1 && t.scalar_type() == at::kFloat, name,
              " must be [T, N] fp32 with contiguous rows");
}

// One row's heads rotated in place. Contraction off here only (a file-wide pragma slowed
// the other loops): a multiply-add would round the torch path's two products once.
__attribute__((optimize("fp-contract=off"), noinline)) void rotate_row(
    float* x, const float* cr, const float* sr, int64_t num_heads, int64_t head_dim) {
  const int64_t half = head_dim / 2;
  for (int64_t h = 0; h < num_heads; ++h) {
    float* x1 = x + h * head_dim;
    float* x2 = x1 + half;
#pragma omp simd
    for (int64_t i = 0; i < half; ++i) {
      const float a = x1[i], b = x2[i];
      x1[i] = a * cr[i] - b * sr[i];
      x2[i] = b * cr[i] + a * sr[i];
    }
  }
}

}  // namespace

// residual += delta (when given), then out = RMSNorm(residual) * weight, row by row; returns
// out. As the torch path: the normalised row is rounded, then scaled by the weight.
torch::Tensor add_rms_norm(torch::Tensor residual, c10::optional<torch::Tensor> delta,
                           torch::Tensor weight, double eps) {
  check_rows(residual, "residual");
  const int64_t rows = residual.size(0), n = residual.size(1);
  TORCH_CHECK(weight.is_contiguous() && weight.numel() == n && weight.scalar_type() == at::kFloat,
              "weight must be [N] fp32");
  const float* d = nullptr;
  int64_t d_stride = 0;
  if (delta.has_value()) {
    check_rows(*delta, "delta");
    TORCH_CHECK(delta->size(0) == rows && delta->size(1) == n, "delta must be shaped as residual");
    d = delta->data_ptr<float>();
    d_stride = delta->stride(0);
  }
  auto out = torch::empty({rows, n}, residual.options());
  float* x = residual.data_ptr<float>();
  float* o = out.data_ptr<float>();
  const float* w = weight.data_ptr<float>();
  const int64_t x_stride = residual.stride(0);
  const float epsf = static_cast<float>(eps);
  at::parallel_for(0, rows, grain_rows(n), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      float* xr = x + r * x_stride;
      if (d != nullptr) {
        const float* dr = d + r * d_stride;
#pragma omp simd
        for (int64_t i = 0; i < n; ++i) xr[i] += dr[i];
      }
      float sum = 0.f;
#pragma omp simd reduction(+ : sum)
      for (int64_t i = 0; i < n; ++i) sum += xr[i] * xr[i];
      const float inv_rms = 1.0f / std::sqrt(sum / static_cast<float>(n) + epsf);
      float* orow = o + r * n;
#pragma omp simd
      for (int64_t i = 0; i < n; ++i) orow[i] = (xr[i] * inv_rms) * w[i];
    }
  });
  return out;
}

// Rotate-half rotary in place on the first `num_heads` heads of each row of qkv [T, *]
// (q's heads, then k's, adjacent): (x1 c - x2 s, x2 c + x1 s) per half; cos, sin [T, hd/2].
void rotary_(torch::Tensor qkv, torch::Tensor cos, torch::Tensor sin, int64_t num_heads,
             int64_t head_dim) {
  check_rows(qkv, "qkv");
  const int64_t rows = qkv.size(0), half = head_dim / 2;
  TORCH_CHECK(head_dim % 2 == 0 && num_heads * head_dim <= qkv.size(1), "head shapes");
  TORCH_CHECK(cos.is_contiguous() && sin.is_contiguous() && cos.scalar_type() == at::kFloat &&
              sin.scalar_type() == at::kFloat && cos.size(0) == rows && cos.size(1) == half &&
              sin.sizes() == cos.sizes(), "cos and sin must be [T, hd/2] fp32, contiguous");
  float* x = qkv.data_ptr<float>();
  const float* c = cos.data_ptr<float>();
  const float* s = sin.data_ptr<float>();
  const int64_t stride = qkv.stride(0);
  at::parallel_for(0, rows, grain_rows(num_heads * head_dim), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r)
      rotate_row(x + r * stride, c + r * half, s + r * half, num_heads, head_dim);
  });
}

// gate = SiLU(gate) * up, in place; returns gate. SiLU rounded before the product, as torch.
torch::Tensor silu_mul_(torch::Tensor gate, torch::Tensor up) {
  check_rows(gate, "gate");
  check_rows(up, "up");
  TORCH_CHECK(gate.sizes() == up.sizes(), "gate and up must have one shape");
  const int64_t rows = gate.size(0), n = gate.size(1);
  float* g = gate.data_ptr<float>();
  const float* u = up.data_ptr<float>();
  const int64_t g_stride = gate.stride(0), u_stride = up.stride(0);
  at::parallel_for(0, rows, grain_rows(n), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      float* gr = g + r * g_stride;
      const float* ur = u + r * u_stride;
      int64_t i = 0;
      for (; i + kWidth <= n; i += kWidth) {
        vecf gv, uv;
        std::memcpy(&gv, gr + i, sizeof(gv));
        std::memcpy(&uv, ur + i, sizeof(uv));
        gv = silu_times(gv, uv);
        std::memcpy(gr + i, &gv, sizeof(gv));
      }
      if (i < n) {  // the tail, through one zero-padded register
        vecf gv{}, uv{};
        std::memcpy(&gv, gr + i, (n - i) * sizeof(float));
        std::memcpy(&uv, ur + i, (n - i) * sizeof(float));
        gv = silu_times(gv, uv);
        std::memcpy(gr + i, &gv, (n - i) * sizeof(float));
      }
    }
  });
  return gate;
}

void register_layer_ops(pybind11::module& m) {
  m.def("add_rms_norm", &add_rms_norm, "residual += delta; RMSNorm(residual) * weight (CPU)");
  m.def("rotary_", &rotary_, "rotate-half rotary in place on q/k heads (CPU)");
  m.def("silu_mul_", &silu_mul_, "gate = SiLU(gate) * up in place (CPU)");
}
