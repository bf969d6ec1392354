// The CPU layer's elementwise work in one pass each (fp32 or bf16): residual add + RMSNorm,
// rotary in place on the q/k columns, SiLU(gate) * up. In torch each is 2-8 operators, every one a
// pass over [T, N] and a dispatch: 18 % of a 4,096-token prefill step on builtin:bench, and a
// few hundred dispatches in every decode step.
//
// Rounding: rotary is the torch path's operation for operation (products rounded, then the
// difference; no fused multiply-add: `rotate_row` is built with contraction off), so its
// results are bit-equal. The norm's sum of squares and SiLU's exp round differently from
// torch's (other summation order; a polynomial exp within ~2 ulp), as the C++ attention does.
// bf16 (not token-exact anyway, held to a tolerance against fp32): each pass computes in fp32
// and rounds once where it stores, where torch's bf16 operators round after every operator;
// the residual stream itself is stored (and normalised) rounded, as torch's.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "cpu_vec.h"

namespace {

// Rows per task: enough elements that a thread's share is worth its wake-up (a decode step's
// 8 rows run on the calling thread).
int64_t grain_rows(int64_t width) {
  return std::max<int64_t>(1, 32768 / std::max<int64_t>(width, 1));
}

inline vecf silu_times(vecf g, vecf u) {
  const vecf silu = g / (1.0f + expv_clamped(-g));
  return silu * u;
}

// [T, N] with contiguous rows, of the given dtype (fp32 or bf16, as the caller's first tensor).
void check_rows(const torch::Tensor& t, const char* name, at::ScalarType dtype = at::kFloat) {
  TORCH_CHECK(t.dim() == 2 && t.stride(1) == 1 && t.scalar_type() == dtype, name,
              " must be [T, N] with contiguous rows, all of one dtype (fp32 or bf16)");
}

bool is_bf16(const torch::Tensor& t) {
  TORCH_CHECK(t.scalar_type() == at::kFloat || t.scalar_type() == at::kBFloat16,
              "the CPU layers take fp32 or bf16");
  return t.scalar_type() == at::kBFloat16;
}

// A bf16 is an fp32's upper 16 bits. Stores round to nearest, ties to even, by integer
// arithmetic the compiler vectorizes (NaN payloads are not preserved: a NaN here means the
// model already broke).
inline float bf16_to_f32(uint16_t b) {
  const uint32_t u = static_cast<uint32_t>(b) << 16;
  float f;
  std::memcpy(&f, &u, sizeof(f));
  return f;
}

inline uint16_t f32_to_bf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof(u));
  u += 0x7FFFu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}

uint16_t* bf16_ptr(const torch::Tensor& t) {
  return reinterpret_cast<uint16_t*>(t.data_ptr<at::BFloat16>());
}

// A row element as fp32 and back: fp32 as it is, bf16 (raw bits) widened and rounded once.
inline float to_f32(float x) { return x; }
inline float to_f32(uint16_t b) { return bf16_to_f32(b); }
inline void store_f32(float* p, float v) { *p = v; }
inline void store_f32(uint16_t* p, float v) { *p = f32_to_bf16(v); }

// One row's heads rotated in place (T: float, or uint16_t for bf16's raw bits; cos and sin
// fp32). Contraction off here only (a file-wide pragma slowed the other loops): a
// multiply-add would round the torch path's two products once.
template <typename T>
__attribute__((optimize("fp-contract=off"), noinline)) void rotate_row(
    T* x, const float* cr, const float* sr, int64_t num_heads, int64_t head_dim) {
  const int64_t half = head_dim / 2;
  for (int64_t h = 0; h < num_heads; ++h) {
    T* x1 = x + h * head_dim;
    T* x2 = x1 + half;
#pragma omp simd
    for (int64_t i = 0; i < half; ++i) {
      const float a = to_f32(x1[i]), b = to_f32(x2[i]);
      store_f32(x1 + i, a * cr[i] - b * sr[i]);
      store_f32(x2 + i, b * cr[i] + a * sr[i]);
    }
  }
}

