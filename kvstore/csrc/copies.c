/* Copies that hash what they write: the verified copy behind every L1 put and get,
 * every shared-memory read and write, and every LMDB read.
 *
 * A copy and then an xxh3 pass read the bytes twice; at 1 MiB (in cache) each pass
 * costs about as much as the other, so a verified copy ran at ~0.5 of memcpy. Here,
 * with AVX2, each 64-byte stripe is loaded once, stored to the destination and fed
 * to XXH3's accumulator from the same registers: one pass. The result is bit for bit
 * XXH3_64bits(dst, n) (tests/test_accel.py checks it against the xxhash package for
 * every length class and alignment), and what is hashed is exactly what was stored,
 * even if the source changes during the copy.
 *
 * Without AVX2 (or for pieces hashed as one stream) the copy goes in 16 KiB blocks,
 * each hashed right after it lands, while still in L1.
 */
#include "copies.h"

#include <stdlib.h>
#include <string.h>

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define KV_X86 1
#include <immintrin.h>
/* Let xxhash.h define its AVX2 kernels (with this target attribute) next to the
 * baseline ones, as its own x86 dispatcher does. */
#define XXH_DISPATCH_AVX2 1
#define XXH_TARGET_AVX2 __attribute__((target("avx2")))
#define KV_AVX2 __attribute__((target("avx2")))
#else
#define KV_X86 0
#endif

#define XXH_INLINE_ALL
#include "xxhash.h"

#define BLOCK (16 * 1024) /* a block copied and then hashed stays in L1 */

/* From this many bytes, a copy into a 32-byte aligned destination uses non-temporal
 * stores: a plain store first reads the destination's line into the cache (a third
 * memory transfer per byte), a loss when the destination is megabytes (a KV cache, the
 * arena) that will not be read again before it leaves the cache. Here a 128 MiB copy
 * ran in 8.5 ms with them against 13 ms with plain stores (and 12 ms for memcpy). */
#define KV_NT_MIN 4096

/* -- plain copies ------------------------------------------------------------------- */

/* Not memcpy: glibc's memcpy uses "rep movsb" for blocks of this size, which on AMD
 * Zen runs ~8x slower when dst - src is a small multiple of 16 modulo 4096 (measured
 * here: 16 KiB in 6 us instead of 0.8), and where arena pages and a caller's buffer
 * fall is chance. Destination-aligned vector stores have no such case. */
#if KV_X86
KV_AVX2 static void copy_avx2(uint8_t *d, const uint8_t *s, size_t n) {
    if (n < 64) {
        memcpy(d, s, n);
        return;
    }
    _mm256_storeu_si256((__m256i *)d, _mm256_loadu_si256((const __m256i *)s));
    size_t i = 32 - ((uintptr_t)d & 31);
    for (; i + 128 <= n; i += 128) {
        __m256i a = _mm256_loadu_si256((const __m256i *)(s + i));
        __m256i b = _mm256_loadu_si256((const __m256i *)(s + i + 32));
        __m256i c = _mm256_loadu_si256((const __m256i *)(s + i + 64));
        __m256i e = _mm256_loadu_si256((const __m256i *)(s + i + 96));
        _mm256_store_si256((__m256i *)(d + i), a);
        _mm256_store_si256((__m256i *)(d + i + 32), b);
        _mm256_store_si256((__m256i *)(d + i + 64), c);
        _mm256_store_si256((__m256i *)(d + i + 96), e);
    }
    for (; i + 32 <= n; i += 32)
        _mm256_store_si256((__m256i *)(d + i), _mm256_loadu_si256((const __m256i *)(s + i)));
    /* The tail: the last 32 bytes, overlapping what is already copied. */
    _mm256_storeu_si256((__m256i *)(d + n - 32),
                        _mm256_loadu_si256((const __m256i *)(s + n - 32)));
}

