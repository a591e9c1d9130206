// One transformer block over B token rows in one call: tinyloop/model.py's `block` for rows of one token each (the
// lanes of a decode step, or the tokens of a speculative chunk, rows of one lane), attending over the paged KV cache
// (mode "fp16" holding fp32 entries), on the CPU (AVX2 + FMA, OpenMP).
//
// Why: at batch 1 the products of a block stream its weights at about the memory bandwidth (cpu_gemv.c), and what
// is left of a step is the ~30 small torch operations around them per block (norms, RoPE, the cache write,
// attention, SiLU, residuals), each a few microseconds of dispatch. Here a block is one call and one OpenMP team:
// the steps below are separated by barriers, and the team's threads share every step.
//
//   h = norm(x) ; qkv = h W_qkv^T (+ bias) ; rotate q, k ; store k, v at the lane's cell
//   att = softmax(q k^T / sqrt(hd)) v over cells 0..cell (grouped-query: H / KV query heads per kv head)
//   x' = x + att W_o^T (or the sandwich variants) ; x' += down(silu(gate) * up) of norm(x')
//
// Products go through cpu_gemv.c's kernels (any weight format), called with threads = 1 inside this team: their
// `omp for` then shares the rows among the team's threads. Every output element is computed the same way for any
// B and any thread count (a row's attention is one thread's, over its lane's cells up to its own), so the block is
// batch-invariant like the products: a row of a chunk has the bits of the same token decoded alone. Every row
// writes its K/V before any row attends (the `omp for`'s barrier), so a chunk of one lane is causal in itself.
// RoPE is mul, mul, add as torch computes it (-ffp-contract=off), so it has torch's bits; the norm, softmax and SiLU
// agree with torch to fp32 rounding, not bitwise. A prefill chunk of more rows than the lanes (tl_block_chunk) runs
// the same row steps with the tiled GEMM's products between them, as its products through torch would.
#include <immintrin.h>
#include <math.h>
#include <string.h>
#include <time.h>

#define INLINE static inline __attribute__((always_inline))

void tl_linear_f32(const float *x, const float *w, float *y, long B, long N, long K, int threads);
void tl_linear_bf16(const float *x, const void *w, float *y, long B, long N, long K, int threads);
void tl_linear_int8(const float *x, const void *w, const float *scale, float *y, long B, long N, long K,
                    int act_quant, int threads);
void tl_linear_int4(const float *x, const void *w, const float *scale, float *y, long B, long N, long K,
                    long group, int act_quant, int threads);
float *tl_thread_buffer(int slot, long n);
void tl_gemm(int fmt, const float *x, const void *w, const float *scale, float *y, long B, long N, long K, long group,
             int act_quant, int threads);
void tl_prefill_attention(const float *q, long sb, long st, long sh, const float *k, const float *v,
                          const long *table, long table_stride, long bt, const long *pos, long B, long T, long H,
                          long KV, long hd, long end, float *out, int threads);

// A matrix in its weight format (tinyloop/formats.py): 0 fp32, 1 bf16, 2 int8, 3 int4. cols is the stored width:
// an int4 matrix whose group does not divide its width holds it zero-padded, and its input rows are padded to
// match (the scratch rows below are cols wide, their tails zero). act_quant: int8 / int4 products quantise x.
typedef struct {
    long fmt, group, rows, cols, act_quant;
    const void *data;
    const float *scale;
} tl_mat;

typedef struct {
    const float *attn_norm, *mlp_norm;
    const float *attn_out_norm, *mlp_out_norm, *bqkv;  // NULL when the model has none
    long on_sum;  // the out-norms normalise the residual sums (Huginn) instead of the branch outputs
    tl_mat qkv, wo, gu, down;
} tl_block_weights;

typedef struct {
    long B, d, H, KV, hd, ffn, bt, threads;
    double eps;
    const float *cos2, *sin2;   // [B, hd]: rotate-half RoPE as x * cos2 + swap_halves(x) * sin2
    const long *cells;          // [B]: the cell each row writes; it attends over its lane's cells 0..cell
    const long *lanes;          // [B]: the lane whose block tables row b uses (NULL: lane b). Rows of one lane at
                                // cells c, c+1, ... are a chunk: each row attends over the cells up to its own
    float *k_store, *v_store;   // [blocks, bt, KV, hd]
    long table_stride;          // elements between two lanes' rows of a slot's block table
    float *scratch;             // tl_block_scratch(...) floats
    // NULL, or [B, mask_width]: which of its cells mask_from.. row b sees (it sees every cell before them): a
    // speculative tree, whose branches share positions and whose tokens see their own branch only
    const unsigned char *mask;
    long mask_from, mask_width;
    // NULL, or [B]: elements added to row b's block table in every slot (an iteration step's core pass: row b at its
    // own loop k_b reads and writes slot core_slot(k_b, j) = core_slot(0, j) + k_b * n_core)
    const long *shift;
    // NULL, or [B]: row b's own mask in place of `mask` (NULL: none, it sees every cell up to its own), over cells
    // row_mask_from[b].. (an iteration step's rows of a speculative tree beside other lanes' rows)
    const unsigned char *const *row_mask;
    const long *row_mask_from;
} tl_block_rows_t;

INLINE float hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

// e^x, |x| < 87: x = n ln2 + r with |r| <= ln2 / 2 (ln2 in two parts, so r is exact to fp32), e^r by its Taylor
// polynomial to degree 7 (relative error < 1e-8), 2^n from the exponent bits.
INLINE __m256 exp_ps(__m256 x) {
    x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.0f)), _mm256_set1_ps(87.0f));
    const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                     _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693145751953125f), x);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(1.428606765330187e-06f), r);
    __m256 p = _mm256_set1_ps(1.0f / 5040);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 720));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 120));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 24));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 6));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(0.5f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
    const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}

INLINE float exp1(float x) {
    float v[8] = {x};
    _mm256_storeu_ps(v, exp_ps(_mm256_loadu_ps(v)));
    return v[0];
}

// y = x m^T; threads = 1 inside a team (the kernels' `omp for` shares the rows), else the team to start.
static void product(const tl_mat *m, const float *x, float *y, long B, int threads) {
    switch (m->fmt) {
        case 0: tl_linear_f32(x, m->data, y, B, m->rows, m->cols, threads); break;
        case 1: tl_linear_bf16(x, m->data, y, B, m->rows, m->cols, threads); break;
        case 2: tl_linear_int8(x, m->data, m->scale, y, B, m->rows, m->cols, (int)m->act_quant, threads); break;
        default: tl_linear_int4(x, m->data, m->scale, y, B, m->rows, m->cols, m->group, (int)m->act_quant, threads);
    }
}

