// Expert GEMMs on 8-bit activation codes with integer dot products (moe_registry_kernels.cpu_dot8 compiles
// this on first use, once per instruction set: the op namespace is the DOT8_NS macro, so two builds load
// side by side).
//
// Activations: each row quantised once per GEMM, per block of 32 columns (as ggml's Q8_0):
// d = amax / 127, q = round(x / d) in [-127, 127]; the block's d, and d * sum(q) for the zero-point term.
// Weights: unsigned codes u (int4: the nibble, 0..15; int8: the byte, 0..255) with a float32 scale s and an
// integer zero z per (row, group); value = (u - z) * s. uint4b8 is z = 8, uint8b128 z = 128, AWQ / GPTQ-asym
// the checkpoint's zero. e2m1 (MXFP4, NVFP4) nibbles become u = 12 + 2 * value (0..24, a 16-byte table in one
// shuffle), z = 12, the scale (e8m0, or e4m3) halved; NVFP4's float32 tensor scale multiplies each output row
// once, and its halved e4m3 group scales are kept in float16, exactly (2^-10 .. 224, four significant bits). Then
//   y = sum_g s_g * sum_{b in g} d_b * dot(u, q)_b  -  sum_g s_g * z_g * sum_{b in g} d_b * sum(q)_b,
// the first an exact int32 dot per 32-column block, the second once per row from per-token sums; where every
// zero is the type's own (no zero points) none is stored and the dot folds it in. Groups of 16 (NVFP4) split a
// block: their scales multiply the dot's int32 lanes (4 columns each) before the block's sum.
// Layout (repacked at load, cpu_dot8.py): rows in groups of RB = 4 interleaved per 64 columns,
// [N / 4][K / 64][4][CB] bytes, CB = 32 (int4: byte j holds column j in its low nibble and column 32 + j in
// its high one) or 64 (int8): one pass over the weights reads one contiguous stream, and a loaded 64-column
// chunk of four rows meets every token of the pass.
// Dots: AVX-512 VNNI (vpdpbusd: u8 x s8 summed in int32, exact), else AVX2 (int4: vpmaddubsw on u <= 15, whose
// int16 pair sums cannot saturate; int8: the codes made signed by xor 0x80 and the sign moved onto q, so
// |w| * (+-q) pairs stay inside int16, the zero then counted from 128), else scalar. Float32 everywhere else.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/Float8_e4m3fn.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#if defined(__linux__)
#include <sys/mman.h>
#endif

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define DOT8_AVX2 1
#endif
#if defined(DOT8_AVX2) && defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && \
    defined(__AVX512VNNI__)
#define DOT8_VNNI 1
#endif
#if defined(DOT8_VNNI) && defined(__AVX512BF16__)
#define DOT8_BF16 1
#endif

#ifndef DOT8_NS
#define DOT8_NS moe_registry_dot8
#endif