static void copy_sse2(uint8_t *d, const uint8_t *s, size_t n) {
    if (n < 64) {
        memcpy(d, s, n);
        return;
    }
    _mm_storeu_si128((__m128i *)d, _mm_loadu_si128((const __m128i *)s));
    size_t i = 16 - ((uintptr_t)d & 15);
    for (; i + 64 <= n; i += 64) {
        __m128i a = _mm_loadu_si128((const __m128i *)(s + i));
        __m128i b = _mm_loadu_si128((const __m128i *)(s + i + 16));
        __m128i c = _mm_loadu_si128((const __m128i *)(s + i + 32));
        __m128i e = _mm_loadu_si128((const __m128i *)(s + i + 48));
        _mm_store_si128((__m128i *)(d + i), a);
        _mm_store_si128((__m128i *)(d + i + 16), b);
        _mm_store_si128((__m128i *)(d + i + 32), c);
        _mm_store_si128((__m128i *)(d + i + 48), e);
    }
    for (; i + 16 <= n; i += 16)
        _mm_store_si128((__m128i *)(d + i), _mm_loadu_si128((const __m128i *)(s + i)));
    _mm_storeu_si128((__m128i *)(d + n - 16), _mm_loadu_si128((const __m128i *)(s + n - 16)));
}

KV_AVX2 static void update_avx2(XXH3_state_t *st, const uint8_t *p, size_t n) {
    XXH3_update(st, p, n, XXH3_accumulate_avx2, XXH3_scrambleAcc_avx2);
}
#else
static void copy_plain(uint8_t *d, const uint8_t *s, size_t n) { memcpy(d, s, n); }
#endif

static void update_base(XXH3_state_t *st, const uint8_t *p, size_t n) {
    XXH3_64bits_update(st, p, n);
}

/* -- the fused pass ----------------------------------------------------------------- */

#if KV_X86
/* XXH3_accumulate_512_avx2 on a stripe loaded from src, which is stored to dst from
 * the same registers. */
KV_AVX2 static inline void stripe_copy(__m256i acc[2], uint8_t *dst, const uint8_t *src,
                                       const uint8_t *secret, int nt) {
    for (int i = 0; i < 2; i++) {
        __m256i data = _mm256_loadu_si256((const __m256i *)(src + 32 * i));
        if (nt) /* dst 32-byte aligned: see KV_NT_MIN */
            _mm256_stream_si256((__m256i *)(dst + 32 * i), data);
        else
            _mm256_storeu_si256((__m256i *)(dst + 32 * i), data);
        __m256i key = _mm256_loadu_si256((const __m256i *)(secret + 32 * i));
        __m256i dk = _mm256_xor_si256(data, key);
        __m256i product = _mm256_mul_epu32(dk, _mm256_srli_epi64(dk, 32));
        __m256i swap = _mm256_shuffle_epi32(data, _MM_SHUFFLE(1, 0, 3, 2));
        acc[i] = _mm256_add_epi64(product, _mm256_add_epi64(acc[i], swap));
    }
}

/* XXH3_hashLong_64b_internal with the default secret, copying as it reads. */
KV_AVX2 static uint64_t fused_avx2(uint8_t *dst, const uint8_t *src, size_t len) {
    if (len <= XXH3_MIDSIZE_MAX) { /* the short-input algorithms read little: copy, hash */
        memcpy(dst, src, len);
        return XXH3_64bits(dst, len);
    }
    const uint8_t *secret = XXH3_kSecret;
    const size_t secret_size = sizeof(XXH3_kSecret);
    const size_t stripes_per_block = (secret_size - XXH_STRIPE_LEN) / XXH_SECRET_CONSUME_RATE;
    const size_t block_len = XXH_STRIPE_LEN * stripes_per_block;
    const size_t nb_blocks = (len - 1) / block_len;
    XXH_ALIGN(64) xxh_u64 acc64[XXH_ACC_NB] = XXH3_INIT_ACC;
    __m256i acc[2] = {_mm256_load_si256((const __m256i *)acc64),
                      _mm256_load_si256((const __m256i *)(acc64 + 4))};
    size_t off = 0;
    const int nt = len >= KV_NT_MIN && !((uintptr_t)dst & 31);
    for (size_t n = 0; n < nb_blocks; n++) {
        if (nt)
            for (size_t s = 0; s < stripes_per_block; s++, off += XXH_STRIPE_LEN)
                stripe_copy(acc, dst + off, src + off, secret + s * XXH_SECRET_CONSUME_RATE, 1);
        else
            for (size_t s = 0; s < stripes_per_block; s++, off += XXH_STRIPE_LEN)
                stripe_copy(acc, dst + off, src + off, secret + s * XXH_SECRET_CONSUME_RATE, 0);
        _mm256_store_si256((__m256i *)acc64, acc[0]);
        _mm256_store_si256((__m256i *)(acc64 + 4), acc[1]);
        XXH3_scrambleAcc_avx2(acc64, secret + secret_size - XXH_STRIPE_LEN);
        acc[0] = _mm256_load_si256((const __m256i *)acc64);
        acc[1] = _mm256_load_si256((const __m256i *)(acc64 + 4));
    }
    /* The last partial block: whole stripes except the one holding the last byte. */
    size_t stripes = ((len - 1) - block_len * nb_blocks) / XXH_STRIPE_LEN;
    for (size_t s = 0; s < stripes; s++, off += XXH_STRIPE_LEN)
        stripe_copy(acc, dst + off, src + off, secret + s * XXH_SECRET_CONSUME_RATE, nt);
    if (nt) _mm_sfence(); /* the streamed stores land before the copy is reported done */
    _mm256_store_si256((__m256i *)acc64, acc[0]);
    _mm256_store_si256((__m256i *)(acc64 + 4), acc[1]);
    /* The rest (1-64 bytes) is copied; the last stripe, ending on the last byte,
     * is hashed from dst, where it now is (in L1). */
    memcpy(dst + off, src + off, len - off);
    XXH3_accumulate_512_avx2(acc64, dst + len - XXH_STRIPE_LEN,
                             secret + secret_size - XXH_STRIPE_LEN - XXH_SECRET_LASTACC_START);
    return XXH3_finalizeLong_64b(acc64, secret, (xxh_u64)len);
}
#endif

