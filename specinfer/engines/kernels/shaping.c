/* specinfer_softmax: rows of float32 logits to float64 probabilities at a temperature, the shaping
 * every sampled token goes through (specinfer/sampling.py calls it through ctypes, not ONNX
 * Runtime).
 *
 * Why: numpy shapes an 8k-token row in ~29 us (seven passes, each a call), a twentieth of an LLM
 * step, and a sampled step shapes 2-5 rows; here it is one pass to widen, scale and find the
 * maximum, one to exponentiate and sum, one to divide.
 *
 * out[r, i] = exp(z_i - max z) / sum_j exp(z_j - max z), z = logits[r] / temperature, in float64
 * (exp within ~2e-16 relative: a degree-12 Taylor polynomial on |r| <= ln 2 / 2 times 2^n). */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>

/* exp(x) for x <= 0, 8 lanes of float64; 0 below -708 (under the smallest normal double). */
static inline __m512d exp_pd(__m512d x) {
    __mmask8 live = _mm512_cmp_pd_mask(x, _mm512_set1_pd(-708.0), _CMP_GE_OQ);
    x = _mm512_max_pd(x, _mm512_set1_pd(-708.0));
    __m512d n = _mm512_roundscale_pd(_mm512_mul_pd(x, _mm512_set1_pd(1.4426950408889634)),
                                     _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512d r = _mm512_fnmadd_pd(n, _mm512_set1_pd(6.93147180369123816490e-01), x);   /* ln 2, high part */
    r = _mm512_fnmadd_pd(n, _mm512_set1_pd(1.90821492927058770002e-10), r);          /* ln 2, low part */
    __m512d p = _mm512_set1_pd(1.0 / 479001600.0);   /* 1 / 12! */
    static const double inverse_factorial[] = {1.0 / 39916800.0, 1.0 / 3628800.0, 1.0 / 362880.0, 1.0 / 40320.0,
                                               1.0 / 5040.0, 1.0 / 720.0, 1.0 / 120.0, 1.0 / 24.0, 1.0 / 6.0, 0.5,
                                               1.0, 1.0};
    for (int i = 0; i < 12; i++) p = _mm512_fmadd_pd(p, r, _mm512_set1_pd(inverse_factorial[i]));
    return _mm512_maskz_scalef_pd(live, p, n);
}

__attribute__((visibility("default"))) void specinfer_softmax(const float *logits, int64_t rows, int64_t V,
                                                              double temperature, double *out) {
    __m512d scale = _mm512_set1_pd(1.0 / temperature);
    for (int64_t row = 0; row < rows; row++, logits += V, out += V) {
        __m512d top = _mm512_set1_pd(-INFINITY);
        for (int64_t i = 0; i < V; i += 8) {
            __mmask8 m = V - i >= 8 ? 0xFF : (__mmask8)((1u << (V - i)) - 1);
            __m512d z = _mm512_mul_pd(_mm512_cvtps_pd(_mm256_maskz_loadu_ps(m, logits + i)), scale);
            _mm512_mask_storeu_pd(out + i, m, z);
            top = _mm512_mask_max_pd(top, m, top, z);
        }
        __m512d shift = _mm512_set1_pd(_mm512_reduce_max_pd(top)), sum = _mm512_setzero_pd();
        for (int64_t i = 0; i < V; i += 8) {
            __mmask8 m = V - i >= 8 ? 0xFF : (__mmask8)((1u << (V - i)) - 1);
            __m512d e = exp_pd(_mm512_sub_pd(_mm512_maskz_loadu_pd(m, out + i), shift));
            _mm512_mask_storeu_pd(out + i, m, e);
            sum = _mm512_add_pd(sum, _mm512_maskz_mov_pd(m, e));
        }
        __m512d inverse = _mm512_set1_pd(1.0 / _mm512_reduce_add_pd(sum));   /* (a division a value cost 4 us a row) */
        for (int64_t i = 0; i < V; i += 8) {
            __mmask8 m = V - i >= 8 ? 0xFF : (__mmask8)((1u << (V - i)) - 1);
            _mm512_mask_storeu_pd(out + i, m, _mm512_mul_pd(_mm512_maskz_loadu_pd(m, out + i), inverse));
        }
    }
}
