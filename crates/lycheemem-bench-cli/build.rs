//! Records the commit the binary is built from, so a benchmark report names the code that made
//! it (not whatever the working directory is checked out at when the binary runs).

use std::path::Path;
use std::process::Command;

fn git(root: &Path, args: &[&str]) -> Option<String> {
    Command::new("git")
        .current_dir(root)
        .args(args)
        .output()
        .ok()
        .filter(|o| o.status.success())
        .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string())
}

fn main() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
    // The code that goes into the binary; results folders and docs do not make it dirty.
    let sources = ["crates", "xtask", "benches", "Cargo.toml", "Cargo.lock"];
    // Paths relative to this package: checkouts sharing one target directory (a CI clone beside
    // a working tree) each check their own files, not the ones of the checkout that ran last.
    for s in sources {
        println!("cargo:rerun-if-changed=../../{s}");
    }
    if let Some(git_dir) = git(&root, &["rev-parse", "--absolute-git-dir"]) {
        // The checkout's own .git is named relative to the package too; a git dir elsewhere (a
        // worktree's) stays absolute.
        let root_abs = root.canonicalize().unwrap_or_else(|_| root.clone());
        let git_dir = match Path::new(&git_dir).strip_prefix(&root_abs) {
            Ok(rel) => format!("../../{}", rel.display()),
            Err(_) => git_dir,
        };
        // A commit or checkout moves HEAD (or the ref it names) and rewrites the index.
        for f in ["HEAD", "index"] {
            println!("cargo:rerun-if-changed={git_dir}/{f}");
        }
    } else {
        // git could not answer here (not installed, or it refuses the directory's owner): still
        // watch the usual place, so another checkout sharing the target directory where git
        // works does not reuse this "unknown".
        for f in ["HEAD", "index"] {
            println!("cargo:rerun-if-changed=../../.git/{f}");
        }
    }
    let commit = match git(&root, &["rev-parse", "--short", "HEAD"]) {
        Some(id) => {
            let mut status = vec!["status", "--porcelain", "--untracked-files=no", "--"];
            status.extend(sources);
            let dirty = git(&root, &status).is_some_and(|s| !s.is_empty());
            if dirty { format!("{id}-dirty") } else { id }
        }
        None => "unknown".into(),
    };
    println!("cargo:rustc-env=LYCHEEMEM_BUILD_COMMIT={commit}");
}
