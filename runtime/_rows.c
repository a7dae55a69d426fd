/* A PS's embedding-row kernels: the row check of a request and the optimizer updates of the
   rows it touches, each one pass in C.

   In NumPy an update of k rows is a gather of the rows (and of each slot's rows), several
   whole-array passes over the gathered copies and a scatter back, with a return to the
   interpreter between each; a row check is three reductions. The rows are scattered over a
   table of hundreds of MiB, so the loops here ask for the rows a few iterations ahead
   (their cache misses overlap instead of waiting in turn).

   Each float operation is the one NumPy's update does, in the same order (runtime/optimizers.py;
   built with -ffp-contract=off), so a row comes out bit for bit as a dense update would leave it.
   The arguments are any C-contiguous buffers (NumPy arrays): tables and gradients float32 and
   2-D, rows int64 and 1-D; no NumPy headers are needed to build. */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

#define AHEAD 8 /* rows prefetched ahead of the one being updated */

typedef struct {
    Py_buffer view;
    int held;
} Buf;

static void release(Buf *bufs, int n) {
    for (int i = 0; i < n; i++)
        if (bufs[i].held) PyBuffer_Release(&bufs[i].view);
}

/* `obj` as a C-contiguous buffer of `ndim` dimensions whose items have the struct format `fmt`
   ("f": float32, "q": int64); -1 with a TypeError when it is not. */
