//! Apache Kafka nodes started here: one KRaft node or a three-node Cluster, their listeners and plans, the partitions' state.

#[allow(clippy::wildcard_imports)]
use super::*;

/// How a node's client listener is protected.
#[derive(Debug, Clone, Default)]
pub(crate) struct Listener {
    /// PEM of the server certificate chain and key (TLS).
    pub tls: Option<(String, String)>,
    /// Also require a client certificate of this CA (PEM).
    pub client_ca: Option<String>,
    /// SASL mechanisms enabled (`SCRAM-SHA-512`, `PLAIN`, ...): any makes
    /// the listener SASL.
    pub sasl: Vec<String>,
    /// `PLAIN` users (name, password).
    pub plain_users: Vec<(String, String)>,
    /// SCRAM users (mechanism, name, password), added by the format.
    pub scram_users: Vec<(String, String, String)>,
}

impl Listener {
    pub(super) fn protocol(&self) -> &'static str {
        match (self.tls.is_some(), !self.sasl.is_empty()) {
            (false, false) => "PLAINTEXT",
            (true, false) => "SSL",
            (false, true) => "SASL_PLAINTEXT",
            (true, true) => "SASL_SSL",
        }
    }
}

/// One node of a KRaft cluster.
#[derive(Debug, Clone)]
pub(crate) struct Node {
    /// `node.id` (1-based).
    pub id: u32,
    /// Its directory: `server.properties`, `data/`, `server.log`.
    pub dir: PathBuf,
    /// Where clients reach it (the `CLIENT` listener).
    pub listen: String,
    /// What it advertises for `CLIENT` (a proxy's address, say).
    pub advertised: String,
}

/// A cluster's nodes and shared settings, before start.
#[derive(Debug, Clone)]
pub(crate) struct Plan {
    pub nodes: Vec<Node>,
    /// `id@host:port` of every controller.
    pub voters: String,
    /// The inter-broker listener port of each node.
    pub internal: Vec<u16>,
    pub controller: Vec<u16>,
    pub listener: Listener,
}

pub(super) const CLUSTER_ID: &str = "aW5ib3gtdGVzdGtpdC0xAA";

impl Plan {
    /// `count` nodes on free ports; the first node's client listener
    /// advertises `advertised` when given.
    pub(crate) fn new(
        count: u32,
        listener: Listener,
        advertised: Option<&str>,
    ) -> Result<Self, HarnessError> {
        let root = temp_dir("inbox-apache-kafka")?;
        let mut nodes = Vec::new();
        let mut internal = Vec::new();
        let mut controller = Vec::new();
        for id in 1..=count {
            let dir = root.join(format!("node-{id}"));
            std::fs::create_dir_all(dir.join("data"))
                .map_err(|e| HarnessError(format!("creating {}: {e}", dir.display())))?;
            let listen = format!("127.0.0.1:{}", free_port()?);
            let advertised = match advertised {
                Some(a) if id == 1 => a.to_owned(),
                _ => listen.clone(),
            };
            nodes.push(Node {
                id,
                dir,
                listen,
                advertised,
            });
            internal.push(free_port()?);
            controller.push(free_port()?);
        }
        let voters = nodes
            .iter()
            .zip(&controller)
            .map(|(n, p)| format!("{}@127.0.0.1:{p}", n.id))
            .collect::<Vec<_>>()
            .join(",");
        spawn_reaper("true", &root);
        let plan = Self {
            nodes,
            voters,
            internal,
            controller,
            listener,
        };
        for (i, node) in plan.nodes.iter().enumerate() {
            plan.write_properties(i, node)?;
            plan.format(node)?;
        }
        Ok(plan)
    }