namespace {

constexpr int64_t QB = 32;         // activation block (columns)
constexpr int64_t CH = 64;         // columns per weight chunk; K is padded to it
constexpr int64_t RB = 4;          // interleaved rows
// e2m1 codes (sign bit 3; magnitudes 0, 0.5, 1, 1.5, 2, 3, 4, 6) as 12 + twice their value, 0..24: unsigned for
// the u8 x s8 dots, integers for exact sums; the weight's zero is 12 and the scale carries the 1/2
constexpr int8_t E2M1_BIASED_TABLE[16] = {12, 13, 14, 15, 16, 18, 20, 24, 12, 11, 10, 9, 8, 6, 4, 0};
#if defined(__AVX2__)
#define E2M1_BIASED _mm_loadu_si128(reinterpret_cast<const __m128i*>(E2M1_BIASED_TABLE))
#endif
#ifndef DOT8_TASK_BYTES
#define DOT8_TASK_BYTES 65536
#endif
constexpr int64_t TASK_BYTES = DOT8_TASK_BYTES;  // weight bytes of one expert per task
#ifndef DOT8_PREFETCH4
#define DOT8_PREFETCH4 8192
#endif
// Bytes of the weight stream fetched (into L2) ahead of the dots, per code width. The 4-bit loop spends more
// instructions per byte (the unpack), so the hardware prefetchers fall behind it and a software prefetch far
// ahead keeps it fed; the 8-bit loop runs at the stream's own pace, where software prefetches only compete with
// the hardware ones (0: none).
template <int BITS>
constexpr int64_t prefetch_ahead() { return BITS == 4 ? DOT8_PREFETCH4 : 0; }

#if defined(DOT8_VNNI)
constexpr int64_t TMAX = 2;  // tokens per pass over a row group (accumulators: 2 x RB x TMAX of 32 registers)
#else
constexpr int64_t TMAX = 1;  // AVX2 has 16 registers
#endif

// One activation row quantised: q [kp] int8, dv [kp / 32 * 8] (each block's d, 8 times: one vector load per
// block), bs [kp / 32] = d * sum(q). Columns past k are 0. per_token: one d for the whole row (amax over its k
// columns, as the W8A8 int8 schemes quantise: q = round(x / d) with d = amax / 127), else one per block.
void quant_row(const float* x, int64_t k, int64_t kp, int8_t* q, float* dv, float* bs, bool per_token) {
  float row_amax = 0.0f;
  if (per_token)
    for (int64_t c = 0; c < k; ++c) row_amax = std::max(row_amax, std::fabs(x[c]));
  for (int64_t b = 0; b < kp / QB; ++b) {
    const int64_t c0 = b * QB, c1 = std::min(k, c0 + QB);
    float amax = row_amax;
    if (!per_token)
      for (int64_t c = c0; c < c1; ++c) amax = std::max(amax, std::fabs(x[c]));
    const float d = amax / 127.0f;
    const float inv = amax > 0.0f ? 127.0f / amax : 0.0f;
    int32_t sum = 0;
    for (int64_t c = c0; c < c0 + QB; ++c) {
      // per token: x / d, as the schemes' reference divides (x * (127 / amax) may round the other way at a tie)
      const float v = c >= c1 || amax == 0.0f ? 0.0f : std::nearbyint(per_token ? x[c] / d : x[c] * inv);
      const int32_t i = static_cast<int32_t>(std::min(127.0f, std::max(-127.0f, v)));
      q[c] = static_cast<int8_t>(i);
      sum += i;
    }
    for (int j = 0; j < 8; ++j) dv[b * 8 + j] = d;
    bs[b] = d * static_cast<float>(sum);
  }
}

// A projection's weights for one expert: codes [np / 4][kp / 64][4][cb], scales and zeros [np][groups].
struct Proj {
  const uint8_t* w;
  const float* s;      // float32 group scales (groups of 32 or more)
  const uint16_t* sh;  // float16 group scales (groups of 16: NVFP4's e4m3 halved, exact in float16), else null
  const float* rs;     // a float32 multiplier per output row [np] (NVFP4's tensor scale), or null
  const uint8_t* z;    // zero points, or null where zc >= 0
  int64_t n, np, kp, groups, gs, bits;
  int64_t zc;  // every zero equals zc (no zero points: the type's own), or -1: the zeros in z
  int64_t cb() const { return bits == 4 ? 32 : 64; }
};

// float16 bits -> float32, exact (normals, subnormals, zeros; the scales are finite)
inline float half_value(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16, em = h & 0x7FFFu;
  if (em < 0x0400u) {  // zero or subnormal: em * 2^-24
    const float v = static_cast<float>(em) * 0x1p-24f;
    return sign ? -v : v;
  }
  const uint32_t bits = sign | ((em << 13) + (112u << 23));
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

// Quantised activation rows: q [rows][kp], dv [rows][kp / 4], xg [rows][groups] = sum over the group's blocks
// of d * sum(q).
struct Acts {
  const int8_t* q;
  const float* dv;
  const float* xg;
  int64_t kp, groups;
};


// The zero point's share, counted from `zbias` (the integer the dot already took as the codes' zero).
// Where (row, group)'s scale and zero sit: [np][groups]; groups of 16, [np / 4][groups / 4][4 rows][4 groups], so
// that a chunk's scales for a row group are one 64-byte line, read in step with its codes.
inline int64_t sidx(const Proj& p, int64_t row, int64_t g) {
  if (p.gs >= QB) return row * p.groups + g;
  return ((row / RB * (p.groups / 4) + g / 4) * RB + row % RB) * 4 + g % 4;
}

inline float scale_of(const Proj& p, int64_t row, int64_t g) {
  return p.sh ? half_value(p.sh[sidx(p, row, g)]) : p.s[sidx(p, row, g)];
}

inline int32_t zero_of(const Proj& p, int64_t row, int64_t g) {
  return p.zc >= 0 ? static_cast<int32_t>(p.zc) : static_cast<int32_t>(p.z[sidx(p, row, g)]);
}

inline float zero_term(const Proj& p, int64_t row, const float* xg, int zbias, int64_t g0 = 0) {
  float corr = 0.0f;
  for (int64_t g = g0; g < p.groups; ++g)
    corr += scale_of(p, row, g) * static_cast<float>(zero_of(p, row, g) - zbias) * xg[g];
  return corr;
}

#if defined(DOT8_AVX2)
// A row group's four sums, the two 128-bit halves of h added (hadd's order), times the rows' multipliers rs (null:
// none), stored into y[0 .. rows) (rows past the layer's end are padding) or added there times w.
inline void store_quad(__m256 h, const float* rs, int64_t rows, float* y, float w, bool add) {
  __m128 v = _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
  if (rs) v = _mm_mul_ps(v, _mm_loadu_ps(rs));
  if (rows >= RB) {
    _mm_storeu_ps(y, add ? _mm_fmadd_ps(v, _mm_set1_ps(w), _mm_loadu_ps(y)) : v);
    return;
  }
  float out[RB];
  _mm_storeu_ps(out, v);
  for (int64_t r = 0; r < rows; ++r) y[r] = add ? y[r] + w * out[r] : out[r];
}
#endif

// y[t][r] for the RB rows of row group `quad` and T tokens (T <= TMAX).
template <int T, int BITS, bool FP4>
void quad_dot(const Proj& p, int64_t quad, const Acts& a, const int64_t* tok, float* const* y, const float* wt) {
  static_assert(BITS == 4 || !FP4, "e2m1 codes are 4-bit");
  const int64_t cb = BITS == 4 ? 32 : 64;
  const int64_t chunks = p.kp / CH;
  [[maybe_unused]] const int64_t per_group = p.gs / CH;  // 0: groups of 32 or 16
  [[maybe_unused]] const bool lanes = p.gs < QB;  // groups of 16: a scale per 4 int32 lanes, applied per chunk
  const uint8_t* wq = p.w + quad * chunks * RB * cb;
  const int64_t n0 = quad * RB;
  [[maybe_unused]] int zbias = 0;  // the integer the dot already took as the codes' zero
  // one zero for the whole projection: the dot starts from -zc * sum(q) over each lane's columns (once per chunk
  // and token, for all four rows), so it sums (u - zc) * q exactly and no zero term is left for the end
  [[maybe_unused]] const bool zfold = p.zc >= 0;
#if defined(DOT8_VNNI)
  const __m512i low = _mm512_set1_epi8(0x0F);
  const __m512i shifts = _mm512_inserti64x4(_mm512_setzero_si512(), _mm256_set1_epi16(4), 1);
  [[maybe_unused]] const __m512i lut = _mm512_broadcast_i32x4(E2M1_BIASED);
  // lane l of a chunk's dot covers columns 4l .. 4l + 3: groups of 16 are lanes 4g .. 4g + 3
  [[maybe_unused]] const __m512i spread = _mm512_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3);
  const __m512i zcv = _mm512_set1_epi8(static_cast<char>(zfold ? p.zc : 0));
  __m512 f[RB][T];
  for (int r = 0; r < RB; ++r)
    for (int t = 0; t < T; ++t) f[r][t] = _mm512_setzero_ps();
  __m512 acc[RB][T];
  for (int r = 0; r < RB; ++r)
    for (int t = 0; t < T; ++t) acc[r][t] = _mm512_setzero_ps();
  for (int64_t c = 0; c < chunks; ++c) {
    __m512i xv[T];
    __m512 xd[T];
    for (int t = 0; t < T; ++t) {
      xv[t] = _mm512_loadu_si512(a.q + tok[t] * a.kp + c * CH);
      xd[t] = _mm512_loadu_ps(a.dv + tok[t] * (a.kp / 4) + c * 16);
    }
    __m512i zq[T];
    for (int t = 0; t < T; ++t)
      zq[t] = _mm512_sub_epi32(_mm512_setzero_si512(), _mm512_dpbusd_epi32(_mm512_setzero_si512(), zcv, xv[t]));
    const uint8_t* wc = wq + c * RB * cb;
    if (prefetch_ahead<BITS>() > 0)
      for (int64_t l = 0; l < RB * cb; l += 64)
        _mm_prefetch(reinterpret_cast<const char*>(wc + prefetch_ahead<BITS>() + l), _MM_HINT_T1);
    // groups of 16: the chunk's 4 rows x 4 group scales, one 32-byte run of float16 (sidx), widened once
    __m512 sc16 = _mm512_setzero_ps();
    if (lanes) sc16 = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p.sh + sidx(p, n0, 4 * c))));
    for (int r = 0; r < RB; ++r) {
      __m512i w;
      if (BITS == 4) {
        const __m512i b = _mm512_broadcast_i64x4(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(wc + r * 32)));
        w = _mm512_and_si512(_mm512_srlv_epi16(b, shifts), low);
        if (FP4) w = _mm512_shuffle_epi8(lut, w);
      } else {
        w = _mm512_loadu_si512(wc + r * 64);
      }
      if (lanes) {  // the row's four group scales of this chunk, spread over their lanes, join the activation scale
        const __m512 sv = _mm512_permutexvar_ps(_mm512_add_epi32(spread, _mm512_set1_epi32(4 * r)), sc16);
        for (int t = 0; t < T; ++t) {
          const __m512i d = _mm512_dpbusd_epi32(zq[t], w, xv[t]);
          f[r][t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(d), _mm512_mul_ps(xd[t], sv), f[r][t]);
        }
        continue;
      }
      for (int t = 0; t < T; ++t) {
        const __m512i d = _mm512_dpbusd_epi32(zq[t], w, xv[t]);
        acc[r][t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(d), xd[t], acc[r][t]);
      }
    }
    // a group ends: its sums times the row's scale (groups of 32: two per chunk, one scale per 8 lanes)
    if (!lanes && (per_group == 0 || (c + 1) % per_group == 0)) {
      for (int r = 0; r < RB; ++r) {
        const float* sr = p.s + (n0 + r) * p.groups;
        const __m512 s = per_group == 0
                             ? _mm512_castpd_ps(_mm512_insertf64x4(_mm512_castps_pd(_mm512_set1_ps(sr[2 * c])),
                                                                  _mm256_castps_pd(_mm256_set1_ps(sr[2 * c + 1])), 1))
                             : _mm512_set1_ps(sr[c / per_group]);
        for (int t = 0; t < T; ++t) {
          f[r][t] = _mm512_fmadd_ps(acc[r][t], s, f[r][t]);
          acc[r][t] = _mm512_setzero_ps();
        }
      }
    }
  }
  // the zero points' share, lane by lane into the sums before they are reduced: f -= s * z * xg per group
  for (int64_t g0 = 0; !zfold && g0 < p.groups; g0 += 16) {
    const __mmask16 m = p.groups - g0 >= 16 ? static_cast<__mmask16>(0xFFFF)
                                            : static_cast<__mmask16>((1u << (p.groups - g0)) - 1);
    for (int r = 0; r < RB; ++r) {
      const int64_t at = (n0 + r) * p.groups + g0;
      const __m512 z = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_maskz_loadu_epi8(m, p.z + at)));
      const __m512 sz = _mm512_mul_ps(_mm512_maskz_loadu_ps(m, p.s + at), z);
      for (int t = 0; t < T; ++t)
        f[r][t] = _mm512_fnmadd_ps(sz, _mm512_maskz_loadu_ps(m, a.xg + tok[t] * a.groups + g0), f[r][t]);
    }
  }
  for (int t = 0; t < T; ++t) {  // the four rows' sums at once
    __m256 x[RB];
    for (int r = 0; r < RB; ++r)
      x[r] = _mm256_add_ps(_mm512_castps512_ps256(f[r][t]),
                           _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(f[r][t]), 1)));
    store_quad(_mm256_hadd_ps(_mm256_hadd_ps(x[0], x[1]), _mm256_hadd_ps(x[2], x[3])), p.rs ? p.rs + n0 : nullptr,
               p.n - n0, y[t] + n0, wt ? wt[t] : 0.0f, wt != nullptr);
  }
