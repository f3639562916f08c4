/* tickserve's low-bit matmul: y = x · Wᵀ (+ bias) with W in 4-bit or 8-bit blocks of 32
 * weights along the input dimension, as GGUF's Q4_0 / Q4_1 / Q8_0 hold them, computed on
 * the quantized weights themselves (never de-quantized to memory).
 *
 * Compiled at run time by engine_proc/kernels/build.py like cpu_kernels.c, once per
 * activation dtype (-DSCALAR_BF16=0|1), with -march=native: AVX-512 VNNI where the CPU
 * has it, AVX2 otherwise, portable C elsewhere (one packed layout for all three).
 *
 * Arithmetic (the scheme of llama.cpp's CPU backend, ggml-quants.c: "vec_dot_q4_1_q8_1"):
 * each row of x is quantized on the fly, per 16 inputs (half a weight block), to int8
 * with a float scale (da = max|x| / 127, qa = round(x / da)), so a block's dot product is
 * two integer dot products and three float multiply-adds:
 *
 *     Q4 block  w = dw·qw + mw,  qw ∈ [0, 15]:   Σ w·x ≈ dw·Σ_h da_h·Σ_h qw·qa + mw·Σ_h da_h·Σ_h qa
 *     Q8 block  w = dw·qw,       qw ∈ [-127, 127]: Σ w·x ≈ dw·Σ_h da_h·Σ_h qw·qa
 *
 * Q4_0 (w = d·(q − 8)) is the Q4 form with mw = −8·dw, exactly (a power of two).
 * The integer products use vpdpbusd (u8 × s8 → s32, four products a lane): Q4's nibbles
 * are the unsigned operand as they are; Q8's signed weights are made unsigned by adding
 * 128 (an xor of the sign bit) and the extra 128·Σ qa is taken off with the scale.
 *
 * Packed layout ("tiles"): the weight's N output rows in tiles of 16 (one vector lane
 * each), each tile holding its K/32 blocks one after another; one tile-block is
 *
 *     Q4 (320 bytes): 256 bytes of nibbles, byte 64·v + 4·n + j (v < 4, n < 16, j < 4)
 *                     holding qw[n][4v + j] in its low nibble and qw[n][16 + 4v + j] in
 *                     its high one; then dw[16] and mw[16] as float16
 *     Q8 (544 bytes): 512 bytes, byte 64·v + 4·n + j (v < 8) = qw[n][4v + j] as int8;
 *                     then dw[16] as float16
 *
 * so one 64-byte load is the weights of 16 rows × 4 inputs: vpdpbusd's operand, with one
 * broadcast dword of qa. engine_proc/quant.py packs and unpacks this layout.
 *
 * Threads: the tiles are split across `nthreads` (OpenMP, torch's runtime, as in
 * cpu_kernels.c); each thread runs every row of x over its tiles, MR rows at a time, so
 * a tile's weights are unpacked once per MR rows and read from memory once per call.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if SCALAR_BF16
typedef uint16_t scalar_t;
#else
typedef float scalar_t;
#endif

static inline float load_scalar(scalar_t x) {
#if SCALAR_BF16
    uint32_t u = (uint32_t)x << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
#else
    return x;
#endif
}

static inline scalar_t store_scalar(float f) {
#if SCALAR_BF16
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (scalar_t)((u >> 16) | 0x40u);
    u += 0x7fffu + ((u >> 16) & 1u);
    return (scalar_t)(u >> 16);
#else
    return f;
#endif
}

static inline float half_to_float(uint16_t h) {
    const uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
    uint32_t exp = (h >> 10) & 0x1fu, mant = h & 0x3ffu, u;
    if (exp == 0) {
        if (mant == 0) {
            u = sign;
        } else { /* subnormal: normalise */
            exp = 127 - 15 + 1;
            while (!(mant & 0x400u)) {
                mant <<= 1;
                exp--;
            }
            u = sign | (exp << 23) | ((mant & 0x3ffu) << 13);
        }
    } else if (exp == 31) {
        u = sign | 0x7f800000u | (mant << 13);
    } else {
        u = sign | ((exp + 127 - 15) << 23) | (mant << 13);
    }
    float f;
    memcpy(&f, &u, 4);
    return f;
}

#define TILE 16
#define QB 32
#define HB 16 /* inputs per activation scale: half a weight block */
#define Q4_BYTES 320
#define Q8_BYTES 544
#define FMT_Q4 0
#define FMT_Q8 1

/* ------------------------------------------------------------------ activation quantization */

#if defined(__AVX512F__) && defined(__AVX512BW__)
#include <immintrin.h>
/* One half-block: x[0 .. HB) → q[0 .. HB) int8, *sum = Σ q; returns the scale da.
 * AVX-512: the scalar arithmetic sixteen inputs at a time — vcvtps2dq rounds to nearest
 * even as nearbyintf does under the default rounding mode, and the clamp is the same, so
 * codes and scales are bit-identical. Scalar, quantization took ~20 % of a 64-row pass
 * (84 µs for 64 × 576 inputs; 24 µs so). */
static inline float quantize_half(const scalar_t *x, int8_t *q, int *sum) {
#if SCALAR_BF16
    const __m512 v = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)x)), 16));
