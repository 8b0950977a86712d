/* Paged decode attention on the CPU, read straight from the paged KV cache (no gather into a padded copy).

   Built and loaded by sarathi_lite/kernels/cpu_native.py (cc -O3 -march=native -fopenmp). One task per decode
   (or per range of its KV heads, when there are too few decodes to keep every thread busy): its K and V rows are
   read in order, and each KV head's slice is shared by its group's query heads. Two
   passes over the context: scores (q . k, 16 tokens at a time, their 16 partial-sum vectors reduced by one
   shuffle tree), softmax in float32 (max, then exp from a polynomial), then the V-weighted sum. Float32 accumulation for float32 and bfloat16 data
   (bfloat16 widened exactly, the output rounded to nearest even). Tasks are spread over OpenMP threads.

   Layouts: q [*, Hq, D] with rows q_stride elements apart (heads and D contiguous); out likewise with o_stride;
   cache [num_blocks, 2, block_size, Hkv, D] contiguous; request r's pages are kv_indices[kv_starts[r]:...]. */
#include <stdint.h>
#include <string.h>
#include <stdlib.h>
#include <math.h>

typedef float v16 __attribute__((vector_size(64)));
typedef int32_t i16v __attribute__((vector_size(64)));
typedef uint16_t u16x16 __attribute__((vector_size(32)));
typedef uint32_t u32x16 __attribute__((vector_size(64)));

#define MAXG 16   /* query heads per KV head */
#define MAXH 128  /* query heads */
/* software prefetch distances, in tokens: a few decodes' K/V rows come from memory, not cache, scattered over
   pages the hardware prefetcher does not follow (16/8 measured as good as 32/16 and 48/24) */
#define KAHEAD 16
#define VAHEAD 8
#define INLINE static inline __attribute__((always_inline))

INLINE v16 load_f32(const float *p) { v16 v; memcpy(&v, p, 64); return v; }
INLINE v16 load_bf16(const uint16_t *p) {
  u16x16 h; memcpy(&h, p, 32);
  u32x16 w = __builtin_convertvector(h, u32x16) << 16;
  v16 v; memcpy(&v, &w, 64); return v;
}
INLINE v16 load(const void *p, int bf16) { return bf16 ? load_bf16((const uint16_t *)p) : load_f32((const float *)p); }
INLINE v16 vsel(i16v m, v16 a, v16 b) {  /* lanes of m all ones: a, else b */
  i16v ai, bi; memcpy(&ai, &a, 64); memcpy(&bi, &b, 64);
  i16v r = (ai & m) | (bi & ~m); v16 out; memcpy(&out, &r, 64); return out;
}
INLINE float hsum(v16 v) {
  v16 a = v + __builtin_shuffle(v, (i16v){8,9,10,11,12,13,14,15,0,1,2,3,4,5,6,7});
  a = a + __builtin_shuffle(a, (i16v){4,5,6,7,0,1,2,3,12,13,14,15,8,9,10,11});
  a = a + __builtin_shuffle(a, (i16v){2,3,0,1,6,7,4,5,10,11,8,9,14,15,12,13});
  a = a + __builtin_shuffle(a, (i16v){1,0,3,2,5,4,7,6,9,8,11,10,13,12,15,14});
  return a[0];
}
INLINE float hmax(v16 v) { float m = v[0]; for (int i = 1; i < 16; i++) m = v[i] > m ? v[i] : m; return m; }
/* lane t of the result = the sum of v[t]'s 16 lanes: a 4-level shuffle tree, then the bit reversal it leaves */
INLINE v16 sum16(const v16 *v) {
  const i16v l1a = {0,1,2,3,4,5,6,7,16,17,18,19,20,21,22,23}, l1b = {8,9,10,11,12,13,14,15,24,25,26,27,28,29,30,31};
  const i16v l2a = {0,1,2,3,16,17,18,19,8,9,10,11,24,25,26,27}, l2b = {4,5,6,7,20,21,22,23,12,13,14,15,28,29,30,31};
  const i16v l3a = {0,1,16,17,4,5,20,21,8,9,24,25,12,13,28,29}, l3b = {2,3,18,19,6,7,22,23,10,11,26,27,14,15,30,31};
  const i16v l4a = {0,16,2,18,4,20,6,22,8,24,10,26,12,28,14,30}, l4b = {1,17,3,19,5,21,7,23,9,25,11,27,13,29,15,31};
  const i16v rev = {0,8,4,12,2,10,6,14,1,9,5,13,3,11,7,15};
  v16 a[8], b[4], c[2];
  for (int i = 0; i < 8; i++) a[i] = __builtin_shuffle(v[2*i], v[2*i+1], l1a) + __builtin_shuffle(v[2*i], v[2*i+1], l1b);
  for (int i = 0; i < 4; i++) b[i] = __builtin_shuffle(a[2*i], a[2*i+1], l2a) + __builtin_shuffle(a[2*i], a[2*i+1], l2b);
  for (int i = 0; i < 2; i++) c[i] = __builtin_shuffle(b[2*i], b[2*i+1], l3a) + __builtin_shuffle(b[2*i], b[2*i+1], l3b);
  v16 d = __builtin_shuffle(c[0], c[1], l4a) + __builtin_shuffle(c[0], c[1], l4b);
  return __builtin_shuffle(d, rev);
}
/* e^x for x <= 0: 2^(x log2 e) = 2^n e^f, n the nearest integer, f in [-ln2/2, ln2/2]; degree-7 Taylor series of
   e^f (relative error under 2e-9, below float32's rounding); x below -87 gives e^-87 (its weight is ~0 anyway) */
