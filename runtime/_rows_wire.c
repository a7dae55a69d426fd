/* The wire's half of tfps.runtime._rows (runtime/wire.py's format): a message's header read, a
   Step request's tensors checked and taken as views of its bytes, a message framed, and an async
   push applied and its reply framed in one call. The kernels it calls are runtime/_rows.c's.

   Everything here reads bytes that came from the network. The readers take only what wire.py's
   Python takes, and decline (None) anything else, a malformed message included, so that wire.py
   and runtime/ps.py say what is wrong with it: a message is read by one set of rules, whichever
   side reads it. Before a tensor's bytes are read as floats or integers, its place is checked to
   lie inside the message and to be aligned for its items. */
#include "_rows.h"

#include <string.h>

#define DECLINE goto decline
#define ENTRY_DIMS 8 /* the dimensions a tensor may have for the C readers (wire.py takes up to WIRE_MAX_DIMS) */

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
   reshape would make two arrays, for each of a request's tensors). */
static PyObject *view_at(const State *st, PyObject *data, PyObject *dtype, Py_ssize_t n, Py_ssize_t offset,
                         Py_ssize_t rows, Py_ssize_t cols, PyObject *shape) {
    PyObject *dims = shape ? Py_NewRef(shape) : cols < 0 ? Py_BuildValue("(n)", n) : Py_BuildValue("(nn)", rows, cols);
    if (!dims) return NULL;
    PyObject *out = PyObject_CallFunction(st->ndarray, "OOOn", dims, dtype, data, offset);
    Py_DECREF(dims);
    return out;
}


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

/* The header of the message in buf[0:len], a message of `total` bytes: 1 read, 0 declined, -1 an
   error. Its length and its count of tensors are checked before anything grows with them. */
static int read_head(const State *st, const char *buf, Py_ssize_t len, Py_ssize_t total, Header *h) {
    h->head = NULL;
    if (!st->json_loads || len < 4) return 0;
    uint32_t hlen;
    memcpy(&hlen, buf, 4); /* little-endian (_rows.h) */
    if (hlen > WIRE_MAX_HEADER_BYTES) return 0;
    h->start = 4 + (Py_ssize_t)hlen;
    if (h->start > len || h->start > total) return 0;
    PyObject *text = PyBytes_FromStringAndSize(buf + 4, hlen);
    if (!text) return -1;
    PyObject *head = PyObject_CallOneArg(st->json_loads, text);
    Py_DECREF(text);
    if (!head) {
        if (!PyErr_ExceptionMatches(PyExc_ValueError)) return -1; /* orjson's JSONDecodeError is one */
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
        h->align > 4096 || PyList_GET_SIZE(h->entries) > WIRE_MAX_TENSORS) {
        Py_DECREF(head);
        return 0;
    }
    h->head = head;
    return 1;
}

/* One tensor's entry, [name, dtype, shape, nbytes]: its parts borrowed from the header. */
typedef struct {
    PyObject *name, *shape;
    int is_float;            /* float32, else int64 */
    Py_ssize_t itemsize;     /* 4 or 8 */
    Py_ssize_t ndim, items, nbytes, dims[ENTRY_DIMS];
} Entry;

/* 1 when `obj` is the entry of a float32 or int64 tensor of at most ENTRY_DIMS dimensions whose
   bytes match its shape, else 0. */
static int read_entry(PyObject *obj, Entry *t) {
    if (!PyList_CheckExact(obj) || PyList_GET_SIZE(obj) != 4) return 0;
    PyObject *wire_dtype = PyList_GET_ITEM(obj, 1);
    t->name = PyList_GET_ITEM(obj, 0);
    t->shape = PyList_GET_ITEM(obj, 2);
    if (!PyUnicode_CheckExact(t->name) || !PyUnicode_CheckExact(wire_dtype) || !PyList_CheckExact(t->shape)) return 0;
    t->is_float = PyUnicode_CompareWithASCIIString(wire_dtype, "float32") == 0;
    if (!t->is_float && PyUnicode_CompareWithASCIIString(wire_dtype, "int64") != 0) return 0;
    t->itemsize = t->is_float ? 4 : 8;
    t->ndim = PyList_GET_SIZE(t->shape);
    t->items = 1;
    if (t->ndim > ENTRY_DIMS) return 0;
    for (Py_ssize_t i = 0; i < t->ndim; i++) {
        t->dims[i] = count_of(PyList_GET_ITEM(t->shape, i));
        if (t->dims[i] < 0 || __builtin_mul_overflow(t->items, t->dims[i], &t->items)) return 0;
    }
    Py_ssize_t nbytes;
    t->nbytes = count_of(PyList_GET_ITEM(obj, 3));
    return !__builtin_mul_overflow(t->items, t->itemsize, &nbytes) && t->nbytes == nbytes;
}

