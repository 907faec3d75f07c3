//! Text bounding shared by the write path (embedding text, encoder prompts).

/// Keeps the first and last `n` characters of `text`, joined by " … ", when it is longer than
/// `2n` characters; otherwise returns it unchanged.
///
/// ```
/// assert_eq!(lycheemem_core::text::head_and_tail("abcdefgh", 2), "ab … gh");
/// assert_eq!(lycheemem_core::text::head_and_tail("abcd", 2), "abcd");
/// ```
pub fn head_and_tail(text: &str, n: usize) -> String {
    let count = text.chars().count();
    if count <= 2 * n {
        return text.to_string();
    }
    let head: String = text.chars().take(n).collect();
    let tail: String = text.chars().skip(count - n).collect();
    format!("{head} … {tail}")
}
