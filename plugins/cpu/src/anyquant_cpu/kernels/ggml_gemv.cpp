// y[m, n] = sum_k w[n, k] * x[m, k] with w read as raw GGUF blocks (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0; the table types
// IQ4_NL and MXFP4, 4-bit codes indexing 16 int8 values, turned into them by a byte shuffle; the K-quants Q4_K, Q5_K
// and Q6_K and the table type IQ4_XS as their super-blocks of 256 weights, each sub-block of 32 on one activation
// block) or anyquant's GQ4
// blocks (GPTQ / AWQ group-quantized int4 repacked at load: fp16 scale s, fp16 zero point z, then Q4_1's
// 16 bytes of nibbles; w = s * (q - z), the offset -s * z exact in fp32) and x quantized
// to int8 per block of 32 (scale max|x|/127, as GGUF's Q8_0) inside the op: integer dot products per
// block, then the block scales. Written for anyquant from the GGUF block layout; three paths chosen at
// run time: AVX512-VNNI (256-bit vpdpbusd), AVX2 (vpmaddubsw + vpmaddwd), both 8 weight rows at a time with
// the blocks transposed in registers, and scalar (also for a last partial group of rows).
#include <torch/library.h>
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

// The vector paths are x86-64's; elsewhere (ARM, POWER, ...) the scalar paths alone compile and run, as they do on
// x86-64 with -DANYQUANT_PORTABLE (how the tests build and check the portable kernel here).
#if (defined(__x86_64__) || defined(_M_X64)) && !defined(ANYQUANT_PORTABLE)
#include <immintrin.h>
#define AQ_X86 1
#endif

namespace {

constexpr int QK = 32;
constexpr int QKK = 256;  // the K-quants' super-block: 8 sub-blocks of 32 weights
constexpr int64_t TYPE_Q4_0 = 2, TYPE_Q4_1 = 3, TYPE_Q8_0 = 8, TYPE_GQ4 = 100;
constexpr int64_t TYPE_Q4_K = 12, TYPE_Q5_K = 13, TYPE_Q6_K = 14;
constexpr int64_t TYPE_IQ4_NL = 20, TYPE_IQ4_XS = 23, TYPE_MXFP4 = 39, TYPE_Q5_0 = 6, TYPE_Q5_1 = 7;
constexpr int64_t TYPE_IL = 1000;  // added to a type: its interleaved form (below)
constexpr int64_t ISA_SCALAR = 0, ISA_AVX2 = 1, ISA_VNNI = 2;

inline float half_at(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  return c10::detail::fp16_ieee_to_fp32_value(h);
}

// the super-block types (256 weights a block): the K-quants and IQ4_XS
constexpr bool is_k(int64_t type) {
  return type == TYPE_Q4_K || type == TYPE_Q5_K || type == TYPE_Q6_K || type == TYPE_IQ4_XS;
}
// the table types: 4-bit codes indexing 16 int8 values (IQ4_NL's and IQ4_XS's kvalues_iq4nl, MXFP4's doubled e2m1
// values), signed weights as Q8_0's
constexpr bool is_lut(int64_t type) { return type == TYPE_IQ4_NL || type == TYPE_IQ4_XS || type == TYPE_MXFP4; }

// llama.cpp's kvalues_iq4nl and kvalues_mxfp4 (the e2m1 values doubled: 0, 0.5, 1, 1.5, 2, 3, 4, 6 and their negatives)
alignas(16) constexpr int8_t KV_IQ4NL[16] = {-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113};
alignas(16) constexpr int8_t KV_MXFP4[16] = {0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12};
constexpr const int8_t* lut_values(int64_t type) { return type == TYPE_MXFP4 ? KV_MXFP4 : KV_IQ4NL; }
// Q5_0 / Q5_1: Q4_0 / Q4_1 with a fifth bit per weight (qh, a little-endian uint32: bit j weight j) before the nibbles
constexpr bool is_q5(int64_t type) { return type == TYPE_Q5_0 || type == TYPE_Q5_1; }

// MXFP4's E8M0 scale byte e as ggml reads it for its doubled values: 2^(e - 128), built as a bit pattern (e < 2: the
// subnormals 2^-128, 2^-127; e = 255 is 2^127, not NaN), as the GGUF plugin's dequantizer builds it
inline float e8m0_half(uint8_t e) {
  const uint32_t bits = e < 2 ? uint32_t{0x00200000} << e : static_cast<uint32_t>(e - 1) << 23;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

// IQ4_XS sub-block j's 6-bit scale (4 low bits in scales_l, 2 high in scales_h) less 32
inline int iq4xs_scale(const uint8_t* blk, int j) {
  const int sh = blk[2] | (blk[3] << 8);
  return (((blk[4 + j / 2] >> (4 * (j % 2))) & 15) | (((sh >> (2 * j)) & 3) << 4)) - 32;
}

// weights per block: 32, or a K-quant's super-block of 256 (a row's cols are a multiple of it)
constexpr int block_qk(int64_t type) { return is_k(type % TYPE_IL) ? QKK : QK; }

// bytes per block (the interleaved form has the blocks' size). The K-quants' super-blocks (llama.cpp's block_q4_K,
// block_q5_K, block_q6_K): Q4_K d, dmin (float16), 12 bytes of 6-bit scales and mins of its 8 sub-blocks of 32, 128
// bytes of nibbles (w = d sc_j q - dmin m_j); Q5_K the same with 32 bytes of fifth bits (qh) before the nibbles; Q6_K
// 128 bytes of low nibbles (ql), 64 of 2-bit highs (qh), 16 int8 scales (one per 16 weights), d last (w = d sc (q - 32)).
// IQ4_NL: float16 d, Q4_0's 16 bytes of nibbles (w = d kv[q]); MXFP4: the E8M0 byte e then Q4_0's nibbles (w = 2^(e-128)
// kv[q]); IQ4_XS (a super-block of 256): d, scales_h (uint16: 2 high bits per sub-block), scales_l (4 bytes of low
// nibbles), then per sub-block of 32 its 16 bytes of nibbles as Q4_0's (w = d (ls - 32) kv[q]). Q5_0: d, 4 bytes of
// fifth bits qh, Q4_0's nibbles (w = d (q - 16)); Q5_1: d, m, qh, nibbles (w = d q + m).
constexpr int block_bytes(int64_t type) {
  return type % TYPE_IL == TYPE_IQ4_NL                                ? 18
         : type % TYPE_IL == TYPE_Q5_0                                ? 22
         : type % TYPE_IL == TYPE_Q5_1                                ? 24
         : type % TYPE_IL == TYPE_MXFP4                               ? 17
         : type % TYPE_IL == TYPE_IQ4_XS                              ? 136
         : type % TYPE_IL == TYPE_Q4_0                                ? 18
         : (type % TYPE_IL == TYPE_Q4_1 || type % TYPE_IL == TYPE_GQ4) ? 20
         : type % TYPE_IL == TYPE_Q4_K                                 ? 144
         : type % TYPE_IL == TYPE_Q5_K                                 ? 176
         : type % TYPE_IL == TYPE_Q6_K                                 ? 210
                                                                       : 34;
}

// The activations, quantized per row m and block b of 32: codes c with x ~ d * c. One pass (``fine`` off,
// llama.cpp's Q8_0 activations): c = round(x / d), d = max|x| / 127, held as int8 q. Two passes (``fine``):
// c = 256 q + l, with l = round((x - d q) * 256 / d) the int8 code of the first pass's residual (|l| <= 128,
// clamped to 127), and the scale d / 256: about 15 bits per activation for one more integer dot product per
// block. Also per block: sum(c), d * sum(c) and the sum of its first 16 codes (Q6_K's scales are per 16 weights).
// The same for every weight type.
struct QX {
  int64_t rows = 0, blocks = 0;
  bool fine = false;
  std::vector<int8_t> q, l;   // [rows, blocks, 32]: the high and (fine) low int8 codes
  std::vector<float> d;       // [rows, blocks]: the scale of c
  std::vector<float> dsum;    // [rows, blocks]: d * sum(c)
  std::vector<int32_t> csum;  // [rows, blocks]: sum(c)
  std::vector<int32_t> csum_lo;  // [rows, blocks]: the sum of the block's first 16 codes c
};

// One block: scale d, codes into q (and l), returns sum(c). Scalar; the same IEEE operations as the vector
// version below (no contraction: -ffp-contract=off), so the codes do not depend on the path.
inline int32_t quantize_block(const float* src, bool fine, int8_t* q, int8_t* l, float& d_out, int32_t& sum_lo) {
  float amax = 0.f;
  for (int j = 0; j < QK; ++j) amax = std::fmax(amax, std::fabs(src[j]));
  const float d = amax / 127.f;
  const float id = d > 0.f ? 1.f / d : 0.f;
  int32_t sum = 0;
  for (int j = 0; j < QK; ++j) {
    // nearbyint: round half to even under the default rounding mode, as torch.round
    const int v = static_cast<int>(std::nearbyint(src[j] * id));
    q[j] = static_cast<int8_t>(v);
    int code = v;
    if (fine) {
      const float r = src[j] - static_cast<float>(v) * d;
      int lo = static_cast<int>(std::nearbyint(r * id * 256.f));
      lo = lo > 127 ? 127 : lo < -127 ? -127 : lo;
      l[j] = static_cast<int8_t>(lo);
      code = 256 * v + lo;
    }
    sum += code;
    if (j == 15) sum_lo = sum;
  }
  d_out = d;
  return sum;
}

#ifdef AQ_X86
#define AQ_TARGET_AVX2 __attribute__((target("avx2,fma,f16c")))
#define AQ_TARGET_VNNI __attribute__((target("avx2,fma,f16c,avx512f,avx512vl,avx512bw,avx512vnni")))

AQ_TARGET_AVX2 inline int32_t hsum_epi32(__m256i v) {
  __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4e));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0xb1));
  return _mm_cvtsi128_si32(s);
}

// 4 x 8 int32 in [-128, 127] -> 32 int8 in order
AQ_TARGET_AVX2 inline void store_int8x32(int8_t* dst, const __m256i* v) {
  const __m256i p = _mm256_packs_epi16(_mm256_packs_epi32(v[0], v[1]), _mm256_packs_epi32(v[2], v[3]));
  // the packs interleave 128-bit lanes: dwords 0 4 1 5 2 6 3 7 -> 0..7
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst),
                      _mm256_permutevar8x32_epi32(p, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
}

// quantize_block in AVX2 (round half to even: the default rounding mode, as nearbyint)
AQ_TARGET_AVX2 int32_t quantize_block_avx2(const float* src, bool fine, int8_t* q, int8_t* l, float& d_out,
                                           int32_t& sum_lo) {
  const __m256 sign = _mm256_set1_ps(-0.f);
  __m256 x[4];
  __m256 amax = _mm256_setzero_ps();
  for (int k = 0; k < 4; ++k) {
    x[k] = _mm256_loadu_ps(src + 8 * k);
    amax = _mm256_max_ps(amax, _mm256_andnot_ps(sign, x[k]));
  }
  __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(amax), _mm256_extractf128_ps(amax, 1));
  m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
  m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
  const float d = _mm_cvtss_f32(m4) / 127.f;
  const float idf = d > 0.f ? 1.f / d : 0.f;
  const __m256 id = _mm256_set1_ps(idf), dv = _mm256_set1_ps(d);
  constexpr int RN = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
  __m256i v[4], lo[4];
  __m256i sv = _mm256_setzero_si256(), sl = _mm256_setzero_si256();
  __m256i sv_lo = sv, sl_lo = sl;  // the first 16 codes' (after k = 1)
  for (int k = 0; k < 4; ++k) {
    if (k == 2) sv_lo = sv, sl_lo = sl;
    const __m256 vf = _mm256_round_ps(_mm256_mul_ps(x[k], id), RN);
    v[k] = _mm256_cvtps_epi32(vf);
    sv = _mm256_add_epi32(sv, v[k]);
    if (fine) {
      const __m256 r = _mm256_sub_ps(x[k], _mm256_mul_ps(vf, dv));
      __m256 t = _mm256_round_ps(_mm256_mul_ps(_mm256_mul_ps(r, id), _mm256_set1_ps(256.f)), RN);
      t = _mm256_min_ps(_mm256_max_ps(t, _mm256_set1_ps(-127.f)), _mm256_set1_ps(127.f));
      lo[k] = _mm256_cvtps_epi32(t);
      sl = _mm256_add_epi32(sl, lo[k]);
    }
  }
  store_int8x32(q, v);
  if (fine) store_int8x32(l, lo);
  d_out = d;
  sum_lo = fine ? 256 * hsum_epi32(sv_lo) + hsum_epi32(sl_lo) : hsum_epi32(sv_lo);
  return fine ? 256 * hsum_epi32(sv) + hsum_epi32(sl) : hsum_epi32(sv);
}
#endif