#elif defined(DOT8_AVX2)
  const __m256i low = _mm256_set1_epi8(0x0F);
  const __m256i ones = _mm256_set1_epi16(1);
  const __m256i flip = _mm256_set1_epi8(static_cast<char>(0x80));
  [[maybe_unused]] const __m256i lut = _mm256_broadcastsi128_si256(E2M1_BIASED);
  if (BITS == 8) zbias = 128;
  // 4-bit codes fold their zero into the dot (above); 8-bit ones take it from 128 already, by the sign trick
  const bool zdone = BITS == 4 ? zfold : p.zc == 128;
  const __m256i zcv = _mm256_set1_epi8(static_cast<char>(zfold && BITS == 4 ? p.zc : 0));
  __m256 f[RB][T];
  for (int r = 0; r < RB; ++r)
    for (int t = 0; t < T; ++t) f[r][t] = _mm256_setzero_ps();
  __m256 acc[RB][T];
  for (int r = 0; r < RB; ++r)
    for (int t = 0; t < T; ++t) acc[r][t] = _mm256_setzero_ps();
  for (int64_t c = 0; c < chunks; ++c) {
    const uint8_t* wc = wq + c * RB * cb;
    if (prefetch_ahead<BITS>() > 0)
      for (int64_t l = 0; l < RB * cb; l += 64)
        _mm_prefetch(reinterpret_cast<const char*>(wc + prefetch_ahead<BITS>() + l), _MM_HINT_T1);
    for (int h = 0; h < 2; ++h) {  // the chunk's two 32-column blocks
      __m256i xv[T];
      __m256 xd[T];
      for (int t = 0; t < T; ++t) {
        xv[t] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a.q + tok[t] * a.kp + c * CH + h * 32));
        xd[t] = _mm256_loadu_ps(a.dv + tok[t] * (a.kp / 4) + c * 16 + h * 8);
      }
      __m256i zq[T];
      for (int t = 0; t < T; ++t) zq[t] = _mm256_madd_epi16(_mm256_maddubs_epi16(zcv, xv[t]), ones);
      for (int r = 0; r < RB; ++r) {
        if (BITS == 4) {
          const __m256i b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wc + r * 32));
          __m256i w = h == 0 ? _mm256_and_si256(b, low) : _mm256_and_si256(_mm256_srli_epi16(b, 4), low);
          if (FP4) w = _mm256_shuffle_epi8(lut, w);  // codes <= 24: the int16 pair sums stay far from saturating
          if (lanes) {  // lanes 0-3 are the block's first 16 columns, 4-7 its second
            const uint16_t* sg = p.sh + sidx(p, n0 + r, 4 * c + 2 * h);
            const __m256 sv = _mm256_insertf128_ps(_mm256_castps128_ps256(_mm_set1_ps(half_value(sg[0]))),
                                                   _mm_set1_ps(half_value(sg[1])), 1);
            for (int t = 0; t < T; ++t) {
              const __m256i d = _mm256_sub_epi32(_mm256_madd_epi16(_mm256_maddubs_epi16(w, xv[t]), ones), zq[t]);
              f[r][t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(d), _mm256_mul_ps(xd[t], sv), f[r][t]);
            }
            continue;
          }
          for (int t = 0; t < T; ++t) {
            const __m256i d = _mm256_sub_epi32(_mm256_madd_epi16(_mm256_maddubs_epi16(w, xv[t]), ones), zq[t]);
            acc[r][t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(d), xd[t], acc[r][t]);
          }
        } else {
          const __m256i w = _mm256_xor_si256(
              _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wc + r * 64 + h * 32)), flip);
          const __m256i aw = _mm256_abs_epi8(w);
          for (int t = 0; t < T; ++t) {
            const __m256i d = _mm256_madd_epi16(_mm256_maddubs_epi16(aw, _mm256_sign_epi8(xv[t], w)), ones);
            acc[r][t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(d), xd[t], acc[r][t]);
          }
        }
      }
      // a group ends: after each block for groups of 32, else after its last chunk
      if (!lanes && (per_group == 0 || (h == 1 && (c + 1) % per_group == 0))) {
        const int64_t g = per_group == 0 ? 2 * c + h : c / per_group;
        for (int r = 0; r < RB; ++r) {
          const __m256 s = _mm256_set1_ps(p.s[(n0 + r) * p.groups + g]);
          for (int t = 0; t < T; ++t) {
            f[r][t] = _mm256_fmadd_ps(acc[r][t], s, f[r][t]);
            acc[r][t] = _mm256_setzero_ps();
          }
        }
      }
    }
  }
  // the zero points' share, lane by lane into the sums before they are reduced (groups past a multiple of 8: after)
  int64_t g0 = zdone ? p.groups : 0;
  for (; g0 + 8 <= p.groups; g0 += 8) {
    for (int r = 0; r < RB; ++r) {
      const int64_t at = (n0 + r) * p.groups + g0;
      const __m256 z = _mm256_sub_ps(
          p.zc >= 0 ? _mm256_set1_ps(static_cast<float>(p.zc))
                    : _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p.z + at)))),
          _mm256_set1_ps(static_cast<float>(zbias)));
      const __m256 sz = _mm256_mul_ps(_mm256_loadu_ps(p.s + at), z);
      for (int t = 0; t < T; ++t)
        f[r][t] = _mm256_fnmadd_ps(sz, _mm256_loadu_ps(a.xg + tok[t] * a.groups + g0), f[r][t]);
    }
  }
  for (int t = 0; t < T; ++t) {
    __m256 h = _mm256_hadd_ps(_mm256_hadd_ps(f[0][t], f[1][t]), _mm256_hadd_ps(f[2][t], f[3][t]));
    if (g0 < p.groups) {
      float rest[RB];
      for (int r = 0; r < RB; ++r) rest[r] = zero_term(p, n0 + r, a.xg + tok[t] * a.groups, zbias, g0);
      h = _mm256_sub_ps(h, _mm256_setr_ps(rest[0], rest[1], rest[2], rest[3], 0.0f, 0.0f, 0.0f, 0.0f));
    }
    store_quad(h, p.rs ? p.rs + n0 : nullptr, p.n - n0, y[t] + n0, wt ? wt[t] : 0.0f, wt != nullptr);
  }
