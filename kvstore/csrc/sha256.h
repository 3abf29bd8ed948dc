/* SHA-256 (FIPS 180-4) for kvstore's chunk keys and sub-hashes.
 *
 * Why not hashlib: a lookup hashes 512 messages of ~1 KiB, and hashlib spends
 * more time per call (a context copy, two updates, a digest: each a Python call)
 * than the SHA instructions spend on the bytes. Here the whole chain is one C
 * loop. The block function uses the x86 SHA extensions when the CPU has them
 * (checked once, at import) and portable C otherwise; both are tested against
 * hashlib.
 */
#ifndef KVSTORE_SHA256_H
#define KVSTORE_SHA256_H

#include <stddef.h>
#include <stdint.h>

typedef struct {
    uint32_t h[8];
    uint64_t total;      /* bytes absorbed so far */
    uint8_t buf[64];     /* a partial block */
    size_t buflen;
} kv_sha256;

/* Which block function is in use: "sha-ni" or "generic". */
const char *kv_sha256_impl(void);
/* Pick the block function: 0 = best the CPU has, 1 = portable C (for tests). */
void kv_sha256_select(int generic);

void kv_sha256_init(kv_sha256 *s);
void kv_sha256_update(kv_sha256 *s, const uint8_t *data, size_t len);
/* The digest of what was absorbed; ``s`` is left as it was (like hashlib's digest()). */
void kv_sha256_digest(const kv_sha256 *s, uint8_t out[32]);

#endif
