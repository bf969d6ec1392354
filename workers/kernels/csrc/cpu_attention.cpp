// Paged attention for the CPU worker, reading K/V in place from the paged KV cache (no
// gathered copy of the blocks): decode rows (below) and prefill chunks (chunk_attention).
//
// Decode:
// Shapes: q [S, H, hd] (row stride given), k_cache/v_cache [NB, bs, Hkv, hd] contiguous,
// block_table [S, W] int64, seq_lens [S] int64 -> written into out [S, H, hd] contiguous.
// Query head h reads KV head h / (H / Hkv), as grouped-query attention does. Scores, softmax
// and the weighted sum are accumulated in fp32 whatever the cache dtype (fp32 or bf16), with
// the exact two-pass softmax (max, then exp and sum), so a row's result does not depend on
// how the rows are batched.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#include "cpu_vec.h"

template <typename T>  // float, or uint16_t for a bf16 cache's raw bits (cpu_decode.cpp)
bool decode_attention_blocked(const float* q, int64_t q_row_stride, const T* k_cache,
                              const T* v_cache, const int64_t* block_table,
                              const int64_t* seq_lens, float* out, int64_t num_seqs,
                              int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
                              int64_t block_size, int64_t table_width, float scale);

namespace {

template <typename T>
void decode_attention_impl(const T* q, int64_t q_row_stride, const T* k_cache, const T* v_cache,
                           const int64_t* block_table, const int64_t* seq_lens, T* out,
                           int64_t num_seqs, int64_t num_heads, int64_t num_kv_heads,
                           int64_t head_dim, int64_t block_size, int64_t table_width,
                           float scale) {
  const int64_t group = num_heads / num_kv_heads;  // query heads per KV head
  const int64_t slot_stride = num_kv_heads * head_dim;  // one token's K (or V) row
  // An item is a row's KV heads [g0, g0 + kv_per_item): all of them when there are rows
  // enough for every thread, so that each K/V row is read whole by one thread (split by KV
  // head, two threads each read half of every row's cache lines: 2x slower here); one KV
  // head per item when few rows must still be spread over the threads.
  const int64_t kv_per_item = num_seqs >= 2 * at::get_num_threads() ? num_kv_heads : 1;
  const int64_t items_per_seq = num_kv_heads / kv_per_item;
  const int64_t nh = kv_per_item * group;  // query heads of an item
  at::parallel_for(0, num_seqs * items_per_seq, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> qf(nh * head_dim), acc(nh * head_dim), scores;
    for (int64_t item = begin; item < end; ++item) {
      const int64_t s = item / items_per_seq, g0 = (item % items_per_seq) * kv_per_item;
      const int64_t n = seq_lens[s];
      T* dst = out + (s * num_heads + g0 * group) * head_dim;
      if (n <= 0) {  // padding row: nothing to attend to
        std::fill(dst, dst + nh * head_dim, T(0));
        continue;
      }
      const T* src = q + s * q_row_stride + g0 * group * head_dim;
      for (int64_t x = 0; x < nh * head_dim; ++x) qf[x] = static_cast<float>(src[x]);
      scores.resize(nh * n);
      const int64_t* table = block_table + s * table_width;
      // Key j lives at row j % bs of block table[j / bs]: walked block by block (no
      // division per key). Query head h of the item reads KV head g0 + h / group.
      for (int64_t first = 0, b = 0; first < n; first += block_size, ++b) {
        const T* block = k_cache + table[b] * block_size * slot_stride + g0 * head_dim;
        const int64_t len = std::min(block_size, n - first);
        for (int64_t o = 0; o < len; ++o) {
          const T* row = block + o * slot_stride;
          for (int64_t h = 0; h < nh; ++h) {
            const float* qh = qf.data() + h * head_dim;
            const T* k = row + (h / group) * head_dim;
            float dot = 0.f;
            // A reduction: without the pragma the compiler keeps it scalar (no reassociation).
#pragma omp simd reduction(+ : dot)
            for (int64_t d = 0; d < head_dim; ++d) dot += qh[d] * static_cast<float>(k[d]);
            scores[h * n + first + o] = dot * scale;
          }
        }
      }
      for (int64_t h = 0; h < nh; ++h) {
        float* row = scores.data() + h * n;
        float peak = -std::numeric_limits<float>::infinity();
        for (int64_t j = 0; j < n; ++j) peak = std::max(peak, row[j]);
        float sum = 0.f;
#pragma omp simd reduction(+ : sum)
        for (int64_t j = 0; j < n; ++j) {
          row[j] = exp_clamped(row[j] - peak);
          sum += row[j];
        }
        const float inv = 1.f / sum;
        for (int64_t j = 0; j < n; ++j) row[j] *= inv;
      }
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t first = 0, b = 0; first < n; first += block_size, ++b) {
        const T* block = v_cache + table[b] * block_size * slot_stride + g0 * head_dim;
        const int64_t len = std::min(block_size, n - first);
        for (int64_t o = 0; o < len; ++o) {
          const T* row = block + o * slot_stride;
          for (int64_t h = 0; h < nh; ++h) {
            const float p = scores[h * n + first + o];
            const T* v = row + (h / group) * head_dim;
            float* a = acc.data() + h * head_dim;
#pragma omp simd
            for (int64_t d = 0; d < head_dim; ++d) a[d] += p * static_cast<float>(v[d]);
          }
        }
      }
      for (int64_t x = 0; x < nh * head_dim; ++x) dst[x] = static_cast<T>(acc[x]);
    }
  });
}

}  // namespace

