// Decode attention over the paged KV cache on CPU: one query per sequence, keys and values read in place through
// the block table (no gathered copy), float32 products and sums whatever the cache's dtype (float32, bfloat16 or
// float16).
//
// Why our own: inductor's code for the traced version (a gather, a masked softmax and two reductions over the
// padded block table) took ~70 us per layer for one sequence of ~200 tokens, 2 ms of a 14 ms step here; torch's
// SDPA needs the context gathered into a padded batch first.
//
// The work is split by sequence and by runs of whole blocks (split-K, as flash-decoding does), so that one
// sequence still keeps every thread busy and each thread streams contiguous blocks, all heads of a token row at
// once: the cache is read from memory once per step (it does not stay in cache behind the weights). Each split
// keeps, per head, its running max, its sum of exponentials and its weighted sum of values; the splits of a
// sequence are merged at the end.
//
// q: [B, H, D] float32 or bfloat16; k_cache, v_cache: [N, block_size, KVH, D]; block_tables: [B, max_blocks] int32;
// positions: [B] int64, each row's own position (it sees keys 0..position, or the last `window` of them).

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/core/InferenceMode.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__) && defined(__F16C__))
#include <immintrin.h>
#endif

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

namespace {

inline float to_float(float x) { return x; }
inline float to_float(c10::BFloat16 x) {
  uint32_t bits = static_cast<uint32_t>(x.x) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}
inline float to_float(c10::Half x) { return static_cast<float>(x); }

// one cache row (D values) as float32, so the dot products and sums below vectorize on plain floats
template <typename T>
inline const float* as_float(const T* row, float* scratch, int64_t d) {
  if constexpr (std::is_same_v<T, float>) {
    return row;
  } else {
#pragma omp simd
    for (int64_t i = 0; i < d; ++i) scratch[i] = to_float(row[i]);
    return scratch;
  }
}

// exp(x) for x <= 0 (a score minus its row's max), vectorizable in a simd loop: 2^n * p(r) with x = n ln2 + r,
// |r| <= ln2 / 2, and a degree-6 polynomial (relative error ~2e-7, below float32's own rounding of the scores)
inline float exp_nonpositive(float x) {
  x = std::max(x, -87.f);  // below it exp underflows to 0 in float32 anyway
  const float n = std::nearbyint(x * 1.44269504088896341f);
  const float r = x - n * 0.693145751953125f - n * 1.428606765330187045e-06f;
  float p = 1.f / 720;
  p = p * r + 1.f / 120;
  p = p * r + 1.f / 24;
  p = p * r + 1.f / 6;
  p = p * r + 0.5f;
  p = p * r + 1.f;
  p = p * r + 1.f;
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof scale);
  return p * scale;
}

inline float dot(const float* a, const float* b, int64_t d) {
  float sum = 0.f;
#pragma omp simd reduction(+ : sum)
  for (int64_t i = 0; i < d; ++i) sum += a[i] * b[i];
  return sum;
}

struct Split {  // what one split of a sequence leaves per head: max score, sum of exp, weighted values [D]
  float* max;
  float* total;
  float* acc;
};

// The exponentials of one head's scores (in place), their max and their sum.
inline void softmax_terms(float* scores, int64_t n, float& top, float& total) {
  top = -std::numeric_limits<float>::infinity();
  for (int64_t i = 0; i < n; ++i) top = std::max(top, scores[i]);
  float sum = 0.f;
#pragma omp simd reduction(+ : sum)
  for (int64_t i = 0; i < n; ++i) {
    scores[i] = exp_nonpositive(scores[i] - top);
    sum += scores[i];
  }
  total = sum;
}

