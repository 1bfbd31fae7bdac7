//! A real `redis-server` for tests: started on a free loopback port with AOF
//! persistence (`appendfsync everysec`, as the deploy docs recommend), in its
//! own directory, killed when dropped. Shared by the runner and CLI tests.

#![allow(dead_code)] // each test crate uses a different subset

use std::net::TcpListener;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

pub struct RedisServer {
    child: Option<Child>,
    pub port: u16,
    dir: PathBuf,
    password: Option<String>,
    /// Arguments beyond the defaults (a cluster node's).
    extra: Vec<String>,
}

/// A free loopback port.
fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .expect("a free loopback port")
}

impl RedisServer {
    /// Starts a server, or returns `None` (printing SKIPPED) when
    /// `redis-server` is not installed, except under CI, where that fails.
    pub fn start(name: &str, password: Option<&str>) -> Option<Self> {
        Self::start_with(name, password, Vec::new())
    }

    /// [`RedisServer::start`] with `extra` arguments for `redis-server`.
    fn start_with(name: &str, password: Option<&str>, extra: Vec<String>) -> Option<Self> {
        if Command::new("redis-server")
            .arg("--version")
            .stdout(Stdio::null())
            .status()
            .is_err()
        {
            assert!(
                std::env::var_os("CI").is_none(),
                "redis-server is not installed; scripts/test.sh installs it"
            );
            eprintln!(
                "SKIPPED {name}: redis-server is not installed (scripts/test.sh installs it)"
            );
            return None;
        }
        let port = free_port();
        let dir =
            std::env::temp_dir().join(format!("qforge-redis-{name}-{}-{port}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).expect("redis dir");
        let mut server = Self {
            child: None,
            port,
            dir,
            password: password.map(str::to_owned),
            extra,
        };
        server.restart();
        Some(server)
    }

    /// `redis://[:PASSWORD@]127.0.0.1:PORT`.
    pub fn url(&self) -> String {
        match &self.password {
            Some(p) => format!("redis://:{p}@127.0.0.1:{}", self.port),
            None => format!("redis://127.0.0.1:{}", self.port),
        }
    }

    /// The URL without the password.
    pub fn url_without_password(&self) -> String {
        format!("redis://127.0.0.1:{}", self.port)
    }

    /// (Re)starts the server on the same port and data directory, and waits
    /// until it has loaded its AOF and answers.
    pub fn restart(&mut self) {
        let mut command = Command::new("redis-server");
        command
            .args(["--port", &self.port.to_string(), "--bind", "127.0.0.1"])
            .args(["--dir", self.dir.to_str().expect("utf-8 path")])
            .args([
                "--appendonly",
                "yes",
                "--appendfsync",
                "everysec",
                "--save",
                "",
            ])
            .args(["--logfile", "redis.log"])
            .args(&self.extra)
            .stdout(Stdio::null())
            .stderr(Stdio::null());
        if let Some(p) = &self.password {
            command.args(["--requirepass", p]);
        }
        self.child = Some(command.spawn().expect("redis-server starts"));
        let client = redis::Client::open(self.url()).expect("url");
        let deadline = Instant::now() + Duration::from_secs(20);
        loop {
            let ready = client
                .get_connection_with_timeout(Duration::from_millis(500))
                .and_then(|mut c| redis::cmd("PING").query::<String>(&mut c));
            if ready.is_ok() {
                return;
            }
            assert!(
                Instant::now() < deadline,
                "redis-server did not start: {ready:?}"
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// Freezes the server (SIGSTOP): its connections stay open and nothing
    /// answers, as on a hung host. Dropping it still kills it.
    pub fn freeze(&self) {
        if let Some(child) = &self.child {
            let status = Command::new("kill")
                .args(["-STOP", &child.id().to_string()])
                .status()
                .expect("kill runs");
            assert!(status.success(), "kill -STOP");
        }
    }

    /// Sends `signal` (e.g. "TERM", "KILL") and waits for the process to end.
    pub fn stop(&mut self, signal: &str) {
        if let Some(mut child) = self.child.take() {
            let _ = Command::new("kill")
                .args([&format!("-{signal}"), &child.id().to_string()])
                .status();
            let _ = child.wait();
        }
    }
}

impl Drop for RedisServer {
    fn drop(&mut self) {
        self.stop("KILL");
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// A Redis Cluster on loopback, its 16 384 slots split evenly between its
/// masters, each node a [`RedisServer`] in cluster mode: the masters first
/// in `nodes`, then their replicas (master `i`'s is `masters + i`).
pub struct RedisCluster {
    pub nodes: Vec<RedisServer>,
    masters: usize,
    /// Each node's cluster bus port.
    buses: Vec<u16>,
}

impl RedisCluster {
    /// Starts `masters` nodes, gives each its share of the slots, joins them
    /// and waits until every node sees the whole cluster serving; `None`
    /// as [`RedisServer::start`].
    pub fn start(name: &str, masters: usize) -> Option<Self> {
        Self::start_with_replicas(name, masters, false)
    }

    /// [`RedisCluster::start`], with one replica per master when `replicas`,
    /// and a node timeout of 1 s so that a dead master's replica takes over
    /// within seconds.
    pub fn start_with_replicas(name: &str, masters: usize, replicas: bool) -> Option<Self> {
        let count = if replicas { 2 * masters } else { masters };
        let (mut nodes, mut buses) = (Vec::new(), Vec::new());
        for i in 0..count {
            buses.push(free_port());
            let extra = [
                "--cluster-enabled",
                "yes",
                "--cluster-config-file",
                "nodes.conf",
                // The bus's default port (+10 000) may be past 65 535.
                "--cluster-port",
                &buses[i].to_string(),
                "--cluster-node-timeout",
                "1000",
                // A replica's first copy starts at once, not 5 s later.
                "--repl-diskless-sync-delay",
                "0",
            ];
            let extra = extra.iter().map(|a| a.to_string()).collect();
            nodes.push(RedisServer::start_with(
                &format!("{name}-{i}"),
                None,
                extra,
            )?);
        }
        let cluster = Self {
            nodes,
            masters,
            buses,
        };
        for (i, node) in cluster.nodes[..masters].iter().enumerate() {
            let (first, last) = cluster.slots_of(i);
            redis::cmd("CLUSTER")
                .arg("ADDSLOTSRANGE")
                .arg(first)
                .arg(last)
                .query::<()>(&mut cluster.connection(node))
                .expect("slots assigned");
        }
        let mut first = cluster.connection(&cluster.nodes[0]);
        for (node, bus) in cluster.nodes[1..].iter().zip(&cluster.buses[1..]) {
            redis::cmd("CLUSTER")
                .arg("MEET")
                .arg("127.0.0.1")
                .arg(node.port)
                .arg(bus)
                .query::<()>(&mut first)
                .expect("nodes meet");
        }
        let deadline = Instant::now() + Duration::from_secs(60);
        for (replica, master) in cluster.nodes[masters..].iter().zip(&cluster.nodes) {
            let id: String = redis::cmd("CLUSTER")
                .arg("MYID")
                .query(&mut cluster.connection(master))
                .expect("a node id");
            // A replica must know its master first: retried until it does.
            while let Err(e) = redis::cmd("CLUSTER")
                .arg("REPLICATE")
                .arg(&id)
                .query::<()>(&mut cluster.connection(replica))
            {
                assert!(Instant::now() < deadline, "no replica: {e}");
                std::thread::sleep(Duration::from_millis(50));
            }
        }
        for node in &cluster.nodes {
            loop {
                let mut connection = cluster.connection(node);
                let info: String = redis::cmd("CLUSTER")
                    .arg("INFO")
                    .query(&mut connection)
                    .expect("cluster info");
                let known = info.contains("cluster_state:ok")
                    && info.contains(&format!("cluster_known_nodes:{count}\r\n"));
                // A replica that never finished its first copy cannot
                // take over: wait for it.
                let synced = !replicas
                    || redis::cmd("INFO")
                        .arg("replication")
                        .query::<String>(&mut connection)
                        .is_ok_and(|r| {
                            r.contains("role:master") || r.contains("master_link_status:up")
                        });
                if known && synced {
                    break;
                }
                assert!(
                    Instant::now() < deadline,
                    "the cluster did not form: {info}"
                );
                std::thread::sleep(Duration::from_millis(50));
            }
        }
        Some(cluster)
    }

    fn connection(&self, node: &RedisServer) -> redis::Connection {
        redis::Client::open(node.url())
            .and_then(|c| c.get_connection())
            .expect("a cluster node answers")
    }

    /// The index of the node that serves `key`'s slot.
    pub fn owner_of(&self, key: &str) -> usize {
        let mut connection = self.connection(&self.nodes[0]);
        let slot: usize = redis::cmd("CLUSTER")
            .arg("KEYSLOT")
            .arg(key)
            .query(&mut connection)
            .expect("a key's slot");
        (0..self.masters)
            .find(|&i| (self.slots_of(i).0..=self.slots_of(i).1).contains(&slot))
            .expect("every slot is served")
    }

    /// Whether node `i` is a master now (a replica is after a failover).
    pub fn is_master(&self, i: usize) -> bool {
        let role: redis::Value = redis::cmd("ROLE")
            .query(&mut self.connection(&self.nodes[i]))
            .expect("a role");
        matches!(role, redis::Value::Array(items) if items.first()
            == Some(&redis::Value::BulkString(b"master".to_vec())))
    }

    /// The first and last slot master `i` serves.
    fn slots_of(&self, i: usize) -> (usize, usize) {
        let n = self.masters;
        (16384 * i / n, 16384 * (i + 1) / n - 1)
    }
}
