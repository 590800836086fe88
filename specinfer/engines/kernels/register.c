/* specinfer's native ONNX Runtime ops, registered in domain "specinfer.native" by
 * SessionOptions.register_custom_ops_library (specinfer/engines/native.py builds this library from
 * every .c file here). */
#include <string.h>

#include "ort_api.h"

const OrtApiSlot *api;
extern OrtCustomOp matmul_f16w_op, matmul_f16w_swiglu_op, normed_matmul_f16w_op, normed_matmul_f16w_swiglu_op,
    matmul_bf16_op, matmul_bf16_swiglu_op, normed_matmul_bf16_op, normed_matmul_bf16_swiglu_op,
    matmul_i8_op, matmul_i8_swiglu_op, normed_matmul_i8_op, normed_matmul_i8_swiglu_op,
    tree_attention_op, tree_attention_slots_op, tree_attention_f16_op, tree_attention_slots_f16_op, draft_chain_op,
    draft_chain_sampled_op, sample_softmax_op;
static OrtCustomOpDomain *domain;

__attribute__((visibility("default"))) OrtStatus *RegisterCustomOps(OrtSessionOptions *options, const OrtApiBase *base) {
    const OrtApiSlot *table = base->GetApi(API_VERSION);
    if (table == NULL) return NULL;   /* too old: ONNX Runtime then has no op and the session fails */
    const char *build = ((const char *(*)(void))table[SLOT_GetBuildInfoString])();
    if (build == NULL || strncmp(build, "ORT Build Info", 14) != 0)
        return ((CreateStatusFn)table[SLOT_CreateStatus])(ORT_FAIL, "specinfer.native: unexpected ONNX Runtime API table");
    api = table;
    OrtStatus *status = NULL;
    if (domain == NULL) {
        OrtCustomOpDomain *made = NULL;
        status = CALL(CreateCustomOpDomain, OrtStatus *(*)(const char *, OrtCustomOpDomain **))("specinfer.native", &made);
        if (status) return status;
        OrtCustomOp *ops[] = {&matmul_f16w_op,         &matmul_f16w_swiglu_op, &normed_matmul_f16w_op,
                              &normed_matmul_f16w_swiglu_op, &tree_attention_op,   &tree_attention_slots_op,
                              &tree_attention_f16_op,  &tree_attention_slots_f16_op, &draft_chain_op,
                              &draft_chain_sampled_op, &matmul_bf16_op, &matmul_bf16_swiglu_op,
                              &normed_matmul_bf16_op, &normed_matmul_bf16_swiglu_op, &matmul_i8_op,
                              &matmul_i8_swiglu_op, &normed_matmul_i8_op, &normed_matmul_i8_swiglu_op,
                              &sample_softmax_op};
        for (size_t i = 0; i < sizeof ops / sizeof ops[0]; i++) {
            status = CALL(CustomOpDomain_Add, OrtStatus *(*)(OrtCustomOpDomain *, const OrtCustomOp *))(made, ops[i]);
            if (status) return status;
        }
        domain = made;
    }
    return CALL(AddCustomOpDomain, OrtStatus *(*)(OrtSessionOptions *, OrtCustomOpDomain *))(options, domain);
}
