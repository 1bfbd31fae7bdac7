//! The Redis backend with real processes: a real `redis-server` on a free
//! loopback port, `qforge calibrate --cluster` as the coordinator and
//! `qforge worker` processes, killed and stopped on purpose. The assertion
//! is always the same: the `.qstats` bytes equal a clean single-worker run.
//!
//! The model is a seeded, wide MLP policy written by the test (two 2048-wide
//! layers; a 64-observation batch takes tens of milliseconds) so that faults
//! land mid-batch, observed on the CartPole rollouts.

#[path = "../../runner/tests/support/redis_server.rs"]
mod redis_server;
mod support;

use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use redis_server::RedisServer;
use serde_json::Value;
use support::root;

/// Complete checkpoints in `dir` (not the temporary files being written).
fn checkpoints_in(dir: &Path) -> usize {
    std::fs::read_dir(dir).map_or(0, |entries| {
        entries
            .filter(|e| {
                e.as_ref()
                    .is_ok_and(|e| e.file_name().to_string_lossy().ends_with(".qstats"))
            })
            .count()
    })
}

/// Heartbeat settings of the tests: fast, so deaths are noticed quickly.
const HEARTBEAT: [&str; 4] = ["--heartbeat-ms", "100", "--heartbeat-timeout-ms", "500"];

fn rollouts() -> String {
    root()
        .join("fixtures/policies/cartpole/rollouts.jsonl")
        .to_string_lossy()
        .into_owned()
}

fn temp(name: &str) -> tempfile::TempDir {
    support::temp("cluster", name)
}

/// Writes a policy with two `width`-wide tanh layers and seeded weights.
fn wide_policy(dir: &Path, width: usize) {
    std::fs::create_dir_all(dir).unwrap();
    let config = serde_json::json!({
        "format": "qforge-mlp-policy", "version": 1, "observation_dim": 4,
        "hidden": [width, width], "activation": "tanh",
        "head": {"kind": "discrete", "actions": 2}
    });
    std::fs::write(dir.join("policy.json"), config.to_string()).unwrap();
    let shapes = [
        ("layers.0.weight", vec![width, 4]),
        ("layers.0.bias", vec![width]),
        ("layers.1.weight", vec![width, width]),
        ("layers.1.bias", vec![width]),
        ("layers.2.weight", vec![2, width]),
        ("layers.2.bias", vec![2]),
    ];
    let mut rng = StdRng::seed_from_u64(7);
    let mut header = serde_json::Map::new();
    let mut data = Vec::new();
    for (name, shape) in &shapes {
        let fan_in = *shape.last().unwrap() as f32;
        let start = data.len();
        for _ in 0..shape.iter().product::<usize>() {
            let v: f32 = rng.random_range(-1.0..1.0) / fan_in.sqrt();
            data.extend_from_slice(&v.to_le_bytes());
        }
        header.insert(
            (*name).into(),
            serde_json::json!({"dtype": "F32", "shape": shape, "data_offsets": [start, data.len()]}),
        );
    }
    let header = Value::Object(header).to_string();
    let mut file = (header.len() as u64).to_le_bytes().to_vec();
    file.extend_from_slice(header.as_bytes());
    file.extend_from_slice(&data);
    std::fs::write(dir.join("model.safetensors"), file).unwrap();
}

/// A child process that is killed when dropped (a failing test leaves no
/// stray workers behind).
struct Proc(Child);

impl Proc {
    fn signal(&self, signal: &str) {
        let status = Command::new("kill")
            .args([&format!("-{signal}"), &self.0.id().to_string()])
            .status()
            .unwrap();
        assert!(status.success(), "kill -{signal}");
    }