void quantize_x(const float* x, int64_t rows, int64_t cols, bool fine, bool vector, QX& out) {
  const int64_t nb = cols / QK;
  out.rows = rows;
  out.blocks = nb;
  out.fine = fine;
  out.q.resize(rows * nb * QK);
  out.l.resize(fine ? rows * nb * QK : 0);
  out.d.resize(rows * nb);
  out.dsum.resize(rows * nb);
  out.csum.resize(rows * nb);
  out.csum_lo.resize(rows * nb);
  for (int64_t i = 0; i < rows * nb; ++i) {
    const float* src = x + i * QK;  // rows are contiguous and cols % 32 == 0: block i of the flat array
    int8_t* q = out.q.data() + i * QK;
    int8_t* l = fine ? out.l.data() + i * QK : nullptr;
    float d;
    int32_t sum_lo = 0;
#ifdef AQ_X86
    const int32_t sum =
        vector ? quantize_block_avx2(src, fine, q, l, d, sum_lo) : quantize_block(src, fine, q, l, d, sum_lo);
#else
    const int32_t sum = quantize_block(src, fine, q, l, d, sum_lo);
#endif
    out.csum[i] = sum;
    out.csum_lo[i] = sum_lo;
    const float dc = fine ? d * (1.f / 256.f) : d;
    out.d[i] = dc;
    out.dsum[i] = dc * static_cast<float>(sum);
  }
}

// ---------------------------------------------------------------------------------------------- scalar
// one weight block times activation block i, from the codes c
template <int64_t TYPE>
inline float block_dot(const uint8_t* blk, const QX& qx, int64_t i) {
  int32_t c[QK];
  for (int j = 0; j < QK; ++j) c[j] = qx.fine ? 256 * qx.q[i * QK + j] + qx.l[i * QK + j] : qx.q[i * QK + j];
  const float dw = TYPE == TYPE_MXFP4 ? e8m0_half(blk[0]) : half_at(blk);
  int32_t dot = 0;
  if (is_lut(TYPE)) {  // IQ4_NL, MXFP4: the codes' int8 values, then Q8_0's arithmetic
    const int8_t* kv = lut_values(TYPE);
    const uint8_t* qs = blk + (TYPE == TYPE_MXFP4 ? 1 : 2);
    for (int j = 0; j < 16; ++j) dot += kv[qs[j] & 15] * c[j] + kv[qs[j] >> 4] * c[j + 16];
    return dw * (qx.d[i] * static_cast<float>(dot));
  }
  if (TYPE == TYPE_Q8_0) {
    const int8_t* wq = reinterpret_cast<const int8_t*>(blk + 2);
    for (int j = 0; j < QK; ++j) dot += wq[j] * c[j];
    return dw * (qx.d[i] * static_cast<float>(dot));
  }
  if (is_q5(TYPE)) {
    const uint8_t* qh = blk + (TYPE == TYPE_Q5_0 ? 2 : 4);
    uint32_t h;
    std::memcpy(&h, qh, 4);
    for (int j = 0; j < 16; ++j) {
      dot += ((qh[4 + j] & 15) | ((h >> j) & 1) << 4) * c[j] + ((qh[4 + j] >> 4) | ((h >> (j + 16)) & 1) << 4) * c[j + 16];
    }
    if (TYPE == TYPE_Q5_0) return dw * (qx.d[i] * static_cast<float>(dot - 16 * qx.csum[i]));
    return dw * (qx.d[i] * static_cast<float>(dot)) + half_at(blk + 2) * qx.dsum[i];
  }
  const uint8_t* qs = blk + (TYPE == TYPE_Q4_0 ? 2 : 4);
  for (int j = 0; j < 16; ++j) dot += (qs[j] & 15) * c[j] + (qs[j] >> 4) * c[j + 16];
  if (TYPE == TYPE_Q4_0) return dw * (qx.d[i] * static_cast<float>(dot - 8 * qx.csum[i]));
  const float mw = TYPE == TYPE_GQ4 ? -(dw * half_at(blk + 2)) : half_at(blk + 2);
  return dw * (qx.d[i] * static_cast<float>(dot)) + mw * qx.dsum[i];
}

// ------------------------------------------------------------------------------------ K-quants, scalar
// A K-quant super-block is 8 sub-blocks of 32 weights, each on one activation block of 32 (the activations are
// quantized per block of 32 as for every type). Q4_K / Q5_K sub-block j: scale d sc_j and offset -dmin m_j, both exact
// in float32 (a float16 times a 6-bit integer), so it is Q4_1's arithmetic: d sc_j dx isum + (-dmin m_j) dx sum(c).
// Q6_K: one int8 scale per 16 weights, so two integer sums per sub-block, each with its own scale d sc; its codes
// q - 32 are taken as q with the offset 32 taken back through the halves' sums of codes (QX's csum_lo).

// Q4_K / Q5_K: sub-block j's 6-bit scale and min from the 12 scale bytes (llama.cpp's get_scale_min_k4)
inline void k_scale_min(const uint8_t* s, int j, int& sc, int& m) {
  if (j < 4) {
    sc = s[j] & 63;
    m = s[j + 4] & 63;
  } else {
    sc = (s[j + 4] & 15) | ((s[j - 4] >> 6) << 4);
    m = (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
  }
}

// sub-block j's 32 codes, unsigned (Q4_K 0..15, Q5_K 0..31, Q6_K 0..63: its offset 32 not taken off)
template <int64_t TYPE>
inline void k_codes(const uint8_t* blk, int j, int32_t* q) {
  if (TYPE == TYPE_Q6_K) {  // half h = j / 4 of 128 weights, its sub-block c: ql's nibble, qh's 2-bit field c
    const int h = j / 4, c = j % 4;
    const uint8_t* ql = blk + 64 * h + 32 * (c & 1);
    const uint8_t* qh = blk + 128 + 32 * h;
    for (int l = 0; l < QK; ++l) q[l] = ((ql[l] >> (4 * (c >> 1))) & 15) | (((qh[l] >> (2 * c)) & 3) << 4);
    return;
  }
  // 32 bytes of nibbles per pair of sub-blocks: the low nibbles sub-block 2 p, the high ones 2 p + 1
  const uint8_t* qs = blk + (TYPE == TYPE_Q5_K ? 48 : 16) + 32 * (j / 2);
  for (int l = 0; l < QK; ++l) q[l] = (qs[l] >> (4 * (j & 1))) & 15;
  if (TYPE == TYPE_Q5_K) {
    for (int l = 0; l < QK; ++l) q[l] |= ((blk[16 + l] >> j) & 1) << 4;  // qh byte l: bit j, sub-block j's
  }
}

// acc plus one super-block times activation blocks i0 .. i0 + 7, from the codes c (the portable reference)
template <int64_t TYPE>
inline float kblock_dot(const uint8_t* blk, const QX& qx, int64_t i0, float acc) {
  int32_t q[QK], c[QK];
  for (int j = 0; j < 8; ++j) {
    const int64_t i = i0 + j;
    for (int l = 0; l < QK; ++l) c[l] = qx.fine ? 256 * qx.q[i * QK + l] + qx.l[i * QK + l] : qx.q[i * QK + l];
    if (TYPE == TYPE_IQ4_XS) {  // sub-block j's 16 bytes of nibbles as IQ4_NL's; its scale d (ls - 32)
      const uint8_t* qs = blk + 8 + 16 * j;
      int32_t dot = 0;
      for (int l = 0; l < 16; ++l) dot += KV_IQ4NL[qs[l] & 15] * c[l] + KV_IQ4NL[qs[l] >> 4] * c[l + 16];
      const float dl = half_at(blk) * static_cast<float>(iq4xs_scale(blk, j));
      acc += static_cast<float>(dot) * (dl * qx.d[i]);
      continue;
    }
    k_codes<TYPE>(blk, j, q);
    if (TYPE == TYPE_Q6_K) {
      int32_t lo = 0, hi = 0;
      for (int l = 0; l < 16; ++l) lo += q[l] * c[l];
      for (int l = 16; l < QK; ++l) hi += q[l] * c[l];
      lo -= 32 * qx.csum_lo[i];
      hi -= 32 * (qx.csum[i] - qx.csum_lo[i]);
      const float d = half_at(blk + 208);
      const int8_t* sc = reinterpret_cast<const int8_t*>(blk + 192);
      acc += static_cast<float>(lo) * (d * static_cast<float>(sc[2 * j]) * qx.d[i]);
      acc += static_cast<float>(hi) * (d * static_cast<float>(sc[2 * j + 1]) * qx.d[i]);
    } else {
      int sc, m;
      k_scale_min(blk + 4, j, sc, m);
      int32_t dot = 0;
      for (int l = 0; l < QK; ++l) dot += q[l] * c[l];
      const float dw = half_at(blk) * static_cast<float>(sc), mw = -(half_at(blk + 2) * static_cast<float>(m));
      acc += static_cast<float>(dot) * (dw * qx.d[i]);
      acc += mw * qx.dsum[i];
    }
  }
  return acc;
}

// acc plus block b (of 32 weights, or a K-quant's super-block) of a row times activation row m's
template <int64_t TYPE>
inline float unit_dot(const uint8_t* blk, const QX& qx, int64_t m, int64_t b, float acc) {
  if (is_k(TYPE)) return kblock_dot<TYPE>(blk, qx, m * qx.blocks + 8 * b, acc);
  return acc + block_dot<TYPE>(blk, qx, m * qx.blocks + b);
}

template <int64_t TYPE>
void rows_scalar(const uint8_t* w, const QX& qx, int64_t mb, int64_t me, float* y, int64_t ld, int64_t n0, int64_t n1) {
  const int64_t nb = qx.blocks / (block_qk(TYPE) / QK);  // blocks of the type per row
  const int bs = block_bytes(TYPE);
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* row = w + n * nb * bs;
    for (int64_t m = mb; m < me; ++m) {
      float acc = 0.f;
      for (int64_t b = 0; b < nb; ++b) acc = unit_dot<TYPE>(row + b * bs, qx, m, b, acc);
      y[m * ld + n] = acc;
    }
  }
}

// ------------------------------------------------------------------------------------- interleaved form
// The interleaved form of a weight (type | TYPE_IL): each group of 8 rows holds, per block b, the 8 rows' blocks as
// one piece of 8 x block bytes: their float16 scales side by side, 16 bytes each (d; Q4_1's m / GQ4's z / Q4_K's and
// Q5_K's dmin after it), then the rest of the blocks' bytes (codes; the K-quants' sub-block scales too) in 32-byte
// chunks k whose 4 bytes at 4 r are row r's bytes 4k..4k+3 of it (Q4: 4 chunks of nibble bytes, Q8_0: 8 chunks,
// Q4_K: 3 of scales then 32 of nibbles, Q5_K: 3, 8 of qh, 32; Q6_K: 32 of ql, 16 of qh, 4 of scales, its d at the
// front as the others'), the vectors the 8-row path multiplies; rows past the last whole group stay as they are.
// IQ4_NL as Q4_0; MXFP4 its 8 rows' E8M0 bytes (8 bytes) then Q4_0's 4 chunks; IQ4_XS d and scales_h as two float16
// rows of 16 bytes, then 1 chunk of scales_l and 32 of nibbles (4 per sub-block); Q5_0 / Q5_1 as Q4_0 / Q4_1 with
// a chunk of qh before the nibbles' 4.
// Same size as the blocks; made once at load (llama.cpp repacks its Q4_0 and Q4_K the same way).

// the float16 scales a block starts with (Q6_K: ends with): how many, and where the first one is
constexpr int il_halves(int64_t type) {
  return (type == TYPE_Q4_1 || type == TYPE_GQ4 || type == TYPE_Q4_K || type == TYPE_Q5_K || type == TYPE_IQ4_XS ||
          type == TYPE_Q5_1)
             ? 2
             : 1;
}
constexpr int il_half_at(int64_t type) { return type == TYPE_Q6_K ? 208 : 0; }
// the bytes of each scale (float16: 2; MXFP4's E8M0 byte: 1), and of the piece's scales (8 rows of each)
constexpr int il_scale_size(int64_t type) { return type == TYPE_MXFP4 ? 1 : 2; }
constexpr int il_front(int64_t type) { return 8 * il_scale_size(type) * il_halves(type); }
// where the rest of the block (its 4-byte words) starts, and how many words
constexpr int il_word_at(int64_t type) { return type == TYPE_Q6_K ? 0 : il_scale_size(type) * il_halves(type); }
constexpr int il_words(int64_t type) { return (block_bytes(type) - il_scale_size(type) * il_halves(type)) / 4; }

// the chunk word q (of the words after the scales) goes to: its own place, but Q6_K's in the order the kernel reads
// them (a piece read front to back: out of order, its loads stalled the 8-row path): the 4 words of scales, then per
// half of 128 weights its 8 words of qh and 16 of ql
constexpr int il_chunk(int64_t type, int q) {
  return type != TYPE_Q6_K ? q : q >= 48 ? q - 48 : q >= 32 ? 4 + 24 * ((q - 32) / 8) + (q - 32) % 8 : 12 + 24 * (q / 16) + q % 16;
}