#else
  float res[RB][T];
  for (int r = 0; r < RB; ++r)
    for (int t = 0; t < T; ++t) {
      float fr = 0.0f;
      for (int64_t c = 0; c < chunks; ++c) {
        const uint8_t* wc = wq + (c * RB + r) * cb;
        for (int64_t b = 0; b < 2; ++b) {
          const int64_t part = std::min<int64_t>(p.gs, QB);  // columns under one weight scale
          for (int64_t j0 = 0; j0 < QB; j0 += part) {
            int32_t dot = 0;
            for (int64_t j = j0; j < j0 + part; ++j) {
              int32_t u = BITS == 4 ? (b == 0 ? wc[j] & 0xF : wc[j] >> 4) : wc[b * 32 + j];
              if (FP4) u = E2M1_BIASED_TABLE[u];
              dot += u * a.q[tok[t] * a.kp + c * CH + b * 32 + j];
            }
            const int64_t g = (c * CH + b * 32 + j0) / p.gs;
            fr += static_cast<float>(dot) * a.dv[tok[t] * (a.kp / 4) + (c * 2 + b) * 8] * scale_of(p, n0 + r, g);
          }
        }
      }
      res[r][t] = fr;
    }
  for (int r = 0; r < RB; ++r) {
    if (n0 + r >= p.n) break;
    for (int t = 0; t < T; ++t) {
      const float v = (res[r][t] - zero_term(p, n0 + r, a.xg + tok[t] * a.groups, zbias)) * (p.rs ? p.rs[n0 + r] : 1.0f);
      if (wt) y[t][n0 + r] += wt[t] * v;
      else y[t][n0 + r] = v;
    }
  }
#endif
}

// The RB-row groups [q0, q1) for ntok pairs (activation rows tok, outputs y; wt: router weights to add the
// outputs with, null: store them).
template <int BITS, bool FP4>
void rows_dot(const Proj& p, int64_t q0, int64_t q1, const Acts& a, const int64_t* tok, int64_t ntok,
              float* const* y, const float* wt) {
  for (int64_t quad = q0; quad < q1; ++quad) {
    int64_t t = 0;
#if defined(DOT8_VNNI)
    for (; t + 2 <= ntok; t += 2) quad_dot<2, BITS, FP4>(p, quad, a, tok + t, y + t, wt ? wt + t : nullptr);
#endif
    for (; t < ntok; ++t) quad_dot<1, BITS, FP4>(p, quad, a, tok + t, y + t, wt ? wt + t : nullptr);
  }
}

// Tasks 0 .. tasks - 1, each run once, in one parallel region of torch's intra-op (OpenMP) pool, every thread
// taking the next task as it comes free. The pool is the one torch's own ops use: a pool of our own would meet
// its threads still spinning after the op before (libgomp's default wait policy) and lose the cores to them.
template <typename F>
void parallel_tasks(int64_t tasks, const F& fn) {
  const int64_t threads = std::min<int64_t>(tasks, at::get_num_threads());
  if (threads <= 1 || at::in_parallel_region()) {
    for (int64_t t = 0; t < tasks; ++t) fn(t);
    return;
  }
  std::atomic<int64_t> next{0};
  at::parallel_for(0, threads, 1, [&](int64_t b0, int64_t b1) {
    for (int64_t i = b0; i < b1; ++i)
      for (int64_t t = next.fetch_add(1); t < tasks; t = next.fetch_add(1)) fn(t);
  });
}

enum Act : int64_t { ACT_NONE = 0, ACT_SILU = 1, ACT_GELU = 2, ACT_SWIGLUOAI = 3 };

// act(gate) * up over one row [gate | up] of 2k values, as moe_registry_kernels.activations computes it.
void act_row(const float* h, int64_t k, int64_t act, float alpha, float limit, float* out) {
  for (int64_t c = 0; c < k; ++c) {
    float g = h[c], u = h[k + c];
    if (act == ACT_SILU) {
      out[c] = g / (1.0f + std::exp(-g)) * u;
    } else if (act == ACT_GELU) {
      out[c] = 0.5f * g * (1.0f + std::erf(g * 0.70710678118654752f)) * u;
    } else {
      g = std::min(g, limit);
      u = std::min(std::max(u, -limit), limit);
      out[c] = (u + 1.0f) * g / (1.0f + std::exp(-alpha * g));
    }
  }
}

// fp8e4m3 weights times fp8e4m3 activations (fp8_gemm). The activations are quantised as the FP8 W8A8 schemes
// declare (per 128 columns with 128x128 weight blocks, per token with channel scales; s = max(amax, floor) / 448,
// q = e4m3(x / s), as quant_ref does), so both sides are e4m3 codes: a product of two has at most 8 significant
// bits and is exact in float32, each group's dot is exact but for its float32 sums, and
// y = sum_g s_w,g * s_x,g * dot_g - the reference's numbers but for the order of float32 roundings.
// AVX-512 BF16: every e4m3 value is a bfloat16 exactly (the subnormals 2^-9 .. 7 * 2^-9 are bfloat16 normals); the
// codes become bfloat16 bits by a table over their 7 magnitude bits (vpermi2w, two 64-entry halves) with the sign
// or'ed back, and vdpbf16ps sums pairwise products in float32. Its flushing of bfloat16 subnormal inputs and
// float32 subnormal results cannot act: no code is below 2^-9, no nonzero product below 2^-18. Other builds:
// float32 FMAs on the codes' float32 bits (fp8 * 2^-120, exact, subnormals included, as cpu_moe.cpp decodes them)
// times the activation codes * 2^60; each group's sum is brought back by 2^60.
#if defined(DOT8_BF16)
using F8Act = uint16_t;  // the activation code's bfloat16 bits
#else
using F8Act = float;  // the activation code * 2^60
#endif

