// anyquant::decode_attention: attention of one new query position per row over that row's own KV cache, every row
// of a decode step in one call (a server's requests each with a cache of its own length: no padding, no mask).
//
// q [R, H, D] and this step's keys and values k [R, KVH, D], v [R, KVH, Dv] (float32, after the rotary embedding);
// keys[i] / values[i] a cache's buffers [b_i, KVH, room_i, D / Dv] (float32, float16 or bfloat16; the last dimension
// contiguous, any other strides: a view from a window's first position is fine), whose b_i rows are the next b_i
// rows of q (sum b_i = R); starts[i] the position the new key and value go to in buffer i (every row of it). The op
// writes them there (rounded to the buffer's dtype as torch's .to() rounds) and attends over the buffer's positions
// first .. starts[i] - 1 (read back from the buffer) and the new one (this step's own, unrounded: what
// NativeCache.update gives attention), first = max(0, start - window + 1) with a window (0: none). Query head h reads
// key head h / (H / KVH) (grouped-query attention). Per head: scores s_j = scaling * (q . k_j) in float32, the
// softmax with its maximum taken off, out = sum_j p_j v_j / sum_j p_j. A row's numbers depend on that row alone:
// the server's batched step and a lone request's step compute each row the same (how greedy answers stay the
// same whatever else shares the step).
//
// Vector path: AVX2 + FMA (8 floats; exp by a degree-5 polynomial on the reduced argument, as Cephes' expf); scalar
// elsewhere (std::exp: the portable build, hosts without AVX2, head sizes not multiples of 8, and isa=0). Not bitwise
// torch's scaled_dot_product_attention (its blocked flash kernel sums in another order): the compiled decode step and
// the modules call this alike.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#if (defined(__x86_64__) || defined(_M_X64)) && !defined(ANYQUANT_PORTABLE)
#include <immintrin.h>
#define AQ_ATTN_X86 1
#endif

namespace {

// one cache's rows: where its buffers are and how far apart its rows, heads and positions lie (elements)
struct Buffers {
  void* k;
  void* v;
  at::ScalarType dtype;
  int64_t kb, kh, kp, vb, vh, vp;  // strides: row (batch), head, position
  int64_t start, first;
};

template <typename T>
inline float as_float(const T* p, int64_t i) {
  return static_cast<float>(p[i]);
}

template <typename T>
inline void store_as(T* p, int64_t i, float x) {
  p[i] = static_cast<T>(x);  // c10::Half / c10::BFloat16: round to nearest even, as torch's .to()
}

// ------------------------------------------------------------------------------------------------- scalar
template <typename T>
void head_scalar(const float* q, const float* knew, const float* vnew, const T* kc, const T* vc, int64_t kp,
                 int64_t vp, int64_t first, int64_t start, int64_t D, int64_t Dv, float scaling, float* scores,
                 float* out) {
  const int64_t n = start - first;
  float top = -INFINITY;
  for (int64_t j = 0; j <= n; ++j) {
    float s = 0.f;
    if (j < n) {
      const T* kr = kc + (first + j) * kp;
      for (int64_t d = 0; d < D; ++d) s += q[d] * as_float(kr, d);
    } else {
      for (int64_t d = 0; d < D; ++d) s += q[d] * knew[d];
    }
    s *= scaling;
    scores[j] = s;
    top = std::max(top, s);
  }
  float total = 0.f;
  for (int64_t d = 0; d < Dv; ++d) out[d] = 0.f;
  for (int64_t j = 0; j <= n; ++j) {
    const float p = std::exp(scores[j] - top);
    total += p;
    if (j < n) {
      const T* vr = vc + (first + j) * vp;
      for (int64_t d = 0; d < Dv; ++d) out[d] += p * as_float(vr, d);
    } else {
      for (int64_t d = 0; d < Dv; ++d) out[d] += p * vnew[d];
    }
  }
  const float inv = 1.f / total;
  for (int64_t d = 0; d < Dv; ++d) out[d] *= inv;
}

#ifdef AQ_ATTN_X86
// ------------------------------------------------------------------------------------------------- AVX2
#define AQ_AVX2 __attribute__((target("avx2,fma,f16c")))

template <typename T>
AQ_AVX2 inline __m256 load8(const T* p);
template <>
AQ_AVX2 inline __m256 load8<float>(const float* p) {
  return _mm256_loadu_ps(p);
}
template <>
AQ_AVX2 inline __m256 load8<c10::Half>(const c10::Half* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}
template <>
AQ_AVX2 inline __m256 load8<c10::BFloat16>(const c10::BFloat16* p) {
  const __m256i w = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm256_castsi256_ps(_mm256_slli_epi32(w, 16));
}

AQ_AVX2 inline float hsum8(__m256 v) {
  const __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 t = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(t, _mm_movehdup_ps(t)));
}

