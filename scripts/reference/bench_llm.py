"""Reference side of `lycheemem bench llm`: llama.cpp (llama-cpp-python) prefill/decode speed.

Usage: python bench_llm.py MODEL.gguf PROMPT_IDS_JSON THREADS DECODE REPEATS
Feeds exactly the given token ids, then greedily decodes DECODE tokens (end-of-sequence
ignored). Prints one JSON line with the best prefill and decode seconds over REPEATS.
"""

import json
import sys
import time

import llama_cpp
import numpy as np
from llama_cpp import Llama

path, ids_path, threads, decode, repeats = sys.argv[1:6]
ids = json.load(open(ids_path))
llm = Llama(model_path=path, n_ctx=len(ids) + int(decode) + 16, n_threads=int(threads),
            n_threads_batch=int(threads), n_batch=512, n_ubatch=512, verbose=False)
n_vocab = llm.n_vocab()
best_prefill = best_decode = float("inf")
for _ in range(int(repeats)):
    llm.reset()
    t0 = time.perf_counter()
    llm.eval(ids)
    best_prefill = min(best_prefill, time.perf_counter() - t0)
    t0 = time.perf_counter()
    for _ in range(int(decode)):
        # Logits of the last evaluated position (logits_all is off).
        tok = int(np.ctypeslib.as_array(llm._ctx.get_logits(), shape=(n_vocab,)).argmax())
        llm.eval([tok])
    best_decode = min(best_decode, time.perf_counter() - t0)
print(json.dumps({"prefill_s": best_prefill, "decode_s": best_decode, "version": llama_cpp.__version__}))