/* -- dispatch ----------------------------------------------------------------------- */

static void (*copy_block)(uint8_t *, const uint8_t *, size_t);
static void (*update)(XXH3_state_t *, const uint8_t *, size_t) = update_base;
static int fused;

void kv_copies_select(int baseline) {
#if KV_X86
    copy_block = copy_sse2;
    update = update_base;
    fused = 0;
    __builtin_cpu_init();
    if (!baseline && __builtin_cpu_supports("avx2")) {
        copy_block = copy_avx2;
        update = update_avx2;
        fused = 1;
    }
#else
    (void)baseline;
    copy_block = copy_plain;
#endif
}

const char *kv_copies_impl(void) { return fused ? "avx2-fused" : "blocks"; }

static void blocks(XXH3_state_t *st, uint8_t *dst, const uint8_t *src, size_t n) {
    for (size_t o = 0; o < n; o += BLOCK) {
        size_t m = n - o < BLOCK ? n - o : BLOCK;
        copy_block(dst + o, src + o, m);
        update(st, dst + o, m);
    }
}

void kv_copy(uint8_t *dst, const uint8_t *src, size_t n) { copy_block(dst, src, n); }

uint64_t kv_xxh3(const uint8_t *p, size_t n) { return XXH3_64bits(p, n); }

uint64_t kv_xxh3_2(const uint8_t *a, size_t na, const uint8_t *b, size_t nb) {
    XXH3_state_t st;
    XXH3_64bits_reset(&st);
    XXH3_64bits_update(&st, a, na);
    XXH3_64bits_update(&st, b, nb);
    return XXH3_64bits_digest(&st);
}

uint64_t kv_copy_xxh3(uint8_t *dst, const uint8_t *src, size_t n) {
#if KV_X86
    if (fused) return fused_avx2(dst, src, n);
#endif
    XXH3_state_t st;
    XXH3_64bits_reset(&st);
    blocks(&st, dst, src, n);
    return XXH3_64bits_digest(&st);
}

/* -- the fused pass over several pieces ------------------------------------------------
 *
 * A scatter (a chunk's payload into the blocks of a paged KV cache, or gathered from
 * them) copies many pieces hashed as one stream. With AVX2 each 64-byte stripe is
 * loaded once, stored, and accumulated into XXH3 from the same registers, as in
 * fused_avx2, whatever the piece boundaries: bytes short of a whole stripe wait in
 * ``part`` (copied there first, then to the destination, so what is hashed is what
 * was stored), and the last whole stripe waits in ``pending``, since XXH3 hashes the
 * stripe that ends the input with another secret (it is known to be last only at the
 * digest). The first 240 bytes are kept too: an input that short has its own
 * algorithm.
 *
 * A piece of KV_NT_MIN bytes or more whose destination is 32-byte aligned is stored
 * with non-temporal stores.
 */
