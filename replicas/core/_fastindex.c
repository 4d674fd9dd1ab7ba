/* Compiled KV-event apply for the compact prefix index (replicas/core/index.py, README.md there).
 *
 * The same changes as the index's one-key Python methods, step for step: U64Table.find1,
 * insert1 (_place1, _relocate1), delete1; NodeHolders.hold1, unhold1, _alloc_rows; and
 * PrefixIndex._store1, _add1, _drop1, _remove_from_slot's block-by-block loop. The Python code
 * stays the reference implementation (tests/unit/replicas/core/test_index_kernel.py checks that
 * both leave the same state); this file only saves the interpreter's cost per block (~20 Python
 * calls a block, ~3-7 us, against a few hundred ns here).
 *
 * It reads and writes the index's own numpy arrays in place, through the memoryviews U64Table
 * keeps (`_mk`, `mv`, `_mo`) and the buffer protocol for the holders' bitmaps: no copy of the
 * state, no numpy C API. Anything that reallocates an array stays in Python and is called from
 * here: a table that must double or whose cuckoo step fails (`U64Table.insert1`), a new worker
 * slot (`PrefixIndex._slot_for`), a bitmap row when none is free (`NodeHolders._alloc_rows`).
 * Before such a call every count kept here (table sizes, digest sums, the total) is written
 * back; after it every pointer is read again.
 *
 * apply_ops(index, ops, start) applies ops[start:] in order and returns their results (a
 * store's "ok" / "parent_block_not_found", a removal's count of unknown ids). It stops before
 * an op it does not take on (an id or hash that is not an int in [0, 2**64), an event shape
 * other than index_run.KvOp's): the caller applies that op in Python and calls again. Counters
 * and the size caches are the caller's to update, from the results.
 *
 * Beside this file: _fastindex.h (a table's cells and one-key methods), _fastindex_table.c
 * (reading a table; its bulk passes: fill_empty, sentinels, occupied, place_each,
 * place_occupied),
 * _fastindex_state.{h,c} (the index's state during a call; the holders' one-node methods),
 * _fastindex_match.c (the query: a prompt's prefix match, one call).
 *
 * Pure like the rest of replicas/core: no I/O, no clock, no randomness.
 */
#include "_fastindex_state.h"

#define AHEAD 2 /* blocks of an event looked up ahead of the one applied (2-8 measured) */
static const uint64_t CHAIN_MULTIPLIER = 0x9E3779B97F4A7C15ULL; /* eventlog.hashing */
static const uint64_t DIGEST_SALT = 0x5BD1E9955BD1E995ULL;     /* index_common */

static PyObject *str_ok, *str_lost;

static inline uint64_t mix(uint64_t block_hash, uint64_t seq)
{
    return (seq ^ DIGEST_SALT) * (2 * block_hash + 1);
}

/* --- the index: PrefixIndex's block-by-block methods ---------------------------------------- */

/* dups[seq] += delta (delta -1 deletes at 1); returns whether the slot had an extra id for it
 * when delta is -1. */
static int dups_change(Ctx *c, Py_ssize_t slot, uint64_t seq, int delta)
{
    PyObject *dups = PyList_GetItem(c->dups, slot);
    if (dups == NULL)
        return -1;
    if (delta < 0 && PyDict_GET_SIZE(dups) == 0)
        return 0;
    PyObject *key = PyLong_FromUnsignedLongLong(seq);
    if (key == NULL)
        return -1;
    PyObject *was = PyDict_GetItemWithError(dups, key); /* borrowed */
    int rc = 0;
    long long n = 0;
    if (was != NULL) {
        n = PyLong_AsLongLong(was);
        if (n == -1 && PyErr_Occurred())
            rc = -1;
    } else if (PyErr_Occurred()) {
        rc = -1;
    }
    if (rc == 0) {
        if (delta > 0) {
            PyObject *v = PyLong_FromLongLong(n + 1);
            rc = v == NULL ? -1 : PyDict_SetItem(dups, key, v);
            Py_XDECREF(v);
        } else if (n) {
            if (n == 1) {
                rc = PyDict_DelItem(dups, key);
            } else {
                PyObject *v = PyLong_FromLongLong(n - 1);
                rc = v == NULL ? -1 : PyDict_SetItem(dups, key, v);
                Py_XDECREF(v);
            }
            if (rc == 0)
                rc = 1;
        }
    }
    Py_DECREF(key);
    return rc;
}

