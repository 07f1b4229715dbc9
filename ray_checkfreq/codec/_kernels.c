/* Byte-layout kernels of the codec: split a frame of elements into streams and merge
 * them back, in one pass each. The layouts are defined in layout.py, whose numpy
 * implementation is the reference these kernels are tested against; this file only
 * makes them fast. Every function releases the GIL while it runs.
 *
 * Loops have no data-dependent branches; elements are loaded and stored with memcpy,
 * which compiles to plain (unaligned) moves, because callers may pass buffers at any
 * address.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

/* ---- planar exponent split for floats with an 8-bit exponent (bfloat16, float32) ---- */

#define OFFSET_SAMPLE_STEP 32
#define OFFSET_CENTER 32

typedef struct {
    Py_ssize_t n;    /* elements */
    Py_ssize_t g;    /* groups of 4 elements (the last one zero-padded) */
    uint8_t *t;      /* 4g bytes: exponent bits 5..0 and the top 2 mantissa bits */
    uint8_t *k;      /* 1 + g bytes: the exponent offset, then exponent bits 7..6 */
    uint8_t *m;      /* float32 only: 8g bytes, mantissa bits 20..13 then 12..5 */
    uint8_t *nib;    /* 2g bytes: low 4 bits of r, two elements to a byte */
    uint8_t *p;      /* g bytes: top 2 bits of r; r = mantissa 4..0 << 1 | sign */
} e8_streams;

static Py_ssize_t e8_groups(Py_ssize_t n) { return (n + 3) / 4; }

static Py_ssize_t e8_total(Py_ssize_t n, int width) {
    Py_ssize_t g = e8_groups(n);
    return 4 * g + 1 + g + (width == 4 ? 8 * g : 0) + 3 * g;
}

static void e8_locate(e8_streams *s, uint8_t *base, Py_ssize_t n, int width) {
    s->n = n;
    s->g = e8_groups(n);
    s->t = base;
    s->k = s->t + 4 * s->g;
    s->m = s->k + 1 + s->g;
    s->nib = s->m + (width == 4 ? 8 * s->g : 0);
    s->p = s->nib + 2 * s->g;
}

/* The median exponent of every OFFSET_SAMPLE_STEP-th element, minus OFFSET_CENTER. The
 * histogram is kept in four parts, one per sample position modulo 4: most samples share
 * a few exponents, and one histogram would make every increment wait for the previous
 * one. */
#define E8_OFFSET(NAME, WORD, MB)                                                        \
    static uint8_t NAME(const uint8_t *src, Py_ssize_t n) {                              \
        Py_ssize_t hist[4][256] = {{0}}, sampled = 0, seen = 0;                          \
        for (Py_ssize_t i = 0; i < n; i += OFFSET_SAMPLE_STEP, sampled++) {              \
            WORD w;                                                                      \
            memcpy(&w, src + (size_t)i * sizeof(WORD), sizeof(WORD));                    \
            hist[sampled & 3][(w >> MB) & 0xFF]++;                                       \
        }                                                                                \
        int median = 0;                                                                  \
        for (; median < 255; median++) {                                                 \
            seen += hist[0][median] + hist[1][median] + hist[2][median] + hist[3][median]; \
            if (2 * seen >= sampled)                                                     \
                break;                                                                   \
        }                                                                                \
        return (uint8_t)((median - OFFSET_CENTER) & 0xFF);                               \
    }

/* Frames are done in chunks of CHUNK elements, each as a few simple loops over
 * contiguous bytes that compilers vectorize: one computes every element's fields (the
 * 2- and 6-bit ones one to a byte, in scratch), the others pack or unpack 4 (or 2) of
 * them per byte through a 32-bit (16-bit) word, which relies on little-endian order.
 * Stream pointers are restrict locals: a store through a uint8_t pointer may alias
 * anything, so without restrict every store would force reloads. */
#define CHUNK 2048

#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ != __ORDER_LITTLE_ENDIAN__
#error "the codec kernels assume a little-endian machine"
#endif

static inline uint8_t pack4x2(const uint8_t *four) { /* bytes <= 3 -> 2 bits each */
    uint32_t x, z;
    memcpy(&x, four, 4);
    z = x | (x >> 6);
    return (uint8_t)(z | (z >> 12));
}

static inline uint32_t unpack4x2(uint32_t packed) { /* 2-bit fields -> one per byte */
    return (packed & 3u) | ((packed & 0xCu) << 6) | ((packed & 0x30u) << 12)
           | ((packed & 0xC0u) << 18);
}


/* SSE2 versions of the chunk loops (SSE2 is part of every x86-64 CPU): 16 elements at a
 * time, computed byte-plane by byte-plane. Each returns how many leading elements it did
 * (a multiple of 16); the scalar loops below do the rest and define the same result. */
#if defined(__SSE2__)
#include <emmintrin.h>
#define B8(v) _mm_set1_epi8((char)(v))
static inline __m128i srl8(__m128i x, int n) { return _mm_and_si128(_mm_srli_epi16(x, n), B8(0xFF >> n)); }
static inline __m128i sll8(__m128i x, int n) { return _mm_and_si128(_mm_slli_epi16(x, n), B8((0xFF << n) & 0xFF)); }

static inline __m128i expand2(const uint8_t *src) { /* 4 bytes of 2-bit fields -> 16 */
    uint32_t v;
    memcpy(&v, src, 4);
    __m128i x = _mm_cvtsi32_si128((int)v);
    x = _mm_unpacklo_epi8(x, x);
    x = _mm_unpacklo_epi16(x, x);
    const __m128i lo = _mm_set1_epi32(0x40100401), hi = _mm_set1_epi32((int)0x80200802u);
    __m128i b0 = _mm_and_si128(_mm_cmpeq_epi8(_mm_and_si128(x, lo), lo), B8(1));
    __m128i b1 = _mm_and_si128(_mm_cmpeq_epi8(_mm_and_si128(x, hi), hi), B8(2));
    return _mm_or_si128(b0, b1);
}

static inline void pack2(__m128i x, uint8_t *dst) { /* 16 bytes <= 3 -> 4 bytes */
    __m128i z = _mm_or_si128(x, _mm_srli_epi32(x, 6));
    z = _mm_and_si128(_mm_or_si128(z, _mm_srli_epi32(z, 12)), _mm_set1_epi32(0xFF));
    z = _mm_packus_epi16(_mm_packs_epi32(z, z), z);
    uint32_t v = (uint32_t)_mm_cvtsi128_si32(z);
    memcpy(dst, &v, 4);
}

static inline __m128i expand_nibbles(const uint8_t *src) { /* 8 bytes -> 16 nibbles */
    __m128i n = _mm_loadl_epi64((const __m128i *)src);
    return _mm_unpacklo_epi8(_mm_and_si128(n, B8(15)), srl8(n, 4));
}

static inline void pack_nibbles(__m128i r, uint8_t *dst) { /* 16 bytes <= 15 -> 8 bytes */
    __m128i x = _mm_or_si128(r, _mm_srli_epi16(r, 4));
    x = _mm_and_si128(x, _mm_set1_epi16(0xFF));
    _mm_storel_epi64((__m128i *)dst, _mm_packus_epi16(x, x));
}

/* The fields of 16 elements from their exponent byte parts: `hi` holds s e7..e1, `lo`
 * e0 and the 7 bits below it. */
#define E8_FIELDS(hi, lo, OFF)                                                           \
    __m128i e = _mm_sub_epi8(_mm_or_si128(sll8(hi, 1), srl8(lo, 7)), OFF);               \
    __m128i tt = _mm_or_si128(sll8(_mm_and_si128(e, B8(63)), 2),                         \
                              _mm_and_si128(srl8(lo, 5), B8(3)));

static Py_ssize_t e8_split32_sse2(const uint32_t *w, Py_ssize_t count, uint32_t off,
                                  uint8_t *t, uint8_t *k, uint8_t *m1, uint8_t *m2,
                                  uint8_t *nib, uint8_t *p) {
    const __m128i OFF = B8(off), FF = _mm_set1_epi32(0xFF);
    Py_ssize_t i = 0;
    for (; i + 16 <= count; i += 16) {
        __m128i v[4], b[4];
        for (int j = 0; j < 4; j++)
            v[j] = _mm_loadu_si128((const __m128i *)(w + i + 4 * j));
        for (int s = 0; s < 4; s++) {
            __m128i q[4];
            for (int j = 0; j < 4; j++)
                q[j] = _mm_and_si128(_mm_srli_epi32(v[j], 8 * s), FF);
            b[s] = _mm_packus_epi16(_mm_packs_epi32(q[0], q[1]), _mm_packs_epi32(q[2], q[3]));
        }
        E8_FIELDS(b[3], b[2], OFF)
        __m128i r = _mm_or_si128(sll8(_mm_and_si128(b[0], B8(31)), 1), srl8(b[3], 7));
        _mm_storeu_si128((__m128i *)(t + i), tt);
        _mm_storeu_si128((__m128i *)(m1 + i),
                         _mm_or_si128(sll8(_mm_and_si128(b[2], B8(31)), 3), srl8(b[1], 5)));
        _mm_storeu_si128((__m128i *)(m2 + i),
                         _mm_or_si128(sll8(_mm_and_si128(b[1], B8(31)), 3), srl8(b[0], 5)));
        pack2(srl8(e, 6), k + i / 4);
        pack2(srl8(r, 4), p + i / 4);
        pack_nibbles(_mm_and_si128(r, B8(15)), nib + i / 2);
    }
    return i;
}

static Py_ssize_t e8_split16_sse2(const uint16_t *w, Py_ssize_t count, uint32_t off,
                                  uint8_t *t, uint8_t *k, uint8_t *m1, uint8_t *m2,
                                  uint8_t *nib, uint8_t *p) {
    (void)m1;
    (void)m2;
    const __m128i OFF = B8(off), FF = _mm_set1_epi16(0xFF);
    Py_ssize_t i = 0;
    for (; i + 16 <= count; i += 16) {
        __m128i v0 = _mm_loadu_si128((const __m128i *)(w + i));
        __m128i v1 = _mm_loadu_si128((const __m128i *)(w + i + 8));
        __m128i lo = _mm_packus_epi16(_mm_and_si128(v0, FF), _mm_and_si128(v1, FF));
        __m128i hi = _mm_packus_epi16(_mm_srli_epi16(v0, 8), _mm_srli_epi16(v1, 8));
        E8_FIELDS(hi, lo, OFF)
        __m128i r = _mm_or_si128(sll8(_mm_and_si128(lo, B8(31)), 1), srl8(hi, 7));
        _mm_storeu_si128((__m128i *)(t + i), tt);
        pack2(srl8(e, 6), k + i / 4);
        pack2(srl8(r, 4), p + i / 4);
        pack_nibbles(_mm_and_si128(r, B8(15)), nib + i / 2);
    }
    return i;
}

