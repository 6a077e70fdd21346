// anyquant::lut4_gemv: y = x @ W.T for W[n, k] = lut[q[n, k]] * s[n, k / group], 4-bit codes into a 16-entry
// float table (bitsandbytes' nf4/fp4, FP4 E2M1 with E8M0 or FP8 scales: MXFP4, NVFP4), float activations.
//
// Codes: uint8 [N, K/2], per block of 32 codes 16 bytes, byte j holding code j (low nibble) and code j + 16 (high
// nibble), as GGUF's Q4 blocks. Scales: float32 [N, K/group], group 16, 32, 64, ... (a block's two halves may have
// two scales: NVFP4's groups of 16). Each weight is formed in float32 as lut[q] * s and multiplied with the float32
// activation (fused multiply-add in the vector paths), summed per row in float32: no activation rounding; with
// ``round`` each weight is first rounded as the format rounds it (bfloat16, float16): the format's own weights.
// Vector paths: AVX512F (vpermps over the 16-entry table; with AVX512-VBMI 128 codes a vector, il_rows512, and with
// AVX512-BF16 two groups' bfloat16 tables a conversion), AVX2 + FMA (two 8-entry permutes and a blend), scalar (the
// only one off x86-64: the portable path, bit for bit the vector paths' weights and float32 sums in another order).

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <type_traits>
#include <vector>

// The vector paths are x86-64's; elsewhere (ARM, POWER, ...) the scalar paths alone compile and run, as they do on
// x86-64 with -DANYQUANT_PORTABLE (how the tests build and check the portable kernel here).
#if (defined(__x86_64__) || defined(_M_X64)) && !defined(ANYQUANT_PORTABLE)
#include <immintrin.h>
#define AQ_LUT_X86 1
#endif

namespace {

constexpr int64_t MAX_ROWS = 4;  // activation rows per pass over a weight row

#ifdef AQ_LUT_X86
// Each formed weight rounded as the format rounds it (round: 0 float32 as formed, 1 bfloat16, 2 float16; nearest
// even), so that the decode path multiplies the format's own weights.
__attribute__((target("avx512f"))) inline __m512 round512(__m512 w, int64_t round) {
  if (round == 1) {
    const __m512i b = _mm512_castps_si512(w);
    const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(b, 16), _mm512_set1_epi32(1));
    const __m512i r = _mm512_add_epi32(b, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7FFF)));
    return _mm512_castsi512_ps(_mm512_and_si512(r, _mm512_set1_epi32(static_cast<int>(0xFFFF0000u))));
  }
  if (round == 2) return _mm512_cvtph_ps(_mm512_cvtps_ph(w, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
  return w;
}

__attribute__((target("avx2,fma,f16c"))) inline __m256 round256(__m256 w, int64_t round) {
  if (round == 1) {
    const __m256i b = _mm256_castps_si256(w);
    const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(b, 16), _mm256_set1_epi32(1));
    const __m256i r = _mm256_add_epi32(b, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7FFF)));
    return _mm256_castsi256_ps(_mm256_and_si256(r, _mm256_set1_epi32(static_cast<int>(0xFFFF0000u))));
  }
  if (round == 2) return _mm256_cvtph_ps(_mm256_cvtps_ph(w, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
  return w;
}

#endif  // AQ_LUT_X86

inline float round1(float w, int64_t round) {
  if (round == 1) return static_cast<float>(c10::BFloat16(w));
  if (round == 2) return static_cast<float>(c10::Half(w));
  return w;
}

#ifdef AQ_LUT_X86
// The decode paths form each group's 16 weights once, round(lut * s) (the same rounding of the same product as
// forming each weight: bit for bit the format's weights), and then only look the codes up in them, walking the groups
// in order (no division per block); the two halves of a block go to two accumulators.
template <int M>
__attribute__((target("avx512f"))) inline void lut_block512(const uint8_t* c, const float* x, int64_t ldx,
                                                           __m512 w_lo, __m512 w_hi, __m512* acc_lo, __m512* acc_hi) {
  const __m512i v = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(c)));
  const __m512 lo = _mm512_permutexvar_ps(v, w_lo);  // vpermps reads the low 4 bits of each index: no mask
  const __m512 hi = _mm512_permutexvar_ps(_mm512_srli_epi32(v, 4), w_hi);
  for (int r = 0; r < M; ++r) {
    acc_lo[r] = _mm512_fmadd_ps(lo, _mm512_loadu_ps(x + r * ldx), acc_lo[r]);
    acc_hi[r] = _mm512_fmadd_ps(hi, _mm512_loadu_ps(x + r * ldx + 16), acc_hi[r]);
  }
}

// M activation rows, a compile-time count: the accumulators stay in registers.
template <int M>
__attribute__((target("avx512f"))) void rows_avx512(const uint8_t* c, const float* s, const float* x, int64_t ldx,
                                                    int64_t k, int64_t group, const float* lut, int64_t round,
                                                    float* y) {
  const __m512 table = _mm512_loadu_ps(lut);
  __m512 acc_lo[M], acc_hi[M];
  for (int r = 0; r < M; ++r) acc_lo[r] = acc_hi[r] = _mm512_setzero_ps();
  if (group == 16) {  // NVFP4: a scale per half block
    for (int64_t b = 0; b < k / 32; ++b) {
      const __m512 w_lo = round512(_mm512_mul_ps(table, _mm512_set1_ps(s[2 * b])), round);
      const __m512 w_hi = round512(_mm512_mul_ps(table, _mm512_set1_ps(s[2 * b + 1])), round);
      lut_block512<M>(c + b * 16, x + b * 32, ldx, w_lo, w_hi, acc_lo, acc_hi);
    }
  } else if (group % 32 != 0) {  // 48, 80, ...: a block's halves may fall in two groups
    for (int64_t b = 0; b < k / 32; ++b) {
      const __m512 w_lo = round512(_mm512_mul_ps(table, _mm512_set1_ps(s[(b * 32) / group])), round);
      const __m512 w_hi = round512(_mm512_mul_ps(table, _mm512_set1_ps(s[(b * 32 + 16) / group])), round);
      lut_block512<M>(c + b * 16, x + b * 32, ldx, w_lo, w_hi, acc_lo, acc_hi);
    }
  } else {
    const int64_t per = group / 32;  // blocks a group
    for (int64_t g = 0; g < k / group; ++g) {
      const __m512 w = round512(_mm512_mul_ps(table, _mm512_set1_ps(s[g])), round);
      for (int64_t b = g * per; b < (g + 1) * per; ++b) lut_block512<M>(c + b * 16, x + b * 32, ldx, w, w, acc_lo, acc_hi);
    }
  }
  for (int r = 0; r < M; ++r) y[r] = _mm512_reduce_add_ps(_mm512_add_ps(acc_lo[r], acc_hi[r]));
}

__attribute__((target("avx512f"))) void row_avx512(const uint8_t* c, const float* s, const float* x, int64_t ldx,
                                                   int64_t m, int64_t k, int64_t group, const float* lut,
                                                   int64_t round, float* y) {
  switch (m) {
    case 1: return rows_avx512<1>(c, s, x, ldx, k, group, lut, round, y);
    case 2: return rows_avx512<2>(c, s, x, ldx, k, group, lut, round, y);
    case 3: return rows_avx512<3>(c, s, x, ldx, k, group, lut, round, y);
    default: return rows_avx512<MAX_ROWS>(c, s, x, ldx, k, group, lut, round, y);
  }
}

