/* kvstore._native: the loops kvstore runs per chunk and per byte, in C.
 *
 * Each function has a pure-Python twin in kvstore/accel.py that gives the same
 * answer (tests/test_accel.py checks both against each other and against
 * hashlib/xxhash); kvstore imports whichever is available, so the package works
 * without a compiler, only slower.
 *
 * - chain_keys / chain_probe: the chained SHA-256 chunk keys of a prompt (and, for
 *   lookup, the dict probe of each key) in one loop, with no Python call per chunk.
 * - probe_keys: the same probe for keys a client hashed (a lookup by keys).
 * - prefix_digests: the cumulative sub-hashes partial matching compares.
 * - copy_xxh3 / scatter_xxh3: a copy that hashes each block right after it lands,
 *   while it is still in L1, so a verified copy costs about one pass over memory
 *   instead of two. The GIL is released for large copies.
 * - Streams / scatter_streams: the same for payloads whose bytes arrive over several
 *   calls (one layer of many chunks per call), each hashed as one stream.
 * - advise: madvise over a range in pieces, the GIL let go for the whole loop.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <errno.h>
#include <string.h>
#include <sys/mman.h>

#include "sha256.h"

#include "copies.h"

/* Below this a copy takes less than releasing and retaking the GIL can cost. */
#define NOGIL_BYTES (64 * 1024)

/* -- SHA-256 ------------------------------------------------------------------------ */

static int absorb_prefix(kv_sha256 *base, Py_buffer *prefix) {
    kv_sha256_init(base);
    kv_sha256_update(base, prefix->buf, (size_t)prefix->len);
    return 0;
}

static PyObject *py_sha256(PyObject *self, PyObject *arg) {
    Py_buffer b;
    if (PyObject_GetBuffer(arg, &b, PyBUF_SIMPLE) < 0) return NULL;
    kv_sha256 s;
    uint8_t out[32];
    kv_sha256_init(&s);
    kv_sha256_update(&s, b.buf, (size_t)b.len);
    kv_sha256_digest(&s, out);
    PyBuffer_Release(&b);
    return PyBytes_FromStringAndSize((const char *)out, 32);
}

static PyObject *py_sha256_impl(PyObject *self, PyObject *noargs) {
    return PyUnicode_FromString(kv_sha256_impl());
}

static PyObject *py_sha256_select(PyObject *self, PyObject *arg) {
    int generic = PyObject_IsTrue(arg);
    if (generic < 0) return NULL;
    kv_sha256_select(generic);
    return PyUnicode_FromString(kv_sha256_impl());
}

/* The key of the chunk at data[off:off+n]: SHA-256(prefix || parent || chunk), where
 * ``base`` has absorbed the prefix already. */
static void chunk_key(const kv_sha256 *base, const uint8_t parent[32], const uint8_t *chunk,
                      size_t n, uint8_t out[32]) {
    kv_sha256 s = *base;
    kv_sha256_update(&s, parent, 32);
    kv_sha256_update(&s, chunk, n);
    kv_sha256_digest(&s, out);
}

/* The probe of one key in a dict: 1 with getattr(value, attr) appended to ``attrs`` when
 * the key is there (and, with ``owner_attr``, its value's owner_attr equals ``owner``),
 * 0 when it is not, -1 with an exception set. */
static int probe_one(PyObject *mapping, PyObject *k, PyObject *attr, PyObject *owner_attr,
                     PyObject *owner, PyObject *attrs) {
    PyObject *value = PyDict_GetItemWithError(mapping, k); /* borrowed */
    if (!value) return PyErr_Occurred() ? -1 : 0;
    Py_INCREF(value); /* borrowed from the dict: keep it while getattr runs */
    if (owner_attr) {
        PyObject *o = PyObject_GetAttr(value, owner_attr);
        int same = o ? PyObject_RichCompareBool(o, owner, Py_EQ) : -1;
        Py_XDECREF(o);
        if (same <= 0) {
            Py_DECREF(value);
            return same;
        }
    }
    PyObject *a = PyObject_GetAttr(value, attr);
    Py_DECREF(value);
    int ok = a && PyList_Append(attrs, a) == 0;
    Py_XDECREF(a);
    return ok ? 1 : -1;
}

