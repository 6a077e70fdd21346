// y[m, n] = sum_k w[n, k] * x[m, k] with w read as raw GGUF blocks (Q4_0, Q4_1, Q8_0) or anyquant's GQ4
// blocks (GPTQ / AWQ group-quantized int4 repacked at load: fp16 scale s, fp16 zero point z, then Q4_1's
// 16 bytes of nibbles; w = s * (q - z), the offset -s * z exact in fp32) and x quantized
// to int8 per block of 32 (scale max|x|/127, as GGUF's Q8_0) inside the op: integer dot products per
// block, then the block scales. Written for anyquant from the GGUF block layout; three paths chosen at
// run time: AVX512-VNNI (256-bit vpdpbusd), AVX2 (vpmaddubsw + vpmaddwd), and scalar.
#include <torch/library.h>
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/Half.h>

#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#define AQ_X86 1
#endif

namespace {

constexpr int QK = 32;
constexpr int64_t TYPE_Q4_0 = 2, TYPE_Q4_1 = 3, TYPE_Q8_0 = 8, TYPE_GQ4 = 100;
constexpr int64_t ISA_SCALAR = 0, ISA_AVX2 = 1, ISA_VNNI = 2;

inline float half_at(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  return c10::detail::fp16_ieee_to_fp32_value(h);
}

int block_bytes(int64_t type) {
  return type == TYPE_Q4_0 ? 18 : (type == TYPE_Q4_1 || type == TYPE_GQ4) ? 20 : 34;
}

// The activations, quantized per row m and block b of 32: codes c with x ~ d * c. One pass (``fine`` off,
// llama.cpp's Q8_0 activations): c = round(x / d), d = max|x| / 127, held as int8 q. Two passes (``fine``):
// c = 256 q + l, with l = round((x - d q) * 256 / d) the int8 code of the first pass's residual (|l| <= 128,
// clamped to 127), and the scale d / 256: about 15 bits per activation for one more integer dot product per
// block. Also per block: d * sum(c), and the 8 partial sums of 4 consecutive c (the lanes the vector dot
// products produce) times the weight type's offset.
struct QX {
  int64_t rows = 0, blocks = 0;
  bool fine = false;
  std::vector<int8_t> q, l;   // [rows, blocks, 32]: the high and (fine) low int8 codes
  std::vector<int32_t> c;     // [rows, blocks, 32]: the codes
  std::vector<float> d;       // [rows, blocks]: the scale of c
  std::vector<float> dsum;    // [rows, blocks]: d * sum(c)
  std::vector<int32_t> part;  // [rows, blocks, 8]: offset * sum of c[4j..4j+3]
  // the same per pair of blocks (b, b+1) in the 512-bit path's order: codes [b 0..15, b+1 0..15, b 16..31,
  // b+1 16..31], and 16 lanes each of partial sums, scales and d * sum(c) / 8 (lanes 0-3, 8-11: b)
  std::vector<int8_t> q2, l2;
  std::vector<int32_t> part2;
  std::vector<float> d2, dsum2;
};

// Cloned for AVX2 where the CPU has it: nearbyint then compiles to one rounding instruction instead of a
// libm call (the baseline x86-64 target has none), the bulk of this function's time. The same IEEE operations
// either way (no contraction: -ffp-contract=off), so the codes do not depend on the clone.
#ifdef AQ_X86
__attribute__((target_clones("avx2", "default")))
#endif
void quantize_x(const float* x, int64_t rows, int64_t cols, int32_t offset, bool fine, QX& out) {
  const int64_t nb = cols / QK;
  out.rows = rows;
  out.blocks = nb;
  out.fine = fine;
  out.q.resize(rows * nb * QK);
  out.l.resize(fine ? rows * nb * QK : 0);
  out.c.resize(rows * nb * QK);
  out.d.resize(rows * nb);
  out.dsum.resize(rows * nb);
  out.part.resize(rows * nb * 8);
  for (int64_t i = 0; i < rows * nb; ++i) {
    const float* src = x + i * QK;  // rows are contiguous and cols % 32 == 0: block i of the flat array
    float amax = 0.f;
    for (int j = 0; j < QK; ++j) amax = std::fmax(amax, std::fabs(src[j]));
    const float d = amax / 127.f;
    const float id = d > 0.f ? 1.f / d : 0.f;
    int8_t* q = out.q.data() + i * QK;
    int32_t* c = out.c.data() + i * QK;
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
        out.l[i * QK + j] = static_cast<int8_t>(lo);
        code = 256 * v + lo;
      }
      c[j] = code;
      sum += code;
    }
    for (int k = 0; k < 8; ++k) {
      out.part[i * 8 + k] = offset * (c[4 * k] + c[4 * k + 1] + c[4 * k + 2] + c[4 * k + 3]);
    }
    const float dc = fine ? d * (1.f / 256.f) : d;
    out.d[i] = dc;
    out.dsum[i] = dc * static_cast<float>(sum);
  }
}