// y = x / sqrt(mean(x^2) + eps) * w
static void rms_norm(const float *x, const float *w, double eps, long d, float *y) {
    __m256 acc = _mm256_setzero_ps();
    long k = 0;
    for (; k + 8 <= d; k += 8) {
        const __m256 v = _mm256_loadu_ps(x + k);
        acc = _mm256_fmadd_ps(v, v, acc);
    }
    float ss = hsum(acc);
    for (; k < d; k++) ss += x[k] * x[k];
    const float r = 1.0f / sqrtf(ss / (float)d + (float)eps);
    for (k = 0; k < d; k++) y[k] = x[k] * r * w[k];
}

// x <- x + a, with the optional out-norm: on_sum: norm(x + a); else x + norm(a).
static void residual(float *x, float *a, const float *out_norm, long on_sum, double eps, long d) {
    if (out_norm && !on_sum) rms_norm(a, out_norm, eps, d, a);
    for (long k = 0; k < d; k++) x[k] += a[k];
    if (out_norm && on_sum) rms_norm(x, out_norm, eps, d, x);
}

// q, k heads of one row rotated in place: y[i] = x[i] cos2[i] + x[i +- hd/2] sin2[i], as mul, mul, add.
static void rotate(float *x, long heads, long hd, const float *cos2, const float *sin2) {
    const long half = hd / 2;
    float t[512];
    for (long h = 0; h < heads; h++, x += hd) {
        for (long i = 0; i < hd; i++) t[i] = x[i];
        for (long i = 0; i < hd; i++) {
            const float a = t[i] * cos2[i], b = t[i < half ? i + half : i - half] * sin2[i];
            x[i] = a + b;
        }
    }
}

// Attention of the G query heads q [G, hd] sharing kv head `g` of one lane, over its cells 0..n-1: out [G, hd].
// seen (NULL: every cell): which of cells from..n-1 count; the others get no weight.
static void attend(const float *q, long G, long g, long n, const long *table, const tl_block_rows_t *r,
                   const unsigned char *seen, long from, float *out) {
    const long hd = r->hd, bt = r->bt, stride = r->KV * hd;
    const float scale = 1.0f / sqrtf((float)hd);
    float *s = tl_thread_buffer(1, G * n);  // per-thread scores, kept between calls
    for (long c0 = 0; c0 < n; c0 += bt) {  // scores, one block of cells at a time
        const float *kb = r->k_store + table[c0 / bt] * bt * stride + g * hd;
        const long m = n - c0 < bt ? n - c0 : bt;
        for (long c = 0; c < m; c++) {
            const float *kc = kb + c * stride;
            for (long j = 0; j < G; j++) {
                __m256 acc = _mm256_setzero_ps();
                for (long i = 0; i < hd; i += 8)
                    acc = _mm256_fmadd_ps(_mm256_loadu_ps(q + j * hd + i), _mm256_loadu_ps(kc + i), acc);
                s[j * n + c0 + c] = hsum(acc) * scale;
            }
        }
    }
    if (seen)
        for (long j = 0; j < G; j++)
            for (long c = from; c < n; c++)
                if (!seen[c - from]) s[j * n + c] = -INFINITY;
    for (long j = 0; j < G; j++) {  // softmax
        float *sj = s + j * n, mx = -INFINITY, sum = 0.0f;
        for (long c = 0; c < n; c++) mx = sj[c] > mx ? sj[c] : mx;
        long c = 0;
        __m256 vsum = _mm256_setzero_ps();
        for (; c + 8 <= n; c += 8) {
            const __m256 e = exp_ps(_mm256_sub_ps(_mm256_loadu_ps(sj + c), _mm256_set1_ps(mx)));
            _mm256_storeu_ps(sj + c, e);
            vsum = _mm256_add_ps(vsum, e);
        }
        for (; c < n; c++) sum += (sj[c] = exp1(sj[c] - mx));
        const float inv = 1.0f / (hsum(vsum) + sum);  // (an unseen cell adds e^-87: nothing to a sum >= 1)
        for (c = 0; c < n; c++) sj[c] *= inv;
        if (seen)
            for (c = from; c < n; c++)
                if (!seen[c - from]) sj[c] = 0.0f;
    }
    __m256 acc[16];  // hd <= 128
    for (long j = 0; j < G; j++) {
        for (long i = 0; i < hd / 8; i++) acc[i] = _mm256_setzero_ps();
        for (long c0 = 0; c0 < n; c0 += bt) {
            const float *vb = r->v_store + table[c0 / bt] * bt * stride + g * hd;
            const long m = n - c0 < bt ? n - c0 : bt;
            for (long c = 0; c < m; c++) {
                const __m256 p = _mm256_set1_ps(s[j * n + c0 + c]);
                for (long i = 0; i < hd / 8; i++)
                    acc[i] = _mm256_fmadd_ps(p, _mm256_loadu_ps(vb + c * stride + 8 * i), acc[i]);
            }
        }
        for (long i = 0; i < hd / 8; i++) _mm256_storeu_ps(out + j * hd + 8 * i, acc[i]);
    }
}

INLINE long lane_of(const tl_block_rows_t *r, long b) { return r->lanes ? r->lanes[b] : b; }

// Row b's block table within `table` (one slot's tables): its lane's, in its own loop's slot when shifted.
INLINE const long *row_table(const tl_block_rows_t *r, const long *table, long b) {
    return table + lane_of(r, b) * r->table_stride + (r->shift ? r->shift[b] : 0);
}

// Floats of scratch a call of B lanes needs with blocks shaped like w: rows of h, qkv, att, o, gu, m.
long tl_block_scratch(const tl_block_weights *w, long B) {
    return B * (w->qkv.cols + w->qkv.rows + w->wo.cols + w->wo.rows + w->gu.rows + w->down.cols);
}

// 1 when tl_block_rows takes these sizes (otherwise the caller runs the block through torch).
int tl_block_ok(long H, long KV, long hd) {
    return hd % 8 == 0 && hd <= 128 && KV > 0 && H % KV == 0;
}

// The steps of a block between its products, one row b at a time; shared by tl_block_rows (decode rows, one
// OpenMP team) and tl_block_chunk (prefill chunks, the tiled GEMM between), so both compute a row the same way.
typedef struct {
    long hs, as, ms, NQKV;   // row widths of h, att, m (padded: a product's stored input width) and qkv
    float *h, *qkv, *att, *o, *gu, *m;
} tl_block_bufs;

static tl_block_bufs block_bufs(const tl_block_weights *w, const tl_block_rows_t *r) {
    const long B = r->B, F = r->ffn;
    tl_block_bufs s = {w->qkv.cols, w->wo.cols, w->down.cols, (r->H + 2 * r->KV) * r->hd};
    s.h = r->scratch, s.qkv = s.h + B * s.hs, s.att = s.qkv + B * s.NQKV, s.o = s.att + B * s.as;
    s.gu = s.o + B * r->d, s.m = s.gu + 2 * B * F;
    for (long b = 0; b < B; b++) {  // the padding columns stay zero
        for (long i = r->d; i < s.hs; i++) s.h[b * s.hs + i] = 0.0f;
        for (long i = r->H * r->hd; i < s.as; i++) s.att[b * s.as + i] = 0.0f;
        for (long i = F; i < s.ms; i++) s.m[b * s.ms + i] = 0.0f;
    }
    return s;
}