/* chain_keys(prefix, parent, data, step) -> list[bytes]
 * chain_probe(prefix, parent, data, step, mapping, attr) -> (keys, attrs, stop_key)
 *
 * The keys of data's step-byte chunks (the last may be shorter), each chained on the
 * one before, the first on ``parent``. chain_probe stops at the first key not in
 * ``mapping`` (a dict), returning the keys found, getattr(value, attr) of each, and
 * the missing key (None when every chunk was found). */
static PyObject *chain(PyObject *args, int probe) {
    Py_buffer prefix, parent, data;
    Py_ssize_t step;
    PyObject *mapping = NULL, *attr = NULL;
    if (probe) {
        if (!PyArg_ParseTuple(args, "y*y*y*nO!U:chain_probe", &prefix, &parent, &data, &step,
                              &PyDict_Type, &mapping, &attr))
            return NULL;
    } else if (!PyArg_ParseTuple(args, "y*y*y*n:chain_keys", &prefix, &parent, &data, &step)) {
        return NULL;
    }
    PyObject *keys = NULL, *attrs = NULL, *stop = NULL, *result = NULL;
    if (parent.len != 32 || step <= 0) {
        PyErr_SetString(PyExc_ValueError, "parent must be 32 bytes and step positive");
        goto done;
    }
    kv_sha256 base;
    absorb_prefix(&base, &prefix);
    keys = PyList_New(0);
    if (!keys || (probe && !(attrs = PyList_New(0)))) goto done;
    uint8_t key[32];
    const uint8_t *p = parent.buf, *buf = data.buf;
    for (Py_ssize_t off = 0; off < data.len; off += step) {
        Py_ssize_t n = data.len - off < step ? data.len - off : step;
        chunk_key(&base, p, buf + off, (size_t)n, key);
        PyObject *k = PyBytes_FromStringAndSize((const char *)key, 32);
        if (!k) goto done;
        if (probe) {
            int held = probe_one(mapping, k, attr, NULL, NULL, attrs);
            if (held < 0) {
                Py_DECREF(k);
                goto done;
            }
            if (!held) {
                stop = k;
                break;
            }
        }
        if (PyList_Append(keys, k) < 0) {
            Py_DECREF(k);
            goto done;
        }
        p = (const uint8_t *)PyBytes_AS_STRING(k);
        Py_DECREF(k); /* the list holds it, so p stays valid */
    }
    if (!probe) {
        result = keys;
        keys = NULL;
    } else {
        result = Py_BuildValue("(OOO)", keys, attrs, stop ? stop : Py_None);
    }
done:
    Py_XDECREF(keys);
    Py_XDECREF(attrs);
    Py_XDECREF(stop);
    PyBuffer_Release(&prefix);
    PyBuffer_Release(&parent);
    PyBuffer_Release(&data);
    return result;
}

static PyObject *py_chain_keys(PyObject *self, PyObject *args) { return chain(args, 0); }
static PyObject *py_chain_probe(PyObject *self, PyObject *args) { return chain(args, 1); }

/* probe_keys(keys, mapping, attr, owner_attr, owner) -> (attrs, stop_key)
 *
 * ``keys``: 32-byte keys, concatenated (what a client sent, hashed on its side). Walks
 * them until the first one not in ``mapping`` (a dict) or whose value's ``owner_attr``
 * is not equal to ``owner``; returns getattr(value, attr) of each key before it, and
 * that key (None when every key passed). */
static PyObject *py_probe_keys(PyObject *self, PyObject *args) {
    Py_buffer keys;
    PyObject *mapping, *attr, *owner_attr, *owner;
    if (!PyArg_ParseTuple(args, "y*O!UUO:probe_keys", &keys, &PyDict_Type, &mapping, &attr,
                          &owner_attr, &owner))
        return NULL;
    PyObject *attrs = NULL, *stop = NULL, *result = NULL;
    if (keys.len % 32) {
        PyErr_SetString(PyExc_ValueError, "keys must be 32 bytes each");
        goto done;
    }
    attrs = PyList_New(0);
    if (!attrs) goto done;
    const char *buf = keys.buf;
    for (Py_ssize_t off = 0; off < keys.len; off += 32) {
        PyObject *k = PyBytes_FromStringAndSize(buf + off, 32);
        if (!k) goto done;
        int held = probe_one(mapping, k, attr, owner_attr, owner, attrs);
        if (held < 0) {
            Py_DECREF(k);
            goto done;
        }
        if (!held) {
            stop = k;
            break;
        }
        Py_DECREF(k);
    }
    result = Py_BuildValue("(OO)", attrs, stop ? stop : Py_None);
done:
    Py_XDECREF(attrs);
    Py_XDECREF(stop);
    PyBuffer_Release(&keys);
    return result;
}

