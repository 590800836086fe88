/* The tree attention's job and task (tree_attention.c), shared with the ops that attend inside
 * their own computation (draft_chain.c). */
#ifndef SPECINFER_TREE_ATTENTION_H
#define SPECINFER_TREE_ATTENTION_H
#include <stddef.h>
#include <stdint.h>

#include "simd.h"

/* exp(x) for x <= 0, 16 lanes: x = n ln2 + r, |r| <= ln2 / 2, a degree-6 polynomial for e^r,
 * times 2^n; 0 below e^-80 (weights that small change nothing, and their products with the values
 * would be denormal numbers: with them the LLM's 7-token run was slower than on GroupQueryAttention,
 * 1.91 ms against 1.57). Within 2 ulp of expf; lanes are independent. */
static inline vf exp_ps(vf x) {
    x = vf_max(x, vf_set1(-87.0f));
    vf n = vf_round(vf_mul(x, vf_set1(1.44269504088896341f)));
    vf r = vf_fnmadd(n, vf_set1(0.693359375f), x);
    r = vf_fnmadd(n, vf_set1(-2.12194440e-4f), r);
    vf p = vf_set1(1.9875691500e-4f);
    p = vf_fmadd(p, r, vf_set1(1.3981999507e-3f));
    p = vf_fmadd(p, r, vf_set1(8.3334519073e-3f));
    p = vf_fmadd(p, r, vf_set1(4.1665795894e-2f));
    p = vf_fmadd(p, r, vf_set1(1.6666665459e-1f));
    p = vf_fmadd(p, r, vf_set1(5.0000001201e-1f));
    p = vf_fmadd(p, vf_mul(r, r), vf_add(r, vf_set1(1.0f)));
    return vf_scale_or_zero(vf_ge(x, vf_set1(-80.0f)), p, n);
}

/* One call's attention: B sequences of T new tokens each over caches of S slots (see
 * tree_attention.c for the layout); positions and bias optional (NULL: slot order, causal). */
typedef struct {
    const float *qkv, *bias, *cos, *sin;
    const int64_t *positions;
    void *keys, *values;   /* the presents: float, or float16 where `half` (rows widened as read) */
    float *out;
    const int32_t *seqlens;
    size_t B, T, H, Hkv, S, D, total, bias_batch;
    float scale;
    int half;
} Job;

/* Bytes of one cached value: float16 or float32. */
static inline size_t kv_itemsize(const Job *job) { return job->half ? 2 : 4; }

/* Attention of task (b, t, g) of B x T x Hkv: token t of sequence b, the query heads of KV head g. */
__attribute__((visibility("hidden"))) void attend_task(const Job *job, size_t task);
/* The new tokens' rotated keys and values into slots P .. P + T - 1 of the presents (the past
 * copied first where a present is not bound to it), in the presents' type. */
__attribute__((visibility("hidden"))) void store_new(const Job *job, const void *past_key, const void *past_value);
#endif
