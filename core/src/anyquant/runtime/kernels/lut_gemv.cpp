// anyquant::lut4_gemv: y = x @ W.T for W[n, k] = lut[q[n, k]] * s[n, k / group], 4-bit codes into a 16-entry
// float table (bitsandbytes' nf4/fp4, FP4 E2M1 with E8M0 or FP8 scales: MXFP4, NVFP4), float activations.
//
// Codes: uint8 [N, K/2], per block of 32 codes 16 bytes, byte j holding code j (low nibble) and code j + 16 (high
// nibble), as GGUF's Q4 blocks. Scales: float32 [N, K/group], group 16, 32, 64, ... (a block's two halves may have
// two scales: NVFP4's groups of 16). Each weight is formed in float32 as lut[q] * s and multiplied with the float32
// activation (fused multiply-add in the vector paths), summed per row in float32: no activation rounding; against
// a format that rounds each weight to bfloat16 (bitsandbytes, NVFP4) the difference is that rounding.
// Vector paths: AVX512F (vpermps over the 16-entry table), AVX2 + FMA (two 8-entry permutes and a blend), scalar.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <torch/library.h>

#include <cstdint>

namespace {

constexpr int64_t MAX_ROWS = 4;  // activation rows per pass over a weight row

__attribute__((target("avx512f"))) void row_avx512(const uint8_t* c, const float* s, const float* x, int64_t ldx,
                                                   int64_t m, int64_t k, int64_t group, const float* lut,
                                                   float* y) {
  const __m512 table = _mm512_loadu_ps(lut);
  const __m512i fifteen = _mm512_set1_epi32(15);
  __m512 acc[MAX_ROWS];
  for (int64_t r = 0; r < m; ++r) acc[r] = _mm512_setzero_ps();
  const int64_t blocks = k / 32;
  for (int64_t b = 0; b < blocks; ++b) {
    const __m512i v = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(c + b * 16)));
    const __m512 lo = _mm512_mul_ps(_mm512_permutexvar_ps(_mm512_and_si512(v, fifteen), table),
                                    _mm512_set1_ps(s[(b * 32) / group]));
    const __m512 hi = _mm512_mul_ps(_mm512_permutexvar_ps(_mm512_srli_epi32(v, 4), table),
                                    _mm512_set1_ps(s[(b * 32 + 16) / group]));
    for (int64_t r = 0; r < m; ++r) {
      const float* xr = x + r * ldx + b * 32;
      acc[r] = _mm512_fmadd_ps(lo, _mm512_loadu_ps(xr), acc[r]);
      acc[r] = _mm512_fmadd_ps(hi, _mm512_loadu_ps(xr + 16), acc[r]);
    }
  }
  for (int64_t r = 0; r < m; ++r) y[r] = _mm512_reduce_add_ps(acc[r]);
}

__attribute__((target("avx2,fma"))) inline __m256 lookup8(__m256i idx, __m256 lut_lo, __m256 lut_hi) {
  const __m256 a = _mm256_permutevar8x32_ps(lut_lo, idx);
  const __m256 b = _mm256_permutevar8x32_ps(lut_hi, idx);
  const __m256i high = _mm256_cmpgt_epi32(idx, _mm256_set1_epi32(7));
  return _mm256_blendv_ps(a, b, _mm256_castsi256_ps(high));
}

__attribute__((target("avx2,fma"))) void row_avx2(const uint8_t* c, const float* s, const float* x, int64_t ldx,
                                                 int64_t m, int64_t k, int64_t group, const float* lut, float* y) {
  const __m256 lut_lo = _mm256_loadu_ps(lut), lut_hi = _mm256_loadu_ps(lut + 8);
  const __m256i fifteen = _mm256_set1_epi32(15);
  __m256 acc[MAX_ROWS];
  for (int64_t r = 0; r < m; ++r) acc[r] = _mm256_setzero_ps();
  const int64_t blocks = k / 32;
  for (int64_t b = 0; b < blocks; ++b) {
    const float s_lo = s[(b * 32) / group], s_hi = s[(b * 32 + 16) / group];
    for (int half = 0; half < 2; ++half) {  // bytes 0..7 then 8..15 of the block
      const __m256i v =
          _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(c + b * 16 + half * 8)));
      const __m256 lo = _mm256_mul_ps(lookup8(_mm256_and_si256(v, fifteen), lut_lo, lut_hi), _mm256_set1_ps(s_lo));
      const __m256 hi = _mm256_mul_ps(lookup8(_mm256_srli_epi32(v, 4), lut_lo, lut_hi), _mm256_set1_ps(s_hi));
      for (int64_t r = 0; r < m; ++r) {
        const float* xr = x + r * ldx + b * 32 + half * 8;
        acc[r] = _mm256_fmadd_ps(lo, _mm256_loadu_ps(xr), acc[r]);
        acc[r] = _mm256_fmadd_ps(hi, _mm256_loadu_ps(xr + 16), acc[r]);
      }
    }
  }
  for (int64_t r = 0; r < m; ++r) {
    const __m128 q = _mm_add_ps(_mm256_castps256_ps128(acc[r]), _mm256_extractf128_ps(acc[r], 1));
    const __m128 d = _mm_add_ps(q, _mm_movehl_ps(q, q));
    y[r] = _mm_cvtss_f32(_mm_add_ss(d, _mm_shuffle_ps(d, d, 1)));
  }
}

