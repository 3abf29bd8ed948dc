/* SHA-256 block functions (portable C and x86 SHA extensions) and the streaming
 * wrapper around them. See sha256.h for why this exists. */
#include "sha256.h"

#include <string.h>

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define KV_HAVE_SHANI 1
#include <cpuid.h>
#include <immintrin.h>
#else
#define KV_HAVE_SHANI 0
#endif

static const uint32_t K[64] __attribute__((aligned(16))) = {
    0x428a2f98, 0x71374491, 0xb5c0fbcf, 0xe9b5dba5, 0x3956c25b, 0x59f111f1, 0x923f82a4,
    0xab1c5ed5, 0xd807aa98, 0x12835b01, 0x243185be, 0x550c7dc3, 0x72be5d74, 0x80deb1fe,
    0x9bdc06a7, 0xc19bf174, 0xe49b69c1, 0xefbe4786, 0x0fc19dc6, 0x240ca1cc, 0x2de92c6f,
    0x4a7484aa, 0x5cb0a9dc, 0x76f988da, 0x983e5152, 0xa831c66d, 0xb00327c8, 0xbf597fc7,
    0xc6e00bf3, 0xd5a79147, 0x06ca6351, 0x14292967, 0x27b70a85, 0x2e1b2138, 0x4d2c6dfc,
    0x53380d13, 0x650a7354, 0x766a0abb, 0x81c2c92e, 0x92722c85, 0xa2bfe8a1, 0xa81a664b,
    0xc24b8b70, 0xc76c51a3, 0xd192e819, 0xd6990624, 0xf40e3585, 0x106aa070, 0x19a4c116,
    0x1e376c08, 0x2748774c, 0x34b0bcb5, 0x391c0cb3, 0x4ed8aa4a, 0x5b9cca4f, 0x682e6ff3,
    0x748f82ee, 0x78a5636f, 0x84c87814, 0x8cc70208, 0x90befffa, 0xa4506ceb, 0xbef9a3f7,
    0xc67178f2,
};

static const uint32_t H0[8] = {
    0x6a09e667, 0xbb67ae85, 0x3c6ef372, 0xa54ff53a,
    0x510e527f, 0x9b05688c, 0x1f83d9ab, 0x5be0cd19,
};

typedef void (*blocks_fn)(uint32_t h[8], const uint8_t *data, size_t nblocks);

#define ROR(x, n) (((x) >> (n)) | ((x) << (32 - (n))))

static void blocks_generic(uint32_t h[8], const uint8_t *p, size_t nblocks) {
    uint32_t w[64];
    for (; nblocks; nblocks--, p += 64) {
        for (int t = 0; t < 16; t++)
            w[t] = (uint32_t)p[4 * t] << 24 | (uint32_t)p[4 * t + 1] << 16 |
                   (uint32_t)p[4 * t + 2] << 8 | (uint32_t)p[4 * t + 3];
        for (int t = 16; t < 64; t++) {
            uint32_t s0 = ROR(w[t - 15], 7) ^ ROR(w[t - 15], 18) ^ (w[t - 15] >> 3);
            uint32_t s1 = ROR(w[t - 2], 17) ^ ROR(w[t - 2], 19) ^ (w[t - 2] >> 10);
            w[t] = w[t - 16] + s0 + w[t - 7] + s1;
        }
        uint32_t a = h[0], b = h[1], c = h[2], d = h[3], e = h[4], f = h[5], g = h[6],
                 hh = h[7];
        for (int t = 0; t < 64; t++) {
            uint32_t t1 = hh + (ROR(e, 6) ^ ROR(e, 11) ^ ROR(e, 25)) + ((e & f) ^ (~e & g)) +
                          K[t] + w[t];
            uint32_t t2 = (ROR(a, 2) ^ ROR(a, 13) ^ ROR(a, 22)) + ((a & b) ^ (a & c) ^ (b & c));
            hh = g; g = f; f = e; e = d + t1; d = c; c = b; b = a; a = t1 + t2;
        }
        h[0] += a; h[1] += b; h[2] += c; h[3] += d;
        h[4] += e; h[5] += f; h[6] += g; h[7] += hh;
    }
}

#if KV_HAVE_SHANI
/* Four rounds per step: the SHA extensions keep the state as ABEF/CDGH and do two
 * rounds per sha256rnds2; sha256msg1/msg2 extend the message schedule. */