#else
    const __m512 v = _mm512_loadu_ps(x);
#endif
    const float amax = _mm512_reduce_max_ps(_mm512_abs_ps(v));
    const float d = amax / 127.0f, id = d > 0.0f ? 1.0f / d : 0.0f;
    const __m512i qi = _mm512_max_epi32(
        _mm512_min_epi32(_mm512_cvtps_epi32(_mm512_mul_ps(v, _mm512_set1_ps(id))), _mm512_set1_epi32(127)),
        _mm512_set1_epi32(-127));
    _mm_storeu_si128((__m128i *)q, _mm512_cvtsepi32_epi8(qi));
    *sum = _mm512_reduce_add_epi32(qi);
    return d;
}
#else
static inline float quantize_half(const scalar_t *x, int8_t *q, int *sum) {
    float v[HB], amax = 0.0f;
    for (int i = 0; i < HB; i++) {
        v[i] = load_scalar(x[i]);
        const float a = fabsf(v[i]);
        amax = a > amax ? a : amax;
    }
    const float d = amax / 127.0f, id = d > 0.0f ? 1.0f / d : 0.0f;
    *sum = 0;
    for (int i = 0; i < HB; i++) {
        const int qi = (int)nearbyintf(v[i] * id);
        q[i] = (int8_t)(qi > 127 ? 127 : qi < -127 ? -127 : qi);
        *sum += q[i];
    }
    return d;
}
#endif

/* Row r of x ([M, K], rows `ldx` apart) → qa[r·K ..] int8 with one scale per 16 inputs,
 * da[r·2nb + h] (h: the half-block), and sa[r·nb + b] = Σ over the block's two halves of
 * da · Σ qa. Half-blocks: an outlier costs the precision of 15 neighbours, not 31 (on
 * SmolLM2 in bfloat16, top-1 agreement with the de-quantized weights 0.94 → 0.95). */
static void quantize_rows(const scalar_t *x, int64_t ldx, int M, int K, int8_t *qa, float *da, float *sa) {
    const int nb = K / QB;
    for (int r = 0; r < M; r++) {
        const scalar_t *xr = x + (int64_t)r * ldx;
        for (int b = 0; b < nb; b++) {
            float block_sum = 0.0f;
            for (int h = 0; h < 2; h++) {
                const int at = b * QB + h * HB;
                int sum;
                const float d = quantize_half(xr + at, qa + (int64_t)r * K + at, &sum);
                da[(int64_t)r * 2 * nb + 2 * b + h] = d;
                block_sum += d * (float)sum;
            }
            sa[(int64_t)r * nb + b] = block_sum;
        }
    }
}

static inline void store_tile(float *acc, const float *bias, void *y, int64_t ldy, int r, int n0, int out_f32) {
    if (bias)
        for (int n = 0; n < TILE; n++) acc[n] += bias[n0 + n];
    if (out_f32) {
        memcpy((float *)y + (int64_t)r * ldy + n0, acc, TILE * sizeof(float));
    } else {
        scalar_t *yr = (scalar_t *)y + (int64_t)r * ldy + n0;
        for (int n = 0; n < TILE; n++) yr[n] = store_scalar(acc[n]);
    }
}

/* ------------------------------------------------------------------ AVX-512 VNNI */
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
#include <immintrin.h>
#define ISA "avx512vnni"
#define MR 8

/* One tile over `rows` (≤ MR, a constant after inlining) rows of quantized x.
 *
 * Per block the tile's weights are unpacked once into eight vectors (Q4: four of low and
 * four of high nibbles; Q8: the eight 64-byte groups), then each row takes its eight
 * vpdpbusd into two integer sums and folds them into its float accumulator at once.
 * Only the weights, one row's two sums and the MR accumulators are live (about 20 of
 * the 32 vector registers): keeping every row's sums across the block instead needs
 * 8 + 2·MR + MR registers and spilled (measured at 64 rows: Q8 1.4x, Q4 1.1x slower). */