void pair_layout(QX& out) {
  const int64_t pairs = out.blocks / 2;
  out.q2.resize(out.rows * pairs * 64);
  out.l2.resize(out.fine ? out.rows * pairs * 64 : 0);
  out.part2.resize(out.rows * pairs * 16);
  out.d2.resize(out.rows * pairs * 16);
  out.dsum2.resize(out.rows * pairs * 16);
  for (int64_t m = 0; m < out.rows; ++m) {
    for (int64_t p = 0; p < pairs; ++p) {
      const int64_t o = m * pairs + p;
      for (int h = 0; h < 2; ++h) {      // which half of each block: elements 0..15 or 16..31
        for (int s = 0; s < 2; ++s) {    // block b or b+1
          const int64_t i = m * out.blocks + 2 * p + s;
          const int quarter = 2 * h + s;  // 16-byte quarter of the 512-bit vector
          std::memcpy(out.q2.data() + o * 64 + quarter * 16, out.q.data() + i * QK + h * 16, 16);
          if (out.fine) std::memcpy(out.l2.data() + o * 64 + quarter * 16, out.l.data() + i * QK + h * 16, 16);
          for (int l = 0; l < 4; ++l) {
            out.part2[o * 16 + quarter * 4 + l] = out.part[i * 8 + h * 4 + l];
            out.d2[o * 16 + quarter * 4 + l] = out.d[i];
            out.dsum2[o * 16 + quarter * 4 + l] = out.dsum[i] * 0.125f;  // 8 lanes per block
          }
        }
      }
    }
  }
}

// ---------------------------------------------------------------------------------------------- scalar
// one weight block times activation block i, from the codes c
template <int64_t TYPE>
inline float block_dot(const uint8_t* blk, const QX& qx, int64_t i) {
  const int32_t* c = qx.c.data() + i * QK;
  const float dw = half_at(blk);
  int32_t dot = 0;
  if (TYPE == TYPE_Q8_0) {
    const int8_t* wq = reinterpret_cast<const int8_t*>(blk + 2);
    for (int j = 0; j < QK; ++j) dot += wq[j] * c[j];
    return dw * (qx.d[i] * static_cast<float>(dot));
  }
  const uint8_t* qs = blk + (TYPE == TYPE_Q4_0 ? 2 : 4);
  int32_t sum = 0;
  for (int j = 0; j < 16; ++j) {
    dot += (qs[j] & 15) * c[j] + (qs[j] >> 4) * c[j + 16];
    sum += c[j] + c[j + 16];
  }
  if (TYPE == TYPE_Q4_0) return dw * (qx.d[i] * static_cast<float>(dot - 8 * sum));
  const float mw = TYPE == TYPE_GQ4 ? -(dw * half_at(blk + 2)) : half_at(blk + 2);
  return dw * (qx.d[i] * static_cast<float>(dot)) + mw * qx.dsum[i];
}

