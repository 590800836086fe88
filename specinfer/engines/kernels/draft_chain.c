/* DraftChain and DraftChainSampled: a small model's whole chain draft (ort_lowering.lower_drafter),
 * for one sequence or several (batch_drafter), in one kernel.
 *
 * Why: an SSM's drafter computes almost nothing (the embedded SSM: ~0.23 MFLOP a token) but as a
 * graph it runs 27 kernels a step, 223 for a chain of 8, at ~1.3 us each in ONNX Runtime; here
 * a sequence's steps run back to back on one thread (the attention by tree_attention.c's task),
 * the sequences of a batch shared out over the intra-op pool. A sequence's draft is the same
 * computation whatever else is in the batch, so bit for bit what it drafts alone.
 *
 * Inputs: input_ids int64 [1, C1 + ... + Cn] (each sequence's step-0 tokens, its root last);
 * optional slot_tokens int64 [n] (C1 .. Cn; absent: one sequence); config int64 [6] (layers,
 * depth, candidates K, Vd, width = (H + 2 Hkv) D, F); numbers float [2] (RMSNorm epsilon,
 * attention scale); cos, sin [positions, D / 2]; embed [V, hidden] (step 0's table, by token id);
 * embed_rows [Vd or more, hidden] (later steps' table, by the head's row); head; final_norm
 * [hidden]; draft_vocab int64 [Vd] (the token id of each head row) or empty (row = token id);
 * then, variadic: per layer LAYER_INPUTS weights (input_norm, qkv, qkv_bias [width] or empty,
 * o_proj, post_norm, gate_up, down); per sequence seqlens_k int32 [1] (= P + C - 1, P the tokens
 * it has cached), total_sequence_length int32 (= P + C) and per layer its past key and value [1,
 * Hkv, S, D]; sampled, per step noise [1, n, K]. Matrices ([K, N] as x W) come packed in panels,
 * [ceil(N / 64), K, 64] (native.pack_panels).
 *
 * Step 0 runs the model over a sequence's tokens, a later step over the token the step before
 * chose; each step's head scores the last token. Greedy (DraftChain) outputs, per step and
 * sequence at row j n + s: draft_tokens int64 [1, depth n, 2] (the two likeliest tokens, the
 * chain follows the first), draft_logits [1, depth n, 2], draft_mass [1, depth n, 1] =
 * sum(exp(logits - max)). Sampled (DraftChainSampled): the K likeliest tokens and their logits
 * [1, depth n, K] and draft_choice int64 [1, depth n, 1], the index among them of argmax(logit +
 * noise) (Gumbel-max: the caller's noise makes it a draw). Ties go to the lower index, as ONNX
 * TopK and ArgMax. Then, per sequence and layer, the present key and value, bound in place to its
 * cache: it gains the rows of its tokens and of its first depth - 1 draft tokens. A present not
 * bound to its past gets a copy of the cache. (Or, the graph's own form, per sequence, step and
 * layer: every step's presents, which a caller binds to the same cache; native.use_draft_chain
 * writes the first form, whose binding costs a runtime a twentieth: 8 outputs, not 32 at depth 8.) */
#include <immintrin.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "ort_api.h"
#include "tree_attention.h"

enum { IN_IDS, IN_SLOT_TOKENS, IN_CONFIG, IN_NUMBERS, IN_COS, IN_SIN, IN_EMBED, IN_EMBED_ROWS, IN_HEAD, IN_FINAL_NORM,
       IN_VOCAB, FIXED_INPUTS };
enum { L_INPUT_NORM, L_QKV, L_QKV_BIAS, L_O, L_POST_NORM, L_GATE_UP, L_DOWN, LAYER_INPUTS };
#define MAX_LAYERS 64
#define MAX_CANDIDATES 256
#define MAX_DEPTH 64
#define PANEL 64

typedef struct {
    const float *input_norm, *qkv, *qkv_bias, *o, *post_norm, *gate_up, *down;
} Layer;

typedef struct {
    size_t layers, depth, K, hidden, width, H, Hkv, D, F, V, Vd, positions;
    float eps, scale;
    const float *cos, *sin, *embed, *embed_rows, *head, *final_norm;
    const int64_t *vocab;
    Layer layer[MAX_LAYERS];
} Model;