/* The exponent byte parts of 16 elements: `hi` = s e7..e1, `lo` = e0 m_top m_top-1 and
 * the 5 bits of r above its sign. */
#define E8_UNFIELDS(OFF)                                                                 \
    __m128i tt = _mm_loadu_si128((const __m128i *)(t + i));                              \
    __m128i r = _mm_or_si128(expand_nibbles(nib + i / 2), sll8(expand2(p + i / 4), 4));  \
    __m128i e = _mm_add_epi8(_mm_or_si128(sll8(expand2(k + i / 4), 6), srl8(tt, 2)), OFF); \
    __m128i hi = _mm_or_si128(sll8(_mm_and_si128(r, B8(1)), 7), srl8(e, 1));             \
    __m128i lo = _mm_or_si128(sll8(_mm_and_si128(e, B8(1)), 7),                          \
                              sll8(_mm_and_si128(tt, B8(3)), 5));

static Py_ssize_t e8_merge32_sse2(uint32_t *w, Py_ssize_t count, uint32_t off,
                                  const uint8_t *t, const uint8_t *k, const uint8_t *m1,
                                  const uint8_t *m2, const uint8_t *nib, const uint8_t *p) {
    const __m128i OFF = B8(off);
    Py_ssize_t i = 0;
    for (; i + 16 <= count; i += 16) {
        E8_UNFIELDS(OFF)
        __m128i a = _mm_loadu_si128((const __m128i *)(m1 + i));
        __m128i c = _mm_loadu_si128((const __m128i *)(m2 + i));
        __m128i b0 = _mm_or_si128(sll8(_mm_and_si128(c, B8(7)), 5), srl8(r, 1));
        __m128i b1 = _mm_or_si128(sll8(_mm_and_si128(a, B8(7)), 5), srl8(c, 3));
        __m128i b2 = _mm_or_si128(lo, srl8(a, 3));
        __m128i l01 = _mm_unpacklo_epi8(b0, b1), h01 = _mm_unpackhi_epi8(b0, b1);
        __m128i l23 = _mm_unpacklo_epi8(b2, hi), h23 = _mm_unpackhi_epi8(b2, hi);
        _mm_storeu_si128((__m128i *)(w + i), _mm_unpacklo_epi16(l01, l23));
        _mm_storeu_si128((__m128i *)(w + i + 4), _mm_unpackhi_epi16(l01, l23));
        _mm_storeu_si128((__m128i *)(w + i + 8), _mm_unpacklo_epi16(h01, h23));
        _mm_storeu_si128((__m128i *)(w + i + 12), _mm_unpackhi_epi16(h01, h23));
    }
    return i;
}

static Py_ssize_t e8_merge16_sse2(uint16_t *w, Py_ssize_t count, uint32_t off,
                                  const uint8_t *t, const uint8_t *k, const uint8_t *m1,
                                  const uint8_t *m2, const uint8_t *nib, const uint8_t *p) {
    (void)m1;
    (void)m2;
    const __m128i OFF = B8(off);
    Py_ssize_t i = 0;
    for (; i + 16 <= count; i += 16) {
        E8_UNFIELDS(OFF)
        __m128i b0 = _mm_or_si128(lo, srl8(r, 1));
        _mm_storeu_si128((__m128i *)(w + i), _mm_unpacklo_epi8(b0, hi));
        _mm_storeu_si128((__m128i *)(w + i + 8), _mm_unpackhi_epi8(b0, hi));
    }
    return i;
}
#else
#define e8_split32_sse2(...) ((Py_ssize_t)0)
#define e8_split16_sse2(...) ((Py_ssize_t)0)
#define e8_merge32_sse2(...) ((Py_ssize_t)0)
#define e8_merge16_sse2(...) ((Py_ssize_t)0)
#endif

/* AVX2 versions of the merge loops, 32 elements at a time, used when the CPU has AVX2
 * (checked once at import). Byte shuffles and unpacks work within 128-bit halves, so
 * the 2-bit and 4-bit fields are spread with a per-half shuffle and the interleaved
 * output halves are put back in order with permute2x128. */
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define HAVE_AVX2_DISPATCH 1
#include <immintrin.h>
static int use_avx2;
#define AVX2 __attribute__((target("avx2")))
#define W8(v) _mm256_set1_epi8((char)(v))

AVX2 static inline __m256i srl8x(__m256i x, int n) {
    return _mm256_and_si256(_mm256_srli_epi16(x, n), W8(0xFF >> n));
}
AVX2 static inline __m256i sll8x(__m256i x, int n) {
    return _mm256_and_si256(_mm256_slli_epi16(x, n), W8((0xFF << n) & 0xFF));
}

AVX2 static inline __m256i expand2x(const uint8_t *src) { /* 8 bytes of 2-bit fields -> 32 */
    int64_t v;
    memcpy(&v, src, 8);
    const __m256i idx = _mm256_setr_epi8(0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3,
                                         4, 4, 4, 4, 5, 5, 5, 5, 6, 6, 6, 6, 7, 7, 7, 7);
    __m256i x = _mm256_shuffle_epi8(_mm256_set1_epi64x(v), idx);
    const __m256i lo = _mm256_set1_epi32(0x40100401), hi = _mm256_set1_epi32((int)0x80200802u);
    __m256i b0 = _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(x, lo), lo), W8(1));
    __m256i b1 = _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(x, hi), hi), W8(2));
    return _mm256_or_si256(b0, b1);
}

AVX2 static inline __m256i expand_nibblesx(const uint8_t *src) { /* 16 bytes -> 32 */
    const __m256i idx = _mm256_setr_epi8(0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6, 7, 7,
                                         8, 8, 9, 9, 10, 10, 11, 11, 12, 12, 13, 13, 14,
                                         14, 15, 15);
    __m256i x = _mm256_shuffle_epi8(
        _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)src)), idx);
    __m256i odd = _mm256_set1_epi16((short)0xFF00);
    return _mm256_blendv_epi8(_mm256_and_si256(x, W8(15)), srl8x(x, 4), odd);
}

#define E8_UNFIELDSX(OFF)                                                                \
    __m256i tt = _mm256_loadu_si256((const __m256i *)(t + i));                           \
    __m256i r = _mm256_or_si256(expand_nibblesx(nib + i / 2), sll8x(expand2x(p + i / 4), 4)); \
    __m256i e = _mm256_add_epi8(_mm256_or_si256(sll8x(expand2x(k + i / 4), 6), srl8x(tt, 2)), \
                                OFF);                                                    \
    __m256i hi = _mm256_or_si256(sll8x(_mm256_and_si256(r, W8(1)), 7), srl8x(e, 1));     \
    __m256i lo = _mm256_or_si256(sll8x(_mm256_and_si256(e, W8(1)), 7),                   \
                                 sll8x(_mm256_and_si256(tt, W8(3)), 5));

AVX2 static Py_ssize_t e8_merge32_avx2(uint32_t *w, Py_ssize_t count, uint32_t off,
                                       const uint8_t *t, const uint8_t *k, const uint8_t *m1,
                                       const uint8_t *m2, const uint8_t *nib,
                                       const uint8_t *p) {
    const __m256i OFF = W8(off);
    Py_ssize_t i = 0;
    for (; i + 32 <= count; i += 32) {
        E8_UNFIELDSX(OFF)
        __m256i a = _mm256_loadu_si256((const __m256i *)(m1 + i));
        __m256i c = _mm256_loadu_si256((const __m256i *)(m2 + i));
        __m256i b0 = _mm256_or_si256(sll8x(_mm256_and_si256(c, W8(7)), 5), srl8x(r, 1));
        __m256i b1 = _mm256_or_si256(sll8x(_mm256_and_si256(a, W8(7)), 5), srl8x(c, 3));
        __m256i b2 = _mm256_or_si256(lo, srl8x(a, 3));
        __m256i l01 = _mm256_unpacklo_epi8(b0, b1), h01 = _mm256_unpackhi_epi8(b0, b1);
        __m256i l23 = _mm256_unpacklo_epi8(b2, hi), h23 = _mm256_unpackhi_epi8(b2, hi);
        /* each holds 4 elements of the low half, then the same 4 of the high half */
        __m256i q0 = _mm256_unpacklo_epi16(l01, l23), q1 = _mm256_unpackhi_epi16(l01, l23);
        __m256i q2 = _mm256_unpacklo_epi16(h01, h23), q3 = _mm256_unpackhi_epi16(h01, h23);
        _mm256_storeu_si256((__m256i *)(w + i), _mm256_permute2x128_si256(q0, q1, 0x20));
        _mm256_storeu_si256((__m256i *)(w + i + 8), _mm256_permute2x128_si256(q2, q3, 0x20));
        _mm256_storeu_si256((__m256i *)(w + i + 16), _mm256_permute2x128_si256(q0, q1, 0x31));
        _mm256_storeu_si256((__m256i *)(w + i + 24), _mm256_permute2x128_si256(q2, q3, 0x31));
    }
    return i;
}

AVX2 static Py_ssize_t e8_merge16_avx2(uint16_t *w, Py_ssize_t count, uint32_t off,
                                       const uint8_t *t, const uint8_t *k, const uint8_t *nib,
                                       const uint8_t *p) {
    const __m256i OFF = W8(off);
    Py_ssize_t i = 0;
    for (; i + 32 <= count; i += 32) {
        E8_UNFIELDSX(OFF)
        __m256i b0 = _mm256_or_si256(lo, srl8x(r, 1));
        __m256i q0 = _mm256_unpacklo_epi8(b0, hi), q1 = _mm256_unpackhi_epi8(b0, hi);
        _mm256_storeu_si256((__m256i *)(w + i), _mm256_permute2x128_si256(q0, q1, 0x20));
        _mm256_storeu_si256((__m256i *)(w + i + 16), _mm256_permute2x128_si256(q0, q1, 0x31));
    }
    return i;
}

AVX2 static inline void pack2x(__m256i x, uint8_t *dst) { /* 32 bytes <= 3 -> 8 bytes */
    __m256i z = _mm256_or_si256(x, _mm256_srli_epi32(x, 6));
    z = _mm256_or_si256(z, _mm256_srli_epi32(z, 12));
    const __m256i low_bytes = _mm256_setr_epi8(0, 4, 8, 12, -1, -1, -1, -1, -1, -1, -1, -1,
                                               -1, -1, -1, -1, 0, 4, 8, 12, -1, -1, -1, -1,
                                               -1, -1, -1, -1, -1, -1, -1, -1);
    z = _mm256_shuffle_epi8(z, low_bytes);
    uint32_t a = (uint32_t)_mm256_extract_epi32(z, 0), b = (uint32_t)_mm256_extract_epi32(z, 4);
    memcpy(dst, &a, 4);
    memcpy(dst + 4, &b, 4);
}

