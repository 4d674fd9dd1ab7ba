/* Compiled prompt hashing for eventlog/hashing.py (design.md §4): the same tokens_hash and
 * sequence-hash chain as the pure-Python code, which stays the reference implementation.
 *
 * Hashing a prompt in Python pays an interpreter round trip per block (512 for 8 k tokens):
 * cutting the block out, calling xxhash, boxing the digest. Here the whole prompt is one call:
 * the token ids are packed as little-endian u32 once, and each block's xxh3_64 comes from the
 * xxhash package itself, never from a copy of its sources. `bind` hands this module the package's
 * own XXH3_64bits_withSeed entry point when its extension module exports it (found with dlsym in
 * the already loaded library), and otherwise its Python function `xxh3_64_intdigest`, called
 * through the C API. Either way the digests are the package's, so the hash cannot drift.
 *
 * Any input this code does not take on (a token that is not an int in [0, 2**32), an object that
 * is neither a list, a tuple nor bytes) returns None: the caller then runs the Python code, which
 * raises the error it always raised.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#if defined(__unix__) || defined(__APPLE__)
#include <dlfcn.h>
#define HAVE_DLSYM 1
#endif

typedef uint64_t (*xxh3_seeded)(const void *input, size_t length, uint64_t seed);

static xxh3_seeded direct_xxh3 = NULL; /* the package's C function, when found */
static PyObject *python_xxh3 = NULL;   /* else its xxh3_64_intdigest */

static const uint64_t CHAIN_MULTIPLIER = 0x9E3779B97F4A7C15ULL; /* eventlog.hashing's P */

/* bind(library_path or None, xxh3_64_intdigest) -> True when the C entry point was found. */
static PyObject *
bind(PyObject *self, PyObject *args)
{
    PyObject *path;
    PyObject *func;
    if (!PyArg_ParseTuple(args, "OO:bind", &path, &func))
        return NULL;
    if (!PyCallable_Check(func)) {
        PyErr_SetString(PyExc_TypeError, "bind: the xxh3 function must be callable");
        return NULL;
    }
    Py_INCREF(func);
    Py_XSETREF(python_xxh3, func);
    direct_xxh3 = NULL;
#ifdef HAVE_DLSYM
    if (path != Py_None) {
        const char *file = PyUnicode_AsUTF8(path);
        if (file == NULL)
            return NULL;
        /* The package is imported already: this finds its library, it loads nothing new. */
#ifdef RTLD_NOLOAD
        void *handle = dlopen(file, RTLD_NOW | RTLD_LOCAL | RTLD_NOLOAD);
#else
        void *handle = dlopen(file, RTLD_NOW | RTLD_LOCAL);
#endif
        if (handle != NULL)
            direct_xxh3 = (xxh3_seeded)dlsym(handle, "XXH3_64bits_withSeed");
    }
#endif
    return PyBool_FromLong(direct_xxh3 != NULL);
}

/* Little-endian u32 bytes of the first `count` token ids of a list or tuple.
 * 0 on success, 1 when the Python code must take over (no exception left set). */
static int
pack_tokens(PyObject *seq, Py_ssize_t count, unsigned char *out)
{
    PyObject **items = PySequence_Fast_ITEMS(seq);
    for (Py_ssize_t i = 0; i < count; i++) {
        PyObject *item = items[i];
        unsigned long value;
#if PY_VERSION_HEX < 0x030C0000 && PyLong_SHIFT == 30
        /* A token id is one 30-bit digit (or zero): read it directly, not through
         * PyLong_AsUnsignedLong's call and checks, which were half of hashing an 8 k-token
         * prompt. */
        if (PyLong_CheckExact(item) && (Py_SIZE(item) == 0 || Py_SIZE(item) == 1)) {
            value = Py_SIZE(item) ? ((PyLongObject *)item)->ob_digit[0] : 0;
            out[4 * i] = (unsigned char)value;
            out[4 * i + 1] = (unsigned char)(value >> 8);
            out[4 * i + 2] = (unsigned char)(value >> 16);
            out[4 * i + 3] = (unsigned char)(value >> 24);
            continue;
        }
#endif
        if (!PyLong_Check(item))
            return 1;
        value = PyLong_AsUnsignedLong(item);
        if (value == (unsigned long)-1 && PyErr_Occurred()) {
            PyErr_Clear();
            return 1;
        }
        if (value > 0xFFFFFFFFUL)
            return 1;
        out[4 * i] = (unsigned char)value;
        out[4 * i + 1] = (unsigned char)(value >> 8);
        out[4 * i + 2] = (unsigned char)(value >> 16);
        out[4 * i + 3] = (unsigned char)(value >> 24);
    }
    return 0;
}

