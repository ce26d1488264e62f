// y = x @ W^T for W held as a checkpoint's own quantized groups: 32 consecutive input columns of one output row
// share a scale (and, for 4 bits, a minimum), W[n, k] = q[n, k] * scale[n, k / 32] + minimum[n, k / 32].
// Sums are float32, so the result is the dequantized matrix's product within float32 rounding (many rows) or the
// activation rounding of the fused path (int16, a relative 2e-5 of the largest output; 8-bit weights from two rows
// with AVX512-VNNI: int8, as llama.cpp's, about 5e-3). x is float32 or bfloat16, and y takes its dtype; many
// bfloat16 rows multiply the weights rounded to bfloat16 (a relative 2^-9 per weight).
//
// Why our own: torch's CPU int4/int8 kernels take bfloat16 scales (a 2^-8 error shared by a whole group, the main
// drift from the float32 reference) and, without AVX512-BF16, run only bfloat16 activations at speed; float32
// ones fall to a scalar loop 20-100x slower.
//
// Two paths. Up to fused_max_rows() rows (decode; 32 with AVX2, 16 with AVX512-VNNI, 12 in portable C++, fewer
// where gemm_int16 takes over), the fused path: activations are quantized to int16 per group and each weight group,
// made int16 once (widened, or its 4-bit nibbles masked in place), is multiplied into every row with madd (vpdpwssd
// with AVX512-VNNI), so a step reads the 4-bit bytes once; 8-bit weights from kByteRows rows with AVX512-VNNI take
// int8 activations and vpdpbusd instead (up to 64 rows without AMX). More rows (batched decode, prefill): tiles of
// weight rows are dequantized into a cache-sized buffer and multiplied by torch's GEMM; or, where prompts stay
// float32 (neither AVX512-BF16 nor AMX: an Ice Lake, an AVX2 Zen 3), from 4 rows of 4-bit weights with AVX512-VNNI
// (6 with AVX2; 8-bit: 9, 14), unpacked to int16 and multiplied with vpdpwssd or vpmaddwd (gemm_int16; 4-bit
// weights with AVX512-VNNI: the nibbles as bytes against the int16 activations split into two bytes, vpdpbusd,
// gemm_nibble_bytes); on an AMD CPU with AVX512-BF16 (Zen 4, Zen 5), those paths take batched decode (up to 64 rows
// of 4-bit weights) and the prompts beyond multiply in bfloat16 (gemm_brgemm: the weights dequantized into the VNNI pairs of oneDNN's brgemm micro-kernel,
// which writes float32 sums straight into y). 8-bit weights from 9 rows to 128 with AVX512-VNNI and no AMX take
// the fused path's int8 activations against weight tiles transposed per call for vpdpbusd (gemm_int8). With AMX a
// third takes 6 to 48 rows (batched decode): the weights
// dequantized to bfloat16 block by block and multiplied on AMX's tiles by oneDNN's brgemm micro-kernel (gemm_amx).
//
// Layouts: 4 bits: uint8 [N, K / 2], ggml's block layout (byte j of a group holds value j in its low nibble and
// value j + 16 in its high one). 8 bits: int8 [N, K]. scale, minimum: float32 or float16 [N, K / 32].

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/native/CPUBlas.h>
#include <c10/core/InferenceMode.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <type_traits>
#include <vector>

#if defined(__AVX2__) && defined(__FMA__)
#include <cpuid.h>
#include <immintrin.h>
#define GROUP_GEMM_AVX2 1
#endif
// AVX512-VNNI: one vpdpwssd multiplies a whole group (32 int16 pairs) and sums pairs, where AVX2 needs two madds
// and an add; half the instructions per group and row
#if defined(GROUP_GEMM_AVX2) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
#define GROUP_GEMM_AVX512 1
#endif

namespace {

constexpr int64_t kGroup = 32;

// A path's switch for benchmarks: on unless the variable is "0" (each caller reads it once)
bool switched_on(const char* name) {
  const char* value = std::getenv(name);
  return value == nullptr || std::strcmp(value, "0") != 0;
}

// LLMSERVE_AMX=0 runs as on a CPU without AMX (benchmarks of those paths on a machine that has it)
bool amx_allowed() {
  static const bool allowed = switched_on("LLMSERVE_AMX");
  return allowed;
}

// Activations as int16 per group of 32 (scale = the group's largest magnitude / 32767, a relative error of at most
// 1.5e-5 of that magnitude, between float16's and float32's), so that one madd multiplies 16 weights: about a third
// of the instructions of dequantizing to float. Their float sums are kept for the minimum's term.
//
// The other layouts take two groups (g, g + 1) or four per pass, in the order the weights unpack to, each group's
// scale repeated over the int32 lanes its sums land in; a row is padded with zeros to whole passes.
// - Paired512 (AVX512): [g 0..15, g+1 0..15, g 16..31, g+1 16..31], the order 32 bytes widen to; scales 8 times.
// - NibbleWords (AVX2, 4 bits): the 32 packed bytes of the pair read as 16-bit words, word i holding bytes 2i and
//   2i + 1, so that masking each word's four nibbles in place gives four int16 vectors without the two lane-crossing
//   widenings per group of the plain layout: [value 2i], [2i + 16], [2i + 1], [2i + 17] for i = 0..7, group g in
//   the low 8 lanes of each and g + 1 in the high 8; scales 4 times.
// - NibbleQuads (AVX512, 4 bits): the same for four groups (g .. g + 3) and their 64 packed bytes, group g + i in
//   lanes 8i .. 8i + 7 of each of the four vectors; scales 4 times.
enum class Layout { Plain, Paired512, NibbleWords, NibbleQuads };

struct QuantizedRows {
  Layout layout;
  std::vector<int16_t> q;  // [M, ldq]
  std::vector<float> scale;  // [M, ldd]
  std::vector<float> sum;    // [M, K / 32]
  int64_t ldq, ldd;
};

#ifdef GROUP_GEMM_AVX512
constexpr int64_t kFusedRows = 16;  // more rows than this take the tiled path (measured crossover)
constexpr int64_t kRowsPerPass = 8;  // 32 vector registers: 8 rows' sums and the weights
#else
#ifdef GROUP_GEMM_AVX2
// AVX2 (Zen 3, 2 threads): 16 rows ran 2.5-3x faster here than the tiled float32 path, 32 rows 1.3-2x; from
// 48 rows the two were level
constexpr int64_t kFusedRows = 32;
#else
constexpr int64_t kFusedRows = 12;  // the portable loops: torch's GEMM takes over early
#endif
constexpr int64_t kRowsPerPass = 4;
#endif
constexpr int64_t kBlock = 16;  // weight rows per block
// Whether more than kFusedRows float32 rows multiply in bfloat16: where the CPU's bfloat16 GEMM beats float32's.
// On AMD's AVX512-BF16 (Zen 4, Zen 5) oneDNN's bfloat16 GEMM ran prompts at twice float32's speed; on an Intel Xeon
// with AVX512-BF16 but no AMX it ran 256 x 576 x 3072 in 5.9 ms against MKL's 3.75 ms in float32 (one vdpbf16ps
// port against two FMA ones), so there prompts stay float32 unless AMX's tiles are there.
bool bfloat16_prompts() {
#ifdef __AVX512BF16__
  static const bool faster = [] {
    __builtin_cpu_init();
    unsigned a = 0, b = 0, c = 0, d = 0;
    const bool amx_bf16 = __get_cpuid_count(7, 0, &a, &b, &c, &d) && ((d >> 22) & 1);
    return __builtin_cpu_is("amd") || (amx_bf16 && amx_allowed());
  }();
  return faster;
#else
  return false;
#endif
}

// LLMSERVE_BRGEMM=0: float32 prompts through torch's bfloat16 GEMM and a widening copy (benchmarks)
bool brgemm_allowed() {
  static const bool allowed = switched_on("LLMSERVE_BRGEMM");
  return allowed;
}

// Whether float32 rows beyond the fused path's may multiply as int16 with vpdpwssd or vpmaddwd (gemm_int16) rather
// than as dequantized tiles through torch's GEMM; LLMSERVE_INT16_PROMPTS=0 keeps the latter. int16_max_rows() says
// up to how many.
bool int16_allowed() {
#ifdef GROUP_GEMM_AVX2
  static const bool allowed = switched_on("LLMSERVE_INT16_PROMPTS");
  return allowed;
#else
  return false;
#endif
}

// AVX512, 4 bits: quads from kQuadRows rows, where the conversions they save per row outweigh their extra work per
// weight row (at one or two rows, pairs ran 10-15 % faster, in cache; from 8 rows quads 5-15 %; Xeon with VNNI)
constexpr int64_t kQuadRows = 3;

Layout layout_for(int bits, int64_t rows) {
#ifdef GROUP_GEMM_AVX512
  return bits == 4 && rows >= kQuadRows ? Layout::NibbleQuads : Layout::Paired512;
#elif defined(GROUP_GEMM_AVX2)
  return bits == 4 ? Layout::NibbleWords : Layout::Plain;
#else
  return Layout::Plain;
#endif
}

// One group's 32 values as int16 and its float sum, into row `row` of `layout` at the group's positions; returns
// the group's scale. The rounding is lrintf's (to nearest, ties to even); values are clamped to int16's range
// where float rounding lands past 32767.
#ifdef GROUP_GEMM_AVX512
inline float quantize_group(const float* v, Layout layout, int64_t g, int16_t* row, float& sum) {
  const __m512 a = _mm512_loadu_ps(v), b = _mm512_loadu_ps(v + 16);
  const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(a), _mm512_abs_ps(b)));
  sum = _mm512_reduce_add_ps(_mm512_add_ps(a, b));
  const float scale = amax > 0.0f ? amax / 32767.0f : 1.0f;
  const __m512 inverse = _mm512_set1_ps(amax > 0.0f ? 32767.0f / amax : 1.0f);
  const __m256i low = _mm512_cvtsepi32_epi16(_mm512_cvtps_epi32(_mm512_mul_ps(a, inverse)));
  const __m256i high = _mm512_cvtsepi32_epi16(_mm512_cvtps_epi32(_mm512_mul_ps(b, inverse)));
  if (layout == Layout::NibbleQuads) {
    // value j to vector (j >= 16) + 2 (j % 2), lane (j % 16) / 2 of the group's run of 8 in it
    const __m512i order = _mm512_set_epi16(31, 29, 27, 25, 23, 21, 19, 17, 15, 13, 11, 9, 7, 5, 3, 1,  //
                                           30, 28, 26, 24, 22, 20, 18, 16, 14, 12, 10, 8, 6, 4, 2, 0);
    const __m512i runs = _mm512_permutexvar_epi16(order, _mm512_inserti64x4(_mm512_castsi256_si512(low), high, 1));
    int16_t* base = row + (g / 4) * 128 + (g % 4) * 8;
    _mm_storeu_si128(reinterpret_cast<__m128i*>(base), _mm512_extracti32x4_epi32(runs, 0));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(base + 32), _mm512_extracti32x4_epi32(runs, 1));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(base + 64), _mm512_extracti32x4_epi32(runs, 2));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(base + 96), _mm512_extracti32x4_epi32(runs, 3));
  } else if (layout == Layout::Paired512) {  // the group's two halves at 0 and 32 of its pair's block
    int16_t* base = row + (g / 2) * 64 + (g % 2) * 16;
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(base), low);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(base + 32), high);
  } else {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(row + g * kGroup), low);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(row + g * kGroup + 16), high);
  }
  return scale;
}
#else
inline float quantize_group(const float* v, Layout layout, int64_t g, int16_t* row, float& sum) {
  alignas(32) int16_t v16[kGroup];
#ifdef GROUP_GEMM_AVX2
  const __m256 sign = _mm256_set1_ps(-0.0f);
  __m256 x[4], m = _mm256_setzero_ps(), s = _mm256_setzero_ps();
  for (int i = 0; i < 4; ++i) {
    x[i] = _mm256_loadu_ps(v + 8 * i);
    m = _mm256_max_ps(m, _mm256_andnot_ps(sign, x[i]));
    s = _mm256_add_ps(s, x[i]);
  }
  __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
  m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
  const float amax = _mm_cvtss_f32(_mm_max_ss(m4, _mm_movehdup_ps(m4)));
  __m128 s4 = _mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1));
  s4 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
  sum = _mm_cvtss_f32(_mm_add_ss(s4, _mm_movehdup_ps(s4)));
  const __m256 inverse = _mm256_set1_ps(amax > 0.0f ? 32767.0f / amax : 1.0f);
  for (int i = 0; i < 4; i += 2) {  // packs interleaves 128-bit lanes; the permute puts them back in order
    const __m256i packed = _mm256_packs_epi32(_mm256_cvtps_epi32(_mm256_mul_ps(x[i], inverse)),
                                              _mm256_cvtps_epi32(_mm256_mul_ps(x[i + 1], inverse)));
    _mm256_store_si256(reinterpret_cast<__m256i*>(v16 + 8 * i), _mm256_permute4x64_epi64(packed, 0xD8));
  }
#else
  float amax = 0.0f;
  sum = 0.0f;
  for (int j = 0; j < kGroup; ++j) {
    amax = std::max(amax, std::fabs(v[j]));
    sum += v[j];
  }
  const float inverse = amax > 0.0f ? 32767.0f / amax : 1.0f;
  for (int j = 0; j < kGroup; ++j)
    v16[j] = static_cast<int16_t>(std::clamp(std::nearbyint(v[j] * inverse), -32768.0f, 32767.0f));
