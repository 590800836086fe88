/* TreeAttention: the lowering's attention (com.microsoft::GroupQueryAttention as ort_lowering.py
 * uses it) over a KV cache bound in place, for a token tree.
 *
 * Why: ONNX Runtime's CPU GroupQueryAttention costs 10-20 us a call at a context of 250 for a
 * handful of queries (a GEMM per head, a softmax over the whole row, scratch buffers), several
 * times what reading the cache takes; the SSMs' drafters call it 16 times a chain and the LLM 6
 * times a step.
 *
 * Inputs: qkv [B, T, (H + 2 Hkv) D] (q, k, v packed per token); past_key, past_value
 * [B, Hkv, S, D] (bound to the same memory as the presents: then the past is read in place);
 * seqlens_k int32 [B] (= P + T - 1, P the tokens already cached); total_sequence_length int32;
 * cos, sin [positions, D / 2] (rotate-half RoPE); optional position_ids int64 [B, T] (default
 * P + t); optional attention_bias [B or 1, 1, T, total] (a tree: 0 where a key is visible, the
 * lowest float where not; default causal); scale float32. Outputs: attention [B, T, H D] and the
 * present key and value [B, Hkv, S, D], the new tokens' rows written at slots P .. P + T - 1.
 *
 * Query t sees keys 0 .. P + t (as GroupQueryAttention: causal, then the bias added); a key whose
 * bias is below -1e30 is skipped. Each query's sums run over its visible keys in slot order, one
 * by one, so a token's output is bit for bit the same whatever else is in the call and wherever
 * its masked neighbours sit: a node of a tree gets what the same token gets in a chain. Tasks are
 * (sequence, token, KV head), shared out over ONNX Runtime's intra-op pool. */
#include <immintrin.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "ort_api.h"
#include "tree_attention.h"

#define MASKED (-1e30f)
#define MAX_GROUP 16   /* query heads per KV head */

/* x rotated to position pos, rotate-half style: (x1 c - x2 s, x2 c + x1 s), halves of D / 2. */
static inline void rotate(const float *x, float *y, const float *cos, const float *sin, size_t D) {
    size_t half = D / 2;
    for (size_t i = 0; i < half; i++) {
        float a = x[i], b = x[i + half];
        y[i] = a * cos[i] - b * sin[i];
        y[i + half] = b * cos[i] + a * sin[i];
    }
}


static size_t past_of(const Job *job, size_t b) { return (size_t)job->seqlens[b] + 1 - job->T; }
static size_t position_of(const Job *job, size_t b, size_t t) {
    return job->positions ? (size_t)job->positions[b * job->T + t] : past_of(job, b) + t;
}

#if SIMD_AVX512
/* 16 vectors to one whose lane i is the sum of v[i]'s lanes: the same adds, in the same order,
 * for every lane (a key's score does not depend on where it falls in a block). */
static inline __m512 sum16(const __m512 *v) {
    __m512 a[8], b[4], c[2];
    for (int i = 0; i < 8; i++)
        a[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]), _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
    for (int i = 0; i < 4; i++)
        b[i] = _mm512_add_ps(_mm512_shuffle_ps(a[2 * i], a[2 * i + 1], 0x44), _mm512_shuffle_ps(a[2 * i], a[2 * i + 1], 0xEE));
    for (int i = 0; i < 2; i++)
        c[i] = _mm512_add_ps(_mm512_shuffle_f32x4(b[2 * i], b[2 * i + 1], 0x88),
                             _mm512_shuffle_f32x4(b[2 * i], b[2 * i + 1], 0xDD));
    return _mm512_add_ps(_mm512_shuffle_f32x4(c[0], c[1], 0x88), _mm512_shuffle_f32x4(c[0], c[1], 0xDD));
}

