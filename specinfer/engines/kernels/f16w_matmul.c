/* MatMulF16W: C[..., N] = A[..., K] x W[K, N], A and C float32, W stored as float16 and widened
 * to float32 in registers (exactly: every float16 is a float32), so the product is the float32
 * MatMul of the same numbers while the weights take half the memory traffic.
 *
 * Why: on CPU the LLM's step is bound by reading its weights (ONNX Runtime's MLAS reads them as
 * float32), and a checkpoint saved in float16 holds nothing a float32 copy adds. ONNX Runtime's CPU
 * provider has no float16-weight float32 MatMul on x86, so this is a custom-op library
 * (specinfer/engines/native.py builds it with the system C compiler and loads it).
 *
 * W comes packed in panels of 64 columns, [N / 64][K][64]: a panel's row k is 128 contiguous
 * bytes, read once per block of 6 rows of A. Each output element is summed over k in order, the
 * same whatever M and whatever thread computes it, so a row's result never depends on the other
 * rows of the batch. The panels are shared out over ONNX Runtime's intra-op pool.
 *
 * MatMulBF16 and its three siblings (below) are the same products on bfloat16 weights and
 * activations, for a model asked to compute in bfloat16.
 *
 * register.c registers it (ort_api.h: the ONNX Runtime C API as used here). */
#include <immintrin.h>
#include <stdlib.h>
#include <string.h>

#include "ort_api.h"
#include "tree_attention.h"   /* exp_ps, first_lanes */

#define PANEL 64
#define LANES 16

/* Rows [0, rows) of A (rows <= ROWS) times one panel: 4 x 16 floats of accumulators per row, so
 * 6 rows hold 24 of the 32 vector registers and each widened weight serves 6 FMAs. */
#define ROWS 6
static inline void panel_rows(const float *A, size_t K, const uint16_t *P, float *C, size_t N, int rows) {
    __m512 acc[ROWS][4];
    for (int r = 0; r < ROWS; r++)
        for (int j = 0; j < 4; j++) acc[r][j] = _mm512_setzero_ps();
    for (size_t k = 0; k < K; k++) {
        const uint16_t *p = P + k * PANEL;
        __m512 b0 = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)p));
        __m512 b1 = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(p + 16)));
        __m512 b2 = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(p + 32)));
        __m512 b3 = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(p + 48)));
        for (int r = 0; r < rows; r++) {
            __m512 a = _mm512_set1_ps(A[r * K + k]);
            acc[r][0] = _mm512_fmadd_ps(a, b0, acc[r][0]);
            acc[r][1] = _mm512_fmadd_ps(a, b1, acc[r][1]);
            acc[r][2] = _mm512_fmadd_ps(a, b2, acc[r][2]);
            acc[r][3] = _mm512_fmadd_ps(a, b3, acc[r][3]);
        }
    }
    for (int r = 0; r < rows; r++)
        for (int j = 0; j < 4; j++) _mm512_storeu_ps(C + r * N + 16 * j, acc[r][j]);
}

typedef struct {
    const float *A;
    const uint16_t *W;
    float *C;
    size_t M, K, N;
    const uint32_t *pairs;   /* bf16 products: A rounded to bfloat16, two k a word ([M][K2]), else NULL */
    size_t K2;               /* (K + 1) / 2 */
} Product;

/* Rows [0, rows) of A (rows <= ROWS) times one panel, with the row count a constant (unrolled). */
#define BY_ROWS(kernel, A, K, P, C, N, rows)          \
    switch (rows) {                                    \
        case 6: kernel(A, K, P, C, N, 6); break;       \
        case 5: kernel(A, K, P, C, N, 5); break;       \
        case 4: kernel(A, K, P, C, N, 4); break;       \
        case 3: kernel(A, K, P, C, N, 3); break;       \
        case 2: kernel(A, K, P, C, N, 2); break;       \
        default: kernel(A, K, P, C, N, 1); break;      \
    }
static void block_rows(const float *A, size_t K, const uint16_t *P, float *C, size_t N, int rows) {
    BY_ROWS(panel_rows, A, K, P, C, N, rows)
}