#endif
  if (layout == Layout::NibbleWords) {  // value j to vector (j >= 16) + 2 (j % 2), lane (j % 16) / 2 of 8
    int16_t* base = row + (g / 2) * 64 + (g % 2) * 8;
    for (int i = 0; i < 8; ++i) {
      base[i] = v16[2 * i];
      base[16 + i] = v16[16 + 2 * i];
      base[32 + i] = v16[2 * i + 1];
      base[48 + i] = v16[17 + 2 * i];
    }
  } else {
    std::copy_n(v16, kGroup, row + g * kGroup);
  }
  return amax > 0.0f ? amax / 32767.0f : 1.0f;
}
#endif

QuantizedRows quantize_rows(const float* x, int64_t M, int64_t K, Layout layout) {
  const int64_t groups = K / kGroup;
  // groups per pass (padded with zeros to whole passes), and int32 lanes per group (its scale repeated as often)
  const int span = layout == Layout::Plain ? 1 : layout == Layout::NibbleQuads ? 4 : 2;
  const int repeat = layout == Layout::Plain ? 1 : layout == Layout::Paired512 ? 8 : 4;
  const int64_t padded = (groups + span - 1) / span * span, ldq = padded * kGroup, ldd = padded * repeat;
  QuantizedRows out{layout, std::vector<int16_t>(M * ldq), std::vector<float>(M * ldd), std::vector<float>(M * groups), ldq,
                    ldd};
  // ~15 ns a group: a decode step's few rows are not worth waking the other threads for
  at::parallel_for(0, M * groups, 4096, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const int64_t m = i / groups, g = i % groups;
      const float scale = quantize_group(x + m * K + g * kGroup, layout, g, out.q.data() + m * ldq, out.sum[i]);
      std::fill_n(out.scale.data() + m * ldd + g * repeat, repeat, scale);
    }
  });
  return out;
}

#ifdef GROUP_GEMM_AVX512
// 8-bit weights (the default model's LM head, the largest matrix) from kByteRows rows: activations as int8 per
// group of 32 (scale = the group's largest magnitude / 127, as llama.cpp's Q8 activations), multiplied with
// vpdpbusd, 64 products an instruction where vpdpwssd makes 32: 16 rows of the LM head 8.8 -> 5.1 ms (Intel Xeon,
// no AMX). Not for the 4-bit matrices: their inputs carry outlier channels that int8 steps of the group's largest
// magnitude blur (on the 20 prompts of bench/quantization_quality.py, prompts through int8 activations kept 7 of 20
// greedy continuations and a logit error of 2.5; the LM head's alone kept 20, 0.45). One row keeps int16: its step
// waits on reading the weights, not on the multiplies. Layout, per pass of four groups g .. g + 3: [values 0..15 of
// g, g + 1, g + 2, g + 3] then [values 16..31 of each], so that dpbusd's int32 lane i sums group g + i / 4; scales
// repeated 4 times. vpdpbusd multiplies unsigned by signed bytes, so the weights are biased by 128 (a sign-bit flip)
// and each group's sum corrected by 128 * (its quantized activations' sum), carried as that group's `sum` against
// the weight scales (the minimum's term's slot).
constexpr int64_t kByteRows = 2;

struct ByteRows {
  std::vector<int8_t> q;     // [M, ldq]
  std::vector<float> scale;  // [M, ldd]
  std::vector<float> sum;    // [M, K / 32]: -128 * scale * (the group's sum of q)
  int64_t ldq, ldd;
};

// One group's 32 values as int8 steps of its largest magnitude / 127 (values 0..15 in low, 16..31 in high, as
// int32); returns the step
inline float quantize_group_int8(const float* v, __m512i& low, __m512i& high) {
  const __m512 a = _mm512_loadu_ps(v), b = _mm512_loadu_ps(v + 16);
  const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(a), _mm512_abs_ps(b)));
  const __m512 inverse = _mm512_set1_ps(amax > 0.0f ? 127.0f / amax : 1.0f);
  low = _mm512_cvtps_epi32(_mm512_mul_ps(a, inverse));  // to nearest, ties to even
  high = _mm512_cvtps_epi32(_mm512_mul_ps(b, inverse));
  return amax > 0.0f ? amax / 127.0f : 1.0f;
}

ByteRows quantize_bytes(const float* x, int64_t M, int64_t K) {
  const int64_t groups = K / kGroup, padded = (groups + 3) / 4 * 4, ldq = padded * kGroup, ldd = padded * 4;
  ByteRows out{std::vector<int8_t>(M * ldq), std::vector<float>(M * ldd), std::vector<float>(M * groups), ldq, ldd};
  at::parallel_for(0, M * groups, 4096, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const int64_t m = i / groups, g = i % groups;
      __m512i low, high;
      const float scale = quantize_group_int8(x + m * K + g * kGroup, low, high);
      int8_t* base = out.q.data() + m * ldq + (g / 4) * 128 + (g % 4) * 16;
      _mm_storeu_si128(reinterpret_cast<__m128i*>(base), _mm512_cvtsepi32_epi8(low));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(base + 64), _mm512_cvtsepi32_epi8(high));
      std::fill_n(out.scale.data() + m * ldd + g * 4, 4, scale);
      out.sum[i] = -128.0f * scale * static_cast<float>(_mm512_reduce_add_epi32(_mm512_add_epi32(low, high)));
    }
  });
  return out;
}
#endif

#ifdef GROUP_GEMM_AVX2
inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}
#endif

// Weight scales and minimums come as float32 or as float16, a GGUF's own (Q4_0, Q4_1, Q8_0 store them so, and a
// float16 value widens exactly): half the bytes, which a one-row decode step, reading the weights from memory,
// waits on (4-bit bytes 53 MB, their float32 scales and minimums another 27 MB, for the default model).
inline float to_float(float v) { return v; }
inline float to_float(at::Half v) {
#ifdef __F16C__
  return _cvtsh_ss(v.x);
#else
  return static_cast<float>(v);
#endif
}

#ifdef GROUP_GEMM_AVX2
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const at::Half* p) {
#ifdef __F16C__
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
#else
  float v[8];
  for (int i = 0; i < 8; ++i) v[i] = to_float(p[i]);
  return _mm256_loadu_ps(v);
#endif
}
// two values into lanes 0 and 1
inline __m128 load2(const float* p) { return _mm_castpd_ps(_mm_load_sd(reinterpret_cast<const double*>(p))); }
inline __m128 load2(const at::Half* p) {
#ifdef __F16C__
  int32_t bits;
  std::memcpy(&bits, p, sizeof bits);
  return _mm_cvtph_ps(_mm_cvtsi32_si128(bits));
#else
  return _mm_setr_ps(to_float(p[0]), to_float(p[1]), 0.0f, 0.0f);
#endif
}
#endif

#ifdef GROUP_GEMM_AVX512
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const at::Half* p) { return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))); }
// the first `count` (1..4) of four values, zeros after
inline __m128 load4(const float* p, int64_t count) {
  return count == 4 ? _mm_loadu_ps(p) : _mm_maskz_loadu_ps((1 << count) - 1, p);
}
inline __m128 load4(const at::Half* p, int64_t count) {
  return _mm_cvtph_ps(count == 4 ? _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))
                                 : _mm_maskz_loadu_epi16((1 << count) - 1, p));
}
#endif

constexpr int64_t group_bytes(int bits) { return bits == 4 ? kGroup / 2 : kGroup; }

#ifdef GROUP_GEMM_AVX512
// One pair of groups (g, g + 1) of a weight row as int16, in the paired order of the activations (see
// QuantizedRows), and its scales, each repeated over the 8 int32 lanes its sums land in. Without Both, g is the last
// (odd) group and g + 1 reads as zeros.
template <int Bits, bool Both, typename S>
inline void load_pair(const uint8_t* q, const S* scale, int64_t g, __m512i& wa, __m512i& wb, __m512& d) {
  if constexpr (Bits == 4) {
    const uint8_t* qg = q + g * 16;
    const __m256i packed = Both ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qg))
                                : _mm256_zextsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(qg)));
    const __m512i bytes = _mm512_cvtepu8_epi16(packed);  // a byte per int16: low nibble values 0..15, high 16..31
    wa = _mm512_and_si512(bytes, _mm512_set1_epi16(0x0F));
    wb = _mm512_srli_epi16(bytes, 4);
  } else {
    const uint8_t* qg = q + g * 32;
    auto halves_of = [&](int64_t offset) {
      const __m128i first = _mm_loadu_si128(reinterpret_cast<const __m128i*>(qg + offset));
      return Both ? _mm256_inserti128_si256(_mm256_castsi128_si256(first),
                                            _mm_loadu_si128(reinterpret_cast<const __m128i*>(qg + 32 + offset)), 1)
                  : _mm256_zextsi128_si256(first);
    };
    wa = _mm512_cvtepi8_epi16(halves_of(0));
    wb = _mm512_cvtepi8_epi16(halves_of(16));
  }
  const __m128 two = Both ? load2(scale + g) : _mm_set_ss(to_float(scale[g]));
  const __m512i halves = _mm512_set_epi32(1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0);
  d = _mm512_permutexvar_ps(halves, _mm512_castps128_ps512(two));
}

// The sums of R rows against W weight rows, one 16-lane chain each, reduced into y[r * ldy + w] with the minimum's
// term.
template <int R, int W>
struct Sums {
  __m512 acc[R][W];
  Sums() {
    for (int r = 0; r < R; ++r)
      for (int w = 0; w < W; ++w) acc[r][w] = _mm512_setzero_ps();
  }
  template <typename T, typename S>
  void store(int64_t groups, const float* xs, const S* minimum, T* y, int64_t ldy) const {
    for (int r = 0; r < R; ++r) {
      for (int w = 0; w < W; ++w) {
        __m512 total = acc[r][w];
        float tail = 0.0f;
        if (minimum) {  // sum over groups of minimum * (the group's sum of x)
          const S* mw = minimum + w * groups;
          const float* xsr = xs + r * groups;
          int64_t g = 0;
          for (; g + 16 <= groups; g += 16)
            total = _mm512_fmadd_ps(load16(mw + g), _mm512_loadu_ps(xsr + g), total);
          for (; g < groups; ++g) tail = std::fma(to_float(mw[g]), xsr[g], tail);
        }
        y[r * ldy + w] = static_cast<T>(_mm512_reduce_add_ps(total) + tail);
      }
    }
  }
};

// 4 bits: R rows of x (NibbleQuads layout) against W consecutive weight rows, four groups per pass: their 64 packed
// bytes read as 32 words and each word's four nibbles masked in place (no widening shuffle), so that one int32
// conversion, one multiply of scales and one FMA per row cover four groups rather than two.
template <int R, int W, typename T, typename S>
void nibble_tile(const int16_t* xq, int64_t ldq, const float* xs, const float* xd, int64_t ldd, int64_t K,
                 const uint8_t* q, int64_t ldw, const S* scale, const S* minimum, T* y, int64_t ldy) {
  const int64_t groups = K / kGroup;
  Sums<R, W> sums;
  const __m512i nibble = _mm512_set1_epi16(0x000F);
  const __m512i spread = _mm512_set_epi32(3, 3, 3, 3, 2, 2, 2, 2, 1, 1, 1, 1, 0, 0, 0, 0);
  auto pass = [&](int64_t u, int64_t count) {  // groups 4u .. 4u + count - 1; a short last pass reads zeros
    __m512i v0[W], v1[W], v2[W], v3[W];
    __m512 d[W];
    for (int w = 0; w < W; ++w) {
      const uint8_t* qu = q + w * ldw + u * 64;
      const S* su = scale + w * groups + u * 4;
      const __m512i words = count == 4 ? _mm512_loadu_si512(qu)
                                       : _mm512_maskz_loadu_epi8((__mmask64{1} << (count * 16)) - 1, qu);
      const __m128 four = load4(su, count);
      v0[w] = _mm512_and_si512(words, nibble);
      v1[w] = _mm512_and_si512(_mm512_srli_epi16(words, 4), nibble);
      v2[w] = _mm512_and_si512(_mm512_srli_epi16(words, 8), nibble);
      v3[w] = _mm512_srli_epi16(words, 12);
      d[w] = _mm512_permutexvar_ps(spread, _mm512_castps128_ps512(four));
    }
    for (int r = 0; r < R; ++r) {
      const int16_t* xr = xq + r * ldq + u * 128;
      const __m512i x0 = _mm512_loadu_si512(xr), x1 = _mm512_loadu_si512(xr + 32);
      const __m512i x2 = _mm512_loadu_si512(xr + 64), x3 = _mm512_loadu_si512(xr + 96);
      const __m512 xdr = _mm512_loadu_ps(xd + r * ldd + u * 16);
      for (int w = 0; w < W; ++w) {
        const __m512i low = _mm512_dpwssd_epi32(_mm512_madd_epi16(v0[w], x0), v1[w], x1);
        const __m512i sum = _mm512_dpwssd_epi32(_mm512_dpwssd_epi32(low, v2[w], x2), v3[w], x3);
        sums.acc[r][w] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum), _mm512_mul_ps(d[w], xdr), sums.acc[r][w]);
      }
    }
  };
  int64_t u = 0;
  for (; 4 * u + 4 <= groups; ++u) pass(u, 4);
  if (4 * u < groups) pass(u, groups - 4 * u);
  sums.store(groups, xs, minimum, y, ldy);
}