/* Lane j: the dot product of query qh with key k[j] (D floats each), for 16 keys. */
static inline vf scores16(const float *qh, const float *const *k, size_t D) {
    __m512 acc[16];
    for (int j = 0; j < 16; j++) acc[j] = _mm512_mul_ps(_mm512_load_ps(qh), _mm512_loadu_ps(k[j]));
    for (size_t c = 16; c < D; c += 16) {
        __m512 qc = _mm512_load_ps(qh + c);
        for (int j = 0; j < 16; j++) acc[j] = _mm512_fmadd_ps(qc, _mm512_loadu_ps(k[j] + c), acc[j]);
    }
    return sum16(acc);
}
#define WEIGH_HEADS 4    /* the most heads and 16-value chunks weigh() keeps in registers */
#define WEIGH_CHUNKS 4
#else
/* 8 vectors to one whose lane i is the sum of v[i]'s lanes, the same adds for every lane. */
static inline __m256 sum8(const __m256 *v) {
    __m256 low = _mm256_hadd_ps(_mm256_hadd_ps(v[0], v[1]), _mm256_hadd_ps(v[2], v[3]));
    __m256 high = _mm256_hadd_ps(_mm256_hadd_ps(v[4], v[5]), _mm256_hadd_ps(v[6], v[7]));
    return _mm256_add_ps(_mm256_permute2f128_ps(low, high, 0x20), _mm256_permute2f128_ps(low, high, 0x31));
}

/* Lane j of 8: the dot product of query qh with key k[j], summed 8 values at a time (16 vectors
 * of 16 would not fit AVX2's 16 registers). */
static inline __m256 scores8(const float *qh, const float *const *k, size_t D) {
    __m256 acc[8];
    for (int j = 0; j < 8; j++) acc[j] = _mm256_mul_ps(_mm256_load_ps(qh), _mm256_loadu_ps(k[j]));
    for (size_t c = 8; c < D; c += 8) {
        __m256 qc = _mm256_load_ps(qh + c);
        for (int j = 0; j < 8; j++) acc[j] = _mm256_fmadd_ps(qc, _mm256_loadu_ps(k[j] + c), acc[j]);
    }
    return sum8(acc);
}

static inline vf scores16(const float *qh, const float *const *k, size_t D) {
    return (vf){scores8(qh, k, D), scores8(qh, k + 8, D)};
}
#define WEIGH_HEADS 2
#define WEIGH_CHUNKS 2
#endif

/* 16 values of a cache from element `at` on: float, or float16 widened (exactly). */
static inline vf row16(const void *cache, int half, size_t at) {
    return half ? vf_from_half((const uint16_t *)cache + at) : vf_load((const float *)cache + at);
}

/* out[h] = sum_i p[h][i] v_i / l[h] over columns [16 c0, 16 (c0 + chunks)) for `heads` heads,
 * key by key in order (l[h] = sum_i p[h][i], summed on the first columns only). Constant heads
 * and chunks keep the accumulators in registers. */
static inline __attribute__((always_inline)) void weigh(const void *V, int half, const uint32_t *visible, size_t n,
                                                       size_t D, const float *p, size_t stride, float *l, float *out,
                                                       const int heads, const int chunks, size_t c0) {
    vf acc[4][4];
    float sum[4] = {0.0f, 0.0f, 0.0f, 0.0f};
    for (int h = 0; h < heads; h++)
        for (int c = 0; c < chunks; c++) acc[h][c] = vf_zero();
    for (size_t i = 0; i < n; i++) {
        size_t v = (size_t)visible[i] * D + 16 * c0;
        vf x[4];
        for (int c = 0; c < chunks; c++) x[c] = row16(V, half, v + 16 * c);
        for (int h = 0; h < heads; h++) {
            float w = p[h * stride + i];
            sum[h] += w;
            vf pw = vf_set1(w);
            for (int c = 0; c < chunks; c++) acc[h][c] = vf_fmadd(pw, x[c], acc[h][c]);
        }
    }
    for (int h = 0; h < heads; h++) {
        if (c0 == 0) l[h] = sum[h];
        vf total = vf_set1(l[h]);
        for (int c = 0; c < chunks; c++) vf_store(out + h * D + 16 * (c0 + c), vf_div(acc[h][c], total));
    }
}

