/* A PS's update kernels: the checks of a request's rows and gradients (inside the table; free of
   NaN and Inf), the optimizer updates of the embedding rows it touches and of the dense parts,
   each one pass in C; a worker's two: its batch's table ids numbered by the distinct ones, and the
   sum of its batch's gradients per table row; the bfloat16 casts of the wire; and the module
   itself. The wire's half (a request parsed, a message framed, an async push answered) is
   runtime/_rows_wire.c; what both share is runtime/_rows.h.

   NumPy would make an update of k rows a gather, several whole-array passes and a scatter, with a
   return to the interpreter between each; here each update is one pass, and the row loops ask for
   the rows a few iterations ahead, as the rows lie scattered over a large table.

   Each float operation is the textbook rule's, in the same order for rows and dense arrays
   (built with -ffp-contract=off: no fused multiply-add), so a row comes out bit for bit as a
   dense update would leave it. The arguments are any C-contiguous buffers (NumPy arrays) whose
   items are aligned: tables and row gradients float32 and 2-D, rows int64 and 1-D, dense arrays
   float32 of any shape; each entry point checks them (`get`) and its own preconditions before it
   reads one, so that no argument can make it read or write outside them. */
#include "_rows.h"

#include <limits.h>
#include <math.h>
#include <string.h>

#define AHEAD 8 /* rows prefetched ahead of the one being updated */
#define LARGE (1 << 16) /* floats: a pass over more lets other threads run meanwhile */

/* The float loops run with subnormal floats taken as zero, in and out (x86's FTZ and DAZ, ARM's
   FZ), as TensorFlow's CPU threads run its kernels, and restore the thread's setting after: a slot
   that decays towards zero would otherwise spend steps in the subnormal range, where each
   operation takes a slow microcode assist. */
#if defined(__x86_64__) || defined(__i386__)
#include <xmmintrin.h>
typedef unsigned int FpMode;
#define FLUSH_BITS 0x8040u /* MXCSR: FTZ (bit 15), DAZ (bit 6) */
static inline FpMode flush_subnormals(void) {
    FpMode old = _mm_getcsr();
    _mm_setcsr(old | FLUSH_BITS);
    return old;
}
static inline void restore_fp(FpMode old) { _mm_setcsr(old); }
#elif defined(__aarch64__)
typedef uint64_t FpMode;
static inline FpMode flush_subnormals(void) {
    FpMode old;
    __asm__ volatile("mrs %0, fpcr" : "=r"(old));
    __asm__ volatile("msr fpcr, %0" : : "r"(old | (1ull << 24))); /* FZ */
    return old;
}
static inline void restore_fp(FpMode old) { __asm__ volatile("msr fpcr, %0" : : "r"(old)); }
#else
typedef int FpMode;
static inline FpMode flush_subnormals(void) { return 0; }
static inline void restore_fp(FpMode old) { (void)old; }
#endif

void release(Buf *bufs, int n) {
    for (int i = 0; i < n; i++)
        if (bufs[i].held) {
            PyBuffer_Release(&bufs[i].view);
            bufs[i].held = 0;
        }
}

/* The NumPy name of the struct format `f` ("f", "q" or "H"). */
static const char *type_name(char f) { return f == 'f' ? "float32" : f == 'H' ? "uint16" : "int64"; }

/* `obj` as a C-contiguous buffer of `ndim` dimensions (any: -1) whose items have one of the (one or
   two) struct formats in `fmt` ("f": float32, "q": int64, "H": uint16), whose size is its shape's
   and whose first item is aligned for its type; -1 with a TypeError or a ValueError when it is not
   (the caller releases b either way). */
int get(PyObject *obj, Buf *b, const char *fmt, int ndim, int writable, const char *what) {
    int flags = PyBUF_C_CONTIGUOUS | PyBUF_FORMAT | (writable ? PyBUF_WRITABLE : 0);
    if (PyObject_GetBuffer(obj, &b->view, flags) < 0) return -1;
    b->held = 1;
    const char *f = b->view.format ? b->view.format : "B";
    if (*f == '<' || *f == '=' || *f == '@') f++;
    int same = (f[0] && !f[1] && strchr(fmt, f[0])) || (strchr(fmt, 'q') && strcmp(f, "l") == 0 && sizeof(long) == 8);
    if (!same || (ndim >= 0 && b->view.ndim != ndim)) {
        const char *type = type_name(fmt[0]), *sep = fmt[1] ? " or " : "", *other = fmt[1] ? type_name(fmt[1]) : "";
        if (ndim < 0)
            PyErr_Format(PyExc_TypeError, "%s: expected an array of %s%s%s, got format '%s'", what, type, sep, other, f);
        else
            PyErr_Format(PyExc_TypeError, "%s: expected a %d-D array of %s%s%s, got %d-D of format '%s'", what, ndim, type,
                         sep, other, b->view.ndim, f);
        return -1;
    }
    Py_ssize_t size = f[0] == 'f' ? 4 : f[0] == 'H' ? 2 : 8, items = 1;
    for (int i = 0; i < b->view.ndim; i++)
        if (b->view.shape[i] < 0 || __builtin_mul_overflow(items, b->view.shape[i], &items)) items = -1;
    Py_ssize_t nbytes;
    if (b->view.itemsize != size || items < 0 || __builtin_mul_overflow(items, size, &nbytes) || nbytes != b->view.len) {
        PyErr_Format(PyExc_ValueError, "%s: a buffer whose size is not its shape's", what);
        return -1;
    }
    if ((uintptr_t)b->view.buf % (uintptr_t)size) {
        PyErr_Format(PyExc_ValueError, "%s: its %zd-byte items are not aligned in memory", what, size);
        return -1;
    }
    return 0;
}

/* check_rows(rows, n) -> True when the rows are strictly increasing (sorted, none repeated);
   ValueError when one is outside 0..n-1 (n >= 0). */
static PyObject *check_rows(PyObject *Py_UNUSED(module), PyObject *args) {
    PyObject *obj;
    long long n;
    if (!PyArg_ParseTuple(args, "OL", &obj, &n)) return NULL;
    if (n < 0) {
        PyErr_Format(PyExc_ValueError, "check_rows: a table of %lld rows", n);
        return NULL;
    }
    Buf b = {0};
    if (get(obj, &b, "q", 1, 0, "rows") < 0) {
        release(&b, 1);
        return NULL;
    }
    int increasing;
    int inside = scan_rows(b.view.buf, b.view.shape[0], n, &increasing);
    release(&b, 1);
    if (!inside) {
        PyErr_Format(PyExc_ValueError, "row index outside 0..%lld", n - 1);
        return NULL;
    }
    return PyBool_FromLong(increasing);
}