typedef struct {   /* one sequence's draft */
    const int64_t *tokens;
    size_t T, total, S, slot;
    int32_t seqlens;
    float *keys[MAX_LAYERS], *values[MAX_LAYERS];
    int failed;
    size_t copy_of;   /* a sequence drafting the same on the same cache (itself if none) */
} Seq;

typedef struct {   /* a call: the model, its sequences, the outputs */
    const Model *m;
    Seq *seqs;
    size_t n;
    const float *noise[MAX_DEPTH];
    int64_t *drafted, *choice;
    float *top, *mass;
} Call;

static size_t panels(size_t n) { return (n + PANEL - 1) / PANEL; }

static OrtStatus *fail(const char *message) { return op_error("DraftChain", message); }

/* y[r] = x[r] W (+ b) for `rows` rows, W [K, N] packed in panels of 64 columns, [ceil(N / 64), K,
 * 64], the last zero-padded: each panel's weights are read in one sweep, k in order. */
#if SIMD_AVX512
static void matmul(const float *x, size_t rows, const float *W, const float *b, float *y, size_t K, size_t N) {
    for (size_t r = 0; r < rows; r++, x += K, y += N)
        for (size_t n = 0; n < N; n += PANEL) {
            const float *w = W + n * K;
            __mmask16 m[4];
            __m512 a[4];
            for (int c = 0; c < 4; c++) {
                size_t at = n + 16 * c, left = N > at ? N - at : 0;
                m[c] = first_lanes(left);
                a[c] = b ? _mm512_maskz_loadu_ps(m[c], b + at) : _mm512_setzero_ps();
            }
            __m512 odd[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps()};
            size_t k = 0;
            for (; k + 2 <= K; k += 2, w += 2 * PANEL) {   /* even and odd k apart: two chains of FMAs, not one */
                __m512 x0 = _mm512_set1_ps(x[k]), x1 = _mm512_set1_ps(x[k + 1]);
                for (int c = 0; c < 4; c++) a[c] = _mm512_fmadd_ps(x0, _mm512_loadu_ps(w + 16 * c), a[c]);
                for (int c = 0; c < 4; c++) odd[c] = _mm512_fmadd_ps(x1, _mm512_loadu_ps(w + PANEL + 16 * c), odd[c]);
            }
            if (k < K)
                for (int c = 0; c < 4; c++) a[c] = _mm512_fmadd_ps(_mm512_set1_ps(x[k]), _mm512_loadu_ps(w + 16 * c), a[c]);
            for (int c = 0; c < 4; c++) _mm512_mask_storeu_ps(y + n + 16 * c, m[c], _mm512_add_ps(a[c], odd[c]));
        }
}
#else
/* (AVX2: a panel's 64 columns are 8 accumulators, chains enough; more would not fit its 16 registers.) */
static void matmul(const float *x, size_t rows, const float *W, const float *b, float *y, size_t K, size_t N) {
    for (size_t r = 0; r < rows; r++, x += K, y += N)
        for (size_t n = 0; n < N; n += PANEL) {
            const float *w = W + n * K;
            vf a[4];
            for (int c = 0; c < 4; c++) {
                size_t at = n + 16 * c;
                a[c] = b ? vf_loadm(first_lanes(N > at ? N - at : 0), b + at) : vf_zero();
            }
            for (size_t k = 0; k < K; k++, w += PANEL) {
                vf xk = vf_set1(x[k]);
                for (int c = 0; c < 4; c++) a[c] = vf_fmadd(xk, vf_load(w + 16 * c), a[c]);
            }
            for (int c = 0; c < 4; c++) {
                size_t at = n + 16 * c;
                vf_storem(y + at, first_lanes(N > at ? N - at : 0), a[c]);
            }
        }
}
#endif

/* y = x / sqrt(mean(x^2) + eps) * w, row by row (SimplifiedLayerNormalization). */
static void rms_norm(const float *x, size_t rows, const float *w, float *y, size_t n, float eps) {
    for (size_t r = 0; r < rows; r++, x += n, y += n) {
        float sum = 0.0f;
        for (size_t i = 0; i < n; i++) sum += x[i] * x[i];
        float inv = 1.0f / sqrtf(sum / (float)n + eps);
        for (size_t i = 0; i < n; i++) y[i] = x[i] * inv * w[i];
    }
}

