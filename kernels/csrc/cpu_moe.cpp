// One expert's GEMM on the CPU, y[M, N] = x[M, K] . W[N, K]^T, with W kept in checkpoint bytes
// (moe_registry_kernels.cpu_native compiles this on first use).
//
// dq_gemm   float32 x times weight codes converted in registers: int8 (uint8 checkpoints as code - 128,
//           with an optional zero point per scale group), fp8e4m3, or packed e2m1 (FP4); float32 sums of
//           code * x per scale group, times the group's scale decoded in registers (float32, e8m0 byte
//           or e4m3 byte), an optional second-level scale per output row once at the end; each 8 codes
//           converted once for up to four rows of x (fp8: x scaled by 2^60 and the scale by 2^60, else
//           exactly dequantised rows and a matmul).
// dq_rows   the weights' values (one float32 rounding, as the reference dequantises) into a float32 tile.
// fp8_fake_quant  fp8 activation quantise-dequantise, bit-equal to quant_ref's.
// int_gemm  int8 activation codes times int8 or packed int4 weight codes, exact int32 dot per
//           weight-scale group (sign-extended int16 pairs, _mm256_madd_epi16: no saturation), then
//           float32: y = x_scale[m] * sum_g w_scale[n, g] * dot_g.
//
// Scales are a grid [ceil(N / srows), ceil(K / scols)] (per tensor: [1, 1] with srows = N, scols = K; per
// channel: [N, 1]; group g: [N, K / g]; block 128x128; MX 1x32 as e8m0 bytes; NVFP4 group 16 as e4m3
// bytes), float32, uint8 (e8m0: 2^(e - 127)) or float8_e4m3fn. Zero points: uint8 on the same grid.
// fp8e4m3 -> float32 by integer ops: sign-extend the byte, shift left 20, keep the sign and the 7
// exponent+mantissa bits: the float32 bits of fp8 * 2^-120, exact for normals and subnormals (fp8
// subnormals become float32 subnormals: never build this with -ffast-math, which flushes them).
// e2m1 (FP4) -> twice its value as an int8 by a 16-entry byte shuffle (0, 1, 2, 3, 4, 6, 8, 12 and their
// negatives), exact; the 1/2 joins the row's final multiplier.
// Every loop has a scalar form; the AVX2 forms are used when the compiler targets AVX2.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/Float8_e4m3fn.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#ifdef __AVX2__
#include <immintrin.h>
#endif

