// Paged decode attention, fp32, register-blocked (decode_attention's path where head_dim is a
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

namespace {

#if defined(__AVX512F__)
constexpr int kW = 16;
#elif defined(__AVX__)
constexpr int kW = 8;
#else
constexpr int kW = 4;
#endif
constexpr int kLevels = __builtin_ctz(kW);  // log2(kW)
typedef float vf __attribute__((vector_size(kW * 4)));
typedef int32_t vi __attribute__((vector_size(kW * 4)));

inline vf load(const float* p) {
  vf v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

// e^x for x <= 0 on a register (Cephes' expf: x = n ln2 + r, |r| <= ln2 / 2, a degree-6
// polynomial for e^r, 2^n from the exponent bits); below -87 it gives ~e^-87.
inline vf exp_nonpositive(vf x) {
  const vf lo = vf{} - 87.0f;
  x = x > lo ? x : lo;
  const vf n = (x * 1.44269504088896341f + 12582912.0f) - 12582912.0f;  // rounded
  const vf r = x - n * 0.693359375f + n * 2.12194440e-4f;
  vf p = vf{} + 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  const vf y = p * r * r + r + 1.0f;
  const vi bits = (__builtin_convertvector(n, vi) + 127) << 23;
  vf scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return y * scale;
}

// Shuffle masks of the reduction. Level t pairs registers (a, b) that hold 2^t keys each,
// kW >> t partial sums per key in adjacent lanes; `lo` takes each key's first half of
// partials, `hi` its second (indices >= kW are b's lanes), so lo + hi holds 2^(t+1) keys
// with half as many partials each. After the last level lane k is key k's sum.
struct Masks {
  int32_t lo[kLevels][kW];
  int32_t hi[kLevels][kW];
};

constexpr Masks make_masks() {
  Masks m{};
  for (int t = 0; t < kLevels; ++t) {
    const int seg = kW >> t, half = seg / 2, keys_in = 1 << t;
    for (int i = 0; i < kW; ++i) {
      const int key = i / half, o = i % half;
      m.lo[t][i] = (key / keys_in) * kW + (key % keys_in) * seg + o;
      m.hi[t][i] = m.lo[t][i] + half;
    }
  }
  return m;
}
constexpr Masks kMasks = make_masks();

template <std::size_t... I>
inline vi mask(const int32_t (&m)[kW], std::index_sequence<I...>) {
  return vi{m[I]...};
}

// acc[k]: key k's partial sums in its lanes -> acc[0], lane k the sum of acc[k]. Unrolled
// by level so that every mask is a constant (one two-register permute each).
template <int T>
inline void reduce_keys(vf* acc) {
  if constexpr (T < kLevels) {
    const vi lo = mask(kMasks.lo[T], std::make_index_sequence<kW>{});
    const vi hi = mask(kMasks.hi[T], std::make_index_sequence<kW>{});
    constexpr int pairs = (kW >> T) / 2;
    for (int v = 0; v < pairs; ++v) {
      const vf a = acc[2 * v], b = acc[2 * v + 1];
      acc[v] = __builtin_shuffle(a, b, lo) + __builtin_shuffle(a, b, hi);
    }
    reduce_keys<T + 1>(acc);
  }
}

// Query head rows `q` [group][HDV * kW] of one KV head against its n keys -> out [group][hd].
// `scores`: the caller's buffer of group * round_up(n, kW) floats.
template <int HDV>
void decode_kv_head(const float* q, const float* k_cache, const float* v_cache,
                    const int64_t* table, int64_t n, int64_t group, int64_t block_size,
                    int64_t slot_stride, int64_t head_off, float scale, float* scores,
                    float* out) {
  constexpr int64_t hd = HDV * kW;
  const int64_t n_pad = (n + kW - 1) / kW * kW;
  const float* rows[kW];
  int64_t b = 0, o = 0;  // key j's block (table index) and row in it, walked without division
  for (int64_t j0 = 0; j0 < n; j0 += kW) {
    for (int k = 0; k < kW; ++k) {
      // Keys past n repeat the last one (valid memory); their scores are never read.
      rows[k] = k_cache + (table[b] * block_size + o) * slot_stride + head_off;
      if (j0 + k + 1 < n && ++o == block_size) {  // on to key j0 + k + 1
        o = 0;
        ++b;
      }
    }
    for (int64_t h = 0; h < group; ++h) {
      vf qh[HDV];
      for (int c = 0; c < HDV; ++c) qh[c] = load(q + h * hd + c * kW);
      vf acc[kW];
      for (int k = 0; k < kW; ++k) {
        vf a = qh[0] * load(rows[k]);
        for (int c = 1; c < HDV; ++c) a += qh[c] * load(rows[k] + c * kW);
        acc[k] = a;
      }
      reduce_keys<0>(acc);
      const vf s = acc[0] * scale;
      std::memcpy(scores + h * n_pad + j0, &s, sizeof(s));
    }
  }
  for (int64_t h = 0; h < group; ++h) {
    float* row = scores + h * n_pad;
    float peak = -std::numeric_limits<float>::infinity();
    for (int64_t j = 0; j < n; ++j) peak = std::max(peak, row[j]);
    vf total = {};
    for (int64_t j0 = 0; j0 < n_pad; j0 += kW) {
      vf e = exp_nonpositive(load(row + j0) - peak);
      for (int k = 0; k < kW; ++k)
        if (j0 + k >= n) e[k] = 0.f;  // the padding keys
      std::memcpy(row + j0, &e, sizeof(e));
      total += e;
    }
    float sum = 0.f;
    for (int k = 0; k < kW; ++k) sum += total[k];
    const vf inv = vf{} + 1.f / sum;
    for (int64_t j0 = 0; j0 < n_pad; j0 += kW) {
      const vf e = load(row + j0) * inv;
      std::memcpy(row + j0, &e, sizeof(e));
    }
  }
  for (int64_t h = 0; h < group; ++h) {
    const float* p = scores + h * n_pad;
    vf acc[HDV] = {};
    for (int64_t j = 0, vb = 0, vo = 0; j < n; ++j) {
      const float* vrow = v_cache + (table[vb] * block_size + vo) * slot_stride + head_off;
      for (int c = 0; c < HDV; ++c) acc[c] += p[j] * load(vrow + c * kW);
      if (++vo == block_size) {
        vo = 0;
        ++vb;
      }
    }
    std::memcpy(out + h * hd, acc, sizeof(acc));
  }
}

template <int HDV>
void decode_fp32(const float* q, int64_t q_row_stride, const float* k_cache,
                 const float* v_cache, const int64_t* block_table, const int64_t* seq_lens,
                 float* out, int64_t num_seqs, int64_t num_heads, int64_t num_kv_heads,
                 int64_t block_size, int64_t table_width, float scale) {
  constexpr int64_t hd = HDV * kW;
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
      scores.resize(group * ((n + kW - 1) / kW * kW));
      for (int64_t g = g0; g < g0 + kv_per_item; ++g)
        decode_kv_head<HDV>(q + s * q_row_stride + g * group * hd, k_cache, v_cache,
                            block_table + s * table_width, n, group, block_size, slot_stride,
                            g * hd, scale, scores.data(), out + (s * num_heads + g * group) * hd);
    }
  });
}

}  // namespace

// The register-blocked path, where head_dim is 1, 2, 4 or 8 registers; false: not taken.
bool decode_attention_fp32(const float* q, int64_t q_row_stride, const float* k_cache,
                           const float* v_cache, const int64_t* block_table,
                           const int64_t* seq_lens, float* out, int64_t num_seqs,
                           int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
                           int64_t block_size, int64_t table_width, float scale) {
  if (head_dim % kW != 0) return false;
  switch (head_dim / kW) {
#define TF_DECODE_CASE(N)                                                                \
  case N:                                                                                \
    decode_fp32<N>(q, q_row_stride, k_cache, v_cache, block_table, seq_lens, out,        \
                   num_seqs, num_heads, num_kv_heads, block_size, table_width, scale);   \
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