/* 0 when every one of the k rows is inside a table of n rows; -1 with a ValueError naming the
   first that is not. */
static int rows_inside(const int64_t *r, Py_ssize_t k, Py_ssize_t n) {
    for (Py_ssize_t i = 0; i < k; i++)
        if (r[i] < 0 || r[i] >= n) {
            PyErr_Format(PyExc_ValueError, "row %lld is outside the table's %zd rows", (long long)r[i], n);
            return -1;
        }
    return 0;
}

/* Whether two buffers share any byte (the kernels take their arrays as restrict pointers). */
int overlap(const Buf *x, const Buf *y) {
    return (const char *)x->view.buf < (const char *)y->view.buf + y->view.len &&
           (const char *)y->view.buf < (const char *)x->view.buf + x->view.len;
}

/* An update's arguments into bufs and *out: the table, its rows and their gradients, and up to two
   slots of the table's shape; -1 with an error set (the caller releases bufs either way). */
static int unpack(PyObject *var, PyObject *s1, PyObject *s2, PyObject *rows, PyObject *grad, Buf *bufs, Rows *out) {
    if (get(var, &bufs[0], "f", 2, 1, "table") < 0 || get(rows, &bufs[1], "q", 1, 0, "rows") < 0 ||
        get(grad, &bufs[2], "f", 2, 0, "gradient") < 0 || (s1 && get(s1, &bufs[3], "f", 2, 1, "slot") < 0) ||
        (s2 && get(s2, &bufs[4], "f", 2, 1, "slot") < 0))
        return -1;
    const Py_ssize_t *shape = bufs[0].view.shape, *gshape = bufs[2].view.shape;
    Py_ssize_t k = bufs[1].view.shape[0];
    if (gshape[0] != k || gshape[1] != shape[1]) {
        PyErr_Format(PyExc_ValueError, "gradient of shape [%zd, %zd] for %zd rows of width %zd", gshape[0], gshape[1], k,
                     shape[1]);
        return -1;
    }
    for (int i = 3; i < NBUFS; i++)
        if (bufs[i].held && (bufs[i].view.shape[0] != shape[0] || bufs[i].view.shape[1] != shape[1])) {
            PyErr_SetString(PyExc_ValueError, "a slot's shape differs from its table's");
            return -1;
        }
    static const char *what[NBUFS] = {"the table", "the rows", "the gradient", "a slot", "another slot"};
    for (int i = 0; i < NBUFS; i++) /* the loop's restrict pointers: no array overlaps another */
        for (int j = i + 1; j < NBUFS; j++)
            if (bufs[i].held && bufs[j].held && overlap(&bufs[i], &bufs[j])) {
                PyErr_Format(PyExc_ValueError, "%s overlaps %s", what[i], what[j]);
                return -1;
            }
    const int64_t *r = bufs[1].view.buf;
    if (rows_inside(r, k, shape[0]) < 0) return -1;
    *out = (Rows){bufs[0].view.buf, s1 ? bufs[3].view.buf : NULL, s2 ? bufs[4].view.buf : NULL, bufs[2].view.buf, r, k,
                  shape[1]};
    return 0;
}

#define ROW(array, i) ((array) + (Py_ssize_t)r.rows[i] * r.d)
#define GRAD(i) (r.grad + (i) * r.d)

static inline void prefetch_row(const float *row, Py_ssize_t d) {
    for (Py_ssize_t j = 0; j < d; j += 64 / sizeof(float)) __builtin_prefetch(row + j, 1, 0);
}

#define PREFETCH(array, i)                                           \
    do {                                                             \
        if ((array) && (i) + AHEAD < r.k) prefetch_row(ROW(array, (i) + AHEAD), r.d); \
    } while (0)

/* The loop every update shares: for each row i, `call` with w (the table's row), a and b (the
   slots' rows, or NULL) and g (its gradient), the GIL released. Each update's work on one row is
   a function of its own, whose restrict arguments let the compiler vectorise it. */
#define FOR_EACH_ROW(call)                                                        \
    Py_BEGIN_ALLOW_THREADS FpMode fp = flush_subnormals();                        \
    for (Py_ssize_t i = 0; i < r.k; i++) {                                        \
        PREFETCH(r.var, i);                                                       \
        PREFETCH(r.s1, i);                                                        \
        PREFETCH(r.s2, i);                                                        \
        float *w = ROW(r.var, i), *a = r.s1 ? ROW(r.s1, i) : NULL, *b = r.s2 ? ROW(r.s2, i) : NULL; \
        const float *g = GRAD(i);                                                 \
        (void)a;                                                                  \
        (void)b;                                                                  \
        call;                                                                     \
    }                                                                             \
    restore_fp(fp);                                                               \
    Py_END_ALLOW_THREADS

typedef float *restrict Out;
typedef const float *restrict In;

static inline void sgd_row(Out w, In g, Py_ssize_t d, float lr) {
    for (Py_ssize_t j = 0; j < d; j++) w[j] -= g[j] * lr;
}

static inline void momentum_row(Out w, Out a, In g, Py_ssize_t d, float lr, float mu) {
    for (Py_ssize_t j = 0; j < d; j++) {
        a[j] = a[j] * mu + g[j];
        w[j] -= a[j] * lr;
    }
}

static inline void adam_row(Out w, Out a, Out b, In g, Py_ssize_t d, float b1, float b2, float rate, float eps) {
    const float c1 = 1 - b1, c2 = 1 - b2;
    for (Py_ssize_t j = 0; j < d; j++) {
        a[j] = a[j] * b1 + g[j] * c1;
        b[j] = b[j] * b2 + g[j] * g[j] * c2;
        w[j] -= a[j] / (sqrtf(b[j]) + eps) * rate;
    }
}

static inline void adagrad_row(Out w, Out a, In g, Py_ssize_t d, float lr, float eps) {
    for (Py_ssize_t j = 0; j < d; j++) {
        a[j] = g[j] * g[j] + a[j];
        w[j] -= g[j] / (sqrtf(a[j]) + eps) * lr;
    }
}

/* Each update over a request's rows (FOR_EACH_ROW), built for each instruction set (SIMD):
   SGD w -= g*lr; momentum a = a*mu + g, w -= a*lr; Adam, rate = lr*sqrt(1-b2^t)/(1-b1^t),
   m = m*b1 + g*(1-b1), v = v*b2 + g²*(1-b2), w -= m/(sqrt(v)+eps)*rate; Adagrad a = g² + a,
   w -= g/(sqrt(a)+eps)*lr. */