struct F8Proj {
  const uint8_t* w;  // codes [np / 4][kp / 64][4][64]
  const float* s;    // scales [np][groups]
  int64_t n, kp, groups, gs;
};

struct F8Acts {
  const F8Act* q;  // [rows][kp]
  const float* s;  // [rows][groups]
  int64_t kp, groups;
};

inline float e4m3_scaled(uint8_t b) {  // fp8 * 2^-120 as float32, exact
  const int32_t i = (static_cast<int32_t>(static_cast<int8_t>(b)) << 20) & static_cast<int32_t>(0x87FFFFFFu);
  float f;
  std::memcpy(&f, &i, 4);
  return f;
}

#if defined(DOT8_BF16)
// bfloat16 bits of every e4m3 magnitude 0..127 (127, NaN, is refused when a checkpoint loads)
const uint16_t* e4m3_bf16_table() {
  alignas(64) static uint16_t table[128];
  static const bool filled = [] {
    for (int m = 0; m < 128; ++m) {
      const float v = e4m3_scaled(static_cast<uint8_t>(m)) * 0x1p120f;
      uint32_t bits;
      std::memcpy(&bits, &v, 4);
      table[m] = static_cast<uint16_t>(bits >> 16);  // exact: an e4m3 value has 4 significant bits
    }
    return true;
  }();
  (void)filled;
  return table;
}
#endif

// y[t][r] for the RB rows of row group `quad` and T tokens.
template <int T>
void f8_quad(const F8Proj& p, int64_t quad, const F8Acts& a, const int64_t* tok, float* const* y, const float* wt) {
  const int64_t chunks = p.kp / CH, per_group = p.gs / CH;
  const uint8_t* wq = p.w + quad * chunks * RB * CH;
  const int64_t n0 = quad * RB;
  // a group ends after its last chunk, or the row's (a partial last block)
  auto ends = [&](int64_t c) { return (c + 1) % per_group == 0 || c + 1 == chunks; };
  auto factor = [&](int r, int t, int64_t g) { return p.s[(n0 + r) * p.groups + g] * a.s[tok[t] * a.groups + g]; };
#if defined(DOT8_BF16)
  const uint16_t* tab = e4m3_bf16_table();
  const __m512i t0 = _mm512_load_si512(tab), t1 = _mm512_load_si512(tab + 32);
  const __m512i t2 = _mm512_load_si512(tab + 64), t3 = _mm512_load_si512(tab + 96);
  const __m512i bit6 = _mm512_set1_epi16(0x40), sign = _mm512_set1_epi16(static_cast<int16_t>(0x8000));
  __m512 f[RB][T], acc[RB][T];
  for (int r = 0; r < RB; ++r)
    for (int t = 0; t < T; ++t) f[r][t] = acc[r][t] = _mm512_setzero_ps();
  for (int64_t c = 0; c < chunks; ++c) {
    __m512i xv[T][2];
    for (int t = 0; t < T; ++t)
      for (int h = 0; h < 2; ++h) xv[t][h] = _mm512_loadu_si512(a.q + tok[t] * a.kp + c * CH + h * 32);
    const uint8_t* wc = wq + c * RB * CH;
    for (int r = 0; r < RB; ++r)
      for (int h = 0; h < 2; ++h) {
        // sign-extended: bits 5..0 index a table half, bit 6 picks the half, bit 15 is the sign
        const __m512i w16 = _mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(wc + r * 64 + h * 32)));
        const __m512i v = _mm512_mask_blend_epi16(_mm512_test_epi16_mask(w16, bit6), _mm512_permutex2var_epi16(t0, w16, t1),
                                                  _mm512_permutex2var_epi16(t2, w16, t3));
        const __m512i b = _mm512_ternarylogic_epi32(v, w16, sign, 0xF8);  // v | (w16 & sign)
        for (int t = 0; t < T; ++t) acc[r][t] = _mm512_dpbf16_ps(acc[r][t], (__m512bh)b, (__m512bh)xv[t][h]);
      }
    if (ends(c))
      for (int r = 0; r < RB; ++r)
        for (int t = 0; t < T; ++t) {
          f[r][t] = _mm512_fmadd_ps(acc[r][t], _mm512_set1_ps(factor(r, t, c / per_group)), f[r][t]);
          acc[r][t] = _mm512_setzero_ps();
        }
  }
  for (int t = 0; t < T; ++t) {
    __m256 x[RB];
    for (int r = 0; r < RB; ++r)
      x[r] = _mm256_add_ps(_mm512_castps512_ps256(f[r][t]),
                           _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(f[r][t]), 1)));
    store_quad(_mm256_hadd_ps(_mm256_hadd_ps(x[0], x[1]), _mm256_hadd_ps(x[2], x[3])), nullptr, p.n - n0, y[t] + n0,
               wt ? wt[t] : 0.0f, wt != nullptr);
  }
#elif defined(DOT8_AVX2)
  const __m256i keep = _mm256_set1_epi32(static_cast<int32_t>(0x87FFFFFFu));
  const __m256 back = _mm256_set1_ps(0x1p60f);
  __m256 f[RB][T], acc[RB][T];
  for (int r = 0; r < RB; ++r)
    for (int t = 0; t < T; ++t) f[r][t] = acc[r][t] = _mm256_setzero_ps();
  for (int64_t c = 0; c < chunks; ++c) {
    const uint8_t* wc = wq + c * RB * CH;
    for (int64_t j = 0; j < CH; j += 8) {
      __m256 xv[T];
      for (int t = 0; t < T; ++t) xv[t] = _mm256_loadu_ps(a.q + tok[t] * a.kp + c * CH + j);
      for (int r = 0; r < RB; ++r) {
        const __m256i i = _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(wc + r * 64 + j)));
        const __m256 w = _mm256_castsi256_ps(_mm256_and_si256(_mm256_slli_epi32(i, 20), keep));
        for (int t = 0; t < T; ++t) acc[r][t] = _mm256_fmadd_ps(w, xv[t], acc[r][t]);
      }
    }
    if (ends(c))
      for (int r = 0; r < RB; ++r)
        for (int t = 0; t < T; ++t) {
          f[r][t] = _mm256_fmadd_ps(_mm256_mul_ps(acc[r][t], back), _mm256_set1_ps(factor(r, t, c / per_group)),
                                    f[r][t]);
          acc[r][t] = _mm256_setzero_ps();
        }
  }
  for (int t = 0; t < T; ++t)
    store_quad(_mm256_hadd_ps(_mm256_hadd_ps(f[0][t], f[1][t]), _mm256_hadd_ps(f[2][t], f[3][t])), nullptr, p.n - n0,
               y[t] + n0, wt ? wt[t] : 0.0f, wt != nullptr);
