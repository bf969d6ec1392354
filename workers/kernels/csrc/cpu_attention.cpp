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
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#include "cpu_vec.h"

bool decode_attention_fp32(const float* q, int64_t q_row_stride, const float* k_cache,
                           const float* v_cache, const int64_t* block_table,
                           const int64_t* seq_lens, float* out, int64_t num_seqs,
                           int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
                           int64_t block_size, int64_t table_width, float scale);  // cpu_decode.cpp

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
      decode_attention_fp32(q.data_ptr<float>(), q.stride(0), k_cache.data_ptr<float>(),
                            v_cache.data_ptr<float>(), table.data_ptr<int64_t>(),
                            lens.data_ptr<int64_t>(), out.data_ptr<float>(), num_seqs,
                            num_heads, num_kv_heads, head_dim, block_size, table.size(1),
                            static_cast<float>(scale)))
    return;  // the register-blocked path (cpu_decode.cpp)
  AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, q.scalar_type(), "decode_attention", [&] {
    decode_attention_impl<scalar_t>(
        q.data_ptr<scalar_t>(), q.stride(0), k_cache.data_ptr<scalar_t>(),
        v_cache.data_ptr<scalar_t>(), table.data_ptr<int64_t>(), lens.data_ptr<int64_t>(),
        out.data_ptr<scalar_t>(), num_seqs, num_heads, num_kv_heads, head_dim, block_size,
        table.size(1), static_cast<float>(scale));
  });
}


// Paged attention of one prefill chunk: its n queries, at positions ctx - n .. ctx - 1 of a
// sequence whose keys 0 .. ctx - 1 are in the cache (the chunk's own already written), each
// attending causally to keys 0 .. its position. Flash-style: per item (a KV head and a tile
// of kRows query rows, i.e. kRows x group query vectors) the keys stream by in tiles of
// kKeys with an online softmax (running max and sum, rescaled as the max grows), so the
// scores are never materialised. Each key tile is read once per item and used by all of its
// query vectors, in register blocks of GCC vector types as wide as the machine's registers
// (-march=native; a type wider than them compiles to code 15x slower): with AVX-512 scores
// of 8 vectors x 32 keys and p @ V of 256 / HD vectors x HD values, 16 accumulators each,
// what its 32 registers hold; with AVX2's 16 registers, 8 accumulators each.
// torch's SDPA reached about a third of this CPU's GEMM rate on these shapes.
#if defined(__AVX512F__)
constexpr int64_t kQueries = 8;  // query vectors per block of the score product
constexpr int64_t kValueFloats = 256;  // accumulated floats per block of p @ V
#elif defined(__AVX__)
constexpr int64_t kQueries = 2;
constexpr int64_t kValueFloats = 64;
#else
constexpr int64_t kQueries = 2;
constexpr int64_t kValueFloats = 32;
#endif
constexpr int64_t kRows = 32;  // query rows per item
constexpr int64_t kKeys = 32;  // keys per tile
constexpr int64_t kKeyVecs = kKeys / kWidth;

inline veci lanes() {
  veci v;
  for (int32_t i = 0; i < kWidth; ++i) v[i] = i;
  return v;
}

