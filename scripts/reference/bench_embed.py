"""Reference side of `lycheemem bench embed`: sentence-transformers (torch, CPU) throughput.

Usage: python bench_embed.py MODEL_DIR TEXTS_JSON THREADS BATCH REPEATS OUT_F32
Prints one JSON line {"seconds": best_of_repeats, "texts": n, "torch": version}; writes the
normalized embeddings as little-endian float32 to OUT_F32 for the agreement check.
"""

import json
import sys
import time

import torch
from sentence_transformers import SentenceTransformer

model_dir, texts_path, threads, batch, repeats, out_path = sys.argv[1:7]
torch.set_num_threads(int(threads))
texts = json.load(open(texts_path))
model = SentenceTransformer(model_dir, device="cpu")
model.encode(texts[:64], batch_size=int(batch))  # warm-up
best = float("inf")
emb = None
for _ in range(int(repeats)):
    t0 = time.perf_counter()
    emb = model.encode(texts, batch_size=int(batch), normalize_embeddings=True, convert_to_numpy=True)
    best = min(best, time.perf_counter() - t0)
emb.astype("<f4").tofile(out_path)
print(json.dumps({"seconds": best, "texts": len(texts), "torch": torch.__version__}))
