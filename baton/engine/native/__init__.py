"""Native CPU kernels: C compiled on the machine that runs them (build.py), loaded with ctypes
(library.py, linear_kernels.py, structs.py), and the stored formats they multiply (formats.py).

The C sources sit in rooms: `runtime/` (thread pool, vector math, AMX tile set-up), `linear/`
(the linear layers' products: compact GEMV, block panels, AMX GEMMs, block records), `attention/`
(decode and prefill attention), `sampling/` (the native step's sampling and logit
adjustments) and `layer/` (a decoder layer's decode step and its activation). A source
includes headers of its own room by name and others by room ("runtime/thread_pool.h"). Imports
nothing of the engine outside this folder."""
