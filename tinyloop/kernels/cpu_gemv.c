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
//          B > 4 2 rows; tiles of up to 2 x rows prefetch the weight stream (without: int8 1.44x the time at B = 1).
// widen: from this B on (bf16 / int8 16, int4 4) a block's rows are widened to fp32 once, into a per-thread
// buffer, and the fp32 tile runs on them; below it, reconverting in registers per tile was as fast or faster.

// The height of the next tile, with `left` x rows still to do, for R weight rows with `per` accumulators per
// element: at most 12 accumulators (of 16 vector registers) and 4 x rows; 4 rows left of a cap of 3 go as 2 + 2.
INLINE int next_tile(long left, int R, int per) {
    const int fit = 12 / (R * per), cap = fit < 4 ? fit : 4;
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
// attention scores (cpu_block.c).
float *tl_thread_buffer(int slot, long n) {
    static __thread float *buf[2];
    static __thread long size[2];
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

void tl_linear_f32(const float *x, const float *w, float *y, long B, long N, long K, int threads) {
    const float *wscale = 0;
#define T(R_, BT_) dense_tile(F32, per_elem, R_, BT_, w + n * K, K, x + b0 * K, K, y + b0 * N + n, N, 0)
    FOR_TILES(N, B, K, threads, TUNE_F32, NO_WIDEN, T)
#undef T
    (void)wscale;
}

void tl_linear_bf16(const float *x, const uint16_t *w, float *y, long B, long N, long K, int threads) {
    const float *wscale = 0;
#define T(R_, BT_) dense_tile(BF16, per_elem, R_, BT_, w + n * K, K, x + b0 * K, K, y + b0 * N + n, N, 0)
#define W(R_, buf) widen_rows(BF16, R_, w + n * K, K, buf)
    FOR_TILES(N, B, K, threads, TUNE_BF16, W, T)
#undef W
#undef T
    (void)wscale;
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
    quant_x(x, B, K, KB, qx, sx, 0);
#define T(R_, BT_) int8q_tile(R_, BT_, w + n * K, K, scale + n, qx + b0 * KB * QB, sx + b0 * KB, KB, \
                              x + b0 * K, K, y + b0 * N + n, N)
    FOR_TILES(N, B, K, threads, TUNE_AQ8, NO_WIDEN, T)
#undef T
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
