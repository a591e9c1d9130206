// y[B, N] = x[B, K] @ W^T on the CPU for every weight format of tinyloop/formats.py (AVX2 + FMA, OpenMP).
//
// Decode at batch 1 reads every weight byte once per token and does 2 flops per weight, so the product is bound
// by memory bandwidth: the goal is to stream W at the machine's read bandwidth, in bytes of the stored format.
// Shape of every kernel:
//   - threads split the N rows (contiguous chunks, so each thread streams its own part of W);
//   - a tile is R = 1..4 rows of W times BT <= 4 rows of x: each weight vector loaded (and widened) once feeds BT
//     fmas, and the next batch tile rereads the same W rows from L1, so W comes from memory once for any B;
//   - every output element is summed the same way whatever the tile, B or thread count (batch invariance, below).
// Two ways to multiply by int8 / int4 weights:
//   weight-only  x stays fp32, weights are widened to fp32 in registers, fp32 accumulation: this is
//                formats.reference_linear up to fp32 rounding.
//   act_quant    x is quantised to int8 per block of 32 values (scale = max|x| / 127) and the block dot products
//                run on integers (maddubs + madd): 4-5 instructions per 32 weights where widening takes 12 or more,
//                so these stream 1.1-2.3x faster (the engine's default for int8 / int4 on the CPU), at the cost of
//                the activation rounding (~0.5% of the output scale at most, x ~ randn, K = 768..2048): this is
//                formats.reference_linear of an act_quant matrix. x is quantised per row and the block sums go to
//                2 accumulators in a fixed alternation, so this is batch-invariant too (tested).
#include <immintrin.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#define INLINE static inline __attribute__((always_inline))
// Weight rows per block at B = 1, 2, 3..4 and > 4, the B from which rows are widened, and accumulators per output
// element (see the row loop).
#ifndef TUNE
#define TUNE_F32 1, 1, 1, 3, 0, 1  // no widening: already fp32
#define TUNE_BF16 1, 1, 1, 2, 16, 2
#define TUNE_I8 4, 1, 1, 2, 16, 2
#define TUNE_I4 2, 2, 2, 2, 4, 2
#define TUNE_AQ8 1, 2, 1, 2, 0, 2  // act_quant, int8 weights
#define TUNE_AQ4 4, 2, 1, 2, 0, 2  // act_quant, int4 weights
#endif
#ifndef TUNE_AQ8V
// act_quant int8 on AVX-512 VNNI (per = 0: 32 registers, 16 accumulators, up to 4 W rows x 4 x rows)
#define TUNE_AQ8V 2, 2, 4, 4, 0, 0
#endif
#define QB 32  // values per activation-quantisation block (and per int4 nibble block)
#ifndef PF_HINT
#define PF_HINT _MM_HINT_T1  // into L2: 5-7 % faster than L1 for int8, the same for the others
#endif
#ifndef PF_F32
#define PF_F32 2048     // bytes ahead in the weight stream that a batch-1 tile prefetches (see `ahead`): fp32
#endif
#ifndef PF_NARROW
#define PF_NARROW 8192  // bf16, int8, int4
#endif

enum { F32, BF16, I8 };
#define ESZ(fmt) ((fmt) == F32 ? 4 : (fmt) == BF16 ? 2 : 1)

// v, loaded into a register once: gcc would otherwise fold a load used by several fmas into each of them (one
// load per fma), which makes loads the limit of a 2 x 3 tile. Changes no value.
INLINE __m256 in_reg(__m256 v) {
    __asm__("" : "+x"(v));
    return v;
}

// The same for integer vectors; also keeps gcc from regrouping a chain of integer adds into a tree, which needs
// more registers than there are (it spilled the int4 tile's int16 sums to the stack).
INLINE __m256i in_reg_i(__m256i v) {
    __asm__("" : "+x"(v));
    return v;
}

#if defined(__AVX512F__)
INLINE __m512 in_reg512(__m512 v) {
    __asm__("" : "+v"(v));
    return v;
}

INLINE __m512i in_reg512i(__m512i v) {
    __asm__("" : "+v"(v));
    return v;
}

// The sum of v's 16 lanes in a fixed order, whatever the compiler (gcc's _mm512_reduce_add_ps adds the same way):
// lanes i + i+8, then + i+4, then (0 + 2) + (1 + 3).
INLINE float reduce16(__m512 v) {
    const __m256 h = _mm256_add_ps(_mm512_castps512_ps256(v), _mm512_extractf32x8_ps(v, 1));
    const __m128 q = _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
    const __m128 p = _mm_add_ps(q, _mm_movehl_ps(q, q));
    return _mm_cvtss_f32(_mm_add_ss(p, _mm_movehdup_ps(p)));
}

// reduce16 of n <= 16 vectors at once (v[n..] are overwritten): the same additions, each level adding two vectors'
// halves in one shuffle pair, so 8 vectors take 8 adds instead of 24 (and 24 shuffles). sums[e] = reduce16(v[e]).
INLINE void reduce16_many(__m512 *v, int n, float *sums) {
    const __m512 z = _mm512_setzero_ps();
    for (int e = n; e < 16; e++) v[e] = z;
    __m512 a[8], b[4], c[2];
    for (int i = 0; i < (n + 1) / 2; i++)  // lane j < 8: element 2i's j + j+8; j >= 8: element 2i+1's
        a[i] = _mm512_add_ps(_mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], 0x44),
                             _mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], 0xEE));
    for (int i = (n + 1) / 2; i < 8; i++) a[i] = z;
    for (int i = 0; i < (n + 3) / 4; i++)  // quad k: element 4i+k's j + j+4
        b[i] = _mm512_add_ps(_mm512_shuffle_f32x4(a[2 * i], a[2 * i + 1], 0x88),
                             _mm512_shuffle_f32x4(a[2 * i], a[2 * i + 1], 0xDD));
    for (int i = (n + 3) / 4; i < 4; i++) b[i] = z;
    c[1] = z;
    for (int i = 0; i < (n + 7) / 8; i++)  // quad k: element 8i+k's 0 + 2, 1 + 3 in lanes 0, 1; 8i+4+k's in 2, 3
        c[i] = _mm512_add_ps(_mm512_shuffle_ps(b[2 * i], b[2 * i + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                             _mm512_shuffle_ps(b[2 * i], b[2 * i + 1], _MM_SHUFFLE(3, 2, 3, 2)));
    // quad k: elements k, 4+k, 8+k, 12+k
    const __m512 d = _mm512_add_ps(_mm512_shuffle_ps(c[0], c[1], _MM_SHUFFLE(2, 0, 2, 0)),
                                   _mm512_shuffle_ps(c[0], c[1], _MM_SHUFFLE(3, 1, 3, 1)));
    float t[16];
    _mm512_storeu_ps(t, d);
    for (int e = 0; e < n; e++) sums[e] = t[4 * (e % 4) + e / 4];
}
#endif

INLINE float hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

// ---- weight-only products: one summation structure per output element, whatever the batch
//
// Batch invariance: y[b, n] must have the same bits whether row b is multiplied alone or in a batch of 32, in any
// tile, on any thread (greedy decoding of a request must not depend on who else is being served). So every
// weight-only product of a format computes every element the same way, for every tile shape, with U
// accumulators per element (TUNE_*):
//   U = 1 (fp32): acc += w[k .. k+8] * x[k .. k+8] (fma), k = 0, 8, 16, ... in order;
//   U = 2 (bf16, int8, int4): acc0 takes the chunks k = 0, 16, 32, ..., acc1 the chunks k = 8, 24, ...; a last
//         full chunk of 8 (K % 16 >= 8) goes into acc0; acc = acc0 + acc1;
//   then hsum(acc), then the K % 8 tail in scalar order (mul, then add: built with -ffp-contract=off); int8
//   multiplies the sum by its row scale at the very end.
// The weight vector is always the same fp32 values: fp32 as is, bf16 shifted, int8 float(q) (no scale), int4
// fma(q, s, -8 s) = round((q - 8) s) (-8 s is exact). Tiles of R weight rows x BT x rows only decide which
// elements are computed together, never how one is summed, so tile shapes can follow B freely.
// Why U differs: a tile holds R * BT * U sums in 16 vector registers. fp32 is compute-bound at large B, where
// U = 1 fits a 3 x 4 tile (12 sums, 7 loads per 12 fmas) instead of 2 x 3 (5 loads per 6 fmas): 1.2x faster at
// B = 16; at B = 1 its single chain per row also streams 10-15 % faster. The narrow formats at small B need the
// extra chains (4 cycles of fma latency each) while they widen weights in registers: U = 1 was 5-30 % slower.

// 8 consecutive weights widened to fp32: bf16 is the high half of an fp32, int8 sign-extends then converts.
INLINE __m256 load8(int fmt, const void *w, long k) {
    if (fmt == F32) return _mm256_loadu_ps((const float *)w + k);
    if (fmt == BF16) {
        __m128i h = _mm_loadu_si128((const __m128i *)((const uint16_t *)w + k));
        return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
    }
    __m128i q = _mm_loadl_epi64((const __m128i *)((const int8_t *)w + k));
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q));
}

INLINE float load1(int fmt, const void *w, long k) {
    if (fmt == F32) return ((const float *)w)[k];
    if (fmt == BF16) {
        uint32_t u = (uint32_t)((const uint16_t *)w)[k] << 16;
        float f;
        memcpy(&f, &u, 4);
        return f;
    }
    return (float)((const int8_t *)w)[k];
}

// The fixed end of every element: hsum(acc), then the scalar K tail from k0, then the row scale.
INLINE float finish(int fmt, __m256 acc, const void *wr, const float *xb, long k0, long K, const float *scale) {
    float s = hsum(acc);
    for (long j = k0; j < K; j++) s += xb[j] * load1(fmt, wr, j);
    return scale ? s * *scale : s;
}

// Software prefetch of the weight stream at B = 1, `dist` bytes ahead of the byte being read, once per cache line.
// The narrow formats carry many instructions per cache line (widening, fmas), so the out-of-order window reaches
// few lines ahead and the hardware prefetcher alone kept int8 at ~6 GB/s per core against fp32's 13 from memory.
// Hint and distances (PF_*) were chosen by alternating two builds in one process (2-core Zen3, the d768 step's
// matrices, B = 1): without prefetch bf16 took 1.27x and int8 1.48x as long.
INLINE void ahead(const void *p, long byte, long dist) {
    if ((byte & 63) == 0) _mm_prefetch((const char *)p + byte + dist, PF_HINT);
}

// acc[r][b] += w[r, k .. k+8] * x[b, k .. k+8]: R weight vectors and one x vector at a time in registers, R + BT
// loads per R * BT fmas. With one x row, a load folded into the fma is as good, and measured 10 % faster for fp32.
INLINE void fma_chunk(int fmt, int R, int BT, const char *const *wr, const float *x, long K, long k, __m256 acc[4][4]) {
    if (BT == 1)
        for (int r = 0; r < R; r++) ahead(wr[r], k * ESZ(fmt), fmt == F32 ? PF_F32 : PF_NARROW);
    __m256 wv[4];
    for (int r = 0; r < R; r++) wv[r] = BT > 1 ? in_reg(load8(fmt, wr[r], k)) : load8(fmt, wr[r], k);
    for (int b = 0; b < BT; b++) {
        __m256 xv = BT > 1 ? in_reg(_mm256_loadu_ps(x + b * K + k)) : _mm256_loadu_ps(x + b * K + k);
        for (int r = 0; r < R; r++) acc[r][b] = _mm256_fmadd_ps(wv[r], xv, acc[r][b]);
    }
}

// out[b * ldy + r] = sum_k x[b, k] * w[r, k] for r < R, b < BT; w rows are `ldw` elements apart, x rows K.
// U (1 or 2): accumulators per element.
INLINE void dense_tile(int fmt, int U, int R, int BT, const void *w, long ldw, const float *x, long K, float *out,
                       long ldy, const float *scale) {
    const char *wr[4];
    __m256 acc0[4][4], acc1[4][4];
    for (int r = 0; r < R; r++) {
        wr[r] = (const char *)w + r * ldw * ESZ(fmt);
        for (int b = 0; b < BT; b++) acc0[r][b] = acc1[r][b] = _mm256_setzero_ps();
    }
    long k = 0;
    if (U == 1)
        for (; k + 8 <= K; k += 8) fma_chunk(fmt, R, BT, wr, x, K, k, acc0);
    else {
        for (; k + 16 <= K; k += 16) {
            fma_chunk(fmt, R, BT, wr, x, K, k, acc0);
            fma_chunk(fmt, R, BT, wr, x, K, k + 8, acc1);
        }
        if (k + 8 <= K) {
            fma_chunk(fmt, R, BT, wr, x, K, k, acc0);
            k += 8;
        }
    }
    for (int r = 0; r < R; r++)
        for (int b = 0; b < BT; b++)
            out[b * ldy + r] = finish(fmt, U == 2 ? _mm256_add_ps(acc0[r][b], acc1[r][b]) : acc0[r][b], wr[r],
                                      x + b * K, k, K, scale ? scale + r : 0);
}

// int4: 16 bytes = 32 values; byte j holds value j (low nibble) and j + 16 (high nibble). Bytes 8h..8h+7 give
// the chunks k + 8h (low) and k + 16 + 8h (high): both go to acc_h, in that order, as in dense_tile (K is a
// multiple of 32, so there is no tail). Unpacking: 8 bytes zero-extended to 8 dwords, & 15 and >> 4.
INLINE void int4_w16(const uint8_t *p, __m256 s, __m256 m8s, __m256 *wl, __m256 *wh) {
    __m256i q = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)p));
    *wl = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_and_si256(q, _mm256_set1_epi32(0x0F))), s, m8s);
    *wh = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_srli_epi32(q, 4)), s, m8s);
}

INLINE void int4_tile(int R, int BT, const uint8_t *w, long ldw, const float *sc, long ngroups, long group,
                      const float *x, long K, float *out, long ldy) {
    __m256 acc[2][4][4];
    for (int r = 0; r < R; r++)
        for (int b = 0; b < BT; b++) acc[0][r][b] = acc[1][r][b] = _mm256_setzero_ps();
    for (long g = 0; g < ngroups; g++) {
        __m256 s[4], m8s[4];
        for (int r = 0; r < R; r++) {
            s[r] = _mm256_broadcast_ss(sc + r * ngroups + g);
            m8s[r] = _mm256_mul_ps(s[r], _mm256_set1_ps(-8.0f));
        }
        for (long k = g * group; k < (g + 1) * group; k += QB)
            for (int h = 0; h < 2; h++) {
                if (BT == 1)
                    for (int r = 0; r < R; r++) ahead(w + r * ldw, k / 2 + 8 * h, PF_NARROW);
                __m256 wl[4], wh[4];
                for (int r = 0; r < R; r++) int4_w16(w + r * ldw + k / 2 + 8 * h, s[r], m8s[r], &wl[r], &wh[r]);
                for (int b = 0; b < BT; b++) {
                    const __m256 xl = in_reg(_mm256_loadu_ps(x + b * K + k + 8 * h));
                    const __m256 xh = in_reg(_mm256_loadu_ps(x + b * K + k + 8 * h + 16));
                    for (int r = 0; r < R; r++) acc[h][r][b] = _mm256_fmadd_ps(wl[r], xl, acc[h][r][b]);
                    for (int r = 0; r < R; r++) acc[h][r][b] = _mm256_fmadd_ps(wh[r], xh, acc[h][r][b]);
                }
            }
    }
    for (int r = 0; r < R; r++)
        for (int b = 0; b < BT; b++) out[b * ldy + r] = hsum(_mm256_add_ps(acc[0][r][b], acc[1][r][b]));
}

