"""Native CPU kernels: C compiled on the machine that runs them, loaded with ctypes."""
