/* The emulated link of a cache's loads (link.h). */
#include "link.h"

#include <math.h>
#include <string.h>
#include <time.h>

int smoe_link_init(smoe_link *l, smoe_err *err) {
    memset(l, 0, sizeof *l);
    if (pthread_mutex_init(&l->mu, NULL) != 0)
        return smoe_err_set(err, SMOE_ENOMEM, "link emulation: mutex init failed");
    return SMOE_OK;
}

void smoe_link_free(smoe_link *l) { pthread_mutex_destroy(&l->mu); }

int smoe_link_set(smoe_link *l, double bytes_per_s, double latency_s, smoe_err *err) {
    if (!isfinite(bytes_per_s) || !isfinite(latency_s) || bytes_per_s < 0.0 || latency_s < 0.0)
        return smoe_err_set(err, SMOE_EINVAL,
                            "throttle: bandwidth and latency must be finite and >= 0 (got %g "
                            "bytes/s, %g s)", bytes_per_s, latency_s);
    pthread_mutex_lock(&l->mu);
    l->bw = bytes_per_s;
    l->lat_s = latency_s;
    l->free_s = 0.0;
    pthread_mutex_unlock(&l->mu);
    return SMOE_OK;
}

double smoe_link_reserve(smoe_link *l, uint64_t bytes) {
    pthread_mutex_lock(&l->mu);
    double until = 0.0;
    if (l->bw > 0.0 || l->lat_s > 0.0) {
        double now = smoe_now();
        double start = l->free_s > now ? l->free_s : now;
        double dur = l->lat_s;
        if (l->bw > 0.0) dur += (double)bytes / l->bw;
        l->free_s = until = start + dur;
    }
    pthread_mutex_unlock(&l->mu);
    return until;
}

void smoe_link_wait(double until) {
    if (until <= 0.0) return;
    for (;;) {
        double left = until - smoe_now();
        if (left <= 0.0) return;
        struct timespec ts;
        ts.tv_sec = (time_t)left;
        ts.tv_nsec = (long)((left - (double)ts.tv_sec) * 1e9);
        if (ts.tv_nsec >= 1000000000L) ts.tv_nsec = 999999999L;
        nanosleep(&ts, NULL);
    }
}
