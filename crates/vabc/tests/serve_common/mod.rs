//! Helpers shared by the `serve_*` integration tests: corpus images, COWs made from
//! them, a running `vabc serve` child that is always stopped, and leak checks.
//!
//! These tests need root and the real kernel (FUSE, loop, mount); they are not skipped.

#![allow(dead_code)]

use std::collections::HashMap;
use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::Mutex;
use std::time::{Duration, Instant};

pub const BS: usize = 4096;

pub fn vabc() -> &'static str {
    env!("CARGO_BIN_EXE_vabc")
}

/// Runs `vabc ARGS` to completion.
/// `vabc verity format --json DATA HASH`: its JSON report (root hash, tree layout).
pub fn verity_format(data: &Path, hash: &Path) -> serde_json::Value {
    let o = Command::new(vabc())
        .args(["verity", "format", "--json"])
        .arg(data)
        .arg(hash)
        .output()
        .unwrap();
    assert!(o.status.success(), "verity format: {o:?}");
    serde_json::from_slice(&o.stdout).unwrap()
}

/// Runs vabc; a `--json` report it prints on success is validated against its
/// documented schema (docs/schemas/), in every test that asks for one.
pub fn run_vabc(args: &[&str]) -> std::process::Output {
    let o = Command::new(vabc()).args(args).output().unwrap();
    if o.status.success() && args.contains(&"--json") && !o.stdout.is_empty() {
        let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap_or_else(|e| {
            panic!(
                "{args:?}: not JSON ({e}): {}",
                String::from_utf8_lossy(&o.stdout)
            )
        });
        validate_report(&schema_name(args), &v);
    }
    o
}

/// The schema file (docs/schemas/NAME.json) of the report `vabc ARGS` prints: the
/// command's words joined by `-` (`bundle-info`, `merge`).
pub fn schema_name(args: &[&str]) -> String {
    const GROUPS: [&str; 6] = ["avb", "bundle", "payload", "trace", "update", "verity"];
    let mut words = args.iter().skip_while(|a| a.starts_with('-'));
    let first = words.next().copied().unwrap_or_default();
    match (GROUPS.contains(&first), words.next()) {
        (true, Some(sub)) => format!("{first}-{sub}"),
        _ => first.to_string(),
    }
}

/// Validates a report against docs/schemas/NAME.json.
#[allow(dead_code)] // Not every test binary reads a report file of its own.
pub fn validate_report(name: &str, v: &serde_json::Value) {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../../docs/schemas")
        .join(format!("{name}.json"));
    let text = std::fs::read_to_string(&path)
        .unwrap_or_else(|e| panic!("no schema {} for a report: {e}", path.display()));
    let schema: serde_json::Value = serde_json::from_str(&text).unwrap();
    let validator = jsonschema::validator_for(&schema)
        .unwrap_or_else(|e| panic!("{}: not a schema: {e}", path.display()));
    let errors: Vec<String> = validator
        .iter_errors(v)
        .map(|e| format!("{e} (at {})", e.instance_path()))
        .collect();
    assert!(
        errors.is_empty(),
        "the {name} report does not follow {}: {errors:#?}\n{v:#}",
        path.display()
    );
}

/// AOSP's COW vectors, read in place.
pub fn vectors() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../../shared/aosp-cow-vectors")
}