__attribute__((target("avx2,fma,f16c"))) inline __m256 lookup8(__m256i idx, __m256 lut_lo, __m256 lut_hi) {
  const __m256 a = _mm256_permutevar8x32_ps(lut_lo, idx);
  const __m256 b = _mm256_permutevar8x32_ps(lut_hi, idx);
  const __m256i high = _mm256_cmpgt_epi32(idx, _mm256_set1_epi32(7));
  return _mm256_blendv_ps(a, b, _mm256_castsi256_ps(high));
}

template <int M>
__attribute__((target("avx2,fma,f16c"))) inline void lut_block256(const uint8_t* c, const float* x, int64_t ldx,
                                                                  const __m256* w_lo, const __m256* w_hi,
                                                                  __m256* acc_lo, __m256* acc_hi) {
  for (int half = 0; half < 2; ++half) {  // bytes 0..7 then 8..15 of the block
    const __m256i v = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(c + half * 8)));
    const __m256 lo = lookup8(_mm256_and_si256(v, _mm256_set1_epi32(15)), w_lo[0], w_lo[1]);
    const __m256 hi = lookup8(_mm256_srli_epi32(v, 4), w_hi[0], w_hi[1]);
    for (int r = 0; r < M; ++r) {
      const float* xr = x + r * ldx + half * 8;
      acc_lo[r] = _mm256_fmadd_ps(lo, _mm256_loadu_ps(xr), acc_lo[r]);
      acc_hi[r] = _mm256_fmadd_ps(hi, _mm256_loadu_ps(xr + 16), acc_hi[r]);
    }
  }
}

__attribute__((target("avx2,fma,f16c"))) inline void lut_weights256(const __m256* table, float scale, int64_t round,
                                                                    __m256* w) {
  const __m256 sv = _mm256_set1_ps(scale);
  w[0] = round256(_mm256_mul_ps(table[0], sv), round);
  w[1] = round256(_mm256_mul_ps(table[1], sv), round);
}

template <int M>
__attribute__((target("avx2,fma,f16c"))) void rows_avx2(const uint8_t* c, const float* s, const float* x, int64_t ldx,
                                                       int64_t k, int64_t group, const float* lut, int64_t round,
                                                       float* y) {
  const __m256 table[2] = {_mm256_loadu_ps(lut), _mm256_loadu_ps(lut + 8)};
  __m256 acc_lo[M], acc_hi[M];
  for (int r = 0; r < M; ++r) acc_lo[r] = acc_hi[r] = _mm256_setzero_ps();
  __m256 w_lo[2], w_hi[2];
  if (group == 16) {
    for (int64_t b = 0; b < k / 32; ++b) {
      lut_weights256(table, s[2 * b], round, w_lo);
      lut_weights256(table, s[2 * b + 1], round, w_hi);
      lut_block256<M>(c + b * 16, x + b * 32, ldx, w_lo, w_hi, acc_lo, acc_hi);
    }
  } else if (group % 32 != 0) {  // 48, 80, ...: a block's halves may fall in two groups
    for (int64_t b = 0; b < k / 32; ++b) {
      lut_weights256(table, s[(b * 32) / group], round, w_lo);
      lut_weights256(table, s[(b * 32 + 16) / group], round, w_hi);
      lut_block256<M>(c + b * 16, x + b * 32, ldx, w_lo, w_hi, acc_lo, acc_hi);
    }
  } else {
    const int64_t per = group / 32;
    for (int64_t g = 0; g < k / group; ++g) {
      lut_weights256(table, s[g], round, w_lo);
      for (int64_t b = g * per; b < (g + 1) * per; ++b) lut_block256<M>(c + b * 16, x + b * 32, ldx, w_lo, w_lo, acc_lo, acc_hi);
    }
  }
  for (int r = 0; r < M; ++r) {
    const __m256 a = _mm256_add_ps(acc_lo[r], acc_hi[r]);
    const __m128 q = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
    const __m128 d = _mm_add_ps(q, _mm_movehl_ps(q, q));
    y[r] = _mm_cvtss_f32(_mm_add_ss(d, _mm_shuffle_ps(d, d, 1)));
  }
}

__attribute__((target("avx2,fma,f16c"))) void row_avx2(const uint8_t* c, const float* s, const float* x, int64_t ldx,
                                                      int64_t m, int64_t k, int64_t group, const float* lut,
                                                      int64_t round, float* y) {
  switch (m) {
    case 1: return rows_avx2<1>(c, s, x, ldx, k, group, lut, round, y);
    case 2: return rows_avx2<2>(c, s, x, ldx, k, group, lut, round, y);
    case 3: return rows_avx2<3>(c, s, x, ldx, k, group, lut, round, y);
    default: return rows_avx2<MAX_ROWS>(c, s, x, ldx, k, group, lut, round, y);
  }
}

// ---------------------------------------------------------------------------------------------------- 128 a vector
// AVX512-VBMI's path: the codes of 128 weights (64 bytes, four blocks) as one vector whose dword lane i holds weight
// 16t + i in nibble t (bits 4t..4t+3), t = 0..7: the blocks' bytes as a 4x16 matrix transposed (byte 4i + u is the
// blocks' byte 16u + i, the same nibbles), one byte permute (vpermb) per 64 bytes. The table indices of weights
// 16t..16t+15 are then that vector shifted right by 4t (vpermps reads the low 4 bits of each lane): a shift, a permute
// and a multiply-add per 16 weights, instead of a byte-to-dword widening per 16 codes as well. The same weights, each
// round(lut[q] * s) of its group's table, the same float32 products; only the order of the float32 sums differs.
#define AQ_IL512 __attribute__((target("avx512f,avx512bw,avx512vbmi,avx512bf16")))

AQ_IL512 inline __m512i chunk_codes512(const uint8_t* c) {
  // 24 chunks ahead (the rows are contiguous: past a row's end, the next row's): a single thread's stream from DRAM
  // is latency-bound without it; a hint, never a fault past the end
  _mm_prefetch(reinterpret_cast<const char*>(c) + 1536, _MM_HINT_T0);
  // byte j = 4i + u of the result is byte 16u + i of the blocks
  const __m512i idx = _mm512_set_epi8(63, 47, 31, 15, 62, 46, 30, 14, 61, 45, 29, 13, 60, 44, 28, 12, 59, 43, 27, 11,
                                      58, 42, 26, 10, 57, 41, 25, 9, 56, 40, 24, 8, 55, 39, 23, 7, 54, 38, 22, 6, 53, 37,
                                      21, 5, 52, 36, 20, 4, 51, 35, 19, 3, 50, 34, 18, 2, 49, 33, 17, 1, 48, 32, 16, 0);
  return _mm512_permutexvar_epi8(idx, _mm512_loadu_si512(c));
}

// The tables of two groups, scales s[0] and s[1], rounded to bfloat16 (round 1) in one conversion (AVX512-BF16's
// vcvtne2ps2bf16: nearest even, as round512; taken only for scales whose products are no float32 subnormals, which
// it would flush): ``pair_lo`` / ``pair_hi`` hold the table's values 0..7 / 8..15 each twice, times (s0, s1, s0, ...),
// so that word 2j of the result is value j times s0 and word 2j + 1 value j times s1.
AQ_IL512 inline void bf16_tables(__m512 pair_lo, __m512 pair_hi, const float* s, __m512* w0, __m512* w1) {
  double both;
  __builtin_memcpy(&both, s, sizeof both);
  const __m512 sv = _mm512_castpd_ps(_mm512_set1_pd(both));
  const __m512i r = reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(_mm512_mul_ps(pair_hi, sv), _mm512_mul_ps(pair_lo, sv)));
  *w0 = _mm512_castsi512_ps(_mm512_slli_epi32(r, 16));
  *w1 = _mm512_castsi512_ps(_mm512_and_si512(r, _mm512_set1_epi32(static_cast<int>(0xFFFF0000u))));
}

