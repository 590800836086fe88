/* The vectors the kernels compute with: 16 floats (vf) and 8 doubles (vd), with lane masks (vmask,
 * vdmask), on AVX-512 or on AVX2 + FMA + F16C, whichever the library is built for (-march=native:
 * native.py builds it on the CPU that runs it).
 *
 * Why: the kernels were written for AVX-512, which many CPUs lack (AMD before Zen 4, Intel's client
 * chips); without the library those run every MatMul on ONNX Runtime's float32 weights, twice the
 * bytes. On AVX-512 each function here is the one intrinsic the kernels called before, so they
 * compute there exactly what they did; on AVX2 a vector is two 8-lane halves, each operation the
 * same on every lane, so a lane's result is the one AVX-512 gives (the same operations, rounded
 * alike). Only the reductions (vf_reduce_add, vd_reduce_add) add in another order there; a kernel
 * that must give a row bit for bit what it gives alone (whatever its batch, or where a token sits
 * in a tree) uses them the same way for every row on either build. The few loops whose register
 * blocking depends on the width (a MatMul panel, attention scores) have a form per build. */
#ifndef SPECINFER_SIMD_H
#define SPECINFER_SIMD_H
#include <immintrin.h>
#include <stddef.h>
#include <stdint.h>

#if defined(__AVX512F__)
#define SIMD_AVX512 1
typedef __m512 vf;
typedef __mmask16 vmask;
typedef __m512d vd;
typedef __mmask8 vdmask;

