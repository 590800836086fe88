/* specinfer_softmax: rows of float32 logits to float64 probabilities at a temperature, the shaping
 * every sampled token goes through; below it, the draw of a token by the inverse CDF from such
 * logits, from a residual or from a distribution (specinfer_sample_softmax,
 * specinfer_sample_residual). specinfer/sampling.py and verify.py call them through ctypes, not
 * ONNX Runtime; the op SampleSoftmax (at the end) draws inside a graph, as sampling.draw does.
 *
 * Why: numpy shapes an 8k-token row in ~29 us (seven passes, each a call), a twentieth of an LLM
 * step, and a sampled step shapes 2-5 rows; here it is one pass to widen, scale and find the
 * maximum, one to exponentiate and sum, one to divide.
 *
 * out[r, i] = exp(z_i - max z) / sum_j exp(z_j - max z), z = logits[r] / temperature, in float64
 * (exp within ~2e-16 relative: a degree-12 Taylor polynomial on |r| <= ln 2 / 2 times 2^n). */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "ort_api.h"
#include "simd.h"

/* exp(x) for x <= 0, 8 lanes of float64; 0 below -708 (under the smallest normal double). */
static inline vd exp_pd(vd x) {
    vdmask live = vd_ge(x, vd_set1(-708.0));
    x = vd_max(x, vd_set1(-708.0));
    vd n = vd_round(vd_mul(x, vd_set1(1.4426950408889634)));
    vd r = vd_fnmadd(n, vd_set1(6.93147180369123816490e-01), x);   /* ln 2, high part */
    r = vd_fnmadd(n, vd_set1(1.90821492927058770002e-10), r);          /* ln 2, low part */
    vd p = vd_set1(1.0 / 479001600.0);   /* 1 / 12! */
    static const double inverse_factorial[] = {1.0 / 39916800.0, 1.0 / 3628800.0, 1.0 / 362880.0, 1.0 / 40320.0,
                                               1.0 / 5040.0, 1.0 / 720.0, 1.0 / 120.0, 1.0 / 24.0, 1.0 / 6.0, 0.5,
                                               1.0, 1.0};
    for (int i = 0; i < 12; i++) p = vd_fmadd(p, r, vd_set1(inverse_factorial[i]));
    return vd_scale_or_zero(live, p, n);
}

__attribute__((visibility("default"))) void specinfer_softmax(const float *logits, int64_t rows, int64_t V,
                                                              double temperature, double *out) {
    vd scale = vd_set1(1.0 / temperature);
    for (int64_t row = 0; row < rows; row++, logits += V, out += V) {
        vd top = vd_set1(-INFINITY);
        for (int64_t i = 0; i < V; i += 8) {
            vdmask m = first_lanes8((size_t)(V - i));
            vd z = vd_mul(vd_from_floats(m, logits + i), scale);
            vd_storem(out + i, m, z);
            top = vd_mask_max(top, m, top, z);
        }
        vd shift = vd_set1(vd_reduce_max(top)), sum = vd_zero();
        for (int64_t i = 0; i < V; i += 8) {
            vdmask m = first_lanes8((size_t)(V - i));
            vd e = exp_pd(vd_sub(vd_loadm(m, out + i), shift));
            vd_storem(out + i, m, e);
            sum = vd_add(sum, vd_maskz(m, e));
        }
        vd inverse = vd_set1(1.0 / vd_reduce_add(sum));   /* (a division a value cost 4 us a row) */
        for (int64_t i = 0; i < V; i += 8) {
            vdmask m = first_lanes8((size_t)(V - i));
            vd_storem(out + i, m, vd_mul(vd_loadm(m, out + i), inverse));
        }
    }
}

/* Sampling by the inverse CDF without writing the distribution: the token sampling.sample() draws
 * with uniform u, the first whose running weight exceeds u times the total, found as sample() finds
 * it, by blocks of SAMPLE_BLOCK weights, then within the block; where rounding leaves no token past
 * the target, the last one with weight. Weights are computed a block at a time (8 lanes), summed
 * per block, and again within the block chosen.
 *
 * Why: a sampled token cost ~90 us cold after an LLM step (a float64 softmax written, then numpy's
 * block sums and searches over it), a seventh of the step; here two reads of the logits. */