#define WEIGH(H, C) weigh(V, half, visible, n, D, p + h * n, n, l + h, out + h * D, H, C, c0)
static void weigh_all(const void *V, int half, const uint32_t *visible, size_t n, size_t D, const float *p,
                      size_t group, float *out) {
    float l[MAX_GROUP];
    for (size_t h = 0; h < group; h += WEIGH_HEADS) {
        size_t heads = group - h < WEIGH_HEADS ? group - h : WEIGH_HEADS;
        for (size_t c0 = 0; c0 < D / 16;) {
            size_t left = D / 16 - c0, chunks = left >= 4 && WEIGH_CHUNKS >= 4 ? 4 : left >= 2 ? 2 : 1;
            switch (heads * 8 + chunks) {
                case 8 + 1: WEIGH(1, 1); break;   case 8 + 2: WEIGH(1, 2); break;   case 8 + 4: WEIGH(1, 4); break;
                case 16 + 1: WEIGH(2, 1); break;  case 16 + 2: WEIGH(2, 2); break;  case 16 + 4: WEIGH(2, 4); break;
                case 24 + 1: WEIGH(3, 1); break;  case 24 + 2: WEIGH(3, 2); break;  case 24 + 4: WEIGH(3, 4); break;
                default: /* 4 heads */
                    if (chunks == 1) WEIGH(4, 1); else if (chunks == 2) WEIGH(4, 2); else WEIGH(4, 4);
            }
            c0 += chunks;
        }
    }
}

/* The keys a query's bias row lets through (above MASKED) into visible[], in slot order, and their
 * biases into kept[]; their count. 16 keys at a time: a block wholly visible (a tree's past, where
 * most keys are) costs one compare, not one branch per key. */
static size_t visible_keys(const float *bias, size_t keys, uint32_t *visible, float *kept) {
    size_t n = 0, j = 0;
    vf masked = vf_set1(MASKED);
    for (; j + 16 <= keys; j += 16) {
        vf row = vf_load(bias + j);
        unsigned bits = vmask_bits(vf_gt(row, masked));
        if (bits == 0xFFFF) {
            for (uint32_t i = 0; i < 16; i++) visible[n + i] = (uint32_t)j + i;
            vf_store(kept + n, row);
            n += 16;
            continue;
        }
        for (; bits; bits &= bits - 1) {
            size_t i = j + (size_t)__builtin_ctz(bits);
            visible[n] = (uint32_t)i, kept[n++] = bias[i];
        }
    }
    for (; j < keys; j++)
        if (bias[j] > MASKED) visible[n] = (uint32_t)j, kept[n++] = bias[j];
    return n;
}

/* One task: token t of sequence b, the query heads of KV head g. */
void attend_task(const Job *job, size_t task) {
    size_t D = job->D, g = task % job->Hkv, t = (task / job->Hkv) % job->T, b = task / (job->Hkv * job->T);
    size_t group = job->H / job->Hkv, width = (job->H + 2 * job->Hkv) * D, keys = past_of(job, b) + t + 1;
    size_t head = (b * job->Hkv + g) * job->S * D, bytes = kv_itemsize(job);
    const void *K = (const char *)job->keys + head * bytes, *V = (const char *)job->values + head * bytes;
    const float *bias = job->bias ? job->bias + ((job->bias_batch > 1 ? b : 0) * job->T + t) * job->total : NULL;
    size_t pos = position_of(job, b, t);

    float q[MAX_GROUP * 256] __attribute__((aligned(64)));
    float wide[16 * 256] __attribute__((aligned(64)));   /* a block of float16 keys, widened */
    for (size_t h = 0; h < group; h++)
        rotate(job->qkv + (b * job->T + t) * width + (g * group + h) * D, q + h * D, job->cos + pos * D / 2,
               job->sin + pos * D / 2, D);

    /* One allocation: the visible keys' slots, their biases, and the scores s[h * n + i] (head-major,
     * the i-th visible key). */
    uint32_t *visible = malloc(keys * (sizeof *visible + sizeof(float)) + (group * keys + 16) * sizeof(float));
    float *out = job->out + (b * job->T + t) * job->H * D + g * group * D;
    if (visible == NULL) {   /* out of memory: this task's output is NaN, not a crash */
        for (size_t i = 0; i < group * D; i++) out[i] = NAN;
        return;
    }
    float *kept = (float *)(visible + keys), *s = kept + keys;
    size_t n = bias ? visible_keys(bias, keys, visible, kept) : keys;
    if (!bias)
        for (size_t j = 0; j < keys; j++) visible[j] = (uint32_t)j;
    vf scale = vf_set1(job->scale);
    for (size_t i0 = 0; i0 < n; i0 += 16) {   /* 16 keys at a time; a short last block repeats its last key */
        size_t m = n - i0 < 16 ? n - i0 : 16;
        vmask lanes = first_lanes(m);
        const float *k[16];
        if (job->half)   /* the block's keys widened once, for every head of the group */
            for (size_t j = 0; j < 16; j++) {
                size_t at = (size_t)visible[i0 + (j < m ? j : m - 1)] * D;
                for (size_t c = 0; c < D; c += 16) vf_store(wide + j * D + c, row16(K, 1, at + c));
                k[j] = wide + j * D;
            }
        else
            for (size_t j = 0; j < 16; j++) k[j] = (const float *)K + (size_t)visible[i0 + (j < m ? j : m - 1)] * D;
        for (size_t h = 0; h < group; h++) {   /* the score scaled, then its bias added (two roundings) */
            vf score = vf_mul(scores16(q + h * D, k, D), scale);
            vf_storem(s + h * n + i0, lanes, bias ? vf_add(score, vf_loadm(lanes, kept + i0)) : score);
        }
    }
    for (size_t h = 0; h < group; h++) {   /* softmax numerators in place */
        float *row = s + h * n;
        vf top = vf_set1(-INFINITY);
        size_t i = 0;
        for (; i + 16 <= n; i += 16) top = vf_max(top, vf_load(row + i));
        vmask tail = first_lanes(n - i);
        top = vf_mask_max(top, tail, top, vf_loadm(tail, row + i));
        vf shift = vf_set1(vf_reduce_max(top));
        for (i = 0; i + 16 <= n; i += 16) vf_store(row + i, exp_ps(vf_sub(vf_load(row + i), shift)));
        if (i < n) vf_storem(row + i, tail, exp_ps(vf_sub(vf_loadm(tail, row + i), shift)));
    }
    weigh_all(V, job->half, visible, n, D, s, group, out);
    free(visible);
}