static inline __attribute__((always_inline)) void tile_rows(int fmt, const uint8_t *w, int nb, const int8_t *qa,
                                                            const float *da, const float *sa, int K, int rows,
                                                            __m512 *acc) {
    const __m512i low = _mm512_set1_epi8(0x0f), flip = _mm512_set1_epi8((char)0x80);
    for (int r = 0; r < rows; r++) acc[r] = _mm512_setzero_ps();
    const int step = fmt == FMT_Q4 ? Q4_BYTES : Q8_BYTES;
    for (int b = 0; b < nb; b++, w += step) {
        __m512i wv[8]; /* wv[0..3]: inputs 0-15 of the block (4 a vector), wv[4..7]: inputs 16-31 */
        if (fmt == FMT_Q4) {
            for (int v = 0; v < 4; v++) {
                const __m512i raw = _mm512_loadu_si512(w + 64 * v);
                wv[v] = _mm512_and_si512(raw, low);
                wv[4 + v] = _mm512_and_si512(_mm512_srli_epi16(raw, 4), low);
            }
        } else {
            for (int v = 0; v < 8; v++) wv[v] = _mm512_xor_si512(_mm512_loadu_si512(w + 64 * v), flip); /* q + 128 */
        }
        const int off = fmt == FMT_Q4 ? 256 : 512;
        const __m512 dw = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(w + off)));
        const __m512 mw = fmt == FMT_Q4 ? _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(w + off + 32)))
                                        : _mm512_mul_ps(dw, _mm512_set1_ps(-128.0f));
        for (int r = 0; r < rows; r++) {
            const int8_t *q = qa + (int64_t)r * K + b * QB;
            __m512i lo_dot = _mm512_setzero_si512(), hi_dot = _mm512_setzero_si512();
            for (int v = 0; v < 4; v++) {
                int32_t a_lo, a_hi;
                memcpy(&a_lo, q + 4 * v, 4);
                memcpy(&a_hi, q + 16 + 4 * v, 4);
                lo_dot = _mm512_dpbusd_epi32(lo_dot, wv[v], _mm512_set1_epi32(a_lo));
                hi_dot = _mm512_dpbusd_epi32(hi_dot, wv[4 + v], _mm512_set1_epi32(a_hi));
            }
            const float *d = da + (int64_t)r * 2 * nb + 2 * b;
            acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(lo_dot), _mm512_mul_ps(dw, _mm512_set1_ps(d[0])), acc[r]);
            acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(hi_dot), _mm512_mul_ps(dw, _mm512_set1_ps(d[1])), acc[r]);
            acc[r] = _mm512_fmadd_ps(mw, _mm512_set1_ps(sa[(int64_t)r * nb + b]), acc[r]);
        }
    }
}

static inline __attribute__((always_inline)) void tile_block(int fmt, const uint8_t *w, int nb, const int8_t *qa,
                                                             const float *da, const float *sa, int K, int rows,
                                                             const float *bias, void *y, int64_t ldy, int n0,
                                                             int out_f32) {
    __m512 acc[MR];
    tile_rows(fmt, w, nb, qa, da, sa, K, rows, acc);
    for (int r = 0; r < rows; r++) {
        float out[TILE];
        _mm512_storeu_ps(out, acc[r]);
        store_tile(out, bias, y, ldy, r, n0, out_f32);
    }
}

/* ------------------------------------------------------------------ AVX2 */
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#define ISA "avx2"
#define MR 2

/* u8 × s8 → s32 lanes, four products each; |u| ≤ 127 keeps vpmaddubsw's s16 pairs exact. */
static inline __m256i dot4(__m256i acc, __m256i u, __m256i a) {
    return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(u, a), _mm256_set1_epi16(1)));
}

static inline __attribute__((always_inline)) void tile_block(int fmt, const uint8_t *w, int nb, const int8_t *qa,
                                                             const float *da, const float *sa, int K, int rows,
                                                             const float *bias, void *y, int64_t ldy, int n0,
                                                             int out_f32) {
    __m256 acc[MR][2];
    const __m256i low = _mm256_set1_epi8(0x0f);
    for (int r = 0; r < rows; r++) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
    const int step = fmt == FMT_Q4 ? Q4_BYTES : Q8_BYTES;
    for (int b = 0; b < nb; b++, w += step) {
        __m256i dot[MR][2][2]; /* [row][tile rows 0-7 | 8-15][inputs 0-15 | 16-31] */
        for (int r = 0; r < rows; r++) dot[r][0][0] = dot[r][0][1] = dot[r][1][0] = dot[r][1][1] = _mm256_setzero_si256();
        if (fmt == FMT_Q4) {
            for (int v = 0; v < 4; v++) {
                for (int h = 0; h < 2; h++) { /* rows 0-7, 8-15 of the tile */
                    const __m256i raw = _mm256_loadu_si256((const __m256i *)(w + 64 * v + 32 * h));
                    const __m256i lo = _mm256_and_si256(raw, low);
                    const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(raw, 4), low);
                    for (int r = 0; r < rows; r++) {
                        const int8_t *q = qa + (int64_t)r * K + b * QB;
                        int32_t a_lo, a_hi;
                        memcpy(&a_lo, q + 4 * v, 4);
                        memcpy(&a_hi, q + 16 + 4 * v, 4);
                        dot[r][h][0] = dot4(dot[r][h][0], lo, _mm256_set1_epi32(a_lo));
                        dot[r][h][1] = dot4(dot[r][h][1], hi, _mm256_set1_epi32(a_hi));
                    }
                }
            }
        } else { /* signed weights: |w| as the unsigned operand, w's sign moved onto x */
            for (int v = 0; v < 8; v++) {
                for (int h = 0; h < 2; h++) {
                    const __m256i q = _mm256_loadu_si256((const __m256i *)(w + 64 * v + 32 * h));
                    const __m256i u = _mm256_sign_epi8(q, q);
                    for (int r = 0; r < rows; r++) {
                        int32_t a;
                        memcpy(&a, qa + (int64_t)r * K + b * QB + 4 * v, 4);
                        dot[r][h][v >= 4] = dot4(dot[r][h][v >= 4], u, _mm256_sign_epi8(_mm256_set1_epi32(a), q));
                    }
                }
            }
        }
        const int off = fmt == FMT_Q4 ? 256 : 512;
        for (int h = 0; h < 2; h++) {
            const __m256 dw = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(w + off + 16 * h)));
            const __m256 mw = fmt == FMT_Q4 ? _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(w + off + 32 + 16 * h)))
                                            : _mm256_setzero_ps();
            for (int r = 0; r < rows; r++) {
                const float *d = da + (int64_t)r * 2 * nb + 2 * b;
                acc[r][h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot[r][h][0]), _mm256_mul_ps(dw, _mm256_set1_ps(d[0])),
                                            acc[r][h]);
                acc[r][h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot[r][h][1]), _mm256_mul_ps(dw, _mm256_set1_ps(d[1])),
                                            acc[r][h]);
                acc[r][h] = _mm256_fmadd_ps(mw, _mm256_set1_ps(sa[(int64_t)r * nb + b]), acc[r][h]);
            }
        }
    }
    for (int r = 0; r < rows; r++) {
        float out[TILE];
        _mm256_storeu_ps(out, acc[r][0]);
        _mm256_storeu_ps(out + 8, acc[r][1]);
        store_tile(out, bias, y, ldy, r, n0, out_f32);
    }
}