namespace {

constexpr int64_t MT = 4;      // rows of x per pass over a weight row
constexpr int64_t ROWS_PER_TASK = 64;  // weight rows per task handed to a thread
constexpr float TWO_120 = 0x1p120f;
constexpr int64_t PREFETCH = 1024;  // bytes of weight codes fetched ahead of the FMAs (past a row's end: the next row's)

enum WKind : int64_t { W_INT8 = 0, W_FP8 = 1, W_FP4 = 2, W_INT4 = 3 };  // weight code kinds (the op's `kind` argument)
constexpr bool packed4(int64_t w) { return w == W_FP4 || w == W_INT4; }  // two codes a byte, low nibble first
enum SKind : int { S_F32 = 0, S_E8M0 = 1, S_E4M3 = 2 };       // scale kinds (from the scale tensor's dtype)

// twice the e2m1 value of each 4-bit code (sign bit 3, exponent bits 2-1, mantissa bit 0)
constexpr float FP4_2X[16] = {0.f, 1.f, 2.f, 3.f, 4.f, 6.f, 8.f, 12.f, -0.f, -1.f, -2.f, -3.f, -4.f, -6.f, -8.f, -12.f};

inline float fp8_bits_value(int8_t b) {  // fp8 * 2^-120 as float32 (exact)
  int32_t i = (static_cast<int32_t>(b) << 20) & static_cast<int32_t>(0x87FFFFFFu);
  float f;
  std::memcpy(&f, &i, 4);
  return f;
}

inline float e8m0_value(uint8_t e) {  // 2^(e - 127), exact (e = 0: the subnormal 2^-127; 255, NaN, is refused on load)
  if (e == 0) return 0x1p-127f;
  const int32_t i = static_cast<int32_t>(e) << 23;
  float f;
  std::memcpy(&f, &i, 4);
  return f;
}

template <int S>
inline float scale_at(const uint8_t* row, int64_t g) {  // the scale of group g in a grid row
  if (S == S_E8M0) return e8m0_value(row[g]);
  if (S == S_E4M3) return fp8_bits_value(static_cast<int8_t>(row[g])) * TWO_120;
  float f;
  std::memcpy(&f, row + 4 * g, 4);
  return f;
}

// One group's multiplier: int8/fp4 -> s; fp8 -> s * 2^120 (exact), or two steps where that overflows.
struct Factor {
  float a;  // first multiplier
  float b;  // second (1: none)
};

inline Factor factor(bool fp8, float s) {
  if (!fp8) return {s, 1.0f};
  float f = s * TWO_120;
  if (std::isfinite(f)) return {f, 1.0f};
  return {TWO_120, s};
}

// Weight code c of a row as float32 without its scale: int8 -> the integer, fp8 -> the bits of fp8 * 2^-120,
// fp4 -> twice the e2m1 value, int4 -> the nibble - 8 (uint4b8's real code; uint4's zero point is kept - 8 too).
template <int W>
inline float raw_at(const uint8_t* wr, int64_t c) {
  if (packed4(W)) {
    const uint8_t b = wr[c >> 1];
    const int nib = (c & 1) ? (b >> 4) : (b & 0xF);
    return W == W_FP4 ? FP4_2X[nib] : static_cast<float>(nib - 8);
  }
  const int8_t b = static_cast<int8_t>(wr[c]);
  return W == W_FP8 ? fp8_bits_value(b) : static_cast<float>(b);
}

#ifdef __AVX2__
template <int W>
inline __m256 raw8(const uint8_t* p) {  // int8 / fp8: 8 codes from p
  __m256i i = _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
  if (W == W_FP8) return _mm256_castsi256_ps(_mm256_and_si256(_mm256_slli_epi32(i, 20),
                                                              _mm256_set1_epi32(static_cast<int32_t>(0x87FFFFFFu))));
  return _mm256_cvtepi32_ps(i);
}

// Codes c .. c + 15 of a row (c even; fp4 and int4: 8 bytes, low nibble first) as two vectors of 8.
template <int W>
inline void raw16(const uint8_t* wr, int64_t c, __m256& a, __m256& b) {
  if (packed4(W)) {
    const __m128i lut = W == W_FP4 ? _mm_setr_epi8(0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12)
                                   : _mm_setr_epi8(-8, -7, -6, -5, -4, -3, -2, -1, 0, 1, 2, 3, 4, 5, 6, 7);
    const __m128i low = _mm_set1_epi8(0x0F);
    const __m128i bytes = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(wr + (c >> 1)));
    const __m128i codes = _mm_unpacklo_epi8(_mm_and_si128(bytes, low), _mm_and_si128(_mm_srli_epi16(bytes, 4), low));
    const __m128i v = _mm_shuffle_epi8(lut, codes);
    a = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(v));
    b = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(v, 8)));
    return;
  }
  a = raw8<W>(wr + c);
  b = raw8<W>(wr + c + 8);
}

inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_shuffle_ps(s, s, 1));
  return _mm_cvtss_f32(s);
}
#endif

// f(r0, r1) over [0, n) in blocks of ROWS_PER_TASK, handed out to at::parallel_for's threads as each frees up
// (on a shared machine a thread that starts late then takes fewer blocks, instead of a fixed half).
template <class F>
void for_rows(int64_t n, const F& f) {
  const int64_t tasks = (n + ROWS_PER_TASK - 1) / ROWS_PER_TASK;
  if (tasks <= 1 || at::get_num_threads() <= 1 || at::in_parallel_region()) {
    f(0, n);
    return;
  }
  std::atomic<int64_t> next{0};
  at::parallel_for(0, std::min<int64_t>(tasks, at::get_num_threads()), 1, [&](int64_t a, int64_t b) {
    for (int64_t i = a; i < b; ++i) {
      for (int64_t t = next.fetch_add(1); t < tasks; t = next.fetch_add(1))
        f(t * ROWS_PER_TASK, std::min(n, (t + 1) * ROWS_PER_TASK));
    }
  });
}

// One weight row's operands: codes, its scale-grid row (bytes), zero-point row (or null), final multiplier.
struct WRow {
  const uint8_t* w;
  const uint8_t* s;
  const uint8_t* z;
  float post;
};