static void attend(void *data, size_t task) { attend_task((const Job *)data, task); }

static OrtStatus *fail(const char *message) { return op_error("TreeAttention", message); }

/* The job's lengths against its cache and the cos/sin tables (``positions`` rows). */
static OrtStatus *check(const Job *job, size_t positions) {
    if (job->total > job->S) return fail("total_sequence_length exceeds the cache's slots");
    for (size_t b = 0; b < job->B; b++) {
        if (job->seqlens[b] + 1 < (int64_t)job->T || (size_t)job->seqlens[b] + 1 > job->total)
            return fail("seqlens_k must be at least T - 1 and below total_sequence_length");
        for (size_t t = 0; t < job->T; t++)
            if (position_of(job, b, t) >= positions) return fail("a position is past the cos/sin tables");
    }
    return NULL;
}

/* D floats into a cache row: copied, or rounded to float16 (to nearest even). */
static void put_row(void *cache, int half, size_t at, const float *x, size_t D) {
    if (!half) {
        memcpy((float *)cache + at, x, D * sizeof(float));
        return;
    }
    for (size_t c = 0; c < D; c += 16) vf_to_half((uint16_t *)cache + at + c, vf_load(x + c));
}

/* The new tokens' keys (rotated) and values written at slots P .. P + T - 1 of the presents (the
 * past copied first where a present is not bound to it), in the presents' type. */
void store_new(const Job *job, const void *past_key, const void *past_value) {
    const void *past[2] = {past_key, past_value};
    void *present[2] = {job->keys, job->values};
    size_t width = (job->H + 2 * job->Hkv) * job->D, D = job->D, bytes = kv_itemsize(job);
    float rotated[256];
    for (size_t b = 0; b < job->B; b++) {
        size_t P = past_of(job, b);
        for (size_t g = 0; g < job->Hkv; g++) {
            size_t head = (b * job->Hkv + g) * job->S * D;
            for (int kv = 0; kv < 2; kv++)
                if (present[kv] != past[kv])
                    memcpy((char *)present[kv] + head * bytes, (const char *)past[kv] + head * bytes, P * D * bytes);
            for (size_t t = 0; t < job->T; t++) {
                const float *x = job->qkv + (b * job->T + t) * width;
                size_t pos = position_of(job, b, t);
                rotate(x + (job->H + g) * D, rotated, job->cos + pos * D / 2, job->sin + pos * D / 2, D);
                put_row(job->keys, job->half, head + (P + t) * D, rotated, D);
                put_row(job->values, job->half, head + (P + t) * D, x + (job->H + job->Hkv + g) * D, D);
            }
        }
    }
}

