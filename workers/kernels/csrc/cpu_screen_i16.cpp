// The greedy screen's GEMM where the CPU has no bf16 units but AVX2 (workers/greedy_head.py's
// "i16" screen): int16 x int16 products summed exactly in int32 by VPMADDWD, from a weight of
// half fp32's bytes. On a 2-core Zen 3, builtin:bench's lm_head (32000 x 512), interleaved in
// one process: 5.2-5.6 ms at 32 rows against 7.8-8.2 for the fp32 decode GEMM
// (cpu_gemm.cpp) and 7.5-8.5 for a bf16 copy widened to fp32 for FMAs; 1.6-2.0 ms at 8 rows
// against 3.1-4.0 and 1.8-2.9.
//
// The weight is quantized per output row (W_j ~ s_j q_j, |q_j| <= qmax_w: greedy_head.py),
// the input per row here (h_r ~ t_r p_r, t_r = max|h_r| / qmax_x, p_r = round(h_r / t_r)),
// with qmax_x qmax_w K < 2^31, so no int32 sum can overflow. Output j of row r is
// (p_r . q_j) t_r s_j in fp32 (three roundings of 2^-24), rounded to bf16 (to nearest) for
// the row pass, which bounds the quantization as it bounds bf16's rounding: the dequantized
// input t_r p_r is returned for it. Layout and walk as the fp32 decode GEMM's: blocks of 16
// outputs, each k pair of them contiguous ([N / 16][K / 2][16][2]).
//
// With AVX512-BW a k pair of a block is one 512-bit register: one VPDPWSSD (AVX512-VNNI; else
// VPMADDWD and VPADDD) a row and pair, where AVX2 takes four instructions. The int32 sums are
// the same exact sums and the scaling the same fp32 operations, so both give the same bits.
// On a 2-core Xeon (KVM model 207: AVX512-BF16 but no AMX, where a VDPBF16PS ran at half the
// rate of fp32 FMAs) builtin:bench's lm_head at 32 rows took 3.4 ms here against 4.1 with
// the AVX2 tiles and 6.3 for the bf16 screen (greedy_head.py times which screen a CPU runs).
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <limits>
#include <utility>

#include "cpu_vec.h"

#if defined(__AVX2__)
namespace {

#if defined(__AVX512BW__)
// Tiles of 8 rows: 8 accumulators, the block's pair and a broadcast in 32 registers.
constexpr int kI16TileRows = 8;
#else
// Tiles of 4 rows: at 6 (12 accumulators) GCC hoisted the broadcasts and spilled the sums.
constexpr int kI16TileRows = 4;
#endif

// 8 fp32 values rounded to bf16 (to nearest even; finite or NaN in, as the row pass reads).
inline void store_bf16x8(uint16_t* y, __m256 v) {
  const __m256i bits = _mm256_castps_si256(v);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
  const __m256i up = _mm256_add_epi32(bits, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7FFF)));
  const __m256i top = _mm256_srli_epi32(up, 16);  // each < 2^16: packus keeps it
  const __m128i packed =
      _mm_packus_epi32(_mm256_castsi256_si128(top), _mm256_extracti128_si256(top, 1));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(y), packed);
}

// One tile of `rows` rows over one block. x: each row's int16 pairs as int32 words.
template <int rows>
void i16_tile(const int32_t* x, int64_t pairs, const int16_t* w, const float* x_scale,
              const float* w_scale, uint16_t* y, int64_t n, const int16_t* next, int64_t pp0,
              int64_t pp1) {
  __m256i acc[rows][2];
  for (int r = 0; r < rows; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_si256();
  auto step = [&](int64_t p) __attribute__((always_inline)) {
    const __m256i w0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + p * 32));
    const __m256i w1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + p * 32 + 16));