// y[t, n] for t < T rows of x and one weight row: each 8 codes are converted once and FMA'd into T rows
// (T <= 2: four independent sums per row over 32 codes, so M = 1 is not bound by the FMA latency); a scale
// group's sums are multiplied by its scale once (fp8: x comes scaled by 2^60 and the group's factor is
// s * 2^60, the caller having checked both stay finite); a zero point z subtracts z * s * sum(x over the group)
// (xsum, [T, groups]); the row's result is multiplied by `post` (fp4's 1/2 times a second-level scale).
// Not the reference's rounding order (it rounds code * scale first): float32 sums either way.
template <int64_t T, int W, int S, bool ZP>
void dq_row(const float* x, int64_t ldx, const float* xsum, int64_t ldxs, const WRow& r, int64_t k,
            int64_t scols, float* y, int64_t ldy) {
  constexpr int NA = T <= 2 ? 4 : 2;  // vector sums per row of x
  float acc_s[T];
  for (int64_t t = 0; t < T; ++t) acc_s[t] = 0.0f;
#ifdef __AVX2__
  __m256 acc[T];
  for (int64_t t = 0; t < T; ++t) acc[t] = _mm256_setzero_ps();
#endif
  for (int64_t c0 = 0, gi = 0; c0 < k; c0 += scols, ++gi) {  // gi: the scale group (no division per group)
    const int64_t c1 = std::min(k, c0 + scols);
    const float f = W == W_FP8 ? scale_at<S>(r.s, gi) * 0x1p60f : scale_at<S>(r.s, gi);
    int64_t c = c0;
#ifdef __AVX2__
    __m256 g[T][NA];
    for (int64_t t = 0; t < T; ++t)
      for (int j = 0; j < NA; ++j) g[t][j] = _mm256_setzero_ps();
    for (; c + 8 * NA <= c1; c += 8 * NA) {
      const int64_t cb = packed4(W) ? c >> 1 : c;  // byte offset
      if ((cb & 63) < (packed4(W) ? 4 * NA : 8 * NA))
        _mm_prefetch(reinterpret_cast<const char*>(r.w + cb + PREFETCH), _MM_HINT_T0);
      __m256 wv[NA];
      for (int j = 0; j < NA; j += 2) raw16<W>(r.w, c + 8 * j, wv[j], wv[j + 1]);
      for (int64_t t = 0; t < T; ++t)
        for (int j = 0; j < NA; ++j) g[t][j] = _mm256_fmadd_ps(wv[j], _mm256_loadu_ps(x + t * ldx + c + 8 * j), g[t][j]);
    }
    if (NA == 4) {
      for (; c + 16 <= c1; c += 16) {
        __m256 w0, w1;
        raw16<W>(r.w, c, w0, w1);
        for (int64_t t = 0; t < T; ++t) {
          g[t][0] = _mm256_fmadd_ps(w0, _mm256_loadu_ps(x + t * ldx + c), g[t][0]);
          g[t][1] = _mm256_fmadd_ps(w1, _mm256_loadu_ps(x + t * ldx + c + 8), g[t][1]);
        }
      }
    }
    const __m256 fv = _mm256_set1_ps(f);
    for (int64_t t = 0; t < T; ++t) {
      __m256 s = _mm256_add_ps(g[t][0], g[t][1]);
      if (NA == 4) s = _mm256_add_ps(s, _mm256_add_ps(g[t][NA - 2], g[t][NA - 1]));
      acc[t] = _mm256_fmadd_ps(s, fv, acc[t]);
    }
#endif
    float gs[T];
    for (int64_t t = 0; t < T; ++t) gs[t] = 0.0f;
    for (; c < c1; ++c) {
      const float v = raw_at<W>(r.w, c);
      for (int64_t t = 0; t < T; ++t) gs[t] += v * x[t * ldx + c];
    }
    if (ZP) {
      const float z = static_cast<float>(static_cast<int32_t>(r.z[gi]) - 128);  // codes are stored as code - 128
      for (int64_t t = 0; t < T; ++t) gs[t] -= z * xsum[t * ldxs + gi];
    }
    for (int64_t t = 0; t < T; ++t) acc_s[t] += gs[t] * f;
  }
  for (int64_t t = 0; t < T; ++t) {
#ifdef __AVX2__
    acc_s[t] += hsum(acc[t]);
#endif
    y[t * ldy] = acc_s[t] * r.post;
  }
}

// The grid and weight operands of one dq_gemm / dq_rows call.
struct Grid {
  const uint8_t* w;   // codes [N, K] (fp4: [N, K / 2])
  int64_t ldw;        // bytes per weight row
  const uint8_t* s;   // scale grid, bytes
  int64_t lds;        // bytes per grid row
  const uint8_t* z;   // zero points [R, C] (or null)
  int64_t ldz;
  const float* s2;    // second-level scale per row [N] (or null)
  int64_t srows, scols, k, n;
  float half;         // fp4: 1/2 (the codes are twice the value); else 1

  WRow row(int64_t r) const {
    const int64_t gr = r / srows;
    return {w + r * ldw, s + gr * lds, z ? z + gr * ldz : nullptr, half * (s2 ? s2[r] : 1.0f)};
  }
};