// Weights 16t..16t+15 of a chunk (w: their group's table) times M rows of x, into sum t % A of each row.
template <int M, int T, int A>
AQ_IL512 inline void il_sub512(__m512i v, __m512 w, const float* x, int64_t ldx, __m512 (*acc)[4]) {
  const __m512 wt = _mm512_permutexvar_ps(T == 0 ? v : _mm512_srli_epi32(v, 4 * T), w);
  for (int r = 0; r < M; ++r) acc[r][T % A] = _mm512_fmadd_ps(wt, _mm512_loadu_ps(x + r * ldx + 16 * T), acc[r][T % A]);
}

// G: 16, 32 or 64 (8, 4 or 2 groups a chunk), 128 (a group of whole chunks: a multiple of 128) or 0 (any other
// multiple of 16). kBF: round 1 by bf16_tables (G 16, 32, 64).
template <int M, int G, bool kBF>
AQ_IL512 void il_rows512(const uint8_t* c, const float* s, const float* x, int64_t ldx, int64_t k, int64_t group,
                         const float* lut, int64_t round, float* y) {
  constexpr int A = M <= 2 ? 4 : 2;  // independent sums a row: the multiply-add's latency over its throughput
  const __m512 table = _mm512_loadu_ps(lut);
  __m512 pair_lo = table, pair_hi = table;
  if (kBF) {
    pair_lo = _mm512_permutexvar_ps(_mm512_set_epi32(7, 7, 6, 6, 5, 5, 4, 4, 3, 3, 2, 2, 1, 1, 0, 0), table);
    pair_hi = _mm512_permutexvar_ps(_mm512_set_epi32(15, 15, 14, 14, 13, 13, 12, 12, 11, 11, 10, 10, 9, 9, 8, 8), table);
  }
  __m512 acc[M][4];
  for (int r = 0; r < M; ++r)
    for (int a = 0; a < 4; ++a) acc[r][a] = _mm512_setzero_ps();
  const int64_t chunks = k / 128;
#define AQ_SUB(T, W) il_sub512<M, T, A>(v, W, xc, ldx, acc)
#define AQ_TABLE(I) round512(_mm512_mul_ps(table, _mm512_set1_ps(sp[I])), round)
  if (G == 128) {  // K is a multiple of the group: whole chunks, no tail
    const int64_t per = group / 128;
    for (int64_t g = 0; g < k / group; ++g) {
      const __m512 w = round512(_mm512_mul_ps(table, _mm512_set1_ps(s[g])), round);
      for (int64_t p = g * per; p < (g + 1) * per; ++p) {
        const __m512i v = chunk_codes512(c + p * 64);
        const float* xc = x + p * 128;
        AQ_SUB(0, w); AQ_SUB(1, w); AQ_SUB(2, w); AQ_SUB(3, w); AQ_SUB(4, w); AQ_SUB(5, w); AQ_SUB(6, w); AQ_SUB(7, w);
      }
    }
  } else if (G == 16) {
    for (int64_t p = 0; p < chunks; ++p) {
      const __m512i v = chunk_codes512(c + p * 64);
      const float* xc = x + p * 128;
      const float* sp = s + p * 8;
      __m512 w0, w1;
      for (int h = 0; h < 2; ++h) {  // two halves: fewer tables live at once
        const float* sh = sp + 4 * h;
        __m512 w2, w3;
        if (kBF) bf16_tables(pair_lo, pair_hi, sh, &w0, &w1), bf16_tables(pair_lo, pair_hi, sh + 2, &w2, &w3);
        else w0 = round512(_mm512_mul_ps(table, _mm512_set1_ps(sh[0])), round),
             w1 = round512(_mm512_mul_ps(table, _mm512_set1_ps(sh[1])), round),
             w2 = round512(_mm512_mul_ps(table, _mm512_set1_ps(sh[2])), round),
             w3 = round512(_mm512_mul_ps(table, _mm512_set1_ps(sh[3])), round);
        if (h == 0) { AQ_SUB(0, w0); AQ_SUB(1, w1); AQ_SUB(2, w2); AQ_SUB(3, w3); }
        else { AQ_SUB(4, w0); AQ_SUB(5, w1); AQ_SUB(6, w2); AQ_SUB(7, w3); }
      }
    }
  } else if (G == 32) {
    for (int64_t p = 0; p < chunks; ++p) {
      const __m512i v = chunk_codes512(c + p * 64);
      const float* xc = x + p * 128;
      const float* sp = s + p * 4;
      __m512 w0, w1, w2, w3;
      if (kBF) bf16_tables(pair_lo, pair_hi, sp, &w0, &w1), bf16_tables(pair_lo, pair_hi, sp + 2, &w2, &w3);
      else w0 = AQ_TABLE(0), w1 = AQ_TABLE(1), w2 = AQ_TABLE(2), w3 = AQ_TABLE(3);
      AQ_SUB(0, w0); AQ_SUB(1, w0); AQ_SUB(2, w1); AQ_SUB(3, w1); AQ_SUB(4, w2); AQ_SUB(5, w2); AQ_SUB(6, w3); AQ_SUB(7, w3);
    }
  } else if (G == 64) {
    for (int64_t p = 0; p < chunks; ++p) {
      const __m512i v = chunk_codes512(c + p * 64);
      const float* xc = x + p * 128;
      const float* sp = s + p * 2;
      __m512 w0, w1;
      if (kBF) bf16_tables(pair_lo, pair_hi, sp, &w0, &w1);
      else w0 = AQ_TABLE(0), w1 = AQ_TABLE(1);
      AQ_SUB(0, w0); AQ_SUB(1, w0); AQ_SUB(2, w0); AQ_SUB(3, w0); AQ_SUB(4, w1); AQ_SUB(5, w1); AQ_SUB(6, w1); AQ_SUB(7, w1);
    }
  } else {  // the groups counted down, a table where one starts
    int64_t g = 0, left = group;
    __m512 w = round512(_mm512_mul_ps(table, _mm512_set1_ps(s[0])), round);
#define AQ_STEP(T)                                                     \
  if (left == 0) {                                                     \
    left = group;                                                      \
    w = round512(_mm512_mul_ps(table, _mm512_set1_ps(s[++g])), round); \
  }                                                                    \
  left -= 16;                                                          \
  AQ_SUB(T, w);
    for (int64_t p = 0; p < chunks; ++p) {
      const __m512i v = chunk_codes512(c + p * 64);
      const float* xc = x + p * 128;
      AQ_STEP(0) AQ_STEP(1) AQ_STEP(2) AQ_STEP(3) AQ_STEP(4) AQ_STEP(5) AQ_STEP(6) AQ_STEP(7)
    }
#undef AQ_STEP
  }
#undef AQ_TABLE
#undef AQ_SUB
  // the last K % 128 weights (G 16, 32, 64, 0): blocks of 32 as lut_block512 reads them
  for (int64_t b = chunks * 4; b < k / 32; ++b) {
    const __m512 w_lo = round512(_mm512_mul_ps(table, _mm512_set1_ps(s[(b * 32) / group])), round);
    const __m512 w_hi = round512(_mm512_mul_ps(table, _mm512_set1_ps(s[(b * 32 + 16) / group])), round);
    __m512 lo[M], hi[M];
    for (int r = 0; r < M; ++r) lo[r] = acc[r][0], hi[r] = acc[r][1];
    lut_block512<M>(c + b * 16, x + b * 32, ldx, w_lo, w_hi, lo, hi);
    for (int r = 0; r < M; ++r) acc[r][0] = lo[r], acc[r][1] = hi[r];
  }
  for (int r = 0; r < M; ++r)
    y[r] = _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(acc[r][0], acc[r][1]), _mm512_add_ps(acc[r][2], acc[r][3])));
}