#else
  for (int r = 0; r < RB && n0 + r < p.n; ++r)
    for (int t = 0; t < T; ++t) {
      float fr = 0.0f, dot = 0.0f;
      for (int64_t c = 0; c < chunks; ++c) {
        for (int64_t j = 0; j < CH; ++j)
          dot += e4m3_scaled(wq[(c * RB + r) * CH + j]) * a.q[tok[t] * a.kp + c * CH + j];
        if (ends(c)) {
          fr += dot * 0x1p60f * factor(r, t, c / per_group);
          dot = 0.0f;
        }
      }
      if (wt) y[t][n0 + r] += wt[t] * fr;
      else y[t][n0 + r] = fr;
    }
#endif
}

void f8_rows(const F8Proj& p, int64_t q0, int64_t q1, const F8Acts& a, const int64_t* tok, int64_t ntok,
             float* const* y, const float* wt) {
  for (int64_t quad = q0; quad < q1; ++quad) {
    int64_t t = 0;
#if defined(DOT8_BF16)
    for (; t + 2 <= ntok; t += 2) f8_quad<2>(p, quad, a, tok + t, y + t, wt ? wt + t : nullptr);
#endif
    for (; t < ntok; ++t) f8_quad<1>(p, quad, a, tok + t, y + t, wt ? wt + t : nullptr);
  }
}

// One activation row quantised to e4m3 per group of gs columns (the last one partial): s [groups], q [kp] (columns
// past k: 0), bit-equal to quant_ref's fake quantisation (cpu_moe.cpp's fp8_fake_quant computes it alike).
void f8_quant_row(const float* x, int64_t k, int64_t kp, int64_t gs, float amax_floor, F8Act* q, float* s) {
  for (int64_t g = 0, c0 = 0; c0 < kp; ++g, c0 += gs) {
    const int64_t c1 = std::min(k, c0 + gs);
    float amax = 0.0f;
    for (int64_t c = c0; c < c1; ++c) amax = std::max(amax, std::fabs(x[c]));
    const float sc = std::max(amax, amax_floor) / 448.0f;
    s[g] = sc;
    for (int64_t c = c0; c < std::min(kp, c0 + gs); ++c) {
      const float v = c < c1 ? static_cast<float>(c10::Float8_e4m3fn(std::min(std::max(x[c] / sc, -448.0f), 448.0f)))
                             : 0.0f;
#if defined(DOT8_BF16)
      uint32_t bits;
      std::memcpy(&bits, &v, 4);
      q[c] = static_cast<uint16_t>(bits >> 16);  // exact: an e4m3 value
#else
      q[c] = v * 0x1p60f;
#endif
    }
  }
}

// The checks every GEMM op makes of its activation rows a [R, K] (act: [R, 2K]), pairs' experts [P], router
// weights and output rows; returns K.
int64_t check_pairs(const at::Tensor& a, int64_t row_div, const at::Tensor& experts, int64_t e, int64_t np,
                    int64_t kp, int64_t n, int64_t act, const c10::optional<at::Tensor>& combine, int64_t per) {
  TORCH_CHECK(act >= ACT_NONE && act <= ACT_SWIGLUOAI, "act: 0 (none), 1 (silu), 2 (gelu) or 3 (swigluoai)");
  TORCH_CHECK(a.dim() == 2 && a.is_contiguous() && a.scalar_type() == at::kFloat, "a: contiguous float32 [R, K]");
  TORCH_CHECK(experts.dim() == 1 && experts.scalar_type() == at::kLong && experts.is_contiguous(), "experts: int64 [P]");
  TORCH_CHECK(act == ACT_NONE || a.size(1) % 2 == 0, "a: [gate | up] rows of an even width with an activation");
  const int64_t k = act == ACT_NONE ? a.size(1) : a.size(1) / 2;
  TORCH_CHECK(k <= kp && kp - k < CH, "a's K = ", k, " does not match the codes' padded K = ", kp);
  TORCH_CHECK(n > np - RB && n <= np, "n = ", n, " does not match the codes' ", np, " rows");
  const int64_t r = a.size(0), pairs = experts.size(0);
  TORCH_CHECK(row_div > 0 && (pairs + row_div - 1) / row_div <= r, "row_div = ", row_div, ": ", pairs,
              " pairs need more than a's ", r, " rows");
  if (combine.has_value() && combine->defined())
    TORCH_CHECK(combine->dim() == 1 && combine->is_contiguous() && combine->scalar_type() == at::kFloat &&
                    combine->size(0) == pairs && per > 0 && pairs % per == 0,
                "combine: contiguous float32 [P] and per dividing P");
  const int64_t* ep = experts.data_ptr<int64_t>();
  for (int64_t i = 0; i < pairs; ++i)
    TORCH_CHECK(ep[i] < e, "experts[", i, "] = ", ep[i], " is outside [0, ", e, ")");
  return k;
}

// Each activation row of a once, act(gate) * up where act != 0, handed to quant(row index, its k values); 16 rows a
// task.
template <typename F>
void each_row(const at::Tensor& a, int64_t k, int64_t act, double alpha, double limit, const F& quant) {
  const float* ap = a.data_ptr<float>();
  const int64_t r = a.size(0), lda = a.size(1);
  constexpr int64_t ROWS_PER_TASK = 16;
  parallel_tasks((r + ROWS_PER_TASK - 1) / ROWS_PER_TASK, [&](int64_t task) {
    const int64_t r0 = task * ROWS_PER_TASK, r1 = std::min(r, r0 + ROWS_PER_TASK);
    std::vector<float> row(act == ACT_NONE ? 0 : k);
    for (int64_t i = r0; i < r1; ++i) {
      const float* x = ap + i * lda;
      if (act != ACT_NONE) {
        act_row(x, k, act, static_cast<float>(alpha), static_cast<float>(limit), row.data());
        x = row.data();
      }
      quant(i, x);
    }
  });
}