    pub(super) fn write_properties(&self, i: usize, node: &Node) -> Result<(), HarnessError> {
        let replicas = self.nodes.len().min(3);
        let min_isr = if replicas >= 3 { 2 } else { 1 };
        let l = &self.listener;
        let mut p = String::new();
        let mut line = |s: String| {
            p.push_str(&s);
            p.push('\n');
        };
        line("process.roles=broker,controller".into());
        line(format!("node.id={}", node.id));
        line(format!("controller.quorum.voters={}", self.voters));
        line(format!(
            "listeners=CLIENT://{},INTERNAL://127.0.0.1:{},CONTROLLER://127.0.0.1:{}",
            node.listen, self.internal[i], self.controller[i]
        ));
        line(format!(
            "advertised.listeners=CLIENT://{},INTERNAL://127.0.0.1:{}",
            node.advertised, self.internal[i]
        ));
        line("controller.listener.names=CONTROLLER".into());
        line("inter.broker.listener.name=INTERNAL".into());
        line(format!(
            "listener.security.protocol.map=CLIENT:{},INTERNAL:PLAINTEXT,CONTROLLER:PLAINTEXT",
            l.protocol()
        ));
        line(format!("log.dirs={}", node.dir.join("data").display()));
        // what tansu does too, and what the relay's unknown-topic rules need
        line("auto.create.topics.enable=false".into());
        line(format!("default.replication.factor={replicas}"));
        line(format!("min.insync.replicas={min_isr}"));
        line(format!("offsets.topic.replication.factor={replicas}"));
        line("offsets.topic.num.partitions=4".into());
        line(format!(
            "transaction.state.log.replication.factor={replicas}"
        ));
        line(format!("transaction.state.log.min.isr={min_isr}"));
        line("transaction.state.log.num.partitions=4".into());
        line(format!(
            "share.coordinator.state.topic.replication.factor={replicas}"
        ));
        line(format!("share.coordinator.state.topic.min.isr={min_isr}"));
        line("group.initial.rebalance.delay.ms=0".into());
        line("num.network.threads=2".into());
        line("num.io.threads=4".into());
        line("log.retention.check.interval.ms=600000".into());
        // a killed node is seen gone within seconds, not the default 9 s
        line("broker.session.timeout.ms=4000".into());
        line("broker.heartbeat.interval.ms=500".into());
        if let Some((cert, key)) = &l.tls {
            line("ssl.keystore.type=PEM".into());
            line(format!("ssl.keystore.certificate.chain={}", one_line(cert)));
            line(format!("ssl.keystore.key={}", one_line(key)));
            if let Some(ca) = &l.client_ca {
                line("ssl.truststore.type=PEM".into());
                line(format!("ssl.truststore.certificates={}", one_line(ca)));
                line("listener.name.client.ssl.client.auth=required".into());
            }
        }
        if !l.sasl.is_empty() {
            line(format!(
                "listener.name.client.sasl.enabled.mechanisms={}",
                l.sasl.join(",")
            ));
            for mechanism in &l.sasl {
                let lower = mechanism.to_lowercase();
                match mechanism.as_str() {
                    "PLAIN" => {
                        let mut users = String::new();
                        for (user, password) in &l.plain_users {
                            let _ = write!(users, " user_{user}=\"{password}\"");
                        }
                        line(format!(
                            "listener.name.client.plain.sasl.jaas.config=org.apache.kafka.common.security.plain.PlainLoginModule required{users};"
                        ));
                    }
                    "OAUTHBEARER" => {
                        line(format!(
                            "listener.name.client.{lower}.sasl.jaas.config=org.apache.kafka.common.security.oauthbearer.OAuthBearerLoginModule required unsecuredLoginStringClaim_sub=\"admin\";"
                        ));
                        line(format!(
                            "listener.name.client.{lower}.sasl.server.callback.handler.class=org.apache.kafka.common.security.oauthbearer.internals.unsecured.OAuthBearerUnsecuredValidatorCallbackHandler"
                        ));
                    }
                    _ => line(format!(
                        "listener.name.client.{lower}.sasl.jaas.config=org.apache.kafka.common.security.scram.ScramLoginModule required;"
                    )),
                }
            }
        }
        std::fs::write(node.dir.join("server.properties"), p)
            .map_err(|e| HarnessError(format!("writing server.properties: {e}")))?;
        let log = format!(
            "status = error\n\
             appender.file.type = File\n\
             appender.file.name = file\n\
             appender.file.fileName = {}\n\
             appender.file.layout.type = PatternLayout\n\
             appender.file.layout.pattern = [%d] %p %m (%c)%n\n\
             rootLogger.level = info\n\
             rootLogger.appenderRef.file.ref = file\n",
            node.dir.join("server.log").display()
        );
        std::fs::write(node.dir.join("log4j2.properties"), log)
            .map_err(|e| HarnessError(format!("writing log4j2.properties: {e}")))
    }

