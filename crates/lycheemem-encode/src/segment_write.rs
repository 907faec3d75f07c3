//! From a finalized segment to the store write that records it: read the segment's raw turns
//! and the session's reference context ρ from the store, encode (one LLM call), organize the
//! records into evidence nodes merged with the stored ones, embed records and nodes in one
//! batch, and advance ρ. The caller commits the returned [`SegmentWrite`] (adding, e.g., the
//! segmenter state) so the segment lands in one transaction.

use lycheemem_core::config::OrganizeConfig;
use lycheemem_core::{Error, Namespace, Result, Segment};
use lycheemem_embed::Embedder;
use lycheemem_store::{SegmentOutcome, SegmentWrite, StoreLookup};
use std::collections::HashMap;

use crate::encoder::{EncodeOutcome, SegmentEncoder, SegmentInput};
use crate::organize::{merge, organize};
use crate::reference::ReferenceContext;

/// The per-session state name under which ρ is persisted.
pub const REFERENCE_STATE: &str = "reference_context";

/// A segment ready to commit, and how its encoding went.
#[derive(Debug, Clone)]
pub struct BuiltSegment {
    pub write: SegmentWrite,
    pub outcome: EncodeOutcome,
}

/// Loads the stored ρ of a session (empty when none was stored yet).
pub fn load_reference(
    store: &dyn StoreLookup,
    ns: &Namespace,
    segment: &Segment,
) -> Result<ReferenceContext> {
    match store.state(ns, &segment.session, REFERENCE_STATE)? {
        Some(v) => serde_json::from_value(v)
            .map_err(|e| Error::Store(format!("stored reference context is unreadable: {e}"))),
        None => Ok(ReferenceContext::default()),
    }
}

/// A segment after its encoder call, before its records are organized into nodes.
#[derive(Debug, Clone)]
pub struct EncodedSegment {
    pub segment: Segment,
    pub outcome: EncodeOutcome,
    /// The session's ρ advanced by this segment (`None` without cross-segment context).
    pub reference: Option<ReferenceContext>,
}

/// Encodes `segment` (whose turns must already be stored) into a store write: [`encode_segment`]
/// then [`organize_segment`]. An encoder failure is not an error: the write then records the
/// failed segment and its usage, and ρ is left as it was. Errors are store or embedder
/// failures.
pub fn build_segment_write(
    encoder: &SegmentEncoder,
    embedder: &dyn Embedder,
    organize_cfg: &OrganizeConfig,
    store: &dyn StoreLookup,
    ns: &Namespace,
    segment: &Segment,
) -> Result<BuiltSegment> {
    let encoded = encode_segment(encoder, store, ns, segment)?;
    organize_segment(encoded, embedder, organize_cfg, store, ns)
}

/// The encoder call of a segment: reads its stored turns, the session date and ρ (only state of
/// the segment's own session), and makes the one LLM call. Segments of different sessions can
/// be encoded concurrently; those of one session must go in order (ρ).
pub fn encode_segment(
    encoder: &SegmentEncoder,
    store: &dyn StoreLookup,
    ns: &Namespace,
    segment: &Segment,
) -> Result<EncodedSegment> {
    let Some(span) = segment.last_turn.checked_sub(segment.first_turn) else {
        return Err(Error::InvalidInput(format!(
            "segment {} ends (turn {}) before it starts (turn {})",
            segment.id, segment.last_turn, segment.first_turn
        )));
    };
    let turns = store.turn_range(ns, &segment.session, segment.first_turn, segment.last_turn)?;
    let expected = span as usize + 1;
    if turns.len() != expected {
        return Err(Error::InvalidInput(format!(
            "segment {} needs {expected} stored turns, found {}",
            segment.id,
            turns.len()
        )));
    }
    let session_date = store.session(ns, &segment.session)?.and_then(|s| s.date);
    let keep_reference = encoder.config().cross_segment_context;
    let mut reference = if keep_reference {
        load_reference(store, ns, segment)?
    } else {
        ReferenceContext::default()
    };
    let input = SegmentInput {
        namespace: ns,
        segment,
        turns: &turns,
        session_date: session_date.as_deref(),
    };
    // A panic inside the encoder (a defect reached by some reply or turn) fails this segment
    // like any other encoder failure instead of unwinding through the caller, which would leave
    // the segment queued and the session stuck on it at every later call.
    let outcome = match std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        encoder.encode(&input, &mut reference)
    })) {
        Ok(outcome) => outcome,
        Err(payload) => {
            let why = payload
                .downcast_ref::<&str>()
                .map(|s| s.to_string())
                .or_else(|| payload.downcast_ref::<String>().cloned())
                .unwrap_or_else(|| "no message".into());
            tracing::error!(segment = %segment.id, "the encoder panicked: {why}");
            return Ok(EncodedSegment {
                segment: segment.clone(),
                outcome: EncodeOutcome::failed(format!("the encoder panicked: {why}")),
                reference: None,
            });
        }
    };
    Ok(EncodedSegment {
        segment: segment.clone(),
        outcome,
        reference: keep_reference.then_some(reference),
    })
}

/// Organizes an encoded segment's records into evidence nodes merged with the stored ones and
/// embeds records and nodes in one batch. The merge reads stored nodes that other sessions
/// also update, so the caller must not let another segment commit between this call and the
/// commit of its write.
pub fn organize_segment(
    encoded: EncodedSegment,
    embedder: &dyn Embedder,
    organize_cfg: &OrganizeConfig,
    store: &dyn StoreLookup,
    ns: &Namespace,
) -> Result<BuiltSegment> {
    let EncodedSegment {
        segment,
        outcome,
        reference,
    } = encoded;
    let segment = &segment;
    if let Some(error) = &outcome.failure {
        let mut write = SegmentWrite::new(
            segment.clone(),
            SegmentOutcome::Failed {
                error: error.clone(),
            },
        );
        write.usage = outcome.usage.clone();
        return Ok(BuiltSegment { write, outcome });
    }
    let upserts = organize(&outcome.records, segment, organize_cfg);
    let ids: Vec<String> = upserts.iter().map(|u| u.node_id.clone()).collect();
    let mut stored: HashMap<String, _> = store
        .nodes(ns, &ids)?
        .into_iter()
        .map(|n| (n.node_id.clone(), n))
        .collect();
    let nodes: Vec<_> = upserts
        .iter()
        .map(|up| merge(stored.remove(&up.node_id), up, organize_cfg))
        .collect();
    let texts: Vec<&str> = outcome
        .records
        .iter()
        .map(|r| r.normalized_text.as_str())
        .chain(nodes.iter().map(|n| n.search_text.as_str()))
        .collect();
    let mut vectors = if texts.is_empty() {
        Vec::new()
    } else {
        embedder.embed(&texts)?
    }
    .into_iter();
    let mut write = SegmentWrite::new(segment.clone(), SegmentOutcome::Encoded);
    write.records = outcome
        .records
        .iter()
        .map(|r| (r.clone(), vectors.next()))
        .collect();
    write.nodes = nodes.into_iter().map(|n| (n, vectors.next())).collect();
    if let Some(reference) = &reference {
        let value = serde_json::to_value(reference)
            .map_err(|e| Error::Store(format!("cannot serialize the reference context: {e}")))?;
        write
            .state
            .push((segment.session.clone(), REFERENCE_STATE.to_string(), value));
    }
    write.usage = outcome.usage.clone();
    Ok(BuiltSegment { write, outcome })
}