// Whether every scale of a row takes bf16_tables: zero, or a finite magnitude of at least ``least`` (no product with
// a nonzero table value below float32's least normal).
AQ_IL512 inline bool bf16_scales(const float* s, int64_t count, float least) {
  const __m512 lo = _mm512_set1_ps(least), hi = _mm512_set1_ps(3.4028234663852886e38f);
  __mmask16 bad = 0;
  int64_t i = 0;
  for (; i + 16 <= count; i += 16) {
    const __m512 a = _mm512_abs_ps(_mm512_loadu_ps(s + i));
    bad |= ~(_mm512_cmp_ps_mask(a, lo, _CMP_GE_OQ) & _mm512_cmp_ps_mask(a, hi, _CMP_LE_OQ)) &
           _mm512_cmp_ps_mask(a, _mm512_setzero_ps(), _CMP_NEQ_UQ);
  }
  for (; i < count; ++i) {
    const float a = std::fabs(s[i]);
    if (a != 0.0f && !(a >= least && a <= 3.4028234663852886e38f)) return false;
  }
  return bad == 0;
}

template <int M>
AQ_IL512 void il_rows512_g(const uint8_t* c, const float* s, const float* x, int64_t ldx, int64_t k, int64_t group,
                           const float* lut, int64_t round, float bf16_least, float* y) {
  const bool bf = round == 1 && bf16_least >= 0.0f && (group == 16 || group == 32 || group == 64) &&
                  bf16_scales(s, k / group, bf16_least);
  if (group == 16) {
    if (bf) return il_rows512<M, 16, true>(c, s, x, ldx, k, group, lut, round, y);
    return il_rows512<M, 16, false>(c, s, x, ldx, k, group, lut, round, y);
  }
  if (group == 32) {
    if (bf) return il_rows512<M, 32, true>(c, s, x, ldx, k, group, lut, round, y);
    return il_rows512<M, 32, false>(c, s, x, ldx, k, group, lut, round, y);
  }
  if (group == 64) {
    if (bf) return il_rows512<M, 64, true>(c, s, x, ldx, k, group, lut, round, y);
    return il_rows512<M, 64, false>(c, s, x, ldx, k, group, lut, round, y);
  }
  if (group % 128 == 0) return il_rows512<M, 128, false>(c, s, x, ldx, k, group, lut, round, y);
  return il_rows512<M, 0, false>(c, s, x, ldx, k, group, lut, round, y);
}

// bf16_least: the least scale magnitude bf16_tables takes (-1: none, where the CPU lacks AVX512-BF16).
AQ_IL512 void il_row512(const uint8_t* c, const float* s, const float* x, int64_t ldx, int64_t m, int64_t k,
                        int64_t group, const float* lut, int64_t round, float bf16_least, float* y) {
  switch (m) {
    case 1: return il_rows512_g<1>(c, s, x, ldx, k, group, lut, round, bf16_least, y);
    case 2: return il_rows512_g<2>(c, s, x, ldx, k, group, lut, round, bf16_least, y);
    case 3: return il_rows512_g<3>(c, s, x, ldx, k, group, lut, round, bf16_least, y);
    default: return il_rows512_g<MAX_ROWS>(c, s, x, ldx, k, group, lut, round, bf16_least, y);
  }
}

#endif  // AQ_LUT_X86

void row_scalar(const uint8_t* c, const float* s, const float* x, int64_t ldx, int64_t m, int64_t k, int64_t group,
                const float* lut, int64_t round, float* y) {
  for (int64_t r = 0; r < m; ++r) {
    float acc = 0.0f;
    for (int64_t b = 0; b < k / 32; ++b) {
      const float s_lo = s[(b * 32) / group], s_hi = s[(b * 32 + 16) / group];
      for (int j = 0; j < 16; ++j) {
        const uint8_t byte = c[b * 16 + j];
        acc += round1(lut[byte & 15] * s_lo, round) * x[r * ldx + b * 32 + j];
        acc += round1(lut[byte >> 4] * s_hi, round) * x[r * ldx + b * 32 + 16 + j];
      }
    }
    y[r] = acc;
  }
}

// ---------------------------------------------------------------------------------------------------- FP8 E4M3
// anyquant::fp8_gemv: y = x @ W.T for W[n, k] = e4m3(q[n, k]) * s[n, k / group]: FP8 weights as stored (one byte),
// decoded to float32 by their bits (normal: sign | (exponent + 120) << 23 | mantissa << 20; subnormal: mantissa *
// 2**-9), times their group's float scale, float32 activations and sums. NaN codes are the caller's to refuse.

#ifdef AQ_LUT_X86
__attribute__((target("avx512f"))) inline __m512 e4m3_16(__m128i raw) {
  const __m512i v = _mm512_cvtepu8_epi32(raw);
  const __m512i sign = _mm512_slli_epi32(_mm512_and_si512(v, _mm512_set1_epi32(0x80)), 24);
  const __m512i e = _mm512_and_si512(_mm512_srli_epi32(v, 3), _mm512_set1_epi32(15));
  const __m512i m = _mm512_and_si512(v, _mm512_set1_epi32(7));
  const __m512i normal = _mm512_or_si512(
      sign, _mm512_or_si512(_mm512_slli_epi32(_mm512_add_epi32(e, _mm512_set1_epi32(120)), 23), _mm512_slli_epi32(m, 20)));
  const __m512 sub = _mm512_castsi512_ps(_mm512_or_si512(
      sign, _mm512_castps_si512(_mm512_mul_ps(_mm512_cvtepi32_ps(m), _mm512_set1_ps(1.0f / 512.0f)))));
  const __mmask16 is_sub = _mm512_cmpeq_epi32_mask(e, _mm512_setzero_si512());
  return _mm512_mask_blend_ps(is_sub, _mm512_castsi512_ps(normal), sub);
}

// An E4M3 byte's bits moved into a float32's (sign to bit 31, exponent and mantissa to bits 20..26) are its value times
// 2**-120 exactly (E4M3's subnormals become float32 subnormals), so round(that * (s * 2**120)) is the same rounding of
// the same product as round(e4m3 * s): three integer ops instead of e4m3_16's eleven. Taken for a group whose
// s * 2**120 is finite (|s| < 2**7) where this thread keeps subnormal inputs (MXCSR's DAZ off); else e4m3_16.
__attribute__((target("avx512f"))) inline __m512 e4m3_scaled_16(__m128i raw) {
  const __m512i v = _mm512_cvtepi8_epi32(raw);  // sign-extended: bit 7 reaches bit 31 after the shift
  return _mm512_castsi512_ps(
      _mm512_and_si512(_mm512_slli_epi32(v, 20), _mm512_set1_epi32(static_cast<int>(0x87F00000u))));
}