// (Outside the anonymous namespace: cpu_stack.cpp calls it too.)
void decode_attention(torch::Tensor out, torch::Tensor q, torch::Tensor k_cache,
                      torch::Tensor v_cache, torch::Tensor block_table, torch::Tensor seq_lens,
                      double scale) {
  TORCH_CHECK(q.dim() == 3 && q.stride(2) == 1 && q.stride(1) == q.size(2),
              "q must be [S, H, hd] with contiguous heads");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "caches must be contiguous");
  TORCH_CHECK(k_cache.scalar_type() == q.scalar_type() && v_cache.scalar_type() == q.scalar_type(),
              "q and the caches must share a dtype");
  TORCH_CHECK(block_table.scalar_type() == at::kLong && seq_lens.scalar_type() == at::kLong,
              "block_table and seq_lens must be int64");
  auto table = block_table.contiguous();
  auto lens = seq_lens.contiguous();
  const int64_t num_seqs = q.size(0), num_heads = q.size(1), head_dim = q.size(2);
  const int64_t num_kv_heads = k_cache.size(2), block_size = k_cache.size(1);
  TORCH_CHECK(num_heads % num_kv_heads == 0 && k_cache.size(3) == head_dim, "head shapes");
  TORCH_CHECK(table.size(0) == num_seqs && lens.size(0) == num_seqs, "one table row per seq");
  TORCH_CHECK(out.is_contiguous() && out.scalar_type() == q.scalar_type() &&
              out.sizes() == q.sizes(), "out must be a contiguous tensor shaped as q");
  if (q.scalar_type() == at::kFloat &&
      decode_attention_blocked(q.data_ptr<float>(), q.stride(0), k_cache.data_ptr<float>(),
                               v_cache.data_ptr<float>(), table.data_ptr<int64_t>(),
                               lens.data_ptr<int64_t>(), out.data_ptr<float>(), num_seqs,
                               num_heads, num_kv_heads, head_dim, block_size, table.size(1),
                               static_cast<float>(scale)))
    return;  // the register-blocked path (cpu_decode.cpp)
  if (q.scalar_type() == at::kBFloat16 && head_dim % kWidth == 0) {
    // The same path over the bf16 cache: q in fp32 (a few KB a step), out rounded once.
    auto qf = q.to(at::kFloat);  // [S, H, hd], contiguous
    auto outf = torch::empty(q.sizes(), qf.options());
    const auto* kb = reinterpret_cast<const uint16_t*>(k_cache.data_ptr<at::BFloat16>());
    const auto* vb = reinterpret_cast<const uint16_t*>(v_cache.data_ptr<at::BFloat16>());
    if (decode_attention_blocked(qf.data_ptr<float>(), qf.stride(0), kb, vb,
                                 table.data_ptr<int64_t>(), lens.data_ptr<int64_t>(),
                                 outf.data_ptr<float>(), num_seqs, num_heads, num_kv_heads,
                                 head_dim, block_size, table.size(1),
                                 static_cast<float>(scale))) {
      out.copy_(outf);
      return;
    }
  }
  AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, q.scalar_type(), "decode_attention", [&] {
    decode_attention_impl<scalar_t>(
        q.data_ptr<scalar_t>(), q.stride(0), k_cache.data_ptr<scalar_t>(),
        v_cache.data_ptr<scalar_t>(), table.data_ptr<int64_t>(), lens.data_ptr<int64_t>(),
        out.data_ptr<scalar_t>(), num_seqs, num_heads, num_kv_heads, head_dim, block_size,
        table.size(1), static_cast<float>(scale));
  });
}