AVX2 static inline void pack_nibblesx(__m256i r, uint8_t *dst) { /* 32 nibbles -> 16 bytes */
    __m256i x = _mm256_and_si256(_mm256_or_si256(r, _mm256_srli_epi16(r, 4)),
                                 _mm256_set1_epi16(0xFF));
    x = _mm256_permute4x64_epi64(_mm256_packus_epi16(x, x), 0xD8);
    _mm_storeu_si128((__m128i *)dst, _mm256_castsi256_si128(x));
}

/* The fields shared by both widths, from `hi` = s e7..e1 and `lo` = e0 m_top.. bytes. */
#define E8_FIELDSX(hi, lo, OFF)                                                          \
    __m256i e = _mm256_sub_epi8(_mm256_or_si256(sll8x(hi, 1), srl8x(lo, 7)), OFF);       \
    __m256i tt = _mm256_or_si256(sll8x(_mm256_and_si256(e, W8(63)), 2),                  \
                                 _mm256_and_si256(srl8x(lo, 5), W8(3)));

AVX2 static Py_ssize_t e8_split32_avx2(const uint32_t *w, Py_ssize_t count, uint32_t off,
                                       uint8_t *t, uint8_t *k, uint8_t *m1, uint8_t *m2,
                                       uint8_t *nib, uint8_t *p) {
    const __m256i OFF = W8(off), FF = _mm256_set1_epi32(0xFF);
    const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
    Py_ssize_t i = 0;
    for (; i + 32 <= count; i += 32) {
        __m256i v[4], b[4];
        for (int j = 0; j < 4; j++)
            v[j] = _mm256_loadu_si256((const __m256i *)(w + i + 8 * j));
        for (int s = 0; s < 4; s++) {
            __m256i q[4];
            for (int j = 0; j < 4; j++)
                q[j] = _mm256_and_si256(_mm256_srli_epi32(v[j], 8 * s), FF);
            __m256i packed = _mm256_packus_epi16(_mm256_packs_epi32(q[0], q[1]),
                                                 _mm256_packs_epi32(q[2], q[3]));
            b[s] = _mm256_permutevar8x32_epi32(packed, order);
        }
        E8_FIELDSX(b[3], b[2], OFF)
        __m256i r = _mm256_or_si256(sll8x(_mm256_and_si256(b[0], W8(31)), 1), srl8x(b[3], 7));
        _mm256_storeu_si256((__m256i *)(t + i), tt);
        _mm256_storeu_si256((__m256i *)(m1 + i), _mm256_or_si256(
            sll8x(_mm256_and_si256(b[2], W8(31)), 3), srl8x(b[1], 5)));
        _mm256_storeu_si256((__m256i *)(m2 + i), _mm256_or_si256(
            sll8x(_mm256_and_si256(b[1], W8(31)), 3), srl8x(b[0], 5)));
        pack2x(srl8x(e, 6), k + i / 4);
        pack2x(srl8x(r, 4), p + i / 4);
        pack_nibblesx(_mm256_and_si256(r, W8(15)), nib + i / 2);
    }
    return i;
}

AVX2 static Py_ssize_t e8_split16_avx2(const uint16_t *w, Py_ssize_t count, uint32_t off,
                                       uint8_t *t, uint8_t *k, uint8_t *nib, uint8_t *p) {
    const __m256i OFF = W8(off), FF = _mm256_set1_epi16(0xFF);
    Py_ssize_t i = 0;
    for (; i + 32 <= count; i += 32) {
        __m256i v0 = _mm256_loadu_si256((const __m256i *)(w + i));
        __m256i v1 = _mm256_loadu_si256((const __m256i *)(w + i + 16));
        __m256i lo = _mm256_permute4x64_epi64(
            _mm256_packus_epi16(_mm256_and_si256(v0, FF), _mm256_and_si256(v1, FF)), 0xD8);
        __m256i hi = _mm256_permute4x64_epi64(
            _mm256_packus_epi16(_mm256_srli_epi16(v0, 8), _mm256_srli_epi16(v1, 8)), 0xD8);
        E8_FIELDSX(hi, lo, OFF)
        __m256i r = _mm256_or_si256(sll8x(_mm256_and_si256(lo, W8(31)), 1), srl8x(hi, 7));
        _mm256_storeu_si256((__m256i *)(t + i), tt);
        pack2x(srl8x(e, 6), k + i / 4);
        pack2x(srl8x(r, 4), p + i / 4);
        pack_nibblesx(_mm256_and_si256(r, W8(15)), nib + i / 2);
    }
    return i;
}
#endif

static Py_ssize_t e8_split32_simd(const uint32_t *w, Py_ssize_t count, uint32_t off,
                                  uint8_t *t, uint8_t *k, uint8_t *m1, uint8_t *m2,
                                  uint8_t *nib, uint8_t *p) {
    Py_ssize_t done = 0;
#ifdef HAVE_AVX2_DISPATCH
    if (use_avx2)
        done = e8_split32_avx2(w, count, off, t, k, m1, m2, nib, p);
#endif
    return done + e8_split32_sse2(w + done, count - done, off, t + done, k + done / 4,
                                  m1 + done, m2 + done, nib + done / 2, p + done / 4);
}

static Py_ssize_t e8_split16_simd(const uint16_t *w, Py_ssize_t count, uint32_t off,
                                  uint8_t *t, uint8_t *k, uint8_t *m1, uint8_t *m2,
                                  uint8_t *nib, uint8_t *p) {
    Py_ssize_t done = 0;
#ifdef HAVE_AVX2_DISPATCH
    if (use_avx2)
        done = e8_split16_avx2(w, count, off, t, k, nib, p);
#endif
    return done + e8_split16_sse2(w + done, count - done, off, t + done, k + done / 4, m1,
                                  m2, nib + done / 2, p + done / 4);
}

#ifdef HAVE_AVX2_DISPATCH
/* AVX-512 (BW and VBMI) versions of the merge loops, 64 elements at a time, used when
 * the CPU has them: whole-register byte permutes (vpermb, vpermt2b/w) spread the packed
 * fields and interleave the output bytes, so no lane fix-ups are needed. */
static int use_avx512;
#define AVX512 __attribute__((target("avx512f,avx512bw,avx512vbmi")))
#define Z8(v) _mm512_set1_epi8((char)(v))
static uint8_t idx_half[64], idx_quarter[64], idx_pairs_lo[64], idx_pairs_hi[64];
static uint16_t idx_words_lo[32], idx_words_hi[32];

static void avx512_tables_init(void) {
    for (int j = 0; j < 64; j++) {
        idx_half[j] = (uint8_t)(j / 2);
        idx_quarter[j] = (uint8_t)(j / 4);
        /* bytes of elements 0-31 (lo) or 32-63 (hi) of two sources, alternating */
        idx_pairs_lo[j] = (uint8_t)(j / 2 + (j % 2 ? 64 : 0));
        idx_pairs_hi[j] = (uint8_t)(32 + j / 2 + (j % 2 ? 64 : 0));
    }
    for (int j = 0; j < 32; j++) { /* 16-bit pairs of elements 0-15 (lo) or 16-31 (hi) */
        idx_words_lo[j] = (uint16_t)(j / 2 + (j % 2 ? 32 : 0));
        idx_words_hi[j] = (uint16_t)(16 + j / 2 + (j % 2 ? 32 : 0));
    }
}

AVX512 static inline __m512i srl8z(__m512i x, int n) {
    return _mm512_and_si512(_mm512_srli_epi16(x, (unsigned)n), Z8(0xFF >> n));
}
AVX512 static inline __m512i sll8z(__m512i x, int n) {
    return _mm512_and_si512(_mm512_slli_epi16(x, (unsigned)n), Z8((0xFF << n) & 0xFF));
}
AVX512 static inline __m512i expand2z(const uint8_t *src) { /* 16 bytes of 2-bit fields -> 64 */
    __m512i x = _mm512_permutexvar_epi8(_mm512_loadu_si512(idx_quarter),
                                        _mm512_castsi128_si512(_mm_loadu_si128((const __m128i *)src)));
    __mmask64 b0 = _mm512_test_epi8_mask(x, _mm512_set1_epi32(0x40100401));
    __mmask64 b1 = _mm512_test_epi8_mask(x, _mm512_set1_epi32((int)0x80200802u));
    return _mm512_or_si512(_mm512_maskz_mov_epi8(b0, Z8(1)), _mm512_maskz_mov_epi8(b1, Z8(2)));
}
AVX512 static inline __m512i expand_nibz(const uint8_t *src) { /* 32 bytes -> 64 nibbles */
    __m512i x = _mm512_permutexvar_epi8(_mm512_loadu_si512(idx_half),
                                        _mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)src)));
    return _mm512_mask_blend_epi8(0xAAAAAAAAAAAAAAAAull, _mm512_and_si512(x, Z8(15)), srl8z(x, 4));
}

#define E8_UNFIELDSZ(OFF)                                                                \
    __m512i tt = _mm512_loadu_si512(t + i);                                              \
    __m512i r = _mm512_or_si512(expand_nibz(nib + i / 2), sll8z(expand2z(p + i / 4), 4)); \
    __m512i e = _mm512_add_epi8(_mm512_or_si512(sll8z(expand2z(k + i / 4), 6), srl8z(tt, 2)), \
                                OFF);                                                    \
    __m512i hi = _mm512_or_si512(sll8z(_mm512_and_si512(r, Z8(1)), 7), srl8z(e, 1));     \
    __m512i lo = _mm512_or_si512(sll8z(_mm512_and_si512(e, Z8(1)), 7),                   \
                                 sll8z(_mm512_and_si512(tt, Z8(3)), 5));

AVX512 static Py_ssize_t e8_merge32_avx512(uint32_t *w, Py_ssize_t count, uint32_t off,
                                           const uint8_t *t, const uint8_t *k,
                                           const uint8_t *m1, const uint8_t *m2,
                                           const uint8_t *nib, const uint8_t *p) {
    const __m512i OFF = Z8(off);
    const __m512i plo = _mm512_loadu_si512(idx_pairs_lo), phi = _mm512_loadu_si512(idx_pairs_hi);
    const __m512i wlo = _mm512_loadu_si512(idx_words_lo), whi = _mm512_loadu_si512(idx_words_hi);
    Py_ssize_t i = 0;
    for (; i + 64 <= count; i += 64) {
        E8_UNFIELDSZ(OFF)
        __m512i a = _mm512_loadu_si512(m1 + i), c = _mm512_loadu_si512(m2 + i);
        __m512i b0 = _mm512_or_si512(sll8z(_mm512_and_si512(c, Z8(7)), 5), srl8z(r, 1));
        __m512i b1 = _mm512_or_si512(sll8z(_mm512_and_si512(a, Z8(7)), 5), srl8z(c, 3));
        __m512i b2 = _mm512_or_si512(lo, srl8z(a, 3));
        __m512i p01l = _mm512_permutex2var_epi8(b0, plo, b1), p01h = _mm512_permutex2var_epi8(b0, phi, b1);
        __m512i p23l = _mm512_permutex2var_epi8(b2, plo, hi), p23h = _mm512_permutex2var_epi8(b2, phi, hi);
        _mm512_storeu_si512(w + i, _mm512_permutex2var_epi16(p01l, wlo, p23l));
        _mm512_storeu_si512(w + i + 16, _mm512_permutex2var_epi16(p01l, whi, p23l));
        _mm512_storeu_si512(w + i + 32, _mm512_permutex2var_epi16(p01h, wlo, p23h));
        _mm512_storeu_si512(w + i + 48, _mm512_permutex2var_epi16(p01h, whi, p23h));
    }
    return i;
}