torch::Tensor add_rms_norm_bf16(torch::Tensor residual, c10::optional<torch::Tensor> delta,
                                torch::Tensor weight, double eps) {
  const int64_t rows = residual.size(0), n = residual.size(1);
  TORCH_CHECK(weight.is_contiguous() && weight.numel() == n &&
              weight.scalar_type() == at::kBFloat16, "weight must be [N] bf16");
  const uint16_t* d = nullptr;
  int64_t d_stride = 0;
  if (delta.has_value()) {
    check_rows(*delta, "delta", at::kBFloat16);
    TORCH_CHECK(delta->size(0) == rows && delta->size(1) == n, "delta must be shaped as residual");
    d = bf16_ptr(*delta);
    d_stride = delta->stride(0);
  }
  auto out = torch::empty({rows, n}, residual.options());
  uint16_t* x = bf16_ptr(residual);
  uint16_t* o = bf16_ptr(out);
  std::vector<float> w(n);
  const uint16_t* wb = bf16_ptr(weight);
  for (int64_t i = 0; i < n; ++i) w[i] = bf16_to_f32(wb[i]);
  const int64_t x_stride = residual.stride(0);
  const float epsf = static_cast<float>(eps);
  at::parallel_for(0, rows, grain_rows(n), [&](int64_t begin, int64_t end) {
    std::vector<float> xf(n);
    for (int64_t r = begin; r < end; ++r) {
      uint16_t* xr = x + r * x_stride;
      if (d != nullptr) {
        const uint16_t* dr = d + r * d_stride;
#pragma omp simd
        for (int64_t i = 0; i < n; ++i) {
          xr[i] = f32_to_bf16(bf16_to_f32(xr[i]) + bf16_to_f32(dr[i]));
        }
      }
      float sum = 0.f;
#pragma omp simd reduction(+ : sum)
      for (int64_t i = 0; i < n; ++i) {
        xf[i] = bf16_to_f32(xr[i]);
        sum += xf[i] * xf[i];
      }
      const float inv_rms = 1.0f / std::sqrt(sum / static_cast<float>(n) + epsf);
      uint16_t* orow = o + r * n;
#pragma omp simd
      for (int64_t i = 0; i < n; ++i) orow[i] = f32_to_bf16(xf[i] * inv_rms * w[i]);
    }
  });
  return out;
}

void silu_mul_row_bf16(uint16_t* g, const uint16_t* u, int64_t n) {
  float gf[kWidth], uf[kWidth];
  for (int64_t i = 0; i < n; i += kWidth) {
    const int64_t m = std::min<int64_t>(kWidth, n - i);  // the tail: zero-padded lanes
    for (int64_t j = 0; j < kWidth; ++j) {
      gf[j] = j < m ? bf16_to_f32(g[i + j]) : 0.f;
      uf[j] = j < m ? bf16_to_f32(u[i + j]) : 0.f;
    }
    const vecf out = silu_times(loadv(gf), loadv(uf));
    storev(gf, out);
    for (int64_t j = 0; j < m; ++j) g[i + j] = f32_to_bf16(gf[j]);
  }
}

}  // namespace

// residual += delta (when given), then out = RMSNorm(residual) * weight, row by row; returns
// out. As the torch path: the normalised row is rounded, then scaled by the weight.
torch::Tensor add_rms_norm(torch::Tensor residual, c10::optional<torch::Tensor> delta,
                           torch::Tensor weight, double eps) {
  if (is_bf16(residual)) {
    check_rows(residual, "residual", at::kBFloat16);
    return add_rms_norm_bf16(residual, delta, weight, eps);
  }
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
  const bool bf16 = is_bf16(qkv);
  check_rows(qkv, "qkv", qkv.scalar_type());
  const int64_t rows = qkv.size(0), half = head_dim / 2;
  TORCH_CHECK(head_dim % 2 == 0 && num_heads * head_dim <= qkv.size(1), "head shapes");
  TORCH_CHECK(cos.is_contiguous() && sin.is_contiguous() && cos.scalar_type() == at::kFloat &&
              sin.scalar_type() == at::kFloat && cos.size(0) == rows && cos.size(1) == half &&
              sin.sizes() == cos.sizes(), "cos and sin must be [T, hd/2] fp32, contiguous");
  const float* c = cos.data_ptr<float>();
  const float* s = sin.data_ptr<float>();
  const int64_t stride = qkv.stride(0);
  auto run = [&](auto* x) {
    at::parallel_for(0, rows, grain_rows(num_heads * head_dim), [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r)
        rotate_row(x + r * stride, c + r * half, s + r * half, num_heads, head_dim);
    });
  };
  if (bf16) run(bf16_ptr(qkv));
  else run(qkv.data_ptr<float>());
}

// gate = SiLU(gate) * up, in place; returns gate. SiLU rounded before the product, as torch.
torch::Tensor silu_mul_(torch::Tensor gate, torch::Tensor up) {
  const bool bf16 = is_bf16(gate);
  check_rows(gate, "gate", gate.scalar_type());
  check_rows(up, "up", gate.scalar_type());
  TORCH_CHECK(gate.sizes() == up.sizes(), "gate and up must have one shape");
  const int64_t rows = gate.size(0), n = gate.size(1);
  if (bf16) {
    uint16_t* g = bf16_ptr(gate);
    const uint16_t* u = bf16_ptr(up);
    const int64_t g_stride = gate.stride(0), u_stride = up.stride(0);
    at::parallel_for(0, rows, grain_rows(n), [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r)
        silu_mul_row_bf16(g + r * g_stride, u + r * u_stride, n);
    });
    return gate;
  }
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
