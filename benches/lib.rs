//! Criterion micro-benchmarks of lycheemem live in `benches/`; this library holds only what the
//! harness-less benchmark binaries share. Whole-system comparisons against reference
//! implementations are harness commands instead (`lycheemem-bench ...`, see the README), because
//! they need a second runtime in the same run.

/// The value after `name` on the command line (`--name value`), or `default`.
pub fn arg(name: &str, default: &str) -> String {
    let args: Vec<String> = std::env::args().collect();
    args.iter()
        .position(|a| a == name)
        .and_then(|i| args.get(i + 1).cloned())
        .unwrap_or_else(|| default.to_string())
}