/// Hex SHA-256 of a whole file.
pub fn sha256_file(p: &Path) -> String {
    use sha2::Digest;
    sha2::Sha256::digest(std::fs::read(p).unwrap())
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

/// Corpus images live in a fixed temporary location shared by all test runs
/// (`make-corpus.sh` output is byte-for-byte reproducible, so reuse is safe).
pub fn corpus_dir() -> PathBuf {
    std::env::var_os("VABC_CORPUS")
        .map_or_else(|| std::env::temp_dir().join("corpus"), PathBuf::from)
}

static CORPUS_LOCK: Mutex<()> = Mutex::new(());

/// Path of `PAIR/{old,new}.KIND.img`, building the pair first if it is missing.
pub fn corpus_image(pair: &str, side: &str, kind: &str) -> PathBuf {
    let dir = corpus_dir();
    let img = dir.join(pair).join(format!("{side}.{kind}.img"));
    if img.exists() {
        return img;
    }
    let _guard = CORPUS_LOCK.lock().unwrap_or_else(|e| e.into_inner());
    if !img.exists() {
        let script =
            Path::new(env!("CARGO_MANIFEST_DIR")).join("../../../shared/corpus/make-corpus.sh");
        let status = Command::new("bash")
            .arg(&script)
            .args(["-p", pair, "-o"])
            .arg(&dir)
            .status()
            .expect("run make-corpus.sh");
        assert!(status.success(), "make-corpus.sh -p {pair} failed");
    }
    assert!(
        img.exists(),
        "{} missing after make-corpus.sh",
        img.display()
    );
    img
}

fn hash_block(b: &[u8]) -> u64 {
    use std::hash::{Hash, Hasher};
    let mut h = std::collections::hash_map::DefaultHasher::new();
    b.hash(&mut h);
    h.finish()
}

enum Planned {
    Copy(u64),
    Zero,
    Xor(u64, u16),
    Replace,
}

/// Writes a COW that turns `old` into `new`: unchanged blocks are left out, zero blocks
/// become ZERO, blocks found elsewhere in `old` COPY, lightly edited blocks XOR (some
/// against an unaligned source), the rest REPLACE (multi-block units in v3).
pub fn make_cow(old: &Path, new: &Path, cow: &Path, version: u16, codec: &str) -> u64 {
    let old_data = std::fs::read(old).unwrap();
    let new_data = std::fs::read(new).unwrap();
    let old_blocks = old_data.len() / BS;
    let mut by_hash: HashMap<u64, u64> = HashMap::new();
    for (i, b) in old_data.chunks_exact(BS).enumerate() {
        by_hash.entry(hash_block(b)).or_insert(i as u64);
    }
    let zero = [0u8; BS];
    let mut plan: Vec<(u64, Planned)> = Vec::new();
    for (i, nb) in new_data.chunks(BS).enumerate() {
        assert_eq!(nb.len(), BS, "new image is not a whole number of blocks");
        let ob = old_data.get(i * BS..(i + 1) * BS);
        if ob == Some(nb) {
            continue;
        }
        let p = if nb == zero {
            Planned::Zero
        } else if let Some(&src) = by_hash
            .get(&hash_block(nb))
            .filter(|&&s| &old_data[s as usize * BS..][..BS] == nb)
        {
            Planned::Copy(src)
        } else if let Some(ob) =
            ob.filter(|ob| ob.iter().zip(nb).filter(|(a, b)| a != b).count() < 1024)
        {
            let _ = ob;
            if i % 2 == 1 && i + 1 < old_blocks {
                Planned::Xor(i as u64, 2048)
            } else {
                Planned::Xor(i as u64, 0)
            }
        } else {
            Planned::Replace
        };
        plan.push((i as u64, p));
    }
    let count = |f: fn(&Planned) -> bool| plan.iter().filter(|(_, p)| f(p)).count();
    eprintln!(
        "make_cow {}: COPY {} ZERO {} XOR {} REPLACE {} (of {} blocks)",
        new.display(),
        count(|p| matches!(p, Planned::Copy(_))),
        count(|p| matches!(p, Planned::Zero)),
        count(|p| matches!(p, Planned::Xor(..))),
        count(|p| matches!(p, Planned::Replace)),
        new_data.len() / BS
    );
    let opts = cow::WriterOptions {
        version,
        compression: codec.parse().unwrap(),
        op_count_max: plan.len() as u64 + 16,
        ..Default::default()
    };
    let mut w = cow::CowWriter::create(cow, opts).unwrap();
    let mut i = 0;
    while i < plan.len() {
        let (b, p) = &plan[i];
        let nb = &new_data[*b as usize * BS..][..BS];
        match p {
            Planned::Copy(src) => w.add_copy(*b, *src, 1).unwrap(),
            Planned::Zero => w.add_zero_blocks(*b, 1).unwrap(),
            Planned::Xor(old_block, off) => {
                let s = *old_block as usize * BS + *off as usize;
                let xored: Vec<u8> = nb
                    .iter()
                    .zip(&old_data[s..s + BS])
                    .map(|(a, b)| a ^ b)
                    .collect();
                w.add_xor_blocks(*b, &xored, *old_block, *off).unwrap();
            }
            Planned::Replace => {
                // Batch consecutive REPLACE blocks so v3 forms multi-block units.
                let mut j = i;
                while j + 1 < plan.len()
                    && matches!(plan[j + 1].1, Planned::Replace)
                    && plan[j + 1].0 == plan[j].0 + 1
                {
                    j += 1;
                }
                let end = plan[j].0 as usize + 1;
                w.add_raw_blocks(*b, &new_data[*b as usize * BS..end * BS])
                    .unwrap();
                i = j;
            }
        }
        i += 1;
    }
    w.finalize().unwrap();
    new_data.len() as u64
}

/// A `vabc serve` child. Dropping it sends SIGTERM and waits, so a failing assertion
/// does not leave mounts behind.
pub struct Server {
    child: Option<Child>,
    pub stdout: Vec<String>,
    stderr_log: Option<PathBuf>,
}

impl Server {
    /// Starts `vabc serve ARGS` and waits for its "ready" line.
    pub fn start(args: &[&std::ffi::OsStr]) -> Server {
        Server::launch(args, None)
    }

    /// Like [`Server::start`], with stderr captured to `log` (read it with [`Server::log`]).
    pub fn start_logged(args: &[&std::ffi::OsStr], log: &Path) -> Server {
        Server::launch(args, Some(log))
    }

    fn launch(args: &[&std::ffi::OsStr], log: Option<&Path>) -> Server {
        let stderr = match log {
            Some(p) => Stdio::from(std::fs::File::create(p).unwrap()),
            None => Stdio::inherit(),
        };
        // The default transport (auto) follows a kernel switch that the io_uring tests
        // flip; tests that do not choose one test the /dev/fuse path, every time.
        let fuse = args.iter().any(|a| *a == "--fuse" || *a == "--mount");
        let chosen = args
            .iter()
            .any(|a| *a == "--fuse-uring" || *a == "--fuse-transport");
        let pin: &[&str] = match fuse && !chosen {
            true => &["--fuse-transport", "classic"],
            false => &[],
        };
        let mut child = Command::new(vabc())
            .arg("serve")
            .args(args)
            .args(pin)
            .stdout(Stdio::piped())
            .stderr(stderr)
            .spawn()
            .expect("spawn vabc serve");
        let out = child.stdout.take().unwrap();
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(out).lines().map_while(Result::ok) {
                if tx.send(line).is_err() {
                    break;
                }
            }
        });
        let mut server = Server {
            child: Some(child),
            stdout: Vec::new(),
            stderr_log: log.map(Path::to_path_buf),
        };
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            match rx.recv_timeout(Duration::from_millis(200)) {
                Ok(line) => {
                    let ready = line.contains("ready");
                    server.stdout.push(line);
                    if ready {
                        return server;
                    }
                }
                Err(_) => {
                    if let Some(status) = server.child.as_mut().unwrap().try_wait().unwrap() {
                        panic!(
                            "vabc serve exited early with {status}: {:?} {}",
                            server.stdout,
                            server.log()
                        );
                    }
                    assert!(Instant::now() < deadline, "vabc serve not ready after 60 s");
                }
            }
        }
    }

    /// Asserts that a line the server printed before "ready" contains `text`.
    pub fn assert_said(&self, text: &str) {
        assert!(
            self.stdout.iter().any(|l| l.contains(text)),
            "no {text:?} in {:?}",
            self.stdout
        );
    }

    /// What the server wrote to stderr so far (only for [`Server::start_logged`]).
    pub fn log(&self) -> String {
        self.stderr_log
            .as_ref()
            .map(|p| std::fs::read_to_string(p).unwrap_or_default())
            .unwrap_or_default()
    }

    pub fn pid(&self) -> i32 {
        self.child.as_ref().unwrap().id() as i32
    }

    /// Sends SIGKILL (no tear-down) and reaps the process.
    pub fn kill(mut self) -> std::process::ExitStatus {
        let mut child = self.child.take().unwrap();
        let _ = child.kill();
        child.wait().unwrap()
    }

    /// Sends SIGTERM and returns the exit status.
    pub fn stop(mut self) -> std::process::ExitStatus {
        let mut child = self.child.take().unwrap();
        sigterm(child.id());
        child.wait().unwrap()
    }

    /// The loop device the mount stack attached, parsed from the ready message.
    pub fn loop_device(&self) -> Option<String> {
        self.stdout.iter().find_map(|l| {
            l.split_whitespace()
                .find(|w| w.starts_with("/dev/loop"))
                .map(str::to_string)
        })
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        if let Some(mut c) = self.child.take() {
            sigterm(c.id());
            let _ = c.wait();
        }
    }
}

