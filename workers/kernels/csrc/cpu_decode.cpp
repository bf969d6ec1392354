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
//
// On a 2-core Zen 3 (AVX2), 32 rows x 160 keys of builtin:bench's heads with the cache in
// L3, a layer took 0.34 ms on both threads (0.51 on one) before three changes: p @ V in
// passes whose accumulators fit the 16 registers, the softmax's max by lanes, the padding
// lanes masked by one compare (and no repeated prefetch by a row's later KV heads); after,
// 0.17-0.28 ms (0.33-0.34 on one). In the decode stack, with the KV read from memory, the
// difference was within the VM's noise (3 interleaved pairs of processes).
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <array>
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

// Key j's row of a KV head into cache ahead of use: a sequence's rows are blocks scattered
// over the pool, which the hardware prefetcher does not follow (the K walk looks
// kPrefetchKeys keys ahead, then at the first V rows; the V walk kPrefetchValues). Read from
// memory (8 layers, 32 rows x 160 keys) the kernel ran at ~10 GB/s of the ~35 a plain read
// gets; offline builtin:bench gained ~2.5 % (2 of 3 interleaved pairs). Each prefetch stream
// walks its keys' (block, row) as the loads do, without division. Into L2, not L1
// (prefetcht1): the L1 requests held the core's few miss buffers while its loads waited; in
// the decode stack on a 2-core Zen 4 the layers' attention of a 32-row step went from ~2.9
// to ~2.1 ms (interleaved in one process).
constexpr int64_t kPrefetchKeys = 2 * kWidth, kPrefetchValues = kWidth;

struct Walk {
  int64_t b, o;  // the key's block (table index) and row in it
};

// `bytes` of key w's slot from head offset `off`, in the sequence of `table`; w moves on.
template <typename T>
inline void prefetch_rows(const T* cache, const int64_t* table, int64_t block_size,
                          int64_t slot_stride, int64_t off, int64_t bytes, Walk& w) {
  const char* p =
      reinterpret_cast<const char*>(cache + (table[w.b] * block_size + w.o) * slot_stride + off);
  for (int64_t line = 0; line < bytes; line += 64) __builtin_prefetch(p + line, 0, 2);
  if (++w.o == block_size) {
    w.o = 0;
    ++w.b;
  }
}

// The registers of a p @ V pass (`pv_pass`): NH x kPvVecs accumulators, kPvVecs values and a
// broadcast within the build's vector registers less one, at most kPvHeads heads. With AVX2
// (16 registers) and head_dim 64, one pass over a row's whole hd held 8 accumulators a
// head, and 3 heads' 24 spilled to the stack: each FMA a load and a store (on a 2-core Zen
// 3, 32 rows x 160 keys, ~65 ns a key and KV head a thread, cached or not). Passes of 2
// registers of hd keep 6 heads' accumulators in registers; AVX-512 at head_dim 64 keeps
// its one pass of 6 heads.
constexpr int64_t kVecRegs = kWidth == 16 ? 32 : 16;
template <int HDV>
constexpr int64_t pv_vecs() {
  for (int64_t cv = HDV; cv > 1; cv /= 2)
    if ((kVecRegs - 2 - cv) / cv >= 4) return cv;  // 4 heads a pass, where hd allows
  return 1;
}
template <int HDV>
constexpr int64_t kPvVecs = pv_vecs<HDV>();
template <int HDV>
constexpr int64_t kPvHeads = std::max<int64_t>((kVecRegs - 2 - kPvVecs<HDV>) / kPvVecs<HDV>, 1);

// Where a pass reads and writes: the KV head's V rows (its table, n keys, head offset), the
// probabilities of its first query head (rows n_pad apart) and its output (rows hd apart),
// both from the pass's first head; c0: the pass's first register of hd.
template <typename T>
struct PvArgs {
  const T* v_cache;
  const int64_t* table;
  int64_t n, n_pad, block_size, slot_stride, head_off;
  const float* scores;
  float* out;
  int64_t c0;
};

// One p @ V pass: NH query heads over registers [c0, c0 + kPvVecs) of hd. Each output's sum
// runs over the keys in order (one FMA a key), whatever the passes. `first`: the pass that
// prefetches V ahead of its loads, and the next head's first K rows (`next`).
template <int HDV, typename T, int NH>
void pv_pass(const PvArgs<T>& a, bool first, NextHead next, const T* k_cache,
             int64_t ahead_heads) {
  constexpr int64_t hd = HDV * kWidth, cv = kPvVecs<HDV>;
  constexpr int64_t head_bytes = hd * static_cast<int64_t>(sizeof(T));
  vecf acc[NH][cv] = {};
  Walk v_ahead{kPrefetchValues / a.block_size, kPrefetchValues % a.block_size}, n_ahead{0, 0};
  // The next head's first kPrefetchKeys K rows, one a key (its own walk prefetches the
  // rest from key kPrefetchKeys on): each (row, head) had started with ~32 keys read at
  // memory latency, ~20 % of a 160-key context.
  const int64_t next_keys = next.table == nullptr || !first ? 0 : std::min(kPrefetchKeys, next.n);
  const T* base = a.v_cache + a.head_off + a.c0 * kWidth;
  for (int64_t j = 0, vb = 0, vo = 0; j < a.n; ++j) {
    const T* vrow = base + (a.table[vb] * a.block_size + vo) * a.slot_stride;
    if (first && ahead_heads > 0 && j + kPrefetchValues < a.n)
      prefetch_rows(a.v_cache, a.table, a.block_size, a.slot_stride, a.head_off,
                    ahead_heads * head_bytes, v_ahead);
    if (j < next_keys)
      prefetch_rows(k_cache, next.table, a.block_size, a.slot_stride, next.head_off,
                    head_bytes, n_ahead);
    vecf v[cv];
    for (int c = 0; c < cv; ++c) v[c] = load_kv(vrow + c * kWidth);
    for (int h = 0; h < NH; ++h) {
      const float p = a.scores[h * a.n_pad + j];
      for (int c = 0; c < cv; ++c) acc[h][c] += p * v[c];
    }
    if (++vo == a.block_size) {
      vo = 0;
      ++vb;
    }
  }
  for (int h = 0; h < NH; ++h)
    std::memcpy(a.out + h * hd + a.c0 * kWidth, acc[h], sizeof(acc[h]));
}