template <int W, int S, bool ZP>
void dq_rows_of(const float* x, int64_t m, const float* xsum, int64_t ldxs, const Grid& gd, float* yp) {
  const int64_t k = gd.k, n = gd.n;
  for_rows(n, [&](int64_t n0, int64_t n1) {
    for (int64_t r = n0; r < n1; ++r) {
      const WRow wr = gd.row(r);
      int64_t t = 0;
      for (; t + MT <= m; t += MT)
        dq_row<MT, W, S, ZP>(x + t * k, k, xsum + t * ldxs, ldxs, wr, k, gd.scols, yp + t * n + r, n);
      switch (m - t) {
        case 3: dq_row<3, W, S, ZP>(x + t * k, k, xsum + t * ldxs, ldxs, wr, k, gd.scols, yp + t * n + r, n); break;
        case 2: dq_row<2, W, S, ZP>(x + t * k, k, xsum + t * ldxs, ldxs, wr, k, gd.scols, yp + t * n + r, n); break;
        case 1: dq_row<1, W, S, ZP>(x + t * k, k, xsum + t * ldxs, ldxs, wr, k, gd.scols, yp + t * n + r, n); break;
        default: break;
      }
    }
  });
}

int scale_kind(const at::Tensor& scale) {
  switch (scale.scalar_type()) {
    case at::kFloat: return S_F32;
    case at::kByte: return S_E8M0;
    case at::kFloat8_e4m3fn: return S_E4M3;
    default: TORCH_CHECK(false, "scale: float32, uint8 (e8m0) or float8_e4m3fn, got ", scale.scalar_type());
  }
  return S_F32;
}

// Checks the operands and returns the grid; K is the weights' logical K (fp4: twice the bytes).
Grid make_grid(const at::Tensor& w, const at::Tensor& scale, const c10::optional<at::Tensor>& zero,
               const c10::optional<at::Tensor>& scale2, int64_t srows, int64_t scols, int64_t kind) {
  TORCH_CHECK(kind == W_INT8 || kind == W_FP8 || kind == W_FP4 || kind == W_INT4,
              "kind: 0 (int8), 1 (fp8e4m3), 2 (e2m1) or 3 (int4)");
  TORCH_CHECK(w.dim() == 2 && w.is_contiguous() && w.element_size() == 1,
              "w: contiguous bytes [N, K] (fp4, int4: [N, K/2])");
  TORCH_CHECK(w.scalar_type() == (packed4(kind) ? at::kByte : at::kChar),
              "w: int8 bytes for int8 and fp8 codes, uint8 for packed fp4 and int4; got ", w.scalar_type(),
              " for kind ", kind);
  TORCH_CHECK(scale.dim() == 2 && scale.is_contiguous(), "scale: contiguous [R, C]");
  scale_kind(scale);
  TORCH_CHECK(srows > 0 && scols > 0, "scale block must be positive");
  const int64_t n = w.size(0), k = packed4(kind) ? 2 * w.size(1) : w.size(1);
  TORCH_CHECK(scale.size(0) == (n + srows - 1) / srows && scale.size(1) == (k + scols - 1) / scols,
              "scale grid ", scale.sizes(), " does not cover w [", n, ", ", k, "] in blocks ", srows, "x", scols);
  TORCH_CHECK(!packed4(kind) || (scols % 2 == 0 || scols == k), "4-bit scale groups must cover whole bytes");
  Grid g{static_cast<const uint8_t*>(w.data_ptr()), w.size(1), static_cast<const uint8_t*>(scale.data_ptr()),
         scale.size(1) * static_cast<int64_t>(scale.element_size()), nullptr, 0, nullptr, srows, scols, k, n,
         kind == W_FP4 ? 0.5f : 1.0f};
  if (zero.has_value() && zero->defined()) {
    TORCH_CHECK(kind == W_INT8 || kind == W_INT4, "zero points go with int8 or int4 codes");
    TORCH_CHECK(zero->scalar_type() == at::kByte && zero->is_contiguous() && zero->sizes() == scale.sizes(),
                "zero: contiguous uint8 on the scale grid ", scale.sizes());
    g.z = zero->data_ptr<uint8_t>();
    g.ldz = zero->size(1);
  }
  if (scale2.has_value() && scale2->defined()) {
    TORCH_CHECK(kind == W_FP4, "scale2: a second-level scale is for FP4 (NVFP4) weights only, got kind ", kind);
    TORCH_CHECK(scale2->scalar_type() == at::kFloat && scale2->is_contiguous() && scale2->numel() == n,
                "scale2: contiguous float32 [N]");
    g.s2 = scale2->data_ptr<float>();
  }
  return g;
}

