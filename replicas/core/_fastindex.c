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
 * Pure like the rest of replicas/core: no I/O, no clock, no randomness.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#define WAYS 8
#define AHEAD 2 /* blocks of an event looked up ahead of the one applied (2-8 measured) */
static const uint64_t TABLE_M = 0x9E3779B97F4A7C15ULL;        /* index_table._M */
static uint64_t TABLE_M_INVERSE;                               /* computed at import */
static const uint64_t CHAIN_MULTIPLIER = 0x9E3779B97F4A7C15ULL; /* eventlog.hashing */
static const uint64_t DIGEST_SALT = 0x5BD1E9955BD1E995ULL;     /* index_common */

static PyObject *str_ok, *str_lost;
static PyObject *a_mk, *a_mv, *a_mo, *a_mask, *a_s1, *a_s2, *a_size, *a_limit, *a_insert1;
static PyObject *a_blocks, *a_dups, *a_sums, *a_slots, *a_holders, *a_total, *a_slot_for;
static PyObject *a_nodes, *a_rows, *a_rows_free, *a_rows_used, *a_alloc_rows;

/* One U64Table, read from its Python object. */
typedef struct {
    PyObject *obj; /* borrowed: kept alive by the index for the whole call */
    uint64_t *keys;
    char *vals;
    uint8_t *occ;
    int wide; /* values: 8 bytes (u64) or 4 (int32) */
    uint64_t mask;
    int s1, s2;
    Py_ssize_t size, limit, cells;
    int dirty;        /* size changed since read */
    uint64_t gen;     /* the context's generation it was read in */
    uint64_t sum;     /* block tables: the slot's digest sum */
    int sum_dirty;
} Table;

typedef struct {
    PyObject *index, *blocks, *dups, *sums, *slots, *holders; /* borrowed or owned: see ctx_* */
    Table *tables;   /* per slot, valid when gen matches */
    Py_ssize_t ntables;
    Table nodes;
    Py_buffer rows;
    int have_rows;
    uint64_t rows_gen;
    uint64_t gen;
    int64_t total_delta;
} Ctx;

static inline uint64_t mix(uint64_t block_hash, uint64_t seq)
{
    return (seq ^ DIGEST_SALT) * (2 * block_hash + 1);
}

static inline uint64_t sentinel(const Table *t, uint64_t bucket)
{
    uint64_t first = ((bucket + 1) & t->mask) << t->s1;
    uint64_t second = ((bucket + 2) & t->mask) << t->s2;
    return (first | second) * TABLE_M_INVERSE;
}

static inline int64_t get_val(const Table *t, Py_ssize_t cell)
{
    if (t->wide)
        return (int64_t)((uint64_t *)t->vals)[cell];
    return ((int32_t *)t->vals)[cell];
}

static inline void set_val(Table *t, Py_ssize_t cell, uint64_t v)
{
    if (t->wide)
        ((uint64_t *)t->vals)[cell] = v;
    else
        ((int32_t *)t->vals)[cell] = (int32_t)(int64_t)v;
}

static int view_of(PyObject *obj, PyObject *name, Py_ssize_t itemsize, void **buf,
                   Py_ssize_t *count)
{
    PyObject *mv = PyObject_GetAttr(obj, name);
    if (mv == NULL)
        return -1;
    if (!PyMemoryView_Check(mv)) {
        Py_DECREF(mv);
        PyErr_SetString(PyExc_TypeError, "a table's cells must be a memoryview");
        return -1;
    }
    Py_buffer *b = PyMemoryView_GET_BUFFER(mv);
    if (b->itemsize != itemsize || !PyBuffer_IsContiguous(b, 'C')) {
        Py_DECREF(mv);
        PyErr_SetString(PyExc_TypeError, "a table's cells have an unexpected layout");
        return -1;
    }
    *buf = b->buf;
    *count = b->len / itemsize;
    Py_DECREF(mv); /* the table object keeps the array and its memoryview alive */
    return 0;
}

static int int_attr(PyObject *obj, PyObject *name, long long *out)
{
    PyObject *v = PyObject_GetAttr(obj, name);
    if (v == NULL)
        return -1;
    *out = PyLong_AsLongLong(v);
    Py_DECREF(v);
    return (*out == -1 && PyErr_Occurred()) ? -1 : 0;
}

