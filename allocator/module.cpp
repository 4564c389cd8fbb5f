// An empty CPython module, so setuptools can build and install the library as harli_train._vmm.
// Python reaches the pool through ctypes on the extern "C" functions (hvmm.h), not through this module.
#define PY_SSIZE_T_CLEAN
#include <Python.h>

static struct PyModuleDef vmm_module = {
    PyModuleDef_HEAD_INIT, "_vmm", "Native VMM page pool; use harli_train.memory (ctypes), not this module.",
    -1, nullptr, nullptr, nullptr, nullptr, nullptr,
};

PyMODINIT_FUNC PyInit__vmm(void) { return PyModule_Create(&vmm_module); }