/* ------------------------------------------------------------------ portable C */
#else
#define ISA "generic"
#define MR 4

static inline void tile_block(int fmt, const uint8_t *w, int nb, const int8_t *qa, const float *da, const float *sa,
                              int K, int rows, const float *bias, void *y, int64_t ldy, int n0, int out_f32) {
    float acc[MR][TILE];
    memset(acc, 0, sizeof acc);
    const int step = fmt == FMT_Q4 ? Q4_BYTES : Q8_BYTES;
    for (int b = 0; b < nb; b++, w += step) {
        const int off = fmt == FMT_Q4 ? 256 : 512;
        float dw[TILE], mw[TILE];
        for (int n = 0; n < TILE; n++) {
            uint16_t h;
            memcpy(&h, w + off + 2 * n, 2);
            dw[n] = half_to_float(h);
            if (fmt == FMT_Q4) {
                memcpy(&h, w + off + 32 + 2 * n, 2);
                mw[n] = half_to_float(h);
            } else {
                mw[n] = 0.0f;
            }
        }
        for (int r = 0; r < rows; r++) {
            const int8_t *q = qa + (int64_t)r * K + b * QB;
            for (int n = 0; n < TILE; n++) {
                int32_t dot[2] = {0, 0};
                for (int k = 0; k < QB; k++) {
                    int qw;
                    if (fmt == FMT_Q4) {
                        const int v = (k % 16) / 4, j = k % 4;
                        const uint8_t byte = w[64 * v + 4 * n + j];
                        qw = k < 16 ? (byte & 0x0f) : (byte >> 4);
                    } else {
                        qw = (int8_t)w[64 * (k / 4) + 4 * n + k % 4];
                    }
                    dot[k / HB] += qw * q[k];
                }
                const float *d = da + (int64_t)r * 2 * nb + 2 * b;
                acc[r][n] += dw[n] * (d[0] * (float)dot[0] + d[1] * (float)dot[1]) + mw[n] * sa[(int64_t)r * nb + b];
            }
        }
    }
    for (int r = 0; r < rows; r++) store_tile(acc[r], bias, y, ldy, r, n0, out_f32);
}
#endif

/* ------------------------------------------------------------------ AMX (bfloat16 tiles) */
/* On a CPU with AMX and bfloat16 activations, passes of AMX_MIN_ROWS rows or more run on
 * the tile unit instead: each tile-block (32 inputs of 16 output rows) is de-quantized
 * in registers to bfloat16, w = dw·qw + mw (Q8: dw·qw) rounded to nearest even, straight
 * into the pair layout tdpbf16ps takes as its B operand (one 1 KB tile: 16 rows of input
 * pairs × 16 outputs), and multiplied with the activations in bfloat16, accumulating in
 * float32. Memory still sees only the packed bytes (Q4: a quarter of bfloat16's), so a
 * 64-row pass is bound by the tile unit's arithmetic instead of by reading a bfloat16
 * copy of the weight, and the de-quantization is paid once per tile, not per row.
 * Blocking: 2 × 2 tiles (32 rows of x × 32 outputs) per step, the four accumulators in
 * tile registers over the whole input dimension; every output still belongs to one
 * thread, so results do not depend on the thread count (passes of up to 64 rows take the
 * column loop instead: see run_tiles_amx_column). Rows are padded to 16 with zeros in a
 * scratch copy of x. Different rounding from the int8 path (bfloat16 weights and
 * activations instead of int8 activations): a pass size picks one of the two, as the
 * crossover picks between low-bit and dense. */
#if SCALAR_BF16 && defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__)
#define AMX 1
#ifndef AMX_MIN_ROWS
/* over a decode step's weights read from memory, one thread: 8 rows 13.5 ms on the tiles
 * against 17.2 on int8 vectors, 12 rows 13.9 against 21.3, 4 rows 13.3 against 13.7;
 * 1-3 rows are faster on the vectors */