namespace {

// Paged attention of one prefill chunk: its n queries, at positions ctx - n .. ctx - 1 of a
// sequence whose keys 0 .. ctx - 1 are in the cache (the chunk's own already written), each
// attending causally to keys 0 .. its position. Flash-style: per item (a KV head and a tile
// of kRows query rows, i.e. kRows x group query vectors) the keys stream by in tiles of
// kKeys with an online softmax (running max and sum, rescaled as the max grows), so the
// scores are never materialised. Each key tile is read once per item and used by all of its
// query vectors, in register blocks of GCC vector types as wide as the machine's registers
// (-march=native; a type wider than them compiles to code 15x slower). A block of kQueries
// query vectors goes through its scores (kQueries x kKeyVecs accumulators), their softmax
// while they are still in registers (a maximum by lane shuffles only when the tile raises
// it; sums kept per lane), and p @ V (kValueFloats accumulated floats at a time) before the
// next block starts, so its weights never leave L1.
// With AVX-512 each block of 4 vectors sees 64 keys at a time: the per-vector softmax work
// (reductions, the running max's rescale) is paid once per 64 keys, not per 32, which with
// 8 vectors x 32 keys and separate passes over the scores had cost as much as the FMAs.
#if defined(__AVX512F__)
constexpr int64_t kQueries = 4;  // query vectors per block
constexpr int64_t kValueFloats = 256;  // accumulated floats per block of p @ V
#elif defined(__AVX__)
constexpr int64_t kQueries = 2;
constexpr int64_t kValueFloats = 64;
#else
constexpr int64_t kQueries = 2;
constexpr int64_t kValueFloats = 32;
#endif
constexpr int64_t kRows = 32;  // query rows per item
constexpr int64_t kKeyVecs = 4;  // registers of scores per query vector
constexpr int64_t kKeys = kKeyVecs * kWidth;  // keys per tile: 64 with AVX-512

// Items [0, total) handed out one at a time to torch's threads: `body(next)` runs once per
// thread and takes items with next() until it returns -1. A static split (each thread its
// half) waits at the region's end for a thread whose core another process took meanwhile;
// here the other thread takes its items, and the wait is at most the item in hand (on 2
// cores the controller, the ingress and Ray's daemons run on the step's cores).
template <typename Body>
void parallel_items(int64_t total, const Body& body) {
  std::atomic<int64_t> counter{0};
  auto next = [&]() -> int64_t {
    const int64_t item = counter.fetch_add(1, std::memory_order_relaxed);
    return item < total ? item : -1;
  };
  const int64_t num_tasks = std::max<int64_t>(std::min<int64_t>(at::get_num_threads(), total), 1);
  at::parallel_for(0, num_tasks, 1, [&](int64_t, int64_t) { body(next); });
}

template <int32_t S>
inline vecf swap_lanes(vecf v) {  // lane i gets lane i ^ S
  veci m;
  for (int32_t i = 0; i < kWidth; ++i) m[i] = i ^ S;
  return __builtin_shuffle(v, m);
}

inline vecf vmax(vecf a, vecf b) { return a > b ? a : b; }

inline bool any_greater(vecf a, vecf b) {  // some lane of a above b's
#if defined(__AVX512F__)
  return _mm512_cmp_ps_mask(a, b, _CMP_GT_OQ) != 0;
#else
  const veci gt = a > b;
  int32_t any = 0;
  for (int32_t i = 0; i < kWidth; ++i) any |= gt[i];
  return any != 0;
#endif
}

inline float reduce_max(vecf v) {
  if constexpr (kWidth >= 16) v = vmax(v, swap_lanes<8>(v));
  if constexpr (kWidth >= 8) v = vmax(v, swap_lanes<4>(v));
  v = vmax(v, swap_lanes<2>(v));
  return std::max(v[0], v[1]);
}

inline float reduce_sum(vecf v) {
  if constexpr (kWidth >= 16) v += swap_lanes<8>(v);
  if constexpr (kWidth >= 8) v += swap_lanes<4>(v);
  v += swap_lanes<2>(v);
  return v[0] + v[1];
}

// 2^x for x <= 0 (the chunk kernel's scores are in log2 units, less their running max): x =
// n + r with n = round(x), 2^r for |r| <= 1/2 by its degree-7 Taylor polynomial (relative error
// under 1e-8, below fp32's rounding), 2^n applied to the exponent. With AVX-512 the rounding
// and the scaling are one instruction each (vrndscaleps, vscalefps), 9 operations in all:
// the exp was a third of the kernel's time at 19.
inline vecf exp2v_nonpositive(vecf x) {
#if defined(__AVX512F__)
  const vecf n = _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
#else
  x = x < -126.f ? vecf{} - 126.f : x;
  const vecf n = (x + 12582912.0f) - 12582912.0f;
#endif
  const vecf r = x - n;
  vecf p = vecf{} + 1.5252733804e-5f;
  p = p * r + 1.5403530393e-4f;
  p = p * r + 1.3333558146e-3f;
  p = p * r + 9.6181291076e-3f;
  p = p * r + 5.5504108665e-2f;
  p = p * r + 2.4022650696e-1f;
  p = p * r + 6.9314718056e-1f;
  p = p * r + 1.0f;
#if defined(__AVX512F__)
  return _mm512_scalef_ps(p, n);
#else
  const veci bits = (__builtin_convertvector(n, veci) + 127) << 23;
  vecf scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return p * scale;
#endif
}

constexpr float kLog2e = 1.44269504088896341f;
constexpr float kLn2 = 0.693147180559945309f;

template <typename T, int64_t HD>
void chunk_attention_impl(const T* q, int64_t q_row_stride, const T* k_cache, const T* v_cache,
                          const int64_t* table, int64_t ctx, int64_t n, T* out,
                          int64_t out_row_stride, int64_t num_heads, int64_t num_kv_heads,
                          int64_t block_size, float scale) {
  constexpr int64_t kHdVecs = HD / kWidth;
  // Query vectors per sub-block of p @ V: kValueFloats / HD, within one block.
  constexpr int64_t kValueQueries = std::min<int64_t>(
      kQueries, kValueFloats / HD > 0 ? kValueFloats / HD : 1);
  static_assert(kQueries % kValueQueries == 0);
  const int64_t group = num_heads / num_kv_heads;
  const int64_t slot_stride = num_kv_heads * HD;
  const int64_t num_tiles = (n + kRows - 1) / kRows;
  // Query vectors of an item, rounded up to whole blocks (padding vectors are zero).
  const int64_t max_vectors = (kRows * group + kQueries - 1) / kQueries * kQueries;
  const float log2_scale = scale * kLog2e;  // scores in log2 units: the softmax uses 2^x
  // Every key tile transposed once per call (kt_all[kv][tile][d][j], zero past ctx), shared
  // by the items of all row tiles; other dtypes' value rows converted once (vt_all[kv][key]).
  const int64_t num_key_tiles = (ctx + kKeys - 1) / kKeys;
  AlignedFloats kt_all(num_kv_heads * num_key_tiles * HD * kKeys);
  AlignedFloats vt_all(std::is_same_v<T, float> ? 0 : num_kv_heads * ctx * HD);
  parallel_items(num_kv_heads * num_key_tiles, [&](const auto& next) {
    for (int64_t t; (t = next()) >= 0;) {
      const int64_t kv = t / num_key_tiles, k0 = (t % num_key_tiles) * kKeys;
      float* kt = kt_all.data() + t * HD * kKeys;
      const int64_t tk = std::min(kKeys, ctx - k0);
      for (int64_t j = 0; j < kKeys; ++j) {
        if (j >= tk) {
          for (int64_t d = 0; d < HD; ++d) kt[d * kKeys + j] = 0.f;
          continue;
        }
        const int64_t key = k0 + j;
        const int64_t slot = (table[key / block_size] * block_size + key % block_size) *
                             slot_stride + kv * HD;
        const T* krow = k_cache + slot;
        for (int64_t d = 0; d < HD; ++d) kt[d * kKeys + j] = static_cast<float>(krow[d]);
        if constexpr (!std::is_same_v<T, float>) {
          const T* vrow = v_cache + slot;
          float* dst = vt_all.data() + (kv * ctx + key) * HD;
          for (int64_t d = 0; d < HD; ++d) dst[d] = static_cast<float>(vrow[d]);
        }
      }
    }
  });
  parallel_items(num_kv_heads * num_tiles, [&](const auto& next) {
    // total: each vector's softmax sum, kept per lane (summed across lanes at the end).
    AlignedFloats qf(max_vectors * HD), acc(max_vectors * HD), peak(max_vectors),
        total(max_vectors * kWidth);
    alignas(64) float p[kQueries * kKeys];  // the block's weights of the tile's keys
    const float* vrows[kKeys];
    const vecf zero = {};
    const vecf neg_inf = zero - std::numeric_limits<float>::infinity();
    for (int64_t item; (item = next()) >= 0;) {
      // KV heads alternate: threads in step each keep to one head's keys and values.
      const int64_t kv = item % num_kv_heads, r0 = (item / num_kv_heads) * kRows;
      const int64_t rows = std::min(kRows, n - r0);
      const int64_t num_vectors = rows * group;  // vector x: row x / group, head x % group
      const int64_t padded = (num_vectors + kQueries - 1) / kQueries * kQueries;
      const int64_t first_pos = ctx - n + r0;  // position of the item's first row
      std::fill(qf.begin(), qf.end(), 0.f);
      for (int64_t x = 0; x < num_vectors; ++x) {
        const T* src = q + (r0 + x / group) * q_row_stride + (kv * group + x % group) * HD;
        for (int64_t d = 0; d < HD; ++d) qf[x * HD + d] = log2_scale * static_cast<float>(src[d]);
      }
      std::fill(acc.begin(), acc.end(), 0.f);
      std::fill(peak.begin(), peak.end(), -std::numeric_limits<float>::infinity());
      std::fill(total.begin(), total.end(), 0.f);
      const int64_t num_keys = first_pos + rows;  // keys the item's last row sees
      for (int64_t k0 = 0; k0 < num_keys; k0 += kKeys) {
        const int64_t tk = std::min(kKeys, num_keys - k0);
        const float* kt = kt_all.data() + (kv * num_key_tiles + k0 / kKeys) * HD * kKeys;
        // The tile's value rows: fp32 read in place from the cache, other dtypes from vt_all.
        for (int64_t j = 0; j < tk; ++j) {
          const int64_t key = k0 + j;
          if constexpr (std::is_same_v<T, float>) {
            vrows[j] = v_cache + (table[key / block_size] * block_size + key % block_size) *
                                     slot_stride + kv * HD;
          } else {
            vrows[j] = vt_all.data() + (kv * ctx + key) * HD;
          }
        }
        for (int64_t x = 0; x < padded; x += kQueries) {
          // Vector x's position (padding vectors: the last row's); positions grow with x.
          auto pos_of = [&](int64_t v) {
            return v < num_vectors ? first_pos + v / group : num_keys - 1;
          };
          if (pos_of(x + kQueries - 1) < k0) continue;  // the whole block is before the tile
          vecf a[kQueries][kKeyVecs] = {};
          const float* qx = qf.data() + x * HD;
          for (int64_t d = 0; d < HD; ++d) {
            vecf kd[kKeyVecs];
#pragma GCC unroll 8
            for (int64_t c = 0; c < kKeyVecs; ++c) kd[c] = loadv(kt + d * kKeys + c * kWidth);
#pragma GCC unroll 8
            for (int64_t b = 0; b < kQueries; ++b) {
              const float qv = qx[b * HD + d];
#pragma GCC unroll 8
              for (int64_t c = 0; c < kKeyVecs; ++c) a[b][c] += qv * kd[c];
            }
          }
          // Causal limit and online softmax in registers: p gets the weights of the keys.
          float rescale[kQueries];
#pragma GCC unroll 8
          for (int64_t b = 0; b < kQueries; ++b) {
            float* pb = p + b * kKeys;
            const int64_t limit = std::min(tk, pos_of(x + b) - k0 + 1);  // keys k0 .. pos
            rescale[b] = 1.f;
            if (limit <= 0) {
              std::fill(pb, pb + kKeys, 0.f);
              continue;
            }
            const bool partial = limit < kKeys;
            veci in[kKeyVecs];
            vecf m = neg_inf;
#pragma GCC unroll 8
            for (int64_t c = 0; c < kKeyVecs; ++c) {
              in[c] = kLanes + static_cast<int32_t>(c * kWidth) < static_cast<int32_t>(limit);
              m = vmax(m, partial ? (in[c] ? a[b][c] : neg_inf) : a[b][c]);
            }
            // The running max moves only when a score of this tile passes it; the test is
            // one compare, the horizontal max and the rescale's exp are paid then only.
            float& peak_x = peak[x + b];
            if (any_greater(m, zero + peak_x)) {
              const float new_peak = std::max(peak_x, reduce_max(m));
              rescale[b] = exp_clamped((peak_x - new_peak) * kLn2);
              peak_x = new_peak;
            }
            const float new_peak = peak_x;
            vecf sums = zero;
#pragma GCC unroll 8
            for (int64_t c = 0; c < kKeyVecs; ++c) {
              vecf w = exp2v_nonpositive(a[b][c] - new_peak);
              if (partial) w = in[c] ? w : zero;
              storev(pb + c * kWidth, w);
              sums += w;
            }
            float* tb = total.data() + (x + b) * kWidth;
            storev(tb, loadv(tb) * rescale[b] + sums);
          }
#pragma GCC unroll 4
          for (int64_t b0 = 0; b0 < kQueries; b0 += kValueQueries) {
            vecf o[kValueQueries][kHdVecs];
            float* ax = acc.data() + (x + b0) * HD;
#pragma GCC unroll 8
            for (int64_t b = 0; b < kValueQueries; ++b)
#pragma GCC unroll 8
              for (int64_t c = 0; c < kHdVecs; ++c)
                o[b][c] = loadv(ax + b * HD + c * kWidth) * rescale[b0 + b];
            const float* pb = p + b0 * kKeys;
            for (int64_t j = 0; j < tk; ++j) {
              const float* v = vrows[j];
              vecf vv[kHdVecs];
#pragma GCC unroll 8
              for (int64_t c = 0; c < kHdVecs; ++c) vv[c] = loadv(v + c * kWidth);
#pragma GCC unroll 8
              for (int64_t b = 0; b < kValueQueries; ++b) {
                const float w = pb[b * kKeys + j];
#pragma GCC unroll 8
                for (int64_t c = 0; c < kHdVecs; ++c) o[b][c] += w * vv[c];
              }
            }
#pragma GCC unroll 8
            for (int64_t b = 0; b < kValueQueries; ++b)
#pragma GCC unroll 8
              for (int64_t c = 0; c < kHdVecs; ++c) storev(ax + b * HD + c * kWidth, o[b][c]);
          }
        }
      }
      for (int64_t x = 0; x < num_vectors; ++x) {
        T* dst = out + (r0 + x / group) * out_row_stride + (kv * group + x % group) * HD;
        const float inv = 1.f / reduce_sum(loadv(total.data() + x * kWidth));
        for (int64_t d = 0; d < HD; ++d) dst[d] = static_cast<T>(acc[x * HD + d] * inv);
      }
    }
  });
}

void chunk_attention(torch::Tensor out, torch::Tensor q, torch::Tensor k_cache,
                     torch::Tensor v_cache, torch::Tensor block_ids, int64_t context_len,
                     double scale) {
  TORCH_CHECK(q.dim() == 3 && q.stride(2) == 1 && q.stride(1) == q.size(2),
              "q must be [n, H, hd] with contiguous heads");
  TORCH_CHECK(out.dim() == 3 && out.stride(2) == 1 && out.stride(1) == out.size(2) &&
              out.sizes() == q.sizes() && out.scalar_type() == q.scalar_type(),
              "out must be shaped as q, with contiguous heads");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "caches must be contiguous");
  TORCH_CHECK(k_cache.scalar_type() == q.scalar_type() && v_cache.scalar_type() == q.scalar_type(),
              "q and the caches must share a dtype");
  TORCH_CHECK(block_ids.scalar_type() == at::kLong, "block_ids must be int64");
  auto ids = block_ids.contiguous();
  const int64_t n = q.size(0), num_heads = q.size(1), head_dim = q.size(2);
  const int64_t num_kv_heads = k_cache.size(2), block_size = k_cache.size(1);
  TORCH_CHECK(num_heads % num_kv_heads == 0 && k_cache.size(3) == head_dim, "head shapes");
  TORCH_CHECK(n >= 1 && context_len >= n && ids.numel() * block_size >= context_len,
              "the chunk's queries are the last of its context, whose blocks are given");
  TORCH_CHECK(head_dim == 64 || head_dim == 128, "chunk_attention: head_dim 64 or 128");
  AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, q.scalar_type(), "chunk_attention", [&] {
    auto run = [&](auto impl) {
      impl(q.data_ptr<scalar_t>(), q.stride(0), k_cache.data_ptr<scalar_t>(),
           v_cache.data_ptr<scalar_t>(), ids.data_ptr<int64_t>(), context_len, n,
           out.data_ptr<scalar_t>(), out.stride(0), num_heads, num_kv_heads, block_size,
           static_cast<float>(scale));
    };
    if (head_dim == 64) run(chunk_attention_impl<scalar_t, 64>);
    else run(chunk_attention_impl<scalar_t, 128>);
  });
}

}  // namespace

