// y = x @ W^T for W held as a checkpoint's own quantized groups: 32 consecutive input columns of one output row
// share a float32 scale (and, for 4 bits, a minimum), W[n, k] = q[n, k] * scale[n, k / 32] + minimum[n, k / 32].
// Sums are float32, so the result is the dequantized matrix's product within float32 rounding (many rows) or the
// int16 activation rounding (few rows; a relative 2e-5 of the largest output).
//
// Why our own: torch's CPU int4/int8 kernels take bfloat16 scales (a 2^-8 error shared by a whole group, the main
// drift from the float32 reference) and, without AVX512-BF16, run only bfloat16 activations at speed; float32
// ones fall to a scalar loop 20-100x slower.
//
// Two paths. Up to 12 rows (decode): activations are quantized to int16 per group (below) and each weight group,
// widened to int16 once, is multiplied into every row with madd, so a step reads the 4-bit bytes once. More rows
// (batched decode, prefill): tiles of weight rows are dequantized into a cache-sized buffer and multiplied by
// torch's float32 GEMM.
//
// Layouts: 4 bits: uint8 [N, K / 2], ggml's block layout (byte j of a group holds value j in its low nibble and
// value j + 16 in its high one). 8 bits: int8 [N, K]. scale, minimum: float32 [N, K / 32].

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/core/InferenceMode.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define GROUP_GEMM_AVX2 1
#endif

namespace {

constexpr int64_t kGroup = 32;
constexpr int64_t kFusedRows = 12;  // more rows than this take the tiled float path (measured crossover)

// Activations as int16 per group of 32 (scale = the group's largest magnitude / 32767, a relative error of at most
// 1.5e-5 of that magnitude, between float16's and float32's), so that one madd multiplies 16 weights: about a third
// of the instructions of dequantizing to float. Their float sums are kept for the minimum's term.
struct QuantizedRows {
  std::vector<int16_t> q;  // [M, K]
  std::vector<float> scale;  // [M, K / 32]
  std::vector<float> sum;    // [M, K / 32]
};

QuantizedRows quantize_rows(const float* x, int64_t M, int64_t K) {
  const int64_t groups = K / kGroup;
  QuantizedRows out{std::vector<int16_t>(M * K), std::vector<float>(M * groups), std::vector<float>(M * groups)};
  at::parallel_for(0, M * groups, 64, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const float* v = x + (i / groups) * K + (i % groups) * kGroup;
      float amax = 0.0f, sum = 0.0f;
      for (int j = 0; j < kGroup; ++j) {
        amax = std::max(amax, std::fabs(v[j]));
        sum += v[j];
      }
      const float scale = amax > 0.0f ? amax / 32767.0f : 1.0f, inverse = 1.0f / scale;
      int16_t* q = out.q.data() + (i / groups) * K + (i % groups) * kGroup;
      for (int j = 0; j < kGroup; ++j) q[j] = static_cast<int16_t>(std::lrintf(v[j] * inverse));
      out.scale[i] = scale;
      out.sum[i] = sum;
    }
  });
  return out;
}

#ifdef GROUP_GEMM_AVX2
inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}
#endif

constexpr int64_t group_bytes(int bits) { return bits == 4 ? kGroup / 2 : kGroup; }

// R rows of x (quantized) against weight row n: y[r * ldy] for r < R.
template <int Bits, int R>
void dot_rows(const int16_t* xq, const float* xs, const float* xd, int64_t K, const uint8_t* q, const float* scale,
              const float* minimum, float* y, int64_t ldy) {
  const int64_t groups = K / kGroup;
#ifdef GROUP_GEMM_AVX2
  __m256 acc[R][2];  // two chains per row, alternating groups: one would wait on the FMA's latency
  for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
  for (int64_t g = 0; g < groups; ++g) {
    __m256i w0, w1;  // the group's values 0..15 and 16..31 as int16
    if constexpr (Bits == 4) {
      const __m128i packed = _mm_loadu_si128(reinterpret_cast<const __m128i*>(q + g * 16));
      const __m128i mask = _mm_set1_epi8(0x0F);
      w0 = _mm256_cvtepu8_epi16(_mm_and_si128(packed, mask));
      w1 = _mm256_cvtepu8_epi16(_mm_and_si128(_mm_srli_epi16(packed, 4), mask));
    } else {
      w0 = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q + g * 32)));
      w1 = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q + g * 32 + 16)));
    }
    const __m256 d = _mm256_broadcast_ss(scale + g);
    for (int r = 0; r < R; ++r) {
      const int16_t* xr = xq + r * K + g * kGroup;
      const __m256i x0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xr));
      const __m256i x1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xr + 16));
      const __m256i sum = _mm256_add_epi32(_mm256_madd_epi16(w0, x0), _mm256_madd_epi16(w1, x1));
      const __m256 scaled = _mm256_mul_ps(d, _mm256_broadcast_ss(xd + r * groups + g));
      acc[r][g & 1] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sum), scaled, acc[r][g & 1]);
    }
  }
  for (int r = 0; r < R; ++r) {
    __m256 total = _mm256_add_ps(acc[r][0], acc[r][1]);
    float tail = 0.0f;
    if (minimum) {  // sum over groups of minimum * (the group's sum of x)
      const float* xsr = xs + r * groups;
      int64_t g = 0;
      for (; g + 8 <= groups; g += 8)
        total = _mm256_fmadd_ps(_mm256_loadu_ps(minimum + g), _mm256_loadu_ps(xsr + g), total);
      for (; g < groups; ++g) tail += minimum[g] * xsr[g];
    }
    y[r * ldy] = hsum(total) + tail;
  }