// Widening R rows to fp32 once, for batches of several tiles: the fp32 tile then rereads them from L1 instead of
// unpacking the same rows for every tile. Same values as the registers get (int8 without its scale, which the
// tile applies at the end), so the same bits come out.
INLINE void widen_rows(int fmt, int R, const void *w, long K, float *out) {
    for (int r = 0; r < R; r++) {
        const char *wr = (const char *)w + r * K * (fmt == BF16 ? 2 : 1);
        long k = 0;
        for (; k + 8 <= K; k += 8) _mm256_storeu_ps(out + r * K + k, load8(fmt, wr, k));
        for (; k < K; k++) out[r * K + k] = load1(fmt, wr, k);
    }
}

INLINE void widen_rows_int4(int R, const uint8_t *w, long ldw, const float *sc, long ngroups, long group, long K,
                            float *out) {
    for (int r = 0; r < R; r++)
        for (long g = 0; g < ngroups; g++) {
            const __m256 s = _mm256_broadcast_ss(sc + r * ngroups + g), m8s = _mm256_mul_ps(s, _mm256_set1_ps(-8.0f));
            for (long k = g * group; k < (g + 1) * group; k += QB)
                for (int h = 0; h < 2; h++) {
                    __m256 wl, wh;
                    int4_w16(w + r * ldw + k / 2 + 8 * h, s, m8s, &wl, &wh);
                    _mm256_storeu_ps(out + r * K + k + 8 * h, wl);
                    _mm256_storeu_ps(out + r * K + k + 8 * h + 16, wh);
                }
        }
}

// ---- act_quant: x quantised per block of 32, integer block dot products

// qx[b, :KB*32] = round(x / d), sx[b, blk] = d = max|x_blk| / 127; sq[b, blk] = sum of the block's q (int4 offset).
static void quant_x(const float *x, long B, long K, long KB, int8_t *qx, float *sx, float *sq) {
    const __m256 absmask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
    const __m256i perm = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
    for (long b = 0; b < B; b++)
        for (long blk = 0; blk < KB; blk++) {
            const float *xb = x + b * K + blk * QB;
            __m256 v[4], m = _mm256_setzero_ps();
            for (int i = 0; i < 4; i++) {
                v[i] = _mm256_loadu_ps(xb + 8 * i);
                m = _mm256_max_ps(m, _mm256_and_ps(v[i], absmask));
            }
            __m128 t = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
            t = _mm_max_ps(t, _mm_movehl_ps(t, t));
            t = _mm_max_ss(t, _mm_movehdup_ps(t));
            float amax = _mm_cvtss_f32(t);
            float d = amax / 127.0f, id = amax > 0 ? 127.0f / amax : 0.0f;
            __m256 vid = _mm256_set1_ps(id);
            __m256i q[4];
            for (int i = 0; i < 4; i++) q[i] = _mm256_cvtps_epi32(_mm256_mul_ps(v[i], vid));  // round half even
            __m256i s = _mm256_add_epi32(_mm256_add_epi32(q[0], q[1]), _mm256_add_epi32(q[2], q[3]));
            // packs interleave the 128-bit lanes; the permute puts the 32 bytes back in order
            __m256i p = _mm256_packs_epi16(_mm256_packs_epi32(q[0], q[1]), _mm256_packs_epi32(q[2], q[3]));
            _mm256_storeu_si256((__m256i *)(qx + (b * KB + blk) * QB), _mm256_permutevar8x32_epi32(p, perm));
            sx[b * KB + blk] = d;
            if (sq) {
                __m128i t2 = _mm_add_epi32(_mm256_castsi256_si128(s), _mm256_extracti128_si256(s, 1));
                t2 = _mm_add_epi32(t2, _mm_shuffle_epi32(t2, 0x4E));
                t2 = _mm_add_epi32(t2, _mm_shuffle_epi32(t2, 0xB1));
                sq[b * KB + blk] = (float)_mm_cvtsi128_si32(t2);
            }
        }
}

// int8 W x int8 x: maddubs needs an unsigned operand, so |w| times x carrying w's sign (sign_epi8).
INLINE void int8q_tile(int R, int BT, const int8_t *w, long ldw, const float *scale, const int8_t *qx,
                       const float *sx, long KB, const float *x, long K, float *out, long ldy) {
    const int U = 2;  // fixed: the same bits for any batch tile
    const __m256i ones = _mm256_set1_epi16(1);
    __m256 acc[2][4][4];
    for (int u = 0; u < U; u++)
        for (int r = 0; r < R; r++)
            for (int b = 0; b < BT; b++) acc[u][r][b] = _mm256_setzero_ps();
    // one block into accumulator set u; blocks are unrolled by U below so that u is a compile-time constant
#define BLOCK(blk, u)                                                                                   \
    for (int r = 0; r < R; r++) {                                                                       \
        if (BT <= 2) ahead(w + r * ldw, (blk) * QB, PF_NARROW);                                        \
        __m256i wv = _mm256_loadu_si256((const __m256i *)(w + r * ldw + (blk) * QB));                  \
        __m256i aw = _mm256_abs_epi8(wv);                                                               \
        for (int b = 0; b < BT; b++) {                                                                  \
            __m256i xv = _mm256_loadu_si256((const __m256i *)(qx + (b * KB + (blk)) * QB));            \
            __m256i p = _mm256_madd_epi16(_mm256_maddubs_epi16(aw, _mm256_sign_epi8(xv, wv)), ones);    \
            acc[u][r][b] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), _mm256_broadcast_ss(sx + b * KB + (blk)), \
                                           acc[u][r][b]);                                               \
        }                                                                                               \
    }
    long blk = 0;
    for (; blk + U <= KB; blk += U)
        for (int u = 0; u < U; u++) BLOCK(blk + u, u)
    for (; blk < KB; blk++) BLOCK(blk, 0)
#undef BLOCK
    for (int r = 0; r < R; r++)
        for (int b = 0; b < BT; b++) {
            __m256 a = acc[0][r][b];
            for (int u = 1; u < U; u++) a = _mm256_add_ps(a, acc[u][r][b]);
            float s = hsum(a);
            for (long j = KB * QB; j < K; j++) s += x[b * K + j] * (float)w[r * ldw + j];  // K tail in fp32
            out[b * ldy + r] = s * scale[r];
        }
}

#if defined(__AVX512F__)
// Zen 4: AMD family 19h in a build with AVX-512 (Zen 3, the same family, has none), whose tiles are tuned apart.
static int zen4(void) {
    static int is = -1;
    if (is < 0) {
        __builtin_cpu_init();
        is = __builtin_cpu_is("amdfam19h");
    }
    return is;
}
#endif

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
#define AQ8_VNNI 1
// The same product on AVX-512 VNNI: vpdpbusd multiplies unsigned by signed bytes and sums 4 products per lane, so
// W goes in as w ^ 0x80 = w + 128 (unsigned) and x as it is: a lane sums (w + 128) q and starts from -128 times the
// sum of its own q (corr, made once per x row by fold_x), so every lane holds exactly sum(w q) over its bytes of one
// block (a correction that mixed blocks or left +-128 sums in lanes would round far coarser in fp32:
// tests/test_gemm.py near-tie identity). Folds: 4 blocks (128 bytes, two loads) are regrouped by two 128-bit
// shuffles into one vector of each block's first 16 bytes and one of its last 16 (lanes 4i..4i+3: block i), so two
// chained vpdpbusd, one convert and one fma (with the lanes' block scales, s16) serve 128 weights; x comes folded
// the same way (fold_x), so a fold's two x vectors, corr and scales are loaded once per x row and shared by the
// tile's R W rows, and each W fold once per W row. The KB % 4 blocks left: a pair as it lies, the last odd block
// under a 32-byte mask. Per element: one accumulator, reduce16, the K tail in fp32, the row scale: the same for any
// tile, so a row's result does not depend on its batch.
// A vpdpbusd and an fma each take one cycle of Zen 4's two 512-bit pipes, so the old tile (one block pair per
// vpdpbusd, convert and fma) spent as much on the fma as on the products; folding halves the converts and fmas and
// with 16 accumulators (tiles up to 4 W x 4 x rows) ran 1.35-1.41x faster at 2-32 rows with the weights in L2 (K =
// 3072 and 768, one thread) and 1.03x at 1-2 rows, 1.15-1.30x at 3-32 from memory (Zen 4, 2 threads, 80 matrices
// 3072 x 768 = 180 MiB, the two builds in turns, session 26). Without in_reg512i gcc folded the x and W loads into
// the vpdpbusd and ran 0.7x.
// How a row of KB blocks lies folded (fold_x): NF folds of 4 blocks as 2 vectors each, then NT vectors of the
// KB % 4 blocks left (a pair each, the last odd block alone); NV vectors and NU units (a fold or a tail vector: one
// -128 sum(q) vector and one scale vector each) in all.
typedef struct {
    long NF, NT, NV, NU;
} fold_t;

INLINE fold_t fold_layout(long KB) {
    const long NF = KB / 4, NT = (KB % 4 + 1) / 2;
    return (fold_t){NF, NT, 2 * NF + NT, NF + NT};
}

INLINE void int8q_tile_vnni(int R, int BT, const int8_t *w, long ldw, const float *scale, const int8_t *xt,
                            const int32_t *corr, const float *s16, const float *x, long K, float *out, long ldy) {
    const long KB = K / QB;
    const fold_t L = fold_layout(KB);
    const long NF = L.NF, NV = L.NV, NU = L.NU;
    const __m512i flip = _mm512_set1_epi8((char)0x80);
    __m512 acc[4][4];
    for (int r = 0; r < R; r++)
        for (int b = 0; b < BT; b++) acc[r][b] = _mm512_setzero_ps();
#define FOLD(f)                                                                                      \
    {                                                                                                   \
        __m512i w0[4], w1[4];                                                                           \
        for (int r = 0; r < R; r++) {                                                                   \
            const int8_t *p = w + r * ldw + (f) * 4 * QB;                                               \
            ahead(p, 0, PF_NARROW);                                                                     \
            ahead(p, 64, PF_NARROW);                                                                    \
            const __m512i v0 = _mm512_loadu_si512(p), v1 = _mm512_loadu_si512(p + 64);                  \
            w0[r] = in_reg512i(_mm512_xor_si512(_mm512_shuffle_i32x4(v0, v1, 0x88), flip)); /* first halves */ \
            w1[r] = in_reg512i(_mm512_xor_si512(_mm512_shuffle_i32x4(v0, v1, 0xDD), flip)); /* second halves */ \
        }                                                                                               \
        for (int b = 0; b < BT; b++) {                                                                  \
            const int8_t *xb = xt + (b * NV + 2 * (f)) * 64;                                            \
            const __m512i x0 = in_reg512i(_mm512_load_si512(xb)), x1 = in_reg512i(_mm512_load_si512(xb + 64)); \
            const __m512i c = in_reg512i(_mm512_load_si512(corr + (b * NU + (f)) * 16));                \
            const __m512 s = in_reg512(_mm512_load_ps(s16 + (b * NU + (f)) * 16));                      \
            for (int r = 0; r < R; r++)                                                                 \
                acc[r][b] = _mm512_fmadd_ps(                                                         \
                    _mm512_cvtepi32_ps(_mm512_dpbusd_epi32(_mm512_dpbusd_epi32(c, w0[r], x0), w1[r], x1)), \
                    s, acc[r][b]);                                                                   \
        }                                                                                               \
    }
#define TAIL(f)                                                                                      \
    {                                                                                                   \
        const long byte = NF * 4 * QB + ((f) - NF) * 2 * QB;                                            \
        const int half = (f) == NU - 1 && (KB & 1);                                                     \
        __m512i wv[4];                                                                                  \
        for (int r = 0; r < R; r++)                                                                     \
            wv[r] = _mm512_xor_si512(half ? _mm512_maskz_loadu_epi8(0xFFFFFFFFULL, w + r * ldw + byte)  \
                                          : _mm512_loadu_si512(w + r * ldw + byte), flip);              \
        for (int b = 0; b < BT; b++) {                                                                  \
            const __m512i xv = _mm512_load_si512(xt + (b * NV + NF + (f)) * 64);                        \
            const __m512i c = _mm512_load_si512(corr + (b * NU + (f)) * 16);                            \
            const __m512 s = in_reg512(_mm512_load_ps(s16 + (b * NU + (f)) * 16));                      \
            for (int r = 0; r < R; r++)                                                                 \
                acc[r][b] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_dpbusd_epi32(c, wv[r], xv)), s, \
                                               acc[r][b]);                                           \
        }                                                                                               \
    }
    for (long f = 0; f < NF; f++) FOLD(f)  // folds: 4 blocks in 2 vectors, one convert and one fma
    for (long f = NF; f < NU; f++) TAIL(f)  // the tail: a pair of blocks as it lies, the last block alone, masked
#undef FOLD
#undef TAIL
    // reduce16 (a tile's elements at once from 6 on: the same sums), the K tail, the row scale
    __m512 v[16];
    float sums[16];
    for (int r = 0; r < R; r++)
        for (int b = 0; b < BT; b++) v[r * BT + b] = acc[r][b];
    if (R * BT >= 6)
        reduce16_many(v, R * BT, sums);
    else
        for (int e = 0; e < R * BT; e++) sums[e] = reduce16(v[e]);
    for (int r = 0; r < R; r++)
        for (int b = 0; b < BT; b++) {
            float s = sums[r * BT + b];
            for (long k = KB * QB; k < K; k++) s += x[b * K + k] * (float)w[r * ldw + k];  // K tail in fp32
            out[b * ldy + r] = s * scale[r];
        }
}

// x for int8q_tile_vnni, per row: NF folds of 4 blocks as 2 vectors (each block's first 16 values in lanes of
// the first, its last 16 in the same lanes of the second), then the tail's pairs as they lie (zeros past the last
// block); per unit (fold or tail vector) -128 times each lane's sum of q, and each lane's block scale.
static void fold_x(const int8_t *qx, const float *sx, long B, long KB, int8_t *xt, int32_t *corr, float *s16) {
    const fold_t L = fold_layout(KB);
    const long NF = L.NF, NV = L.NV, NU = L.NU;
    const __m512i ones = _mm512_set1_epi8(1);
    for (long b = 0; b < B; b++) {
        const int8_t *q = qx + b * KB * QB;
        const float *sb = sx + b * KB;
        for (long u = 0; u < NU; u++) {
            __m512i v[2], sum = _mm512_setzero_si512();
            float lane_scale[16];
            int nv;
            if (u < NF) {
                const __m512i v0 = _mm512_loadu_si512(q + u * 4 * QB), v1 = _mm512_loadu_si512(q + u * 4 * QB + 64);
                v[0] = _mm512_shuffle_i32x4(v0, v1, 0x88);
                v[1] = _mm512_shuffle_i32x4(v0, v1, 0xDD);
                nv = 2;
                for (int l = 0; l < 16; l++) lane_scale[l] = sb[u * 4 + l / 4];
            } else {
                const long blk = NF * 4 + (u - NF) * 2;
                const int two = blk + 1 < KB;
                v[0] = two ? _mm512_loadu_si512(q + blk * QB) : _mm512_maskz_loadu_epi8(0xFFFFFFFFULL, q + blk * QB);
                nv = 1;
                for (int l = 0; l < 16; l++) lane_scale[l] = l < 8 ? sb[blk] : two ? sb[blk + 1] : 0.0f;
            }
            for (int i = 0; i < nv; i++) {
                _mm512_store_si512(xt + (b * NV + (u < NF ? 2 * u + i : NF + u)) * 64, v[i]);
                sum = _mm512_dpbusd_epi32(sum, ones, v[i]);
            }
            _mm512_store_si512(corr + (b * NU + u) * 16, _mm512_sub_epi32(_mm512_setzero_si512(), _mm512_slli_epi32(sum, 7)));
            _mm512_store_ps(s16 + (b * NU + u) * 16, _mm512_loadu_ps(lane_scale));
        }
    }
}
#endif