// R rows of x (Paired512 layout) against W consecutive weight rows, a pair of groups per pass.
template <int Bits, int R, int W, typename T, typename S>
void pair_tile(const int16_t* xq, int64_t ldq, const float* xs, const float* xd, int64_t ldd, int64_t K,
               const uint8_t* q, int64_t ldw, const S* scale, const S* minimum, T* y, int64_t ldy) {
  const int64_t groups = K / kGroup;
  Sums<R, W> sums;
  auto pass = [&](int64_t p, auto both) {
    __m512i wa[W], wb[W];
    __m512 d[W];
    for (int w = 0; w < W; ++w)
      load_pair<Bits, decltype(both)::value>(q + w * ldw, scale + w * groups, 2 * p, wa[w], wb[w], d[w]);
    for (int r = 0; r < R; ++r) {
      const int16_t* xr = xq + r * ldq + p * 64;
      const __m512i xa = _mm512_loadu_si512(xr), xb = _mm512_loadu_si512(xr + 32);
      const __m512 xdr = _mm512_loadu_ps(xd + r * ldd + p * 16);
      for (int w = 0; w < W; ++w) {
        const __m512i sum = _mm512_dpwssd_epi32(_mm512_dpwssd_epi32(_mm512_setzero_si512(), wa[w], xa), wb[w], xb);
        sums.acc[r][w] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum), _mm512_mul_ps(d[w], xdr), sums.acc[r][w]);
      }
    }
  };
  int64_t p = 0;
  for (; p < groups / 2; ++p) pass(p, std::true_type{});
  if (groups % 2) pass(p, std::false_type{});
  sums.store(groups, xs, minimum, y, ldy);
}

// R rows of x (ByteRows) against W consecutive 8-bit weight rows, four groups per pass: their 128 bytes, the first
// and second halves of each group gathered by two lane shuffles.
template <int R, int W, typename T, typename S>
void byte_quad_tile(const int8_t* xq, int64_t ldq, const float* xs, const float* xd, int64_t ldd, int64_t K,
                    const uint8_t* q, int64_t ldw, const S* scale, T* y, int64_t ldy) {
  const int64_t groups = K / kGroup;
  Sums<R, W> sums;
  const __m512i bias = _mm512_set1_epi8(static_cast<char>(0x80));
  const __m512i spread = _mm512_set_epi32(3, 3, 3, 3, 2, 2, 2, 2, 1, 1, 1, 1, 0, 0, 0, 0);
  auto pass = [&](int64_t u, int64_t count) {  // groups 4u .. 4u + count - 1; a short last pass reads zeros
    __m512i lo[W], hi[W];
    __m512 d[W];
    for (int w = 0; w < W; ++w) {
      const uint8_t* qu = q + w * ldw + u * 128;
      const int64_t first = std::min<int64_t>(count, 2) * 32, second = std::max<int64_t>(count - 2, 0) * 32;
      const __m512i a = first == 64 ? _mm512_loadu_si512(qu) : _mm512_maskz_loadu_epi8((__mmask64{1} << first) - 1, qu);
      const __m512i b = second == 64 ? _mm512_loadu_si512(qu + 64)
                                     : _mm512_maskz_loadu_epi8((__mmask64{1} << second) - 1, qu + 64);
      lo[w] = _mm512_xor_si512(_mm512_shuffle_i64x2(a, b, _MM_SHUFFLE(2, 0, 2, 0)), bias);
      hi[w] = _mm512_xor_si512(_mm512_shuffle_i64x2(a, b, _MM_SHUFFLE(3, 1, 3, 1)), bias);
      const S* su = scale + w * groups + u * 4;
      const __m128 four = load4(su, count);
      d[w] = _mm512_permutexvar_ps(spread, _mm512_castps128_ps512(four));
    }
    for (int r = 0; r < R; ++r) {
      const int8_t* xr = xq + r * ldq + u * 128;
      const __m512i xl = _mm512_loadu_si512(xr), xh = _mm512_loadu_si512(xr + 64);
      const __m512 xdr = _mm512_loadu_ps(xd + r * ldd + u * 16);
      for (int w = 0; w < W; ++w) {
        const __m512i sum = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(_mm512_setzero_si512(), lo[w], xl), hi[w], xh);
        sums.acc[r][w] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum), _mm512_mul_ps(d[w], xdr), sums.acc[r][w]);
      }
    }
  };
  int64_t u = 0;
  for (; 4 * u + 4 <= groups; ++u) pass(u, 4);
  if (4 * u < groups) pass(u, groups - 4 * u);
  sums.store(groups, xs, scale, y, ldy);  // each group's bias correction: its scale times the carried sum
}
#elif defined(GROUP_GEMM_AVX2)
// The sums of R rows against W weight rows, one 8-lane chain each (two, alternating, where there are fewer than 4),
// reduced into y[r * ldy + w] with the minimum's term.
template <int R, int W, int Chains>
struct Sums {
  __m256 acc[R][W][Chains];
  Sums() {
    for (int r = 0; r < R; ++r)
      for (int w = 0; w < W; ++w)
        for (int c = 0; c < Chains; ++c) acc[r][w][c] = _mm256_setzero_ps();
  }
  template <typename T, typename S>
  void store(int64_t groups, const float* xs, const S* minimum, T* y, int64_t ldy) const {
    for (int r = 0; r < R; ++r) {
      for (int w = 0; w < W; ++w) {
        __m256 total = acc[r][w][0];
        if constexpr (Chains == 2) total = _mm256_add_ps(total, acc[r][w][1]);
        float tail = 0.0f;
        if (minimum) {  // sum over groups of minimum * (the group's sum of x)
          const S* mw = minimum + w * groups;
          const float* xsr = xs + r * groups;
          int64_t j = 0;
          for (; j + 8 <= groups; j += 8)
            total = _mm256_fmadd_ps(load8(mw + j), _mm256_loadu_ps(xsr + j), total);
          for (; j < groups; ++j) tail = std::fma(to_float(mw[j]), xsr[j], tail);
        }
        y[r * ldy + w] = static_cast<T>(hsum(total) + tail);
      }
    }
  }
};

// 4 bits: R rows of x (NibbleWords layout) against W consecutive weight rows, a pair of groups per pass.
template <int R, int W, typename T, typename S>
void nibble_tile(const int16_t* xq, int64_t ldq, const float* xs, const float* xd, int64_t ldd, int64_t K,
                 const uint8_t* q, int64_t ldw, const S* scale, const S* minimum, T* y, int64_t ldy) {
  const int64_t groups = K / kGroup;
  constexpr int Chains = R * W >= 4 ? 1 : 2;
  Sums<R, W, Chains> sums;
  const __m256i nibble = _mm256_set1_epi16(0x000F);
  const __m256i halves = _mm256_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1);
  auto pass = [&](int64_t p, auto chain, auto both) {  // compile-time chain, so the sums stay in registers
    constexpr int c = decltype(chain)::value % Chains;
    constexpr bool Both = decltype(both)::value;
    for (int w = 0; w < W; ++w) {
      const uint8_t* qp = q + w * ldw + p * 32;
      const __m256i words = Both ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qp))
                                 : _mm256_zextsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(qp)));
      const __m256i v0 = _mm256_and_si256(words, nibble), v1 = _mm256_and_si256(_mm256_srli_epi16(words, 4), nibble);
      const __m256i v2 = _mm256_and_si256(_mm256_srli_epi16(words, 8), nibble), v3 = _mm256_srli_epi16(words, 12);
      const S* sw = scale + w * groups + 2 * p;
      const __m256 d = Both ? _mm256_permutevar8x32_ps(_mm256_castps128_ps256(load2(sw)), halves)
                            : _mm256_set1_ps(to_float(sw[0]));
      for (int r = 0; r < R; ++r) {
        const __m256i* xr = reinterpret_cast<const __m256i*>(xq + r * ldq + p * 64);
        const __m256i low = _mm256_add_epi32(_mm256_madd_epi16(v0, _mm256_loadu_si256(xr)),
                                             _mm256_madd_epi16(v1, _mm256_loadu_si256(xr + 1)));
        const __m256i high = _mm256_add_epi32(_mm256_madd_epi16(v2, _mm256_loadu_si256(xr + 2)),
                                              _mm256_madd_epi16(v3, _mm256_loadu_si256(xr + 3)));
        const __m256i sum = _mm256_add_epi32(low, high);
        const __m256 xdr = _mm256_loadu_ps(xd + r * ldd + p * 8);
        sums.acc[r][w][c] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sum), _mm256_mul_ps(d, xdr), sums.acc[r][w][c]);
      }
    }
  };
  const int64_t pairs = groups / 2;
  int64_t p = 0;
  for (; p + 2 <= pairs; p += 2) {
    pass(p, std::integral_constant<int, 0>{}, std::true_type{});
    pass(p + 1, std::integral_constant<int, 1>{}, std::true_type{});
  }
  if (p < pairs) pass(p++, std::integral_constant<int, 0>{}, std::true_type{});
  if (groups % 2) pass(p, std::integral_constant<int, 1>{}, std::false_type{});
  sums.store(groups, xs, minimum, y, ldy);
}

// 8 bits: R rows of x (plain layout) against W consecutive weight rows, a group per pass.
template <int R, int W, typename T, typename S>
void byte_tile(const int16_t* xq, int64_t ldq, const float* xs, const float* xd, int64_t ldd, int64_t K,
               const uint8_t* q, int64_t ldw, const S* scale, const S* minimum, T* y, int64_t ldy) {
  const int64_t groups = K / kGroup;
  constexpr int Chains = R * W >= 4 ? 1 : 2;
  Sums<R, W, Chains> sums;
  auto pass = [&](int64_t g, auto chain) {
    constexpr int c = decltype(chain)::value % Chains;
    for (int w = 0; w < W; ++w) {
      const __m128i* qg = reinterpret_cast<const __m128i*>(q + w * ldw + g * 32);
      const __m256i w0 = _mm256_cvtepi8_epi16(_mm_loadu_si128(qg)), w1 = _mm256_cvtepi8_epi16(_mm_loadu_si128(qg + 1));
      const __m256 d = _mm256_set1_ps(to_float(scale[w * groups + g]));
      for (int r = 0; r < R; ++r) {
        const __m256i* xr = reinterpret_cast<const __m256i*>(xq + r * ldq + g * kGroup);
        const __m256i sum = _mm256_add_epi32(_mm256_madd_epi16(w0, _mm256_loadu_si256(xr)),
                                             _mm256_madd_epi16(w1, _mm256_loadu_si256(xr + 1)));
        const __m256 xdr = _mm256_broadcast_ss(xd + r * ldd + g);
        sums.acc[r][w][c] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sum), _mm256_mul_ps(d, xdr), sums.acc[r][w][c]);
      }
    }
  };
  int64_t g = 0;
  for (; g + 2 <= groups; g += 2) {
    pass(g, std::integral_constant<int, 0>{});
    pass(g + 1, std::integral_constant<int, 1>{});
  }
  if (g < groups) pass(g, std::integral_constant<int, 0>{});
  sums.store(groups, xs, minimum, y, ldy);
}
#endif

// R rows of x (quantized) against W consecutive weight rows: y[r * ldy + w].
template <int Bits, int R, int W, typename T, typename S>
void dot_tile(Layout layout, const int16_t* xq, int64_t ldq, const float* xs, const float* xd, int64_t ldd, int64_t K,
              const uint8_t* q, int64_t ldw, const S* scale, const S* minimum, T* y, int64_t ldy) {
#if defined(GROUP_GEMM_AVX512)
  if (Bits == 4 && layout == Layout::NibbleQuads) {
    nibble_tile<R, W, T>(xq, ldq, xs, xd, ldd, K, q, ldw, scale, minimum, y, ldy);
  } else {
    pair_tile<Bits, R, W, T>(xq, ldq, xs, xd, ldd, K, q, ldw, scale, minimum, y, ldy);
  }
#elif defined(GROUP_GEMM_AVX2)
  if constexpr (Bits == 4) {
    nibble_tile<R, W, T>(xq, ldq, xs, xd, ldd, K, q, ldw, scale, minimum, y, ldy);
  } else {
    byte_tile<R, W, T>(xq, ldq, xs, xd, ldd, K, q, ldw, scale, minimum, y, ldy);
  }
#else
  const int64_t groups = K / kGroup;
  for (int r = 0; r < R; ++r) {
    for (int w = 0; w < W; ++w) {
      const uint8_t* qw = q + w * ldw;
      const S* sw = scale + w * groups;
      float total = 0.0f;
      for (int64_t g = 0; g < groups; ++g) {
        int32_t sum = 0;
        for (int j = 0; j < kGroup; ++j) {
          int32_t v;
          if constexpr (Bits == 4) {
            v = j < 16 ? (qw[g * 16 + j] & 0x0F) : (qw[g * 16 + j - 16] >> 4);
          } else {
            v = static_cast<int8_t>(qw[g * 32 + j]);
          }
          sum += v * xq[r * ldq + g * kGroup + j];
        }
        total += static_cast<float>(sum) * to_float(sw[g]) * xd[r * ldd + g];
        if (minimum) total = std::fma(to_float(minimum[w * groups + g]), xs[r * groups + g], total);
      }
      y[r * ldy + w] = static_cast<T>(total);
    }
  }
#endif
}

#ifdef GROUP_GEMM_AVX512
// Weight rows per dot_tile: 4-8 chains, in 32 registers. One weight row at a time for 8 bits: two or four rows of
// the LM head (28 MB, read from memory each step) ran 2-3x slower than one here (Zen 4), where four 4-bit rows run
// one row of x 20-40 % faster.
template <int Bits, int R>
constexpr int kTileWidth = Bits == 8 ? 1 : R <= 2 ? 4 : R <= 4 ? 2 : 1;
#else
// AVX2 (16 registers): the activations of R rows, the R x W sums and one weight group at a time
template <int Bits, int R>
// (measured on a Zen 3: one row 5-10 % faster with four weight rows, two rows with two; more rows gained nothing)
constexpr int kTileWidth = Bits == 8 ? 1 : R == 1 ? 4 : R == 2 ? 2 : 1;
#endif

