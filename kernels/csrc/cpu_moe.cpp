// One expert's GEMM on the CPU, y[M, N] = x[M, K] . W[N, K]^T, with W kept in checkpoint bytes
// (moe_registry_kernels.cpu_native compiles this on first use; issue 21).
//
// dq_gemm   float32 x times int8 or fp8e4m3 codes converted in registers, each 8 codes once for four
//           rows of x; float32 sums of code * x per scale group, times the group's scale (fp8: x
//           scaled by 2^60 and the scale by 2^60, else exactly dequantised rows and a matmul).
// dq_rows   code * scale (one float32 rounding, as the reference dequantises) into a float32 tile.
// fp8_fake_quant  fp8 activation quantise-dequantise, bit-equal to quant_ref's.
// int_gemm  int8 activation codes times int8 or packed int4 weight codes, exact int32 dot per
//           weight-scale group (sign-extended int16 pairs, _mm256_madd_epi16: no saturation), then
//           float32: y = x_scale[m] * sum_g w_scale[n, g] * dot_g.
//
// Scales are a float32 grid [ceil(N / srows), ceil(K / scols)] (per tensor: [1, 1] with srows = N,
// scols = K; per channel: [N, 1]; group g: [N, K / g]; block 128x128; MX 1x32 as float32).
// fp8e4m3 -> float32 by integer ops: sign-extend the byte, shift left 20, keep the sign and the 7
// exponent+mantissa bits: the float32 bits of fp8 * 2^-120, exact for normals and subnormals (fp8
// subnormals become float32 subnormals: never build this with -ffast-math, which flushes them).
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

inline float fp8_bits_value(int8_t b) {  // fp8 * 2^-120 as float32 (exact)
  int32_t i = (static_cast<int32_t>(b) << 20) & static_cast<int32_t>(0x87FFFFFFu);
  float f;
  std::memcpy(&f, &i, 4);
  return f;
}

// One group's multiplier: int8 -> s; fp8 -> s * 2^120 (exact), or two steps where that overflows.
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

inline float dq_scalar(const int8_t* w, int64_t k, bool fp8, Factor f) {
  float v = fp8 ? fp8_bits_value(w[k]) : static_cast<float>(w[k]);
  v = v * f.a;
  if (f.b != 1.0f) v = v * f.b;
  return v;
}

