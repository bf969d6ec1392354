// Paged decode attention, register-blocked, over an fp32 or a bf16 cache (queries and sums in
// fp32 either way) (decode_attention's path where head_dim is a
// whole number of registers). Same result as the generic loop in cpu_attention.cpp up to
// the order of the dot products' sums: exact two-pass softmax, per (row, KV head).
//
// Why: the generic loop summed each (key, query head) dot product across its register's
// lanes (a horizontal sum per key and head), and accumulated p @ V through memory; at 32
// rows x ~150 keys on builtin:bench it took 21 % of the decode step, reading ~5 MB a layer
// at ~19 GB/s. Here a tile of W keys (W = floats per register) gives each query head W
// vectors of partial sums, reduced together by log2(W) levels of two-register shuffles into
// one register of W scores; p @ V accumulates in registers.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <utility>
#include <vector>

#include "cpu_vec.h"

namespace {

constexpr int kLevels = __builtin_ctz(kWidth);  // log2(kWidth)

// Shuffle masks of the reduction. Level t pairs registers (a, b) that hold 2^t keys each,
// kWidth >> t partial sums per key in adjacent lanes; `lo` takes each key's first half of
// partials, `hi` its second (indices >= kWidth are b's lanes), so lo + hi holds 2^(t+1) keys
// with half as many partials each. After the last level lane k is key k's sum.
struct Masks {
  int32_t lo[kLevels][kWidth];
  int32_t hi[kLevels][kWidth];
};

constexpr Masks make_masks() {
  Masks m{};
  for (int t = 0; t < kLevels; ++t) {
    const int seg = kWidth >> t, half = seg / 2, keys_in = 1 << t;
    for (int i = 0; i < kWidth; ++i) {
      const int key = i / half, o = i % half;
      m.lo[t][i] = (key / keys_in) * kWidth + (key % keys_in) * seg + o;
      m.hi[t][i] = m.lo[t][i] + half;
    }
  }
  return m;
}
constexpr Masks kMasks = make_masks();

template <std::size_t... I>
inline veci mask(const int32_t (&m)[kWidth], std::index_sequence<I...>) {
  return veci{m[I]...};
}

// acc[k]: key k's partial sums in its lanes -> acc[0], lane k the sum of acc[k]. Unrolled
// by level so that every mask is a constant (one two-register permute each).
template <int T>
inline void reduce_keys(vecf* acc) {
  if constexpr (T < kLevels) {
    const veci lo = mask(kMasks.lo[T], std::make_index_sequence<kWidth>{});
    const veci hi = mask(kMasks.hi[T], std::make_index_sequence<kWidth>{});
    constexpr int pairs = (kWidth >> T) / 2;
    for (int v = 0; v < pairs; ++v) {
      const vecf a = acc[2 * v], b = acc[2 * v + 1];
      acc[v] = __builtin_shuffle(a, b, lo) + __builtin_shuffle(a, b, hi);
    }
    reduce_keys<T + 1>(acc);
  }
}

// kWidth cache elements as floats: fp32 as they are, bf16 (raw bits) widened (cpu_vec.h).
inline vecf load_kv(const float* p) { return loadv(p); }
inline vecf load_kv(const uint16_t* p) { return load_bf16(p); }

// The (row, KV head) a thread attends next: its table row, keys and head offset (table null:
// none). Its first keys are prefetched during this one's p @ V pass.
struct NextHead {
  const int64_t* table;
  int64_t n, head_off;
};

// Query head rows `q` [group][HDV * kWidth] of one KV head against its n keys -> out [group][hd].
// `scores`: the caller's buffer of group * round_up(n, kWidth) floats. `ahead_heads`: how
// many KV heads' rows (this one's and the next ones', adjacent in a slot) its walks prefetch.
template <int HDV, typename T>
void decode_kv_head(const float* q, const T* k_cache, const T* v_cache,
                    const int64_t* table, int64_t n, int64_t group, int64_t block_size,
                    int64_t slot_stride, int64_t head_off, float scale, float* scores,
                    float* out, NextHead next, int64_t ahead_heads) {
  constexpr int64_t hd = HDV * kWidth;
  const int64_t n_pad = (n + kWidth - 1) / kWidth * kWidth;
  const T* rows[kWidth];
  // Key j's row of this KV head into cache ahead of use: a sequence's rows are blocks
  // scattered over the pool, which the hardware prefetcher does not follow (the K walk
  // looks kPrefetchKeys keys ahead, then at the first V rows; the V walk kPrefetchValues).
  // Read from memory (8 layers, 32 rows x 160 keys) the kernel ran at ~10 GB/s of the ~35
  // a plain read gets; offline builtin:bench gained ~2.5 % (2 of 3 interleaved pairs).
  // Each prefetch stream walks its keys' (block, row) as the loads do, without division.
  // Into L2, not L1 (prefetcht1): the L1 requests held the core's few miss buffers while
  // its loads waited; in the decode stack on a 2-core Zen 4 the layers' attention of a
  // 32-row step went from ~2.9 to ~2.1 ms (interleaved in one process).
  struct Walk {
    int64_t b, o;  // the key's block (table index) and row in it
  };
  constexpr int64_t head_bytes = hd * static_cast<int64_t>(sizeof(T));
  // `bytes` of the key's slot from head offset `off`, in the sequence of `tbl`; w moves on.
  auto prefetch_rows = [&](const T* cache, const int64_t* tbl, int64_t off, int64_t bytes,
                           Walk& w) {
    const char* p = reinterpret_cast<const char*>(
        cache + (tbl[w.b] * block_size + w.o) * slot_stride + off);
    for (int64_t line = 0; line < bytes; line += 64) __builtin_prefetch(p + line, 0, 2);
    if (++w.o == block_size) {
      w.o = 0;
      ++w.b;
    }
  };
  auto prefetch = [&](const T* cache, Walk& w) {
    prefetch_rows(cache, table, head_off, ahead_heads * head_bytes, w);
  };
  constexpr int64_t kPrefetchKeys = 2 * kWidth, kPrefetchValues = kWidth;
  Walk k_ahead{kPrefetchKeys / block_size, kPrefetchKeys % block_size}, v_first{0, 0};
  int64_t b = 0, o = 0;  // key j's block (table index) and row in it, walked without division
  for (int64_t j0 = 0; j0 < n; j0 += kWidth) {
    // Keys j0 + kPrefetchKeys onwards, one by one across tiles; past n the first V rows.
    for (int64_t j = j0 + kPrefetchKeys; j < j0 + kPrefetchKeys + kWidth; ++j) {
      if (j < n) prefetch(k_cache, k_ahead);
      else if (j - n < std::min(kPrefetchValues, n)) prefetch(v_cache, v_first);  // own keys
    }
    for (int k = 0; k < kWidth; ++k) {
      // Keys past n repeat the last one (valid memory); their scores are never read.
      rows[k] = k_cache + (table[b] * block_size + o) * slot_stride + head_off;
      if (j0 + k + 1 < n && ++o == block_size) {  // on to key j0 + k + 1
        o = 0;
        ++b;
      }
    }
    for (int64_t h = 0; h < group; ++h) {
      vecf qh[HDV];
      for (int c = 0; c < HDV; ++c) qh[c] = loadv(q + h * hd + c * kWidth);
      vecf acc[kWidth];
      for (int k = 0; k < kWidth; ++k) {
        vecf a = qh[0] * load_kv(rows[k]);
        for (int c = 1; c < HDV; ++c) a += qh[c] * load_kv(rows[k] + c * kWidth);
        acc[k] = a;
      }
      reduce_keys<0>(acc);
      const vecf s = acc[0] * scale;
      std::memcpy(scores + h * n_pad + j0, &s, sizeof(s));
    }
  }
  for (int64_t h = 0; h < group; ++h) {
    float* row = scores + h * n_pad;
    float peak = -std::numeric_limits<float>::infinity();
    for (int64_t j = 0; j < n; ++j) peak = std::max(peak, row[j]);
    vecf total = {};
    for (int64_t j0 = 0; j0 < n_pad; j0 += kWidth) {
      vecf e = expv_clamped<true>(loadv(row + j0) - peak);
      for (int k = 0; k < kWidth; ++k)
        if (j0 + k >= n) e[k] = 0.f;  // the padding keys
      std::memcpy(row + j0, &e, sizeof(e));
      total += e;
    }
    float sum = 0.f;
    for (int k = 0; k < kWidth; ++k) sum += total[k];
    const vecf inv = vecf{} + 1.f / sum;
    for (int64_t j0 = 0; j0 < n_pad; j0 += kWidth) {
      const vecf e = loadv(row + j0) * inv;
      std::memcpy(row + j0, &e, sizeof(e));
    }
  }
  // p @ V with the keys outside: each V row is read once for all the group's query heads
  // (one head at a time re-read a row's V from L2 once per head: ~7 % of the kernel with
  // the cache in L3, builtin:bench's 4 heads a KV head). Each head's sum runs over the keys
  // in the same order as before. At most ~24 accumulators in registers (hd 128: 3 heads).
  constexpr int64_t kMaxGroup = std::max(24 / HDV, 1);
  for (int64_t h0 = 0; h0 < group; h0 += kMaxGroup) {
    const int64_t num_heads = std::min(group - h0, kMaxGroup);
    vecf acc[kMaxGroup][HDV] = {};
    Walk v_ahead{kPrefetchValues / block_size, kPrefetchValues % block_size}, n_ahead{0, 0};
    // The next head's first kPrefetchKeys K rows, one a key (its own walk prefetches the
    // rest from key kPrefetchKeys on): each (row, head) had started with ~32 keys read at
    // memory latency, ~20 % of a 160-key context.
    const int64_t next_keys = next.table == nullptr || h0 != 0 ? 0
                              : std::min(kPrefetchKeys, next.n);
    for (int64_t j = 0, vb = 0, vo = 0; j < n; ++j) {
      const T* vrow = v_cache + (table[vb] * block_size + vo) * slot_stride + head_off;
      if (h0 == 0 && j + kPrefetchValues < n) prefetch(v_cache, v_ahead);
      if (j < next_keys) prefetch_rows(k_cache, next.table, next.head_off, head_bytes, n_ahead);
      vecf v[HDV];
      for (int c = 0; c < HDV; ++c) v[c] = load_kv(vrow + c * kWidth);
      for (int64_t h = 0; h < num_heads; ++h) {
        const float p = scores[(h0 + h) * n_pad + j];
        for (int c = 0; c < HDV; ++c) acc[h][c] += p * v[c];
      }
      if (++vo == block_size) {
        vo = 0;
        ++vb;
      }
    }
    for (int64_t h = 0; h < num_heads; ++h)
      std::memcpy(out + (h0 + h) * hd, acc[h], sizeof(acc[h]));
  }
}

template <int HDV, typename T>
void decode_paged(const float* q, int64_t q_row_stride, const T* k_cache, const T* v_cache,
                  const int64_t* block_table, const int64_t* seq_lens, float* out,
                  int64_t num_seqs, int64_t num_heads, int64_t num_kv_heads,
                  int64_t block_size, int64_t table_width, float scale) {
  constexpr int64_t hd = HDV * kWidth;
  const int64_t group = num_heads / num_kv_heads;
  const int64_t slot_stride = num_kv_heads * hd;
  // As the generic loop: a row's KV heads in one item when rows are enough for every thread
  // (each K/V row read whole by one thread), one KV head per item otherwise.
  const int64_t kv_per_item = num_seqs >= 2 * at::get_num_threads() ? num_kv_heads : 1;
  const int64_t items_per_seq = num_kv_heads / kv_per_item;
  at::parallel_for(0, num_seqs * items_per_seq, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores;
    for (int64_t item = begin; item < end; ++item) {
      const int64_t s = item / items_per_seq, g0 = (item % items_per_seq) * kv_per_item;
      const int64_t n = seq_lens[s];
      float* dst = out + (s * num_heads + g0 * group) * hd;
      if (n <= 0) {  // padding row: nothing to attend to
        std::fill(dst, dst + kv_per_item * group * hd, 0.f);
        continue;
      }
      scores.resize(group * ((n + kWidth - 1) / kWidth * kWidth));
      for (int64_t g = g0; g < g0 + kv_per_item; ++g) {
        // The row's first KV head prefetches every head's rows of the item (whole slots,
        // where a head's pass alone read every other 256 bytes of each: the next heads'
        // passes then read from L2). The head after this one in this thread's items: the
        // next KV head of the row, or the next item's first (when it has keys).
        NextHead next{nullptr, 0, 0};
        if (g + 1 < g0 + kv_per_item) {
          next = NextHead{block_table + s * table_width, n, (g + 1) * hd};
        } else if (item + 1 < end) {
          const int64_t s1 = (item + 1) / items_per_seq;
          const int64_t g1 = ((item + 1) % items_per_seq) * kv_per_item;
          if (seq_lens[s1] > 0) next = NextHead{block_table + s1 * table_width, seq_lens[s1],
                                                g1 * hd};
        }
        decode_kv_head<HDV, T>(q + s * q_row_stride + g * group * hd, k_cache, v_cache,
                            block_table + s * table_width, n, group, block_size, slot_stride,
                            g * hd, scale, scores.data(), out + (s * num_heads + g * group) * hd,
                            next, g == g0 ? kv_per_item : 1);
      }
    }
  });
}

}  // namespace

