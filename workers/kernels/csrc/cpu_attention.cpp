// Paged decode attention for the CPU worker: each decode row's query heads attend to its
// context read in place from the paged KV cache (no gathered copy of the blocks).
//
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
#include <vector>

namespace {

// exp for x <= 0 (scores minus their max) in a form the compiler vectorizes (std::exp is a
// scalar libm call per element: it was most of the kernel's time). Cephes' expf: x = n ln2 + r,
// |r| <= ln2 / 2, a degree-6 polynomial for e^r, 2^n from the exponent bits; ~1 ulp over
// [-87, 0] (tested against torch.exp). Below -87 it returns ~e^-87, which is 0 in any sum here.
inline float exp_nonpositive(float x) {
  x = std::max(x, -87.0f);
  const float n = std::floor(x * 1.44269504088896341f + 0.5f);
  const float r = x - n * 0.693359375f + n * 2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  const float y = p * r * r + r + 1.0f;
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return y * scale;
}

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
          row[j] = exp_nonpositive(row[j] - peak);
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
  AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, q.scalar_type(), "decode_attention", [&] {
    decode_attention_impl<scalar_t>(
        q.data_ptr<scalar_t>(), q.stride(0), k_cache.data_ptr<scalar_t>(),
        v_cache.data_ptr<scalar_t>(), table.data_ptr<int64_t>(), lens.data_ptr<int64_t>(),
        out.data_ptr<scalar_t>(), num_seqs, num_heads, num_kv_heads, head_dim, block_size,
        table.size(1), static_cast<float>(scale));
  });
}

}  // namespace

torch::Tensor exp_nonpositive_op(torch::Tensor x) {
  auto in = x.contiguous().to(at::kFloat);
  auto out = torch::empty_like(in);
  const float* src = in.data_ptr<float>();
  float* dst = out.data_ptr<float>();
  for (int64_t i = 0; i < in.numel(); ++i) dst[i] = exp_nonpositive(src[i]);
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("decode_attention", &decode_attention, "paged decode attention (CPU)");
  m.def("exp_nonpositive", &exp_nonpositive_op, "the kernel's exp, for its test");
}