static SIMD void sgd_rows(Rows r, float lr) { FOR_EACH_ROW(sgd_row(w, g, r.d, lr)); }
static SIMD void momentum_rows(Rows r, float lr, float mu) { FOR_EACH_ROW(momentum_row(w, a, g, r.d, lr, mu)); }
static SIMD void adam_rows(Rows r, float b1, float b2, float rate, float eps) { FOR_EACH_ROW(adam_row(w, a, b, g, r.d, b1, b2, rate, eps)); }
static SIMD void adagrad_rows(Rows r, float lr, float eps) { FOR_EACH_ROW(adagrad_row(w, a, g, r.d, lr, eps)); }

/* A dense update's arguments: n floats each of the variable, its slots (up to two) and the
   gradient, read; and of the new variable and new slots, written. A dense update leaves the
   arrays it is given as they were (a reply or a checkpoint may be reading them), so it writes
   its results to fresh arrays, in the same one pass. The gradient it applies is
   (grad + plus) * scale: a sync step's mean made in the same pass (the sum of the other
   workers' gradients, the last one's, 1/n), or grad * 1 when there is no `plus`. */
typedef struct {
    const float *var, *s1, *s2, *grad, *plus;
    float *out, *o1, *o2;
    Py_ssize_t n;
    float scale;
} Dense;

#define NDENSE 8
#define PLUS 7 /* objs[PLUS]: the optional second gradient */

/* objs: the variable, the gradient, the new variable, each slot and its new array, then the
   second gradient (NULL or None: none); nobjs counts those up to the last slot's. */
static int unpack_dense(PyObject **objs, int nobjs, Buf *bufs, Dense *d) {
    static const char *what[NDENSE] = {"variable", "gradient", "out", "slot", "slot out", "slot", "slot out", "second gradient"};
    static const int writable[NDENSE] = {0, 0, 1, 0, 1, 0, 1, 0};
    float *p[NDENSE] = {0};
    if (objs[PLUS] == Py_None) objs[PLUS] = NULL;
    for (int i = 0; i < NDENSE; i++) {
        if (i >= nobjs && !(i == PLUS && objs[PLUS])) continue;
        if (get(objs[i], &bufs[i], "f", -1, writable[i], what[i]) < 0) return -1;
        if (bufs[i].view.len != bufs[0].view.len) {
            PyErr_Format(PyExc_ValueError, "%s of %zd floats for a variable of %zd", what[i],
                         bufs[i].view.len / (Py_ssize_t)sizeof(float), bufs[0].view.len / (Py_ssize_t)sizeof(float));
            return -1;
        }
        p[i] = bufs[i].view.buf;
    }
    for (int i = 0; i < NDENSE; i++) /* the loop's restrict pointers: no out array overlaps another array */
        for (int k = 0; k < NDENSE; k++)
            if (writable[i] && bufs[i].held && bufs[k].held && k != i && overlap(&bufs[i], &bufs[k])) {
                PyErr_Format(PyExc_ValueError, "%s overlaps %s: a dense update writes to fresh arrays", what[i], what[k]);
                return -1;
            }
    *d = (Dense){p[0], p[3], p[5], p[1], p[PLUS], p[2], p[4], p[6], bufs[0].view.len / (Py_ssize_t)sizeof(float), d->scale};
    return 0;
}

/* Each dense loop is its row kernel's update (the same float operations), over every float,
   written to the out arrays; h holds the hyperparameters, in the Python call's order. */
#define DENSE_POINTERS                                                                          \
    const float *restrict w = d->var, *restrict g0 = d->grad, *restrict a1 = d->s1, *restrict a2 = d->s2; \
    const float *restrict g1 = d->plus, scale = d->scale;                                       \
    float *restrict out = d->out, *restrict n1 = d->o1, *restrict n2 = d->o2;                     \
    (void)a1, (void)a2, (void)n1, (void)n2

/* The dense loops touch up to eight arrays, more than GCC checks for overlap at run time, so
   without this it leaves Adam's loop scalar; unpack_dense has checked that no out array overlaps
   another array. */
#define IVDEP _Pragma("GCC ivdep")

/* The gradient of float j (the compiler makes one loop with `plus` and one without). */
#define G(j) ((g1 ? g0[j] + g1[j] : g0[j]) * scale)

/* Each dense loop ORs `nonfinite` over the gradient it applies, so that the check costs no pass
   of its own (the caller drops the new arrays of a non-finite one). */

static SIMD uint32_t sgd_loop(const Dense *d, const float *h) {
    const float lr = h[0];
    uint32_t bad = 0;
    DENSE_POINTERS;
    IVDEP for (Py_ssize_t j = 0; j < d->n; j++) {
        float g = G(j);
        bad |= nonfinite(g);
        out[j] = w[j] - g * lr;
    }
    return bad;
}

static SIMD uint32_t momentum_loop(const Dense *d, const float *h) {
    const float lr = h[0], mu = h[1];
    uint32_t bad = 0;
    DENSE_POINTERS;
    IVDEP for (Py_ssize_t j = 0; j < d->n; j++) {
        float g = G(j), acc = a1[j] * mu + g;
        bad |= nonfinite(g);
        n1[j] = acc;
        out[j] = w[j] - acc * lr;
    }
    return bad;
}

static SIMD uint32_t adam_loop(const Dense *d, const float *h) {
    const float b1 = h[0], b2 = h[1], rate = h[2], eps = h[3], c1 = 1 - b1, c2 = 1 - b2;
    uint32_t bad = 0;
    DENSE_POINTERS;
    IVDEP for (Py_ssize_t j = 0; j < d->n; j++) {
        float g = G(j), m = a1[j] * b1 + g * c1, v = a2[j] * b2 + g * g * c2;
        bad |= nonfinite(g);
        n1[j] = m;
        n2[j] = v;
        out[j] = w[j] - m / (sqrtf(v) + eps) * rate;
    }
    return bad;
}

static SIMD uint32_t adagrad_loop(const Dense *d, const float *h) {
    const float lr = h[0], eps = h[1];
    uint32_t bad = 0;
    DENSE_POINTERS;
    IVDEP for (Py_ssize_t j = 0; j < d->n; j++) {
        float g = G(j), acc = g * g + a1[j];
        bad |= nonfinite(g);
        n1[j] = acc;
        out[j] = w[j] - g / (sqrtf(acc) + eps) * lr;
    }
    return bad;
}

typedef uint32_t (*DenseLoop)(const Dense *, const float *);

