// fp32 linear layers at a decode step's few rows (the CPU worker's `worker.cpu_decode_gemm`):
// y [M, N] = x [M, K] @ w [N, K]^T for M up to a few dozen rows.
//
// At those rows a step streams every weight from memory once and does little work per
// byte; oneDNN's packed kernel reached ~10 GB/s of the ~24 a plain read gets on 2 cores.
// Here the weight is packed as [N / kBlock][K][kBlock] (kBlock = two registers of outputs,
// contiguous per block), each thread walks its blocks in order (cpu_vec.h's
// for_each_row_tile, which also splits the rows into tiles), and while it computes one
// block (a tile of rows at a time, the block's 64 KB re-read from L2) it prefetches the
// next block's lines into L2, a share of the k rows during each tile: memory keeps
// streaming while the tiles compute. In the decode stack a thread's last block prefetches
// its first block of the next GEMM (`decode_linear_then`); with both, a 32-row step of
// builtin:bench's layers on a 2-core Zen 4 went from 12.8 to 12.5 ms and its lm_head
// screen from 3.4 to 3.3 ms (with the weights cached the layers' GEMMs take 7.0 ms, 8.4
// streamed). Sums run over k in order, one FMA per term (the result differs from oneDNN's
// by summation order only, within fp32 rounding).
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <utility>

#include "cpu_vec.h"

namespace {

// Whether the decode GEMM prefetches (its next block, the next GEMM's first): process-wide,
// set at a worker's start (on by default; workers/gemm_prefetch.py). Hardware prefetchers
// differ: on a 2-core Xeon the prefetches took the 40 GEMMs from 7.8-8.3 to 7.0-7.5 ms; on a
// 2-core Zen 4 (the eighth session of 2026-12-07) they took them from 9.0 to 9.9.
std::atomic<bool> g_prefetch{true};

constexpr int64_t kBlock = 2 * kWidth;  // outputs per block: two registers
// Most rows per tile: 2 x kTileRows accumulators, a weight pair and a broadcast in registers
// (32 of them with AVX-512, 16 below). Rows split evenly (32 rows: 11, 11, 10; before, tiles
// of 14 and a tail: 14, 14, 4). On a 2-core Zen 4, over the model's 40 weights: 8 rows 118
// against 91 GFLOP/s, 24 rows 185 against 148, 32 rows +4 %; 12 rows, not 14: 10-12 row
// tiles ran 2-5 % faster than 14 at 32-64 rows.
constexpr int kTileRows = kWidth == 16 ? 12 : 6;

// One tile of `rows` rows (a compile-time count: its accumulators stay in registers) over
// one block: y[r][0:kBlock] = sum_k x[r][k] w[k][0:kBlock]. `next`: the block whose rows
// [pk0, pk1) to prefetch.
template <int rows>
inline void tile(const float* x, int64_t k_len, const float* w, float* y, int64_t n,
                 const float* next, int64_t pk0, int64_t pk1) {
  vecf acc[rows][2];
  for (int r = 0; r < rows; ++r) acc[r][0] = acc[r][1] = vecf{};
  auto step = [&](int64_t k) __attribute__((always_inline)) {
    const vecf w0 = loadv(w + k * kBlock), w1 = loadv(w + k * kBlock + kWidth);
#pragma GCC unroll 16
    for (int r = 0; r < rows; ++r) {
      const float b = x[r * k_len + k];
      acc[r][0] += b * w0;
      acc[r][1] += b * w1;
    }
  };
  // The next block's lines of each k in the prefetching range, into L2 (cpu_vec.h).
  for_each_k(k_len, next != nullptr, pk0, pk1, step,
             [&](int64_t k) __attribute__((always_inline)) {
               __builtin_prefetch(next + k * kBlock, 0, 2);
               if constexpr (kBlock * sizeof(float) > 64)
                 __builtin_prefetch(next + k * kBlock + 16, 0, 2);
             });
  for (int r = 0; r < rows; ++r) {
    storev(y + r * n, acc[r][0]);
    storev(y + r * n + kWidth, acc[r][1]);
  }
}

using TileFn = void (*)(const float*, int64_t, const float*, float*, int64_t, const float*,
                       int64_t, int64_t);

template <int... R>
constexpr std::array<TileFn, sizeof...(R)> tiles_of(std::integer_sequence<int, R...>) {
  return {&tile<R + 1>...};
}
// kTiles[r - 1]: the tile of r rows.
constexpr std::array<TileFn, kTileRows> kTiles =
    tiles_of(std::make_integer_sequence<int, kTileRows>{});

}  // namespace

