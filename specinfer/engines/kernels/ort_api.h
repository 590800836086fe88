/* The few pieces of ONNX Runtime's C API that specinfer's kernels use, declared by hand: the
 * OrtApi function table of the running library is reached through its slots' indices in the
 * public onnxruntime_c_api.h (the table only ever grows at its end), and register.c checks one of
 * them before use. */
#ifndef SPECINFER_ORT_API_H
#define SPECINFER_ORT_API_H
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>

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
    SLOT_KernelContext_GetInputCount = 88,
    SLOT_KernelContext_GetOutputCount = 89,
    SLOT_KernelContext_GetInput = 90,
    SLOT_KernelContext_GetOutput = 91,
    SLOT_ReleaseTensorTypeAndShapeInfo = 99,
    SLOT_GetBuildInfoString = 254,
    SLOT_KernelContext_ParallelFor = 274,
};
#define API_VERSION 17 /* ONNX Runtime 1.17: the first with KernelContext_ParallelFor */
enum { ORT_FAIL = 1, ORT_INVALID_ARGUMENT = 2 };

extern const OrtApiSlot *api;   /* set by RegisterCustomOps */
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
    OrtStatus *(*CreateKernelV2)(const struct OrtCustomOp *, const OrtApiSlot *, const OrtKernelInfo *, void **);
    OrtStatus *(*KernelComputeV2)(void *, OrtKernelContext *);
    void *InferOutputShapeFn;
    int (*GetStartVersion)(const struct OrtCustomOp *);
    int (*GetEndVersion)(const struct OrtCustomOp *);
    void *GetMayInplace, *ReleaseMayInplace, *GetAliasMap, *ReleaseAliasMap;
} OrtCustomOp;

enum { TYPE_UNDEFINED = 0, TYPE_FLOAT = 1, TYPE_INT8 = 3, TYPE_INT32 = 6, TYPE_INT64 = 7, TYPE_FLOAT16 = 10, TYPE_DOUBLE = 11,
       TYPE_BFLOAT16 = 16 };
enum { INPUT_REQUIRED = 0, INPUT_OPTIONAL = 1, INPUT_VARIADIC = 2 };

typedef OrtStatus *(*GetInputFn)(const OrtKernelContext *, size_t, const OrtValue **);
typedef OrtStatus *(*GetOutputFn)(OrtKernelContext *, size_t, const int64_t *, size_t, OrtValue **);
typedef OrtStatus *(*DataFn)(const OrtValue *, void **);
typedef OrtStatus *(*ParallelForFn)(const OrtKernelContext *, void (*)(void *, size_t), size_t, size_t, void *);
typedef OrtStatus *(*CreateStatusFn)(int, const char *);

/* A tensor's shape into dims (at most `most` of them); returns its rank. */
static inline size_t shape_of(const OrtValue *value, int64_t *dims, size_t most) {
    OrtShape *info = NULL;
    size_t rank = 0;
    CALL(GetTensorTypeAndShape, OrtStatus *(*)(const OrtValue *, OrtShape **))(value, &info);
    CALL(GetDimensionsCount, OrtStatus *(*)(const OrtShape *, size_t *))(info, &rank);
    if (rank > most) rank = most;
    CALL(GetDimensions, OrtStatus *(*)(const OrtShape *, int64_t *, size_t))(info, dims, rank);
    CALL(ReleaseTensorTypeAndShapeInfo, void (*)(OrtShape *))(info);
    return rank;
}

/* An invalid-argument status naming the op: "specinfer.native <op>: <message>". */
static inline OrtStatus *op_error(const char *op, const char *message) {
    char text[256];
    snprintf(text, sizeof text, "specinfer.native %s: %s", op, message);
    return CALL(CreateStatus, CreateStatusFn)(ORT_INVALID_ARGUMENT, text);
}

static inline void *data_of(const OrtValue *value) {
    void *data = NULL;
    CALL(GetTensorMutableData, DataFn)(value, &data);
    return data;
}

/* Callbacks every op here shares: stateless kernels on the CPU, single inputs and outputs, any opset. */
static inline void *stateless_kernel(const OrtCustomOp *op, const OrtApiSlot *a, const OrtKernelInfo *info) {
    (void)op; (void)a; (void)info;
    return (void *)1;
}
static inline OrtStatus *stateless_kernel_v2(const OrtCustomOp *op, const OrtApiSlot *a, const OrtKernelInfo *info,
                                             void **kernel) {
    *kernel = stateless_kernel(op, a, info);
    return NULL;
}
static inline void op_destroy(void *kernel) { (void)kernel; }
static inline const char *op_cpu(const OrtCustomOp *op) { (void)op; return "CPUExecutionProvider"; }
static inline int op_required(const OrtCustomOp *op, size_t i) { (void)op; (void)i; return INPUT_REQUIRED; }
static inline int op_default_memory(const OrtCustomOp *op, size_t i) { (void)op; (void)i; return 0; }
static inline int op_arity(const OrtCustomOp *op) { (void)op; return 1; }
static inline int op_homogeneous(const OrtCustomOp *op) { (void)op; return 1; }
static inline int op_start_version(const OrtCustomOp *op) { (void)op; return 1; }
static inline int op_end_version(const OrtCustomOp *op) { (void)op; return 2147483647; }
#endif