// int4 W (q in 0..15, unsigned: maddubs takes it as is) x int8 x, two blocks per step: one 32-byte load holds
// blocks j, j+1; its low nibbles are values 0..15 of both (one per 128-bit lane) and its high nibbles values
// 16..31, so x is stored pair-interleaved to match (xp: [j 0..15 | j+1 0..15][j 16..31 | j+1 16..31]). Both
// halves' int16 sums add without overflow (2 * 2 * 15 * 127), so one madd + one convert serve 64 values; lanes
// 0-3 hold block j, 4-7 block j+1, and sx8 / the scale vector carry the matching per-lane scales.
// The -8 offset comes off on integers before the convert: sum_k (q - 8) q_x = dot - 8 sum(q_x), with 8 sum(q_x)
// of each block precomputed into one lane of o8 (lane 0 for block j, lane 4 for block j + 1).
// G32: group == 32, so a pair's two scales are adjacent (one 8-byte load), else they are looked up via gidx.
// Octets (G32 only): 8 blocks = 4 pairs at a time, where the float work per pair (convert, scale, accumulate) is
// most of the cost. Two rounds of hadd_epi16 fold the 4 pairs' int16 sums into 2 lanes per block (each still
// < 2^15: 4 * 7620), one madd into 1 int32 lane per block, in lane order blocks 0 2 4 6 | 1 3 5 7 (`octlanes`);
// then one convert, one scale and one fma serve 256 values: 1.2x faster than pairs alone at batch 1 (one
// thread, d768 shapes). sxo / o8o hold the x scales and offsets in that lane order; pairs take the rest.
INLINE void int4q_tile(int G32, int R, int BT, const uint8_t *w, long ldw, const float *sc, long ngroups,
                       const int *gidx, const int8_t *qx, const float *sx, const float *sx8, const int32_t *o8,
                       const float *sq, const float *sxo, const int32_t *o8o, long KB, float *out, long ldy) {
    const int U = 2;  // fixed: the same bits for any batch tile
    const __m256i ones = _mm256_set1_epi16(1), lo = _mm256_set1_epi8(0x0F);
    const long KP = KB / 2, KO = G32 ? KB / 8 : 0;  // block pairs, octets
    const __m256i pairlanes = _mm256_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1);
    const __m256i octlanes = _mm256_setr_epi32(0, 2, 4, 6, 1, 3, 5, 7);
    __m256 acc[2][4][4];
    for (int u = 0; u < U; u++)
        for (int r = 0; r < R; r++)
            for (int b = 0; b < BT; b++) acc[u][r][b] = _mm256_setzero_ps();
    for (long o = 0; o < KO; o++)
        for (int r = 0; r < R; r++) {
            const uint8_t *wo = w + r * ldw + o * 4 * QB;
            if (BT <= 2) {
                ahead(wo, 0, PF_NARROW);
                ahead(wo, 64, PF_NARROW);
            }
            __m256i ql[4], qh[4];
            for (int i = 0; i < 4; i++) {
                const __m256i v = _mm256_loadu_si256((const __m256i *)(wo + i * QB));
                ql[i] = _mm256_and_si256(v, lo);
                qh[i] = _mm256_and_si256(_mm256_srli_epi16(v, 4), lo);
            }
            const __m256 sv = _mm256_permutevar8x32_ps(_mm256_loadu_ps(sc + r * ngroups + 8 * o), octlanes);
            for (int b = 0; b < BT; b++) {
                const int8_t *xb = qx + (b * KB + 8 * o) * QB;
                __m256i p[4];
                for (int i = 0; i < 4; i++)
                    p[i] = _mm256_add_epi16(
                        _mm256_maddubs_epi16(ql[i], _mm256_loadu_si256((const __m256i *)(xb + 2 * i * QB))),
                        _mm256_maddubs_epi16(qh[i], _mm256_loadu_si256((const __m256i *)(xb + (2 * i + 1) * QB))));
                const __m256i h = _mm256_hadd_epi16(_mm256_hadd_epi16(p[0], p[1]), _mm256_hadd_epi16(p[2], p[3]));
                const __m256i p32 = _mm256_sub_epi32(_mm256_madd_epi16(h, ones),
                                                     _mm256_loadu_si256((const __m256i *)(o8o + (b * KO + o) * 8)));
                const __m256 d = _mm256_mul_ps(sv, _mm256_loadu_ps(sxo + (b * KO + o) * 8));
                acc[0][r][b] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p32), d, acc[0][r][b]);
            }
        }
#define PAIR(j, u)                                                                                      \
    for (int r = 0; r < R; r++) {                                                                       \
        if (BT <= 2) ahead(w + r * ldw, (j) * QB, PF_NARROW);                                          \
        __m256i v = _mm256_loadu_si256((const __m256i *)(w + r * ldw + (j) * QB));                     \
        __m256i ql = _mm256_and_si256(v, lo), qh = _mm256_and_si256(_mm256_srli_epi16(v, 4), lo);       \
        const float *s = sc + r * ngroups;                                                              \
        __m256 sv = G32 ? _mm256_permutevar8x32_ps(                                                     \
                              _mm256_castps128_ps256(_mm_castpd_ps(_mm_load_sd((const double *)(s + 2 * (j))))), \
                              pairlanes)                                                                \
                        : _mm256_insertf128_ps(_mm256_castps128_ps256(_mm_broadcast_ss(s + gidx[2 * (j)])), \
                                               _mm_broadcast_ss(s + gidx[2 * (j) + 1]), 1);             \
        for (int b = 0; b < BT; b++) {                                                                  \
            const int8_t *xb = qx + (b * KB + 2 * (j)) * QB;                                            \
            __m256i p = _mm256_add_epi16(_mm256_maddubs_epi16(ql, _mm256_loadu_si256((const __m256i *)xb)), \
                                         _mm256_maddubs_epi16(qh, _mm256_loadu_si256((const __m256i *)(xb + QB)))); \
            __m256i p32 = _mm256_sub_epi32(_mm256_madd_epi16(p, ones),                                  \
                                           _mm256_loadu_si256((const __m256i *)(o8 + (b * KP + (j)) * 8))); \
            __m256 d = _mm256_mul_ps(sv, _mm256_loadu_ps(sx8 + (b * KP + (j)) * 8));                   \
            acc[u][r][b] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p32), d, acc[u][r][b]);                    \
        }                                                                                               \
    }
    long j = 4 * KO;
    for (; j + U <= KP; j += U)
        for (int u = 0; u < U; u++) PAIR(j + u, u)
    for (; j < KP; j++) PAIR(j, 0)
#undef PAIR
    if (KB & 1)  // the last block of an odd count, unpaired (its x is in natural order)
        for (int r = 0; r < R; r++) {
            __m128i v = _mm_loadu_si128((const __m128i *)(w + r * ldw + (KB - 1) * QB / 2));
            __m256i q = _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(v, 4), v), lo);
            __m256 s = _mm256_broadcast_ss(sc + r * ngroups + gidx[KB - 1]);
            for (int b = 0; b < BT; b++) {
                __m256i xv = _mm256_loadu_si256((const __m256i *)(qx + (b * KB + KB - 1) * QB));
                __m256i p = _mm256_madd_epi16(_mm256_maddubs_epi16(q, xv), ones);
                p = _mm256_sub_epi32(p, _mm256_setr_epi32((int)(8 * sq[b * KB + KB - 1]), 0, 0, 0, 0, 0, 0, 0));
                __m256 d = _mm256_mul_ps(s, _mm256_broadcast_ss(sx + b * KB + KB - 1));
                acc[0][r][b] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), d, acc[0][r][b]);
            }
        }
    // the R sums of a tile row reduced together (hadd_ps twice, then the 128-bit halves): same order for any R
    for (int b = 0; b < BT; b++) {
        __m256 a[4];
        for (int r = 0; r < 4; r++) a[r] = r < R ? _mm256_add_ps(acc[0][r][b], acc[1][r][b]) : _mm256_setzero_ps();
        const __m256 t = _mm256_hadd_ps(_mm256_hadd_ps(a[0], a[1]), _mm256_hadd_ps(a[2], a[3]));
        const __m128 s4 = _mm_add_ps(_mm256_castps256_ps128(t), _mm256_extractf128_ps(t, 1));
        float sums[4];
        _mm_storeu_ps(sums, s4);
        for (int r = 0; r < R; r++) out[b * ldy + r] = sums[r];
    }
}

// ---- the row loop: threads take contiguous runs of blocks of RB weight rows; each block walks the batch in
// tiles. RB and the tiles only group elements (see above), so they are chosen for speed alone (2-core Zen3,
// alternating builds in one process over a decode step's matrices and in whole decode steps, TUNE_* at the top):
//   B = 1: bandwidth-bound. fp32 and bf16 take one row (one sequential stream: bf16 16 % faster than with two
//          rows, in whole decode steps); int4 R = 2, int8 R = 4 (11 % faster than 2, R = 1 1.3x slower).
//   B = 2..4: fp32 / bf16 / int8 one row (BT = B; bf16 at B = 2 1.38x faster than with two rows); int4 two rows
//          (its unpacking is the cost).
//   B > 4: fp32 3 rows x 4 x rows (see above); the others 2 x 3 with U = 2: fma throughput is the limit.
//   act_quant: int8 1 row at B = 1 (2 rows 1.2x the time), int4 4 (2 rows 1.08x); B = 2 2 rows, B = 3..4 1 row,
//          B > 4 2 rows; tiles of up to 2 x rows prefetch the weight stream (without: int8 1.44x the time at B = 1);
//          the VNNI int8 tile at every height (B = 3: 1.10 -> 0.94 ms over 4 layers of d 768, Sapphire Rapids);
//          VNNI: up to 4 rows x 4 (int8q_tile_vnni, 16 accumulators of 32 registers).
// widen: from this B on (bf16 / int8 16, int4 4) a block's rows are widened to fp32 once, into a per-thread
// buffer, and the fp32 tile runs on them; below it, reconverting in registers per tile was as fast or faster.

// The height of the next tile, with `left` x rows still to do, for R weight rows with `per` accumulators per
// element: at most 12 accumulators (of 16 vector registers) and 4 x rows; 4 rows left of a cap of 3 go as 2 + 2.
// per = 0: a 512-bit tile with one accumulator per element, 16 of its 32 registers.
INLINE int next_tile(long left, int R, int per) {
    const int fit = per ? 12 / (R * per) : 16 / R, cap = fit < 4 ? fit : 4;
    if (left == 4 && cap == 3) return 2;
    return left < cap ? (int)left : cap;
}

// R and BT (1..4) as compile-time constants, so that the tiles keep acc in registers.
#define SWITCH_BT(R_, bt, TILE)                                                          \
    switch (bt) {                                                                        \
        case 1: TILE(R_, 1); break; case 2: TILE(R_, 2); break;                          \
        case 3: TILE(R_, 3); break; default: TILE(R_, 4); break; }
#define SWITCH_TILES(R, bt, TILE)                                                        \
    switch (R) {                                                                         \
        case 1: SWITCH_BT(1, bt, TILE) break; case 2: SWITCH_BT(2, bt, TILE) break;      \
        case 3: SWITCH_BT(3, bt, TILE) break; default: SWITCH_BT(4, bt, TILE) break; }

#define WIDE_TILE(R_, BT_) dense_tile(F32, per_elem, R_, BT_, wide, K, x + b0 * K, K, y + b0 * N + n, N, wscale)

// Per-thread buffers of n floats, kept between calls (no allocation per product): slot 0 holds widened rows, slot 1
// attention scores (cpu_block.c), slot 2 the AVX2 GEMM's partial sums.
float *tl_thread_buffer(int slot, long n) {
    static __thread float *buf[3];
    static __thread long size[3];
    if (n > size[slot]) {
        free(buf[slot]);
        buf[slot] = aligned_alloc(64, (n * 4 + 63) & ~63L);
        size[slot] = n;
    }
    return buf[slot];
}
#define wide_buffer(n) tl_thread_buffer(0, n)

// One block: n..n+R-1 rows of W, all B rows of x.
#define BLOCK(R_, WIDEN, TILE)                                                           \
    do {                                                                                 \
        if (wide) { WIDEN(R_, wide); }                                                   \
        for (long b0 = 0, bt; b0 < (B); b0 += bt) {                                      \
            bt = next_tile((B) - b0, R_, per_elem);                                      \
            if (wide) { SWITCH_TILES(R_, bt, WIDE_TILE) }                                \
            else { SWITCH_TILES(R_, bt, TILE) }                                          \
        }                                                                                \
    } while (0)

// The rows' loop runs in an OpenMP team only for threads > 1: a team of one still costs ~1 us per call (libgomp),
// and a decode step makes ~80 calls. Outside a team the `omp for` is one thread's whole loop.
#define FOR_TILES(N, B, K, threads, TUNE_, WIDEN, TILE) FOR_TILES_(N, B, K, threads, TUNE_, WIDEN, TILE)
#define FOR_TILES_(N, B, K, threads, rb1, rb2, rb34, rbB, widen, per, WIDEN, TILE)     \
    const long RB = (B) == 1 ? (rb1) : (B) == 2 ? (rb2) : (B) <= 4 ? (rb34) : (rbB);       \
    const int per_elem = (per);                                                          \
    if ((threads) > 1) {                                                                 \
        _Pragma("omp parallel num_threads(threads)")                                     \
        ROWS(N, B, K, RB, widen, WIDEN, TILE)                                            \
    } else                                                                               \
        ROWS(N, B, K, RB, widen, WIDEN, TILE)

#define ROWS(N, B, K, RB, widen, WIDEN, TILE)                                            \
    {                                                                                    \
        float *wide = (widen) && (B) >= (widen) ? wide_buffer(RB * (K)) : 0;             \
        _Pragma("omp for schedule(static) nowait")                                       \
        for (long i = 0; i < ((N) + RB - 1) / RB; i++) {                                 \
            const long n0 = RB * i;                                                      \
            if (n0 + RB <= (N)) {                                                        \
                const long n = n0;                                                       \
                if (RB == 4) BLOCK(4, WIDEN, TILE);                                      \
                else if (RB == 3) BLOCK(3, WIDEN, TILE);                                 \
                else if (RB == 2) BLOCK(2, WIDEN, TILE);                                 \
                else BLOCK(1, WIDEN, TILE);                                              \
            } else                                                                       \
                for (long n = n0; n < (N); n++) BLOCK(1, WIDEN, TILE);                   \
        }                                                                                \
    }
#define NO_WIDEN(R_, buf)