static int load_table(PyObject *obj, Table *t, int wide)
{
    void *keys, *vals, *occ;
    Py_ssize_t nk, nv, no;
    long long mask, s1, s2, size, limit;
    if (view_of(obj, a_mk, 8, &keys, &nk) < 0 || view_of(obj, a_mv, wide ? 8 : 4, &vals, &nv) < 0
        || view_of(obj, a_mo, 1, &occ, &no) < 0)
        return -1;
    if (int_attr(obj, a_mask, &mask) < 0 || int_attr(obj, a_s1, &s1) < 0
        || int_attr(obj, a_s2, &s2) < 0 || int_attr(obj, a_size, &size) < 0
        || int_attr(obj, a_limit, &limit) < 0)
        return -1;
    if (nk != nv || nk != no || nk != (mask + 1) * WAYS) {
        PyErr_SetString(PyExc_ValueError, "a table's columns disagree");
        return -1;
    }
    t->obj = obj;
    t->keys = keys;
    t->vals = vals;
    t->occ = occ;
    t->wide = wide;
    t->mask = (uint64_t)mask;
    t->s1 = (int)s1;
    t->s2 = (int)s2;
    t->size = (Py_ssize_t)size;
    t->limit = (Py_ssize_t)limit;
    t->cells = nk;
    t->dirty = 0;
    return 0;
}

static int flush_table(Table *t)
{
    if (!t->dirty)
        return 0;
    PyObject *v = PyLong_FromSsize_t(t->size);
    if (v == NULL)
        return -1;
    int rc = PyObject_SetAttr(t->obj, a_size, v);
    Py_DECREF(v);
    t->dirty = 0;
    return rc;
}

/* --- the context: the index's objects, tables read lazily, counts written back -------------- */

static int ctx_flush(Ctx *c)
{
    for (Py_ssize_t s = 0; s < c->ntables; s++) {
        Table *t = &c->tables[s];
        if (t->gen != c->gen)
            continue;
        if (flush_table(t) < 0)
            return -1;
        if (t->sum_dirty) {
            PyObject *v = PyLong_FromUnsignedLongLong(t->sum);
            if (v == NULL || PyList_SetItem(c->sums, s, v) < 0)
                return -1;
            t->sum_dirty = 0;
        }
    }
    if (c->nodes.gen == c->gen && flush_table(&c->nodes) < 0)
        return -1;
    if (c->total_delta) {
        PyObject *was = PyObject_GetAttr(c->index, a_total);
        if (was == NULL)
            return -1;
        PyObject *delta = PyLong_FromLongLong(c->total_delta);
        PyObject *now = delta ? PyNumber_Add(was, delta) : NULL;
        Py_DECREF(was);
        Py_XDECREF(delta);
        if (now == NULL)
            return -1;
        int rc = PyObject_SetAttr(c->index, a_total, now);
        Py_DECREF(now);
        if (rc < 0)
            return -1;
        c->total_delta = 0;
    }
    return 0;
}

/* Everything read before may have moved: write counts back, forget pointers. */
static int ctx_before_python(Ctx *c)
{
    if (ctx_flush(c) < 0)
        return -1;
    c->gen++;
    if (c->have_rows) {
        PyBuffer_Release(&c->rows);
        c->have_rows = 0;
    }
    return 0;
}

static Table *ctx_table(Ctx *c, Py_ssize_t slot)
{
    if (slot >= c->ntables) {
        Py_ssize_t n = PyList_GET_SIZE(c->blocks);
        if (slot >= n) {
            PyErr_SetString(PyExc_IndexError, "slot without a block table");
            return NULL;
        }
        Table *grown = PyMem_Realloc(c->tables, (size_t)n * sizeof(Table));
        if (grown == NULL) {
            PyErr_NoMemory();
            return NULL;
        }
        memset(grown + c->ntables, 0, (size_t)(n - c->ntables) * sizeof(Table));
        c->tables = grown;
        c->ntables = n;
    }
    Table *t = &c->tables[slot];
    if (t->gen != c->gen) {
        if (load_table(PyList_GET_ITEM(c->blocks, slot), t, 1) < 0)
            return NULL;
        PyObject *sum = PyList_GetItem(c->sums, slot);
        if (sum == NULL)
            return NULL;
        t->sum = PyLong_AsUnsignedLongLong(sum);
        if (t->sum == (uint64_t)-1 && PyErr_Occurred())
            return NULL;
        t->sum_dirty = 0;
        t->gen = c->gen;
    }
    return t;
}

