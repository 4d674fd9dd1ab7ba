/* The compact prefix index's kernel (_fastindex.c): its prefix match, one call a query.
 *
 * prefix_match(holders, seq_hashes) -> (slots, lengths), or None where the Python code must
 * answer (a hash that is not an int in [0, 2**64), a sequence that is neither a list, a tuple
 * nor a 1-d u64 buffer). prefix_match(holders, seq_hashes, by_slot) writes each length at its
 * slot of by_slot (int64, zeros, a cell per slot) instead and returns how many slots matched
 * (match_columns: no list to turn into an array). The answer is PrefixIndex._match_python's (index.py: prefix_holders,
 * then the one-holder shortcut or NodeHolders.match): each slot that holds the query's first
 * block, with its match length, the number of leading blocks it holds; in order of length, then
 * slot. The Python code looks up all of the query's hashes at once, takes their holder values up
 * to the first one nobody holds, and ANDs bitmap rows along them; here the walk goes block by
 * block and stops as soon as no slot still matches, keeping the running set as one slot (the
 * common case: one worker's conversation) until a bitmap row splits it.
 *
 * At 25.6 M pairs the node table is hundreds of MB: every lookup is a cache miss, so the lookups
 * run ahead of the walk (Lookups: the keys of block i + 2 * MATCH_AHEAD asked for, the cell of
 * block i + MATCH_AHEAD found and its value asked for, while block i is read). Reads only; the
 * index is not changed. Pure: no I/O, no clock, no randomness.
 */
#include "_fastindex.h"

#define MATCH_AHEAD 8 /* blocks looked up ahead of the one read (4-12 measured: 8-12 alike) */
#define RING 32 /* a power of two above MATCH_AHEAD */
#define FEW_HASHES 1024 /* a query this long converts its hashes on the stack */
#define FEW_WORDS 16    /* bitmaps this wide (1,024 slots) keep the running set on the stack */

static PyObject *a_nodes, *a_rows;

/* PyLong_AsUnsignedLongLong goes through _PyLong_AsByteArray in CPython 3.11; the unsigned long
 * conversion reads the digits directly, ~2x faster for 512 hashes a query. */
#if ULONG_MAX == UINT64_MAX
#define AS_U64(v) ((uint64_t)PyLong_AsUnsignedLong(v))
#else
#define AS_U64(v) ((uint64_t)PyLong_AsUnsignedLongLong(v))
#endif

int match_names(void)
{
    return (a_nodes = PyUnicode_InternFromString("nodes"))
        && (a_rows = PyUnicode_InternFromString("rows")) ? 0 : -1;
}

/* The query's hashes as u64: 0, 1 when Python must answer, -1 on error. */
static int read_hashes(PyObject *seq, uint64_t *out, Py_ssize_t n)
{
    if (PyList_Check(seq) || PyTuple_Check(seq)) {
        PyObject **items = PySequence_Fast_ITEMS(seq);
        for (Py_ssize_t i = 0; i < n; i++) {
            PyObject *v = items[i];
            if (!PyLong_Check(v))
                return 1;
            out[i] = AS_U64(v);
            if (out[i] == (uint64_t)-1 && PyErr_Occurred()) {
                PyErr_Clear();
                return 1;
            }
        }
        return 0;
    }
    Py_buffer view;
    if (PyObject_GetBuffer(seq, &view, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) < 0) {
        PyErr_Clear();
        return 1;
    }
    const char *f = view.format ? view.format : "B";
    if (*f == '<' || *f == '=' || *f == '@')
        f++;
    int u64 = view.ndim == 1 && view.itemsize == 8 && (f[0] == 'Q' || f[0] == 'L') && !f[1]
              && view.len == n * 8;
    if (u64)
        memcpy(out, view.buf, (size_t)n * 8);
    PyBuffer_Release(&view);
    return !u64;
}