// The pairs grouped by expert (counting sort), then rows(expert, first row group, end row group, the pairs'
// activation rows, their count, their output rows, their router weights or null) for each (expert, block of rows of
// about TASK_BYTES) - with combine, each block of rows over every expert, so no two threads add into one output - as
// the tasks of one parallel_tasks call, each handed to whichever thread is free.
template <typename F>
void run_pairs(const at::Tensor& experts, int64_t e, int64_t row_div, const c10::optional<at::Tensor>& combine,
               int64_t per, at::Tensor& y, int64_t np, int64_t row_bytes, const F& rows) {
  const int64_t pairs = experts.size(0), n = y.size(1);
  const int64_t* ep = experts.data_ptr<int64_t>();
  const bool combined = combine.has_value() && combine->defined();
  std::vector<int64_t> start(e + 1, 0);
  for (int64_t i = 0; i < pairs; ++i)
    if (ep[i] >= 0) ++start[ep[i] + 1];
  for (int64_t x = 0; x < e; ++x) start[x + 1] += start[x];
  std::vector<int64_t> order(start[e]), fill(start.begin(), start.end() - 1);
  for (int64_t i = 0; i < pairs; ++i)
    if (ep[i] >= 0) order[fill[ep[i]]++] = i;
  float* yp = y.data_ptr<float>();
  const float* wp = combined ? combine->data_ptr<float>() : nullptr;
  std::vector<int64_t> tok(order.size());
  std::vector<float*> yrow(order.size());
  std::vector<float> wt(combined ? order.size() : 0);
  for (size_t i = 0; i < order.size(); ++i) {
    tok[i] = order[i] / row_div;
    yrow[i] = yp + (combined ? order[i] / per : order[i]) * n;
    if (combined) wt[i] = wp[order[i]];
  }
  std::vector<int64_t> used;
  for (int64_t x = 0; x < e; ++x)
    if (start[x + 1] > start[x]) used.push_back(x);
  // rows per task: about TASK_BYTES of one expert's weights, one stream the prefetchers follow
  const int64_t block = std::max<int64_t>(RB, std::min<int64_t>(np, TASK_BYTES / row_bytes) / RB * RB);
  const int64_t blocks = (np + block - 1) / block;
  const int64_t tasks = combined ? blocks : static_cast<int64_t>(used.size()) * blocks;
  auto expert_rows = [&](int64_t x, int64_t blk) {
    const int64_t first = start[x];
    rows(x, blk * block / RB, std::min(np, (blk + 1) * block) / RB, tok.data() + first, start[x + 1] - first,
         yrow.data() + first, combined ? wt.data() + first : nullptr);
  };
  parallel_tasks(tasks, [&](int64_t t) {
    if (combined) {
      for (int64_t x : used) expert_rows(x, t);
    } else {
      expert_rows(used[t / blocks], t % blocks);
    }
  });
}

}  // namespace

// The pairs' GEMMs: pair i multiplies activation row i / row_div of a by expert experts[i]'s weights
// (experts[i] < 0: a foreign expert, it adds nothing). codes [E, Np / 4, Kp / 64, 4, CB] uint8, scale [E, Np, G]
// float32 (groups of 16: float16, in sidx's order), zero [E, Np, G] uint8 (zero_const >= 0: empty, every zero is
// zero_const and the dots fold it in), row_scale [E, Np] float32 multiplying each output row (or none); n the real
// rows (Np: n rounded up to 4), bits 4 or 8, e2m1: the 4-bit codes are FP4, gs the columns per scale group (16, 32
// or a multiple of 64; per channel: Kp). act != 0: a's rows are [gate | up] of 2K and the GEMM's input is
// act(gate) * up (silu, gelu, swigluoai with alpha and limit). Without combine: y [P, N]; with combine (router
// weights [P]): y [P / per, N], row j = sum over pairs i of token j (i / per) of combine[i] * pair i's output.
// The rows are quantised once, then run_pairs runs the (expert, block of rows) tasks.
at::Tensor dot8_gemm(at::Tensor a, int64_t row_div, at::Tensor experts, at::Tensor codes, at::Tensor scale,
                     at::Tensor zero, int64_t zero_const, c10::optional<at::Tensor> row_scale, int64_t n, int64_t bits,
                     bool e2m1, int64_t gs, int64_t act, double alpha, double limit,
                     c10::optional<at::Tensor> combine, int64_t per, bool per_token) {
  TORCH_CHECK(bits == 4 || bits == 8, "bits must be 4 or 8");
  TORCH_CHECK(bits == 4 || !e2m1, "e2m1 codes are 4-bit");
  const bool fp4 = e2m1;
  TORCH_CHECK(zero_const >= -1 && zero_const <= 255, "zero_const: the one zero of every code (0..255), or -1");
  TORCH_CHECK(gs != QB / 2 || (bits == 4 && zero_const >= 0), "groups of 16 take 4-bit codes with one zero");
  const int64_t cb = bits == 4 ? 32 : 64;
  TORCH_CHECK(codes.dim() == 5 && codes.is_contiguous() && codes.scalar_type() == at::kByte && codes.size(3) == RB &&
                  codes.size(4) == cb, "codes: contiguous uint8 [E, Np/4, Kp/64, 4, ", cb, "]");
  const int64_t e = codes.size(0), np = codes.size(1) * RB, kp = codes.size(2) * CH;
  const int64_t k = check_pairs(a, row_div, experts, e, np, kp, n, act, combine, per);
  TORCH_CHECK((gs == QB / 2 || gs == QB || (gs > 0 && gs % CH == 0)) && kp % gs == 0, "group size ", gs,
              " must be 16, 32 or a multiple of 64 dividing ", kp);
  const int64_t groups = kp / gs;
  const auto sdtype = gs == QB / 2 ? at::kHalf : at::kFloat;
  TORCH_CHECK(scale.dim() == 3 && scale.is_contiguous() && scale.scalar_type() == sdtype &&
                  scale.size(0) == e && scale.size(1) == np && scale.size(2) == groups,
              "scale: contiguous ", sdtype, " (float16 for groups of 16, else float32) [E, Np, G] = [", e, ", ", np,
              ", ", groups, "]");
  const bool zeros = zero_const < 0;  // zero points stored; with one zero for all, none are
  TORCH_CHECK(zero.is_contiguous() && zero.scalar_type() == at::kByte &&
                  (zeros ? zero.sizes() == scale.sizes() : zero.numel() == 0),
              "zero: contiguous uint8 on the scale's grid, or empty with zero_const >= 0");
  const bool scaled = row_scale.has_value() && row_scale->defined();
  if (scaled)
    TORCH_CHECK(row_scale->dim() == 2 && row_scale->is_contiguous() && row_scale->scalar_type() == at::kFloat &&
                    row_scale->size(0) == e && row_scale->size(1) == np,
                "row_scale: contiguous float32 [E, Np] = [", e, ", ", np, "]");
  const int64_t r = a.size(0), pairs = experts.size(0);
  const bool combined = combine.has_value() && combine->defined();
  at::Tensor y = at::zeros({combined ? pairs / per : pairs, n}, a.options());
  if (pairs == 0) return y;

  // the activation rows, quantised once (after the activation function, where one is given)
  at::Tensor q = at::empty({r, kp}, a.options().dtype(at::kChar));
  at::Tensor dv = at::empty({r, kp / 4}, a.options());
  at::Tensor bs = at::empty({r, kp / QB}, a.options());
  at::Tensor xg = at::empty({r, groups}, a.options());
  {
    int8_t* qp = q.data_ptr<int8_t>();
    float* dp = dv.data_ptr<float>();
    float* bp = bs.data_ptr<float>();
    float* gp = xg.data_ptr<float>();
    each_row(a, k, act, alpha, limit, [&](int64_t i, const float* x) {
      quant_row(x, k, kp, qp + i * kp, dp + i * (kp / 4), bp + i * (kp / QB), per_token);
      for (int64_t g = 0; g < groups; ++g) {
        float s = 0.0f;
        if (gs < QB) {  // half a block: its d times the half's codes
          int32_t sum = 0;
          for (int64_t c = g * gs; c < (g + 1) * gs; ++c) sum += qp[i * kp + c];
          s = dp[i * (kp / 4) + g * gs / QB * 8] * static_cast<float>(sum);
        }
        for (int64_t b = g * (gs / QB); b < (g + 1) * (gs / QB); ++b) s += bp[i * (kp / QB) + b];
        gp[i * groups + g] = s;
      }
    });
  }
  const Acts acts{q.data_ptr<int8_t>(), dv.data_ptr<float>(), xg.data_ptr<float>(), kp, groups};
  const uint8_t* cp = codes.data_ptr<uint8_t>();
  const float* sp = gs == QB / 2 ? nullptr : scale.data_ptr<float>();
  const uint16_t* shp = gs == QB / 2 ? reinterpret_cast<const uint16_t*>(scale.data_ptr<at::Half>()) : nullptr;
  const float* rsp = scaled ? row_scale->data_ptr<float>() : nullptr;
  const uint8_t* zp = zeros ? zero.data_ptr<uint8_t>() : nullptr;
  const int64_t expert_bytes = np * kp * bits / 8;
  run_pairs(experts, e, row_div, combine, per, y, np, kp * bits / 8,
            [&](int64_t x, int64_t q0, int64_t q1, const int64_t* tok, int64_t count, float* const* yr, const float* w) {
              const Proj p{cp + x * expert_bytes, sp ? sp + x * np * groups : nullptr,
                           shp ? shp + x * np * groups : nullptr, rsp ? rsp + x * np : nullptr,
                           zp ? zp + x * np * groups : nullptr, n, np, kp, groups, gs, bits, zero_const};
              if (fp4) rows_dot<4, true>(p, q0, q1, acts, tok, count, yr, w);
              else if (bits == 4) rows_dot<4, false>(p, q0, q1, acts, tok, count, yr, w);
              else rows_dot<8, false>(p, q0, q1, acts, tok, count, yr, w);
            });
  return y;
}