/* prefix_digests(prefix, data, unit, size) -> bytes
 * One entry per whole ``unit`` bytes of data: the first ``size`` bytes of
 * SHA-256(prefix || data[:(j+1)*unit]). */
static PyObject *py_prefix_digests(PyObject *self, PyObject *args) {
    Py_buffer prefix, data;
    Py_ssize_t unit, size;
    if (!PyArg_ParseTuple(args, "y*y*nn:prefix_digests", &prefix, &data, &unit, &size))
        return NULL;
    PyObject *result = NULL;
    if (unit <= 0 || size <= 0 || size > 32) {
        PyErr_SetString(PyExc_ValueError, "unit must be positive and size in [1, 32]");
        goto done;
    }
    Py_ssize_t count = data.len / unit;
    result = PyBytes_FromStringAndSize(NULL, count * size);
    if (!result) goto done;
    uint8_t *out = (uint8_t *)PyBytes_AS_STRING(result), digest[32];
    kv_sha256 s;
    absorb_prefix(&s, &prefix);
    for (Py_ssize_t j = 0; j < count; j++) {
        kv_sha256_update(&s, (const uint8_t *)data.buf + j * unit, (size_t)unit);
        kv_sha256_digest(&s, digest);
        memcpy(out + j * size, digest, (size_t)size);
    }
done:
    PyBuffer_Release(&prefix);
    PyBuffer_Release(&data);
    return result;
}

/* u32le(ids) -> bytes: a list or tuple of ints as little-endian u32, each checked to
 * be in [0, 2**32). vLLM hands prompts over as lists; array("I", ids) spends ~13 ns
 * an id (1.7 ms for 128k tokens) where this loop spends a few. */
static PyObject *py_u32le(PyObject *self, PyObject *arg) {
    PyObject *seq = PySequence_Fast(arg, "token ids must be a list or tuple of ints");
    if (!seq) return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    PyObject **items = PySequence_Fast_ITEMS(seq);
    PyObject *out = PyBytes_FromStringAndSize(NULL, n * 4);
    if (!out) goto fail;
    uint8_t *p = (uint8_t *)PyBytes_AS_STRING(out);
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *v = items[i];
        unsigned long x;
        if (PyLong_Check(v)) {
            x = PyLong_AsUnsignedLong(v);
        } else { /* numpy integers and other __index__ types, as array("I") takes them */
            Py_INCREF(v);
            PyObject *iv = PyNumber_Index(v); /* Python code: may change a list under us */
            if (!iv) {
                if (PyErr_ExceptionMatches(PyExc_TypeError)) {
                    PyErr_Clear();
                    PyErr_Format(PyExc_TypeError, "token id %zd is %.100s, not an int", i,
                                 Py_TYPE(v)->tp_name);
                }
                Py_DECREF(v);
                goto fail;
            }
            Py_DECREF(v);
            x = PyLong_AsUnsignedLong(iv);
            Py_DECREF(iv);
            if (PySequence_Fast_GET_SIZE(seq) != n) {
                PyErr_SetString(PyExc_RuntimeError, "the token id list changed while it was read");
                goto fail;
            }
            items = PySequence_Fast_ITEMS(seq); /* the list may have been reallocated */
        }
        if ((x == (unsigned long)-1 && PyErr_Occurred()) || x > 0xFFFFFFFFul) {
            PyErr_Clear();
            PyErr_Format(PyExc_OverflowError, "token id %zd is not in [0, 4294967295]", i);
            goto fail;
        }
        p[4 * i] = (uint8_t)x;
        p[4 * i + 1] = (uint8_t)(x >> 8);
        p[4 * i + 2] = (uint8_t)(x >> 16);
        p[4 * i + 3] = (uint8_t)(x >> 24);
    }
    Py_DECREF(seq);
    return out;
fail:
    Py_XDECREF(out);
    Py_DECREF(seq);
    return NULL;
}

/* -- copies that hash what landed (copies.c) ---------------------------------------- */

static PyObject *py_copies_impl(PyObject *self, PyObject *noargs) {
    return PyUnicode_FromString(kv_copies_impl());
}