static OrtStatus *compute_kv(OrtKernelContext *ctx, int half) {
    const OrtValue *in[10] = {NULL};
    for (size_t i = 0; i < 10; i++) CALL(KernelContext_GetInput, GetInputFn)(ctx, i, &in[i]);
    int64_t qd[3], kd[4], cd[2], bd[4], pd[2], sd[1];
    if (shape_of(in[0], qd, 3) != 3 || shape_of(in[1], kd, 4) != 4 || shape_of(in[5], cd, 2) != 2)
        return fail("qkv must be [B, T, width], the cache [B, Hkv, S, D], cos [positions, D / 2]");
    Job job = {0};
    job.B = (size_t)qd[0], job.T = (size_t)qd[1], job.Hkv = (size_t)kd[1], job.S = (size_t)kd[2], job.D = (size_t)kd[3];
    if (job.D == 0 || job.D % 16 || job.D > 256 || (size_t)cd[1] * 2 != job.D || kd[0] != qd[0] ||
        (size_t)qd[2] % job.D || (size_t)qd[2] / job.D <= 2 * job.Hkv)
        return fail("head size must be a multiple of 16 up to 256, with qkv, cache and cos/sin agreeing");
    job.H = (size_t)qd[2] / job.D - 2 * job.Hkv;
    if (job.H % job.Hkv || job.H / job.Hkv > MAX_GROUP) return fail("query heads must be a multiple of KV heads, at most 16 each");
    if (shape_of(in[3], sd, 1) != 1 || (size_t)sd[0] != job.B) return fail("seqlens_k must be [B]");
    job.qkv = data_of(in[0]);
    job.seqlens = data_of(in[3]);
    job.total = (size_t)*(const int32_t *)data_of(in[4]);
    job.cos = data_of(in[5]);
    job.sin = data_of(in[6]);
    job.scale = *(const float *)data_of(in[9]);
    if (in[7]) {
        if (shape_of(in[7], pd, 2) != 2 || (size_t)pd[0] != job.B || (size_t)pd[1] != job.T)
            return fail("position_ids must be [B, T]");
        job.positions = data_of(in[7]);
    }
    if (in[8]) {
        if (shape_of(in[8], bd, 4) != 4 || (bd[0] != 1 && (size_t)bd[0] != job.B) || (size_t)bd[2] != job.T ||
            (size_t)bd[3] != job.total)
            return fail("attention_bias must be [B or 1, 1, T, total_sequence_length]");
        job.bias = data_of(in[8]);
        job.bias_batch = (size_t)bd[0];
    }
    OrtStatus *bad = check(&job, (size_t)cd[0]);
    if (bad) return bad;
    int64_t od[3] = {qd[0], qd[1], (int64_t)(job.H * job.D)};
    OrtValue *out[3] = {NULL};
    CALL(KernelContext_GetOutput, GetOutputFn)(ctx, 0, od, 3, &out[0]);
    CALL(KernelContext_GetOutput, GetOutputFn)(ctx, 1, kd, 4, &out[1]);
    CALL(KernelContext_GetOutput, GetOutputFn)(ctx, 2, kd, 4, &out[2]);
    job.out = data_of(out[0]);
    job.keys = data_of(out[1]);
    job.values = data_of(out[2]);
    job.half = half;
    store_new(&job, data_of(in[1]), data_of(in[2]));
    if (job.B > 0 && job.T > 0)
        CALL(KernelContext_ParallelFor, ParallelForFn)(ctx, attend, job.B * job.T * job.Hkv, 0, &job);
    return NULL;
}

