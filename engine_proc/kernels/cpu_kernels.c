/* tickserve's CPU kernels: the per-layer work of a decode step that is not a matmul.
 *
 * Compiled at run time for the host CPU by engine_proc/kernels/build.py, once per
 * (dtype, head_dim, group, block_size), with the model's shapes as constants so every
 * inner loop has a fixed trip count and vectorises (-O3 -march=native):
 *
 *   -DSCALAR_BF16=0|1   model and KV-cache dtype: float32, or bfloat16 held as uint16
 *   -DHEAD_DIM=D        head dimension
 *   -DGROUP=G           query heads per KV head (grouped-query attention)
 *   -DBLOCK_SIZE=BS     tokens per KV-cache block
 *
 * KV-cache layout (one K and one V tensor per layer; block ids come from block tables),
 * as in engine_proc/kv_cache.py:
 *   float32   k_cache[block][kv head][D][BS]       keys transposed within a block: the BS keys
 *                                                  of one dimension are contiguous, so q·k for a
 *                                                  whole block is D vector FMAs, no horizontal sums
 *             v_cache[block][kv head][BS][D]       values as rows: p·v accumulates along D
 *   bfloat16  k_cache[block][kv head][D/2][BS][2]  the same, in pairs of dimensions
 *             v_cache[block][kv head][BS/2][D][2]  the same, in pairs of tokens
 * Pairs are AVX-512 BF16's operand layout: vdpbf16ps multiplies 32 pairs of bfloat16 and
 * adds each pair's two products into one of 16 float32 lanes, so q·k takes D/2 such
 * instructions per block and p·v BS/2 per row of D. Without AVX-512 BF16 the pairs are
 * split into two float32 vectors (a shift and a mask) and multiplied as such.
 *
 * All arithmetic is float32; bfloat16 values are widened on load and rounded to nearest
 * even on store, as torch rounds. Every function takes `nthreads` (torch's intra-op
 * thread count) and runs on the OpenMP runtime torch itself loaded (same soname, so
 * the dynamic loader reuses it: one thread pool, no oversubscription).
 */
#include <float.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

#if SCALAR_BF16
typedef uint16_t scalar_t;
static inline float load(scalar_t x) {
    uint32_t u = (uint32_t)x << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}
static inline scalar_t store(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (scalar_t)((u >> 16) | 0x40u); /* NaN stays NaN */
    u += 0x7fffu + ((u >> 16) & 1u);                                            /* nearest even */
    return (scalar_t)(u >> 16);
}
#else
typedef float scalar_t;
static inline float load(scalar_t x) { return x; }
static inline scalar_t store(float f) { return f; }
#endif

#define D HEAD_DIM
#define G GROUP
#define BS BLOCK_SIZE
#define HALF (HEAD_DIM / 2)

/* Explicit vectors (GCC/Clang vector extensions): the attention loops are written on
 * them, not left to the auto-vectoriser. One vector is one register: 16 lanes with
 * AVX-512, 8 without (one AVX2 register, two SSE ones). Sixteen lanes on AVX2 made GCC
 * split every vector, shuffle and select into pieces through the stack (decode
 * attention 3.4x slower per layer in float32, 2.8x in bfloat16, on a Zen 3 host). */
#if defined(__AVX512F__)
#define VL 16
#else
#define VL 8
#endif
typedef float vf __attribute__((vector_size(VL * 4)));
typedef int32_t vi __attribute__((vector_size(VL * 4)));
typedef uint32_t vu __attribute__((vector_size(VL * 4)));
typedef uint16_t vh __attribute__((vector_size(VL * 2)));
#if HEAD_DIM % VL || BLOCK_SIZE % VL
#error "HEAD_DIM and BLOCK_SIZE must be multiples of 16"
#endif
#define DV (D / VL)  /* vectors per head dimension */
#define KV (BS / VL) /* vectors per block of keys */
#define PAIRED SCALAR_BF16
#ifndef PREFETCH_BLOCKS
#define PREFETCH_BLOCKS 2 /* how far ahead decode attention asks for the next KV block */
#endif
#if PAIRED && defined(__AVX512BF16__) && VL == 16
#include <immintrin.h>
#define DPBF16 1
#else
#define DPBF16 0
#endif

/* AMX (Intel's tile matrix unit, Sapphire Rapids and later): with bfloat16 and a head
 * dimension of 64 or 128, rows of up to TWO_PASS_MAX keys take both matrix products of
 * attention as tile multiplies (attend_two_pass_amx). -march=native defines __AMX_BF16__
 * only where the CPU has it; the kernel also needs the kernel's permission to use the
 * tile state (arch_prctl ARCH_REQ_XCOMP_PERM, asked once per process), and falls back to
 * the vector path without it. */
#if PAIRED && defined(__AMX_TILE__) && defined(__AMX_BF16__) && GROUP <= 16 && (HEAD_DIM == 64 || HEAD_DIM == 128)
#define AMX 1
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>
#else
#define AMX 0
#endif

/* VL lanes of bfloat16 pairs: the even (low) and odd (high) halves as float32 vectors. */
static inline vf pair_lo(vu pairs) { return (vf)(pairs << 16); }
static inline vf pair_hi(vu pairs) { return (vf)(pairs & 0xffff0000u); }
static inline vu vload_pairs(const uint16_t *p) {
    vu u;
    memcpy(&u, p, sizeof u);
    return u;
}
/* acc + Σ over each lane's pair: a.lo·b.lo + a.hi·b.hi, b one pair broadcast to every lane. */
static inline vf dot_pairs(vf acc, vu a, uint32_t b) {
#if DPBF16
    return (vf)_mm512_dpbf16_ps((__m512)acc, (__m512bh)(__m512i)a, (__m512bh)_mm512_set1_epi32((int)b));
#else
    vu bv = (vu){0} + b;
    return acc + pair_lo(a) * pair_lo(bv) + pair_hi(a) * pair_hi(bv);
#endif
}

static inline vf vload(const scalar_t *p) {
    vf f;
#if SCALAR_BF16
    vh h;
    memcpy(&h, p, sizeof h);
    vu u = __builtin_convertvector(h, vu) << 16;
    memcpy(&f, &u, sizeof f);
#else
    memcpy(&f, p, sizeof f);
#endif
    return f;
}

static inline vf vselect(vi mask, vf a, vf b) { /* mask ? a : b, lane by lane (mask lanes 0 or -1) */
    return (vf)(((vi)a & mask) | ((vi)b & ~mask));
}

/* Round every lane to the storage dtype and back (bfloat16: nearest even, NaN stays NaN).
 * With AVX-512 BF16 one vcvtneps2bf16 does the rounding (nearest even, NaN quieted, as
 * below; it flushes denormals, which activations never are) instead of six integer ops. */