/* The K largest of x[0 .. n), largest first, ties to the lower index (ONNX TopK). */
static void top_k(const float *x, size_t n, size_t K, float *value, int64_t *index) {
    size_t kept = 0;
    for (size_t i = 0; i < n; i++) {
        if (kept == K) {   /* skip the 16 values from i on that beat none kept, 16 at once */
            size_t left = n - i < 16 ? n - i : 16;
            vmask in = first_lanes(left);
            unsigned beats = vmask_bits(vmask_and(in, vf_gt(vf_loadm(in, x + i), vf_set1(value[K - 1]))));
            if (beats == 0) { i += left - 1; continue; }
            i += (size_t)__builtin_ctz(beats);
        }
        size_t at = kept < K ? kept++ : K - 1;
        while (at > 0 && x[i] > value[at - 1]) {
            value[at] = value[at - 1];
            index[at] = index[at - 1];
            at--;
        }
        value[at] = x[i];
        index[at] = (int64_t)i;
    }
}

/* act = silu(gate) * up for one token's [gate | up] of 2 F: gate sigmoid(gate) from exp(-|gate|). */
static void swiglu(const float *gate_up, float *act, size_t F) {
    for (size_t f = 0; f < F; f += 16) {
        vmask m = first_lanes(F - f);
        vf g = vf_loadm(m, gate_up + f), u = vf_loadm(m, gate_up + F + f);
        vf e = exp_ps(vf_sub(vf_zero(), vf_abs(g)));
        vf one = vf_set1(1.0f);
        vf sig = vf_blend(vf_ge(g, vf_zero()), e, one);
        sig = vf_div(sig, vf_add(one, e));
        vf_storem(act + f, m, vf_mul(vf_mul(g, sig), u));
    }
}

/* sum(exp(x - top)) over n values, x <= top. */
static float mass(const float *x, size_t n, float top) {
    vf sum = vf_zero(), shift = vf_set1(top);
    for (size_t i = 0; i < n; i += 16) {
        vmask m = first_lanes(n - i);
        sum = vf_add(sum, vf_maskz(m, exp_ps(vf_sub(vf_loadm(m, x + i), shift))));
    }
    return vf_reduce_add(sum);
}

typedef struct {
    float *residual, *normed, *qkv, *attn, *gate_up, *act, *logits;
} Scratch;

/* One step of a sequence: the model over T tokens whose embeddings are in s->residual, their keys
 * and values written at slots P .. P + T - 1 of its cache; the last token's logits into s->logits. */
static void step(const Model *m, const Seq *q, const Scratch *s, size_t T, int32_t seqlens, size_t total) {
    for (size_t i = 0; i < m->layers; i++) {
        const Layer *L = &m->layer[i];
        rms_norm(s->residual, T, L->input_norm, s->normed, m->hidden, m->eps);
        matmul(s->normed, T, L->qkv, L->qkv_bias, s->qkv, m->hidden, m->width);
        Job job = {0};
        job.qkv = s->qkv, job.cos = m->cos, job.sin = m->sin, job.keys = q->keys[i], job.values = q->values[i];
        job.out = s->attn, job.seqlens = &seqlens, job.B = 1, job.T = T, job.H = m->H, job.Hkv = m->Hkv;
        job.S = q->S, job.D = m->D, job.total = total, job.scale = m->scale;
        store_new(&job, q->keys[i], q->values[i]);
        for (size_t task = 0; task < T * m->Hkv; task++) attend_task(&job, task);
        matmul(s->attn, T, L->o, NULL, s->normed, m->H * m->D, m->hidden);
        for (size_t j = 0; j < T * m->hidden; j++) s->residual[j] += s->normed[j];
        rms_norm(s->residual, T, L->post_norm, s->normed, m->hidden, m->eps);
        matmul(s->normed, T, L->gate_up, NULL, s->gate_up, m->hidden, 2 * m->F);
        for (size_t t = 0; t < T; t++) swiglu(s->gate_up + t * 2 * m->F, s->act + t * m->F, m->F);
        matmul(s->act, T, L->down, NULL, s->normed, m->F, m->hidden);
        for (size_t j = 0; j < T * m->hidden; j++) s->residual[j] += s->normed[j];
    }
    rms_norm(s->residual + (T - 1) * m->hidden, 1, m->final_norm, s->normed, m->hidden, m->eps);
    matmul(s->normed, 1, m->head, NULL, s->logits, m->hidden, m->Vd);
}