template <typename T, int64_t HD>
void chunk_attention_impl(const T* q, int64_t q_row_stride, const T* k_cache, const T* v_cache,
                          const int64_t* table, int64_t ctx, int64_t n, T* out,
                          int64_t out_row_stride, int64_t num_heads, int64_t num_kv_heads,
                          int64_t block_size, float scale) {
  constexpr int64_t kValueQueries = kValueFloats / HD > 0 ? kValueFloats / HD : 1;
  constexpr int64_t kBlock = kQueries > kValueQueries ? kQueries : kValueQueries;
  const int64_t group = num_heads / num_kv_heads;
  const int64_t slot_stride = num_kv_heads * HD;
  const int64_t num_tiles = (n + kRows - 1) / kRows;
  // Query vectors of an item, rounded up to whole blocks (padding vectors are zero).
  const int64_t max_vectors = (kRows * group + kBlock - 1) / kBlock * kBlock;
  at::parallel_for(0, num_kv_heads * num_tiles, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> qf(max_vectors * HD), acc(max_vectors * HD), kt(HD * kKeys),
        vt(kKeys * HD), p(max_vectors * kKeys), peak(max_vectors), total(max_vectors);
    const float* vrows[kKeys];
    for (int64_t item = begin; item < end; ++item) {
      const int64_t kv = item / num_tiles, r0 = (item % num_tiles) * kRows;
      const int64_t rows = std::min(kRows, n - r0);
      const int64_t num_vectors = rows * group;  // vector x: row x / group, head x % group
      const int64_t padded = (num_vectors + kBlock - 1) / kBlock * kBlock;
      const int64_t first_pos = ctx - n + r0;  // position of the item's first row
      std::fill(qf.begin(), qf.end(), 0.f);
      for (int64_t x = 0; x < num_vectors; ++x) {
        const T* src = q + (r0 + x / group) * q_row_stride + (kv * group + x % group) * HD;
        for (int64_t d = 0; d < HD; ++d) qf[x * HD + d] = scale * static_cast<float>(src[d]);
      }
      std::fill(acc.begin(), acc.end(), 0.f);
      std::fill(peak.begin(), peak.end(), -std::numeric_limits<float>::infinity());
      std::fill(total.begin(), total.end(), 0.f);
      const int64_t num_keys = first_pos + rows;  // keys the item's last row sees
      for (int64_t k0 = 0; k0 < num_keys; k0 += kKeys) {
        const int64_t tk = std::min(kKeys, num_keys - k0);
        // The tile's keys transposed (kt[d][j]), zero past tk; its value rows: fp32 read in
        // place (vrows), other dtypes converted into vt. Keys walked block by block.
        for (int64_t j = 0, b = k0 / block_size, o = k0 % block_size; j < kKeys; ++j) {
          if (j < tk) {
            const int64_t slot = (table[b] * block_size + o) * slot_stride + kv * HD;
            const T* krow = k_cache + slot;
            for (int64_t d = 0; d < HD; ++d) kt[d * kKeys + j] = static_cast<float>(krow[d]);
            if constexpr (std::is_same_v<T, float>) {
              vrows[j] = v_cache + slot;
            } else {
              const T* vrow = v_cache + slot;
              for (int64_t d = 0; d < HD; ++d) vt[j * HD + d] = static_cast<float>(vrow[d]);
              vrows[j] = vt.data() + j * HD;
            }
            if (++o == block_size) {
              o = 0;
              ++b;
            }
          } else {
            for (int64_t d = 0; d < HD; ++d) kt[d * kKeys + j] = 0.f;
          }
        }
        for (int64_t x = 0; x < padded; x += kQueries) {
          vecf a[kQueries][kKeyVecs] = {};
          const float* qx = qf.data() + x * HD;
          for (int64_t d = 0; d < HD; ++d) {
            vecf kd[kKeyVecs];
#pragma GCC unroll 8
            for (int64_t c = 0; c < kKeyVecs; ++c) kd[c] = loadv(kt.data() + d * kKeys + c * kWidth);
#pragma GCC unroll 8
            for (int64_t b = 0; b < kQueries; ++b) {
              const float qv = qx[b * HD + d];
#pragma GCC unroll 8
              for (int64_t c = 0; c < kKeyVecs; ++c) a[b][c] += qv * kd[c];
            }
          }
#pragma GCC unroll 8
          for (int64_t b = 0; b < kQueries; ++b)
#pragma GCC unroll 8
            for (int64_t c = 0; c < kKeyVecs; ++c)
              storev(p.data() + (x + b) * kKeys + c * kWidth, a[b][c]);
        }
        // Causal limit and online softmax: p becomes the weights of the tile's keys.
        for (int64_t x = 0; x < padded; ++x) {
          float* px = p.data() + x * kKeys;
          const int64_t pos = x < num_vectors ? first_pos + x / group : num_keys - 1;
          const int64_t limit = std::min(tk, pos - k0 + 1);  // keys k0 .. pos
          if (limit <= 0) {
            std::fill(px, px + kKeys, 0.f);
            continue;
          }
          const vecf zero = {};
          const veci lane = lanes();
          const vecf neg_inf = zero - std::numeric_limits<float>::infinity();
          vecf peaks = neg_inf;
          for (int64_t c = 0; c < kKeyVecs; ++c) {
            const veci in = lane + static_cast<int32_t>(c * kWidth) < static_cast<int32_t>(limit);
            const vecf s = loadv(px + c * kWidth);
            peaks = in && s > peaks ? s : peaks;
          }
          float tile_peak = peaks[0];
          for (int64_t j = 1; j < kWidth; ++j) tile_peak = std::max(tile_peak, peaks[j]);
          const float new_peak = std::max(peak[x], tile_peak);
          const float rescale = exp_clamped(peak[x] - new_peak);
          peak[x] = new_peak;
          vecf sums = zero;
          for (int64_t c = 0; c < kKeyVecs; ++c) {
            const veci in = lane + static_cast<int32_t>(c * kWidth) < static_cast<int32_t>(limit);
            const vecf w = in ? expv_clamped<true>(loadv(px + c * kWidth) - new_peak) : zero;
            storev(px + c * kWidth, w);
            sums += w;
          }
          float sum = 0.f;
          for (int64_t j = 0; j < kWidth; ++j) sum += sums[j];
          total[x] = total[x] * rescale + sum;
          if (rescale != 1.f) {
            float* ax = acc.data() + x * HD;
#pragma omp simd
            for (int64_t d = 0; d < HD; ++d) ax[d] *= rescale;
          }
        }
        for (int64_t x = 0; x < padded; x += kValueQueries) {
          vecf o[kValueQueries][HD / kWidth];
          float* ax = acc.data() + x * HD;
#pragma GCC unroll 8
          for (int64_t b = 0; b < kValueQueries; ++b)
#pragma GCC unroll 8
            for (int64_t c = 0; c < HD / kWidth; ++c) o[b][c] = loadv(ax + b * HD + c * kWidth);
          const float* px = p.data() + x * kKeys;
          for (int64_t j = 0; j < tk; ++j) {
            const float* v = vrows[j];
            vecf vv[HD / kWidth];
#pragma GCC unroll 8
            for (int64_t c = 0; c < HD / kWidth; ++c) vv[c] = loadv(v + c * kWidth);
#pragma GCC unroll 8
            for (int64_t b = 0; b < kValueQueries; ++b) {
              const float w = px[b * kKeys + j];
#pragma GCC unroll 8
              for (int64_t c = 0; c < HD / kWidth; ++c) o[b][c] += w * vv[c];
            }
          }
#pragma GCC unroll 8
          for (int64_t b = 0; b < kValueQueries; ++b)
#pragma GCC unroll 8
            for (int64_t c = 0; c < HD / kWidth; ++c) storev(ax + b * HD + c * kWidth, o[b][c]);
        }
      }
      for (int64_t x = 0; x < num_vectors; ++x) {
        T* dst = out + (r0 + x / group) * out_row_stride + (kv * group + x % group) * HD;
        const float inv = 1.f / total[x];
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

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  register_layer_ops(m);
  m.def("decode_attention", &decode_attention, "paged decode attention (CPU)");
  m.def("chunk_attention", &chunk_attention, "paged attention of one prefill chunk (CPU)");
  m.attr("chunk_attention_width") = kWidth;  // floats per register it was built for
  m.def("exp_clamped", &exp_clamped_op, "the kernels' exp (cpu_vec.h), for its test");
}