// R rows of x (QuantizedRows or ByteRows) against weight rows [begin, end).
template <int Bits, int R, typename T, typename Rows, typename S>
void rows_pass(const Rows& x, int64_t m, const uint8_t* q, const S* scale, const S* minimum, int64_t begin,
               int64_t end, int64_t N, int64_t K, T* y) {
  const int64_t groups = K / kGroup, row_bytes = groups * group_bytes(Bits);
  const auto* xq = x.q.data() + m * x.ldq;
  const float* xs = x.sum.data() + m * groups;
  const float* xd = x.scale.data() + m * x.ldd;
  auto tile = [&](int64_t n, auto width) {
    constexpr int W = decltype(width)::value;
    const S* mn = minimum ? minimum + n * groups : nullptr;
#ifdef GROUP_GEMM_AVX512
    if constexpr (std::is_same_v<Rows, ByteRows>) {
      byte_quad_tile<R, W, T>(xq, x.ldq, xs, xd, x.ldd, K, q + n * row_bytes, row_bytes, scale + n * groups,
                              y + m * N + n, N);
      return;
    } else
#endif
    {
      dot_tile<Bits, R, W, T>(x.layout, xq, x.ldq, xs, xd, x.ldd, K, q + n * row_bytes, row_bytes, scale + n * groups,
                              mn, y + m * N + n, N);
    }
  };
  constexpr int W = kTileWidth<Bits, R>;
  int64_t n = begin;
  for (; n + W <= end; n += W) tile(n, std::integral_constant<int, W>{});
  for (; n < end; ++n) tile(n, std::integral_constant<int, 1>{});
}

template <int Bits, typename T, typename Rows, typename S>
void gemm(const Rows& x, int64_t M, const uint8_t* q, const S* scale, const S* minimum, int64_t N, int64_t K,
          T* y) {
  at::parallel_for(0, N, kBlock, [&](int64_t begin, int64_t end) {
    // a block of weight rows for each pass of rows of x: the pass's activations stay in L1 across the block
    for (int64_t block = begin; block < end; block += kBlock) {
      const int64_t last = std::min(block + kBlock, end);
      for (int64_t m = 0; m < M; m += kRowsPerPass) {
        switch (std::min<int64_t>(kRowsPerPass, M - m)) {
          case 1: rows_pass<Bits, 1>(x, m, q, scale, minimum, block, last, N, K, y); break;
          case 2: rows_pass<Bits, 2>(x, m, q, scale, minimum, block, last, N, K, y); break;
          case 3: rows_pass<Bits, 3>(x, m, q, scale, minimum, block, last, N, K, y); break;
#ifdef GROUP_GEMM_AVX512
          case 4: rows_pass<Bits, 4>(x, m, q, scale, minimum, block, last, N, K, y); break;
          case 5: rows_pass<Bits, 5>(x, m, q, scale, minimum, block, last, N, K, y); break;
          case 6: rows_pass<Bits, 6>(x, m, q, scale, minimum, block, last, N, K, y); break;
          case 7: rows_pass<Bits, 7>(x, m, q, scale, minimum, block, last, N, K, y); break;
          default: rows_pass<Bits, 8>(x, m, q, scale, minimum, block, last, N, K, y); break;
#else
          default: rows_pass<Bits, 4>(x, m, q, scale, minimum, block, last, N, K, y); break;
#endif
        }
      }
    }
  });
}

// One weight row -> K floats.
template <int Bits, typename S>
void dequantize_row(const uint8_t* q, const S* scale, const S* minimum, int64_t K, float* out) {
  for (int64_t g = 0; g < K / kGroup; ++g) {
    const float d = to_float(scale[g]), m = minimum ? to_float(minimum[g]) : 0.0f;
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

// Round to nearest even, as torch's own conversion does.
inline void to_bfloat16(const float* in, int64_t n, at::BFloat16* out) {
  int64_t i = 0;
#ifdef __AVX512BF16__
  for (; i + 16 <= n; i += 16)
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + i), (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(in + i)));
#endif
  for (; i < n; ++i) out[i] = at::BFloat16(in[i]);
}

// One weight row -> K values of T: bfloat16 straight from the groups where the CPU converts natively (a float row
// then a conversion pass took twice as long: ~28 ms of each 256-token prompt step here), else through float.
template <int Bits, typename T, typename S>
void dequantize_row_as(const uint8_t* q, const S* scale, const S* minimum, int64_t K, T* out,
                       std::vector<float>& row) {
  if constexpr (std::is_same_v<T, float>) {
    dequantize_row<Bits>(q, scale, minimum, K, out);
  } else {
#if defined(GROUP_GEMM_AVX512) && defined(__AVX512BF16__)
    for (int64_t g = 0; g < K / kGroup; ++g) {
      const __m512 d = _mm512_set1_ps(to_float(scale[g])), m = _mm512_set1_ps(minimum ? to_float(minimum[g]) : 0.0f);
      const uint8_t* qg = q + g * group_bytes(Bits);
      __m512i first, second;  // values 0..15 and 16..31 as int32
      if constexpr (Bits == 4) {
        const __m128i packed = _mm_loadu_si128(reinterpret_cast<const __m128i*>(qg));
        const __m128i mask = _mm_set1_epi8(0x0F);
        first = _mm512_cvtepu8_epi32(_mm_and_si128(packed, mask));
        second = _mm512_cvtepu8_epi32(_mm_and_si128(_mm_srli_epi16(packed, 4), mask));
      } else {
        first = _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(qg)));
        second = _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(qg + 16)));
      }
      const __m512 lo = _mm512_fmadd_ps(_mm512_cvtepi32_ps(first), d, m);
      const __m512 hi = _mm512_fmadd_ps(_mm512_cvtepi32_ps(second), d, m);
      _mm512_storeu_si512(out + g * kGroup, (__m512i)_mm512_cvtne2ps_pbh(hi, lo));  // lo in the lower half
    }
#else
    dequantize_row<Bits>(q, scale, minimum, K, row.data());
    to_bfloat16(row.data(), K, out);
#endif
  }
}

// Many rows: tiles of weight rows dequantized into a cache-sized buffer in x's dtype, each multiplied by torch's own
// GEMM (single-threaded inside this parallel loop), so prefill runs at the dense kernel's speed without a dense copy
// of the matrix. bfloat16 activations multiply bfloat16 tiles: the CPUs where bfloat16 is the default type
// (AVX512-BF16, AMX) run that GEMM at two to three times float32's rate.
//
// A matrix of at most kWholeBytes dequantized is instead dequantized whole, in parallel, and multiplied by one
// GEMM on every thread: a tile per thread ran torch's GEMM at ~180 GMAC/s a thread here (Zen 5, bfloat16), one
// multi-threaded GEMM at ~205 a thread (256 rows 8-19 % faster, 17-64 rows 20-50 %), for a buffer the size of the
// matrix.
constexpr int64_t kWholeBytes = 8 << 20;

// The dense matrix's memory, kept between calls (per thread and dtype; at most kWholeBytes): a fresh one is mapped
// and page-faulted in on every call, 0.55 ms of a 4.8 ms prompt GEMM of 576 x 3072 (Intel Xeon, float32)
at::Tensor dense_scratch(int64_t N, int64_t K, const at::TensorOptions& options) {
  thread_local at::Tensor kept[2];
  at::Tensor& buffer = kept[options.dtype() == at::kBFloat16];
  if (!buffer.defined() || buffer.numel() < N * K) buffer = at::empty({N * K}, options);
  return buffer.narrow(0, 0, N * K).view({N, K});
}

template <int Bits, typename T, typename S>
void gemm_tiled(const at::Tensor& x, const uint8_t* q, const S* scale, const S* minimum, int64_t N,
                at::Tensor& y) {
  const int64_t K = x.size(1), groups = K / kGroup, row_bytes = groups * group_bytes(Bits);
  if (N * K * static_cast<int64_t>(sizeof(T)) <= kWholeBytes) {
    at::Tensor dense = dense_scratch(N, K, x.options());
    T* w = dense.data_ptr<T>();
    at::parallel_for(0, N, 16, [&](int64_t begin, int64_t end) {
      std::vector<float> row(std::is_same_v<T, float> ? 0 : K);
      for (int64_t n = begin; n < end; ++n)
        dequantize_row_as<Bits, T>(q + n * row_bytes, scale + n * groups, minimum ? minimum + n * groups : nullptr, K,
                                   w + n * K, row);
    });
    at::mm_out(y, x, dense.t());
    return;
  }
  const int64_t tile = std::max<int64_t>(16, std::min<int64_t>(128, (int64_t{1} << 17) / sizeof(T) / K / 16 * 16));
  const int64_t tiles = (N + tile - 1) / tile;
  at::parallel_for(0, tiles, 1, [&](int64_t begin, int64_t end) {
    // the caller's inference mode is thread-local: without it here, mm_out into y (an inference tensor) is refused
    c10::InferenceMode inference;
    at::Tensor buffer = at::empty({tile, K}, x.options());
    T* w = buffer.data_ptr<T>();
    std::vector<float> row(std::is_same_v<T, float> ? 0 : K);
    for (int64_t t = begin; t < end; ++t) {
      const int64_t n0 = t * tile, rows = std::min(tile, N - n0);
      for (int64_t r = 0; r < rows; ++r) {
        const int64_t n = n0 + r;
        dequantize_row_as<Bits, T>(q + n * row_bytes, scale + n * groups, minimum ? minimum + n * groups : nullptr, K,
                                   w + r * K, row);
      }
      at::Tensor out = y.narrow(1, n0, rows);
      at::mm_out(out, x, buffer.narrow(0, 0, rows).t());
    }
  });
}

// Whether AMX's bfloat16 tiles run the few-row product: the CPU lists AMX-BF16 and oneDNN's brgemm micro-kernel
// (torch's cpublas::brgemm, which asks the kernel for the tile state) can run bfloat16 here.
bool amx_rows() {
#if defined(GROUP_GEMM_AVX512) && defined(__AVX512BF16__)
  static const bool usable = [] {
    unsigned a = 0, b = 0, c = 0, d = 0;
    const bool amx_bf16 = __get_cpuid_count(7, 0, &a, &b, &c, &d) && ((d >> 22) & 1);
    return amx_bf16 && amx_allowed() && at::native::cpublas::could_pack(at::kBFloat16);
  }();
  return usable;
#else
  return false;
#endif
}

// Rows that AMX multiplies, where it can (2 threads, us per call, fused / AMX): 3072 x 576 4 bits, 4 rows 130 / 123,
// 16 rows 378 / 129, 48 rows 335 (tiled) / 236, 64 rows 374 / 374; 576 x 1536, 6 rows 64 / 70, 8 rows 98 / 66;
// the 8-bit LM head 49152 x 576, 6 rows 2075 / 1806, 16 rows 6118 / 2307. Fewer rows: the fused path reads the
// 4-bit bytes once, where AMX's costs a dequantization of the whole matrix whatever the row count; more: the tiled
// path's GEMM, whose large B operand oneDNN blocks better than the micro-kernel's.
constexpr int64_t kAmxRows = 6, kAmxMaxRows = 48;

bool amx_takes(int64_t rows) { return rows >= kAmxRows && rows <= kAmxMaxRows && amx_rows(); }

// The most rows the fused path takes. 8-bit weights, without AMX and where prompts stay float32 (an Intel Xeon with
// AVX512-VNNI) but not as int16 (LLMSERVE_INT16_PROMPTS=0): their int8 activations multiply the LM head 9.4 / 12.5 / 21.2 ms at 24 / 32 / 64 rows, where its
// dequantized tiles through MKL's float32 GEMM take 14.6 / 16.4 / 26.2 (2 threads).
constexpr int64_t kByteMaxRows = 64;

// 4-bit weights where float32 rows beyond the fused path's multiply as int16 (gemm_int16, AVX512-VNNI): it unpacks each weight
// once per call and multiplies 16 weight rows per instruction, the fused path one; from 6 rows it ran the default
// model's four matrices faster (2 threads, Intel Xeon Ice Lake: 8 rows 545 / 636 us, 16 rows 662 / 1212 us a
// layer; 3 rows 469 / 308). As bytes (gemm_nibble_bytes), from 4 rows (a Zen 5, in cache, bytes / fused: a layer's
// four matrices at 4 rows 96 / 123 us, 5 rows 106 / 149; 3 rows 88 / 88, 2 rows 77 / 55)
constexpr int64_t kVnniFusedRows = 3;
// and 8-bit ones (the LM head, read from memory at few rows) from 9 rows: 16 rows 7.1 / 11.1 ms, 32 rows 10.1 /
// 21.9, 8 rows 5.5 / 5.7 (int8 activations with vpdpbusd on the fused path)
constexpr int64_t kVnniByteFusedRows = 8;

// AVX2 (Zen 3, 2 threads, us per call, int16 / fused): 4-bit weights from 6 rows (a layer's four matrices at 8
// rows 720 / 770, 16 rows 1061 / 1390, 4 rows 520 / 417), 8-bit ones from 14 (the LM head at 16 rows 7.9 / 9.6 ms,
// 12 rows 9.7 / 8.4, 8 rows 5.6 / 3.7)
constexpr int64_t kMaddFusedRows = 5, kMaddByteFusedRows = 13;