/* `free`: the cell probe picked for the absent id, or -1 to have place1 pick it. */
static int add1(Ctx *c, Py_ssize_t slot, uint64_t block_hash, uint64_t seq, Py_ssize_t free)
{
    Table *t = ctx_table(c, slot);
    if (t == NULL || insert1_probed(c, t, block_hash, seq, free) < 0)
        return -1;
    t = ctx_table(c, slot);
    if (t == NULL)
        return -1;
    t->sum += mix(block_hash, seq);
    t->sum_dirty = 1;
    c->total_delta++;
    int held = hold1(c, slot, seq);
    if (held < 0)
        return -1;
    return held ? (dups_change(c, slot, seq, 1) < 0 ? -1 : 0) : 0;
}

static int drop1(Ctx *c, Py_ssize_t slot, uint64_t block_hash, uint64_t seq, Py_ssize_t cell)
{
    Table *t = ctx_table(c, slot);
    if (t == NULL)
        return -1;
    delete1(t, cell);
    t->sum -= mix(block_hash, seq);
    t->sum_dirty = 1;
    c->total_delta--;
    int extra = dups_change(c, slot, seq, -1);
    if (extra < 0)
        return -1;
    return extra ? 0 : unhold1(c, slot, seq);
}

static int store1(Ctx *c, Py_ssize_t slot, uint64_t block_hash, uint64_t seq)
{
    Table *t = ctx_table(c, slot);
    if (t == NULL)
        return -1;
    Probe p = probe(t, block_hash);
    if (p.found >= 0) {
        uint64_t was = (uint64_t)get_val(t, p.found);
        if (was == seq)
            return 0; /* re-announced: nothing changes */
        if (drop1(c, slot, block_hash, was, p.found) < 0) /* the engine reused the id */
            return -1;
        p.free = -1; /* the drop freed a cell: place1 picks again */
    }
    return add1(c, slot, block_hash, seq, p.free);
}

/* --- ops ------------------------------------------------------------------------------------ */

/* A Python int in [0, 2**64) as u64: 0, or 1 when it is not one (no exception left set). */
static int as_u64(PyObject *v, uint64_t *out)
{
#if PY_VERSION_HEX < 0x030C0000 && PyLong_SHIFT == 30
    /* An int's 30-bit digits read directly: PyLong_AsUnsignedLongLong goes through
     * _PyLong_AsByteArray for every int of more than one digit (each block hash), which was
     * ~8 % of applying a 64-block event. Up to three digits, the third below 2**4, is < 2**64. */
    if (PyLong_CheckExact(v)) {
        Py_ssize_t size = Py_SIZE(v);
        const digit *d = ((PyLongObject *)v)->ob_digit;
        if (size == 0) {
            *out = 0;
            return 0;
        }
        if (size == 1 || size == 2 || (size == 3 && d[2] < (1u << (64 - 2 * PyLong_SHIFT)))) {
            uint64_t x = d[0];
            if (size > 1)
                x |= (uint64_t)d[1] << PyLong_SHIFT;
            if (size > 2)
                x |= (uint64_t)d[2] << (2 * PyLong_SHIFT);
            *out = x;
            return 0;
        }
    }
#endif
    if (!PyLong_Check(v))
        return 1;
    *out = PyLong_AsUnsignedLongLong(v);
    if (*out == (uint64_t)-1 && PyErr_Occurred()) {
        PyErr_Clear();
        return 1;
    }
    return 0;
}

/* Validate and convert an op's numbers before anything changes. Returns the count of u64s put
 * in *buf (grown as needed), or -1 on error, -2 when Python must apply the op. */
static int reserve(uint64_t **buf, Py_ssize_t *cap, Py_ssize_t need)
{
    if (need > *cap) {
        uint64_t *grown = PyMem_Realloc(*buf, (size_t)need * 8);
        if (grown == NULL) {
            PyErr_NoMemory();
            return -1;
        }
        *buf = grown;
        *cap = need;
    }
    return 0;
}

/* Pairs a reader left packed (eventlog/packed_pairs.py): their `words` are already the u64s,
 * 16 bytes a pair in native order. Returns the count of u64s, -1 on error, -2 when not packed. */
static Py_ssize_t read_packed(PyObject *seq, uint64_t **buf, Py_ssize_t *cap)
{
    PyObject *words = PyObject_GetAttr(seq, a_words);
    if (words == NULL) {
        PyErr_Clear();
        return -2;
    }
    Py_ssize_t need = -2;
    if (PyBytes_Check(words) && PyBytes_GET_SIZE(words) % 16 == 0) {
        need = PyBytes_GET_SIZE(words) / 8;
        if (reserve(buf, cap, need) < 0)
            need = -1;
        else
            memcpy(*buf, PyBytes_AS_STRING(words), (size_t)need * 8);
    }
    Py_DECREF(words);
    return need;
}

