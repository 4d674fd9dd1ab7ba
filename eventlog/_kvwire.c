/* A BlocksStored's `blocks`, read from its msgpack bytes straight into u64 words
 * (eventlog/kv_decode.py).
 *
 * Decoding a KV message into Python objects makes, for every block, a tuple and two ints of three
 * digits each, which the compact index's kernel reads back into u64s and the garbage of which is
 * then freed: ~60 % of reading a replayed KV stream that the index itself does not spend. Here the
 * value msgspec left undecoded (a msgspec.Raw) becomes 16 bytes a block, (block id, tokens hash)
 * in native byte order, in one pass.
 *
 * It takes on exactly one shape: an array of arrays of two non-negative integers, in any of
 * msgpack's array and integer encodings (fixarray, array 16/32; positive fixint, uint 8-64,
 * int 8-64 holding a value >= 0), and nothing after it. Anything else returns None and the caller
 * decodes the message with msgspec, whose verdict (a value or an error) then stands: this code
 * never accepts what `list[tuple[Hash, Hash]]` would refuse, and never refuses on its own.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

typedef struct {
    const unsigned char *p, *end;
} Cursor;

static inline int take(Cursor *c, Py_ssize_t n, const unsigned char **at)
{
    if (c->end - c->p < n)
        return 0;
    *at = c->p;
    c->p += n;
    return 1;
}

static inline uint64_t big_endian(const unsigned char *b, int n)
{
    uint64_t v = 0;
    for (int i = 0; i < n; i++)
        v = (v << 8) | b[i];
    return v;
}

/* An array header: its length, or -1 when the next value is not an array. */
static Py_ssize_t array_length(Cursor *c)
{
    const unsigned char *b;
    if (!take(c, 1, &b))
        return -1;
    if ((b[0] & 0xf0) == 0x90)
        return b[0] & 0x0f;
    if (b[0] == 0xdc)
        return take(c, 2, &b) ? (Py_ssize_t)big_endian(b, 2) : -1;
    if (b[0] == 0xdd)
        return take(c, 4, &b) ? (Py_ssize_t)big_endian(b, 4) : -1;
    return -1;
}

/* A non-negative integer into *out: 1, or 0 when the next value is anything else. */
static int unsigned_int(Cursor *c, uint64_t *out)
{
    const unsigned char *b;
    if (!take(c, 1, &b))
        return 0;
    unsigned char tag = b[0];
    if (tag <= 0x7f) {
        *out = tag;
        return 1;
    }
    int width;
    switch (tag) {
    case 0xcc: case 0xd0: width = 1; break;
    case 0xcd: case 0xd1: width = 2; break;
    case 0xce: case 0xd2: width = 4; break;
    case 0xcf: case 0xd3: width = 8; break;
    default: return 0; /* negative fixint, nil, bool, float, str, bin, array, map, ext */
    }
    if (!take(c, width, &b))
        return 0;
    if (tag >= 0xd0 && (b[0] & 0x80))
        return 0; /* a signed encoding of a negative value: Hash is >= 0 */
    *out = big_endian(b, width);
    return 1;
}

static PyObject *pair_words(PyObject *self, PyObject *arg)
{
    Py_buffer view;
    if (PyObject_GetBuffer(arg, &view, PyBUF_SIMPLE) < 0)
        return NULL;
    Cursor c = {(const unsigned char *)view.buf, (const unsigned char *)view.buf + view.len};
    PyObject *out = NULL;
    Py_ssize_t n = array_length(&c);
    /* every block takes at least 3 bytes (a fixarray and two fixints): a longer count is a lie */
    if (n < 0 || n > (c.end - c.p) / 3)
        goto not_taken;
    out = PyBytes_FromStringAndSize(NULL, n * 16);
    if (out == NULL)
        goto done;
    uint64_t *words = (uint64_t *)PyBytes_AS_STRING(out);
    for (Py_ssize_t i = 0; i < n; i++) {
        if (array_length(&c) != 2 || !unsigned_int(&c, &words[2 * i])
            || !unsigned_int(&c, &words[2 * i + 1]))
            goto not_taken;
    }
    if (c.p != c.end)
        goto not_taken;
    goto done;
not_taken:
    Py_XDECREF(out);
    out = Py_NewRef(Py_None);
done:
    PyBuffer_Release(&view);
    return out;
}

static PyMethodDef methods[] = {
    {"pair_words", pair_words, METH_O,
     "pair_words(msgpack) -> bytes | None: an array of [u64, u64] arrays as 16 bytes a pair "
     "(native order), or None for any other value."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_kvwire",
    "A BlocksStored's blocks read from msgpack into u64 words; eventlog/kv_decode.py.", -1,
    methods,
};

PyMODINIT_FUNC
PyInit__kvwire(void)
{
    return PyModule_Create(&module);
}