// bias, RoPE, and row b's k and v into its cell
static void qkv_row(const tl_block_weights *w, const tl_block_rows_t *r, const long *table, const tl_block_bufs *s,
                    long b) {
    const long H = r->H, KV = r->KV, hd = r->hd, NQKV = s->NQKV;
    float *row = s->qkv + b * NQKV;
    if (w->bqkv)
        for (long i = 0; i < NQKV; i++) row[i] += w->bqkv[i];
    rotate(row, H + KV, hd, r->cos2 + b * hd, r->sin2 + b * hd);
    const long cell = r->cells[b], blk = row_table(r, table, b)[cell / r->bt];
    float *kd = r->k_store + (blk * r->bt + cell % r->bt) * KV * hd;
    float *vd = r->v_store + (blk * r->bt + cell % r->bt) * KV * hd;
    for (long i = 0; i < KV * hd; i++) {
        kd[i] = row[H * hd + i];
        vd[i] = row[(H + KV) * hd + i];
    }
}

// x_out = x + attention branch (with its out-norm), and its MLP norm into h
static void mid_row(const tl_block_weights *w, const tl_block_rows_t *r, const tl_block_bufs *s, const float *x,
                    float *x_out, long b) {
    const long d = r->d;
    float *xo = x_out + b * d;
    for (long k = 0; k < d; k++) xo[k] = x[b * d + k];
    residual(xo, s->o + b * d, w->attn_out_norm, w->on_sum, r->eps, d);
    rms_norm(xo, w->mlp_norm, r->eps, d, s->h + b * s->hs);
}

// silu(gate) * up, gate / (1 + e^-gate) as torch's silu
static void silu_row(const tl_block_rows_t *r, const tl_block_bufs *s, long b) {
    const long F = r->ffn;
    const float *g = s->gu + b * 2 * F, *u = g + F;
    float *mb = s->m + b * s->ms;
    long i = 0;
    for (; i + 8 <= F; i += 8) {
        const __m256 gv = _mm256_loadu_ps(g + i);
        const __m256 e = exp_ps(_mm256_sub_ps(_mm256_setzero_ps(), gv));
        const __m256 sg = _mm256_div_ps(gv, _mm256_add_ps(_mm256_set1_ps(1.0f), e));
        _mm256_storeu_ps(mb + i, _mm256_mul_ps(sg, _mm256_loadu_ps(u + i)));
    }
    for (; i < F; i++) mb[i] = g[i] / (1.0f + exp1(-g[i])) * u[i];
}

// x_out [B, d] = block(x [B, d]) for lanes writing cell cells[b] of the slot whose block table is `table`.
void tl_block_rows(const tl_block_weights *w, const tl_block_rows_t *r, const long *table, const float *x,
                   float *x_out) {
    const long B = r->B, d = r->d, KV = r->KV, hd = r->hd, G = r->H / KV;
    const tl_block_bufs s = block_bufs(w, r);
#pragma omp parallel num_threads(r->threads) if (r->threads > 1)
    {
#pragma omp for schedule(static)
        for (long b = 0; b < B; b++) rms_norm(x + b * d, w->attn_norm, r->eps, d, s.h + b * s.hs);
        product(&w->qkv, s.h, s.qkv, B, 1);
#pragma omp barrier
#pragma omp for schedule(static)
        for (long b = 0; b < B; b++) qkv_row(w, r, table, &s, b);
#pragma omp for schedule(static)
        for (long i = 0; i < B * KV; i++) {
            const long b = i / KV, g = i % KV;
            const unsigned char *seen = r->row_mask ? r->row_mask[b] : r->mask ? r->mask + b * r->mask_width : 0;
            attend(s.qkv + b * s.NQKV + g * G * hd, G, g, r->cells[b] + 1, row_table(r, table, b), r, seen,
                   r->row_mask ? r->row_mask_from[b] : r->mask_from, s.att + b * s.as + g * G * hd);
        }
        product(&w->wo, s.att, s.o, B, 1);
#pragma omp barrier
#pragma omp for schedule(static)
        for (long b = 0; b < B; b++) mid_row(w, r, &s, x, x_out, b);
        product(&w->gu, s.h, s.gu, B, 1);
#pragma omp barrier
#pragma omp for schedule(static)
        for (long b = 0; b < B; b++) silu_row(r, &s, b);
        product(&w->down, s.m, s.o, B, 1);
#pragma omp barrier
#pragma omp for schedule(static)
        for (long b = 0; b < B; b++) residual(x_out + b * d, s.o + b * d, w->mlp_out_norm, w->on_sum, r->eps, d);
    }
}

// y = x m^T through the tiled GEMM (cpu_gemv.c), its own OpenMP team
static void gemm(const tl_mat *m, const float *x, float *y, long B, int threads) {
    tl_gemm((int)m->fmt, x, m->data, m->scale, y, B, m->rows, m->cols, m->group, (int)m->act_quant, threads);
}

// The same block over a prefill chunk: r->B = lanes x T rows, row l T + t token t of lane l at cell pos[l T + t]
// (r->cells), each row attending over its lane's cells up to its own. Many rows make the products compute-bound, so
// they take the tiled GEMM (the prefill chunk's products through torch take it too) between the row steps above,
// each its own team, and attention is cpu_attention.c's blocked causal kernel. x_out may not be x.
void tl_block_chunk(const tl_block_weights *w, const tl_block_rows_t *r, const long *table, long T, long end,
                    const float *x, float *x_out) {
    const long B = r->B, d = r->d, H = r->H, KV = r->KV, hd = r->hd;
    const int threads = (int)r->threads;
    const tl_block_bufs s = block_bufs(w, r);
#pragma omp parallel for num_threads(threads) schedule(static)
    for (long b = 0; b < B; b++) rms_norm(x + b * d, w->attn_norm, r->eps, d, s.h + b * s.hs);
    gemm(&w->qkv, s.h, s.qkv, B, threads);
#pragma omp parallel for num_threads(threads) schedule(static)
    for (long b = 0; b < B; b++) qkv_row(w, r, table, &s, b);
    tl_prefill_attention(s.qkv, T * s.NQKV, s.NQKV, hd, r->k_store, r->v_store, table, r->table_stride, r->bt,
                         r->cells, B / T, T, H, KV, hd, end, s.att, threads);
    gemm(&w->wo, s.att, s.o, B, threads);
#pragma omp parallel for num_threads(threads) schedule(static)
    for (long b = 0; b < B; b++) mid_row(w, r, &s, x, x_out, b);
    gemm(&w->gu, s.h, s.gu, B, threads);
#pragma omp parallel for num_threads(threads) schedule(static)
    for (long b = 0; b < B; b++) silu_row(r, &s, b);
    gemm(&w->down, s.m, s.o, B, threads);
#pragma omp parallel for num_threads(threads) schedule(static)
    for (long b = 0; b < B; b++) residual(x_out + b * d, s.o + b * d, w->mlp_out_norm, w->on_sum, r->eps, d);
}