static inline vf vround(vf f) {
#if DPBF16
    return (vf)_mm512_slli_epi32(_mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh((__m512)f)), 16);
#elif SCALAR_BF16
    vu u = (vu)f;
    u = (vu)vselect(f != f, (vf)(u | 0x00400000u), f); /* quiet a NaN so rounding keeps it one */
    u += 0x7fffu + ((u >> 16) & 1u);
    return (vf)(u & 0xffff0000u);
#else
    return f;
#endif
}

static inline void vstore(scalar_t *p, vf f) {
#if DPBF16
    _mm256_storeu_si256((__m256i *)p, (__m256i)_mm512_cvtneps_pbh((__m512)f));
#elif SCALAR_BF16
    vh h = __builtin_convertvector((vu)vround(f) >> 16, vh);
    memcpy(p, &h, sizeof h);
#else
    memcpy(p, &f, sizeof f);
#endif
}

/* Horizontal sum and maximum of the lanes, by halving (log2 VL shuffles). The shuffle is
 * clang's __builtin_shufflevector (constant lane indices) or GCC's __builtin_shuffle (a
 * mask vector); GCC before 12 has only the latter, clang only the former. */
#if defined(__clang__)
#define VSHUFFLE(v, ...) __builtin_shufflevector(v, v, __VA_ARGS__)
#else
#define VSHUFFLE(v, ...) __builtin_shuffle(v, (vi){__VA_ARGS__})
#endif
#if VL == 16
#define VSWAP8(v) VSHUFFLE(v, 8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7)
#define VSWAP4(v) VSHUFFLE(v, 4, 5, 6, 7, 0, 1, 2, 3, 12, 13, 14, 15, 8, 9, 10, 11)
#define VSWAP2(v) VSHUFFLE(v, 2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13)
#define VSWAP1(v) VSHUFFLE(v, 1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14)
#else
#define VSWAP4(v) VSHUFFLE(v, 4, 5, 6, 7, 0, 1, 2, 3)
#define VSWAP2(v) VSHUFFLE(v, 2, 3, 0, 1, 6, 7, 4, 5)
#define VSWAP1(v) VSHUFFLE(v, 1, 0, 3, 2, 5, 4, 7, 6)
#endif

static inline float vsum(vf v) {
#if VL == 16
    v += VSWAP8(v);
#endif
    v += VSWAP4(v);
    v += VSWAP2(v);
    v += VSWAP1(v);
    return v[0];
}

static inline vf vmax2(vf a, vf b) { return vselect(b > a, b, a); }

static inline float vmax(vf v) {
#if VL == 16
    v = vmax2(v, VSWAP8(v));
#endif
    v = vmax2(v, VSWAP4(v));
    v = vmax2(v, VSWAP2(v));
    v = vmax2(v, VSWAP1(v));
    return v[0];
}

/* exp_approx on every lane (the same polynomial; n rounded by the 1.5·2^23 trick). */
static inline vf vexp(vf x) {
    const vf lo = x * 0.0f - 87.0f, hi = x * 0.0f + 88.0f;
    x = vselect(x < lo, lo, x);
    x = vselect(x > hi, hi, x);
    const vf t = x * 1.4426950408889634f;
    const vf n = (t + 12582912.0f) - 12582912.0f;
    const vf f = (t - n) * 0.6931471805599453f;
    vf p = 1.0f + f * (1.0f + f * (0.5f + f * (1.6666667e-1f + f * (4.1666668e-2f + f * (8.3333338e-3f
           + f * (1.3888889e-3f + f * 1.9841270e-4f))))));
    vi bits;
    memcpy(&bits, &p, sizeof p);
    bits += __builtin_convertvector(n, vi) << 23;
    memcpy(&p, &bits, sizeof p);
    return p;
}

/* e^x for x in [-87, 88], relative error ~2e-7: x·log2(e) = n + f with n an integer and
 * |f| <= 1/2, 2^f by its Taylor series to degree 7, 2^n into the exponent bits. Written
 * with plain arithmetic so that loops calling it vectorise (libm's expf does not). */
static inline float exp_approx(float x) {
    x = x < -87.0f ? -87.0f : (x > 88.0f ? 88.0f : x);
    float t = x * 1.4426950408889634f;
    float n = nearbyintf(t);
    float f = (t - n) * 0.6931471805599453f; /* e^f = 2^(t - n) */
    float p = 1.0f + f * (1.0f + f * (0.5f + f * (1.6666667e-1f + f * (4.1666668e-2f + f * (8.3333338e-3f
              + f * (1.3888889e-3f + f * 1.9841270e-4f))))));
    int32_t bits;
    memcpy(&bits, &p, 4);
    bits += (int32_t)n << 23;
    memcpy(&p, &bits, 4);
    return p;
}

#define TWO_PASS_KEYS 4096 /* the scores one two-pass item keeps on its stack, per query head */
#ifndef TWO_PASS_MAX
/* rows up to this many keys take the two-pass softmax: bfloat16 only, where it measured
 * 1.1-1.5x faster per layer (tools/bench_attention.py); on float32 rows it was not faster */
#define TWO_PASS_MAX (PAIRED ? TWO_PASS_KEYS : 0)
#endif
_Static_assert(TWO_PASS_MAX <= TWO_PASS_KEYS, "TWO_PASS_MAX exceeds the scores kept on the stack");

/* Every line of one KV head's block at `at`; locality 3 (prefetcht0, into L1) or 2
 * (prefetcht1, L2: needed a little later). A macro: __builtin_prefetch wants a constant. */
#define PREFETCH_HEAD_BLOCK(cache, at, head_stride, locality)                                     \
    do {                                                                                          \
        const char *p_ = (const char *)((cache) + (at));                                          \
        for (int64_t off_ = 0; off_ < (int64_t)sizeof(scalar_t) * (head_stride); off_ += 64)     \
            __builtin_prefetch(p_ + off_, 0, locality);                                           \
    } while (0)

static inline void prefetch_block(const scalar_t *cache, int64_t at, int64_t head_stride) {
    PREFETCH_HEAD_BLOCK(cache, at, head_stride, 3);
}

/* The exponentials of a two-pass item, all keys at once: scores[g][i] ← e^(scores[g][i] −
 * max_g) for i < len, 0 for len <= i < padded (mv[g]: each head's maximum, lane-wise);
 * inv[g] ← 1 / Σ. With bfloat16, probs[g·TWO_PASS_KEYS + i] also gets them rounded to
 * bfloat16 (the operand of the p·v products). */