// where byte j of row r's block lies within its group's interleaved piece
inline int il_offset(int64_t type, int r, int j) {
  const int nh = il_halves(type), hs = il_half_at(type), su = il_scale_size(type);
  if (j >= hs && j < hs + su * nh) return 8 * su * ((j - hs) / su) + su * r + (j - hs) % su;
  const int q = j - il_word_at(type);  // byte q of the words
  return il_front(type) + 32 * il_chunk(type, q / 4) + 4 * r + q % 4;
}

// The pieces in column tiles of IL_TILE blocks of 32 (2,048 columns; 8 super-blocks of a K-quant): every group's
// pieces of a tile, group after group, before the next tile's. A thread's share of a tile is then one contiguous
// stream, and the kernel runs each tile over all its groups while the tile's activation codes stay in L1 (a 5,632-wide
// row's codes did not: the 25 KB of weights a group streams between two uses of the same codes evicted them;
// 2048x5632 Q4_0 ran at 60 % of 5632x2048's bandwidth). Rows of at most one tile: piece (g, b) at 8 bs (g nb + b).
constexpr int64_t IL_TILE = 64;
// How far ahead the 8-row paths prefetch an interleaved weight's stream (a thread's share of a tile is contiguous; past
// its end the hint reads the next group's pieces, or nothing: a prefetch never faults). The hardware prefetchers alone
// fell behind two threads' streams: 2 threads, 1.1B shapes, 72-80 GB/s copy bandwidth, 5632x2048 Q4_K 151-156 ->
// 118-123 us, Q6_K 193-205 -> 168-171 us; at 45 GB/s Q4_0 145-167 -> 128-135 us (bench/kernels.py --shapes kquants).
constexpr int64_t IL_PREFETCH = 4096;  // bytes ahead, blocks of 32
constexpr int64_t IL_PREFETCH_K = 4;   // pieces ahead (8 super-blocks of 144 to 210 bytes each), K-quants

// where the piece of group g, block b of a type lies (bytes), for nb blocks per row and G whole groups of 8 rows
inline int64_t il_piece(int64_t type, int64_t g, int64_t b, int64_t nb, int64_t G) {
  const int64_t tile = IL_TILE * QK / block_qk(type), bs = block_bytes(type);
  const int64_t t = b / tile, tw = std::min(tile, nb - t * tile);
  return 8 * bs * (G * t * tile + g * tw + (b - t * tile));
}

template <int64_t TYPE>
void rows_scalar_il(const uint8_t* w, const QX& qx, int64_t mb, int64_t me, float* y, int64_t ld, int64_t g0,
                    int64_t g1, int64_t G) {
  const int64_t nb = qx.blocks / (block_qk(TYPE) / QK);
  constexpr int bs = block_bytes(TYPE);
  uint8_t raw[bs];
  for (int64_t g = g0; g < g1; ++g) {
    for (int r = 0; r < 8; ++r) {
      for (int64_t m = mb; m < me; ++m) {
        float acc = 0.f;
        for (int64_t b = 0; b < nb; ++b) {
          const uint8_t* piece = w + il_piece(TYPE, g, b, nb, G);
          for (int j = 0; j < bs; ++j) raw[j] = piece[il_offset(TYPE, r, j)];
          acc = unit_dot<TYPE>(raw, qx, m, b, acc);
        }
        y[m * ld + 8 * g + r] = acc;
      }
    }
  }
}

#ifdef AQ_X86
// ------------------------------------------------------------------------------------ AVX2 and VNNI

// ------------------------------------------------------------------------ 8 rows at a time, lanes = rows
// Block b of 8 consecutive rows, read where it is stored and transposed in registers: lane r of vector v[k]
// holds row r's 4 weights 4k..4k+3 (k < 4) or 16+4k'..16+4k'+3 (k = 4 + k'), as unsigned bytes (Q4: the
// nibble bytes 4k'..4k'+3, low nibbles for v[k'], high ones for v[4+k']; Q8_0: the codes' dwords k, plus 128
// with VNNI), so that one integer dot product against the activation's 4 codes broadcast to every lane
// advances all 8 rows, and the block's scales are applied once per 8 rows (no horizontal sums). llama.cpp
// repacks the file into such an interleaved layout at load; here the bytes are read in place.

// 8 dwords, one per row r at p + r * stride (scalar loads: vpgatherdd measured slower on AMD Zen 4, and
// Intel's microcode for the Downfall mitigation makes it slower still)
AQ_TARGET_AVX2 inline __m256i dwords8(const uint8_t* p, int64_t stride) {
  int32_t v[8];
  for (int r = 0; r < 8; ++r) std::memcpy(&v[r], p + r * stride, 4);
  return _mm256_setr_epi32(v[0], v[1], v[2], v[3], v[4], v[5], v[6], v[7]);
}

// the float16 values in the low 16 bits of each of 8 dwords, as 8 floats
AQ_TARGET_AVX2 inline __m256 halves8(__m256i v) {
  v = _mm256_and_si256(v, _mm256_set1_epi32(0xFFFF));
  return _mm256_cvtph_ps(_mm_packus_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1)));
}

// rows r and r + 4's 16 bytes at p (+ r * stride) in one vector
AQ_TARGET_AVX2 inline __m256i two_rows(const uint8_t* p, int64_t stride, int r) {
  return _mm256_inserti128_si256(
      _mm256_castsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + r * stride))),
      _mm_loadu_si128(reinterpret_cast<const __m128i*>(p + (r + 4) * stride)), 1);
}

// 8 rows x 4 dwords (16 bytes at p + r * stride) -> t[k]: lane r = row r's dword k
AQ_TARGET_AVX2 inline void transpose8x4(const uint8_t* p, int64_t stride, __m256i* t) {
  const __m256i y0 = two_rows(p, stride, 0), y1 = two_rows(p, stride, 1);
  const __m256i y2 = two_rows(p, stride, 2), y3 = two_rows(p, stride, 3);
  const __m256i a = _mm256_unpacklo_epi32(y0, y1), b = _mm256_unpackhi_epi32(y0, y1);
  const __m256i c = _mm256_unpacklo_epi32(y2, y3), d = _mm256_unpackhi_epi32(y2, y3);
  t[0] = _mm256_unpacklo_epi64(a, c);
  t[1] = _mm256_unpackhi_epi64(a, c);
  t[2] = _mm256_unpacklo_epi64(b, d);
  t[3] = _mm256_unpackhi_epi64(b, d);
}

// 8 rows x 8 dwords (32 bytes at p + r * stride) -> t[k]: lane r = row r's dword k
AQ_TARGET_AVX2 inline void transpose8x8(const uint8_t* p, int64_t stride, __m256i* t) {
  __m256i r[8], u[8];
  for (int i = 0; i < 8; ++i) r[i] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + i * stride));
  for (int i = 0; i < 8; i += 2) {
    u[i] = _mm256_unpacklo_epi32(r[i], r[i + 1]);
    u[i + 1] = _mm256_unpackhi_epi32(r[i], r[i + 1]);
  }
  // rows 0-3 (i = 0) and 4-7 (i = 4): dwords {0,4}, {1,5}, {2,6}, {3,7} of each 4 rows
  for (int i = 0; i < 8; i += 4) {
    r[i] = _mm256_unpacklo_epi64(u[i], u[i + 2]);
    r[i + 1] = _mm256_unpackhi_epi64(u[i], u[i + 2]);
    r[i + 2] = _mm256_unpacklo_epi64(u[i + 1], u[i + 3]);
    r[i + 3] = _mm256_unpackhi_epi64(u[i + 1], u[i + 3]);
  }
  for (int k = 0; k < 4; ++k) {
    t[k] = _mm256_permute2x128_si256(r[k], r[4 + k], 0x20);
    t[4 + k] = _mm256_permute2x128_si256(r[k], r[4 + k], 0x31);
  }
}

// a table type's 16 int8 values in each 128-bit lane, for _mm256_shuffle_epi8 on the codes; with VNNI as unsigned bytes
// (+ 128, Q8_0's offset for vpdpbusd, taken back through sum(c)), else signed (vpmaddubsw with Q8_0's sign trick)
AQ_TARGET_AVX2 inline __m256i lut_table(int64_t type, bool vnni) {
  if (!is_lut(type)) return _mm256_setzero_si256();
  const __m128i t = _mm_loadu_si128(reinterpret_cast<const __m128i*>(lut_values(type)));
  const __m256i both = _mm256_broadcastsi128_si256(t);
  return vnni ? _mm256_xor_si256(both, _mm256_set1_epi8(static_cast<char>(0x80))) : both;
}

// per lane (dword) of qh: byte b (0..3) is 16 where bit s + b of the lane is set, else 0 (Q5's fifth bits)
AQ_TARGET_AVX2 inline __m256i fifth_bits(__m256i qh, int s) {
  // the lane's bits s .. s + 7 in each of its 4 bytes, then byte b's own bit b picked
  const __m256i spread = _mm256_setr_epi8(0, 0, 0, 0, 4, 4, 4, 4, 8, 8, 8, 8, 12, 12, 12, 12,  //
                                          0, 0, 0, 0, 4, 4, 4, 4, 8, 8, 8, 8, 12, 12, 12, 12);
  const __m256i bit = _mm256_set1_epi32(0x08040201);
  const __m256i t = _mm256_and_si256(_mm256_shuffle_epi8(_mm256_srli_epi32(qh, s), spread), bit);
  return _mm256_and_si256(_mm256_cmpeq_epi8(t, bit), _mm256_set1_epi8(16));
}

// e8m0_half of 8 int32 lanes (0..255)
AQ_TARGET_AVX2 inline __m256 e8m0_half8(__m256i e) {
  const __m256i small = _mm256_sllv_epi32(_mm256_set1_epi32(0x00200000), e);
  const __m256i large = _mm256_slli_epi32(_mm256_sub_epi32(e, _mm256_set1_epi32(1)), 23);
  return _mm256_castsi256_ps(_mm256_blendv_epi8(large, small, _mm256_cmpgt_epi32(_mm256_set1_epi32(2), e)));
}

#define AQ_BCAST(P) _mm256_set1_epi32(*reinterpret_cast<const int32_t*>(P))
// the 8 dot products of a block's chunks v[0..7] with the codes at X, as sum of four chains of two
#define AQ_DOT4(DOT, V, X)                                                                               \
  _mm256_add_epi32(                                                                                      \
      _mm256_add_epi32(DOT(DOT(_mm256_setzero_si256(), V[0], AQ_BCAST(X)), V[1], AQ_BCAST(X + 4)),       \
                       DOT(DOT(_mm256_setzero_si256(), V[2], AQ_BCAST(X + 8)), V[3], AQ_BCAST(X + 12))), \
      _mm256_add_epi32(DOT(DOT(_mm256_setzero_si256(), V[4], AQ_BCAST(X + 16)), V[5], AQ_BCAST(X + 20)), \
                       DOT(DOT(_mm256_setzero_si256(), V[6], AQ_BCAST(X + 24)), V[7], AQ_BCAST(X + 28))))

