/*
 * A fixed-capacity, lock-free, open-addressing map from pointer-sized keys to
 * 64-bit values: device pointers -> allocation sizes, allocation handles ->
 * sizes, graph execs -> block costs. Readers never lock (cuGraphLaunch looks
 * a cost up on the launch path).
 *
 * Keys are unique while present: a pointer is removed before the driver frees
 * it, so the driver cannot hand the same value to another thread while the
 * old entry still exists. Values are stored right after the key is claimed; a
 * lookup can only race with that for a key whose creating call has not
 * returned yet, which callers never look up.
 *
 * The slot array is an anonymous MAP_NORESERVE mapping allocated on first
 * use; only touched pages cost memory.
 */
#include "shim_internal.h"

#include <sys/mman.h>

#define KEY_EMPTY ((uintptr_t)0)
#define KEY_TOMB ((uintptr_t)1)
#define MAX_PROBE 128

struct dilu_ptrmap_slot {
    _Atomic uintptr_t key;
    _Atomic uint64_t value;
};

static bool ensure_slots(struct dilu_ptrmap *m) {
    int st = atomic_load_explicit(&m->ready, memory_order_acquire);
    if (DILU_LIKELY(st == 2)) return true;
    if (st == 3) return false;
    int expected = 0;
    if (atomic_compare_exchange_strong(&m->ready, &expected, 1)) {
        size_t bytes = ((size_t)1 << m->bits) * sizeof(struct dilu_ptrmap_slot);
        void *p = mmap(NULL, bytes, PROT_READ | PROT_WRITE,
                       MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
        if (p == MAP_FAILED) {
            atomic_store_explicit(&m->ready, 3, memory_order_release);
            return false;
        }
        m->slots = p;
        m->mask = ((uint64_t)1 << m->bits) - 1;
        atomic_store_explicit(&m->ready, 2, memory_order_release);
        return true;
    }
    while ((st = atomic_load_explicit(&m->ready, memory_order_acquire)) == 1) {
    }
    return st == 2;
}

static inline uint64_t slot_of(const struct dilu_ptrmap *m, uintptr_t key) {
    return ((uint64_t)key * 0x9E3779B97F4A7C15ull) >> (64 - m->bits);
}

bool dilu_ptrmap_insert(struct dilu_ptrmap *m, uintptr_t key, uint64_t value) {
    if (key <= KEY_TOMB || !ensure_slots(m)) return false;
    uint64_t h = slot_of(m, key);
    for (unsigned i = 0; i < MAX_PROBE; i++) {
        struct dilu_ptrmap_slot *s = &m->slots[(h + i) & m->mask];
        uintptr_t cur = atomic_load_explicit(&s->key, memory_order_acquire);
        while (cur == KEY_EMPTY || cur == KEY_TOMB) {
            if (atomic_compare_exchange_weak_explicit(&s->key, &cur, key, memory_order_acq_rel,
                                                      memory_order_acquire)) {
                atomic_store_explicit(&s->value, value, memory_order_release);
                return true;
            }
        }
    }
    return false;
}

static struct dilu_ptrmap_slot *find(struct dilu_ptrmap *m, uintptr_t key) {
    if (key <= KEY_TOMB || atomic_load_explicit(&m->ready, memory_order_acquire) != 2) return NULL;
    uint64_t h = slot_of(m, key);
    for (unsigned i = 0; i < MAX_PROBE; i++) {
        struct dilu_ptrmap_slot *s = &m->slots[(h + i) & m->mask];
        uintptr_t cur = atomic_load_explicit(&s->key, memory_order_acquire);
        if (cur == key) return s;
        if (cur == KEY_EMPTY) return NULL;
    }
    return NULL;
}

bool dilu_ptrmap_lookup(struct dilu_ptrmap *m, uintptr_t key, uint64_t *value) {
    struct dilu_ptrmap_slot *s = find(m, key);
    if (!s) return false;
    *value = atomic_load_explicit(&s->value, memory_order_acquire);
    return true;
}

bool dilu_ptrmap_remove(struct dilu_ptrmap *m, uintptr_t key, uint64_t *value) {
    struct dilu_ptrmap_slot *s = find(m, key);
    if (!s) return false;
    uint64_t v = atomic_load_explicit(&s->value, memory_order_acquire);
    uintptr_t expected = key;
    if (!atomic_compare_exchange_strong_explicit(&s->key, &expected, KEY_TOMB,
                                                 memory_order_acq_rel, memory_order_acquire))
        return false; /* another thread removed it first */
    if (value) *value = v;
    return true;
}

bool dilu_ptrmap_upsert(struct dilu_ptrmap *m, uintptr_t key, uint64_t value) {
    struct dilu_ptrmap_slot *s = find(m, key);
    if (s) {
        atomic_store_explicit(&s->value, value, memory_order_release);
        return true;
    }
    return dilu_ptrmap_insert(m, key, value);
}