#define AMX_MIN_ROWS 4
#endif
#include <sys/syscall.h>
#include <unistd.h>

static int amx_permitted = 0; /* 0 not asked yet, 1 granted, -1 refused */

static int amx_usable(void) {
    if (!amx_permitted) /* ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA (Linux 5.16+) */
        amx_permitted = syscall(SYS_arch_prctl, 0x1023, 18) == 0 ? 1 : -1;
    return amx_permitted > 0;
}

struct tile_config {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
};

static void amx_configure(void) { /* all eight tiles 16 rows × 64 bytes */
    struct tile_config c;
    memset(&c, 0, sizeof c);
    c.palette = 1;
    for (int t = 0; t < 8; t++) c.rows[t] = 16, c.colsb[t] = 64;
    /* ldtilecfg reads all 64 bytes, but GCC's _tile_loadconfig tells the compiler of 8
     * only, so without this the stores to rows and colsb may be dropped as dead (seen:
     * a #GP on ldtilecfg once the function was inlined differently) */
    __asm__ volatile("" : : "r"(&c) : "memory");
    _tile_loadconfig(&c);
}

/* f_a, f_b: 16 outputs' weights at inputs 2p and 2p + 1 → row p of a B tile (dword n =
 * bf16(f_a[n]) | bf16(f_b[n]) << 16). */
static inline void store_pair(uint16_t *row, __m512 fa, __m512 fb, __m512i interleave) {
    const __m512i both = (__m512i)_mm512_cvtne2ps_pbh(fb, fa); /* fa in elements 0-15, fb in 16-31 */
    _mm512_store_si512((__m512i *)row, _mm512_permutexvar_epi16(interleave, both));
}

/* One tile-block → one B tile of bfloat16 (512 elements) at buf. */
static inline void unpack_block(int fmt, const uint8_t *w, uint16_t *buf, __m512i interleave) {
    const __m512 codes = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    const int off = fmt == FMT_Q4 ? 256 : 512;
    const __m512 dw = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(w + off)));
    if (fmt == FMT_Q4) {
        const __m512 mw = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(w + off + 32)));
        for (int v = 0; v < 4; v++) { /* byte j of dword n: qw[n][4v + j] (low), qw[n][16 + 4v + j] (high) */
            const __m512i raw = _mm512_loadu_si512(w + 64 * v);
            for (int h = 0; h < 2; h++) {
                __m512 f[4];
                for (int j = 0; j < 4; j++) { /* vpermps reads an index's low 4 bits: the nibble, as a float */
                    const __m512i q = _mm512_srli_epi32(raw, 8 * j + 4 * h);
                    f[j] = _mm512_fmadd_ps(_mm512_permutexvar_ps(q, codes), dw, mw);
                }
                store_pair(buf + 32 * (8 * h + 2 * v), f[0], f[1], interleave);
                store_pair(buf + 32 * (8 * h + 2 * v + 1), f[2], f[3], interleave);
            }
        }
    } else {
        for (int v = 0; v < 8; v++) { /* byte j of dword n: qw[n][4v + j], signed */
            const __m512i raw = _mm512_loadu_si512(w + 64 * v);
            __m512 f[4];
            for (int j = 0; j < 4; j++) {
                const __m512i q = _mm512_srai_epi32(_mm512_slli_epi32(raw, 24 - 8 * j), 24);
                f[j] = _mm512_mul_ps(_mm512_cvtepi32_ps(q), dw);
            }
            store_pair(buf + 32 * (2 * v), f[0], f[1], interleave);
            store_pair(buf + 32 * (2 * v + 1), f[2], f[3], interleave);
        }
    }
}

static inline __m512i pair_interleave(void) {
    uint16_t idx[32];
    for (int n = 0; n < 16; n++) idx[2 * n] = (uint16_t)n, idx[2 * n + 1] = (uint16_t)(16 + n);
    return _mm512_loadu_si512(idx);
}

/* One 16 × 16 float32 accumulator tile (rows `rows` of it valid) → y, with the bias. */
static void store_acc(const float *acc, int rows, const float *bias, void *y, int64_t ldy, int r0, int n0,
                      int out_f32) {
    const __m512 b = bias ? _mm512_loadu_ps(bias + n0) : _mm512_setzero_ps();
    for (int r = 0; r < rows; r++) {
        const __m512 v = _mm512_add_ps(_mm512_load_ps(acc + 16 * r), b);
        if (out_f32)
            _mm512_storeu_ps((float *)y + (int64_t)(r0 + r) * ldy + n0, v);
        else
            _mm256_storeu_si256((__m256i *)((scalar_t *)y + (int64_t)(r0 + r) * ldy + n0), (__m256i)_mm512_cvtneps_pbh(v));
    }
}

/* Tiles [t0, t1) of W for the Mpad (a multiple of 16) rows of xa ([Mpad, K] bfloat16).
 *
 * Software-pipelined: while the tile unit multiplies one pair of tiles, the vector units
 * de-quantize the next pair, a share of its blocks after each step, so the two overlap
 * instead of taking turns (de-quantizing a pair costs about as much as multiplying it by
 * 64 rows). `buf` holds two pairs: 4 · nb B tiles. */