// rows [a, b) of the grid's weights dequantised into o (float32 rows of K): value = code * scale (fp8: in
// one step where s * 2^120 is finite), (code - zero) * scale, fp4: value * (scale * scale2).
template <int W, int S>
void dq_rows_range(const Grid& gd, int64_t r0, int64_t a, int64_t b, float* op) {
  const int64_t k = gd.k;
  for (int64_t i = a; i < b; ++i) {
    const int64_t r = r0 + i;
    const WRow wr = gd.row(r);
    float* o = op + i * k;
    const float s2 = gd.s2 ? gd.s2[r] : 1.0f;
    for (int64_t c0 = 0, g = 0; c0 < k; c0 += gd.scols, ++g) {
      const int64_t c1 = std::min(k, c0 + gd.scols);
      float s = scale_at<S>(wr.s, g);
      if (W == W_FP4) s = 0.5f * (s * s2);  // the reference's scale * scale2, halved for the doubled codes
      const Factor f = factor(W == W_FP8, s);
      const int32_t z = wr.z ? static_cast<int32_t>(wr.z[g]) - 128 : 0;
      int64_t c = c0;
#ifdef __AVX2__
      const __m256 fa = _mm256_set1_ps(f.a), fb = _mm256_set1_ps(f.b);
      if (W == W_INT8 && wr.z) {
        const __m256i zv = _mm256_set1_epi32(z);
        for (; c + 8 <= c1; c += 8) {
          const __m256i i8 = _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(wr.w + c)));
          _mm256_storeu_ps(o + c, _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_sub_epi32(i8, zv)), fa));
        }
      } else if (packed4(W)) {
        const __m256 zf = _mm256_set1_ps(static_cast<float>(z));  // int4: (code - 8) - (zero - 8), exact
        for (; c + 16 <= c1; c += 16) {
          __m256 v0, v1;
          raw16<W>(wr.w, c, v0, v1);
          if (W == W_INT4) {
            v0 = _mm256_sub_ps(v0, zf);
            v1 = _mm256_sub_ps(v1, zf);
          }
          _mm256_storeu_ps(o + c, _mm256_mul_ps(v0, fa));
          _mm256_storeu_ps(o + c + 8, _mm256_mul_ps(v1, fa));
        }
      } else {
        for (; c + 8 <= c1; c += 8) {
          __m256 v = _mm256_mul_ps(raw8<W>(wr.w + c), fa);
          _mm256_storeu_ps(o + c, f.b != 1.0f ? _mm256_mul_ps(v, fb) : v);
        }
      }
#endif
      for (; c < c1; ++c) {
        float v;
        if (W == W_INT8 && wr.z) {
          v = static_cast<float>(static_cast<int32_t>(static_cast<int8_t>(wr.w[c])) - z) * f.a;
        } else {
          v = (W == W_INT4 ? raw_at<W>(wr.w, c) - static_cast<float>(z) : raw_at<W>(wr.w, c)) * f.a;
          if (f.b != 1.0f) v = v * f.b;
        }
        o[c] = v;
      }
    }
  }
}

template <int W, int S>
void dq_rows_all(const Grid& gd, int64_t r0, int64_t rows, float* op) {
  for_rows(rows, [&](int64_t a, int64_t b) { dq_rows_range<W, S>(gd, r0, a, b, op); });
}

void dq_rows_dispatch(const Grid& gd, int64_t kind, int skind, int64_t r0, int64_t rows, float* op) {
  if (kind == W_INT8 && skind == S_F32) return dq_rows_all<W_INT8, S_F32>(gd, r0, rows, op);
  if (kind == W_FP8 && skind == S_F32) return dq_rows_all<W_FP8, S_F32>(gd, r0, rows, op);
  if (kind == W_FP8 && skind == S_E8M0) return dq_rows_all<W_FP8, S_E8M0>(gd, r0, rows, op);
  if (kind == W_FP4 && skind == S_E8M0) return dq_rows_all<W_FP4, S_E8M0>(gd, r0, rows, op);
  if (kind == W_FP4 && skind == S_E4M3) return dq_rows_all<W_FP4, S_E4M3>(gd, r0, rows, op);
  if (kind == W_INT4 && skind == S_F32) return dq_rows_all<W_INT4, S_F32>(gd, r0, rows, op);
  TORCH_CHECK(false, "no dequantisation for weight kind ", kind, " with scale kind ", skind);
}

}  // namespace

