/* meshnet.backends._capture: a llama.cpp shard's eval callback in C (backends/eval_capture.py).
 *
 * llama.cpp calls a context's eval callback for every node of every graph it computes, first to
 * ask whether the caller wants that node's output (ask = true) and then, for a node it wants, once
 * the node is computed (ask = false). A shard wants one or two nodes of a few hundred: the last
 * layer's output (copied out: what crosses the seam to the next hop) and, for some families, the
 * graph's rescaled input (overwritten with the inbound rows). As a Python ctypes callback each ask
 * costs a trip into the interpreter: ~330 of them a step on 10 layers of the bundled model,
 * 0.3-0.7 ms of a ~4.9 ms decode step on a 2-core CPU VM (bench shards). Here they cost nothing.
 *
 * The module holds no Python state and exports two things: EVAL, the address of meshnet_eval (the
 * callback itself, a ggml_backend_sched_eval_callback), and STATE_LAYOUT, the size and two offsets
 * of struct capture, which eval_capture.py checks against its ctypes mirror before using it.
 * ggml is not linked: struct capture carries the two libggml functions it calls
 * (ggml_backend_tensor_get / _set) and the offsets of the two struct ggml_tensor fields it reads,
 * checked at load by backends/ggml_layout.py.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

typedef void (*tensor_io)(void *tensor, void *data, size_t offset, size_t size);

/* One shard's callback state. Set up by eval_capture.py; counters reset before each llama_decode
 * and read after it, all on the thread that calls llama_decode (the shard's compute lock). */
struct capture {
    const char *target;    /* the last layer's output name, NUL included; NULL: nothing to copy out */
    int64_t target_len;
    const char *overwrite; /* the rescaled input's name, NUL included; NULL: nothing to overwrite */
    int64_t overwrite_len;
    int64_t name_offset;   /* offsetof(struct ggml_tensor, name) */
    int64_t ne_offset;     /* offsetof(struct ggml_tensor, ne) */
    int64_t n_embd;
    int64_t row;           /* floats a position carries across a seam (streams x n_embd) */
    float *out;            /* where captured rows go */
    int64_t out_size;      /* its floats */
    const float *rows;     /* the inbound rows of the running chunk (overwrite), or NULL */
    int64_t rows_size;     /* their floats */
    tensor_io get;         /* ggml_backend_tensor_get */
    tensor_io put;         /* ggml_backend_tensor_set */
    int64_t captured;      /* rows copied out by this llama_decode */
    int64_t overwritten;   /* floats overwritten by this llama_decode */
};

/* The same decisions, in the same order, as the Python callback (eval_capture.PythonCapture):
 * false on an "ask" for a node that is not ours (and true when computed, never aborting the
 * graph); false on a wanted node whose shape does not fit (llama_decode then fails: nothing wrong
 * is computed). */
static bool meshnet_eval(void *tensor, bool ask, void *user_data) {
    struct capture *c = (struct capture *)user_data;
    const char *name = (const char *)tensor + c->name_offset;
    bool ours = c->target != NULL && strncmp(name, c->target, (size_t)c->target_len) == 0;
    bool rescaled = c->overwrite != NULL && strncmp(name, c->overwrite, (size_t)c->overwrite_len) == 0;
    if (!(ours || rescaled)) {
        return !ask;
    }
    if (ask) {
        return true;
    }
    const int64_t *ne = (const int64_t *)((const char *)tensor + c->ne_offset);
    int64_t elements = ne[0] * ne[1] * ne[2] * ne[3];
    if (rescaled) {
        if (c->rows == NULL || ne[0] != c->n_embd || c->overwritten + elements > c->rows_size) {
            return false;
        }
        c->put(tensor, (void *)(c->rows + c->overwritten), 0, (size_t)elements * sizeof(float));
        c->overwritten += elements;
        return true;
    }
    int64_t at = c->captured * c->row;
    if (ne[0] != c->n_embd || elements % c->row != 0 || at + elements > c->out_size) {
        return false;
    }
    c->get(tensor, c->out + at, 0, (size_t)elements * sizeof(float));
    c->captured += elements / c->row;
    return true;
}

static struct PyModuleDef capture_module = {
    PyModuleDef_HEAD_INIT,
    "_capture",
    "A llama.cpp shard's eval callback in C: EVAL (its address) and STATE_LAYOUT (size, offsets).",
    -1,
    NULL,
};

PyMODINIT_FUNC PyInit__capture(void) {
    PyObject *module = PyModule_Create(&capture_module);
    if (module == NULL) {
        return NULL;
    }
    PyObject *eval = PyLong_FromVoidPtr((void *)meshnet_eval);
    PyObject *layout = Py_BuildValue(
        "(nnn)", (Py_ssize_t)sizeof(struct capture), (Py_ssize_t)offsetof(struct capture, captured),
        (Py_ssize_t)offsetof(struct capture, overwritten));
    if (eval == NULL || layout == NULL || PyModule_AddObject(module, "EVAL", eval) < 0) {
        Py_XDECREF(eval);
        Py_XDECREF(layout);
        Py_DECREF(module);
        return NULL;
    }
    if (PyModule_AddObject(module, "STATE_LAYOUT", layout) < 0) {
        Py_DECREF(layout);
        Py_DECREF(module);
        return NULL;
    }
    return module;
}
