// What the CPU kernels share (cpu_attention.cpp, cpu_decode.cpp, cpu_layers.cpp): GCC vector
// types as wide as the build's registers (-march=native; a type wider than them compiles to
// code 15x slower) and one exp.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <new>
#include <utility>

#include <ATen/Parallel.h>

#if defined(__AVX2__)
#include <immintrin.h>
#endif

#if defined(__AVX512F__)
constexpr int64_t kWidth = 16;  // floats per register
#elif defined(__AVX__)
constexpr int64_t kWidth = 8;
#else
constexpr int64_t kWidth = 4;
#endif
typedef float vecf __attribute__((vector_size(kWidth * 4)));
typedef int32_t veci __attribute__((vector_size(kWidth * 4)));

// Zeroed floats on a 64-byte boundary. std::vector's memory is 16-byte aligned (glibc), and
// a 512-bit load from it then spans two cache lines; the chunk kernel's transposed key tiles
// and accumulators are read a register at a time.
class AlignedFloats {
 public:
  explicit AlignedFloats(int64_t n) : size_(n) {
    const size_t bytes = (static_cast<size_t>(std::max<int64_t>(n, 1)) * sizeof(float) + 63) /
                         64 * 64;
    data_ = static_cast<float*>(std::aligned_alloc(64, bytes));
    if (data_ == nullptr) throw std::bad_alloc();
    std::fill(data_, data_ + n, 0.f);
  }
  AlignedFloats(const AlignedFloats&) = delete;
  AlignedFloats& operator=(const AlignedFloats&) = delete;
  ~AlignedFloats() { std::free(data_); }
  float* data() { return data_; }
  const float* data() const { return data_; }
  float* begin() { return data_; }
  float* end() { return data_ + size_; }
  float& operator[](int64_t i) { return data_[i]; }

 private:
  float* data_;
  int64_t size_;
};

// Each lane's index (0 .. kWidth - 1): the kernels mask a tile's lanes past a length with one
// compare against it.
template <std::size_t... I>
constexpr veci lanes_of(std::index_sequence<I...>) {
  return veci{static_cast<int32_t>(I)...};
}
constexpr veci kLanes = lanes_of(std::make_index_sequence<kWidth>{});

inline vecf loadv(const float* p) {
  vecf v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}
inline void storev(float* p, vecf v) { std::memcpy(p, &v, sizeof(v)); }

// kWidth bf16 values (raw bits) as floats: each widened into the upper half of its lane.
typedef uint16_t vech __attribute__((vector_size(kWidth * 2)));
inline vecf load_bf16(const uint16_t* p) {
#if defined(__AVX512F__)
  // One zero-extending load and a shift (GCC's generic conversion compiled to shuffles).
  const __m512i wide =
      _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  return reinterpret_cast<vecf>(_mm512_castsi512_ps(_mm512_slli_epi32(wide, 16)));
#elif defined(__AVX2__)
  const __m256i wide =
      _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return reinterpret_cast<vecf>(_mm256_castsi256_ps(_mm256_slli_epi32(wide, 16)));
#else
  vech h;
  std::memcpy(&h, p, sizeof(h));
  const veci bits = __builtin_convertvector(h, veci) << 16;
  vecf f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
#endif
}

// Whether any lane of a comparison's mask (all ones or zero per lane) is set.
inline bool any_lane(veci mask) {
#if defined(__AVX512F__)
  const __m512i m = reinterpret_cast<__m512i>(mask);
  return _mm512_test_epi32_mask(m, m) != 0;
#elif defined(__AVX__)
  const __m256i m = reinterpret_cast<__m256i>(mask);
  return !_mm256_testz_si256(m, m);
#else
  for (int k = 0; k < kWidth; ++k)
    if (mask[k] != 0) return true;
  return false;
#endif
}

// Cephes' expf, in a form the compiler vectorizes (std::exp is a scalar libm call per element:
// it was most of the attention kernels' time): x = n ln2 + r, |r| <= ln2 / 2, a degree-6
// polynomial for e^r, 2^n from the exponent bits; ~1 ulp over [-87, 88] (tested against
// torch.exp). x is clamped there: below -87 it gives ~e^-87, which is 0 in any sum here.
// e^r for |r| <= ln2 / 2, on one float or on a register of them.
template <typename V>
inline V exp_reduced(V r) {
  V p = V{} + 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  return p * r * r + r + 1.0f;
}

inline float exp_clamped(float x) {
  x = std::min(std::max(x, -87.0f), 88.0f);
  const float n = std::floor(x * 1.44269504088896341f + 0.5f);
  const float r = x - n * 0.693359375f + n * 2.12194440e-4f;
  const float y = exp_reduced(r);
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return y * scale;
}