// fp8e4m3 weights times fp8e4m3 activations, the pairs as dot8_gemm's: codes [E, Np / 4, Kp / 64, 4, 64] uint8 (the
// e4m3 bytes), scale [E, Np, G] float32, gs the columns per group of both the weight scales and the activations'
// (128, or Kp: per channel and per token); each activation row is quantised to e4m3 once per group, with amax_floor
// under its amax.
at::Tensor dot8_fp8_gemm(at::Tensor a, int64_t row_div, at::Tensor experts, at::Tensor codes, at::Tensor scale,
                         int64_t n, int64_t gs, double amax_floor, int64_t act, double alpha, double limit,
                         c10::optional<at::Tensor> combine, int64_t per) {
  TORCH_CHECK(codes.dim() == 5 && codes.is_contiguous() && codes.scalar_type() == at::kByte && codes.size(3) == RB &&
                  codes.size(4) == CH, "codes: contiguous uint8 [E, Np/4, Kp/64, 4, 64]");
  const int64_t e = codes.size(0), np = codes.size(1) * RB, kp = codes.size(2) * CH;
  const int64_t k = check_pairs(a, row_div, experts, e, np, kp, n, act, combine, per);
  TORCH_CHECK(gs > 0 && gs % CH == 0 && gs <= kp, "group size ", gs, " must be a multiple of 64 up to ", kp);
  const int64_t groups = (kp + gs - 1) / gs;
  TORCH_CHECK(scale.dim() == 3 && scale.is_contiguous() && scale.scalar_type() == at::kFloat && scale.size(0) == e &&
                  scale.size(1) == np && scale.size(2) == groups,
              "scale: contiguous float32 [E, Np, G] = [", e, ", ", np, ", ", groups, "]");
  TORCH_CHECK(amax_floor > 0.0, "amax_floor must be positive");
  const int64_t r = a.size(0), pairs = experts.size(0);
  const bool combined = combine.has_value() && combine->defined();
  at::Tensor y = at::zeros({combined ? pairs / per : pairs, n}, a.options());
  if (pairs == 0) return y;
  at::Tensor q = at::empty({r, kp}, a.options().dtype(sizeof(F8Act) == 2 ? at::kShort : at::kFloat));
  at::Tensor xs = at::empty({r, groups}, a.options());
  F8Act* qp = reinterpret_cast<F8Act*>(q.data_ptr());
  float* xsp = xs.data_ptr<float>();
  each_row(a, k, act, alpha, limit, [&](int64_t i, const float* x) {
    f8_quant_row(x, k, kp, gs, static_cast<float>(amax_floor), qp + i * kp, xsp + i * groups);
  });
  const F8Acts acts{qp, xsp, kp, groups};
  const uint8_t* cp = codes.data_ptr<uint8_t>();
  const float* sp = scale.data_ptr<float>();
  run_pairs(experts, e, row_div, combine, per, y, np, kp,
            [&](int64_t x, int64_t q0, int64_t q1, const int64_t* tok, int64_t count, float* const* yr, const float* w) {
              const F8Proj p{cp + x * np * kp, sp + x * np * groups, n, kp, groups, gs};
              f8_rows(p, q0, q1, acts, tok, count, yr, w);
            });
  return y;
}

// An uninitialised uint8 buffer of nbytes for the repacked codes, aligned to 2 MiB and marked for transparent huge
// pages where the kernel offers them (madvise mode): a decode step streams each expert's codes once, and on 4 KiB
// pages every 4 KiB of that stream is a TLB miss the loads wait on.
at::Tensor dot8_weight_buffer(int64_t nbytes) {
  TORCH_CHECK(nbytes >= 0, "nbytes must be >= 0, got ", nbytes);
  constexpr size_t HUGE_PAGE = size_t{1} << 21;
  const size_t size = std::max<size_t>(1, (static_cast<size_t>(nbytes) + HUGE_PAGE - 1) / HUGE_PAGE) * HUGE_PAGE;
  void* p = std::aligned_alloc(HUGE_PAGE, size);
  TORCH_CHECK(p != nullptr, "could not allocate ", size, " bytes for the repacked weights");
#if defined(__linux__) && defined(MADV_HUGEPAGE)
  madvise(p, size, MADV_HUGEPAGE);  // advice only: where it is refused the buffer stays on small pages
#endif
  return at::from_blob(p, {nbytes}, [](void* q) { std::free(q); }, at::TensorOptions().dtype(at::kByte));
}

std::string dot8_isa() {
#if defined(DOT8_BF16)
  return "avx512bf16";
#elif defined(DOT8_VNNI)
  return "avx512vnni";
#elif defined(DOT8_AVX2)
  return "avx2";
#else
  return "scalar";
#endif
}

TORCH_LIBRARY(DOT8_NS, m) {
  m.def("gemm(Tensor a, int row_div, Tensor experts, Tensor codes, Tensor scale, Tensor zero, int zero_const, "
        "Tensor? row_scale, int n, int bits, bool e2m1, int gs, int act, float alpha, float limit, Tensor? combine, "
        "int per, bool per_token=False) -> Tensor", &dot8_gemm);
  m.def("fp8_gemm(Tensor a, int row_div, Tensor experts, Tensor codes, Tensor scale, int n, int gs, float amax_floor, "
        "int act, float alpha, float limit, Tensor? combine, int per) -> Tensor", &dot8_fp8_gemm);
  m.def("isa() -> str", &dot8_isa);
  m.def("weight_buffer(int nbytes) -> Tensor", &dot8_weight_buffer);
}
