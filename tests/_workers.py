"""The environment variables that keep a pytest-xdist worker's TensorFlow and BLAS to one
thread (set by conftest.py; removed by tests that measure the default threading)."""

WORKER_THREAD_VARIABLES = ("TF_NUM_INTRAOP_THREADS", "TF_NUM_INTEROP_THREADS", "OMP_NUM_THREADS")
