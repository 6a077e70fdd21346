"""anyquant-cpu: anyquant's CPU engine, the ``cpu-fast`` backend.

:mod:`anyquant_cpu.engine` turns a format's packed layouts (:mod:`anyquant_runtime.layouts`) into fast CPU modules,
:mod:`anyquant_cpu.step` compiles the native decoder's decode step, :mod:`anyquant_cpu.kernels` is the GEMV kernel
compiled when this package is installed. Core reaches it through :mod:`anyquant_runtime.cpu` only; without this
distribution every format still loads and generates on its exact backends. Importing this package imports neither
torch nor the kernel; the hooks live in :mod:`anyquant_cpu.plugin`.
"""

__version__ = "0.1.0"