// e^x for x <= 0 (a score less the maximum): x = n ln2 + r, e^r by Cephes' expf polynomial, 2^n from the exponent
// bits; below -87 (e^x < 2^-125) it is 0
AQ_AVX2 inline __m256 exp8(__m256 x) {
  const __m256 tiny = _mm256_cmp_ps(x, _mm256_set1_ps(-87.f), _CMP_LT_OQ);
  x = _mm256_max_ps(x, _mm256_set1_ps(-87.f));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 y = _mm256_set1_ps(1.9875691500e-4f);
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(1.3981999507e-3f));
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(8.3334519073e-3f));
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(4.1665795894e-2f));
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(1.6666665459e-1f));
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(5.0000001201e-1f));
  y = _mm256_fmadd_ps(y, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.f)));
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_andnot_ps(tiny, _mm256_mul_ps(y, _mm256_castsi256_ps(e)));
}

// q . k over D (a multiple of 8) in two chains of 8 lanes
template <typename T>
AQ_AVX2 inline __m256 dot_lanes(const float* q, const T* k, int64_t D) {
  __m256 a = _mm256_setzero_ps(), b = _mm256_setzero_ps();
  int64_t d = 0;
  for (; d + 16 <= D; d += 16) {
    a = _mm256_fmadd_ps(_mm256_loadu_ps(q + d), load8(k + d), a);
    b = _mm256_fmadd_ps(_mm256_loadu_ps(q + d + 8), load8(k + d + 8), b);
  }
  if (d < D) a = _mm256_fmadd_ps(_mm256_loadu_ps(q + d), load8(k + d), a);
  return _mm256_add_ps(a, b);
}

// the lane sums of 8 vectors as one vector (lane i: the sum of a[i]'s lanes), three rounds of pairwise adds
AQ_AVX2 inline __m256 sums8(const __m256* a) {
  const __m256 h0 = _mm256_hadd_ps(a[0], a[1]), h1 = _mm256_hadd_ps(a[2], a[3]);
  const __m256 h2 = _mm256_hadd_ps(a[4], a[5]), h3 = _mm256_hadd_ps(a[6], a[7]);
  const __m256 g0 = _mm256_hadd_ps(h0, h1), g1 = _mm256_hadd_ps(h2, h3);
  // g0's 128-bit halves: vectors 0-3's low and high lane sums; g1's the same for 4-7
  return _mm256_add_ps(_mm256_permute2f128_ps(g0, g1, 0x20), _mm256_permute2f128_ps(g0, g1, 0x31));
}

// out[c .. c + 8 W) = sum_j p_j v_j[c .. c + 8 W) over n rows of v (and the new row), W vectors held in registers
template <typename T, int W>
AQ_AVX2 inline void weighted_rows(float* out, const float* p, const T* v, int64_t vp, int64_t n, const float* vnew,
                                  int64_t c) {
  __m256 acc[W];
  for (int w = 0; w < W; ++w) acc[w] = _mm256_setzero_ps();
  for (int64_t j = 0; j < n; ++j) {
    const __m256 pj = _mm256_set1_ps(p[j]);
    const T* row = v + j * vp + c;
    for (int w = 0; w < W; ++w) acc[w] = _mm256_fmadd_ps(pj, load8(row + 8 * w), acc[w]);
  }
  const __m256 pn = _mm256_set1_ps(p[n]);
  for (int w = 0; w < W; ++w) acc[w] = _mm256_fmadd_ps(pn, _mm256_loadu_ps(vnew + c + 8 * w), acc[w]);
  for (int w = 0; w < W; ++w) _mm256_storeu_ps(out + c + 8 * w, acc[w]);
}