INLINE v16 vexp(v16 x) {
  x = vsel(x < -87.0f, (v16){0} - 87.0f, x);
  v16 t = x * 1.44269504088896341f;
  i16v ni = __builtin_convertvector(t - 0.5f, i16v);  /* truncation toward zero: rounds t <= 0 to nearest */
  v16 f = (t - __builtin_convertvector(ni, v16)) * 0.69314718055994531f;
  v16 p = 1.0f + f * (1.0f + f * (0.5f + f * (1.0f / 6 + f * (1.0f / 24 + f * (1.0f / 120 + f * (1.0f / 720 +
          f * (1.0f / 5040)))))));
  i16v e = (ni + 127) << 23;
  v16 scale; memcpy(&scale, &e, 64);
  return p * scale;
}
INLINE uint16_t to_bf16(float f) {
  uint32_t u; memcpy(&u, &f, 4);
  if ((u & 0x7fffffff) > 0x7f800000) return (uint16_t)((u >> 16) | 0x40);
  u += 0x7fff + ((u >> 16) & 1); return (uint16_t)(u >> 16);
}

/* One decode request, KV heads h0 .. h1 - 1 (all of them, or a task's range): each of their query heads over tokens
   [first, len). Rows are read in order, this range's slice of each K and V row shared by the heads of each group.
   s: scratch of hkv * group * sstride floats. */
INLINE void one(const char *q, const char *cache, char *out, int64_t qoff, int64_t ooff, int64_t len,
                const int32_t *pages, int64_t hkv, int64_t h0, int64_t h1, int64_t group, int64_t bs, float scale,
                int64_t window_left, float *s, int64_t sstride, const int ND, const int bf16) {
  const int64_t es = bf16 ? 2 : 4, d = 16 * ND, row = hkv * d * es, blk = 2 * bs * row;
  const int64_t first = window_left >= 0 && len - 1 - window_left > 0 ? len - 1 - window_left : 0, n = len - first;
  v16 qv[MAXH][8], acc[MAXH][8], mxv[MAXH];
  float sum[MAXH];
  for (int64_t j = h0 * group; j < h1 * group; j++) {
    const char *qr = q + (qoff + j * d) * es;
    for (int c = 0; c < ND; c++) { qv[j][c] = load(qr + 16 * c * es, bf16) * scale; acc[j][c] = (v16){0}; }
    mxv[j] = (v16){0} - INFINITY;
  }
  const v16 lane = {0,1,2,3,4,5,6,7,8,9,10,11,12,13,14,15};
  const int64_t lo = h0 * d * es, hi = h1 * d * es;  /* this task's bytes of a K or V row */
  for (int64_t t0 = 0; t0 < n; t0 += 16) {  /* scores, 16 tokens at a time */
    const int64_t m = n - t0 < 16 ? n - t0 : 16;
    for (int64_t i = t0 + KAHEAD; i < t0 + KAHEAD + 16 && i < n; i++) {  /* K rows KAHEAD tokens ahead of use */
      const char *k = cache + pages[(first + i) / bs] * blk + ((first + i) % bs) * row;
      for (int64_t b = lo; b < hi; b += 64) __builtin_prefetch(k + b, 0, 3);
    }
    for (int64_t h = h0; h < h1; h++) {
      v16 P[MAXG][16];
      for (int64_t i = 0; i < 16; i++) {
        if (i >= m) { for (int64_t j = 0; j < group; j++) P[j][i] = (v16){0}; continue; }
        const int64_t t = first + t0 + i;
        const char *k = cache + pages[t / bs] * blk + (t % bs) * row + h * d * es;
        v16 kv[8];
        for (int c = 0; c < ND; c++) kv[c] = load(k + 16 * c * es, bf16);
        for (int64_t j = 0; j < group; j++) {
          const v16 *qj = qv[h * group + j];
          v16 p = qj[0] * kv[0];
          for (int c = 1; c < ND; c++) p += qj[c] * kv[c];
          P[j][i] = p;
        }
      }
      for (int64_t j = 0; j < group; j++) {
        const int64_t head = h * group + j;
        v16 r = vsel(lane < (float)m, sum16(P[j]), (v16){0} - INFINITY);
        memcpy(s + head * sstride + t0, &r, 64);
        mxv[head] = vsel(r > mxv[head], r, mxv[head]);
      }
    }
  }
  for (int64_t j = h0 * group; j < h1 * group; j++) {  /* softmax numerators in place, and their sums */
    float *sj = s + j * sstride;
    const float mx = hmax(mxv[j]);
    v16 tot = {0};
    for (int64_t t = 0; t < n; t += 16) { v16 e = vexp(load_f32(sj + t) - mx); memcpy(sj + t, &e, 64); tot += e; }
    sum[j] = hsum(tot);
  }
  for (int64_t i = 0; i < n; i++) {  /* the V-weighted sums */
    const int64_t t = first + i;
    if (i + VAHEAD < n) {  /* a V row VAHEAD tokens ahead */
      const char *v = cache + pages[(t + VAHEAD) / bs] * blk + (bs + (t + VAHEAD) % bs) * row;
      for (int64_t b = lo; b < hi; b += 64) __builtin_prefetch(v + b, 0, 3);
    }
    const char *v = cache + pages[t / bs] * blk + (bs + t % bs) * row;
    for (int64_t h = h0; h < h1; h++) {
      v16 vv[8];
      for (int c = 0; c < ND; c++) vv[c] = load(v + (h * d + 16 * c) * es, bf16);
      for (int64_t j = h * group; j < (h + 1) * group; j++) {
        const float p = s[j * sstride + i];
        for (int c = 0; c < ND; c++) acc[j][c] += p * vv[c];
      }
    }
  }
  for (int64_t j = h0 * group; j < h1 * group; j++) {
    char *o = out + (ooff + j * d) * es;
    const float inv = 1.f / sum[j];
    for (int c = 0; c < ND; c++) {
      v16 val = acc[j][c] * inv;
      if (bf16) for (int x = 0; x < 16; x++) ((uint16_t *)o)[16 * c + x] = to_bf16(val[x]);
      else memcpy(o + 16 * c * 4, &val, 64);
    }
  }
}