static Py_ssize_t read_numbers(PyObject *seq, int pairs, uint64_t **buf, Py_ssize_t *cap)
{
    if (!PyList_Check(seq) && !PyTuple_Check(seq))
        return pairs ? read_packed(seq, buf, cap) : -2;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    Py_ssize_t need = pairs ? 2 * n : n;
    if (reserve(buf, cap, need) < 0)
        return -1;
    PyObject **items = PySequence_Fast_ITEMS(seq);
    for (Py_ssize_t i = 0; i < n; i++) {
        if (!pairs) {
            if (as_u64(items[i], &(*buf)[i]))
                return -2;
            continue;
        }
        PyObject *pair = items[i];
        if (!PyTuple_Check(pair) || PyTuple_GET_SIZE(pair) != 2)
            return -2;
        if (as_u64(PyTuple_GET_ITEM(pair, 0), &(*buf)[2 * i])
            || as_u64(PyTuple_GET_ITEM(pair, 1), &(*buf)[2 * i + 1]))
            return -2;
    }
    return need;
}

static PyObject *slot_of(Ctx *c, PyObject *worker, Py_ssize_t *slot)
{
    PyObject *s = PyDict_GetItemWithError(c->slots, worker);
    if (s == NULL) {
        *slot = -1;
        return PyErr_Occurred() ? NULL : Py_None;
    }
    *slot = PyLong_AsSsize_t(s);
    return (*slot == -1 && PyErr_Occurred()) ? NULL : Py_None;
}

/* One op; returns its result (new reference), NULL on error, or Py_NotImplemented (borrowed,
 * not increfed) when Python must apply it. */
static PyObject *apply_op(Ctx *c, PyObject *op, uint64_t **buf, Py_ssize_t *cap)
{
    if (!PyTuple_Check(op) || PyTuple_GET_SIZE(op) != 4)
        return Py_NotImplemented;
    PyObject *kind = PyTuple_GET_ITEM(op, 0), *worker = PyTuple_GET_ITEM(op, 1);
    PyObject *a = PyTuple_GET_ITEM(op, 2), *b = PyTuple_GET_ITEM(op, 3);
    long k = PyLong_Check(kind) ? PyLong_AsLong(kind) : -1;
    if (k == -1 && PyErr_Occurred())
        PyErr_Clear();
    Py_ssize_t slot;
    if (k == 0) { /* STORE */
        uint64_t parent_id = 0;
        if (a != Py_None && as_u64(a, &parent_id))
            return Py_NotImplemented;
        Py_ssize_t n = read_numbers(b, 1, buf, cap);
        if (n < 0)
            return n == -1 ? NULL : Py_NotImplemented;
        if (slot_of(c, worker, &slot) == NULL)
            return NULL;
        uint64_t seq = 0; /* a root block's sequence hash is its tokens_hash */
        if (a == Py_None) {
            if (slot < 0) {
                if (ctx_before_python(c) < 0)
                    return NULL;
                PyObject *s = PyObject_CallMethodObjArgs(c->index, a_slot_for, worker, NULL);
                if (s == NULL)
                    return NULL;
                slot = PyLong_AsSsize_t(s);
                Py_DECREF(s);
                if (slot == -1 && PyErr_Occurred())
                    return NULL;
            }
        } else {
            if (slot < 0)
                return Py_NewRef(str_lost);
            Table *t = ctx_table(c, slot);
            if (t == NULL)
                return NULL;
            Py_ssize_t cell = find1(t, parent_id);
            if (cell < 0)
                return Py_NewRef(str_lost);
            seq = (uint64_t)get_val(t, cell);
        }
        uint64_t *pairs = *buf;
        for (Py_ssize_t i = 1; i < n; i += 2) /* (id, tokens hash) -> (id, sequence hash) */
            pairs[i] = seq = seq * CHAIN_MULTIPLIER + pairs[i];
        for (Py_ssize_t i = 0; i < n; i += 2) {
            if (i + 2 * AHEAD < n) { /* the tables are large: start the loads a few blocks early */
                Table *t = ctx_table(c, slot), *nodes = ctx_nodes(c);
                if (t == NULL || nodes == NULL)
                    return NULL;
                prefetch(t, pairs[i + 2 * AHEAD]);
                prefetch(nodes, pairs[i + 2 * AHEAD + 1]);
            }
            if (store1(c, slot, pairs[i], pairs[i + 1]) < 0)
                return NULL;
        }
        return Py_NewRef(str_ok);
    }
    if (k != 1)
        return Py_NotImplemented;
    /* REMOVE */
    Py_ssize_t n = read_numbers(a, 0, buf, cap);
    if (n < 0)
        return n == -1 ? NULL : Py_NotImplemented;
    if (slot_of(c, worker, &slot) == NULL)
        return NULL;
    if (slot < 0)
        return PyLong_FromSsize_t(n);
    Py_ssize_t unknown = 0;
    const uint64_t *ids = *buf;
    for (Py_ssize_t i = 0; i < n; i++) {
        Table *t = ctx_table(c, slot);
        if (t == NULL)
            return NULL;
        Py_ssize_t cell = find1(t, ids[i]);
        if (cell < 0) {
            unknown++;
            continue;
        }
        if (drop1(c, slot, ids[i], (uint64_t)get_val(t, cell), cell) < 0)
            return NULL;
    }
    return PyLong_FromSsize_t(unknown);
}