AVX512 static Py_ssize_t e8_merge16_avx512(uint16_t *w, Py_ssize_t count, uint32_t off,
                                           const uint8_t *t, const uint8_t *k,
                                           const uint8_t *nib, const uint8_t *p) {
    const __m512i OFF = Z8(off);
    const __m512i plo = _mm512_loadu_si512(idx_pairs_lo), phi = _mm512_loadu_si512(idx_pairs_hi);
    Py_ssize_t i = 0;
    for (; i + 64 <= count; i += 64) {
        E8_UNFIELDSZ(OFF)
        __m512i b0 = _mm512_or_si512(lo, srl8z(r, 1));
        _mm512_storeu_si512(w + i, _mm512_permutex2var_epi8(b0, plo, hi));
        _mm512_storeu_si512(w + i + 32, _mm512_permutex2var_epi8(b0, phi, hi));
    }
    return i;
}
#endif

static Py_ssize_t e8_merge32_simd(uint32_t *w, Py_ssize_t count, uint32_t off,
                                  const uint8_t *t, const uint8_t *k, const uint8_t *m1,
                                  const uint8_t *m2, const uint8_t *nib, const uint8_t *p) {
    Py_ssize_t done = 0;
#ifdef HAVE_AVX2_DISPATCH
    if (use_avx512)
        done = e8_merge32_avx512(w, count, off, t, k, m1, m2, nib, p);
    if (use_avx2)
        done += e8_merge32_avx2(w + done, count - done, off, t + done, k + done / 4,
                                m1 + done, m2 + done, nib + done / 2, p + done / 4);
#endif
    return done + e8_merge32_sse2(w + done, count - done, off, t + done, k + done / 4,
                                  m1 + done, m2 + done, nib + done / 2, p + done / 4);
}

static Py_ssize_t e8_merge16_simd(uint16_t *w, Py_ssize_t count, uint32_t off,
                                  const uint8_t *t, const uint8_t *k, const uint8_t *m1,
                                  const uint8_t *m2, const uint8_t *nib, const uint8_t *p) {
    Py_ssize_t done = 0;
#ifdef HAVE_AVX2_DISPATCH
    if (use_avx512)
        done = e8_merge16_avx512(w, count, off, t, k, nib, p);
    if (use_avx2)
        done += e8_merge16_avx2(w + done, count - done, off, t + done, k + done / 4,
                                nib + done / 2, p + done / 4);
#endif
    return done + e8_merge16_sse2(w + done, count - done, off, t + done, k + done / 4, m1,
                                  m2, nib + done / 2, p + done / 4);
}

#define E8_SPLIT(NAME, OFFSET, WORD, BITS, MB)                                           \
    static void NAME##_chunk(const WORD *restrict w, Py_ssize_t count, uint32_t off,     \
                             uint8_t *restrict t, uint8_t *restrict k,                   \
                             uint8_t *restrict m1, uint8_t *restrict m2,                 \
                             uint8_t *restrict nib, uint8_t *restrict p) {               \
        uint8_t kf[CHUNK], rf[CHUNK], rhi[CHUNK];                                        \
        Py_ssize_t done = NAME##_simd(w, count, off, t, k, m1, m2, nib, p);              \
        w += done, t += done, k += done / 4, nib += done / 2, p += done / 4;             \
        if (BITS == 32)                                                                  \
            m1 += done, m2 += done;                                                      \
        count -= done;                                                                   \
        for (Py_ssize_t i = 0; i < count; i++) {                                         \
            uint32_t x = w[i];                                                           \
            uint32_t e = ((x >> MB) - off) & 0xFFu;                                      \
            uint32_t man = x & ((1u << MB) - 1u);                                        \
            uint32_t r = ((man & 31u) << 1) | (x >> (BITS - 1));                         \
            t[i] = (uint8_t)(((e & 63u) << 2) | (man >> (MB - 2)));                      \
            kf[i] = (uint8_t)(e >> 6);                                                   \
            rf[i] = (uint8_t)(r & 15u);                                                  \
            rhi[i] = (uint8_t)(r >> 4);                                                  \
            if (BITS == 32) {                                                            \
                m1[i] = (uint8_t)(man >> 13);                                            \
                m2[i] = (uint8_t)(man >> 5);                                             \
            }                                                                            \
        }                                                                                \
        for (Py_ssize_t g = 0; g < count / 4; g++) {                                     \
            k[g] = pack4x2(kf + 4 * g);                                                  \
            p[g] = pack4x2(rhi + 4 * g);                                                 \
        }                                                                                \
        for (Py_ssize_t h = 0; h < count / 2; h++)                                       \
            nib[h] = (uint8_t)(rf[2 * h] | (rf[2 * h + 1] << 4));                        \
    }                                                                                    \
    static void NAME(const uint8_t *src, e8_streams *s) {                                \
        uint32_t off = OFFSET(src, s->n);                                                \
        Py_ssize_t m2_at = 4 * s->g;                                                     \
        s->k[0] = (uint8_t)off;                                                          \
        for (Py_ssize_t c = 0; c < s->n; c += CHUNK) {                                   \
            Py_ssize_t count = s->n - c < CHUNK ? s->n - c : CHUNK;                      \
            WORD padded[CHUNK];                                                          \
            const WORD *w = (const WORD *)(src + (size_t)c * sizeof(WORD));              \
            if (count % 4 || ((uintptr_t)w % sizeof(WORD))) {                            \
                memset(padded, 0, sizeof(padded));                                       \
                memcpy(padded, w, (size_t)count * sizeof(WORD));                         \
                w = padded;                                                              \
                count = (count + 3) / 4 * 4;                                             \
            }                                                                            \
            NAME##_chunk(w, count, off, s->t + c, s->k + 1 + c / 4,                      \
                         BITS == 32 ? s->m + c : NULL,                                   \
                         BITS == 32 ? s->m + m2_at + c : NULL, s->nib + c / 2,           \
                         s->p + c / 4);                                                  \
        }                                                                                \
    }

#define E8_MERGE(NAME, WORD, BITS, MB)                                                   \
    static void NAME##_chunk(WORD *restrict w, Py_ssize_t count, uint32_t off,           \
                             const uint8_t *restrict t, const uint8_t *restrict k,       \
                             const uint8_t *restrict m1, const uint8_t *restrict m2,     \
                             const uint8_t *restrict nib, const uint8_t *restrict p) {   \
        uint8_t kf[CHUNK], rf[CHUNK];                                                    \
        Py_ssize_t done = NAME##_simd(w, count, off, t, k, m1, m2, nib, p);              \
        w += done, t += done, k += done / 4, nib += done / 2, p += done / 4;             \
        if (BITS == 32)                                                                  \
            m1 += done, m2 += done;                                                      \
        count -= done;                                                                   \
        for (Py_ssize_t g = 0; g < count / 4; g++) {                                     \
            uint32_t kw = unpack4x2(k[g]);                                               \
            uint32_t lo = (uint32_t)nib[2 * g] | ((uint32_t)nib[2 * g + 1] << 16);       \
            uint32_t rw = ((lo & 0x000F000Fu) | ((lo & 0x00F000F0u) << 4))               \
                          | (unpack4x2(p[g]) << 4);                                      \
            memcpy(kf + 4 * g, &kw, 4);                                                  \
            memcpy(rf + 4 * g, &rw, 4);                                                  \
        }                                                                                \
        for (Py_ssize_t i = 0; i < count; i++) {                                         \
            uint32_t tb = t[i], r = rf[i];                                               \
            uint32_t e = ((((uint32_t)kf[i] << 6) | (tb >> 2)) + off) & 0xFFu;           \
            uint32_t man = ((tb & 3u) << (MB - 2)) | (r >> 1);                           \
            if (BITS == 32)                                                              \
                man |= ((uint32_t)m1[i] << 13) | ((uint32_t)m2[i] << 5);                 \
            w[i] = (WORD)(((r & 1u) << (BITS - 1)) | (e << MB) | man);                   \
        }                                                                                \
    }                                                                                    \
    static void NAME(const e8_streams *s, uint8_t *dst) {                                \
        uint32_t off = s->k[0];                                                          \
        Py_ssize_t m2_at = 4 * s->g;                                                     \
        for (Py_ssize_t c = 0; c < s->n; c += CHUNK) {                                   \
            Py_ssize_t count = s->n - c < CHUNK ? s->n - c : CHUNK;                      \
            WORD *out = (WORD *)(dst + (size_t)c * sizeof(WORD)), padded[CHUNK];         \
            int direct = count % 4 == 0 && (uintptr_t)out % sizeof(WORD) == 0;           \
            NAME##_chunk(direct ? out : padded, (count + 3) / 4 * 4, off, s->t + c,      \
                         s->k + 1 + c / 4, BITS == 32 ? s->m + c : NULL,                 \
                         BITS == 32 ? s->m + m2_at + c : NULL, s->nib + c / 2,           \
                         s->p + c / 4);                                                  \
            if (!direct)                                                                 \
                memcpy(out, padded, (size_t)count * sizeof(WORD));                       \
        }                                                                                \
    }

E8_OFFSET(e8_offset16, uint16_t, 7)
E8_OFFSET(e8_offset32, uint32_t, 23)
E8_SPLIT(e8_split16, e8_offset16, uint16_t, 16, 7)
E8_SPLIT(e8_split32, e8_offset32, uint32_t, 32, 23)
E8_MERGE(e8_merge16, uint16_t, 16, 7)
E8_MERGE(e8_merge32, uint32_t, 32, 23)

/* ---- byte grouping, each element rotated left by `rotation` bits first ---- */

#define ROTL(WORD, BITS, w, k) ((k) ? (WORD)(((w) << (k)) | ((w) >> ((BITS) - (k)))) : (w))
#define ROTR(WORD, BITS, w, k) ((k) ? (WORD)(((w) >> (k)) | ((w) << ((BITS) - (k)))) : (w))

