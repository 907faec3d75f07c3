"""Writes reference token ids from llama.cpp's tokenizer (llama-cpp-python) for GGUF models.

Usage: python make_tokenizer_fixtures.py OUT_JSON NAME=PATH.gguf [NAME=PATH.gguf ...]
The corpus covers English, code, emoji, CJK, Cyrillic, Arabic, Devanagari, numbers, whitespace
runs and chat special tokens, so the Rust tokenizer built from the same GGUF must match exactly.
"""

import json
import sys

from llama_cpp import Llama

CORPUS = [
    "Hello world!",
    "The quick brown fox jumps over the lazy dog.",
    "I'm sure they'll say we've done it, won't they? It's John's.",
    "def fib(n):\n    return n if n < 2 else fib(n - 1) + fib(n - 2)\n",
    "for (int i = 0; i < 10; ++i) { sum += a[i] * b[i]; }",
    '{"records": [{"memory_type": "fact", "evidence_turns": [0, 12, 345]}]}',
    "Prices: $1,234.56, 3.14159, 1000000 and 2023-05-08T13:56:00Z",
    "🎉🔥 emoji party 👩‍👩‍👧‍👦 with ZWJ and flags 🇫🇷🇯🇵",
    "我昨天在上海参加了一个机器学习会议。",
    "東京で新しいカメラを買いました。",
    "오늘 날씨가 정말 좋네요.",
    "Привет, как дела? Давно не виделись.",
    "أحب قراءة الكتب في المساء.",
    "नमस्ते, आप कैसे हैं?",
    "naïve café résumé — “quotes” … ellipsis",
    "   leading spaces\t\ttabs\n\n\nnewlines   trailing   ",
    "<|im_start|>user\nWhat did Caroline do on 8 May 2023?<|im_end|>\n<|im_start|>assistant\n",
    "a",
    "",
]


def main(out_path, specs):
    result = {"corpus": CORPUS, "models": {}}
    for spec in specs:
        name, path = spec.split("=", 1)
        llm = Llama(model_path=path, vocab_only=True, verbose=False)
        result["models"][name] = [llm.tokenize(t.encode("utf-8"), add_bos=False, special=True) for t in CORPUS]
    with open(out_path, "w") as f:
        json.dump(result, f, ensure_ascii=False, indent=0)
    print(f"wrote {out_path}")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
