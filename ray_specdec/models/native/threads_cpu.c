/* The OS thread ids of the calling thread's OpenMP team: which threads run torch's parallel work for it (torch and
 * these kernels share one libgomp in a process; native/__init__.py checks that before trusting the answer). Used to
 * keep a serving process's other threads below them (ray_specdec/serving/thread_priority.py). */
#include <stdint.h>
#if defined(__linux__)
#include <sys/syscall.h>
#include <unistd.h>
#endif
#ifdef _OPENMP
#include <omp.h>
#endif

static int64_t this_thread_id(void) {
#if defined(__linux__)
    return (int64_t)syscall(SYS_gettid);
#else
    return -1;
#endif
}

/* out[i] = the id of the team's thread i for a team of up to `threads`; returns the team's size (at most
 * `threads`), the caller's own id in out[0]. */
int omp_team_thread_ids(int threads, int64_t *out) {
    int size = 1;
#ifdef _OPENMP
#pragma omp parallel num_threads(threads)
    {
        out[omp_get_thread_num()] = this_thread_id();
        if (omp_get_thread_num() == 0) size = omp_get_num_threads();
    }
#else
    (void)threads;
    out[0] = this_thread_id();
#endif
    return size;
}
