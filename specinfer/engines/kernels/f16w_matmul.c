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
 * The ONNX Runtime C API is reached through the OrtApi function table of the running library;
 * the few slots used are declared below by their index in the public onnxruntime_c_api.h (the
 * table only ever grows at its end), and RegisterCustomOps checks one of them before use.
 */
#include <immintrin.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

typedef struct OrtStatus OrtStatus;
typedef struct OrtValue OrtValue;
typedef struct OrtKernelContext OrtKernelContext;
typedef struct OrtKernelInfo OrtKernelInfo;
typedef struct OrtSessionOptions OrtSessionOptions;
typedef struct OrtCustomOpDomain OrtCustomOpDomain;
typedef struct OrtTensorTypeAndShapeInfo OrtShape;
typedef void *OrtApiSlot;

typedef struct OrtApiBase {
    const OrtApiSlot *(*GetApi)(uint32_t version);
    const char *(*GetVersionString)(void);
} OrtApiBase;

/* Slots of OrtApi used here, by index in onnxruntime_c_api.h. */
enum {
    SLOT_CreateStatus = 0,
    SLOT_CreateCustomOpDomain = 26,
    SLOT_CustomOpDomain_Add = 27,
    SLOT_AddCustomOpDomain = 28,
    SLOT_GetTensorMutableData = 51,
    SLOT_GetDimensionsCount = 61,
    SLOT_GetDimensions = 62,
    SLOT_GetTensorTypeAndShape = 65,
    SLOT_KernelContext_GetInput = 90,
    SLOT_KernelContext_GetOutput = 91,
    SLOT_ReleaseTensorTypeAndShapeInfo = 99,
    SLOT_GetBuildInfoString = 254,
    SLOT_KernelContext_ParallelFor = 274,
};
#define API_VERSION 17 /* ONNX Runtime 1.17: the first with KernelContext_ParallelFor */

static const OrtApiSlot *api;
#define CALL(slot, type) ((type)api[SLOT_##slot])

/* OrtCustomOp as onnxruntime_c_api.h lays it out: a version, then 25 callbacks; ONNX Runtime reads
 * those its version has, a NULL optional one meaning its default. */
typedef struct OrtCustomOp {
    uint32_t version;
    void *(*CreateKernel)(const struct OrtCustomOp *, const OrtApiSlot *, const OrtKernelInfo *);
    const char *(*GetName)(const struct OrtCustomOp *);
    const char *(*GetExecutionProviderType)(const struct OrtCustomOp *);
    int (*GetInputType)(const struct OrtCustomOp *, size_t);
    size_t (*GetInputTypeCount)(const struct OrtCustomOp *);
    int (*GetOutputType)(const struct OrtCustomOp *, size_t);
    size_t (*GetOutputTypeCount)(const struct OrtCustomOp *);
    void (*KernelCompute)(void *, OrtKernelContext *);
    void (*KernelDestroy)(void *);
    int (*GetInputCharacteristic)(const struct OrtCustomOp *, size_t);
    int (*GetOutputCharacteristic)(const struct OrtCustomOp *, size_t);
    int (*GetInputMemoryType)(const struct OrtCustomOp *, size_t);
    int (*GetVariadicInputMinArity)(const struct OrtCustomOp *);
    int (*GetVariadicInputHomogeneity)(const struct OrtCustomOp *);
    int (*GetVariadicOutputMinArity)(const struct OrtCustomOp *);
    int (*GetVariadicOutputHomogeneity)(const struct OrtCustomOp *);
    void *CreateKernelV2, *KernelComputeV2, *InferOutputShapeFn;
    int (*GetStartVersion)(const struct OrtCustomOp *);
    int (*GetEndVersion)(const struct OrtCustomOp *);
    void *GetMayInplace, *ReleaseMayInplace, *GetAliasMap, *ReleaseAliasMap;
} OrtCustomOp;

enum { TYPE_FLOAT = 1, TYPE_FLOAT16 = 10 };
#define PANEL 64

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
} Job;

static void run_panel(void *data, size_t panel) {
    const Job *job = (const Job *)data;
    const uint16_t *P = job->W + panel * job->K * PANEL;
    for (size_t m = 0; m < job->M; m += ROWS) {
        const float *A = job->A + m * job->K;
        float *C = job->C + m * job->N + panel * PANEL;
        switch (job->M - m >= ROWS ? ROWS : (int)(job->M - m)) {   /* constant row counts unroll */
            case 6: panel_rows(A, job->K, P, C, job->N, 6); break;
            case 5: panel_rows(A, job->K, P, C, job->N, 5); break;
            case 4: panel_rows(A, job->K, P, C, job->N, 4); break;
            case 3: panel_rows(A, job->K, P, C, job->N, 3); break;
            case 2: panel_rows(A, job->K, P, C, job->N, 2); break;
            default: panel_rows(A, job->K, P, C, job->N, 1); break;
        }
    }
}

static size_t shape_of(const OrtValue *value, int64_t *dims, size_t most) {
    OrtShape *info = NULL;
    size_t rank = 0;
    CALL(GetTensorTypeAndShape, OrtStatus *(*)(const OrtValue *, OrtShape **))(value, &info);
    CALL(GetDimensionsCount, OrtStatus *(*)(const OrtShape *, size_t *))(info, &rank);
    if (rank > most) rank = most;
    CALL(GetDimensions, OrtStatus *(*)(const OrtShape *, int64_t *, size_t))(info, dims, rank);
    CALL(ReleaseTensorTypeAndShapeInfo, void (*)(OrtShape *))(info);
    return rank;
}