#define AQ_ROWS8_BODY(DOT)                                                                               \
  const int64_t nb = qx.blocks;                                                                          \
  constexpr int bs = block_bytes(TYPE);                                                                  \
  constexpr int qoff = TYPE == TYPE_Q4_1 || TYPE == TYPE_GQ4 ? 4 : TYPE == TYPE_MXFP4 ? 1                 \
                       : TYPE == TYPE_Q5_0 ? 6 : TYPE == TYPE_Q5_1 ? 8 : 2;                              \
  constexpr bool has_min = TYPE == TYPE_Q4_1 || TYPE == TYPE_GQ4 || TYPE == TYPE_Q5_1;                   \
  /* the unsigned codes' offset, taken back through sum(c): Q4_0's 8, Q8_0's and the tables' 128 added for \
     vpdpbusd */                                                                                         \
  constexpr bool has_offset = TYPE == TYPE_Q4_0 || TYPE == TYPE_Q5_0 ||                                  \
                               ((TYPE == TYPE_Q8_0 || is_lut(TYPE)) && VNNI);                           \
  constexpr int32_t offset = TYPE == TYPE_Q4_0 ? 8 : TYPE == TYPE_Q5_0 ? 16 : 128;                       \
  const int64_t rb = nb * bs;                                                                            \
  const __m256i lowmask = _mm256_set1_epi8(15);                                                          \
  const __m256i table = lut_table(TYPE, VNNI);                                                           \
  const bool fine = qx.fine;                                                                             \
  /* interleaved: a column tile at a time over every group (il_piece), each row's sum kept in y between tiles   \
     (float32: exact, the blocks still summed in order); read in place: the whole row at once */          \
  const int64_t tile = IL ? IL_TILE : nb;                                                                \
  for (int64_t b0 = 0; b0 < nb; b0 += tile) {                                                            \
  const int64_t b1 = std::min(nb, b0 + tile);                                                            \
  for (int64_t g = g0; g < g1; ++g) {                                                                    \
    const uint8_t* base = w + g * 8 * rb;                                                                \
    /* the tile's pieces of group g lie one after another from il_piece(g, b0) */                        \
    const uint8_t* tile_base = IL ? w + il_piece(TYPE, g, b0, nb, G) - b0 * 8 * bs : base;                \
    __m256 acc[M];                                                                                       \
    for (int m = 0; m < M; ++m) acc[m] = b0 ? _mm256_loadu_ps(y + (m0 + m) * ld + g * 8) : _mm256_setzero_ps(); \
    for (int64_t b = b0; b < b1; ++b) {                                                                  \
      __m256 dw, mw = _mm256_setzero_ps();                                                               \
      __m256i v[8], qh = _mm256_setzero_si256(); /* Q5: lane r = row r's 32 fifth bits */                \
      if (IL) {                                                                                          \
        /* interleaved: the 8 rows' scales side by side, then the chunks as the vectors want them */      \
        const uint8_t* blk = tile_base + b * 8 * bs;                                                     \
        {                                                                                                \
          const char* pf = reinterpret_cast<const char*>(blk) + IL_PREFETCH;                              \
          for (int l = 0; l < 8 * bs; l += 64) _mm_prefetch(pf + l, _MM_HINT_T0);                          \
        }                                                                                                \
        if (TYPE == TYPE_MXFP4) {                                                                        \
          dw = e8m0_half8(_mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(blk))));  \
        } else {                                                                                         \
          dw = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(blk)));                  \
        }                                                                                                \
        if (has_min) mw = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 16)));  \
        const uint8_t* chunks = blk + il_front(TYPE);                                                    \
        if (is_q5(TYPE)) {                                                                               \
          qh = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(chunks));                             \
          chunks += 32;                                                                                  \
        }                                                                                                \
        for (int k = 0; k < (TYPE == TYPE_Q8_0 ? 8 : 4); ++k) {                                          \
          v[k] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(chunks + 32 * k));                  \
        }                                                                                                \
      } else {                                                                                           \
        const uint8_t* blk = base + b * bs;                                                              \
        /* the next group's 8 rows (contiguous, 8 bs per block step): 8 short strided streams are more   \
           than the hardware prefetchers follow */                                                       \
        if (g + 1 < g1) {                                                                                \
          const char* pf = reinterpret_cast<const char*>(base + 8 * rb + b * 8 * bs);                    \
          for (int l = 0; l < 8 * bs; l += 64) _mm_prefetch(pf + l, _MM_HINT_T0);                        \
        }                                                                                                \
        const __m256i sc = dwords8(blk, rb);                                                             \
        dw = TYPE == TYPE_MXFP4 ? e8m0_half8(_mm256_and_si256(sc, _mm256_set1_epi32(0xFF))) : halves8(sc); \
        if (has_min) mw = halves8(_mm256_srli_epi32(sc, 16));                                            \
        if (TYPE == TYPE_Q8_0) {                                                                         \
          transpose8x8(blk + 2, rb, v);                                                                  \
        } else {                                                                                         \
          transpose8x4(blk + qoff, rb, v);                                                               \
        }                                                                                                \
        if (is_q5(TYPE)) qh = dwords8(blk + qoff - 4, rb);                                               \
      }                                                                                                  \
      if (TYPE == TYPE_GQ4) mw = _mm256_sub_ps(_mm256_setzero_ps(), _mm256_mul_ps(dw, mw));             \
      if (TYPE == TYPE_Q8_0) {                                                                           \
        if (VNNI) {                                                                                      \
          for (int k = 0; k < 8; ++k) v[k] = _mm256_xor_si256(v[k], _mm256_set1_epi8(static_cast<char>(0x80))); \
        }                                                                                                \
      } else {                                                                                           \
        for (int k = 0; k < 4; ++k) {                                                                    \
          v[4 + k] = _mm256_and_si256(_mm256_srli_epi16(v[k], 4), lowmask);                              \
          v[k] = _mm256_and_si256(v[k], lowmask);                                                        \
        }                                                                                                \
        if (is_q5(TYPE)) { /* weight 4 k + b's fifth bit (qh bit 4 k + b; the high nibbles' 16 + 4 k + b) \
                              into bit 4 of byte b of chunk k */                                         \
          for (int k = 0; k < 8; ++k) v[k] = _mm256_or_si256(v[k], fifth_bits(qh, k < 4 ? 4 * k : 16 + 4 * (k - 4))); \
        }                                                                                                \
        if (is_lut(TYPE)) { /* the codes' int8 values (+ 128 for vpdpbusd): one byte shuffle each */      \
          for (int k = 0; k < 8; ++k) v[k] = _mm256_shuffle_epi8(table, v[k]);                           \
        }                                                                                                \
      }                                                                                                  \
      for (int m = 0; m < M; ++m) {                                                                      \
        const int64_t i = (m0 + m) * nb + b;                                                             \
        const int8_t* xq = qx.q.data() + i * QK;                                                         \
        /* four short chains of dot products (not two long ones): the blocks' integer work overlaps */   \
        __m256i s = AQ_DOT4(DOT, v, xq);                                                                 \
        if (fine) s = _mm256_add_epi32(_mm256_slli_epi32(s, 8), AQ_DOT4(DOT, v, qx.l.data() + i * QK));  \
        if (has_offset) s = _mm256_sub_epi32(s, _mm256_set1_epi32(offset * qx.csum[i]));                 \
        acc[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s), _mm256_mul_ps(dw, _mm256_set1_ps(qx.d[i])), acc[m]); \
        if (has_min) acc[m] = _mm256_fmadd_ps(mw, _mm256_set1_ps(qx.dsum[i]), acc[m]);                   \
      }                                                                                                  \
    }                                                                                                    \
    for (int m = 0; m < M; ++m) _mm256_storeu_ps(y + (m0 + m) * ld + g * 8, acc[m]);                 \
  }                                                                                                      \
  }

template <int64_t TYPE, int M, bool IL>
AQ_TARGET_AVX2 void rows8_avx2(const uint8_t* w, const QX& qx, int64_t m0, float* y, int64_t ld, int64_t g0,
                               int64_t g1, int64_t G) {
  constexpr bool VNNI = false;
  const __m256i ones = _mm256_set1_epi16(1);
#define AQ_DOT8_AVX2(ACC, W, X)                                                                                 \
  (TYPE == TYPE_Q8_0 || is_lut(TYPE)                                                                            \
       ? _mm256_add_epi32(ACC, _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_sign_epi8(W, W), _mm256_sign_epi8(X, W)), ones)) \
       : _mm256_add_epi32(ACC, _mm256_madd_epi16(_mm256_maddubs_epi16(W, X), ones)))
  AQ_ROWS8_BODY(AQ_DOT8_AVX2)
#undef AQ_DOT8_AVX2
}

template <int64_t TYPE, int M, bool IL>
AQ_TARGET_VNNI void rows8_vnni(const uint8_t* w, const QX& qx, int64_t m0, float* y, int64_t ld, int64_t g0,
                               int64_t g1, int64_t G) {
  constexpr bool VNNI = true;
#define AQ_DOT8_VNNI(ACC, W, X) _mm256_dpbusd_epi32(ACC, W, X)
  AQ_ROWS8_BODY(AQ_DOT8_VNNI)
#undef AQ_DOT8_VNNI
}

// ------------------------------------------------------------------------ K-quants, 8 rows at a time
// The 8-row path on super-blocks (lanes = rows as above): per group of 8 rows and super-block, the rows' scales as
// lane vectors (Q4_K / Q5_K: d and dmin, the 6-bit sub-block scales and mins unpacked from their 3 words with a few
// whole-vector shifts and masks; Q6_K: d and the 16 int8 scales in 4 words), then per sub-block j the 8 chunks of 4
// weights a row (Q4_K's nibbles; Q5_K's with its fifth bit from qh; Q6_K's low nibble from ql and 2-bit high from qh),
// dotted with activation block 8 b + j and scaled: Q4_K / Q5_K as Q4_1 (d sc_j, -dmin m_j), Q6_K per 16 weights.

// lane-wise byte k (0..3) of v, unsigned / signed, as 8 int32
AQ_TARGET_AVX2 inline __m256i byte_of(__m256i v, int k) {
  return _mm256_and_si256(_mm256_srli_epi32(v, 8 * k), _mm256_set1_epi32(0xFF));
}
AQ_TARGET_AVX2 inline __m256i sbyte_of(__m256i v, int k) { return _mm256_srai_epi32(_mm256_slli_epi32(v, 24 - 8 * k), 24); }

// the 8 dot products of chunks v[0..3] (16 weights a row) with the codes at X, as two chains of two
#define AQ_DOT2(DOT, V, X)                                                                         \
  _mm256_add_epi32(DOT(DOT(_mm256_setzero_si256(), V[0], AQ_BCAST(X)), V[1], AQ_BCAST(X + 4)), \
                   DOT(DOT(_mm256_setzero_si256(), V[2], AQ_BCAST(X + 8)), V[3], AQ_BCAST(X + 12)))

// words WORD .. WORD + 7 of the 8 rows' super-block b (from the piece, or transposed from the rows in place) into OUT
#define AQ_K_CHUNK8(WORD, OUT)                                                                             \
  if (IL) {                                                                                                \
    for (int k_ = 0; k_ < 8; ++k_)                                                                         \
      OUT[k_] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(piece + il_front(TYPE) + 32 * (il_chunk(TYPE, WORD) + k_))); \
  } else {                                                                                                 \
    transpose8x8(blk + il_word_at(TYPE) + 4 * (WORD), rb, OUT);                                            \
  }