#pragma GCC unroll 8
    for (int r = 0; r < rows; ++r) {
      const __m256i b = _mm256_set1_epi32(x[r * pairs + p]);
      acc[r][0] = _mm256_add_epi32(acc[r][0], _mm256_madd_epi16(w0, b));
      acc[r][1] = _mm256_add_epi32(acc[r][1], _mm256_madd_epi16(w1, b));
    }
  };
  for_each_k(pairs, next != nullptr, pp0, pp1, step,  // one line a pair
             [&](int64_t p) __attribute__((always_inline)) {
               __builtin_prefetch(next + p * 32, 0, 2);
             });
  const __m256 s0 = _mm256_loadu_ps(w_scale), s1 = _mm256_loadu_ps(w_scale + 8);
  for (int r = 0; r < rows; ++r) {
    const __m256 t = _mm256_set1_ps(x_scale[r]);
    store_bf16x8(y + r * n, _mm256_mul_ps(_mm256_cvtepi32_ps(acc[r][0]), _mm256_mul_ps(s0, t)));
    store_bf16x8(y + r * n + 8,
                 _mm256_mul_ps(_mm256_cvtepi32_ps(acc[r][1]), _mm256_mul_ps(s1, t)));
  }
}

#if defined(__AVX512BW__)
// 16 fp32 values rounded to bf16 as store_bf16x8 rounds them (the same bits).
inline void store_bf16x16(uint16_t* y, __m512 v) {
  const __m512i bits = _mm512_castps_si512(v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  const __m512i up = _mm512_add_epi32(bits, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7FFF)));
  // Each word < 2^16 after the shift: VPMOVDW's truncation keeps it whole.
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(y),
                      _mm512_cvtepi32_epi16(_mm512_srli_epi32(up, 16)));
}

// i16_tile with a block's k pair in one register.
template <int rows>
void i16_tile512(const int32_t* x, int64_t pairs, const int16_t* w, const float* x_scale,
                 const float* w_scale, uint16_t* y, int64_t n, const int16_t* next, int64_t pp0,
                 int64_t pp1) {
  __m512i acc[rows];
  for (int r = 0; r < rows; ++r) acc[r] = _mm512_setzero_si512();
  auto step = [&](int64_t p) __attribute__((always_inline)) {
    const __m512i wp = _mm512_loadu_si512(w + p * 32);
#pragma GCC unroll 8
    for (int r = 0; r < rows; ++r) {
      const __m512i b = _mm512_set1_epi32(x[r * pairs + p]);
#if defined(__AVX512VNNI__)
      acc[r] = _mm512_dpwssd_epi32(acc[r], wp, b);
#else
      acc[r] = _mm512_add_epi32(acc[r], _mm512_madd_epi16(wp, b));
#endif
    }
  };
  for_each_k(pairs, next != nullptr, pp0, pp1, step,  // one line a pair
             [&](int64_t p) __attribute__((always_inline)) {
               __builtin_prefetch(next + p * 32, 0, 2);
             });
  const __m512 s = _mm512_loadu_ps(w_scale);
  for (int r = 0; r < rows; ++r)
    store_bf16x16(y + r * n, _mm512_mul_ps(_mm512_cvtepi32_ps(acc[r]),
                                           _mm512_mul_ps(s, _mm512_set1_ps(x_scale[r]))));
}
#endif

using I16TileFn = void (*)(const int32_t*, int64_t, const int16_t*, const float*, const float*,
                           uint16_t*, int64_t, const int16_t*, int64_t, int64_t);

template <int... R>
constexpr std::array<I16TileFn, sizeof...(R)> i16_tiles_of(std::integer_sequence<int, R...>) {
#if defined(__AVX512BW__)
  return {&i16_tile512<R + 1>...};
#else
  return {&i16_tile<R + 1>...};
#endif
}
constexpr std::array<I16TileFn, kI16TileRows> kI16Tiles =
    i16_tiles_of(std::make_integer_sequence<int, kI16TileRows>{});

}  // namespace
#endif

bool screen_i16_available() {
#if defined(__AVX2__)
  return true;
#else
  return false;
#endif
}