static PyObject *py_copies_select(PyObject *self, PyObject *arg) {
    int baseline = PyObject_IsTrue(arg);
    if (baseline < 0) return NULL;
    kv_copies_select(baseline);
    return PyUnicode_FromString(kv_copies_impl());
}

/* advise(address, size, advice, piece) -> int: madvise [address, address + size) one
 * piece of ``piece`` bytes at a time; 0, or the errno of the first piece refused (the
 * rest is not advised). Each call holds the process's mapping lock while it runs, and
 * whatever maps memory meanwhile (a thread's stack, a large allocation) waits for it:
 * small pieces keep that wait short. The GIL is let go for the whole loop, where a
 * Python loop of ctypes calls would take it back after every piece. */
static PyObject *py_advise(PyObject *self, PyObject *args) {
    unsigned long long address;
    Py_ssize_t size, piece;
    int advice;
    if (!PyArg_ParseTuple(args, "Knin:advise", &address, &size, &advice, &piece)) return NULL;
    if (size < 0 || piece <= 0) {
        PyErr_SetString(PyExc_ValueError, "size must be >= 0 and piece > 0");
        return NULL;
    }
    int err = 0;
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t off = 0; off < size; off += piece) {
        Py_ssize_t n = size - off < piece ? size - off : piece;
        if (madvise((void *)(uintptr_t)(address + (unsigned long long)off), (size_t)n,
                    advice) != 0) {
            err = errno;
            break;
        }
    }
    Py_END_ALLOW_THREADS
    return PyLong_FromLong(err);
}

/* Whether [a, a+n) and [b, b+n) share a byte. */
static int overlap(const uint8_t *a, const uint8_t *b, Py_ssize_t n) {
    return n > 0 && a < b + n && b < a + n;
}

/* xxh3_2(a, b) -> int: the xxh3_64 of a followed by b, in one call (a record
 * header's checksum covers its fixed fields and its token ids, which the stored
 * checksum separates). */
static PyObject *py_xxh3_2(PyObject *self, PyObject *args) {
    Py_buffer a, b;
    if (!PyArg_ParseTuple(args, "y*y*:xxh3_2", &a, &b)) return NULL;
    uint64_t h = kv_xxh3_2(a.buf, (size_t)a.len, b.buf, (size_t)b.len);
    PyBuffer_Release(&a);
    PyBuffer_Release(&b);
    return PyLong_FromUnsignedLongLong(h);
}

/* copy(dst, src): copy src into dst (same length); overlapping buffers as memmove.
 * copy_xxh3(dst, src) -> int: the same, returning the xxh3_64 of the bytes as they are
 * in dst. */
static PyObject *copy_into(PyObject *args, int hash) {
    Py_buffer dst, src;
    if (!PyArg_ParseTuple(args, hash ? "w*y*:copy_xxh3" : "w*y*:copy", &dst, &src))
        return NULL;
    PyObject *result = NULL;
    if (dst.len != src.len) {
        PyErr_Format(PyExc_ValueError, "dst is %zd bytes, src %zd", dst.len, src.len);
    } else {
        uint64_t h = 0;
        size_t n = (size_t)dst.len;
        if (overlap(dst.buf, src.buf, dst.len)) {
            memmove(dst.buf, src.buf, n);
            if (hash) h = kv_xxh3(dst.buf, n);
        } else if (dst.len >= NOGIL_BYTES) {
            Py_BEGIN_ALLOW_THREADS
            if (hash)
                h = kv_copy_xxh3(dst.buf, src.buf, n);
            else
                kv_copy(dst.buf, src.buf, n);
            Py_END_ALLOW_THREADS
        } else if (hash) {
            h = kv_copy_xxh3(dst.buf, src.buf, n);
        } else {
            kv_copy(dst.buf, src.buf, n);
        }
        result = hash ? PyLong_FromUnsignedLongLong(h) : Py_NewRef(Py_None);
    }
    PyBuffer_Release(&dst);
    PyBuffer_Release(&src);
    return result;
}

static PyObject *py_copy(PyObject *self, PyObject *args) { return copy_into(args, 0); }
static PyObject *py_copy_xxh3(PyObject *self, PyObject *args) { return copy_into(args, 1); }