/* The bfloat16 products (MatMulBF16 and the three ops beside it): A rounded to bfloat16 (to
 * nearest even) and W stored in bfloat16, multiplied and summed in float32 by AVX512-BF16's
 * VDPBF16PS, which takes two k at once: twice the arithmetic rate of float32 FMAs (measured on
 * 2 Zen 4 cores, K 384 x N 2048, one thread: 211-227 GFLOP/s from 4 rows against 106-113 for the
 * float16 weights widened; 89 against 54 for one row). The rounding of the activations is the
 * precision a bfloat16 model has on a GPU; each output is still summed over k in order, the same
 * whatever M, so a row's result never depends on the batch. W comes packed in panels of 64 columns
 * by pairs of k, [N / 64][K2][64][2] (K2 = ceil(K / 2), an odd K's last pair padded with zero).
 * Compiled for AVX512-BF16 whatever the build machine: specinfer/engines/native.py chooses these
 * ops only on a CPU that has it. */
#define BF16 __attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16")))

BF16 static inline void bf16_panel_rows(const uint32_t *A, size_t K2, const uint16_t *P, float *C, size_t N,
                                        int rows) {
    __m512 acc[ROWS][4];
    for (int r = 0; r < ROWS; r++)
        for (int j = 0; j < 4; j++) acc[r][j] = _mm512_setzero_ps();
    for (size_t k = 0; k < K2; k++) {
        const uint16_t *p = P + k * 2 * PANEL;
        __m512bh b0 = (__m512bh)_mm512_loadu_si512(p);
        __m512bh b1 = (__m512bh)_mm512_loadu_si512(p + 32);
        __m512bh b2 = (__m512bh)_mm512_loadu_si512(p + 64);
        __m512bh b3 = (__m512bh)_mm512_loadu_si512(p + 96);
        for (int r = 0; r < rows; r++) {
            __m512bh a = (__m512bh)_mm512_set1_epi32((int)A[r * K2 + k]);
            acc[r][0] = _mm512_dpbf16_ps(acc[r][0], a, b0);
            acc[r][1] = _mm512_dpbf16_ps(acc[r][1], a, b1);
            acc[r][2] = _mm512_dpbf16_ps(acc[r][2], a, b2);
            acc[r][3] = _mm512_dpbf16_ps(acc[r][3], a, b3);
        }
    }
    for (int r = 0; r < rows; r++)
        for (int j = 0; j < 4; j++) _mm512_storeu_ps(C + r * N + 16 * j, acc[r][j]);
}

BF16 static void bf16_block_rows(const uint32_t *A, size_t K2, const uint16_t *P, float *C, size_t N, int rows) {
    BY_ROWS(bf16_panel_rows, A, K2, P, C, N, rows)
}

/* Rows of float32 as bfloat16 pairs (round to nearest even, as VCVTNEPS2BF16 rounds), an odd K's
 * last pair padded with zero. */
BF16 static void to_bf16_pairs(const float *A, size_t M, size_t K, uint32_t *out) {
    size_t K2 = (K + 1) / 2;
    for (size_t r = 0; r < M; r++) {
        const float *a = A + r * K;
        uint16_t *o = (uint16_t *)(out + r * K2);
        for (size_t k = 0; k < K; k += LANES) {
            __mmask16 m = first_lanes(K - k);
            __m256bh h = _mm512_cvtneps_pbh(_mm512_maskz_loadu_ps(m, a + k));
            _mm256_mask_storeu_epi16(o + k, m, (__m256i)h);
        }
        if (K & 1) o[K] = 0;
    }
}

/* Rows [m, m + rows) of the job's A times panel ``panel``, into C (``ldc`` floats a row). */
static void panel_block(const Product *job, size_t panel, size_t m, float *C, size_t ldc, int rows) {
    if (job->pairs)
        bf16_block_rows(job->pairs + m * job->K2, job->K2, job->W + panel * job->K2 * 2 * PANEL, C, ldc, rows);
    else
        block_rows(job->A + m * job->K, job->K, job->W + panel * job->K * PANEL, C, ldc, rows);
}

static int rows_from(const Product *job, size_t m) { return job->M - m >= ROWS ? ROWS : (int)(job->M - m); }

static void run_panel(void *data, size_t panel) {
    const Product *job = (const Product *)data;
    for (size_t m = 0; m < job->M; m += ROWS)
        panel_block(job, panel, m, job->C + m * job->N + panel * PANEL, job->N, rows_from(job, m));
}

/* out = (x / sqrt(mean(x^2) + eps)) * gamma for each row x of the sum input + skip, which goes to
 * sum: SkipSimplifiedLayerNormalization's two outputs, in ONNX Runtime's arithmetic (float, the
 * square sum then a division by the root) with the square sum in 16 lanes. A row's result depends
 * on that row alone. */