// x_out = blocks ws[0..n-1] in turn over a prefill chunk (tl_block_chunk), block i writing the slot whose block
// table is tables[i]; tmp [B, d] holds every other intermediate.
void tl_blocks_chunk(long n, const tl_block_weights *const *ws, const tl_block_rows_t *r, const long *const *tables,
                     long T, long end, const float *x, float *x_out, float *tmp) {
    for (long i = 0; i < n; i++) {
        float *dst = (n - 1 - i) % 2 ? tmp : x_out;  // the last block writes x_out
        tl_block_chunk(ws[i], r, tables[i], T, end, x, dst);
        x = dst;
    }
}

// x_out = blocks ws[0..n-1] applied in turn to x, block i writing the slot whose block table is tables[i]: a loop
// pass (or the prelude, or the coda) in one call. tmp [B, d] holds every other intermediate.
void tl_blocks_rows(long n, const tl_block_weights *const *ws, const tl_block_rows_t *r, const long *const *tables,
                    const float *x, float *x_out, float *tmp) {
    for (long i = 0; i < n; i++) {
        float *dst = (n - 1 - i) % 2 ? tmp : x_out;  // the last block writes x_out
        tl_block_rows(ws[i], r, tables[i], x, dst);
        x = dst;
    }
}

// y [B, d] = rms_norm(x) * w row by row: the norms of a decode step outside its blocks (the final norm), as one call
// where torch takes ~6 operations, each slow after the blocks' weight stream has pushed torch's code and data out of
// the caches (~100 us for a d768 row, against ~15 us warm).
void tl_rms_norm_rows(const float *x, const float *w, double eps, long B, long d, float *y) {
    for (long b = 0; b < B; b++) rms_norm(x + b * d, w, eps, d, y + b * d);
}

// The model's forward over token rows, for a range of loops, in one call (kernels/cpu_block.py's DecodeStep):
// tinyloop/model.py's LoopedLM.encode / loop / decode_head for B rows of one token each, through the same C pieces
// the step through Python calls (tl_blocks_rows, rms_norm, the products at the step's thread count), so the logits
// have the same bits. A decode step is the range 0..loops with the embedding and the head; speculative decoding
// drafts rows through 0..draft_loops and continues them from there to verify_loops. What it saves against the step
// through Python is the Python between the pieces: ~0.5 ms per token, a sixth of an int4 d768 token.
typedef struct {
    long n_prelude, n_core, n_coda, loops;  // loops: the core passes `blocks` holds (any range within them runs)
    long injection;   // 0 none (s), 1 add (s + e), 2 adapter ([s | e] W_adapter^T)
    long state_init;  // 0 zeros, 1 the prelude's output e, 2 noise rows at the rows' positions
    long loop_norm, coda_norm, final_norm;
    double embed_scale;
    const float *embed, *norm_w, *noise;  // embed [V, d], final norm [d], noise [positions, d]
    const float *cos2, *sin2;              // [positions, hd]: model.rope_factors of the whole table
    tl_mat adapter, head;
    const tl_block_weights *const *blocks;  // in step order: prelude, core x loops, coda
    const long *slots;                      // the layer slot each of them writes
} tl_step_t;

// Floats of work a call of B rows needs (two rows of passes, [s | e], RoPE rows, and the RoPE rows, e and s of a
// subset of them: tl_iterate_rows, tl_iterate_until).
long tl_step_work(long B, long d, long hd) { return B * (6 * d + 4 * hd); }

// blocks[0..n-1] of the step from x into out (tmp: a third buffer; with n == 0, out = x).
static void pass(const tl_step_t *s, long first, long n, tl_block_rows_t *r, const long *table, long slot_stride,
                 const float *x, float *out, float *tmp) {
    const long *tables[64];
    for (long i = 0; i < n; i++) tables[i] = table + s->slots[first + i] * slot_stride;
    if (n == 0)
        memcpy(out, x, r->B * r->d * sizeof(float));
    else
        tl_blocks_rows(n, s->blocks + first, r, tables, x, out, tmp);
}

// The pieces of a forward over B rows (r->B), shared by tl_forward_rows and tl_iterate_rows so both compute a row
// the same way. x, tmp: [B, d] buffers; cat: [B, 2d].

// RoPE rows at the rows' positions into cos2, sin2 [B, hd], which r points at.
static void rope_rows(const tl_step_t *s, tl_block_rows_t *r, const long *pos, float *cos2, float *sin2) {
    const long hd = r->hd;
    for (long b = 0; b < r->B; b++) {
        memcpy(cos2 + b * hd, s->cos2 + pos[b] * hd, hd * sizeof(float));
        memcpy(sin2 + b * hd, s->sin2 + pos[b] * hd, hd * sizeof(float));
    }
    r->cos2 = cos2;
    r->sin2 = sin2;
}

// The embedding of ids [B] and the prelude into e, the initial states into st.
static void encode(const tl_step_t *s, tl_block_rows_t *r, const long *table, long slot_stride, const long *ids,
                   const long *pos, float *e, float *st, float *x, float *tmp) {
    const long B = r->B, d = r->d;
    for (long b = 0; b < B; b++) {
        const float *row = s->embed + ids[b] * d;
        for (long k = 0; k < d; k++) x[b * d + k] = s->embed_scale != 1.0 ? row[k] * (float)s->embed_scale : row[k];
    }
    pass(s, 0, s->n_prelude, r, table, slot_stride, x, e, tmp);
    for (long b = 0; b < B; b++)
        for (long k = 0; k < d; k++)
            st[b * d + k] = s->state_init == 0   ? 0.0f
                            : s->state_init == 1 ? e[b * d + k]
                                                 : s->noise[pos[b] * d + k];
}

// One loop: st <- core(inject(st, e)) at loop `loop` (rows shifted by r->shift run at their own), then the loop norm.
static void core_pass(const tl_step_t *s, tl_block_rows_t *r, const long *table, long slot_stride, long loop,
                      const float *e, float *st, float *x, float *tmp, float *cat) {
    const long B = r->B, d = r->d, n = B * d;
    const float *in = st;
    if (s->injection == 1) {
        for (long i = 0; i < n; i++) x[i] = st[i] + e[i];
        in = x;
    } else if (s->injection == 2) {
        for (long b = 0; b < B; b++) {
            memcpy(cat + 2 * b * d, st + b * d, d * sizeof(float));
            memcpy(cat + 2 * b * d + d, e + b * d, d * sizeof(float));
        }
        product(&s->adapter, cat, x, B, (int)r->threads);
        in = x;
    }
    float *out = in == st ? x : st;
    pass(s, s->n_prelude + loop * s->n_core, s->n_core, r, table, slot_stride, in, out, tmp);
    if (s->loop_norm) tl_rms_norm_rows(out, s->norm_w, r->eps, B, d, out);
    if (out != st) memcpy(st, out, n * sizeof(float));
}