    /// Waits for the exit; panics past `limit`.
    fn wait(&mut self, limit: Duration, what: &str) -> std::process::ExitStatus {
        let deadline = Instant::now() + limit;
        loop {
            if let Some(status) = self.0.try_wait().unwrap() {
                return status;
            }
            assert!(
                Instant::now() < deadline,
                "{what} did not finish within {limit:?}"
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    fn finished(&mut self) -> bool {
        self.0.try_wait().unwrap().is_some()
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// One calibration setup: the model, the output folder, the reference bytes.
struct Setup {
    dir: tempfile::TempDir,
    model: String,
    reference: Vec<u8>,
    recipe: Vec<String>,
}

impl Setup {
    fn new(name: &str, samples: usize) -> Self {
        Self::with_width(name, samples, 2048)
    }

    fn with_width(name: &str, samples: usize, width: usize) -> Self {
        let dir = temp(name);
        wide_policy(&dir.path().join("policy"), width);
        let model = dir.path().join("policy").to_string_lossy().into_owned();
        let recipe = vec![
            "--samples".to_owned(),
            samples.to_string(),
            "--batch-size".to_owned(),
            "64".to_owned(),
        ];
        let mut setup = Self {
            dir,
            model,
            reference: Vec::new(),
            recipe,
        };
        let out = setup.dir.path().join("reference.qstats");
        let status = setup.calibrate(&["--workers", "1"], &out).0.wait().unwrap();
        assert!(status.success());
        setup.reference = std::fs::read(out).unwrap();
        setup
    }

    fn calibrate(&self, extra: &[&str], out: &Path) -> Proc {
        Proc(
            Command::new(env!("CARGO_BIN_EXE_qforge"))
                .args(["calibrate", "--model", &self.model, "--data", &rollouts()])
                .args(&self.recipe)
                .args(extra)
                .args(["--json", "-o", out.to_str().unwrap()])
                .env("RAYON_NUM_THREADS", "1")
                .stdout(Stdio::piped())
                .stderr(Stdio::piped())
                .spawn()
                .unwrap(),
        )
    }

    fn worker(&self, url: &str, run: &str, name: &str) -> Proc {
        let log = std::fs::File::create(self.dir.path().join(format!("{name}.log"))).unwrap();
        Proc(
            Command::new(env!("CARGO_BIN_EXE_qforge"))
                .args(["worker", "--cluster", url, "--run", run, "--name", name])
                .args(["--wait", "60"])
                .env("RAYON_NUM_THREADS", "1")
                .stdout(Stdio::null())
                .stderr(log)
                .spawn()
                .unwrap(),
        )
    }

    /// Waits for the coordinator, checks success, returns its JSON summary
    /// and whether its output equals the reference.
    fn finish(&self, mut coordinator: Proc, out: &Path) -> Value {
        let status = coordinator.wait(Duration::from_secs(240), "the coordinator");
        let mut stdout = String::new();
        let mut stderr = String::new();
        use std::io::Read;
        coordinator
            .0
            .stdout
            .take()
            .unwrap()
            .read_to_string(&mut stdout)
            .unwrap();
        coordinator
            .0
            .stderr
            .take()
            .unwrap()
            .read_to_string(&mut stderr)
            .unwrap();
        assert!(status.success(), "coordinator failed: {stderr}");
        let bytes = std::fs::read(out).unwrap();
        assert!(
            bytes == self.reference,
            "{} differs from the single-worker run",
            out.display()
        );
        serde_json::from_str(&stdout).unwrap()
    }
}

fn cluster_args<'a>(url: &'a str, run: &'a str) -> Vec<&'a str> {
    let mut args = vec!["--cluster", url, "--run", run];
    args.extend(HEARTBEAT);
    args
}

fn redis_get(server: &RedisServer, key: &str) -> Option<String> {
    let client = redis::Client::open(server.url()).unwrap();
    let mut connection = client.get_connection().unwrap();
    redis::cmd("GET").arg(key).query(&mut connection).unwrap()
}

#[test]
fn one_and_four_workers_give_identical_bytes_behind_a_password() {
    let Some(server) = RedisServer::start("auth", Some("s3cret pass")) else {
        return;
    };
    let setup = Setup::new("auth", 1024);
    let url = server.url();
    for workers in [1, 4] {
        let run = format!("auth-{workers}");
        let out = setup.dir.path().join(format!("{run}.qstats"));
        let coordinator = setup.calibrate(&cluster_args(&url, &run), &out);
        let mut pool: Vec<Proc> = (0..workers)
            .map(|w| setup.worker(&url, &run, &format!("w{w}")))
            .collect();
        let summary = setup.finish(coordinator, &out);
        assert_eq!(summary["backend"], "redis");
        assert_eq!(summary["merged_batches"], 16);
        for worker in &mut pool {
            assert!(worker.wait(Duration::from_secs(20), "a worker").success());
        }
    }

    // The password beside the URL, where `ps` does not show it: from a
    // file for the coordinator, from the environment for the worker.
    let bare = server.url_without_password();
    let password_file = setup.dir.path().join("redis-password");
    std::fs::write(&password_file, "s3cret pass\n").unwrap();
    let out = setup.dir.path().join("beside.qstats");
    let mut args = cluster_args(&bare, "beside");
    args.extend(["--redis-password-file", password_file.to_str().unwrap()]);
    let coordinator = setup.calibrate(&args, &out);
    let mut worker = Proc(
        Command::new(env!("CARGO_BIN_EXE_qforge"))
            .args([
                "worker",
                "--cluster",
                &bare,
                "--run",
                "beside",
                "--wait",
                "60",
            ])
            .env("QFORGE_REDIS_PASSWORD", "s3cret pass")
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap(),
    );
    assert_eq!(setup.finish(coordinator, &out)["merged_batches"], 16);
    assert!(worker.wait(Duration::from_secs(20), "a worker").success());
    // Given twice: refused, and the message does not repeat it.
    let out = Command::new(env!("CARGO_BIN_EXE_qforge"))
        .args(["worker", "--cluster", &url, "--wait", "1"])
        .args(["--redis-password-file", password_file.to_str().unwrap()])
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    assert!(stderr.contains("given twice"), "{stderr}");
    assert!(!stderr.contains("s3cret"), "the password leaks: {stderr}");

    // Without the password, or with a wrong one: a clear error, exit 1.
    for url in [
        server.url_without_password(),
        format!("redis://:wrong@127.0.0.1:{}", server.port),
    ] {
        let out = Command::new(env!("CARGO_BIN_EXE_qforge"))
            .args(["worker", "--cluster", &url, "--wait", "1"])
            .output()
            .unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(1), "{stderr}");
        assert!(stderr.contains("refused the credentials"), "{stderr}");
        assert!(!stderr.contains("wrong"), "the password leaks: {stderr}");
    }
}

/// Returns once `worker` has a task of `run` delivered and not yet
/// acknowledged, or the coordinator has finished.
fn wait_until_holding_a_task(
    server: &RedisServer,
    run: &str,
    worker: &str,
    coordinator: &mut Proc,
) {
    let client = redis::Client::open(server.url()).unwrap();
    let mut connection = client.get_connection().unwrap();
    let deadline = Instant::now() + Duration::from_secs(120);
    loop {
        let pending: Vec<(String, String, u64, u64)> = redis::cmd("XPENDING")
            .arg(format!("qforge:{{{run}}}:tasks"))
            .arg("workers")
            .arg("-")
            .arg("+")
            .arg(1)
            .arg(worker)
            .query(&mut connection)
            .unwrap_or_default();
        if !pending.is_empty() || coordinator.finished() {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "{worker} never took a task of {run}"
        );
        std::thread::sleep(Duration::from_millis(5));
    }
}

#[test]
fn twenty_seeded_runs_with_workers_sigkilled_give_identical_bytes() {
    let Some(server) = RedisServer::start("chaos", None) else {
        return;
    };
    // Batches must be slow enough for a SIGKILL 50–500 ms into a run to land
    // mid-batch: with 2048-wide layers an optimised build finished most runs
    // before the first kill, and no run reclaimed anything.
    let setup = Setup::with_width("chaos", 2048, 4096);
    let url = server.url();
    let mut reclaimed_somewhere = false;
    for seed in 0..20u64 {
        let mut rng = StdRng::seed_from_u64(seed);
        let run = format!("chaos-{seed}");
        let out = setup.dir.path().join(format!("{run}.qstats"));
        let mut coordinator = setup.calibrate(&cluster_args(&url, &run), &out);
        let mut pool: Vec<Proc> = (0..3)
            .map(|w| setup.worker(&url, &run, &format!("s{seed}-w{w}")))
            .collect();
        let kills = rng.random_range(1..=3);
        for k in 0..kills {
            std::thread::sleep(Duration::from_millis(rng.random_range(50..500)));
            let victim = rng.random_range(0..pool.len());
            // The first kill waits for its victim to hold a task, so every
            // run loses a batch mid-flight however fast or loaded the
            // machine is (a kill by the clock alone landed between batches,
            // or after the run, on a busy CI machine).
            if k == 0 {
                wait_until_holding_a_task(
                    &server,
                    &run,
                    &format!("s{seed}-w{victim}"),
                    &mut coordinator,
                );
            }
            if coordinator.finished() {
                break;
            }
            pool[victim].signal("KILL");
            pool[victim] = setup.worker(&url, &run, &format!("s{seed}-r{k}"));
        }
        let summary = setup.finish(coordinator, &out);
        assert_eq!(summary["coverage"], 1.0, "seed {seed}");
        for worker in &mut pool {
            assert!(worker.wait(Duration::from_secs(20), "a worker").success());
        }
        // Did some replacement redo a dead worker's batch?
        reclaimed_somewhere |= std::fs::read_dir(setup.dir.path()).unwrap().any(|e| {
            let text = std::fs::read_to_string(e.unwrap().path()).unwrap_or_default();
            text.contains("reclaimed)") && !text.contains(" 0 reclaimed)")
        });
    }
    assert!(
        reclaimed_somewhere,
        "no run exercised reclaiming a dead worker's task"
    );
}

#[test]
fn a_sigkilled_coordinator_resumes_to_identical_bytes() {
    let Some(server) = RedisServer::start("coordinator", None) else {
        return;
    };
    let setup = Setup::new("coordinator", 2048);
    let url = server.url();
    let checkpoints = setup.dir.path().join("checkpoints");
    let out = setup.dir.path().join("resumed.qstats");
    let mut args = cluster_args(&url, "crash");
    let dir = checkpoints.to_str().unwrap();
    args.extend(["--checkpoint-dir", dir, "--checkpoint-every", "4"]);
    let coordinator = setup.calibrate(&args, &out);
    let mut pool: Vec<Proc> = (0..2)
        .map(|w| setup.worker(&url, "crash", &format!("w{w}")))
        .collect();
    let deadline = Instant::now() + Duration::from_secs(60);
    while checkpoints_in(&checkpoints.join("crash")) < 2 {
        assert!(Instant::now() < deadline, "no checkpoint appeared");
        std::thread::sleep(Duration::from_millis(10));
    }
    coordinator.signal("KILL");
    drop(coordinator);

    args.extend(["--resume", "crash"]);
    let resumed = setup.calibrate(&args, &out);
    let summary = setup.finish(resumed, &out);
    assert!(
        summary["resumed_batches"].as_u64().unwrap() >= 8,
        "{summary}"
    );
    for worker in &mut pool {
        assert!(worker.wait(Duration::from_secs(20), "a worker").success());
    }
}

#[test]
fn redis_stopped_mid_run_by_sigterm_or_sigkill_loses_and_doubles_nothing() {
    for signal in ["TERM", "KILL"] {
        let name = format!("outage-{signal}");
        let Some(mut server) = RedisServer::start(&name, None) else {
            return;
        };
        let setup = Setup::new(&name, 4000);
        let url = server.url();
        let out = setup.dir.path().join("out.qstats");
        let checkpoints = setup.dir.path().join("checkpoints");
        let mut args = cluster_args(&url, "outage");
        args.extend(["--checkpoint-dir", checkpoints.to_str().unwrap()]);
        args.extend(["--checkpoint-every", "4"]);
        let coordinator = setup.calibrate(&args, &out);
        let mut pool: Vec<Proc> = (0..2)
            .map(|w| setup.worker(&url, "outage", &format!("w{w}")))
            .collect();
        let deadline = Instant::now() + Duration::from_secs(60);
        while checkpoints_in(&checkpoints.join("outage")) < 1 {
            assert!(Instant::now() < deadline, "no progress before the outage");
            std::thread::sleep(Duration::from_millis(10));
        }
        server.stop(signal);
        std::thread::sleep(Duration::from_millis(1500));
        server.restart();
        let summary = setup.finish(coordinator, &out);
        assert_eq!(summary["merged_batches"], 63, "{signal}: {summary}");
        for worker in &mut pool {
            assert!(worker.wait(Duration::from_secs(30), "a worker").success());
        }
    }
}

#[test]
fn a_sigstopped_worker_loses_its_batch_and_its_late_result_is_dropped() {
    let Some(server) = RedisServer::start("stop", None) else {
        return;
    };
    // Four times the work per batch, so the run outlasts the stop by seconds
    // and the stopped worker's late result arrives while it still runs.
    let setup = Setup::with_width("stop", 4000, 4096);
    let url = server.url();
    let out = setup.dir.path().join("out.qstats");
    let mut args = cluster_args(&url, "stop");
    args.extend(["--speculation", "1"]);
    let coordinator = setup.calibrate(&args, &out);
    let mut sleeper = setup.worker(&url, "stop", "sleeper");
    // Stop the first worker while it is observing a batch.
    let deadline = Instant::now() + Duration::from_secs(60);
    let task = loop {
        let beat = redis_get(&server, "qforge:{stop}:hb:sleeper");
        if let Some(task) = beat.filter(|b| b != "-") {
            break task;
        }
        assert!(
            Instant::now() < deadline,
            "the worker never started a batch"
        );
        std::thread::sleep(Duration::from_millis(5));
    };
    sleeper.signal("STOP");
    let mut other = setup.worker(&url, "stop", "other");
    // Resume it only once the other worker has taken its task over (the
    // task is no longer pending on the stopped worker), so its result
    // arrives late whatever the machine's load.
    let client = redis::Client::open(server.url()).unwrap();
    let mut connection = client.get_connection().unwrap();
    let deadline = Instant::now() + Duration::from_secs(120);
    loop {
        let pending: Vec<(String, String, u64, u64)> = redis::cmd("XPENDING")
            .arg("qforge:{stop}:tasks")
            .arg("workers")
            .arg(&task)
            .arg(&task)
            .arg(1)
            .query(&mut connection)
            .unwrap();
        if pending
            .first()
            .is_none_or(|(_, consumer, _, _)| consumer != "sleeper")
        {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "the stopped worker's task was never taken over"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    sleeper.signal("CONT");
    let summary = setup.finish(coordinator, &out);
    assert!(summary["duplicates"].as_u64().unwrap() >= 1, "{summary}");
    assert!(
        sleeper
            .wait(Duration::from_secs(20), "the stopped worker")
            .success()
    );
    assert!(
        other
            .wait(Duration::from_secs(20), "the other worker")
            .success()
    );
    let log = std::fs::read_to_string(setup.dir.path().join("other.log")).unwrap();
    assert!(!log.contains(" 0 reclaimed)"), "{log}");
}

/// The one SmolLM2 run through Redis (a few thousand tokens): the coordinator
/// plans with the tokenizer and chat template alone, the worker loads the
/// weights, and the bytes equal the embedded backend's.
#[test]
fn smollm2_through_redis_equals_the_embedded_run() {
    let Some(server) = RedisServer::start("smollm2", None) else {
        return;
    };
    let model = root().join("models/smollm2-135m-instruct-q4_1.gguf");
    assert!(
        model.exists(),
        "{} is missing: run scripts/fetch-models.sh (scripts/test.sh does)",
        model.display()
    );
    let dir = temp("smollm2");
    let dir = dir.path();
    let common = |out: &Path| {
        let mut command = Command::new(env!("CARGO_BIN_EXE_qforge"));
        command
            .args(["calibrate", "--model", model.to_str().unwrap()])
            .args([
                "--data",
                root()
                    .join("fixtures/episodes/arithmetic.jsonl")
                    .to_str()
                    .unwrap(),
            ])
            .args(["--samples", "16", "--seq-len", "96", "--batch-size", "4"])
            .args(["-o", out.to_str().unwrap(), "--json"]);
        command
    };
    let embedded = dir.join("embedded.qstats");
    let status = common(&embedded).args(["--workers", "1"]).status().unwrap();
    assert!(status.success());
    let clustered = dir.join("redis.qstats");
    let url = server.url();
    let mut worker = Proc(
        Command::new(env!("CARGO_BIN_EXE_qforge"))
            .args(["worker", "--cluster", &url, "--run", "smol", "--wait", "60"])
            .stderr(Stdio::null())
            .spawn()
            .unwrap(),
    );
    let status = common(&clustered)
        .args(["--cluster", &url, "--run", "smol"])
        .stdout(Stdio::null())
        .status()
        .unwrap();
    assert!(status.success());
    assert!(worker.wait(Duration::from_secs(60), "the worker").success());
    assert_eq!(
        std::fs::read(&clustered).unwrap(),
        std::fs::read(&embedded).unwrap(),
        "Redis and embedded statistics differ"
    );
}

#[test]
fn quantize_through_redis_writes_the_embedded_artifact() {
    let Some(server) = RedisServer::start("quantize", None) else {
        return;
    };
    let dir = temp("quantize");
    let dir = dir.path();
    let quantize = |extra: &[&str], out: &str| -> Proc {
        Proc(
            Command::new(env!("CARGO_BIN_EXE_qforge"))
                .current_dir(dir)
                .args(["quantize", "-o", out, "--json"])
                .args(extra)
                .stdout(Stdio::null())
                .stderr(std::fs::File::create(dir.join(format!("{out}.log"))).unwrap())
                .spawn()
                .unwrap(),
        )
    };
    let url = server.url();
    let mut coordinator = quantize(&["--cluster", &url], "cluster");
    // The worker joins whichever run is active (the quantize run's name is
    // derived from its hashes).
    let mut worker = Proc(
        Command::new(env!("CARGO_BIN_EXE_qforge"))
            .args(["worker", "--cluster", &url, "--wait", "60"])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap(),
    );
    let status = coordinator.wait(Duration::from_secs(60), "quantize --cluster");
    let log = std::fs::read_to_string(dir.join("cluster.log")).unwrap();
    assert!(status.success(), "{log}");
    assert!(worker.wait(Duration::from_secs(20), "the worker").success());
    assert!(
        quantize(&[], "embedded")
            .wait(Duration::from_secs(60), "quantize")
            .success()
    );
    // Same statistics, same decisions, same bytes.
    for file in ["qforge.json", "model.safetensors", "policy.json"] {
        assert_eq!(
            std::fs::read(dir.join("cluster").join(file)).unwrap(),
            std::fs::read(dir.join("embedded").join(file)).unwrap(),
            "{file}"
        );
    }
    let report: Value =
        serde_json::from_slice(&std::fs::read(dir.join("cluster/report.json")).unwrap()).unwrap();
    assert_eq!(report["calibration"]["backend"], "redis");
    // The method search ran plain, then SmoothQuant's two passes; the worker
    // followed from one method into the next.
    assert_eq!(report["method"]["chosen"], "smoothquant");

    // Under a looser budget plain holds and the search stops after its
    // pass: the worker, told the next pass is skipped, leaves cleanly.
    let mut coordinator = quantize(&["--cluster", &url, "--min-agreement", "0.98"], "loose");
    let worker_log = dir.join("loose-worker.log");
    let mut worker = Proc(
        Command::new(env!("CARGO_BIN_EXE_qforge"))
            .args(["worker", "--cluster", &url, "--wait", "60"])
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(&worker_log).unwrap())
            .spawn()
            .unwrap(),
    );
    let status = coordinator.wait(Duration::from_secs(60), "quantize --cluster");
    let log = std::fs::read_to_string(dir.join("loose.log")).unwrap();
    assert!(status.success(), "{log}");
    assert!(worker.wait(Duration::from_secs(20), "the worker").success());
    let report: Value =
        serde_json::from_slice(&std::fs::read(dir.join("loose/report.json")).unwrap()).unwrap();
    assert_eq!(report["method"]["chosen"], "plain");
    let worker_log = std::fs::read_to_string(&worker_log).unwrap();
    assert!(
        worker_log.contains("is skipped; nothing to do"),
        "{worker_log}"
    );
}

/// SmoothQuant's two passes on three workers, one SIGKILLed while it
/// observes a batch of the second pass (the smoothed model): the workers
/// follow the pipeline from pass to pass, the killed worker's batch is redone,
/// and the artifact is byte-identical to the single-thread embedded run's.
/// Static scales under a loose budget, so the guard accepts the recipe's plan
/// as it is and the scales come straight from the second pass's statistics.
#[test]
fn smoothquant_on_three_workers_with_one_killed_writes_the_single_worker_artifact() {
    let Some(server) = RedisServer::start("smoothquant", None) else {
        return;
    };
    let dir = temp("smoothquant");
    let dir = dir.path();
    let model = root().join("models/smollm2-135m-instruct-q4_1.gguf");
    let quantize = |extra: &[&str], out: &str| -> Proc {
        Proc(
            Command::new(env!("CARGO_BIN_EXE_qforge"))
                .current_dir(dir)
                .args(["quantize", "--model", model.to_str().unwrap()])
                .args([
                    "--data",
                    root()
                        .join("fixtures/episodes/arithmetic.jsonl")
                        .to_str()
                        .unwrap(),
                    "--eval-data",
                    root().join("fixtures/text/eval.txt").to_str().unwrap(),
                ])
                .args(["--samples", "16", "--seq-len", "96", "--batch-size", "2"])
                // A fixed α: the search (the coordinator's, the same in both
                // runs) is not what this test is about, and costs minutes.
                .args(["--smoothquant", "--alpha", "0.5", "--activations", "static"])
                .args(["--max-perplexity-increase", "1", "--ctx", "128"])
                .args(extra)
                .args(["-o", out, "--json"])
                .stdout(Stdio::null())
                .stderr(std::fs::File::create(dir.join(format!("{out}.log"))).unwrap())
                .spawn()
                .unwrap(),
        )
    };
    let report = quantize_with_one_worker_killed(&server, dir, "smq", 2, &quantize);
    let passes = report["calibration"]["passes"].as_array().unwrap();
    assert_eq!(passes.len(), 2, "{report}");
    for pass in passes {
        assert_eq!(pass["merged"], pass["planned"], "{pass}");
    }
}

/// GPTQ on three workers, one SIGKILLed while it sums a Hessian: the exact
/// Gram matrices merge to the single-worker integers, so GPTQ rounds the
/// same int8 weights. The policy is two 2048-wide layers, so each batch's
/// result carries two 2048 × 2048 Hessians (tens of MB through Redis).
#[test]
fn gptq_on_three_workers_with_one_killed_writes_the_single_worker_artifact() {
    let Some(server) = RedisServer::start("gptq", None) else {
        return;
    };
    let dir = temp("gptq");
    let dir = dir.path();
    wide_policy(&dir.join("policy"), 2048);
    let model = dir.join("policy");
    let quantize = |extra: &[&str], out: &str| -> Proc {
        Proc(
            Command::new(env!("CARGO_BIN_EXE_qforge"))
                .current_dir(dir)
                .args(["quantize", "--model", model.to_str().unwrap()])
                .args(["--data", &rollouts()])
                // The output `nearest` is the same recipe without GPTQ.
                .args(if out == "nearest" {
                    &["--no-method-search"][..]
                } else {
                    &["--gptq"]
                })
                .args(["--samples", "512", "--batch-size", "128"])
                // The test is about bytes, not about this random policy's
                // accuracy: any decision the guard reaches will do.
                .args(["--min-agreement", "0", "--activations", "dynamic"])
                .args(extra)
                .args(["-o", out, "--json"])
                .stdout(Stdio::null())
                .stderr(std::fs::File::create(dir.join(format!("{out}.log"))).unwrap())
                .spawn()
                .unwrap(),
        )
    };
    // The Hessians fit in one group, so the activation pass (pass 1) sums them.
    let report = quantize_with_one_worker_killed(&server, dir, "gptq", 1, &quantize);
    let passes: Vec<&str> = report["calibration"]["passes"]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| p["pass"].as_str().unwrap())
        .collect();
    assert_eq!(passes, ["activation+hessian"], "{report}");
    assert_eq!(report["gptq"]["layers"], 3, "{report}");
    // GPTQ chose other integers than rounding to nearest does.
    let mut nearest = quantize(&["--workers", "1"], "nearest");
    assert!(nearest.wait(Duration::from_secs(900), "quantize").success());
    assert!(
        std::fs::read(dir.join("nearest/model.safetensors")).unwrap()
            != std::fs::read(dir.join("embedded/model.safetensors")).unwrap()
    );
}

/// Runs `quantize --cluster` (run `run`) with three workers, SIGKILLs one as
/// soon as its heartbeat names a task of pass `pass`, then `quantize
/// --workers 1`, and asserts both wrote the same `model.safetensors` and
/// `qforge.json`; returns the cluster run's report.
fn quantize_with_one_worker_killed(
    server: &RedisServer,
    dir: &Path,
    run: &str,
    pass: usize,
    quantize: &dyn Fn(&[&str], &str) -> Proc,
) -> Value {
    let url = server.url();
    let mut args = vec!["--cluster", &url, "--run", run];
    args.extend(HEARTBEAT);
    let mut coordinator = quantize(&args, "cluster");
    let worker = |name: &str| {
        Proc(
            Command::new(env!("CARGO_BIN_EXE_qforge"))
                .args(["worker", "--cluster", &url, "--run", run, "--name", name])
                .args(["--wait", "120"])
                .stdout(Stdio::null())
                .stderr(std::fs::File::create(dir.join(format!("{name}.log"))).unwrap())
                .spawn()
                .unwrap(),
        )
    };
    let victim = worker("victim");
    let mut survivors = [worker("a"), worker("b")];
    // The first pass's Redis run is the run itself; later passes' carry a suffix.
    let pass_run = match pass {
        1 => run.to_owned(),
        _ => format!("{run}.pass{pass}"),
    };
    let heartbeat = format!("qforge:{{{pass_run}}}:hb:victim");
    let deadline = Instant::now() + Duration::from_secs(600);
    loop {
        let beat = redis_get(server, &heartbeat);
        if beat.is_some_and(|b| b != "-") {
            break;
        }
        assert!(
            !coordinator.finished() && Instant::now() < deadline,
            "the victim never observed a batch of pass {pass}"
        );
        std::thread::sleep(Duration::from_millis(5));
    }
    victim.signal("KILL");
    let status = coordinator.wait(Duration::from_secs(900), "quantize --cluster");
    let log = std::fs::read_to_string(dir.join("cluster.log")).unwrap();
    assert!(status.success(), "{log}");
    for (i, w) in survivors.iter_mut().enumerate() {
        assert!(
            w.wait(Duration::from_secs(60), "a worker").success(),
            "worker {i}"
        );
    }
    let followed = std::fs::read_to_string(dir.join("a.log")).unwrap();
    assert!(
        followed.contains(&format!("joining run {pass_run}")),
        "{followed}"
    );
    assert!(
        quantize(&["--workers", "1"], "embedded")
            .wait(Duration::from_secs(900), "quantize --workers 1")
            .success()
    );
    for file in ["model.safetensors", "qforge.json"] {
        assert!(
            std::fs::read(dir.join("cluster").join(file)).unwrap()
                == std::fs::read(dir.join("embedded").join(file)).unwrap(),
            "{file} differs between the cluster and the single-worker run"
        );
    }
    serde_json::from_slice(&std::fs::read(dir.join("cluster/report.json")).unwrap()).unwrap()
}