/* A scatter's spans: ``spans_obj`` read once (a snapshot: parsing a span may run Python
 * code) into ``width`` (3 or 4) Py_ssize_t each, (offset in a, offset in b, length[,
 * stream]), each checked to lie inside both buffers without overlapping itself.
 * ``shape`` and ``overlaps`` are the errors for a span that is not such a tuple and for
 * one that overlaps. NULL with an exception set; free the result with PyMem_Free. */
static Py_ssize_t *parse_spans(PyObject *spans_obj, int width, const Py_buffer *a,
                               const Py_buffer *b, const char *shape, const char *overlaps,
                               Py_ssize_t *count) {
    PyObject *spans = PySequence_Tuple(spans_obj);
    if (!spans) return NULL;
    Py_ssize_t n_spans = PyTuple_GET_SIZE(spans);
    Py_ssize_t *out = PyMem_Malloc(sizeof *out * (size_t)width * (size_t)(n_spans ? n_spans : 1));
    if (!out) {
        PyErr_NoMemory();
        goto fail;
    }
    for (Py_ssize_t i = 0; i < n_spans; i++) {
        PyObject *t = PyTuple_GET_ITEM(spans, i);
        Py_ssize_t *s = out + i * width;
        if (!PyTuple_Check(t)) {
            PyErr_SetString(PyExc_TypeError, shape);
            goto fail;
        }
        if (!(width == 3 ? PyArg_ParseTuple(t, "nnn", s, s + 1, s + 2)
                         : PyArg_ParseTuple(t, "nnnn", s, s + 1, s + 2, s + 3)))
            goto fail;
        Py_ssize_t off = s[0], pos = s[1], n = s[2];
        if (off < 0 || pos < 0 || n < 0 || off > a->len - n || pos > b->len - n) {
            PyErr_Format(PyExc_ValueError, "span (%zd, %zd, %zd) is outside the buffers", off,
                         pos, n);
            goto fail;
        }
        if (overlap((uint8_t *)a->buf + off, (uint8_t *)b->buf + pos, n)) {
            PyErr_SetString(PyExc_ValueError, overlaps);
            goto fail;
        }
    }
    Py_DECREF(spans);
    *count = n_spans;
    return out;
fail:
    PyMem_Free(out);
    Py_DECREF(spans);
    return NULL;
}

/* scatter_xxh3(arena, buf, spans, into_arena) -> int
 * Copy between ``buf`` and the arena along ``spans``, (arena offset, buf offset,
 * length) triples: into the arena when ``into_arena``, out of it otherwise. Returns
 * the xxh3_64 of the bytes where they landed, in span order. */
static PyObject *py_scatter_xxh3(PyObject *self, PyObject *args) {
    Py_buffer arena, buf;
    PyObject *spans_obj;
    int into;
    if (!PyArg_ParseTuple(args, "y*y*Op:scatter_xxh3", &arena, &buf, &spans_obj, &into))
        return NULL;
    PyObject *result = NULL;
    Py_ssize_t (*trip)[3] = NULL, count = 0;
    if (into ? arena.readonly : buf.readonly) {
        PyErr_SetString(PyExc_ValueError, into ? "the arena is read-only" : "buf is read-only");
        goto done;
    }
    trip = (Py_ssize_t(*)[3])parse_spans(spans_obj, 3, &arena, &buf,
                                         "each span is an (offset, position, length) tuple",
                                         "the buffer overlaps the arena span", &count);
    if (!trip) goto done;
    uint64_t h = 0;
    uint8_t *a = arena.buf, *b = buf.buf;
    if (count == 1) { /* one extent (most records): the one-pass copy */
        uint8_t *mine = a + trip[0][0], *theirs = b + trip[0][1];
        size_t n = (size_t)trip[0][2];
        Py_BEGIN_ALLOW_THREADS
        h = into ? kv_copy_xxh3(mine, theirs, n) : kv_copy_xxh3(theirs, mine, n);
        Py_END_ALLOW_THREADS
    } else {
        kv_stream *st = kv_stream_new();
        if (!st) {
            PyErr_NoMemory();
            goto done;
        }
        Py_BEGIN_ALLOW_THREADS
        for (Py_ssize_t i = 0; i < count; i++) {
            uint8_t *mine = a + trip[i][0], *theirs = b + trip[i][1];
            size_t n = (size_t)trip[i][2];
            if (into)
                kv_stream_copy(st, mine, theirs, n);
            else
                kv_stream_copy(st, theirs, mine, n);
        }
        h = kv_stream_digest(st);
        Py_END_ALLOW_THREADS
        kv_stream_free(st);
    }
    result = PyLong_FromUnsignedLongLong(h);
done:
    PyMem_Free(trip);
    PyBuffer_Release(&arena);
    PyBuffer_Release(&buf);
    return result;
}