template <typename T>
AQ_AVX2 void head_avx2(const float* q, const float* knew, const float* vnew, const T* kc, const T* vc, int64_t kp,
                       int64_t vp, int64_t first, int64_t start, int64_t D, int64_t Dv, float scaling, float* scores,
                       float* out) {
  const int64_t n = start - first;
  const T* k0 = kc + first * kp;
  const __m256 sc = _mm256_set1_ps(scaling);
  // the scores, 8 positions at a time (their dot products' lanes summed together), then the rest one by one
  int64_t j = 0;
  __m256 top8 = _mm256_set1_ps(-INFINITY);
  for (; j + 8 <= n; j += 8) {
    __m256 a[8];
    for (int i = 0; i < 8; ++i) a[i] = dot_lanes(q, k0 + (j + i) * kp, D);
    const __m256 s8 = _mm256_mul_ps(sums8(a), sc);
    _mm256_storeu_ps(scores + j, s8);
    top8 = _mm256_max_ps(top8, s8);
  }
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, top8);
  float top = lanes[0];
  for (int i = 1; i < 8; ++i) top = std::max(top, lanes[i]);
  for (; j < n; ++j) {
    scores[j] = hsum8(dot_lanes(q, k0 + j * kp, D)) * scaling;
    top = std::max(top, scores[j]);
  }
  scores[n] = hsum8(dot_lanes(q, knew, D)) * scaling;
  top = std::max(top, scores[n]);
  // the weights p_j = e^(s_j - top), 8 at a time, and their sum in 8 lanes
  const __m256 t8 = _mm256_set1_ps(top);
  __m256 sum = _mm256_setzero_ps();
  j = 0;
  for (; j + 8 <= n + 1; j += 8) {
    const __m256 p = exp8(_mm256_sub_ps(_mm256_loadu_ps(scores + j), t8));
    _mm256_storeu_ps(scores + j, p);
    sum = _mm256_add_ps(sum, p);
  }
  if (j <= n) {
    alignas(32) float tail[8];
    const int64_t left = n + 1 - j;
    for (int64_t i = 0; i < 8; ++i) tail[i] = i < left ? scores[j + i] - top : -INFINITY;
    const __m256 p = exp8(_mm256_load_ps(tail));
    _mm256_store_ps(tail, p);
    for (int64_t i = 0; i < left; ++i) scores[j + i] = tail[i];
    sum = _mm256_add_ps(sum, p);
  }
  const float total = hsum8(sum);
  // the values' weighted sum, 64 features at a time held in registers (then 32, 16, 8)
  const T* v0 = vc + first * vp;
  int64_t c = 0;
  for (; c + 64 <= Dv; c += 64) weighted_rows<T, 8>(out, scores, v0, vp, n, vnew, c);
  if (c + 32 <= Dv) {
    weighted_rows<T, 4>(out, scores, v0, vp, n, vnew, c);
    c += 32;
  }
  if (c + 16 <= Dv) {
    weighted_rows<T, 2>(out, scores, v0, vp, n, vnew, c);
    c += 16;
  }
  if (c + 8 <= Dv) weighted_rows<T, 1>(out, scores, v0, vp, n, vnew, c);
  const __m256 inv = _mm256_set1_ps(1.f / total);
  for (int64_t d = 0; d < Dv; d += 8) _mm256_storeu_ps(out + d, _mm256_mul_ps(_mm256_loadu_ps(out + d), inv));
}