#define SAMPLE_BLOCK 128

/* weights(i0, n, out): the n weights from i0, into out (n <= SAMPLE_BLOCK). */
typedef void (*Weights)(const void *src, int64_t i0, int64_t n, double *out);

typedef struct { const float *logits; double scale, shift; } Softmax;
typedef struct { const double *p, *q; } Residual;

static void softmax_weights(const void *src, int64_t i0, int64_t n, double *out) {
    const Softmax *s = src;
    vd scale = vd_set1(s->scale), shift = vd_set1(s->shift);
    for (int64_t i = 0; i < n; i += 8) {
        vdmask m = first_lanes8((size_t)(n - i));
        vd z = vd_mul(vd_from_floats(m, s->logits + i0 + i), scale);
        vd_storem(out + i, m, exp_pd(vd_sub(z, shift)));
    }
}

static void residual_weights(const void *src, int64_t i0, int64_t n, double *out) {
    const Residual *r = src;
    if (r->q == NULL) {   /* the weights themselves */
        memcpy(out, r->p + i0, (size_t)n * sizeof *out);
        return;
    }
    for (int64_t i = 0; i < n; i += 8) {
        vdmask m = first_lanes8((size_t)(n - i));
        vd d = vd_sub(vd_loadm(m, r->p + i0 + i), vd_loadm(m, r->q + i0 + i));
        vd_storem(out + i, m, vd_max(d, vd_zero()));
    }
}

/* The token for uniform u under the weights; -1 if they have no mass (or no memory). */
static int64_t inverse_cdf(Weights weights, const void *src, int64_t V, double u) {
    int64_t blocks = (V + SAMPLE_BLOCK - 1) / SAMPLE_BLOCK;
    double *cumulative = malloc((size_t)blocks * sizeof *cumulative), w[SAMPLE_BLOCK];
    if (cumulative == NULL || V <= 0) { free(cumulative); return -1; }
    double running = 0.0;
    for (int64_t b = 0; b < blocks; b++) {
        int64_t n = V - b * SAMPLE_BLOCK < SAMPLE_BLOCK ? V - b * SAMPLE_BLOCK : SAMPLE_BLOCK;
        weights(src, b * SAMPLE_BLOCK, n, w);
        double sum = 0.0;
        for (int64_t i = 0; i < n; i++) sum += w[i];
        cumulative[b] = running += sum;
    }
    int64_t token = -1;
    if (running > 0.0) {
        double target = u * running;
        int64_t b = 0;
        while (b < blocks && !(cumulative[b] > target)) b++;
        if (b == blocks)   /* u * total rounded up to the total: the last block with weight */
            for (b = blocks - 1; b > 0 && !(cumulative[b] > cumulative[b - 1]); b--) {}
        int64_t n = V - b * SAMPLE_BLOCK < SAMPLE_BLOCK ? V - b * SAMPLE_BLOCK : SAMPLE_BLOCK;
        weights(src, b * SAMPLE_BLOCK, n, w);
        double below = b ? cumulative[b - 1] : 0.0;
        for (int64_t i = 0; i < n && token < 0; i++)
            if ((below += w[i]) > target) token = b * SAMPLE_BLOCK + i;
        for (int64_t i = n - 1; i >= 0 && token < 0; i--)   /* rounding: the block's last token with weight */
            if (w[i] > 0.0) token = b * SAMPLE_BLOCK + i;
    }
    free(cumulative);
    return token;
}

/* The token drawn with uniform u from softmax(logits / temperature) (sampling.sample of
 * sampling.probabilities with no top-k or top-p cut). */
__attribute__((visibility("default"))) int64_t specinfer_sample_softmax(const float *logits, int64_t V, double temperature,
                                                                        double u) {
    Softmax s = {logits, 1.0 / temperature, 0.0};
    vd top = vd_set1(-INFINITY), scale = vd_set1(s.scale);
    for (int64_t i = 0; i < V; i += 8) {
        vdmask m = first_lanes8((size_t)(V - i));
        top = vd_mask_max(top, m, top, vd_mul(vd_from_floats(m, logits + i), scale));
    }
    s.shift = vd_reduce_max(top);
    return inverse_cdf(softmax_weights, &s, V, u);
}