/* Sequence `task`'s whole chain (a task of the pool). */
static void draft(void *data, size_t task) {
    const Call *c = (const Call *)data;
    const Model *m = c->m;
    Seq *q = &c->seqs[task];
    if (q->copy_of != q->slot) return;   /* its rows are copied from the one it repeats */
    size_t T = q->T, hidden = m->hidden, F = m->F;
    Scratch s = {malloc(T * hidden * sizeof(float)), malloc(T * hidden * sizeof(float)),
                 malloc(T * m->width * sizeof(float)), malloc(T * m->H * m->D * sizeof(float)),
                 malloc(T * 2 * F * sizeof(float)), malloc(T * F * sizeof(float)), malloc(m->Vd * sizeof(float))};
    if (!s.residual || !s.normed || !s.qkv || !s.attn || !s.gate_up || !s.act || !s.logits) {
        q->failed = 1;
    } else {
        float value[MAX_CANDIDATES];
        int64_t index[MAX_CANDIDATES];
        for (size_t t = 0; t < T; t++) memcpy(s.residual + t * hidden, m->embed + q->tokens[t] * hidden, hidden * sizeof(float));
        for (size_t j = 0, n = T; j < m->depth; j++, n = 1) {
            step(m, q, &s, n, q->seqlens + (int32_t)j, q->total + j);
            top_k(s.logits, m->Vd, m->K, value, index);
            size_t row = j * c->n + q->slot, chosen = 0;
            if (c->choice) {
                const float *noise = c->noise[j] + q->slot * m->K;
                for (size_t i = 1; i < m->K; i++)
                    if (value[i] + noise[i] > value[chosen] + noise[chosen]) chosen = i;
                c->choice[row] = (int64_t)chosen;
            } else {
                c->mass[row] = mass(s.logits, m->Vd, value[0]);
            }
            for (size_t i = 0; i < m->K; i++) {
                c->drafted[row * m->K + i] = m->vocab ? m->vocab[index[i]] : index[i];
                c->top[row * m->K + i] = value[i];
            }
            memcpy(s.residual, m->embed_rows + index[chosen] * hidden, hidden * sizeof(float));
        }
    }
    free(s.residual), free(s.normed), free(s.qkv), free(s.attn), free(s.gate_up), free(s.act), free(s.logits);
}

static const OrtValue *input(OrtKernelContext *ctx, size_t i) {
    const OrtValue *v = NULL;
    CALL(KernelContext_GetInput, GetInputFn)(ctx, i, &v);
    return v;
}

/* An input of exactly `rank` dims whose sizes are `want` (0: any; the size read into it). */
static void *tensor(OrtKernelContext *ctx, size_t i, size_t rank, size_t *want) {
    int64_t d[4];
    const OrtValue *v = input(ctx, i);
    if (v == NULL || shape_of(v, d, 4) != rank) return NULL;
    for (size_t r = 0; r < rank; r++) {
        if (want[r] && (size_t)d[r] != want[r]) return NULL;
        want[r] = (size_t)d[r];
    }
    return data_of(v);
}