static Table *ctx_nodes(Ctx *c)
{
    if (c->nodes.gen != c->gen) {
        PyObject *obj = PyObject_GetAttr(c->holders, a_nodes);
        if (obj == NULL)
            return NULL;
        int rc = load_table(obj, &c->nodes, 0);
        Py_DECREF(obj); /* the holders object keeps it */
        if (rc < 0)
            return NULL;
        c->nodes.gen = c->gen;
    }
    return &c->nodes;
}

static uint64_t *ctx_rows(Ctx *c, Py_ssize_t *words)
{
    if (!c->have_rows || c->rows_gen != c->gen) {
        if (c->have_rows)
            PyBuffer_Release(&c->rows);
        c->have_rows = 0;
        PyObject *rows = PyObject_GetAttr(c->holders, a_rows);
        if (rows == NULL)
            return NULL;
        int rc = PyObject_GetBuffer(rows, &c->rows, PyBUF_C_CONTIGUOUS | PyBUF_WRITABLE
                                                       | PyBUF_FORMAT);
        Py_DECREF(rows);
        if (rc < 0)
            return NULL;
        c->have_rows = 1;
        c->rows_gen = c->gen;
        if (c->rows.ndim != 2 || c->rows.itemsize != 8) {
            PyErr_SetString(PyExc_TypeError, "holder bitmaps must be a 2-d u64 array");
            return NULL;
        }
    }
    *words = c->rows.shape[1];
    return (uint64_t *)c->rows.buf;
}

/* --- one table: U64Table's one-key methods -------------------------------------------------- */

static inline Py_ssize_t find1(const Table *t, uint64_t key)
{
    if (!t->size)
        return -1;
    uint64_t h = key * TABLE_M;
    Py_ssize_t b = (Py_ssize_t)(h >> t->s1) * WAYS;
    for (int w = 0; w < WAYS; w++)
        if (t->keys[b + w] == key)
            return b + w;
    b = (Py_ssize_t)((h >> t->s2) & t->mask) * WAYS;
    for (int w = 0; w < WAYS; w++)
        if (t->keys[b + w] == key)
            return b + w;
    return -1;
}

/* Occupancy read from the keys, which a lookup has just brought into the cache: an empty cell
 * of bucket B holds B's sentinel, and no key that may live in B equals it (index_table.py). */
static inline int used(const Table *t, Py_ssize_t b)
{
    uint64_t empty = sentinel(t, (uint64_t)(b / WAYS));
    int n = 0;
    for (int w = 0; w < WAYS; w++)
        n += t->keys[b + w] != empty;
    return n;
}

static inline int first_free(const Table *t, Py_ssize_t b)
{
    uint64_t empty = sentinel(t, (uint64_t)(b / WAYS));
    for (int w = 0; w < WAYS; w++)
        if (t->keys[b + w] == empty)
            return w;
    return -1;
}

/* Ask for a key's two buckets ahead of its lookup (a hint: nothing is read). */
static inline void prefetch(const Table *t, uint64_t key)
{
    uint64_t h = key * TABLE_M;
    __builtin_prefetch(&t->keys[(h >> t->s1) * WAYS]);
    __builtin_prefetch(&t->keys[((h >> t->s2) & t->mask) * WAYS]);
}

/* _relocate1: one cuckoo step, or -1. */
static Py_ssize_t relocate1(Table *t, uint64_t key, uint64_t val)
{
    uint64_t h = key * TABLE_M;
    uint64_t buckets[2] = {h >> t->s1, (h >> t->s2) & t->mask};
    for (int i = 0; i < 2; i++) {
        uint64_t b = buckets[i];
        for (Py_ssize_t cell = (Py_ssize_t)b * WAYS; cell < (Py_ssize_t)b * WAYS + WAYS; cell++) {
            uint64_t resident = t->keys[cell];
            uint64_t rh = resident * TABLE_M;
            uint64_t r1 = rh >> t->s1, r2 = (rh >> t->s2) & t->mask;
            uint64_t other = r1 == b ? r2 : r1;
            if (other == b)
                continue;
            int way = first_free(t, (Py_ssize_t)other * WAYS);
            if (way < 0)
                continue;
            Py_ssize_t to = (Py_ssize_t)other * WAYS + way;
            t->keys[to] = resident;
            set_val(t, to, (uint64_t)get_val(t, cell));
            t->occ[to] = 1;
            t->keys[cell] = key;
            set_val(t, cell, val);
            return cell;
        }
    }
    return -1;
}