template <int64_t TYPE>
void rows_scalar(const uint8_t* w, const QX& qx, float* y, int64_t n_rows, int64_t n0, int64_t n1) {
  const int64_t nb = qx.blocks;
  const int bs = block_bytes(TYPE);
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* row = w + n * nb * bs;
    for (int64_t m = 0; m < qx.rows; ++m) {
      float acc = 0.f;
      for (int64_t b = 0; b < nb; ++b) {
        acc += block_dot<TYPE>(row + b * bs, qx, m * nb + b);
      }
      y[m * n_rows + n] = acc;
    }
  }
}

#ifdef AQ_X86
// ------------------------------------------------------------------------------------ AVX2 and VNNI
// One block per step in 256 bits: the weight's 32 codes as unsigned bytes (Q4: low nibbles are
// elements 0..15, high nibbles 16..31; Q8_0 with VNNI: code + 128, the offset taken back through
// `part`), dotted with the activation's signed bytes into 8 int32 lanes.

#define AQ_TARGET_AVX2 __attribute__((target("avx2,fma,f16c")))
#define AQ_TARGET_VNNI __attribute__((target("avx2,fma,f16c,avx512f,avx512vl,avx512bw,avx512vnni")))

AQ_TARGET_AVX2 inline float hsum8(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// the body, shared by both targets through a macro (target attributes do not propagate to lambdas)
#define AQ_ROWS_BODY(DOT)                                                                                \
  const int64_t nb = qx.blocks;                                                                          \
  constexpr int bs = TYPE == TYPE_Q4_0 ? 18 : TYPE == TYPE_Q8_0 ? 34 : 20;                               \
  const __m256i lowmask = _mm256_set1_epi8(15);                                                          \
  const bool fine = qx.fine;                                                                             \
  for (int64_t n = n0; n < n1; ++n) {                                                                    \
    const uint8_t* row = w + n * nb * bs;                                                                \
    __m256 acc[M];                                                                                       \
    float off[M];                                                                                        \
    for (int m = 0; m < M; ++m) {                                                                        \
      acc[m] = _mm256_setzero_ps();                                                                      \
      off[m] = 0.f;                                                                                      \
    }                                                                                                    \
    for (int64_t b = 0; b < nb; ++b) {                                                                   \
      const uint8_t* blk = row + b * bs;                                                                 \
      const float dw = _cvtsh_ss(*reinterpret_cast<const uint16_t*>(blk));                               \
      __m256i wq;                                                                                        \
      if (TYPE == TYPE_Q8_0) {                                                                           \
        wq = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 2));                              \
      } else {                                                                                           \
        const __m128i t = _mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + (TYPE == TYPE_Q4_0 ? 2 : 4))); \
        wq = _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(t, 4), t), lowmask);                       \
      }                                                                                                  \
      const float mw = TYPE == TYPE_Q4_1   ? _cvtsh_ss(*reinterpret_cast<const uint16_t*>(blk + 2))        \
                       : TYPE == TYPE_GQ4 ? -(dw * _cvtsh_ss(*reinterpret_cast<const uint16_t*>(blk + 2))) \
                                          : 0.f;                                                         \
      for (int m = 0; m < M; ++m) {                                                                      \
        const int64_t i = (m0 + m) * nb + b;                                                             \
        __m256i xq = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qx.q.data() + i * QK));         \
        __m256i dot = DOT;                                                                               \
        if (fine) {                                                                                      \
          xq = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qx.l.data() + i * QK));               \
          dot = _mm256_add_epi32(_mm256_slli_epi32(dot, 8), DOT);                                        \
        }                                                                                                \
        if (TYPE == TYPE_Q4_0 || (TYPE == TYPE_Q8_0 && VNNI)) {                                          \
          dot = _mm256_sub_epi32(dot, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qx.part.data() + i * 8))); \
        }                                                                                                \
        acc[m] = _mm256_fmadd_ps(_mm256_set1_ps(dw * qx.d[i]), _mm256_cvtepi32_ps(dot), acc[m]);          \
        if (TYPE != TYPE_Q4_0 && TYPE != TYPE_Q8_0) off[m] += mw * qx.dsum[i];                           \
      }                                                                                                  \
    }                                                                                                    \
    for (int m = 0; m < M; ++m) y[(m0 + m) * n_rows + n] = hsum8(acc[m]) + off[m];                       \
  }