// ---- fp32 rows on 512-bit vectors (where the compiler targets AVX-512 F: Intel since Skylake-SP, AMD Zen 4)
//
// The 256-bit tiles above reach at most half the fmas of a core with two 512-bit units, which is what bounds fp32
// at 16 rows. Here an element is one 512-bit accumulator: acc += w[k .. k+16] * x[k .. k+16] for k = 0, 16, ... in
// order, the K % 16 tail as one more masked chunk (zeros past K, which add nothing), then _mm512_reduce_add_ps (a
// fixed tree). Every tile sums an element that way, so tiles follow B freely and the product stays batch-invariant
// (another summation than the 256-bit kernel's: a machine's bits are its own). bf16 weights without AMX take the
// same tiles (widened to fp32 in registers, or from 8 rows once per block into a buffer: the same values), so bf16
// rows stream half the bytes at fp32's fma rate. Tiles: R W rows x BT x rows, up to 8 x 6 accumulators.
//   B < 8 (the weight stream is the limit): 1 W row (bf16 at 4-7 rows: 2) times all B rows (up to 6 per tile),
//         prefetched PF_* bytes ahead, so W comes from memory once in one stream.
//   B >= 8: blocks of 8 W rows, x tiles of 2 rows (Zen 4: 4 x 4, f32_block_rows); on Intel each block walks K in
//         blocks of 256, every x tile per K block, its accumulators kept between blocks (the same sums): the block's
//         W slice (8 KB) and the x slices (16 KB at 16 rows) stay in L1 (Sapphire Rapids: 4-16 rows 7-10 % faster
//         than all of K); on AMD blocks of 1024 (f32_kc). While a block's tiles run, they prefetch the next block's
//         rows into L2, a share each, so the weight stream overlaps the fmas instead of taking turns with them.
// Zen 5 (2 threads, 4 copies of a d768 layer's matrices, alternating builds), against the tiles before (fp32: 8 x 2
// at every B > 1, K blocks of 256; bf16: the 256-bit tiles): fp32 2-7 rows 1.2-1.8x, 16-32 rows 1.1x (16 rows
// 166 -> 184 GFLOP/s); bf16 3-32 rows 1.2-2.4x (16 rows 129 -> 224); 1-2 rows the same. (Not remeasured on Intel.)
#if defined(__AVX512F__)
#define TL_F32_512 1
#define F32R 8  // most W rows per block
#ifndef WIDE512
#define WIDE512 8  // bf16 from this many rows: a block's rows widened to fp32 once, the tiles read them from L1
#endif

// K per block at B > 1 (a multiple of 16; all of K when K is shorter): 256 on Intel (above), 1024 on AMD, where
// the blocks of 256 ran 4-32 rows 1.3x slower than all of K (Zen 5, 2 threads, 4 copies of a d768 layer's
// matrices, alternating builds; 1024 and all of K the same up to K = 768, 1024 8 % faster at K = 2048).
static long f32_kc(void) {
    static long kc;
    if (!kc) {
        __builtin_cpu_init();
        kc = __builtin_cpu_is("amd") ? 1024 : 256;
    }
    return kc;
}

// W rows per block at B >= 8, each x tile 16 / that many rows (16 accumulators). 4 on Zen 4 (AMD family 19h with
// AVX-512; 32 KiB of L1 data), where 4 x 4 ran 8-18 % faster than 8 x 2 at 8-32 rows (2 threads, 6 copies of a d768
// layer's matrices streamed from memory, alternating builds, the same bits; 1.0x with the weights in L2); 8
// elsewhere (Zen 5, Intel: measured with 8 x 2, 48 KiB of L1).
static long f32_block_rows(void) { return zen4() ? 4 : 8; }

// 16 consecutive weights as fp32 (zeros where m is clear): fp32 as is, bf16 the high half of an fp32.
INLINE __m512 load16w(int fmt, const void *w, long i, __mmask16 m) {
    if (fmt == F32) return _mm512_maskz_loadu_ps(m, (const float *)w + i);
    const __m256i h = _mm256_maskz_loadu_epi16(m, (const uint16_t *)w + i);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

// One chunk of 16 k of the tile: acc[r][b] += w[r, k .. k+16] * x[b, k .. k+16].
INLINE void f32_chunk512(int fmt, int R, int BT, const void *w, long K, const float *x, long k, __m512 acc[8][6],
                         int pf) {
    const __mmask16 m = K - k >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (K - k)) - 1);
    __m512 wv[8];
    for (int r = 0; r < R; r++) {
        if (pf) _mm_prefetch((const char *)w + (r * K + k) * ESZ(fmt) + (fmt == F32 ? PF_F32 : PF_NARROW), PF_HINT);
        wv[r] = load16w(fmt, w, r * K + k, m);
    }
    for (int b = 0; b < BT; b++) {
        const __m512 xv = _mm512_maskz_loadu_ps(m, x + b * K + k);
        for (int r = 0; r < R; r++) acc[r][b] = _mm512_fmadd_ps(wv[r], xv, acc[r][b]);
    }
}

// Chunks k0 .. k1 of the tile's elements; acc comes from (and goes back to) keep between K blocks, so each element
// still sums its chunks in order into one accumulator; the last block reduces it. next_lines > 0: also prefetch
// that many cache lines from next into L2 (the tile's share of the next block's rows), two with each of the first
// chunks: a loop of their own, since a check in every chunk cost the tiles 5-20 % (Zen 4), and in a burst before the
// loop they queued behind each other (B = 8: 1.25x the time).
INLINE void f32_tile512(int fmt, int R, int BT, const void *w, long K, const float *x, float *out, long ldy, long k0,
                        long k1, __m512 *keep, int pf, const char *next, long next_lines) {
    __m512 acc[8][6];
    for (int r = 0; r < R; r++)
        for (int b = 0; b < BT; b++) acc[r][b] = k0 ? keep[r * BT + b] : _mm512_setzero_ps();
    long k = k0;
    for (long line = 0; line < next_lines && k < k1; line += 2, k += 16) {  // (an odd share's last line is past it)
        _mm_prefetch(next + 64 * line, _MM_HINT_T1);
        _mm_prefetch(next + 64 * line + 64, _MM_HINT_T1);
        f32_chunk512(fmt, R, BT, w, K, x, k, acc, pf);
    }
    for (; k < k1; k += 16) f32_chunk512(fmt, R, BT, w, K, x, k, acc, pf);
    if (k1 < K)
        for (int r = 0; r < R; r++)
            for (int b = 0; b < BT; b++) keep[r * BT + b] = acc[r][b];
    else
        for (int r = 0; r < R; r++)
            for (int b = 0; b < BT; b++) out[b * ldy + r] = _mm512_reduce_add_ps(acc[r][b]);
}

#define F32_BT(F_, R_, bt, NX, NL)                                                                         \
    switch (bt) {                                                                                          \
        case 1: f32_tile512(F_, R_, 1, wn, K, x + b0 * K, y + b0 * N + n, N, k0, k1, kp, pf, NX, NL); break;      \
        case 2: f32_tile512(F_, R_, 2, wn, K, x + b0 * K, y + b0 * N + n, N, k0, k1, kp, pf, NX, NL); break;      \
        case 3: f32_tile512(F_, R_, 3, wn, K, x + b0 * K, y + b0 * N + n, N, k0, k1, kp, pf, NX, NL); break;      \
        case 4: f32_tile512(F_, R_, 4, wn, K, x + b0 * K, y + b0 * N + n, N, k0, k1, kp, pf, NX, NL); break;      \
        case 5: f32_tile512(F_, R_, 5, wn, K, x + b0 * K, y + b0 * N + n, N, k0, k1, kp, pf, NX, NL); break;      \
        default: f32_tile512(F_, R_, 6, wn, K, x + b0 * K, y + b0 * N + n, N, k0, k1, kp, pf, NX, NL); break; }
#define F32_R(F_, R, NX, NL)                                                                               \
    if (R == F32R) { F32_BT(F_, F32R, bt, NX, NL) }                                                        \
    else if (R == 4) { F32_BT(F_, 4, bt, NX, NL) }                                                         \
    else if (R == 2) { F32_BT(F_, 2, bt, NX, NL) }                                                         \
    else { F32_BT(F_, 1, bt, NX, NL) }

// fmt F32 or BF16 (the row kernel of bf16 weights where there is no AMX: the same tiles, the weights widened in
// registers or, from WIDE512 rows, once per block into a buffer; the same values, so the same bits either way).
static void f32_rows512(int fmt, const float *x, const void *w, float *y, long B, long N, long K) {
    // (past 32 rows, which the engine's steps never pass, all of K at once: keep holds 8 x 32 accumulators)
    // Below 8 rows, where the weight stream is the limit: blocks of 1 W row (bf16 at 4-7 rows: 2, two chains to cover
    // the widening's latency) times all the rows in one tile, prefetched; W comes from memory once.
    const long RB = B >= 8 ? f32_block_rows() : fmt == BF16 && B >= 4 ? 2 : 1, BT = B >= 8 ? 16 / RB : 6;
    const long KC = B < 8 || B > 32 ? K : f32_kc();
    __m512 keep[8 * 32];  // a block's accumulators between K blocks
    float *wide = fmt == BF16 && B >= WIDE512 ? wide_buffer(F32R * K) : 0;
#pragma omp for schedule(static) nowait
    for (long i = 0; i < (N + RB - 1) / RB; i++)
        for (long n = i * RB, end = n + RB < N ? n + RB : N; n < end;) {
            const long R = end - n >= F32R ? F32R : end - n >= 4 ? 4 : end - n >= 2 ? 2 : 1;
            const void *wn = (const char *)w + n * K * ESZ(fmt);
            if (wide) {
                widen_rows(BF16, R, wn, K, wide);
                wn = wide;
            }
            for (long k0 = 0, k1; k0 < K; k0 = k1) {
                k1 = k0 + KC < K ? k0 + KC : K;
                for (long b0 = 0, bt; b0 < B; b0 += bt) {
                    bt = B - b0 < BT ? B - b0 : BT;
                    __m512 *kp = keep + R * b0;
                    const int pf = b0 == 0 && RB <= 2;
                    // B >= 8: the block's calls (K blocks x tiles) share out the prefetch of the next block's
                    // rows. Without it the block's first tile waited for its rows from memory and the others ran
                    // with the memory idle: 1.16-1.46x the time at 8-32 rows (Zen 4, fp32 and bf16). The last
                    // block's next lies past N: none.
                    const char *nx = 0;
                    long nl = 0;
                    if (B >= 8 && n + R < N) {
                        const long lines = ((N - n - R < RB ? N - n - R : RB) * K * ESZ(fmt) + 63) / 64;
                        const long tiles = (B + BT - 1) / BT, calls = (K + KC - 1) / KC * tiles;
                        const long per = (lines + calls - 1) / calls, c = k0 / KC * tiles + b0 / BT;
                        nx = (const char *)w + (n + R) * K * ESZ(fmt) + c * per * 64;
                        nl = lines - c * per < per ? lines - c * per : per;
                    }
                    // (below 8 rows the tiles are built without the next block's prefetch: its check alone cost
                    // batch 1 7 %)
                    if (B < 8 && fmt == F32) { F32_R(F32, R, 0, 0) }
                    else if (B < 8) { F32_R(BF16, R, 0, 0) }
                    else if (fmt == F32 || wide) { F32_R(F32, R, nx, nl) }
                    else { F32_R(BF16, R, nx, nl) }
                }
            }
            n += R;
        }
}
#undef F32_R
#undef F32_BT

static void rows512(int fmt, const float *x, const void *w, float *y, long B, long N, long K, int threads) {
    if (threads > 1) {
#pragma omp parallel num_threads(threads)
        f32_rows512(fmt, x, w, y, B, N, K);
    } else
        f32_rows512(fmt, x, w, y, B, N, K);
}
#endif

void tl_linear_f32(const float *x, const float *w, float *y, long B, long N, long K, int threads) {
#ifdef TL_F32_512
    rows512(F32, x, w, y, B, N, K, threads);
#else
    const float *wscale = 0;
#define T(R_, BT_) dense_tile(F32, per_elem, R_, BT_, w + n * K, K, x + b0 * K, K, y + b0 * N + n, N, 0)
    FOR_TILES(N, B, K, threads, TUNE_F32, NO_WIDEN, T)
#undef T
    (void)wscale;
#endif
}

// The row kernel of bf16 weights; tl_linear_bf16 (below) runs it where the CPU has no AMX.
static void rows_bf16(const float *x, const uint16_t *w, float *y, long B, long N, long K, int threads) {
#ifdef TL_F32_512
    rows512(BF16, x, w, y, B, N, K, threads);
#else
    const float *wscale = 0;
#define T(R_, BT_) dense_tile(BF16, per_elem, R_, BT_, w + n * K, K, x + b0 * K, K, y + b0 * N + n, N, 0)
#define W(R_, buf) widen_rows(BF16, R_, w + n * K, K, buf)
    FOR_TILES(N, B, K, threads, TUNE_BF16, W, T)
#undef W
#undef T
    (void)wscale;
#endif
}

void tl_linear_int8(const float *x, const int8_t *w, const float *scale, float *y, long B, long N, long K,
                    int act_quant, int threads) {
    if (!act_quant) {
#define wscale (scale + n)
#define T(R_, BT_) dense_tile(I8, per_elem, R_, BT_, w + n * K, K, x + b0 * K, K, y + b0 * N + n, N, scale + n)
#define W(R_, buf) widen_rows(I8, R_, w + n * K, K, buf)
        FOR_TILES(N, B, K, threads, TUNE_I8, W, T)
#undef W
#undef T
#undef wscale
        return;
    }
    const float *wscale = 0;
    (void)wscale;
    const long KB = K / QB;
    int8_t *qx = aligned_alloc(64, (B * KB * QB + 64) & ~63L);
    float *sx = malloc((B * KB + 1) * sizeof(float));
#ifdef AQ8_VNNI
    const fold_t lay = fold_layout(KB);
    const long NV = lay.NV, NU = lay.NU;
    int8_t *xt = aligned_alloc(64, B * NV * 64 + 64);
    int32_t *corr = aligned_alloc(64, B * NU * 64 + 64);
    float *s16 = aligned_alloc(64, B * NU * 64 + 64);
    quant_x(x, B, K, KB, qx, sx, 0);
    fold_x(qx, sx, B, KB, xt, corr, s16);
#define T(R_, BT_) int8q_tile_vnni(R_, BT_, w + n * K, K, scale + n, xt + b0 * NV * 64, corr + b0 * NU * 16, \
                                   s16 + b0 * NU * 16, x + b0 * K, K, y + b0 * N + n, N)
    FOR_TILES(N, B, K, threads, TUNE_AQ8V, NO_WIDEN, T)
#undef T
    free(xt);
    free(corr);
    free(s16);
#else
    quant_x(x, B, K, KB, qx, sx, 0);
#define T(R_, BT_) int8q_tile(R_, BT_, w + n * K, K, scale + n, qx + b0 * KB * QB, sx + b0 * KB, KB, \
                              x + b0 * K, K, y + b0 * N + n, N)
    FOR_TILES(N, B, K, threads, TUNE_AQ8, NO_WIDEN, T)
#undef T
#endif
    free(qx);
    free(sx);
}