/* One dense update: `loop` over the unpacked objs (unpack_dense's), the GIL released; 1 when the
   gradient was finite, 0 when not, -1 with an error set. */
static int dense_pass(PyObject **objs, int nobjs, DenseLoop loop, const float *h, float scale) {
    Buf bufs[NDENSE] = {0};
    Dense d = {.scale = scale};
    if (unpack_dense(objs, nobjs, bufs, &d) < 0) {
        release(bufs, NDENSE);
        return -1;
    }
    uint32_t bad;
    Py_BEGIN_ALLOW_THREADS FpMode fp = flush_subnormals();
    bad = loop(&d, h);
    restore_fp(fp);
    Py_END_ALLOW_THREADS
    release(bufs, NDENSE);
    return !bad;
}

/* The three arguments of take and segment_sum, into bufs: a 2-D float32 array (named `what`
   in errors), 1-D int64 rows (`rows_what`) and a writable 2-D float32 `out` that shares no memory
   with either; -1 with the error set (the caller releases bufs either way). */
static int rows_and_out(PyObject *args, Buf *bufs, const char *what, const char *rows_what) {
    PyObject *arr, *rows, *out;
    if (!PyArg_ParseTuple(args, "OOO", &arr, &rows, &out)) return -1;
    if (get(arr, &bufs[0], "f", 2, 0, what) < 0 || get(rows, &bufs[1], "q", 1, 0, rows_what) < 0 ||
        get(out, &bufs[2], "f", 2, 1, "out") < 0)
        return -1;
    if (overlap(&bufs[0], &bufs[2]) || overlap(&bufs[1], &bufs[2])) {
        PyErr_Format(PyExc_ValueError, "out shares memory with %s or %s", what, rows_what);
        return -1;
    }
    return 0;
}

/* o[i] = t[r[i]] for the k rows of width d (each inside t), each asked for AHEAD rows before it is
   copied, the GIL released. */
static void gather_rows(const float *t, const int64_t *r, Py_ssize_t k, Py_ssize_t d, float *o) {
    Py_BEGIN_ALLOW_THREADS for (Py_ssize_t i = 0; i < k; i++) {
        if (i + AHEAD < k)
            for (Py_ssize_t j = 0; j < d; j += 64 / sizeof(float)) __builtin_prefetch(t + r[i + AHEAD] * d + j, 0, 0);
        memcpy(o + i * d, t + r[i] * d, (size_t)d * sizeof(float));
    }
    Py_END_ALLOW_THREADS
}

/* take(table, rows, out): out[i] = table[rows[i]], the rows asked for ahead (a reply's rows), each
   inside the table. */
static PyObject *take(PyObject *Py_UNUSED(module), PyObject *args) {
    Buf bufs[3] = {0};
    if (rows_and_out(args, bufs, "table", "rows") < 0) goto fail;
    const float *t = bufs[0].view.buf;
    const int64_t *r = bufs[1].view.buf;
    float *o = bufs[2].view.buf;
    Py_ssize_t n = bufs[0].view.shape[0], d = bufs[0].view.shape[1], k = bufs[1].view.shape[0];
    if (bufs[2].view.shape[0] != k || bufs[2].view.shape[1] != d) {
        PyErr_Format(PyExc_ValueError, "out of shape [%zd, %zd] for %zd rows of width %zd", bufs[2].view.shape[0],
                     bufs[2].view.shape[1], k, d);
        goto fail;
    }
    if (rows_inside(r, k, n) < 0) goto fail;
    gather_rows(t, r, k, d, o);
    release(bufs, 3);
    Py_RETURN_NONE;
fail:
    release(bufs, 3);
    return NULL;
}

/* segment_sum(values, indices, out): out = 0, then out[indices[i]] += values[i] for i in order:
   a worker's gradient of a batch's table rows from TensorFlow's IndexedSlices, each row summed in
   the order TensorFlow's UnsortedSegmentSum adds them, so bit for bit its result. */
static SIMD void sum_rows(const float *v, const int64_t *r, Py_ssize_t k, Py_ssize_t d, float *o, Py_ssize_t n) {
    memset(o, 0, (size_t)n * (size_t)d * sizeof(float));
    for (Py_ssize_t i = 0; i < k; i++) {
        float *restrict row = o + r[i] * d;
        const float *restrict add = v + i * d;
        for (Py_ssize_t j = 0; j < d; j++) row[j] += add[j];
    }
}

static PyObject *segment_sum(PyObject *Py_UNUSED(module), PyObject *args) {
    Buf bufs[3] = {0};
    if (rows_and_out(args, bufs, "values", "indices") < 0) goto fail;
    const float *v = bufs[0].view.buf;
    const int64_t *r = bufs[1].view.buf;
    float *o = bufs[2].view.buf;
    Py_ssize_t k = bufs[0].view.shape[0], d = bufs[0].view.shape[1], n = bufs[2].view.shape[0];
    if (bufs[1].view.shape[0] != k || bufs[2].view.shape[1] != d) {
        PyErr_Format(PyExc_ValueError, "%zd indices and out of width %zd for %zd values of width %zd", bufs[1].view.shape[0],
                     bufs[2].view.shape[1], k, d);
        goto fail;
    }
    if (rows_inside(r, k, n) < 0) goto fail;
    Py_BEGIN_ALLOW_THREADS FpMode fp = flush_subnormals();
    sum_rows(v, r, k, d, o, n);
    restore_fp(fp);
    Py_END_ALLOW_THREADS
    release(bufs, 3);
    Py_RETURN_NONE;
fail:
    release(bufs, 3);
    return NULL;
}

/* unique(ids, uniq, inverse) -> k: the k distinct values of ids in increasing order in uniq[:k],
   and inverse[i] = where ids[i] is among them; NumPy's unique(ids, return_inverse=True), for a
   worker's batch of table ids. The ids go through a hash table, and only the distinct ones are
   sorted (NumPy sorts them all), by radix on the bytes in which they differ. */