// AMD's AVX512-BF16 (Zen 4, 2 threads, us per call, bfloat16 tiles / int16): gemm_int16 takes batched decode, where
// it is faster, and leaves prompts to the bfloat16 tiles. 4-bit weights from 6 rows to 64 (a layer's four matrices
// at 16 rows 690 / 477, 64 rows 1673 / 1483, 96 rows 2084 / 2098, 256 rows 4811 / 5364); 8-bit ones from 17 (the
// fused path's int8 below: the LM head at 16 rows 4.8 / 5.5 ms) to 128 (32 rows 10.3 / 7.8 ms, 128 rows 23.4 /
// 23.0, 256 rows 54.9 / 59.0).
constexpr int64_t kBf16Int16MaxRows = 64, kBf16Int16MaxByteRows = 128;

// The most float32 rows gemm_int16 takes (0: none): every row count above fused_max_rows() where prompts stay float32
// (neither AVX512-BF16 nor AMX); batched decode only where they multiply in bfloat16 without AMX (an AMD CPU)
int64_t int16_max_rows(int64_t bits) {
  if (!int16_allowed() || amx_rows()) return 0;
  if (!bfloat16_prompts()) return INT64_MAX;
  return bits == 8 ? kBf16Int16MaxByteRows : kBf16Int16MaxRows;
}

// 8-bit weights: the most float32 rows gemm_int8 takes, beyond the fused path's (AVX512-VNNI without AMX). The
// LM head on a Zen 4 (2 threads, ms per call, before: the fused path to 16 rows, gemm_int16 beyond / gemm_int8):
// 12 rows 3.79 / 3.05, 16 rows 4.46 / 3.56, 32 rows 7.9 / 5.0, 64 rows 12.9 / 8.3, 128 rows 22.2 / 13.4; 8 rows
// level with the fused path (2.4), so the fused path keeps 8 rows there as on an Intel Xeon. In a 16-stream
// decode step: 5.5 -> 3.8 ms.
constexpr int64_t kInt8MaxRows = 128;

// LLMSERVE_INT8_ROWS=0: 8-bit weights beyond the fused path's rows take the int16 path or the tiles (benchmarks)
bool int8_allowed() {
  static const bool allowed = switched_on("LLMSERVE_INT8_ROWS");
  return allowed;
}

int64_t int8_max_rows() {
#ifdef GROUP_GEMM_AVX512
  if (!amx_rows() && int8_allowed()) return kInt8MaxRows;
#endif
  return 0;
}

int64_t fused_max_rows(int64_t bits) {
#ifdef GROUP_GEMM_AVX512
  if (int16_max_rows(bits) > 0) {
    if (bits == 4) return kVnniFusedRows;
    return int8_max_rows() > 0 || !bfloat16_prompts() ? kVnniByteFusedRows : kFusedRows;
  }
  if (bits == 8 && !amx_rows() && !bfloat16_prompts()) return kByteMaxRows;
#elif defined(GROUP_GEMM_AVX2)
  if (int16_max_rows(bits) > 0) return bits == 8 ? kMaddByteFusedRows : kMaddFusedRows;
#endif
  return kFusedRows;
}

// AMX: y^T = W x^T, so that the weights, dequantized row by row to bfloat16 (the prompt path's rounding), are the
// micro-kernel's A operand in their natural layout, and the few activation rows, packed once per call in the VNNI
// pairs AMX reads ([K / 2][M][2]), its B. A decode step then costs one dequantization of the weights, nearly
// whatever its row count (about half the time of 16 rows; the micro-kernel the rest).
#if defined(GROUP_GEMM_AVX512) && defined(__AVX512BF16__)
template <int Bits, typename T, typename S>
void gemm_amx(const T* x, int64_t M, int64_t K, const uint8_t* q, const S* scale, const S* minimum, int64_t N,
              T* y) {
  const int64_t groups = K / kGroup, row_bytes = groups * group_bytes(Bits);
  thread_local std::vector<uint32_t> packed;  // bfloat16 pairs (k, k + 1) of row m at [k / 2][m]
  packed.resize(K / 2 * M);
  for (int64_t m = 0; m < M; ++m)
    for (int64_t k = 0; k < K; k += 2) {
      const uint32_t lo = at::BFloat16(float(x[m * K + k])).x, hi = at::BFloat16(float(x[m * K + k + 1])).x;
      packed[k / 2 * M + m] = lo | hi << 16;
    }
  const auto* bp = reinterpret_cast<const at::BFloat16*>(packed.data());
  // blocks of at most 256 weight rows and 512 KiB dequantized, at least two per thread
  const int64_t threads = at::get_num_threads();
  int64_t block = std::min<int64_t>({256, (512 << 10) / (2 * K), (N + 2 * threads - 1) / (2 * threads)});
  block = std::max<int64_t>(16, (block + 15) / 16 * 16);
  const int64_t blocks = (N + block - 1) / block;
  at::parallel_for(0, blocks, 1, [&](int64_t begin, int64_t end) {
    // kept per thread between calls: a fresh buffer this size is mapped and faulted in (tens of us a call)
    thread_local std::vector<at::BFloat16> w;
    thread_local std::vector<float> out, row;
    if (w.size() < static_cast<size_t>(block * K)) w.resize(block * K);
    if (out.size() < static_cast<size_t>(block * M)) out.resize(block * M);
    for (int64_t b = begin; b < end; ++b) {
      const int64_t n0 = b * block, rows = std::min(block, N - n0);
      for (int64_t r = 0; r < rows; ++r) {
        const int64_t n = n0 + r;
        dequantize_row_as<Bits, at::BFloat16>(q + n * row_bytes, scale + n * groups,
                                              minimum ? minimum + n * groups : nullptr, K, w.data() + r * K, row);
      }
      at::native::cpublas::brgemm(rows, M, K, K, M, M, false, w.data(), bp, out.data(), true);
      // out is y's block transposed: 16 of its rows gathered per store of y
      const __m512i stride = _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                                _mm512_set1_epi32(static_cast<int>(M)));
      for (int64_t m = 0; m < M; ++m) {
        T* yr = y + m * N + n0;
        int64_t r = 0;
        for (; r + 16 <= rows; r += 16) {
          const __m512 v = _mm512_i32gather_ps(stride, out.data() + r * M + m, 4);
          if constexpr (std::is_same_v<T, float>) _mm512_storeu_ps(yr + r, v);
          else _mm256_storeu_si256(reinterpret_cast<__m256i*>(yr + r), (__m256i)_mm512_cvtneps_pbh(v));
        }
        for (; r < rows; ++r) yr[r] = T(out[r * M + m]);
      }
    }
    at::native::cpublas::brgemm_release();
  });
}
#endif

#ifdef GROUP_GEMM_AVX2
// Float32 prompts where they stay float32 (no AVX512-BF16, no AMX: an Intel Xeon such as Ice Lake, or an AVX2 CPU
// such as AMD's Zen 3): the activations as int16 per group (the decode path's rounding) and the weights widened to
// int16, multiplied with vpdpwssd (AVX512-VNNI: 32 products an instruction on two ports, where float32's FMA makes
// 16; the tiled float32 path through MKL's GEMM ran prompts at ~240 GFLOP/s on 2 threads of an Ice Lake) or with
// vpmaddwd and vpaddd (AVX2: 16 products per two instructions, which Zen 3 issues on more ports than its two FMA
// ones). Each tile of weight rows is unpacked once per call into the madd layout ([group][pair p][row]: values 2p
// and 2p + 1 of the group as one int32), so that one broadcast pair of x multiplies a vector of weight rows; every
// row of x then reuses it.
#ifdef GROUP_GEMM_AVX512
constexpr int64_t kInt16Cols = 32;  // weight rows per tile: two vectors of sums
constexpr int kInt16Rows = 6;       // rows of x per micro-kernel pass: 12 int32 and 12 float sums in registers


// r[i] lane j -> r[j] lane i, for 16 x 16 int32
inline void transpose16(__m512i r[16]) {
  __m512i t[16];
  for (int i = 0; i < 16; i += 2) {
    t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
    t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
  }
  for (int i = 0; i < 16; i += 4) {
    r[i] = _mm512_unpacklo_epi64(t[i], t[i + 2]);
    r[i + 1] = _mm512_unpackhi_epi64(t[i], t[i + 2]);
    r[i + 2] = _mm512_unpacklo_epi64(t[i + 1], t[i + 3]);
    r[i + 3] = _mm512_unpackhi_epi64(t[i + 1], t[i + 3]);
  }
  for (int i = 0; i < 16; i += 8)
    for (int j = 0; j < 4; ++j) {
      t[i + j] = _mm512_shuffle_i32x4(r[i + j], r[i + j + 4], 0x88);
      t[i + j + 4] = _mm512_shuffle_i32x4(r[i + j], r[i + j + 4], 0xDD);
    }
  for (int j = 0; j < 8; ++j) {
    r[j] = _mm512_shuffle_i32x4(t[j], t[j + 8], 0x88);
    r[j + 8] = _mm512_shuffle_i32x4(t[j], t[j + 8], 0xDD);
  }
}

// One group's int32 sums of R rows against a tile's 32 weight rows into the float sums f: times the weight scales
// and x's step, plus (with minimums) each weight row's minimum times the group's float sum of x.
template <int R, bool Minimum>
__attribute__((always_inline)) inline void add_group(const __m512i (&a)[R][2], const float* ws, const float* wm,
                                                     const float* xd, const float* xs, int64_t groups, int64_t g,
                                                     __m512 (&f)[R][2]) {
  const __m512 s0 = _mm512_loadu_ps(ws + g * kInt16Cols), s1 = _mm512_loadu_ps(ws + g * kInt16Cols + 16);
  for (int r = 0; r < R; ++r) {
    const __m512 d = _mm512_set1_ps(xd[r * groups + g]);
    f[r][0] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(a[r][0]), _mm512_mul_ps(s0, d), f[r][0]);
    f[r][1] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(a[r][1]), _mm512_mul_ps(s1, d), f[r][1]);
  }
  if constexpr (Minimum) {
    const __m512 m0 = _mm512_loadu_ps(wm + g * kInt16Cols), m1 = _mm512_loadu_ps(wm + g * kInt16Cols + 16);
    for (int r = 0; r < R; ++r) {
      const __m512 sum = _mm512_set1_ps(xs[r * groups + g]);
      f[r][0] = _mm512_fmadd_ps(sum, m0, f[r][0]);
      f[r][1] = _mm512_fmadd_ps(sum, m1, f[r][1]);
    }
  }
}

// The float sums of R rows into y[r * ldy + c] for c < cols.
template <int R>
__attribute__((always_inline)) inline void store_sums(const __m512 (&f)[R][2], float* y, int64_t ldy, int64_t cols) {
  const __mmask16 first = cols >= 16 ? 0xFFFF : (1u << cols) - 1, second = cols >= 32 ? 0xFFFF : cols <= 16 ? 0 : (1u << (cols - 16)) - 1;
  for (int r = 0; r < R; ++r) {
    _mm512_mask_storeu_ps(y + r * ldy, first, f[r][0]);
    _mm512_mask_storeu_ps(y + r * ldy + 16, second, f[r][1]);
  }
}

// Weight rows [n0, n0 + 32) of an 8-bit matrix (4-bit ones take gemm_nibble_bytes here), zeros past N -> wt
// [groups][16 pairs][32] int32.
template <int Bits>
void pack_weights_int16(const uint8_t* q, int64_t n0, int64_t N, int64_t K, int32_t* wt) {
  static_assert(Bits == 8);
  const int64_t groups = K / kGroup;
  for (int half = 0; half < 2; ++half) {
    for (int64_t g = 0; g < groups; ++g) {
      __m512i r[16];
      for (int i = 0; i < 16; ++i) {
        const int64_t n = n0 + half * 16 + i;
        r[i] = n < N ? _mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + n * K + g * 32)))
                     : _mm512_setzero_si512();
      }
      transpose16(r);
      for (int p = 0; p < 16; ++p) _mm512_storeu_si512(wt + (g * 16 + p) * kInt16Cols + half * 16, r[p]);
    }
  }
}

// R rows of x (Plain int16 rows) against one packed tile: y[r * ldy + c] for c < cols.
template <int R, bool Minimum, typename T>
void int16_tile(const int16_t* xq, int64_t ldq, const float* xd, const float* xs, int64_t groups, const int32_t* wt,
               const float* ws, const float* wm, T* y, int64_t ldy, int64_t cols) {
  __m512 f[R][2];
  for (int r = 0; r < R; ++r) f[r][0] = f[r][1] = _mm512_setzero_ps();
  for (int64_t g = 0; g < groups; ++g) {
    __m512i a[R][2];
    const int32_t* wg = wt + g * 16 * kInt16Cols;
    auto pairs = [&](int p, auto first) {
      const __m512i w0 = _mm512_loadu_si512(wg + p * kInt16Cols), w1 = _mm512_loadu_si512(wg + p * kInt16Cols + 16);
      for (int r = 0; r < R; ++r) {
        int32_t pair;
        std::memcpy(&pair, xq + r * ldq + g * kGroup + 2 * p, sizeof pair);
        const __m512i b = _mm512_set1_epi32(pair);
        if constexpr (decltype(first)::value) {  // vpmaddwd starts the sums: no zeroing
          a[r][0] = _mm512_madd_epi16(b, w0);
          a[r][1] = _mm512_madd_epi16(b, w1);
        } else {
          a[r][0] = _mm512_dpwssd_epi32(a[r][0], b, w0);
          a[r][1] = _mm512_dpwssd_epi32(a[r][1], b, w1);
        }
      }
    };
    pairs(0, std::true_type{});
#pragma GCC unroll 15
    for (int p = 1; p < 16; ++p) pairs(p, std::false_type{});
    add_group<R, Minimum>(a, ws, wm, xd, xs, groups, g, f);
  }
  const __mmask16 first = cols >= 16 ? 0xFFFF : (1u << cols) - 1, second = cols >= 32 ? 0xFFFF : cols <= 16 ? 0 : (1u << (cols - 16)) - 1;
  for (int r = 0; r < R; ++r) {
    T* yr = y + r * ldy;
    if constexpr (std::is_same_v<T, float>) {
      _mm512_mask_storeu_ps(yr, first, f[r][0]);
      _mm512_mask_storeu_ps(yr + 16, second, f[r][1]);
    } else {
      alignas(64) float out[32];
      _mm512_store_ps(out, f[r][0]);
      _mm512_store_ps(out + 16, f[r][1]);
      for (int64_t c = 0; c < cols; ++c) yr[c] = T(out[c]);
    }
  }
}

