/* exp(x) for x <= 0 for the project's C kernels (runner/native.py puts runner/ on the
 * include path and hashes this header into every library's name). */
#ifndef SPECBUDGET_EXP_NONPOSITIVE_H
#define SPECBUDGET_EXP_NONPOSITIVE_H
#include <math.h>
#include <stdint.h>
#include <string.h>

/* exp(x) for x <= 0 (a value less its row's maximum): Cody-Waite reduction and the
 * Cephes polynomial, ~1 ulp; only IEEE basic operations, so it vectorises and gives
 * the same bits in vector and scalar code. */
static inline float exp_nonpositive(float x) {
    x = x > -87.0f ? x : -87.0f;
    /* round to nearest by the 1.5 * 2^23 trick: floorf does not vectorise here */
    float n = (x * 1.44269504088896341f + 12582912.0f) - 12582912.0f;
    float r = fmaf(n, -0.693359375f, x);
    r = fmaf(n, 2.12194440e-4f, r);
    float z = r * r;
    float y = 1.9875691500e-4f;
    y = fmaf(y, r, 1.3981999507e-3f);
    y = fmaf(y, r, 8.3334519073e-3f);
    y = fmaf(y, r, 4.1665795894e-2f);
    y = fmaf(y, r, 1.6666665459e-1f);
    y = fmaf(y, r, 5.0000001201e-1f);
    y = fmaf(y, z, r + 1.0f);
    int32_t e = (int32_t)n + 127;
    uint32_t bits = (uint32_t)e << 23;
    float s;
    memcpy(&s, &bits, 4);
    return y * s;
}
#endif