template <int64_t TYPE, int M>
AQ_TARGET_AVX2 void rows_avx2(const uint8_t* w, const QX& qx, int64_t m0, float* y, int64_t n_rows, int64_t n0,
                              int64_t n1) {
  constexpr bool VNNI = false;
  const __m256i ones = _mm256_set1_epi16(1);
  // Q8_0: |w| times x with w's sign (vpmaddubsw takes unsigned x signed bytes; pairs stay in int16)
#define AQ_DOT_AVX2                                                                                      \
  (TYPE == TYPE_Q8_0                                                                                     \
       ? _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_sign_epi8(wq, wq), _mm256_sign_epi8(xq, wq)), ones) \
       : _mm256_madd_epi16(_mm256_maddubs_epi16(wq, xq), ones))
  AQ_ROWS_BODY(AQ_DOT_AVX2)
#undef AQ_DOT_AVX2
}

template <int64_t TYPE, int M>
AQ_TARGET_VNNI void rows_vnni(const uint8_t* w, const QX& qx, int64_t m0, float* y, int64_t n_rows, int64_t n0,
                              int64_t n1) {
  constexpr bool VNNI = true;
  const __m256i flip = _mm256_set1_epi8(static_cast<char>(0x80));
#define AQ_DOT_VNNI                                                                            \
  (TYPE == TYPE_Q8_0 ? _mm256_dpbusd_epi32(_mm256_setzero_si256(), _mm256_xor_si256(wq, flip), xq) \
                     : _mm256_dpbusd_epi32(_mm256_setzero_si256(), wq, xq))
  AQ_ROWS_BODY(AQ_DOT_VNNI)
#undef AQ_DOT_VNNI
}

#define AQ_TARGET_VNNI512 __attribute__((target("avx2,fma,f16c,avx512f,avx512vl,avx512bw,avx512dq,avx512vnni")))

AQ_TARGET_VNNI512 inline float hsum16(__m512 v) { return _mm512_reduce_add_ps(v); }