#define GROUP(NAME, WORD, BITS)                                                          \
    static void NAME##_split(const uint8_t *src, Py_ssize_t n, int k, uint8_t *out) {     \
        for (Py_ssize_t i = 0; i < n; i++) {                                             \
            WORD w;                                                                      \
            memcpy(&w, src + (size_t)i * sizeof(WORD), sizeof(WORD));                    \
            w = ROTL(WORD, BITS, w, k);                                                  \
            for (int b = 0; b < (int)sizeof(WORD); b++)                                  \
                out[(size_t)b * n + i] = (uint8_t)(w >> (8 * b));                        \
        }                                                                                \
    }                                                                                    \
    static void NAME##_merge(const uint8_t *const *streams, Py_ssize_t n, int k,         \
                             uint8_t *dst) {                                             \
        for (Py_ssize_t i = 0; i < n; i++) {                                             \
            WORD w = 0;                                                                  \
            for (int b = 0; b < (int)sizeof(WORD); b++)                                  \
                w |= (WORD)((WORD)streams[b][i] << (8 * b));                             \
            w = ROTR(WORD, BITS, w, k);                                                  \
            memcpy(dst + (size_t)i * sizeof(WORD), &w, sizeof(WORD));                    \
        }                                                                                \
    }

GROUP(group16, uint16_t, 16)
GROUP(group32, uint32_t, 32)
GROUP(group64, uint64_t, 64)


/* ---- crc32 (zlib's: reflected polynomial 0xEDB88320), folded with carry-less multiply ----
 * The method of Gopal et al., "Fast CRC Computation for Generic Polynomials Using
 * PCLMULQDQ Instruction" (Intel, 2009): four 128-bit lanes are folded forward 512 bits at
 * a time, then into one lane, to 64 bits and by Barrett reduction to 32. The constants
 * are powers of x modulo the polynomial, bit-reflected, as given there. Buffers shorter
 * than 64 bytes and the last len % 16 bytes go through a byte table. */
static uint32_t crc_table[256];

static void crc_table_init(void) {
    for (uint32_t n = 0; n < 256; n++) {
        uint32_t c = n;
        for (int k = 0; k < 8; k++)
            c = c & 1 ? 0xEDB88320u ^ (c >> 1) : c >> 1;
        crc_table[n] = c;
    }
}

/* `state` is the inverted crc (the shift register), as is the result. */
static uint32_t crc_bytes(uint32_t state, const uint8_t *buf, size_t len) {
    for (size_t i = 0; i < len; i++)
        state = crc_table[(state ^ buf[i]) & 0xFF] ^ (state >> 8);
    return state;
}

#ifdef HAVE_AVX2_DISPATCH
static int use_clmul;
#define CLMUL __attribute__((target("pclmul,sse4.1")))

CLMUL static inline __m128i fold(__m128i acc, __m128i k, __m128i next) {
    return _mm_xor_si128(_mm_xor_si128(_mm_clmulepi64_si128(acc, k, 0x00),
                                       _mm_clmulepi64_si128(acc, k, 0x11)), next);
}

/* Folds the 16-byte blocks of buf (len a multiple of 16) into acc, then reduces it to
 * the 32-bit state. */
CLMUL static uint32_t crc_reduce(__m128i acc, const uint8_t *buf, size_t len) {
    const __m128i k3k4 = _mm_set_epi64x(0x0ccaa009e, 0x1751997d0);
    const __m128i k5 = _mm_set_epi64x(0, 0x163cd6124);
    const __m128i poly = _mm_set_epi64x(0x1f7011641, 0x1db710641);
    const __m128i low32 = _mm_setr_epi32(-1, 0, -1, 0);
    size_t pos = 0;
    for (; pos + 16 <= len; pos += 16)
        acc = fold(acc, k3k4, _mm_loadu_si128((const __m128i *)(buf + pos)));
    /* 128 -> 64 bits */
    __m128i t = _mm_clmulepi64_si128(acc, k3k4, 0x10);
    acc = _mm_xor_si128(_mm_srli_si128(acc, 8), t);
    t = _mm_srli_si128(acc, 4);
    acc = _mm_xor_si128(_mm_clmulepi64_si128(_mm_and_si128(acc, low32), k5, 0x00), t);
    /* Barrett reduction to 32 bits */
    t = _mm_clmulepi64_si128(_mm_and_si128(acc, low32), poly, 0x10);
    t = _mm_clmulepi64_si128(_mm_and_si128(t, low32), poly, 0x00);
    return (uint32_t)_mm_extract_epi32(_mm_xor_si128(acc, t), 1);
}

/* len >= 64 and a multiple of 16. */
CLMUL static uint32_t crc_clmul(uint32_t state, const uint8_t *buf, size_t len) {
    const __m128i k1k2 = _mm_set_epi64x(0x1c6e41596, 0x154442bd4);
    const __m128i k3k4 = _mm_set_epi64x(0x0ccaa009e, 0x1751997d0);
    __m128i x[4];
    for (int j = 0; j < 4; j++)
        x[j] = _mm_loadu_si128((const __m128i *)(buf + 16 * j));
    x[0] = _mm_xor_si128(x[0], _mm_cvtsi32_si128((int)state));
    size_t pos = 64;
    for (; pos + 64 <= len; pos += 64)
        for (int j = 0; j < 4; j++)
            x[j] = fold(x[j], k1k2, _mm_loadu_si128((const __m128i *)(buf + pos + 16 * j)));
    __m128i acc = x[0];
    for (int j = 1; j < 4; j++)
        acc = fold(acc, k3k4, x[j]);
    return crc_reduce(acc, buf + pos, len - pos);
}

/* The same fold, 8 lanes of 128 bits at a time with 256-bit carry-less multiplies
 * (VPCLMULQDQ), 1024 bits forward per step; the lanes are then folded into one in order
 * as above. Constants: x^(1024+32) and x^(1024-32) mod P, bit-reflected, shifted by 1
 * (computed the way the 512-bit ones above are). len >= 128 and a multiple of 16. */
static int use_vpclmul;
#define VPCLMUL __attribute__((target("avx2,vpclmulqdq,pclmul,sse4.1")))

VPCLMUL static uint32_t crc_vpclmul(uint32_t state, const uint8_t *buf, size_t len) {
    const __m256i k8 = _mm256_set_epi64x(0x14a7fe880, 0x1e88ef372, 0x14a7fe880, 0x1e88ef372);
    const __m128i k3k4 = _mm_set_epi64x(0x0ccaa009e, 0x1751997d0);
    __m256i x[4];
    for (int j = 0; j < 4; j++)
        x[j] = _mm256_loadu_si256((const __m256i *)(buf + 32 * j));
    x[0] = _mm256_xor_si256(x[0], _mm256_zextsi128_si256(_mm_cvtsi32_si128((int)state)));
    size_t pos = 128;
    for (; pos + 128 <= len; pos += 128)
        for (int j = 0; j < 4; j++)
            x[j] = _mm256_xor_si256(
                _mm256_xor_si256(_mm256_clmulepi64_epi128(x[j], k8, 0x00),
                                 _mm256_clmulepi64_epi128(x[j], k8, 0x11)),
                _mm256_loadu_si256((const __m256i *)(buf + pos + 32 * j)));
    __m128i acc = _mm256_castsi256_si128(x[0]);
    acc = fold(acc, k3k4, _mm256_extracti128_si256(x[0], 1));
    for (int j = 1; j < 4; j++) {
        acc = fold(acc, k3k4, _mm256_castsi256_si128(x[j]));
        acc = fold(acc, k3k4, _mm256_extracti128_si256(x[j], 1));
    }
    return crc_reduce(acc, buf + pos, len - pos);
}
#endif

static uint32_t crc32_update(uint32_t crc, const uint8_t *buf, size_t len) {
    uint32_t state = ~crc;
#ifdef HAVE_AVX2_DISPATCH
    if (use_clmul && len >= 64) {
        size_t bulk = len & ~(size_t)15;
        state = use_vpclmul && bulk >= 128 ? crc_vpclmul(state, buf, bulk)
                                           : crc_clmul(state, buf, bulk);
        buf += bulk;
        len -= bulk;
    }
#endif
    return ~crc_bytes(state, buf, len);
}

static PyObject *py_crc32(PyObject *self, PyObject *args) {
    Py_buffer data;
    unsigned int value = 0;
    if (!PyArg_ParseTuple(args, "y*|I", &data, &value))
        return NULL;
    uint32_t crc;
    Py_BEGIN_ALLOW_THREADS
    crc = crc32_update(value, (const uint8_t *)data.buf, (size_t)data.len);
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&data);
    return PyLong_FromUnsignedLong(crc);
}

/* ---- Huffman coding of one byte stream (the planar split's exponent stream T) ----
 * Stored form: table log L (1 byte, <= HUF_MAX_BITS) | 256 code lengths, 4 bits each,
 * symbol 2i in the low nibble of byte i (0: absent) | byte length of each of HUF_LANES
 * bit streams (u32 LE each) | the bit streams. Lane j codes the symbols [n*j/4, n*(j+1)/4)
 * of the stream, least significant bit first; codes are canonical (shorter codes first,
 * then by symbol), stored bit-reversed so that the decoder indexes its table with the
 * next L bits as they come. The code is complete (Kraft sum exactly 1).
 *
 * Why not zstd's Huffman literals: its decoder here emits one symbol per table lookup
 * from 4 streams at ~1.1 GB/s, the largest cost of decode. This decoder looks up L = 12
 * bits at a time and emits every whole code they hold (up to 3; ~2.6 for the exponent
 * streams of trained weights), from 4 independent lanes. */

#define HUF_MAX_BITS 12
#define HUF_LANES 4
#define HUF_HEADER (1 + 128 + 4 * HUF_LANES)

static inline uint64_t load64le(const uint8_t *p) {
    uint64_t v;
    memcpy(&v, p, 8);
    return v;
}

/* Code lengths of a Huffman code for `freq` (symbols with freq 0 get 0), at most
 * HUF_MAX_BITS bits: lengths are computed unbounded, the levels deeper than the limit
 * are folded into it, and the Kraft sum is restored by lengthening the codes of the
 * deepest level that has room, one at a time; lengths are then handed out again in
 * order of frequency. At least two symbols get a code (a lone symbol gets a partner). */