static void run_tiles_amx(int fmt, const uint8_t *w, int t0, int t1, int nb, const uint16_t *xa, int Mpad, int M,
                          int K, const float *bias, void *y, int64_t ldy, int out_f32, uint16_t *buf) {
    const int step = fmt == FMT_Q4 ? Q4_BYTES : Q8_BYTES;
    const int64_t lda = (int64_t)K * 2, tile_bytes = (int64_t)nb * step; /* bytes */
    const __m512i interleave = pair_interleave();
    float acc[256] __attribute__((aligned(64)));
    uint16_t *cur = buf, *nxt = buf + (size_t)2 * nb * 512;
    amx_configure();
    for (int i = 0; i < nb * (t0 + 1 < t1 ? 2 : 1); i++) /* the first pair, before any multiply */
        unpack_block(fmt, w + t0 * tile_bytes + (int64_t)i * step, cur + (size_t)i * 512, interleave);
    const int chunks = (Mpad + 31) / 32, steps = chunks * nb;
    for (int t = t0; t < t1; t += 2) {
        const int pair = t + 1 < t1;
        const int next = t + 2 < t1 ? (t + 3 < t1 ? 2 : 1) : 0; /* tiles in the next pair */
        const int units = next * nb;                             /* its blocks to unpack */
        const uint8_t *wn = w + (t + 2) * tile_bytes;           /* its tiles' bytes follow each other */
        int done = 0, s = 0;
        uint16_t *b0 = cur, *b1 = cur + (size_t)nb * 512;
        for (int m0 = 0; m0 < Mpad; m0 += 32) {
            const int two = m0 + 16 < Mpad;
            const uint16_t *a0 = xa + (int64_t)m0 * K, *a1 = a0 + (int64_t)16 * K;
            _tile_zero(4);
            _tile_zero(5);
            _tile_zero(6);
            _tile_zero(7);
            for (int b = 0; b < nb; b++, s++) { /* tiles: 0, 1 x; 2, 3 weights; 4-7 accumulators */
                _tile_loadd(0, a0 + 32 * b, lda);
                _tile_loadd(2, b0 + 512 * b, 64);
                _tile_dpbf16ps(4, 0, 2);
                if (two) {
                    _tile_loadd(1, a1 + 32 * b, lda);
                    _tile_dpbf16ps(6, 1, 2);
                }
                if (pair) {
                    _tile_loadd(3, b1 + 512 * b, 64);
                    _tile_dpbf16ps(5, 0, 3);
                    if (two) _tile_dpbf16ps(7, 1, 3);
                }
                const int target = (int)((int64_t)units * (s + 1) / steps);
                for (; done < target; done++) {
                    const uint8_t *blk = wn + (int64_t)done * step;
                    for (int line = 0; line < step; line += 64) /* the pair after: from memory meanwhile */
                        _mm_prefetch((const char *)(blk + 2 * tile_bytes + line), _MM_HINT_T0);
                    unpack_block(fmt, blk, nxt + (size_t)done * 512, interleave);
                }
            }
            const int rows0 = M - m0 < 16 ? M - m0 : 16, rows1 = M - m0 - 16 < 16 ? M - m0 - 16 : 16;
            _tile_stored(4, acc, 64);
            store_acc(acc, rows0, bias, y, ldy, m0, t * TILE, out_f32);
            if (pair) {
                _tile_stored(5, acc, 64);
                store_acc(acc, rows0, bias, y, ldy, m0, (t + 1) * TILE, out_f32);
            }
            if (two && rows1 > 0) {
                _tile_stored(6, acc, 64);
                store_acc(acc, rows1, bias, y, ldy, m0 + 16, t * TILE, out_f32);
                if (pair) {
                    _tile_stored(7, acc, 64);
                    store_acc(acc, rows1, bias, y, ldy, m0 + 16, (t + 1) * TILE, out_f32);
                }
            }
        }
        uint16_t *swap = cur;
        cur = nxt, nxt = swap;
    }
    _tile_release(); /* back to the init state: nothing for a context switch to save */
}

/* Passes of at most AMX_COLUMN_ROWS rows take run_tiles_amx_column instead of the panel
 * loop above: over a decode step's weights read from memory, one thread, 16 rows 15.1 ms
 * against 17.7, 32 rows 18.0 against 20.1, 48 rows 5 % faster, 64 rows the same. Tried
 * and slower: splitting K so that x stays in L1 (the partial sums' spills and the
 * strided weight reads cost more than x's reloads from L2 save). */
#ifndef AMX_COLUMN_ROWS
#define AMX_COLUMN_ROWS 64
#endif
#define COLUMN_AHEAD 2      /* blocks de-quantized ahead of the one multiplied */
#define COLUMN_PREFETCH 8   /* blocks ahead whose packed bytes are asked from memory */
#define COLUMN_RING (COLUMN_AHEAD + 1)

