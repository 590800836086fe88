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
} Product;

/* Rows [0, rows) of A (rows <= ROWS) times one panel, with the row count a constant (unrolled). */
static void block_rows(const float *A, size_t K, const uint16_t *P, float *C, size_t N, int rows) {
    switch (rows) {
        case 6: panel_rows(A, K, P, C, N, 6); break;
        case 5: panel_rows(A, K, P, C, N, 5); break;
        case 4: panel_rows(A, K, P, C, N, 4); break;
        case 3: panel_rows(A, K, P, C, N, 3); break;
        case 2: panel_rows(A, K, P, C, N, 2); break;
        default: panel_rows(A, K, P, C, N, 1); break;
    }
}

static int rows_from(const Product *job, size_t m) { return job->M - m >= ROWS ? ROWS : (int)(job->M - m); }

static void run_panel(void *data, size_t panel) {
    const Product *job = (const Product *)data;
    const uint16_t *P = job->W + panel * job->K * PANEL;
    for (size_t m = 0; m < job->M; m += ROWS)
        block_rows(job->A + m * job->K, job->K, P, job->C + m * job->N + panel * PANEL, job->N, rows_from(job, m));
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
 * 2 and epsilon input 3, W input 4, and input 0 + input 1 goes to output 1. */
static OrtStatus *product(OrtKernelContext *ctx, void (*task)(void *, size_t), size_t columns, int normed,
                          const char *name) {
    const OrtValue *a = NULL, *w = NULL;
    CALL(KernelContext_GetInput, GetInputFn)(ctx, 0, &a);
    CALL(KernelContext_GetInput, GetInputFn)(ctx, normed ? 4 : 1, &w);
    int64_t dims[8], wdims[3];
    size_t rank = shape_of(a, dims, 8);
    shape_of(w, wdims, 3);   /* [panels, K, 64], checked when the graph was written */
    size_t M = 1;
    for (size_t i = 0; i + 1 < rank; i++) M *= (size_t)dims[i];
    Product job = {data_of(a), data_of(w), NULL, M, (size_t)wdims[1], (size_t)wdims[0] * columns};
    if (rank == 0 || (size_t)dims[rank - 1] != job.K) return op_error(name, "the input's last axis is not the weight's K");
    float *scratch = NULL;
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
    dims[rank - 1] = (int64_t)job.N;
    OrtValue *c = NULL;
    CALL(KernelContext_GetOutput, GetOutputFn)(ctx, 0, dims, rank, &c);
    job.C = data_of(c);
    if (M > 0) CALL(KernelContext_ParallelFor, ParallelForFn)(ctx, task, (size_t)wdims[0], 0, &job);
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
    const uint16_t *P = job->W + panel * job->K * PANEL;
    float both[ROWS * PANEL] __attribute__((aligned(64)));   /* rows x (32 gate, 32 up) */
    for (size_t m = 0; m < job->M; m += ROWS) {
        int rows = rows_from(job, m);
        block_rows(job->A + m * job->K, job->K, P, both, PANEL, rows);
        for (int r = 0; r < rows; r++)
            for (int j = 0; j < PANEL / 2; j += LANES)
                _mm512_storeu_ps(job->C + (m + r) * job->N + panel * (PANEL / 2) + j,
                                 silu_times(_mm512_load_ps(both + r * PANEL + j),
                                            _mm512_load_ps(both + r * PANEL + PANEL / 2 + j)));
    }
}

/* The four ops: MatMulF16W and MatMulF16WSwiGLU, and each with the RMSNorm before it
 * (SkipRMSNormMatMulF16W, SkipRMSNormMatMulF16WSwiGLU: inputs x, skip, gamma [K], epsilon [1], W;
 * outputs the product of RMSNorm(x + skip) * gamma and x + skip). The norm op they replace,
 * SkipSimplifiedLayerNormalization, was 12 kernels a step of the embedded LLM: without them the
 * step is 1-5% faster (ONNX Runtime costs ~0.35 us a kernel, ~1 us more with a pool hand-off). */
static OrtStatus *compute(void *k, OrtKernelContext *ctx) { (void)k; return product(ctx, run_panel, PANEL, 0, "MatMulF16W"); }
static OrtStatus *compute_swiglu(void *k, OrtKernelContext *ctx) {
    (void)k;
    return product(ctx, run_swiglu_panel, PANEL / 2, 0, "MatMulF16WSwiGLU");
}
static OrtStatus *compute_normed(void *k, OrtKernelContext *ctx) {
    (void)k;
    return product(ctx, run_panel, PANEL, 1, "SkipRMSNormMatMulF16W");
}
static OrtStatus *compute_normed_swiglu(void *k, OrtKernelContext *ctx) {
    (void)k;
    return product(ctx, run_swiglu_panel, PANEL / 2, 1, "SkipRMSNormMatMulF16WSwiGLU");
}
static void compute_v1(void *kernel, OrtKernelContext *ctx) { (void)kernel; (void)ctx; }   /* never called: V2 is set */

static const char *op_name(const OrtCustomOp *op) { (void)op; return "MatMulF16W"; }
static const char *swiglu_name(const OrtCustomOp *op) { (void)op; return "MatMulF16WSwiGLU"; }
static const char *normed_name(const OrtCustomOp *op) { (void)op; return "SkipRMSNormMatMulF16W"; }
static const char *normed_swiglu_name(const OrtCustomOp *op) { (void)op; return "SkipRMSNormMatMulF16WSwiGLU"; }
static int input_type(const OrtCustomOp *op, size_t i) { (void)op; return i == 0 ? TYPE_FLOAT : TYPE_FLOAT16; }
static size_t inputs(const OrtCustomOp *op) { (void)op; return 2; }
static int output_type(const OrtCustomOp *op, size_t i) { (void)op; (void)i; return TYPE_FLOAT; }
static size_t outputs(const OrtCustomOp *op) { (void)op; return 1; }
static int normed_input_type(const OrtCustomOp *op, size_t i) { (void)op; return i == 4 ? TYPE_FLOAT16 : TYPE_FLOAT; }
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