/* The model's inputs read and checked; NULL or the reason they are wrong. */
static OrtStatus *read_model(OrtKernelContext *ctx, Model *m, int sampled, size_t sequences) {
    int64_t cd[1], d[4];
    const OrtValue *config = input(ctx, IN_CONFIG), *numbers = input(ctx, IN_NUMBERS);
    if (shape_of(config, cd, 1) != 1 || cd[0] != 6 || shape_of(numbers, d, 1) != 1 || d[0] != 2)
        return fail("config must be [layers, depth, candidates, Vd, width, F] and numbers [epsilon, scale]");
    const int64_t *c = data_of(config);
    const float *f = data_of(numbers);
    if (c[0] < 1 || c[0] > MAX_LAYERS || c[1] < 1 || c[1] > MAX_DEPTH || c[2] < 1 || c[2] > MAX_CANDIDATES ||
        c[3] < 1 || c[4] < 1 || c[5] < 1)
        return fail("config's layers, depth, candidates or sizes out of range");
    m->layers = (size_t)c[0], m->depth = (size_t)c[1], m->K = sampled ? (size_t)c[2] : 2;
    m->Vd = (size_t)c[3], m->width = (size_t)c[4], m->F = (size_t)c[5];
    m->eps = f[0], m->scale = f[1];
    /* The inputs' count before any variadic one is read (ONNX Runtime hands out values past the end). */
    size_t count = 0;
    CALL(KernelContext_GetInputCount, OrtStatus *(*)(const OrtKernelContext *, size_t *))(ctx, &count);
    if (sequences == 0 || count != FIXED_INPUTS + m->layers * LAYER_INPUTS + sequences * (2 + 2 * m->layers) +
                                        (sampled ? m->depth : 0))
        return fail("the inputs must be the fixed ones, the layers' weights, each sequence's and, sampled, a noise a step");
    size_t e[2] = {0, 0}, r[2] = {0, 0}, n[1] = {0}, cs[2] = {0, 0};
    if (!(m->embed = tensor(ctx, IN_EMBED, 2, e))) return fail("embed must be [V, hidden]");
    m->V = e[0], m->hidden = e[1];
    size_t h[3] = {panels(m->Vd), m->hidden, PANEL};
    if (!(m->head = tensor(ctx, IN_HEAD, 3, h))) return fail("head must be [hidden, Vd] in panels");
    r[1] = m->hidden, n[0] = m->hidden;   /* embed_rows: any rows from Vd up (a chain of 1 never reads it) */
    if (!(m->embed_rows = tensor(ctx, IN_EMBED_ROWS, 2, r)) || r[0] < m->Vd ||
        !(m->final_norm = tensor(ctx, IN_FINAL_NORM, 1, n)))
        return fail("embed_rows must be [Vd or more, hidden] and final_norm [hidden]");
    if (m->K > m->Vd) return fail("more candidates than the head scores");
    const OrtValue *vocab = input(ctx, IN_VOCAB);
    if (shape_of(vocab, d, 1) != 1 || (d[0] != 0 && (size_t)d[0] != m->Vd)) return fail("draft_vocab must be [Vd] or empty");
    m->vocab = d[0] ? data_of(vocab) : NULL;
    if (!(m->cos = tensor(ctx, IN_COS, 2, cs)) || !(m->sin = tensor(ctx, IN_SIN, 2, cs)))
        return fail("cos and sin must be [positions, D / 2]");
    m->D = 2 * cs[1], m->positions = cs[0];
    if (m->D == 0 || m->D % 16 || m->D > 256 || m->width % m->D) return fail("head size must be a multiple of 16 up to 256");
    size_t heads = m->width / m->D;   /* H + 2 Hkv, and H D = o_proj's rows */
    size_t o0[3] = {panels(m->hidden), 0, PANEL};
    if (!tensor(ctx, FIXED_INPUTS + L_O, 3, o0) || o0[1] % m->D || o0[1] / m->D >= heads || (heads - o0[1] / m->D) % 2)
        return fail("o_proj must be [H D, hidden] in panels, with qkv's width (H + 2 Hkv) D");
    m->H = o0[1] / m->D, m->Hkv = (heads - m->H) / 2;
    if (m->Hkv == 0 || m->H % m->Hkv || m->H / m->Hkv > 16) return fail("query heads must be a multiple of KV heads, at most 16 each");
    for (size_t i = 0; i < m->layers; i++) {
        Layer *L = &m->layer[i];
        size_t base = FIXED_INPUTS + i * LAYER_INPUTS, in[1] = {m->hidden}, post[1] = {m->hidden};
        size_t qkv[3] = {panels(m->width), m->hidden, PANEL}, o[3] = {panels(m->hidden), m->H * m->D, PANEL};
        size_t gu[3] = {panels(2 * m->F), m->hidden, PANEL}, down[3] = {panels(m->hidden), m->F, PANEL};
        if (!(L->input_norm = tensor(ctx, base + L_INPUT_NORM, 1, in)) || !(L->qkv = tensor(ctx, base + L_QKV, 3, qkv)) ||
            !(L->o = tensor(ctx, base + L_O, 3, o)) || !(L->post_norm = tensor(ctx, base + L_POST_NORM, 1, post)) ||
            !(L->gate_up = tensor(ctx, base + L_GATE_UP, 3, gu)) || !(L->down = tensor(ctx, base + L_DOWN, 3, down)))
            return fail("a layer's weights have the wrong shape (matrices in panels)");
        const OrtValue *bias = input(ctx, base + L_QKV_BIAS);   /* empty: none (an empty tensor may have no data) */
        if (shape_of(bias, d, 4) != 1 || (d[0] != 0 && (size_t)d[0] != m->width)) return fail("qkv_bias must be [width] or empty");
        L->qkv_bias = d[0] ? data_of(bias) : NULL;
    }
    return NULL;
}