static void huf_lengths(const uint64_t *freq, uint8_t *len) {
    int sym[256], m = 0;
    memset(len, 0, 256);
    for (int s = 0; s < 256; s++)
        if (freq[s])
            sym[m++] = s;
    if (m == 0)
        sym[m++] = 0;
    if (m == 1) {
        len[sym[0]] = len[(sym[0] + 1) & 255] = 1;
        return;
    }
    /* sort by frequency, ascending (insertion sort: at most 256 symbols) */
    for (int i = 1; i < m; i++) {
        int s = sym[i], j = i;
        while (j > 0 && freq[sym[j - 1]] > freq[s]) {
            sym[j] = sym[j - 1];
            j--;
        }
        sym[j] = s;
    }
    /* two-queue construction: leaves 0..m-1, internal nodes m..2m-2 in creation order */
    uint64_t w[512];
    int parent[512];
    for (int i = 0; i < m; i++)
        w[i] = freq[sym[i]];
    int leaf = 0, node = m, next = m;
    for (; next < 2 * m - 1; next++) {
        int pick[2];
        for (int k = 0; k < 2; k++) {
            if (leaf < m && (node >= next || w[leaf] <= w[node]))
                pick[k] = leaf++;
            else
                pick[k] = node++;
        }
        w[next] = w[pick[0]] + w[pick[1]];
        parent[pick[0]] = parent[pick[1]] = next;
    }
    int depth[512], count[256] = {0};
    depth[2 * m - 2] = 0;
    for (int i = 2 * m - 3; i >= 0; i--)
        depth[i] = depth[parent[i]] + 1;
    for (int i = 0; i < m; i++)
        count[depth[i] < HUF_MAX_BITS ? depth[i] : HUF_MAX_BITS]++;
    uint32_t kraft = 0;
    for (int l = 1; l <= HUF_MAX_BITS; l++)
        kraft += (uint32_t)count[l] << (HUF_MAX_BITS - l);
    while (kraft > (1u << HUF_MAX_BITS)) {
        /* move one code from the deepest level to the next below a shallower code */
        count[HUF_MAX_BITS]--;
        for (int l = HUF_MAX_BITS - 1; l > 0; l--) {
            if (count[l]) {
                count[l]--;
                count[l + 1] += 2;
                break;
            }
        }
        kraft--;
    }
    /* longest codes to the least frequent symbols */
    int i = 0;
    for (int l = HUF_MAX_BITS; l >= 1; l--)
        for (int c = 0; c < count[l]; c++)
            len[sym[i++]] = (uint8_t)l;
}

/* Canonical codes, bit-reversed (first bit in the least significant place). Returns 0,
 * or -1 when the lengths do not form a complete code of at most HUF_MAX_BITS bits. */
static int huf_codes(const uint8_t *len, uint16_t *code) {
    int count[HUF_MAX_BITS + 1] = {0};
    for (int s = 0; s < 256; s++) {
        if (len[s] > HUF_MAX_BITS)
            return -1;
        count[len[s]]++;
    }
    count[0] = 0;
    uint32_t kraft = 0, next[HUF_MAX_BITS + 2], c = 0;
    for (int l = 1; l <= HUF_MAX_BITS; l++) {
        kraft += (uint32_t)count[l] << (HUF_MAX_BITS - l);
        c = (c + (l > 1 ? (uint32_t)count[l - 1] : 0)) << (l > 1 ? 1 : 0);
        next[l] = c;
    }
    if (kraft != (1u << HUF_MAX_BITS))
        return -1;
    for (int s = 0; s < 256; s++) {
        int l = len[s];
        if (!l) {
            code[s] = 0;
            continue;
        }
        uint32_t v = next[l]++, r = 0;
        for (int b = 0; b < l; b++)
            r |= ((v >> b) & 1u) << (l - 1 - b);
        code[s] = (uint16_t)r;
    }
    return 0;
}

static void huf_histogram(const uint8_t *src, Py_ssize_t n, uint64_t *freq) {
    uint32_t h[4][256] = {{0}};
    Py_ssize_t i = 0;
    for (; i + 4 <= n; i += 4) {
        h[0][src[i]]++;
        h[1][src[i + 1]]++;
        h[2][src[i + 2]]++;
        h[3][src[i + 3]]++;
        if (((i + 4) & 0x3FFFFFF) == 0) /* keep the 32-bit counts from overflowing */
            for (int s = 0; s < 256; s++) {
                freq[s] += (uint64_t)h[0][s] + h[1][s] + h[2][s] + h[3][s];
                h[0][s] = h[1][s] = h[2][s] = h[3][s] = 0;
            }
    }
    for (; i < n; i++)
        h[0][src[i]]++;
    for (int s = 0; s < 256; s++)
        freq[s] += (uint64_t)h[0][s] + h[1][s] + h[2][s] + h[3][s];
}

/* Bytes one lane of n symbols may take while it is written (<= 12 bits a symbol, plus
 * the 8-byte stores' slack). */
static Py_ssize_t huf_lane_bound(Py_ssize_t n) {
    return (n * HUF_MAX_BITS + 7) / 8 + 16;
}

static Py_ssize_t huf_bound(Py_ssize_t n) {
    return HUF_HEADER + HUF_LANES * huf_lane_bound(n / HUF_LANES + 1);
}

/* A bit writer: `bits` (< 8 after a flush) pending bits in `acc`, flushed to `dst`. */
typedef struct {
    uint64_t acc;
    unsigned bits;
    uint8_t *dst;
} huf_writer;

#define HUF_PUT(wr, c)                                                                   \
    do {                                                                                 \
        uint32_t c_ = (c);                                                               \
        (wr).acc |= (uint64_t)(c_ & 0xFFFF) << (wr).bits;                                \
        (wr).bits += c_ >> 16;                                                           \
    } while (0)
/* Stores 8 bytes and advances by the whole bytes written, without branches. */
#define HUF_FLUSH(wr)                                                                    \
    do {                                                                                 \
        memcpy((wr).dst, &(wr).acc, 8);                                                  \
        (wr).dst += (wr).bits >> 3;                                                      \
        (wr).acc >>= (wr).bits & ~7u; /* bits <= 55 */                                   \
        (wr).bits &= 7;                                                                  \
    } while (0)

/* The first `count` symbols (a multiple of 4) of two lanes, 4 of each between flushes
 * (<= 48 bits on top of < 8 pending): two independent chains, few enough registers
 * (4 lanes at once spilled them). */
#define HUF_PUT_PAIR(NAME, ATTR)                                                         \
    ATTR static void NAME(const uint32_t *cl, const uint8_t *s0, const uint8_t *s1,      \
                          Py_ssize_t count, huf_writer *wa, huf_writer *wb) {            \
        huf_writer w0 = *wa, w1 = *wb;                                                   \
        for (Py_ssize_t i = 0; i < count; i += 4) {                                      \
            HUF_PUT(w0, cl[s0[i]]);                                                      \
            HUF_PUT(w1, cl[s1[i]]);                                                      \
            HUF_PUT(w0, cl[s0[i + 1]]);                                                  \
            HUF_PUT(w1, cl[s1[i + 1]]);                                                  \
            HUF_PUT(w0, cl[s0[i + 2]]);                                                  \
            HUF_PUT(w1, cl[s1[i + 2]]);                                                  \
            HUF_PUT(w0, cl[s0[i + 3]]);                                                  \
            HUF_PUT(w1, cl[s1[i + 3]]);                                                  \
            HUF_FLUSH(w0);                                                               \
            HUF_FLUSH(w1);                                                               \
        }                                                                                \
        *wa = w0, *wb = w1;                                                              \
    }

#ifdef HAVE_AVX2_DISPATCH
static int use_bmi2;
HUF_PUT_PAIR(huf_put_bmi2, __attribute__((target("bmi2"))))
#endif
HUF_PUT_PAIR(huf_put_plain, )

/* Writes the coded stream to `out` (huf_bound(n) bytes); returns its length. The lanes
 * are written together, 4 symbols of each between flushes (<= 48 bits on top of < 8
 * pending), each into its own region of `out`; the regions are then closed up. */
static Py_ssize_t huf_encode(const uint8_t *src, Py_ssize_t n, const uint8_t *len,
                             uint8_t *out) {
    uint16_t code[256];
    uint32_t cl[256]; /* code | length << 16 */
    huf_codes(len, code);
    for (int s = 0; s < 256; s++)
        cl[s] = code[s] | (uint32_t)len[s] << 16;
    out[0] = HUF_MAX_BITS;
    for (int i = 0; i < 128; i++)
        out[1 + i] = (uint8_t)(len[2 * i] | (len[2 * i + 1] << 4));
    huf_writer wr[HUF_LANES];
    const uint8_t *lane_src[HUF_LANES];
    Py_ssize_t lane_n[HUF_LANES], common = n;
    uint8_t *region = out + HUF_HEADER;
    for (int j = 0; j < HUF_LANES; j++) {
        Py_ssize_t lo = n * j / HUF_LANES, hi = n * (j + 1) / HUF_LANES;
        lane_src[j] = src + lo;
        lane_n[j] = hi - lo;
        common = lane_n[j] < common ? lane_n[j] : common;
        wr[j] = (huf_writer){0, 0, region};
        region += huf_lane_bound(hi - lo);
    }
    Py_ssize_t i = common / 4 * 4;
    for (int j = 0; j < HUF_LANES; j += 2) {
#ifdef HAVE_AVX2_DISPATCH
        if (use_bmi2)
            huf_put_bmi2(cl, lane_src[j], lane_src[j + 1], i, &wr[j], &wr[j + 1]);
        else
#endif
            huf_put_plain(cl, lane_src[j], lane_src[j + 1], i, &wr[j], &wr[j + 1]);
    }
    uint8_t *dst = out + HUF_HEADER;
    for (int j = 0; j < HUF_LANES; j++) {
        for (Py_ssize_t r = i; r < lane_n[j]; r++) {
            HUF_PUT(wr[j], cl[lane_src[j][r]]);
            if (wr[j].bits >= 32)
                HUF_FLUSH(wr[j]);
        }
        HUF_FLUSH(wr[j]);
        if (wr[j].bits)
            wr[j].dst++;
        uint8_t *start = out + HUF_HEADER;
        for (int q = 0; q < j; q++)
            start += huf_lane_bound(lane_n[q]);
        uint32_t lane_len = (uint32_t)(wr[j].dst - start);
        memmove(dst, start, lane_len);
        dst += lane_len;
        memcpy(out + 1 + 128 + 4 * j, &lane_len, 4);
    }
    return dst - out;
}

/* Decoding table, for every value of the next HUF_MAX_BITS bits: up to 3 symbols (bits
 * 0-23, stored as they are), bits consumed (24-29), number of symbols (30-31). A shift by
 * entry >> 24 consumes the bits (shifts use only the low 6 bits of their count). */
