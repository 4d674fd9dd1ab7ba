/* What the compact prefix index's kernel (_fastindex.c, _fastindex_table.c, _fastindex_match.c)
 * knows of a U64Table (replicas/core/index_table.py): its cells read through the memoryviews the
 * table keeps, and its one-key methods (find1, _place1, _relocate1, delete1) step for step, so
 * that the kernel leaves the cells the Python code leaves. */
#ifndef JETROUTER_FASTINDEX_H
#define JETROUTER_FASTINDEX_H

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#define WAYS 8
static const uint64_t TABLE_M = 0x9E3779B97F4A7C15ULL;         /* index_table._M */
static const uint64_t TABLE_M_INVERSE = 0xF1DE83E19937733DULL; /* TABLE_M * this == 1 */

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

/* Attribute names, interned once (table_names). */
extern PyObject *a_mk, *a_mv, *a_mo, *a_mask, *a_s1, *a_s2, *a_size, *a_limit;

int table_names(void);
int int_attr(PyObject *obj, PyObject *name, long long *out);
int load_table(PyObject *obj, Table *t, int wide);
int flush_table(Table *t);
PyObject *fill_empty(PyObject *self, PyObject *args);
PyObject *sentinels(PyObject *self, PyObject *args);
PyObject *occupied(PyObject *self, PyObject *args);
PyObject *place_each(PyObject *self, PyObject *args);
PyObject *place_occupied(PyObject *self, PyObject *args);
int match_names(void);
PyObject *prefix_match(PyObject *self, PyObject *args);

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

/* --- U64Table's one-key methods ------------------------------------------------------------- */

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

/* _relocate1: one cuckoo step, or -1 (_fastindex_table.c: rarely needed). */
Py_ssize_t relocate1(Table *t, uint64_t key, uint64_t val);

/* find1 and, for an absent key, the cell place1 would pick without a cuckoo step, from one read
 * of the two buckets (storing a block looks up a key that is nearly always absent, then places
 * it: reading both buckets twice more, for their fill and first free way, was the kernel's
 * largest cost). `free` is -1 when both buckets are full (place1 then tries a cuckoo step). */
typedef struct {
    Py_ssize_t found, free;
} Probe;

/* One bucket of probe: the key's cell, or -1 with the bucket's fill and first free way. */
static inline Py_ssize_t probe_bucket(const Table *t, Py_ssize_t b, uint64_t key, int *fill,
                                      int *free_way)
{
    uint64_t empty = sentinel(t, (uint64_t)(b / WAYS));
    for (int w = 0; w < WAYS; w++) {
        uint64_t k = t->keys[b + w];
        if (k == key && t->size)
            return b + w;
        if (k != empty)
            (*fill)++;
        else if (*free_way < 0)
            *free_way = w;
    }
    return -1;
}

static inline Probe probe(const Table *t, uint64_t key)
{
    uint64_t h = key * TABLE_M;
    Py_ssize_t b1 = (Py_ssize_t)(h >> t->s1) * WAYS;
    Py_ssize_t b2 = (Py_ssize_t)((h >> t->s2) & t->mask) * WAYS;
    int n1 = 0, n2 = 0, free1 = -1, free2 = -1;
    Probe p = {probe_bucket(t, b1, key, &n1, &free1), -1};
    if (p.found >= 0 || (p.found = probe_bucket(t, b2, key, &n2, &free2)) >= 0)
        return p;
    /* place1's choice: the second bucket when it is the emptier, its first free way */
    if (n2 < n1)
        p.free = free2 < 0 ? -1 : b2 + free2;
    else
        p.free = free1 < 0 ? -1 : b1 + free1;
    return p;
}

/* A key into a free cell. */
static inline Py_ssize_t place_at(Table *t, Py_ssize_t cell, uint64_t key, uint64_t val)
{
    t->keys[cell] = key;
    set_val(t, cell, val);
    t->occ[cell] = 1;
    return cell;
}

/* _place1 (for an absent key): the emptier bucket's first free cell, else a cuckoo step; -1
 * when both fail. */
static inline Py_ssize_t place1(Table *t, uint64_t key, uint64_t val)
{
    Probe p = probe(t, key);
    return p.free < 0 ? relocate1(t, key, val) : place_at(t, p.free, key, val);
}

static inline void delete1(Table *t, Py_ssize_t cell)
{
    t->keys[cell] = sentinel(t, (uint64_t)(cell / WAYS));
    t->occ[cell] = 0;
    t->size--;
    t->dirty = 1;
}

#endif