/* Tiles [t0, t1) of W for Mpad <= 64 rows of xa: one tile of outputs at a time against
 * every row tile at once (accumulators 4-7: rows 16r..16r + 15), so each block is
 * multiplied by all the rows right after it is de-quantized and nothing is kept but a ring
 * of COLUMN_RING B tiles, which stays in L1 (the panel loop's buffers, 72-192 KB, live in
 * L2). Tile 3 holds the block's weights, tiles 0-2 take turns holding x. The vector units
 * de-quantize block i + COLUMN_AHEAD while the tile unit multiplies block i. */
static void run_tiles_amx_column(int fmt, const uint8_t *w, int t0, int t1, int nb, const uint16_t *xa, int Mpad,
                                 int M, int K, const float *bias, void *y, int64_t ldy, int out_f32) {
    const int step = fmt == FMT_Q4 ? Q4_BYTES : Q8_BYTES;
    const int64_t lda = (int64_t)K * 2;
    const __m512i interleave = pair_interleave();
    uint16_t ring[COLUMN_RING][512] __attribute__((aligned(64)));
    float acc[256] __attribute__((aligned(64)));
    const int rt = Mpad / 16, items = (t1 - t0) * nb;
    const uint16_t *x1 = xa + (int64_t)16 * K, *x2 = xa + (int64_t)32 * K, *x3 = xa + (int64_t)48 * K;
    const uint8_t *w0 = w + (int64_t)t0 * nb * step; /* item i: tile t0 + i / nb, block i % nb; in order */
    amx_configure();
    for (int i = 0; i < COLUMN_AHEAD && i < items; i++)
        unpack_block(fmt, w0 + (int64_t)i * step, ring[i % COLUMN_RING], interleave);
    for (int i = 0; i < items; i++) {
        const int b = i % nb;
        if (b == 0) {
            _tile_zero(4);
            _tile_zero(5);
            _tile_zero(6);
            _tile_zero(7);
        }
        _tile_loadd(3, ring[i % COLUMN_RING], 64);
        _tile_loadd(0, xa + 32 * b, lda);
        _tile_dpbf16ps(4, 0, 3);
        if (rt > 1) {
            _tile_loadd(1, x1 + 32 * b, lda);
            _tile_dpbf16ps(5, 1, 3);
        }
        if (rt > 2) {
            _tile_loadd(2, x2 + 32 * b, lda);
            _tile_dpbf16ps(6, 2, 3);
        }
        if (rt > 3) {
            _tile_loadd(0, x3 + 32 * b, lda);
            _tile_dpbf16ps(7, 0, 3);
        }
        if (i + COLUMN_PREFETCH < items)
            for (int line = 0; line < step; line += 64)
                _mm_prefetch((const char *)(w0 + (int64_t)(i + COLUMN_PREFETCH) * step + line), _MM_HINT_T0);
        if (i + COLUMN_AHEAD < items)
            unpack_block(fmt, w0 + (int64_t)(i + COLUMN_AHEAD) * step, ring[(i + COLUMN_AHEAD) % COLUMN_RING],
                         interleave);
        if (b == nb - 1) { /* the tile's last block: its outputs are done */
            const int n0 = (t0 + i / nb) * TILE;
            for (int r = 0; r < rt && 16 * r < M; r++) {
                switch (r) { /* a tile's number must be a constant */
                case 0: _tile_stored(4, acc, 64); break;
                case 1: _tile_stored(5, acc, 64); break;
                case 2: _tile_stored(6, acc, 64); break;
                default: _tile_stored(7, acc, 64);
                }
                store_acc(acc, M - 16 * r < 16 ? M - 16 * r : 16, bias, y, ldy, 16 * r, n0, out_f32);
            }
        }
    }
    _tile_release();
}

/* Tiles [t0, t1) on whichever loop fits Mpad; the panel loop's buffer (4 · nb B tiles)
 * is allocated here. Returns 0, or -1 when that buffer could not be. */
static int run_tiles_amx_any(int fmt, const uint8_t *w, int t0, int t1, int nb, const uint16_t *xa, int Mpad, int M,
                             int K, const float *bias, void *y, int64_t ldy, int out_f32) {
    if (t1 <= t0) return 0;
    if (Mpad <= AMX_COLUMN_ROWS) {
        run_tiles_amx_column(fmt, w, t0, t1, nb, xa, Mpad, M, K, bias, y, ldy, out_f32);
        return 0;
    }
    uint16_t *buf = aligned_alloc(64, (size_t)4 * nb * 512 * 2);
    if (!buf) return -1;
    run_tiles_amx(fmt, w, t0, t1, nb, xa, Mpad, M, K, bias, y, ldy, out_f32, buf);
    free(buf);
    return 0;
}

/* The AMX pass: x copied into zero-padded rows, the tiles split across threads as above.
 * Returns 0, or -1 when scratch memory ran out. */