static inline void softmax_scores(float scores[G][TWO_PASS_KEYS], const vf mv[G], int len, int padded,
                                  uint16_t *probs, float inv[G]) {
    vi lane;
    for (int i = 0; i < VL; i++) lane[i] = i;
    for (int g = 0; g < G; g++) {
        const float mx = vmax(mv[g]);
        vf sum = {0};
        for (int i = 0; i < padded; i += VL) {
            vf v;
            memcpy(&v, &scores[g][i], sizeof v);
            const vf e = vselect(lane + i < len, vexp(v - mx), (vf){0});
            sum += e;
            memcpy(&scores[g][i], &e, sizeof e);
            if (PAIRED) {
                const vh half = __builtin_convertvector((vu)vround(e) >> 16, vh);
                memcpy(probs + (int64_t)g * TWO_PASS_KEYS + i, &half, sizeof half);
            }
        }
        inv[g] = 1.0f / vsum(sum);
    }
}

/* One (row, KV head) item of decode_attention for a row of len <= TWO_PASS_KEYS keys, the
 * softmax in two passes over stored scores: pass 1 reads every key block once (q·k for
 * the G heads, a running maximum kept lane-wise, no horizontal step per block); the
 * exponentials and their sum then run over all keys at once; pass 2 reads every value
 * block once. Against the online form (one rescale and two horizontal reductions per
 * head per block) this does the same loads and 3–4× fewer non-dot instructions. */
static void attend_two_pass(const scalar_t *qb, const scalar_t *k_cache, const scalar_t *v_cache,
                            const int32_t *table, int len, int64_t h, int64_t head_stride, int64_t blk_stride,
                            float scale, scalar_t *ob) {
    const int nblk = (len + BS - 1) / BS, padded = nblk * BS;
    float scores[G][TWO_PASS_KEYS] __attribute__((aligned(64)));
    vf mv[G];
    for (int g = 0; g < G; g++) mv[g] = (vf){0} - FLT_MAX;
#if PAIRED
    uint32_t qpair[G][D / 2];
    for (int g = 0; g < G; g++)
        for (int dp = 0; dp < D / 2; dp++) memcpy(&qpair[g][dp], qb + g * D + 2 * dp, 4);
#else
    float qf[G][D];
    for (int g = 0; g < G; g++)
        for (int d = 0; d < D; d++) qf[g][d] = load(qb[g * D + d]);
#endif
    vi lane;
    for (int i = 0; i < VL; i++) lane[i] = i;
    for (int ahead = 0; ahead < PREFETCH_BLOCKS && ahead < nblk; ahead++)
        prefetch_block(k_cache, (int64_t)table[ahead] * blk_stride + h * head_stride, head_stride);
    for (int blk = 0; blk < nblk; blk++) { /* pass 1: scores */
        const scalar_t *kb = k_cache + (int64_t)table[blk] * blk_stride + h * head_stride;
        if (blk + PREFETCH_BLOCKS < nblk)
            prefetch_block(k_cache, (int64_t)table[blk + PREFETCH_BLOCKS] * blk_stride + h * head_stride, head_stride);
        vf sc[G][KV];
        for (int g = 0; g < G; g++)
            for (int j = 0; j < KV; j++) sc[g][j] = (vf){0};
#if PAIRED
        for (int dp = 0; dp < D / 2; dp++)
            for (int j = 0; j < KV; j++) {
                const vu k = vload_pairs(kb + ((int64_t)dp * BS + j * VL) * 2);
                for (int g = 0; g < G; g++) sc[g][j] = dot_pairs(sc[g][j], k, qpair[g][dp]);
            }
#else
        for (int d = 0; d < D; d++)
            for (int j = 0; j < KV; j++) {
                const vf k = vload(kb + d * BS + j * VL);
                for (int g = 0; g < G; g++) sc[g][j] += qf[g][d] * k;
            }
#endif
        for (int g = 0; g < G; g++)
            for (int j = 0; j < KV; j++) {
                const vi valid = lane + (blk * BS + j * VL) < len;
                const vf v = vselect(valid, sc[g][j] * scale, (vf){0} - FLT_MAX);
                mv[g] = vselect(v > mv[g], v, mv[g]);
                memcpy(&scores[g][blk * BS + j * VL], &v, sizeof v);
            }
    }
    float inv[G];
#if PAIRED
    uint32_t pp[G][TWO_PASS_KEYS / 2] __attribute__((aligned(64)));
    softmax_scores(scores, mv, len, padded, (uint16_t *)pp, inv);
#else
    softmax_scores(scores, mv, len, padded, NULL, inv);
#endif
    vf acc[G][DV];
    for (int g = 0; g < G; g++)
        for (int j = 0; j < DV; j++) acc[g][j] = (vf){0};
    for (int ahead = 0; ahead < PREFETCH_BLOCKS && ahead < nblk; ahead++)
        prefetch_block(v_cache, (int64_t)table[ahead] * blk_stride + h * head_stride, head_stride);
    for (int blk = 0; blk < nblk; blk++) { /* pass 2: values */
        const scalar_t *vb = v_cache + (int64_t)table[blk] * blk_stride + h * head_stride;
        if (blk + PREFETCH_BLOCKS < nblk)
            prefetch_block(v_cache, (int64_t)table[blk + PREFETCH_BLOCKS] * blk_stride + h * head_stride, head_stride);
        const int n = len - blk * BS < BS ? len - blk * BS : BS;
#if PAIRED
        int t = 0;
        for (; t + 1 < n; t += 2)
            for (int j = 0; j < DV; j++) {
                const vu v = vload_pairs(vb + ((int64_t)(t / 2) * D + j * VL) * 2);
                for (int g = 0; g < G; g++) acc[g][j] = dot_pairs(acc[g][j], v, pp[g][(blk * BS + t) / 2]);
            }
        if (t < n) /* an odd last token: its partner slot is unwritten, never multiplied */
            for (int j = 0; j < DV; j++) {
                const vf v = pair_lo(vload_pairs(vb + ((int64_t)(t / 2) * D + j * VL) * 2));
                for (int g = 0; g < G; g++) acc[g][j] += scores[g][blk * BS + t] * v;
            }
#else
        for (int t = 0; t < n; t++) {
            vf v[DV];
            for (int j = 0; j < DV; j++) v[j] = vload(vb + t * D + j * VL);
            for (int g = 0; g < G; g++) {
                const float pt = scores[g][blk * BS + t];
                for (int j = 0; j < DV; j++) acc[g][j] += pt * v[j];
            }
        }
#endif
    }
    for (int g = 0; g < G; g++)
        for (int j = 0; j < DV; j++) vstore(ob + g * D + j * VL, acc[g][j] * inv[g]);
}