// The register-blocked path, where head_dim is 1, 2, 4 or 8 registers; false: not taken.
// q and out fp32 (a bf16 caller converts them); the caches fp32 or bf16 (T: float or the
// raw bits, uint16_t).
template <typename T>
bool decode_attention_blocked(const float* q, int64_t q_row_stride, const T* k_cache,
                              const T* v_cache, const int64_t* block_table,
                              const int64_t* seq_lens, float* out, int64_t num_seqs,
                              int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
                              int64_t block_size, int64_t table_width, float scale) {
  if (head_dim % kWidth != 0) return false;
  switch (head_dim / kWidth) {
#define TF_DECODE_CASE(N)                                                                \
  case N:                                                                                \
    decode_paged<N, T>(q, q_row_stride, k_cache, v_cache, block_table, seq_lens, out,    \
                       num_seqs, num_heads, num_kv_heads, block_size, table_width, scale); \
    return true;
    TF_DECODE_CASE(1)
    TF_DECODE_CASE(2)
    TF_DECODE_CASE(4)
    TF_DECODE_CASE(8)
#undef TF_DECODE_CASE
    default:
      return false;
  }
}

template bool decode_attention_blocked<float>(const float*, int64_t, const float*, const float*,
                                              const int64_t*, const int64_t*, float*, int64_t,
                                              int64_t, int64_t, int64_t, int64_t, int64_t, float);
template bool decode_attention_blocked<uint16_t>(const float*, int64_t, const uint16_t*,
                                                 const uint16_t*, const int64_t*,
                                                 const int64_t*, float*, int64_t, int64_t,
                                                 int64_t, int64_t, int64_t, int64_t, float);
