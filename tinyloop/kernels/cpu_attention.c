// Causal attention of a prefill chunk straight over the paged KV cache (mode "fp16" holding fp32 entries): what
// engine/forward.py's torch path computes by gathering every cell of the lanes' context out of the blocks and calling
// SDPA with a [B, 1, T, end] boolean mask, without the gathered copy, the mask or the T x end scores.
//
// A work item is (lane, kv head, tile of rows): the rows are the lane's (token, query head) pairs of the G = H / KV
// query heads that share the kv head, token-major, so one read of a key or value serves all G heads and every row of
// the tile. The tile is transposed (rows across the vector lanes: q^T [hd][ROWS], out^T [hd][ROWS]), which keeps the
// whole online softmax vertical: scores of a cell for every row are one vector FMA per element of the key (the key's
// element broadcast), the running max and sum are vectors, and no horizontal sum is ever taken. The tile walks its
// lane's block table over cells 0..(its last row's position) in chunks of CT cells; a row counts a cell iff
// cell <= its position (the torch path's mask: kpos <= pos), so cells past a row's own (later tokens of the chunk,
// stale cells of other requests) get no weight, and only chunks reaching past the tile's first position are masked.
// Items are handed out dynamically, latest tiles (the most cells) first, to the threads of torch's OpenMP pool.
#include <immintrin.h>
#include <math.h>

#define INLINE static inline __attribute__((always_inline))

#ifdef __AVX512F__
#define VW 16
#define NV 3  // vectors of rows per tile (48 rows)
#define CB 8  // cells per score block, elements per output block: 24 accumulators of the 32 registers
typedef __m512 vf;
#define vload _mm512_loadu_ps
#define vstore _mm512_storeu_ps
#define vset1 _mm512_set1_ps
#define vzero _mm512_setzero_ps
#define vadd _mm512_add_ps
#define vsub _mm512_sub_ps
#define vmul _mm512_mul_ps
#define vmax _mm512_max_ps
#define vmin _mm512_min_ps
#define vfmadd _mm512_fmadd_ps
#define vfnmadd _mm512_fnmadd_ps
#define vround(x) _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)
#define vpow2(n) _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), \
                                                                        _mm512_set1_epi32(127)), 23))
INLINE vf vkeep(vf s, vf cell, vf pos, vf fill) {
    return _mm512_mask_blend_ps(_mm512_cmp_ps_mask(cell, pos, _CMP_LE_OQ), fill, s);
}
#else
#define VW 8
#define NV 2  // (16 rows)
#define CB 4  // 8 accumulators of the 16 registers
typedef __m256 vf;
#define vload _mm256_loadu_ps
#define vstore _mm256_storeu_ps
#define vset1 _mm256_set1_ps
#define vzero _mm256_setzero_ps
#define vadd _mm256_add_ps
#define vsub _mm256_sub_ps
#define vmul _mm256_mul_ps
#define vmax _mm256_max_ps
#define vmin _mm256_min_ps
#define vfmadd _mm256_fmadd_ps
#define vfnmadd _mm256_fnmadd_ps
#define vround(x) _mm256_round_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)
#define vpow2(n) _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), \
                                                                        _mm256_set1_epi32(127)), 23))
INLINE vf vkeep(vf s, vf cell, vf pos, vf fill) {
    return _mm256_blendv_ps(fill, s, _mm256_cmp_ps(cell, pos, _CMP_LE_OQ));
}
#endif

#define ROWS (NV * VW)
#define CT 32       // cells per step of the online softmax
#define MAX_HD 128  // as cpu_block.c: q^T and out^T of a tile live on the stack (48 KiB)

