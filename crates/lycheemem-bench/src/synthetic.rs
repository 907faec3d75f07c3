//! Seeded synthetic data for storage, retrieval and server benchmarks: clustered unit vectors
//! (embedding-like: many topics of Zipf-distributed sizes), Zipf-distributed pseudo-words, and
//! whole synthetic memories. Not used by the memory itself (it lives with the benchmark harness).

use lycheemem_core::config::OrganizeConfig;
use lycheemem_core::{
    FinalizeReason, MemoryType, Namespace, Record, Result, Role, Segment, SessionId, SourceRole,
    TemporalScope, Turn,
};
use lycheemem_encode::organize::{merge, organize};
use lycheemem_store::prelude::*;
use lycheemem_store::{SegmentOutcome, SegmentWrite, SessionInfo, Store, StoreOptions};
use std::collections::HashMap;
use std::path::Path;

/// xorshift64*: fast, seeded, good enough for synthetic data.
pub struct Rng(pub u64);
impl Rng {
    pub fn next_u64(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }
    pub fn unit(&mut self) -> f32 {
        (self.next_u64() >> 40) as f32 / (1u64 << 24) as f32
    }
    /// Approximately standard normal (sum of 4 uniforms, rescaled).
    pub fn normal(&mut self) -> f32 {
        ((self.unit() + self.unit() + self.unit() + self.unit()) - 2.0) * 1.732
    }
    /// Zipf-like rank in `0..n` (exponent ≈ 1) by inverse transform on a log scale.
    pub fn zipf(&mut self, n: usize) -> usize {
        let u = self.unit().max(1e-7);
        (((n as f32).powf(u) - 1.0) as usize).min(n - 1)
    }
}

/// Scales to unit length (the one implementation lives in `lycheemem_core::vector`).
pub use lycheemem_core::vector::normalize;

/// `n` unit vectors around `n / 100` random topic centres.
pub fn clustered_vectors(n: usize, dims: usize, seed: u64) -> Vec<Vec<f32>> {
    let mut rng = Rng(seed | 1);
    let centres: Vec<Vec<f32>> = (0..(n / 100).max(10))
        .map(|_| {
            let mut c: Vec<f32> = (0..dims).map(|_| rng.normal()).collect();
            normalize(&mut c);
            c
        })
        .collect();
    let sigma = 0.9 / (dims as f32).sqrt();
    (0..n)
        .map(|_| {
            let c = &centres[rng.zipf(centres.len())];
            let mut v: Vec<f32> = c.iter().map(|x| x + sigma * rng.normal()).collect();
            normalize(&mut v);
            v
        })
        .collect()
}

/// A pronounceable synthetic word for vocabulary rank `i`.
pub fn word(mut i: usize) -> String {
    const SYL: [&str; 16] = [
        "ka", "lo", "mi", "ne", "ru", "sa", "to", "vi", "ber", "dan", "gol", "hin", "jas", "kor",
        "lum", "pen",
    ];
    let mut w = String::new();
    loop {
        w.push_str(SYL[i % SYL.len()]);
        i /= SYL.len();
        if i == 0 {
            break;
        }
    }
    w
}

pub fn sentence(rng: &mut Rng, vocab: usize, len: usize) -> String {
    (0..len)
        .map(|_| word(rng.zipf(vocab)))
        .collect::<Vec<_>>()
        .join(" ")
}

/// Resident memory of this process, MiB (NaN where `/proc` is unavailable).
pub fn rss_mib() -> f64 {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("VmRSS:"))
                .and_then(|l| l.split_whitespace().nth(1))
                .and_then(|kb| kb.parse::<f64>().ok())
        })
        .map_or(f64::NAN, |kb| kb / 1024.0)
}

pub fn percentile(sorted: &[f64], p: f64) -> f64 {
    if sorted.is_empty() {
        return f64::NAN;
    }
    sorted[((sorted.len() - 1) as f64 * p).round() as usize]
}

/// Records per synthetic segment.
pub const RECORDS_PER_SEGMENT: usize = 100;
const SEGMENTS_PER_SESSION: usize = 5;
const TURNS_PER_SESSION: u32 = 25;

/// A synthetic memory of `n` records in the namespace `bench`, shaped like real memory: records
/// with Zipf-distributed entities and tags, half of them dated, organized into evidence nodes
/// by the real organizer, plus raw turns; vectors are clustered synthetic unit vectors.
pub fn build_store(dir: &Path, n: usize, dims: usize, seed: u64) -> Result<(Store, Namespace)> {
    let store = Store::open(dir, StoreOptions::new(dims))?;
    let ns = fill_store(&store, n, dims, seed)?;
    Ok((store, ns))
}