/* _place1: the emptier bucket's first free cell, else a cuckoo step; -1 when both fail. */
static Py_ssize_t place1(Table *t, uint64_t key, uint64_t val)
{
    uint64_t h = key * TABLE_M;
    Py_ssize_t b1 = (Py_ssize_t)(h >> t->s1) * WAYS;
    Py_ssize_t b2 = (Py_ssize_t)((h >> t->s2) & t->mask) * WAYS;
    if (used(t, b2) < used(t, b1))
        b1 = b2;
    int way = first_free(t, b1);
    if (way < 0)
        return relocate1(t, key, val);
    Py_ssize_t cell = b1 + way;
    t->keys[cell] = key;
    set_val(t, cell, val);
    t->occ[cell] = 1;
    return cell;
}

/* insert1 of an absent key: here when it fits, else U64Table.insert1 itself (it doubles the
 * table, or places the key in bulk), after which every pointer is read again. */
static int insert1(Ctx *c, Table *t, uint64_t key, uint64_t val)
{
    if (t->size < t->limit && place1(t, key, val) >= 0) {
        t->size++;
        t->dirty = 1;
        return 0;
    }
    PyObject *obj = t->obj;
    Py_INCREF(obj);
    if (ctx_before_python(c) < 0) {
        Py_DECREF(obj);
        return -1;
    }
    PyObject *r = t->wide ? PyObject_CallMethod(obj, "insert1", "KK", (unsigned long long)key,
                                                (unsigned long long)val)
                          : PyObject_CallMethod(obj, "insert1", "KL", (unsigned long long)key,
                                                (long long)(int64_t)val);
    Py_DECREF(obj);
    if (r == NULL)
        return -1;
    Py_DECREF(r);
    return 0;
}

static inline void delete1(Table *t, Py_ssize_t cell)
{
    t->keys[cell] = sentinel(t, (uint64_t)(cell / WAYS));
    t->occ[cell] = 0;
    t->size--;
    t->dirty = 1;
}

/* --- holders: NodeHolders' one-node methods ------------------------------------------------- */

/* _alloc_rows(1): a free row (zeroed), or -1 with an exception set. */
static Py_ssize_t alloc_row(Ctx *c)
{
    PyObject *free_rows = PyObject_GetAttr(c->holders, a_rows_free);
    if (free_rows == NULL)
        return -1;
    Py_ssize_t row = -1;
    Py_ssize_t words;
    uint64_t *rows = ctx_rows(c, &words);
    if (rows == NULL) {
        Py_DECREF(free_rows);
        return -1;
    }
    if (PyList_Check(free_rows) && PyList_GET_SIZE(free_rows) > 0) {
        Py_ssize_t last = PyList_GET_SIZE(free_rows) - 1;
        row = PyLong_AsSsize_t(PyList_GET_ITEM(free_rows, last));
        if ((row == -1 && PyErr_Occurred()) || PyList_SetSlice(free_rows, last, last + 1, NULL) < 0)
            row = -1;
    } else {
        long long used_rows;
        if (int_attr(c->holders, a_rows_used, &used_rows) == 0) {
            if (used_rows < c->rows.shape[0]) {
                PyObject *v = PyLong_FromLongLong(used_rows + 1);
                if (v != NULL && PyObject_SetAttr(c->holders, a_rows_used, v) == 0)
                    row = (Py_ssize_t)used_rows;
                Py_XDECREF(v);
            } else {  /* the bitmaps must grow: NodeHolders._alloc_rows does it */
                Py_DECREF(free_rows);
                if (ctx_before_python(c) < 0)
                    return -1;
                PyObject *r = PyObject_CallMethod(c->holders, "_alloc_rows", "n", (Py_ssize_t)1);
                if (r == NULL)
                    return -1;
                PyObject *first = PySequence_GetItem(r, 0);
                Py_DECREF(r);
                if (first == NULL)
                    return -1;
                row = PyNumber_AsSsize_t(first, PyExc_OverflowError);
                Py_DECREF(first);
                return row; /* _alloc_rows zeroed it */
            }
        }
    }
    Py_DECREF(free_rows);
    if (row < 0 || row >= c->rows.shape[0]) {
        if (!PyErr_Occurred())
            PyErr_SetString(PyExc_IndexError, "bitmap row out of range");
        return -1;
    }
    memset(rows + row * words, 0, (size_t)words * 8);
    return row;
}