// Q4_0 / Q4_1 / GQ4, two blocks per step in 512 bits (x in QX's pair layout), an odd last block in 256 bits.
template <int64_t TYPE, int M>
AQ_TARGET_VNNI512 void rows_vnni512(const uint8_t* w, const QX& qx, int64_t m0, float* y, int64_t n_rows,
                                    int64_t n0, int64_t n1) {
  const int64_t nb = qx.blocks, pairs = nb / 2;
  constexpr int bs = TYPE == TYPE_Q4_0 ? 18 : 20;
  constexpr int qoff = TYPE == TYPE_Q4_0 ? 2 : 4;
  constexpr bool has_min = TYPE != TYPE_Q4_0;  // Q4_1's m, or GQ4's -d z
  const __m512i lowmask = _mm512_set1_epi8(15);
  const bool fine = qx.fine;
  // scale lanes: block b's d in lanes 0-3 and 8-11, b+1's in 4-7 and 12-15 (Q4_1: its m as well, GQ4: z)
  const __m512i idx_d = TYPE == TYPE_Q4_0 ? _mm512_set_epi32(1, 1, 1, 1, 0, 0, 0, 0, 1, 1, 1, 1, 0, 0, 0, 0)
                                          : _mm512_set_epi32(2, 2, 2, 2, 0, 0, 0, 0, 2, 2, 2, 2, 0, 0, 0, 0);
  const __m512i idx_m = _mm512_set_epi32(3, 3, 3, 3, 1, 1, 1, 1, 3, 3, 3, 3, 1, 1, 1, 1);
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* row = w + n * nb * bs;
    __m512 acc[M];
    for (int m = 0; m < M; ++m) acc[m] = _mm512_setzero_ps();
    for (int64_t p = 0; p < pairs; ++p) {
      const uint8_t* b0 = row + 2 * p * bs;
      const uint8_t* b1 = b0 + bs;
      const __m256i t = _mm256_set_m128i(_mm_loadu_si128(reinterpret_cast<const __m128i*>(b1 + qoff)),
                                         _mm_loadu_si128(reinterpret_cast<const __m128i*>(b0 + qoff)));
      const __m512i wq = _mm512_and_si512(
          _mm512_inserti64x4(_mm512_castsi256_si512(t), _mm256_srli_epi16(t, 4), 1), lowmask);
      __m128i h;
      if (TYPE == TYPE_Q4_0) {
        uint16_t d0, d1;
        std::memcpy(&d0, b0, 2);
        std::memcpy(&d1, b1, 2);
        h = _mm_cvtsi32_si128(static_cast<int>(d0 | (static_cast<uint32_t>(d1) << 16)));
      } else {
        uint32_t dm0, dm1;
        std::memcpy(&dm0, b0, 4);
        std::memcpy(&dm1, b1, 4);
        h = _mm_cvtsi64_si128(static_cast<long long>(dm0 | (static_cast<uint64_t>(dm1) << 32)));
      }
      const __m512 hw = _mm512_castps128_ps512(_mm_cvtph_ps(h));
      const __m512 dw = _mm512_permutexvar_ps(idx_d, hw);
      // the offset per block: Q4_1's m; GQ4's -(d z), exact in fp32 (11 by at most 11 significant bits)
      const __m512 mw = TYPE == TYPE_GQ4 ? _mm512_sub_ps(_mm512_setzero_ps(),
                                                         _mm512_mul_ps(dw, _mm512_permutexvar_ps(idx_m, hw)))
                                         : _mm512_permutexvar_ps(idx_m, hw);
      for (int m = 0; m < M; ++m) {
        const int64_t o = (m0 + m) * pairs + p;
        __m512i dot = _mm512_dpbusd_epi32(_mm512_setzero_si512(), wq, _mm512_loadu_si512(qx.q2.data() + o * 64));
        if (fine) {
          dot = _mm512_add_epi32(_mm512_slli_epi32(dot, 8),
                                 _mm512_dpbusd_epi32(_mm512_setzero_si512(), wq, _mm512_loadu_si512(qx.l2.data() + o * 64)));
        }
        if (TYPE == TYPE_Q4_0) dot = _mm512_sub_epi32(dot, _mm512_loadu_si512(qx.part2.data() + o * 16));
        acc[m] = _mm512_fmadd_ps(_mm512_mul_ps(dw, _mm512_loadu_ps(qx.d2.data() + o * 16)),
                                 _mm512_cvtepi32_ps(dot), acc[m]);
        if (has_min) acc[m] = _mm512_fmadd_ps(mw, _mm512_loadu_ps(qx.dsum2.data() + o * 16), acc[m]);
      }
    }
    float tail[M] = {};
    if (nb % 2) {
      for (int m = 0; m < M; ++m) tail[m] = block_dot<TYPE>(row + (nb - 1) * bs, qx, (m0 + m) * nb + nb - 1);
    }
    for (int m = 0; m < M; ++m) y[(m0 + m) * n_rows + n] = hsum16(acc[m]) + tail[m];
  }
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

template <int64_t TYPE>
void run_rows(int64_t isa, const uint8_t* w, const QX& qx, float* y, int64_t n_rows, int64_t n0, int64_t n1) {
#ifdef AQ_X86
  if (isa != ISA_SCALAR) {
    for (int64_t m0 = 0; m0 < qx.rows;) {
      const int64_t left = qx.rows - m0;
      const int step = left >= 4 ? 4 : static_cast<int>(left);
#define AQ_CALL(FN) \
  switch (step) {   \
    case 4: FN<TYPE, 4>(w, qx, m0, y, n_rows, n0, n1); break; \
    case 3: FN<TYPE, 3>(w, qx, m0, y, n_rows, n0, n1); break; \
    case 2: FN<TYPE, 2>(w, qx, m0, y, n_rows, n0, n1); break; \
    default: FN<TYPE, 1>(w, qx, m0, y, n_rows, n0, n1); break; \
  }
      if (isa == ISA_VNNI && TYPE != TYPE_Q8_0) {
        AQ_CALL(rows_vnni512)
      } else if (isa == ISA_VNNI) {
        AQ_CALL(rows_vnni)
      } else {
        AQ_CALL(rows_avx2)
      }
#undef AQ_CALL
      m0 += step;
    }
    return;
  }
#endif
  rows_scalar<TYPE>(w, qx, y, n_rows, n0, n1);
}