#ifdef __AVX512F__
// 16 floats per register
struct Vec {
  using V = __m512;
  static constexpr int64_t kWidth = 16;
  static constexpr int kMaxChunks = 16;  // 32 registers: D up to 256
  static constexpr int kRegisters = 32;
  static V load(const float* p) { return _mm512_loadu_ps(p); }
  static V load(const c10::Half* p) { return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))); }
  static V load(const c10::BFloat16* p) {
    const __m512i wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
    return _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
  }
  static V zero() { return _mm512_setzero_ps(); }
  static V broadcast(float x) { return _mm512_set1_ps(x); }
  static V mul(V a, V b) { return _mm512_mul_ps(a, b); }
  static V fmadd(V a, V b, V c) { return _mm512_fmadd_ps(a, b, c); }
  static void store(float* p, V v) { _mm512_storeu_ps(p, v); }
  static float sum(V v) { return _mm512_reduce_add_ps(v); }
};
#define PAGED_ATTENTION_VECTOR 1
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
// 8 floats per register, for CPUs without AVX512 (Zen 3, older Xeons): there the generic loop below ran 16
// sequences of ~220 tokens at 2.0 ms per layer (float16 cache, hot: a scalar conversion per value), this at 0.26
struct Vec {
  using V = __m256;
  static constexpr int64_t kWidth = 8;
  static constexpr int kMaxChunks = 16;  // 16 registers: D up to 128
  static constexpr int kRegisters = 16;
  static V load(const float* p) { return _mm256_loadu_ps(p); }
  static V load(const c10::Half* p) { return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }
  static V load(const c10::BFloat16* p) {
    const __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    return _mm256_castsi256_ps(_mm256_slli_epi32(wide, 16));
  }
  static V zero() { return _mm256_setzero_ps(); }
  static V broadcast(float x) { return _mm256_set1_ps(x); }
  static V mul(V a, V b) { return _mm256_mul_ps(a, b); }
  static V fmadd(V a, V b, V c) { return _mm256_fmadd_ps(a, b, c); }
  static void store(float* p, V v) { _mm256_storeu_ps(p, v); }
  static float sum(V v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
  }
};
#define PAGED_ATTENTION_VECTOR 1
#endif

