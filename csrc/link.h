/* An emulated slower link for a cache's loads (SpecMD Appendix A.4, "hardware emulation"),
 * one routine for both tiers: the CPU cache's store reads (cache.c) and the GPU cache's
 * loads (cuda/gcache.c).  Every load occupies the link for latency + bytes / bandwidth; loads
 * queue on it in the order they start, and a load returns no earlier than its end on the link.
 * 0/0: off (loads take what the hardware takes).
 *
 * Locking: `mu` guards the three fields (loads run without the slot table's lock, on the
 * demand thread or the prefetch worker). */
#ifndef SMOE_LINK_H
#define SMOE_LINK_H

#include <pthread.h>

#include "common.h"

typedef struct smoe_link {
    pthread_mutex_t mu;
    double bw;     /* [mu] bytes per second, 0: no bandwidth limit */
    double lat_s;  /* [mu] seconds added to every load */
    double free_s; /* [mu] smoe_now() time at which the link is free */
} smoe_link;

int smoe_link_init(smoe_link *l, smoe_err *err); /* off */
void smoe_link_free(smoe_link *l);

/* bytes_per_s = latency_s = 0: off; negative or non-finite: SMOE_EINVAL. */
int smoe_link_set(smoe_link *l, double bytes_per_s, double latency_s, smoe_err *err);

/* Reserve the link for one load of `bytes`; the time the load may return (0: off). */
double smoe_link_reserve(smoe_link *l, uint64_t bytes);

/* Sleep until smoe_now() >= until (no-op for 0). */
void smoe_link_wait(double until);

#endif