#define EMPTY_SLOT (-1)
/* key[:k] sorted increasing, idx[:k] moved alike; key2 and idx2: room for as many. */
static void radix_sort(uint64_t *key, int32_t *idx, uint64_t *key2, int32_t *idx2, Py_ssize_t k) {
    uint64_t *const key0 = key;
    int32_t *const idx0 = idx;
    uint64_t all_or = 0, all_and = ~(uint64_t)0;
    for (Py_ssize_t i = 0; i < k; i++) all_or |= key[i], all_and &= key[i];
    size_t count[256];
    for (int shift = 0; shift < 64; shift += 8) {
        if ((((all_or ^ all_and) >> shift) & 0xff) == 0) continue; /* every key has this byte alike */
        memset(count, 0, sizeof count);
        for (Py_ssize_t i = 0; i < k; i++) count[(key[i] >> shift) & 0xff]++;
        size_t at = 0;
        for (int b = 0; b < 256; b++) {
            size_t c = count[b];
            count[b] = at;
            at += c;
        }
        for (Py_ssize_t i = 0; i < k; i++) {
            size_t to = count[(key[i] >> shift) & 0xff]++;
            key2[to] = key[i], idx2[to] = idx[i];
        }
        uint64_t *tk = key;
        key = key2, key2 = tk;
        int32_t *ti = idx;
        idx = idx2, idx2 = ti;
    }
    if (key != key0) { /* an odd number of passes: the result is in the other pair */
        memcpy(key0, key, (size_t)k * sizeof *key);
        memcpy(idx0, idx, (size_t)k * sizeof *idx);
    }
}

static PyObject *unique(PyObject *Py_UNUSED(module), PyObject *args) {
    PyObject *ids, *uniq, *inverse, *result = NULL;
    Buf bufs[3] = {0};
    int64_t *slot_key = NULL;
    int32_t *slot_at = NULL, *order = NULL, *order2 = NULL, *rank = NULL;
    uint64_t *key = NULL, *key2 = NULL;
    if (!PyArg_ParseTuple(args, "OOO", &ids, &uniq, &inverse)) return NULL;
    if (get(ids, &bufs[0], "q", 1, 0, "ids") < 0 || get(uniq, &bufs[1], "q", 1, 1, "uniq") < 0 ||
        get(inverse, &bufs[2], "q", -1, 1, "inverse") < 0)
        goto done;
    Py_ssize_t n = bufs[0].view.shape[0];
    if (bufs[1].view.shape[0] < n || bufs[2].view.len != n * (Py_ssize_t)sizeof(int64_t)) {
        PyErr_Format(PyExc_ValueError, "uniq of %zd and inverse of %zd items for %zd ids", bufs[1].view.shape[0],
                     bufs[2].view.len / (Py_ssize_t)sizeof(int64_t), n);
        goto done;
    }
    if (n > INT32_MAX / 2) {
        PyErr_SetString(PyExc_ValueError, "too many ids");
        goto done;
    }
    if (overlap(&bufs[0], &bufs[1]) || overlap(&bufs[0], &bufs[2]) || overlap(&bufs[1], &bufs[2])) {
        PyErr_SetString(PyExc_ValueError, "ids, uniq and inverse must not share memory");
        goto done;
    }
    size_t slots = 16, m = n ? (size_t)n : 1;
    while (slots < 2 * (size_t)n) slots <<= 1;
    slot_key = PyMem_Malloc(slots * sizeof *slot_key);
    slot_at = PyMem_Malloc(slots * sizeof *slot_at);
    order = PyMem_Malloc(m * sizeof *order);
    order2 = PyMem_Malloc(m * sizeof *order2);
    rank = PyMem_Malloc(m * sizeof *rank);
    key = PyMem_Malloc(m * sizeof *key);
    key2 = PyMem_Malloc(m * sizeof *key2);
    if (!slot_key || !slot_at || !order || !order2 || !rank || !key || !key2) {
        PyErr_NoMemory();
        goto done;
    }
    const int64_t *in = bufs[0].view.buf;
    int64_t *out = bufs[1].view.buf, *inv = bufs[2].view.buf;
    Py_ssize_t k = 0;
    Py_BEGIN_ALLOW_THREADS
    for (size_t s = 0; s < slots; s++) slot_at[s] = EMPTY_SLOT;
    for (Py_ssize_t i = 0; i < n; i++) { /* inv: each id's distinct value, numbered as first seen */
        uint64_t h = ((uint64_t)in[i] * 0x9E3779B97F4A7C15ull) >> 32;
        size_t s = h & (slots - 1);
        while (slot_at[s] != EMPTY_SLOT && slot_key[s] != in[i]) s = (s + 1) & (slots - 1);
        if (slot_at[s] == EMPTY_SLOT) {
            slot_key[s] = in[i], slot_at[s] = (int32_t)k;
            key[k] = (uint64_t)in[i] ^ 0x8000000000000000ull; /* signed order as unsigned */
            order[k] = (int32_t)k;
            k++;
        }
        inv[i] = slot_at[s];
    }
    radix_sort(key, order, key2, order2, k);
    for (Py_ssize_t j = 0; j < k; j++) {
        out[j] = (int64_t)(key[j] ^ 0x8000000000000000ull);
        rank[order[j]] = (int32_t)j;
    }
    for (Py_ssize_t i = 0; i < n; i++) inv[i] = rank[inv[i]]; /* renumbered in increasing order */
    Py_END_ALLOW_THREADS
    result = PyLong_FromSsize_t(k);
done:
    PyMem_Free(slot_key), PyMem_Free(slot_at), PyMem_Free(order), PyMem_Free(order2), PyMem_Free(rank);
    PyMem_Free(key), PyMem_Free(key2);
    release(bufs, 3);
    return result;
}

/* put_back(block, lo, saved): a checkpoint's block of a table (rows lo.. of it, copied while
   training changed them) gets back the rows' values as they were at the snapshot: each entry of
   the list `saved` is (rows, their old values, ...), the rows strictly increasing. Each block
   finds its rows in each entry by a binary search, so that a read of a large table with many
   entries kept holds the GIL briefly. Every row it copies is checked (inside the block, and
   increasing from the one before): a ValueError, and the block left part-way, when one is not. */