#define AQ_UNROLL _Pragma("GCC unroll 8")
#define AQ_ROWS8K_BODY(DOT)                                                                                  \
  const int64_t nbx = qx.blocks, nb = nbx / 8; /* activation blocks, super-blocks per row */                \
  constexpr int bs = block_bytes(TYPE), nh = il_halves(TYPE);                                               \
  const int64_t rb = nb * bs;                                                                               \
  const __m256i lowmask = _mm256_set1_epi8(15);                                                             \
  const __m256i table = lut_table(TYPE, VNNI); /* IQ4_XS's values (+ 128 for vpdpbusd) */                   \
  const bool fine = qx.fine;                                                                                \
  const int64_t tile = IL ? IL_TILE / 8 : nb;                                                               \
  for (int64_t b0 = 0; b0 < nb; b0 += tile) {                                                               \
    const int64_t b1 = std::min(nb, b0 + tile);                                                             \
    for (int64_t g = g0; g < g1; ++g) {                                                                     \
      const uint8_t* base = w + g * 8 * rb;                                                                 \
      const uint8_t* tile_base = IL ? w + il_piece(TYPE, g, b0, nb, G) - b0 * 8 * bs : base;                \
      __m256 acc[M];                                                                                        \
      for (int m = 0; m < M; ++m) acc[m] = b0 ? _mm256_loadu_ps(y + (m0 + m) * ld + g * 8) : _mm256_setzero_ps(); \
      for (int64_t b = b0; b < b1; ++b) {                                                                   \
        const uint8_t* piece = tile_base + b * 8 * bs; /* IL: the group's piece of super-block b */         \
        const uint8_t* blk = base + b * bs;            /* in place: row 0's super-block b, row r's + r rb */ \
        if (!IL && g + 1 < g1) {                                                                            \
          const char* pf = reinterpret_cast<const char*>(base + 8 * rb + b * 8 * bs);                       \
          for (int l = 0; l < 8 * bs; l += 64) _mm_prefetch(pf + l, _MM_HINT_T0);                           \
        }                                                                                                   \
        if (IL) {                                                                                           \
          const char* pf = reinterpret_cast<const char*>(piece) + IL_PREFETCH_K * 8 * bs;                   \
          for (int l = 0; l < 8 * bs; l += 64) _mm_prefetch(pf + l, _MM_HINT_T0);                           \
        }                                                                                                   \
        __m256 dw;                                                                                            \
        if (TYPE == TYPE_IQ4_XS) {                                                                            \
          /* d, scales_h (2 bits a sub-block) and scales_l (4) as lanes; per pair of sub-blocks 8 chunks of nibbles */\
          __m256i sh, sl, qs[8], v[8];                                                                        \
          if (IL) {                                                                                           \
            dw = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(piece)));                   \
            sh = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(piece + 16)));        \
            sl = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(piece + 32));                            \
          } else {                                                                                            \
            __m256i sw[4];                                                                                    \
            transpose8x4(blk, rb, sw);                                                                        \
            dw = halves8(sw[0]);                                                                              \
            sh = _mm256_srli_epi32(sw[0], 16);                                                                \
            sl = sw[1];                                                                                       \
          }                                                                                                   \
          AQ_UNROLL for (int p = 0; p < 4; ++p) {                                                             \
            AQ_K_CHUNK8(1 + 8 * p, qs)                                                                        \
            AQ_UNROLL for (int e = 0; e < 2; ++e) {                                                           \
              const int j = 2 * p + e;                                                                        \
              AQ_UNROLL for (int k = 0; k < 4; ++k) {                                                         \
                v[k] = _mm256_shuffle_epi8(table, _mm256_and_si256(qs[4 * e + k], lowmask));                  \
                v[4 + k] = _mm256_shuffle_epi8(table, _mm256_and_si256(_mm256_srli_epi16(qs[4 * e + k], 4), lowmask));\
              }                                                                                               \
              const __m256i ls = _mm256_or_si256(                                                             \
                  _mm256_and_si256(_mm256_srli_epi32(sl, 4 * j), _mm256_set1_epi32(15)),                      \
                  _mm256_slli_epi32(_mm256_and_si256(_mm256_srli_epi32(sh, 2 * j), _mm256_set1_epi32(3)), 4));\
              const __m256 fdw = _mm256_mul_ps(dw, _mm256_cvtepi32_ps(_mm256_sub_epi32(ls, _mm256_set1_epi32(32))));\
              for (int m = 0; m < M; ++m) {                                                                   \
                const int64_t i = (m0 + m) * nbx + 8 * b + j;                                                 \
                __m256i s = AQ_DOT4(DOT, v, qx.q.data() + i * QK);                                            \
                if (fine) s = _mm256_add_epi32(_mm256_slli_epi32(s, 8), AQ_DOT4(DOT, v, qx.l.data() + i * QK));\
                if (VNNI) s = _mm256_sub_epi32(s, _mm256_set1_epi32(128 * qx.csum[i]));                       \
                acc[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s), _mm256_mul_ps(fdw, _mm256_set1_ps(qx.d[i])), acc[m]);\
              }                                                                                               \
            }                                                                                                 \
          }                                                                                                   \
        } else if (TYPE == TYPE_Q6_K) {                                                                       \
          __m256i sc[4], ql[8], qh[8], v[8];                                                                \
          if (IL) {                                                                                         \
            dw = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(piece)));                 \
            for (int k = 0; k < 4; ++k)                                                                     \
              sc[k] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(piece + 16 + 32 * k));            \
          } else {                                                                                          \
            dw = halves8(_mm256_srli_epi32(dwords8(blk + 206, rb), 16));                                    \
            transpose8x4(blk + 192, rb, sc);                                                                \
          }                                                                                                 \
          AQ_UNROLL for (int h = 0; h < 2; ++h) {                                                           \
            AQ_K_CHUNK8(32 + 8 * h, qh)                                                                     \
            AQ_UNROLL for (int e = 0; e < 4; ++e) { /* ql's first 32 bytes: c = 0 (low nibbles), 2 (high); then 1, 3 */ \
              const int c = e / 2 + 2 * (e % 2), j = 4 * h + c;                                             \
              if (e % 2 == 0) { AQ_K_CHUNK8(16 * h + 8 * (e / 2), ql) }                                     \
              AQ_UNROLL for (int k = 0; k < 8; ++k) {                                                                 \
                const __m256i lo = _mm256_and_si256(c < 2 ? ql[k] : _mm256_srli_epi16(ql[k], 4), lowmask); \
                const __m256i hi = c == 0 ? _mm256_slli_epi16(qh[k], 4)                                     \
                                   : c == 1 ? _mm256_slli_epi16(qh[k], 2)                                   \
                                   : c == 2 ? qh[k]                                                         \
                                            : _mm256_srli_epi16(qh[k], 2);                                  \
                v[k] = _mm256_or_si256(lo, _mm256_and_si256(hi, _mm256_set1_epi8(0x30)));                   \
              }                                                                                             \
              const __m256 s0 = _mm256_mul_ps(dw, _mm256_cvtepi32_ps(sbyte_of(sc[j / 2], 2 * (j % 2))));     \
              const __m256 s1 = _mm256_mul_ps(dw, _mm256_cvtepi32_ps(sbyte_of(sc[j / 2], 2 * (j % 2) + 1))); \
              for (int m = 0; m < M; ++m) {                                                                 \
                const int64_t i = (m0 + m) * nbx + 8 * b + j;                                               \
                const int8_t* xq = qx.q.data() + i * QK;                                                    \
                __m256i lo = AQ_DOT2(DOT, v, xq), hi = AQ_DOT2(DOT, (v + 4), (xq + 16));                    \
                if (fine) {                                                                                 \
                  const int8_t* xl = qx.l.data() + i * QK;                                                  \
                  lo = _mm256_add_epi32(_mm256_slli_epi32(lo, 8), AQ_DOT2(DOT, v, xl));                     \
                  hi = _mm256_add_epi32(_mm256_slli_epi32(hi, 8), AQ_DOT2(DOT, (v + 4), (xl + 16)));        \
                }                                                                                           \
                const int32_t c_lo = qx.csum_lo[i], c_hi = qx.csum[i] - c_lo;                               \
                lo = _mm256_sub_epi32(lo, _mm256_set1_epi32(32 * c_lo));                                    \
                hi = _mm256_sub_epi32(hi, _mm256_set1_epi32(32 * c_hi));                                    \
                const __m256 dx = _mm256_set1_ps(qx.d[i]);                                                  \
                acc[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(lo), _mm256_mul_ps(s0, dx), acc[m]);            \
                acc[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(hi), _mm256_mul_ps(s1, dx), acc[m]);            \
              }                                                                                             \
            }                                                                                               \
          }                                                                                                 \
        } else {                                                                                            \
          __m256 dmw;                                                                                       \
          __m256i sw[4], qs[8], qh[8], v[8];                                                                \
          if (IL) {                                                                                         \
            dw = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(piece)));                 \
            dmw = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(piece + 16)));           \
            for (int k = 0; k < 3; ++k)                                                                     \
              sw[1 + k] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(piece + 32 + 32 * k));        \
          } else {                                                                                          \
            transpose8x4(blk, rb, sw); /* d and dmin, then the 3 words of scales and mins */                \
            dw = halves8(sw[0]);                                                                            \
            dmw = halves8(_mm256_srli_epi32(sw[0], 16));                                                    \
          }                                                                                                 \
          /* bytes j of sc4[0] / mn4[0]: sub-block j's scale / min (j < 4); of sc4[1] / mn4[1]: j + 4's */  \
          const __m256i m6 = _mm256_set1_epi8(63), m4 = lowmask, hi2 = _mm256_set1_epi8(0x30);             \
          const __m256i sc4[2] = {                                                                          \
              _mm256_and_si256(sw[1], m6),                                                                  \
              _mm256_or_si256(_mm256_and_si256(sw[3], m4), _mm256_and_si256(_mm256_srli_epi32(sw[1], 2), hi2))}; \
          const __m256i mn4[2] = {                                                                          \
              _mm256_and_si256(sw[2], m6),                                                                  \
              _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi32(sw[3], 4), m4),                            \
                              _mm256_and_si256(_mm256_srli_epi32(sw[2], 2), hi2))};                         \
          constexpr int qs_word = TYPE == TYPE_Q5_K ? 11 : 3;                                               \
          if (TYPE == TYPE_Q5_K) { AQ_K_CHUNK8(3, qh) }                                                     \
          AQ_UNROLL for (int p = 0; p < 4; ++p) {                                                           \
            AQ_K_CHUNK8(qs_word + 8 * p, qs)                                                                \
            AQ_UNROLL for (int e = 0; e < 2; ++e) {                                                         \
              const int j = 2 * p + e;                                                                      \
              AQ_UNROLL for (int k = 0; k < 8; ++k) {                                                                 \
                v[k] = _mm256_and_si256(e ? _mm256_srli_epi16(qs[k], 4) : qs[k], lowmask);                  \
                if (TYPE == TYPE_Q5_K) {                                                                    \
                  const __m256i bit = _mm256_and_si256(qh[k], _mm256_set1_epi8(static_cast<char>(1 << j))); \
                  v[k] = _mm256_or_si256(v[k], j < 4 ? _mm256_slli_epi16(bit, 4 - j) : _mm256_srli_epi16(bit, j - 4)); \
                }                                                                                           \
              }                                                                                             \
              const __m256 fdw = _mm256_mul_ps(dw, _mm256_cvtepi32_ps(byte_of(sc4[j / 4], j % 4)));         \
              const __m256 fmw = _mm256_sub_ps(_mm256_setzero_ps(),                                         \
                                               _mm256_mul_ps(dmw, _mm256_cvtepi32_ps(byte_of(mn4[j / 4], j % 4)))); \
              for (int m = 0; m < M; ++m) {                                                                 \
                const int64_t i = (m0 + m) * nbx + 8 * b + j;                                               \
                __m256i s = AQ_DOT4(DOT, v, qx.q.data() + i * QK);                                          \
                if (fine) s = _mm256_add_epi32(_mm256_slli_epi32(s, 8), AQ_DOT4(DOT, v, qx.l.data() + i * QK)); \
                acc[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s), _mm256_mul_ps(fdw, _mm256_set1_ps(qx.d[i])), acc[m]); \
                acc[m] = _mm256_fmadd_ps(fmw, _mm256_set1_ps(qx.dsum[i]), acc[m]);                          \
              }                                                                                             \
            }                                                                                               \
          }                                                                                                 \
        }                                                                                                   \
      }                                                                                                     \
      for (int m = 0; m < M; ++m) _mm256_storeu_ps(y + (m0 + m) * ld + g * 8, acc[m]);                     \
    }                                                                                                       \
  }

template <int64_t TYPE, int M, bool IL>
AQ_TARGET_AVX2 void rows8k_avx2(const uint8_t* w, const QX& qx, int64_t m0, float* y, int64_t ld, int64_t g0,
                                int64_t g1, int64_t G) {
  constexpr bool VNNI = false;
  const __m256i ones = _mm256_set1_epi16(1);
#define AQ_DOT8_AVX2(ACC, W, X)                                                                                 \
  (TYPE == TYPE_IQ4_XS /* signed weights: Q8_0's sign trick */                                                 \
       ? _mm256_add_epi32(ACC, _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_sign_epi8(W, W), _mm256_sign_epi8(X, W)), ones)) \
       : _mm256_add_epi32(ACC, _mm256_madd_epi16(_mm256_maddubs_epi16(W, X), ones)))
  AQ_ROWS8K_BODY(AQ_DOT8_AVX2)
#undef AQ_DOT8_AVX2
}

template <int64_t TYPE, int M, bool IL>
AQ_TARGET_VNNI void rows8k_vnni(const uint8_t* w, const QX& qx, int64_t m0, float* y, int64_t ld, int64_t g0,
                                int64_t g1, int64_t G) {
  constexpr bool VNNI = true;
#define AQ_DOT8_VNNI(ACC, W, X) _mm256_dpbusd_epi32(ACC, W, X)
  AQ_ROWS8K_BODY(AQ_DOT8_VNNI)
#undef AQ_DOT8_VNNI
}

#endif  // AQ_X86

int64_t best_isa() {
#ifdef AQ_X86
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx512vnni") && __builtin_cpu_supports("avx512vl") &&
      __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) {
    return ISA_VNNI;
  }
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c")) {
    return ISA_AVX2;
  }
#endif
  return ISA_SCALAR;
}

// rows [8 g0, min(8 g1, n_rows)) of y's rows [mb, me) (row stride ld) from the activations' rows [mb, me): whole
// groups of 8 on the 8-row path, a last partial group on the scalar one
template <int64_t TYPE, bool IL>
void run_rows(int64_t isa, const uint8_t* w, const QX& qx, int64_t mb, int64_t me, float* y, int64_t ld,
              int64_t n_rows, int64_t g0, int64_t g1) {
  const int64_t n1 = std::min(8 * g1, n_rows);
#ifdef AQ_X86
  if (isa != ISA_SCALAR) {
    const int64_t full = std::min(g1, n_rows / 8);
    // up to 8 activation rows a pass over the weights where the vector registers hold them (AVX512-VL's 32: the
    // 8-row path's accumulators and a block's 8 chunks), else 4; a row's sums are the same either way
    const int widest = isa == ISA_VNNI && !is_k(TYPE) ? 8 : 4;
    for (int64_t m0 = mb; m0 < me && full > g0;) {
      const int64_t left = me - m0;
      const int step = left >= widest ? widest : left >= 4 ? 4 : static_cast<int>(left);
#define AQ_CALL(FN)                                               \
  switch (step) {                                                 \
    case 8: FN<TYPE, 8, IL>(w, qx, m0, y, ld, g0, full, n_rows / 8); break;   \
    case 4: FN<TYPE, 4, IL>(w, qx, m0, y, ld, g0, full, n_rows / 8); break;   \
    case 3: FN<TYPE, 3, IL>(w, qx, m0, y, ld, g0, full, n_rows / 8); break;   \
    case 2: FN<TYPE, 2, IL>(w, qx, m0, y, ld, g0, full, n_rows / 8); break;   \
    default: FN<TYPE, 1, IL>(w, qx, m0, y, ld, g0, full, n_rows / 8); break;  \
  }
      if constexpr (is_k(TYPE)) {
        if (isa == ISA_VNNI) {
          AQ_CALL(rows8k_vnni)
        } else {
          AQ_CALL(rows8k_avx2)
        }
      } else if (isa == ISA_VNNI) {
        AQ_CALL(rows8_vnni)
      } else {
        AQ_CALL(rows8_avx2)
      }
#undef AQ_CALL
      m0 += step;
    }
    const int64_t t0 = std::max(8 * full, 8 * g0);  // a last partial group (rows % 8): scalar
    if (n1 > t0) rows_scalar<TYPE>(w, qx, mb, me, y, ld, t0, n1);
    return;
  }
#endif
  if (IL) {
    const int64_t full = std::min(g1, n_rows / 8);
    if (full > g0) rows_scalar_il<TYPE>(w, qx, mb, me, y, ld, g0, full, n_rows / 8);
    const int64_t t0 = std::max(8 * full, 8 * g0);
    if (n1 > t0) rows_scalar<TYPE>(w, qx, mb, me, y, ld, t0, n1);
    return;
  }
  rows_scalar<TYPE>(w, qx, mb, me, y, ld, 8 * g0, n1);
}