// w [N, K] fp32 -> [N / kBlock, K, kBlock], N a multiple of `decode_gemm_block()`.
torch::Tensor pack_decode_weight(torch::Tensor w) {
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == torch::kFloat32, "w: [N, K] fp32");
  const int64_t n = w.size(0), k_len = w.size(1);
  TORCH_CHECK(n % kBlock == 0, "N must be a multiple of ", kBlock);
  return w.contiguous().view({n / kBlock, kBlock, k_len}).transpose(1, 2).contiguous();
}

// x [M, K] fp32 (contiguous), packed w from `pack_decode_weight`, optional bias [N] ->
// y [M, N] fp32. `next`: the packed weight the caller runs next on these threads (its
// first blocks are prefetched during this one's last), or none.
torch::Tensor decode_linear_then(torch::Tensor x, torch::Tensor packed,
                                 std::optional<torch::Tensor> bias,
                                 const torch::Tensor* next) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat32 && x.is_contiguous(),
              "x: contiguous [M, K] fp32");
  TORCH_CHECK(packed.dim() == 3 && packed.size(2) == kBlock && packed.size(1) == x.size(1),
              "packed: [N / block, K, block] for this x");
  const int64_t m = x.size(0), k_len = x.size(1), num_blocks = packed.size(0);
  const int64_t n = num_blocks * kBlock;
  auto y = torch::empty({m, n}, x.options());
  const float* xp = x.data_ptr<float>();
  const float* wp = packed.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  const bool prefetch = g_prefetch.load(std::memory_order_relaxed);
  const bool has_next = next != nullptr;
  TORCH_CHECK(!has_next || (next->dim() == 3 && next->size(2) == kBlock &&
                            next->scalar_type() == torch::kFloat32 && next->is_contiguous()),
              "next: a packed fp32 weight [N / block, K, block]");
  const bool fetch_next = prefetch && has_next;
  const float* np = fetch_next ? next->data_ptr<float>() : nullptr;
  const int64_t next_k = fetch_next ? next->size(1) : 0;
  for_each_row_tile(m, num_blocks, kTileRows, [&](int64_t b, int64_t r0, int64_t rows,
                                                  const Prefetch& p) {
    const float* w = wp + b * k_len * kBlock;
    const int64_t len = p.next_weight ? next_k : k_len;
    const float* pf = p.block < 0 || !prefetch ? nullptr
        : (p.next_weight ? np : wp) + p.block * len * kBlock;
    kTiles[rows - 1](xp + r0 * k_len, k_len, w, yp + r0 * n + b * kBlock, n, pf,
                     p.begin(len), p.end(len));
  }, fetch_next ? next->size(0) : 0);
  if (bias.has_value()) y.add_(*bias);
  return y;
}

torch::Tensor decode_linear(torch::Tensor x, torch::Tensor packed,
                            std::optional<torch::Tensor> bias) {
  return decode_linear_then(std::move(x), std::move(packed), std::move(bias), nullptr);
}

int64_t decode_gemm_block() { return kBlock; }

void set_decode_gemm_prefetch(bool on) { g_prefetch.store(on, std::memory_order_relaxed); }

bool decode_gemm_prefetch() { return g_prefetch.load(std::memory_order_relaxed); }

// Measured faster than oneDNN's packed kernel with AVX-512 (a 2-core Xeon, Zen 4) and with
// AVX2 + FMA (a 2-core Zen 3, the builtin:bench weights: 1.4x at 8 rows, 1.3x at 32, 1.1x at
// 64; lm_head 1.2x at 32). Builds without FMA (SSE, AVX alone) have it, untested for speed.
bool decode_gemm_preferred() {
#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
  return true;
#else
  return false;
#endif
}

void register_gemm_ops(pybind11::module& m) {
  m.def("pack_decode_weight", &pack_decode_weight, "w [N, K] -> [N / block, K, block] (CPU)");
  m.def("decode_linear", &decode_linear, "x @ w^T at a decode step's few rows (CPU fp32)",
        pybind11::arg("x"), pybind11::arg("packed"), pybind11::arg("bias") = pybind11::none());
  m.def("decode_gemm_block", &decode_gemm_block, "outputs per packed block (N's multiple)");
  m.def("set_decode_gemm_prefetch", &set_decode_gemm_prefetch,
        "whether the decode GEMM prefetches its weights' next blocks (process-wide)");
  m.def("decode_gemm_prefetch", &decode_gemm_prefetch, "the decode GEMM's prefetch setting");
  m.def("decode_gemm_preferred", &decode_gemm_preferred, "whether the worker uses it here");
}
