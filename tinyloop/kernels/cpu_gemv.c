// y[B, N] = x[B, K] @ W^T on the CPU for every weight format of tinyloop/formats.py (AVX2 + FMA, OpenMP).
//
// Decode at batch 1 reads every weight byte once per token and does 2 flops per weight, so the product is bound
// by memory bandwidth: the goal is to stream W at the machine's read bandwidth, in bytes of the stored format.
// Shape of every kernel:
//   - threads split the N rows (contiguous chunks, so each thread streams its own part of W);
//   - a tile is R = 1 or 2 rows of W times BT <= 4 rows of x: each weight vector loaded (and widened) once feeds
//     BT fmas, and the next batch tile rereads the same W rows from L1 (for B > 4 widened to fp32 once), so W
//     comes from memory once for any B;
//   - U independent accumulators per (row, batch row) when BT is small, to cover the 4-cycle FMA latency.
// Two ways to multiply by int8 / int4 weights:
//   weight-only  x stays fp32, weights are widened to fp32 in registers, fp32 accumulation: this is
//                formats.reference_linear up to fp32 rounding.
//   act_quant    x is quantised to int8 per block of 32 values (scale = max|x| / 127) and the block dot products
//                run on integers (maddubs + madd): fewer instructions per weight byte, at the cost of the
//                activation rounding (~0.5% of the output scale at most, x ~ randn, K = 768..2048).
#include <immintrin.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define INLINE static inline __attribute__((always_inline))
#define QB 32  // values per activation-quantisation block (and per int4 nibble block)

enum { F32, BF16, I8 };

INLINE float hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

// ---- weight-only, formats with one value per element: fp32, bf16, int8 (its row scale is applied at the end)

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

// out[b * ldy + r] = sum_k x[b, k] * w[r, k] for r < R, b < BT; w rows are `ldw` elements apart.
INLINE void dense_tile(int fmt, int R, int BT, const void *w, long ldw, const float *x, long K, float *out,
                       long ldy, const float *scale) {
    const int U = BT == 1 ? 4 : BT == 2 ? 2 : 1;
    const int esz = fmt == F32 ? 4 : fmt == BF16 ? 2 : 1;
    const char *wr[2] = {(const char *)w, (const char *)w + ldw * esz};
    __m256 acc[4][2][4];
    for (int u = 0; u < U; u++)
        for (int r = 0; r < R; r++)
            for (int b = 0; b < BT; b++) acc[u][r][b] = _mm256_setzero_ps();
    long k = 0;
    for (; k + 8 * U <= K; k += 8 * U)
        for (int u = 0; u < U; u++)
            for (int r = 0; r < R; r++) {
                __m256 wv = load8(fmt, wr[r], k + 8 * u);
                for (int b = 0; b < BT; b++)
                    acc[u][r][b] = _mm256_fmadd_ps(wv, _mm256_loadu_ps(x + b * K + k + 8 * u), acc[u][r][b]);
            }
    for (; k + 8 <= K; k += 8)
        for (int r = 0; r < R; r++) {
            __m256 wv = load8(fmt, wr[r], k);
            for (int b = 0; b < BT; b++)
                acc[0][r][b] = _mm256_fmadd_ps(wv, _mm256_loadu_ps(x + b * K + k), acc[0][r][b]);
        }
    for (int r = 0; r < R; r++)
        for (int b = 0; b < BT; b++) {
            __m256 a = acc[0][r][b];
            for (int u = 1; u < U; u++) a = _mm256_add_ps(a, acc[u][r][b]);
            float s = hsum(a);
            for (long j = k; j < K; j++) s += x[b * K + j] * load1(fmt, wr[r], j);  // K tail
            out[b * ldy + r] = scale ? s * scale[r] : s;
        }
}

// ---- weight-only int4: 16 bytes = 32 values; byte j holds value j (low nibble) and j + 16 (high nibble).
// Unpacking: 8 bytes zero-extended to 8 dwords; & 15 gives values 8h.., >> 4 values 16 + 8h.. (3 ops / 16 values).

INLINE float dot(const float *a, const float *b, long n) {
    __m256 acc = _mm256_setzero_ps();
    long k = 0;
    for (; k + 8 <= n; k += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(a + k), _mm256_loadu_ps(b + k), acc);
    float s = hsum(acc);
    for (; k < n; k++) s += a[k] * b[k];
    return s;
}