#if AMX
/* Tiles (one configuration for the whole kernel, loaded once per thread per call):
 *   S      G × 16 float32   the scores of 16 keys                     (pass 1, accumulator)
 *   K      16 × 64 bytes    32 dimensions of 16 keys, in pairs          (pass 1, the k_cache layout as is)
 *   V      PV_K/2 × 64      PV_K tokens of 16 dimensions, in token pairs (pass 2, the v_cache layout as is)
 *   P      G × PV_K bf16    the probabilities of PV_K tokens            (pass 2)
 *   Q0..Q3 G × 32 bf16      q, 32 dimensions each                       (pass 1)
 *          G × 16 float32   the output, 16 dimensions each             (pass 2, accumulators; same shape)
 * tdpbf16ps multiplies bfloat16 pairs and accumulates in float32, as vdpbf16ps does. */
#define PV_K (BS % 32 == 0 ? 32 : 16) /* tokens per p·v tile multiply */
#define T_S 0
#define T_K 1
#define T_V 2
#define T_P 3
#define T_Q0 4
#define T_Q1 5
#define T_Q2 6
#define T_Q3 7
/* GCC's tile intrinsics paste their tile numbers into the assembly text unexpanded: these
 * wrappers expand the names above to numbers first. */
#define TLOAD(t, p, stride) _tile_loadd(t, p, stride)
#define TSTORE(t, p, stride) _tile_stored(t, p, stride)
#define TZERO(t) _tile_zero(t)
#define TDP(c, a, b) _tile_dpbf16ps(c, a, b)
struct tile_config {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
};

static int amx_permitted = 0; /* 0 not asked yet, 1 granted, -1 refused */

static int amx_usable(void) {
    if (!amx_permitted) /* ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA (Linux 5.16+) */
        amx_permitted = syscall(SYS_arch_prctl, 0x1023, 18) == 0 ? 1 : -1;
    return amx_permitted > 0;
}

static void amx_configure(void) {
    struct tile_config c;
    memset(&c, 0, sizeof c);
    c.palette = 1;
    c.rows[T_S] = G, c.colsb[T_S] = 64;
    c.rows[T_K] = 16, c.colsb[T_K] = 64;
    c.rows[T_V] = PV_K / 2, c.colsb[T_V] = 64;
    c.rows[T_P] = G, c.colsb[T_P] = PV_K * 2;
    for (int t = T_Q0; t <= T_Q3; t++) c.rows[t] = G, c.colsb[t] = 64;
    __asm__ volatile("" : : "r"(&c) : "memory"); /* keep the stores: see qmatmul.c's amx_configure */
    _tile_loadconfig(&c);
}

/* attend_two_pass on the tile unit: the same two passes, the same float32 softmax, the
 * same bfloat16 probabilities; q·k and p·v as tile multiplies straight from the cache's
 * pair layouts (no repacking). Keys past len in the last block get masked scores; values
 * past len are never read (the last len % PV_K tokens take the vector path), so garbage
 * there, NaN included, changes nothing. */
static void attend_two_pass_amx(const scalar_t *qb, const scalar_t *k_cache, const scalar_t *v_cache,
                                const int32_t *table, int len, int64_t h, int64_t head_stride, int64_t blk_stride,
                                float scale, scalar_t *ob) {
    const int nblk = (len + BS - 1) / BS, padded = nblk * BS;
    float scores[G][TWO_PASS_KEYS] __attribute__((aligned(64)));
    uint16_t probs[G][TWO_PASS_KEYS] __attribute__((aligned(64)));
    TLOAD(T_Q0, qb + 0, D * 2);
    TLOAD(T_Q1, qb + 32, D * 2);
#if D == 128
    TLOAD(T_Q2, qb + 64, D * 2);
    TLOAD(T_Q3, qb + 96, D * 2);
#endif
    for (int ahead = 0; ahead < PREFETCH_BLOCKS && ahead < nblk; ahead++)
        prefetch_block(k_cache, (int64_t)table[ahead] * blk_stride + h * head_stride, head_stride);
    for (int blk = 0; blk < nblk; blk++) { /* pass 1: scores, 16 keys a tile */
        const scalar_t *kb = k_cache + (int64_t)table[blk] * blk_stride + h * head_stride;
        if (blk + PREFETCH_BLOCKS < nblk)
            prefetch_block(k_cache, (int64_t)table[blk + PREFETCH_BLOCKS] * blk_stride + h * head_stride, head_stride);
        /* this block's values, for pass 2, into L2 meanwhile */
        PREFETCH_HEAD_BLOCK(v_cache, (int64_t)table[blk] * blk_stride + h * head_stride, head_stride, 2);
        for (int s = 0; s < BS; s += 16) { /* k_cache rows: dimension pairs, BS keys each */
#define QK_TILE(c, tq) do {                                                         \
                TLOAD(T_K, kb + ((int64_t)(c) * 16 * BS + s) * 2, BS * 4);          \
                TDP(T_S, tq, T_K);                                                  \
            } while (0)
            TZERO(T_S);
            QK_TILE(0, T_Q0);
            QK_TILE(1, T_Q1);
#if D == 128
            QK_TILE(2, T_Q2);
            QK_TILE(3, T_Q3);
#endif
#undef QK_TILE
            TSTORE(T_S, &scores[0][blk * BS + s], TWO_PASS_KEYS * 4);
        }
    }
    vi lane;
    for (int i = 0; i < VL; i++) lane[i] = i;
    vf mv[G];
    for (int g = 0; g < G; g++) { /* scale, mask the keys past len, each head's maximum */
        mv[g] = (vf){0} - FLT_MAX;
        for (int i = 0; i < padded; i += VL) {
            vf v;
            memcpy(&v, &scores[g][i], sizeof v);
            v = vselect(lane + i < len, v * scale, (vf){0} - FLT_MAX);
            mv[g] = vmax2(mv[g], v);
            memcpy(&scores[g][i], &v, sizeof v);
        }
    }
    float inv[G];
    softmax_scores(scores, mv, len, padded, &probs[0][0], inv);
    const int full = len / PV_K * PV_K; /* tokens whose values the tiles multiply */
    for (int r = 0; r < D; r += 64) { /* pass 2: values, 64 dimensions a round (four accumulators) */
        TZERO(T_Q0);
        TZERO(T_Q1);
        TZERO(T_Q2);
        TZERO(T_Q3);
        for (int ahead = 0; ahead < PREFETCH_BLOCKS && ahead < nblk; ahead++)
            prefetch_block(v_cache, (int64_t)table[ahead] * blk_stride + h * head_stride, head_stride);
        for (int blk = 0; blk < nblk; blk++) {
            const scalar_t *vb = v_cache + (int64_t)table[blk] * blk_stride + h * head_stride;
            if (blk + PREFETCH_BLOCKS < nblk)
                prefetch_block(v_cache, (int64_t)table[blk + PREFETCH_BLOCKS] * blk_stride + h * head_stride,
                               head_stride);
            const int upto = full - blk * BS < BS ? full - blk * BS : BS;
            for (int t = 0; t < upto; t += PV_K) { /* v_cache rows: token pairs, D dimensions each */
                TLOAD(T_P, &probs[0][blk * BS + t], TWO_PASS_KEYS * 2);
                const scalar_t *vt = vb + ((int64_t)(t / 2) * D + r) * 2;
#define PV_TILE(n, tacc) do {                                   \
                    TLOAD(T_V, vt + (n) * 32, D * 4);           \
                    TDP(tacc, T_P, T_V);                        \
                } while (0)
                PV_TILE(0, T_Q0);
                PV_TILE(1, T_Q1);
                PV_TILE(2, T_Q2);
                PV_TILE(3, T_Q3);
#undef PV_TILE
            }
        }
        vf tail[G][64 / VL]; /* the last tokens, fewer than PV_K: vectors, reading only those */
        for (int g = 0; g < G; g++)
            for (int j = 0; j < 64 / VL; j++) tail[g][j] = (vf){0};
        if (full < len) {
            const int blk = full / BS, end = len - blk * BS;
            const scalar_t *vb = v_cache + (int64_t)table[blk] * blk_stride + h * head_stride;
            int t = full - blk * BS;
            for (; t + 1 < end; t += 2)
                for (int j = 0; j < 64 / VL; j++) {
                    const vu v = vload_pairs(vb + ((int64_t)(t / 2) * D + r + j * VL) * 2);
                    for (int g = 0; g < G; g++) {
                        uint32_t pair;
                        memcpy(&pair, &probs[g][blk * BS + t], 4);
                        tail[g][j] = dot_pairs(tail[g][j], v, pair);
                    }
                }
            if (t < end) /* an odd last token: its partner slot is unwritten, never multiplied */
                for (int j = 0; j < 64 / VL; j++) {
                    const vf v = pair_lo(vload_pairs(vb + ((int64_t)(t / 2) * D + r + j * VL) * 2));
                    for (int g = 0; g < G; g++) tail[g][j] += scores[g][blk * BS + t] * v;
                }
        }
        float o[G][64] __attribute__((aligned(64)));
        TSTORE(T_Q0, &o[0][0], 64 * 4);
        TSTORE(T_Q1, &o[0][16], 64 * 4);
        TSTORE(T_Q2, &o[0][32], 64 * 4);
        TSTORE(T_Q3, &o[0][48], 64 * 4);
        for (int g = 0; g < G; g++)
            for (int j = 0; j < 64 / VL; j++) {
                vf v;
                memcpy(&v, &o[g][j * VL], sizeof v);
                vstore(ob + g * D + r + j * VL, (v + tail[g][j]) * inv[g]);
            }
    }
}
#endif