#else
constexpr int64_t kInt16Cols = 16;  // weight rows per tile: two vectors of sums
// rows of x per micro-kernel pass: 6 int32 sums, 2 weight vectors and a broadcast in registers, the float sums
// spilled (one thread, in cache, Zen 3: 47-52 GMAC/s, of 66 for vpmaddwd and vpaddd alone; 4 to 6 rows, where GCC
// spills the int32 sums too, 30-43)
constexpr int kInt16Rows = 3;

// The 32 values of group g of one weight row as int16: values 0..15 (pairs 0..7) in lo, 16..31 in hi
template <int Bits>
inline void group_halves(const uint8_t* q, int64_t g, __m256i& lo, __m256i& hi) {
  if constexpr (Bits == 4) {
    const __m128i packed = _mm_loadu_si128(reinterpret_cast<const __m128i*>(q + g * 16));
    const __m128i mask = _mm_set1_epi8(0x0F);
    lo = _mm256_cvtepu8_epi16(_mm_and_si128(packed, mask));
    hi = _mm256_cvtepu8_epi16(_mm_and_si128(_mm_srli_epi16(packed, 4), mask));
  } else {
    const __m128i* p = reinterpret_cast<const __m128i*>(q + g * 32);
    lo = _mm256_cvtepi8_epi16(_mm_loadu_si128(p));
    hi = _mm256_cvtepi8_epi16(_mm_loadu_si128(p + 1));
  }
}

// r[i] lane j -> r[j] lane i, for 8 x 8 int32
inline void transpose8(__m256i r[8]) {
  __m256i t[8], u[8];
  for (int i = 0; i < 8; i += 2) {
    t[i] = _mm256_unpacklo_epi32(r[i], r[i + 1]);
    t[i + 1] = _mm256_unpackhi_epi32(r[i], r[i + 1]);
  }
  for (int i = 0; i < 8; i += 4) {
    u[i] = _mm256_unpacklo_epi64(t[i], t[i + 2]);
    u[i + 1] = _mm256_unpackhi_epi64(t[i], t[i + 2]);
    u[i + 2] = _mm256_unpacklo_epi64(t[i + 1], t[i + 3]);
    u[i + 3] = _mm256_unpackhi_epi64(t[i + 1], t[i + 3]);
  }
  for (int j = 0; j < 4; ++j) {
    r[j] = _mm256_permute2x128_si256(u[j], u[j + 4], 0x20);
    r[j + 4] = _mm256_permute2x128_si256(u[j], u[j + 4], 0x31);
  }
}

// Weight rows [n0, n0 + 16), zeros past N -> wt [groups][16 pairs][16] int32.
template <int Bits>
void pack_weights_int16(const uint8_t* q, int64_t n0, int64_t N, int64_t K, int32_t* wt) {
  const int64_t groups = K / kGroup, row_bytes = groups * group_bytes(Bits);
  for (int half = 0; half < 2; ++half) {
    for (int64_t g = 0; g < groups; ++g) {
      __m256i lo[8], hi[8];
      for (int i = 0; i < 8; ++i) {
        const int64_t n = n0 + half * 8 + i;
        if (n < N) group_halves<Bits>(q + n * row_bytes, g, lo[i], hi[i]);
        else lo[i] = hi[i] = _mm256_setzero_si256();
      }
      transpose8(lo);
      transpose8(hi);
      int32_t* out = wt + g * 16 * kInt16Cols + half * 8;
      for (int p = 0; p < 8; ++p) {
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + p * kInt16Cols), lo[p]);
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + (p + 8) * kInt16Cols), hi[p]);
      }
    }
  }
}

// R rows of x (Plain int16 rows) against one packed tile: y[r * ldy + c] for c < cols.
template <int R, bool Minimum, typename T>
void int16_tile(const int16_t* xq, int64_t ldq, const float* xd, const float* xs, int64_t groups, const int32_t* wt,
                const float* ws, const float* wm, T* y, int64_t ldy, int64_t cols) {
  __m256 f[R][2];
  for (int r = 0; r < R; ++r) f[r][0] = f[r][1] = _mm256_setzero_ps();
  for (int64_t g = 0; g < groups; ++g) {
    __m256i a[R][2];
    const int32_t* wg = wt + g * 16 * kInt16Cols;
    auto pairs = [&](int p, auto first) {
      const __m256i w0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wg + p * kInt16Cols));
      const __m256i w1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wg + p * kInt16Cols + 8));
      for (int r = 0; r < R; ++r) {
        int32_t pair;
        std::memcpy(&pair, xq + r * ldq + g * kGroup + 2 * p, sizeof pair);
        const __m256i b = _mm256_set1_epi32(pair);
        if constexpr (decltype(first)::value) {
          a[r][0] = _mm256_madd_epi16(b, w0);
          a[r][1] = _mm256_madd_epi16(b, w1);
        } else {
          a[r][0] = _mm256_add_epi32(a[r][0], _mm256_madd_epi16(b, w0));
          a[r][1] = _mm256_add_epi32(a[r][1], _mm256_madd_epi16(b, w1));
        }
      }
    };
    pairs(0, std::true_type{});
#pragma GCC unroll 5
    for (int p = 1; p < 16; ++p) pairs(p, std::false_type{});
    const __m256 s0 = _mm256_loadu_ps(ws + g * kInt16Cols), s1 = _mm256_loadu_ps(ws + g * kInt16Cols + 8);
    for (int r = 0; r < R; ++r) {
      const __m256 d = _mm256_set1_ps(xd[r * groups + g]);
      f[r][0] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(a[r][0]), _mm256_mul_ps(s0, d), f[r][0]);
      f[r][1] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(a[r][1]), _mm256_mul_ps(s1, d), f[r][1]);
    }
    if constexpr (Minimum) {  // minimum * (the group's float sum of x)
      const __m256 m0 = _mm256_loadu_ps(wm + g * kInt16Cols), m1 = _mm256_loadu_ps(wm + g * kInt16Cols + 8);
      for (int r = 0; r < R; ++r) {
        const __m256 sum = _mm256_set1_ps(xs[r * groups + g]);
        f[r][0] = _mm256_fmadd_ps(sum, m0, f[r][0]);
        f[r][1] = _mm256_fmadd_ps(sum, m1, f[r][1]);
      }
    }
  }
  for (int r = 0; r < R; ++r) {
    T* yr = y + r * ldy;
    if (std::is_same_v<T, float> && cols == kInt16Cols) {
      _mm256_storeu_ps(reinterpret_cast<float*>(yr), f[r][0]);
      _mm256_storeu_ps(reinterpret_cast<float*>(yr) + 8, f[r][1]);
    } else {
      alignas(32) float out[16];
      _mm256_store_ps(out, f[r][0]);
      _mm256_store_ps(out + 8, f[r][1]);
      for (int64_t c = 0; c < cols; ++c) yr[c] = T(out[c]);
    }
  }
}
#endif

// Rows [n0, n0 + kInt16Cols) of [N, groups] scales (or minimums), zeros past N -> dst [groups][kInt16Cols] float
template <typename S>
void pack_scales(const S* src, int64_t n0, int64_t N, int64_t groups, float* dst) {
#ifdef GROUP_GEMM_AVX512
  // 16 columns by 16 groups at a time, transposed in registers: the scalar loop's strided stores took 12 % of a
  // 16-row gate/up call on a Zen 5 (perf)
  for (int64_t half = 0; half < kInt16Cols; half += 16)
    for (int64_t g0 = 0; g0 < groups; g0 += 16) {
      const int64_t count = std::min<int64_t>(16, groups - g0);
      const __mmask16 mask = (1u << count) - 1;
      __m512i r[16];
      for (int i = 0; i < 16; ++i) {
        const int64_t n = n0 + half + i;
        const S* row = src + n * groups + g0;
        __m512 v;
        if (n >= N) v = _mm512_setzero_ps();
        else if constexpr (std::is_same_v<S, float>) v = _mm512_maskz_loadu_ps(mask, row);
        else v = _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(mask, row));
        r[i] = _mm512_castps_si512(v);
      }
      transpose16(r);
      for (int64_t g = 0; g < count; ++g) _mm512_storeu_si512(dst + (g0 + g) * kInt16Cols + half, r[g]);
    }
#else
  for (int64_t c = 0; c < kInt16Cols; ++c) {
    const int64_t n = n0 + c;
    for (int64_t g = 0; g < groups; ++g) dst[g * kInt16Cols + c] = n < N ? to_float(src[n * groups + g]) : 0.0f;
  }
#endif
}

// Weight rows [n0, n0 + kInt16Cols) copied into a buffer of this thread's: one sequential read, which the hardware
// prefetchers follow, where the packs' 16- or 32-byte reads down the tile's rows, a row's length apart, left them
// idle. Weights from memory (the decode step's case), 2 threads, a Zen 5: gate/up, down and q/k/v at 16 rows
// 389 -> 320 us, at 8 rows 468 -> 367; the 8-bit LM head at 16 rows 4.4 -> 2.8 ms. Weights already in cache pay
// for the copy (4-13 % at 12-32 rows), and the fused path's blocks of whole rows, read in order, lost by it.
inline const uint8_t* staged_tile(const uint8_t* q, int64_t n0, int64_t N, int64_t row_bytes) {
  thread_local std::vector<uint8_t> staged;
  staged.resize(kInt16Cols * row_bytes);
  std::memcpy(staged.data(), q + n0 * row_bytes, std::min(kInt16Cols, N - n0) * row_bytes);
  return staged.data();
}

// Weight rows [n0, n0 + kInt16Cols), zeros past N -> wt (pack_weights_int16), ws / wm [groups][kInt16Cols] float
// scales and minimums (wm untouched without minimums: the tile reads it only with them).
template <int Bits, typename S>
void pack_int16(const uint8_t* q, const S* scale, const S* minimum, int64_t n0, int64_t N, int64_t K, int32_t* wt,
                float* ws, float* wm) {
  const int64_t groups = K / kGroup;
  pack_weights_int16<Bits>(staged_tile(q, n0, N, groups * group_bytes(Bits)), 0, std::min(kInt16Cols, N - n0), K, wt);
  pack_scales(scale, n0, N, groups, ws);
  if (minimum) pack_scales(minimum, n0, N, groups, wm);
}

// Rows [0, M) of x against one packed tile, kInt16Rows at a time (the micro-kernels' register budget) and the rest
// in one shorter pass: pass(first row, std::integral_constant<int, rows>, std::bool_constant<with minimums>)
template <typename Pass>
void row_passes(int64_t M, bool with_minimum, const Pass& pass) {
  auto all_rows = [&](auto minimum) {
    int64_t m = 0;
    for (; m + kInt16Rows <= M; m += kInt16Rows) pass(m, std::integral_constant<int, kInt16Rows>{}, minimum);
    switch (M - m) {
      case 5: pass(m, std::integral_constant<int, 5>{}, minimum); break;
      case 4: pass(m, std::integral_constant<int, 4>{}, minimum); break;
      case 3: pass(m, std::integral_constant<int, 3>{}, minimum); break;
      case 2: pass(m, std::integral_constant<int, 2>{}, minimum); break;
      case 1: pass(m, std::integral_constant<int, 1>{}, minimum); break;
      default: break;
    }
  };
  if (with_minimum) all_rows(std::true_type{});
  else all_rows(std::false_type{});
}

#ifdef GROUP_GEMM_AVX512
// 4-bit weights, from more rows than the fused path's: gemm_int16's int16 activations split into bytes, x = 256 hi +
// lo (hi signed, lo unsigned: exact for every int16), each multiplied with vpdpbusd against the weights' own 4-bit
// values as bytes, unsigned against hi and signed against lo (0..15 is both). 256 (w . hi) + (w . lo) is
// vpdpwssd's integer sum exactly, in as many instructions, from a tile of bytes ([group][quad p][32 weight rows]:
// values 4p .. 4p + 3 of the group as one int32): half the bytes of int16 pairs and half their transposes to pack.
// A layer's four matrices, 2 threads, in cache, a Zen 5 (gemm_int16 / this, ms): 8 rows 0.186 / 0.134, 16 rows
// 0.236 / 0.211, 64 rows 0.680 / 0.663; a 16-stream decode step, its weights from memory, 1-2 % faster.
struct SplitRows {
  std::vector<int8_t> hi;   // [M, K]
  std::vector<uint8_t> lo;  // [M, K]
};

SplitRows split_rows(const QuantizedRows& rows, int64_t M, int64_t K) {
  SplitRows out{std::vector<int8_t>(M * K), std::vector<uint8_t>(M * K)};
  for (int64_t m = 0; m < M; ++m)
    for (int64_t k = 0; k < K; k += kGroup) {
      const __m512i v = _mm512_loadu_si512(rows.q.data() + m * rows.ldq + k);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(out.hi.data() + m * K + k), _mm512_cvtepi16_epi8(_mm512_srai_epi16(v, 8)));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(out.lo.data() + m * K + k), _mm512_cvtepi16_epi8(v));
    }
  return out;
}