// The coda, final norm and head of states st (left as they are: the caller may continue them): logits [B, V].
// st may be cat (normalised in place for the coda norm).
static void decode_head(const tl_step_t *s, tl_block_rows_t *r, const long *table, long slot_stride, const float *st,
                        float *logits, float *x, float *tmp, float *cat) {
    const float *in = st;
    if (s->coda_norm) {
        tl_rms_norm_rows(st, s->norm_w, r->eps, r->B, r->d, cat);
        in = cat;
    }
    pass(s, s->n_prelude + s->loops * s->n_core, s->n_coda, r, table, slot_stride, in, x, tmp);
    if (s->final_norm) tl_rms_norm_rows(x, s->norm_w, r->eps, r->B, r->d, x);
    product(&s->head, x, logits, r->B, (int)r->threads);
}

// Loops first..last-1 of B rows, with what comes before and after them when asked:
//   ids != NULL   first the embedding of tokens ids [B], the prelude (into e) and the initial state (into st);
//   ids == NULL   st [B, d] holds the rows' states after `first` loops and e [B, d] their prelude outputs;
//   logits        != NULL: afterwards the coda, final norm and head, logits [B, V].
// On return st holds the states after `last` loops. Row b is at position pos[b] (RoPE, the noise init) and writes
// cell r->cells[b] of its lane (r->lanes); table: the cache's block tables [slots, lanes, blocks], slot_stride
// elements per slot.
void tl_forward_rows(const tl_step_t *s, tl_block_rows_t *r, const long *table, long slot_stride, const long *ids,
                     const long *pos, long first, long last, float *e, float *st, float *logits, float *work) {
    const long B = r->B, n = B * r->d;
    float *x = work, *tmp = x + n, *cat = tmp + n, *cos2 = cat + 2 * n;
    rope_rows(s, r, pos, cos2, cos2 + B * r->hd);
    if (ids) encode(s, r, table, slot_stride, ids, pos, e, st, x, tmp);
    for (long loop = first; loop < last; loop++) core_pass(s, r, table, slot_stride, loop, e, st, x, tmp, cat);
    if (logits) decode_head(s, r, table, slot_stride, st, logits, x, tmp, cat);
}

#define MAX_ITERATE_ROWS 64

// Room for the per-row arrays of a subset of rows.
typedef struct {
    long cells[MAX_ITERATE_ROWS], lanes[MAX_ITERATE_ROWS], mask_from[MAX_ITERATE_ROWS];
    const unsigned char *mask[MAX_ITERATE_ROWS];
} tl_subset_t;

// rows idx[0..m-1] of r as a call of their own (their cells, lanes, row masks and RoPE rows gathered into `room`
// and cos2, sin2).
static tl_block_rows_t subset(const tl_block_rows_t *r, const long *idx, long m, tl_subset_t *room, float *cos2,
                              float *sin2) {
    tl_block_rows_t sub = *r;
    const long hd = r->hd;
    for (long i = 0; i < m; i++) {
        room->cells[i] = r->cells[idx[i]];
        room->lanes[i] = lane_of(r, idx[i]);
        if (r->row_mask) room->mask[i] = r->row_mask[idx[i]], room->mask_from[i] = r->row_mask_from[idx[i]];
        memcpy(cos2 + i * hd, r->cos2 + idx[i] * hd, hd * sizeof(float));
        memcpy(sin2 + i * hd, r->sin2 + idx[i] * hd, hd * sizeof(float));
    }
    sub.B = m, sub.cells = room->cells, sub.lanes = room->lanes, sub.cos2 = cos2, sub.sin2 = sin2, sub.shift = 0;
    sub.mask = 0;
    if (r->row_mask) sub.row_mask = room->mask, sub.row_mask_from = room->mask_from;
    return sub;
}

// The indices of the rows whose flag is set, into idx: how many.
static long flagged(const unsigned char *flag, long B, long *idx) {
    long m = 0;
    for (long b = 0; b < B; b++)
        if (flag[b]) idx[m++] = b;
    return m;
}

// The prelude of the rows with start[b] (the embedding of ids[b], the prelude into e, the initial state into st),
// then one core pass of every row at its own loop loop[b] (writing and attending slots core_slot(loop[b], j) of its
// lane), the rows sharing each product: the weights stream once for the pass whatever the rows' depths. A row with
// out[b] (out NULL: none) sits the pass out, its prelude too: the pass runs the other rows as a call of their own
// (subset), so it writes and reads none of its K/V and leaves its e and st as they are. r's RoPE rows are the rows'
// (rope_rows).
static void start_and_pass(const tl_step_t *s, tl_block_rows_t *r, const long *table, long slot_stride,
                           const long *ids, const long *pos, const long *loop, const unsigned char *start,
                           const unsigned char *out, float *e, float *st, float *work) {
    const long B = r->B, d = r->d, hd = r->hd, n = B * d;
    float *x = work, *tmp = x + n, *cat = tmp + n, *sub_cos = cat + 2 * n + 2 * B * hd;
    long idx[MAX_ITERATE_ROWS], ids_in[MAX_ITERATE_ROWS], pos_in[MAX_ITERATE_ROWS], shift[MAX_ITERATE_ROWS];
    tl_subset_t room;
    unsigned char starts[MAX_ITERATE_ROWS];
    for (long b = 0; b < B; b++) starts[b] = start[b] && !(out && out[b]);
    long m = flagged(starts, B, idx);
    if (m) {  // the prelude of the starting rows alone: their e into cat, their states into tmp, then scattered
        tl_block_rows_t sub = subset(r, idx, m, &room, sub_cos, sub_cos + B * hd);
        for (long i = 0; i < m; i++) ids_in[i] = ids[idx[i]], pos_in[i] = pos[idx[i]];
        float *e_sub = cat, *st_sub = cat + m * d;
        encode(s, &sub, table, slot_stride, ids_in, pos_in, e_sub, st_sub, x, tmp);
        for (long i = 0; i < m; i++) {
            memcpy(e + idx[i] * d, e_sub + i * d, d * sizeof(float));
            memcpy(st + idx[i] * d, st_sub + i * d, d * sizeof(float));
        }
    }
    if (!out) {
        for (long b = 0; b < B; b++) shift[b] = loop[b] * s->n_core * slot_stride;
        r->shift = shift;  // loop 0's blocks and slots, each row in its own loop's slots
        core_pass(s, r, table, slot_stride, 0, e, st, x, tmp, cat);
        r->shift = 0;
        return;
    }
    unsigned char runs[MAX_ITERATE_ROWS];  // the rows in the pass: their e, st gathered, st scattered back
    for (long b = 0; b < B; b++) runs[b] = !out[b];
    if (!(m = flagged(runs, B, idx))) return;
    tl_block_rows_t sub = subset(r, idx, m, &room, sub_cos, sub_cos + B * hd);
    float *e_in = sub_cos + 2 * B * hd, *st_in = e_in + n;
    for (long i = 0; i < m; i++) {
        shift[i] = loop[idx[i]] * s->n_core * slot_stride;
        memcpy(e_in + i * d, e + idx[i] * d, d * sizeof(float));
        memcpy(st_in + i * d, st + idx[i] * d, d * sizeof(float));
    }
    sub.shift = shift;
    core_pass(s, &sub, table, slot_stride, 0, e_in, st_in, x, tmp, cat);
    for (long i = 0; i < m; i++) memcpy(st + idx[i] * d, st_in + i * d, d * sizeof(float));
}