template <int M, bool kBits>
__attribute__((target("avx512f"))) inline void fp8_group512(const uint8_t* c, const float* x, int64_t ldx, int64_t j,
                                                           int64_t end, __m512 sv, int64_t round, __m512* acc_a,
                                                           __m512* acc_b) {
  for (; j < end; j += 32) {  // a group is a multiple of 16: the last chunk may be alone
    const bool pair = j + 32 <= end;
    const __m128i r0 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(c + j));
    const __m512 w0 = round512(_mm512_mul_ps(kBits ? e4m3_scaled_16(r0) : e4m3_16(r0), sv), round);
    for (int r = 0; r < M; ++r) acc_a[r] = _mm512_fmadd_ps(w0, _mm512_loadu_ps(x + r * ldx + j), acc_a[r]);
    if (!pair) break;
    const __m128i r1 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(c + j + 16));
    const __m512 w1 = round512(_mm512_mul_ps(kBits ? e4m3_scaled_16(r1) : e4m3_16(r1), sv), round);
    for (int r = 0; r < M; ++r) acc_b[r] = _mm512_fmadd_ps(w1, _mm512_loadu_ps(x + r * ldx + j + 16), acc_b[r]);
  }
}

template <int M>
__attribute__((target("avx512f"))) void fp8_rows_avx512(const uint8_t* c, const float* s, const float* x, int64_t ldx,
                                                        int64_t k, int64_t group, int64_t round, float* y) {
  __m512 acc_a[M], acc_b[M];  // even and odd chunks of 16: two dependency chains, in registers
  for (int r = 0; r < M; ++r) acc_a[r] = acc_b[r] = _mm512_setzero_ps();
  constexpr float kUp = 1329227995784915872903807060280344576.0f;  // 2**120
  const bool bits = (_mm_getcsr() & 0x40) == 0;
  for (int64_t g = 0; g < k / group; ++g) {  // groups in order: no division per chunk
    const float sg = s[g];
    if (bits && std::fabs(sg) < 128.0f) {
      fp8_group512<M, true>(c, x, ldx, g * group, (g + 1) * group, _mm512_set1_ps(sg * kUp), round, acc_a, acc_b);
    } else {
      fp8_group512<M, false>(c, x, ldx, g * group, (g + 1) * group, _mm512_set1_ps(sg), round, acc_a, acc_b);
    }
  }
  for (int r = 0; r < M; ++r) y[r] = _mm512_reduce_add_ps(_mm512_add_ps(acc_a[r], acc_b[r]));
}

__attribute__((target("avx512f"))) void fp8_row_avx512(const uint8_t* c, const float* s, const float* x, int64_t ldx,
                                                       int64_t m, int64_t k, int64_t group, int64_t round, float* y) {
  switch (m) {
    case 1: return fp8_rows_avx512<1>(c, s, x, ldx, k, group, round, y);
    case 2: return fp8_rows_avx512<2>(c, s, x, ldx, k, group, round, y);
    case 3: return fp8_rows_avx512<3>(c, s, x, ldx, k, group, round, y);
    default: return fp8_rows_avx512<MAX_ROWS>(c, s, x, ldx, k, group, round, y);
  }
}

#endif  // AQ_LUT_X86

inline float e4m3_scalar(uint8_t b) {
  const int e = (b >> 3) & 15, mant = b & 7;
  const float mag = e == 0 ? mant / 512.0f : std::ldexp(1.0f + mant / 8.0f, e - 7);
  return (b & 0x80) ? -mag : mag;
}

void fp8_row_scalar(const uint8_t* c, const float* s, const float* x, int64_t ldx, int64_t m, int64_t k, int64_t group,
                    int64_t round, float* y) {
  for (int64_t r = 0; r < m; ++r) {
    float acc = 0.0f;
    for (int64_t j = 0; j < k; ++j) acc += round1(e4m3_scalar(c[j]) * s[j / group], round) * x[r * ldx + j];
    y[r] = acc;
  }
}

// AVX512-VBMI (and BW) beside AVX512F: the AVX512 path reads 128 weights a vector (il_rows512)
bool lut_vbmi_here() {
#if defined(AQ_LUT_X86) && !defined(ANYQUANT_LUT_NO_VBMI)  // the define: the AVX512F loop alone (to test it here)
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vbmi");
#else
  return false;
#endif
}

// The least scale magnitude whose products with the table's nonzero values are all float32 normals (with a margin of
// 2), which bf16_tables takes; -1 where the CPU lacks AVX512-BF16.
float lut_bf16_least(const float* lut) {
#ifdef AQ_LUT_X86
  __builtin_cpu_init();
  if (!__builtin_cpu_supports("avx512bf16")) return -1.0f;
  double least = 0.0;
  for (int i = 0; i < 16; ++i) {
    const double a = std::fabs(static_cast<double>(lut[i]));
    if (a != 0.0) least = std::max(least, 2.0 * 1.1754943508222875e-38 / a);  // NaN: skipped (the sums are NaN)
  }
  return least > 3.4e38 ? std::numeric_limits<float>::infinity() : static_cast<float>(least);
#else
  (void)lut;
  return -1.0f;
#endif
}

int64_t lut_isa_here() {
#ifdef AQ_LUT_X86
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx512f")) return 2;
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) return 1;
#endif
  return 0;
}

// Both ops check every argument before reading anything (a failed check is a TORCH_CHECK naming the op: a RuntimeError
// in Python): dtypes, dimensions, contiguity, the CPU, every size against the others (all of them sizes of real
// tensors, so no product below can overflow), group, round and isa.
void check_x(const at::Tensor& x, const char* op) {
  TORCH_CHECK(x.device().is_cpu(), "anyquant::", op, " runs on the CPU");
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(), "anyquant::", op,
              ": x: contiguous float32 [M, K]");
  TORCH_CHECK(x.size(1) > 0 && x.size(1) % 32 == 0, "anyquant::", op, ": K must be a positive multiple of 32, not ",
              x.size(1));
}

void check_weight(int64_t k, const at::Tensor& codes, const at::Tensor& scales, const at::Tensor& lut, int64_t group,
                  const char* op) {
  TORCH_CHECK(codes.device().is_cpu() && scales.device().is_cpu() && lut.device().is_cpu(), "anyquant::", op,
              " runs on the CPU");
  TORCH_CHECK(codes.dim() == 2 && codes.scalar_type() == at::kByte && codes.is_contiguous(), "anyquant::", op,
              ": codes: contiguous uint8 [N, K/2]");
  TORCH_CHECK(scales.dim() == 2 && scales.scalar_type() == at::kFloat && scales.is_contiguous(), "anyquant::", op,
              ": scales: contiguous float32 [N, K/group]");
  TORCH_CHECK(lut.numel() == 16 && lut.scalar_type() == at::kFloat && lut.is_contiguous(), "anyquant::", op,
              ": lut: 16 float32 values");
  TORCH_CHECK(codes.size(1) == k / 2, "anyquant::", op, ": codes hold ", codes.size(1) * 2, " values a row, x has ", k);
  TORCH_CHECK(group >= 16 && group % 16 == 0 && k % group == 0, "anyquant::", op, ": group ", group,
              " must be a multiple of 16 dividing ", k);
  TORCH_CHECK(scales.size(0) == codes.size(0) && scales.size(1) == k / group, "anyquant::", op, ": scales must be [",
              codes.size(0), ", ", k / group, "]");
}