/// Writes the synthetic memory of [`build_store`] into an open store of any backend; returns
/// its namespace.
pub fn fill_store(store: &dyn MemoryStore, n: usize, dims: usize, seed: u64) -> Result<Namespace> {
    let ns = Namespace::new("bench")?;
    let vectors = clustered_vectors(n, dims, seed);
    let mut rng = Rng(seed.wrapping_mul(17) | 1);
    let entities = (n / 40).max(10);
    let organize_cfg = OrganizeConfig::default();
    let segments = n.div_ceil(RECORDS_PER_SEGMENT);
    for s in 0..segments {
        let session = SessionId::new(format!("s{}", s / SEGMENTS_PER_SESSION))?;
        if s % SEGMENTS_PER_SESSION == 0 {
            store.put_session(
                &ns,
                SessionInfo::new(
                    session.clone(),
                    Some(format!(
                        "2023-{:02}-15",
                        1 + (s / SEGMENTS_PER_SESSION) % 12
                    )),
                ),
            )?;
            let turns = (0..TURNS_PER_SESSION)
                .map(|i| {
                    let text = sentence(&mut rng, 20_000, 12);
                    let mut v: Vec<f32> = vectors[(rng.next_u64() % n as u64) as usize]
                        .iter()
                        .map(|x| x + 0.02 * rng.normal())
                        .collect();
                    normalize(&mut v);
                    let turn = Turn {
                        session: session.clone(),
                        index: i,
                        role: if i % 2 == 0 {
                            Role::User
                        } else {
                            Role::Assistant
                        },
                        speaker: None,
                        text,
                        time: None,
                    };
                    (turn, Some(v))
                })
                .collect();
            store.add_turns(&ns, turns)?;
        }
        let first =
            (s % SEGMENTS_PER_SESSION) as u32 * (TURNS_PER_SESSION / SEGMENTS_PER_SESSION as u32);
        let last = first + TURNS_PER_SESSION / SEGMENTS_PER_SESSION as u32 - 1;
        let segment = Segment {
            id: Segment::make_id(&session, first, last),
            session: session.clone(),
            first_turn: first,
            last_turn: last,
            exchanges: last - first + 1,
            tokens: 300,
            reason: FinalizeReason::SemanticBoundary,
        };
        let range = s * RECORDS_PER_SEGMENT..((s + 1) * RECORDS_PER_SEGMENT).min(n);
        let mut records = Vec::new();
        for i in range.clone() {
            let text = format!("{} {}", sentence(&mut rng, 20_000, 10), word(20_000 + i));
            let date = (i % 2 == 0).then(|| {
                format!(
                    "2023-{:02}-{:02}",
                    1 + rng.next_u64() % 12,
                    1 + rng.next_u64() % 28
                )
            });
            records.push(Record {
                record_id: Record::make_id(&ns, &text),
                memory_type: MemoryType::ALL[i % 4],
                normalized_text: Record::make_normalized_text(MemoryType::ALL[i % 4], &text),
                semantic_text: text,
                entities: (0..1 + i % 2)
                    .map(|_| format!("Person{}", rng.zipf(entities)))
                    .collect(),
                tags: (0..1 + i % 2).map(|_| word(rng.zipf(300))).collect(),
                temporal: TemporalScope {
                    t_ref: date,
                    ..TemporalScope::default()
                },
                evidence_turns: vec![first + (i as u32 % (last - first + 1))],
                source_session: session.clone(),
                source_role: SourceRole::User,
                segment_id: segment.id.clone(),
                created_at: None,
                confidence: 1.0,
            });
        }
        let upserts = organize(&records, &segment, &organize_cfg);
        let ids: Vec<String> = upserts.iter().map(|u| u.node_id.clone()).collect();
        let mut stored: HashMap<String, _> = store
            .nodes(&ns, &ids)?
            .into_iter()
            .map(|n| (n.node_id.clone(), n))
            .collect();
        let record_index: HashMap<&str, usize> = records
            .iter()
            .zip(range.clone())
            .map(|(r, i)| (r.record_id.as_str(), i))
            .collect();
        let mut write = SegmentWrite::new(segment, SegmentOutcome::Encoded);
        for up in &upserts {
            let node = merge(stored.remove(&up.node_id), up, &organize_cfg);
            // The node's vector: the mean of this segment's linked records (synthetic stand-in
            // for embedding its search text).
            let mut v = vec![0f32; dims];
            for (id, _) in &up.records {
                if let Some(&i) = record_index.get(id.as_str()) {
                    v.iter_mut().zip(&vectors[i]).for_each(|(a, b)| *a += b);
                }
            }
            normalize(&mut v);
            write.nodes.push((node, Some(v)));
        }
        for (r, i) in records.into_iter().zip(range) {
            write.records.push((r, Some(vectors[i].clone())));
        }
        store.commit_segment(&ns, write)?;
    }
    lycheemem::mark_sessions_processed(store, &ns)?;
    store.checkpoint()?;
    Ok(ns)
}
