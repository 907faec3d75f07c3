//! Key normalization for evidence nodes (docs/algorithm.md, "Evidence nodes").

/// Normalizes an entity, tag or other node key: casefold; whitespace and the separators
/// `- _ : / \ | , ;` (and their full-width forms) become spaces; every character that is not a
/// letter, digit (including CJK) or space is dropped; runs of spaces collapse; the ends are
/// trimmed. The function is idempotent.
///
/// ```
/// use lycheemem_core::normalize_key;
/// assert_eq!(normalize_key("  LGBTQ+ Support-Group / Pride "), "lgbtq support group pride");
/// assert_eq!(normalize_key("Caroline's"), "carolines");
/// assert_eq!(normalize_key("東京：旅行"), "東京 旅行");
/// ```
pub fn normalize_key(raw: &str) -> String {
    let mut out = String::with_capacity(raw.len());
    let mut pending_space = false;
    for c in raw.chars().flat_map(char::to_lowercase) {
        if c.is_whitespace() || is_separator(c) {
            pending_space = true;
        } else if c.is_alphanumeric() {
            if pending_space && !out.is_empty() {
                out.push(' ');
            }
            pending_space = false;
            out.push(c);
        }
    }
    out
}

fn is_separator(c: char) -> bool {
    matches!(
        c,
        '-' | '_' | ':' | '/' | '\\' | '|' | ',' | ';'
            | '\u{FF0D}' // fullwidth hyphen-minus
            | '\u{FF3F}' // fullwidth low line
            | '\u{FF1A}' // fullwidth colon
            | '\u{FF0F}' // fullwidth solidus
            | '\u{FF3C}' // fullwidth reverse solidus
            | '\u{FF5C}' // fullwidth vertical line
            | '\u{FF0C}' // fullwidth comma
            | '\u{FF1B}' // fullwidth semicolon
            | '\u{3001}' // ideographic comma
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn separators_become_single_spaces() {
        assert_eq!(normalize_key("a-b_c:d/e\\f|g,h;i"), "a b c d e f g h i");
        assert_eq!(normalize_key("a－b＿c，d；e"), "a b c d e");
        assert_eq!(normalize_key("--x--"), "x");
        assert_eq!(normalize_key("New   York\tCity"), "new york city");
    }

    #[test]
    fn drops_punctuation_and_symbols() {
        assert_eq!(normalize_key("Dr. Smith!"), "dr smith");
        assert_eq!(normalize_key("🎉 party 🎉"), "party");
        assert_eq!(normalize_key("C++"), "c");
        assert_eq!(normalize_key("Ünïcödé ÉCOLE"), "ünïcödé école");
        assert_eq!(normalize_key("!!!"), "");
    }

    proptest! {
        #[test]
        fn idempotent(s in "\\PC{0,64}") {
            let once = normalize_key(&s);
            prop_assert_eq!(normalize_key(&once), once.clone());
        }

        #[test]
        fn no_edge_or_double_spaces(s in "\\PC{0,64}") {
            let k = normalize_key(&s);
            prop_assert!(!k.starts_with(' ') && !k.ends_with(' ') && !k.contains("  "));
        }
    }
}
