// The greedy screen's row pass (workers/greedy_head.py): from a row's bf16 screened logits,
// its top k, the bound on bf16's error, the candidates (the top k, or every id within twice
// the bound when the top k cannot decide) and their fp32 logits, the argmax. One pass over
// the row in C++ where the torch operators (padding, block maxima, top k, norms, a gather,
// a batched matmul) cost ~1.6 ms of a 32-row decode step; the bound is greedy_head.py's.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <array>
#include <cmath>
#include <cstring>
#include <limits>
#include <utility>
#include <vector>

#include "cpu_vec.h"

namespace {

inline float bf16_to_float(uint16_t bits) {
  const uint32_t word = static_cast<uint32_t>(bits) << 16;
  float out;
  std::memcpy(&out, &word, sizeof(out));
  return out;
}

// A row's k largest values, largest first (ids ascending on ties), by insertion into a
// sorted array; whether the row is finite (false: stopped at a NaN or an infinity).
// A register of kWidth values is looked at lane by lane only where one of them would
// enter (above the k-th largest so far) or is not finite: past the first registers
// almost none do, and the scan runs at the speed of the loads.
bool top_k_of(const uint16_t* row, int64_t vocab, int64_t top_k, float* top_val,
              int64_t* top_id) {
  int64_t filled = 0;
  auto consider = [&](int64_t j) {
    const float v = bf16_to_float(row[j]);
    if (!std::isfinite(v)) return false;
    if (filled == top_k && v <= top_val[top_k - 1]) return true;
    int64_t at = filled < top_k ? filled++ : top_k - 1;
    while (at > 0 && top_val[at - 1] < v) {
      top_val[at] = top_val[at - 1];
      top_id[at] = top_id[at - 1];
      --at;
    }
    top_val[at] = v;
    top_id[at] = j;
    return true;
  };
  const veci exponent = veci{} + 0x7F800000;
  int64_t j = 0;
  for (; j + kWidth <= vocab; j += kWidth) {
    const vecf v = load_bf16(row + j);
    veci bits;
    std::memcpy(&bits, &v, sizeof(bits));
    const float floor = filled == top_k ? top_val[top_k - 1]
                                        : -std::numeric_limits<float>::infinity();
    if (!any_lane((v > floor) | ((bits & exponent) == exponent))) continue;
    for (int k = 0; k < kWidth; ++k)
      if (!consider(j + k)) return false;
  }
  for (; j < vocab; ++j)
    if (!consider(j)) return false;
  return true;
}

float dot(const float* a, const float* b, int64_t n) {
  vecf acc{};
  int64_t i = 0;
  for (; i + kWidth <= n; i += kWidth) acc += loadv(a + i) * loadv(b + i);
  float sum = 0.f;
  for (int k = 0; k < kWidth; ++k) sum += acc[k];
  for (; i < n; ++i) sum += a[i] * b[i];
  return sum;
}

}  // namespace