// The coda, final norm and head of the rows with finish[b], from their states st: logits [rows finishing, V].
static void finish_rows(const tl_step_t *s, tl_block_rows_t *r, const long *table, long slot_stride,
                        const unsigned char *finish, const float *st, float *logits, float *work) {
    const long B = r->B, d = r->d, hd = r->hd, n = B * d;
    float *x = work, *tmp = x + n, *cat = tmp + n, *sub_cos = cat + 2 * n + 2 * B * hd;
    long idx[MAX_ITERATE_ROWS];
    tl_subset_t room;
    const long m = flagged(finish, B, idx);
    if (!m) return;
    tl_block_rows_t sub = subset(r, idx, m, &room, sub_cos, sub_cos + B * hd);
    for (long i = 0; i < m; i++) memcpy(cat + i * d, st + idx[i] * d, d * sizeof(float));
    decode_head(s, &sub, table, slot_stride, cat, logits, x, tmp, cat);
}

// One iteration-level step over B <= 64 rows (kernels/cpu_block.py's DecodeStep.iterate): the prelude of the rows
// with start[b], one core pass of every row at its own loop loop[b], then the coda, final norm and head of the rows
// with finish[b]: logits [rows finishing, V], in row order. e, st [B, d] are read (the rows that do not start) and
// written (e: starting rows; st: every row, its state after the pass). A row goes through the pieces
// tl_forward_rows runs, in the same order, and every piece computes a row the same way in any batch: a lane's
// tokens have the bits of the lane decoded alone at its loop count.
void tl_iterate_rows(const tl_step_t *s, tl_block_rows_t *r, const long *table, long slot_stride, const long *ids,
                     const long *pos, const long *loop, const unsigned char *start, const unsigned char *finish,
                     float *e, float *st, float *logits, float *work) {
    rope_rows(s, r, pos, work + 4 * r->B * r->d, work + 4 * r->B * r->d + r->B * r->hd);
    start_and_pass(s, r, table, slot_stride, ids, pos, loop, start, 0, e, st, work);
    finish_rows(s, r, table, slot_stride, finish, st, logits, work);
}

// A row's exit rule for tl_iterate_until (tinyloop/exits.py), and what it keeps between calls: its token runs at
// most `loops` loops, and its rule may stop it from min_loops on. rule 0: none (it runs `loops`); 1: latent (the
// relative latent change |s_k - s_k-1| / |s_k| < threshold when threshold > 0, or the exit gate's sigmoid >= 0.5
// where the model has one); 2: a forced depth (the schedule: it stops after `threshold` loops); 3: cdf (Ouro's
// cumulative exit probability reaches the threshold). chosen: the token's exit loop is chosen (under exit_kv
// "compute" it loops on for its K/V), used: the loops it exits with (`loops` until chosen); cdf, rest: the cdf rule's
// sum and the mass left, in fp32 as exits.Track keeps them.
typedef struct {
    long rule, loops, min_loops;
    double threshold;
    long chosen, used;
    float cdf, rest;
} tl_exit_t;

// z = gate . s + bias, the exit gate's logit of a state.
static double gate_logit(const float *gate_w, double gate_b, const float *s, long d) {
    double z = gate_b;
    for (long i = 0; i < d; i++) z += (double)gate_w[i] * s[i];
    return z;
}

// Whether a token may stop after `k` loops, its state gone from old to now (the cdf rule's sums move on every loop).
static int rule_fires(tl_exit_t *x, long k, const float *old, const float *now, long d, const float *gate_w,
                      double gate_b) {
    int fires = 0;
    if (x->rule == 2) {
        fires = k >= (long)x->threshold;
    } else if (x->rule == 3) {
        const float lam = 1.0f / (1.0f + expf(-(float)gate_logit(gate_w, gate_b, now, d)));
        x->cdf = x->cdf + (k >= x->loops ? x->rest : lam * x->rest);
        x->rest = x->rest * (1.0f - lam);
        fires = x->threshold > 0 && x->cdf >= (float)x->threshold;
    } else if (x->rule == 1) {
        if (x->threshold > 0) {
            double change = 0.0, size = 0.0;
            for (long i = 0; i < d; i++) {
                const double v = now[i], dv = v - old[i];
                change += dv * dv;
                size += v * v;
            }
            const double norm = sqrt(size) > 1e-12 ? sqrt(size) : 1e-12;
            fires = (float)(sqrt(change) / norm) < (float)x->threshold;
        }
        if (gate_w && !fires) fires = gate_logit(gate_w, gate_b, now, d) >= 0;  // sigmoid(z) >= 0.5: z >= 0
    }
    return fires && k >= x->min_loops;
}

// A finished token's skipped loops, up to its `loops` (exit_kv "copy"): copies of its last loop's K/V at its cell.
static void copy_skipped(const tl_step_t *s, const tl_block_rows_t *r, const long *table, long slot_stride, long b,
                         const tl_exit_t *x) {
    const long cell = r->cells[b], lane = lane_of(r, b), n = r->KV * r->hd, bt = r->bt, off = (cell % bt) * n;
    for (long k = x->used; k < x->loops; k++)
        for (long j = 0; j < s->n_core; j++) {
            const long src = s->slots[s->n_prelude + (x->used - 1) * s->n_core + j];
            const long dst = s->slots[s->n_prelude + k * s->n_core + j];
            const long from = table[src * slot_stride + lane * r->table_stride + cell / bt];
            const long to = table[dst * slot_stride + lane * r->table_stride + cell / bt];
            memcpy(r->k_store + to * bt * n + off, r->k_store + from * bt * n + off, n * sizeof(float));
            memcpy(r->v_store + to * bt * n + off, r->v_store + from * bt * n + off, n * sizeof(float));
        }
}

// The first index of the largest of v[0..n-1] (torch.argmax's choice: a greedy draw).
static long argmax(const float *v, long n) {
    long best = 0;
    for (long i = 1; i < n; i++)
        if (v[i] > v[best]) best = i;
    return best;
}