// e^x as cpu_block.c's exp_ps (relative error < 1e-8): x clamped to [-87, 87], so e^-inf is ~1e-38, not 0; masked
// cells are zeroed explicitly after it.
INLINE vf vexp(vf x) {
    x = vmin(vmax(x, vset1(-87.0f)), vset1(87.0f));
    const vf n = vround(vmul(x, vset1(1.44269504088896341f)));
    vf r = vfnmadd(n, vset1(0.693145751953125f), x);
    r = vfnmadd(n, vset1(1.428606765330187e-06f), r);
    vf p = vset1(1.0f / 5040);
    p = vfmadd(p, r, vset1(1.0f / 720));
    p = vfmadd(p, r, vset1(1.0f / 120));
    p = vfmadd(p, r, vset1(1.0f / 24));
    p = vfmadd(p, r, vset1(1.0f / 6));
    p = vfmadd(p, r, vset1(0.5f));
    p = vfmadd(p, r, vset1(1.0f));
    p = vfmadd(p, r, vset1(1.0f));
    return vmul(p, vpow2(n));
}

typedef struct {
    const float *q;           // [B, T, H, hd] at strides sb, st, sh (floats; the last dimension contiguous)
    long sb, st, sh;
    const float *k, *v;       // the pool's stores [blocks, bt, KV, hd]
    const long *table;        // lane b's block table at table + b * table_stride
    long table_stride, bt;
    const long *pos;          // [B, T]: each row sees cells 0..pos
    long B, T, H, KV, hd, end;
    float *out;               // [B, T, H, hd]
} job_t;

