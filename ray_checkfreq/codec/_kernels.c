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

static Py_ssize_t e8_merge32_simd(uint32_t *w, Py_ssize_t count, uint32_t off,
                                  const uint8_t *t, const uint8_t *k, const uint8_t *m1,
                                  const uint8_t *m2, const uint8_t *nib, const uint8_t *p) {
    Py_ssize_t done = 0;
#ifdef HAVE_AVX2_DISPATCH
    if (use_avx2)
        done = e8_merge32_avx2(w, count, off, t, k, m1, m2, nib, p);
#endif
    return done + e8_merge32_sse2(w + done, count - done, off, t + done, k + done / 4,
                                  m1 + done, m2 + done, nib + done / 2, p + done / 4);
}

static Py_ssize_t e8_merge16_simd(uint16_t *w, Py_ssize_t count, uint32_t off,
                                  const uint8_t *t, const uint8_t *k, const uint8_t *m1,
                                  const uint8_t *m2, const uint8_t *nib, const uint8_t *p) {
    Py_ssize_t done = 0;
#ifdef HAVE_AVX2_DISPATCH
    if (use_avx2)
        done = e8_merge16_avx2(w, count, off, t, k, nib, p);
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

/* len >= 64 and a multiple of 16. */
CLMUL static uint32_t crc_clmul(uint32_t state, const uint8_t *buf, size_t len) {
    const __m128i k1k2 = _mm_set_epi64x(0x1c6e41596, 0x154442bd4);
    const __m128i k3k4 = _mm_set_epi64x(0x0ccaa009e, 0x1751997d0);
    const __m128i k5 = _mm_set_epi64x(0, 0x163cd6124);
    const __m128i poly = _mm_set_epi64x(0x1f7011641, 0x1db710641);
    const __m128i low32 = _mm_setr_epi32(-1, 0, -1, 0);
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
#endif

static uint32_t crc32_update(uint32_t crc, const uint8_t *buf, size_t len) {
    uint32_t state = ~crc;
#ifdef HAVE_AVX2_DISPATCH
    if (use_clmul && len >= 64) {
        size_t bulk = len & ~(size_t)15;
        state = crc_clmul(state, buf, bulk);
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
    {"crc32", py_crc32, METH_VARARGS,
     "crc32(data, value=0): zlib.crc32, with carry-less multiply where the CPU has it."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_kernels", "Byte-layout kernels of the codec.", -1, methods,
};

/* RAY_CHECKFREQ_CODEC_NO_AVX2 (any value) keeps both AVX2 and carry-less multiply off: the
 * tests use it to run the SSE2 and byte-table paths that older CPUs take. */
PyMODINIT_FUNC PyInit__kernels(void) {
#ifdef HAVE_AVX2_DISPATCH
    __builtin_cpu_init();
    use_avx2 = __builtin_cpu_supports("avx2") && getenv("RAY_CHECKFREQ_CODEC_NO_AVX2") == NULL;
    use_clmul = __builtin_cpu_supports("pclmul") && __builtin_cpu_supports("sse4.1")
                && getenv("RAY_CHECKFREQ_CODEC_NO_AVX2") == NULL;
#endif
    crc_table_init();
    PyObject *m = PyModule_Create(&module);
    if (m != NULL && PyModule_AddIntConstant(m, "clmul",
#ifdef HAVE_AVX2_DISPATCH
                                             use_clmul
#else
                                             0
#endif
                                             ) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    if (m != NULL && PyModule_AddIntConstant(m, "avx2",
#ifdef HAVE_AVX2_DISPATCH
                                             use_avx2
#else
                                             0
#endif
                                             ) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
