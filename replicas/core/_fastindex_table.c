/* The compact prefix index's kernel (_fastindex.c): reading a U64Table from its Python object, and
 * the table's bulk passes — _fill_empty (a table doubling, or restored), a new table's sentinel
 * keys (_alloc), its occupied cells in cell order (items), the keys _place leaves to _place1,
 * a restored table's cells (from_cells) — each giving the arrays the numpy code gives. No numpy headers: the arrays come through the buffer protocol. */
#include "_fastindex.h"

PyObject *a_mk, *a_mv, *a_mo, *a_mask, *a_s1, *a_s2, *a_size, *a_limit;

int table_names(void)
{
    return (a_mk = PyUnicode_InternFromString("_mk")) && (a_mv = PyUnicode_InternFromString("mv"))
        && (a_mo = PyUnicode_InternFromString("_mo"))
        && (a_mask = PyUnicode_InternFromString("mask"))
        && (a_s1 = PyUnicode_InternFromString("_s1")) && (a_s2 = PyUnicode_InternFromString("_s2"))
        && (a_size = PyUnicode_InternFromString("size"))
        && (a_limit = PyUnicode_InternFromString("_limit")) ? 0 : -1;
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

int int_attr(PyObject *obj, PyObject *name, long long *out)
{
    PyObject *v = PyObject_GetAttr(obj, name);
    if (v == NULL)
        return -1;
    *out = PyLong_AsLongLong(v);
    Py_DECREF(v);
    return (*out == -1 && PyErr_Occurred()) ? -1 : 0;
}

int load_table(PyObject *obj, Table *t, int wide)
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

int flush_table(Table *t)
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

/* _relocate1: one cuckoo step, or -1. */
Py_ssize_t relocate1(Table *t, uint64_t key, uint64_t val)
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

/* Key i of a column that may sit at any byte offset (v6's owners are a view of the snapshot's
 * buffer, index_arrays.py): read through memcpy, which compiles to one unaligned load. */
static inline uint64_t load_key(const unsigned char *keys, Py_ssize_t i)
{
    uint64_t key;
    memcpy(&key, keys + 8 * i, 8);
    return key;
}

/* Put key i in the next free cell of bucket b if it has one (both passes of fill_empty). */
static inline int fill_into(Table *t, uint8_t *fill, uint64_t b, uint64_t key, uint64_t val)
{
    if (fill[b] >= WAYS)
        return 0;
    Py_ssize_t cell = (Py_ssize_t)b * WAYS + fill[b]++;
    t->keys[cell] = key;
    set_val(t, cell, val);
    t->occ[cell] = 1;
    return 1;
}

/* fill_empty(table, keys, vals) -> positions of the keys left for U64Table._place, in the order
 * _fill_empty leaves them. Each key to its first bucket, the k-th of a bucket's keys (in input
 * order) to its k-th cell; the overflow, in (first bucket, input) order, likewise to its second
 * bucket after what the first pass put there: what _fill_empty's two stable sorts give. */
/* Keys (u64) and as many values (u64 or int32) as buffers, and the table they go into loaded for
 * the values' width. 0; or -1 with an exception set and no buffer held. */
static int keys_vals_table(PyObject *obj, PyObject *keys_obj, PyObject *vals_obj, const char *who,
                           Py_buffer *kb, Py_buffer *vb, Table *t)
{
    if (PyObject_GetBuffer(keys_obj, kb, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) < 0)
        return -1;
    if (PyObject_GetBuffer(vals_obj, vb, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) < 0) {
        PyBuffer_Release(kb);
        return -1;
    }
    Py_ssize_t n = kb->len / 8;
    if (kb->itemsize != 8 || (vb->itemsize != 8 && vb->itemsize != 4)
        || vb->len / vb->itemsize != n) {
        PyErr_Format(PyExc_TypeError, "%s: u64 keys and as many u64/int32 values", who);
    } else if (load_table(obj, t, vb->itemsize == 8) == 0) {
        return 0;
    }
    PyBuffer_Release(kb);
    PyBuffer_Release(vb);
    return -1;
}

PyObject *fill_empty(PyObject *self, PyObject *args)
{
    PyObject *obj, *keys_obj, *vals_obj;
    if (!PyArg_ParseTuple(args, "OOO:fill_empty", &obj, &keys_obj, &vals_obj))
        return NULL;
    Table t;
    Py_buffer kb, vb;
    memset(&t, 0, sizeof(t));
    if (keys_vals_table(obj, keys_obj, vals_obj, "fill_empty", &kb, &vb, &t) < 0)
        return NULL;
    PyObject *out = NULL;
    uint8_t *fill = NULL;
    Waiting *waiting = NULL, *second = NULL;
    Py_ssize_t n = kb.len / 8;
    int wide = vb.itemsize == 8;
    const unsigned char *keys = kb.buf;
#define VAL_AT(i) (wide ? ((const uint64_t *)vb.buf)[i] \
                        : (uint64_t)(int64_t)((const int32_t *)vb.buf)[i])
    fill = PyMem_Calloc((size_t)(t.mask + 1), 1);
    waiting = PyMem_Malloc((size_t)(n ? n : 1) * sizeof(Waiting));
    if (fill == NULL || waiting == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    Py_ssize_t left = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        uint64_t key = load_key(keys, i);
        uint64_t b = (key * TABLE_M) >> t.s1;
        if (!fill_into(&t, fill, b, key, VAL_AT(i))) {
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
        uint64_t key = load_key(keys, i);
        uint64_t b = ((key * TABLE_M) >> t.s2) & t.mask;
        if (!fill_into(&t, fill, b, key, VAL_AT(i))) {
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
#undef VAL_AT
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
PyObject *sentinels(PyObject *self, PyObject *args)
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
PyObject *occupied(PyObject *self, PyObject *args)
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

/* --- the keys _place's rounds left: U64Table._place1 for each, in order ----------------------- */

/* place_each(table, keys, vals) -> positions of the keys that found no room (both buckets full
 * and no cuckoo step): place1 for each key in turn, as _place's last loop calls _place1, so the
 * same keys land in the same cells. The size is the caller's to count, as there. */
PyObject *place_each(PyObject *self, PyObject *args)
{
    PyObject *obj, *keys_obj, *vals_obj;
    if (!PyArg_ParseTuple(args, "OOO:place_each", &obj, &keys_obj, &vals_obj))
        return NULL;
    Table t;
    Py_buffer kb, vb;
    if (keys_vals_table(obj, keys_obj, vals_obj, "place_each", &kb, &vb, &t) < 0)
        return NULL;
    Py_ssize_t n = kb.len / 8;
    int wide = vb.itemsize == 8;
    const unsigned char *keys = kb.buf;
    PyObject *out = PyList_New(0);
    for (Py_ssize_t i = 0; out != NULL && i < n; i++) {
        uint64_t val = wide ? ((const uint64_t *)vb.buf)[i]
                            : (uint64_t)(int64_t)((const int32_t *)vb.buf)[i];
        if (place1(&t, load_key(keys, i), val) >= 0)
            continue;
        PyObject *v = PyLong_FromSsize_t(i);
        if (v == NULL || PyList_Append(out, v) < 0)
            Py_CLEAR(out);
        Py_XDECREF(v);
    }
    PyBuffer_Release(&kb);
    PyBuffer_Release(&vb);
    return out;
}

/* --- a restored block table: U64Table.from_cells ---------------------------------------------- */

/* place_occupied(table, keys, vals, occupancy): into an empty table, the k-th key and value at
 * the k-th set bit of occupancy (one bit a cell, little-endian), each checked to sit in one of
 * its two buckets; the same cells as from_cells' numpy code, in one pass and no temporaries. The
 * size is the caller's to set. */
PyObject *place_occupied(PyObject *self, PyObject *args)
{
    PyObject *obj, *keys_obj, *vals_obj, *occ_obj;
    if (!PyArg_ParseTuple(args, "OOOO:place_occupied", &obj, &keys_obj, &vals_obj, &occ_obj))
        return NULL;
    Py_buffer kb, vb, ob;
    Table t;
    if (keys_vals_table(obj, keys_obj, vals_obj, "place_occupied", &kb, &vb, &t) < 0)
        return NULL;
    if (PyObject_GetBuffer(occ_obj, &ob, PyBUF_C_CONTIGUOUS) < 0) {
        PyBuffer_Release(&kb);
        PyBuffer_Release(&vb);
        return NULL;
    }
    PyObject *result = NULL;
    Py_ssize_t n = kb.len / 8;
    int wide = vb.itemsize == 8;
    const unsigned char *keys = kb.buf, *bits = ob.buf;
    Py_ssize_t k = 0;
    for (Py_ssize_t i = 0; i < ob.len; i++) /* as many cells as keys, checked first as there */
        k += __builtin_popcount(bits[i]);
    if (ob.len * 8 != t.cells || k != n) {
        PyErr_SetString(PyExc_ValueError, "table cells do not match their occupancy");
        goto done;
    }
    k = 0;
    for (Py_ssize_t i = 0; i < ob.len; i++) {
        for (unsigned int byte = bits[i]; byte; byte &= byte - 1) {
            Py_ssize_t cell = i * 8 + __builtin_ctz(byte);
            uint64_t key = load_key(keys, k);
            uint64_t h = key * TABLE_M, bucket = (uint64_t)(cell / WAYS);
            if (bucket != h >> t.s1 && bucket != ((h >> t.s2) & t.mask)) {
                PyErr_SetString(PyExc_ValueError, "a key outside both of its buckets");
                goto done;
            }
            t.keys[cell] = key;
            set_val(&t, cell, wide ? ((const uint64_t *)vb.buf)[k]
                                   : (uint64_t)(int64_t)((const int32_t *)vb.buf)[k]);
            t.occ[cell] = 1;
            k++;
        }
    }
    result = Py_NewRef(Py_None);
done:
    PyBuffer_Release(&kb);
    PyBuffer_Release(&vb);
    PyBuffer_Release(&ob);
    return result;
}