#ifdef __AVX2__
inline __m256 dq8(const int8_t* p, bool fp8, __m256 fa, __m256 fb, bool two) {
  __m256i i = _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
  __m256 v;
  if (fp8) {
    i = _mm256_and_si256(_mm256_slli_epi32(i, 20), _mm256_set1_epi32(static_cast<int32_t>(0x87FFFFFFu)));
    v = _mm256_castsi256_ps(i);
  } else {
    v = _mm256_cvtepi32_ps(i);
  }
  v = _mm256_mul_ps(v, fa);
  return two ? _mm256_mul_ps(v, fb) : v;
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

// Weight codes as float32 without their scale: int8 -> the integer, fp8 -> the bits of fp8 * 2^-120.
template <bool FP8>
inline float raw_scalar(int8_t b) {
  return FP8 ? fp8_bits_value(b) : static_cast<float>(b);
}

#ifdef __AVX2__
template <bool FP8>
inline __m256 raw8(const int8_t* p) {
  __m256i i = _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
  if (FP8) return _mm256_castsi256_ps(_mm256_and_si256(_mm256_slli_epi32(i, 20),
                                                       _mm256_set1_epi32(static_cast<int32_t>(0x87FFFFFFu))));
  return _mm256_cvtepi32_ps(i);
}
#endif

// y[t, n] for t < T rows of x and one weight row: each 8 codes are converted once and FMA'd into T rows;
// a scale group's sums are multiplied by its scale once (fp8: x comes scaled by 2^60 and the group's
// factor is s * 2^60, the caller having checked both stay finite). Not the reference's rounding order
// (it rounds code * scale first): float32 sums either way.
template <int64_t T, bool FP8>
void dq_row(const float* x, int64_t ldx, const int8_t* w, const float* srow, int64_t k, int64_t scols,
            float* y, int64_t ldy) {
  float acc_s[T];
  for (int64_t t = 0; t < T; ++t) acc_s[t] = 0.0f;
#ifdef __AVX2__
  __m256 acc[T];
  for (int64_t t = 0; t < T; ++t) acc[t] = _mm256_setzero_ps();
#endif
  for (int64_t c0 = 0, gi = 0; c0 < k; c0 += scols, ++gi) {  // gi: the scale group (no division per group)
    const int64_t c1 = std::min(k, c0 + scols);
    const float f = FP8 ? srow[gi] * 0x1p60f : srow[gi];
    int64_t c = c0;
#ifdef __AVX2__
    __m256 g[T][2];
    for (int64_t t = 0; t < T; ++t) g[t][0] = g[t][1] = _mm256_setzero_ps();
    for (; c + 16 <= c1; c += 16) {
      if ((c & 63) == 0) _mm_prefetch(reinterpret_cast<const char*>(w + c + PREFETCH), _MM_HINT_T0);
      const __m256 w0 = raw8<FP8>(w + c), w1 = raw8<FP8>(w + c + 8);
      for (int64_t t = 0; t < T; ++t) {
        g[t][0] = _mm256_fmadd_ps(w0, _mm256_loadu_ps(x + t * ldx + c), g[t][0]);
        g[t][1] = _mm256_fmadd_ps(w1, _mm256_loadu_ps(x + t * ldx + c + 8), g[t][1]);
      }
    }
    const __m256 fv = _mm256_set1_ps(f);
    for (int64_t t = 0; t < T; ++t) acc[t] = _mm256_fmadd_ps(_mm256_add_ps(g[t][0], g[t][1]), fv, acc[t]);
#endif
    float gs[T];
    for (int64_t t = 0; t < T; ++t) gs[t] = 0.0f;
    for (; c < c1; ++c) {
      const float v = raw_scalar<FP8>(w[c]);
      for (int64_t t = 0; t < T; ++t) gs[t] += v * x[t * ldx + c];
    }
    for (int64_t t = 0; t < T; ++t) acc_s[t] += gs[t] * f;
  }
  for (int64_t t = 0; t < T; ++t) {
#ifdef __AVX2__
    acc_s[t] += hsum(acc[t]);
#endif
    y[t * ldy] = acc_s[t];
  }
}

template <bool FP8>
void dq_rows_of(const float* x, int64_t m, const int8_t* wp, const float* sp, int64_t sc, int64_t srows,
                int64_t scols, int64_t k, int64_t n, float* yp) {
  for_rows(n, [&](int64_t n0, int64_t n1) {
    for (int64_t r = n0; r < n1; ++r) {
      const int8_t* wr = wp + r * k;
      const float* sr = sp + (r / srows) * sc;
      int64_t t = 0;
      for (; t + MT <= m; t += MT) dq_row<MT, FP8>(x + t * k, k, wr, sr, k, scols, yp + t * n + r, n);
      switch (m - t) {
        case 3: dq_row<3, FP8>(x + t * k, k, wr, sr, k, scols, yp + t * n + r, n); break;
        case 2: dq_row<2, FP8>(x + t * k, k, wr, sr, k, scols, yp + t * n + r, n); break;
        case 1: dq_row<1, FP8>(x + t * k, k, wr, sr, k, scols, yp + t * n + r, n); break;
        default: break;
      }
    }
  });
}

void check_grid(const at::Tensor& w, const at::Tensor& scale, int64_t srows, int64_t scols) {
  TORCH_CHECK(w.dim() == 2 && w.is_contiguous() && w.scalar_type() == at::kChar, "w: contiguous int8 [N, K]");
  TORCH_CHECK(scale.dim() == 2 && scale.is_contiguous() && scale.scalar_type() == at::kFloat,
              "scale: contiguous float32 [R, C]");
  TORCH_CHECK(srows > 0 && scols > 0, "scale block must be positive");
  TORCH_CHECK(scale.size(0) == (w.size(0) + srows - 1) / srows && scale.size(1) == (w.size(1) + scols - 1) / scols,
              "scale grid ", scale.sizes(), " does not cover w ", w.sizes(), " in blocks ", srows, "x", scols);
}

}  // namespace