/* One token's key and value of KV head h (D elements each, k already rotated) → cache
 * slot `slot` in the layouts the attention paths read (see rope_write_kv). */
static inline void write_token_kv(scalar_t *k_cache, scalar_t *v_cache, int64_t slot, int h, int64_t head_stride,
                                  int64_t blk_stride, const scalar_t *k, const scalar_t *v) {
    const int64_t blk = slot / BS, off = slot % BS;
    scalar_t *kdst = k_cache + blk * blk_stride + (int64_t)h * head_stride;
    scalar_t *vdst = v_cache + blk * blk_stride + (int64_t)h * head_stride;
#if PAIRED /* key dims 2i, 2i+1 at [blk][head][i][off][0..1]; value dim i at [blk][head][off/2][i][off%2] */
    for (int i = 0; i < D / 2; i++) memcpy(kdst + ((int64_t)i * BS + off) * 2, k + 2 * i, 2 * sizeof(scalar_t));
    for (int i = 0; i < D; i++) vdst[((off / 2) * D + i) * 2 + off % 2] = v[i];
#else /* key dim i at [blk][head][i][off]; value row at [blk][head][off] */
    for (int i = 0; i < D; i++) kdst[(int64_t)i * BS + off] = k[i];
    memcpy(vdst + off * D, v, sizeof(scalar_t) * D);
#endif
}

/* Decode attention over the paged KV cache, reading blocks in place (no gather, no
 * padding): for every row b and query head h,
 *
 *     out[b, h] = softmax(scale · q[b, h] · K[b]ᵀ) · V[b]      over the row's seq_lens[b] keys
 *
 * with K[b], V[b] the tokens [0, seq_lens[b]) of the row's blocks
 * block_tables[b, 0 .. ceil(seq_lens[b] / BS)). Rows of up to TWO_PASS_MAX keys keep
 * their scores and take the softmax in two passes (attend_two_pass); longer ones compute
 * it online, one block at a time (running max and sum: Milakov & Gimelshein 2018, "Online
 * normalizer calculation for softmax", §3). Either way each key and value is read once. The G query
 * heads of one KV head are one work item: they share every key and value load.
 *
 * q: [batch, heads · D] rows `q_stride` elements apart (heads = kv_heads · G);
 * out: the same shape, rows `out_stride` apart; block_tables: [batch, table_stride] int32;
 * seq_lens: [batch] int32, each >= 1. Keys past a row's length in its last block are
 * read but masked (they are finite: blocks are zeroed when a row takes them).
 *
 * new_slots (or NULL): each row's own new token is written to the cache first, at
 * new_slots[b], from new_k / new_v ([batch, kv_heads · D], rows `new_stride` apart; k
 * rotated), by the work item that then reads it: the lines of the row's last block are
 * fetched once, for the write, instead of once by a separate write pass and again here
 * (a decode token's key touches D/2 lines of its block in the pair layout).
 */