static void compute(void *kernel, OrtKernelContext *ctx) {
    (void)kernel;
    typedef OrtStatus *(*GetInputFn)(const OrtKernelContext *, size_t, const OrtValue **);
    const OrtValue *a = NULL, *w = NULL;
    CALL(KernelContext_GetInput, GetInputFn)(ctx, 0, &a);
    CALL(KernelContext_GetInput, GetInputFn)(ctx, 1, &w);
    int64_t dims[8], wdims[3];
    size_t rank = shape_of(a, dims, 8);
    shape_of(w, wdims, 3);   /* [N / 64, K, 64], checked when the graph was written */
    size_t M = 1;
    for (size_t i = 0; i + 1 < rank; i++) M *= (size_t)dims[i];
    Job job = {NULL, NULL, NULL, M, (size_t)wdims[1], (size_t)(wdims[0] * PANEL)};
    dims[rank - 1] = (int64_t)job.N;
    OrtValue *c = NULL;
    CALL(KernelContext_GetOutput, OrtStatus *(*)(OrtKernelContext *, size_t, const int64_t *, size_t, OrtValue **))(
        ctx, 0, dims, rank, &c);
    typedef OrtStatus *(*DataFn)(const OrtValue *, void **);
    CALL(GetTensorMutableData, DataFn)(a, (void **)&job.A);
    CALL(GetTensorMutableData, DataFn)(w, (void **)&job.W);
    CALL(GetTensorMutableData, DataFn)(c, (void **)&job.C);
    if (M == 0) return;
    CALL(KernelContext_ParallelFor, OrtStatus *(*)(const OrtKernelContext *, void (*)(void *, size_t), size_t, size_t, void *))(
        ctx, run_panel, (size_t)wdims[0], 0, &job);
}

static void *create_kernel(const OrtCustomOp *op, const OrtApiSlot *a, const OrtKernelInfo *info) {
    (void)op; (void)a; (void)info;
    return (void *)1;   /* stateless */
}
static void destroy_kernel(void *kernel) { (void)kernel; }
static const char *op_name(const OrtCustomOp *op) { (void)op; return "MatMulF16W"; }
static const char *op_provider(const OrtCustomOp *op) { (void)op; return "CPUExecutionProvider"; }
static int input_type(const OrtCustomOp *op, size_t i) { (void)op; return i == 0 ? TYPE_FLOAT : TYPE_FLOAT16; }
static size_t two(const OrtCustomOp *op) { (void)op; return 2; }
static int output_type(const OrtCustomOp *op, size_t i) { (void)op; (void)i; return TYPE_FLOAT; }
static size_t one(const OrtCustomOp *op) { (void)op; return 1; }
static int required(const OrtCustomOp *op, size_t i) { (void)op; (void)i; return 0; }
static int default_memory(const OrtCustomOp *op, size_t i) { (void)op; (void)i; return 0; }
static int arity(const OrtCustomOp *op) { (void)op; return 1; }
static int homogeneous(const OrtCustomOp *op) { (void)op; return 1; }
static int start_version(const OrtCustomOp *op) { (void)op; return 1; }
static int end_version(const OrtCustomOp *op) { (void)op; return 2147483647; }

static OrtCustomOp matmul_op = {
    API_VERSION, create_kernel, op_name, op_provider, input_type, two, output_type, one, compute,
    destroy_kernel, required, required, default_memory, arity, homogeneous, arity, homogeneous,
    NULL, NULL, NULL, start_version, end_version, NULL, NULL, NULL, NULL,
};
static OrtCustomOpDomain *domain;

/* Called by ONNX Runtime's SessionOptions.register_custom_ops_library. */
__attribute__((visibility("default"))) OrtStatus *RegisterCustomOps(OrtSessionOptions *options, const OrtApiBase *base) {
    const OrtApiSlot *table = base->GetApi(API_VERSION);
    if (table == NULL) return NULL;   /* too old: ONNX Runtime then has no op and the session fails */
    typedef OrtStatus *(*CreateStatusFn)(int, const char *);
    const char *build = ((const char *(*)(void))table[SLOT_GetBuildInfoString])();
    if (build == NULL || strncmp(build, "ORT Build Info", 14) != 0)
        return ((CreateStatusFn)table[SLOT_CreateStatus])(1, "specinfer MatMulF16W: unexpected ONNX Runtime API table");
    api = table;
    OrtStatus *status = NULL;
    if (domain == NULL) {
        status = CALL(CreateCustomOpDomain, OrtStatus *(*)(const char *, OrtCustomOpDomain **))("specinfer.native", &domain);
        if (status) return status;
        status = CALL(CustomOpDomain_Add, OrtStatus *(*)(OrtCustomOpDomain *, const OrtCustomOp *))(domain, &matmul_op);
        if (status) return status;
    }
    return CALL(AddCustomOpDomain, OrtStatus *(*)(OrtSessionOptions *, OrtCustomOpDomain *))(options, domain);
}