static void compute_v1(void *kernel, OrtKernelContext *ctx) { (void)kernel; (void)ctx; }   /* never called: V2 is set */
static OrtStatus *compute(void *kernel, OrtKernelContext *ctx) { (void)kernel; return compute_kv(ctx, 0); }
static OrtStatus *compute_f16(void *kernel, OrtKernelContext *ctx) { (void)kernel; return compute_kv(ctx, 1); }
static const char *op_name(const OrtCustomOp *op) { (void)op; return "TreeAttention"; }
static const char *f16_name(const OrtCustomOp *op) { (void)op; return "TreeAttentionF16KV"; }
static int input_type(const OrtCustomOp *op, size_t i) {
    (void)op;
    return i == 3 || i == 4 ? TYPE_INT32 : i == 7 ? TYPE_INT64 : TYPE_FLOAT;
}
static int f16_input_type(const OrtCustomOp *op, size_t i) { return i == 1 || i == 2 ? TYPE_FLOAT16 : input_type(op, i); }
static size_t inputs(const OrtCustomOp *op) { (void)op; return 10; }
static int input_kind(const OrtCustomOp *op, size_t i) { (void)op; return i == 7 || i == 8 ? INPUT_OPTIONAL : INPUT_REQUIRED; }
static int output_type(const OrtCustomOp *op, size_t i) { (void)op; (void)i; return TYPE_FLOAT; }
static int f16_output_type(const OrtCustomOp *op, size_t i) { (void)op; return i == 0 ? TYPE_FLOAT : TYPE_FLOAT16; }
static size_t outputs(const OrtCustomOp *op) { (void)op; return 3; }

OrtCustomOp tree_attention_op = {
    API_VERSION, stateless_kernel, op_name, op_cpu, input_type, inputs, output_type, outputs, compute_v1,
    op_destroy, input_kind, op_required, op_default_memory, op_arity, op_homogeneous, op_arity, op_homogeneous,
    stateless_kernel_v2, compute, NULL, op_start_version, op_end_version, NULL, NULL, NULL, NULL,
};

/* TreeAttentionF16KV: the same over a cache of float16 (past and present float16, rows widened as
 * read and rounded to nearest as written; the arithmetic float32 as above): half the cache's
 * bytes, which a batch of many sequences reads from memory every step. */
OrtCustomOp tree_attention_f16_op = {
    API_VERSION, stateless_kernel, f16_name, op_cpu, f16_input_type, inputs, f16_output_type, outputs, compute_v1,
    op_destroy, input_kind, op_required, op_default_memory, op_arity, op_homogeneous, op_arity, op_homogeneous,
    stateless_kernel_v2, compute_f16, NULL, op_start_version, op_end_version, NULL, NULL, NULL, NULL,
};

/* TreeAttentionSlots: the attention of n sequences' new tokens in one call, each sequence on its
 * own cache: what a batched graph ran as a Split of q|k|v by sequence, one TreeAttention per
 * sequence and a Concat (ort_lowering.batch_sequences), without their 2 + n kernels a layer, and
 * with every sequence's tasks shared out over the pool at once (16 one-token sequences gave each
 * of the 16 calls 2 tasks).
 *
 * Inputs: qkv [1, T1 + ... + Tn, width]; slot_tokens int64 [n] (T1 .. Tn); optional position_ids
 * int64 [1, T1 + ... + Tn]; cos, sin; scale; then per sequence s: past_key, past_value
 * [1, Hkv, S_s, D], seqlens_k int32 [1], total_sequence_length int32, attention_bias
 * [1, 1, T_s, total_s] or an empty tensor (causal). Outputs: attention [1, T1 + ... + Tn, H D],
 * then per sequence its present key and value. Each sequence gets bit for bit what TreeAttention
 * gives it alone. */
#define SLOT_INPUTS 5
#define FIXED_INPUTS 6

typedef struct {
    Job *jobs;
    size_t *first;   /* first[s]: sequence s's first task; first[n]: every task */
    size_t n;
} Slots;

static void attend_slot(void *data, size_t task) {
    const Slots *slots = (const Slots *)data;
    size_t lo = 0, hi = slots->n;   /* the s with first[s] <= task < first[s + 1] */
    while (hi - lo > 1) {
        size_t mid = (lo + hi) / 2;
        if (slots->first[mid] <= task) lo = mid; else hi = mid;
    }
    attend_task(&slots->jobs[lo], task - slots->first[lo]);
}

