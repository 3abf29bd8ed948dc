/* Copies that return the xxh3_64 of the bytes they wrote (see copies.c). */
#ifndef KVSTORE_COPIES_H
#define KVSTORE_COPIES_H

#include <stddef.h>
#include <stdint.h>

/* Pick the implementations: 0 = best the CPU has, 1 = baseline (for tests). */
void kv_copies_select(int baseline);
/* "avx2-fused" or "blocks". */
const char *kv_copies_impl(void);

/* Copy n bytes, dst and src not overlapping (our vector loop where the CPU has AVX2: see copies.c for why). */
void kv_copy(uint8_t *dst, const uint8_t *src, size_t n);

/* XXH3_64bits of n bytes. */
uint64_t kv_xxh3(const uint8_t *p, size_t n);
/* XXH3_64bits of a followed by b (as if concatenated). */
uint64_t kv_xxh3_2(const uint8_t *a, size_t na, const uint8_t *b, size_t nb);

/* Copy n bytes (dst and src must not overlap) and return XXH3_64bits of them, in one pass where the CPU allows. */
uint64_t kv_copy_xxh3(uint8_t *dst, const uint8_t *src, size_t n);

/* The same over several (dst, src, n) pieces, hashed as one stream in order. */
typedef struct kv_stream kv_stream;
kv_stream *kv_stream_new(void);
void kv_stream_copy(kv_stream *s, uint8_t *dst, const uint8_t *src, size_t n);
uint64_t kv_stream_digest(kv_stream *s);
void kv_stream_free(kv_stream *s);
/* Order the non-temporal stores made so far before later stores (another thread told
 * that the bytes are there then reads them). kv_stream_digest fences its own stream. */
void kv_copies_fence(void);

#endif