/* hold1: 1 if the slot held the node already, 0 if not, -1 on error. */
static int hold1(Ctx *c, Py_ssize_t slot, uint64_t seq)
{
    Table *nodes = ctx_nodes(c);
    if (nodes == NULL)
        return -1;
    Py_ssize_t cell = find1(nodes, seq);
    if (cell < 0)
        return insert1(c, nodes, seq, (uint64_t)slot) < 0 ? -1 : 0;
    int64_t v = get_val(nodes, cell);
    Py_ssize_t word = slot >> 6;
    uint64_t bit = 1ULL << (slot & 63);
    Py_ssize_t words;
    if (v >= 0) {
        if (v == slot)
            return 1;
        Py_ssize_t row = alloc_row(c);
        if (row < 0)
            return -1;
        uint64_t *rows = ctx_rows(c, &words);
        nodes = ctx_nodes(c); /* a row that had to grow went through Python */
        if (rows == NULL || nodes == NULL)
            return -1;
        cell = find1(nodes, seq);
        rows[row * words + (v >> 6)] = 1ULL << (v & 63);
        rows[row * words + word] |= bit;
        set_val(nodes, cell, (uint64_t)(-2 - (int64_t)row));
        return 0;
    }
    uint64_t *rows = ctx_rows(c, &words);
    if (rows == NULL)
        return -1;
    uint64_t *mask = &rows[(-2 - v) * words + word];
    if (*mask & bit)
        return 1;
    *mask |= bit;
    return 0;
}