bool has_avx2() { return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c"); }
#endif

template <typename T>
void run_head(bool vector, const float* q, const float* knew, const float* vnew, const Buffers& b, int64_t row,
              int64_t kvh, int64_t D, int64_t Dv, float scaling, float* scores, float* out) {
  const T* kc = static_cast<const T*>(b.k) + row * b.kb + kvh * b.kh;
  const T* vc = static_cast<const T*>(b.v) + row * b.vb + kvh * b.vh;
#ifdef AQ_ATTN_X86
  if (vector) {
    head_avx2<T>(q, knew, vnew, kc, vc, b.kp, b.vp, b.first, b.start, D, Dv, scaling, scores, out);
    return;
  }
#endif
  (void)vector;
  head_scalar<T>(q, knew, vnew, kc, vc, b.kp, b.vp, b.first, b.start, D, Dv, scaling, scores, out);
}

template <typename T>
void write_new(const Buffers& b, int64_t row, int64_t kvh, const float* knew, const float* vnew, int64_t D, int64_t Dv) {
  T* kc = static_cast<T*>(b.k) + row * b.kb + kvh * b.kh + b.start * b.kp;
  T* vc = static_cast<T*>(b.v) + row * b.vb + kvh * b.vh + b.start * b.vp;
  for (int64_t d = 0; d < D; ++d) store_as(kc, d, knew[d]);
  for (int64_t d = 0; d < Dv; ++d) store_as(vc, d, vnew[d]);
}

at::Tensor decode_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, at::TensorList keys,
                            at::TensorList values, at::IntArrayRef starts, int64_t window, double scaling,
                            int64_t isa) {
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && v.dim() == 3, "anyquant::decode_attention: q [rows, heads, head_dim], "
              "k and v [rows, kv_heads, head_dim]");
  TORCH_CHECK(q.scalar_type() == at::kFloat && k.scalar_type() == at::kFloat && v.scalar_type() == at::kFloat,
              "anyquant::decode_attention: float32 q, k and v");
  TORCH_CHECK(q.device().is_cpu() && k.device().is_cpu() && v.device().is_cpu(), "anyquant::decode_attention runs on the CPU");
  const int64_t R = q.size(0), H = q.size(1), D = q.size(2), KVH = k.size(1), Dv = v.size(2);
  TORCH_CHECK(k.size(0) == R && v.size(0) == R && v.size(1) == KVH && k.size(2) == D,
              "anyquant::decode_attention: k [", R, ", kv_heads, ", D, "] and v [", R, ", kv_heads, dv]");
  TORCH_CHECK(KVH > 0 && H % KVH == 0, "anyquant::decode_attention: heads ", H, " not a multiple of kv_heads ", KVH);
  TORCH_CHECK(D > 0 && Dv > 0, "anyquant::decode_attention: head sizes of at least 1");
  TORCH_CHECK(keys.size() == values.size() && keys.size() == starts.size(),
              "anyquant::decode_attention: one start per cache buffer");
  TORCH_CHECK(window >= 0 && std::isfinite(scaling), "anyquant::decode_attention: window >= 0, finite scaling");
  TORCH_CHECK(isa >= -1 && isa <= 1, "anyquant::decode_attention: isa -1 (the best here), 0 (scalar) or 1 (AVX2)");
  std::vector<Buffers> caches;
  std::vector<int64_t> row_cache, row_in;  // each row of q: its buffer and its row there
  for (size_t i = 0; i < keys.size(); ++i) {
    const at::Tensor& kb = keys[i];
    const at::Tensor& vb = values[i];
    TORCH_CHECK(kb.dim() == 4 && vb.dim() == 4 && kb.size(0) == vb.size(0) && kb.size(1) == KVH && vb.size(1) == KVH &&
                    kb.size(3) == D && vb.size(3) == Dv && kb.size(2) == vb.size(2),
                "anyquant::decode_attention: buffer ", i, " is not [rows, ", KVH, ", room, ", D, "] / [.., ", Dv, "]");
    TORCH_CHECK(kb.scalar_type() == vb.scalar_type() &&
                    (kb.scalar_type() == at::kFloat || kb.scalar_type() == at::kHalf || kb.scalar_type() == at::kBFloat16),
                "anyquant::decode_attention: buffers of float32, float16 or bfloat16, keys and values alike");
    TORCH_CHECK(kb.device().is_cpu() && vb.device().is_cpu(), "anyquant::decode_attention runs on the CPU");
    TORCH_CHECK(kb.stride(3) == 1 && vb.stride(3) == 1, "anyquant::decode_attention: a buffer's last dimension contiguous");
    const int64_t start = starts[i];
    TORCH_CHECK(start >= 0 && start < kb.size(2), "anyquant::decode_attention: start ", start, " outside buffer ", i,
                "'s ", kb.size(2), " positions");
    const int64_t first = window > 0 ? std::max<int64_t>(0, start - window + 1) : 0;
    caches.push_back({kb.data_ptr(), vb.data_ptr(), kb.scalar_type(), kb.stride(0), kb.stride(1), kb.stride(2),
                      vb.stride(0), vb.stride(1), vb.stride(2), start, first});
    for (int64_t r = 0; r < kb.size(0); ++r) {
      row_cache.push_back(static_cast<int64_t>(i));
      row_in.push_back(r);
    }
  }
  TORCH_CHECK(static_cast<int64_t>(row_cache.size()) == R, "anyquant::decode_attention: the buffers hold ",
              row_cache.size(), " rows, q has ", R);
  const at::Tensor qc = q.contiguous(), kc = k.contiguous(), vc = v.contiguous();
  at::Tensor out = at::empty({R, H, Dv}, q.options());
  const float* pq = qc.data_ptr<float>();
  const float* pk = kc.data_ptr<float>();
  const float* pv = vc.data_ptr<float>();
  float* po = out.data_ptr<float>();
  const int64_t groups = H / KVH;
  const float fscale = static_cast<float>(scaling);
  bool vector = false;