static PyObject *put_back(PyObject *Py_UNUSED(module), PyObject *args) {
    PyObject *block, *saved;
    long long lo;
    Buf bufs[3] = {0};
    if (!PyArg_ParseTuple(args, "OLO!", &block, &lo, &PyList_Type, &saved)) return NULL;
    if (get(block, &bufs[0], "f", 2, 1, "block") < 0) goto fail;
    float *out = bufs[0].view.buf;
    Py_ssize_t d = bufs[0].view.shape[1];
    if (lo < 0 || lo > LLONG_MAX - bufs[0].view.shape[0]) {
        PyErr_Format(PyExc_ValueError, "put_back: a block from row %lld of %zd rows", lo, bufs[0].view.shape[0]);
        goto fail;
    }
    long long hi = lo + bufs[0].view.shape[0];
    for (Py_ssize_t i = 0; i < PyList_GET_SIZE(saved); i++) {
        PyObject *entry = PyList_GET_ITEM(saved, i);
        if (!PyTuple_Check(entry) || PyTuple_GET_SIZE(entry) < 2) {
            PyErr_SetString(PyExc_TypeError, "saved: expected tuples (rows, values, ...)");
            goto fail;
        }
        if (get(PyTuple_GET_ITEM(entry, 0), &bufs[1], "q", 1, 0, "rows") < 0 ||
            get(PyTuple_GET_ITEM(entry, 1), &bufs[2], "f", 2, 0, "values") < 0)
            goto fail;
        const int64_t *r = bufs[1].view.buf;
        const float *v = bufs[2].view.buf;
        Py_ssize_t k = bufs[1].view.shape[0];
        if (bufs[2].view.shape[0] != k || bufs[2].view.shape[1] != d) {
            PyErr_Format(PyExc_ValueError, "values of shape [%zd, %zd] for %zd rows of width %zd", bufs[2].view.shape[0],
                         bufs[2].view.shape[1], k, d);
            goto fail;
        }
        if (overlap(&bufs[0], &bufs[1]) || overlap(&bufs[0], &bufs[2])) {
            PyErr_SetString(PyExc_ValueError, "put_back: the block shares memory with an entry");
            goto fail;
        }
        Py_ssize_t a = 0, z = k; /* the first row >= lo */
        while (a < z) {
            Py_ssize_t m = a + (z - a) / 2;
            if (r[m] < lo) a = m + 1;
            else z = m;
        }
        for (Py_ssize_t first = a; a < k && r[a] < hi; a++) {
            if (r[a] < lo || (a > first && r[a] <= r[a - 1])) {
                PyErr_SetString(PyExc_ValueError, "put_back: an entry's rows are not strictly increasing");
                goto fail;
            }
            memcpy(out + (r[a] - lo) * d, v + a * d, (size_t)d * sizeof(float));
        }
        release(bufs + 1, 2);
    }
    release(bufs, 3);
    Py_RETURN_NONE;
fail:
    release(bufs, 3);
    return NULL;
}

/* finite(array) -> False when a float32 array holds a NaN or an Inf (its 8 exponent bits all set),
   in one pass at memory speed. */
static PyObject *all_finite(PyObject *Py_UNUSED(module), PyObject *obj) {
    Buf b = {0};
    if (get(obj, &b, "f", -1, 0, "array") < 0) {
        release(&b, 1);
        return NULL;
    }
    Py_ssize_t n = b.view.len / (Py_ssize_t)sizeof(float);
    PyThreadState *saved = n >= LARGE ? PyEval_SaveThread() : NULL; /* the GIL, released for a long pass */
    int finite = finite_floats(b.view.buf, n);
    if (saved) PyEval_RestoreThread(saved);
    release(&b, 1);
    return PyBool_FromLong(finite);
}


/* ---- bfloat16 on the wire (spec.training.wireDtype) --------------------------------------

   A bfloat16 is a float32's upper 16 bits. to_bfloat16 rounds to nearest, ties to even, as
   ml_dtypes' astype and TensorFlow's cast do (a NaN becomes the quiet NaN of its sign, as there);
   from_bfloat16 is exact. Each is one pass that vectorises, where NumPy's astype to and from
   ml_dtypes' bfloat16 goes element by element. The bfloat16 side is given as its bits (uint16):
   NumPy does not export bfloat16 through the buffer protocol. */

static SIMD void narrow_loop(const void *from, void *to, Py_ssize_t n) {
    const uint32_t *restrict s = from;
    uint16_t *restrict d = to;
    for (Py_ssize_t i = 0; i < n; i++) {
        uint32_t u = s[i];
        uint32_t rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
        d[i] = (uint16_t)((u & 0x7fffffffu) > 0x7f800000u ? ((u >> 16) & 0x8000u) | 0x7fc0u : rounded);
    }
}

static SIMD void widen_loop(const void *from, void *to, Py_ssize_t n) {
    const uint16_t *restrict s = from;
    uint32_t *restrict d = to;
    for (Py_ssize_t i = 0; i < n; i++) d[i] = (uint32_t)s[i] << 16;
}

/* The two casts' shared part: (source, destination) of the formats `from` and `to`, as many items
   each and sharing no memory, then `loop` over them (the GIL released for a long one). */
static PyObject *cast(PyObject *args, const char *from, const char *to, void (*loop)(const void *, void *, Py_ssize_t)) {
    PyObject *src, *dst;
    Buf b[2] = {0};
    if (!PyArg_ParseTuple(args, "OO", &src, &dst)) return NULL;
    if (get(src, &b[0], from, -1, 0, "source") < 0 || get(dst, &b[1], to, -1, 1, "destination") < 0) goto fail;
    Py_ssize_t n = b[0].view.len / b[0].view.itemsize;
    if (b[1].view.len / b[1].view.itemsize != n) {
        PyErr_Format(PyExc_ValueError, "%zd items into room for %zd", n, b[1].view.len / b[1].view.itemsize);
        goto fail;
    }
    if (overlap(&b[0], &b[1])) {
        PyErr_SetString(PyExc_ValueError, "the source and the destination share memory");
        goto fail;
    }
    PyThreadState *saved = n >= LARGE ? PyEval_SaveThread() : NULL;
    loop(b[0].view.buf, b[1].view.buf, n);
    if (saved) PyEval_RestoreThread(saved);
    release(b, 2);
    Py_RETURN_NONE;
fail:
    release(b, 2);
    return NULL;
}

/* to_bfloat16(float32 array, uint16 array of as many items) */
static PyObject *to_bfloat16(PyObject *Py_UNUSED(module), PyObject *args) { return cast(args, "f", "H", narrow_loop); }

/* from_bfloat16(uint16 array, float32 array of as many items) */
static PyObject *from_bfloat16(PyObject *Py_UNUSED(module), PyObject *args) { return cast(args, "H", "f", widen_loop); }


/* ---- the optimizers by number ---------------------------------------------------------------
   As update_dense, update_rows and apply_async take them (runtime/optimizers.py's kernel_args):
   0 SGD, 1 momentum, 2 Adam, 3 Adagrad, each with its hyperparameters h in its kernels' order (SGD
   lr; momentum lr, mu; Adam b1, b2, rate, eps; Adagrad lr, eps) and this many slots, whose names
   come in its kernels' order. */
static const int SLOTS_OF[4] = {0, 1, 2, 1};

static DenseLoop dense_loop(int opt) {
    switch (opt) {
    case 0: return sgd_loop;
    case 1: return momentum_loop;
    case 2: return adam_loop;
    default: return adagrad_loop;
    }
}