static Py_ssize_t query_length(PyObject *seq)
{
    if (PyList_Check(seq) || PyTuple_Check(seq))
        return PySequence_Fast_GET_SIZE(seq);
    if (!PyObject_CheckBuffer(seq))
        return -2;
    Py_ssize_t n = PyObject_Length(seq);
    if (n < 0)
        PyErr_Clear();
    return n < 0 ? -2 : n;
}

/* Ask for a key's two buckets of keys (a hint: nothing is read). Always inlined: GCC finds a
 * function that only prefetches free of side effects, and drops its calls. */
static inline __attribute__((always_inline)) void prefetch_keys(const Table *t, uint64_t key)
{
    uint64_t h = key * TABLE_M;
    const uint64_t *keys = t->keys;
    __builtin_prefetch(keys + (Py_ssize_t)(h >> t->s1) * WAYS, 0, 3);
    __builtin_prefetch(keys + (Py_ssize_t)((h >> t->s2) & t->mask) * WAYS, 0, 3);
}

/* find1 without branches on where the key sits (which bucket, which way: a coin toss a lookup,
 * so a branch on it is mispredicted every other block). */
static inline Py_ssize_t find_cell(const Table *t, uint64_t key)
{
    uint64_t h = key * TABLE_M;
    Py_ssize_t b1 = (Py_ssize_t)(h >> t->s1) * WAYS;
    Py_ssize_t b2 = (Py_ssize_t)((h >> t->s2) & t->mask) * WAYS;
    const uint64_t *k1 = t->keys + b1, *k2 = t->keys + b2;
    unsigned m1 = 0, m2 = 0;
    for (int w = 0; w < WAYS; w++) {
        m1 |= (unsigned)(k1[w] == key) << w;
        m2 |= (unsigned)(k2[w] == key) << w;
    }
    unsigned m = m1 | m2 << WAYS;
    if (!m)
        return -1;
    return (m1 ? b1 : b2 - WAYS) + __builtin_ctz(m);
}

/* The query's lookups, pipelined: while block i is read, the cell of block i + MATCH_AHEAD is
 * found (its keys asked for MATCH_AHEAD blocks earlier) and its value asked for, and the keys of
 * block i + 2 * MATCH_AHEAD are asked for. */
typedef struct {
    const Table *t;
    const uint64_t *hashes;
    Py_ssize_t n;
    Py_ssize_t cells[RING];
} Lookups;

static inline void lookup_ahead(Lookups *l, Py_ssize_t j)
{
    Py_ssize_t cell = find_cell(l->t, l->hashes[j]);
    l->cells[j & (RING - 1)] = cell;
    if (cell >= 0)
        __builtin_prefetch((const int32_t *)l->t->vals + cell, 0, 3);
}

static inline void lookups_start(Lookups *l)
{
    for (Py_ssize_t j = 0; j < l->n && j < 2 * MATCH_AHEAD; j++)
        prefetch_keys(l->t, l->hashes[j]);
    for (Py_ssize_t j = 0; j < l->n && j < MATCH_AHEAD; j++)
        lookup_ahead(l, j);
}

/* Block i's cell (-1: nobody holds it), the lookups moved on by one block. */
static inline Py_ssize_t lookup(Lookups *l, Py_ssize_t i)
{
    if (i + 2 * MATCH_AHEAD < l->n)
        prefetch_keys(l->t, l->hashes[i + 2 * MATCH_AHEAD]);
    if (i + MATCH_AHEAD < l->n)
        lookup_ahead(l, i + MATCH_AHEAD);
    return l->cells[i & (RING - 1)];
}

/* Where the answer goes: two lists (slots, lengths), or each length at its slot of an int64
 * array (by_slot, nslots cells), counting the slots. */
typedef struct {
    PyObject *slots, *lengths;
    int64_t *by_slot;
    Py_ssize_t nslots, count;
} Answer;