at::Tensor ggml_gemv(const at::Tensor& x, const at::Tensor& blocks, int64_t type, int64_t rows, int64_t cols,
                     int64_t isa, int64_t passes) {
  TORCH_CHECK(passes == 1 || passes == 2, "anyquant::ggml_gemv: passes is 1 or 2, not ", passes);
  TORCH_CHECK(type == TYPE_Q4_0 || type == TYPE_Q4_1 || type == TYPE_Q8_0 || type == TYPE_GQ4,
              "anyquant::ggml_gemv: block type ", type, " is not Q4_0 (2), Q4_1 (3), Q8_0 (8) or GQ4 (100)");
  TORCH_CHECK(cols % QK == 0 && cols > 0 && rows > 0, "anyquant::ggml_gemv: cols ", cols,
              " is not a positive multiple of 32 (rows ", rows, ")");
  TORCH_CHECK(x.device().is_cpu() && blocks.device().is_cpu(), "anyquant::ggml_gemv runs on the CPU");
  TORCH_CHECK(x.size(-1) == cols, "anyquant::ggml_gemv: x has ", x.size(-1), " columns, not ", cols);
  TORCH_CHECK(blocks.scalar_type() == at::kByte && blocks.is_contiguous(),
              "anyquant::ggml_gemv: blocks must be a contiguous uint8 tensor");
  TORCH_CHECK(blocks.numel() == rows * (cols / QK) * block_bytes(type), "anyquant::ggml_gemv: blocks hold ",
              blocks.numel(), " bytes, not ", rows * (cols / QK) * block_bytes(type));
  const int64_t best = best_isa();
  if (isa < 0 || isa > best) isa = best;
  const auto out_shape = [&] {
    auto s = x.sizes().vec();
    s.back() = rows;
    return s;
  }();
  const at::Tensor xf = x.reshape({-1, cols}).to(at::kFloat).contiguous();
  const int64_t m = xf.size(0);
  const int32_t offset = type == TYPE_Q4_0 ? 8 : (type == TYPE_Q8_0 && isa == ISA_VNNI) ? 128 : 0;
  // one per calling thread, kept between calls: its vectors keep their capacity (a decode step's calls
  // would otherwise allocate and zero a dozen buffers each)
  // (the workers below read it through a pointer: naming a thread_local inside the lambda would give each
  // worker thread its own, empty, instance)
  thread_local QX mine;
  QX* const qp = &mine;
  quantize_x(xf.data_ptr<float>(), m, cols, offset, passes == 2, *qp);
  if (isa == ISA_VNNI && type != TYPE_Q8_0) pair_layout(*qp);
  at::Tensor y = at::empty({m, rows}, xf.options());
  float* yp = y.data_ptr<float>();
  const uint8_t* wp = blocks.data_ptr<uint8_t>();
  at::parallel_for(0, rows, 16, [&](int64_t n0, int64_t n1) {
    const QX& qx = *qp;
    if (type == TYPE_Q4_0) run_rows<TYPE_Q4_0>(isa, wp, qx, yp, rows, n0, n1);
    else if (type == TYPE_Q4_1) run_rows<TYPE_Q4_1>(isa, wp, qx, yp, rows, n0, n1);
    else if (type == TYPE_GQ4) run_rows<TYPE_GQ4>(isa, wp, qx, yp, rows, n0, n1);
    else run_rows<TYPE_Q8_0>(isa, wp, qx, yp, rows, n0, n1);
  });
  return y.to(x.scalar_type()).reshape(out_shape);
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
  m.def("kernel_isa() -> int", &kernel_isa);
  m.def("kernel_threads() -> int", &kernel_threads);
}

TORCH_LIBRARY_IMPL(anyquant, CPU, m) { m.impl("ggml_gemv", &ggml_gemv); }