// screened [S, V] bf16, hidden [S, H] fp32, rounded [S, H] bf16 or fp32 (the screen's input:
// hidden rounded to bf16, or quantized and dequantized by cpu_screen_i16.cpp),
// weight [V, H] fp32 -> (ids [S] int64, how [S] int8: 0 decided by the top k, 1 widened,
// 2 not decided: a NaN or an infinity, the caller takes the row's whole fp32 logits).
std::tuple<torch::Tensor, torch::Tensor> greedy_screen(
    torch::Tensor screened, torch::Tensor hidden, torch::Tensor rounded, torch::Tensor weight,
    int64_t top_k, double max_row_norm, double max_residual_norm, double sum_bound,
    double safety) {
  TORCH_CHECK(screened.scalar_type() == torch::kBFloat16 && screened.is_contiguous() &&
                  screened.dim() == 2, "screened: contiguous [S, V] bf16");
  TORCH_CHECK(hidden.scalar_type() == torch::kFloat32 && hidden.is_contiguous(),
              "hidden: contiguous [S, H] fp32");
  const bool rounded_bf16 = rounded.scalar_type() == torch::kBFloat16;
  TORCH_CHECK((rounded_bf16 || rounded.scalar_type() == torch::kFloat32) &&
                  rounded.is_contiguous() && rounded.sizes() == hidden.sizes(),
              "rounded: the screen's input, bf16 or fp32, hidden's shape");
  TORCH_CHECK(weight.scalar_type() == torch::kFloat32 && weight.is_contiguous() &&
                  weight.size(0) == screened.size(1) && weight.size(1) == hidden.size(1),
              "weight: contiguous [V, H] fp32");
  const int64_t rows = screened.size(0), vocab = screened.size(1), width = hidden.size(1);
  TORCH_CHECK(top_k >= 1 && top_k <= vocab, "top_k in [1, V]");
  auto ids = torch::zeros({rows}, torch::kInt64);
  auto how = torch::zeros({rows}, torch::kInt8);
  const auto* sp = reinterpret_cast<const uint16_t*>(screened.data_ptr<at::BFloat16>());
  const auto* rp = rounded_bf16
      ? reinterpret_cast<const uint16_t*>(rounded.data_ptr<at::BFloat16>()) : nullptr;
  const float* rfp = rounded_bf16 ? nullptr : rounded.data_ptr<float>();
  const float* hp = hidden.data_ptr<float>();
  const float* wp = weight.data_ptr<float>();
  int64_t* ip = ids.data_ptr<int64_t>();
  int8_t* op = how.data_ptr<int8_t>();
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> top_val(top_k);
    std::vector<int64_t> top_id(top_k), cand;
    for (int64_t r = begin; r < end; ++r) {
      const uint16_t* row = sp + r * vocab;
      const float* h = hp + r * width;
      const bool finite = top_k_of(row, vocab, top_k, top_val.data(), top_id.data());
      double hb_sq = 0.0, dh_sq = 0.0;
      for (int64_t i = 0; i < width && finite; ++i) {
        const double hb = rp != nullptr ? bf16_to_float(rp[r * width + i]) : rfp[r * width + i];
        hb_sq += hb * hb;
        dh_sq += (h[i] - hb) * (h[i] - hb);
      }
      if (!finite || !std::isfinite(hb_sq) || !std::isfinite(dh_sq)) {
        op[r] = 2;
        continue;
      }
      const double largest = std::max(std::fabs(top_val[0]), std::fabs(top_val[top_k - 1]));
      const double err =
          safety * (std::sqrt(dh_sq) * max_row_norm +
                    std::sqrt(hb_sq) * (max_residual_norm + sum_bound * max_row_norm) +
                    std::ldexp(largest, -8));
      cand.clear();
      if (top_val[top_k - 1] + err < top_val[0] - err) {
        cand.assign(top_id.begin(), top_id.end());
      } else {  // widened: every id within 2e of the largest, ascending
        op[r] = 1;
        const double floor = top_val[0] - 2.0 * err;
        for (int64_t j = 0; j < vocab; ++j)
          if (bf16_to_float(row[j]) >= floor) cand.push_back(j);
      }
      std::sort(cand.begin(), cand.end());  // ties: the lowest id, as argmax
      int64_t best = cand[0];
      float best_val = dot(h, wp + best * width, width);
      for (size_t c = 1; c < cand.size(); ++c) {
        const float v = dot(h, wp + cand[c] * width, width);
        if (v > best_val) { best_val = v; best = cand[c]; }
      }
      ip[r] = best;
    }
  });
  return {ids, how};
}

// The screen's GEMM, bf16 x bf16 -> bf16 with fp32 sums (workers/greedy_head.py's
// `approx`), where the build has AVX512-BF16: oneDNN's kernel ran a 32-row step of
// builtin:bench's lm_head (32000 x 512) at ~360 GFLOP/s on a Zen 4 without AMX. The layout
// and the walk (cpu_vec.h's for_each_row_tile) are the fp32 decode GEMM's (cpu_gemm.cpp):
// blocks of 32 outputs, each k pair of them contiguous ([N / 32][K / 2][32][2]) for
// VDPBF16PS, which adds a lane's two products (exact in fp32) to its sum, rounding each
// addition; the output is rounded to bf16 (to nearest). The bound of greedy_head.py holds
// as for oneDNN's kernel, which uses the same instruction here.
#if defined(__AVX512BF16__)
namespace {

constexpr int64_t kScreenBlock = 32;  // outputs per block: two registers of 16 fp32 sums
constexpr int kScreenTileRows = 12;

template <int rows>
void screen_tile(const uint32_t* x, int64_t pairs, const uint32_t* w, uint16_t* y, int64_t n,
                 const uint32_t* next, int64_t pp0, int64_t pp1) {
  __m512 acc[rows][2];
  for (int r = 0; r < rows; ++r) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
  auto step = [&](int64_t p) __attribute__((always_inline)) {
    const __m512bh w0 = (__m512bh)_mm512_loadu_si512(w + p * kScreenBlock);
    const __m512bh w1 = (__m512bh)_mm512_loadu_si512(w + p * kScreenBlock + 16);
#pragma GCC unroll 16
    for (int r = 0; r < rows; ++r) {
      const __m512bh b = (__m512bh)_mm512_set1_epi32(static_cast<int>(x[r * pairs + p]));
      acc[r][0] = _mm512_dpbf16_ps(acc[r][0], w0, b);
      acc[r][1] = _mm512_dpbf16_ps(acc[r][1], w1, b);
    }
  };
  for_each_k(pairs, next != nullptr, pp0, pp1, step,  // the next block's lines of a pair
             [&](int64_t p) __attribute__((always_inline)) {
               __builtin_prefetch(next + p * kScreenBlock, 0, 2);
               __builtin_prefetch(next + p * kScreenBlock + 16, 0, 2);
             });
  for (int r = 0; r < rows; ++r)
    for (int c = 0; c < 2; ++c)
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(y + r * n + c * 16),
                          (__m256i)_mm512_cvtneps_pbh(acc[r][c]));
}