typedef struct {
    const float *input, *skip, *gamma;
    float *sum, *out;
    size_t K;
    float eps;
} Norm;

static void norm_row(void *data, size_t r) {
    const Norm *n = (const Norm *)data;
    size_t K = n->K;
    const float *a = n->input + r * K, *s = n->skip + r * K;
    float *x = n->sum + r * K, *y = n->out + r * K;
    __m512 squares = _mm512_setzero_ps();
    for (size_t k = 0; k < K; k += LANES) {
        __mmask16 m = first_lanes(K - k);
        __m512 v = _mm512_add_ps(_mm512_maskz_loadu_ps(m, a + k), _mm512_maskz_loadu_ps(m, s + k));
        _mm512_mask_storeu_ps(x + k, m, v);
        squares = _mm512_fmadd_ps(v, v, squares);
    }
    float mean = _mm512_reduce_add_ps(squares) / (float)K + n->eps;
    __m512 root = _mm512_set1_ps(_mm_cvtss_f32(_mm_sqrt_ss(_mm_set_ss(mean))));
    for (size_t k = 0; k < K; k += LANES) {
        __mmask16 m = first_lanes(K - k);
        __m512 v = _mm512_div_ps(_mm512_maskz_loadu_ps(m, x + k), root);
        _mm512_mask_storeu_ps(y + k, m, _mm512_mul_ps(v, _mm512_maskz_loadu_ps(m, n->gamma + k)));
    }
}

/* Rows below this are normalized on the calling thread: the pool's hand-out costs more. */
#define NORM_POOL_ROWS 32

/* A x W on the pool, a task a panel (``task``), each panel giving ``columns`` of the output. A is
 * input 0, W input 1; or, ``normed``, A is the RMSNorm of input 0 + input 1 (skip) with gamma input
 * 2 and epsilon input 3, W input 4, and input 0 + input 1 goes to output 1. ``bf16``: W is packed
 * in bfloat16 pairs and A is rounded to them first (the norm, if any, in float32 before). */
static OrtStatus *product(OrtKernelContext *ctx, void (*task)(void *, size_t), size_t columns, int normed,
                          int bf16, const char *name) {
    const OrtValue *a = NULL, *w = NULL;
    CALL(KernelContext_GetInput, GetInputFn)(ctx, 0, &a);
    CALL(KernelContext_GetInput, GetInputFn)(ctx, normed ? 4 : 1, &w);
    int64_t dims[8], wdims[3];
    size_t rank = shape_of(a, dims, 8);
    shape_of(w, wdims, 3);   /* [panels, K, 64] or, bf16, [panels, K2, 128]: checked when the graph was written */
    size_t M = 1;
    for (size_t i = 0; i + 1 < rank; i++) M *= (size_t)dims[i];
    size_t K = rank ? (size_t)dims[rank - 1] : 0;
    Product job = {data_of(a), data_of(w), NULL, M, K, (size_t)wdims[0] * columns, NULL, (K + 1) / 2};
    if (rank == 0 || (bf16 ? job.K2 : K) != (size_t)wdims[1])
        return op_error(name, "the input's last axis is not the weight's K");
    float *scratch = NULL;
    uint32_t *pairs = NULL;
    if (normed) {
        const OrtValue *skip = NULL, *gamma = NULL, *eps = NULL;
        CALL(KernelContext_GetInput, GetInputFn)(ctx, 1, &skip);
        CALL(KernelContext_GetInput, GetInputFn)(ctx, 2, &gamma);
        CALL(KernelContext_GetInput, GetInputFn)(ctx, 3, &eps);
        int64_t sdims[8], gdims[2];
        if (shape_of(skip, sdims, 8) != rank || memcmp(sdims, dims, rank * sizeof dims[0]) ||
            shape_of(gamma, gdims, 2) != 1 || (size_t)gdims[0] != job.K)
            return op_error(name, "skip must have the input's shape and gamma [K]");
        OrtValue *sum = NULL;
        CALL(KernelContext_GetOutput, GetOutputFn)(ctx, 1, dims, rank, &sum);
        scratch = malloc(M * job.K * sizeof(float));
        if (scratch == NULL) return op_error(name, "out of memory for the normalized rows");
        Norm norm = {data_of(a), data_of(skip), data_of(gamma), data_of(sum), scratch, job.K,
                     *(const float *)data_of(eps)};
        if (M >= NORM_POOL_ROWS)
            CALL(KernelContext_ParallelFor, ParallelForFn)(ctx, norm_row, M, 0, &norm);
        else
            for (size_t r = 0; r < M; r++) norm_row(&norm, r);
        job.A = scratch;
    }
    if (bf16) {
        pairs = malloc(M * job.K2 * sizeof(uint32_t));
        if (pairs == NULL) {
            free(scratch);
            return op_error(name, "out of memory for the rows in bfloat16");
        }
        to_bf16_pairs(job.A, M, job.K, pairs);
        job.pairs = pairs;
    }
    dims[rank - 1] = (int64_t)job.N;
    OrtValue *c = NULL;
    CALL(KernelContext_GetOutput, GetOutputFn)(ctx, 0, dims, rank, &c);
    job.C = data_of(c);
    if (M > 0) CALL(KernelContext_ParallelFor, ParallelForFn)(ctx, task, (size_t)wdims[0], 0, &job);
    free(pairs);
    free(scratch);
    return NULL;
}

