//! Criterion micro-benchmarks of lycheemem live in `benches/`; this library is empty on purpose.
//! Whole-system comparisons against reference implementations are harness commands instead
//! (`lycheemem bench ...`, see the README), because they need a second runtime in the same run.