void rows_update(int opt, Rows r, const float *h) {
    switch (opt) {
    case 0: sgd_rows(r, h[0]); break;
    case 1: momentum_rows(r, h[0], h[1]); break;
    case 2: adam_rows(r, h[0], h[1], h[2], h[3]); break;
    default: adagrad_rows(r, h[0], h[1]); break;
    }
}

/* 0 when `opt` is an optimizer and `slots` (a tuple) holds as many things as it has slots; else -1 with a ValueError. */
int optimizer_slots(int opt, PyObject *slots, const char *what) {
    if (opt < 0 || opt > 3 || PyTuple_GET_SIZE(slots) != SLOTS_OF[opt]) {
        PyErr_Format(PyExc_ValueError, "%s: an optimizer 0..3 and a tuple of its slots", what);
        return -1;
    }
    return 0;
}

/* The arrays of the slots `slot_names` in `mine` ({slot name: array}) into s; -1 with an error set. */
static int slot_arrays(PyObject *slot_names, PyObject *mine, PyObject **s) {
    if (!PyDict_Check(mine)) {
        PyErr_SetString(PyExc_TypeError, "a part's slots: a dict of arrays by slot name");
        return -1;
    }
    for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(slot_names); i++)
        if (!(s[i] = PyDict_GetItemWithError(mine, PyTuple_GET_ITEM(slot_names, i)))) {
            if (!PyErr_Occurred()) PyErr_Format(PyExc_KeyError, "no slot %R", PyTuple_GET_ITEM(slot_names, i));
            return -1;
        }
    return 0;
}

/* A table's update, its arrays (the table, its slots `mine`, the rows and their gradients)
   checked by unpack and held in `job` until it is done: -1 with an error set (the caller
   releases job->bufs either way). */
int row_job(PyObject *slot_names, PyObject *var, PyObject *mine, PyObject *rows, PyObject *grad, RowJob *job) {
    PyObject *s[2] = {NULL, NULL};
    if (slot_arrays(slot_names, mine, s) < 0) return -1;
    return unpack(var, s[0], s[1], rows, grad, job->bufs, &job->r);
}

/* One dense part's update into new arrays: `var` and its slots (`mine`) with the gradient
   (grad + plus) * scale (plus: NULL or None for none). *out: the new variable, *fresh: {slot
   name: its new array} (new references). 1 when the gradient was finite, 0 when not (its new
   arrays are then not to be used), -1 with an error set. */
int dense_part(const State *st, int opt, const float *h, PyObject *slot_names, PyObject *var, PyObject *mine,
               PyObject *grad, PyObject *plus, float scale, PyObject **out, PyObject **fresh) {
    PyObject *o[NDENSE] = {var, grad}, *s[2] = {NULL, NULL}, *made[2] = {NULL, NULL};
    int finite = -1;
    *out = *fresh = NULL;
    if (slot_arrays(slot_names, mine, s) < 0 || !(*out = PyObject_CallOneArg(st->empty_like, var)) ||
        !(*fresh = PyDict_New()))
        goto done;
    o[2] = *out;
    o[PLUS] = plus;
    for (int i = 0; i < SLOTS_OF[opt]; i++) {
        if (!(made[i] = PyObject_CallOneArg(st->empty_like, var)) ||
            PyDict_SetItem(*fresh, PyTuple_GET_ITEM(slot_names, i), made[i]) < 0)
            goto done;
        o[3 + 2 * i] = s[i];
        o[4 + 2 * i] = made[i];
    }
    finite = dense_pass(o, 3 + 2 * SLOTS_OF[opt], dense_loop(opt), h, scale);
done:
    Py_XDECREF(made[0]); /* held by *fresh from here */
    Py_XDECREF(made[1]);
    if (finite < 0) {
        Py_CLEAR(*out);
        Py_CLEAR(*fresh);
    }
    return finite;
}

/* update_dense(opt, h, slot_names, var, slots, grad[, plus, scale]) -> (finite, new var, {slot:
   new array}): the optimizer's update of a dense part (slots: {slot name: array}) with the gradient
   (grad + plus) * scale, a sync step's mean made in the same pass (the other workers' sum, the last
   worker's gradient, 1/n). The given arrays are left as they were (a reply or a checkpoint may be
   reading them); `finite`: the gradient had no NaN and no Inf (if not, the new arrays are not to be
   used). */
static PyObject *update_dense(PyObject *module, PyObject *args) {
    int opt;
    float h[4], scale = 1;
    PyObject *slot_names, *var, *mine, *grad, *plus = NULL, *out, *fresh;
    if (!PyArg_ParseTuple(args, "i(ffff)O!OOO|Of", &opt, &h[0], &h[1], &h[2], &h[3], &PyTuple_Type, &slot_names, &var, &mine,
                          &grad, &plus, &scale))
        return NULL;
    if (optimizer_slots(opt, slot_names, "update_dense") < 0) return NULL;
    int finite = dense_part(state_of(module), opt, h, slot_names, var, mine, grad, plus, scale, &out, &fresh);
    return finite < 0 ? NULL : Py_BuildValue("(ONN)", finite ? Py_True : Py_False, out, fresh);
}

/* update_rows(opt, h, slot_names, table, slots, rows, grad): the optimizer's update of the `rows`
   (int64, each once, inside the table) of `table` and of its slots ({slot name: array}), in place,
   with their gradients (a row each). */
static PyObject *update_rows(PyObject *Py_UNUSED(module), PyObject *args) {
    int opt;
    float h[4];
    PyObject *slot_names, *var, *mine, *rows, *grad;
    if (!PyArg_ParseTuple(args, "i(ffff)O!OOOO", &opt, &h[0], &h[1], &h[2], &h[3], &PyTuple_Type, &slot_names, &var, &mine,
                          &rows, &grad))
        return NULL;
    if (optimizer_slots(opt, slot_names, "update_rows") < 0) return NULL;
    RowJob job = {0};
    int ok = row_job(slot_names, var, mine, rows, grad, &job) == 0;
    if (ok) rows_update(opt, job.r, h);
    release(job.bufs, NBUFS);
    return ok ? Py_NewRef(Py_None) : NULL;
}