static void huf_table(const uint8_t *len, const uint16_t *code, uint32_t *table) {
    /* The codes by length: for each first code, the entries whose low bits are it get
     * that symbol; then, for each second code that fits in the bits left, the entries
     * whose next bits are it get both; then likewise a third. The code is complete and
     * prefix-free, so every entry is written at level 1 and overwritten by the deepest
     * level that fits; each level writes at most 2^HUF_MAX_BITS entries (measured faster
     * than looking up each entry's codes, with or without AVX2 gathers). */
    uint8_t sym[256];
    int at[HUF_MAX_BITS + 2] = {0}, m;
    for (int s = 0; s < 256; s++) /* counting sort by length; length 0 (absent) last */
        at[len[s] ? len[s] + 1 : 0]++;
    m = 256 - at[0];
    at[0] = 0;
    for (int l = 1; l <= HUF_MAX_BITS + 1; l++)
        at[l] += at[l - 1];
    for (int s = 0; s < 256; s++)
        if (len[s])
            sym[at[len[s]]++] = (uint8_t)s;
    const uint32_t size = 1u << HUF_MAX_BITS;
    for (int a = 0; a < m; a++) {
        uint32_t s1 = sym[a], l1 = len[s1], base1 = code[s1];
        for (uint32_t i = base1; i < size; i += 1u << l1)
            table[i] = s1 | l1 << 24 | 1u << 30;
        for (int b = 0; b < m && l1 + len[sym[b]] <= HUF_MAX_BITS; b++) {
            uint32_t s2 = sym[b], l12 = l1 + len[s2], base2 = base1 | (uint32_t)code[s2] << l1;
            for (uint32_t i = base2; i < size; i += 1u << l12)
                table[i] = s1 | s2 << 8 | l12 << 24 | 2u << 30;
            for (int c = 0; c < m && l12 + len[sym[c]] <= HUF_MAX_BITS; c++) {
                uint32_t s3 = sym[c], l123 = l12 + len[s3];
                uint32_t base3 = base2 | (uint32_t)code[s3] << l12;
                for (uint32_t i = base3; i < size; i += 1u << l123)
                    table[i] = s1 | s2 << 8 | s3 << 16 | l123 << 24 | 3u << 30;
            }
        }
    }
}

#define HUF_MASK ((1u << HUF_MAX_BITS) - 1)
#define HUF_SENTINEL ((uint64_t)1 << 57)
/* One lookup: emit its symbols (a 4-byte store; the extra byte is overwritten next). */
#define HUF_STEP(v, o)                                                                   \
    do {                                                                                 \
        uint32_t e_ = table[(v) & HUF_MASK];                                             \
        memcpy(o, &e_, 4);                                                               \
        o += e_ >> 30;                                                                   \
        v >>= (e_ >> 24) & 63;                                                           \
    } while (0)
/* The next 57 bits of a lane with a 1 above them: after the lookups, the bits they
 * consumed are 57 minus the position of that 1. */
#define HUF_LOAD(u) ((load64le(src + ((u) >> 3)) >> ((u) & 7) & (HUF_SENTINEL - 1)) | HUF_SENTINEL)
#define HUF_CONSUMED(v) (__builtin_clzll(v) - 6)

/* Rounds that every lane can still run in the fast loop: a round reads 8 bytes at the
 * lane's position (>= 57 fresh bits, of which 4 lookups use <= 48, so it moves <= 6
 * bytes) and writes <= 4 * 3 symbols plus 1 byte of slack. `pos` is in bits from `src`. */
static Py_ssize_t huf_safe_rounds(const Py_ssize_t *pos, const Py_ssize_t *lane_end,
                                  uint8_t *const *o, uint8_t *const *end) {
    Py_ssize_t rounds = PY_SSIZE_T_MAX;
    for (int j = 0; j < HUF_LANES; j++) {
        Py_ssize_t by_input = (lane_end[j] - 8 - (pos[j] >> 3)) / 6 + 1;
        Py_ssize_t by_output = (end[j] - o[j] - 16) / 12 + 1;
        if (lane_end[j] - 8 - (pos[j] >> 3) < 0 || end[j] - o[j] < 16)
            return 0;
        rounds = by_input < rounds ? by_input : rounds;
        rounds = by_output < rounds ? by_output : rounds;
    }
    return rounds;
}

#define HUF_FAST(NAME, ATTR)                                                             \
    ATTR static void NAME(const uint32_t *table, const uint8_t *src, Py_ssize_t *pos,    \
                          uint8_t **o, Py_ssize_t rounds, const uint8_t **pf,            \
                          const uint8_t *pf_end) {                                       \
        const uint8_t *ahead = *pf;                                                      \
        uint8_t *o0 = o[0], *o1 = o[1], *o2 = o[2], *o3 = o[3];                          \
        Py_ssize_t u0 = pos[0], u1 = pos[1], u2 = pos[2], u3 = pos[3];                   \
        for (Py_ssize_t r = 0; r < rounds; r++) {                                        \
            if (ahead < pf_end) {                                                        \
                __builtin_prefetch(ahead);                                               \
                __builtin_prefetch(ahead + 64);                                          \
                ahead += 128;                                                            \
            }                                                                            \
            uint64_t v0 = HUF_LOAD(u0), v1 = HUF_LOAD(u1), v2 = HUF_LOAD(u2),             \
                     v3 = HUF_LOAD(u3);                                                  \
            for (int k = 0; k < 4; k++) {                                                \
                HUF_STEP(v0, o0);                                                        \
                HUF_STEP(v1, o1);                                                        \
                HUF_STEP(v2, o2);                                                        \
                HUF_STEP(v3, o3);                                                        \
            }                                                                            \
            u0 += HUF_CONSUMED(v0), u1 += HUF_CONSUMED(v1);                              \
            u2 += HUF_CONSUMED(v2), u3 += HUF_CONSUMED(v3);                              \
        }                                                                                \
        *pf = ahead;                                                                     \
        o[0] = o0, o[1] = o1, o[2] = o2, o[3] = o3;                                      \
        pos[0] = u0, pos[1] = u1, pos[2] = u2, pos[3] = u3;                              \
    }

/* GCC's SLP vectorizer moves the 4 output pointers into vector registers (measured
 * slower): keep them scalar. */
#if defined(__GNUC__) && !defined(__clang__)
#define HUF_SCALAR __attribute__((optimize("no-tree-slp-vectorize")))
#else
#define HUF_SCALAR
#endif
HUF_FAST(huf_fast_plain, HUF_SCALAR)
#ifdef HAVE_AVX2_DISPATCH
HUF_FAST(huf_fast_bmi2, HUF_SCALAR __attribute__((target("bmi2"))))
#endif

/* 0, or -1 if the stored stream is malformed. `out` receives exactly n bytes. */
/* `ahead`: memory that the caller reads next (the frame's other streams), prefetched a
 * little every round, so that fetching it from memory overlaps the decoding. */
static int huf_decode(const uint8_t *src, Py_ssize_t src_len, uint8_t *out, Py_ssize_t n,
                      const uint8_t *ahead, Py_ssize_t ahead_len) {
    const uint8_t *ahead_end = ahead + ahead_len;
    if (src_len < HUF_HEADER || src[0] != HUF_MAX_BITS)
        return -1;
    uint8_t len[256];
    uint16_t code[256];
    for (int i = 0; i < 128; i++) {
        len[2 * i] = src[1 + i] & 15;
        len[2 * i + 1] = src[1 + i] >> 4;
    }
    if (huf_codes(len, code) < 0)
        return -1;
    uint32_t table[1 << HUF_MAX_BITS];
    huf_table(len, code, table);
    /* positions in bits from src; lane j spans bytes [lane_start[j], lane_end[j]) */
    Py_ssize_t lane_start[HUF_LANES], lane_end[HUF_LANES], pos[HUF_LANES];
    Py_ssize_t total = HUF_HEADER;
    uint8_t *o[HUF_LANES], *end[HUF_LANES];
    for (int j = 0; j < HUF_LANES; j++) {
        uint32_t l;
        memcpy(&l, src + 1 + 128 + 4 * j, 4);
        lane_start[j] = total;
        pos[j] = 8 * total;
        total += l;
        lane_end[j] = total;
        o[j] = out + n * j / HUF_LANES;
        end[j] = out + n * (j + 1) / HUF_LANES;
        if (total > src_len)
            return -1;
    }
    if (total != src_len)
        return -1;
    Py_ssize_t rounds;
    while ((rounds = huf_safe_rounds(pos, lane_end, o, end)) > 0) {
#ifdef HAVE_AVX2_DISPATCH
        if (use_bmi2)
            huf_fast_bmi2(table, src, pos, o, rounds, &ahead, ahead_end);
        else
#endif
            huf_fast_plain(table, src, pos, o, rounds, &ahead, ahead_end);
    }
    /* the rest one symbol at a time, reading only inside the lane */
    for (int j = 0; j < HUF_LANES; j++) {
        uint8_t *p = o[j];
        while (p < end[j]) {
            Py_ssize_t byte = pos[j] >> 3;
            if (byte >= lane_end[j])
                return -1;
            uint64_t v = 0;
            Py_ssize_t have = lane_end[j] - byte < 8 ? lane_end[j] - byte : 8;
            memcpy(&v, src + byte, (size_t)have);
            v >>= pos[j] & 7;
            uint32_t e = table[v & HUF_MASK];
            *p++ = (uint8_t)e;
            pos[j] += len[e & 0xFF];
        }
        /* every lane ends inside its last byte */
        if ((pos[j] + 7) >> 3 != lane_end[j] || (lane_end[j] > lane_start[j]) != (pos[j] > 8 * lane_start[j]))
            return -1;
    }
    return 0;
}

/* Whether the stream has runs (more than 1/64 of its 8-byte words repeat the one
 * before): zero rows, untouched rows of optimizer state, XOR deltas. */
static int huf_prefers_lz(const uint8_t *src, Py_ssize_t n) {
    Py_ssize_t words = n / 8, repeats = 0;
    for (Py_ssize_t i = 1; i < words; i++)
        repeats += load64le(src + 8 * i) == load64le(src + 8 * (i - 1));
    return repeats * 64 > words;
}

static PyObject *py_huf_encode(PyObject *self, PyObject *args) {
    Py_buffer src;
    if (!PyArg_ParseTuple(args, "y*", &src))
        return NULL;
    Py_ssize_t n = src.len;
    PyObject *result = PyBytes_FromStringAndSize(NULL, huf_bound(n));
    if (result == NULL) {
        PyBuffer_Release(&src);
        return NULL;
    }
    Py_ssize_t stored = -1;
    Py_BEGIN_ALLOW_THREADS
    if (!huf_prefers_lz((const uint8_t *)src.buf, n)) {
        uint64_t freq[256] = {0};
        uint8_t len[256];
        huf_histogram((const uint8_t *)src.buf, n, freq);
        huf_lengths(freq, len);
        stored = huf_encode((const uint8_t *)src.buf, n, len,
                            (uint8_t *)PyBytes_AS_STRING(result));
    }
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&src);
    if (stored < 0) { /* runs: zstd's matches beat any code of >= 1 bit per symbol */
        Py_DECREF(result);
        Py_RETURN_NONE;
    }
    if (_PyBytes_Resize(&result, stored) < 0)
        return NULL;
    return result;
}