#ifdef PAGED_ATTENTION_VECTOR
// One split of one sequence with D = C vector registers, each KV head's rows loaded into registers once for the
// query heads that share it (GQA): keys, then the exponentials, then values with the output rows held in
// registers. The generic loop below read every row through a float copy and kept its sums in memory, 5-8x slower
// (AVX512, 16 sequences of ~220 tokens: 251 us per layer, hot).
template <typename T, int C>
void split_vector(const float* query, const T* kp, const T* vp, const int32_t* table, int64_t block_size,
                  int64_t row_stride, int64_t KVH, int64_t group, int64_t first, int64_t stop, float* scores,
                  const Split& part) {
  using V = Vec::V;
  constexpr int64_t W = Vec::kWidth, D = W * C;
  const int64_t n = stop - first;
  // each token's row offset, walked once through the block table: computed at every row read instead (a 64-bit
  // division and remainder each, ~14 per token), one layer of 16 sequences x ~170 tokens took 131-163 us against
  // 112-116 (Intel Xeon, float16 cache, hot, four alternating runs)
  thread_local std::vector<int64_t> offsets;
  offsets.resize(static_cast<size_t>(n));
  for (int64_t t = first, block = first / block_size, slot = first % block_size; t < stop; ++t) {
    offsets[t - first] = (static_cast<int64_t>(table[block]) * block_size + slot) * row_stride;
    if (++slot == block_size) slot = 0, ++block;
  }
  const int64_t* offset = offsets.data();  // a plain pointer: the vector is thread_local, reached through TLS
  auto row_at = [offset, first](const T* cache, int64_t t, int64_t kvh) {
    return cache + offset[t - first] + kvh * D;
  };
  // the first pass over a sequence's rows reads them from memory, in blocks scattered over the pool: fetch whole
  // rows (all KV heads) a block ahead. Measured with the cache flushed (Zen 5, 16 x 220 tokens): 309-333 us
  // against 336 without, within that machine's noise; 6 or 32 tokens ahead did no better
  constexpr int64_t kAhead = 16;
  auto prefetch_row = [&](const T* cache, int64_t t) {
    const char* row = reinterpret_cast<const char*>(row_at(cache, t, 0));
    for (int64_t byte = 0; byte < row_stride * static_cast<int64_t>(sizeof(T)); byte += 64)
      _mm_prefetch(row + byte, _MM_HINT_T0);
  };
  for (int64_t kvh = 0; kvh < KVH; ++kvh) {
    const float* q = query + kvh * group * D;
    float* s = scores + kvh * group * n;  // [group, n]
    for (int64_t t = first; t < stop; ++t) {
      if (kvh == 0 && t + kAhead < stop) prefetch_row(kp, t + kAhead);
      const T* k = row_at(kp, t, kvh);
      V kc[C];
      for (int c = 0; c < C; ++c) kc[c] = Vec::load(k + W * c);
      for (int64_t g = 0; g < group; ++g) {
        const float* qg = q + g * D;
        V acc = Vec::mul(Vec::load(qg), kc[0]);
        for (int c = 1; c < C; ++c) acc = Vec::fmadd(Vec::load(qg + W * c), kc[c], acc);
        s[g * n + (t - first)] = Vec::sum(acc);
      }
    }
    for (int64_t g = 0; g < group; ++g) {
      const int64_t h = kvh * group + g;
      softmax_terms(s + g * n, n, part.max[h], part.total[h]);
    }
    // the values: G query heads of the group at a time, so that each value row is loaded (and converted from
    // 16 bits) once for all of them, not once per head: 112-116 -> 102-104 us for the layer above
    auto values = [&](int64_t g0, auto heads) {
      constexpr int G = decltype(heads)::value;
      V o[G][C];
      for (int j = 0; j < G; ++j)
        for (int c = 0; c < C; ++c) o[j][c] = Vec::zero();
      const float* p = s + g0 * n;
      for (int64_t t = first; t < stop; ++t) {
        if (kvh == 0 && g0 == 0 && t + kAhead < stop) prefetch_row(vp, t + kAhead);
        const T* v = row_at(vp, t, kvh);
        V vc[C];
        for (int c = 0; c < C; ++c) vc[c] = Vec::load(v + W * c);
        for (int j = 0; j < G; ++j) {
          const V w = Vec::broadcast(p[j * n + (t - first)]);
          for (int c = 0; c < C; ++c) o[j][c] = Vec::fmadd(w, vc[c], o[j][c]);
        }
      }
      for (int j = 0; j < G; ++j)
        for (int c = 0; c < C; ++c) Vec::store(part.acc + (kvh * group + g0 + j) * D + W * c, o[j][c]);
    };
    constexpr int S = std::max(1, std::min(4, (Vec::kRegisters - 2) / C - 1));  // G x C sums, C values, a weight
    int64_t g = 0;
    for (; g + S <= group; g += S) values(g, std::integral_constant<int, S>{});
    switch (group - g) {
      case 3: if constexpr (S > 3) values(g, std::integral_constant<int, 3>{}); break;
      case 2: if constexpr (S > 2) values(g, std::integral_constant<int, 2>{}); break;
      case 1: if constexpr (S > 1) values(g, std::integral_constant<int, 1>{}); break;
      default: break;
    }
  }
}

template <typename T>
using SplitKernel = void (*)(const float*, const T*, const T*, const int32_t*, int64_t, int64_t, int64_t, int64_t,
                             int64_t, int64_t, float*, const Split&);

template <typename T, int C>
constexpr SplitKernel<T> kernel_of() {
  if constexpr (C <= Vec::kMaxChunks) {
    return split_vector<T, C>;
  } else {
    return nullptr;
  }
}

// the head sizes of the model families we run
template <typename T>
SplitKernel<T> vector_kernel(int64_t D) {
  if (D % Vec::kWidth != 0) return nullptr;
  switch (D / Vec::kWidth) {
    case 1: return kernel_of<T, 1>();
    case 2: return kernel_of<T, 2>();
    case 3: return kernel_of<T, 3>();
    case 4: return kernel_of<T, 4>();
    case 5: return kernel_of<T, 5>();
    case 6: return kernel_of<T, 6>();
    case 8: return kernel_of<T, 8>();
    case 10: return kernel_of<T, 10>();
    case 12: return kernel_of<T, 12>();
    case 16: return kernel_of<T, 16>();
    default: return nullptr;
  }
}
#endif