static int unhold1(Ctx *c, Py_ssize_t slot, uint64_t seq)
{
    Table *nodes = ctx_nodes(c);
    if (nodes == NULL)
        return -1;
    Py_ssize_t cell = find1(nodes, seq);
    if (cell < 0)
        return 0; /* only a 64-bit hash collision gets here */
    int64_t v = get_val(nodes, cell);
    if (v >= 0) {
        if (v == slot)
            delete1(nodes, cell);
        return 0;
    }
    Py_ssize_t words;
    uint64_t *rows = ctx_rows(c, &words);
    if (rows == NULL)
        return -1;
    int64_t row = -2 - v;
    uint64_t *r = rows + row * words;
    r[slot >> 6] &= ~(1ULL << (slot & 63));
    Py_ssize_t left = -1;
    int nonzero = 0;
    for (Py_ssize_t w = 0; w < words; w++)
        if (r[w]) {
            nonzero++;
            left = w;
        }
    if (nonzero == 1 && (r[left] & (r[left] - 1)) == 0) {
        set_val(nodes, cell, (uint64_t)(left * 64 + __builtin_ctzll(r[left])));
        PyObject *free_rows = PyObject_GetAttr(c->holders, a_rows_free);
        if (free_rows == NULL)
            return -1;
        PyObject *n = PyLong_FromLongLong(row);
        int rc = n == NULL ? -1 : PyList_Append(free_rows, n);
        Py_XDECREF(n);
        Py_DECREF(free_rows);
        return rc;
    }
    return 0;
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

static int add1(Ctx *c, Py_ssize_t slot, uint64_t block_hash, uint64_t seq)
{
    Table *t = ctx_table(c, slot);
    if (t == NULL || insert1(c, t, block_hash, seq) < 0)
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
    Py_ssize_t cell = find1(t, block_hash);
    if (cell >= 0) {
        uint64_t was = (uint64_t)get_val(t, cell);
        if (was == seq)
            return 0; /* re-announced: nothing changes */
        if (drop1(c, slot, block_hash, was, cell) < 0) /* the engine reused the id */
            return -1;
    }
    return add1(c, slot, block_hash, seq);
}

/* --- ops ------------------------------------------------------------------------------------ */

/* A Python int in [0, 2**64) as u64: 0, or 1 when it is not one (no exception left set). */
static int as_u64(PyObject *v, uint64_t *out)
{
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
static Py_ssize_t read_numbers(PyObject *seq, int pairs, uint64_t **buf, Py_ssize_t *cap)
{
    if (!PyList_Check(seq) && !PyTuple_Check(seq))
        return -2;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    Py_ssize_t need = pairs ? 2 * n : n;
    if (need > *cap) {
        uint64_t *grown = PyMem_Realloc(*buf, (size_t)need * 8);
        if (grown == NULL) {
            PyErr_NoMemory();
            return -1;
        }
        *buf = grown;
        *cap = need;
    }
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

static int ctx_open(Ctx *c, PyObject *index)
{
    memset(c, 0, sizeof(*c));
    c->gen = 1;
    c->index = index;
    c->blocks = PyObject_GetAttr(index, a_blocks);
    c->dups = PyObject_GetAttr(index, a_dups);
    c->sums = PyObject_GetAttr(index, a_sums);
    c->slots = PyObject_GetAttr(index, a_slots);
    c->holders = PyObject_GetAttr(index, a_holders);
    if (c->blocks == NULL || c->dups == NULL || c->sums == NULL || c->slots == NULL
        || c->holders == NULL)
        return -1;
    if (!PyList_Check(c->blocks) || !PyList_Check(c->dups) || !PyList_Check(c->sums)
        || !PyDict_Check(c->slots)) {
        PyErr_SetString(PyExc_TypeError, "not a compact prefix index");
        return -1;
    }
    return 0;
}

static void ctx_close(Ctx *c)
{
    if (c->have_rows)
        PyBuffer_Release(&c->rows);
    PyMem_Free(c->tables);
    Py_XDECREF(c->blocks);
    Py_XDECREF(c->dups);
    Py_XDECREF(c->sums);
    Py_XDECREF(c->slots);
    Py_XDECREF(c->holders);
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

/* --- bulk load: U64Table._fill_empty ------------------------------------------------------- */

typedef struct {
    uint64_t bucket;
    Py_ssize_t at;
} Waiting;

static int by_bucket(const void *x, const void *y)
{
    const Waiting *a = x, *b = y;
    if (a->bucket != b->bucket)
        return a->bucket < b->bucket ? -1 : 1;
    return (a->at > b->at) - (a->at < b->at);
}

/* fill_empty(table, keys, vals) -> positions of the keys left for U64Table._place, in the order
 * _fill_empty leaves them. Each key to its first bucket, the k-th of a bucket's keys (in input
 * order) to its k-th cell; the overflow, in (first bucket, input) order, likewise to its second
 * bucket after what the first pass put there: what _fill_empty's two stable sorts give. */
static PyObject *fill_empty(PyObject *self, PyObject *args)
{
    PyObject *obj, *keys_obj, *vals_obj;
    if (!PyArg_ParseTuple(args, "OOO:fill_empty", &obj, &keys_obj, &vals_obj))
        return NULL;
    Table t;
    Py_buffer kb, vb;
    memset(&t, 0, sizeof(t));
    int wide = 1;
    if (PyObject_GetBuffer(keys_obj, &kb, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) < 0)
        return NULL;
    if (PyObject_GetBuffer(vals_obj, &vb, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) < 0) {
        PyBuffer_Release(&kb);
        return NULL;
    }
    PyObject *out = NULL;
    uint8_t *fill = NULL;
    Waiting *waiting = NULL, *second = NULL;
    Py_ssize_t n = kb.len / 8;
    wide = vb.itemsize == 8;
    if (kb.itemsize != 8 || (vb.itemsize != 8 && vb.itemsize != 4) || vb.len / vb.itemsize != n) {
        PyErr_SetString(PyExc_TypeError, "fill_empty: u64 keys and as many u64/int32 values");
        goto done;
    }
    if (load_table(obj, &t, wide) < 0)
        goto done;
    const uint64_t *keys = kb.buf;
    fill = PyMem_Calloc((size_t)(t.mask + 1), 1);
    waiting = PyMem_Malloc((size_t)(n ? n : 1) * sizeof(Waiting));
    if (fill == NULL || waiting == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    Py_ssize_t left = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        uint64_t b = (keys[i] * TABLE_M) >> t.s1;
        if (fill[b] < WAYS) {
            Py_ssize_t cell = (Py_ssize_t)b * WAYS + fill[b]++;
            t.keys[cell] = keys[i];
            set_val(&t, cell, wide ? ((const uint64_t *)vb.buf)[i]
                                   : (uint64_t)(int64_t)((const int32_t *)vb.buf)[i]);
            t.occ[cell] = 1;
        } else {
            waiting[left].bucket = b;
            waiting[left++].at = i;
        }
    }
    qsort(waiting, (size_t)left, sizeof(Waiting), by_bucket);
    second = PyMem_Malloc((size_t)(left ? left : 1) * sizeof(Waiting));
    if (second == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    Py_ssize_t rest = 0;
    for (Py_ssize_t j = 0; j < left; j++) {
        Py_ssize_t i = waiting[j].at;
        uint64_t b = ((keys[i] * TABLE_M) >> t.s2) & t.mask;
        if (fill[b] < WAYS) {
            Py_ssize_t cell = (Py_ssize_t)b * WAYS + fill[b]++;
            t.keys[cell] = keys[i];
            set_val(&t, cell, wide ? ((const uint64_t *)vb.buf)[i]
                                   : (uint64_t)(int64_t)((const int32_t *)vb.buf)[i]);
            t.occ[cell] = 1;
        } else {
            second[rest].bucket = b;
            second[rest++].at = j; /* ties keep the first pass's order */
        }
    }
    qsort(second, (size_t)rest, sizeof(Waiting), by_bucket);
    out = PyList_New(rest);
    for (Py_ssize_t j = 0; out != NULL && j < rest; j++) {
        PyObject *v = PyLong_FromSsize_t(waiting[second[j].at].at);
        if (v == NULL)
            Py_CLEAR(out);
        else
            PyList_SET_ITEM(out, j, v);
    }
done:
    PyMem_Free(fill);
    PyMem_Free(waiting);
    PyMem_Free(second);
    PyBuffer_Release(&kb);
    PyBuffer_Release(&vb);
    return out;
}

/* --- a new table's empty cells, and a table's occupied ones (U64Table._alloc, items) ---------- */

static int writable_u64(PyObject *obj, Py_buffer *view, Py_ssize_t count)
{
    if (PyObject_GetBuffer(obj, view, PyBUF_C_CONTIGUOUS | PyBUF_WRITABLE | PyBUF_FORMAT) < 0)
        return -1;
    if (view->itemsize != 8 || view->len != count * 8) {
        PyBuffer_Release(view);
        PyErr_SetString(PyExc_ValueError, "expected a u64 array of another size");
        return -1;
    }
    return 0;
}

/* sentinels(empty, keys, mask, s1, s2): each bucket's sentinel into empty[bucket] and into the
 * bucket's 8 cells of keys, as U64Table._sentinels and the repeat after it compute them. */
static PyObject *sentinels(PyObject *self, PyObject *args)
{
    PyObject *empty_obj, *keys_obj;
    unsigned long long mask;
    int s1, s2;
    if (!PyArg_ParseTuple(args, "OOKii:sentinels", &empty_obj, &keys_obj, &mask, &s1, &s2))
        return NULL;
    Py_ssize_t buckets = (Py_ssize_t)mask + 1;
    Py_buffer eb, kb;
    if (s1 < 0 || s1 > 63 || s2 < 0 || s2 > 63 || writable_u64(empty_obj, &eb, buckets) < 0)
        return s1 < 0 || s1 > 63 || s2 < 0 || s2 > 63
               ? (PyErr_SetString(PyExc_ValueError, "sentinels: shifts out of range"), NULL)
               : NULL;
    if (writable_u64(keys_obj, &kb, buckets * WAYS) < 0) {
        PyBuffer_Release(&eb);
        return NULL;
    }
    Table t;
    t.mask = (uint64_t)mask;
    t.s1 = s1;
    t.s2 = s2;
    uint64_t *empty = eb.buf, *keys = kb.buf;
    for (Py_ssize_t b = 0; b < buckets; b++) {
        uint64_t key = sentinel(&t, (uint64_t)b);
        empty[b] = key;
        for (int w = 0; w < WAYS; w++)
            keys[b * WAYS + w] = key;
    }
    PyBuffer_Release(&eb);
    PyBuffer_Release(&kb);
    Py_RETURN_NONE;
}

/* occupied(table, keys, vals): the occupied cells' keys and values, in cell order, into arrays
 * of as many (U64Table.items; the caller counted the cells). */
static PyObject *occupied(PyObject *self, PyObject *args)
{
    PyObject *obj, *keys_obj, *vals_obj;
    if (!PyArg_ParseTuple(args, "OOO:occupied", &obj, &keys_obj, &vals_obj))
        return NULL;
    Table t;
    Py_buffer kb, vb;
    PyObject *mv = PyObject_GetAttr(obj, a_mv);
    if (mv == NULL)
        return NULL;
    int wide = PyMemoryView_Check(mv) && PyMemoryView_GET_BUFFER(mv)->itemsize == 8;
    Py_DECREF(mv);
    if (load_table(obj, &t, wide) < 0)
        return NULL;
    Py_ssize_t count = PyObject_Length(keys_obj);
    if (count < 0 || writable_u64(keys_obj, &kb, count) < 0)
        return NULL;
    if (PyObject_GetBuffer(vals_obj, &vb, PyBUF_C_CONTIGUOUS | PyBUF_WRITABLE | PyBUF_FORMAT) < 0) {
        PyBuffer_Release(&kb);
        return NULL;
    }
    PyObject *result = NULL;
    if (vb.itemsize != (wide ? 8 : 4) || vb.len != count * vb.itemsize) {
        PyErr_SetString(PyExc_ValueError, "occupied: values of another type or size");
        goto done;
    }
    uint64_t *keys = kb.buf;
    Py_ssize_t n = 0;
    for (Py_ssize_t cell = 0; cell < t.cells; cell++) {
        if (!t.occ[cell])
            continue;
        if (n == count) {
            n++;
            break;
        }
        keys[n] = t.keys[cell];
        if (wide)
            ((uint64_t *)vb.buf)[n] = ((uint64_t *)t.vals)[cell];
        else
            ((int32_t *)vb.buf)[n] = ((int32_t *)t.vals)[cell];
        n++;
    }
    if (n != count)
        PyErr_SetString(PyExc_ValueError, "occupied: not as many occupied cells");
    else
        result = Py_NewRef(Py_None);
done:
    PyBuffer_Release(&kb);
    PyBuffer_Release(&vb);
    return result;
}

static PyMethodDef methods[] = {
    {"apply_ops", apply_ops, METH_VARARGS,
     "apply_ops(index, ops, start) -> results of ops[start:k]; ops[k] is Python's to apply"},
    {"fill_empty", fill_empty, METH_VARARGS,
     "fill_empty(table, keys, vals) -> positions of the keys left for U64Table._place"},
    {"sentinels", sentinels, METH_VARARGS,
     "sentinels(empty, keys, mask, s1, s2): a new table's empty keys"},
    {"occupied", occupied, METH_VARARGS,
     "occupied(table, keys, vals): the occupied cells' keys and values, in cell order"},
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
    uint64_t inv = 1; /* Newton's iteration for the inverse of an odd number mod 2**64 */
    for (int i = 0; i < 6; i++)
        inv *= 2 - TABLE_M * inv;
    TABLE_M_INVERSE = inv;
    INTERN(str_ok, "ok");
    INTERN(str_lost, "parent_block_not_found");
    INTERN(a_mk, "_mk");
    INTERN(a_mv, "mv");
    INTERN(a_mo, "_mo");
    INTERN(a_mask, "mask");
    INTERN(a_s1, "_s1");
    INTERN(a_s2, "_s2");
    INTERN(a_size, "size");
    INTERN(a_limit, "_limit");
    INTERN(a_insert1, "insert1");
    INTERN(a_blocks, "_blocks");
    INTERN(a_dups, "_dups");
    INTERN(a_sums, "_sums");
    INTERN(a_slots, "_slots");
    INTERN(a_holders, "_holders");
    INTERN(a_total, "_total");
    INTERN(a_slot_for, "_slot_for");
    INTERN(a_nodes, "nodes");
    INTERN(a_rows, "rows");
    INTERN(a_rows_free, "rows_free");
    INTERN(a_rows_used, "rows_used");
    INTERN(a_alloc_rows, "_alloc_rows");
    return PyModule_Create(&module);
}