// hidden [M, K] fp32, packed [N / 16, K / 2, 16, 2] int16, w_scale [N] fp32, qmax_x ->
// (screened [M, N] bf16, dequantized [M, K] fp32: t_r p_r, the input the screen used; a row
// with a NaN or an infinity comes out NaN in both, for the row pass to hand back).
std::tuple<torch::Tensor, torch::Tensor> screen_i16(torch::Tensor hidden, torch::Tensor packed,
                                                    torch::Tensor w_scale, int64_t qmax_x) {
  TORCH_CHECK(screen_i16_available(), "built without AVX2");
  TORCH_CHECK(hidden.dim() == 2 && hidden.scalar_type() == torch::kFloat32 &&
                  hidden.is_contiguous(), "hidden: contiguous [M, K] fp32");
  TORCH_CHECK(packed.dim() == 4 && packed.scalar_type() == torch::kInt16 &&
                  packed.is_contiguous() && packed.size(2) == 16 && packed.size(3) == 2 &&
                  packed.size(1) * 2 == hidden.size(1),
              "packed: contiguous [N / 16, K / 2, 16, 2] int16 for this hidden");
  TORCH_CHECK(w_scale.scalar_type() == torch::kFloat32 && w_scale.is_contiguous() &&
                  w_scale.numel() == packed.size(0) * 16, "w_scale: [N] fp32");
  TORCH_CHECK(qmax_x >= 1 && qmax_x <= 32767, "qmax_x in [1, 32767]");
  const int64_t m = hidden.size(0), k_len = hidden.size(1), num_blocks = packed.size(0);
  const int64_t n = num_blocks * 16;
  auto screened = torch::empty({m, n}, hidden.options().dtype(torch::kBFloat16));
  auto dequantized = torch::empty({m, k_len}, hidden.options());
  auto quantized = torch::empty({m, k_len}, hidden.options().dtype(torch::kInt16));
  auto x_scale = torch::empty({m}, hidden.options());
  const float* hp = hidden.data_ptr<float>();
  float* dp = dequantized.data_ptr<float>();
  int16_t* qp = quantized.data_ptr<int16_t>();
  float* tp = x_scale.data_ptr<float>();
  for (int64_t r = 0; r < m; ++r) {  // M x K: a few thousand values, on this thread
    const float* h = hp + r * k_len;
    float largest = 0.f;
    bool finite = true;
    for (int64_t i = 0; i < k_len && finite; ++i) {
      finite = std::isfinite(h[i]);
      largest = std::max(largest, std::fabs(h[i]));
    }
    if (!finite) {  // NaN scores and input: the row pass's fp32 fallback
      tp[r] = std::numeric_limits<float>::quiet_NaN();
      std::fill(qp + r * k_len, qp + (r + 1) * k_len, int16_t{0});
      std::fill(dp + r * k_len, dp + (r + 1) * k_len, tp[r]);
      continue;
    }
    const float t = largest > 0.f ? largest / static_cast<float>(qmax_x) : 1.f;
    tp[r] = t;
    const float q = static_cast<float>(qmax_x);
    for (int64_t i = 0; i < k_len; ++i) {
      const float p = std::min(std::max(std::nearbyint(h[i] / t), -q), q);
      qp[r * k_len + i] = static_cast<int16_t>(p);
      dp[r * k_len + i] = p * t;
    }
  }
#if defined(__AVX2__)
  const auto* xp = reinterpret_cast<const int32_t*>(qp);
  const int16_t* wp = packed.data_ptr<int16_t>();
  const float* sp = w_scale.data_ptr<float>();
  auto* yp = reinterpret_cast<uint16_t*>(screened.data_ptr<at::BFloat16>());
  const int64_t pairs = k_len / 2;
  for_each_row_tile(m, num_blocks, kI16TileRows, [&](int64_t b, int64_t r0, int64_t rows,
                                                     const Prefetch& pf) {
    const int16_t* w = wp + b * pairs * 32;
    kI16Tiles[rows - 1](xp + r0 * pairs, pairs, w, tp + r0, sp + b * 16,
                        yp + r0 * n + b * 16, n,
                        pf.block < 0 ? nullptr : wp + pf.block * pairs * 32,
                        pf.begin(pairs), pf.end(pairs));
  });
#endif
  return {screened, dequantized};
}

void register_screen_i16_ops(pybind11::module& m) {
  m.def("screen_i16_available", &screen_i16_available, "whether screen_i16 is built here");
  m.def("screen_i16", &screen_i16,
        "hidden [M, K] fp32 quantized per row @ int16 blocks^T -> (bf16 [M, N], dequantized)");
}