    pub(super) fn format(&self, node: &Node) -> Result<(), HarnessError> {
        let mut cmd = Command::new(java());
        cmd.current_dir(&node.dir)
            .arg(format!(
                "-Dlog4j2.configurationFile={}",
                node.dir.join("log4j2.properties").display()
            ))
            .args(["-cp", classpath()?, "kafka.tools.StorageTool", "format"])
            .args(["-t", CLUSTER_ID, "-c", "server.properties"]);
        for (mechanism, user, password) in &self.listener.scram_users {
            cmd.args([
                "--add-scram",
                &format!("{mechanism}=[name={user},password={password}]"),
            ]);
        }
        run(cmd, "formatting the Apache Kafka storage")
    }
}

/// A PEM value on one line of a properties file.
pub(super) fn one_line(pem: &str) -> String {
    pem.trim().replace('\n', "\\n\\\n    ")
}

impl Node {
    /// Starts the node and waits until it serves ([`Node::wait`]).
    pub(crate) fn start(&self) -> Result<Child, HarnessError> {
        let (mut child, mark) = self.spawn()?;
        self.wait(&mut child, mark)?;
        Ok(child)
    }

    /// Spawns the node's process (a reaper kills it when this process
    /// ends); returns it and where its log stood before.
    pub(crate) fn spawn(&self) -> Result<(Child, u64), HarnessError> {
        let mark = std::fs::metadata(self.dir.join("server.log")).map_or(0, |m| m.len());
        let out = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(self.dir.join("stdout.log"))
            .map_err(|e| HarnessError(format!("creating the broker's stdout log: {e}")))?;
        let err = out
            .try_clone()
            .map_err(|e| HarnessError(format!("creating the broker's stdout log: {e}")))?;
        let child = Command::new(java())
            .current_dir(&self.dir)
            .args(["-Xms64m", "-Xmx768m", "-XX:+UseSerialGC"])
            .arg(format!(
                "-Dlog4j2.configurationFile={}",
                self.dir.join("log4j2.properties").display()
            ))
            .args(["-cp", classpath()?, "kafka.Kafka", "server.properties"])
            .stdin(Stdio::null())
            .stdout(out)
            .stderr(err)
            .spawn()
            .map_err(|e| HarnessError(format!("starting {}: {e}", java().display())))?;
        spawn_reaper(
            &format!("kill -9 {}", child.id()),
            Path::new("/nonexistent"),
        );
        Ok((child, mark))
    }

    /// Waits until the node's log, past `mark`, says the server started
    /// (90 s at most: a node of a cluster waits for a quorum).
    pub(crate) fn wait(&self, child: &mut Child, mark: u64) -> Result<(), HarnessError> {
        let log_path = self.dir.join("server.log");
        let deadline = Instant::now() + Duration::from_secs(90);
        loop {
            let started = std::fs::read(&log_path)
                .ok()
                .and_then(|log| log.get(usize::try_from(mark).ok()?..).map(<[u8]>::to_vec))
                .is_some_and(|tail| {
                    String::from_utf8_lossy(&tail).contains("Kafka Server started")
                });
            if started {
                return Ok(());
            }
            let exited = child.try_wait().ok().flatten();
            if exited.is_some() || Instant::now() > deadline {
                let _ = child.kill();
                let log = std::fs::read_to_string(&log_path).unwrap_or_default();
                let stdout =
                    std::fs::read_to_string(self.dir.join("stdout.log")).unwrap_or_default();
                let lines: Vec<&str> = log.lines().collect();
                let tail = lines[lines.len().saturating_sub(40)..].join("\n");
                return Err(HarnessError(format!(
                    "Apache Kafka node {} did not start on {} (exit: {exited:?}): {stdout}\n{tail}",
                    self.id, self.listen
                )));
            }
            std::thread::sleep(Duration::from_millis(100));
        }
    }
}