static int get(PyObject *obj, Buf *b, const char *fmt, int ndim, int writable, const char *what) {
    int flags = PyBUF_C_CONTIGUOUS | PyBUF_FORMAT | (writable ? PyBUF_WRITABLE : 0);
    if (PyObject_GetBuffer(obj, &b->view, flags) < 0) return -1;
    b->held = 1;
    const char *f = b->view.format ? b->view.format : "B";
    if (*f == '<' || *f == '=' || *f == '@') f++;
    int same = strcmp(f, fmt) == 0 || (fmt[0] == 'q' && strcmp(f, "l") == 0 && sizeof(long) == 8);
    if (!same || b->view.ndim != ndim) {
        PyErr_Format(PyExc_TypeError, "%s: expected a %d-D array of %s, got %d-D of format '%s'", what, ndim,
                     fmt[0] == 'f' ? "float32" : "int64", b->view.ndim, f);
        return -1;
    }
    return 0;
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
    const int64_t *r = b.view.buf;
    Py_ssize_t k = b.view.shape[0];
    int increasing = 1, outside = 0;
    int64_t prev = -1;
    for (Py_ssize_t i = 0; i < k; i++) {
        outside |= (r[i] < 0) | (r[i] >= n);
        increasing &= r[i] > prev;
        prev = r[i];
    }
    release(&b, 1);
    if (outside) {
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

/* The loop every update shares: for each row i, `body` with w (the table's row), a and b (the
   slots' rows, or NULL) and g (its gradient), the GIL released. */
#define FOR_EACH_ROW(body)                                                        \
    Py_BEGIN_ALLOW_THREADS for (Py_ssize_t i = 0; i < r.k; i++) {                 \
        PREFETCH(r.var, i);                                                       \
        PREFETCH(r.s1, i);                                                        \
        PREFETCH(r.s2, i);                                                        \
        float *w = ROW(r.var, i), *a = r.s1 ? ROW(r.s1, i) : NULL, *b = r.s2 ? ROW(r.s2, i) : NULL; \
        const float *g = GRAD(i);                                                 \
        (void)a;                                                                  \
        (void)b;                                                                  \
        for (Py_ssize_t j = 0; j < r.d; j++) { body; }                           \
    }                                                                             \
    Py_END_ALLOW_THREADS

/* sgd(table, rows, grad, lr): w -= g*lr */
static PyObject *sgd(PyObject *self, PyObject *args) {
    PyObject *var, *rows, *grad;
    float lr;
    Buf bufs[NBUFS] = {0};
    Rows r;
    if (!PyArg_ParseTuple(args, "OOOf", &var, &rows, &grad, &lr)) return NULL;
    if (unpack(var, NULL, NULL, rows, grad, bufs, &r) < 0) goto fail;
    FOR_EACH_ROW(w[j] -= g[j] * lr);
    release(bufs, NBUFS);
    Py_RETURN_NONE;
fail:
    release(bufs, NBUFS);
    return NULL;
}

/* momentum(table, accum, rows, grad, lr, mu): a = a*mu + g; w -= a*lr */
static PyObject *momentum(PyObject *self, PyObject *args) {
    PyObject *var, *acc, *rows, *grad;
    float lr, mu;
    Buf bufs[NBUFS] = {0};
    Rows r;
    if (!PyArg_ParseTuple(args, "OOOOff", &var, &acc, &rows, &grad, &lr, &mu)) return NULL;
    if (unpack(var, acc, NULL, rows, grad, bufs, &r) < 0) goto fail;
    FOR_EACH_ROW(a[j] = a[j] * mu + g[j]; w[j] -= a[j] * lr);
    release(bufs, NBUFS);
    Py_RETURN_NONE;
fail:
    release(bufs, NBUFS);
    return NULL;
}

/* adam(table, m, v, rows, grad, b1, b2, rate, eps), rate = lr*sqrt(1-b2^t)/(1-b1^t):
   m = m*b1 + g*(1-b1); v = v*b2 + g²*(1-b2); w -= m/(sqrt(v)+eps)*rate */
static PyObject *adam(PyObject *self, PyObject *args) {
    PyObject *var, *m, *v, *rows, *grad;
    float b1, b2, rate, eps;
    Buf bufs[NBUFS] = {0};
    Rows r;
    if (!PyArg_ParseTuple(args, "OOOOOffff", &var, &m, &v, &rows, &grad, &b1, &b2, &rate, &eps)) return NULL;
    if (unpack(var, m, v, rows, grad, bufs, &r) < 0) goto fail;
    const float c1 = 1 - b1, c2 = 1 - b2;
    FOR_EACH_ROW(a[j] = a[j] * b1 + g[j] * c1; b[j] = b[j] * b2 + g[j] * g[j] * c2;
                 w[j] -= a[j] / (sqrtf(b[j]) + eps) * rate);
    release(bufs, NBUFS);
    Py_RETURN_NONE;
fail:
    release(bufs, NBUFS);
    return NULL;
}

/* adagrad(table, accum, rows, grad, lr, eps): a = g² + a; w -= g/(sqrt(a)+eps)*lr */
static PyObject *adagrad(PyObject *self, PyObject *args) {
    PyObject *var, *acc, *rows, *grad;
    float lr, eps;
    Buf bufs[NBUFS] = {0};
    Rows r;
    if (!PyArg_ParseTuple(args, "OOOOff", &var, &acc, &rows, &grad, &lr, &eps)) return NULL;
    if (unpack(var, acc, NULL, rows, grad, bufs, &r) < 0) goto fail;
    FOR_EACH_ROW(a[j] = g[j] * g[j] + a[j]; w[j] -= g[j] / (sqrtf(a[j]) + eps) * lr);
    release(bufs, NBUFS);
    Py_RETURN_NONE;
fail:
    release(bufs, NBUFS);
    return NULL;
}

/* take(table, rows, out): out[i] = table[rows[i]], the rows asked for ahead (a reply's rows;
   NumPy's take waits for each row's cache misses in turn). Rows must be inside the table. */
static PyObject *take(PyObject *self, PyObject *args) {
    PyObject *var, *rows, *out;
    Buf bufs[3] = {0};
    if (!PyArg_ParseTuple(args, "OOO", &var, &rows, &out)) return NULL;
    if (get(var, &bufs[0], "f", 2, 0, "table") < 0 || get(rows, &bufs[1], "q", 1, 0, "rows") < 0 ||
        get(out, &bufs[2], "f", 2, 1, "out") < 0)
        goto fail;
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
    Py_BEGIN_ALLOW_THREADS for (Py_ssize_t i = 0; i < k; i++) {
        if (i + AHEAD < k)
            for (Py_ssize_t j = 0; j < d; j += 64 / sizeof(float)) __builtin_prefetch(t + r[i + AHEAD] * d + j, 0, 0);
        memcpy(o + i * d, t + r[i] * d, d * sizeof(float));
    }
    Py_END_ALLOW_THREADS
    release(bufs, 3);
    Py_RETURN_NONE;
fail:
    release(bufs, 3);
    return NULL;
}

static PyMethodDef methods[] = {
    {"check_rows", check_rows, METH_VARARGS, "check_rows(rows, n) -> strictly increasing?; ValueError outside 0..n-1"},
    {"take", take, METH_VARARGS, "take(table, rows, out): out[i] = table[rows[i]]"},
    {"sgd", sgd, METH_VARARGS, "sgd(table, rows, grad, lr)"},
    {"momentum", momentum, METH_VARARGS, "momentum(table, accum, rows, grad, lr, mu)"},
    {"adam", adam, METH_VARARGS, "adam(table, m, v, rows, grad, b1, b2, rate, eps)"},
    {"adagrad", adagrad, METH_VARARGS, "adagrad(table, accum, rows, grad, lr, eps)"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_rows", "A PS's embedding-row kernels (runtime/_rows.c).", -1,
                                    methods};

PyMODINIT_FUNC PyInit__rows(void) { return PyModule_Create(&module); }