static int answer(Answer *a, Py_ssize_t slot, Py_ssize_t length)
{
    a->count++;
    if (a->by_slot != NULL) {
        if (slot >= a->nslots) {
            PyErr_SetString(PyExc_IndexError, "a matching slot past the end of by_slot");
            return -1;
        }
        a->by_slot[slot] = length;
        return 0;
    }
    PyObject *s = PyLong_FromSsize_t(slot);
    if (s == NULL)
        return -1;
    int rc = PyList_Append(a->slots, s);
    Py_DECREF(s);
    if (rc < 0)
        return -1;
    PyObject *n = PyLong_FromSsize_t(length);
    if (n == NULL)
        return -1;
    rc = PyList_Append(a->lengths, n);
    Py_DECREF(n);
    return rc;
}

/* Every slot of a bitmap, lowest first, with one length. */
static int answer_bits(Answer *a, const uint64_t *bits, Py_ssize_t words, Py_ssize_t length)
{
    for (Py_ssize_t w = 0; w < words; w++)
        for (uint64_t x = bits[w]; x; x &= x - 1)
            if (answer(a, w * 64 + __builtin_ctzll(x), length) < 0)
                return -1;
    return 0;
}

/* The holder bitmaps (NodeHolders.rows, 2-d u64) and the row of a value -2 - row. */
typedef struct {
    PyObject *holders;
    Py_buffer view;
    int have;
} Rows;

static const uint64_t *row_of(Rows *r, int64_t v, Py_ssize_t *words)
{
    if (!r->have) {
        PyObject *rows = PyObject_GetAttr(r->holders, a_rows);
        if (rows == NULL)
            return NULL;
        int rc = PyObject_GetBuffer(rows, &r->view, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT);
        Py_DECREF(rows);
        if (rc < 0)
            return NULL;
        r->have = 1;
        if (r->view.ndim != 2 || r->view.itemsize != 8) {
            PyErr_SetString(PyExc_TypeError, "holder bitmaps must be a 2-d u64 array");
            return NULL;
        }
    }
    int64_t row = -2 - v;
    if (row < 0 || row >= r->view.shape[0]) {
        PyErr_SetString(PyExc_IndexError, "a node's bitmap row is out of range");
        return NULL;
    }
    *words = r->view.shape[1];
    return (const uint64_t *)r->view.buf + row * r->view.shape[1];
}

static inline int has_slot(const uint64_t *row, Py_ssize_t words, int64_t slot)
{
    return (slot >> 6) < words && (row[slot >> 6] >> (slot & 63)) & 1;
}

/* The walk: 0, or -1 on error. */
static int walk(const Table *t, Rows *rows, const uint64_t *hashes, Py_ssize_t n, Answer *a)
{
    uint64_t few[FEW_WORDS], *running = few;
    Py_ssize_t words = 0;
    int64_t single = -1; /* >= 0: the running set is this one slot; else the bitmap running */
    int rc = -1;
    Lookups ahead = {t, hashes, n, {0}};
    lookups_start(&ahead);
    Py_ssize_t i = 0;
    for (; i < n; i++) {
        Py_ssize_t cell = lookup(&ahead, i);
        if (cell < 0)
            break; /* nobody holds it: every slot still matching stops here */
        int64_t v = get_val(t, cell);
        if (i == 0) {
            if (v >= 0) {
                single = v;
                continue;
            }
            const uint64_t *row = row_of(rows, v, &words);
            if (row == NULL)
                goto done;
            if (words > FEW_WORDS && (running = PyMem_Malloc((size_t)words * 8)) == NULL) {
                PyErr_NoMemory();
                goto done;
            }
            memcpy(running, row, (size_t)words * 8);
            continue;
        }
        if (single >= 0) { /* one slot matching: does it hold this block too? */
            if (v == single)
                continue;
            if (v < 0) {
                Py_ssize_t w;
                const uint64_t *row = row_of(rows, v, &w);
                if (row == NULL)
                    goto done;
                if (has_slot(row, w, single))
                    continue;
            }
            rc = answer(a, (Py_ssize_t)single, i);
            goto done;
        }
        if (v >= 0) { /* one holder: it alone may go on, the others stop here */
            int kept = has_slot(running, words, v);
            if (kept)
                running[v >> 6] &= ~(1ULL << (v & 63));
            if (answer_bits(a, running, words, i) < 0)
                goto done;
            if (!kept) {
                rc = 0;
                goto done;
            }
            single = v;
            continue;
        }
        Py_ssize_t w;
        const uint64_t *row = row_of(rows, v, &w);
        if (row == NULL)
            goto done;
        uint64_t left = 0, kept = 0;
        for (Py_ssize_t k = 0; k < words; k++)
            left |= running[k] & ~row[k];
        if (left) {
            for (Py_ssize_t k = 0; k < words; k++) {
                uint64_t out = running[k] & ~row[k];
                for (; out; out &= out - 1)
                    if (answer(a, k * 64 + __builtin_ctzll(out), i) < 0)
                        goto done;
                running[k] &= row[k];
                kept |= running[k];
            }
            if (!kept) {
                rc = 0;
                goto done;
            }
        }
    }
    /* the query's end, or a block nobody holds: whoever still matches matched this far */
    rc = single >= 0 ? answer(a, (Py_ssize_t)single, i)
                     : answer_bits(a, running, i ? words : 0, i);
done:
    if (running != few)
        PyMem_Free(running);
    return rc;
}

