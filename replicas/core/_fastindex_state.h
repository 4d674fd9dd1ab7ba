/* The compact prefix index as its kernel (_fastindex.c) sees it during one call: the index's
 * Python objects, each slot's block table read when first needed, the counts the kernel keeps
 * (table sizes, digest sums, the total) until it writes them back, and the holders' one-node
 * methods (NodeHolders.hold1, unhold1, _alloc_rows) step for step. */
#ifndef JETROUTER_FASTINDEX_STATE_H
#define JETROUTER_FASTINDEX_STATE_H

#include "_fastindex.h"

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

int state_names(void);
int ctx_open(Ctx *c, PyObject *index);
void ctx_close(Ctx *c);
int ctx_flush(Ctx *c);
int ctx_before_python(Ctx *c);
Table *ctx_table_read(Ctx *c, Py_ssize_t slot);
Table *ctx_nodes_read(Ctx *c);
int insert1_python(Ctx *c, Table *t, uint64_t key, uint64_t val);
int hold1(Ctx *c, Py_ssize_t slot, uint64_t seq);
int unhold1(Ctx *c, Py_ssize_t slot, uint64_t seq);

extern PyObject *a_slot_for, *a_words; /* a_words: packed pairs' words */

/* The slot's block table, read again only after Python ran (the calls per block stay inline). */
static inline Table *ctx_table(Ctx *c, Py_ssize_t slot)
{
    if (slot < c->ntables && c->tables[slot].gen == c->gen)
        return &c->tables[slot];
    return ctx_table_read(c, slot);
}

static inline Table *ctx_nodes(Ctx *c)
{
    return c->nodes.gen == c->gen ? &c->nodes : ctx_nodes_read(c);
}

/* insert1 of an absent key: here when it fits, else U64Table.insert1 itself (it doubles the
 * table, or places the key in bulk), after which every pointer is read again. */
static inline int insert1(Ctx *c, Table *t, uint64_t key, uint64_t val)
{
    if (t->size < t->limit && place1(t, key, val) >= 0) {
        t->size++;
        t->dirty = 1;
        return 0;
    }
    return insert1_python(c, t, key, val);
}

/* insert1 of a key `probe` found absent, into the cell it picked (`free`): the same cell. */
static inline int insert1_probed(Ctx *c, Table *t, uint64_t key, uint64_t val, Py_ssize_t free)
{
    if (free < 0 || t->size >= t->limit)
        return insert1(c, t, key, val);
    place_at(t, free, key, val);
    t->size++;
    t->dirty = 1;
    return 0;
} /* "_slot_for", interned: a root store of a new worker calls it */

#endif
