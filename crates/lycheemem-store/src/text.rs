//! Full-text analysis and BM25 arithmetic shared by every backend, so that a document is split
//! into the same terms and scored with the same numbers wherever it is stored.
//!
//! Analysis is tantivy's `en_stem` chain (split on non-alphanumerics, drop tokens over 40
//! bytes, lowercase, English Snowball stemmer). Scoring is tantivy's BM25 (k1 = 1.2,
//! b = 0.75, idf = ln(1 + (N − df + 0.5) / (df + 0.5))) with document lengths quantized to its
//! one-byte field norms; the corpus statistics (N, total length, df) are over live documents
//! (docs/algorithm.md, "Storage rules").

use tantivy::fieldnorm::FieldNormReader;
use tantivy::tokenizer::{
    Language, LowerCaser, RemoveLongFilter, SimpleTokenizer, Stemmer, TextAnalyzer,
};

/// BM25 term-saturation parameter (tantivy's).
pub const BM25_K1: f32 = 1.2;
/// BM25 length-normalization parameter (tantivy's).
pub const BM25_B: f32 = 0.75;

/// The analyzer every backend indexes and queries with (tantivy's `en_stem`).
pub fn analyzer() -> TextAnalyzer {
    TextAnalyzer::builder(SimpleTokenizer::default())
        .filter(RemoveLongFilter::limit(40))
        .filter(LowerCaser)
        .filter(Stemmer::new(Language::English))
        .build()
}

/// A document as the full-text index sees it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AnalyzedDoc {
    /// Distinct terms with their frequencies, in first-occurrence order.
    pub terms: Vec<(String, u32)>,
    /// The quantized length the document is scored with (a field-norm id, 0..=255).
    pub norm_id: u8,
}

impl AnalyzedDoc {
    /// The document length BM25 uses (the field norm the id stands for).
    pub fn norm(&self) -> u32 {
        norm_of(self.norm_id)
    }
}

/// Splits a document into terms with frequencies and its quantized length.
pub fn analyze(analyzer: &mut TextAnalyzer, text: &str) -> AnalyzedDoc {
    let mut terms: Vec<(String, u32)> = Vec::new();
    let mut index: std::collections::HashMap<String, usize> = std::collections::HashMap::new();
    let mut tokens = 0u32;
    let mut stream = analyzer.token_stream(text);
    while let Some(token) = stream.next() {
        tokens = tokens.saturating_add(1);
        match index.get(&token.text) {
            Some(&i) => terms[i].1 += 1,
            None => {
                index.insert(token.text.clone(), terms.len());
                terms.push((token.text.clone(), 1));
            }
        }
    }
    AnalyzedDoc {
        terms,
        norm_id: FieldNormReader::fieldnorm_to_id(tokens),
    }
}

/// The distinct terms of a query, in order.
pub fn query_terms(analyzer: &mut TextAnalyzer, query: &str) -> Vec<String> {
    let mut terms: Vec<String> = Vec::new();
    let mut stream = analyzer.token_stream(query);
    while let Some(token) = stream.next() {
        if !terms.contains(&token.text) {
            terms.push(token.text.clone());
        }
    }
    terms
}

/// The length a field-norm id stands for.
pub fn norm_of(norm_id: u8) -> u32 {
    FieldNormReader::id_to_fieldnorm(norm_id)
}

/// BM25 statistics of a corpus and the scoring of one document against query terms, computed
/// exactly as tantivy does (f32, same operation order per term).
#[derive(Debug, Clone, Copy)]
pub struct Bm25 {
    docs: u64,
    average_norm: f32,
}

impl Bm25 {
    /// Statistics over `docs` live documents whose field norms sum to `tokens`.
    pub fn new(docs: u64, tokens: u64) -> Self {
        Bm25 {
            docs,
            average_norm: tokens as f32 / docs as f32,
        }
    }

    /// The weight of a term found in `doc_freq` documents: idf × (1 + k1).
    pub fn term_weight(&self, doc_freq: u64) -> f32 {
        let doc_freq = doc_freq.min(self.docs);
        let x = ((self.docs - doc_freq) as f32 + 0.5) / (doc_freq as f32 + 0.5);
        (1.0 + x).ln() * (1.0 + BM25_K1)
    }

    /// The length normalization of a document: k1 × (1 − b + b × norm / average).
    pub fn length_norm(&self, norm_id: u8) -> f32 {
        BM25_K1 * (1.0 - BM25_B + BM25_B * norm_of(norm_id) as f32 / self.average_norm)
    }

    /// One term's contribution to a document's score.
    pub fn term_score(&self, weight: f32, term_freq: u32, norm_id: u8) -> f32 {
        let tf = term_freq as f32;
        weight * (tf / (tf + self.length_norm(norm_id)))
    }

    /// The average field norm.
    pub fn average_norm(&self) -> f32 {
        self.average_norm
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn analysis_matches_the_en_stem_chain() {
        let mut a = analyzer();
        let doc = analyze(&mut a, "Alice adopted cats; the cat ADOPTS Cats!");
        assert_eq!(
            doc.terms,
            vec![
                ("alic".to_string(), 1),
                ("adopt".to_string(), 2),
                ("cat".to_string(), 3),
                ("the".to_string(), 1)
            ]
        );
        assert_eq!(doc.norm(), 7);
        assert_eq!(query_terms(&mut a, "cat Cats bike"), vec!["cat", "bike"]);
        // Long documents are quantized like tantivy's field norms.
        let long = analyze(&mut a, &"word ".repeat(1000));
        assert!(long.norm() <= 1000 && long.norm() > 900);
    }

    #[test]
    fn bm25_matches_hand_computed_values() {
        let bm25 = Bm25::new(10, 50);
        let idf = ((10.0f32 - 2.0 + 0.5) / (2.0 + 0.5) + 1.0).ln();
        assert!((bm25.term_weight(2) - idf * 2.2).abs() < 1e-6);
        let norm = 1.2 * (1.0 - 0.75 + 0.75 * 5.0 / 5.0);
        let expected = idf * 2.2 * (1.0 / (1.0 + norm));
        assert!((bm25.term_score(bm25.term_weight(2), 1, 5) - expected).abs() < 1e-6);
    }
}