// Rows [r0, r0 + out.size(0)) of W dequantised into out (float32 [rows, K]).
void dq_rows(at::Tensor w, at::Tensor scale, c10::optional<at::Tensor> zero, c10::optional<at::Tensor> scale2,
             int64_t srows, int64_t scols, int64_t kind, int64_t r0, at::Tensor out) {
  const Grid gd = make_grid(w, scale, zero, scale2, srows, scols, kind);
  TORCH_CHECK(out.dim() == 2 && out.is_contiguous() && out.scalar_type() == at::kFloat &&
                  out.size(1) == gd.k && r0 >= 0 && r0 + out.size(0) <= gd.n,
              "out: contiguous float32 [rows, K] inside w");
  dq_rows_dispatch(gd, kind, scale_kind(scale), r0, out.size(0), out.data_ptr<float>());
}

// fp8_fold: every scale * 2^60 is finite (the caller checks once per layer); x * 2^60 is checked here.
// Where either is not, the weight rows are dequantised exactly (dq_rows) and multiplied by torch.
at::Tensor dq_gemm(at::Tensor x, at::Tensor w, at::Tensor scale, c10::optional<at::Tensor> zero,
                   c10::optional<at::Tensor> scale2, int64_t srows, int64_t scols, int64_t kind, bool fp8_fold) {
  const Grid gd = make_grid(w, scale, zero, scale2, srows, scols, kind);
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && x.scalar_type() == at::kFloat && x.size(1) == gd.k,
              "x: contiguous float32 [M, K] with w's K");
  const int64_t m = x.size(0), n = gd.n;
  const int skind = scale_kind(scale);
  at::Tensor y = at::empty({m, n}, x.options());
  float* yp = y.data_ptr<float>();
  if (kind == W_FP8) {
    at::Tensor xs = x * 0x1p60;
    if (!fp8_fold || !xs.isfinite().all().item<bool>()) {
      at::Tensor tile = at::empty({n, gd.k}, x.options());
      dq_rows_dispatch(gd, kind, skind, 0, n, tile.data_ptr<float>());
      return at::mm(x, tile.t());
    }
    if (skind == S_F32) dq_rows_of<W_FP8, S_F32, false>(xs.data_ptr<float>(), m, nullptr, 0, gd, yp);
    else if (skind == S_E8M0) dq_rows_of<W_FP8, S_E8M0, false>(xs.data_ptr<float>(), m, nullptr, 0, gd, yp);
    else TORCH_CHECK(false, "fp8 weights take float32 or e8m0 scales");
    return y;
  }
  const float* xp = x.data_ptr<float>();
  if (kind == W_FP4) {
    if (skind == S_E8M0) dq_rows_of<W_FP4, S_E8M0, false>(xp, m, nullptr, 0, gd, yp);
    else if (skind == S_E4M3) dq_rows_of<W_FP4, S_E4M3, false>(xp, m, nullptr, 0, gd, yp);
    else TORCH_CHECK(false, "fp4 weights take e8m0 or e4m3 scales");
    return y;
  }
  TORCH_CHECK(skind == S_F32, "int8 and int4 weights take float32 scales");
  const bool int4 = kind == W_INT4;
  if (gd.z) {  // sum of x over each scale group (torch's reduction; a partial last group padded with 0)
    const int64_t groups = scale.size(1);
    const at::Tensor xsum = at::constant_pad_nd(x, {0, groups * scols - gd.k}).view({m, groups, scols}).sum(2)
                                .contiguous();
    if (int4) dq_rows_of<W_INT4, S_F32, true>(xp, m, xsum.data_ptr<float>(), groups, gd, yp);
    else dq_rows_of<W_INT8, S_F32, true>(xp, m, xsum.data_ptr<float>(), groups, gd, yp);
    return y;
  }
  if (int4) dq_rows_of<W_INT4, S_F32, false>(xp, m, nullptr, 0, gd, yp);
  else dq_rows_of<W_INT8, S_F32, false>(xp, m, nullptr, 0, gd, yp);
  return y;
}