// One weight of a call: its blocks, type, rows; where its rows start among the call's groups and outputs; the one
// activation row it multiplies (and output row it writes), or -1: every row.
struct Part {
  const uint8_t* w;
  int64_t type, rows, group0, col0, xrow;
};

// the parts' groups of 8 rows numbered one after another from 0 (group0), for run_parts; returns how many
int64_t number_groups(std::vector<Part>& parts) {
  int64_t groups = 0;
  for (Part& p : parts) {
    p.group0 = groups;
    groups += (p.rows + 7) / 8;
  }
  return groups;
}

// y[m, col0 + n] = part's row n times activation row m (m: every row, or the part's xrow), the parts' groups of 8
// rows (numbered here) split over torch's threads together
void run_parts(const QX& qx, std::vector<Part>& parts, float* y, int64_t ld, int64_t isa) {
  const int64_t groups = number_groups(parts);
  // over groups of 8 rows (each row's arithmetic does not depend on how the groups are split over threads)
  at::parallel_for(0, groups, 2, [&](int64_t a, int64_t b) {
    for (const Part& p : parts) {
      const int64_t g0 = std::max(a, p.group0) - p.group0;
      const int64_t g1 = std::min(b, p.group0 + (p.rows + 7) / 8) - p.group0;
      if (g1 <= g0) continue;
      float* const yo = y + p.col0;
      const int64_t mb = p.xrow < 0 ? 0 : p.xrow, me = p.xrow < 0 ? qx.rows : p.xrow + 1;
#define AQ_RUN(IL)                                                                                            \
  if (base == TYPE_Q4_0) run_rows<TYPE_Q4_0, IL>(isa, p.w, qx, mb, me, yo, ld, p.rows, g0, g1);               \
  else if (base == TYPE_Q4_1) run_rows<TYPE_Q4_1, IL>(isa, p.w, qx, mb, me, yo, ld, p.rows, g0, g1);          \
  else if (base == TYPE_GQ4) run_rows<TYPE_GQ4, IL>(isa, p.w, qx, mb, me, yo, ld, p.rows, g0, g1);            \
  else if (base == TYPE_Q4_K) run_rows<TYPE_Q4_K, IL>(isa, p.w, qx, mb, me, yo, ld, p.rows, g0, g1);          \
  else if (base == TYPE_Q5_K) run_rows<TYPE_Q5_K, IL>(isa, p.w, qx, mb, me, yo, ld, p.rows, g0, g1);          \
  else if (base == TYPE_Q6_K) run_rows<TYPE_Q6_K, IL>(isa, p.w, qx, mb, me, yo, ld, p.rows, g0, g1);          \
  else if (base == TYPE_IQ4_NL) run_rows<TYPE_IQ4_NL, IL>(isa, p.w, qx, mb, me, yo, ld, p.rows, g0, g1);      \
  else if (base == TYPE_IQ4_XS) run_rows<TYPE_IQ4_XS, IL>(isa, p.w, qx, mb, me, yo, ld, p.rows, g0, g1);      \
  else if (base == TYPE_MXFP4) run_rows<TYPE_MXFP4, IL>(isa, p.w, qx, mb, me, yo, ld, p.rows, g0, g1);        \
  else if (base == TYPE_Q5_0) run_rows<TYPE_Q5_0, IL>(isa, p.w, qx, mb, me, yo, ld, p.rows, g0, g1);          \
  else if (base == TYPE_Q5_1) run_rows<TYPE_Q5_1, IL>(isa, p.w, qx, mb, me, yo, ld, p.rows, g0, g1);          \
  else run_rows<TYPE_Q8_0, IL>(isa, p.w, qx, mb, me, yo, ld, p.rows, g0, g1);
      const int64_t base = p.type % TYPE_IL;
      if (p.type >= TYPE_IL) {
        AQ_RUN(true)
      } else {
        AQ_RUN(false)
      }
#undef AQ_RUN
    }
  });
}

int64_t pick_isa(int64_t isa) {
  const int64_t best = best_isa();
  return isa < 0 || isa > best ? best : isa;
}

// The activations' codes: one per calling thread, kept between calls (its vectors keep their capacity: a decode
// step's calls would otherwise allocate and zero a dozen buffers each). Workers read it through the pointer given
// to them (naming a thread_local inside a parallel lambda would give each worker thread its own, empty, instance).
QX& thread_qx(int slot) {
  thread_local QX mine[2];
  return mine[slot];
}

// Every op checks every argument before it reads or writes anything (sizes, types, dtypes, layout, device, options),
// with overflow-checked arithmetic: rows * (cols / 32) * block_bytes computed in int64 wrapped for hostile sizes (a
// 20-byte tensor passed as 2**62 + 1 rows of Q4_1, and ggml_interleave wrote past its copy). A failed check is a
// TORCH_CHECK naming the op (a RuntimeError in Python).

// a * b, or false when the product does not fit int64
inline bool mul_fits(int64_t a, int64_t b, int64_t& out) { return !__builtin_mul_overflow(a, b, &out); }

void check_passes_isa(int64_t passes, int64_t isa, const char* name) {
  TORCH_CHECK(passes == 1 || passes == 2, "anyquant::", name, ": passes is 1 or 2, not ", passes);
  TORCH_CHECK(isa >= -1 && isa <= ISA_VNNI, "anyquant::", name, ": isa is -1 (the best path here) or 0..", ISA_VNNI,
              " (a path, the best here when it is higher), not ", isa);
}

// x: floating point [..., cols] on the CPU
void check_x(const at::Tensor& x, int64_t cols, const char* name) {
  TORCH_CHECK(x.device().is_cpu(), "anyquant::", name, " runs on the CPU");
  TORCH_CHECK(x.dim() >= 1, "anyquant::", name, ": x has no dimensions; it is [..., cols]");
  TORCH_CHECK(at::isFloatingType(x.scalar_type()), "anyquant::", name, ": x is floating point, not ", x.scalar_type());
  TORCH_CHECK(x.size(-1) == cols, "anyquant::", name, ": x has ", x.size(-1), " columns, not ", cols);
}

// y[:, col0 + n] for every part's row n, the parts' groups of 8 rows split over torch's threads together
at::Tensor gemv_parts(const at::Tensor& x, std::vector<Part>& parts, int64_t cols, int64_t isa, int64_t passes,
                      const char* name) {
  check_passes_isa(passes, isa, name);
  TORCH_CHECK(cols % QK == 0 && cols > 0, "anyquant::", name, ": cols ", cols, " is not a positive multiple of 32");
  check_x(x, cols, name);
  isa = pick_isa(isa);
  int64_t total = 0;
  for (Part& p : parts) {  // side by side (check_part made them all read every activation row)
    p.col0 = total;
    TORCH_CHECK(!__builtin_add_overflow(total, p.rows, &total), "anyquant::", name, ": the parts' rows add up past int64");
  }
  auto out_shape = x.sizes().vec();
  out_shape.back() = total;
  const at::Tensor xf = x.reshape({-1, cols}).to(at::kFloat).contiguous();
  const int64_t m = xf.size(0);
  int64_t outputs = 0;
  TORCH_CHECK(mul_fits(m, total, outputs), "anyquant::", name, ": ", m, " rows of x times ", total,
              " output columns overflow int64");
  QX& qx = thread_qx(0);
  quantize_x(xf.data_ptr<float>(), m, cols, passes == 2, isa != ISA_SCALAR, qx);
  at::Tensor y = at::empty({m, total}, xf.options());
  run_parts(qx, parts, y.data_ptr<float>(), total, isa);
  return y.to(x.scalar_type()).reshape(out_shape);
}

bool known_type(int64_t type) {
  const int64_t base = type >= TYPE_IL ? type - TYPE_IL : type;
  return base == TYPE_Q4_0 || base == TYPE_Q4_1 || base == TYPE_Q8_0 || base == TYPE_GQ4 || is_k(base) ||
         is_lut(base) || is_q5(base);
}

#define AQ_TYPE_NAMES \
  "Q4_0 (2), Q4_1 (3), Q5_0 (6), Q5_1 (7), Q8_0 (8), Q4_K (12), Q5_K (13), Q6_K (14), IQ4_NL (20), IQ4_XS (23), " \
  "MXFP4 (39) or GQ4 (100)"

// A weight [rows, cols] of blocks: every argument checked, the byte count in overflow-checked int64 (a size that wraps
// is refused, never compared with the tensor's numel modulo 2**64)
Part check_part(const at::Tensor& blocks, int64_t type, int64_t rows, int64_t cols, const char* name) {
  TORCH_CHECK(known_type(type), "anyquant::", name, ": block type ", type,
              " is not " AQ_TYPE_NAMES ", or one of them interleaved (+1000)");
  TORCH_CHECK(rows > 0, "anyquant::", name, ": rows ", rows, " is not positive");
  const int qk = block_qk(type);  // a K-quant's rows are whole super-blocks of 256
  TORCH_CHECK(cols % qk == 0 && cols > 0, "anyquant::", name, ": cols ", cols, " is not a positive multiple of ", qk,
              qk == QK ? "" : " (a K-quant's super-block)");
  TORCH_CHECK(blocks.device().is_cpu(), "anyquant::", name, " runs on the CPU");
  TORCH_CHECK(blocks.scalar_type() == at::kByte && blocks.is_contiguous(), "anyquant::", name,
              ": blocks must be a contiguous uint8 tensor");
  int64_t count = 0, bytes = 0;
  const bool fits = mul_fits(rows, cols / qk, count) && mul_fits(count, block_bytes(type), bytes);
  TORCH_CHECK(fits && blocks.numel() == bytes, "anyquant::", name, ": blocks hold ", blocks.numel(), " bytes, not ",
              fits ? std::to_string(bytes)
                   : "the bytes of [" + std::to_string(rows) + ", " + std::to_string(cols) + "] weights (past int64)");
  return Part{blocks.data_ptr<uint8_t>(), type, rows, 0, 0, -1};
}

at::Tensor ggml_gemv(const at::Tensor& x, const at::Tensor& blocks, int64_t type, int64_t rows, int64_t cols,
                     int64_t isa, int64_t passes) {
  std::vector<Part> parts{check_part(blocks, type, rows, cols, "ggml_gemv")};
  return gemv_parts(x, parts, cols, isa, passes, "ggml_gemv");
}

// Several weights on the same x (q, k and v; gate and up): the activations quantized once, one parallel region
// over all their rows, the outputs side by side; each row computed as ggml_gemv computes it.
at::Tensor ggml_gemv_cat(const at::Tensor& x, at::TensorList blocks, at::IntArrayRef types, at::IntArrayRef rows,
                         int64_t isa, int64_t passes) {
  TORCH_CHECK(!blocks.empty() && blocks.size() == types.size() && blocks.size() == rows.size(),
              "anyquant::ggml_gemv_cat: ", blocks.size(), " blocks, ", types.size(), " types and ", rows.size(),
              " row counts (one each, at least one)");
  TORCH_CHECK(x.dim() >= 1, "anyquant::ggml_gemv_cat: x has no dimensions; it is [..., cols]");
  const int64_t cols = x.size(-1);
  std::vector<Part> parts;
  for (size_t j = 0; j < blocks.size(); ++j) parts.push_back(check_part(blocks[j], types[j], rows[j], cols, "ggml_gemv_cat"));
  return gemv_parts(x, parts, cols, isa, passes, "ggml_gemv_cat");
}