#else
  for (int r = 0; r < R; ++r) {
    float total = 0.0f;
    for (int64_t g = 0; g < groups; ++g) {
      int32_t sum = 0;
      for (int j = 0; j < kGroup; ++j) {
        int32_t w;
        if constexpr (Bits == 4) {
          w = j < 16 ? (q[g * 16 + j] & 0x0F) : (q[g * 16 + j - 16] >> 4);
        } else {
          w = static_cast<int8_t>(q[g * 32 + j]);
        }
        sum += w * xq[r * K + g * kGroup + j];
      }
      total += static_cast<float>(sum) * scale[g] * xd[r * groups + g];
      if (minimum) total += minimum[g] * xs[r * groups + g];
    }
    y[r * ldy] = total;
  }
#endif
}

template <int Bits>
void gemm(const QuantizedRows& x, int64_t M, const uint8_t* q, const float* scale, const float* minimum, int64_t N,
          int64_t K, float* y) {
  const int64_t groups = K / kGroup, row_bytes = groups * group_bytes(Bits);
  at::parallel_for(0, N, 16, [&](int64_t begin, int64_t end) {
    for (int64_t n = begin; n < end; ++n) {  // at most kFusedRows rows of x: they stay in L1 while the weights pass
      const uint8_t* qn = q + n * row_bytes;
      const float* sn = scale + n * groups;
      const float* mn = minimum ? minimum + n * groups : nullptr;
      for (int64_t m = 0; m < M; m += 4) {
        const int16_t* xq = x.q.data() + m * K;
        const float* xs = x.sum.data() + m * groups;
        const float* xd = x.scale.data() + m * groups;
        float* out = y + m * N + n;
        switch (std::min<int64_t>(4, M - m)) {
          case 1: dot_rows<Bits, 1>(xq, xs, xd, K, qn, sn, mn, out, N); break;
          case 2: dot_rows<Bits, 2>(xq, xs, xd, K, qn, sn, mn, out, N); break;
          case 3: dot_rows<Bits, 3>(xq, xs, xd, K, qn, sn, mn, out, N); break;
          default: dot_rows<Bits, 4>(xq, xs, xd, K, qn, sn, mn, out, N); break;
        }
      }
    }
  });
}

// One weight row -> K floats.
template <int Bits>
void dequantize_row(const uint8_t* q, const float* scale, const float* minimum, int64_t K, float* out) {
  for (int64_t g = 0; g < K / kGroup; ++g) {
    const float d = scale[g], m = minimum ? minimum[g] : 0.0f;
    const uint8_t* qg = q + g * group_bytes(Bits);
    float* o = out + g * kGroup;
#ifdef GROUP_GEMM_AVX2
    const __m256 dv = _mm256_set1_ps(d), mv = _mm256_set1_ps(m);
    if constexpr (Bits == 4) {
      const __m128i packed = _mm_loadu_si128(reinterpret_cast<const __m128i*>(qg));
      const __m128i mask = _mm_set1_epi8(0x0F);
      const __m128i lo = _mm_and_si128(packed, mask), hi = _mm_and_si128(_mm_srli_epi16(packed, 4), mask);
      const __m128i parts[4] = {lo, _mm_srli_si128(lo, 8), hi, _mm_srli_si128(hi, 8)};
      for (int i = 0; i < 4; ++i)
        _mm256_storeu_ps(o + 8 * i, _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(parts[i])), dv, mv));
    } else {
      for (int i = 0; i < 4; ++i) {
        const __m128i v = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(qg + 8 * i));
        _mm256_storeu_ps(o + 8 * i, _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(v)), dv, mv));
      }
    }