/* A new (k, d) float32 array of the `rows` of 2-D `table`, each inside it. */
PyObject *gathered(const State *st, PyObject *table, PyObject *rows) {
    Buf b[3] = {0};
    PyObject *out = NULL;
    if (get(table, &b[0], "f", 2, 0, "table") < 0 || get(rows, &b[1], "q", 1, 0, "rows") < 0) goto fail;
    Py_ssize_t n = b[0].view.shape[0], d = b[0].view.shape[1], k = b[1].view.shape[0];
    const float *t = b[0].view.buf;
    const int64_t *r = b[1].view.buf;
    if (rows_inside(r, k, n) < 0) goto fail;
    out = PyObject_CallFunction(st->empty, "(nn)O", k, d, st->float32);
    if (!out || get(out, &b[2], "f", 2, 1, "out") < 0) goto fail;
    float *o = b[2].view.buf;
    gather_rows(t, r, k, d, o);
    release(b, 3);
    return out;
fail:
    release(b, 3);
    Py_XDECREF(out);
    return NULL;
}


/* ---- the module -------------------------------------------------------------------------- */

static PyMethodDef methods[] = {
    {"finite", all_finite, METH_O, "finite(float32 array) -> no NaN and no Inf in it?"},
    {"check_rows", check_rows, METH_VARARGS, "check_rows(rows, n) -> strictly increasing?; ValueError outside 0..n-1"},
    {"take", take, METH_VARARGS, "take(table, rows, out): out[i] = table[rows[i]]"},
    {"segment_sum", segment_sum, METH_VARARGS, "segment_sum(values, indices, out): out = 0; out[indices[i]] += values[i]"},
    {"unique", unique, METH_VARARGS, "unique(ids, uniq, inverse) -> k: uniq[:k] the distinct ids, increasing; ids == uniq[inverse]"},
    {"put_back", put_back, METH_VARARGS,
     "put_back(block, lo, [(rows, values, ...)]): block[r - lo] = the row's value, for rows in the block (each entry's rows "
     "strictly increasing)"},
    {"update_rows", update_rows, METH_VARARGS,
     "update_rows(opt, h, slot_names, table, slots, rows, grad): the optimizer's update of those rows, in place"},
    {"update_dense", update_dense, METH_VARARGS,
     "update_dense(opt, h, slot_names, var, slots, grad[, plus, scale]) -> (finite, new var, {slot: new array})"},
    {"to_bfloat16", to_bfloat16, METH_VARARGS, "to_bfloat16(float32 array, uint16 array): its bfloat16 bits, rounded to nearest even"},
    {"from_bfloat16", from_bfloat16, METH_VARARGS, "from_bfloat16(uint16 array of bfloat16 bits, float32 array)"},
    {"read_header", read_header, METH_VARARGS, "read_header(view, total) -> wire.header's (meta, places), or None"},
    {"encode_message", encode_message, METH_VARARGS, "encode_message(meta JSON, tensors) -> wire.pieces' output, or None"},
    {"parse_request", parse_request, METH_VARARGS, "parse_request(data, layout, check_dense) -> (meta, dense, sparse, rows), or None"},
    {"apply_async", apply_async, METH_VARARGS,
     "apply_async(opt, h, slot_names, vars, slots, dense, sparse, rows, reply_dense, meta) -> (pieces, nbytes), or the name "
     "of a non-finite dense gradient"},
    {NULL, NULL, 0, NULL},
};

static int module_traverse(PyObject *module, visitproc visit, void *arg) {
    State *st = state_of(module);
    if (st) {
        Py_VISIT(st->ndarray);
        Py_VISIT(st->float32);
        Py_VISIT(st->int64);
        Py_VISIT(st->empty);
        Py_VISIT(st->empty_like);
        Py_VISIT(st->json_loads);
    }
    return 0;
}

static int module_clear(PyObject *module) {
    State *st = state_of(module);
    if (st) {
        Py_CLEAR(st->ndarray);
        Py_CLEAR(st->float32);
        Py_CLEAR(st->int64);
        Py_CLEAR(st->empty);
        Py_CLEAR(st->empty_like);
        Py_CLEAR(st->json_loads);
    }
    return 0;
}

static void module_free(void *module) { module_clear((PyObject *)module); }

/* The module's state, made before any of its functions can be called (so no call finds it half
   made, whichever thread makes it): what it uses of NumPy, and orjson's parser for the wire's
   headers (none without orjson: the wire's readers then leave every message to wire.py). */
static int module_exec(PyObject *module) {
    State *st = state_of(module);
    PyObject *np = PyImport_ImportModule("numpy");
    if (!np) return -1;
    PyObject *dtype = PyObject_GetAttrString(np, "dtype");
    st->ndarray = PyObject_GetAttrString(np, "ndarray");
    st->empty = PyObject_GetAttrString(np, "empty");
    st->empty_like = PyObject_GetAttrString(np, "empty_like");
    if (dtype) {
        st->float32 = PyObject_CallFunction(dtype, "s", "float32");
        st->int64 = PyObject_CallFunction(dtype, "s", "int64");
    }
    Py_XDECREF(dtype);
    Py_DECREF(np);
    if (!st->ndarray || !st->empty || !st->empty_like || !st->float32 || !st->int64) return -1;
    PyObject *orjson = PyImport_ImportModule("orjson");
    if (orjson) {
        st->json_loads = PyObject_GetAttrString(orjson, "loads");
        Py_DECREF(orjson);
        if (!st->json_loads) return -1;
    } else if (PyErr_ExceptionMatches(PyExc_ImportError)) {
        PyErr_Clear();
    } else {
        return -1;
    }
    if (PyModule_AddIntConstant(module, "ALIGN", WIRE_ALIGN) < 0 ||
        PyModule_AddIntConstant(module, "MAX_HEADER_BYTES", WIRE_MAX_HEADER_BYTES) < 0 ||
        PyModule_AddIntConstant(module, "MAX_TENSORS", WIRE_MAX_TENSORS) < 0 ||
        PyModule_AddIntConstant(module, "MAX_DIMS", WIRE_MAX_DIMS) < 0)
        return -1;
    return 0;
}

static PyModuleDef_Slot module_slots[] = {
    {Py_mod_exec, module_exec},
    {0, NULL},
};

static struct PyModuleDef module_def = {
    PyModuleDef_HEAD_INIT,
    .m_name = "_rows",
    .m_doc = "A PS's update kernels, a worker's id numbering and row sums, the wire's reading and framing "
             "(runtime/_rows.c, runtime/_rows_wire.c).",
    .m_size = sizeof(State),
    .m_methods = methods,
    .m_slots = module_slots,
    .m_traverse = module_traverse,
    .m_clear = module_clear,
    .m_free = module_free,
};

PyMODINIT_FUNC PyInit__rows(void) { return PyModuleDef_Init(&module_def); }