/* MatMulF16WSwiGLU: the MLP's gate and up projections and its activation in one op,
 * C[..., I] = silu(A x Wg) * (A x Wu), for the lowering's Split of A x [Wg | Wu], Sigmoid, Mul and
 * Mul (3 kernels a layer fewer, and the [.., 2 I] product never written). W comes packed as for
 * MatMulF16W, its panel t holding Wg's columns 32 t .. 32 t + 31 then Wu's same columns
 * ([2 I / 64][K][64]): a panel's product gives 32 outputs, and the panels are shared out over the
 * pool as MatMulF16W's are (panels of two whole 64-column halves made half as many tasks, and the
 * one-token step 6% slower). Each product is MatMulF16W's, sum for sum; silu(g) = g sigmoid(g),
 * sigmoid(g) = 1 / (1 + e^-g) computed as e / (1 + e) with e = e^g where g < 0 (exp_ps takes
 * x <= 0 only): ~2 ulp. */
static inline __m512 silu_times(__m512 g, __m512 u) {
    __m512 e = exp_ps(_mm512_sub_ps(_mm512_setzero_ps(), _mm512_abs_ps(g)));   /* e^-|g| */
    __m512 one = _mm512_set1_ps(1.0f);
    __mmask16 negative = _mm512_cmp_ps_mask(g, _mm512_setzero_ps(), _CMP_LT_OQ);
    __m512 sigmoid = _mm512_div_ps(_mm512_mask_blend_ps(negative, one, e), _mm512_add_ps(one, e));
    return _mm512_mul_ps(_mm512_mul_ps(g, sigmoid), u);
}

static void run_swiglu_panel(void *data, size_t panel) {
    const Product *job = (const Product *)data;
    float both[ROWS * PANEL] __attribute__((aligned(64)));   /* rows x (32 gate, 32 up) */
    for (size_t m = 0; m < job->M; m += ROWS) {
        int rows = rows_from(job, m);
        panel_block(job, panel, m, both, PANEL, rows);
        for (int r = 0; r < rows; r++)
            for (int j = 0; j < PANEL / 2; j += LANES)
                _mm512_storeu_ps(job->C + (m + r) * job->N + panel * (PANEL / 2) + j,
                                 silu_times(_mm512_load_ps(both + r * PANEL + j),
                                            _mm512_load_ps(both + r * PANEL + PANEL / 2 + j)));
    }
}

/* The eight ops: MatMulF16W and MatMulF16WSwiGLU, each with the RMSNorm before it
 * (SkipRMSNormMatMulF16W, SkipRMSNormMatMulF16WSwiGLU: inputs x, skip, gamma [K], epsilon [1], W;
 * outputs the product of RMSNorm(x + skip) * gamma and x + skip), and the same four on bfloat16
 * (MatMulBF16, ...). The norm op they replace, SkipSimplifiedLayerNormalization, was 12 kernels a
 * step of the embedded LLM: without them the step is 1-5% faster (ONNX Runtime costs ~0.35 us a
 * kernel, ~1 us more with a pool hand-off). */
#define COMPUTE(fn, task, columns, normed, bf16, name) \
    static OrtStatus *fn(void *k, OrtKernelContext *ctx) { (void)k; return product(ctx, task, columns, normed, bf16, name); }