/* xxh3_64 of `length` bytes with `seed`; -1 with an exception set on failure. */
static int
block_hash(const unsigned char *data, Py_ssize_t length, PyObject *seed, uint64_t seed_value,
           uint64_t *out)
{
    if (direct_xxh3 != NULL) {
        *out = direct_xxh3(data, (size_t)length, seed_value);
        return 0;
    }
    PyObject *chunk = PyBytes_FromStringAndSize((const char *)data, length);
    if (chunk == NULL)
        return -1;
    PyObject *digest = PyObject_CallFunctionObjArgs(python_xxh3, chunk, seed, NULL);
    Py_DECREF(chunk);
    if (digest == NULL)
        return -1;
    *out = PyLong_AsUnsignedLongLong(digest);
    Py_DECREF(digest);
    if (*out == (uint64_t)-1 && PyErr_Occurred())
        return -1;
    return 0;
}

/* The tokens' full blocks as one little-endian u32 buffer. Returns the buffer (the bytes
 * object's own, or `*heap` to free) or NULL: with an exception set on error, without one when the Python
 * code must take over. */
static const unsigned char *
token_bytes(PyObject *tokens, Py_ssize_t block_size, Py_ssize_t *blocks, unsigned char **heap)
{
    Py_ssize_t block_bytes = 4 * block_size;
    *heap = NULL;
    if (PyBytes_CheckExact(tokens)) {
        *blocks = PyBytes_GET_SIZE(tokens) / block_bytes;
        return (const unsigned char *)PyBytes_AS_STRING(tokens);
    }
    if (!PyList_CheckExact(tokens) && !PyTuple_CheckExact(tokens))
        return NULL;
    /* A list is not copied: nothing in this call runs Python code before the packing ends. */
    Py_ssize_t count = PySequence_Fast_GET_SIZE(tokens);
    *blocks = count / block_size;
    Py_ssize_t used = *blocks * block_size;
    if (used == 0)
        return (const unsigned char *)"";
    *heap = PyMem_Malloc((size_t)used * 4);
    if (*heap == NULL) {
        PyErr_NoMemory();
        return NULL;
    }
    if (pack_tokens(tokens, used, *heap) != 0) {
        PyMem_Free(*heap);
        *heap = NULL;
        return NULL;
    }
    return *heap;
}

/* hash_blocks(tokens, block_size, seed, salt, first_salt, chain) -> list[int] | None
 *
 * Every full block's xxh3_64(seed) xor salt (the first block also xor first_salt); with chain
 * true, the sequence-hash chain over those values (seq[0] = value[0]). None: use Python. */
static PyObject *
hash_blocks(PyObject *self, PyObject *args)
{
    PyObject *tokens;
    Py_ssize_t block_size;
    PyObject *seed;
    unsigned long long salt;
    unsigned long long first_salt;
    int chain;
    if (!PyArg_ParseTuple(args, "OnOKKp:hash_blocks", &tokens, &block_size, &seed, &salt,
                          &first_salt, &chain))
        return NULL;
    if (python_xxh3 == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "hash_blocks: bind() was never called");
        return NULL;
    }
    if (block_size <= 0) {
        PyErr_SetString(PyExc_ValueError, "block_size must be positive");
        return NULL;
    }
    if (block_size > PY_SSIZE_T_MAX / 4)
        Py_RETURN_NONE; /* its byte length would not fit: the Python code handles it */
    uint64_t seed_value = PyLong_AsUnsignedLongLong(seed);
    if (seed_value == (uint64_t)-1 && PyErr_Occurred())
        return NULL;
    Py_ssize_t blocks = 0;
    unsigned char *heap;
    const unsigned char *raw = token_bytes(tokens, block_size, &blocks, &heap);
    if (raw == NULL) {
        if (PyErr_Occurred())
            return NULL;
        Py_RETURN_NONE;
    }
    PyObject *out = PyList_New(blocks);
    if (out == NULL) {
        PyMem_Free(heap);
        return NULL;
    }
    Py_ssize_t block_bytes = 4 * block_size;
    uint64_t seq = 0;
    for (Py_ssize_t i = 0; i < blocks; i++) {
        uint64_t value;
        if (block_hash(raw + i * block_bytes, block_bytes, seed, seed_value, &value) != 0)
            goto fail;
        value ^= (uint64_t)salt;
        if (i == 0)
            value ^= (uint64_t)first_salt;
        if (chain) {
            seq = seq * CHAIN_MULTIPLIER + value; /* unsigned arithmetic wraps: mod 2**64 */
            value = seq;
        }
        PyObject *number = PyLong_FromUnsignedLongLong(value);
        if (number == NULL)
            goto fail;
        PyList_SET_ITEM(out, i, number);
    }
    PyMem_Free(heap);
    return out;
fail:
    PyMem_Free(heap);
    Py_DECREF(out);
    return NULL;
}

static PyMethodDef methods[] = {
    {"bind", bind, METH_VARARGS,
     "bind(library_path, xxh3_64_intdigest): the xxh3 to call; True if the C entry was found."},
    {"hash_blocks", hash_blocks, METH_VARARGS,
     "hash_blocks(tokens, block_size, seed, salt, first_salt, chain) -> list[int] | None"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_fasthash",
    "Compiled prompt hashing; eventlog/hashing.py holds the reference code.", -1, methods,
};

PyMODINIT_FUNC
PyInit__fasthash(void)
{
    return PyModule_Create(&module);
}
