/* Keyed uniforms of coupled sampling (speculation/coupled.py `keyed_rows`), the same bits as its torch path.
 *
 * Row r of the output holds, for every token x < vocab, the uniform u(seed, choice, position, x) in (0, 1): 52 bits
 * of Philox-4x32-10 (Salmon et al., 2011) for the counter (x / 2, position, choice low, choice high) under the key
 * (seed low, seed high), words (0, 1) for an even x and (2, 3) for an odd one, 26 bits of each, as (m + 0.5) / 2^52.
 * Every step is integer arithmetic but the last, which is exact in double ((m + 0.5) fits 53 bits; the power-of-two
 * scale is exact), so no compiler flag can change a bit. The loop over a row's counters has no dependence between
 * iterations: the compiler vectorises it (32 x 32 -> 64-bit products are one instruction on AVX2 and AVX-512). */
#include <stdint.h>

#define PHILOX_M0 0xD2511F53u
#define PHILOX_M1 0xCD9E8D57u
#define PHILOX_W0 0x9E3779B9u
#define PHILOX_W1 0xBB67AE85u
#define PHILOX_ROUNDS 10

static inline double unit52(uint32_t high, uint32_t low) {
    uint64_t m = ((uint64_t)(high >> 6) << 26) | (uint64_t)(low >> 6);
    return ((double)m + 0.5) * 0x1p-52;
}

/* keys: rows x (seed, choice, position), seed and choice in [0, 2^63), position in [0, 2^32) (checked by the
 * caller); out: rows x vocab doubles. One thread: a step's noise (tens of rows of a few thousand pairs) takes about a
 * millisecond, and a second thread competing for the cores with the step's other work cost more than it saved. */
void keyed_uniforms(const int64_t *keys, int64_t rows, int64_t vocab, double *out) {
    const int64_t pairs = vocab / 2;
    for (int64_t r = 0; r < rows; r++) {
        const uint64_t seed = (uint64_t)keys[3 * r], choice = (uint64_t)keys[3 * r + 1];
        const uint32_t k0 = (uint32_t)seed, k1 = (uint32_t)(seed >> 32);
        const uint32_t position = (uint32_t)keys[3 * r + 2];
        const uint32_t choice_low = (uint32_t)choice, choice_high = (uint32_t)(choice >> 32);
        double *row = out + r * vocab;
        for (int64_t j = 0; j < pairs + (vocab & 1); j++) {
            uint32_t c0 = (uint32_t)j, c1 = position, c2 = choice_low, c3 = choice_high;
            uint32_t key0 = k0, key1 = k1;
            for (int round = 0; round < PHILOX_ROUNDS; round++) {
                if (round) {
                    key0 += PHILOX_W0;
                    key1 += PHILOX_W1;
                }
                const uint64_t p0 = (uint64_t)PHILOX_M0 * c0, p1 = (uint64_t)PHILOX_M1 * c2;
                const uint32_t hi0 = (uint32_t)(p0 >> 32), lo0 = (uint32_t)p0;
                const uint32_t hi1 = (uint32_t)(p1 >> 32), lo1 = (uint32_t)p1;
                c0 = hi1 ^ c1 ^ key0;
                c1 = lo1;
                c2 = hi0 ^ c3 ^ key1;
                c3 = lo0;
            }
            row[2 * j] = unit52(c0, c1);
            if (j < pairs) row[2 * j + 1] = unit52(c2, c3);
        }
    }
}