int64_t check_path(int64_t round, int64_t isa, const char* op) {
  TORCH_CHECK(round >= 0 && round <= 2, "anyquant::", op, ": round is 0 (float32), 1 (bfloat16) or 2 (float16), not ",
              round);
  const int64_t here = lut_isa_here();
  TORCH_CHECK(isa >= -1, "anyquant::", op, ": isa is -1 (the best path here) or 0..2, not ", isa);
  const int64_t path = isa < 0 ? here : isa;
  TORCH_CHECK(path <= here, "anyquant::", op, ": isa ", isa, " does not run on this CPU (best: ", here, ")");
  return path;
}

// One weight's rows as the kernel reads them: codes, scales and table, its group, and where its outputs go.
struct LutPart {
  const uint8_t* codes;
  const float* scales;
  const float* lut;
  int64_t group, rows, col0;
  float bf16_least;
};

LutPart lut_part(const at::Tensor& codes, const at::Tensor& scales, const at::Tensor& lut, int64_t group, int64_t col0) {
  return {codes.data_ptr<uint8_t>(), scales.data_ptr<float>(), lut.data_ptr<float>(), group, codes.size(0), col0,
          lut_bf16_least(lut.data_ptr<float>())};
}

// Output row ``row`` of part ``p`` for every row of x [m, k]: y[r, p.col0 + row] (y's rows ``ldy`` apart).
inline void lut4_row(const LutPart& p, int64_t row, const float* xp, int64_t m, int64_t k, int64_t round, int64_t path,
                     [[maybe_unused]] bool vbmi, float* yp, int64_t ldy) {
  float out[MAX_ROWS];
  const uint8_t* c = p.codes + row * (k / 2);
  const float* s = p.scales + row * (k / p.group);
  for (int64_t r0 = 0; r0 < m; r0 += MAX_ROWS) {
    const int64_t rows = std::min<int64_t>(MAX_ROWS, m - r0);
    const float* xr = xp + r0 * k;
#ifdef AQ_LUT_X86
    if (path == 2 && vbmi) il_row512(c, s, xr, k, rows, k, p.group, p.lut, round, p.bf16_least, out);
    else if (path == 2) row_avx512(c, s, xr, k, rows, k, p.group, p.lut, round, out);
    else if (path == 1) row_avx2(c, s, xr, k, rows, k, p.group, p.lut, round, out);
    else
#endif
      row_scalar(c, s, xr, k, rows, k, p.group, p.lut, round, out);
    for (int64_t r = 0; r < rows; ++r) yp[(r0 + r) * ldy + p.col0 + row] = out[r];
  }
}

// The parts' rows in one parallel region (16 rows a task), their outputs side by side in y [m, total].
at::Tensor lut4_parts(const at::Tensor& x, const std::vector<LutPart>& parts, int64_t total, int64_t round,
                      int64_t path) {
  const int64_t m = x.size(0), k = x.size(1);
  const bool vbmi = lut_vbmi_here();
  auto y = at::empty({m, total}, x.options());
  const float* xp = x.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  at::parallel_for(0, total, 16, [&](int64_t begin, int64_t end) {
    size_t j = 0;
    for (int64_t row = begin; row < end; ++row) {
      while (row >= parts[j].col0 + parts[j].rows) ++j;
      lut4_row(parts[j], row - parts[j].col0, xp, m, k, round, path, vbmi, yp, total);
    }
  });
  return y;
}

at::Tensor lut4_gemv(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales, const at::Tensor& lut,
                     int64_t group, int64_t round, int64_t isa) {
  const int64_t path = check_path(round, isa, "lut4_gemv");
  check_x(x, "lut4_gemv");
  check_weight(x.size(1), codes, scales, lut, group, "lut4_gemv");
  return lut4_parts(x, {lut_part(codes, scales, lut, group, 0)}, codes.size(0), round, path);
}

// anyquant::lut4_gemv_cat: lut4_gemv of several weights on the same rows x (q, k, v; gate, up), their outputs side by
// side in one tensor, from one parallel region; each output bit for bit lut4_gemv's. tables[j]: weight j's 16 values,
// then its scales [N_j, K/groups[j]] (the one storage Lut4Linear keeps them in).
at::Tensor lut4_gemv_cat(const at::Tensor& x, at::TensorList codes, at::TensorList tables, at::IntArrayRef groups,
                         int64_t round, int64_t isa) {
  const int64_t path = check_path(round, isa, "lut4_gemv_cat");
  check_x(x, "lut4_gemv_cat");
  TORCH_CHECK(!codes.empty() && codes.size() == tables.size() && codes.size() == groups.size(),
              "anyquant::lut4_gemv_cat: ", codes.size(), " codes, ", tables.size(), " tables and ", groups.size(),
              " groups (one each, at least one)");
  const int64_t k = x.size(1);
  std::vector<LutPart> parts;
  std::vector<at::Tensor> views;  // the tables' lut and scales views, alive while the parts point into them
  int64_t total = 0;
  for (size_t j = 0; j < codes.size(); ++j) {
    const at::Tensor& table = tables[j];
    const int64_t group = groups[j];
    TORCH_CHECK(codes[j].dim() == 2 && group >= 16 && k % group == 0, "anyquant::lut4_gemv_cat: weight ", j,
                ": codes [N, K/2] and a group dividing K");
    const int64_t n = codes[j].size(0);
    TORCH_CHECK(table.dim() == 1 && table.scalar_type() == at::kFloat && table.is_contiguous() &&
                    table.numel() == 16 + n * (k / group),
                "anyquant::lut4_gemv_cat: table ", j, ": contiguous float32, 16 values then [", n, ", ", k / group,
                "] scales");
    views.push_back(table.narrow(0, 0, 16));
    views.push_back(table.narrow(0, 16, n * (k / group)).view({n, k / group}));
    check_weight(k, codes[j], views[views.size() - 1], views[views.size() - 2], group, "lut4_gemv_cat");
    parts.push_back(lut_part(codes[j], views[views.size() - 1], views[views.size() - 2], group, total));
    total += n;
  }
  return lut4_parts(x, parts, total, round, path);
}