/// A partition as the cluster's metadata describes it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PartitionState {
    /// The partition.
    pub partition: i32,
    /// The leader's node id (`-1`: none).
    pub leader: i32,
    /// The replicas' node ids.
    pub replicas: Vec<i32>,
    /// The in-sync replicas' node ids.
    pub isr: Vec<i32>,
}

/// A KRaft cluster of Apache Kafka nodes, each broker and controller
/// (combined mode), on one machine: replication factor 3 and
/// `min.insync.replicas` 2 once it has three nodes. A test kills, stops and
/// restarts nodes by id ([`kill`](Self::kill), [`stop`](Self::stop),
/// [`restart`](Self::restart)); [`leader`](Self::leader) and
/// [`coordinator`](Self::coordinator) say where a partition's leader and a
/// group's coordinator are, asked of the cluster through librdkafka (the
/// `confluent-kafka` wheel for `python3`, which `cargo xtask test` installs).
#[derive(Debug)]
pub struct Cluster {
    plan: Plan,
    children: Vec<Option<Child>>,
}

impl Cluster {
    /// Starts `nodes` nodes (all spawned, then each waited for: a node
    /// serves once a quorum of controllers runs).
    ///
    /// # Errors
    ///
    /// A [`HarnessError`] saying why the cluster did not start.
    pub fn start(nodes: u32) -> Result<Self, HarnessError> {
        let plan = Plan::new(nodes, Listener::default(), None)?;
        let started = Instant::now();
        let mut spawned = Vec::new();
        for node in &plan.nodes {
            spawned.push(node.spawn()?);
        }
        let mut children = Vec::new();
        for (node, (mut child, mark)) in plan.nodes.iter().zip(spawned) {
            node.wait(&mut child, mark)?;
            children.push(Some(child));
        }
        eprintln!(
            "inbox-testkit: started an Apache Kafka {} cluster of {nodes} on {} in {:.1} s",
            version(),
            plan.nodes
                .iter()
                .map(|n| n.listen.as_str())
                .collect::<Vec<_>>()
                .join(","),
            started.elapsed().as_secs_f64()
        );
        Ok(Self { plan, children })
    }

    /// Every node's client address.
    pub fn bootstrap(&self) -> Vec<String> {
        self.plan.nodes.iter().map(|n| n.listen.clone()).collect()
    }

    /// The node ids, 1 to the cluster's size.
    pub fn ids(&self) -> Vec<i32> {
        self.plan
            .nodes
            .iter()
            .filter_map(|n| i32::try_from(n.id).ok())
            .collect()
    }

    pub(super) fn index(&self, id: i32) -> Result<usize, HarnessError> {
        self.plan
            .nodes
            .iter()
            .position(|n| i64::from(n.id) == i64::from(id))
            .ok_or_else(|| HarnessError(format!("the cluster has no node {id}")))
    }

    /// The process id of node `id`, while it runs.
    pub fn pid(&self, id: i32) -> Option<u32> {
        let i = self.index(id).ok()?;
        self.children[i].as_ref().map(Child::id)
    }

    /// Kills node `id` (SIGKILL: no controlled shutdown).
    ///
    /// # Errors
    ///
    /// A [`HarnessError`] for an unknown or stopped node.
    pub fn kill(&mut self, id: i32) -> Result<(), HarnessError> {
        let i = self.index(id)?;
        let mut child = self.children[i]
            .take()
            .ok_or_else(|| HarnessError(format!("node {id} is not running")))?;
        child
            .kill()
            .and_then(|()| child.wait().map(|_| ()))
            .map_err(|e| HarnessError(format!("killing node {id}: {e}")))
    }

    /// Stops node `id` as an operator does in a rolling restart (SIGTERM:
    /// a controlled shutdown that moves its leaderships first); waits for
    /// it to exit (60 s, then SIGKILL).
    ///
    /// # Errors
    ///
    /// A [`HarnessError`] for an unknown or stopped node.
    pub fn stop(&mut self, id: i32) -> Result<(), HarnessError> {
        let i = self.index(id)?;
        let mut child = self.children[i]
            .take()
            .ok_or_else(|| HarnessError(format!("node {id} is not running")))?;
        run(
            {
                let mut cmd = Command::new("kill");
                cmd.args(["-TERM", &child.id().to_string()]);
                cmd
            },
            &format!("stopping node {id}"),
        )?;
        let deadline = Instant::now() + Duration::from_secs(60);
        while child.try_wait().ok().flatten().is_none() {
            if Instant::now() > deadline {
                let _ = child.kill();
                break;
            }
            std::thread::sleep(Duration::from_millis(100));
        }
        let _ = child.wait();
        Ok(())
    }