static inline vf vf_zero(void) { return _mm512_setzero_ps(); }
static inline vf vf_set1(float x) { return _mm512_set1_ps(x); }
static inline vf vf_load(const float *p) { return _mm512_loadu_ps(p); }
static inline void vf_store(float *p, vf v) { _mm512_storeu_ps(p, v); }
static inline vf vf_loadm(vmask m, const float *p) { return _mm512_maskz_loadu_ps(m, p); }   /* 0 where off */
static inline void vf_storem(float *p, vmask m, vf v) { _mm512_mask_storeu_ps(p, m, v); }
static inline vf vf_add(vf a, vf b) { return _mm512_add_ps(a, b); }
static inline vf vf_sub(vf a, vf b) { return _mm512_sub_ps(a, b); }
static inline vf vf_mul(vf a, vf b) { return _mm512_mul_ps(a, b); }
static inline vf vf_div(vf a, vf b) { return _mm512_div_ps(a, b); }
static inline vf vf_max(vf a, vf b) { return _mm512_max_ps(a, b); }
static inline vf vf_abs(vf a) { return _mm512_abs_ps(a); }
static inline vf vf_fmadd(vf a, vf b, vf c) { return _mm512_fmadd_ps(a, b, c); }    /* a b + c */
static inline vf vf_fnmadd(vf a, vf b, vf c) { return _mm512_fnmadd_ps(a, b, c); }  /* c - a b */
static inline vf vf_round(vf a) { return _mm512_roundscale_ps(a, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
static inline vmask vf_lt(vf a, vf b) { return _mm512_cmp_ps_mask(a, b, _CMP_LT_OQ); }
static inline vmask vf_ge(vf a, vf b) { return _mm512_cmp_ps_mask(a, b, _CMP_GE_OQ); }
static inline vmask vf_gt(vf a, vf b) { return _mm512_cmp_ps_mask(a, b, _CMP_GT_OQ); }
static inline vmask vmask_and(vmask a, vmask b) { return a & b; }
static inline unsigned vmask_bits(vmask m) { return m; }   /* lane i at bit i */
static inline vf vf_maskz(vmask m, vf a) { return _mm512_maskz_mov_ps(m, a); }
static inline vf vf_blend(vmask m, vf a, vf b) { return _mm512_mask_blend_ps(m, a, b); }   /* b where m */
static inline vf vf_mask_max(vf src, vmask m, vf a, vf b) { return _mm512_mask_max_ps(src, m, a, b); }
/* a 2^n where m (n integral, the result a normal number), 0 elsewhere */
static inline vf vf_scale_or_zero(vmask m, vf a, vf n) { return _mm512_maskz_scalef_ps(m, a, n); }
static inline float vf_reduce_add(vf a) { return _mm512_reduce_add_ps(a); }
static inline float vf_reduce_max(vf a) { return _mm512_reduce_max_ps(a); }
static inline vf vf_from_half(const uint16_t *p) { return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)p)); }
static inline void vf_to_half(uint16_t *p, vf v) {   /* rounded to nearest even */
    _mm256_storeu_si256((__m256i *)p, _mm512_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
}
static inline vmask first_lanes(size_t left) { return left >= 16 ? 0xFFFF : (vmask)((1u << left) - 1); }

static inline vd vd_zero(void) { return _mm512_setzero_pd(); }
static inline vd vd_set1(double x) { return _mm512_set1_pd(x); }
static inline vd vd_loadm(vdmask m, const double *p) { return _mm512_maskz_loadu_pd(m, p); }
static inline void vd_storem(double *p, vdmask m, vd v) { _mm512_mask_storeu_pd(p, m, v); }
static inline vd vd_from_floats(vdmask m, const float *p) { return _mm512_cvtps_pd(_mm256_maskz_loadu_ps(m, p)); }
static inline vd vd_add(vd a, vd b) { return _mm512_add_pd(a, b); }
static inline vd vd_sub(vd a, vd b) { return _mm512_sub_pd(a, b); }
static inline vd vd_mul(vd a, vd b) { return _mm512_mul_pd(a, b); }
static inline vd vd_max(vd a, vd b) { return _mm512_max_pd(a, b); }
static inline vd vd_fmadd(vd a, vd b, vd c) { return _mm512_fmadd_pd(a, b, c); }
static inline vd vd_fnmadd(vd a, vd b, vd c) { return _mm512_fnmadd_pd(a, b, c); }
static inline vd vd_round(vd a) { return _mm512_roundscale_pd(a, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
static inline vdmask vd_ge(vd a, vd b) { return _mm512_cmp_pd_mask(a, b, _CMP_GE_OQ); }
static inline vd vd_maskz(vdmask m, vd a) { return _mm512_maskz_mov_pd(m, a); }
static inline vd vd_mask_max(vd src, vdmask m, vd a, vd b) { return _mm512_mask_max_pd(src, m, a, b); }
static inline vd vd_scale_or_zero(vdmask m, vd a, vd n) { return _mm512_maskz_scalef_pd(m, a, n); }
static inline double vd_reduce_add(vd a) { return _mm512_reduce_add_pd(a); }
static inline double vd_reduce_max(vd a) { return _mm512_reduce_max_pd(a); }
static inline vdmask first_lanes8(size_t left) { return left >= 8 ? 0xFF : (vdmask)((1u << left) - 1); }

#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define SIMD_AVX512 0
typedef struct { __m256 lo, hi; } vf;
typedef struct { __m256 lo, hi; } vmask;     /* a lane on: all its bits set */
typedef struct { __m256d lo, hi; } vd;
typedef struct { __m256d lo, hi; } vdmask;

#define VF2(expr_lo, expr_hi) ((vf){expr_lo, expr_hi})
static inline vf vf_zero(void) { return VF2(_mm256_setzero_ps(), _mm256_setzero_ps()); }
static inline vf vf_set1(float x) { return VF2(_mm256_set1_ps(x), _mm256_set1_ps(x)); }
static inline vf vf_load(const float *p) { return VF2(_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)); }
static inline void vf_store(float *p, vf v) { _mm256_storeu_ps(p, v.lo); _mm256_storeu_ps(p + 8, v.hi); }
/* Masked loads and stores touch no memory in the lanes that are off (VMASKMOVPS). */
static inline vf vf_loadm(vmask m, const float *p) {
    return VF2(_mm256_maskload_ps(p, _mm256_castps_si256(m.lo)), _mm256_maskload_ps(p + 8, _mm256_castps_si256(m.hi)));
}
static inline void vf_storem(float *p, vmask m, vf v) {
    _mm256_maskstore_ps(p, _mm256_castps_si256(m.lo), v.lo);
    _mm256_maskstore_ps(p + 8, _mm256_castps_si256(m.hi), v.hi);
}
static inline vf vf_add(vf a, vf b) { return VF2(_mm256_add_ps(a.lo, b.lo), _mm256_add_ps(a.hi, b.hi)); }
static inline vf vf_sub(vf a, vf b) { return VF2(_mm256_sub_ps(a.lo, b.lo), _mm256_sub_ps(a.hi, b.hi)); }
static inline vf vf_mul(vf a, vf b) { return VF2(_mm256_mul_ps(a.lo, b.lo), _mm256_mul_ps(a.hi, b.hi)); }
static inline vf vf_div(vf a, vf b) { return VF2(_mm256_div_ps(a.lo, b.lo), _mm256_div_ps(a.hi, b.hi)); }
static inline vf vf_max(vf a, vf b) { return VF2(_mm256_max_ps(a.lo, b.lo), _mm256_max_ps(a.hi, b.hi)); }
static inline vf vf_abs(vf a) {
    __m256 sign = _mm256_set1_ps(-0.0f);
    return VF2(_mm256_andnot_ps(sign, a.lo), _mm256_andnot_ps(sign, a.hi));
}
static inline vf vf_fmadd(vf a, vf b, vf c) { return VF2(_mm256_fmadd_ps(a.lo, b.lo, c.lo), _mm256_fmadd_ps(a.hi, b.hi, c.hi)); }
static inline vf vf_fnmadd(vf a, vf b, vf c) { return VF2(_mm256_fnmadd_ps(a.lo, b.lo, c.lo), _mm256_fnmadd_ps(a.hi, b.hi, c.hi)); }
static inline vf vf_round(vf a) {
    return VF2(_mm256_round_ps(a.lo, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC),
               _mm256_round_ps(a.hi, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
}
#define VF_CMP(name, predicate)                                                                          \
    static inline vmask name(vf a, vf b) {                                                               \
        return (vmask){_mm256_cmp_ps(a.lo, b.lo, predicate), _mm256_cmp_ps(a.hi, b.hi, predicate)};     \
    }
VF_CMP(vf_lt, _CMP_LT_OQ)
VF_CMP(vf_ge, _CMP_GE_OQ)
VF_CMP(vf_gt, _CMP_GT_OQ)
static inline vmask vmask_and(vmask a, vmask b) { return (vmask){_mm256_and_ps(a.lo, b.lo), _mm256_and_ps(a.hi, b.hi)}; }
static inline unsigned vmask_bits(vmask m) {
    return (unsigned)_mm256_movemask_ps(m.lo) | (unsigned)_mm256_movemask_ps(m.hi) << 8;
}
static inline vf vf_maskz(vmask m, vf a) { return VF2(_mm256_and_ps(m.lo, a.lo), _mm256_and_ps(m.hi, a.hi)); }
static inline vf vf_blend(vmask m, vf a, vf b) { return VF2(_mm256_blendv_ps(a.lo, b.lo, m.lo), _mm256_blendv_ps(a.hi, b.hi, m.hi)); }
static inline vf vf_mask_max(vf src, vmask m, vf a, vf b) { return vf_blend(m, src, vf_max(a, b)); }
/* 2^n as the float whose exponent field is n + 127: exact for the normal results asked for, as
 * AVX-512's VSCALEFPS. */
static inline __m256 pow2_ps(__m256 n) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23));
}
static inline vf vf_scale_or_zero(vmask m, vf a, vf n) {
    return vf_maskz(m, VF2(_mm256_mul_ps(a.lo, pow2_ps(n.lo)), _mm256_mul_ps(a.hi, pow2_ps(n.hi))));
}
static inline float reduce_add8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}
static inline float vf_reduce_add(vf a) { return reduce_add8(_mm256_add_ps(a.lo, a.hi)); }
static inline float vf_reduce_max(vf a) {
    __m256 v = _mm256_max_ps(a.lo, a.hi);
    __m128 s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_max_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_max_ss(s, _mm_movehdup_ps(s)));
}
static inline vf vf_from_half(const uint16_t *p) {
    return VF2(_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p)), _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(p + 8))));
}
static inline void vf_to_half(uint16_t *p, vf v) {
    _mm_storeu_si128((__m128i *)p, _mm256_cvtps_ph(v.lo, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
    _mm_storeu_si128((__m128i *)(p + 8), _mm256_cvtps_ph(v.hi, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
}
static inline __m256 lanes_below(size_t left) {   /* lanes 0 .. left - 1 of 8 on */
    __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    return _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32((int)(left > 8 ? 8 : left)), lane));
}
static inline vmask first_lanes(size_t left) { return (vmask){lanes_below(left), lanes_below(left > 8 ? left - 8 : 0)}; }

#define VD2(expr_lo, expr_hi) ((vd){expr_lo, expr_hi})
static inline vd vd_zero(void) { return VD2(_mm256_setzero_pd(), _mm256_setzero_pd()); }
static inline vd vd_set1(double x) { return VD2(_mm256_set1_pd(x), _mm256_set1_pd(x)); }
static inline vd vd_loadm(vdmask m, const double *p) {
    return VD2(_mm256_maskload_pd(p, _mm256_castpd_si256(m.lo)), _mm256_maskload_pd(p + 4, _mm256_castpd_si256(m.hi)));
}
static inline void vd_storem(double *p, vdmask m, vd v) {
    _mm256_maskstore_pd(p, _mm256_castpd_si256(m.lo), v.lo);
    _mm256_maskstore_pd(p + 4, _mm256_castpd_si256(m.hi), v.hi);
}
static inline vd vd_from_floats(vdmask m, const float *p) {   /* 8 floats widened, 0 where off */
    /* the float lanes' mask: the low half of each double lane's, lanes 0-3 from m.lo, 4-7 from m.hi */
    __m256i low_halves = _mm256_setr_epi32(0, 2, 4, 6, 0, 2, 4, 6);
    __m256i lo = _mm256_permutevar8x32_epi32(_mm256_castpd_si256(m.lo), low_halves);
    __m256i hi = _mm256_permutevar8x32_epi32(_mm256_castpd_si256(m.hi), low_halves);
    __m256 x = _mm256_maskload_ps(p, _mm256_permute2x128_si256(lo, hi, 0x20));
    return VD2(_mm256_cvtps_pd(_mm256_castps256_ps128(x)), _mm256_cvtps_pd(_mm256_extractf128_ps(x, 1)));
}
static inline vd vd_add(vd a, vd b) { return VD2(_mm256_add_pd(a.lo, b.lo), _mm256_add_pd(a.hi, b.hi)); }
static inline vd vd_sub(vd a, vd b) { return VD2(_mm256_sub_pd(a.lo, b.lo), _mm256_sub_pd(a.hi, b.hi)); }
static inline vd vd_mul(vd a, vd b) { return VD2(_mm256_mul_pd(a.lo, b.lo), _mm256_mul_pd(a.hi, b.hi)); }
static inline vd vd_max(vd a, vd b) { return VD2(_mm256_max_pd(a.lo, b.lo), _mm256_max_pd(a.hi, b.hi)); }
static inline vd vd_fmadd(vd a, vd b, vd c) { return VD2(_mm256_fmadd_pd(a.lo, b.lo, c.lo), _mm256_fmadd_pd(a.hi, b.hi, c.hi)); }
static inline vd vd_fnmadd(vd a, vd b, vd c) { return VD2(_mm256_fnmadd_pd(a.lo, b.lo, c.lo), _mm256_fnmadd_pd(a.hi, b.hi, c.hi)); }
static inline vd vd_round(vd a) {
    return VD2(_mm256_round_pd(a.lo, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC),
               _mm256_round_pd(a.hi, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
}
static inline vdmask vd_ge(vd a, vd b) { return (vdmask){_mm256_cmp_pd(a.lo, b.lo, _CMP_GE_OQ), _mm256_cmp_pd(a.hi, b.hi, _CMP_GE_OQ)}; }
static inline vd vd_maskz(vdmask m, vd a) { return VD2(_mm256_and_pd(m.lo, a.lo), _mm256_and_pd(m.hi, a.hi)); }
static inline vd vd_mask_max(vd src, vdmask m, vd a, vd b) {
    vd top = vd_max(a, b);
    return VD2(_mm256_blendv_pd(src.lo, top.lo, m.lo), _mm256_blendv_pd(src.hi, top.hi, m.hi));
}
/* 2^n for integral n, |n| < 2^51, as the double whose exponent field is n + 1023: n's bits read off
 * n + 1.5 2^52 (AVX2 converts no double to a 64-bit integer). */
static inline __m256d pow2_pd(__m256d n) {
    __m256d magic = _mm256_set1_pd(6755399441055744.0);
    __m256i bits = _mm256_sub_epi64(_mm256_castpd_si256(_mm256_add_pd(n, magic)), _mm256_castpd_si256(magic));
    return _mm256_castsi256_pd(_mm256_slli_epi64(_mm256_add_epi64(bits, _mm256_set1_epi64x(1023)), 52));
}
static inline vd vd_scale_or_zero(vdmask m, vd a, vd n) {
    return vd_maskz(m, VD2(_mm256_mul_pd(a.lo, pow2_pd(n.lo)), _mm256_mul_pd(a.hi, pow2_pd(n.hi))));
}
static inline double vd_reduce_add(vd a) {
    __m256d v = _mm256_add_pd(a.lo, a.hi);
    __m128d s = _mm_add_pd(_mm256_castpd256_pd128(v), _mm256_extractf128_pd(v, 1));
    return _mm_cvtsd_f64(_mm_add_sd(s, _mm_unpackhi_pd(s, s)));
}
static inline double vd_reduce_max(vd a) {
    __m256d v = _mm256_max_pd(a.lo, a.hi);
    __m128d s = _mm_max_pd(_mm256_castpd256_pd128(v), _mm256_extractf128_pd(v, 1));
    return _mm_cvtsd_f64(_mm_max_sd(s, _mm_unpackhi_pd(s, s)));
}
static inline __m256d lanes_below4(size_t left) {   /* lanes 0 .. left - 1 of 4 on */
    __m256i lane = _mm256_setr_epi64x(0, 1, 2, 3);
    return _mm256_castsi256_pd(_mm256_cmpgt_epi64(_mm256_set1_epi64x((long long)(left > 4 ? 4 : left)), lane));
}
static inline vdmask first_lanes8(size_t left) { return (vdmask){lanes_below4(left), lanes_below4(left > 4 ? left - 4 : 0)}; }
#else
#error "specinfer's native kernels need AVX-512F, or AVX2 with FMA and F16C"
#endif
#endif
