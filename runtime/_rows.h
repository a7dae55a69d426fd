/* What the two halves of the extension module tfps.runtime._rows share: runtime/_rows.c (the
   kernels: optimizer updates, row checks and copies, bfloat16 casts, the worker's id numbering and
   row sums, and the module itself) and runtime/_rows_wire.c (the wire: a request's header read and
   its tensors checked, a message framed, an async push applied and answered). */
#ifndef TFPS_ROWS_H
#define TFPS_ROWS_H

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

/* The platform the kernels and the wire are written for: a message's integers are read with memcpy
   in the machine's byte order and its tensors used in place, so the machine must be the wire's. */
#if !defined(__BYTE_ORDER__) || __BYTE_ORDER__ != __ORDER_LITTLE_ENDIAN__
#error "tfps.runtime._rows reads the wire's little-endian integers and tensors in place: a little-endian machine only"
#endif
_Static_assert(sizeof(Py_ssize_t) == 8 && sizeof(size_t) == 8, "a 64-bit Py_ssize_t and size_t");
_Static_assert(sizeof(long long) == 8 && sizeof(int64_t) == 8, "long long is int64");
_Static_assert(sizeof(float) == 4 && sizeof(uint32_t) == 4, "float is 32 bits");
_Static_assert(__FLT_MANT_DIG__ == 24 && __FLT_MAX_EXP__ == 128, "float is IEEE 754 binary32");

/* The float loops are built for AVX2 and for the baseline (SSE2), and the loader picks the one the
   CPU runs (GCC's function multiversioning), since the package is built once for every machine it
   goes to. Square roots and divisions are correctly rounded at any vector width and no
   multiply-add is fused: both give the same bits. */
#if defined(__x86_64__) && defined(__has_attribute)
#if __has_attribute(target_clones)
#define SIMD __attribute__((target_clones("avx2", "default")))
#endif
#endif
#ifndef SIMD
#define SIMD
#endif
#define EXPONENT 0x7f800000u /* a float32's exponent bits */

/* 1 when x is a NaN or an Inf (its exponent bits all set); written so that loops vectorise. */
static inline uint32_t nonfinite(float x) {
    uint32_t u;
    memcpy(&u, &x, sizeof u);
    return (u & EXPONENT) == EXPONENT;
}

/* 1 when none of the n floats is a NaN or an Inf. Not inlined: a loop of its own vectorises. In
   the header, so that each file calls its own build of it: a call through the other file costs a
   request's parse measurably. */
__attribute__((noinline, unused)) static SIMD int finite_floats(const float *restrict x, Py_ssize_t n) {
    uint32_t bad = 0;
    for (Py_ssize_t i = 0; i < n; i++) bad |= nonfinite(x[i]);
    return !bad;
}

/* Not exported from the module's shared object: the two files' own interface. */
#define INTERNAL __attribute__((visibility("hidden")))

/* The wire's limits (runtime/wire.py's ALIGN, MAX_HEADER_BYTES, MAX_TENSORS, MAX_DIMS): a message
   past one is refused by wire.py, and the C readers leave it to wire.py to say so. */
#define WIRE_ALIGN 64
#define WIRE_MAX_HEADER_BYTES (4 << 20)
#define WIRE_MAX_TENSORS 65536
#define WIRE_MAX_DIMS 32

/* The module's state: what it uses of NumPy and the header's JSON parser, set once by its exec slot
   before any of its functions can run, and read only after. */
typedef struct {
    PyObject *ndarray, *float32, *int64, *empty, *empty_like;
    PyObject *json_loads; /* orjson.loads; NULL without orjson (the readers then decline every message) */
} State;

static inline State *state_of(PyObject *module) { return (State *)PyModule_GetState(module); }

/* A buffer held from the checks until the work is done. */
typedef struct {
    Py_buffer view;
    int held;
} Buf;

INTERNAL void release(Buf *bufs, int n);
INTERNAL int get(PyObject *obj, Buf *b, const char *fmt, int ndim, int writable, const char *what);
INTERNAL int overlap(const Buf *x, const Buf *y);

/* 1 when the k rows are all inside 0..n-1; *increasing: whether they are strictly increasing.
   Here, inline, for both files: a request's rows are checked with it in the request's own pass. */
static inline int scan_rows(const int64_t *r, Py_ssize_t k, long long n, int *increasing) {
    int inside = 1, up = 1;
    int64_t prev = -1;
    for (Py_ssize_t i = 0; i < k; i++) {
        inside &= (r[i] >= 0) & (r[i] < n);
        up &= r[i] > prev;
        prev = r[i];
    }
    *increasing = up;
    return inside;
}

/* An update of a table's rows: the table (n x d, written), up to two slots of its shape (written),
   k rows (each at most once) and their gradients (k x d). */
typedef struct {
    float *var, *s1, *s2;
    const float *grad;
    const int64_t *rows;
    Py_ssize_t k, d;
} Rows;

#define NBUFS 5

/* One table's update: its buffers, held from the checks until the update is done. */
typedef struct {
    Buf bufs[NBUFS];
    Rows r;
} RowJob;

INTERNAL int optimizer_slots(int opt, PyObject *slots, const char *what);
INTERNAL int row_job(PyObject *slot_names, PyObject *var, PyObject *mine, PyObject *rows, PyObject *grad, RowJob *job);
INTERNAL void rows_update(int opt, Rows r, const float *h);
INTERNAL int dense_part(const State *st, int opt, const float *h, PyObject *slot_names, PyObject *var, PyObject *mine,
                        PyObject *grad, PyObject *plus, float scale, PyObject **out, PyObject **fresh);
INTERNAL PyObject *gathered(const State *st, PyObject *table, PyObject *rows);

/* The wire's functions of the module (runtime/_rows_wire.c). */
INTERNAL PyObject *read_header(PyObject *module, PyObject *args);
INTERNAL PyObject *parse_request(PyObject *module, PyObject *args);
INTERNAL PyObject *encode_message(PyObject *module, PyObject *args);
INTERNAL PyObject *apply_async(PyObject *module, PyObject *args);

#endif