void decode_attention(const scalar_t *q, int64_t q_stride, scalar_t *k_cache, scalar_t *v_cache,
                      const int32_t *block_tables, int64_t table_stride, const int32_t *seq_lens,
                      scalar_t *out, int64_t out_stride, int batch, int kv_heads, float scale, int nthreads,
                      const scalar_t *new_k, const scalar_t *new_v, int64_t new_stride, const int64_t *new_slots) {
    const int64_t head_stride = (int64_t)D * BS;
    const int64_t blk_stride = (int64_t)kv_heads * head_stride;
    const int64_t items = (int64_t)batch * kv_heads;
#if AMX
    const int amx = amx_usable();
#endif
#pragma omp parallel num_threads(nthreads) if (nthreads > 1 && items > 1)
    {
#if AMX
    if (amx) amx_configure();
#endif
#pragma omp for schedule(dynamic, 1)
    for (int64_t item = 0; item < items; item++) {
        const int b = (int)(item / kv_heads), h = (int)(item % kv_heads);
        if (new_slots)
            write_token_kv(k_cache, v_cache, new_slots[b], h, head_stride, blk_stride,
                           new_k + b * new_stride + (int64_t)h * D, new_v + b * new_stride + (int64_t)h * D);
        if (seq_lens[b] <= TWO_PASS_MAX) {
#if AMX
            if (amx) {
                attend_two_pass_amx(q + b * q_stride + (int64_t)h * G * D, k_cache, v_cache,
                                    block_tables + b * table_stride, seq_lens[b], h, head_stride, blk_stride, scale,
                                    out + b * out_stride + (int64_t)h * G * D);
                continue;
            }
#endif
            attend_two_pass(q + b * q_stride + (int64_t)h * G * D, k_cache, v_cache, block_tables + b * table_stride,
                            seq_lens[b], h, head_stride, blk_stride, scale, out + b * out_stride + (int64_t)h * G * D);
            continue;
        }
        float qf[G][D], m[G], l[G];
        vf acc[G][DV];
        const scalar_t *qb = q + b * q_stride + (int64_t)h * G * D;
        for (int g = 0; g < G; g++) {
            for (int d = 0; d < D; d++) qf[g][d] = load(qb[g * D + d]) * scale;
            for (int j = 0; j < DV; j++) acc[g][j] = (vf){0};
            m[g] = -FLT_MAX;
            l[g] = 0.0f;
        }
#if PAIRED
        uint32_t qpair[G][D / 2]; /* q as bfloat16 pairs (unscaled: the scores are scaled after) */
        for (int g = 0; g < G; g++)
            for (int dp = 0; dp < D / 2; dp++) memcpy(&qpair[g][dp], qb + g * D + 2 * dp, 4);
#endif
        vi lane;
        for (int i = 0; i < VL; i++) lane[i] = i;
        const int len = seq_lens[b];
        const int32_t *table = block_tables + b * table_stride;
        for (int ahead = 0; ahead < PREFETCH_BLOCKS && ahead * BS < len; ahead++) { /* the first blocks */
            const int64_t at = (int64_t)table[ahead] * blk_stride + (int64_t)h * head_stride;
            for (int64_t off = 0; off < (int64_t)sizeof(scalar_t) * head_stride; off += 64) {
                __builtin_prefetch((const char *)(k_cache + at) + off);
                __builtin_prefetch((const char *)(v_cache + at) + off);
            }
        }
        for (int start = 0; start < len; start += BS) {
            const int n = len - start < BS ? len - start : BS;
            const int64_t base = (int64_t)table[start / BS] * blk_stride + (int64_t)h * head_stride;
            const scalar_t *kb = k_cache + base, *vb = v_cache + base;
            if (start + PREFETCH_BLOCKS * BS < len) { /* blocks lie anywhere in memory: ask for one a few ahead */
                const int64_t next = (int64_t)table[start / BS + PREFETCH_BLOCKS] * blk_stride + (int64_t)h * head_stride;
                const char *nk = (const char *)(k_cache + next), *nv = (const char *)(v_cache + next);
                for (int64_t off = 0; off < (int64_t)sizeof(scalar_t) * head_stride; off += 64) {
                    __builtin_prefetch(nk + off);
                    __builtin_prefetch(nv + off);
                }
            }
            vf s[G][KV];
            for (int g = 0; g < G; g++)
                for (int j = 0; j < KV; j++) s[g][j] = (vf){0};
#if PAIRED
            for (int dp = 0; dp < D / 2; dp++) { /* dims 2dp, 2dp+1 of BS keys, in pairs */
                for (int j = 0; j < KV; j++) {
                    const vu k = vload_pairs(kb + ((int64_t)dp * BS + j * VL) * 2);
                    for (int g = 0; g < G; g++) s[g][j] = dot_pairs(s[g][j], k, qpair[g][dp]);
                }
            }
            for (int g = 0; g < G; g++)
                for (int j = 0; j < KV; j++) s[g][j] *= scale;
#else
            for (int d = 0; d < D; d++) { /* keys of dimension d, BS of them side by side */
                for (int j = 0; j < KV; j++) {
                    const vf k = vload(kb + d * BS + j * VL);
                    for (int g = 0; g < G; g++) s[g][j] += qf[g][d] * k;
                }
            }
#endif
            float p[G][BS];
#if PAIRED
            uint32_t pp[G][BS / 2];
#endif
            for (int g = 0; g < G; g++) {
                float mx = m[g];
                for (int j = 0; j < KV; j++) {
                    const vi valid = lane + j * VL < n;
                    s[g][j] = vselect(valid, s[g][j], (vf){0} - FLT_MAX);
                    const float bm = vmax(s[g][j]);
                    mx = bm > mx ? bm : mx;
                }
                if (mx > m[g]) {
                    const float corr = exp_approx(m[g] - mx);
                    l[g] *= corr;
                    for (int j = 0; j < DV; j++) acc[g][j] *= corr;
                    m[g] = mx;
                }
                vf sum = {0};
                for (int j = 0; j < KV; j++) {
                    const vi valid = lane + j * VL < n;
                    const vf e = vexp(s[g][j] - mx);
                    const vf pj = vselect(valid, e, (vf){0});
                    sum += pj;
                    memcpy(&p[g][j * VL], &pj, sizeof pj);
#if PAIRED /* the probabilities as bfloat16, tokens side by side: exactly the pairs (t, t+1) */
                    const vh half = __builtin_convertvector((vu)vround(pj) >> 16, vh);
                    memcpy(&pp[g][j * VL / 2], &half, sizeof half);
#endif
                }
                l[g] += vsum(sum);
            }
#if PAIRED
            int t = 0;
            for (; t + 1 < n; t += 2) { /* tokens t, t+1 of every dim, in pairs */
                for (int j = 0; j < DV; j++) {
                    const vu v = vload_pairs(vb + ((int64_t)(t / 2) * D + j * VL) * 2);
                    for (int g = 0; g < G; g++) acc[g][j] = dot_pairs(acc[g][j], v, pp[g][t / 2]);
                }
            }
            if (t < n) { /* an odd last token: its partner slot is unwritten, never multiplied */
                for (int j = 0; j < DV; j++) {
                    const vf v = pair_lo(vload_pairs(vb + ((int64_t)(t / 2) * D + j * VL) * 2));
                    for (int g = 0; g < G; g++) acc[g][j] += p[g][t] * v;
                }
            }
#else
            for (int t = 0; t < n; t++) { /* value rows */
                vf v[DV];
                for (int j = 0; j < DV; j++) v[j] = vload(vb + t * D + j * VL);
                for (int g = 0; g < G; g++) {
                    const float pt = p[g][t];
                    for (int j = 0; j < DV; j++) acc[g][j] += pt * v[j];
                }
            }
#endif
        }
        scalar_t *ob = out + b * out_stride + (int64_t)h * G * D;
        for (int g = 0; g < G; g++) {
            const float inv = 1.0f / l[g];
            for (int j = 0; j < DV; j++) vstore(ob + g * D + j * VL, acc[g][j] * inv);
        }
    }
#if AMX
    if (amx) _tile_release(); /* back to the init state: nothing for a context switch to save */
#endif
    }
}