typedef struct {
#if KV_X86
    __m256i acc[2];
    __m256i pending[2]; /* the last whole stripe, not yet accumulated */
#endif
    uint8_t part[XXH_STRIPE_LEN]; /* bytes of a stripe not yet whole */
    uint8_t head[XXH3_MIDSIZE_MAX];
    size_t part_len, total, stripe; /* stripe: where in its block the next one goes */
    int has_pending, streamed;
} fstream;

struct kv_stream {
    XXH3_state_t st;
    fstream f;
};

#if KV_X86
KV_AVX2 static inline __m256i acc_step(__m256i acc, __m256i data, const uint8_t *key_at) {
    __m256i key = _mm256_loadu_si256((const __m256i *)key_at);
    __m256i dk = _mm256_xor_si256(data, key);
    __m256i product = _mm256_mul_epu32(dk, _mm256_srli_epi64(dk, 32));
    __m256i swap = _mm256_shuffle_epi32(data, _MM_SHUFFLE(1, 0, 3, 2));
    return _mm256_add_epi64(product, _mm256_add_epi64(acc, swap));
}

/* One stripe more in the stream: the one waiting before it is accumulated (it is not
 * the last), and this one waits. */
KV_AVX2 static inline void fs_stripe(fstream *f, __m256i d0, __m256i d1) {
    if (f->total < XXH3_MIDSIZE_MAX) {
        XXH_ALIGN(32) uint8_t tmp[XXH_STRIPE_LEN];
        _mm256_store_si256((__m256i *)tmp, d0);
        _mm256_store_si256((__m256i *)(tmp + 32), d1);
        size_t room = XXH3_MIDSIZE_MAX - f->total;
        memcpy(f->head + f->total, tmp, room < XXH_STRIPE_LEN ? room : XXH_STRIPE_LEN);
    }
    f->total += XXH_STRIPE_LEN;
    if (f->has_pending) {
        const uint8_t *key = XXH3_kSecret + f->stripe * XXH_SECRET_CONSUME_RATE;
        f->acc[0] = acc_step(f->acc[0], f->pending[0], key);
        f->acc[1] = acc_step(f->acc[1], f->pending[1], key + 32);
        if (++f->stripe == (sizeof(XXH3_kSecret) - XXH_STRIPE_LEN) / XXH_SECRET_CONSUME_RATE) {
            XXH_ALIGN(64) xxh_u64 acc64[XXH_ACC_NB];
            _mm256_store_si256((__m256i *)acc64, f->acc[0]);
            _mm256_store_si256((__m256i *)(acc64 + 4), f->acc[1]);
            XXH3_scrambleAcc_avx2(acc64, XXH3_kSecret + sizeof(XXH3_kSecret) - XXH_STRIPE_LEN);
            f->acc[0] = _mm256_load_si256((const __m256i *)acc64);
            f->acc[1] = _mm256_load_si256((const __m256i *)(acc64 + 4));
            f->stripe = 0;
        }
    }
    f->pending[0] = d0;
    f->pending[1] = d1;
    f->has_pending = 1;
}

KV_AVX2 static void fs_reset(fstream *f) {
    XXH_ALIGN(64) xxh_u64 init[XXH_ACC_NB] = XXH3_INIT_ACC;
    f->acc[0] = _mm256_load_si256((const __m256i *)init);
    f->acc[1] = _mm256_load_si256((const __m256i *)(init + 4));
    f->part_len = f->total = f->stripe = 0;
    f->has_pending = f->streamed = 0;
}

/* Bytes short of a stripe go to ``part``, then from there to dst; a whole one is hashed. */
KV_AVX2 static size_t fs_part(fstream *f, uint8_t *dst, const uint8_t *src, size_t n) {
    size_t take = XXH_STRIPE_LEN - f->part_len;
    if (take > n) take = n;
    memcpy(f->part + f->part_len, src, take);
    memcpy(dst, f->part + f->part_len, take);
    f->part_len += take;
    if (f->part_len == XXH_STRIPE_LEN) {
        f->part_len = 0;
        fs_stripe(f, _mm256_loadu_si256((const __m256i *)f->part),
                  _mm256_loadu_si256((const __m256i *)(f->part + 32)));
    }
    return take;
}