// Rows [r0, r0 + out.size(0)) of W dequantised into out (float32 [rows, K]).
void dq_rows(at::Tensor w, at::Tensor scale, int64_t srows, int64_t scols, bool fp8, int64_t r0,
             at::Tensor out) {
  check_grid(w, scale, srows, scols);
  TORCH_CHECK(out.dim() == 2 && out.is_contiguous() && out.scalar_type() == at::kFloat &&
                  out.size(1) == w.size(1) && r0 >= 0 && r0 + out.size(0) <= w.size(0),
              "out: contiguous float32 [rows, K] inside w");
  const int64_t k = w.size(1), sc = scale.size(1);
  const int8_t* wp = w.data_ptr<int8_t>();
  const float* sp = scale.data_ptr<float>();
  float* op = out.data_ptr<float>();
  for_rows(out.size(0), [&](int64_t a, int64_t b) {
    for (int64_t i = a; i < b; ++i) {
      const int64_t r = r0 + i;
      const int8_t* wr = wp + r * k;
      const float* sr = sp + (r / srows) * sc;
      float* o = op + i * k;
      for (int64_t c0 = 0, g = 0; c0 < k; c0 += scols, ++g) {
        const int64_t c1 = std::min(k, c0 + scols);
        const Factor f = factor(fp8, sr[g]);
        int64_t c = c0;
#ifdef __AVX2__
        const __m256 fa = _mm256_set1_ps(f.a), fb = _mm256_set1_ps(f.b);
        for (; c + 8 <= c1; c += 8) _mm256_storeu_ps(o + c, dq8(wr + c, fp8, fa, fb, f.b != 1.0f));
#endif
        for (; c < c1; ++c) o[c] = dq_scalar(wr, c, fp8, f);
      }
    }
  });
}

// fp8_fold: every scale * 2^60 is finite (the caller checks once per layer); x * 2^60 is checked here.
// Where either is not, the weight rows are dequantised exactly (dq_rows) and multiplied by torch.
at::Tensor dq_gemm(at::Tensor x, at::Tensor w, at::Tensor scale, int64_t srows, int64_t scols, bool fp8,
                   bool fp8_fold) {
  check_grid(w, scale, srows, scols);
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && x.scalar_type() == at::kFloat && x.size(1) == w.size(1),
              "x: contiguous float32 [M, K] with w's K");
  const int64_t m = x.size(0), n = w.size(0), k = w.size(1), sc = scale.size(1);
  const int8_t* wp = w.data_ptr<int8_t>();
  const float* sp = scale.data_ptr<float>();
  if (fp8) {
    at::Tensor xs = x * 0x1p60;
    if (!fp8_fold || !xs.isfinite().all().item<bool>()) {
      at::Tensor tile = at::empty({n, k}, x.options());
      dq_rows(w, scale, srows, scols, fp8, 0, tile);
      return at::mm(x, tile.t());
    }
    at::Tensor y = at::empty({m, n}, x.options());
    dq_rows_of<true>(xs.data_ptr<float>(), m, wp, sp, sc, srows, scols, k, n, y.data_ptr<float>());
    return y;
  }
  at::Tensor y = at::empty({m, n}, x.options());
  dq_rows_of<false>(x.data_ptr<float>(), m, wp, sp, sc, srows, scols, k, n, y.data_ptr<float>());
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
  m.def("dq_gemm(Tensor x, Tensor w, Tensor scale, int srows, int scols, bool fp8, bool fp8_fold) -> Tensor",
        &dq_gemm);
  m.def("dq_rows(Tensor w, Tensor scale, int srows, int scols, bool fp8, int r0, Tensor(a!) out) -> ()", &dq_rows);
  m.def("int_gemm(Tensor xq, Tensor xs, Tensor w, int bits, Tensor scale, int srows, int scols) -> Tensor",
        &int_gemm);
  m.def("fp8_fake_quant(Tensor x, int group, float amax_floor, float static_scale) -> Tensor", &fp8_fake_quant);
  m.def("isa() -> str", &isa);
}
