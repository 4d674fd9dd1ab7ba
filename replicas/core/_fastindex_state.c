/* The compact prefix index's kernel (_fastindex.c): the index's state during one call, and the
 * holders' one-node methods. See _fastindex_state.h. */
#include "_fastindex_state.h"

static PyObject *a_blocks, *a_dups, *a_sums, *a_slots, *a_holders, *a_total;
static PyObject *a_nodes, *a_rows, *a_rows_free, *a_rows_used;
PyObject *a_slot_for, *a_words;

int state_names(void)
{
    return (a_blocks = PyUnicode_InternFromString("_blocks"))
        && (a_dups = PyUnicode_InternFromString("_dups"))
        && (a_sums = PyUnicode_InternFromString("_sums"))
        && (a_slots = PyUnicode_InternFromString("_slots"))
        && (a_holders = PyUnicode_InternFromString("_holders"))
        && (a_total = PyUnicode_InternFromString("_total"))
        && (a_slot_for = PyUnicode_InternFromString("_slot_for"))
        && (a_words = PyUnicode_InternFromString("words"))
        && (a_nodes = PyUnicode_InternFromString("nodes"))
        && (a_rows = PyUnicode_InternFromString("rows"))
        && (a_rows_free = PyUnicode_InternFromString("rows_free"))
        && (a_rows_used = PyUnicode_InternFromString("rows_used")) ? 0 : -1;
}

/* --- the context: the index's objects, tables read lazily, counts written back -------------- */

int ctx_flush(Ctx *c)
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
int ctx_before_python(Ctx *c)
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

Table *ctx_table_read(Ctx *c, Py_ssize_t slot)
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

Table *ctx_nodes_read(Ctx *c)
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

/* --- changing a table ------------------------------------------------------------------------ */

/* insert1's way through Python (_fastindex_state.h). */
int insert1_python(Ctx *c, Table *t, uint64_t key, uint64_t val)
{
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
int hold1(Ctx *c, Py_ssize_t slot, uint64_t seq)
{
    Table *nodes = ctx_nodes(c);
    if (nodes == NULL)
        return -1;
    Probe p = probe(nodes, seq);
    Py_ssize_t cell = p.found;
    if (cell < 0)
        return insert1_probed(c, nodes, seq, (uint64_t)slot, p.free) < 0 ? -1 : 0;
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

int unhold1(Ctx *c, Py_ssize_t slot, uint64_t seq)
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

int ctx_open(Ctx *c, PyObject *index)
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

void ctx_close(Ctx *c)
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