namespace {

// Packed int4 (int_gemm's bits = 4): 32 codes per 16 bytes, byte j of a block holds code j in its low
// nibble and code j + 16 in its high one; stored code = real code + 8 (uint4b8).
inline int32_t int4_at(const uint8_t* wr, int64_t c) {
  const uint8_t b = wr[(c / 32) * 16 + (c % 32) % 16];
  return static_cast<int32_t>((c % 32) < 16 ? (b & 0xF) : (b >> 4)) - 8;
}

// int32 dot of x codes (int16) with one weight row's codes over [c0, c1).
template <int64_t T>
void int_dot(const int16_t* x, int64_t ldx, const uint8_t* wr, int bits, int64_t c0, int64_t c1, int32_t* out) {
  int32_t acc_s[T];
  for (int64_t t = 0; t < T; ++t) acc_s[t] = 0;
  int64_t c = c0;
#ifdef __AVX2__
  __m256i acc[T];
  for (int64_t t = 0; t < T; ++t) acc[t] = _mm256_setzero_si256();
  if (bits == 8) {
    for (; c + 16 <= c1; c += 16) {
      if ((c & 63) == 0) _mm_prefetch(reinterpret_cast<const char*>(wr + c + PREFETCH), _MM_HINT_T0);
      const __m256i w = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(wr + c)));
      for (int64_t t = 0; t < T; ++t)
        acc[t] = _mm256_add_epi32(acc[t], _mm256_madd_epi16(
            w, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x + t * ldx + c))));
    }
  } else if (c0 % 32 == 0) {
    const __m128i low = _mm_set1_epi8(0x0F);
    const __m256i eight = _mm256_set1_epi16(8);
    for (; c + 32 <= c1; c += 32) {
      if ((c & 127) == 0) _mm_prefetch(reinterpret_cast<const char*>(wr + c / 2 + PREFETCH), _MM_HINT_T0);
      const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(wr + c / 2));
      const __m256i lo = _mm256_sub_epi16(_mm256_cvtepu8_epi16(_mm_and_si128(b, low)), eight);
      const __m256i hi = _mm256_sub_epi16(_mm256_cvtepu8_epi16(_mm_and_si128(_mm_srli_epi16(b, 4), low)), eight);
      for (int64_t t = 0; t < T; ++t) {
        const int16_t* xr = x + t * ldx + c;
        acc[t] = _mm256_add_epi32(acc[t], _mm256_madd_epi16(lo, _mm256_loadu_si256(
            reinterpret_cast<const __m256i*>(xr))));
        acc[t] = _mm256_add_epi32(acc[t], _mm256_madd_epi16(hi, _mm256_loadu_si256(
            reinterpret_cast<const __m256i*>(xr + 16))));
      }
    }
  }
#endif
  for (; c < c1; ++c) {
    const int32_t v = bits == 8 ? static_cast<int32_t>(reinterpret_cast<const int8_t*>(wr)[c]) : int4_at(wr, c);
    for (int64_t t = 0; t < T; ++t) acc_s[t] += v * x[t * ldx + c];
  }
  for (int64_t t = 0; t < T; ++t) {
#ifdef __AVX2__
    __m128i s = _mm_add_epi32(_mm256_castsi256_si128(acc[t]), _mm256_extracti128_si256(acc[t], 1));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4E));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0xB1));
    acc_s[t] += _mm_cvtsi128_si32(s);
#endif
    out[t] = acc_s[t];
  }
}

template <int64_t T>
void int_row(const int16_t* x, int64_t ldx, const uint8_t* wr, int bits, const float* srow, int64_t k,
             int64_t scols, const float* xs, float* y, int64_t ldy) {
  float acc[T];
  int32_t dot[T];
  for (int64_t t = 0; t < T; ++t) acc[t] = 0.0f;
  for (int64_t c0 = 0, g = 0; c0 < k; c0 += scols, ++g) {
    int_dot<T>(x, ldx, wr, bits, c0, std::min(k, c0 + scols), dot);
    const float s = srow[g];
    for (int64_t t = 0; t < T; ++t) acc[t] += s * static_cast<float>(dot[t]);
  }
  for (int64_t t = 0; t < T; ++t) y[t * ldy] = acc[t] * xs[t];
}

}  // namespace

