/* A PS's update kernels: the decoding and checks of a request (its rows; its gradients free of
   NaN and Inf), the optimizer updates of the embedding rows it touches, and the dense updates,
   each one pass in C; and a worker's two: its batch's table ids numbered by the distinct ones,
   and the sum of its batch's gradients per table row.

   In NumPy an update of k rows is a gather of the rows (and of each slot's rows), several
   whole-array passes over the gathered copies and a scatter back, with a return to the
   interpreter between each; a row check is three reductions. The rows are scattered over a
   table of hundreds of MiB, so the loops here ask for the rows a few iterations ahead
   (their cache misses overlap instead of waiting in turn). A dense update in NumPy is several
   passes over the variable's size (SGD two: a multiply, then a subtract; Adam more than ten);
   here it is one.

   Each float operation is the textbook rule's, in the same order for rows and dense arrays
   (built with -ffp-contract=off: no fused multiply-add), so a row comes out bit for bit as a
   dense update would leave it. The arguments are any C-contiguous buffers (NumPy arrays):
   tables and row gradients float32 and 2-D, rows int64 and 1-D, dense arrays float32 of any
   shape; no NumPy headers are needed to build. */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

#define AHEAD 8 /* rows prefetched ahead of the one being updated */

/* The float loops are built twice on x86-64, for AVX2 and for the baseline (SSE2), and the loader
   picks the one the CPU runs (GCC's function multiversioning). The package is built once for
   every machine it goes to, so it cannot be built for the CPU it runs on. Square roots and
   divisions are correctly rounded at any vector width and no multiply-add is fused (built with
   -ffp-contract=off): both give the same bits. Measured on an AMD EPYC (Zen 4), baseline -> AVX2:
   Adam's update of 760 rows at random in a 1M x 64 table 73 -> 62 us, a dense Adam update of 335k
   floats 222 -> 122 us, the finiteness check of 335k floats 28 -> 17 us, 670k floats to bfloat16
   230 -> 100 us, a worker's sum of 4,096 rows of 64 into 1,366 37 -> 34 us. */
#if defined(__x86_64__) && defined(__has_attribute)
#if __has_attribute(target_clones)
#define SIMD __attribute__((target_clones("avx2", "default")))
#endif
#endif
#ifndef SIMD
#define SIMD
#endif
#define EXPONENT 0x7f800000u /* a float32's exponent bits */
#define LARGE (1 << 16) /* floats: a pass over more lets other threads run meanwhile */

typedef struct {
    Py_buffer view;
    int held;
} Buf;

/* The float loops run with subnormal floats taken as zero, in and out (x86's FTZ and DAZ, ARM's
   FZ), as TensorFlow's CPU threads run its kernels (Keras's optimizers included), and restore the
   thread's setting after. Without it a slot that decays towards zero (Adam's first moment, b1 a
   step, where a unit's gradient is zero) spends steps in the subnormal range, where each
   operation takes a microcode assist: a dense Adam update of 33k such floats took 1.8 ms instead
   of 24 us, and a 2M-row Adam job's PS CPU tripled after some thousands of steps. */
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

/* 1 when x is a NaN or an Inf (its exponent bits all set); written so that loops vectorise. */
static inline uint32_t nonfinite(float x) {
    uint32_t u;
    memcpy(&u, &x, sizeof u);
    return (u & EXPONENT) == EXPONENT;
}

/* 1 when none of the n floats is a NaN or an Inf. Not inlined: a loop of its own vectorises. */
__attribute__((noinline)) static SIMD int finite_floats(const float *restrict x, Py_ssize_t n) {
    uint32_t bad = 0;
    for (Py_ssize_t i = 0; i < n; i++) bad |= nonfinite(x[i]);
    return !bad;
}

static void release(Buf *bufs, int n) {
    for (int i = 0; i < n; i++)
        if (bufs[i].held) {
            PyBuffer_Release(&bufs[i].view);
            bufs[i].held = 0;
        }
}

/* The NumPy name of the struct format `f` ("f", "q" or "H"). */
static const char *type_name(char f) { return f == 'f' ? "float32" : f == 'H' ? "uint16" : "int64"; }

/* `obj` as a C-contiguous buffer of `ndim` dimensions (any: -1) whose items have one of the (one or
   two) struct formats in `fmt` ("f": float32, "q": int64, "H": uint16); -1 with a TypeError when it is not. */
static int get(PyObject *obj, Buf *b, const char *fmt, int ndim, int writable, const char *what) {
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
    return 0;
}

