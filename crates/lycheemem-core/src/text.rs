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

/// The characters of JSON `text` outside its strings (quotes excluded), with their byte offsets:
/// the brackets, commas, colons and literals that give a reply its structure, for salvaging a
/// reply cut off mid-way.
///
/// ```
/// let outside: String = lycheemem_core::text::json_structure(r#"{"a,]": [1, "b\"}"]}"#)
///     .map(|(_, c)| c)
///     .collect();
/// assert_eq!(outside, "{: [1, ]}");
/// ```
pub fn json_structure(text: &str) -> impl Iterator<Item = (usize, char)> + '_ {
    let (mut in_string, mut escaped) = (false, false);
    text.char_indices().filter(move |&(_, c)| {
        if in_string {
            if escaped {
                escaped = false;
            } else if c == '\\' {
                escaped = true;
            } else if c == '"' {
                in_string = false;
            }
            false
        } else if c == '"' {
            in_string = true;
            false
        } else {
            true
        }
    })
}