at::Tensor fp8_gemv(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& scales, int64_t group,
                    int64_t round, int64_t isa) {
  TORCH_CHECK(round >= 0 && round <= 2, "anyquant::fp8_gemv: round is 0 (float32), 1 (bfloat16) or 2 (float16), not ",
              round);
  TORCH_CHECK(x.device().is_cpu() && weight.device().is_cpu() && scales.device().is_cpu(),
              "anyquant::fp8_gemv runs on the CPU");
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(),
              "anyquant::fp8_gemv: x: contiguous float32 [M, K]");
  TORCH_CHECK(weight.dim() == 2 && (weight.scalar_type() == at::kByte || weight.scalar_type() == at::kFloat8_e4m3fn) &&
                  weight.is_contiguous(),
              "anyquant::fp8_gemv: weight: contiguous [N, K] float8_e4m3fn or its uint8 bits, not ", weight.scalar_type());
  TORCH_CHECK(scales.dim() == 2 && scales.scalar_type() == at::kFloat && scales.is_contiguous(),
              "anyquant::fp8_gemv: scales: contiguous float32 [N, K/group]");
  const int64_t m = x.size(0), k = x.size(1), n = weight.size(0);
  TORCH_CHECK(k > 0 && k % 16 == 0 && weight.size(1) == k,
              "anyquant::fp8_gemv: K must be a positive multiple of 16 and the weight's width");
  TORCH_CHECK(group >= 16 && group % 16 == 0 && k % group == 0, "anyquant::fp8_gemv: group ", group,
              " must be a multiple of 16 dividing ", k);
  TORCH_CHECK(scales.size(0) == n && scales.size(1) == k / group, "anyquant::fp8_gemv: scales must be [", n, ", ",
              k / group, "]");
  const int64_t here = lut_isa_here() == 2 ? 2 : 0;  // the vector path is AVX512F's; else scalar
  TORCH_CHECK(isa >= -1, "anyquant::fp8_gemv: isa is -1 (the best path here), 0 or 2, not ", isa);
  const int64_t path = isa < 0 ? here : isa;
  TORCH_CHECK(path == 0 || path == here, "anyquant::fp8_gemv: isa ", isa, " does not run fp8_gemv on this CPU (best: ",
              here, ")");
  auto y = at::empty({m, n}, x.options());
  const float* xp = x.data_ptr<float>();
  const uint8_t* cp = static_cast<const uint8_t*>(weight.data_ptr());
  const float* sp = scales.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  const int64_t sk = k / group;
  at::parallel_for(0, n, 16, [&](int64_t begin, int64_t end) {
    float out[MAX_ROWS];
    for (int64_t row = begin; row < end; ++row) {
      for (int64_t r0 = 0; r0 < m; r0 += MAX_ROWS) {
        const int64_t rows = std::min<int64_t>(MAX_ROWS, m - r0);
#ifdef AQ_LUT_X86
        if (path == 2) fp8_row_avx512(cp + row * k, sp + row * sk, xp + r0 * k, k, rows, k, group, round, out);
        else
#endif
          fp8_row_scalar(cp + row * k, sp + row * sk, xp + r0 * k, k, rows, k, group, round, out);
        for (int64_t r = 0; r < rows; ++r) yp[(r0 + r) * n + row] = out[r];
      }
    }
  });
  return y;
}

// ---------------------------------------------------------------------------------------------------- exact weights
// anyquant::lut4_dequant / fp8_dequant: the format's exact weight [N, K] in float32, each value round(lut[q] * s) /
// round(e4m3(q) * s) as the decode ops form it (bit for bit): what a prompt's GEMM multiplies, formed at memory speed
// from a table of each group's values instead of torch's unpack, gather and repeat (a dozen passes over the weight).
// lut4_dequant_out / fp8_dequant_out: the same values written into a caller's contiguous [N, K] float32, bfloat16 or
// float16 tensor, converted to its dtype as torch converts (nearest even): bit for bit ``op(...).to(out.dtype)``,
// without the float32 tensor (the prompt path forms a weight a slice of rows at a time into one buffer).

// A formed (already rounded) float32 value as the output dtype: torch's conversions (nearest even).
template <typename T>
inline T out_value(float w) {
  return static_cast<T>(w);
}

#ifdef AQ_LUT_X86
// 16 formed values stored as T: float32 as they are; bfloat16 rounded to nearest even (round512's rounding, as
// c10::BFloat16's) and their high halves; float16 by vcvtps2ph, nearest even.
__attribute__((target("avx512f"))) inline void store512(float* out, __m512 w) { _mm512_storeu_ps(out, w); }
__attribute__((target("avx512f"))) inline void store512(c10::BFloat16* out, __m512 w) {
  const __m512i b = _mm512_srli_epi32(_mm512_castps_si512(round512(w, 1)), 16);
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(out), _mm512_cvtepi32_epi16(b));
}
__attribute__((target("avx512f"))) inline void store512(c10::Half* out, __m512 w) {
  const __m256i h = _mm512_cvtps_ph(w, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(out), h);
}

template <typename T>
__attribute__((target("avx512f"))) void lut4_dequant_row512(const uint8_t* c, const float* s, int64_t k, int64_t group,
                                                            const float* lut, int64_t round, T* out) {
  const __m512 table = _mm512_loadu_ps(lut);
  for (int64_t b = 0; b < k / 32; ++b) {
    const __m512 w_lo = round512(_mm512_mul_ps(table, _mm512_set1_ps(s[(b * 32) / group])), round);
    const __m512 w_hi = round512(_mm512_mul_ps(table, _mm512_set1_ps(s[(b * 32 + 16) / group])), round);
    const __m512i v = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(c + b * 16)));
    store512(out + b * 32, _mm512_permutexvar_ps(v, w_lo));  // the low 4 bits of each index
    store512(out + b * 32 + 16, _mm512_permutexvar_ps(_mm512_srli_epi32(v, 4), w_hi));
  }
}

#endif  // AQ_LUT_X86

// out: contiguous [n, k] float32 / bfloat16 / float16 on the CPU (checked by the callers' dtype dispatch).
void check_out(const at::Tensor& out, int64_t n, int64_t k, const char* op) {
  TORCH_CHECK(out.device().is_cpu() && out.dim() == 2 && out.size(0) == n && out.size(1) == k && out.is_contiguous(),
              "anyquant::", op, ": out must be a contiguous CPU tensor [", n, ", ", k, "], not ", out.sizes());
  TORCH_CHECK(out.scalar_type() == at::kFloat || out.scalar_type() == at::kBFloat16 || out.scalar_type() == at::kHalf,
              "anyquant::", op, ": out is float32, bfloat16 or float16, not ", out.scalar_type());
}

// Calls fn(T* data) with out's data as its element type.
template <typename Fn>
void with_out_type(const at::Tensor& out, Fn fn) {
  if (out.scalar_type() == at::kBFloat16) fn(out.data_ptr<c10::BFloat16>());
  else if (out.scalar_type() == at::kHalf) fn(out.data_ptr<c10::Half>());
  else fn(out.data_ptr<float>());
}