template <typename T>
void decode(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache, const at::Tensor& tables,
            const at::Tensor& positions, double scale, int64_t window, at::Tensor& out) {
  const int64_t B = q.size(0), H = q.size(1), D = q.size(2);
  const int64_t block_size = k_cache.size(1), KVH = k_cache.size(2), max_blocks = tables.size(1);
  const int64_t group = H / KVH, row_stride = KVH * D;
  const float* qp = q.data_ptr<float>();
  const int64_t q_row = q.stride(0), q_head = q.stride(1);  // q is often a view into the fused qkv projection
  const T* kp = k_cache.data_ptr<T>();
  const T* vp = v_cache.data_ptr<T>();
  const int32_t* tp = tables.data_ptr<int32_t>();
  const int64_t* pp = positions.data_ptr<int64_t>();
  float* op = out.data_ptr<float>();

  // splits per sequence: enough tasks for every thread (a few each), never less than 2 blocks per split
  int64_t longest = 1;
  for (int64_t b = 0; b < B; ++b) longest = std::max(longest, pp[b] + 1);
  const int64_t blocks = (longest + block_size - 1) / block_size;
  const int64_t wanted = (2 * at::get_num_threads() + B - 1) / B;
  const int64_t splits = std::max<int64_t>(1, std::min(wanted, blocks / 2));
  const int64_t blocks_per_split = (blocks + splits - 1) / splits;
  std::vector<float> partial(static_cast<size_t>(B * splits * H * (D + 2)));
  auto split_of = [&](int64_t b, int64_t s) {
    float* base = partial.data() + (b * splits + s) * H * (D + 2);
    return Split{base, base + H, base + 2 * H};
  };

#ifdef PAGED_ATTENTION_VECTOR
  const SplitKernel<T> fast = vector_kernel<T>(D);
#endif
  at::parallel_for(0, B * splits, 1, [&](int64_t begin, int64_t end) {
    c10::InferenceMode guard;  // thread-local: the pool's threads do not inherit it
    std::vector<float> query(H * D), scores, k_row(D), v_row(D);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t b = task / splits, s = task % splits;
      const int64_t last = pp[b];
      const int64_t first = std::max(window > 0 ? last - window + 1 : 0, s * blocks_per_split * block_size);
      const int64_t stop = std::min(last + 1, (s + 1) * blocks_per_split * block_size);
      Split part = split_of(b, s);
      if (first >= stop) {  // nothing of this sequence falls in this split
        std::fill(part.max, part.max + H, -std::numeric_limits<float>::infinity());
        std::fill(part.total, part.total + H, 0.f);
        std::fill(part.acc, part.acc + H * D, 0.f);
        continue;
      }
      const int64_t n = stop - first;
      for (int64_t h = 0; h < H; ++h)
        for (int64_t i = 0; i < D; ++i) query[h * D + i] = qp[b * q_row + h * q_head + i] * static_cast<float>(scale);
      scores.resize(static_cast<size_t>(H * n));
      const int32_t* table = tp + b * max_blocks;
#ifdef PAGED_ATTENTION_VECTOR
      if (fast != nullptr) {
        fast(query.data(), kp, vp, table, block_size, row_stride, KVH, group, first, stop, scores.data(), part);
        continue;
      }
#endif
      for (int64_t t = first; t < stop; ++t) {
        const T* row = kp + (static_cast<int64_t>(table[t / block_size]) * block_size + t % block_size) * row_stride;
        for (int64_t kvh = 0; kvh < KVH; ++kvh) {
          const float* k = as_float(row + kvh * D, k_row.data(), D);
          for (int64_t h = kvh * group; h < (kvh + 1) * group; ++h)
            scores[h * n + (t - first)] = dot(query.data() + h * D, k, D);
        }
      }
      for (int64_t h = 0; h < H; ++h) softmax_terms(scores.data() + h * n, n, part.max[h], part.total[h]);
      std::fill(part.acc, part.acc + H * D, 0.f);
      for (int64_t t = first; t < stop; ++t) {
        const T* row = vp + (static_cast<int64_t>(table[t / block_size]) * block_size + t % block_size) * row_stride;
        for (int64_t kvh = 0; kvh < KVH; ++kvh) {
          const float* v = as_float(row + kvh * D, v_row.data(), D);
          for (int64_t h = kvh * group; h < (kvh + 1) * group; ++h) {
            const float p = scores[h * n + (t - first)];
            float* acc = part.acc + h * D;
#pragma omp simd
            for (int64_t i = 0; i < D; ++i) acc[i] += p * v[i];
          }
        }
      }
    }
  });

  for (int64_t b = 0; b < B; ++b) {
    for (int64_t h = 0; h < H; ++h) {
      float top = -std::numeric_limits<float>::infinity();
      for (int64_t s = 0; s < splits; ++s) top = std::max(top, split_of(b, s).max[h]);
      float* o = op + (b * H + h) * D;
      std::fill(o, o + D, 0.f);
      float total = 0.f;
      for (int64_t s = 0; s < splits; ++s) {
        const Split part = split_of(b, s);
        if (part.total[h] == 0.f) continue;
        const float w = std::exp(part.max[h] - top);
        total += w * part.total[h];
        const float* acc = part.acc + h * D;
        for (int64_t i = 0; i < D; ++i) o[i] += w * acc[i];
      }
      const float inv = 1.f / total;
      for (int64_t i = 0; i < D; ++i) o[i] *= inv;
    }
  }
}