/* Sequence s's inputs read and checked (before anything is written). */
static OrtStatus *read_seq(OrtKernelContext *ctx, const Model *m, Seq *q, size_t base) {
    size_t one[1] = {1}, none[1] = {0};
    const int32_t *seqlens = tensor(ctx, base, 1, one), *total = tensor(ctx, base + 1, 0, none);
    if (seqlens == NULL || total == NULL) return fail("a sequence's seqlens_k must be [1] and its total_sequence_length a scalar");
    q->seqlens = *seqlens, q->total = (size_t)*total;
    if (q->seqlens < 0 || (size_t)q->seqlens + 1 != q->total || q->total < q->T)
        return fail("seqlens_k must be total_sequence_length - 1, and that at least the sequence's tokens");
    for (size_t i = 0; i < m->layers; i++) {
        size_t k[4] = {1, m->Hkv, 0, m->D}, v[4] = {1, m->Hkv, 0, m->D};
        if (!tensor(ctx, base + 2 + 2 * i, 4, k) || !tensor(ctx, base + 3 + 2 * i, 4, v) || k[2] != v[2])
            return fail("a sequence's caches must be [1, Hkv, S, D] with the model's heads");
        q->S = k[2];
    }
    if (q->total + m->depth - 1 > q->S || q->total + m->depth - 1 > m->positions)
        return fail("the draft runs past the cache or the cos/sin tables");
    for (size_t t = 0; t < q->T; t++)
        if (q->tokens[t] < 0 || (size_t)q->tokens[t] >= m->V) return fail("a token id is outside the vocabulary");
    return NULL;
}