    /// Starts node `id` again (same ports, same storage) and waits until it
    /// serves.
    ///
    /// # Errors
    ///
    /// A [`HarnessError`] for an unknown or running node, or why it did not
    /// start.
    pub fn restart(&mut self, id: i32) -> Result<(), HarnessError> {
        let i = self.index(id)?;
        if self.children[i].is_some() {
            return Err(HarnessError(format!("node {id} is running")));
        }
        self.children[i] = Some(self.plan.nodes[i].start()?);
        Ok(())
    }

    /// A client of the cluster (every node a bootstrap address).
    ///
    /// # Errors
    ///
    /// A [`HarnessError`] when no node can be reached.
    pub async fn client(&self) -> Result<rskafka::client::Client, HarnessError> {
        rskafka::client::ClientBuilder::new(self.bootstrap())
            .build()
            .await
            .map_err(|e| HarnessError(format!("connecting to the cluster: {e}")))
    }

    /// Creates `name` with `partitions` partitions, each replicated on
    /// every node (at most three).
    ///
    /// # Errors
    ///
    /// A [`HarnessError`] when the cluster refuses.
    pub async fn create_topic(&self, name: &str, partitions: i32) -> Result<(), HarnessError> {
        let replicas = i16::try_from(self.plan.nodes.len().min(3)).unwrap_or(3);
        self.create_topic_with(name, partitions, replicas).await
    }

    /// Creates `name` with `partitions` of `replicas` replicas each (1: a
    /// partition is offline while its one node is down), and waits until
    /// every partition has a leader.
    ///
    /// # Errors
    ///
    /// A [`HarnessError`] when the cluster refuses.
    pub async fn create_topic_with(
        &self,
        name: &str,
        partitions: i32,
        replicas: i16,
    ) -> Result<(), HarnessError> {
        let client = self.client().await?;
        client
            .controller_client()
            .map_err(|e| HarnessError(format!("controller: {e}")))?
            .create_topic(name, partitions, replicas, 10_000)
            .await
            .map_err(|e| HarnessError(format!("creating topic {name}: {e}")))?;
        visible(&client, name, partitions).await
    }

    /// The partitions of `topic` as the cluster's metadata has them.
    ///
    /// # Errors
    ///
    /// A [`HarnessError`] when librdkafka cannot ask.
    pub fn describe(&self, topic: &str) -> Result<Vec<PartitionState>, HarnessError> {
        let out = self.ask(&format!(
            "md = a.list_topics(topic={topic:?}, timeout=10)\n\
             t = md.topics[{topic:?}]\n\
             if t.error is not None: raise SystemExit(str(t.error))\n\
             for p in sorted(t.partitions.values(), key=lambda p: p.id):\n\
             \x20   print(p.id, p.leader, ','.join(map(str, p.replicas)), ','.join(map(str, p.isrs)))\n"
        ))?;
        let ids = |s: &str| -> Vec<i32> { s.split(',').filter_map(|x| x.parse().ok()).collect() };
        Ok(out
            .lines()
            .filter_map(|line| {
                let mut f = line.split_whitespace();
                Some(PartitionState {
                    partition: f.next()?.parse().ok()?,
                    leader: f.next()?.parse().ok()?,
                    replicas: ids(f.next().unwrap_or("")),
                    isr: ids(f.next().unwrap_or("")),
                })
            })
            .collect())
    }

    /// The node that leads `topic`/`partition` now.
    ///
    /// # Errors
    ///
    /// A [`HarnessError`] when it cannot be asked or there is no leader.
    pub fn leader(&self, topic: &str, partition: i32) -> Result<i32, HarnessError> {
        self.describe(topic)?
            .into_iter()
            .find(|p| p.partition == partition && p.leader >= 0)
            .map(|p| p.leader)
            .ok_or_else(|| HarnessError(format!("{topic}:{partition} has no leader")))
    }