/* Where the next tensor starts, from `offset` (the end of the one before) and the message's
   alignment: 0 and *at set when it has room for `nbytes` in a message of `total` bytes; -1 when
   not. (Where it lies in memory is its reader's to check: read_header reads no tensor, and
   wire.tensor_at copies one that lies misaligned.) */
static int place_of(Py_ssize_t offset, Py_ssize_t align, Py_ssize_t nbytes, Py_ssize_t total, Py_ssize_t *at) {
    Py_ssize_t pad = (align - offset % align) % align;
    if (offset > total || pad > total - offset) return -1; /* compared, not added: no overflow near the limit */
    offset += pad;
    if (nbytes > total - offset) return -1;
    *at = offset;
    return 0;
}

/* read_header(view, total) -> wire.header's (meta, places) for a message of `total` bytes whose
   first bytes `view` holds, or None (wire.header then reads it). */
PyObject *read_header(PyObject *module, PyObject *args) {
    const State *st = state_of(module);
    PyObject *data;
    Py_ssize_t total;
    if (!PyArg_ParseTuple(args, "On", &data, &total)) return NULL;
    Py_buffer v;
    if (PyObject_GetBuffer(data, &v, PyBUF_SIMPLE) < 0) return NULL;
    PyObject *places = NULL, *result = NULL;
    Header h;
    int read = read_head(st, v.buf, v.len, total, &h);
    if (read <= 0) {
        PyBuffer_Release(&v);
        return read < 0 ? NULL : Py_NewRef(Py_None);
    }
    Py_ssize_t count = PyList_GET_SIZE(h.entries), offset = h.start;
    if (!(places = PyList_New(count))) goto fail;
    for (Py_ssize_t e = 0; e < count; e++) {
        Entry t;
        if (!read_entry(PyList_GET_ITEM(h.entries, e), &t) || place_of(offset, h.align, t.nbytes, total, &offset) < 0)
            DECLINE;
        PyObject *shape = PyTuple_New(t.ndim);
        if (!shape) goto fail;
        for (Py_ssize_t i = 0; i < t.ndim; i++) PyTuple_SET_ITEM(shape, i, Py_NewRef(PyList_GET_ITEM(t.shape, i)));
        PyObject *place = Py_BuildValue("(OONnn)", t.name, t.is_float ? st->float32 : st->int64, shape, offset, t.nbytes);
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


/* ---- a Step request's common shape, decoded and checked in one call ----------------------

   parse_request(data, layout, check_dense) decodes a wire message whose every tensor is one the
   shard expects, as a worker sends it: its dense gradients (float32, the part's shape; with
   check_dense free of NaN and Inf), each table's rows as indices (int64, strictly increasing,
   inside the table) followed by their gradients (float32, finite), and the rows it asks for
   (int64, inside the table). It returns (meta, dense, sparse, rows): the header's meta, {part:
   gradient}, {part: (indices, gradients)} and {part: rows}, each tensor a NumPy view of `data`.
   Anything else (a message malformed in any way, a tensor not aligned in memory, bfloat16
   gradients, repeated or unsorted rows, an unknown name) gives None, and the shard's Python
   checks, which name what is wrong, take the message instead: this is the fast path of the
   requests the PS answers all the time, never a second set of rules. `layout` maps each tensor
   name the shard accepts to (kind, part, shape): kind 0 a dense part (shape: its shape), 1 a
   table's indices, 2 their gradients, 3 the rows asked for (shape: the table's (rows, width)). */

PyObject *parse_request(PyObject *module, PyObject *args) {
    const State *st = state_of(module);
    PyObject *data, *layout;
    int check_dense;
    if (!PyArg_ParseTuple(args, "OO!p", &data, &PyDict_Type, &layout, &check_dense)) return NULL;
    Py_buffer v;
    if (PyObject_GetBuffer(data, &v, PyBUF_SIMPLE) < 0) return NULL;
    PyObject *head = NULL, *dense = NULL, *sparse = NULL, *pulled = NULL, *indices = NULL, *result = NULL;
    const char *buf = v.buf;
    Py_ssize_t total = v.len;
    Header h;
    int read = read_head(st, buf, total, total, &h);
    if (read < 0) goto fail;
    if (!read) DECLINE;
    head = h.head;
    PyObject *meta = h.meta, *entries = h.entries;
    dense = PyDict_New();
    sparse = PyDict_New();
    pulled = PyDict_New();
    indices = PyDict_New(); /* part -> its indices, until their gradients come */
    if (!dense || !sparse || !pulled || !indices) goto fail;
    Py_ssize_t offset = h.start, count = PyList_GET_SIZE(entries);
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
        if (t.is_float != (kind == 0 || kind == 2)) DECLINE;
        Py_ssize_t ndim = t.ndim, items = t.items, nbytes = t.nbytes, *dims = t.dims;
        if (place_of(offset, h.align, nbytes, total, &offset) < 0) DECLINE;
        const char *at = buf + offset;
        if ((uintptr_t)at & (uintptr_t)(t.itemsize - 1)) DECLINE; /* read as floats or integers below: aligned only */
        Py_ssize_t table_rows = 0, width = 0;
        if (kind != 0 && !PyArg_ParseTuple(want, "nn", &table_rows, &width)) goto fail;
        PyObject *arr = NULL, *target = NULL, *key = part;
        if (kind == 0) { /* a dense gradient: the part's shape exactly */
            if (!PyTuple_CheckExact(want) || PyTuple_GET_SIZE(want) != ndim) DECLINE;
            for (Py_ssize_t i = 0; i < ndim; i++) {
                Py_ssize_t dim = PyLong_AsSsize_t(PyTuple_GET_ITEM(want, i));
                if (dim == -1 && PyErr_Occurred()) goto fail;
                if (dim != dims[i]) DECLINE;
            }
            if (check_dense && !finite_floats((const float *)at, items)) DECLINE;
            arr = view_at(st, data, st->float32, items, offset, 0, -1, ndim == 1 ? NULL : want); /* 1-D: no reshape */
            target = dense;
        } else if (kind == 1 || kind == 3) { /* rows: 1-D, inside the table; a push's strictly increasing */
            int increasing;
            if (ndim != 1 || !scan_rows((const int64_t *)at, items, table_rows, &increasing) || (kind == 1 && !increasing))
                DECLINE;
            arr = view_at(st, data, st->int64, items, offset, 0, -1, NULL);
            target = kind == 1 ? indices : pulled;
        } else { /* gradients of the indices that came just before them */
            PyObject *idx = PyDict_GetItemWithError(indices, part);
            if (!idx) {
                if (PyErr_Occurred()) goto fail;
                DECLINE;
            }
            if (ndim != 2 || dims[0] != PyObject_Length(idx) || dims[1] != width || !finite_floats((const float *)at, items))
                DECLINE;
            arr = view_at(st, data, st->float32, items, offset, dims[0], dims[1], NULL);
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


/* ---- a message framed ---------------------------------------------------------------------- */

/* A message's header, written as orjson writes it. */
typedef struct {
    char *p;
    size_t n, cap;
} Text;

static int text_add(Text *t, const char *s, size_t n) {
    if (!n) return 0;
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

/* Append the tensor `arr` (named `name`; float32 or int64) to a message's `pieces` and its entry to
   `head`, after the padding that starts it on a WIRE_ALIGN boundary of the message's tensors
   (`offset`: their bytes so far): its bytes as one flat memoryview (`as_bytes`, as wire.pieces
   gives them) or as `arr` itself (a reply that only a socket sends). 0, or -1 with an error set. */
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
    if (head->n > UINT32_MAX) {
        PyErr_SetString(PyExc_ValueError, "a message header over 4 GiB");
        return -1;
    }
    uint32_t hlen = (uint32_t)head->n; /* little-endian (_rows.h) */
    PyObject *length = PyBytes_FromStringAndSize((const char *)&hlen, 4), *text = PyBytes_FromStringAndSize(head->p, head->n);
    int framed = length && text && PyList_Insert(pieces, 0, text) == 0 && PyList_Insert(pieces, 0, length) == 0;
    Py_XDECREF(length);
    Py_XDECREF(text);
    return framed ? 0 : -1;
}

/* encode_message(meta, tensors) -> wire.pieces' output for a message whose tensors are all NumPy
   arrays (the type itself), C-contiguous, of at least one dimension, float32 or int64, and whose
   names are strings; None for any other (wire.pieces then encodes it). meta: its JSON. */
PyObject *encode_message(PyObject *module, PyObject *args) {
    const State *st = state_of(module);
    PyObject *meta, *tensors;
    if (!PyArg_ParseTuple(args, "SO!", &meta, &PyDict_Type, &tensors)) return NULL;
    PyObject *pieces = PyList_New(0), *name, *arr, *result = NULL;
    Text head = {0};
    Py_ssize_t pos = 0, offset = 0;
    if (!pieces || head_start(&head, meta) < 0) goto fail;
    for (int first = 1; PyDict_Next(tensors, &pos, &name, &arr); first = 0) {
        if (!PyUnicode_CheckExact(name) || Py_TYPE(arr) != (PyTypeObject *)st->ndarray) DECLINE;
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


/* ---- an async push applied and answered in one call --------------------------------------

   apply_async(opt, h, slot_names, vars, slots, dense, sparse, rows, reply_dense, meta) applies
   the push of a request that parse_request took (its rows strictly increasing and inside their
   tables, every gradient float32, the rows' finite) and encodes the reply, as runtime/ps.py's
   Shard does it in Python for every other request: the same float operations on the same arrays,
   the same bytes back. opt, h, slot_names: the optimizer by number, its hyperparameters (Adam's
   rate for this update) and its slots (runtime/_rows.c); vars: {part: array}, slots: {part:
   {slot: array}} (the shard's own dicts: each dense part's new arrays replace its old there, its
   tables change in place); dense, sparse, rows: parse_request's; reply_dense: the dense parts to
   send back, in order; meta: the reply's meta as JSON. Every array is checked again by the
   kernels' own checks before anything changes. Nothing changes until every dense gradient is
   known finite: the name of the first that is not comes back instead. Else (pieces, nbytes): the
   reply as wire.pieces makes it (length, header, padding and each tensor's own array), and its
   size. One call for the whole request spares the per-part calls, dicts and argument parsing
   that the same work makes in Python. */

PyObject *apply_async(PyObject *module, PyObject *args) {
    const State *st = state_of(module);
    int opt;
    float h[4] = {0};
    PyObject *slot_names, *vars, *slots, *dense, *sparse, *rows, *reply_dense, *meta;
    if (!PyArg_ParseTuple(args, "i(ffff)O!O!O!O!O!O!O!S", &opt, &h[0], &h[1], &h[2], &h[3], &PyTuple_Type, &slot_names,
                          &PyDict_Type, &vars, &PyDict_Type, &slots, &PyDict_Type, &dense, &PyDict_Type, &sparse,
                          &PyDict_Type, &rows, &PyTuple_Type, &reply_dense, &meta))
        return NULL;
    if (optimizer_slots(opt, slot_names, "apply_async") < 0) return NULL;
    Py_ssize_t njobs = PyDict_GET_SIZE(sparse), done_jobs = 0;
    RowJob *jobs = PyMem_Calloc(njobs ? (size_t)njobs : 1, sizeof(RowJob));
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
        if (done_jobs >= njobs) {
            PyErr_SetString(PyExc_RuntimeError, "apply_async: the tables changed during the call");
            goto fail;
        }
        if (row_job(slot_names, var, mine, PyTuple_GET_ITEM(value, 0), PyTuple_GET_ITEM(value, 1), &jobs[done_jobs++]) < 0)
            goto fail;
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
        int finite = dense_part(st, opt, h, slot_names, var, mine, value, NULL, 1, &out, &fresh);
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
        PyObject *mine = PyDict_GetItemWithError(slots, part);
        if (!mine || !PyDict_Check(mine)) {
            if (!PyErr_Occurred()) PyErr_SetString(PyExc_KeyError, "apply_async: a dense part's slots went missing");
            goto fail;
        }
        if (PyDict_SetItem(vars, part, PyTuple_GET_ITEM(entry, 1)) < 0 || PyDict_Update(mine, PyTuple_GET_ITEM(entry, 2)) < 0)
            goto fail;
    }
    for (Py_ssize_t j = 0; j < done_jobs; j++) rows_update(opt, jobs[j].r, h);

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
        if (!PyUnicode_Check(part)) {
            PyErr_SetString(PyExc_TypeError, "apply_async: a dense part's name is a string");
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
        PyObject *out = gathered(st, table, value), *key = out ? PyUnicode_FromFormat("%S:rows", name) : NULL;
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