// xq int8 [M, K] codes, xs float32 [M] scales; w int8 [N, K] (bits 8) or uint8 [N, K / 2] packed (bits 4).
at::Tensor int_gemm(at::Tensor xq, at::Tensor xs, at::Tensor w, int64_t bits, at::Tensor scale,
                       int64_t srows, int64_t scols) {
  TORCH_CHECK(bits == 8 || bits == 4, "bits must be 8 or 4");
  TORCH_CHECK(xq.dim() == 2 && xq.is_contiguous() && xq.scalar_type() == at::kChar, "xq: contiguous int8 [M, K]");
  TORCH_CHECK(xs.dim() == 1 && xs.is_contiguous() && xs.scalar_type() == at::kFloat && xs.size(0) == xq.size(0),
              "xs: float32 [M]");
  TORCH_CHECK(w.dim() == 2 && w.is_contiguous() && w.element_size() == 1, "w: contiguous bytes [N, K or K/2]");
  const int64_t m = xq.size(0), n = w.size(0), k = xq.size(1);
  TORCH_CHECK(bits == 8 ? w.size(1) == k : (k % 32 == 0 && w.size(1) * 2 == k), "w does not match x's K = ", k,
              " (int4: K a multiple of 32)");
  TORCH_CHECK(scale.dim() == 2 && scale.is_contiguous() && scale.scalar_type() == at::kFloat &&
                  srows > 0 && scols > 0 && scale.size(0) == (n + srows - 1) / srows &&
                  scale.size(1) == (k + scols - 1) / scols,
              "scale grid ", scale.sizes(), " does not cover [", n, ", ", k, "]");
  auto x16 = xq.to(at::kShort);
  auto y = at::empty({m, n}, xs.options());
  const int16_t* xp = x16.data_ptr<int16_t>();
  const float* xsp = xs.data_ptr<float>();
  const uint8_t* wp = static_cast<const uint8_t*>(w.data_ptr());
  const float* sp = scale.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  const int64_t ldw = w.size(1), sc = scale.size(1);
  const int b = static_cast<int>(bits);
  for_rows(n, [&](int64_t n0, int64_t n1) {
    for (int64_t r = n0; r < n1; ++r) {
      const uint8_t* wr = wp + r * ldw;
      const float* sr = sp + (r / srows) * sc;
      int64_t t = 0;
      for (; t + MT <= m; t += MT) int_row<MT>(xp + t * k, k, wr, b, sr, k, scols, xsp + t, yp + t * n + r, n);
      switch (m - t) {
        case 3: int_row<3>(xp + t * k, k, wr, b, sr, k, scols, xsp + t, yp + t * n + r, n); break;
        case 2: int_row<2>(xp + t * k, k, wr, b, sr, k, scols, xsp + t, yp + t * n + r, n); break;
        case 1: int_row<1>(xp + t * k, k, wr, b, sr, k, scols, xsp + t, yp + t * n + r, n); break;
        default: break;
      }
    }
  });
  return y;
}

// fp8e4m3 activations quantised and dequantised as quant_ref.fake_quantize_activation does (bit for bit):
// per row, groups of `group` columns (K: per token): s = max(amax, amax_floor) / 448, or the static
// scale when static_scale > 0; q = fp8(clamp(x / s, -448, 448)) (round to nearest even); out = q * s.
at::Tensor fp8_fake_quant(at::Tensor x, int64_t group, double amax_floor, double static_scale) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && x.scalar_type() == at::kFloat, "x: contiguous float32 [M, K]");
  TORCH_CHECK(group > 0, "group must be positive");
  const int64_t m = x.size(0), k = x.size(1);
  at::Tensor out = at::empty_like(x);
  const float* xp = x.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const float floor_f = static_cast<float>(amax_floor), fixed = static_cast<float>(static_scale);
  for (int64_t r = 0; r < m; ++r) {
    for (int64_t c0 = 0; c0 < k; c0 += group) {
      const int64_t c1 = std::min(k, c0 + group);
      float s = fixed;
      if (!(fixed > 0.0f)) {
        float amax = 0.0f;
        for (int64_t c = c0; c < c1; ++c) amax = std::max(amax, std::fabs(xp[r * k + c]));
        s = std::max(amax, floor_f) / 448.0f;
      }
      for (int64_t c = c0; c < c1; ++c) {
        const float v = std::min(std::max(xp[r * k + c] / s, -448.0f), 448.0f);
        op[r * k + c] = static_cast<float>(c10::Float8_e4m3fn(v)) * s;
      }
    }
  }
  return out;
}

std::string isa() {
#ifdef __AVX2__
  return "avx2";
#else
  return "scalar";
#endif
}

// torch.ops.moe_registry_cpu.* (a plain library, not a Python module: it compiles in a third of the time)
TORCH_LIBRARY(moe_registry_cpu, m) {
  m.def("dq_gemm(Tensor x, Tensor w, Tensor scale, Tensor? zero, Tensor? scale2, int srows, int scols, int kind, "
        "bool fp8_fold) -> Tensor", &dq_gemm);
  m.def("dq_rows(Tensor w, Tensor scale, Tensor? zero, Tensor? scale2, int srows, int scols, int kind, int r0, "
        "Tensor(a!) out) -> ()", &dq_rows);
  m.def("int_gemm(Tensor xq, Tensor xs, Tensor w, int bits, Tensor scale, int srows, int scols) -> Tensor",
        &int_gemm);
  m.def("fp8_fake_quant(Tensor x, int group, float amax_floor, float static_scale) -> Tensor", &fp8_fake_quant);
  m.def("isa() -> str", &isa);
}