void lut4_dequant_out(const at::Tensor& codes, const at::Tensor& scales, const at::Tensor& lut, int64_t group,
                      int64_t round, const at::Tensor& out) {
  TORCH_CHECK(round >= 0 && round <= 2, "anyquant::lut4_dequant: round is 0 (float32), 1 (bfloat16) or 2 (float16), "
              "not ", round);
  TORCH_CHECK(codes.device().is_cpu() && scales.device().is_cpu() && lut.device().is_cpu(),
              "anyquant::lut4_dequant runs on the CPU");
  TORCH_CHECK(codes.dim() == 2 && codes.scalar_type() == at::kByte && codes.is_contiguous(),
              "anyquant::lut4_dequant: codes: contiguous uint8 [N, K/2]");
  TORCH_CHECK(scales.dim() == 2 && scales.scalar_type() == at::kFloat && scales.is_contiguous(),
              "anyquant::lut4_dequant: scales: contiguous float32 [N, K/group]");
  TORCH_CHECK(lut.numel() == 16 && lut.scalar_type() == at::kFloat && lut.is_contiguous(),
              "anyquant::lut4_dequant: lut: 16 float32 values");
  const int64_t n = codes.size(0), k = codes.size(1) * 2;
  TORCH_CHECK(k > 0 && k % 32 == 0, "anyquant::lut4_dequant: K must be a positive multiple of 32, not ", k);
  TORCH_CHECK(group >= 16 && group % 16 == 0 && k % group == 0, "anyquant::lut4_dequant: group ", group,
              " must be a multiple of 16 dividing ", k);
  TORCH_CHECK(scales.size(0) == n && scales.size(1) == k / group, "anyquant::lut4_dequant: scales must be [", n, ", ",
              k / group, "]");
  check_out(out, n, k, "lut4_dequant_out");
  const uint8_t* cp = codes.data_ptr<uint8_t>();
  const float* sp = scales.data_ptr<float>();
  const float* lp = lut.data_ptr<float>();
  const int64_t sk = k / group;
  [[maybe_unused]] const bool vector = lut_isa_here() == 2;
  with_out_type(out, [&](auto* wp) {
    using T = std::remove_pointer_t<decltype(wp)>;
    at::parallel_for(0, n, 16, [&](int64_t begin, int64_t end) {
      T table[16];
      for (int64_t row = begin; row < end; ++row) {
        const uint8_t* c = cp + row * (k / 2);
        T* dst = wp + row * k;
#ifdef AQ_LUT_X86
        if (vector) {
          lut4_dequant_row512(c, sp + row * sk, k, group, lp, round, dst);
          continue;
        }
#endif
        for (int64_t g = 0; g < sk; ++g) {  // a group is one or more halves of 16 values of blocks of 32
          for (int i = 0; i < 16; ++i) table[i] = out_value<T>(round1(lp[i] * sp[row * sk + g], round));
          for (int64_t j = g * group; j < (g + 1) * group; ++j) {  // value j of the row: block j / 32, its half
            const int64_t b = j / 32, i = j % 32;
            const uint8_t byte = c[b * 16 + (i & 15)];
            dst[j] = table[i < 16 ? (byte & 15) : (byte >> 4)];
          }
        }
      }
    });
  });
}

at::Tensor lut4_dequant(const at::Tensor& codes, const at::Tensor& scales, const at::Tensor& lut, int64_t group,
                        int64_t round) {
  TORCH_CHECK(codes.dim() == 2, "anyquant::lut4_dequant: codes: contiguous uint8 [N, K/2]");
  auto w = at::empty({codes.size(0), codes.size(1) * 2}, codes.options().dtype(at::kFloat));
  lut4_dequant_out(codes, scales, lut, group, round, w);
  return w;
}

void fp8_dequant_out(const at::Tensor& weight, const at::Tensor& scales, int64_t group, int64_t round,
                     const at::Tensor& out) {
  TORCH_CHECK(round >= 0 && round <= 2, "anyquant::fp8_dequant: round is 0 (float32), 1 (bfloat16) or 2 (float16), "
              "not ", round);
  TORCH_CHECK(weight.device().is_cpu() && scales.device().is_cpu(), "anyquant::fp8_dequant runs on the CPU");
  TORCH_CHECK(weight.dim() == 2 && (weight.scalar_type() == at::kByte || weight.scalar_type() == at::kFloat8_e4m3fn) &&
                  weight.is_contiguous(),
              "anyquant::fp8_dequant: weight: contiguous [N, K] float8_e4m3fn or its uint8 bits, not ",
              weight.scalar_type());
  TORCH_CHECK(scales.dim() == 2 && scales.scalar_type() == at::kFloat && scales.is_contiguous(),
              "anyquant::fp8_dequant: scales: contiguous float32 [N, K/group]");
  const int64_t n = weight.size(0), k = weight.size(1);
  TORCH_CHECK(k > 0 && k % 16 == 0, "anyquant::fp8_dequant: K must be a positive multiple of 16, not ", k);
  TORCH_CHECK(group >= 16 && group % 16 == 0 && k % group == 0, "anyquant::fp8_dequant: group ", group,
              " must be a multiple of 16 dividing ", k);
  TORCH_CHECK(scales.size(0) == n && scales.size(1) == k / group, "anyquant::fp8_dequant: scales must be [", n, ", ",
              k / group, "]");
  check_out(out, n, k, "fp8_dequant_out");
  const uint8_t* cp = static_cast<const uint8_t*>(weight.data_ptr());
  const float* sp = scales.data_ptr<float>();
  const int64_t sk = k / group;
  float codes[256];
  for (int i = 0; i < 256; ++i) codes[i] = e4m3_scalar(static_cast<uint8_t>(i));
  with_out_type(out, [&](auto* wp) {
    using T = std::remove_pointer_t<decltype(wp)>;
    at::parallel_for(0, n, 16, [&](int64_t begin, int64_t end) {
      for (int64_t row = begin; row < end; ++row) {
        const uint8_t* c = cp + row * k;
        T* dst = wp + row * k;
        for (int64_t g = 0; g < sk; ++g) {
          const float sg = sp[row * sk + g];
          if (group >= 512) {  // a table of the group's 256 values, then lookups
            T table[256];
            for (int i = 0; i < 256; ++i) table[i] = out_value<T>(round1(codes[i] * sg, round));
            for (int64_t j = g * group; j < (g + 1) * group; ++j) dst[j] = table[c[j]];
          } else {
            for (int64_t j = g * group; j < (g + 1) * group; ++j)
              dst[j] = out_value<T>(round1(codes[c[j]] * sg, round));
          }
        }
      }
    });
  });
}

at::Tensor fp8_dequant(const at::Tensor& weight, const at::Tensor& scales, int64_t group, int64_t round) {
  TORCH_CHECK(weight.dim() == 2, "anyquant::fp8_dequant: weight: contiguous [N, K] float8_e4m3fn or its uint8 bits");
  auto w = at::empty({weight.size(0), weight.size(1)}, scales.options().dtype(at::kFloat));
  fp8_dequant_out(weight, scales, group, round, w);
  return w;
}

int64_t lut_isa() { return lut_isa_here(); }

}  // namespace

TORCH_LIBRARY_FRAGMENT(anyquant, m) {
  m.def("lut4_gemv(Tensor x, Tensor codes, Tensor scales, Tensor lut, int group, int round=0, int isa=-1) -> Tensor");
  m.def("lut4_gemv_cat(Tensor x, Tensor[] codes, Tensor[] tables, int[] groups, int round=0, int isa=-1) -> Tensor");
  m.def("fp8_gemv(Tensor x, Tensor weight, Tensor scales, int group, int round=0, int isa=-1) -> Tensor");
  m.def("lut_isa() -> int", &lut_isa);
  m.def("lut4_dequant(Tensor codes, Tensor scales, Tensor lut, int group, int round=0) -> Tensor");
  m.def("fp8_dequant(Tensor weight, Tensor scales, int group, int round=0) -> Tensor");
  m.def("lut4_dequant_out(Tensor codes, Tensor scales, Tensor lut, int group, int round, Tensor(a!) out) -> ()");
  m.def("fp8_dequant_out(Tensor weight, Tensor scales, int group, int round, Tensor(a!) out) -> ()");
}

TORCH_LIBRARY_IMPL(anyquant, CPU, m) {
  m.impl("lut4_gemv", &lut4_gemv);
  m.impl("lut4_gemv_cat", &lut4_gemv_cat);
  m.impl("fp8_gemv", &fp8_gemv);
  m.impl("lut4_dequant", &lut4_dequant);
  m.impl("fp8_dequant", &fp8_dequant);
  m.impl("lut4_dequant_out", &lut4_dequant_out);
  m.impl("fp8_dequant_out", &fp8_dequant_out);
}