// Row b's greedy draw from its logits, as tl_iterate_until hands it back (chosen, used, n_chosen, its budget, ids[b])
// with start[b] set: its next token starts from it. Whether it is eos. A row that asks for log-probabilities
// (keep_at[b] >= 0) also gets the logits its n-th draw was taken from, row keep_at[b] + n of kept [rows, V] (room for
// its budget): the caller scores them as it scores a token it chose itself (Sequence.score_all), so drawing here
// changes none of its log-probabilities.
static int draw(long b, const float *row, long V, const tl_exit_t *x, long *ids, unsigned char *start, long *budget,
                long cap, long eos, long *chosen, long *used, long *n_chosen, float *kept, const long *keep_at) {
    const long token = argmax(row, V), n = n_chosen[b]++;
    chosen[b * cap + n] = token, used[b * cap + n] = x->used;
    if (kept && keep_at[b] >= 0) memcpy(kept + (keep_at[b] + n) * V, row, V * sizeof(float));
    budget[b]--, start[b] = 1, ids[b] = token;
    return token == eos;
}

// The fewest passes before a running token may end, `done` loops run: at its loop count (no rule, or an exit chosen
// under exit_kv "compute", which loops on for its K/V), at its forced depth, or, under an adaptive rule, at any pass
// from min_loops on.
static long passes_left(const tl_exit_t *x, long done) {
    long k = x->loops;
    if (x->rule && !x->chosen) {
        k = x->min_loops > done + 1 ? x->min_loops : done + 1;
        if (x->rule == 2 && (long)x->threshold > k) k = (long)x->threshold;
        if (k > x->loops) k = x->loops;
    }
    return k - done;
}

// Coalescing the heads of greedy rows (tl_iterate_until's `wait`; docs/engine.md). A head call streams the whole head
// matrix and the coda's weights for its rows, and the next pass the prelude's for the rows it starts: for the bundled
// model ~0.2-0.3 ms and ~0.1 ms for a few rows, most of a 16-row pass (0.41 ms). Lanes exiting early end their tokens
// at scattered passes, so most heads and preludes ran for 1-4 rows. A greedy row whose token ended may instead sit
// out passes (start_and_pass's `out`: no K/V written or read, its state untouched) until a batch-mate's token ends
// too, and their heads and their next tokens' preludes run as one product each: the same rows, the same bits (every
// piece is batch-invariant), fewer weight streams. Rows at one depth that once waited for each other then end
// together, so a steady mix soon needs no waiting. What waiting costs is the passes the waiting rows do not run: n
// rows waiting p passes lose n p row-passes, a pass of every row when n p = B, about what one head call and one
// prelude save. Hence the held rows (n of B, having waited `waited` passes) wait one more pass only where some running
// row's token may end within p passes (passes_left), p <= most - waited (never more than `most` passes in all) and
// n p <= B. (A row that ends the call takes the held rows' heads into its own product: tl_iterate_until's last.)
// `most` is `wait` where every held row's depth was known in advance (no rule, or a forced depth: elastic lanes,
// whose depth holds a latency target and changes seldom, so rows that met once stay together) and `wait_rule`
// where a held row exits by an adaptive rule: its depth changes token by token, groups break up every few tokens,
// and re-forming them takes longer waits (measured on 16 distinct prompts: docs/engine.md).
static int keep_waiting(const tl_exit_t *exits, const long *done, const unsigned char *held,
                        const unsigned char *parked, long B, long n, long waited, long wait, long wait_rule) {
    long most = wait_rule;
    for (long b = 0; b < B; b++)
        if (held[b] && exits[b].rule != 1 && exits[b].rule != 3) most = wait;
    long p = most + 1;
    for (long b = 0; b < B; b++)
        if (!held[b] && !parked[b]) {
            const long left = passes_left(exits + b, done[b]);
            p = left < p ? left : p;
        }
    return waited + p <= most && n * p <= B;
}

INLINE double seconds_since(const struct timespec *t0) {
    struct timespec now;
    clock_gettime(CLOCK_MONOTONIC, &now);
    return (double)(now.tv_sec - t0->tv_sec) + 1e-9 * (double)(now.tv_nsec - t0->tv_nsec);
}