static PyObject *py_huf_decode(PyObject *self, PyObject *args) {
    Py_buffer src, out, ahead = {0};
    if (!PyArg_ParseTuple(args, "y*w*|y*", &src, &out, &ahead))
        return NULL;
    int rc;
    Py_BEGIN_ALLOW_THREADS
    rc = huf_decode((const uint8_t *)src.buf, src.len, (uint8_t *)out.buf, out.len,
                    (const uint8_t *)ahead.buf, ahead.buf ? ahead.len : 0);
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&src);
    PyBuffer_Release(&out);
    if (ahead.obj != NULL)
        PyBuffer_Release(&ahead);
    if (rc < 0) {
        PyErr_SetString(PyExc_ValueError, "huf_decode: malformed Huffman stream");
        return NULL;
    }
    Py_RETURN_NONE;
}

/* ---- Python bindings ---- */

static int check_width(int width, int e8) {
    if (width == 2 || width == 4 || (!e8 && width == 8))
        return 0;
    PyErr_Format(PyExc_ValueError, "unsupported element width %d", width);
    return -1;
}

static int get_buffers(PyObject *seq, Py_buffer *views, Py_ssize_t count) {
    PyObject *fast = PySequence_Fast(seq, "streams must be a sequence of buffers");
    if (fast == NULL)
        return -1;
    if (PySequence_Fast_GET_SIZE(fast) != count) {
        PyErr_Format(PyExc_ValueError, "expected %zd streams", count);
        Py_DECREF(fast);
        return -1;
    }
    for (Py_ssize_t i = 0; i < count; i++) {
        if (PyObject_GetBuffer(PySequence_Fast_GET_ITEM(fast, i), &views[i],
                               PyBUF_C_CONTIGUOUS) < 0) {
            while (i-- > 0)
                PyBuffer_Release(&views[i]);
            Py_DECREF(fast);
            return -1;
        }
    }
    Py_DECREF(fast);
    return 0;
}

static void release_buffers(Py_buffer *views, Py_ssize_t count) {
    for (Py_ssize_t i = 0; i < count; i++)
        PyBuffer_Release(&views[i]);
}

static PyObject *py_e8_split(PyObject *self, PyObject *args) {
    Py_buffer src, out;
    int width;
    if (!PyArg_ParseTuple(args, "y*iw*", &src, &width, &out))
        return NULL;
    PyObject *result = NULL;
    if (check_width(width, 1) < 0)
        goto done;
    Py_ssize_t n = src.len / width;
    if (src.len % width || out.len != e8_total(n, width)) {
        PyErr_SetString(PyExc_ValueError, "e8_split: buffer sizes do not match");
        goto done;
    }
    e8_streams s;
    e8_locate(&s, (uint8_t *)out.buf, n, width);
    Py_BEGIN_ALLOW_THREADS
    if (width == 2)
        e8_split16((const uint8_t *)src.buf, &s);
    else
        e8_split32((const uint8_t *)src.buf, &s);
    Py_END_ALLOW_THREADS
    result = Py_NewRef(Py_None);
done:
    PyBuffer_Release(&src);
    PyBuffer_Release(&out);
    return result;
}

static PyObject *py_e8_merge(PyObject *self, PyObject *args) {
    PyObject *seq;
    Py_buffer out, v[4];
    int width;
    if (!PyArg_ParseTuple(args, "Oiw*", &seq, &width, &out))
        return NULL;
    if (check_width(width, 1) < 0) {
        PyBuffer_Release(&out);
        return NULL;
    }
    Py_ssize_t count = width == 4 ? 4 : 3;
    if (get_buffers(seq, v, count) < 0) {
        PyBuffer_Release(&out);
        return NULL;
    }
    PyObject *result = NULL;
    Py_ssize_t n = out.len / width, g = e8_groups(n);
    Py_ssize_t want[4] = {4 * g, 1 + g, width == 4 ? 8 * g : 3 * g, 3 * g};
    for (Py_ssize_t i = 0; i < count; i++) {
        if (v[i].len != want[i]) {
            PyErr_Format(PyExc_ValueError, "e8_merge: stream %zd holds %zd bytes, expected %zd",
                         i, v[i].len, want[i]);
            goto done;
        }
    }
    if (out.len % width) {
        PyErr_SetString(PyExc_ValueError, "e8_merge: output is not whole elements");
        goto done;
    }
    e8_streams s = {.n = n, .g = g, .t = (uint8_t *)v[0].buf, .k = (uint8_t *)v[1].buf};
    s.m = width == 4 ? (uint8_t *)v[2].buf : NULL;
    s.nib = (uint8_t *)v[count - 1].buf;
    s.p = s.nib + 2 * g;
    Py_BEGIN_ALLOW_THREADS
    if (width == 2)
        e8_merge16(&s, (uint8_t *)out.buf);
    else
        e8_merge32(&s, (uint8_t *)out.buf);
    Py_END_ALLOW_THREADS
    result = Py_NewRef(Py_None);
done:
    release_buffers(v, count);
    PyBuffer_Release(&out);
    return result;
}

static PyObject *py_group_split(PyObject *self, PyObject *args) {
    Py_buffer src, out;
    int width, rotation;
    if (!PyArg_ParseTuple(args, "y*iiw*", &src, &width, &rotation, &out))
        return NULL;
    PyObject *result = NULL;
    if (check_width(width, 0) < 0)
        goto done;
    if (rotation < 0 || rotation >= 8 * width || src.len % width || out.len != src.len) {
        PyErr_SetString(PyExc_ValueError, "group_split: bad rotation or buffer sizes");
        goto done;
    }
    Py_ssize_t n = src.len / width;
    Py_BEGIN_ALLOW_THREADS
    if (width == 2)
        group16_split((const uint8_t *)src.buf, n, rotation, (uint8_t *)out.buf);
    else if (width == 4)
        group32_split((const uint8_t *)src.buf, n, rotation, (uint8_t *)out.buf);
    else
        group64_split((const uint8_t *)src.buf, n, rotation, (uint8_t *)out.buf);
    Py_END_ALLOW_THREADS
    result = Py_NewRef(Py_None);
done:
    PyBuffer_Release(&src);
    PyBuffer_Release(&out);
    return result;
}

static PyObject *py_group_merge(PyObject *self, PyObject *args) {
    PyObject *seq;
    Py_buffer out, v[8];
    int width, rotation;
    if (!PyArg_ParseTuple(args, "Oiiw*", &seq, &width, &rotation, &out))
        return NULL;
    if (check_width(width, 0) < 0 || rotation < 0 || rotation >= 8 * width) {
        if (!PyErr_Occurred())
            PyErr_SetString(PyExc_ValueError, "group_merge: bad rotation");
        PyBuffer_Release(&out);
        return NULL;
    }
    if (get_buffers(seq, v, width) < 0) {
        PyBuffer_Release(&out);
        return NULL;
    }
    PyObject *result = NULL;
    Py_ssize_t n = out.len / width;
    const uint8_t *streams[8];
    for (int b = 0; b < width; b++) {
        if (v[b].len != n || out.len % width) {
            PyErr_SetString(PyExc_ValueError, "group_merge: buffer sizes do not match");
            goto done;
        }
        streams[b] = (const uint8_t *)v[b].buf;
    }
    Py_BEGIN_ALLOW_THREADS
    if (width == 2)
        group16_merge(streams, n, rotation, (uint8_t *)out.buf);
    else if (width == 4)
        group32_merge(streams, n, rotation, (uint8_t *)out.buf);
    else
        group64_merge(streams, n, rotation, (uint8_t *)out.buf);
    Py_END_ALLOW_THREADS
    result = Py_NewRef(Py_None);
done:
    release_buffers(v, width);
    PyBuffer_Release(&out);
    return result;
}

static PyMethodDef methods[] = {
    {"e8_split", py_e8_split, METH_VARARGS,
     "e8_split(src, width, out): planar exponent split of a frame into out."},
    {"e8_merge", py_e8_merge, METH_VARARGS,
     "e8_merge(streams, width, out): inverse of e8_split."},
    {"group_split", py_group_split, METH_VARARGS,
     "group_split(src, width, rotation, out): byte grouping after rotating each element."},
    {"group_merge", py_group_merge, METH_VARARGS,
     "group_merge(streams, width, rotation, out): inverse of group_split."},
    {"huf_encode", py_huf_encode, METH_VARARGS,
     "huf_encode(src): src Huffman-coded (bytes), or None when it has runs (use zstd)."},
    {"huf_decode", py_huf_decode, METH_VARARGS,
     "huf_decode(stored, out, ahead=None): decode a huf_encode stream into out (len(out) "
     "symbols), prefetching the buffer ahead meanwhile."},
    {"crc32", py_crc32, METH_VARARGS,
     "crc32(data, value=0): zlib.crc32, with carry-less multiply where the CPU has it."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_kernels", "Byte-layout kernels of the codec.", -1, methods,
};

/* RAY_CHECKFREQ_CODEC_NO_AVX2 (any value) keeps AVX2, AVX-512, BMI2 and carry-less multiply
 * off: the tests use it to run the SSE2 and byte-table paths that older CPUs take;
 * RAY_CHECKFREQ_CODEC_NO_AVX512 keeps only AVX-512 off (the AVX2 paths). */
PyMODINIT_FUNC PyInit__kernels(void) {
#ifdef HAVE_AVX2_DISPATCH
    __builtin_cpu_init();
    use_avx2 = __builtin_cpu_supports("avx2") && getenv("RAY_CHECKFREQ_CODEC_NO_AVX2") == NULL;
    use_avx512 = use_avx2 && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw")
                 && __builtin_cpu_supports("avx512vbmi")
                 && getenv("RAY_CHECKFREQ_CODEC_NO_AVX512") == NULL;
    if (use_avx512)
        avx512_tables_init();
    use_bmi2 = __builtin_cpu_supports("bmi2") && getenv("RAY_CHECKFREQ_CODEC_NO_AVX2") == NULL;
    use_vpclmul = __builtin_cpu_supports("vpclmulqdq") && __builtin_cpu_supports("avx2")
                  && getenv("RAY_CHECKFREQ_CODEC_NO_AVX2") == NULL;
    use_clmul = __builtin_cpu_supports("pclmul") && __builtin_cpu_supports("sse4.1")
                && getenv("RAY_CHECKFREQ_CODEC_NO_AVX2") == NULL;
#endif
    crc_table_init();
    PyObject *m = PyModule_Create(&module);
    /* Which paths this CPU takes, for the tests and the benchmarks to report. */
    int clmul = 0, avx512 = 0, avx2 = 0;
#ifdef HAVE_AVX2_DISPATCH
    clmul = use_clmul;
    avx512 = use_avx512;
    avx2 = use_avx2;
#endif
    if (m != NULL && (PyModule_AddIntConstant(m, "clmul", clmul) < 0
                      || PyModule_AddIntConstant(m, "avx512", avx512) < 0
                      || PyModule_AddIntConstant(m, "avx2", avx2) < 0)) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
