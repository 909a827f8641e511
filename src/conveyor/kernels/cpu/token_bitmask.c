/* Structured outputs: a packed token bitmask (llguidance's layout) applied to logits in
 * place. Built apart from the other kernels and without -ffast-math: it writes -inf,
 * which -ffinite-math-only lets the compiler assume never happens. */
#include <stdint.h>
#include <math.h>

/* logits: float32 rows of `stride` floats, `vocab` of them scored; mask: `nrows` rows of
 * `words` int32 words; mask row r applies to logits row rows[r]. Bit i of word j allows
 * token 32 j + i; every token its row does not allow (any past 32 words too) becomes
 * -inf. A word of all ones (the common case of a free span) costs one compare. */
int apply_token_bitmask_f32(float *logits, int64_t stride, int vocab, const int32_t *mask,
                            int words, const int64_t *rows, int nrows)
{
    const float ninf = -INFINITY;
    for (int r = 0; r < nrows; r++) {
        float *l = logits + rows[r] * stride;
        const uint32_t *m = (const uint32_t *)(mask + (int64_t)r * words);
        int covered = 32 * words < vocab ? 32 * words : vocab;
        for (int j = 0; 32 * j < covered; j++) {
            uint32_t w = m[j];
            if (w == 0xFFFFFFFFu)
                continue;
            int base = 32 * j;
            int end = base + 32 < covered ? base + 32 : covered;
            if (w == 0) {
                for (int t = base; t < end; t++)
                    l[t] = ninf;
                continue;
            }
            for (uint32_t banned = ~w; banned; banned &= banned - 1) {
                int t = base + __builtin_ctz(banned);
                if (t >= end)
                    break;
                l[t] = ninf;
            }
        }
        for (int t = covered; t < vocab; t++)
            l[t] = ninf;
    }
    return 0;
}