    /// The node that coordinates `group` now.
    ///
    /// # Errors
    ///
    /// A [`HarnessError`] when it cannot be asked.
    pub fn coordinator(&self, group: &str) -> Result<i32, HarnessError> {
        let out = self.ask(&format!(
            "d = a.describe_consumer_groups([{group:?}], request_timeout=10)[{group:?}].result(timeout=15)\n\
             print(d.coordinator.id)\n"
        ))?;
        out.trim()
            .parse()
            .map_err(|_| HarnessError(format!("no coordinator of {group} in {out:?}")))
    }

    /// Waits until every partition of `topics` has a leader and all its
    /// replicas in sync (what an operator waits for between two nodes of a
    /// rolling restart), `timeout` at most.
    ///
    /// # Errors
    ///
    /// A [`HarnessError`] naming what was still out of sync.
    pub fn wait_in_sync(&self, topics: &[&str], timeout: Duration) -> Result<(), HarnessError> {
        let deadline = Instant::now() + timeout;
        loop {
            let mut behind = Vec::new();
            for topic in topics {
                match self.describe(topic) {
                    Ok(parts) => behind.extend(
                        parts
                            .into_iter()
                            .filter(|p| p.leader < 0 || p.isr.len() < p.replicas.len())
                            .map(|p| format!("{topic}:{} {p:?}", p.partition)),
                    ),
                    Err(e) => behind.push(e.0),
                }
            }
            if behind.is_empty() {
                return Ok(());
            }
            if Instant::now() > deadline {
                return Err(HarnessError(format!(
                    "not in sync after {timeout:?}: {}",
                    behind.join("; ")
                )));
            }
            std::thread::sleep(Duration::from_millis(250));
        }
    }

    /// Runs `script` in `python3` with `a`, a librdkafka admin client of the
    /// running nodes; returns what it printed.
    pub(super) fn ask(&self, script: &str) -> Result<String, HarnessError> {
        let running: Vec<String> = self
            .plan
            .nodes
            .iter()
            .zip(&self.children)
            .filter(|(_, c)| c.is_some())
            .map(|(n, _)| n.listen.clone())
            .collect();
        let program = format!(
            "from confluent_kafka.admin import AdminClient\n\
             a = AdminClient({{'bootstrap.servers': {:?}, 'socket.timeout.ms': 5000}})\n\
             {script}",
            running.join(",")
        );
        let out = Command::new("python3")
            .args(["-c", &program])
            .stdin(Stdio::null())
            .output()
            .map_err(|e| HarnessError(format!("python3 (librdkafka's admin client): {e}")))?;
        if out.status.success() {
            Ok(String::from_utf8_lossy(&out.stdout).into_owned())
        } else {
            Err(HarnessError(format!(
                "asking the cluster through librdkafka failed: {}",
                String::from_utf8_lossy(&out.stderr)
            )))
        }
    }
}

/// Waits (10 s at most) until the metadata `client` reads lists `name`
/// with its `partitions`: Apache Kafka answers CreateTopics once its
/// controller has the topic, and a broker's metadata may not have it yet
/// for a few milliseconds, in which a consumer started at once would find
/// no such topic.
pub(crate) async fn visible(
    client: &rskafka::client::Client,
    name: &str,
    partitions: i32,
) -> Result<(), HarnessError> {
    let deadline = Instant::now() + Duration::from_secs(10);
    let want = usize::try_from(partitions).unwrap_or(0);
    loop {
        let listed = client.list_topics().await.map(|topics| {
            topics
                .iter()
                .any(|t| t.name == name && t.partitions.len() >= want)
        });
        match listed {
            Ok(true) => return Ok(()),
            _ if Instant::now() > deadline => {
                return Err(HarnessError(format!(
                    "topic {name} not in the metadata 10 s after it was created: {listed:?}"
                )));
            }
            _ => tokio::time::sleep(Duration::from_millis(20)).await,
        }
    }
}