KV_AVX2 static void fs_copy(fstream *f, uint8_t *dst, const uint8_t *src, size_t n) {
    size_t off = 0;
    if (f->part_len) off = fs_part(f, dst, src, n);
    size_t whole = off + (n - off) / XXH_STRIPE_LEN * XXH_STRIPE_LEN;
    if (n - off >= KV_NT_MIN && !((uintptr_t)(dst + off) & 31)) {
        f->streamed = 1;
        for (; off < whole; off += XXH_STRIPE_LEN) {
            __m256i d0 = _mm256_loadu_si256((const __m256i *)(src + off));
            __m256i d1 = _mm256_loadu_si256((const __m256i *)(src + off + 32));
            _mm256_stream_si256((__m256i *)(dst + off), d0);
            _mm256_stream_si256((__m256i *)(dst + off + 32), d1);
            fs_stripe(f, d0, d1);
        }
    } else {
        for (; off < whole; off += XXH_STRIPE_LEN) {
            __m256i d0 = _mm256_loadu_si256((const __m256i *)(src + off));
            __m256i d1 = _mm256_loadu_si256((const __m256i *)(src + off + 32));
            _mm256_storeu_si256((__m256i *)(dst + off), d0);
            _mm256_storeu_si256((__m256i *)(dst + off + 32), d1);
            fs_stripe(f, d0, d1);
        }
    }
    while (off < n) off += fs_part(f, dst + off, src + off, n - off);
}

KV_AVX2 static uint64_t fs_digest(fstream *f) {
    if (f->streamed) _mm_sfence(); /* the streamed stores land before anyone is told */
    size_t len = f->total + f->part_len;
    if (len <= XXH3_MIDSIZE_MAX) {
        memcpy(f->head + f->total, f->part, f->part_len);
        return XXH3_64bits(f->head, len);
    }
    XXH_ALIGN(64) uint8_t last[XXH_STRIPE_LEN];
    XXH_ALIGN(64) uint8_t pending[XXH_STRIPE_LEN];
    _mm256_store_si256((__m256i *)pending, f->pending[0]);
    _mm256_store_si256((__m256i *)(pending + 32), f->pending[1]);
    if (f->part_len) {
        /* The stripe waiting is not the last: it is hashed as any other, and the last
         * stripe is the input's last 64 bytes, partly in it. */
        fs_stripe(f, f->pending[0], f->pending[1]);
        f->total -= XXH_STRIPE_LEN; /* counted once already */
        memcpy(last, pending + f->part_len, XXH_STRIPE_LEN - f->part_len);
        memcpy(last + XXH_STRIPE_LEN - f->part_len, f->part, f->part_len);
    } else {
        memcpy(last, pending, XXH_STRIPE_LEN);
    }
    XXH_ALIGN(64) xxh_u64 acc64[XXH_ACC_NB];
    _mm256_store_si256((__m256i *)acc64, f->acc[0]);
    _mm256_store_si256((__m256i *)(acc64 + 4), f->acc[1]);
    XXH3_accumulate_512_avx2(acc64, last,
                             XXH3_kSecret + sizeof(XXH3_kSecret) - XXH_STRIPE_LEN -
                                 XXH_SECRET_LASTACC_START);
    return XXH3_finalizeLong_64b(acc64, XXH3_kSecret, (xxh_u64)len);
}
#endif

kv_stream *kv_stream_new(void) {
    kv_stream *s = XXH_alignedMalloc(sizeof *s, 64);
    if (!s) return NULL;
    XXH3_64bits_reset(&s->st);
#if KV_X86
    if (fused) fs_reset(&s->f);
#endif
    return s;
}

void kv_stream_copy(kv_stream *s, uint8_t *dst, const uint8_t *src, size_t n) {
#if KV_X86
    if (fused) {
        fs_copy(&s->f, dst, src, n);
        return;
    }
#endif
    blocks(&s->st, dst, src, n);
}

uint64_t kv_stream_digest(kv_stream *s) {
#if KV_X86
    if (fused) return fs_digest(&s->f);
#endif
    return XXH3_64bits_digest(&s->st);
}

void kv_stream_free(kv_stream *s) { XXH_alignedFree(s); }

void kv_copies_fence(void) {
#if KV_X86
    _mm_sfence();
#endif
}