// out = sum_k x[b, k] * (q[r, k] - 8) * s[r, k / group].
// One x row (BT = 1): the scale is applied per group to the partial sum of x * q and the offset comes off at the
//   end with the group sums of x (x8[g] = 8 sum x_g): sum_g s_g (sum x q) - sum_g s_g x8[g]. 2 fewer ops per 16.
// Several rows: each weight vector is dequantised once (w = q s - 8 s, one fma) and feeds BT fmas.
INLINE void int4_tile(int R, int BT, const uint8_t *w, long ldw, const float *sc, long ngroups, long group,
                      const float *x, const float *x8, long K, float *out, long ldy) {
    const int U = BT == 1 ? 2 : BT == 2 ? 2 : 1;
    const __m256i lo = _mm256_set1_epi32(0x0F);
    __m256 acc[2][2][4];
    for (int u = 0; u < U; u++)
        for (int r = 0; r < R; r++)
            for (int b = 0; b < BT; b++) acc[u][r][b] = _mm256_setzero_ps();
    for (long g = 0; g < ngroups; g++) {
        __m256 s[2], m8s[2], t[2][2];
        for (int r = 0; r < R; r++) {
            s[r] = _mm256_broadcast_ss(sc + r * ngroups + g);
            m8s[r] = _mm256_mul_ps(s[r], _mm256_set1_ps(-8.0f));
            t[r][0] = t[r][1] = _mm256_setzero_ps();
        }
        for (long k = g * group; k < (g + 1) * group; k += QB)
            for (int h = 0; h < 2; h++)  // bytes 8h..8h+7: values 8h.. (low nibbles) and 16 + 8h.. (high)
                for (int r = 0; r < R; r++) {
                    __m256i q = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(w + r * ldw + k / 2 + 8 * h)));
                    __m256 ql = _mm256_cvtepi32_ps(_mm256_and_si256(q, lo));
                    __m256 qh = _mm256_cvtepi32_ps(_mm256_srli_epi32(q, 4));
                    if (BT == 1) {
                        t[r][0] = _mm256_fmadd_ps(ql, _mm256_loadu_ps(x + k + 8 * h), t[r][0]);
                        t[r][1] = _mm256_fmadd_ps(qh, _mm256_loadu_ps(x + k + 8 * h + 16), t[r][1]);
                        continue;
                    }
                    __m256 wl = _mm256_fmadd_ps(ql, s[r], m8s[r]), wh = _mm256_fmadd_ps(qh, s[r], m8s[r]);
                    for (int b = 0; b < BT; b++) {
                        const float *xb = x + b * K + k + 8 * h;
                        acc[0][r][b] = _mm256_fmadd_ps(wl, _mm256_loadu_ps(xb), acc[0][r][b]);
                        acc[U - 1][r][b] = _mm256_fmadd_ps(wh, _mm256_loadu_ps(xb + 16), acc[U - 1][r][b]);
                    }
                }
        if (BT == 1)
            for (int r = 0; r < R; r++) {
                acc[0][r][0] = _mm256_fmadd_ps(t[r][0], s[r], acc[0][r][0]);
                acc[1][r][0] = _mm256_fmadd_ps(t[r][1], s[r], acc[1][r][0]);
            }
    }
    for (int r = 0; r < R; r++)
        for (int b = 0; b < BT; b++) {
            __m256 a = acc[0][r][b];
            for (int u = 1; u < U; u++) a = _mm256_add_ps(a, acc[u][r][b]);
            out[b * ldy + r] = hsum(a) - (BT == 1 ? dot(sc + r * ngroups, x8, ngroups) : 0.0f);
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
    const int U = BT == 1 ? 2 : 1;
    const __m256i ones = _mm256_set1_epi16(1);
    __m256 acc[2][2][4];
    for (int u = 0; u < U; u++)
        for (int r = 0; r < R; r++)
            for (int b = 0; b < BT; b++) acc[u][r][b] = _mm256_setzero_ps();
    // one block into accumulator set u; blocks are unrolled by U below so that u is a compile-time constant
#define BLOCK(blk, u)                                                                                   \
    for (int r = 0; r < R; r++) {                                                                       \
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
INLINE void int4q_tile(int G32, int R, int BT, const uint8_t *w, long ldw, const float *sc, long ngroups,
                       const int *gidx, const int8_t *qx, const float *sx, const float *sx8, const int32_t *o8,
                       const float *sq, long KB, float *out, long ldy) {
    const int U = BT == 1 ? 2 : 1;
    const __m256i ones = _mm256_set1_epi16(1), lo = _mm256_set1_epi8(0x0F);
    const long KP = KB / 2;  // block pairs
    const __m256i pairlanes = _mm256_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1);
    __m256 acc[2][2][4];
    for (int u = 0; u < U; u++)
        for (int r = 0; r < R; r++)
            for (int b = 0; b < BT; b++) acc[u][r][b] = _mm256_setzero_ps();
#define PAIR(j, u)                                                                                      \
    for (int r = 0; r < R; r++) {                                                                       \
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
    long j = 0;
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
    for (int r = 0; r < R; r++)
        for (int b = 0; b < BT; b++) {
            __m256 a = acc[0][r][b];
            for (int u = 1; u < U; u++) a = _mm256_add_ps(a, acc[u][r][b]);
            out[b * ldy + r] = hsum(a);
        }
}

// ---- widening W rows to fp32 once, for batches of more than one tile (B > 4): the tile loop then runs the fp32
// tile on them from L1 instead of unpacking the same rows again for every 4 x rows.
INLINE void widen_rows(int fmt, int R, const void *w, long K, const float *scale, float *out) {
    for (int r = 0; r < R; r++) {
        const char *wr = (const char *)w + r * K * (fmt == BF16 ? 2 : 1);
        const __m256 s = _mm256_set1_ps(fmt == I8 ? scale[r] : 1.0f);
        long k = 0;
        for (; k + 8 <= K; k += 8) _mm256_storeu_ps(out + r * K + k, _mm256_mul_ps(load8(fmt, wr, k), s));
        for (; k < K; k++) out[r * K + k] = load1(fmt, wr, k) * (fmt == I8 ? scale[r] : 1.0f);
    }
}

INLINE void widen_rows_int4(int R, const uint8_t *w, long ldw, const float *sc, long ngroups, long group, long K,
                            float *out) {
    const __m256i lo = _mm256_set1_epi32(0x0F);
    for (int r = 0; r < R; r++)
        for (long g = 0; g < ngroups; g++) {
            const __m256 s = _mm256_broadcast_ss(sc + r * ngroups + g), m8s = _mm256_mul_ps(s, _mm256_set1_ps(-8.0f));
            for (long k = g * group; k < (g + 1) * group; k += QB)
                for (int h = 0; h < 2; h++) {
                    __m256i q = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(w + r * ldw + k / 2 + 8 * h)));
                    _mm256_storeu_ps(out + r * K + k + 8 * h,
                                     _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_and_si256(q, lo)), s, m8s));
                    _mm256_storeu_ps(out + r * K + k + 8 * h + 16,
                                     _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_srli_epi32(q, 4)), s, m8s));
                }
        }
}