/* The token drawn with uniform u from normalize(max(0, p - q)) (verify.residual, then sample), or
 * with q NULL from normalize(p) (sampling.inverse_cdf); -1 where that has no mass (p == q up to
 * rounding: the caller draws from p, as residual() returns it). */
__attribute__((visibility("default"))) int64_t specinfer_sample_residual(const double *p, const double *q, int64_t V,
                                                                         double u) {
    Residual r = {p, q};
    return inverse_cdf(residual_weights, &r, V, u);
}

/* SampleSoftmax: each row of logits [..., V] (float) drawn from at its own temperature and uniform
 * (double, one each a row, in any shape of as many), the token specinfer_sample_softmax gives it
 * (sampling.draw, exactly), out int64 [...]: sampled incremental decoding's chain of tokens in one
 * run of the LLM's drafter graph (ort_lowering.sampled_decoding), no Python between its steps. A
 * row without mass (logits not finite) gets -1, which the runtime refuses. */
static OrtStatus *fail(const char *message) { return op_error("SampleSoftmax", message); }

static size_t count_of(const OrtValue *value) {
    int64_t dims[8];
    size_t rank = shape_of(value, dims, 8), n = 1;
    for (size_t i = 0; i < rank; i++) n *= (size_t)dims[i];
    return n;
}

static OrtStatus *compute_sample(void *kernel, OrtKernelContext *ctx) {
    (void)kernel;
    const OrtValue *in[3] = {NULL};
    for (size_t i = 0; i < 3; i++) CALL(KernelContext_GetInput, GetInputFn)(ctx, i, &in[i]);
    int64_t dims[8];
    size_t rank = shape_of(in[0], dims, 8);
    if (rank < 1 || rank == 8 || dims[rank - 1] < 1) return fail("logits must be [..., V], V >= 1");
    size_t V = (size_t)dims[rank - 1], rows = count_of(in[0]) / V;
    if (count_of(in[1]) != rows || count_of(in[2]) != rows)
        return fail("temperature and uniform must have one value for each row of logits");
    const float *logits = data_of(in[0]);
    const double *temperature = data_of(in[1]), *uniform = data_of(in[2]);
    for (size_t r = 0; r < rows; r++)
        if (!(temperature[r] > 0.0) || !(uniform[r] >= 0.0 && uniform[r] < 1.0))
            return fail("each temperature must be > 0 and each uniform in [0, 1)");
    OrtValue *out = NULL;
    CALL(KernelContext_GetOutput, GetOutputFn)(ctx, 0, dims, rank - 1, &out);
    int64_t *tokens = data_of(out);
    for (size_t r = 0; r < rows; r++)
        tokens[r] = specinfer_sample_softmax(logits + r * V, (int64_t)V, temperature[r], uniform[r]);
    return NULL;
}

static void compute_sample_v1(void *kernel, OrtKernelContext *ctx) { (void)kernel; (void)ctx; }   /* never called: V2 is set */
static const char *sample_name(const OrtCustomOp *op) { (void)op; return "SampleSoftmax"; }
static int sample_input_type(const OrtCustomOp *op, size_t i) { (void)op; return i == 0 ? TYPE_FLOAT : TYPE_DOUBLE; }
static size_t sample_inputs(const OrtCustomOp *op) { (void)op; return 3; }
static int sample_output_type(const OrtCustomOp *op, size_t i) { (void)op; (void)i; return TYPE_INT64; }
static size_t sample_outputs(const OrtCustomOp *op) { (void)op; return 1; }

OrtCustomOp sample_softmax_op = {
    API_VERSION, stateless_kernel, sample_name, op_cpu, sample_input_type, sample_inputs, sample_output_type,
    sample_outputs, compute_sample_v1, op_destroy, op_required, op_required, op_default_memory, op_arity,
    op_homogeneous, op_arity, op_homogeneous, stateless_kernel_v2, compute_sample, NULL, op_start_version,
    op_end_version, NULL, NULL, NULL, NULL,
};