#define VARIANT(ND, BF) static void run_##ND##_##BF(const char *q, const char *cache, char *out, \
    const int64_t *q_rows, int64_t q_stride, int64_t o_stride, const int64_t *kv_lens, const int64_t *kv_starts, \
    const int32_t *kv_indices, int64_t n_req, int64_t hkv, int64_t group, int64_t bs, float scale, \
    int64_t window_left, int64_t num_threads, int64_t sstride, int64_t parts) { \
  _Pragma("omp parallel num_threads(num_threads) if(num_threads > 1)") { \
    float *s = (float *)aligned_alloc(64, sizeof(float) * hkv * group * sstride); \
    _Pragma("omp for schedule(dynamic, 1)") \
    for (int64_t task = 0; task < n_req * parts; task++) { \
      const int64_t r = task / parts, p = task % parts; \
      one(q, cache, out, q_rows[r] * q_stride, q_rows[r] * o_stride, kv_lens[r], kv_indices + kv_starts[r], hkv, \
          p * hkv / parts, (p + 1) * hkv / parts, group, bs, scale, window_left, s, sstride, ND, BF); } \
    free(s); } }
VARIANT(1, 0) VARIANT(2, 0) VARIANT(4, 0) VARIANT(8, 0) VARIANT(1, 1) VARIANT(2, 1) VARIANT(4, 1) VARIANT(8, 1)

/* 0 on success; -1 for a head size or group this kernel does not take (the caller falls back). */
int paged_decode(const void *q, const void *cache, void *out, const int64_t *q_rows, int64_t q_stride,
                 int64_t o_stride, const int64_t *kv_lens, const int64_t *kv_starts, const int32_t *kv_indices,
                 int64_t n_req, int64_t hkv, int64_t group,
                 int64_t d, int64_t bs, float scale, int64_t window_left, int64_t num_threads, int bf16) {
  if (group < 1 || group > MAXG || hkv * group > MAXH || !(d == 16 || d == 32 || d == 64 || d == 128)) return -1;
  int64_t max_len = 1;
  for (int64_t r = 0; r < n_req; r++) max_len = kv_lens[r] > max_len ? kv_lens[r] : max_len;
  const int64_t sstride = (max_len + 15) / 16 * 16;
  /* with few decodes, split each one's KV heads over tasks (at least 4 per thread where the heads allow), so every
     thread has work: a few decodes' K/V come from memory, not cache, and one thread alone cannot draw the
     bandwidth */
  int64_t parts = 1;
  if (num_threads > 1 && n_req > 0) parts = (4 * num_threads + n_req - 1) / n_req;
  if (parts > hkv) parts = hkv;
#define GO(ND) (bf16 ? run_##ND##_1 : run_##ND##_0)(q, cache, out, q_rows, q_stride, o_stride, kv_lens, kv_starts, kv_indices, n_req, \
    hkv, group, bs, scale, window_left, num_threads, sstride, parts)
  switch (d / 16) { case 1: GO(1); break; case 2: GO(2); break; case 4: GO(4); break; default: GO(8); }
  return 0;
}