// Weight rows [0, 32) of a 4-bit matrix, zeros from N -> wt [groups][8 quads][32] int32, two groups per transpose
void pack_weights_nibbles(const uint8_t* q, int64_t N, int64_t K, int32_t* wt) {
  const int64_t groups = K / kGroup, row_bytes = groups * group_bytes(4);
  const __m256i mask = _mm256_set1_epi8(0x0F);
  for (int half = 0; half < 2; ++half)
    for (int64_t g = 0; g < groups; g += 2) {
      const __mmask32 bytes = g + 1 < groups ? ~__mmask32(0) : __mmask32(0xFFFF);
      __m512i r[16];
      for (int i = 0; i < 16; ++i) {
        const int64_t n = half * 16 + i;
        if (n >= N) {
          r[i] = _mm512_setzero_si512();
          continue;
        }
        const __m256i packed = _mm256_maskz_loadu_epi8(bytes, q + n * row_bytes + g * 16);
        const __m256i low = _mm256_and_si256(packed, mask), high = _mm256_and_si256(_mm256_srli_epi16(packed, 4), mask);
        r[i] = _mm512_inserti64x4(_mm512_castsi256_si512(low), high, 1);  // g 0..15, g+1 0..15, g 16..31, g+1 16..31
      }
      transpose16(r);  // r[p]: bytes 4p .. 4p + 3 of that order, for each of the 16 rows
      int32_t* out = wt + g * 8 * kInt16Cols + half * 16;
      for (int s = 0; s < 4; ++s) {
        _mm512_storeu_si512(out + s * kInt16Cols, r[s]);
        _mm512_storeu_si512(out + (s + 4) * kInt16Cols, r[s + 8]);
        if (g + 1 < groups) {
          _mm512_storeu_si512(out + (8 + s) * kInt16Cols, r[s + 4]);
          _mm512_storeu_si512(out + (12 + s) * kInt16Cols, r[s + 12]);
        }
      }
    }
}

// R rows of split x against one packed tile: y[r * ldy + c] for c < cols.
template <int R, bool Minimum>
void nibble_byte_tile(const int8_t* xh, const uint8_t* xl, int64_t K, const float* xd, const float* xs, int64_t groups,
                      const int32_t* wt, const float* ws, const float* wm, float* y, int64_t ldy, int64_t cols) {
  __m512 f[R][2];
  for (int r = 0; r < R; ++r) f[r][0] = f[r][1] = _mm512_setzero_ps();
  for (int64_t g = 0; g < groups; ++g) {
    __m512i a[R][2];
    for (int r = 0; r < R; ++r) a[r][0] = a[r][1] = _mm512_setzero_si512();
    const int32_t* wg = wt + g * 8 * kInt16Cols;
    // w . hi, then times 256 before w . lo joins it: one chain of sums per row and vector, as gemm_int16's
#pragma GCC unroll 8
    for (int p = 0; p < 8; ++p) {
      const __m512i w0 = _mm512_loadu_si512(wg + p * kInt16Cols), w1 = _mm512_loadu_si512(wg + p * kInt16Cols + 16);
      for (int r = 0; r < R; ++r) {
        int32_t quad;
        std::memcpy(&quad, xh + r * K + g * kGroup + 4 * p, sizeof quad);
        const __m512i b = _mm512_set1_epi32(quad);
        a[r][0] = _mm512_dpbusd_epi32(a[r][0], w0, b);
        a[r][1] = _mm512_dpbusd_epi32(a[r][1], w1, b);
      }
    }
    for (int r = 0; r < R; ++r) {
      a[r][0] = _mm512_slli_epi32(a[r][0], 8);
      a[r][1] = _mm512_slli_epi32(a[r][1], 8);
    }
#pragma GCC unroll 8
    for (int p = 0; p < 8; ++p) {
      const __m512i w0 = _mm512_loadu_si512(wg + p * kInt16Cols), w1 = _mm512_loadu_si512(wg + p * kInt16Cols + 16);
      for (int r = 0; r < R; ++r) {
        int32_t quad;
        std::memcpy(&quad, xl + r * K + g * kGroup + 4 * p, sizeof quad);
        const __m512i b = _mm512_set1_epi32(quad);
        a[r][0] = _mm512_dpbusd_epi32(a[r][0], b, w0);
        a[r][1] = _mm512_dpbusd_epi32(a[r][1], b, w1);
      }
    }
    add_group<R, Minimum>(a, ws, wm, xd, xs, groups, g, f);
  }
  store_sums<R>(f, y, ldy, cols);
}

template <typename S>
void gemm_nibble_bytes(const float* x, int64_t M, int64_t K, const uint8_t* q, const S* scale, const S* minimum,
                       int64_t N, float* y) {
  const int64_t groups = K / kGroup;
  const QuantizedRows rows = quantize_rows(x, M, K, Layout::Plain);
  const SplitRows split = split_rows(rows, M, K);
  const int64_t tiles = (N + kInt16Cols - 1) / kInt16Cols;
  at::parallel_for(0, tiles, 1, [&](int64_t begin, int64_t end) {
    thread_local std::vector<int32_t> wt;
    thread_local std::vector<float> ws, wm;
    wt.resize(groups * 8 * kInt16Cols);
    ws.resize(groups * kInt16Cols);
    wm.resize(groups * kInt16Cols);
    for (int64_t t = begin; t < end; ++t) {
      const int64_t n0 = t * kInt16Cols, cols = std::min(kInt16Cols, N - n0);
      pack_weights_nibbles(staged_tile(q, n0, N, groups * group_bytes(4)), cols, K, wt.data());
      pack_scales(scale, n0, N, groups, ws.data());
      if (minimum) pack_scales(minimum, n0, N, groups, wm.data());
      row_passes(M, minimum != nullptr, [&](int64_t m, auto count, auto with_minimum) {
        nibble_byte_tile<decltype(count)::value, decltype(with_minimum)::value>(
            split.hi.data() + m * K, split.lo.data() + m * K, K, rows.scale.data() + m * rows.ldd,
            rows.sum.data() + m * groups, groups, wt.data(), ws.data(), wm.data(), y + m * N + n0, N, cols);
      });
    }
  });
}
#endif

template <int Bits, typename T, typename S>
void gemm_int16(const float* x, int64_t M, int64_t K, const uint8_t* q, const S* scale, const S* minimum, int64_t N,
               T* y) {
  const int64_t groups = K / kGroup;
  const QuantizedRows rows = quantize_rows(x, M, K, Layout::Plain);
  const int64_t tiles = (N + kInt16Cols - 1) / kInt16Cols;
  at::parallel_for(0, tiles, 1, [&](int64_t begin, int64_t end) {
    thread_local std::vector<int32_t> wt;
    thread_local std::vector<float> ws, wm;
    wt.resize(groups * 16 * kInt16Cols);
    ws.resize(groups * kInt16Cols);
    wm.resize(groups * kInt16Cols);
    for (int64_t t = begin; t < end; ++t) {
      const int64_t n0 = t * kInt16Cols, cols = std::min(kInt16Cols, N - n0);
      pack_int16<Bits>(q, scale, minimum, n0, N, K, wt.data(), ws.data(), wm.data());
      row_passes(M, minimum != nullptr, [&](int64_t m, auto count, auto with_minimum) {
        int16_tile<decltype(count)::value, decltype(with_minimum)::value>(
            rows.q.data() + m * rows.ldq, rows.ldq, rows.scale.data() + m * rows.ldd, rows.sum.data() + m * groups,
            groups, wt.data(), ws.data(), wm.data(), y + m * N + n0, N, cols);
      });
    }
  });
}

#ifdef GROUP_GEMM_AVX512
// 8-bit weights (the LM head) from more rows than the fused path's to kInt8MaxRows: the fused path's int8
// activations (per group, scale = largest magnitude / 127) against weight tiles transposed once per call into
// vpdpbusd's layout ([group][quad p][32 weight rows]: values 4p .. 4p + 3 of the group as one int32), so that one
// broadcast quad of x multiplies 16 weight rows, 64 products an instruction where gemm_int16's vpdpwssd makes 32.
// The weights are biased by 128 (vpdpbusd's unsigned operand) and each sum starts at -128 * (the group's sum of
// quantized x), which takes the bias out.
struct PlainBytes {
  std::vector<int8_t> q;        // [M, K]
  std::vector<float> scale;     // [M, groups]
  std::vector<float> sum;       // [M, groups]: the group's float sum of x (the minimum's term)
  std::vector<int32_t> offset;  // [M, groups]: -128 * (the group's sum of q)
};

PlainBytes quantize_plain_bytes(const float* x, int64_t M, int64_t K) {
  const int64_t groups = K / kGroup;
  PlainBytes out{std::vector<int8_t>(M * K), std::vector<float>(M * groups), std::vector<float>(M * groups),
                 std::vector<int32_t>(M * groups)};
  at::parallel_for(0, M * groups, 4096, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const float* v = x + i * kGroup;  // row i / groups, group i % groups: rows are whole groups
      __m512i low, high;
      out.scale[i] = quantize_group_int8(v, low, high);
      _mm_storeu_si128(reinterpret_cast<__m128i*>(out.q.data() + i * kGroup), _mm512_cvtsepi32_epi8(low));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(out.q.data() + i * kGroup + 16), _mm512_cvtsepi32_epi8(high));
      out.sum[i] = _mm512_reduce_add_ps(_mm512_add_ps(_mm512_loadu_ps(v), _mm512_loadu_ps(v + 16)));
      out.offset[i] = -128 * _mm512_reduce_add_epi32(_mm512_add_epi32(low, high));
    }
  });
  return out;
}

// Weight rows [n0, n0 + 32) of an 8-bit matrix, zeros past N -> wt [groups][8 quads][32] int32, biased by 128.
void pack_weights_int8(const uint8_t* q, int64_t n0, int64_t N, int64_t K, int32_t* wt) {
  const int64_t groups = K / kGroup;
  const __m512i bias = _mm512_set1_epi8(static_cast<char>(0x80));
  for (int half = 0; half < 2; ++half) {
    for (int64_t g = 0; g < groups; g += 2) {  // two groups (64 bytes, 16 quads) per transpose
      const __mmask64 bytes = g + 1 < groups ? ~__mmask64(0) : __mmask64(0xFFFFFFFF);
      __m512i r[16];
      for (int i = 0; i < 16; ++i) {
        const int64_t n = n0 + half * 16 + i;
        r[i] = n < N ? _mm512_maskz_loadu_epi8(bytes, q + n * K + g * kGroup) : _mm512_setzero_si512();
      }
      transpose16(r);
      const int quads = g + 1 < groups ? 16 : 8;
      for (int p = 0; p < quads; ++p)
        _mm512_storeu_si512(wt + (g * 8 + p) * kInt16Cols + half * 16, _mm512_xor_si512(r[p], bias));
    }
  }
}

// R rows of quantized x against one packed tile: y[r * ldy + c] for c < cols.
template <int R, bool Minimum>
void int8_tile(const int8_t* xq, int64_t K, const float* xd, const float* xs, const int32_t* xo, int64_t groups,
               const int32_t* wt, const float* ws, const float* wm, float* y, int64_t ldy, int64_t cols) {
  __m512 f[R][2];
  for (int r = 0; r < R; ++r) f[r][0] = f[r][1] = _mm512_setzero_ps();
  for (int64_t g = 0; g < groups; ++g) {
    __m512i a[R][2];
    for (int r = 0; r < R; ++r) a[r][0] = a[r][1] = _mm512_set1_epi32(xo[r * groups + g]);
    const int32_t* wg = wt + g * 8 * kInt16Cols;
#pragma GCC unroll 8
    for (int p = 0; p < 8; ++p) {
      const __m512i w0 = _mm512_loadu_si512(wg + p * kInt16Cols), w1 = _mm512_loadu_si512(wg + p * kInt16Cols + 16);
      for (int r = 0; r < R; ++r) {
        int32_t quad;
        std::memcpy(&quad, xq + r * K + g * kGroup + 4 * p, sizeof quad);
        const __m512i b = _mm512_set1_epi32(quad);
        a[r][0] = _mm512_dpbusd_epi32(a[r][0], w0, b);
        a[r][1] = _mm512_dpbusd_epi32(a[r][1], w1, b);
      }
    }
    add_group<R, Minimum>(a, ws, wm, xd, xs, groups, g, f);
  }
  store_sums<R>(f, y, ldy, cols);
}

template <typename S>
void gemm_int8(const float* x, int64_t M, int64_t K, const uint8_t* q, const S* scale, const S* minimum, int64_t N,
               float* y) {
  const int64_t groups = K / kGroup;
  const PlainBytes rows = quantize_plain_bytes(x, M, K);
  const int64_t tiles = (N + kInt16Cols - 1) / kInt16Cols;
  at::parallel_for(0, tiles, 1, [&](int64_t begin, int64_t end) {
    thread_local std::vector<int32_t> wt;
    thread_local std::vector<float> ws, wm;
    wt.resize(groups * 8 * kInt16Cols);
    ws.resize(groups * kInt16Cols);
    wm.resize(groups * kInt16Cols);
    for (int64_t t = begin; t < end; ++t) {
      const int64_t n0 = t * kInt16Cols, cols = std::min(kInt16Cols, N - n0);
      pack_weights_int8(staged_tile(q, n0, N, K), 0, cols, K, wt.data());
      pack_scales(scale, n0, N, groups, ws.data());
      if (minimum) pack_scales(minimum, n0, N, groups, wm.data());
      row_passes(M, minimum != nullptr, [&](int64_t m, auto count, auto with_minimum) {
        int8_tile<decltype(count)::value, decltype(with_minimum)::value>(
            rows.q.data() + m * K, K, rows.scale.data() + m * groups, rows.sum.data() + m * groups,
            rows.offset.data() + m * groups, groups, wt.data(), ws.data(), wm.data(), y + m * N + n0, N, cols);
      });
    }
  });
}
#endif
#endif