// ---- the row loop: threads take contiguous runs of row blocks; each block walks the batch 4 rows at a time.
// Blocks are 1 row for B <= rows1, else 2 (x loads shared by 2 rows). One row at a time reads W as one sequential
// stream, which the hardware prefetcher follows best: fp32 / bf16 / int8 at B <= 4 stream 15-50% faster that way
// (Zen3, 4096x768, one thread); int4 is the exception (its tiles are bound by the unpacking, which 2 rows amortise).
// WIDEN(R, buf), when `widen` and B > 4, writes the block's R rows as fp32 into buf, and the fp32 tile runs on them.
#define SWITCH_TILES(R, bt, TILE)                                                        \
    if (R == 2) switch (bt) {                                                            \
        case 1: TILE(2, 1); break; case 2: TILE(2, 2); break;                            \
        case 3: TILE(2, 3); break; default: TILE(2, 4); break; }                         \
    else switch (bt) {                                                                   \
        case 1: TILE(1, 1); break; case 2: TILE(1, 2); break;                            \
        case 3: TILE(1, 3); break; default: TILE(1, 4); break; }

#define WIDE_TILE(R_, BT_) dense_tile(F32, R_, BT_, wide, K, x + b0 * K, K, y + b0 * N + n, N, 0)

#define FOR_TILES(N, B, K, threads, rows1, widen, WIDEN, TILE)                           \
    const long RB = (B) <= (rows1) ? 1 : 2;                                              \
    _Pragma("omp parallel num_threads(threads)") {                                       \
        float *wide = (widen) && (B) > 4 ? aligned_alloc(64, (2 * (K) * 4 + 63) & ~63L) : 0; \
        _Pragma("omp for schedule(static)")                                              \
        for (long i = 0; i < ((N) + RB - 1) / RB; i++) {                                 \
            const long n = RB * i;                                                       \
            const int R = n + 1 < (N) && RB == 2 ? 2 : 1;                                \
            if (wide) { WIDEN(R, wide); }                                                \
            for (long b0 = 0; b0 < (B); b0 += 4) {                                       \
                const int bt = (B) - b0 < 4 ? (int)((B) - b0) : 4;                       \
                if (wide) { SWITCH_TILES(R, bt, WIDE_TILE) }                             \
                else { SWITCH_TILES(R, bt, TILE) }                                       \
            }                                                                            \
        }                                                                                \
        free(wide);                                                                      \
    }