at::Tensor paged_decode_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                                  const at::Tensor& block_tables, const at::Tensor& positions, double scale,
                                  int64_t window) {
  TORCH_CHECK(q.dim() == 3 && k_cache.dim() == 4 && v_cache.sizes() == k_cache.sizes(), "bad shapes");
  TORCH_CHECK(q.size(2) == k_cache.size(3) && q.size(1) % k_cache.size(2) == 0, "q does not match the cache");
  TORCH_CHECK(block_tables.dim() == 2 && block_tables.size(0) == q.size(0) && positions.numel() == q.size(0),
              "one block table row and one position per query row");
  TORCH_CHECK(block_tables.scalar_type() == at::kInt && positions.scalar_type() == at::kLong, "index dtypes");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "the cache must be contiguous");
  TORCH_CHECK(v_cache.scalar_type() == k_cache.scalar_type(), "k_cache and v_cache differ in dtype");
  const at::Tensor q32 = q.stride(2) == 1 ? q.to(at::kFloat) : q.to(at::kFloat).contiguous();
  const at::Tensor tables = block_tables.contiguous(), pos = positions.contiguous();
  at::Tensor out = at::empty(q.sizes(), q.options().dtype(at::kFloat));
  if (q.size(0) == 0) return out.to(q.scalar_type());
  switch (k_cache.scalar_type()) {
    case at::kFloat:
      decode<float>(q32, k_cache, v_cache, tables, pos, scale, window, out);
      break;
    case at::kBFloat16:
      decode<c10::BFloat16>(q32, k_cache, v_cache, tables, pos, scale, window, out);
      break;
    case at::kHalf:
      decode<c10::Half>(q32, k_cache, v_cache, tables, pos, scale, window, out);
      break;
    default:
      TORCH_CHECK(false, "paged_decode_attention: the cache must be float32, bfloat16 or float16");
  }
  return out.to(q.scalar_type());
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(llmserve_kernels, m) {
  m.def(
      "paged_decode_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_tables, Tensor positions, "
      "float scale, int window) -> Tensor");
}

TORCH_LIBRARY_IMPL(llmserve_kernels, CPU, m) { m.impl("paged_decode_attention", &paged_decode_attention); }
