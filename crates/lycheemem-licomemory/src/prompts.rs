//! The instructions of LiCoMemory's LLM calls, in lycheemem's words after the authors' prompts
//! (SPEC-licomemory §2–3): what each call is asked for, not their text.

use lycheemem_core::config::LicoMemoryConfig;

/// A new session summary.
pub fn summary_create(cfg: &LicoMemoryConfig, date_key: &str) -> String {
    format!(
        "You write the summary of one conversation session for a long-term memory.
Group what was said into themes. For each theme give a short title and a summary: first the user's points \
(their preferences, personal facts, plans and events), then what the other side answered.
Write in the third person, state only facts from the dialogue, and quote at most 10 words at a time. \
The whole summary has about {lo} to {hi} words.
Give at most {keys} keys: short lowercase keywords for the session's topics; one key is the session date {date_key}.",
        lo = cfg.summary_words.0,
        hi = cfg.summary_words.1,
        keys = cfg.summary_max_keys,
    )
}

/// An existing summary updated with a new chunk.
pub fn summary_update(cfg: &LicoMemoryConfig) -> String {
    format!(
        "You keep the summary of one conversation session up to date for a long-term memory.
You get the current summary (JSON) and the next part of the dialogue. Return the whole summary again.
Keep every key and theme. Fold new material into an existing theme where it fits (preferred); add a theme or a \
key only for a new topic. If nothing new was said, return the summary unchanged.
Write in the third person, state only facts from the dialogue, and quote at most 10 words at a time. \
The whole summary stays around {lo} to {hi} words.",
        lo = cfg.summary_words.0,
        hi = cfg.summary_words.1,
    )
}

/// Entities and relations of one chunk.
pub const EXTRACTION: &str = "You extract a knowledge graph from one chunk of a dialogue for a long-term memory.
Entities: the people, times, organizations, locations, events, concepts and objects the chunk mentions that are \
worth remembering, each with one of the types person, time, organization, location, event, concept, object. \
The speakers are always entities of type person (in a chat with an assistant: User and Assistant).
Turn relative dates (yesterday, last week, next month) into absolute dates using the session time, as entities \
of type time.
Relations: (source, target, relation) between two of the entities, the relation a short verb phrase. Prefer \
relations that reveal the speakers' personal information, preferences, plans and experiences.
Strength 1 to 10: how important and certain the relation is; relations involving a speaker get a higher \
strength.";

/// The entities a question is about.
pub const QUERY_ENTITIES: &str = "You list the entities a question about past conversations is about, each with \
one of the types person, time, organization, location, event, concept, object.
\"I\", \"me\" and \"my\" mean the user (User); \"you\" means the assistant (Assistant).
Turn relative dates (yesterday, last month, two weeks ago) into absolute dates using the question time, as \
entities of type time.";

/// The answer instructions (after the question, the summary, the triples and the chunks).
pub const ANSWER: &str = "Answer the question using only the context above. Keep the answer short: a phrase \
or one or two sentences. When facts conflict, prefer the one closest to the question time. Give dates as \
absolute dates. If the context does not contain the answer, say that the context is insufficient to answer.";
