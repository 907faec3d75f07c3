"""One-off: give a peer store written by the pre-checkpoint harness its build cost in
progress.json, from its llm-calls.jsonl (build-phase calls, a repeated identical request
counted once: a unit redone after a kill replays its calls) and its usage.json (embedding
counts; wall seconds of the runs that finished, plus the LLM seconds of the calls it missed)."""
import json, os, sys
store = sys.argv[1]
seen = {}
# --drop-last N: the last N distinct calls belong to a unit a kill cut short (not in progress).
drop = int(sys.argv[sys.argv.index("--drop-last") + 1]) if "--drop-last" in sys.argv else 0
for line in open(os.path.join(store, "llm-calls.jsonl")):
    c = json.loads(line)
    if c["phase"] != "build":
        continue
    key = json.dumps([c["messages"], c["options"]], sort_keys=True)
    seen.setdefault(key, c["completion"])
for key in list(seen)[len(seen) - drop:]:
    del seen[key]
u = {"chat_calls": len(seen), "prompt_tokens": 0, "completion_tokens": 0, "cached_prompt_tokens": 0,
     "llm_seconds": 0.0, "embed_requests": 0, "embed_texts": 0, "errors": 0}
for comp in seen.values():
    u["prompt_tokens"] += comp["prompt_tokens"]
    u["completion_tokens"] += comp["completion_tokens"]
    u["cached_prompt_tokens"] += comp.get("cached_prompt_tokens", 0)
    u["llm_seconds"] += comp["latency_ms"] / 1e3
old = {"usage": {"llm_seconds": 0.0}, "seconds": 0.0}
if os.path.exists(os.path.join(store, "usage.json")):
    old = json.load(open(os.path.join(store, "usage.json")))
    for k in ("embed_requests", "embed_texts", "errors"):
        u[k] = old["usage"].get(k, 0)
seconds = old["seconds"] + (u["llm_seconds"] - old["usage"]["llm_seconds"])
progress = json.load(open(os.path.join(store, "progress.json")))
assert "usage" not in progress
progress["usage"] = u
progress["seconds"] = seconds
print(json.dumps({"usage": u, "seconds": seconds, "old": old}, indent=1))
if "--write" in sys.argv:
    tmp = os.path.join(store, "progress.json.tmp")
    json.dump(progress, open(tmp, "w"))
    os.replace(tmp, os.path.join(store, "progress.json"))