void tl_linear_int4(const float *x, const uint8_t *w, const float *scale, float *y, long B, long N, long K,
                    long group, int act_quant, int threads) {
    const long G = K / group, ldw = K / 2;
    const float *wscale = 0;
    (void)wscale;
    if (!act_quant) {
#define T(R_, BT_) int4_tile(R_, BT_, w + n * ldw, ldw, scale + n * G, G, group, x + b0 * K, K, y + b0 * N + n, N)
#define W(R_, buf) widen_rows_int4(R_, w + n * ldw, ldw, scale + n * G, G, group, K, buf)
        FOR_TILES(N, B, K, threads, TUNE_I4, W, T)
#undef W
#undef T
        return;
    }
    const long KB = K / QB, KP = KB / 2, bpg = group / QB;
    int8_t *qx = aligned_alloc(64, (B * K + 64) & ~63L);
    float *sx = malloc(B * KB * sizeof(float)), *sq = malloc(B * KB * sizeof(float));
    float *sx8 = malloc((B * KP + 1) * 8 * sizeof(float));
    int32_t *o8 = calloc((B * KP + 1) * 8, sizeof(int32_t));
    int *gidx = malloc(KB * sizeof(int));  // block -> its scale group (no division in the inner loop)
    for (long j = 0; j < KB; j++) gidx[j] = (int)(j / bpg);
    quant_x(x, B, K, KB, qx, sx, sq);
    for (long b = 0; b < B; b++)
        for (long j = 0; j < KP; j++) {  // pair-interleave: [j 0..15 | j+1 0..15][j 16..31 | j+1 16..31]
            int8_t *p = qx + (b * KB + 2 * j) * QB, t[16];
            memcpy(t, p + 16, 16);
            memcpy(p + 16, p + 32, 16);
            memcpy(p + 32, t, 16);
            for (int i = 0; i < 8; i++) sx8[(b * KP + j) * 8 + i] = sx[b * KB + 2 * j + i / 4];
            o8[(b * KP + j) * 8] = (int32_t)(8 * sq[b * KB + 2 * j]);
            o8[(b * KP + j) * 8 + 4] = (int32_t)(8 * sq[b * KB + 2 * j + 1]);
        }
    const int g32 = group == QB;
    const long KO = g32 ? KB / 8 : 0;  // octets: x scales and offsets in int4q_tile's lane order
    float *sxo = malloc((B * KO + 1) * 8 * sizeof(float));
    int32_t *o8o = malloc((B * KO + 1) * 8 * sizeof(int32_t));
    for (long b = 0; b < B; b++)
        for (long o = 0; o < KO; o++)
            for (int i = 0; i < 8; i++) {
                const long blk = b * KB + 8 * o + (i < 4 ? 2 * i : 2 * i - 7);
                sxo[(b * KO + o) * 8 + i] = sx[blk];
                o8o[(b * KO + o) * 8 + i] = (int32_t)(8 * sq[blk]);
            }
#define T(R_, BT_)                                                                                             \
    int4q_tile(g32, R_, BT_, w + n * ldw, ldw, scale + n * G, G, gidx, qx + b0 * K, sx + b0 * KB, sx8 + b0 * KP * 8, \
               o8 + b0 * KP * 8, sq + b0 * KB, sxo + b0 * KO * 8, o8o + b0 * KO * 8, KB, y + b0 * N + n, N)
    FOR_TILES(N, B, K, threads, TUNE_AQ4, NO_WIDEN, T)
#undef T
    free(qx);
    free(sx);
    free(sq);
    free(sx8);
    free(o8);
    free(gidx);
    free(sxo);
    free(o8o);
}

// The bandwidth probe: sum n floats with every thread reading its own contiguous part.
double tl_stream_read(const float *a, long n, int threads) {
    const long chunk = 1 << 14;
    double total = 0.0;
#pragma omp parallel for num_threads(threads) schedule(static) reduction(+ : total)
    for (long c0 = 0; c0 < n; c0 += chunk) {
        long end = c0 + chunk < n ? c0 + chunk : n, k = c0;
        __m256 s0 = _mm256_setzero_ps(), s1 = s0, s2 = s0, s3 = s0;
        for (; k + 32 <= end; k += 32) {
            s0 = _mm256_add_ps(s0, _mm256_loadu_ps(a + k));
            s1 = _mm256_add_ps(s1, _mm256_loadu_ps(a + k + 8));
            s2 = _mm256_add_ps(s2, _mm256_loadu_ps(a + k + 16));
            s3 = _mm256_add_ps(s3, _mm256_loadu_ps(a + k + 24));
        }
        float s = hsum(_mm256_add_ps(_mm256_add_ps(s0, s1), _mm256_add_ps(s2, s3)));
        for (; k < end; k++) s += a[k];
        total += s;
    }
    return total;
}

// 1 when this CPU runs the code above (the Python side asks before the first product).
int tl_cpu_ok(void) {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
}

// Back [p, p + bytes) by 2 MiB pages where the kernel allows (Linux: MADV_COLLAPSE, 6.1+): a batch-1 product
// streams its weights faster from huge pages (d768 step's matrices, 2 threads: 28.0 against 24.5 GB/s; the
// streaming read 32.9 against 29.4), as the hardware prefetchers stop at every 4 KiB page and TLB misses go.
// The range is widened to whole 2 MiB pages when they are mapped (neighbouring heap memory comes along), else
// narrowed to the pages inside it. Returns the bytes collapsed; 0 where nothing could be (no error: an
// optimisation only).
#include <sys/mman.h>
#ifndef MADV_COLLAPSE
#define MADV_COLLAPSE 25
#endif
long tl_huge_pages(void *p, long bytes) {
    const unsigned long H = 2UL << 20, a = (unsigned long)p, e = a + bytes;
    const unsigned long out[2] = {a & ~(H - 1), (e + H - 1) & ~(H - 1)}, in[2] = {(a + H - 1) & ~(H - 1), e & ~(H - 1)};
    for (int i = 0; i < 2; i++) {
        const unsigned long *r = i ? in : out;
        if (r[1] <= r[0]) continue;
        madvise((void *)r[0], r[1] - r[0], MADV_HUGEPAGE);
        if (madvise((void *)r[0], r[1] - r[0], MADV_COLLAPSE) == 0) return (long)(r[1] - r[0]);
    }
    return 0;
}

// ---- many rows (prefill chunks, batches past the engine's 32 lanes): tiled GEMM on AVX-512
//
// The products above keep W rows in registers and walk x rows: right at few rows, where W's bytes are the cost.
// With many rows the multiply-adds are the cost, and a dot-product tile (R W rows x BT x rows, each accumulator
// a vector along k, a horizontal sum per element) spends a load per fma. Here a vector runs along 16 x rows
// instead: x is packed once per call into tiles of 16 rows, column-major within the tile (xp[t][k][16]), and each
// weight is broadcast from its stored row and feeds MB x vectors. A tile of R = 8 W rows x MB = 3 x vectors
// (48 rows) is 24 fmas per 3 + 8 loads, no horizontal sums, and each W panel is read once per 48 rows, from L1.
//   fp32: W rows as stored; bf16 and weight-only int8 / int4: a panel of R rows widened to fp32 once per chunk
//         of x (the same values the row kernels use), then the fp32 tile.
//   act_quant int8 / int4: x quantised per block of 32 as in quant_x (same q and scales, so the same product as
//         formats.reference_linear up to fp32 rounding), stored as q + 128 (vpdpbusd multiplies unsigned by
//         signed bytes); vpdpbusd sums 4 products per lane, 64 per instruction. Per block of 32 the int32 sums
//         start at -128 * sum(w block) (the +128's share, precomputed per panel), then scale into fp32
//         accumulators by the x block's scales (a vector: one per x row) and, for int4, the weight group's scale.
//         int4 panels are unpacked to int8 (q - 8) once per chunk.
// Not batch-invariant (the summation order differs from the row kernels): the dispatcher sends only products of
// more rows than the engine's lanes here, which torch's GEMM ran before.
// Chunks: x tiles are taken in chunks of about 1 MiB (L2 is 1-2 MiB per core on the targets), panels inside a
// chunk split over the threads; W is read once per chunk.
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
#define TL_GEMM 1
#define GT 16        // x rows per vector
#define GR 8         // W rows per fp32 panel
#define GM 3         // x vectors per fp32 tile
#define IR 4         // W rows per integer panel
#define IM 3         // x vectors per integer tile
#define GS 8         // fp32 panels per super-panel: its 64 columns of y are written before the next x tile
#define PFX 32       // k steps ahead that the fp32 tile prefetches x (its 3 streams come from L2)
#define CHUNK_BYTES (1L << 20)

// acc[r][m] holds y[b0 + 16 m + i, n + r] for lanes i: written back transposed, rows past B dropped; times
// scale[r] after adding tail[r][b] (the int8 K tail) where given.
// A full fp32 panel (R = 8) is transposed in registers, 16 rows of 8 floats per vector: the scalar stores of the
// general case cost ~10 % of a K = 768 tile.
INLINE void gemm_store(int R, int MB, __m512 acc[GR][GM], float *y, long ldy, long B, long b0, const float *scale) {
    float t[GT];
    if (R == 8 && !scale) {
        for (int m = 0; m < MB; m++) {
            __m512 u[8];
            for (int h = 0; h < 8; h += 4) {  // rows h..h+3: u[j + h] lane l = acc[h..h+3][m] at x row 4 l + j
                const __m512 t0 = _mm512_unpacklo_ps(acc[h][m], acc[h + 1][m]), t1 = _mm512_unpackhi_ps(acc[h][m], acc[h + 1][m]),
                             t2 = _mm512_unpacklo_ps(acc[h + 2][m], acc[h + 3][m]), t3 = _mm512_unpackhi_ps(acc[h + 2][m], acc[h + 3][m]);
                u[h] = _mm512_shuffle_ps(t0, t2, 0x44), u[h + 1] = _mm512_shuffle_ps(t0, t2, 0xEE);
                u[h + 2] = _mm512_shuffle_ps(t1, t3, 0x44), u[h + 3] = _mm512_shuffle_ps(t1, t3, 0xEE);
            }
            for (int j = 0; j < 4; j++)
                for (int q = 0; q < 2; q++) {  // x rows 8 q + j (low half) and 8 q + 4 + j (high)
                    const __m512 v = _mm512_shuffle_f32x4(_mm512_shuffle_f32x4(u[j], u[j + 4], q ? 0xEE : 0x44),
                                                          _mm512_shuffle_f32x4(u[j], u[j + 4], q ? 0xEE : 0x44), 0xD8);
                    for (int s = 0; s < 2; s++) {
                        const long b = b0 + m * GT + 8 * q + 4 * s + j;
                        if (b < B)
                            _mm256_storeu_ps(y + b * ldy, _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), s)));
                    }
                }
        }
        return;
    }
    for (int r = 0; r < R; r++)
        for (int m = 0; m < MB; m++) {
            _mm512_storeu_ps(t, scale ? _mm512_mul_ps(acc[r][m], _mm512_set1_ps(scale[r])) : acc[r][m]);
            for (int i = 0; i < GT && b0 + m * GT + i < B; i++) y[(b0 + m * GT + i) * ldy + r] = t[i];
        }
}

INLINE void f32_gemm_tile(int R, int MB, const float *w, long ldw, const float *xp, long K, float *y, long ldy,
                          long B, long b0, const float *scale) {
    __m512 acc[GR][GM];
    for (int r = 0; r < R; r++)
        for (int m = 0; m < MB; m++) acc[r][m] = _mm512_setzero_ps();
    for (long k = 0; k < K; k++) {
        __m512 xv[GM];
        for (int m = 0; m < MB; m++) _mm_prefetch((const char *)(xp + (m * K + k + PFX) * GT), _MM_HINT_T0);
        for (int m = 0; m < MB; m++) xv[m] = _mm512_load_ps(xp + (m * K + k) * GT);
        for (int r = 0; r < R; r++) {
            const __m512 wb = _mm512_set1_ps(w[r * ldw + k]);
            for (int m = 0; m < MB; m++) acc[r][m] = _mm512_fmadd_ps(xv[m], wb, acc[r][m]);
        }
    }
    gemm_store(R, MB, acc, y, ldy, B, b0, scale);
}

// xq: [t][K/4 words][16] of q + 128; sxq: [t][KB][16]; corr: [R][KB]; wsc: [R][G] (int4) or 0 (int8).
INLINE void int_gemm_tile(int R, int MB, const int8_t *w, long ldw, const int32_t *corr, const float *wsc, long G,
                          long bpg, const int32_t *xq, const float *sxq, long KB, float *y, long ldy, long B,
                          long b0, const float *scale) {
    __m512 acc[GR][GM];
    for (int r = 0; r < R; r++)
        for (int m = 0; m < MB; m++) acc[r][m] = _mm512_setzero_ps();
    // g: the weight group of block blk, counted up (a division per block cost ~a third of an int4 tile)
    for (long blk = 0, g = 0, in_g = 0; blk < KB; blk++) {
        __m512i ai[IR][IM];
        for (int r = 0; r < R; r++)
            for (int m = 0; m < MB; m++) ai[r][m] = _mm512_set1_epi32(corr[r * KB + blk]);
        const int32_t *xb = xq + blk * 8 * GT;
        // fully unrolled: otherwise gcc copies every accumulator after each vpdpbusd (a move per instruction)
#pragma GCC unroll 8
        for (int s = 0; s < QB / 4; s++) {
            __m512i xv[IM];
            for (int m = 0; m < MB; m++) xv[m] = _mm512_load_si512(xb + (m * KB * 8 + s) * GT);
            for (int r = 0; r < R; r++) {
                int32_t wd;
                memcpy(&wd, w + r * ldw + blk * QB + 4 * s, 4);
                const __m512i wb = _mm512_set1_epi32(wd);
                for (int m = 0; m < MB; m++) ai[r][m] = _mm512_dpbusd_epi32(ai[r][m], xv[m], wb);
            }
        }
        for (int m = 0; m < MB; m++) {
            const __m512 sv = _mm512_load_ps(sxq + (m * KB + blk) * GT);
            for (int r = 0; r < R; r++) {
                const __m512 d = wsc ? _mm512_mul_ps(sv, _mm512_set1_ps(wsc[r * G + g])) : sv;
                acc[r][m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(ai[r][m]), d, acc[r][m]);
            }
        }
        if (++in_g == bpg) in_g = 0, g++;
    }
    gemm_store(R, MB, acc, y, ldy, B, b0, scale);
}

#define GSWITCH_MB(R_, mb, TILE)                                                         \
    switch (mb) { case 1: TILE(R_, 1); break; case 2: TILE(R_, 2); break; default: TILE(R_, 3); break; }
#define GSWITCH(R, mb, TILE)                                                             \
    switch (R) {                                                                         \
        case 1: GSWITCH_MB(1, mb, TILE) break; case 2: GSWITCH_MB(2, mb, TILE) break;    \
        case 3: GSWITCH_MB(3, mb, TILE) break; case 4: GSWITCH_MB(4, mb, TILE) break;    \
        case 5: GSWITCH_MB(5, mb, TILE) break; case 6: GSWITCH_MB(6, mb, TILE) break;    \
        case 7: GSWITCH_MB(7, mb, TILE) break; default: GSWITCH_MB(8, mb, TILE) break; }

// x [B, K] -> tile t of xp[t][k][16], rows past B zero; a gather per k (scalar, this was ~10 % of a K = 768
// product at N = 768).
static void pack_f32(const float *x, long B, long K, long t, float *xp) {
    float *d = xp + t * K * GT;
    const __m512i idx = _mm512_mullo_epi32(_mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0),
                                           _mm512_set1_epi32((int)K));
    const __mmask16 live = B - t * GT >= GT ? 0xFFFF : (__mmask16)((1u << (B - t * GT)) - 1);
    for (long k = 0; k < K; k++)
        _mm512_store_ps(d + k * GT, _mm512_mask_i32gather_ps(_mm512_setzero_ps(), live, idx, x + t * GT * K + k, 4));
}