pub fn sigterm(pid: u32) {
    let _ = Command::new("kill")
        .args(["-TERM", &pid.to_string()])
        .status();
}

/// One AOSP vector to export through FUSE: its base, the COW `cow_name`, the expected
/// image and its size, and an empty mount directory `dir` in `tmp`.
pub struct VectorExport {
    pub tmp: tempfile::TempDir,
    pub base: PathBuf,
    pub cow: PathBuf,
    pub expected: PathBuf,
    pub size: String,
    pub dir: PathBuf,
}

impl VectorExport {
    pub fn new(cow_name: &str) -> VectorExport {
        let v = vectors();
        let expected = v.join("expected.img");
        let size = std::fs::metadata(&expected).unwrap().len().to_string();
        let tmp = tempfile::tempdir().unwrap();
        let dir = tmp.path().join("fuse");
        std::fs::create_dir(&dir).unwrap();
        VectorExport {
            tmp,
            base: v.join("base.img"),
            cow: v.join(cow_name),
            expected,
            size,
            dir,
        }
    }

    /// `--base B --cow C --size S --fuse DIR`.
    pub fn args(&self) -> Vec<&std::ffi::OsStr> {
        vec![
            os("--base"),
            self.base.as_os_str(),
            os("--cow"),
            self.cow.as_os_str(),
            os("--size"),
            os(&self.size),
            os("--fuse"),
            self.dir.as_os_str(),
        ]
    }
}