static OrtStatus *compute(OrtKernelContext *ctx, int sampled) {
    Model *m = calloc(1, sizeof *m);
    Call c = {0};
    OrtStatus *bad = NULL;
    size_t ids[2] = {1, 0};
    const int64_t *tokens = tensor(ctx, IN_IDS, 2, ids), *sizes = NULL;
    c.n = 1;
    if (input(ctx, IN_SLOT_TOKENS)) {
        size_t sd[1] = {0};
        if (!(sizes = tensor(ctx, IN_SLOT_TOKENS, 1, sd))) c.n = 0; else c.n = sd[0];
    }
    if (m == NULL) bad = fail("out of memory");
    else if (tokens == NULL || ids[1] == 0) bad = fail("input_ids must be [1, tokens], tokens >= 1");
    else bad = read_model(ctx, m, sampled, c.n);
    if (bad) goto done;
    size_t seq_inputs = 2 + 2 * m->layers, first_seq = FIXED_INPUTS + m->layers * LAYER_INPUTS;
    c.m = m;
    c.seqs = calloc(c.n, sizeof *c.seqs);
    if (c.seqs == NULL) { bad = fail("out of memory"); goto done; }
    for (size_t s = 0, row = 0; s < c.n; s++) {
        Seq *q = &c.seqs[s];
        q->T = sizes ? (size_t)sizes[s] : ids[1], q->tokens = tokens + row, q->slot = s;
        if (sizes && (sizes[s] < 1 || row + (size_t)sizes[s] > ids[1])) { bad = fail("slot_tokens must be positive and sum to the tokens"); goto done; }
        row += q->T;
        if ((bad = read_seq(ctx, m, q, first_seq + s * seq_inputs))) goto done;
        if (s == c.n - 1 && row != ids[1]) { bad = fail("slot_tokens must be positive and sum to the tokens"); goto done; }
    }
    for (size_t j = 0; sampled && j < m->depth; j++) {
        size_t want[3] = {1, c.n, m->K};
        if (!(c.noise[j] = tensor(ctx, first_seq + c.n * seq_inputs + j, 3, want))) {
            bad = fail("each step's noise must be [1, sequences, candidates]");
            goto done;
        }
    }
    size_t outputs_given = 0;
    CALL(KernelContext_GetOutputCount, OrtStatus *(*)(const OrtKernelContext *, size_t *))(ctx, &outputs_given);
    size_t steps_out = outputs_given == 3 + c.n * m->layers * 2 ? 1 : m->depth;   /* presents per sequence and layer */
    if (outputs_given != 3 + c.n * steps_out * m->layers * 2) {
        bad = fail("the outputs must be the draft's three, then each sequence's presents (per layer, or per step and layer)");
        goto done;
    }
    int64_t od[3] = {1, (int64_t)(m->depth * c.n), (int64_t)m->K}, ld[3] = {1, (int64_t)(m->depth * c.n), 1};
    OrtValue *out[3] = {NULL};
    for (int o = 0; o < 3; o++) CALL(KernelContext_GetOutput, GetOutputFn)(ctx, o, o == 2 ? ld : od, 3, &out[o]);
    c.drafted = data_of(out[0]), c.top = data_of(out[1]);
    if (sampled) c.choice = data_of(out[2]); else c.mass = data_of(out[2]);
    /* Each sequence works on its step-0 presents (its caches, bound in place, or a copy of them). */
    for (size_t s = 0; s < c.n; s++)
        for (size_t i = 0; i < m->layers; i++)
            for (int kv = 0; kv < 2; kv++) {
                Seq *q = &c.seqs[s];
                int64_t kd[4] = {1, (int64_t)m->Hkv, (int64_t)q->S, (int64_t)m->D};
                OrtValue *present = NULL;
                CALL(KernelContext_GetOutput, GetOutputFn)(ctx, 3 + (s * steps_out * m->layers + i) * 2 + kv, kd, 4, &present);
                float *past = data_of(input(ctx, first_seq + s * seq_inputs + 2 + 2 * i + kv)), *cache = data_of(present);
                if (cache != past) memcpy(cache, past, m->Hkv * q->S * m->D * sizeof(float));
                if (kv) q->values[i] = cache; else q->keys[i] = cache;
            }
    /* A batch's spare slots share one scratch cache and draft the same: the first of them drafts,
     * the others copy its rows (two drafts on one cache would write it at once). Sequences on one
     * cache with different inputs are refused. */
    for (size_t s = 0; s < c.n && !bad; s++) {
        Seq *q = &c.seqs[s];
        q->copy_of = s;
        for (size_t t = 0; t < s; t++) {
            const Seq *o = &c.seqs[t];
            if (o->keys[0] != q->keys[0] && o->values[0] != q->values[0]) continue;
            int same = o->T == q->T && o->seqlens == q->seqlens && !memcmp(o->tokens, q->tokens, q->T * sizeof *q->tokens);
            for (size_t j = 0; sampled && same && j < m->depth; j++)
                same = !memcmp(c.noise[j] + o->slot * m->K, c.noise[j] + q->slot * m->K, m->K * sizeof(float));
            if (!same) bad = fail("two sequences with different inputs share a cache");
            q->copy_of = t;
            break;
        }
    }
    if (bad) goto done;
    CALL(KernelContext_ParallelFor, ParallelForFn)(ctx, draft, c.n, 0, &c);
    for (size_t s = 0; s < c.n; s++)
        for (size_t j = 0, from = c.seqs[s].copy_of; from != s && j < m->depth; j++) {
            size_t row = j * c.n + s, source = j * c.n + from;
            memcpy(c.drafted + row * m->K, c.drafted + source * m->K, m->K * sizeof *c.drafted);
            memcpy(c.top + row * m->K, c.top + source * m->K, m->K * sizeof *c.top);
            if (sampled) c.choice[row] = c.choice[source]; else c.mass[row] = c.mass[source];
        }
    for (size_t s = 0; s < c.n; s++) {
        Seq *q = &c.seqs[s];
        if (q->failed) { bad = fail("out of memory"); goto done; }
        int64_t kd[4] = {1, (int64_t)m->Hkv, (int64_t)q->S, (int64_t)m->D};
        for (size_t j = 1; j < steps_out; j++)   /* later steps' presents bound elsewhere get the cache */
            for (size_t i = 0; i < m->layers; i++)
                for (int kv = 0; kv < 2; kv++) {
                    OrtValue *present = NULL;
                    CALL(KernelContext_GetOutput, GetOutputFn)(ctx, 3 + ((s * m->depth + j) * m->layers + i) * 2 + kv, kd, 4, &present);
                    float *cache = kv ? q->values[i] : q->keys[i], *there = data_of(present);
                    if (there != cache) memcpy(there, cache, m->Hkv * q->S * m->D * sizeof(float));
                }
    }
done:
    free(c.seqs);
    free(m);
    return bad;
}