COMPUTE(compute, run_panel, PANEL, 0, 0, "MatMulF16W")
COMPUTE(compute_swiglu, run_swiglu_panel, PANEL / 2, 0, 0, "MatMulF16WSwiGLU")
COMPUTE(compute_normed, run_panel, PANEL, 1, 0, "SkipRMSNormMatMulF16W")
COMPUTE(compute_normed_swiglu, run_swiglu_panel, PANEL / 2, 1, 0, "SkipRMSNormMatMulF16WSwiGLU")
COMPUTE(compute_bf16, run_panel, PANEL, 0, 1, "MatMulBF16")
COMPUTE(compute_bf16_swiglu, run_swiglu_panel, PANEL / 2, 0, 1, "MatMulBF16SwiGLU")
COMPUTE(compute_bf16_normed, run_panel, PANEL, 1, 1, "SkipRMSNormMatMulBF16")
COMPUTE(compute_bf16_normed_swiglu, run_swiglu_panel, PANEL / 2, 1, 1, "SkipRMSNormMatMulBF16SwiGLU")
static void compute_v1(void *kernel, OrtKernelContext *ctx) { (void)kernel; (void)ctx; }   /* never called: V2 is set */

#define NAME(fn, name) static const char *fn(const OrtCustomOp *op) { (void)op; return name; }
NAME(op_name, "MatMulF16W")
NAME(swiglu_name, "MatMulF16WSwiGLU")
NAME(normed_name, "SkipRMSNormMatMulF16W")
NAME(normed_swiglu_name, "SkipRMSNormMatMulF16WSwiGLU")
NAME(bf16_name, "MatMulBF16")
NAME(bf16_swiglu_name, "MatMulBF16SwiGLU")
NAME(bf16_normed_name, "SkipRMSNormMatMulBF16")
NAME(bf16_normed_swiglu_name, "SkipRMSNormMatMulBF16SwiGLU")
static int input_type(const OrtCustomOp *op, size_t i) { (void)op; return i == 0 ? TYPE_FLOAT : TYPE_FLOAT16; }
static int bf16_input_type(const OrtCustomOp *op, size_t i) { (void)op; return i == 0 ? TYPE_FLOAT : TYPE_BFLOAT16; }
static size_t inputs(const OrtCustomOp *op) { (void)op; return 2; }
static int output_type(const OrtCustomOp *op, size_t i) { (void)op; (void)i; return TYPE_FLOAT; }
static size_t outputs(const OrtCustomOp *op) { (void)op; return 1; }
static int normed_input_type(const OrtCustomOp *op, size_t i) { (void)op; return i == 4 ? TYPE_FLOAT16 : TYPE_FLOAT; }
static int bf16_normed_input_type(const OrtCustomOp *op, size_t i) { (void)op; return i == 4 ? TYPE_BFLOAT16 : TYPE_FLOAT; }
static size_t normed_inputs(const OrtCustomOp *op) { (void)op; return 5; }
static size_t normed_outputs(const OrtCustomOp *op) { (void)op; return 2; }

#define F16W_OP(name_fn, in_type, n_in, n_out, compute_fn)                                                         \
    {API_VERSION, stateless_kernel, name_fn, op_cpu, in_type, n_in, output_type, n_out, compute_v1, op_destroy,  \
     op_required, op_required, op_default_memory, op_arity, op_homogeneous, op_arity, op_homogeneous,            \
     stateless_kernel_v2, compute_fn, NULL, op_start_version, op_end_version, NULL, NULL, NULL, NULL}
OrtCustomOp matmul_f16w_op = F16W_OP(op_name, input_type, inputs, outputs, compute);
OrtCustomOp matmul_f16w_swiglu_op = F16W_OP(swiglu_name, input_type, inputs, outputs, compute_swiglu);
OrtCustomOp normed_matmul_f16w_op = F16W_OP(normed_name, normed_input_type, normed_inputs, normed_outputs, compute_normed);
OrtCustomOp normed_matmul_f16w_swiglu_op =
    F16W_OP(normed_swiglu_name, normed_input_type, normed_inputs, normed_outputs, compute_normed_swiglu);
OrtCustomOp matmul_bf16_op = F16W_OP(bf16_name, bf16_input_type, inputs, outputs, compute_bf16);
OrtCustomOp matmul_bf16_swiglu_op = F16W_OP(bf16_swiglu_name, bf16_input_type, inputs, outputs, compute_bf16_swiglu);
OrtCustomOp normed_matmul_bf16_op =
    F16W_OP(bf16_normed_name, bf16_normed_input_type, normed_inputs, normed_outputs, compute_bf16_normed);
OrtCustomOp normed_matmul_bf16_swiglu_op =
    F16W_OP(bf16_normed_swiglu_name, bf16_normed_input_type, normed_inputs, normed_outputs, compute_bf16_normed_swiglu);
