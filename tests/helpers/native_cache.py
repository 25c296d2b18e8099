"""The cache directory (XDG_CACHE_HOME, under pytest's base temp) that tests keep their converted
GGUF metadata and native kernels in, apart from the user's: one for every such test, so the
kernels are compiled once a run (a cache of each file's, or of each test's, cost 20 s of
compiling each)."""

PRIVATE_CACHE = "private-cache"