using ScreenTileFn = void (*)(const uint32_t*, int64_t, const uint32_t*, uint16_t*, int64_t,
                              const uint32_t*, int64_t, int64_t);

template <int... R>
constexpr std::array<ScreenTileFn, sizeof...(R)> screen_tiles_of(
    std::integer_sequence<int, R...>) {
  return {&screen_tile<R + 1>...};
}
constexpr std::array<ScreenTileFn, kScreenTileRows> kScreenTiles =
    screen_tiles_of(std::make_integer_sequence<int, kScreenTileRows>{});

}  // namespace
#endif

bool screen_gemm_available() {
#if defined(__AVX512BF16__)
  return true;
#else
  return false;
#endif
}

// w [N, K] bf16, N a multiple of 32 and K even -> [N / 32, K / 2, 32, 2].
torch::Tensor pack_screen_weight(torch::Tensor w) {
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == torch::kBFloat16, "w: [N, K] bf16");
  const int64_t n = w.size(0), k_len = w.size(1);
  TORCH_CHECK(n % 32 == 0 && k_len % 2 == 0, "N must be a multiple of 32, K even");
  return w.contiguous().view({n / 32, 32, k_len / 2, 2}).permute({0, 2, 1, 3}).contiguous();
}

// x [M, K] bf16 (contiguous), packed w from `pack_screen_weight` -> y [M, N] bf16.
torch::Tensor screen_gemm(torch::Tensor x, torch::Tensor packed) {
  TORCH_CHECK(screen_gemm_available(), "built without AVX512-BF16");
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kBFloat16 && x.is_contiguous(),
              "x: contiguous [M, K] bf16");
  TORCH_CHECK(packed.dim() == 4 && packed.scalar_type() == torch::kBFloat16 &&
                  packed.size(2) == 32 && packed.size(3) == 2 &&
                  packed.size(1) * 2 == x.size(1), "packed: [N / 32, K / 2, 32, 2] for this x");
  const int64_t m = x.size(0), pairs = packed.size(1), num_blocks = packed.size(0);
  const int64_t n = num_blocks * 32;
  auto y = torch::empty({m, n}, x.options());
#if defined(__AVX512BF16__)
  const auto* xp = reinterpret_cast<const uint32_t*>(x.data_ptr<at::BFloat16>());
  const auto* wp = reinterpret_cast<const uint32_t*>(packed.data_ptr<at::BFloat16>());
  auto* yp = reinterpret_cast<uint16_t*>(y.data_ptr<at::BFloat16>());
  for_each_row_tile(m, num_blocks, kScreenTileRows, [&](int64_t b, int64_t r0, int64_t rows,
                                                        const Prefetch& p) {
    const uint32_t* w = wp + b * pairs * kScreenBlock;
    kScreenTiles[rows - 1](xp + r0 * pairs, pairs, w, yp + r0 * n + b * kScreenBlock, n,
                           p.block < 0 ? nullptr : wp + p.block * pairs * kScreenBlock,
                           p.begin(pairs), p.end(pairs));
  });
#endif
  return y;
}

void register_screen_ops(pybind11::module& m) {
  m.def("greedy_screen", &greedy_screen, "greedy ids from a bf16 screen, checked in fp32 (CPU)");
  m.def("screen_gemm_available", &screen_gemm_available, "whether screen_gemm is built here");
  m.def("pack_screen_weight", &pack_screen_weight, "w [N, K] bf16 -> screen_gemm's blocks");
  m.def("screen_gemm", &screen_gemm, "x [M, K] bf16 @ packed^T -> [M, N] bf16 (AVX512-BF16)");
}