// A mixture-of-experts layer's chosen experts on rows x [T, H] (float32): per row t, its experts index[t, :] (int64;
// one outside [0, E) skipped, transformers' mark for an expert held elsewhere) taken in ascending expert order (ties
// in their top-k order), each expert e's output w * down_e(silu(gate_e x) * up_e x) with w = weights[t, pos] added
// to 0 in that order: the arithmetic of anyquant_runtime.experts.Experts' one-token path, bit for bit (each output
// row as ggml_gemv gives it, silu torch's own, the products and sums float32 operations in the same order). blocks,
// types: gate, up and down of expert 0, then of expert 1, ... (gate and up [intermediate, H], down [H, intermediate]).
// Per row two parallel regions: every chosen expert's gate and up on the row's codes, then every chosen expert's
// down, each on its own intermediate row.
at::Tensor ggml_experts(const at::Tensor& x, const at::Tensor& index, const at::Tensor& weights, at::TensorList blocks,
                        at::IntArrayRef types, int64_t intermediate, int64_t isa, int64_t passes) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.dim() == 2 && x.device().is_cpu(),
              "anyquant::ggml_experts: x is float32 [tokens, hidden] on the CPU");
  TORCH_CHECK(index.scalar_type() == at::kLong && weights.scalar_type() == at::kFloat && index.dim() == 2 &&
                  index.sizes() == weights.sizes() && index.size(0) == x.size(0),
              "anyquant::ggml_experts: index (int64) and weights (float32) are [tokens, top_k] alike");
  TORCH_CHECK(index.device().is_cpu() && weights.device().is_cpu(), "anyquant::ggml_experts runs on the CPU");
  check_passes_isa(passes, isa, "ggml_experts");
  TORCH_CHECK(!blocks.empty() && blocks.size() % 3 == 0 && types.size() == blocks.size(),
              "anyquant::ggml_experts: gate, up and down blocks and types for each expert");
  const int64_t experts = static_cast<int64_t>(blocks.size() / 3), hidden = x.size(1), tokens = x.size(0);
  const int64_t k = index.size(1);
  TORCH_CHECK(intermediate % QK == 0 && intermediate > 0, "anyquant::ggml_experts: intermediate ", intermediate,
              " is not a positive multiple of 32");
  std::vector<Part> gate_up, down;
  for (int64_t e = 0; e < experts; ++e) {
    gate_up.push_back(check_part(blocks[3 * e], types[3 * e], intermediate, hidden, "ggml_experts"));
    gate_up.push_back(check_part(blocks[3 * e + 1], types[3 * e + 1], intermediate, hidden, "ggml_experts"));
    down.push_back(check_part(blocks[3 * e + 2], types[3 * e + 2], hidden, intermediate, "ggml_experts"));
  }
  isa = pick_isa(isa);
  const at::Tensor xc = x.contiguous(), ic = index.contiguous(), wc = weights.contiguous();
  const int64_t* ip = ic.data_ptr<int64_t>();
  const float* wp = wc.data_ptr<float>();
  at::Tensor out = at::zeros_like(xc);
  float* const op = out.data_ptr<float>();
  QX& qx = thread_qx(0);
  QX& qm = thread_qx(1);
  for (int64_t t = 0; t < tokens; ++t) {
    std::vector<std::pair<int64_t, int64_t>> chosen;  // (expert, position in the top-k)
    for (int64_t pos = 0; pos < k; ++pos) {
      const int64_t e = ip[t * k + pos];
      if (e >= 0 && e < experts) chosen.emplace_back(e, pos);
    }
    if (chosen.empty()) continue;
    std::stable_sort(chosen.begin(), chosen.end(),
                     [](const auto& a, const auto& b) { return a.first < b.first; });
    const int64_t n = static_cast<int64_t>(chosen.size());
    std::vector<Part> parts;
    for (const auto& c : chosen) {
      for (int j = 0; j < 2; ++j) {  // gate, then up: intermediate columns each, side by side
        parts.push_back(gate_up[2 * c.first + j]);
        parts.back().col0 = (static_cast<int64_t>(parts.size()) - 1) * intermediate;
      }
    }
    const int64_t total = static_cast<int64_t>(parts.size()) * intermediate;
    quantize_x(xc.data_ptr<float>() + t * hidden, 1, hidden, passes == 2, isa != ISA_SCALAR, qx);
    at::Tensor gu = at::empty({n, 2, intermediate}, xc.options());
    run_parts(qx, parts, gu.data_ptr<float>(), total, isa);
    const at::Tensor mid = at::silu(gu.select(1, 0)).mul_(gu.select(1, 1)).contiguous();  // [n, intermediate]
    quantize_x(mid.data_ptr<float>(), n, intermediate, passes == 2, isa != ISA_SCALAR, qm);
    parts.clear();
    for (int64_t i = 0; i < n; ++i) {
      parts.push_back(down[chosen[i].first]);
      parts.back().xrow = i;  // col0 0: each on its own output row
    }
    at::Tensor z = at::empty({n, hidden}, xc.options());
    const float* const zp = z.data_ptr<float>();
    run_parts(qm, parts, z.data_ptr<float>(), hidden, isa);
    float* const o = op + t * hidden;
    for (int64_t i = 0; i < n; ++i) {
      const float w = wp[t * k + chosen[i].second];
      const float* zi = zp + i * hidden;
      for (int64_t h = 0; h < hidden; ++h) o[h] = o[h] + zi[h] * w;
    }
  }
  return out;
}

// The stored row that output row r comes from: r itself, or with qk_head rows > 0 (llama.cpp's converter permuted
// the Q/K rows of "llama" files: within each head of qk_head rows, stored row 2 i + p holds row p qk_head / 2 + i)
// the stored row that holds it. qk_head is a multiple of 16, so a group of 8 output rows reads 8 stored rows 2 apart.
inline int64_t stored_row(int64_t r, int64_t qk_head) {
  if (qk_head == 0) return r;
  const int64_t half = qk_head / 2, j = r % qk_head;
  return r - j + 2 * (j % half) + j / half;
}

// groups [g0, g1) of blocks (src) into their interleaved form (dst), or back (forward false): il_offset's mapping, a
// scale (2 bytes) and a word (4 bytes) at a time; qk_head: forward from permuted rows (stored_row)
template <int64_t TYPE>
void interleave_groups(const uint8_t* src, uint8_t* dst, int64_t nb, int64_t G, int64_t g0, int64_t g1, bool forward,
                       int64_t qk_head) {
  constexpr int bs = block_bytes(TYPE), scales = il_halves(TYPE), words = il_words(TYPE);
  constexpr int hs = il_half_at(TYPE), ws = il_word_at(TYPE), su = il_scale_size(TYPE);
  int at_scale[8][scales], at_word[8][words];
  for (int r = 0; r < 8; ++r) {
    for (int i = 0; i < scales; ++i) at_scale[r][i] = il_offset(TYPE, r, hs + su * i);
    for (int q = 0; q < words; ++q) at_word[r][q] = il_offset(TYPE, r, ws + 4 * q);
  }
  for (int64_t g = g0; g < g1; ++g) {
    for (int64_t b = 0; b < nb; ++b) {
      const int64_t piece = il_piece(TYPE, g, b, nb, G);
      for (int r = 0; r < 8; ++r) {
        const int64_t row = (stored_row(8 * g + r, qk_head) * nb + b) * bs;
        if (forward) {
          for (int i = 0; i < scales; ++i) std::memcpy(dst + piece + at_scale[r][i], src + row + hs + su * i, su);
          for (int q = 0; q < words; ++q) std::memcpy(dst + piece + at_word[r][q], src + row + ws + 4 * q, 4);
        } else {
          for (int i = 0; i < scales; ++i) std::memcpy(dst + row + hs + su * i, src + piece + at_scale[r][i], su);
          for (int q = 0; q < words; ++q) std::memcpy(dst + row + ws + 4 * q, src + piece + at_word[r][q], 4);
        }
      }
    }
  }
}

#ifdef AQ_X86
// interleave_groups' forward direction with the kernel's own 8-row transposes (the same bytes where they belong;
// one vector store per 32-byte chunk instead of eight 4-byte copies: the load's copy of a 1.1B model's weights,
// ~0.2 s, is mostly these copies and the new pages' first touch): the words 8 at a time, then 4, then one by one
template <int64_t TYPE>
AQ_TARGET_AVX2 void interleave_groups_avx2(const uint8_t* src, uint8_t* dst, int64_t nb, int64_t G, int64_t g0,
                                           int64_t g1, int64_t qk_head) {
  constexpr int bs = block_bytes(TYPE), scales = il_halves(TYPE), words = il_words(TYPE);
  constexpr int hs = il_half_at(TYPE), ws = il_word_at(TYPE), su = il_scale_size(TYPE);
  const int64_t rb = nb * bs, step = (qk_head ? 2 : 1) * rb;  // a group's 8 stored rows are step apart
  __m256i t[8];
  for (int64_t g = g0; g < g1; ++g) {
    const uint8_t* const first = src + stored_row(8 * g, qk_head) * rb;
    for (int64_t b = 0; b < nb; ++b) {
      uint8_t* const piece = dst + il_piece(TYPE, g, b, nb, G);
      const uint8_t* const blk = first + b * bs;  // output row 8 g's block b; row r's at + r step
      for (int r = 0; r < 8; ++r) {
        for (int i = 0; i < scales; ++i) std::memcpy(piece + 8 * su * i + su * r, blk + r * step + hs + su * i, su);
      }
      uint8_t* const chunks = piece + il_front(TYPE);
      int q = 0;
      for (; q + 8 <= words; q += 8) {
        transpose8x8(blk + ws + 4 * q, step, t);
        for (int c = 0; c < 8; ++c) _mm256_storeu_si256(reinterpret_cast<__m256i*>(chunks + 32 * il_chunk(TYPE, q + c)), t[c]);
      }
      if (q + 4 <= words) {
        transpose8x4(blk + ws + 4 * q, step, t);
        for (int c = 0; c < 4; ++c) _mm256_storeu_si256(reinterpret_cast<__m256i*>(chunks + 32 * il_chunk(TYPE, q + c)), t[c]);
        q += 4;
      }
      for (; q < words; ++q) {
        for (int r = 0; r < 8; ++r) std::memcpy(chunks + 32 * il_chunk(TYPE, q) + 4 * r, blk + r * step + ws + 4 * q, 4);
      }
    }
  }
}
#endif

// The interleaved form of blocks (forward) or the blocks back from it, as a new tensor; groups split over threads.
// qk_heads > 0 (forward only): the blocks' rows are as llama.cpp's converter permutes Q/K rows in qk_heads heads,
// and the interleaved form is that of the rows un-permuted (stored_row), with no un-permuted copy made first.
at::Tensor ggml_interleave(const at::Tensor& blocks, int64_t type, int64_t rows, int64_t cols, bool forward,
                           int64_t qk_heads) {
  TORCH_CHECK(type < TYPE_IL && known_type(type), "anyquant::ggml_interleave: block type ", type,
              " is not " AQ_TYPE_NAMES);
  check_part(blocks, type, rows, cols, "ggml_interleave");
  TORCH_CHECK(qk_heads >= 0 && (qk_heads == 0 || (forward && rows % qk_heads == 0 && rows / qk_heads % 16 == 0)),
              "anyquant::ggml_interleave: qk_heads=", qk_heads, " needs the forward direction and heads of a multiple",
              " of 16 rows (", rows, " rows)");
  const int64_t qk_head = qk_heads ? rows / qk_heads : 0;
  const int64_t nb = cols / block_qk(type), bs = block_bytes(type), groups = rows / 8;
  at::Tensor out = at::empty_like(blocks);
  const uint8_t* src = blocks.data_ptr<uint8_t>();
  uint8_t* dst = out.data_ptr<uint8_t>();
  const bool vector = forward && best_isa() != ISA_SCALAR;
  at::parallel_for(0, groups, 16, [&](int64_t g0, int64_t g1) {
#define AQ_EACH_TYPE(CALL)                     \
  switch (type) {                              \
    case TYPE_Q4_0: CALL(TYPE_Q4_0); break;    \
    case TYPE_Q4_1: CALL(TYPE_Q4_1); break;    \
    case TYPE_GQ4: CALL(TYPE_GQ4); break;      \
    case TYPE_Q4_K: CALL(TYPE_Q4_K); break;    \
    case TYPE_Q5_K: CALL(TYPE_Q5_K); break;    \
    case TYPE_Q6_K: CALL(TYPE_Q6_K); break;    \
    case TYPE_IQ4_NL: CALL(TYPE_IQ4_NL); break;\
    case TYPE_IQ4_XS: CALL(TYPE_IQ4_XS); break;\
    case TYPE_MXFP4: CALL(TYPE_MXFP4); break;  \
    case TYPE_Q5_0: CALL(TYPE_Q5_0); break;    \
    case TYPE_Q5_1: CALL(TYPE_Q5_1); break;    \
    default: CALL(TYPE_Q8_0); break;           \
  }
#ifdef AQ_X86
    if (vector) {
#define AQ_IL_AVX2(T) interleave_groups_avx2<T>(src, dst, nb, groups, g0, g1, qk_head)
      AQ_EACH_TYPE(AQ_IL_AVX2)
#undef AQ_IL_AVX2
      return;
    }
#endif
#define AQ_IL(T) interleave_groups<T>(src, dst, nb, groups, g0, g1, forward, qk_head)
    AQ_EACH_TYPE(AQ_IL)
#undef AQ_IL
  });
  const int64_t done = groups * 8 * nb * bs;  // rows past the last whole group: as they are
  std::memcpy(dst + done, src + done, blocks.numel() - done);
  return out;
}