#if defined(GROUP_GEMM_AVX512) && defined(__AVX512BF16__)
// Float32 prompts on an AMD CPU with AVX512-BF16 (Zen 4): the weights dequantized to bfloat16 in the VNNI pairs
// oneDNN's brgemm micro-kernel reads ([K / 2][N][2], kept between calls as the tiled path's dense matrix) and x
// rounded to bfloat16, multiplied by the micro-kernel into y in float32, where torch's bfloat16 GEMM writes
// bfloat16 that must then be widened: that widening of gate/up's [256, 3072] product took 0.4-0.6 ms of each
// 2.4 ms prompt GEMM (its destination cold in cache). Same rounding as the tiled path: x and the weights to
// bfloat16, float32 sums. A prefill of 16 x 146 tokens, 8 alternating rounds in one process: median 2.69 -> 2.54 s
// (LLMSERVE_BRGEMM=0 / default); 256 rows per call in cache: q/k/v and o 10-18 % faster, gate/up level. Matrices
// over kWholeBytes dequantized (the LM head) keep the tiles.
constexpr int64_t kBrgemmRows = 32, kBrgemmCols = 64;  // x rows and weight rows per micro-kernel call

// Whether torch's build runs the micro-kernel on this CPU (oneDNN's ukernel API compiled in, bfloat16 supported):
// one small product tried once, since cpublas::brgemm raises where it cannot
bool brgemm_runs() {
  static const bool runs = [] {
    try {
      std::vector<at::BFloat16> a(16 * 32, at::BFloat16(1.0f)), b(32 * 16, at::BFloat16(1.0f));
      std::vector<float> c(16 * 16);
      at::native::cpublas::brgemm(16, 16, 32, 32, 16, 16, false, a.data(), b.data(), c.data(), true);
      at::native::cpublas::brgemm_release();
      return c[0] == 32.0f && c[255] == 32.0f;
    } catch (const std::exception&) {
      return false;
    }
  }();
  return runs;
}

template <int Bits, typename S>
void gemm_brgemm(const at::Tensor& xb, const uint8_t* q, const S* scale, const S* minimum, int64_t N, float* y) {
  const int64_t M = xb.size(0), K = xb.size(1), groups = K / kGroup, row_bytes = groups * group_bytes(Bits);
  const int64_t padded = (N + 15) / 16 * 16;
  at::Tensor dense = dense_scratch(padded, K, xb.options());
  auto* pairs = reinterpret_cast<int32_t*>(dense.data_ptr<at::BFloat16>());  // [K / 2][padded]
  at::parallel_for(0, padded / 16, 1, [&](int64_t begin, int64_t end) {
    std::vector<at::BFloat16> rows(16 * K);
    std::vector<float> scratch;
    for (int64_t b = begin; b < end; ++b) {
      for (int64_t i = 0; i < 16; ++i) {
        const int64_t n = b * 16 + i;
        if (n < N)
          dequantize_row_as<Bits, at::BFloat16>(q + n * row_bytes, scale + n * groups,
                                                minimum ? minimum + n * groups : nullptr, K, rows.data() + i * K,
                                                scratch);
        else
          std::fill_n(rows.data() + i * K, K, at::BFloat16(0.0f));
      }
      const auto* rp = reinterpret_cast<const int32_t*>(rows.data());  // [16][K / 2] pairs
      for (int64_t p = 0; p < K / 2; p += 16) {
        __m512i r[16];
        for (int i = 0; i < 16; ++i) r[i] = _mm512_loadu_si512(rp + i * (K / 2) + p);
        transpose16(r);
        for (int i = 0; i < 16; ++i) _mm512_storeu_si512(pairs + (p + i) * padded + b * 16, r[i]);
      }
    }
  });
  const int64_t row_blocks = (M + kBrgemmRows - 1) / kBrgemmRows, col_blocks = (N + kBrgemmCols - 1) / kBrgemmCols;
  const auto* xp = xb.data_ptr<at::BFloat16>();
  const auto* wp = dense.data_ptr<at::BFloat16>();
  // a column block's weights (K x 64 bfloat16, 72 KiB at K = 576) stay in cache while every row block passes
  at::parallel_for(0, row_blocks * col_blocks, 1, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const int64_t n0 = t / row_blocks * kBrgemmCols, m0 = t % row_blocks * kBrgemmRows;
      at::native::cpublas::brgemm(std::min(kBrgemmRows, M - m0), std::min(kBrgemmCols, N - n0), K, K, padded, N,
                                  false, xp + m0 * K, wp + n0 * 2, y + m0 * N + n0, true);
    }
    at::native::cpublas::brgemm_release();
  });
}
#endif

// y = x W^T with S the scales' and minimums' type (float or at::Half); mn null for symmetric weights
template <typename S>
void group_linear_into(const at::Tensor& xc, const uint8_t* qp, const S* sp, const S* mn, int64_t bits, at::Tensor& y) {
  const bool bf16 = xc.scalar_type() == at::kBFloat16;
  const int64_t M = xc.size(0), K = xc.size(1), N = y.size(1);
#if defined(GROUP_GEMM_AVX512) && defined(__AVX512BF16__)
  if (amx_takes(M)) {
    if (bf16) {
      const auto* xp = xc.data_ptr<at::BFloat16>();
      auto* yp = y.data_ptr<at::BFloat16>();
      if (bits == 4) gemm_amx<4>(xp, M, K, qp, sp, mn, N, yp);
      else gemm_amx<8>(xp, M, K, qp, sp, mn, N, yp);
    } else {
      if (bits == 4) gemm_amx<4>(xc.data_ptr<float>(), M, K, qp, sp, mn, N, y.data_ptr<float>());
      else gemm_amx<8>(xc.data_ptr<float>(), M, K, qp, sp, mn, N, y.data_ptr<float>());
    }
    return;
  }
#endif
#ifdef GROUP_GEMM_AVX512
  if (!bf16 && bits == 8 && M > fused_max_rows(8) && M <= int8_max_rows()) {
    gemm_int8(xc.data_ptr<float>(), M, K, qp, sp, mn, N, y.data_ptr<float>());
    return;
  }
#endif
  // bfloat16 rows keep the fused path to kFusedRows: gemm_int16 takes float32 ones only
  if (M > (bf16 ? std::max(kFusedRows, fused_max_rows(bits)) : fused_max_rows(bits))) {
#ifdef GROUP_GEMM_AVX2
    if (!bf16 && M <= int16_max_rows(bits)) {
#ifdef GROUP_GEMM_AVX512
      if (bits == 4) gemm_nibble_bytes(xc.data_ptr<float>(), M, K, qp, sp, mn, N, y.data_ptr<float>());
#else
      if (bits == 4) gemm_int16<4>(xc.data_ptr<float>(), M, K, qp, sp, mn, N, y.data_ptr<float>());
#endif
      else gemm_int16<8>(xc.data_ptr<float>(), M, K, qp, sp, mn, N, y.data_ptr<float>());
      return;
    }
#endif
    // float32 rows too are multiplied in bfloat16 where the CPU does that natively (prompts: twice the speed); the
    // few-row paths, which decode steps take, keep float32 activations
#if defined(GROUP_GEMM_AVX512) && defined(__AVX512BF16__)
    if (!bf16 && bfloat16_prompts() && !amx_rows() && brgemm_allowed() &&
        N * K * static_cast<int64_t>(sizeof(at::BFloat16)) <= kWholeBytes && brgemm_runs()) {
      const at::Tensor xb = xc.to(at::kBFloat16);
      if (bits == 4) gemm_brgemm<4>(xb, qp, sp, mn, N, y.data_ptr<float>());
      else gemm_brgemm<8>(xb, qp, sp, mn, N, y.data_ptr<float>());
      return;
    }
#endif
    if (bf16 || bfloat16_prompts()) {
      const at::Tensor xb = xc.to(at::kBFloat16);  // no copy when x is bfloat16 already
      at::Tensor yb = bf16 ? y : at::empty({M, N}, xc.options().dtype(at::kBFloat16));
      if (bits == 4) gemm_tiled<4, at::BFloat16>(xb, qp, sp, mn, N, yb);
      else gemm_tiled<8, at::BFloat16>(xb, qp, sp, mn, N, yb);
      if (!bf16) y.copy_(yb);
    } else {
      if (bits == 4) gemm_tiled<4, float>(xc, qp, sp, mn, N, y);
      else gemm_tiled<8, float>(xc, qp, sp, mn, N, y);
    }
    return;
  }
  // few rows: widened to float (exact from bfloat16), quantized per group (int16; int8 for 8-bit weights from
  // kByteRows rows), summed in float32
  const at::Tensor x32 = bf16 ? xc.to(at::kFloat) : xc;
#ifdef GROUP_GEMM_AVX512
  if (bits == 8 && M >= kByteRows) {
    const ByteRows rows = quantize_bytes(x32.data_ptr<float>(), M, K);
    if (bf16) gemm<8>(rows, M, qp, sp, mn, N, K, y.data_ptr<at::BFloat16>());
    else gemm<8>(rows, M, qp, sp, mn, N, K, y.data_ptr<float>());
    return;
  }
#endif
  const QuantizedRows rows = quantize_rows(x32.data_ptr<float>(), M, K, layout_for(bits, M));
  if (bf16) {
    if (bits == 4) gemm<4>(rows, M, qp, sp, mn, N, K, y.data_ptr<at::BFloat16>());
    else gemm<8>(rows, M, qp, sp, mn, N, K, y.data_ptr<at::BFloat16>());
  } else {
    if (bits == 4) gemm<4>(rows, M, qp, sp, mn, N, K, y.data_ptr<float>());
    else gemm<8>(rows, M, qp, sp, mn, N, K, y.data_ptr<float>());
  }
}

at::Tensor group_linear(const at::Tensor& x, const at::Tensor& q, const at::Tensor& scale,
                        const c10::optional<at::Tensor>& minimum, int64_t bits) {
  TORCH_CHECK(bits == 4 || bits == 8, "group_linear: bits must be 4 or 8");
  TORCH_CHECK(x.dim() == 2 && (x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16),
              "group_linear: x must be float32 or bfloat16 [M, K]");
  const bool half = scale.scalar_type() == at::kHalf;
  TORCH_CHECK((scale.scalar_type() == at::kFloat || half) && scale.dim() == 2,
              "group_linear: scale must be float32 or float16 [N, K/32]");
  const int64_t M = x.size(0), K = x.size(1), N = scale.size(0);
  TORCH_CHECK(K % kGroup == 0 && scale.size(1) == K / kGroup, "group_linear: K must be whole groups of 32");
  TORCH_CHECK(q.size(0) == N && q.size(1) == (bits == 4 ? K / 2 : K) && q.element_size() == 1,
              "group_linear: q has the wrong shape");
  const bool has_minimum = minimum.has_value() && minimum->defined();
  TORCH_CHECK(!has_minimum || (minimum->sizes() == scale.sizes() && minimum->scalar_type() == scale.scalar_type()),
              "group_linear: minimum must match scale's shape and dtype");
  const at::Tensor xc = x.contiguous(), qc = q.contiguous(), sc = scale.contiguous();
  const at::Tensor min_c = has_minimum ? minimum->contiguous() : at::Tensor();
  at::Tensor y = at::empty({M, N}, x.options());
  if (M == 0) return y;
  const auto* qp = static_cast<const uint8_t*>(qc.data_ptr());
  if (half) {
    group_linear_into<at::Half>(xc, qp, sc.data_ptr<at::Half>(), has_minimum ? min_c.data_ptr<at::Half>() : nullptr,
                                bits, y);
  } else {
    group_linear_into<float>(xc, qp, sc.data_ptr<float>(), has_minimum ? min_c.data_ptr<float>() : nullptr, bits, y);
  }
  return y;
}

int64_t fused_rows(int64_t bits) { return fused_max_rows(bits); }

// the fewest rows whose activations the fused path rounds to int8 rather than int16, for 8-bit weights (0: none)
int64_t int8_rows() {
#ifdef GROUP_GEMM_AVX512
  return kByteRows;
#else
  return 0;
#endif
}

}  // namespace

TORCH_LIBRARY(llmserve_kernels, m) {
  m.def("group_linear(Tensor x, Tensor q, Tensor scale, Tensor? minimum, int bits) -> Tensor");
  // the most rows the int16 path takes (its rounding differs from the tiled path's): for tests and benchmarks
  m.def("fused_rows(int bits) -> int", &fused_rows);
  m.def("int8_rows() -> int", &int8_rows);
  m.def("bfloat16_prompts() -> bool", &bfloat16_prompts);  // whether float32 rows beyond those multiply in bfloat16
  m.def("amx_takes(int rows) -> bool", &amx_takes);
  m.def("int16_rows(int bits) -> int", &int16_max_rows);
  m.def("int8_max_rows() -> int", &int8_max_rows);  // the most float32 rows of 8-bit weights with int8 activations  // the most float32 rows beyond those that multiply as int16
}

TORCH_LIBRARY_IMPL(llmserve_kernels, CPU, m) { m.impl("group_linear", &group_linear); }
