/* The 8-bit dynamic format of muonscale.block_quantization as one pass over each block, on
 * CPU. Same function as the torch path there, bit for bit: the same float32 operations
 * (|x|, max, one division, one multiplication; no contraction, no reassociation) and the same
 * integer code arithmetic. Row-major contiguous (rows, cols) matrices; blocks are segments of
 * `block` entries of one row, the last block of a row possibly shorter. Built by
 * muonscale/kernels/cpu_quantization.py with -O3 -ffp-contract=off; no Python or torch
 * headers. */

#include <math.h>
#include <stdint.h>
#include <string.h>

#if defined(__GNUC__) && !defined(__clang__) && defined(__x86_64__)
#define MUONSCALE_CLONES __attribute__((target_clones("avx512f", "avx2", "default")))
#else
#define MUONSCALE_CLONES
#endif

/* Per block: absmax = max |x| (NaN if any entry is NaN, as torch's amax); each entry's code
 * from the bits b of y = x / s (s = absmax, or 1 where absmax is not > 0): the bucket
 * h = (b >> 16) & 0x7fff, code = ((r[h] + b) >> 16) mod 256, complemented (xor 0xff) where
 * y < 0 in the signed format. `r` is the 32768-entry int32 bucket table. */
MUONSCALE_CLONES
void muonscale_quantize_dynamic(const float *restrict x, uint8_t *restrict codes,
                                float *restrict absmax, int64_t rows, int64_t cols, int64_t block,
                                const int32_t *restrict r, int is_signed) {
    const int64_t blocks = (cols + block - 1) / block;
    const uint32_t complement = is_signed ? 0xffu : 0u;
    for (int64_t i = 0; i < rows; i++) {
        const float *restrict row = x + i * cols;
        uint8_t *restrict row_codes = codes + i * cols;
        for (int64_t k = 0; k < blocks; k++) {
            const int64_t start = k * block;
            const int64_t stop = start + block < cols ? start + block : cols;
            /* max |x| on the bits: a non-negative float's order is its bits' order, and any
               NaN's magnitude bits exceed infinity's */
            uint32_t top = 0;
            for (int64_t j = start; j < stop; j++) {
                uint32_t b;
                memcpy(&b, row + j, sizeof b);
                b &= 0x7fffffffu;
                top = b > top ? b : top;
            }
            float m;
            memcpy(&m, &top, sizeof m);
            if (top > 0x7f800000u) m = NAN;
            absmax[i * blocks + k] = m;
            const float s = m > 0.0f ? m : 1.0f;
            for (int64_t j = start; j < stop; j++) {
                const float y = row[j] / s;
                uint32_t b;
                memcpy(&b, &y, sizeof b);
                uint32_t code = ((uint32_t)r[(b >> 16) & 0x7fffu] + b) >> 16;
                code ^= complement & (0u - (b >> 31));
                row_codes[j] = (uint8_t)code;
            }
        }
    }
}

/* out = table[code] * absmax of the entry's block, float32. */
MUONSCALE_CLONES
void muonscale_dequantize_dynamic(const uint8_t *restrict codes, const float *restrict absmax,
                                  float *restrict out, int64_t rows, int64_t cols,
                                  int64_t block, const float *restrict table) {
    const int64_t blocks = (cols + block - 1) / block;
    for (int64_t i = 0; i < rows; i++) {
        const uint8_t *restrict row_codes = codes + i * cols;
        float *restrict row_out = out + i * cols;
        for (int64_t k = 0; k < blocks; k++) {
            const int64_t start = k * block;
            const int64_t stop = start + block < cols ? start + block : cols;
            const float s = absmax[i * blocks + k];
            for (int64_t j = start; j < stop; j++) row_out[j] = table[row_codes[j]] * s;
        }
    }
}