// fmt: F32, BF16, I8 (weight-only, scale per row) or 3 (int4 weight-only, group scales).
static void gemm_widened(int fmt, const float *x, const void *w, const float *scale, float *y, long B, long N,
                         long K, long group, int threads) {
    const long T = (B + GT - 1) / GT, tc = CHUNK_BYTES / (K * GT * 4) < GM ? GM : CHUNK_BYTES / (K * GT * 4);
    float *xp = aligned_alloc(64, T * K * GT * 4);
    const long G = fmt == 3 ? K / group : 0;
#pragma omp parallel num_threads(threads)
    {
        float *wide = fmt == F32 ? 0 : wide_buffer(GS * GR * K);
#pragma omp for schedule(static)
        for (long t = 0; t < T; t++) pack_f32(x, B, K, t, xp);
        for (long c0 = 0; c0 < T; c0 += tc) {
            const long c1 = c0 + tc < T ? c0 + tc : T;
            // super-panels of GS panels: each x tile goes through all of them, so a line of y (16 floats) is
            // written whole before the next tile (panel by panel, at N = 4096, the half-written lines of a chunk
            // fell out of L2 and were read back: gate|up ran 0.8x the other shapes)
#pragma omp for schedule(static) nowait
            for (long p = 0; p < (N + GS * GR - 1) / (GS * GR); p++) {
                const long n = p * GS * GR, RS = N - n < GS * GR ? N - n : GS * GR;
                const float *wp = (const float *)w + n * K, *sc = 0;
                if (fmt == BF16 || fmt == I8) {
                    for (long r = 0; r < RS; r++) widen_rows(fmt, 1, (const char *)w + (n + r) * K * ESZ(fmt), K, wide + r * K);
                    wp = wide;
                    sc = fmt == I8 ? scale + n : 0;
                } else if (fmt == 3) {
                    for (long r = 0; r < RS; r++)
                        widen_rows_int4(1, (const uint8_t *)w + (n + r) * (K / 2), K / 2, scale + (n + r) * G, G, group, K,
                                        wide + r * K);
                    wp = wide;
                }
                for (long t = c0; t < c1; t += GM) {
                    const long mb = c1 - t < GM ? c1 - t : GM;
                    for (long h = 0; h < RS; h += GR) {
                        const long R = RS - h < GR ? RS - h : GR;
#define TILE(R_, MB_) f32_gemm_tile(R_, MB_, wp + h * K, K, xp + t * K * GT, K, y + n + h, N, B, t * GT, sc ? sc + h : 0)
                        GSWITCH(R, mb, TILE)
#undef TILE
                    }
                }
            }
        }
    }
    free(xp);
}

// act_quant: int8 weights (group 0, scale per row) or int4 (group > 0, scale [N][K / group]).
static void gemm_int(const float *x, const void *w, const float *scale, float *y, long B, long N, long K, long group,
                     int threads) {
    const long KB = K / QB, KW = KB * QB / 4, T = (B + GT - 1) / GT, G = group ? K / group : 0;
    const long tc = CHUNK_BYTES / (KW * GT * 4) < IM ? IM : CHUNK_BYTES / (KW * GT * 4);
    int8_t *qx = aligned_alloc(64, (B * KB * QB + 64) & ~63L);
    float *sx = malloc((B * KB + 1) * sizeof(float));
    int32_t *xq = aligned_alloc(64, (T * KW * GT + 16) * 4);
    float *sxq = aligned_alloc(64, (T * KB * GT + 16) * 4);
#pragma omp parallel num_threads(threads)
    {
        // per thread: the panel's int8 rows (int4 unpacked) and corrections, in the wide buffer
        float *buf = wide_buffer(IR * (K + KB) + IR);
        int8_t *wq = (int8_t *)buf;
        int32_t *corr = (int32_t *)(buf + IR * K / 4 + 1);
#pragma omp for schedule(static)
        for (long b = 0; b < B; b++) quant_x(x + b * K, 1, K, KB, qx + b * KB * QB, sx + b * KB, 0);
#pragma omp for schedule(static)
        for (long t = 0; t < T; t++)
            for (long i = 0; i < GT; i++) {
                const long b = t * GT + i;
                const int32_t *src = (const int32_t *)(qx + b * KB * QB);
                for (long j = 0; j < KW; j++) xq[(t * KW + j) * GT + i] = b < B ? src[j] ^ (int32_t)0x80808080 : (int32_t)0x80808080;
                for (long blk = 0; blk < KB; blk++) sxq[(t * KB + blk) * GT + i] = b < B ? sx[b * KB + blk] : 0.0f;
            }
        for (long c0 = 0; c0 < T; c0 += tc) {
            const long c1 = c0 + tc < T ? c0 + tc : T;
#pragma omp for schedule(static) nowait
            for (long p = 0; p < (N + IR - 1) / IR; p++) {
                const long n = p * IR, R = N - n < IR ? N - n : IR;
                const int8_t *wp = (const int8_t *)w + n * K;
                long ldw = K;
                if (group) {  // int4: byte j of a block holds value j (low nibble) and j + 16 (high); q - 8
                    const __m128i lo = _mm_set1_epi8(15), eight = _mm_set1_epi8(8);
                    for (long r = 0; r < R; r++)
                        for (long blk = 0; blk < KB; blk++) {
                            const __m128i v = _mm_loadu_si128((const __m128i *)((const uint8_t *)w + (n + r) * (K / 2) +
                                                                                blk * QB / 2));
                            int8_t *d = wq + r * K + blk * QB;
                            _mm_storeu_si128((__m128i *)d, _mm_sub_epi8(_mm_and_si128(v, lo), eight));
                            _mm_storeu_si128((__m128i *)(d + 16), _mm_sub_epi8(_mm_and_si128(_mm_srli_epi16(v, 4), lo), eight));
                        }
                    wp = wq;
                }
                // the +128 of x's bytes, per block: sad sums (w ^ 0x80) = w + 128 as unsigned bytes
                for (long r = 0; r < R; r++)
                    for (long blk = 0; blk < KB; blk++) {
                        const __m256i v = _mm256_xor_si256(_mm256_loadu_si256((const __m256i *)(wp + r * ldw + blk * QB)),
                                                           _mm256_set1_epi8((char)0x80));
                        const __m256i q = _mm256_sad_epu8(v, _mm256_setzero_si256());
                        const long sum = _mm256_extract_epi64(q, 0) + _mm256_extract_epi64(q, 1) +
                                         _mm256_extract_epi64(q, 2) + _mm256_extract_epi64(q, 3) - 128 * QB;
                        corr[r * KB + blk] = (int32_t)(-128 * sum);
                    }
                for (long t = c0; t < c1; t += IM) {
                    const long mb = c1 - t < IM ? c1 - t : IM;
                    const float *wsc = group ? scale + n * G : 0, *rsc = group ? 0 : scale + n;
                    float *yt = y + n;
#define TILE(R_, MB_)                                                                                          \
    int_gemm_tile(R_, MB_, wp, ldw, corr, wsc, G, group / QB, xq + t * KW * GT, sxq + t * KB * GT, KB, yt, N, B, \
                  t * GT, KB * QB < K ? 0 : rsc)
                    switch (R) { case 1: GSWITCH_MB(1, mb, TILE) break; case 2: GSWITCH_MB(2, mb, TILE) break;
                                 case 3: GSWITCH_MB(3, mb, TILE) break; default: GSWITCH_MB(4, mb, TILE) break; }
#undef TILE
                    if (KB * QB < K)  // int8's K tail in fp32 (x not quantised there, as in quant_x), then the scale
                        for (long b = t * GT; b < B && b < (t + mb) * GT; b++)
                            for (long r = 0; r < R; r++) {
                                float s = 0;
                                for (long k = KB * QB; k < K; k++) s += x[b * K + k] * (float)wp[r * ldw + k];
                                yt[b * N + r] = (yt[b * N + r] + s) * rsc[r];
                            }
                }
            }
        }
    }
    free(qx);
    free(sx);
    free(xq);
    free(sxq);
}

// ---- bf16 weights on AMX (Sapphire Rapids and later): tile dot products, x split into bf16 parts
//
// AMX's TDPBF16PS multiplies a 16 x 32 bf16 tile by a 32 x 16 one into 16 x 16 fp32 sums (the products exact,
// each added in fp32), 8-25x the rate of 512-bit fp32 fmas per core (measured: torch's bf16 mm 1.38 TFLOP/s on one
// thread against 0.17 for its fp32 one). The weights are bf16 already; x is not, and rounding it to bf16 would
// move outputs by ~1e-3 relative, far past the bf16 format's tolerance (the product is x @ float(W)^T in fp32).
// So x is split into XP bf16 parts, x = hi + mid + lo (each part the rounded remainder of the one before: exact
// to ~2^-26 of |x|), and each part is multiplied: XP tile products per block, each exact, summed in fp32, which is
// the fp32 product to fp32 rounding (tests/test_gemm.py, 1e-5). (The 512-bit vdpbf16ps does 2 bf16 pairs per
// lane: with x split in 2 parts it would do as many instructions as the fp32 fmas it replaces, with no gain.)
// Roles: A = W as stored (16 rows of 32 bf16 = 64 bytes, stride K), B = x in the pair layout TDPBF16PS wants
// (xv[p][tile of 16 x rows][block of 32 k][16 pairs][16 rows][2]), packed once per call; C = 16 W rows x 16 x
// rows, written to y transposed. Tiles: C 2 x 2 (tmm0-3), A two W tiles (tmm4-5), B two x tiles (tmm6-7): per
// block of 32 k, 2 + 2 XP tile loads per 4 XP products. Threads split W panels of 32 rows (no K split: the thread
// count changes no bit). A W panel with fewer than 32 rows, or K not a multiple of 32, is copied zero-padded first.
#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__)
#define TL_AMX 1
#include <sys/syscall.h>
#ifndef XP
#define XP 3            // bf16 parts of x
#endif
#define AMX_ROWS 32     // W rows per panel, x rows per pair of B tiles

// The kernel (Linux 5.16+) lets a process use AMX's tile data only once asked (arch_prctl ARCH_REQ_XCOMP_PERM for
// XFEATURE_XTILEDATA); a refusal (older kernels, a hypervisor without it) keeps the 512-bit tiles.
static int amx_ok(void) {
    static int ok = -1;
    if (ok < 0)
        ok = __builtin_cpu_supports("amx-tile") && __builtin_cpu_supports("amx-bf16") &&
             syscall(SYS_arch_prctl, 0x1023, 18) == 0;
    return ok;
}

typedef struct { uint8_t palette, start_row, reserved[14]; uint16_t colsb[16]; uint8_t rows[16]; } amx_cfg;

// This thread's 8 tiles as every AMX kernel here uses them: 16 rows of 64 bytes.
static void amx_configure(void) {
    amx_cfg cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette = 1;
    for (int i = 0; i < 8; i++) cfg.colsb[i] = 64, cfg.rows[i] = 16;
    _tile_loadconfig(&cfg);
}

INLINE __m512 bf16_widen(__m256i h) { return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16)); }

// Rows b of x (zero past B) split into XP bf16 parts, row-major [XP][Bp][K32] (zero past K).
static void amx_split_row(const float *x, long B, long K, long K32, long Bp, long b, uint16_t *parts) {
    for (long k = 0; k < K32; k += 16) {
        const long n = b < B ? (K - k < 16 ? (K - k > 0 ? K - k : 0) : 16) : 0;
        __m512 v = _mm512_maskz_loadu_ps((__mmask16)((1u << n) - 1), x + b * K + k);
        for (int p = 0; p < XP; p++) {
            const __m256i h = (__m256i)_mm512_cvtneps_pbh(v);
            _mm256_storeu_si256((__m256i *)(parts + (p * Bp + b) * K32 + k), h);
            v = _mm512_sub_ps(v, bf16_widen(h));  // exact: the remainder of a rounding to fewer bits
        }
    }
}

// x tile t (16 rows) of part p, block kb, into B's layout: row j holds the pairs (2j, 2j + 1) of the 16 x rows.
static void amx_pack_tile(const uint16_t *parts, long Bp, long K32, long p, long t, long kb, uint32_t *out) {
    const __m512i idx = _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                           _mm512_set1_epi32((int)(K32 / 2)));
    const uint32_t *src = (const uint32_t *)(parts + (p * Bp + t * 16) * K32 + kb * 32);
    for (int j = 0; j < 16; j++) _mm512_storeu_si512(out + j * 16, _mm512_i32gather_epi32(idx, src + j, 4));
}

// C tile (16 W rows n.. x 16 x rows b..) to y[b][n], transposed; rows past B and columns past N dropped.
static void amx_store(const float *c, float *y, long N, long B, long b0, long n0) {
    const __m512i idx = _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                           _mm512_set1_epi32(16));
    const long nn = N - n0 < 16 ? N - n0 : 16;
    for (long i = 0; i < 16 && b0 + i < B; i++)
        _mm512_mask_storeu_ps(y + (b0 + i) * N + n0, (__mmask16)((1u << nn) - 1), _mm512_i32gather_ps(idx, c + i, 4));
}

// W rows n..n+AMX_ROWS-1 as A tiles read them: in place (ldw = K) where whole and K a multiple of 32, else copied
// zero-padded into pad (ldw = K32).
static const uint16_t *amx_panel(const uint16_t *w, long n, long N, long K, long K32, uint16_t *pad, long *ldw) {
    if (K32 == K && N - n >= AMX_ROWS) {
        *ldw = K;
        return w + n * K;
    }
    for (long r = 0; r < AMX_ROWS; r++) {
        uint16_t *d = pad + r * K32;
        if (n + r < N) {
            memcpy(d, w + (n + r) * K, K * 2);
            memset(d + K, 0, (K32 - K) * 2);
        } else
            memset(d, 0, K32 * 2);
    }
    *ldw = K32;
    return pad;
}