template <int HDV, typename T>
using PvPass = void (*)(const PvArgs<T>&, bool, NextHead, const T*, int64_t);
template <int HDV, typename T, int... R>
constexpr std::array<PvPass<HDV, T>, sizeof...(R)> pv_passes_of(
    std::integer_sequence<int, R...>) {
  return {&pv_pass<HDV, T, R + 1>...};
}
// kPvPasses<HDV, T>[h - 1]: the pass of h heads.
template <int HDV, typename T>
constexpr auto kPvPasses =
    pv_passes_of<HDV, T>(std::make_integer_sequence<int, static_cast<int>(kPvHeads<HDV>)>{});

// Query head rows `q` [group][HDV * kWidth] of one KV head against its n keys -> out [group][hd].
// `scores`: the caller's buffer of group * round_up(n, kWidth) floats. `ahead_heads`: how
// many KV heads' rows (this one's and the next ones', adjacent in a slot) its walks prefetch.
template <int HDV, typename T>
void decode_kv_head(const float* q, const T* k_cache, const T* v_cache,
                    const int64_t* table, int64_t n, int64_t group, int64_t block_size,
                    int64_t slot_stride, int64_t head_off, float scale, float* scores,
                    float* out, NextHead next, int64_t ahead_heads) {
  constexpr int64_t hd = HDV * kWidth;
  constexpr int64_t head_bytes = hd * static_cast<int64_t>(sizeof(T));
  const int64_t n_pad = (n + kWidth - 1) / kWidth * kWidth;
  const T* rows[kWidth];
  auto prefetch = [&](const T* cache, Walk& w) {
    prefetch_rows(cache, table, block_size, slot_stride, head_off, ahead_heads * head_bytes, w);
  };
  Walk k_ahead{kPrefetchKeys / block_size, kPrefetchKeys % block_size}, v_first{0, 0};
  int64_t b = 0, o = 0;  // key j's block (table index) and row in it, walked without division
  for (int64_t j0 = 0; j0 < n; j0 += kWidth) {
    // Keys j0 + kPrefetchKeys onwards, one by one across tiles; past n the first V rows.
    // ahead_heads 0 (a row's later KV heads: the first one's walks covered them): no walk.
    for (int64_t j = j0 + kPrefetchKeys; ahead_heads > 0 && j < j0 + kPrefetchKeys + kWidth;
         ++j) {
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
    // The max lane-wise, then across the lanes (exact in any order; NaNs skipped as by
    // std::max): one scalar max a key was a chain of its latency, ~14 % of the kernel.
    const vecf lowest = vecf{} - std::numeric_limits<float>::infinity();
    vecf peaks = lowest;
    int64_t j = 0;
    for (; j + kWidth <= n; j += kWidth) {
      const vecf x = loadv(row + j);
      peaks = peaks < x ? x : peaks;
    }
    float peak = -std::numeric_limits<float>::infinity();
    for (int k = 0; k < kWidth; ++k) peak = std::max(peak, peaks[k]);
    for (; j < n; ++j) peak = std::max(peak, row[j]);
    vecf total = {};
    for (int64_t j0 = 0; j0 < n_pad; j0 += kWidth) {
      vecf e = expv_clamped<true>(loadv(row + j0) - peak);
      // The padding keys of the last tile to 0, by one compare (a lane at a time it was
      // ~20 % of the kernel at 160 keys on a Zen 3).
      if (j0 + kWidth > n) e = kLanes < veci{} + static_cast<int32_t>(n - j0) ? e : vecf{};
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
  // p @ V with the keys outside: each V row's lines are read once for all the group's query
  // heads (one head at a time re-read a row's V from L2 once per head: ~7 % of the kernel
  // with the cache in L3, builtin:bench's 4 heads a KV head), in passes whose accumulators
  // stay in registers (`pv_pass`).
  for (int64_t c0 = 0; c0 < HDV; c0 += kPvVecs<HDV>)
    for (int64_t h0 = 0; h0 < group; h0 += kPvHeads<HDV>) {
      const PvArgs<T> args{v_cache, table, n, n_pad, block_size, slot_stride, head_off,
                           scores + h0 * n_pad, out + h0 * hd, c0};
      const int64_t num_heads = std::min(group - h0, kPvHeads<HDV>);
      kPvPasses<HDV, T>[num_heads - 1](args, c0 == 0 && h0 == 0, next, k_cache, ahead_heads);
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
        // passes then read from L2 and prefetch nothing more: at 32 rows x 160 keys on a
        // Zen 3 their repeated prefetches were ~10 % of the kernel). The head after this
        // one in this thread's items: the next KV head of the row, or the next item's first
        // (when it has keys).
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
                            next, g == g0 ? kv_per_item : 0);
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