#define NO_WIDEN(R_, buf)

void tl_linear_f32(const float *x, const float *w, float *y, long B, long N, long K, int threads) {
#define T(R_, BT_) dense_tile(F32, R_, BT_, w + n * K, K, x + b0 * K, K, y + b0 * N + n, N, 0)
    FOR_TILES(N, B, K, threads, 4, 0, NO_WIDEN, T)
#undef T
}

void tl_linear_bf16(const float *x, const uint16_t *w, float *y, long B, long N, long K, int threads) {
#define T(R_, BT_) dense_tile(BF16, R_, BT_, w + n * K, K, x + b0 * K, K, y + b0 * N + n, N, 0)
#define W(R_, buf) widen_rows(BF16, R_, w + n * K, K, 0, buf)
    FOR_TILES(N, B, K, threads, 4, 1, W, T)
#undef W
#undef T
}

void tl_linear_int8(const float *x, const int8_t *w, const float *scale, float *y, long B, long N, long K,
                    int act_quant, int threads) {
    if (!act_quant) {
#define T(R_, BT_) dense_tile(I8, R_, BT_, w + n * K, K, x + b0 * K, K, y + b0 * N + n, N, scale + n)
#define W(R_, buf) widen_rows(I8, R_, w + n * K, K, scale + n, buf)
        FOR_TILES(N, B, K, threads, 4, 1, W, T)
#undef W
#undef T
        return;
    }
    const long KB = K / QB;
    int8_t *qx = aligned_alloc(64, (B * KB * QB + 64) & ~63L);
    float *sx = malloc((B * KB + 1) * sizeof(float));
    quant_x(x, B, K, KB, qx, sx, 0);
#define T(R_, BT_) int8q_tile(R_, BT_, w + n * K, K, scale + n, qx + b0 * KB * QB, sx + b0 * KB, KB, \
                              x + b0 * K, K, y + b0 * N + n, N)
    FOR_TILES(N, B, K, threads, 4, 0, NO_WIDEN, T)
#undef T
    free(qx);
    free(sx);
}

void tl_linear_int4(const float *x, const uint8_t *w, const float *scale, float *y, long B, long N, long K,
                    long group, int act_quant, int threads) {
    const long G = K / group, ldw = K / 2;
    if (!act_quant) {
        float *x8 = malloc(B * G * sizeof(float));  // 8 * the sum of each group of x (the offset, for BT = 1)
        for (long b = 0; b < B; b++)
            for (long g = 0; g < G; g++) {
                float t = 0.0f;
                for (long k = g * group; k < (g + 1) * group; k++) t += x[b * K + k];
                x8[b * G + g] = 8.0f * t;
            }
#define T(R_, BT_) int4_tile(R_, BT_, w + n * ldw, ldw, scale + n * G, G, group, x + b0 * K, x8 + b0 * G, K, \
                             y + b0 * N + n, N)
#define W(R_, buf) widen_rows_int4(R_, w + n * ldw, ldw, scale + n * G, G, group, K, buf)
        FOR_TILES(N, B, K, threads, 0, 1, W, T)
#undef W
#undef T
        free(x8);
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
#define T(R_, BT_)                                                                                           \
    do {                                                                                                     \
        if (g32) int4q_tile(1, R_, BT_, w + n * ldw, ldw, scale + n * G, G, gidx, qx + b0 * K, sx + b0 * KB, \
                            sx8 + b0 * KP * 8, o8 + b0 * KP * 8, sq + b0 * KB, KB, y + b0 * N + n, N);       \
        else int4q_tile(0, R_, BT_, w + n * ldw, ldw, scale + n * G, G, gidx, qx + b0 * K, sx + b0 * KB,     \
                        sx8 + b0 * KP * 8, o8 + b0 * KP * 8, sq + b0 * KB, KB, y + b0 * N + n, N);           \
    } while (0)
    FOR_TILES(N, B, K, threads, 0, 0, NO_WIDEN, T)
#undef T
    free(qx);
    free(sx);
    free(sq);
    free(sx8);
    free(o8);
    free(gidx);
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