/* 1 when the k rows are all inside 0..n-1; *increasing: whether they are strictly increasing. */
static int scan_rows(const int64_t *r, Py_ssize_t k, long long n, int *increasing) {
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

/* check_rows(rows, n) -> True when the rows are strictly increasing (sorted, none repeated);
   ValueError when one is outside 0..n-1. */
static PyObject *check_rows(PyObject *self, PyObject *args) {
    PyObject *obj;
    long long n;
    if (!PyArg_ParseTuple(args, "OL", &obj, &n)) return NULL;
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
static int overlap(const Buf *x, const Buf *y) {
    return (const char *)x->view.buf < (const char *)y->view.buf + y->view.len &&
           (const char *)y->view.buf < (const char *)x->view.buf + x->view.len;
}

/* An update's arguments: a table (n x d, written), up to two slots of its shape (written),
   k rows (each at most once) and their gradients (k x d). */
typedef struct {
    float *var, *s1, *s2;
    const float *grad;
    const int64_t *rows;
    Py_ssize_t k, d;
} Rows;

#define NBUFS 5

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

/* The dense loops touch up to eight arrays: more than GCC checks for overlap at run time
   (the restrict locals above do not stand in for those checks), so without this it leaves
   Adam's loop scalar. unpack_dense has checked that no out array overlaps another array. */
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

/* take(table, rows, out): out[i] = table[rows[i]], the rows asked for ahead (a reply's rows;
   NumPy's take waits for each row's cache misses in turn). Rows must be inside the table. */
/* The three arguments of take and segment_sum, into bufs: a 2-D float32 array (named `what`
   in errors), 1-D int64 rows (`rows_what`) and a writable 2-D float32 `out`; -1 with the error
   set (the caller releases bufs either way). */
static int rows_and_out(PyObject *args, Buf *bufs, const char *what, const char *rows_what) {
    PyObject *arr, *rows, *out;
    if (!PyArg_ParseTuple(args, "OOO", &arr, &rows, &out)) return -1;
    if (get(arr, &bufs[0], "f", 2, 0, what) < 0 || get(rows, &bufs[1], "q", 1, 0, rows_what) < 0 ||
        get(out, &bufs[2], "f", 2, 1, "out") < 0)
        return -1;
    return 0;
}

/* o[i] = t[r[i]] for the k rows of width d, each asked for AHEAD rows before it is copied, the GIL released. */
static void gather_rows(const float *t, const int64_t *r, Py_ssize_t k, Py_ssize_t d, float *o) {
    Py_BEGIN_ALLOW_THREADS for (Py_ssize_t i = 0; i < k; i++) {
        if (i + AHEAD < k)
            for (Py_ssize_t j = 0; j < d; j += 64 / sizeof(float)) __builtin_prefetch(t + r[i + AHEAD] * d + j, 0, 0);
        memcpy(o + i * d, t + r[i] * d, d * sizeof(float));
    }
    Py_END_ALLOW_THREADS
}

static PyObject *take(PyObject *self, PyObject *args) {
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

/* segment_sum(values, indices, out): out = 0, then out[indices[i]] += values[i] for i in order.
   A worker's gradient of a batch's table rows from TensorFlow's IndexedSlices (one row of values
   per id looked up), each row summed in the order TensorFlow's UnsortedSegmentSum adds them, so
   bit for bit its result. Its CPU kernel goes a row at a time through Eigen: summed here
   instead, a worker of the 2M-row click model (4,096 ids a batch) spends 0.22 ms less a step. */
static SIMD void sum_rows(const float *v, const int64_t *r, Py_ssize_t k, Py_ssize_t d, float *o, Py_ssize_t n) {
    memset(o, 0, (size_t)(n * d) * sizeof(float));
    for (Py_ssize_t i = 0; i < k; i++) {
        float *restrict row = o + r[i] * d;
        const float *restrict add = v + i * d;
        for (Py_ssize_t j = 0; j < d; j++) row[j] += add[j];
    }
}

static PyObject *segment_sum(PyObject *self, PyObject *args) {
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
    if (overlap(&bufs[0], &bufs[2]) || overlap(&bufs[1], &bufs[2])) {
        PyErr_SetString(PyExc_ValueError, "out shares memory with values or indices");
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
   worker's batch of table ids. NumPy sorts all the ids (an argsort of 4,096 ids: 0.12 ms a step
   on the 2M-row click model); here they go through a hash table, and only the distinct ones
   (about a third of them there) are sorted, by radix on the bytes in which they differ. */
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

static PyObject *unique(PyObject *self, PyObject *args) {
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
   the list `saved` is (rows, their old values, ...), the rows strictly increasing. A snapshot keeps
   one entry per update during the read, and each block looks through all of them: per entry a
   binary search here, where NumPy's masks made four calls and passes. Reading a 5M x 64 table
   with 1,500 entries kept: 4.9 s with the masks (the GIL held, the PS's requests waiting), 0.6 s
   with this, 0.2 s for the copies alone. */
static PyObject *put_back(PyObject *self, PyObject *args) {
    PyObject *block, *saved;
    long long lo;
    Buf bufs[3] = {0};
    if (!PyArg_ParseTuple(args, "OLO!", &block, &lo, &PyList_Type, &saved)) return NULL;
    if (get(block, &bufs[0], "f", 2, 1, "block") < 0) goto fail;
    float *out = bufs[0].view.buf;
    Py_ssize_t d = bufs[0].view.shape[1];
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
        Py_ssize_t a = 0, z = k; /* the first row >= lo */
        while (a < z) {
            Py_ssize_t m = a + (z - a) / 2;
            if (r[m] < lo) a = m + 1;
            else z = m;
        }
        for (; a < k && r[a] < hi; a++) memcpy(out + (r[a] - lo) * d, v + a * d, d * sizeof(float));
        release(bufs + 1, 2);
    }
    release(bufs, 3);
    Py_RETURN_NONE;
fail:
    release(bufs, 3);
    return NULL;
}

/* finite(array) -> False when a float32 array holds a NaN or an Inf (its 8 exponent bits all set).
   One pass at memory speed: NumPy's cheapest check, a sum, is pairwise and several times slower. */
static PyObject *all_finite(PyObject *self, PyObject *obj) {
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
   ml_dtypes' bfloat16 goes element by element: 670k floats on this machine 0.55 ms to bfloat16
   and 0.20 ms back that way, 0.29 and 0.16 ms here, and in the 670k job with the bfloat16 wire
   the PS's CPU a worker step fell from 2.0 to 1.6 ms. The bfloat16 side is given as its bits
   (uint16): NumPy does not export bfloat16 through the buffer protocol. */

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
   each, then `loop` over them (the GIL released for a long one). */
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
static PyObject *to_bfloat16(PyObject *self, PyObject *args) { return cast(args, "f", "H", narrow_loop); }

/* from_bfloat16(uint16 array, float32 array of as many items) */
static PyObject *from_bfloat16(PyObject *self, PyObject *args) { return cast(args, "H", "f", widen_loop); }


/* ---- a Step request's common shape, decoded and checked in one call ----------------------

   parse_request(data, layout, check_dense) decodes a wire message (runtime/wire.py) whose every
   tensor is one the shard expects, as a worker sends it: its dense gradients (float32, the
   part's shape; with check_dense free of NaN and Inf), each table's rows as indices (int64,
   strictly increasing, inside the table) followed by their gradients (float32, finite), and the
   rows it asks for (int64, inside the table). It returns (meta, dense, sparse, rows): the
   header's meta, {part: gradient}, {part: (indices, gradients)} and {part: rows}, each tensor a
   NumPy view of `data`. Anything else (a message malformed in any way, bfloat16 gradients,
   repeated or unsorted rows, an unknown name) gives None, and the shard's Python checks, which
   name what is wrong, take the message instead: this is the fast path of the requests the PS
   answers all the time, never a second set of rules. `layout` maps each tensor name the shard
   accepts to (kind, part, shape): kind 0 a dense part (shape: its shape), 1 a table's indices,
   2 their gradients, 3 the rows asked for (shape: the table's (rows, width)). */

static PyObject *np_ndarray, *np_float32, *np_int64, *json_loads;

static int parse_setup(void) {
    if (json_loads) return 0;
    PyObject *wire = PyImport_ImportModule("tfps.runtime.wire"), *np = wire ? PyImport_ImportModule("numpy") : NULL;
    if (np) {
        json_loads = PyObject_GetAttrString(wire, "json_loads");
        np_ndarray = PyObject_GetAttrString(np, "ndarray");
        PyObject *dtype = PyObject_GetAttrString(np, "dtype");
        if (dtype) {
            np_float32 = PyObject_CallFunction(dtype, "s", "float32");
            np_int64 = PyObject_CallFunction(dtype, "s", "int64");
            Py_DECREF(dtype);
        }
    }
    Py_XDECREF(wire);
    Py_XDECREF(np);
    if (!json_loads || !np_ndarray || !np_float32 || !np_int64) {
        Py_CLEAR(json_loads);
        return -1;
    }
    return 0;
}

/* A non-negative C integer from a Python int (not a bool); -1 when it is anything else. */
static Py_ssize_t count_of(PyObject *obj) {
    if (!PyLong_CheckExact(obj)) return -1;
    Py_ssize_t v = PyLong_AsSsize_t(obj);
    if (v < 0) {
        PyErr_Clear();
        return -1;
    }
    return v;
}

/* The tensor at `offset` of `data` as a NumPy view of `n` items of `dtype`, in `rows` x `cols`
   (cols < 0: 1-D) or in `shape` (a tuple) when given: one call of np.ndarray (frombuffer and a
   reshape take twice as long, for each of a request's tensors). */
static PyObject *view_at(PyObject *data, PyObject *dtype, Py_ssize_t n, Py_ssize_t offset, Py_ssize_t rows,
                         Py_ssize_t cols, PyObject *shape) {
    PyObject *dims = shape ? Py_NewRef(shape) : cols < 0 ? Py_BuildValue("(n)", n) : Py_BuildValue("(nn)", rows, cols);
    if (!dims) return NULL;
    PyObject *out = PyObject_CallFunction(np_ndarray, "OOOn", dims, dtype, data, offset);
    Py_DECREF(dims);
    return out;
}


#define DECLINE goto decline

/* ---- a message's header, read ---------------------------------------------------------------
   The readers below take what runtime/wire.py's `header` takes, for messages whose every tensor is
   float32 or int64, and say 0 (decline) for anything else: the caller's Python then reads the
   message and says what is wrong with it. */

typedef struct {
    PyObject *head;    /* the decoded JSON (a new reference) */
    PyObject *meta;    /* borrowed from head */
    PyObject *entries; /* borrowed from head */
    Py_ssize_t align, start; /* the tensors' alignment; where the first may start */
} Header;

/* The header of the message in buf[0:len], a message of `total` bytes: 1 read, 0 declined, -1 an error. */
static int read_head(const char *buf, Py_ssize_t len, Py_ssize_t total, Header *h) {
    h->head = NULL;
    if (len < 4) return 0;
    uint32_t hlen;
    memcpy(&hlen, buf, 4); /* little-endian, as every machine this runs on */
    h->start = 4 + (Py_ssize_t)hlen;
    if (h->start > len || h->start > total) return 0;
    PyObject *text = PyBytes_FromStringAndSize(buf + 4, hlen);
    if (!text) return -1;
    PyObject *head = PyObject_CallOneArg(json_loads, text);
    Py_DECREF(text);
    if (!head) {
        PyErr_Clear();
        return 0;
    }
    if (!PyDict_CheckExact(head)) {
        Py_DECREF(head);
        return 0;
    }
    h->meta = PyDict_GetItemString(head, "meta");
    h->entries = PyDict_GetItemString(head, "tensors");
    PyObject *align_obj = PyDict_GetItemString(head, "align");
    h->align = align_obj ? count_of(align_obj) : 1;
    if (!h->meta || !PyDict_CheckExact(h->meta) || !h->entries || !PyList_CheckExact(h->entries) || h->align < 1 ||
        h->align > 4096) {
        Py_DECREF(head);
        return 0;
    }
    h->head = head;
    return 1;
}

/* One tensor's entry, [name, dtype, shape, nbytes]: its parts borrowed from the header. */
typedef struct {
    PyObject *name, *shape;
    int is_float; /* float32, else int64 */
    Py_ssize_t ndim, items, nbytes, dims[8];
} Entry;

/* 1 when `obj` is the entry of a float32 or int64 tensor whose bytes match its shape, else 0. */
static int read_entry(PyObject *obj, Entry *t) {
    if (!PyList_CheckExact(obj) || PyList_GET_SIZE(obj) != 4) return 0;
    PyObject *wire_dtype = PyList_GET_ITEM(obj, 1);
    t->name = PyList_GET_ITEM(obj, 0);
    t->shape = PyList_GET_ITEM(obj, 2);
    if (!PyUnicode_CheckExact(t->name) || !PyUnicode_CheckExact(wire_dtype) || !PyList_CheckExact(t->shape)) return 0;
    t->is_float = PyUnicode_CompareWithASCIIString(wire_dtype, "float32") == 0;
    if (!t->is_float && PyUnicode_CompareWithASCIIString(wire_dtype, "int64") != 0) return 0;
    t->ndim = PyList_GET_SIZE(t->shape);
    t->items = 1;
    if (t->ndim > 8) return 0;
    for (Py_ssize_t i = 0; i < t->ndim; i++) {
        t->dims[i] = count_of(PyList_GET_ITEM(t->shape, i));
        if (t->dims[i] < 0 || (t->dims[i] && t->items > PY_SSIZE_T_MAX / 8 / t->dims[i])) return 0;
        t->items *= t->dims[i];
    }
    t->nbytes = count_of(PyList_GET_ITEM(obj, 3));
    return t->nbytes == t->items * (t->is_float ? 4 : 8);
}

/* read_header(view, total) -> wire.header's (meta, places) for a message of `total` bytes whose
   first bytes `view` holds, or None (wire.header then reads it). */
static PyObject *read_header(PyObject *self, PyObject *args) {
    PyObject *data;
    Py_ssize_t total;
    if (!PyArg_ParseTuple(args, "On", &data, &total)) return NULL;
    if (parse_setup() < 0) return NULL;
    Py_buffer v;
    if (PyObject_GetBuffer(data, &v, PyBUF_SIMPLE) < 0) return NULL;
    PyObject *places = NULL, *result = NULL;
    Header h;
    int read = read_head(v.buf, v.len, total, &h);
    if (read <= 0) {
        PyBuffer_Release(&v);
        return read < 0 ? NULL : Py_NewRef(Py_None);
    }
    Py_ssize_t count = PyList_GET_SIZE(h.entries), offset = h.start;
    if (!(places = PyList_New(count))) goto fail;
    for (Py_ssize_t e = 0; e < count; e++) {
        Entry t;
        if (!read_entry(PyList_GET_ITEM(h.entries, e), &t)) DECLINE;
        offset += (h.align - offset % h.align) % h.align;
        if (offset > total || t.nbytes > total - offset) DECLINE;
        PyObject *shape = PyTuple_New(t.ndim);
        if (!shape) goto fail;
        for (Py_ssize_t i = 0; i < t.ndim; i++) PyTuple_SET_ITEM(shape, i, Py_NewRef(PyList_GET_ITEM(t.shape, i)));
        PyObject *place = Py_BuildValue("(OONnn)", t.name, t.is_float ? np_float32 : np_int64, shape, offset, t.nbytes);
        if (!place) goto fail;
        PyList_SET_ITEM(places, e, place);
        offset += t.nbytes;
    }
    if (offset != total) DECLINE;
    result = Py_BuildValue("(OO)", h.meta, places);
    goto done;
decline:
    result = Py_NewRef(Py_None);
    goto done;
fail:
    result = NULL;
done:
    Py_XDECREF(places);
    Py_DECREF(h.head);
    PyBuffer_Release(&v);
    return result;
}


static PyObject *parse_request(PyObject *self, PyObject *args) {
    PyObject *data, *layout;
    int check_dense;
    if (!PyArg_ParseTuple(args, "OO!p", &data, &PyDict_Type, &layout, &check_dense)) return NULL;
    if (parse_setup() < 0) return NULL;
    Py_buffer v;
    if (PyObject_GetBuffer(data, &v, PyBUF_SIMPLE) < 0) return NULL;
    PyObject *head = NULL, *dense = NULL, *sparse = NULL, *pulled = NULL, *indices = NULL, *result = NULL;
    const char *buf = v.buf;
    Py_ssize_t total = v.len;
    Header h;
    int read = read_head(buf, total, total, &h);
    if (read < 0) goto fail;
    if (!read) DECLINE;
    head = h.head;
    PyObject *meta = h.meta, *entries = h.entries;
    Py_ssize_t align = h.align, start = h.start;
    dense = PyDict_New();
    sparse = PyDict_New();
    pulled = PyDict_New();
    indices = PyDict_New(); /* part -> its indices, until their gradients come */
    if (!dense || !sparse || !pulled || !indices) goto fail;
    Py_ssize_t offset = start, count = PyList_GET_SIZE(entries);
    for (Py_ssize_t e = 0; e < count; e++) {
        Entry t;
        if (!read_entry(PyList_GET_ITEM(entries, e), &t)) DECLINE;
        PyObject *name = t.name, *expect = PyDict_GetItemWithError(layout, name);
        if (!expect) {
            if (PyErr_Occurred()) goto fail;
            DECLINE;
        }
        long kind;
        PyObject *part, *want;
        if (!PyArg_ParseTuple(expect, "lOO", &kind, &part, &want)) goto fail;
        int is_float = t.is_float;
        if (is_float != (kind == 0 || kind == 2)) DECLINE;
        Py_ssize_t ndim = t.ndim, items = t.items, nbytes = t.nbytes, *dims = t.dims;
        offset += (align - offset % align) % align;
        if (offset > total || nbytes > total - offset) DECLINE;
        const char *at = buf + offset;
        Py_ssize_t table_rows = 0, width = 0;
        if (kind != 0 && !PyArg_ParseTuple(want, "nn", &table_rows, &width)) goto fail;
        PyObject *arr = NULL, *target = NULL, *key = part;
        if (kind == 0) { /* a dense gradient: the part's shape exactly */
            if (!PyTuple_CheckExact(want) || PyTuple_GET_SIZE(want) != ndim) DECLINE;
            for (Py_ssize_t i = 0; i < ndim; i++)
                if (PyLong_AsSsize_t(PyTuple_GET_ITEM(want, i)) != dims[i]) DECLINE;
            if (check_dense && !finite_floats((const float *)at, items)) DECLINE;
            arr = view_at(data, np_float32, items, offset, 0, -1, ndim == 1 ? NULL : want); /* 1-D: no reshape */
            target = dense;
        } else if (kind == 1 || kind == 3) { /* rows: 1-D, inside the table; a push's strictly increasing */
            int increasing;
            if (ndim != 1 || !scan_rows((const int64_t *)at, items, table_rows, &increasing) || (kind == 1 && !increasing)) DECLINE;
            arr = view_at(data, np_int64, items, offset, 0, -1, NULL);
            target = kind == 1 ? indices : pulled;
        } else { /* gradients of the indices that came just before them */
            PyObject *idx = PyDict_GetItemWithError(indices, part);
            if (!idx) {
                if (PyErr_Occurred()) goto fail;
                DECLINE;
            }
            if (ndim != 2 || dims[0] != PyObject_Length(idx) || dims[1] != width || !finite_floats((const float *)at, items)) DECLINE;
            arr = view_at(data, np_float32, items, offset, dims[0], dims[1], NULL);
            if (arr) {
                PyObject *pair = PyTuple_Pack(2, idx, arr);
                Py_DECREF(arr);
                arr = pair;
            }
            target = sparse;
        }
        if (!arr) goto fail;
        int known = PyDict_Contains(target, key);
        int stored = known == 0 ? PyDict_SetItem(target, key, arr) : -1;
        Py_DECREF(arr);
        if (known < 0 || (known == 0 && stored < 0)) goto fail;
        if (known) DECLINE; /* a name twice */
        if (kind == 2 && PyDict_DelItem(indices, part) < 0) goto fail;
        offset += nbytes;
    }
    if (offset != total || PyDict_GET_SIZE(indices)) DECLINE; /* trailing bytes; indices without gradients */
    result = PyTuple_Pack(4, meta, dense, sparse, pulled);
    goto done;
decline:
    result = Py_NewRef(Py_None);
    goto done;
fail:
    result = NULL;
done:
    Py_XDECREF(head);
    Py_XDECREF(dense);
    Py_XDECREF(sparse);
    Py_XDECREF(pulled);
    Py_XDECREF(indices);
    PyBuffer_Release(&v);
    return result;
}

/* ---- an async push applied and answered in one call --------------------------------------

   apply_async(opt, h, slot_names, vars, slots, dense, sparse, rows, reply_dense, meta) applies
   the push of a request that parse_request took (its rows strictly increasing and inside their
   tables, every gradient float32, the rows' finite) and encodes the reply, as runtime/ps.py's
   Shard does it in Python for every other request: the same float operations on the same arrays,
   the same bytes back. opt, h, slot_names: the optimizer by number, its hyperparameters (Adam's
   rate for this update) and its slots (below); vars: {part: array}, slots: {part: {slot: array}}
   (the shard's own dicts: each dense part's new arrays replace its old there, its tables change
   in place);
   dense, sparse, rows: parse_request's; reply_dense: the dense parts to send back, in order;
   meta: the reply's meta as JSON. Nothing changes until every dense gradient is known finite:
   the name of the first that is not comes back instead. Else (pieces, nbytes): the reply as
   wire.pieces makes it (length, header, padding and each tensor's own array), and its size.

   In Python the same request makes a call per dense part, per table and per reply tensor, each
   with its arrays, dicts and argument parsing around it: about twice the CPU of the kernels
   themselves, which the PS spends on every request a worker sends. */

static PyObject *np_empty_like, *np_empty;

#define WIRE_ALIGN 64 /* runtime/wire.py's ALIGN: each tensor of a message starts on such a boundary */

static int apply_setup(void) {
    if (np_empty) return 0;
    if (parse_setup() < 0) return -1;
    PyObject *np = PyImport_ImportModule("numpy");
    if (!np) return -1;
    np_empty_like = PyObject_GetAttrString(np, "empty_like");
    np_empty = np_empty_like ? PyObject_GetAttrString(np, "empty") : NULL;
    Py_DECREF(np);
    if (!np_empty) {
        Py_CLEAR(np_empty_like);
        return -1;
    }
    return 0;
}

/* A reply's header, written as orjson writes it. */
typedef struct {
    char *p;
    size_t n, cap;
} Text;

static int text_add(Text *t, const char *s, size_t n) {
    if (t->n + n > t->cap) {
        size_t cap = t->cap ? t->cap : 1024;
        while (cap < t->n + n) cap *= 2;
        char *grown = PyMem_Realloc(t->p, cap);
        if (!grown) {
            PyErr_NoMemory();
            return -1;
        }
        t->p = grown;
        t->cap = cap;
    }
    memcpy(t->p + t->n, s, n);
    t->n += n;
    return 0;
}

static int text_int(Text *t, Py_ssize_t v) {
    char digits[32];
    int k = snprintf(digits, sizeof digits, "%zd", v);
    return text_add(t, digits, (size_t)k);
}

/* `name` as a JSON string (quotes, backslashes and control characters escaped). */
static int text_str(Text *t, PyObject *name) {
    Py_ssize_t n;
    const char *s = PyUnicode_AsUTF8AndSize(name, &n);
    if (!s || text_add(t, "\"", 1) < 0) return -1;
    for (Py_ssize_t i = 0; i < n; i++) {
        unsigned char c = (unsigned char)s[i];
        char esc[8];
        if (c == '"' || c == '\\') {
            esc[0] = '\\', esc[1] = (char)c;
            if (text_add(t, esc, 2) < 0) return -1;
        } else if (c < 0x20) {
            snprintf(esc, sizeof esc, "\\u%04x", c);
            if (text_add(t, esc, 6) < 0) return -1;
        } else if (text_add(t, s + i, 1) < 0) {
            return -1;
        }
    }
    return text_add(t, "\"", 1);
}

/* One table's update: its buffers, held from the checks until the update is done. */
typedef struct {
    Buf bufs[NBUFS];
    Rows r;
} RowJob;

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

static void rows_update(int opt, Rows r, const float *h) {
    switch (opt) {
    case 0: sgd_rows(r, h[0]); break;
    case 1: momentum_rows(r, h[0], h[1]); break;
    case 2: adam_rows(r, h[0], h[1], h[2], h[3]); break;
    default: adagrad_rows(r, h[0], h[1]); break;
    }
}

/* 0 when `opt` is an optimizer and `slots` (a tuple) holds as many things as it has slots; else -1 with a ValueError. */
static int optimizer_slots(int opt, PyObject *slots, const char *what) {
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
static int row_job(PyObject *slot_names, PyObject *var, PyObject *mine, PyObject *rows, PyObject *grad, RowJob *job) {
    PyObject *s[2] = {NULL, NULL};
    if (slot_arrays(slot_names, mine, s) < 0) return -1;
    return unpack(var, s[0], s[1], rows, grad, job->bufs, &job->r);
}

/* One dense part's update into new arrays: `var` and its slots (`mine`) with the gradient
   (grad + plus) * scale (plus: NULL or None for none). *out: the new variable, *fresh: {slot
   name: its new array} (new references). 1 when the gradient was finite, 0 when not (its new
   arrays are then not to be used), -1 with an error set. */
static int dense_part(int opt, const float *h, PyObject *slot_names, PyObject *var, PyObject *mine, PyObject *grad,
                      PyObject *plus, float scale, PyObject **out, PyObject **fresh) {
    PyObject *o[NDENSE] = {var, grad}, *s[2] = {NULL, NULL}, *made[2] = {NULL, NULL};
    int finite = -1;
    *out = *fresh = NULL;
    if (slot_arrays(slot_names, mine, s) < 0 || !(*out = PyObject_CallOneArg(np_empty_like, var)) || !(*fresh = PyDict_New()))
        goto done;
    o[2] = *out;
    o[PLUS] = plus;
    for (int i = 0; i < SLOTS_OF[opt]; i++) {
        if (!(made[i] = PyObject_CallOneArg(np_empty_like, var)) ||
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
static PyObject *update_dense(PyObject *self, PyObject *args) {
    int opt;
    float h[4], scale = 1;
    PyObject *slot_names, *var, *mine, *grad, *plus = NULL, *out, *fresh;
    if (!PyArg_ParseTuple(args, "i(ffff)O!OOO|Of", &opt, &h[0], &h[1], &h[2], &h[3], &PyTuple_Type, &slot_names, &var, &mine,
                          &grad, &plus, &scale))
        return NULL;
    if (optimizer_slots(opt, slot_names, "update_dense") < 0 || apply_setup() < 0) return NULL;
    int finite = dense_part(opt, h, slot_names, var, mine, grad, plus, scale, &out, &fresh);
    return finite < 0 ? NULL : Py_BuildValue("(ONN)", finite ? Py_True : Py_False, out, fresh);
}

/* update_rows(opt, h, slot_names, table, slots, rows, grad): the optimizer's update of the `rows`
   (int64, each once, inside the table) of `table` and of its slots ({slot name: array}), in place,
   with their gradients (a row each). */
static PyObject *update_rows(PyObject *self, PyObject *args) {
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

/* Append the tensor `arr` (named `name`; float32 or int64) to a message's `pieces` and its entry to
   `head`, after the padding that starts it on an ALIGN boundary of the message's tensors (`offset`:
   their bytes so far): its bytes as one flat memoryview (`as_bytes`, as wire.pieces gives them) or
   as `arr` itself (a reply that only a socket sends). 0, or -1 with an error set. */
static int message_tensor(PyObject *pieces, Text *head, PyObject *name, PyObject *arr, Py_ssize_t *offset, int first,
                          int as_bytes) {
    static const char zeros[WIRE_ALIGN] = {0};
    Buf b = {0};
    PyObject *bytes = NULL;
    if (get(arr, &b, "fq", -1, 0, "tensor") < 0) goto fail;
    if (!b.view.ndim && as_bytes) {
        PyErr_SetString(PyExc_TypeError, "tensor: a 0-d array"); /* wire.pieces sends its bytes its own way */
        goto fail;
    }
    int is_float = b.view.itemsize == 4;
    if ((!first && text_add(head, ",", 1) < 0) || text_add(head, "[", 1) < 0 || text_str(head, name) < 0 ||
        text_add(head, is_float ? ",\"float32\",[" : ",\"int64\",[", is_float ? 12 : 10) < 0)
        goto fail;
    for (int i = 0; i < b.view.ndim; i++)
        if ((i && text_add(head, ",", 1) < 0) || text_int(head, b.view.shape[i]) < 0) goto fail;
    if (text_add(head, "],", 2) < 0 || text_int(head, b.view.len) < 0 || text_add(head, "]", 1) < 0) goto fail;
    Py_ssize_t pad = (WIRE_ALIGN - *offset % WIRE_ALIGN) % WIRE_ALIGN;
    if (pad) {
        PyObject *z = PyBytes_FromStringAndSize(zeros, pad);
        if (!z || PyList_Append(pieces, z) < 0) {
            Py_XDECREF(z);
            goto fail;
        }
        Py_DECREF(z);
    }
    if (b.view.len) {
        PyObject *view = as_bytes ? PyMemoryView_FromObject(arr) : NULL;
        bytes = as_bytes ? (view ? PyObject_CallMethod(view, "cast", "s", "B") : NULL) : Py_NewRef(arr);
        Py_XDECREF(view);
        if (!bytes || PyList_Append(pieces, bytes) < 0) goto fail;
    }
    *offset += pad + b.view.len;
    Py_XDECREF(bytes);
    release(&b, 1);
    return 0;
fail:
    Py_XDECREF(bytes);
    release(&b, 1);
    return -1;
}

/* The header's start: `{"meta":<meta>,"tensors":[` (meta: JSON bytes). */
static int head_start(Text *head, PyObject *meta) {
    return text_add(head, "{\"meta\":", 8) < 0 || text_add(head, PyBytes_AS_STRING(meta), PyBytes_GET_SIZE(meta)) < 0 ||
                   text_add(head, ",\"tensors\":[", 12) < 0
               ? -1
               : 0;
}

/* The header's end, its padding and its length put before it in `pieces`: 0, or -1 with an error set. */
static int head_finish(PyObject *pieces, Text *head) {
    char tail[32];
    int tail_n = snprintf(tail, sizeof tail, "],\"align\":%d}", WIRE_ALIGN);
    if (text_add(head, tail, (size_t)tail_n) < 0) return -1;
    while ((4 + head->n) % WIRE_ALIGN)
        if (text_add(head, " ", 1) < 0) return -1;
    uint32_t hlen = (uint32_t)head->n; /* little-endian, as every machine this runs on */
    PyObject *length = PyBytes_FromStringAndSize((const char *)&hlen, 4), *text = PyBytes_FromStringAndSize(head->p, head->n);
    int framed = length && text && PyList_Insert(pieces, 0, text) == 0 && PyList_Insert(pieces, 0, length) == 0;
    Py_XDECREF(length);
    Py_XDECREF(text);
    return framed ? 0 : -1;
}

/* encode_message(meta, tensors) -> wire.pieces' output for a message whose tensors are all NumPy
   arrays (the type itself), C-contiguous, of at least one dimension, float32 or int64, and whose
   names are strings; None for any other (wire.pieces then encodes it). meta: its JSON. */
static PyObject *encode_message(PyObject *self, PyObject *args) {
    PyObject *meta, *tensors;
    if (!PyArg_ParseTuple(args, "SO!", &meta, &PyDict_Type, &tensors)) return NULL;
    if (parse_setup() < 0) return NULL;
    PyObject *pieces = PyList_New(0), *name, *arr, *result = NULL;
    Text head = {0};
    Py_ssize_t pos = 0, offset = 0;
    if (!pieces || head_start(&head, meta) < 0) goto fail;
    for (int first = 1; PyDict_Next(tensors, &pos, &name, &arr); first = 0) {
        if (!PyUnicode_CheckExact(name) || Py_TYPE(arr) != (PyTypeObject *)np_ndarray) DECLINE;
        if (message_tensor(pieces, &head, name, arr, &offset, first, 1) < 0) {
            if (!PyErr_ExceptionMatches(PyExc_TypeError) && !PyErr_ExceptionMatches(PyExc_ValueError) &&
                !PyErr_ExceptionMatches(PyExc_BufferError))
                goto fail;
            PyErr_Clear(); /* not contiguous, or of another dtype */
            DECLINE;
        }
    }
    if (head_finish(pieces, &head) < 0) goto fail;
    result = Py_NewRef(pieces);
    goto done;
decline:
    result = Py_NewRef(Py_None);
    goto done;
fail:
    result = NULL;
done:
    PyMem_Free(head.p);
    Py_XDECREF(pieces);
    return result;
}

/* A new (k, d) float32 array of the `rows` of 2-D `table`. */
static PyObject *gathered(PyObject *table, PyObject *rows) {
    Buf b[3] = {0};
    PyObject *out = NULL;
    if (get(table, &b[0], "f", 2, 0, "table") < 0 || get(rows, &b[1], "q", 1, 0, "rows") < 0) goto fail;
    Py_ssize_t n = b[0].view.shape[0], d = b[0].view.shape[1], k = b[1].view.shape[0];
    const float *t = b[0].view.buf;
    const int64_t *r = b[1].view.buf;
    if (rows_inside(r, k, n) < 0) goto fail;
    out = PyObject_CallFunction(np_empty, "(nn)O", k, d, np_float32);
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

static PyObject *apply_async(PyObject *self, PyObject *args) {
    int opt;
    float h[4] = {0};
    PyObject *slot_names, *vars, *slots, *dense, *sparse, *rows, *reply_dense, *meta;
    if (!PyArg_ParseTuple(args, "i(ffff)O!O!O!O!O!O!O!S", &opt, &h[0], &h[1], &h[2], &h[3], &PyTuple_Type, &slot_names,
                          &PyDict_Type, &vars, &PyDict_Type, &slots, &PyDict_Type, &dense, &PyDict_Type, &sparse,
                          &PyDict_Type, &rows, &PyTuple_Type, &reply_dense, &meta))
        return NULL;
    if (optimizer_slots(opt, slot_names, "apply_async") < 0) return NULL;
    if (apply_setup() < 0) return NULL;
    Py_ssize_t njobs = PyDict_GET_SIZE(sparse), done_jobs = 0;
    RowJob *jobs = PyMem_Calloc(njobs ? njobs : 1, sizeof(RowJob));
    PyObject *made = PyList_New(0), *pieces = NULL, *result = NULL;
    Text head = {0};
    if (!jobs || !made) {
        if (!jobs) PyErr_NoMemory();
        goto fail;
    }
    Py_ssize_t pos = 0;
    PyObject *name, *value;

    /* every table's arrays checked before anything changes */
    while (PyDict_Next(sparse, &pos, &name, &value)) {
        PyObject *var = PyDict_GetItemWithError(vars, name), *mine = var ? PyDict_GetItemWithError(slots, name) : NULL;
        if (!mine || !PyTuple_Check(value) || PyTuple_GET_SIZE(value) != 2) {
            if (!PyErr_Occurred()) PyErr_SetString(PyExc_ValueError, "apply_async: a table's (indices, values) the shard holds");
            goto fail;
        }
        if (row_job(slot_names, var, mine, PyTuple_GET_ITEM(value, 0), PyTuple_GET_ITEM(value, 1), &jobs[done_jobs++]) < 0) goto fail;
    }

    /* each dense part's new arrays, kept only once every gradient is known finite */
    pos = 0;
    while (PyDict_Next(dense, &pos, &name, &value)) {
        PyObject *var = PyDict_GetItemWithError(vars, name), *mine = var ? PyDict_GetItemWithError(slots, name) : NULL;
        if (!mine) {
            if (!PyErr_Occurred()) PyErr_SetString(PyExc_KeyError, "apply_async: a dense part the shard does not hold");
            goto fail;
        }
        PyObject *out, *fresh;
        int finite = dense_part(opt, h, slot_names, var, mine, value, NULL, 1, &out, &fresh);
        PyObject *entry = finite < 0 ? NULL : Py_BuildValue("(ONN)", name, out, fresh);
        int appended = entry ? PyList_Append(made, entry) : -1;
        Py_XDECREF(entry);
        if (appended < 0) goto fail;
        if (!finite) {
            result = Py_NewRef(name);
            goto done;
        }
    }
    for (Py_ssize_t i = 0; i < PyList_GET_SIZE(made); i++) {
        PyObject *entry = PyList_GET_ITEM(made, i), *part = PyTuple_GET_ITEM(entry, 0);
        if (PyDict_SetItem(vars, part, PyTuple_GET_ITEM(entry, 1)) < 0 ||
            PyDict_Update(PyDict_GetItem(slots, part), PyTuple_GET_ITEM(entry, 2)) < 0)
            goto fail;
    }
    for (Py_ssize_t j = 0; j < njobs; j++) rows_update(opt, jobs[j].r, h);

    /* the reply: the dense parts asked for, then each table's rows asked for */
    Py_ssize_t offset = 0;
    int first = 1;
    pieces = PyList_New(0);
    if (!pieces || head_start(&head, meta) < 0) goto fail;
    for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(reply_dense); i++, first = 0) {
        PyObject *part = PyTuple_GET_ITEM(reply_dense, i), *arr = PyDict_GetItemWithError(vars, part);
        if (!arr) {
            if (!PyErr_Occurred()) PyErr_SetString(PyExc_KeyError, "apply_async: a dense part to reply the shard does not hold");
            goto fail;
        }
        if (message_tensor(pieces, &head, part, arr, &offset, first, 0) < 0) goto fail;
    }
    pos = 0;
    while (PyDict_Next(rows, &pos, &name, &value)) {
        PyObject *table = PyDict_GetItemWithError(vars, name);
        if (!table) {
            if (!PyErr_Occurred()) PyErr_SetString(PyExc_KeyError, "apply_async: rows of a table the shard does not hold");
            goto fail;
        }
        PyObject *out = gathered(table, value), *key = out ? PyUnicode_FromFormat("%U:rows", name) : NULL;
        int ok = key && message_tensor(pieces, &head, key, out, &offset, first, 0) == 0;
        Py_XDECREF(out);
        Py_XDECREF(key);
        if (!ok) goto fail;
        first = 0;
    }
    if (head_finish(pieces, &head) < 0) goto fail;
    result = Py_BuildValue("(On)", pieces, (Py_ssize_t)(4 + head.n) + offset);
    goto done;
fail:
    result = NULL;
done:
    for (Py_ssize_t j = 0; j < done_jobs; j++) release(jobs[j].bufs, NBUFS);
    PyMem_Free(jobs);
    PyMem_Free(head.p);
    Py_XDECREF(made);
    Py_XDECREF(pieces);
    return result;
}

static PyMethodDef methods[] = {
    {"finite", all_finite, METH_O, "finite(float32 array) -> no NaN and no Inf in it?"},
    {"check_rows", check_rows, METH_VARARGS, "check_rows(rows, n) -> strictly increasing?; ValueError outside 0..n-1"},
    {"take", take, METH_VARARGS, "take(table, rows, out): out[i] = table[rows[i]]"},
    {"segment_sum", segment_sum, METH_VARARGS, "segment_sum(values, indices, out): out = 0; out[indices[i]] += values[i]"},
    {"unique", unique, METH_VARARGS, "unique(ids, uniq, inverse) -> k: uniq[:k] the distinct ids, increasing; ids == uniq[inverse]"},
    {"put_back", put_back, METH_VARARGS, "put_back(block, lo, [(rows, values, ...)]): block[r - lo] = the row's value, for rows in the block"},
    {"update_rows", update_rows, METH_VARARGS, "update_rows(opt, h, table, slots, rows, grad): the optimizer's update of those rows, in place"},
    {"update_dense", update_dense, METH_VARARGS,
     "update_dense(opt, h, var, grad, out, slots, slots_out[, plus, scale]) -> was the gradient finite?"},
    {"to_bfloat16", to_bfloat16, METH_VARARGS, "to_bfloat16(float32 array, uint16 array): its bfloat16 bits, rounded to nearest even"},
    {"from_bfloat16", from_bfloat16, METH_VARARGS, "from_bfloat16(uint16 array of bfloat16 bits, float32 array)"},
    {"read_header", read_header, METH_VARARGS, "read_header(view, total) -> wire.header's (meta, places), or None"},
    {"encode_message", encode_message, METH_VARARGS, "encode_message(meta JSON, tensors) -> wire.pieces' output, or None"},
    {"parse_request", parse_request, METH_VARARGS, "parse_request(data, layout, check_dense) -> (meta, dense, sparse, rows), or None"},
    {"apply_async", apply_async, METH_VARARGS,
     "apply_async(opt, h, slot_names, vars, slots, dense, sparse, rows, reply_dense, meta) -> (pieces, nbytes), or the name of a non-finite dense gradient"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_rows", "A PS's update kernels, a worker's id numbering and row sums, the wire's framing (runtime/_rows.c).", -1,
                                    methods};

PyMODINIT_FUNC PyInit__rows(void) { return PyModule_Create(&module); }