/* Which path decode_attention's two-pass rows take here: "amx-bf16" (tile multiplies),
 * "avx512-bf16" (vdpbf16ps), or "vector" (float32 vectors; AVX-512, AVX2 or portable). */
const char *decode_attention_isa(void) {
#if AMX
    if (amx_usable()) return "amx-bf16";
#endif
    return DPBF16 ? "avx512-bf16" : "vector";
}

/* Rotary position embedding (Su et al. 2021, "RoFormer", §3.4.2, in the half-split
 * layout of GPT-NeoX and Hugging Face's Llama: dimension i pairs with i + D/2) applied
 * to the query and key heads of a fused QKV projection, and the keys and values written
 * to their cache slots:
 *
 *     qkv[t] = [q heads (heads · D) | k heads (kv_heads · D) | v heads (kv_heads · D)]
 *     q heads rotated in place; rotated k and v → k_cache / v_cache at slot slots[t]
 *
 * cos_sin: [max_position, D] float32, row p = (cos θ_p,i for i < D/2 | sin θ_p,i for i < D/2),
 * from the model's own rotary embedding (so rope scaling variants are whatever it computes).
 * qkv: [ntok, ...] rows `qkv_stride` elements apart; positions and slots: [ntok] int64.
 * Tokens before `first_write` (decode rows whose attention writes their own key and
 * value: decode_attention's new_slots) get their keys rotated in place in qkv instead
 * and nothing written to the cache.
 */
void rope_write_kv(scalar_t *qkv, int64_t qkv_stride, int ntok, int heads, int kv_heads, const int64_t *positions,
                   const float *cos_sin, const int64_t *slots, scalar_t *k_cache, scalar_t *v_cache, int nthreads,
                   int first_write) {
    const int64_t head_stride = (int64_t)D * BS, blk_stride = (int64_t)kv_heads * head_stride;
#pragma omp parallel for num_threads(nthreads) schedule(static) if (nthreads > 1 && ntok > 64)
    for (int t = 0; t < ntok; t++) {
        const float *cs = cos_sin + positions[t] * D;
        scalar_t *row = qkv + (int64_t)t * qkv_stride;
        const int write = t >= first_write;
        for (int hh = 0; hh < heads + kv_heads; hh++) {
            scalar_t *x = row + (int64_t)hh * D;
            float y[D];
#if HALF % VL == 0
            for (int i = 0; i < HALF; i += VL) {
                vf c, s;
                memcpy(&c, cs + i, sizeof c);
                memcpy(&s, cs + HALF + i, sizeof s);
                const vf x1 = vload(x + i), x2 = vload(x + HALF + i);
                const vf y1 = x1 * c - x2 * s, y2 = x2 * c + x1 * s;
                memcpy(y + i, &y1, sizeof y1);
                memcpy(y + HALF + i, &y2, sizeof y2);
            }
#else
            for (int i = 0; i < HALF; i++) {
                const float x1 = load(x[i]), x2 = load(x[i + HALF]);
                y[i] = x1 * cs[i] - x2 * cs[HALF + i];
                y[i + HALF] = x2 * cs[i] + x1 * cs[HALF + i];
            }
#endif
            if (hh < heads || !write) { /* rotated in place */
                for (int i = 0; i < D; i += VL) {
                    vf v;
                    memcpy(&v, y + i, sizeof v);
                    vstore(x + i, v);
                }
            } else {
                scalar_t k[D];
                for (int i = 0; i < D; i++) k[i] = store(y[i]);
                write_token_kv(k_cache, v_cache, slots[t], hh - heads, head_stride, blk_stride, k,
                               row + (int64_t)(kv_heads + hh) * D); /* its value: kv_heads heads on */
            }
        }
    }
}

/* RMSNorm (Zhang & Sennrich 2019, "Root Mean Square Layer Normalization", eq. 4) of
 * residual + x, as a Llama decoder layer does between its blocks:
 *
 *     residual ← residual + x                    (when residual is not NULL)
 *     out      ← weight · (r / sqrt(mean(r²) + eps))
 *
 * rounded where Hugging Face's LlamaRMSNorm rounds (the normalised value is rounded to
 * the model dtype before the weight multiplies it). x, residual, out: [ntok, hidden]
 * contiguous; out may be x.
 */
void add_rms_norm(const scalar_t *x, scalar_t *residual, const scalar_t *weight, scalar_t *out, int ntok, int hidden,
                  float eps, int nthreads) {
#pragma omp parallel for num_threads(nthreads) schedule(static) if (nthreads > 1 && (int64_t)ntok * hidden >= 32768)
    for (int t = 0; t < ntok; t++) {
        const scalar_t *xr = x + (int64_t)t * hidden;
        scalar_t *rr = residual ? residual + (int64_t)t * hidden : 0;
        scalar_t *o = out + (int64_t)t * hidden;
        const scalar_t *src = rr ? rr : xr;
        vf ss = {0};
        int i = 0;
        for (; i + VL <= hidden; i += VL) {
            vf v = vload(xr + i);
            if (rr) {
                v = vround(vload(rr + i) + v);
                vstore(rr + i, v);
            }
            ss += v * v;
        }
        float tail = 0.0f;
        for (; i < hidden; i++) {
            float v = load(xr[i]);
            if (rr) {
                rr[i] = store(load(rr[i]) + v);
                v = load(rr[i]);
            }
            tail += v * v;
        }
        const float inv = 1.0f / sqrtf((vsum(ss) + tail) / (float)hidden + eps);
        for (i = 0; i + VL <= hidden; i += VL) vstore(o + i, vload(weight + i) * vround(vload(src + i) * inv));
        for (; i < hidden; i++) o[i] = store(load(weight[i]) * load(store(load(src[i]) * inv)));
    }
}

/* SwiGLU's gate (Shazeer 2020, "GLU Variants Improve Transformer", eq. 6): for a fused
 * gate/up projection gate_up [ntok, 2 · inter] = [gate | up],
 *
 *     out[t, i] = silu(gate[t, i]) · up[t, i],    silu(x) = x / (1 + e^-x)
 *
 * rounded after the silu and after the product, as the unfused PyTorch ops round.
 * out: [ntok, inter] contiguous.
 */