#ifdef AQ_ATTN_X86
  vector = isa != 0 && has_avx2() && D % 8 == 0 && Dv % 8 == 0;
#endif
  TORCH_CHECK(isa != 1 || vector, "anyquant::decode_attention: the AVX2 path does not run here (or head sizes not multiples of 8)");
  // the new keys and values into the buffers (what later steps read back)
  for (int64_t r = 0; r < R; ++r) {
    const Buffers& b = caches[row_cache[r]];
    for (int64_t g = 0; g < KVH; ++g) {
      const float* kn = pk + (r * KVH + g) * D;
      const float* vn = pv + (r * KVH + g) * Dv;
      if (b.dtype == at::kFloat) write_new<float>(b, row_in[r], g, kn, vn, D, Dv);
      else if (b.dtype == at::kHalf) write_new<c10::Half>(b, row_in[r], g, kn, vn, D, Dv);
      else write_new<c10::BFloat16>(b, row_in[r], g, kn, vn, D, Dv);
    }
  }
  // one task a (row, query head); tasks of little work run on one thread (waking the pool costs more)
  int64_t most = 1;
  for (const Buffers& b : caches) most = std::max(most, b.start - b.first + 1);
  const int64_t grain = std::max<int64_t>(1, 8192 / std::max<int64_t>(1, most * (D + Dv)));
  at::parallel_for(0, R * H, grain, [&](int64_t t0, int64_t t1) {
    std::vector<float> scores(static_cast<size_t>(most + 8));
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t r = t / H, h = t % H, g = h / groups;
      const Buffers& b = caches[row_cache[r]];
      const float* qh = pq + (r * H + h) * D;
      const float* kn = pk + (r * KVH + g) * D;
      const float* vn = pv + (r * KVH + g) * Dv;
      float* oh = po + (r * H + h) * Dv;
      if (b.dtype == at::kFloat) run_head<float>(vector, qh, kn, vn, b, row_in[r], g, D, Dv, fscale, scores.data(), oh);
      else if (b.dtype == at::kHalf) run_head<c10::Half>(vector, qh, kn, vn, b, row_in[r], g, D, Dv, fscale, scores.data(), oh);
      else run_head<c10::BFloat16>(vector, qh, kn, vn, b, row_in[r], g, D, Dv, fscale, scores.data(), oh);
    }
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(anyquant, m) {
  m.def("decode_attention(Tensor q, Tensor k, Tensor v, Tensor(a!)[] keys, Tensor(b!)[] values, int[] starts, int window, "
        "float scaling, int isa=-1) -> Tensor");
}

TORCH_LIBRARY_IMPL(anyquant, CPU, m) { m.impl("decode_attention", &decode_attention); }