/// Switches the kernel's FUSE-over-io_uring parameter on or off (root, Linux 6.14+ with
/// CONFIG_FUSE_IO_URING). It only lets FUSE servers that ask for rings use them, so
/// other daemons are unaffected.
pub fn set_fuse_uring_param(on: bool) {
    const PARAM: &str = "/sys/module/fuse/parameters/enable_uring";
    std::fs::write(PARAM, if on { "Y" } else { "N" })
        .unwrap_or_else(|e| panic!("write {PARAM} (needs root and CONFIG_FUSE_IO_URING): {e}"));
}

pub fn os<S: AsRef<std::ffi::OsStr> + ?Sized>(s: &S) -> &std::ffi::OsStr {
    s.as_ref()
}

/// Mount points (from /proc/self/mountinfo) at or below `dir`.
pub fn mounts_under(dir: &Path) -> Vec<String> {
    let info = std::fs::read_to_string("/proc/self/mountinfo").unwrap();
    let d = dir.to_string_lossy().to_string();
    info.lines()
        .filter_map(|l| l.split(' ').nth(4))
        .filter(|mp| mp.starts_with(&d))
        .map(str::to_string)
        .collect()
}

/// Loop devices whose backing file path contains `needle`.
pub fn loops_backed_by(needle: &str) -> Vec<String> {
    let mut found = Vec::new();
    for e in std::fs::read_dir("/sys/block").unwrap().flatten() {
        let name = e.file_name().to_string_lossy().to_string();
        if !name.starts_with("loop") {
            continue;
        }
        if let Ok(b) = std::fs::read_to_string(e.path().join("loop/backing_file"))
            && b.contains(needle)
        {
            found.push(format!("{name}: {}", b.trim()));
        }
    }
    found
}

