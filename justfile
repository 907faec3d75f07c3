# Convenience recipes; each is a thin alias of `cargo xtask` (which needs nothing but cargo).

# Fetch the default models and run the main job.
demo:
    cargo xtask demo

# Format check, all tests (they fetch the small models they need), clippy (what CI runs).
test:
    cargo xtask test

# Regenerate parity fixtures with the reference Python implementations.
fixtures:
    cargo xtask fixtures

# Embedding throughput: candle vs sentence-transformers.
bench-embed:
    cargo xtask bench-embed

# List / fetch / verify model weights.
models *ARGS:
    cargo run --release -p lycheemem-cli -- models {{ARGS}}

# `cargo check` of the binaries with the CUDA feature (CUDA compiler from PyPI; no GPU needed).
cuda-check:
    cargo xtask cuda-check