// Iteration-level steps over B <= 64 rows, in one call, until some row's token is done and needs the caller
// (kernels/cpu_block.py's DecodeStep.iterate_until; engine/c_backend.py's CBackend.iterate): a row with start[b] first
// runs the prelude of ids[b]; then every row runs one core pass at its own loop, done[b] -> done[b] + 1, and its
// exit rule (exits[b]) decides whether its token stops there. Between passes where no token ends there is nothing to
// schedule, so they run here without returning. A token whose exit is chosen ends there (exit_kv "copy", compute =
// 0: its skipped loops' K/V, up to its `loops`, become copies of its last loop's) or loops on to `loops` for its K/V
// (compute = 1); its logits come from the state it exited with (row lanes[b] of o_lanes).
// A row with budget[b] > 0 (a greedy draw the caller lets C make) takes its next token here: the argmax of its
// logits goes to chosen[b * cap + i] (the loops it ran to used[b * cap + i]), n_chosen[b] counts them, and its next
// token starts at the next cell and position (ids, pos and r->cells move on; a forced depth's next token stops after
// next_depth[b * cap + i] loops), while no row needs the caller. Such a row may wait up to `wait` passes for its
// head, `wait_rule` if it exits by an adaptive rule (keep_waiting: 0, every head runs in the pass its token ends).
// Once a row needs the caller (a token ended without budget, or a greedy draw gave eos, or a head ran after the call
// had drawn for ahead_s seconds), the call ends: the other rows' tokens ended here are finish[b], and their coda,
// final norm and head give logits [rows finished, V], in row order (with the waiting rows' heads in the same
// product, their draws made); a row whose draw was made but whose next token did not start has start[b] set. A
// row's latent (e, s) lives at row lanes[b] of e_lanes, s_lanes [lanes, d], read and written in place. The passes are tl_iterate_rows's, so each row has the same bits as there
// and as its token decoded alone. Returns the passes run; *heads: the head products run. rows: work floats for 4 B
// d; head: floats for B V (the greedy rows' logits, consumed in the pass: it may be `logits`). kept, keep_at: where
// a row asking for log-probabilities keeps the logits of its draws (draw; kept NULL: no row asks).
// verify[b] (verify NULL: none): row b is a row of a drafted chunk (a speculative lane's pending token and drafts,
// rows of one lane at consecutive cells, starting together): its token ends within this call, it never needs the
// caller alone (its head runs in the last product, and it sits out the passes after its token ends), and the call
// does not end while one of them still loops (the other rows sit those passes out). The chunk's rows pass in step,
// so each attends to the earlier rows' K/V at its own loop, written in the same pass or, for a row that exited,
// copied at its exit: the bits of the tokens decoded one by one.
long tl_iterate_until(const tl_step_t *s, tl_block_rows_t *r, const long *table, long slot_stride, long *ids,
                      long *pos, long *done, unsigned char *start, tl_exit_t *exits, const float *gate_w,
                      double gate_b, long compute, unsigned char *finish, float *e_lanes, float *s_lanes,
                      float *o_lanes, float *logits, float *work, float *rows, long *budget, long cap, long eos,
                      const double *next_depth, long *chosen, long *used, long *n_chosen, float *head,
                      double ahead_s, long wait, long wait_rule, long *heads, float *kept, const long *keep_at,
                      const unsigned char *verify) {
    const long B = r->B, d = r->d, hd = r->hd, V = s->head.rows;
    struct timespec t0;
    clock_gettime(CLOCK_MONOTONIC, &t0);
    float *e = rows, *st = rows + B * d, *old = rows + 2 * B * d, *out = rows + 3 * B * d;
    long *cells = (long *)r->cells;  // (the caller's array: a row's cell moves on with its greedy draws)
    for (long b = 0; b < B; b++) {
        const long lane = lane_of(r, b);
        memcpy(e + b * d, e_lanes + lane * d, d * sizeof(float));
        memcpy(st + b * d, s_lanes + lane * d, d * sizeof(float));
        memcpy(out + b * d, o_lanes + lane * d, d * sizeof(float));
        n_chosen[b] = 0;
    }
    rope_rows(s, r, pos, work + 4 * B * d, work + 4 * B * d + B * hd);
    unsigned char held[MAX_ITERATE_ROWS] = {0};  // greedy rows whose token ended, waiting for their head
    // rows out of the passes for the rest of the call: a verify row whose token ended (its head runs in the last
    // product), and every other row once the call is ending while verify rows still loop
    unsigned char parked[MAX_ITERATE_ROWS] = {0}, sits[MAX_ITERATE_ROWS];
    long passes = 0, ended = 0, n_held = 0, waited = 0, verifying = 0;
    for (long b = 0; b < B; b++) verifying += verify && verify[b];
    *heads = 0;
    while (1) {
        long at[MAX_ITERATE_ROWS], n_sits = 0;
        for (long b = 0; b < B; b++) at[b] = done[b], n_sits += sits[b] = held[b] || parked[b];
        memcpy(old, st, B * d * sizeof(float));
        start_and_pass(s, r, table, slot_stride, ids, pos, at, start, n_sits ? sits : 0, e, st, work);
        for (long b = 0; b < B; b++)
            if (start[b] && !sits[b])  // the state loop 0 started from: the initial state of its prelude output
                for (long k = 0; k < d; k++)
                    old[b * d + k] = s->state_init == 0   ? 0.0f
                                     : s->state_init == 1 ? e[b * d + k]
                                                          : s->noise[pos[b] * d + k];
        for (long b = 0; b < B; b++)
            if (!sits[b]) start[b] = 0;  // (a parked row's next token, drawn, starts in the next call)
        passes++;
        waited += n_held > 0;
        for (long b = 0; b < B; b++) {
            if (sits[b]) continue;  // (it sat the pass out)
            tl_exit_t *x = exits + b;
            const long k = ++done[b];
            if (x->rule && !x->chosen) {
                memcpy(out + b * d, st + b * d, d * sizeof(float));  // the state it exits with, if it stops here
                if (rule_fires(x, k, old + b * d, st + b * d, d, gate_w, gate_b) && k < x->loops)
                    x->chosen = 1, x->used = k;
            }
            finish[b] = k >= x->loops || (x->chosen && !compute);
            if (!finish[b]) continue;
            if (!x->rule) memcpy(out + b * d, st + b * d, d * sizeof(float));  // its head reads it
            if (!compute) copy_skipped(s, r, table, slot_stride, b, x);
            if (verify && verify[b]) {  // its chunk's last row to end ends the call
                parked[b] = 1;
                ended |= --verifying == 0;
            } else if (budget[b] > 0)
                held[b] = 1, finish[b] = 0, n_held++;
            else
                ended = 1;
        }
        if (ended && verifying) {  // the call ends once the verify rows' tokens end: the other rows sit out till then
            for (long b = 0; b < B; b++) parked[b] |= !verify[b];
            continue;
        }
        if (!n_held) {
            if (ended) break;
            continue;
        }
        // The call ends: the held rows' heads run in the product of the rows that end it (below; wait = 0 keeps the
        // heads apart, as before coalescing). Otherwise they wait while keep_waiting says it pays, the call's time
        // limit included: a head forced at ahead_s would start its rows' next tokens out of step with the batch-mates
        // they were waiting for, and rows out of step by more than `wait` passes end apart for the rest of their
        // requests; so the call ends at the first head after ahead_s, at most `wait` (`wait_rule`) passes later. (A
        // held row's draw may be eos, found a pass or two later: the others' passes in between are theirs anyway, so
        // nothing is lost but those passes' time.)
        if (ended && (wait || wait_rule)) break;
        if (!ended && keep_waiting(exits, done, held, parked, B, n_held, waited, wait, wait_rule))
            continue;
        finish_rows(s, r, table, slot_stride, held, out, head, work);
        ++*heads;
        for (long b = 0, i = 0; b < B; b++)
            if (held[b])
                ended |= draw(b, head + i++ * V, V, exits + b, ids, start, budget, cap, eos, chosen, used, n_chosen,
                              kept, keep_at);
        ended |= seconds_since(&t0) > ahead_s;
        if (ended) {  // the drawn rows' next tokens start in the next call (start[b] stays set)
            memset(held, 0, B);
            n_held = 0;
            if (!verifying) break;
            for (long b = 0; b < B; b++) parked[b] |= !verify[b];
            continue;
        }
        for (long b = 0; b < B; b++) {
            if (!held[b]) continue;
            tl_exit_t *x = exits + b;
            pos[b]++, cells[b]++, done[b] = 0;
            x->chosen = 0, x->used = x->loops, x->cdf = 0.0f, x->rest = 1.0f;
            if (x->rule == 2) x->threshold = next_depth[b * cap + n_chosen[b] - 1];
            held[b] = 0;
        }
        n_held = waited = 0;
        rope_rows(s, r, pos, work + 4 * B * d, work + 4 * B * d + B * hd);
    }
    // the heads of the rows that end the call and of the rows still waiting, as one product: the waiting rows' draws
    // are made (their next tokens start in the next call) and the others' logits close up, in row order
    unsigned char last[MAX_ITERATE_ROWS];
    long m = 0;
    for (long b = 0; b < B; b++) m += last[b] = finish[b] || held[b];
    if (m) {
        finish_rows(s, r, table, slot_stride, last, out, logits, work);
        ++*heads;
    }
    for (long b = 0, i = 0, j = 0; b < B; b++) {
        if (!last[b]) continue;
        const float *row = logits + i++ * V;
        if (held[b]) {
            draw(b, row, V, exits + b, ids, start, budget, cap, eos, chosen, used, n_chosen, kept, keep_at);
        } else {
            if (row != logits + j * V) memmove(logits + j * V, row, V * sizeof(float));
            j++;
        }
    }
    for (long b = 0; b < B; b++) {
        const long lane = lane_of(r, b);
        memcpy(e_lanes + lane * d, e + b * d, d * sizeof(float));
        memcpy(s_lanes + lane * d, st + b * d, d * sizeof(float));
        memcpy(o_lanes + lane * d, out + b * d, d * sizeof(float));
    }
    return passes;
}