static int qmatmul_amx(int fmt, const uint8_t *w, int N, int K, const scalar_t *x, int64_t ldx, int M,
                       const float *bias, void *y, int64_t ldy, int out_f32, int nthreads) {
    const int nb = K / QB, tiles = N / TILE, Mpad = (M + 15) / 16 * 16;
    uint16_t *xa = aligned_alloc(64, (size_t)Mpad * K * 2);
    if (!xa) return -1;
    for (int r = 0; r < M; r++) memcpy(xa + (size_t)r * K, x + (int64_t)r * ldx, (size_t)K * 2);
    memset(xa + (size_t)M * K, 0, (size_t)(Mpad - M) * K * 2);
    int failed = 0;
    if (nthreads > 1 && tiles > 2) {
#pragma omp parallel num_threads(nthreads) reduction(| : failed)
        {
            extern int omp_get_thread_num(void), omp_get_num_threads(void);
            const int id = omp_get_thread_num(), n = omp_get_num_threads();
            /* whole pairs of tiles to each thread, so no pair straddles two */
            const int pairs = (tiles + 1) / 2;
            const int t0 = 2 * (int)((int64_t)pairs * id / n), t1e = 2 * (int)((int64_t)pairs * (id + 1) / n);
            const int t1 = t1e < tiles ? t1e : tiles;
            failed |= run_tiles_amx_any(fmt, w, t0, t1, nb, xa, Mpad, M, K, bias, y, ldy, out_f32) != 0;
        }
    } else {
        failed = run_tiles_amx_any(fmt, w, 0, tiles, nb, xa, Mpad, M, K, bias, y, ldy, out_f32) != 0;
    }
    free(xa);
    return failed ? -1 : 0;
}
#else
#define AMX 0
#define AMX_MIN_ROWS 0
#endif

/* ------------------------------------------------------------------ entry points */

static void run_tiles(int fmt, const uint8_t *w, int t0, int t1, int nb, const int8_t *qa, const float *da,
                      const float *sa, int M, int K, const float *bias, void *y, int64_t ldy, int out_f32) {
    const int step = fmt == FMT_Q4 ? Q4_BYTES : Q8_BYTES;
    const size_t esz = out_f32 ? sizeof(float) : sizeof(scalar_t);
    for (int t = t0; t < t1; t++) {
        const uint8_t *wt = w + (int64_t)t * nb * step;
        for (int r0 = 0; r0 < M; r0 += MR) {
            const int rows = M - r0 < MR ? M - r0 : MR;
            const int8_t *q = qa + (int64_t)r0 * K;
            const float *d = da + (int64_t)r0 * 2 * nb, *s = sa + (int64_t)r0 * nb;
            char *yr = (char *)y + (size_t)r0 * ldy * esz;
            switch (rows) { /* a constant row count for each inlined copy: its loops unroll */
#define ROWS(n) \
    case n: tile_block(fmt, wt, nb, q, d, s, K, n, bias, yr, ldy, t * TILE, out_f32); break;
                ROWS(1)
#if MR >= 2
                ROWS(2)
#endif
#if MR >= 4
                ROWS(3)
                ROWS(4)
#endif
#if MR >= 8
                ROWS(5)
                ROWS(6)
                ROWS(7)
                ROWS(8)
#endif
#undef ROWS
            }
        }
    }
}

/* y[M, N] = x[M, K] · Wᵀ + bias for W packed as `fmt` (0: Q4, 1: Q8) tiles (see the top
 * of this file). x: rows `ldx` elements apart; y: rows `ldy` apart, float32 when
 * `out_f32` is set, else the compiled dtype; bias: [N] float32 or NULL. N a multiple of
 * 16, K of 32 (checked by the caller). Returns 0, or -1 when scratch memory ran out. */
int qmatmul(int fmt, const uint8_t *w, int N, int K, const scalar_t *x, int64_t ldx, int M, const float *bias,
            void *y, int64_t ldy, int out_f32, int nthreads) {
    const int nb = K / QB, tiles = N / TILE;
#if AMX
    if (M >= AMX_MIN_ROWS && amx_usable()) return qmatmul_amx(fmt, w, N, K, x, ldx, M, bias, y, ldy, out_f32, nthreads);
#endif
    int8_t *qa = malloc((size_t)M * K + 3 * sizeof(float) * (size_t)M * nb);
    if (!qa) return -1;
    float *da = (float *)(qa + (size_t)M * K), *sa = da + 2 * (size_t)M * nb;
    quantize_rows(x, ldx, M, K, qa, da, sa);
    const int64_t work = (int64_t)M * N * K;
    if (nthreads > 1 && tiles > 1 && work >= (1 << 18)) {
#pragma omp parallel num_threads(nthreads)
        {
            extern int omp_get_thread_num(void), omp_get_num_threads(void);
            const int id = omp_get_thread_num(), n = omp_get_num_threads();
            const int t0 = (int)((int64_t)tiles * id / n), t1 = (int)((int64_t)tiles * (id + 1) / n);
            run_tiles(fmt, w, t0, t1, nb, qa, da, sa, M, K, bias, y, ldy, out_f32);
        }
    } else {
        run_tiles(fmt, w, 0, tiles, nb, qa, da, sa, M, K, bias, y, ldy, out_f32);
    }
    free(qa);
    return 0;
}

/* Which code path this build takes ("avx512vnni", "avx2" or "generic"). */
const char *qmatmul_isa(void) { return ISA; }

/* The row count from which a pass runs on AMX tiles; 0 where this build or CPU has none. */
int qmatmul_tile_rows(void) {
#if AMX
    return amx_usable() ? AMX_MIN_ROWS : 0;
#else
    return 0;
#endif
}