// The exact weight [rows, cols] from its blocks (either form), as the formats' torch code computes it in float32:
// Q4_0 (q - 8) * d, Q4_1 q * d + m, Q8_0 q * d, GQ4 (q - z) * s, Q4_K / Q5_K q * (d * sc) - dmin * m, Q6_K
// (q - 32) * (d * sc), Q5_0 (q - 16) * d, Q5_1 q * d + m, IQ4_NL kv[q] * d, IQ4_XS kv[q] * (d * (ls - 32)), MXFP4 kv[q] * 2^(e-128); then rounded to dtype (float32: as is; float16 or bfloat16 to nearest even, as torch's .to()).
// One pass over the blocks for a prompt's GEMM, where the torch code makes several (and the interleaved form was first
// copied back).
inline void dequantize_block(int64_t base, const uint8_t* blk, float* v) {
  if (is_lut(base)) {  // 32 weights a block (IQ4_XS: 8 sub-blocks of them), Q4_0's nibble order
    const int8_t* kv = lut_values(base);
    const int n = base == TYPE_IQ4_XS ? 8 : 1;
    for (int j = 0; j < n; ++j) {
      const float s = base == TYPE_MXFP4   ? e8m0_half(blk[0])
                      : base == TYPE_IQ4_NL ? half_at(blk)
                                            : half_at(blk) * static_cast<float>(iq4xs_scale(blk, j));
      const uint8_t* qs = blk + (base == TYPE_MXFP4 ? 1 : base == TYPE_IQ4_NL ? 2 : 8 + 16 * j);
      float* vj = v + QK * j;
      for (int i = 0; i < 16; ++i) {
        vj[i] = static_cast<float>(kv[qs[i] & 15]) * s;
        vj[i + 16] = static_cast<float>(kv[qs[i] >> 4]) * s;
      }
    }
    return;
  }
  const float d = half_at(blk + (base == TYPE_Q6_K ? 208 : 0));
  if (is_k(base)) {
    int32_t q[QK];
    for (int j = 0; j < 8; ++j) {
      float* vj = v + QK * j;
      if (base == TYPE_Q6_K) {
        k_codes<TYPE_Q6_K>(blk, j, q);
        const int8_t* sc = reinterpret_cast<const int8_t*>(blk + 192);
        const float s0 = d * static_cast<float>(sc[2 * j]), s1 = d * static_cast<float>(sc[2 * j + 1]);
        for (int l = 0; l < QK; ++l) vj[l] = static_cast<float>(q[l] - 32) * (l < 16 ? s0 : s1);
        continue;
      }
      if (base == TYPE_Q4_K) {
        k_codes<TYPE_Q4_K>(blk, j, q);
      } else {
        k_codes<TYPE_Q5_K>(blk, j, q);
      }
      int sc, m;
      k_scale_min(blk + 4, j, sc, m);
      const float dl = d * static_cast<float>(sc), ml = half_at(blk + 2) * static_cast<float>(m);
      for (int l = 0; l < QK; ++l) vj[l] = static_cast<float>(q[l]) * dl - ml;
    }
    return;
  }
  if (base == TYPE_Q8_0) {
    for (int i = 0; i < QK; ++i) v[i] = static_cast<float>(static_cast<int8_t>(blk[2 + i])) * d;
    return;
  }
  if (is_q5(base)) {
    const uint8_t* qh = blk + (base == TYPE_Q5_0 ? 2 : 4);
    uint32_t h;
    std::memcpy(&h, qh, 4);
    const float m = base == TYPE_Q5_1 ? half_at(blk + 2) : 0.f;
    for (int i = 0; i < 16; ++i) {
      const int lo = (qh[4 + i] & 15) | ((h >> i) & 1) << 4, hi = (qh[4 + i] >> 4) | ((h >> (i + 16)) & 1) << 4;
      if (base == TYPE_Q5_0) {
        v[i] = static_cast<float>(lo - 16) * d;
        v[i + 16] = static_cast<float>(hi - 16) * d;
      } else {
        v[i] = static_cast<float>(lo) * d + m;
        v[i + 16] = static_cast<float>(hi) * d + m;
      }
    }
    return;
  }
  const uint8_t* qs = blk + (base == TYPE_Q4_0 ? 2 : 4);
  if (base == TYPE_Q4_0) {
    for (int i = 0; i < 16; ++i) {
      v[i] = (static_cast<float>(qs[i] & 15) - 8.f) * d;
      v[i + 16] = (static_cast<float>(qs[i] >> 4) - 8.f) * d;
    }
  } else if (base == TYPE_Q4_1) {
    const float m = half_at(blk + 2);
    for (int i = 0; i < 16; ++i) {
      v[i] = static_cast<float>(qs[i] & 15) * d + m;
      v[i + 16] = static_cast<float>(qs[i] >> 4) * d + m;
    }
  } else {  // GQ4
    const float z = half_at(blk + 2);
    for (int i = 0; i < 16; ++i) {
      v[i] = (static_cast<float>(qs[i] & 15) - z) * d;
      v[i + 16] = (static_cast<float>(qs[i] >> 4) - z) * d;
    }
  }
}

// Row r (0..7) of an interleaved piece (8 rows' block b) back in the stored block layout (il_offset's inverse).
inline void deinterleave_row(int64_t base, const uint8_t* piece, int r, uint8_t* raw) {
  const int nh = il_halves(base), hs = il_half_at(base), ws = il_word_at(base), words = il_words(base);
  const int su = il_scale_size(base);
  for (int i = 0; i < nh; ++i) std::memcpy(raw + hs + su * i, piece + 8 * su * i + su * r, su);
  const uint8_t* codes = piece + il_front(base);
  for (int c = 0; c < words; ++c) std::memcpy(raw + ws + 4 * c, codes + 32 * il_chunk(base, c) + 4 * r, 4);
}

template <typename OUT>
void dequantize_rows(const uint8_t* w, int64_t type, int64_t rows, int64_t nb, int64_t r0, int64_t r1, OUT* out) {
  const int64_t base = type % TYPE_IL;
  const int bs = block_bytes(base), qk = block_qk(base);
  const int64_t interleaved_rows = type >= TYPE_IL ? rows / 8 * 8 : 0;  // rows past the last whole group: as stored
  uint8_t raw[block_bytes(TYPE_Q6_K)];
  float v[QKK];
  for (int64_t r = r0; r < r1; ++r) {
    OUT* dst = out + r * nb * qk;
    for (int64_t b = 0; b < nb; ++b) {
      const uint8_t* blk = w + (r * nb + b) * bs;
      if (r < interleaved_rows) {
        deinterleave_row(base, w + il_piece(base, r / 8, b, nb, rows / 8), static_cast<int>(r % 8), raw);
        blk = raw;
      }
      dequantize_block(base, blk, v);
      for (int i = 0; i < qk; ++i) dst[b * qk + i] = static_cast<OUT>(v[i]);
    }
  }
}

at::Tensor ggml_dequantize(const at::Tensor& blocks, int64_t type, int64_t rows, int64_t cols, at::ScalarType dtype) {
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kHalf || dtype == at::kBFloat16,
              "anyquant::ggml_dequantize: dtype float32, float16 or bfloat16, not ", dtype);
  check_part(blocks, type, rows, cols, "ggml_dequantize");
  int64_t outputs = 0;
  TORCH_CHECK(mul_fits(rows, cols, outputs), "anyquant::ggml_dequantize: [", rows, ", ", cols, "] overflows int64");
  at::Tensor out = at::empty({rows, cols}, blocks.options().dtype(dtype));
  const uint8_t* w = blocks.data_ptr<uint8_t>();
  const int64_t nb = cols / block_qk(type);
  at::parallel_for(0, rows, 64, [&](int64_t r0, int64_t r1) {
    if (dtype == at::kFloat) dequantize_rows(w, type, rows, nb, r0, r1, out.data_ptr<float>());
    else if (dtype == at::kHalf) dequantize_rows(w, type, rows, nb, r0, r1, out.data_ptr<c10::Half>());
    else dequantize_rows(w, type, rows, nb, r0, r1, out.data_ptr<c10::BFloat16>());
  });
  return out;
}

// RMSNorm of each row of a float32 x [..., n] (n = weight's length): y = (x * (1 / sqrt(mean(x^2) + eps))) * w,
// the sum of squares in 16 float partial sums. One call where torch's float32 rms_norm is six ops (~11 us on a
// 1,024-wide row, ~1 us here); not bitwise torch's (its reduction order differs): the decode step and the
// modules call it alike (anyquant_runtime.layers.RMSNorm's kernel_rows).
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && weight.scalar_type() == at::kFloat,
              "anyquant::rms_norm: float32 x and weight");
  TORCH_CHECK(x.device().is_cpu() && weight.device().is_cpu(), "anyquant::rms_norm runs on the CPU");
  TORCH_CHECK(weight.dim() == 1, "anyquant::rms_norm: weight is one-dimensional, not ", weight.dim(), "-D");
  TORCH_CHECK(std::isfinite(eps) && eps >= 0.0, "anyquant::rms_norm: eps is a finite number >= 0, not ", eps);
  const int64_t n = weight.numel();
  TORCH_CHECK(x.dim() >= 1 && x.size(-1) == n, "anyquant::rms_norm: x's last dimension is not the weight's ", n);
  const at::Tensor xc = x.contiguous(), wc = weight.contiguous();
  at::Tensor out = at::empty_like(xc);
  const float* px = xc.data_ptr<float>();
  const float* pw = wc.data_ptr<float>();
  float* py = out.data_ptr<float>();
  const int64_t rows = n == 0 ? 0 : xc.numel() / n;
  const float feps = static_cast<float>(eps);
  for (int64_t r = 0; r < rows; ++r) {
    const float* xr = px + r * n;
    float* yr = py + r * n;
    float acc[16] = {0.f};
    int64_t i = 0;
    for (; i + 16 <= n; i += 16)
      for (int j = 0; j < 16; ++j) acc[j] += xr[i + j] * xr[i + j];
    for (; i < n; ++i) acc[0] += xr[i] * xr[i];
    for (int w = 8; w > 0; w /= 2)
      for (int j = 0; j < w; ++j) acc[j] += acc[j + w];
    const float scale = 1.f / std::sqrt(acc[0] / static_cast<float>(n) + feps);
    for (int64_t k = 0; k < n; ++k) yr[k] = (xr[k] * scale) * pw[k];
  }
  return out;
}

int64_t kernel_isa() { return best_isa(); }

// How many threads the op's at::parallel_for runs on (torch's intra-op count where the library was built with
// OpenMP, 1 where it was not).
int64_t kernel_threads() {
  std::atomic<int64_t> seen{0};
  at::parallel_for(0, 1024, 1, [&](int64_t, int64_t) {
    const int64_t bit = int64_t{1} << (at::get_thread_num() & 63);
    seen.fetch_or(bit);
  });
  return __builtin_popcountll(static_cast<unsigned long long>(seen.load()));
}

}  // namespace

TORCH_LIBRARY(anyquant, m) {
  m.def("ggml_gemv(Tensor x, Tensor blocks, int type, int rows, int cols, int isa=-1, int passes=2) -> Tensor");
  m.def("ggml_gemv_cat(Tensor x, Tensor[] blocks, int[] types, int[] rows, int isa=-1, int passes=2) -> Tensor");
  m.def("ggml_experts(Tensor x, Tensor index, Tensor weights, Tensor[] blocks, int[] types, int intermediate, int isa=-1, int passes=2) -> Tensor");
  m.def("ggml_interleave(Tensor blocks, int type, int rows, int cols, bool forward=True, int qk_heads=0) -> Tensor");
  m.def("ggml_dequantize(Tensor blocks, int type, int rows, int cols, ScalarType dtype) -> Tensor");
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
  m.def("kernel_isa() -> int", &kernel_isa);
  m.def("kernel_threads() -> int", &kernel_threads);
}

TORCH_LIBRARY_IMPL(anyquant, CPU, m) {
  m.impl("ggml_gemv", &ggml_gemv);
  m.impl("ggml_gemv_cat", &ggml_gemv_cat);
  m.impl("ggml_experts", &ggml_experts);
  m.impl("ggml_interleave", &ggml_interleave);
  m.impl("ggml_dequantize", &ggml_dequantize);
  m.impl("rms_norm", &rms_norm);
}
