"""A server's defaults, stated once: create_app's and its engine threads' (scheduler.py), load_app's, Ray's
replicas' and the flags of `smollm2 serve`, which reads them here before its flags are parsed: this module imports
nothing (nor does the package's __init__), so the command line starts without loading the server. A request's own
defaults are generation.request.Request's, or its API's."""

MAX_BATCH_SIZE = 8  # rows of the KV cache: requests decoding at once
MAX_WAITING = 64  # requests queued beyond those; more get 429
PREFIX_CACHE_BYTES = 256 << 20  # a 135M model's whole window in bf16 (188 MiB), where a server's memory is its weights
SPECULATIVE = "ngram"  # prompt lookup, in create_app's terms and the command line's: the same answers, faster where
# they repeat their input
# What `smollm2 serve` (and Ray's replicas) keep in the KV cache; create_app keeps the model's dtype, which gives
# generate()'s answers bit for bit. bf16 holds a row's slots in half the memory of fp32 and moves the embedded model's
# perplexity by 0.006%, where int8 (a quarter) moves it by 0.6% (benchmarks/kv_cache.py).
SERVE_KV_CACHE_DTYPE = "bf16"