static OrtStatus *compute_slots_kv(OrtKernelContext *ctx, int half) {
    const OrtValue *in[FIXED_INPUTS] = {NULL};
    for (size_t i = 0; i < FIXED_INPUTS; i++) CALL(KernelContext_GetInput, GetInputFn)(ctx, i, &in[i]);
    int64_t qd[3], nd[1], cd[2], pd[2];
    if (shape_of(in[0], qd, 3) != 3 || qd[0] != 1 || shape_of(in[1], nd, 1) != 1 || shape_of(in[3], cd, 2) != 2)
        return fail("qkv must be [1, tokens, width], slot_tokens [n], cos [positions, D / 2]");
    size_t n = (size_t)nd[0], D = (size_t)cd[1] * 2, tokens = (size_t)qd[1];
    const int64_t *sizes = data_of(in[1]);
    const int64_t *positions = NULL;
    if (in[2]) {
        if (shape_of(in[2], pd, 2) != 2 || pd[0] != 1 || (size_t)pd[1] != tokens) return fail("position_ids must be [1, tokens]");
        positions = data_of(in[2]);
    }
    if (D == 0 || D % 16 || D > 256 || (size_t)qd[2] % D) return fail("head size must be a multiple of 16 up to 256");
    size_t count = 0;
    CALL(KernelContext_GetInputCount, OrtStatus *(*)(const OrtKernelContext *, size_t *))(ctx, &count);
    if (count != FIXED_INPUTS + SLOT_INPUTS * n) return fail("slot_tokens must name one sequence for each group of sequence inputs");
    Job *jobs = calloc(n ? n : 1, sizeof *jobs);
    size_t *first = malloc((n + 1) * sizeof *first);
    OrtStatus *bad = NULL;
    if (jobs == NULL || first == NULL) { bad = fail("out of memory"); goto done; }
    int64_t od[3] = {1, qd[1], 0};
    size_t row = 0;
    first[0] = 0;
    for (size_t s = 0; s < n && !bad; s++) {
        const OrtValue *v[SLOT_INPUTS] = {NULL};
        for (size_t i = 0; i < SLOT_INPUTS; i++) CALL(KernelContext_GetInput, GetInputFn)(ctx, FIXED_INPUTS + SLOT_INPUTS * s + i, &v[i]);
        int64_t kd[4], sd[1], bd[4];
        if (sizes[s] < 1 || row + (size_t)sizes[s] > tokens) { bad = fail("slot_tokens must be positive and sum to the tokens of qkv"); break; }
        if (shape_of(v[0], kd, 4) != 4 || kd[0] != 1 || (size_t)kd[3] != D || shape_of(v[2], sd, 1) != 1 || sd[0] != 1) {
            bad = fail("a sequence's cache must be [1, Hkv, S, D] and its seqlens_k [1]");
            break;
        }
        Job *job = &jobs[s];
        job->B = 1, job->T = (size_t)sizes[s], job->Hkv = (size_t)kd[1], job->S = (size_t)kd[2], job->D = D;
        if (job->Hkv == 0 || (size_t)qd[2] / D <= 2 * job->Hkv) { bad = fail("qkv's width must hold the query, key and value heads"); break; }
        job->H = (size_t)qd[2] / D - 2 * job->Hkv;
        if (job->H % job->Hkv || job->H / job->Hkv > MAX_GROUP) { bad = fail("query heads must be a multiple of KV heads, at most 16 each"); break; }
        job->qkv = (const float *)data_of(in[0]) + row * qd[2];
        job->positions = positions ? positions + row : NULL;
        job->cos = data_of(in[3]);
        job->sin = data_of(in[4]);
        job->scale = *(const float *)data_of(in[5]);
        job->seqlens = data_of(v[2]);
        job->total = (size_t)*(const int32_t *)data_of(v[3]);
        size_t rank = shape_of(v[4], bd, 4);
        if (!(rank == 1 && bd[0] == 0)) {   /* an empty tensor: no bias */
            if (rank != 4 || bd[0] != 1 || (size_t)bd[2] != job->T || (size_t)bd[3] != job->total) {
                bad = fail("a sequence's attention_bias must be [1, 1, T, total_sequence_length] or empty");
                break;
            }
            job->bias = data_of(v[4]);
            job->bias_batch = 1;
        }
        bad = check(job, (size_t)cd[0]);
        od[2] = (int64_t)(job->H * D);
        row += job->T;
        first[s + 1] = first[s] + job->T * job->Hkv;
    }
    if (!bad && row != tokens) bad = fail("slot_tokens must sum to the tokens of qkv");
    if (!bad && n > 1)
        for (size_t s = 1; s < n; s++)
            if (jobs[s].H != jobs[0].H) { bad = fail("every sequence must have the same heads"); break; }
    if (bad) goto done;
    OrtValue *out = NULL;
    CALL(KernelContext_GetOutput, GetOutputFn)(ctx, 0, od, 3, &out);
    float *attn = data_of(out);
    row = 0;
    for (size_t s = 0; s < n; s++) {
        Job *job = &jobs[s];
        const OrtValue *past[2] = {NULL, NULL};
        OrtValue *present[2] = {NULL, NULL};
        int64_t kd[4];
        for (int kv = 0; kv < 2; kv++) {
            CALL(KernelContext_GetInput, GetInputFn)(ctx, FIXED_INPUTS + SLOT_INPUTS * s + kv, &past[kv]);
            shape_of(past[kv], kd, 4);
            CALL(KernelContext_GetOutput, GetOutputFn)(ctx, 1 + 2 * s + kv, kd, 4, &present[kv]);
        }
        job->out = attn + row * job->H * D;
        job->keys = data_of(present[0]);
        job->values = data_of(present[1]);
        job->half = half;
        store_new(job, data_of(past[0]), data_of(past[1]));
        row += job->T;
    }
    Slots slots = {jobs, first, n};
    if (n > 0) CALL(KernelContext_ParallelFor, ParallelForFn)(ctx, attend_slot, first[n], 0, &slots);
done:
    free(first);
    free(jobs);
    return bad;
}

