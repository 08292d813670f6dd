// dtype.c: element types, tensor-view helpers, and the IEEE half / bfloat16
// conversions (round to nearest even, NaN kept quiet).
#include <math.h>
#include <string.h>

#include "internal.h"

static const struct {
    const char *name;
    size_t size;
} g_dtypes[MHA_DTYPE_COUNT] = {
    [MHA_F32] = {"F32", 4},   [MHA_F16] = {"F16", 2}, [MHA_BF16] = {"BF16", 2},
    [MHA_BOOL] = {"BOOL", 1}, [MHA_I64] = {"I64", 8}, [MHA_I32] = {"I32", 4},
    [MHA_U8] = {"U8", 1},     [MHA_F64] = {"F64", 8},
};

size_t mha_dtype_size(mha_dtype t) {
    return ((unsigned)t < MHA_DTYPE_COUNT) ? g_dtypes[t].size : 0;
}

const char *mha_dtype_name(mha_dtype t) {
    return ((unsigned)t < MHA_DTYPE_COUNT) ? g_dtypes[t].name : "INVALID";
}

mha_status mha_dtype_from_name(mha_dtype *out, const char *name) {
    if (!out || !name)
        return mha__fail(MHA_ERR_INVALID_ARG, "mha_dtype_from_name: NULL argument");
    for (int i = 0; i < MHA_DTYPE_COUNT; i++) {
        if (strcmp(name, g_dtypes[i].name) == 0) {
            *out = (mha_dtype)i;
            return MHA_OK;
        }
    }
    return mha__fail(MHA_ERR_UNSUPPORTED, "unknown dtype \"%.64s\"", name);
}

mha_tensor mha_tensor_contiguous(void *data, mha_dtype dtype, int ndim, const int64_t *shape) {
    mha_tensor t;
    memset(&t, 0, sizeof t);
    t.data = data;
    t.dtype = dtype;
    if (ndim < 0) ndim = 0;
    if (ndim > MHA_MAX_DIMS) ndim = MHA_MAX_DIMS;
    t.ndim = ndim;
    int64_t s = 1;
    for (int i = ndim - 1; i >= 0; i--) {
        t.shape[i] = shape[i];
        t.stride[i] = s;
        s *= shape[i] > 0 ? shape[i] : 1;
    }
    return t;
}

int64_t mha_tensor_numel(const mha_tensor *t) {
    int64_t n = 1;
    for (int i = 0; i < t->ndim; i++) n *= t->shape[i];
    return n;
}

static uint32_t f32_bits(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    return u;
}

static float bits_f32(uint32_t u) {
    float f;
    memcpy(&f, &u, 4);
    return f;
}

float mha_f16_to_f32(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000) << 16;
    uint32_t exp = (h >> 10) & 0x1f;
    uint32_t man = h & 0x3ff;
    if (exp == 0x1f) return bits_f32(sign | 0x7f800000u | (man << 13));
    if (exp == 0) {
        // subnormal (or zero): man * 2^-24
        float v = (float)man * 0x1p-24f;
        return sign ? -v : v;
    }
    return bits_f32(sign | ((exp + 112) << 23) | (man << 13));
}

uint16_t mha_f32_to_f16(float f) {
    uint32_t u = f32_bits(f);
    uint16_t sign = (uint16_t)((u >> 16) & 0x8000);
    uint32_t a = u & 0x7fffffffu;
    if (a >= 0x7f800000u)  // inf or NaN
        return (uint16_t)(sign | 0x7c00 | (a > 0x7f800000u ? 0x200 : 0));
    if (a >= 0x477ff000u) return (uint16_t)(sign | 0x7c00);  // rounds to inf
    if (a < 0x38800000u) {
        // result is subnormal or zero: round |f| * 2^24 to nearest even
        float v = bits_f32(a) * 0x1p24f;
        float r = nearbyintf(v);  // default rounding mode: ties to even
        return (uint16_t)(sign | (uint16_t)r);
    }
    uint32_t exp = (a >> 23) - 112;
    uint32_t man = a & 0x7fffff;
    uint32_t h = (exp << 10) | (man >> 13);
    uint32_t rest = man & 0x1fff;
    if (rest > 0x1000 || (rest == 0x1000 && (h & 1))) h++;
    return (uint16_t)(sign | h);
}

float mha_bf16_to_f32(uint16_t h) { return bits_f32((uint32_t)h << 16); }

uint16_t mha_f32_to_bf16(float f) {
    uint32_t u = f32_bits(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40);
    u += 0x7fff + ((u >> 16) & 1);
    return (uint16_t)(u >> 16);
}