// The same on a register; n = x log2(e) rounded to nearest by the 1.5 * 2^23 trick.
// kNonPositive: the caller's x <= 0 (scores minus their max), so no upper clamp in the
// attention kernels' inner loop (it cost them ~10 % at 136-row chunks).
template <bool kNonPositive = false>
inline vecf expv_clamped(vecf x) {
  const vecf lo = vecf{} - 87.0f, hi = vecf{} + 88.0f;
  x = x < lo ? lo : x;
  if constexpr (!kNonPositive) x = x > hi ? hi : x;
  const vecf n = (x * 1.44269504088896341f + 12582912.0f) - 12582912.0f;
  const vecf r = x - n * 0.693359375f + n * 2.12194440e-4f;
  const vecf y = exp_reduced(r);
  const veci bits = (__builtin_convertvector(n, veci) + 127) << 23;
  vecf scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return y * scale;
}

// A tile's walk over k in [0, k_len): step(k) for each k in order, and prefetch(j) for each
// j of [pk0, pk1) (clamped to k_len: the next weight's range may be longer than this one's),
// none where !prefetching. The prefetches are spread evenly over the whole walk, one before
// every k_len / (pk1 - pk0) steps: issued back to back over the first third of the walk
// (a tile's share of the next block), they asked for lines faster than a core's few miss
// buffers return them, and the rest of the walk asked for none. Spread, builtin:bench's 40
// decode GEMMs at 32 rows read from memory took 7.0-7.5 ms against 7.8-8.3 on a 2-core Xeon,
// LocalEngine's offline run +2-6 % (5 interleaved pairs). No test of the range at every k:
// it was ~8 scalar instructions beside a tile's 10-12 vector ones (a 5-row fp32 tile ran
// ~25 % slower a row than a 6-row one on a Zen 3), so the inner loop is its steps alone.
template <typename Step, typename Fetch>
__attribute__((always_inline)) inline void for_each_k(int64_t k_len, bool prefetching,
                                                      int64_t pk0, int64_t pk1,
                                                      const Step& step, const Fetch& prefetch) {
  pk1 = prefetching ? std::min(pk1, k_len) : 0;
  pk0 = std::min(pk0, pk1);
  const int64_t count = pk1 - pk0;
  int64_t k = 0;
  if (count > 0) {
    // prefetch(pk0 + j) before every (k_len / count)-th step, spread over the whole walk
    const int64_t every = k_len / count, extra = k_len % count;
    int64_t err = 0;
    for (int64_t j = 0; j < count; ++j) {
      prefetch(pk0 + j);
      int64_t n = every;
      err += extra;
      if (err >= count) {
        err -= count;
        ++n;
      }
      for (const int64_t stop = k + n; k < stop; ++k) step(k);
    }
  }
  for (; k < k_len; ++k) step(k);
}

// What a tile of for_each_row_tile prefetches into L2 while it computes: part `part` of
// `num_parts` of a block's k range (of `block` in this weight, or in the next GEMM's weight
// where `next_weight`), none where block < 0.
struct Prefetch {
  int64_t block = -1;
  bool next_weight = false;
  int64_t part = 0, num_parts = 1;
  // The first and past-the-last k (or k pair) of `len` this tile prefetches.
  int64_t begin(int64_t len) const { return part * len / num_parts; }
  int64_t end(int64_t len) const { return (part + 1) * len / num_parts; }
};

// The first block of `num_blocks` that at::parallel_for(0, num_blocks, 1, ...) gives torch's
// thread `tid` (ATen's OpenMP split: even chunks in thread order), or -1 if it gets none.
inline int64_t first_block_of(int64_t tid, int64_t num_blocks) {
  const int64_t tasks = std::min<int64_t>(at::get_num_threads(), num_blocks);
  if (tasks <= 0) return -1;
  const int64_t chunk = (num_blocks + tasks - 1) / tasks;
  return tid * chunk < num_blocks ? tid * chunk : -1;
}

// The walk of a GEMM over a weight packed in blocks of outputs (cpu_gemm.cpp's fp32 decode
// GEMM, cpu_screen.cpp's bf16 screen): blocks shared out over torch's threads, in order within
// each; a block's m rows in the fewest tiles of at most max_rows, as even as they go (a short
// tail tile re-read its block from L2 for little work). run(block, first_row, rows, prefetch):
// a block's tiles share out the prefetch of the thread's next block, so that memory streams
// all through the block's compute. A thread's last block prefetches its first block of the
// next GEMM (`next_num_blocks` > 0: the weight a caller runs next on these threads): that
// block had waited on memory at the start of every GEMM.
template <typename Run>
void for_each_row_tile(int64_t m, int64_t num_blocks, int64_t max_rows, const Run& run,
                       int64_t next_num_blocks = 0) {
  const int64_t num_tiles = (m + max_rows - 1) / max_rows;
  at::parallel_for(0, num_blocks, 1, [&](int64_t begin, int64_t end) {
    const int64_t next_first =
        next_num_blocks > 0 ? first_block_of(at::get_thread_num(), next_num_blocks) : -1;
    for (int64_t b = begin; b < end; ++b)
      for (int64_t t = 0; t < num_tiles; ++t) {
        const int64_t r0 = t * m / num_tiles;
        Prefetch p{b + 1 < end ? b + 1 : next_first, b + 1 >= end, t, num_tiles};
        run(b, r0, (t + 1) * m / num_tiles - r0, p);
      }
  });
}