/// Asserts that nothing of a serve run is left: no mount under `dir`, no vabc FUSE
/// mount, no loop device on a FUSE export.
pub fn assert_nothing_left(dir: &Path) {
    let m = mounts_under(dir);
    assert!(m.is_empty(), "left mounted: {m:?}");
    let info = std::fs::read_to_string("/proc/self/mountinfo").unwrap();
    let ours: Vec<&str> = info
        .lines()
        .filter(|l| l.contains("fuse.vabc") && l.contains(&dir.to_string_lossy().to_string()))
        .collect();
    assert!(ours.is_empty(), "FUSE export left mounted: {ours:?}");
    let loops = loops_backed_by(&dir.to_string_lossy());
    assert!(loops.is_empty(), "loop devices left attached: {loops:?}");
}

/// Runs a command and returns (success, stdout+stderr).
pub fn run(cmd: &mut Command) -> (bool, String) {
    let out = cmd.output().unwrap_or_else(|e| panic!("run {cmd:?}: {e}"));
    let mut text = String::from_utf8_lossy(&out.stdout).to_string();
    text.push_str(&String::from_utf8_lossy(&out.stderr));
    (out.status.success(), text)
}

/// Mounts an image read-only through util-linux (the reference side); unmounted on drop.
pub struct RefMount {
    pub dir: PathBuf,
}

impl RefMount {
    pub fn new(img: &Path, fstype: &str, dir: &Path) -> RefMount {
        std::fs::create_dir_all(dir).unwrap();
        let (ok, out) = run(Command::new("mount")
            .args(["-t", fstype, "-o", "ro,loop"])
            .arg(img)
            .arg(dir));
        assert!(ok, "reference mount of {} failed: {out}", img.display());
        RefMount {
            dir: dir.to_path_buf(),
        }
    }
}

impl Drop for RefMount {
    fn drop(&mut self) {
        let _ = Command::new("umount").arg(&self.dir).status();
    }
}

/// An 8 MiB sparse base (a hole at 3..5 MiB) and a new image with a 1 MiB run of zeros
/// written over data at 1..2 MiB (ZERO ops) and 64 KiB changed at 6 MiB; returns (old,
/// new, cow). Served, 1..2 and 3..5 MiB read as zeros with nothing stored.
pub fn sparse_pair(t: &Path) -> (PathBuf, PathBuf, PathBuf) {
    use std::os::unix::fs::FileExt;
    const MIB: usize = 1 << 20;
    let mut rng = fastrand::Rng::with_seed(0x2545_f491_4f6c_dd1d);
    let mut bytes = |n: usize| -> Vec<u8> {
        let mut v = vec![0u8; n];
        rng.fill(&mut v);
        v
    };
    let old = t.join("old.img");
    let f = std::fs::File::create(&old).unwrap();
    f.set_len(8 * MIB as u64).unwrap();
    f.write_all_at(&bytes(3 * MIB), 0).unwrap();
    f.write_all_at(&bytes(3 * MIB), 5 * MIB as u64).unwrap();
    f.sync_all().unwrap();
    let mut new_data = std::fs::read(&old).unwrap();
    new_data[MIB..2 * MIB].fill(0);
    new_data[6 * MIB..6 * MIB + (64 << 10)].copy_from_slice(&bytes(64 << 10));
    let new = t.join("new.img");
    std::fs::write(&new, &new_data).unwrap();
    let cow = t.join("update.cow");
    make_cow(&old, &new, &cow, 3, "lz4");
    (old, new, cow)
}