/* -- streams: payloads copied part by part -------------------------------------------
 *
 * Streams(n): n xxh3_64 streams, each the hash of one payload whose bytes arrive in
 * several calls of scatter_streams (a paged KV cache is loaded one layer of every
 * chunk at a time, so a layer can be used before the next one is copied). digest(i)
 * ends stream i and returns its hash; a stream takes no bytes after that. A Streams is
 * used by one thread at a time: a call while another runs raises. */
typedef struct {
    PyObject_HEAD
    Py_ssize_t n;
    kv_stream **s;
    uint64_t *digest;
    char *ended;
    int busy;
} StreamsObject;

static void streams_dealloc(StreamsObject *o) {
    for (Py_ssize_t i = 0; o->s && i < o->n; i++)
        if (o->s[i]) kv_stream_free(o->s[i]);
    PyMem_Free(o->s);
    PyMem_Free(o->digest);
    PyMem_Free(o->ended);
    Py_TYPE(o)->tp_free((PyObject *)o);
}

static int streams_init(StreamsObject *o, PyObject *args, PyObject *kw) {
    Py_ssize_t n;
    if (kw && PyDict_Size(kw)) {
        PyErr_SetString(PyExc_TypeError, "Streams takes no keyword arguments");
        return -1;
    }
    if (!PyArg_ParseTuple(args, "n:Streams", &n)) return -1;
    if (o->s || n < 0) {
        PyErr_SetString(PyExc_ValueError, o->s ? "Streams is already set up" : "n < 0");
        return -1;
    }
    size_t m = (size_t)(n ? n : 1);
    o->s = PyMem_Calloc(m, sizeof *o->s);
    o->digest = PyMem_Calloc(m, sizeof *o->digest);
    o->ended = PyMem_Calloc(m, 1);
    if (!o->s || !o->digest || !o->ended) {
        PyErr_NoMemory();
        return -1;
    }
    o->n = n;
    for (Py_ssize_t i = 0; i < n; i++) {
        if (!(o->s[i] = kv_stream_new())) {
            PyErr_NoMemory();
            return -1;
        }
    }
    return 0;
}

static PyObject *streams_digest(StreamsObject *o, PyObject *arg) {
    Py_ssize_t i = PyNumber_AsSsize_t(arg, PyExc_IndexError);
    if (i == -1 && PyErr_Occurred()) return NULL;
    if (i < 0 || i >= o->n) {
        PyErr_SetString(PyExc_IndexError, "no such stream");
        return NULL;
    }
    if (o->busy) {
        PyErr_SetString(PyExc_RuntimeError, "Streams is in use by another call");
        return NULL;
    }
    if (!o->ended[i]) {
        o->digest[i] = kv_stream_digest(o->s[i]);
        o->ended[i] = 1;
    }
    return PyLong_FromUnsignedLongLong(o->digest[i]);
}

static Py_ssize_t streams_len(StreamsObject *o) { return o->n; }

static PyMethodDef streams_methods[] = {
    {"digest", (PyCFunction)streams_digest, METH_O,
     "End stream i (no more bytes go into it) and return its xxh3_64."},
    {NULL, NULL, 0, NULL},
};

static PySequenceMethods streams_seq = {.sq_length = (lenfunc)streams_len};

static PyTypeObject StreamsType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "kvstore._native.Streams",
    .tp_basicsize = sizeof(StreamsObject),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "Streams(n): n xxh3_64 streams fed by scatter_streams, ended by digest(i).",
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)streams_init,
    .tp_dealloc = (destructor)streams_dealloc,
    .tp_methods = streams_methods,
    .tp_as_sequence = &streams_seq,
};

/* scatter_streams(streams, src, dst, spans)
 * Copy src into dst along ``spans``, (src offset, dst offset, length, stream) tuples,
 * each span's bytes hashed onto the end of its stream where they landed, in span order.
 * The GIL is let go for the copies; the stores are fenced before it returns. */