static void gemm_amx_bf16(const float *x, const uint16_t *w, float *y, long B, long N, long K, int threads) {
    const long K32 = (K + 31) & ~31L, KB = K32 / 32, Bp = (B + AMX_ROWS - 1) / AMX_ROWS * AMX_ROWS, T = Bp / 16;
    // x rows per chunk: its packed parts in about 1 MiB (L2 is 2 MiB per core on Sapphire Rapids)
    long rc = CHUNK_BYTES / (XP * K32 * 2) / AMX_ROWS * AMX_ROWS;
    if (rc < AMX_ROWS) rc = AMX_ROWS;
    uint16_t *parts = aligned_alloc(64, XP * Bp * K32 * 2);
    uint32_t *xv = aligned_alloc(64, XP * T * KB * 1024);  // [p][t][kb] tiles of 1 KiB
#pragma omp parallel num_threads(threads)
    {
        amx_configure();
        // per thread: a zero-padded W panel, then the 4 C tiles (64-byte aligned: K32 is a multiple of 32)
        uint16_t *pad = (uint16_t *)wide_buffer(AMX_ROWS * K32 / 2 + 1024);
        float *c = (float *)pad + AMX_ROWS * K32 / 2;
#pragma omp for schedule(static)
        for (long b = 0; b < Bp; b++) amx_split_row(x, B, K, K32, Bp, b, parts);
#pragma omp for schedule(static) collapse(2)
        for (long p = 0; p < XP; p++)
            for (long t = 0; t < T; t++)
                for (long kb = 0; kb < KB; kb++) amx_pack_tile(parts, Bp, K32, p, t, kb, xv + ((p * T + t) * KB + kb) * 256);
        for (long c0 = 0; c0 < Bp; c0 += rc) {
            const long c1 = c0 + rc < Bp ? c0 + rc : Bp;
#pragma omp for schedule(static) nowait
            for (long pn = 0; pn < (N + AMX_ROWS - 1) / AMX_ROWS; pn++) {
                const long n = pn * AMX_ROWS;
                long ldw;
                const uint16_t *wp = amx_panel(w, n, N, K, K32, pad, &ldw);
                for (long b = c0; b < c1; b += AMX_ROWS) {
                    const long t = b / 16;
                    _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);
                    for (long kb = 0; kb < KB; kb++) {
                        _tile_loadd(4, wp + kb * 32, ldw * 2);
                        _tile_loadd(5, wp + 16 * ldw + kb * 32, ldw * 2);
                        for (long p = 0; p < XP; p++) {
                            const uint32_t *xt = xv + ((p * T + t) * KB + kb) * 256;
                            _tile_loadd(6, xt, 64);
                            _tile_loadd(7, xt + KB * 256, 64);  // tile t + 1, the same block
                            _tile_dpbf16ps(0, 4, 6);
                            _tile_dpbf16ps(1, 4, 7);
                            _tile_dpbf16ps(2, 5, 6);
                            _tile_dpbf16ps(3, 5, 7);
                        }
                    }
                    _tile_stored(0, c, 64);
                    _tile_stored(1, c + 256, 64);
                    _tile_stored(2, c + 512, 64);
                    _tile_stored(3, c + 768, 64);
                    for (int i = 0; i < 4; i++)
                        if (n + 16 * (i >> 1) < N) amx_store(c + 256 * i, y, N, B, b + 16 * (i & 1), n + 16 * (i >> 1));
                }
            }
        }
        _tile_release();
    }
    free(parts);
    free(xv);
}

// bf16 rows on AMX (tl_linear_bf16 where amx_ok(): decode rows, any B). x is split into XP parts as above, but
// each part is summed on its own over K (block after block, in its own C column) and a row's element is then
// (hi + mid) + lo: a tile product gives every column the same sum wherever the column lies, so the parts can be
// laid out by B and the product is still batch-invariant:
//   XP * B <= 16 (batch 1 to 5): one x tile, column XP * b + p holding part p of row b, so a W tile times it gives
//       every part of every row in one tile product per block, where parts as tiles take XP: at batch 1 the AMX
//       unit had held that layout to 0.85x the row kernel's rate. The parts' columns are gathered into y.
//   more rows: per group of 16 x rows, one tile per part (column b % 16), each into its own C tile (3 of them per
//       W tile of 16 rows); the three are added as vectors and written to y transposed.
// Made for few rows inside a C block's team: there is no barrier, so each thread splits and packs all of x itself
// (XP * B * K values, against the N * K * B multiply-adds it shares out), then takes its W panels of 32 rows.
// At few rows the panels stream from memory, and a tile load takes 64 bytes from each of 16 rows, which the
// hardware prefetchers follow worse than the row kernels' single stream (0.75-0.85x their rate at batch 1), so the
// loop prefetches each row AMX_AHEAD blocks ahead, into the next panel at the end of one (further ahead, or the next
// panel whole, was slower: L1 is 48 KiB).
#ifndef AMX_AHEAD
#define AMX_AHEAD 2
#endif
#if XP != 3
#error "amx_rows_bf16 holds XP = 3 parts in tiles 4-6"
#endif

// Prefetch, at block kb of `rows` W rows read from wp (ldw apart), the block AMX_AHEAD further on, or past the end the
// start of the rows at `after` (NULL: none).
INLINE void amx_ahead(const uint16_t *wp, long ldw, long kb, long KB, const uint16_t *after, int rows) {
    const uint16_t *f = kb + AMX_AHEAD < KB ? wp + (kb + AMX_AHEAD) * 32 : after ? after + (kb + AMX_AHEAD - KB) * 32 : 0;
    if (f)
        for (int r = 0; r < rows; r++) _mm_prefetch((const char *)(f + r * ldw), _MM_HINT_T0);
}

// Rows 0..B-1 (B <= AMX_ROWS) of x into y, tiles configured.
static void amx_rows_chunk(const float *x, const uint16_t *w, float *y, long B, long N, long K) {
    const long K32 = (K + 31) & ~31L, KB = K32 / 32, dense = XP * B <= 16, T = dense ? 1 : (B + 15) / 16 * XP;
    const long panels = (N + AMX_ROWS - 1) / AMX_ROWS;
    const int direct = K32 == K;
    // per thread: the parts, the packed tiles, a zero-padded W panel, then C tiles (all 64-byte aligned)
    const long n_parts = (XP * B * K32 / 2 + 15) & ~15L, n_tiles = T * KB * 256, n_pad = AMX_ROWS * K32 / 2;
    float *buf = wide_buffer(n_parts + n_tiles + n_pad + 1024);
    uint16_t *parts = (uint16_t *)buf, *pad = (uint16_t *)(buf + n_parts + n_tiles);
    uint32_t *xv = (uint32_t *)(buf + n_parts);
    float *c = buf + n_parts + n_tiles + n_pad;
    for (long b = 0; b < B; b++) amx_split_row(x, B, K, K32, B, b, parts);
    memset(xv, 0, n_tiles * 4);
    for (long b = 0; b < B; b++)
        for (long p = 0; p < XP; p++) {
            const long t = dense ? 0 : b / 16 * XP + p, col = dense ? XP * b + p : b % 16;
            const uint32_t *pairs = (const uint32_t *)(parts + (p * B + b) * K32);
            for (long kb = 0; kb < KB; kb++)
                for (long j = 0; j < 16; j++) xv[((t * KB + kb) * 16 + j) * 16 + col] = pairs[kb * 16 + j];
        }
    const __m512i down = _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                            _mm512_set1_epi32(16));
#pragma omp for schedule(static) nowait
    for (long pn = 0; pn < panels; pn++) {
        const long n = pn * AMX_ROWS;
        long ldw;
        const uint16_t *wp = amx_panel(w, n, N, K, K32, pad, &ldw);
        // the next whole panel, streamed while this one runs (read in place, this one is prefetched as it goes)
        const uint16_t *after = pn + 1 < panels && N - n >= 2 * AMX_ROWS ? w + (n + AMX_ROWS) * K : 0;
        if (dense) {  // both W tiles against the one x tile
            _tile_zero(0); _tile_zero(1);
            for (long kb = 0; kb < KB; kb++) {
                if (direct) amx_ahead(wp, ldw, kb, KB, after, AMX_ROWS);
                _tile_loadd(4, wp + kb * 32, ldw * 2);
                _tile_loadd(5, wp + 16 * ldw + kb * 32, ldw * 2);
                _tile_loadd(6, xv + kb * 256, 64);
                _tile_dpbf16ps(0, 4, 6);
                _tile_dpbf16ps(1, 5, 6);
            }
            _tile_stored(0, c, 64);
            _tile_stored(1, c + 256, 64);
            for (long i = 0; i < 2 && n + 16 * i < N; i++) {
                const __mmask16 m = N - n - 16 * i >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (N - n - 16 * i)) - 1);
                for (long b = 0; b < B; b++) {
                    const float *cb = c + i * 256 + XP * b;
                    const __m512 hi = _mm512_i32gather_ps(down, cb, 4), mid = _mm512_i32gather_ps(down, cb + 1, 4);
                    const __m512 lo = _mm512_i32gather_ps(down, cb + 2, 4);
                    _mm512_mask_storeu_ps(y + b * N + n + 16 * i, m, _mm512_add_ps(_mm512_add_ps(hi, mid), lo));
                }
            }
            continue;
        }
        for (long i = 0; i < 2 && n + 16 * i < N; i++)  // each W tile against each group's three part tiles
            for (long g = 0; g < T / XP; g++) {
                const uint32_t *xg = xv + g * XP * KB * 256;
                _tile_zero(0); _tile_zero(1); _tile_zero(2);
                for (long kb = 0; kb < KB; kb++) {
                    if (direct && g == 0) amx_ahead(wp + 16 * i * ldw, ldw, kb, KB, i ? after : wp + 16 * ldw, 16);
                    _tile_loadd(3, wp + 16 * i * ldw + kb * 32, ldw * 2);
                    _tile_loadd(4, xg + kb * 256, 64);
                    _tile_loadd(5, xg + (KB + kb) * 256, 64);
                    _tile_loadd(6, xg + (2 * KB + kb) * 256, 64);
                    _tile_dpbf16ps(0, 3, 4);
                    _tile_dpbf16ps(1, 3, 5);
                    _tile_dpbf16ps(2, 3, 6);
                }
                _tile_stored(0, c, 64);
                _tile_stored(1, c + 256, 64);
                _tile_stored(2, c + 512, 64);
                for (int j = 0; j < 256; j += 16)
                    _mm512_storeu_ps(c + j, _mm512_add_ps(_mm512_add_ps(_mm512_loadu_ps(c + j), _mm512_loadu_ps(c + 256 + j)),
                                                          _mm512_loadu_ps(c + 512 + j)));
                amx_store(c, y, N, B, 16 * g, n + 16 * i);
            }
    }
}

// Any B, in chunks of AMX_ROWS rows (a chunk's rows sum as in any other: the per-thread buffers stay small).
static void amx_rows_bf16(const float *x, const uint16_t *w, float *y, long B, long N, long K) {
    amx_configure();
    for (long b0 = 0; b0 < B; b0 += AMX_ROWS)
        amx_rows_chunk(x + b0 * K, w, y + b0 * N, B - b0 < AMX_ROWS ? B - b0 : AMX_ROWS, N, K);
    _tile_release();
}
#endif
#endif

int tl_gemm_ok(void);

// y = x W^T for bf16 W and B rows (decode rows, any B): on AMX tiles where the CPU has them (amx_rows_bf16), else the
// row kernel. Either is batch-invariant; the choice is the machine's, made once per process (tl_set_amx).
static int use_amx_rows = 1;
void tl_set_amx(int on) { use_amx_rows = on; }

void tl_linear_bf16(const float *x, const uint16_t *w, float *y, long B, long N, long K, int threads) {
#ifdef TL_AMX
    if (use_amx_rows && tl_gemm_ok() == 512 && amx_ok()) {
        if (threads > 1) {
#pragma omp parallel num_threads(threads)
            amx_rows_bf16(x, w, y, B, N, K);
        } else
            amx_rows_bf16(x, w, y, B, N, K);
        return;
    }
#endif
    rows_bf16(x, w, y, B, N, K, threads);
}

// ---- many rows on AVX2 + FMA: the same scheme, 8 x rows per vector (every CPU these kernels run on)
//
// Where AVX-512 VNNI is missing (AMD Zen 1-3, Intel before Ice Lake) the tiles are 256 bits wide: x packed into
// tiles of 8 rows (xp[t][k][8]), each weight broadcast into the fmas of AM x vectors, a tile of AR W rows x AM
// vectors holding 12 accumulators of the 16 registers (3 + 4 loads per 12 fmas: the x vectors held in registers,
// else gcc folds a load into every fma and loads, 16 per 12 fmas, are the limit). The x tiles that remain after
// groups of AM (40 rows: 3 + 2 tiles; 4 tiles go as 2 + 2) take panels of AR2 W rows, so 2 vectors still hold 12
// accumulators (with AR rows, 8: the 40-row products ran 5-25 % slower, the 16-row group 1.3x).
//   fp32, bf16, weight-only int8 / int4: blocked over W rows and K (a2_gemm_f32), panels widened once per block.
//   act_quant int8: x quantised as quant_x does and packed as the values q * d (exactly what
//         formats.reference_linear multiplies), then the same fp32 tile over the widened panel, the row scale at
//         the end. Without VNNI an int8 x int8 product costs maddubs (sign trick, since both are signed) plus a madd
//         to 32 bits every 4 values, as many multiply uops per value as an fp32 fma on a 128-bit-wide core (Zen 1),
//         so the integer route cannot beat the fp32 one there; x's rounding is the same either way.
//   act_quant int4: on integers. Weights unpacked to q in 0..15 (unsigned, maddubs' first operand) and x signed,
//         so a pair of products is at most 2 * 15 * 127 and a whole block of 32 sums in int16 (8 * 3810 < 2^15):
//         one maddubs and one add per 4 values x 8 rows, one madd to 32 bits per block; the -8 offset comes off
//         as 8 * sum(q_x) per block and row (precomputed), then one convert and one fma by the x scales times the
//         group's scale. Tiles of 2 W rows x 2 vectors (int16 and fp32 sums for each: 8 registers).
// Every element is one fma chain over K in order (fp32) or over its blocks in order (int4), whatever the tile, the
// chunk or the thread count; still not the row kernels' order, so the dispatcher's rule (only past the lanes) holds.
#define AT 8   // x rows per vector
#define AR 4   // W rows per fp32 panel
#define AR2 6  // W rows per panel for 1 or 2 x vectors (12 accumulators for 2)
#define AM 3   // x vectors per fp32 tile
#define QR 2   // W rows per int4 panel
#define QM 2   // x vectors per int4 tile

// x's chunk is shared by the threads, so it has to stay in every core's L2: half of it (Zen 1: 512 KiB per core).
static long a2_chunk_bytes(void) {
    static long bytes;
    if (!bytes) {
        const long l2 = sysconf(_SC_LEVEL2_CACHE_SIZE);
        bytes = l2 > 0 ? l2 / 2 : 256L << 10;
    }
    return bytes;
}

// Tile t of xp[t][k][8] from x [B, K] (rows past B zero); with qx / sx (act_quant), the first KB blocks of each row
// are its quantised values q * d and the K tail stays as it is, as in formats.quantize_activations.
static void a2_pack(const float *x, const int8_t *qx, const float *sx, long B, long K, long KB, long t, float *xp) {
    float *d = xp + t * K * AT;
    for (long i = 0; i < AT; i++) {
        const long b = t * AT + i;
        for (long k = 0; k < K; k++) {
            float v = 0.0f;
            if (b < B) v = qx && k < KB * QB ? qx[b * KB * QB + k] * sx[b * KB + k / QB] : x[b * K + k];
            d[k * AT + i] = v;
        }
    }
}

#ifndef A2_KC
#define A2_KC 256  // k per block: a tile's x (24 rows x KC) stays in L1 while the block's W panels stream from L2
#endif
#ifndef A2_NC
#define A2_NC 64  // W rows per block: the block's widened panels, NC x KC, stay in L2 while x's tiles pass
#endif

// c[r] holds y[i, r] for x rows i < 8 (W row r; times scale[r] where scale): written to y [rows][ldy], rows past
// `rows` dropped; four whole W rows of eight x rows through one 8 x 4 transpose.
INLINE void a2_out(int R, __m256 c[AR], float *y, long ldy, long rows, const float *scale) {
    if (scale)
        for (int r = 0; r < R; r++) c[r] = _mm256_mul_ps(c[r], _mm256_set1_ps(scale[r]));
    if (R == AR && rows >= AT) {
        const __m256 t0 = _mm256_unpacklo_ps(c[0], c[1]), t1 = _mm256_unpackhi_ps(c[0], c[1]);
        const __m256 t2 = _mm256_unpacklo_ps(c[2], c[3]), t3 = _mm256_unpackhi_ps(c[2], c[3]);
        const __m256 u[4] = {_mm256_shuffle_ps(t0, t2, 0x44), _mm256_shuffle_ps(t0, t2, 0xEE),
                             _mm256_shuffle_ps(t1, t3, 0x44), _mm256_shuffle_ps(t1, t3, 0xEE)};  // rows i, i + 4
        for (int i = 0; i < 4; i++) {
            _mm_storeu_ps(y + i * ldy, _mm256_castps256_ps128(u[i]));
            _mm_storeu_ps(y + (i + 4) * ldy, _mm256_extractf128_ps(u[i], 1));
        }
        return;
    }
    float t[AR][AT];
    for (int r = 0; r < R; r++) _mm256_storeu_ps(t[r], c[r]);
    for (long i = 0; i < AT && i < rows; i++)
        for (int r = 0; r < R; r++) y[i * ldy + r] = t[r][i];
}