static void tile(const job_t *j, long b, long g, long r0) {
    const long G = j->H / j->KV, hd = j->hd, rows = j->T * G, stride = j->KV * j->hd;
    const long *table = j->table + b * j->table_stride;
    const float scale = 1.0f / sqrtf((float)hd);
    _Alignas(64) float qt[MAX_HD * ROWS], ot[MAX_HD * ROWS], s[CT * ROWS], posf[ROWS];
    long pmin = j->end, n = 0;
    for (long r = 0; r < ROWS; r++) {  // rows past the lane's last repeat it (finite throughout, never stored)
        const long f = r0 + r < rows ? r0 + r : rows - 1, t = f / G, h = g * G + f % G;
        long p = j->pos[b * j->T + t];
        p = p < j->end ? p : j->end - 1;
        pmin = p < pmin ? p : pmin;
        n = p + 1 > n ? p + 1 : n;
        posf[r] = (float)p;
        const float *qr = j->q + b * j->sb + t * j->st + h * j->sh;
        for (long d = 0; d < hd; d++) qt[d * ROWS + r] = qr[d] * scale;
    }
    for (long i = 0; i < hd * ROWS; i++) ot[i] = 0.0f;
    vf m[NV], l[NV], pv[NV];
    for (int v = 0; v < NV; v++) m[v] = vset1(-INFINITY), l[v] = vzero(), pv[v] = vload(posf + v * VW);
    const float *kc[CT], *vc[CT];
    for (long c0 = 0; c0 < n; c0 += CT) {
        for (long c = 0; c < CT; c++) {  // cells past n point at cell n - 1 (masked: every row's position is < n)
            const long cell = c0 + c < n ? c0 + c : n - 1;
            const long off = (table[cell / j->bt] * j->bt + cell % j->bt) * stride + g * hd;
            kc[c] = j->k + off, vc[c] = j->v + off;
        }
        for (long c = 0; c < CT; c += CB) {  // scores s[c][rows] = q k_c^T, CB cells at a time
            vf acc[CB][NV];
            for (int i = 0; i < CB; i++)
                for (int v = 0; v < NV; v++) acc[i][v] = vzero();
            for (long d = 0; d < hd; d++) {
                vf qv[NV];
                for (int v = 0; v < NV; v++) qv[v] = vload(qt + d * ROWS + v * VW);
                for (int i = 0; i < CB; i++) {
                    const vf kb = vset1(kc[c + i][d]);
                    for (int v = 0; v < NV; v++) acc[i][v] = vfmadd(kb, qv[v], acc[i][v]);
                }
            }
            for (int i = 0; i < CB; i++)
                for (int v = 0; v < NV; v++) vstore(s + (c + i) * ROWS + v * VW, acc[i][v]);
        }
        const int masked = c0 + CT - 1 > pmin;
        vf mx[NV], alpha[NV];
        for (int v = 0; v < NV; v++) mx[v] = m[v];
        for (long c = 0; c < CT; c++)
            for (int v = 0; v < NV; v++) {
                vf x = vload(s + c * ROWS + v * VW);
                if (masked) x = vkeep(x, vset1((float)(c0 + c)), pv[v], vset1(-INFINITY));
                mx[v] = vmax(mx[v], x);
                vstore(s + c * ROWS + v * VW, x);
            }
        for (int v = 0; v < NV; v++) {
            alpha[v] = vexp(vsub(m[v], mx[v]));  // (first chunk: m = -inf, alpha ~ 1e-38 scales zeros)
            l[v] = vmul(l[v], alpha[v]);
            m[v] = mx[v];
        }
        for (long c = 0; c < CT; c++)
            for (int v = 0; v < NV; v++) {
                vf p = vexp(vsub(vload(s + c * ROWS + v * VW), m[v]));
                if (masked) p = vkeep(p, vset1((float)(c0 + c)), pv[v], vzero());
                l[v] = vadd(l[v], p);
                vstore(s + c * ROWS + v * VW, p);
            }
        for (long d = 0; d < hd; d += CB) {  // out^T[d] = alpha out^T[d] + sum_c v_c[d] p_c, CB elements at a time
            vf acc[CB][NV];
            for (int i = 0; i < CB; i++)
                for (int v = 0; v < NV; v++) acc[i][v] = vmul(vload(ot + (d + i) * ROWS + v * VW), alpha[v]);
            for (long c = 0; c < CT; c++) {
                vf p[NV];
                for (int v = 0; v < NV; v++) p[v] = vload(s + c * ROWS + v * VW);
                for (int i = 0; i < CB; i++) {
                    const vf vb = vset1(vc[c][d + i]);
                    for (int v = 0; v < NV; v++) acc[i][v] = vfmadd(vb, p[v], acc[i][v]);
                }
            }
            for (int i = 0; i < CB; i++)
                for (int v = 0; v < NV; v++) vstore(ot + (d + i) * ROWS + v * VW, acc[i][v]);
        }
    }
    float sum[ROWS];
    for (int v = 0; v < NV; v++) vstore(sum + v * VW, l[v]);
    for (long r = 0; r < ROWS && r0 + r < rows; r++) {
        const long f = r0 + r, t = f / G, h = g * G + f % G;
        float *o = j->out + ((b * j->T + t) * j->H + h) * hd;
        const float inv = 1.0f / sum[r];
        for (long d = 0; d < hd; d++) o[d] = ot[d * ROWS + r] * inv;
    }
}

// 1 when tl_prefill_attention takes these sizes (otherwise the caller keeps the torch path).
int tl_prefill_attention_ok(long H, long KV, long hd) {
    return KV > 0 && H % KV == 0 && hd % 8 == 0 && hd <= MAX_HD;
}

// out [B, T, H, hd] = softmax(q k^T / sqrt(hd) + causal mask) v for each lane's rows, over its cells 0..pos.
void tl_prefill_attention(const float *q, long sb, long st, long sh, const float *k, const float *v,
                          const long *table, long table_stride, long bt, const long *pos, long B, long T, long H,
                          long KV, long hd, long end, float *out, int threads) {
    const job_t j = {q, sb, st, sh, k, v, table, table_stride, bt, pos, B, T, H, KV, hd, end, out};
    const long tiles = (T * (H / KV) + ROWS - 1) / ROWS, items = B * KV * tiles;
#pragma omp parallel for num_threads(threads) schedule(dynamic, 1) if (threads > 1)
    for (long i = 0; i < items; i++) {
        const long r = tiles - 1 - i / (B * KV), bg = i % (B * KV);
        tile(&j, bg / KV, bg % KV, r * ROWS);
    }
}