/* apply_ops(index, ops, start) -> list of results of ops[start:k], k the first op Python must
 * apply (or the end). */
static PyObject *apply_ops(PyObject *self, PyObject *args)
{
    PyObject *index, *ops;
    Py_ssize_t start;
    if (!PyArg_ParseTuple(args, "OOn:apply_ops", &index, &ops, &start))
        return NULL;
    if (!PyList_Check(ops) && !PyTuple_Check(ops)) {
        PyErr_SetString(PyExc_TypeError, "apply_ops: ops must be a list or a tuple");
        return NULL;
    }
    Ctx c;
    PyObject *results = NULL;
    uint64_t *buf = NULL;
    Py_ssize_t cap = 0;
    if (ctx_open(&c, index) < 0)
        goto done;
    results = PyList_New(0);
    if (results == NULL)
        goto done;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(ops);
    for (Py_ssize_t i = start < 0 ? 0 : start; i < n; i++) {
        PyObject *r = apply_op(&c, PySequence_Fast_GET_ITEM(ops, i), &buf, &cap);
        if (r == Py_NotImplemented)
            break;
        if (r == NULL || PyList_Append(results, r) < 0) {
            Py_XDECREF(r);
            Py_CLEAR(results);
            break;
        }
        Py_DECREF(r);
    }
    if (ctx_flush(&c) < 0)
        Py_CLEAR(results);
done:
    PyMem_Free(buf);
    ctx_close(&c);
    return results;
}

static PyMethodDef methods[] = {
    {"apply_ops", apply_ops, METH_VARARGS,
     "apply_ops(index, ops, start) -> results of ops[start:k]; ops[k] is Python's to apply"},
    {"fill_empty", fill_empty, METH_VARARGS,
     "fill_empty(table, keys, vals) -> positions of the keys left for U64Table._place"},
    {"sentinels", sentinels, METH_VARARGS,
     "sentinels(empty, keys, mask, s1, s2): a new table's empty keys"},
    {"prefix_match", prefix_match, METH_VARARGS,
     "prefix_match(holders, seq_hashes[, by_slot]) -> (slots, lengths) as PrefixIndex._match_python"
     " gives them (by_slot: written there, their count returned), or None: Python's to answer"},
    {"occupied", occupied, METH_VARARGS,
     "occupied(table, keys, vals): the occupied cells' keys and values, in cell order"},
    {"place_each", place_each, METH_VARARGS,
     "place_each(table, keys, vals) -> positions of the keys U64Table._place1 finds no room for"},
    {"place_occupied", place_occupied, METH_VARARGS,
     "place_occupied(table, keys, vals, occupancy): a restored table's cells (from_cells)"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_fastindex",
    "Compiled KV-event apply for the compact prefix index; index.py holds the reference code.",
    -1, methods,
};

#define INTERN(var, text)                                  \
    do {                                                   \
        if ((var = PyUnicode_InternFromString(text)) == NULL) \
            return NULL;                                   \
    } while (0)

PyMODINIT_FUNC
PyInit__fastindex(void)
{
    if (table_names() < 0 || state_names() < 0 || match_names() < 0)
        return NULL;
    INTERN(str_ok, "ok");
    INTERN(str_lost, "parent_block_not_found");
    return PyModule_Create(&module);
}