__attribute__((target("sha,sse4.1"))) static void blocks_shani(uint32_t h[8],
                                                                const uint8_t *p,
                                                                size_t nblocks) {
    const __m128i bswap = _mm_set_epi64x(0x0c0d0e0f08090a0bULL, 0x0405060700010203ULL);
    __m128i tmp = _mm_loadu_si128((const __m128i *)&h[0]);
    __m128i s1 = _mm_loadu_si128((const __m128i *)&h[4]);
    tmp = _mm_shuffle_epi32(tmp, 0xB1);        /* CDAB */
    s1 = _mm_shuffle_epi32(s1, 0x1B);          /* EFGH */
    __m128i s0 = _mm_alignr_epi8(tmp, s1, 8);  /* ABEF */
    s1 = _mm_blend_epi16(s1, tmp, 0xF0);       /* CDGH */
    for (; nblocks; nblocks--, p += 64) {
        const __m128i abef = s0, cdgh = s1;
        __m128i m[4];
#pragma GCC unroll 16
        for (int i = 0; i < 16; i++) {
            if (i < 4) {
                m[i] = _mm_shuffle_epi8(_mm_loadu_si128((const __m128i *)(p + 16 * i)), bswap);
            } else {
                __m128i x = _mm_sha256msg1_epu32(m[i & 3], m[(i - 3) & 3]);
                x = _mm_add_epi32(x, _mm_alignr_epi8(m[(i - 1) & 3], m[(i - 2) & 3], 4));
                m[i & 3] = _mm_sha256msg2_epu32(x, m[(i - 1) & 3]);
            }
            __m128i wk = _mm_add_epi32(m[i & 3], _mm_load_si128((const __m128i *)&K[4 * i]));
            s1 = _mm_sha256rnds2_epu32(s1, s0, wk);
            s0 = _mm_sha256rnds2_epu32(s0, s1, _mm_shuffle_epi32(wk, 0x0E));
        }
        s0 = _mm_add_epi32(s0, abef);
        s1 = _mm_add_epi32(s1, cdgh);
    }
    tmp = _mm_shuffle_epi32(s0, 0x1B);         /* FEBA */
    s1 = _mm_shuffle_epi32(s1, 0xB1);          /* DCHG */
    s0 = _mm_blend_epi16(tmp, s1, 0xF0);       /* DCBA */
    s1 = _mm_alignr_epi8(s1, tmp, 8);          /* HGFE */
    _mm_storeu_si128((__m128i *)&h[0], s0);
    _mm_storeu_si128((__m128i *)&h[4], s1);
}

static int cpu_has_shani(void) {
    unsigned a, b, c, d;
    if (!__get_cpuid_count(7, 0, &a, &b, &c, &d)) return 0;
    if (!(b & (1u << 29))) return 0;  /* SHA */
    if (!__get_cpuid(1, &a, &b, &c, &d)) return 0;
    return (c & (1u << 19)) && (c & (1u << 9));  /* SSE4.1, SSSE3 */
}
#endif

static blocks_fn blocks = blocks_generic;
static const char *impl = "generic";

void kv_sha256_select(int generic) {
    blocks = blocks_generic;
    impl = "generic";
#if KV_HAVE_SHANI
    if (!generic && cpu_has_shani()) {
        blocks = blocks_shani;
        impl = "sha-ni";
    }
#else
    (void)generic;
#endif
}

const char *kv_sha256_impl(void) { return impl; }

void kv_sha256_init(kv_sha256 *s) {
    memcpy(s->h, H0, sizeof H0);
    s->total = 0;
    s->buflen = 0;
}

void kv_sha256_update(kv_sha256 *s, const uint8_t *data, size_t len) {
    s->total += len;
    if (s->buflen) {
        size_t take = 64 - s->buflen < len ? 64 - s->buflen : len;
        memcpy(s->buf + s->buflen, data, take);
        s->buflen += take;
        data += take;
        len -= take;
        if (s->buflen < 64) return;
        blocks(s->h, s->buf, 1);
        s->buflen = 0;
    }
    if (len >= 64) {
        blocks(s->h, data, len / 64);
        data += len - len % 64;
        len %= 64;
    }
    memcpy(s->buf, data, len);
    s->buflen = len;
}

void kv_sha256_digest(const kv_sha256 *s, uint8_t out[32]) {
    uint32_t h[8];
    uint8_t tail[128];
    size_t n = s->buflen;
    memcpy(h, s->h, sizeof h);
    memcpy(tail, s->buf, n);
    tail[n++] = 0x80;
    size_t padded = n <= 56 ? 64 : 128;
    memset(tail + n, 0, padded - 8 - n);
    uint64_t bits = s->total * 8;
    for (int i = 0; i < 8; i++) tail[padded - 1 - i] = (uint8_t)(bits >> (8 * i));
    blocks(h, tail, padded / 64);
    for (int i = 0; i < 8; i++) {
        out[4 * i] = (uint8_t)(h[i] >> 24);
        out[4 * i + 1] = (uint8_t)(h[i] >> 16);
        out[4 * i + 2] = (uint8_t)(h[i] >> 8);
        out[4 * i + 3] = (uint8_t)h[i];
    }
}