PyObject *prefix_match(PyObject *self, PyObject *args)
{
    PyObject *holders, *seq, *by_slot = Py_None;
    if (!PyArg_ParseTuple(args, "OO|O:prefix_match", &holders, &seq, &by_slot))
        return NULL;
    Py_ssize_t n = query_length(seq);
    if (n == -2)
        Py_RETURN_NONE;
    Answer a = {NULL, NULL, NULL, 0, 0};
    Py_buffer out_view;
    int have_out = 0;
    if (by_slot != Py_None) {
        if (PyObject_GetBuffer(by_slot, &out_view, PyBUF_C_CONTIGUOUS | PyBUF_WRITABLE
                                                     | PyBUF_FORMAT) < 0)
            return NULL;
        have_out = 1;
        const char *f = out_view.format ? out_view.format : "B";
        if (*f == '<' || *f == '=' || *f == '@')
            f++;
        if (out_view.ndim != 1 || out_view.itemsize != 8 || (f[0] != 'q' && f[0] != 'l')
            || f[1]) {
            PyBuffer_Release(&out_view);
            PyErr_SetString(PyExc_TypeError, "prefix_match: by_slot must be a 1-d int64 array");
            return NULL;
        }
        a.by_slot = out_view.buf;
        a.nslots = out_view.shape[0];
    }
    uint64_t few[FEW_HASHES], *hashes = few;
    PyObject *out = NULL;
    Rows rows = {holders, {0}, 0};
    if (n > FEW_HASHES && (hashes = PyMem_Malloc((size_t)n * 8)) == NULL) {
        hashes = few;
        PyErr_NoMemory();
        goto done;
    }
    if (a.by_slot == NULL && ((a.slots = PyList_New(0)) == NULL
                              || (a.lengths = PyList_New(0)) == NULL))
        goto done;
    int declined = read_hashes(seq, hashes, n);
    if (declined < 0)
        goto done;
    if (declined) {
        out = Py_NewRef(Py_None);
        goto done;
    }
    PyObject *nodes = PyObject_GetAttr(holders, a_nodes);
    if (nodes == NULL)
        goto done;
    Table t;
    int rc = load_table(nodes, &t, 0);
    Py_DECREF(nodes); /* the holders object keeps it */
    if (rc < 0)
        goto done;
    if (t.size && walk(&t, &rows, hashes, n, &a) < 0)
        goto done;
    out = a.by_slot != NULL ? PyLong_FromSsize_t(a.count)
                            : PyTuple_Pack(2, a.slots, a.lengths);
done:
    if (rows.have)
        PyBuffer_Release(&rows.view);
    if (have_out)
        PyBuffer_Release(&out_view);
    Py_XDECREF(a.slots);
    Py_XDECREF(a.lengths);
    if (hashes != few)
        PyMem_Free(hashes);
    return out;
}