static PyObject *py_scatter_streams(PyObject *self, PyObject *args) {
    PyObject *streams_obj, *spans_obj;
    Py_buffer src, dst;
    if (!PyArg_ParseTuple(args, "O!y*w*O:scatter_streams", &StreamsType, &streams_obj, &src,
                          &dst, &spans_obj))
        return NULL;
    StreamsObject *st = (StreamsObject *)streams_obj;
    PyObject *result = NULL;
    Py_ssize_t (*span)[4] = NULL, count = 0, total = 0;
    if (st->busy) {
        PyErr_SetString(PyExc_RuntimeError, "Streams is in use by another call");
        goto done;
    }
    span = (Py_ssize_t(*)[4])parse_spans(
        spans_obj, 4, &src, &dst, "each span is a (src offset, dst offset, length, stream) tuple",
        "a span's source and destination overlap", &count);
    if (!span) goto done;
    for (Py_ssize_t i = 0; i < count; i++) {
        Py_ssize_t k = span[i][3];
        if (k < 0 || k >= st->n || st->ended[k]) {
            PyErr_Format(PyExc_ValueError, "stream %zd is not an open stream of these", k);
            goto done;
        }
        total += span[i][2];
    }
    st->busy = 1;
    uint8_t *a = src.buf, *b = dst.buf;
    if (total >= NOGIL_BYTES) {
        Py_BEGIN_ALLOW_THREADS
        for (Py_ssize_t i = 0; i < count; i++)
            kv_stream_copy(st->s[span[i][3]], b + span[i][1], a + span[i][0], (size_t)span[i][2]);
        kv_copies_fence();
        Py_END_ALLOW_THREADS
    } else {
        for (Py_ssize_t i = 0; i < count; i++)
            kv_stream_copy(st->s[span[i][3]], b + span[i][1], a + span[i][0], (size_t)span[i][2]);
        kv_copies_fence();
    }
    st->busy = 0;
    result = Py_NewRef(Py_None);
done:
    PyMem_Free(span);
    PyBuffer_Release(&src);
    PyBuffer_Release(&dst);
    return result;
}

static PyMethodDef methods[] = {
    {"sha256", py_sha256, METH_O, "SHA-256 of a buffer (for tests of the block function)."},
    {"sha256_impl", py_sha256_impl, METH_NOARGS, "The SHA-256 block function in use."},
    {"sha256_select", py_sha256_select, METH_O,
     "Use the portable block function when true, the best one otherwise."},
    {"chain_keys", py_chain_keys, METH_VARARGS, "Chained SHA-256 keys of a prompt's chunks."},
    {"chain_probe", py_chain_probe, METH_VARARGS,
     "Chained keys up to the first one missing from a dict."},
    {"probe_keys", py_probe_keys, METH_VARARGS,
     "Leading 32-byte keys held in a dict by one owner, up to the first that is not."},
    {"prefix_digests", py_prefix_digests, METH_VARARGS,
     "Truncated SHA-256 of each whole-unit prefix."},
    {"u32le", py_u32le, METH_O, "A list or tuple of ints as little-endian u32 bytes."},
    {"copies_impl", py_copies_impl, METH_NOARGS, "The copy+hash implementation in use."},
    {"copies_select", py_copies_select, METH_O,
     "Use the baseline copy+hash when true, the best one otherwise."},
    {"xxh3_2", py_xxh3_2, METH_VARARGS, "xxh3_64 of two buffers as if concatenated."},
    {"copy", py_copy, METH_VARARGS, "Copy one buffer into another of the same length."},
    {"copy_xxh3", py_copy_xxh3, METH_VARARGS, "Copy, returning the xxh3_64 of the copy."},
    {"scatter_xxh3", py_scatter_xxh3, METH_VARARGS,
     "Copy along arena spans, returning the xxh3_64 of what landed."},
    {"scatter_streams", py_scatter_streams, METH_VARARGS,
     "Copy along spans, hashing each span onto its stream of a Streams."},
    {"advise", py_advise, METH_VARARGS,
     "madvise a range in pieces without the GIL; 0 or the first errno."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "kvstore._native",
    "Native loops for kvstore (see kvstore/accel.py for their pure-Python twins).", -1,
    methods, NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__native(void) {
    kv_sha256_select(0);
    kv_copies_select(0);
    if (PyType_Ready(&StreamsType) < 0) return NULL;
    PyObject *m = PyModule_Create(&module);
    if (!m) return NULL;
    if (PyModule_AddObjectRef(m, "Streams", (PyObject *)&StreamsType) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