torch::Tensor exp_clamped_op(torch::Tensor x) {
  auto in = x.contiguous().to(at::kFloat);
  auto out = torch::empty_like(in);
  const float* src = in.data_ptr<float>();
  float* dst = out.data_ptr<float>();
  for (int64_t i = 0; i < in.numel(); ++i) dst[i] = exp_clamped(src[i]);
  return out;
}

void register_layer_ops(pybind11::module& m);  // cpu_layers.cpp
void register_thread_ops(pybind11::module& m);  // cpu_threads.cpp
void register_gemm_ops(pybind11::module& m);  // cpu_gemm.cpp
void register_screen_ops(pybind11::module& m);  // cpu_screen.cpp
void register_screen_i16_ops(pybind11::module& m);  // cpu_screen_i16.cpp
void register_stack_ops(pybind11::module& m);  // cpu_stack.cpp

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  register_layer_ops(m);
  register_thread_ops(m);
  register_gemm_ops(m);
  register_screen_ops(m);
  register_screen_i16_ops(m);
  register_stack_ops(m);
  m.def("decode_attention", &decode_attention, "paged decode attention (CPU)");
  m.def("chunk_attention", &chunk_attention, "paged attention of one prefill chunk (CPU)");
  m.attr("chunk_attention_width") = kWidth;  // floats per register it was built for
  m.def("exp_clamped", &exp_clamped_op, "the kernels' exp (cpu_vec.h), for its test");
}