void row_scalar(const uint8_t* c, const float* s, const float* x, int64_t ldx, int64_t m, int64_t k, int64_t group,
                const float* lut, float* y) {
  for (int64_t r = 0; r < m; ++r) {
    float acc = 0.0f;
    for (int64_t b = 0; b < k / 32; ++b) {
      const float s_lo = s[(b * 32) / group], s_hi = s[(b * 32 + 16) / group];
      for (int j = 0; j < 16; ++j) {
        const uint8_t byte = c[b * 16 + j];
        acc += lut[byte & 15] * s_lo * x[r * ldx + b * 32 + j];
        acc += lut[byte >> 4] * s_hi * x[r * ldx + b * 32 + 16 + j];
      }
    }
    y[r] = acc;
  }
}

int64_t lut_isa_here() {
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx512f")) return 2;
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) return 1;
  return 0;
}

at::Tensor lut4_gemv(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales, const at::Tensor& lut,
                     int64_t group, int64_t isa) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(), "x: contiguous float32 [M, K]");
  TORCH_CHECK(codes.dim() == 2 && codes.scalar_type() == at::kByte && codes.is_contiguous(), "codes: uint8 [N, K/2]");
  TORCH_CHECK(scales.dim() == 2 && scales.scalar_type() == at::kFloat && scales.is_contiguous(),
              "scales: contiguous float32 [N, K/group]");
  TORCH_CHECK(lut.numel() == 16 && lut.scalar_type() == at::kFloat && lut.is_contiguous(), "lut: 16 float32 values");
  const int64_t m = x.size(0), k = x.size(1), n = codes.size(0);
  TORCH_CHECK(k > 0 && k % 32 == 0, "K must be a positive multiple of 32, not ", k);
  TORCH_CHECK(codes.size(1) == k / 2, "codes hold ", codes.size(1) * 2, " values a row, x has ", k);
  TORCH_CHECK(group >= 16 && group % 16 == 0 && k % group == 0, "group ", group, " must be a multiple of 16 dividing ", k);
  TORCH_CHECK(scales.size(0) == n && scales.size(1) == k / group, "scales must be [", n, ", ", k / group, "]");
  const int64_t here = lut_isa_here();
  const int64_t path = isa < 0 ? here : isa;
  TORCH_CHECK(path <= here, "isa ", isa, " does not run on this CPU (best: ", here, ")");
  auto y = at::empty({m, n}, x.options());
  const float* xp = x.data_ptr<float>();
  const uint8_t* cp = codes.data_ptr<uint8_t>();
  const float* sp = scales.data_ptr<float>();
  const float* lp = lut.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  const int64_t sk = k / group;
  at::parallel_for(0, n, 16, [&](int64_t begin, int64_t end) {
    float out[MAX_ROWS];
    for (int64_t row = begin; row < end; ++row) {
      for (int64_t r0 = 0; r0 < m; r0 += MAX_ROWS) {
        const int64_t rows = std::min<int64_t>(MAX_ROWS, m - r0);
        const uint8_t* c = cp + row * (k / 2);
        const float* s = sp + row * sk;
        const float* xr = xp + r0 * k;
        if (path == 2) row_avx512(c, s, xr, k, rows, k, group, lp, out);
        else if (path == 1) row_avx2(c, s, xr, k, rows, k, group, lp, out);
        else row_scalar(c, s, xr, k, rows, k, group, lp, out);
        for (int64_t r = 0; r < rows; ++r) yp[(r0 + r) * n + row] = out[r];
      }
    }
  });
  return y;
}

int64_t lut_isa() { return lut_isa_here(); }

}  // namespace

TORCH_LIBRARY_FRAGMENT(anyquant, m) {
  m.def("lut4_gemv(Tensor x, Tensor codes, Tensor scales, Tensor lut, int group, int isa=-1) -> Tensor");
  m.def("lut_isa() -> int", &lut_isa);
}

TORCH_LIBRARY_IMPL(anyquant, CPU, m) { m.impl("lut4_gemv", &lut4_gemv); }