static OrtStatus *compute_greedy(void *kernel, OrtKernelContext *ctx) { (void)kernel; return compute(ctx, 0); }
static OrtStatus *compute_sampled(void *kernel, OrtKernelContext *ctx) { (void)kernel; return compute(ctx, 1); }
static void compute_v1(void *kernel, OrtKernelContext *ctx) { (void)kernel; (void)ctx; }   /* never called: V2 is set */
static const char *greedy_name(const OrtCustomOp *op) { (void)op; return "DraftChain"; }
static const char *sampled_name(const OrtCustomOp *op) { (void)op; return "DraftChainSampled"; }
static int input_type(const OrtCustomOp *op, size_t i) {
    (void)op;
    return i == IN_IDS || i == IN_SLOT_TOKENS || i == IN_CONFIG || i == IN_VOCAB ? TYPE_INT64
           : i == FIXED_INPUTS ? TYPE_UNDEFINED : TYPE_FLOAT;
}
static size_t inputs(const OrtCustomOp *op) { (void)op; return FIXED_INPUTS + 1; }
static int input_kind(const OrtCustomOp *op, size_t i) {
    (void)op;
    return i == IN_SLOT_TOKENS ? INPUT_OPTIONAL : i == FIXED_INPUTS ? INPUT_VARIADIC : INPUT_REQUIRED;
}
static int greedy_output_type(const OrtCustomOp *op, size_t i) { (void)op; return i == 0 ? TYPE_INT64 : TYPE_FLOAT; }
static int sampled_output_type(const OrtCustomOp *op, size_t i) { (void)op; return i == 0 || i == 2 ? TYPE_INT64 : TYPE_FLOAT; }
static size_t outputs(const OrtCustomOp *op) { (void)op; return 4; }
static int output_kind(const OrtCustomOp *op, size_t i) { (void)op; return i == 3 ? INPUT_VARIADIC : INPUT_REQUIRED; }
static int heterogeneous(const OrtCustomOp *op) { (void)op; return 0; }

OrtCustomOp draft_chain_op = {
    API_VERSION, stateless_kernel, greedy_name, op_cpu, input_type, inputs, greedy_output_type, outputs, compute_v1,
    op_destroy, input_kind, output_kind, op_default_memory, op_arity, heterogeneous, op_arity, op_homogeneous,
    stateless_kernel_v2, compute_greedy, NULL, op_start_version, op_end_version, NULL, NULL, NULL, NULL,
};

OrtCustomOp draft_chain_sampled_op = {
    API_VERSION, stateless_kernel, sampled_name, op_cpu, input_type, inputs, sampled_output_type, outputs, compute_v1,
    op_destroy, input_kind, output_kind, op_default_memory, op_arity, heterogeneous, op_arity, op_homogeneous,
    stateless_kernel_v2, compute_sampled, NULL, op_start_version, op_end_version, NULL, NULL, NULL, NULL,
};