#else
    for (int j = 0; j < kGroup; ++j) {
      const int v = Bits == 4 ? (j < 16 ? (qg[j] & 0x0F) : (qg[j - 16] >> 4)) : static_cast<int8_t>(qg[j]);
      o[j] = static_cast<float>(v) * d + m;
    }
#endif
  }
}

// Many rows: tiles of weight rows dequantized into a cache-sized float buffer, each multiplied by torch's own
// float32 GEMM (single-threaded inside this parallel loop), so prefill runs at the dense kernel's speed without a
// float copy of the matrix.
template <int Bits>
void gemm_tiled(const at::Tensor& x, const uint8_t* q, const float* scale, const float* minimum, int64_t N,
                at::Tensor& y) {
  const int64_t K = x.size(1), groups = K / kGroup, row_bytes = groups * group_bytes(Bits);
  const int64_t tile = std::max<int64_t>(16, std::min<int64_t>(128, (int64_t{1} << 15) / K / 16 * 16));
  const int64_t tiles = (N + tile - 1) / tile;
  at::parallel_for(0, tiles, 1, [&](int64_t begin, int64_t end) {
    // the caller's inference mode is thread-local: without it here, mm_out into y (an inference tensor) is refused
    c10::InferenceMode inference;
    at::Tensor buffer = at::empty({tile, K}, x.options());
    float* w = buffer.data_ptr<float>();
    for (int64_t t = begin; t < end; ++t) {
      const int64_t n0 = t * tile, rows = std::min(tile, N - n0);
      for (int64_t r = 0; r < rows; ++r) {
        const int64_t n = n0 + r;
        dequantize_row<Bits>(q + n * row_bytes, scale + n * groups, minimum ? minimum + n * groups : nullptr, K,
                             w + r * K);
      }
      at::Tensor out = y.narrow(1, n0, rows);
      at::mm_out(out, x, buffer.narrow(0, 0, rows).t());
    }
  });
}

at::Tensor group_linear(const at::Tensor& x, const at::Tensor& q, const at::Tensor& scale,
                        const c10::optional<at::Tensor>& minimum, int64_t bits) {
  TORCH_CHECK(bits == 4 || bits == 8, "group_linear: bits must be 4 or 8");
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat, "group_linear: x must be float32 [M, K]");
  TORCH_CHECK(scale.scalar_type() == at::kFloat && scale.dim() == 2, "group_linear: scale must be float32 [N, K/32]");
  const int64_t M = x.size(0), K = x.size(1), N = scale.size(0);
  TORCH_CHECK(K % kGroup == 0 && scale.size(1) == K / kGroup, "group_linear: K must be whole groups of 32");
  TORCH_CHECK(q.size(0) == N && q.size(1) == (bits == 4 ? K / 2 : K) && q.element_size() == 1,
              "group_linear: q has the wrong shape");
  const float* mn = nullptr;
  at::Tensor min_c;
  if (minimum.has_value() && minimum->defined()) {
    TORCH_CHECK(minimum->sizes() == scale.sizes() && minimum->scalar_type() == at::kFloat,
                "group_linear: minimum must match scale");
    min_c = minimum->contiguous();
    mn = min_c.data_ptr<float>();
  }
  const at::Tensor xc = x.contiguous(), qc = q.contiguous(), sc = scale.contiguous();
  at::Tensor y = at::empty({M, N}, x.options());
  if (M == 0) return y;
  const auto* qp = static_cast<const uint8_t*>(qc.data_ptr());
  const float* xp = xc.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  if (M > kFusedRows) {
    if (bits == 4) gemm_tiled<4>(xc, qp, sc.data_ptr<float>(), mn, N, y);
    else gemm_tiled<8>(xc, qp, sc.data_ptr<float>(), mn, N, y);
    return y;
  }
  const QuantizedRows rows = quantize_rows(xp, M, K);
  if (bits == 4) gemm<4>(rows, M, qp, sc.data_ptr<float>(), mn, N, K, yp);
  else gemm<8>(rows, M, qp, sc.data_ptr<float>(), mn, N, K, yp);
  return y;
}

}  // namespace

TORCH_LIBRARY(llmserve_kernels, m) {
  m.def("group_linear(Tensor x, Tensor q, Tensor scale, Tensor? minimum, int bits) -> Tensor");
}

TORCH_LIBRARY_IMPL(llmserve_kernels, CPU, m) { m.impl("group_linear", &group_linear); }