void silu_and_mul(const scalar_t *gate_up, scalar_t *out, int ntok, int inter, int nthreads) {
#pragma omp parallel for num_threads(nthreads) schedule(static) if (nthreads > 1 && (int64_t)ntok * inter >= 16384)
    for (int t = 0; t < ntok; t++) {
        const scalar_t *g = gate_up + (int64_t)t * 2 * inter, *u = g + inter;
        scalar_t *o = out + (int64_t)t * inter;
        int i = 0;
        for (; i + VL <= inter; i += VL) {
            const vf x = vload(g + i), up = vload(u + i);
            vstore(o + i, vround(x / (1.0f + vexp(-x))) * up);
        }
        for (; i < inter; i++) {
            const float x = load(g[i]);
            const float a = load(store(x / (1.0f + exp_approx(-x))));
            o[i] = store(a * load(u[i]));
        }
    }
}

/* Greedy decoding's argmax: out[r] = the first index of the largest of x[r, 0 .. cols)
 * (torch.argmax's tie rule), for float32 logits rows `stride` elements apart. */
void argmax_rows(const float *x, int64_t stride, int rows, int cols, int64_t *out, int nthreads) {
#pragma omp parallel for num_threads(nthreads) schedule(static) if (nthreads > 1 && rows > 1)
    for (int r = 0; r < rows; r++) {
        const float *row = x + (int64_t)r * stride;
        int i = 0;
        float best = -FLT_MAX;
        if (cols >= VL) {
            vf m;
            memcpy(&m, row, sizeof m);
            for (i = VL; i + VL <= cols; i += VL) {
                vf v;
                memcpy(&v, row + i, sizeof v);
                m = vselect(v > m, v, m);
            }
            best = vmax(m);
        }
        for (; i < cols; i++) best = row[i] > best ? row[i] : best;
        int64_t at = 0;
        for (int j = 0; j < cols; j++)
            if (row[j] == best) {
                at = j;
                break;
            }
        out[r] = at;
    }
}

/* ------------------------------------------------------------------ a decode step's layers */

/* qmatmul.c's entry point (another library, built per dtype; its address comes from the
 * caller): y[M, N] = x[M, K] · Wᵀ + bias on packed low-bit tiles; 0, or -1 without memory. */
typedef int (*qmatmul_fn)(int fmt, const uint8_t *w, int n, int k, const scalar_t *x, int64_t ldx, int m,
                          const float *bias, void *y, int64_t ldy, int out_f32, int nthreads);

/* A packed low-bit projection (engine_proc.quant.PackedWeight); every field 8 bytes, so
 * the ctypes mirror (engine_proc.backends.decode_loop) has no padding to agree on. */
struct packed_linear {
    int64_t fmt, out_features, in_features;
    const uint8_t *data;
    const float *bias; /* [out_features] float32, or NULL */
};

struct decode_layer {
    const scalar_t *ln1, *ln2; /* the two RMSNorm weights, [hidden] */
    double eps1, eps2;
    struct packed_linear qkv, o, gate_up, down; /* q|k|v and gate|up fused along the output */
    scalar_t *k_cache, *v_cache;                 /* this layer's KV cache (layout at the top) */
};

/* The decoder layers of one decode-only step, all in C: per layer the same kernel calls,
 * in the same order and on the same buffers, as engine_proc/backends/llama_runner.py's
 * loop (so the same numbers, bit for bit), without a return to Python between them.
 * At one row a layer's arithmetic takes tens of microseconds and each of its ten calls
 * from Python cost several more.
 *
 * batch rows, one token each (positions, slots [batch] int64; block_tables [batch,
 * table_stride] int32; seq_lens [batch] int32, counting the new token). residual
 * [batch, hidden] holds the embeddings on entry and the residual stream after the last
 * layer's attention block on return; x [batch, hidden] the last layer's MLP output (the
 * caller adds the two before the final norm). h [batch, hidden], qkv [batch,
 * (heads + 2 · kv_heads) · D], attn [batch, heads · D], gate_up [batch, 2 · inter], act
 * [batch, inter]: scratch, all contiguous. Returns 0, or -1 when qmatmul found no memory. */
int decode_layers(qmatmul_fn qmatmul, const struct decode_layer *layers, int nlayers, int batch, int hidden,
                  int heads, int kv_heads, int inter, scalar_t *residual, scalar_t *x, scalar_t *h, scalar_t *qkv,
                  scalar_t *attn, scalar_t *gate_up, scalar_t *act, const int64_t *positions, const float *cos_sin,
                  const int64_t *slots, const int32_t *block_tables, int64_t table_stride, const int32_t *seq_lens,
                  float scale, int nthreads) {
    const int hd = heads * D, kvd = kv_heads * D, width = hd + 2 * kvd;
    for (int i = 0; i < nlayers; i++) {
        const struct decode_layer *L = layers + i;
        /* the first layer normalizes the embeddings; the others add the last MLP output first */
        add_rms_norm(i ? x : residual, i ? residual : 0, L->ln1, h, batch, hidden, (float)L->eps1, nthreads);
        if (qmatmul((int)L->qkv.fmt, L->qkv.data, width, hidden, h, hidden, batch, L->qkv.bias, qkv, width, 0,
                    nthreads))
            return -1;
        /* every row is a decode row: keys rotated in place, each written by its attention */
        rope_write_kv(qkv, width, batch, heads, kv_heads, positions, cos_sin, slots, L->k_cache, L->v_cache, nthreads,
                      batch);
        decode_attention(qkv, width, L->k_cache, L->v_cache, block_tables, table_stride, seq_lens, attn, hd, batch,
                         kv_heads, scale, nthreads, qkv + hd, qkv + hd + kvd, width, slots);
        if (qmatmul((int)L->o.fmt, L->o.data, hidden, hd, attn, hd, batch, L->o.bias, x, hidden, 0, nthreads))
            return -1;
        add_rms_norm(x, residual, L->ln2, h, batch, hidden, (float)L->eps2, nthreads);
        if (qmatmul((int)L->gate_up.fmt, L->gate_up.data, 2 * inter, hidden, h, hidden, batch, L->gate_up.bias,
                    gate_up, 2 * inter, 0, nthreads))
            return -1;
        silu_and_mul(gate_up, act, batch, inter, nthreads);
        if (qmatmul((int)L->down.fmt, L->down.data, hidden, inter, act, inter, batch, L->down.bias, x, hidden, 0,
                    nthreads))
            return -1;
    }
    return 0;
}