static OrtStatus *compute_slots(void *kernel, OrtKernelContext *ctx) { (void)kernel; return compute_slots_kv(ctx, 0); }
static OrtStatus *compute_slots_f16(void *kernel, OrtKernelContext *ctx) { (void)kernel; return compute_slots_kv(ctx, 1); }
static const char *slots_name(const OrtCustomOp *op) { (void)op; return "TreeAttentionSlots"; }
static const char *slots_f16_name(const OrtCustomOp *op) { (void)op; return "TreeAttentionSlotsF16KV"; }
static int slots_input_type(const OrtCustomOp *op, size_t i) {
    (void)op;
    return i == 1 || i == 2 ? TYPE_INT64 : i == FIXED_INPUTS ? TYPE_UNDEFINED : TYPE_FLOAT;
}
static size_t slots_inputs(const OrtCustomOp *op) { (void)op; return FIXED_INPUTS + 1; }
static int slots_input_kind(const OrtCustomOp *op, size_t i) {
    (void)op;
    return i == 2 ? INPUT_OPTIONAL : i == FIXED_INPUTS ? INPUT_VARIADIC : INPUT_REQUIRED;
}
static int slots_outputs_kind(const OrtCustomOp *op, size_t i) { (void)op; return i == 1 ? INPUT_VARIADIC : INPUT_REQUIRED; }
static size_t slots_outputs(const OrtCustomOp *op) { (void)op; return 2; }
static int slot_arity(const OrtCustomOp *op) { (void)op; return SLOT_INPUTS; }
static int heterogeneous(const OrtCustomOp *op) { (void)op; return 0; }
static int present_arity(const OrtCustomOp *op) { (void)op; return 2; }

OrtCustomOp tree_attention_slots_op = {
    API_VERSION, stateless_kernel, slots_name, op_cpu, slots_input_type, slots_inputs, output_type, slots_outputs,
    compute_v1, op_destroy, slots_input_kind, slots_outputs_kind, op_default_memory, slot_arity, heterogeneous,
    present_arity, op_homogeneous, stateless_kernel_v2, compute_slots, NULL, op_start_version, op_end_version,
    NULL, NULL, NULL, NULL,
};

OrtCustomOp tree_attention_slots_f16_op = {   /* TreeAttentionSlots over float16 caches (TreeAttentionF16KV) */
    API_VERSION, stateless_kernel, slots_f16_name, op_cpu, slots_input_type, slots_inputs, f16_output_type,
    slots_outputs, compute_v1, op_destroy, slots_input_kind, slots_outputs_kind, op_default_memory, slot_arity,
    heterogeneous, present_arity, op_homogeneous, stateless_kernel_v2, compute_slots_f16, NULL, op_start_version,
    op_end_version, NULL, NULL, NULL, NULL,
};