// The sums of MB x vectors (xp + m * xs, x rows b0 + 8 m + i) for R <= AR2 W rows (wp + r * ldw) over KC values:
// added to acc [MB][R][8] (zero first where first), or where last written to y (ldy, rows past B dropped).
INLINE void a2_micro(int R, int MB, const float *wp, long ldw, const float *xp, long xs, long KC, float *acc,
                     int first, int last, float *y, long ldy, long B, long b0, const float *scale) {
    __m256 c[AM][AR2];
    for (int r = 0; r < R; r++)
        for (int m = 0; m < MB; m++) c[m][r] = first ? _mm256_setzero_ps() : _mm256_load_ps(acc + (m * R + r) * AT);
    for (long k = 0; k < KC; k++) {
        __m256 xv[AM];
        for (int m = 0; m < MB; m++) xv[m] = in_reg(_mm256_load_ps(xp + m * xs + k * AT));
        for (int r = 0; r < R; r++) {
            const __m256 wb = _mm256_broadcast_ss(wp + r * ldw + k);
            for (int m = 0; m < MB; m++) c[m][r] = _mm256_fmadd_ps(xv[m], wb, c[m][r]);
        }
    }
    __m256 out[AM][AR2];  // a copy for the store: with c's own address taken, gcc would keep c in memory in the loop
    for (int r = 0; r < R; r++)
        for (int m = 0; m < MB; m++) out[m][r] = in_reg(c[m][r]);
    for (int m = 0; m < MB; m++)
        if (last)
            for (int r0 = 0; r0 < R; r0 += AR)
                a2_out(R - r0 < AR ? R - r0 : AR, out[m] + r0, y + (b0 + m * AT) * ldy + r0, ldy, B - b0 - m * AT,
                       scale ? scale + r0 : 0);
        else
            for (int r = 0; r < R; r++) _mm256_store_ps(acc + (m * R + r) * AT, out[m][r]);
}

#define A2SWITCH_R(mb, R_, TILE)                                                         \
    switch (mb) { case 1: TILE(R_, 1); break; case 2: TILE(R_, 2); break; default: TILE(R_, 3); break; }
#define A2SWITCH(R, mb, TILE)                                                            \
    switch (R) {                                                                         \
        case 1: A2SWITCH_R(mb, 1, TILE) break; case 2: A2SWITCH_R(mb, 2, TILE) break;    \
        case 3: A2SWITCH_R(mb, 3, TILE) break; case 4: A2SWITCH_R(mb, 4, TILE) break;    \
        case 5: if (mb == 1) TILE(5, 1); else TILE(5, 2); break;                         \
        default: if (mb == 1) TILE(6, 1); else TILE(6, 2); break; }

// fmt: F32, BF16, I8 (scale per row) or 3 (int4, group scales); act_quant (int8 / int4): x rounded first.
// Blocked as BLIS blocks a GEMM: a thread takes NC W rows at a time (bf16 / int8 / int4 widened to fp32 once, fp32
// read in place), and for each K block of KC runs every x tile of 24 rows (in L1) against the block's rows (in L2).
// Partial sums wait in a buffer between K blocks: storing and reloading an fp32 sum changes no bit, so every
// element is still one fma chain over K in order.
static void a2_gemm_f32(int fmt, const float *x, const void *w, const float *scale, float *y, long B, long N, long K,
                        long group, int act_quant, int threads) {
    const long T = (B + AT - 1) / AT, KB = act_quant ? K / QB : 0, NB = (N + A2_NC - 1) / A2_NC;
    const long G = fmt == 3 ? K / group : 0;
    float *xp = aligned_alloc(64, (T * K * AT * 4 + 63) & ~63L);
    int8_t *qx = act_quant ? aligned_alloc(64, (B * KB * QB + 64) & ~63L) : 0;
    float *sx = act_quant ? malloc((B * KB + 1) * sizeof(float)) : 0;
#pragma omp parallel num_threads(threads)
    {
        float *wide = fmt == F32 ? 0 : tl_thread_buffer(0, A2_NC * K);
        float *acc = tl_thread_buffer(2, T * A2_NC * AT);  // [t][n][8] for the block's NC rows
        if (act_quant) {
#pragma omp for schedule(static)
            for (long b = 0; b < B; b++) quant_x(x + b * K, 1, K, KB, qx + b * KB * QB, sx + b * KB, 0);
        }
#pragma omp for schedule(static)
        for (long t = 0; t < T; t++) a2_pack(x, qx, sx, B, K, KB, t, xp);
#pragma omp for schedule(dynamic, 1)
        for (long nb = 0; nb < NB; nb++) {
            const long n0 = nb * A2_NC, RN = N - n0 < A2_NC ? N - n0 : A2_NC;
            const float *wb = (const float *)w + n0 * K;
            if (fmt == 3) widen_rows_int4(RN, (const uint8_t *)w + n0 * (K / 2), K / 2, scale + n0 * G, G, group, K, wide);
            else if (fmt != F32) widen_rows(fmt, RN, (const char *)w + n0 * K * ESZ(fmt), K, wide);
            if (fmt != F32) wb = wide;
            for (long k0 = 0; k0 < K; k0 += A2_KC) {
                const long kc = K - k0 < A2_KC ? K - k0 : A2_KC;
                for (long t = 0, mb; t < T; t += mb) {
                    mb = T - t == 4 ? 2 : T - t < AM ? T - t : AM;  // (4 tiles as 2 + 2, not 3 + 1)
                    const long ar = mb == AM ? AR : AR2;
                    for (long n = 0; n < RN; n += ar) {
                        const long R = RN - n < ar ? RN - n : ar;
                        const float *wp = wb + n * K + k0, *xt = xp + (t * K + k0) * AT;
                        float *a = acc + (t * A2_NC + n * mb) * AT;
#define TILE(R_, MB_) a2_micro(R_, MB_, wp, K, xt, K * AT, kc, a, k0 == 0, k0 + kc == K, y + n0 + n, N, B, t * AT, \
                              fmt == I8 ? scale + n0 + n : 0)
                        A2SWITCH(R, mb, TILE)
#undef TILE
                    }
                }
            }
        }
    }
    free(xp);
    free(qx);
    free(sx);
}

// xq: [t][K/4 words][8] of q; o8, sxq: [t][KB][8] (8 * sum(q) and d per block); wq: [R][K] nibbles as bytes 0..15;
// wsc: the panel's group scales [R][G]; bpg: blocks per group.
INLINE void a2_int4q_tile(int R, int MB, const uint8_t *wq, long K, const float *wsc, long G, long bpg,
                          const int32_t *xq, const int32_t *o8, const float *sxq, long KB, float *y, long ldy, long B,
                          long b0) {
    const __m256i ones = _mm256_set1_epi16(1);
    __m256 acc[AR][AM];
    for (int r = 0; r < R; r++)
        for (int m = 0; m < MB; m++) acc[r][m] = _mm256_setzero_ps();
    for (long blk = 0, g = 0, in_g = 0; blk < KB; blk++) {
        __m256i s16[QR][QM];
        for (int r = 0; r < R; r++)
            for (int m = 0; m < MB; m++) s16[r][m] = _mm256_setzero_si256();
        const int32_t *xb = xq + blk * 8 * AT;
#pragma GCC unroll 8
        for (int s = 0; s < QB / 4; s++) {
            __m256i xv[QM];
            for (int m = 0; m < MB; m++) xv[m] = in_reg_i(_mm256_load_si256((const __m256i *)(xb + (m * KB * 8 + s) * AT)));
            for (int r = 0; r < R; r++) {
                int32_t wd;
                memcpy(&wd, wq + r * K + blk * QB + 4 * s, 4);
                const __m256i wb = _mm256_set1_epi32(wd);
                for (int m = 0; m < MB; m++)
                    s16[r][m] = in_reg_i(_mm256_add_epi16(s16[r][m], _mm256_maddubs_epi16(wb, xv[m])));
            }
        }
        for (int m = 0; m < MB; m++) {
            const __m256 sv = _mm256_load_ps(sxq + (m * KB + blk) * AT);
            const __m256i ov = _mm256_load_si256((const __m256i *)(o8 + (m * KB + blk) * AT));
            for (int r = 0; r < R; r++) {
                const __m256i p = _mm256_sub_epi32(_mm256_madd_epi16(s16[r][m], ones), ov);
                const __m256 d = _mm256_mul_ps(sv, _mm256_set1_ps(wsc[r * G + g]));
                acc[r][m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), d, acc[r][m]);
            }
        }
        if (++in_g == bpg) in_g = 0, g++;
    }
    __m256 out[AM][AR];  // a copy for the store: with acc's own address taken, gcc kept acc in memory in the loop
    for (int r = 0; r < R; r++)
        for (int m = 0; m < MB; m++) out[m][r] = in_reg(acc[r][m]);
    for (int m = 0; m < MB; m++) a2_out(R, out[m], y + (b0 + m * AT) * ldy, ldy, B - b0 - m * AT, 0);
}

// act_quant int4 (K a multiple of the group, itself a multiple of 32).
static void a2_gemm_int4q(const float *x, const uint8_t *w, const float *scale, float *y, long B, long N, long K,
                          long group, int threads) {
    const long KB = K / QB, KW = K / 4, T = (B + AT - 1) / AT, G = K / group;
    const long per = a2_chunk_bytes() / (KW * AT * 4), tc = per < QM ? QM : per;
    int8_t *qx = aligned_alloc(64, (B * K + 64) & ~63L);
    float *sx = malloc((B * KB + 1) * sizeof(float)), *sq = malloc((B * KB + 1) * sizeof(float));
    int32_t *xq = aligned_alloc(64, (T * KW * AT * 4 + 63) & ~63L);
    int32_t *o8 = aligned_alloc(64, (T * KB * AT * 4 + 63) & ~63L);
    float *sxq = aligned_alloc(64, (T * KB * AT * 4 + 63) & ~63L);
#pragma omp parallel num_threads(threads)
    {
        uint8_t *wq = (uint8_t *)wide_buffer(QR * K / 4 + 1);
#pragma omp for schedule(static)
        for (long b = 0; b < B; b++) quant_x(x + b * K, 1, K, KB, qx + b * K, sx + b * KB, sq + b * KB);
#pragma omp for schedule(static)
        for (long t = 0; t < T; t++)
            for (long i = 0; i < AT; i++) {
                const long b = t * AT + i;
                const int32_t *src = (const int32_t *)(qx + b * K);
                for (long j = 0; j < KW; j++) xq[(t * KW + j) * AT + i] = b < B ? src[j] : 0;
                for (long blk = 0; blk < KB; blk++) {
                    sxq[(t * KB + blk) * AT + i] = b < B ? sx[b * KB + blk] : 0.0f;
                    o8[(t * KB + blk) * AT + i] = b < B ? (int32_t)(8 * sq[b * KB + blk]) : 0;
                }
            }
        for (long c0 = 0; c0 < T; c0 += tc) {
            const long c1 = c0 + tc < T ? c0 + tc : T;
#pragma omp for schedule(static) nowait
            for (long p = 0; p < (N + QR - 1) / QR; p++) {
                const long n = p * QR, R = N - n < QR ? N - n : QR;
                // byte j of a block holds value j (low nibble) and j + 16 (high): unpacked to natural order
                const __m128i lo = _mm_set1_epi8(15);
                for (long r = 0; r < R; r++)
                    for (long blk = 0; blk < KB; blk++) {
                        const __m128i v = _mm_loadu_si128((const __m128i *)(w + (n + r) * (K / 2) + blk * QB / 2));
                        uint8_t *d = wq + r * K + blk * QB;
                        _mm_storeu_si128((__m128i *)d, _mm_and_si128(v, lo));
                        _mm_storeu_si128((__m128i *)(d + 16), _mm_and_si128(_mm_srli_epi16(v, 4), lo));
                    }
                for (long t = c0; t < c1; t += QM) {
                    const long mb = c1 - t < QM ? c1 - t : QM;
#define TILE(R_, MB_)                                                                                          \
    a2_int4q_tile(R_, MB_, wq, K, scale + n * G, G, group / QB, xq + t * KW * AT, o8 + t * KB * AT,            \
                  sxq + t * KB * AT, KB, y + n, N, B, t * AT)
                    if (R == 1) { if (mb == 1) TILE(1, 1); else TILE(1, 2); }
                    else { if (mb == 1) TILE(2, 1); else TILE(2, 2); }
#undef TILE
                }
            }
        }
    }
    free(qx);
    free(sx);
    free(sq);
    free(xq);
    free(o8);
    free(sxq);
}

// Which tiled GEMM runs here: 512 (AVX-512 F/BW/VNNI, compiled in and present), 256 (AVX2 + FMA, which these
// kernels need anyway), 0 (neither). The answer is kept: tl_gemm asks it on every call.
int tl_gemm_ok(void) {
    static int isa = -1;
    if (isa < 0) {
        __builtin_cpu_init();
        isa = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") ? 256 : 0;
#ifdef TL_GEMM
        if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
            __builtin_cpu_supports("avx512vnni"))
            isa = 512;
#endif
    }
    return isa;
}

// 1 where tl_gemm multiplies bf16 weights on AMX tiles (compiled in, present, and allowed by the kernel), else 0.
int tl_gemm_amx(void) {
#ifdef TL_AMX
    return tl_gemm_ok() == 512 && amx_ok();
#else
    return 0;
#endif
}

// y[B, N] = x[B, K] @ W^T for many rows. fmt 0 fp32, 1 bf16, 2 int8 (scale [N]), 3 int4 (scale [N][K / group]);
// act_quant: int8 / int4 on integers (AVX2: int8 through fp32, see above). Only where tl_gemm_ok().
void tl_gemm(int fmt, const float *x, const void *w, const float *scale, float *y, long B, long N, long K, long group,
             int act_quant, int threads) {
    const int f = fmt == 0 ? F32 : fmt == 1 ? BF16 : fmt == 2 ? I8 : 3;
    act_quant = act_quant && fmt >= 2;
#ifdef TL_GEMM
    if (tl_gemm_ok() == 512) {
        // K < 32 (int8): no whole block to quantise, so the product is the weight-only one (quant_x leaves a tail
        // as it is), and gemm_int's chunk size would divide by zero
        if (act_quant && K >= QB) gemm_int(x, w, scale, y, B, N, K, fmt == 3 ? group : 0, threads);
#ifdef TL_AMX
        else if (f == BF16 && amx_ok()) gemm_amx_bf16(x, w, y, B, N, K, threads);
#endif
        else gemm_widened(f, x, w, scale, y, B, N, K, group, threads);
        return;
    }
#endif
    if (act_quant && fmt == 3) a2_gemm_int4q(x, w, scale, y, B, N, K, group, threads);
    else a2_gemm_f32(f, x, w, scale, y, B, N, K, group, act_quant, threads);
}
