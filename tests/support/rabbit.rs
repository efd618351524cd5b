//! Throwaway RabbitMQ nodes for integration tests.
//!
//! Each node is fully private: own node name, AMQP port, distribution port,
//! epmd port (`ERL_EPMD_PORT`, so the system epmd on 4369 is never used),
//! rabbitmqctl distribution port range, mnesia/log dirs, the plugins of
//! [`DEFAULT_PLUGINS`] (with the stream plugin, a stream-protocol listener on a port of its
//! own), and a private `HOME` holding the Erlang cookie. `rabbitmqctl` is always
//! invoked with the very same environment (see [`RabbitMq::env`]).

use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::sync::{Mutex, OnceLock};
use std::time::{Duration, Instant};

use super::{cleanup_now, free_port, make_server_dir, port_open, sh_quote, spawn_watchdog, tail};

/// A RabbitMQ node in `/tmp/pgoutbox-rmq-XXXXXX` (server output in
/// `server.out`, broker log under `log/`). `guest`/`guest` works on loopback.
#[derive(Debug)]
pub struct RabbitMq {
    root: PathBuf,
    bin: PathBuf,
    nodename: String,
    amqp_port: u16,
    /// The stream-protocol listener's port, when the node has the `rabbitmq_stream` plugin.
    stream_port: Option<u16>,
    dist_port: u16,
    epmd_port: u16,
    ctl_port_min: u16,
    /// `HOME` of the node and its `rabbitmqctl` (holds `.erlang.cookie`).
    home: PathBuf,
    /// Appended to `RABBITMQ_SERVER_ADDITIONAL_ERL_ARGS`.
    extra_erl_args: String,
    server: Mutex<Option<Child>>,
    private: bool,
}

/// How [`RabbitMq::start_node`] differs from a private node of its own.
#[derive(Debug, Default, Clone)]
pub struct NodeOptions {
    /// Extra `rabbitmq.conf` lines (`{root}` is the node's directory, `{amqp_port}` the
    /// port the harness waits on: a TLS-only node puts its `ssl` listener there).
    pub extra_conf: String,
    /// An epmd port shared with other nodes (a cluster); default: a port of its own.
    pub epmd_port: Option<u16>,
    /// A `HOME` shared with other nodes, holding their common `.erlang.cookie`; default:
    /// `home/` in the node's directory.
    pub home: Option<PathBuf>,
    /// Extra Erlang VM flags (`+S 1:1`, ...).
    pub extra_erl_args: String,
    /// Node name prefix (default `pgoutbox-test`).
    pub name: Option<String>,
    /// The plugins enabled from boot (its enabled-plugins file); default:
    /// [`DEFAULT_PLUGINS`].
    pub plugins: Option<Vec<String>>,
}

/// The plugins every node has from boot: the consistent-hash exchange of the partitions
/// topology (issue 18) and `pgoutbox declare-topology` (issue 31), and the stream protocol
/// (`rabbitmq_stream`, issue 19: [`RabbitMq::stream_url`]), enabled through the node's
/// enabled-plugins file so no test pays a restart or a `rabbitmq-plugins` call.
pub const DEFAULT_PLUGINS: &[&str] = &["rabbitmq_consistent_hash_exchange", STREAM_PLUGIN];

/// The plugin of the stream protocol. A node that has it listens for that protocol on a port
/// of its own ([`RabbitMq::stream_port`]), and its Metadata answers name that port.
pub const STREAM_PLUGIN: &str = "rabbitmq_stream";

static SHARED: OnceLock<RabbitMq> = OnceLock::new();

impl RabbitMq {
    /// The per-process shared node (lazy, thread-safe, stopped by a watchdog
    /// when the test process exits). Use unique exchange/queue names on it,
    /// and never block/stop it: use [`RabbitMq::start_private`] for that.
    pub fn shared() -> &'static RabbitMq {
        SHARED.get_or_init(|| {
            super::run_shared(
                "rabbitmq",
                || RabbitMq::start_new(false, ""),
                RabbitMq::describe,
                RabbitMq::attach,
            )
        })
    }

    /// This node as `key=value` lines, for [`RabbitMq::attach`] in another test process.
    pub(crate) fn describe(&self) -> String {
        format!(
            "root={}\nbin={}\nnodename={}\namqp_port={}\nstream_port={}\ndist_port={}\nepmd_port={}\nctl_port_min={}\nhome={}\nextra_erl_args={}\n",
            self.root.display(),
            self.bin.display(),
            self.nodename,
            self.amqp_port,
            self.stream_port.unwrap_or(0),
            self.dist_port,
            self.epmd_port,
            self.ctl_port_min,
            self.home.display(),
            self.extra_erl_args
        )
    }

    /// A handle on a running node that [`RabbitMq::describe`] described, not stopped when
    /// dropped.
    pub(crate) fn attach(text: &str) -> RabbitMq {
        let port = |key: &str| super::described(text, key).parse::<u16>().expect(key);
        RabbitMq {
            root: super::described(text, "root").into(),
            bin: super::described(text, "bin").into(),
            nodename: super::described(text, "nodename").into(),
            amqp_port: port("amqp_port"),
            stream_port: Some(port("stream_port")).filter(|p| *p != 0),
            dist_port: port("dist_port"),
            epmd_port: port("epmd_port"),
            ctl_port_min: port("ctl_port_min"),
            home: super::described(text, "home").into(),
            extra_erl_args: super::described(text, "extra_erl_args").into(),
            server: Mutex::new(None),
            private: false,
        }
    }

    /// A private node (for block/unblock, stop_app, closing connections…);
    /// stopped on Drop.
    pub fn start_private() -> RabbitMq {
        RabbitMq::start_new(true, "")
    }

    /// A private node with exactly `plugins` enabled from boot (none: `&[]`).
    pub fn start_private_with_plugins(plugins: &[&str]) -> RabbitMq {
        let options = NodeOptions {
            plugins: Some(plugins.iter().map(|p| (*p).to_owned()).collect()),
            ..NodeOptions::default()
        };
        RabbitMq::start_node(true, &options, &[])
    }

    /// A private node with extra `rabbitmq.conf` lines (e.g. `max_message_size = 1048576`).
    pub fn start_private_with(extra_conf: &str) -> RabbitMq {
        RabbitMq::start_new(true, extra_conf)
    }

    /// A private node with extra `rabbitmq.conf` lines and files written into its
    /// directory before it starts (certificates, say); `{root}` in `extra_conf` is replaced
    /// by that directory. The files go away with the node.
    pub fn start_private_with_files(extra_conf: &str, files: &[(&str, &[u8])]) -> RabbitMq {
        RabbitMq::start_new_with_files(true, extra_conf, files)
    }

    fn start_new(private: bool, extra_conf: &str) -> RabbitMq {
        RabbitMq::start_new_with_files(private, extra_conf, &[])
    }

    fn start_new_with_files(private: bool, extra_conf: &str, files: &[(&str, &[u8])]) -> RabbitMq {
        let options = NodeOptions {
            extra_conf: extra_conf.to_owned(),
            ..NodeOptions::default()
        };
        RabbitMq::start_node(private, &options, files)
    }

    /// Starts a node with `options` (a cluster member, say), waits until its AMQP port is
    /// open; stopped on Drop when `private`.
    pub fn start_node(private: bool, options: &NodeOptions, files: &[(&str, &[u8])]) -> RabbitMq {
        let t0 = Instant::now();
        let bin = find_bin_dir();
        let root = make_server_dir("pgoutbox-rmq-");
        let plugins = options
            .plugins
            .clone()
            .unwrap_or_else(|| DEFAULT_PLUGINS.iter().map(|p| (*p).to_owned()).collect());
        let amqp_port = free_port();
        // Outside the ephemeral range: a restart (RabbitMq::restart) binds it again, and no
        // client connection's local port can have taken it meanwhile.
        let stream_port = plugins
            .iter()
            .any(|p| p == STREAM_PLUGIN)
            .then(super::free_port_outside_ephemeral_range);
        let dist_port = free_port();
        let epmd_port = options.epmd_port.unwrap_or_else(free_port);
        let ctl_port_min = free_port();
        let nodename = format!(
            "{}@localhost",
            super::unique(options.name.as_deref().unwrap_or("pgoutbox-test")).replace('_', "-")
        );
        let home = options.home.clone().unwrap_or_else(|| root.join("home"));
        let r = RabbitMq {
            root,
            bin,
            nodename,
            amqp_port,
            stream_port,
            dist_port,
            epmd_port,
            ctl_port_min,
            home,
            extra_erl_args: options.extra_erl_args.clone(),
            server: Mutex::new(None),
            private,
        };
        for d in ["home", "mnesia", "log"] {
            std::fs::create_dir_all(r.root.join(d)).expect("mkdir");
        }
        set_mode(&r.root.join("home"), 0o700);
        std::fs::write(
            r.root.join("enabled_plugins"),
            format!("[{}].\n", plugins.join(",")),
        )
        .unwrap();
        std::fs::write(r.root.join("rabbitmq-env.conf"), "").unwrap();
        for (name, contents) in files {
            std::fs::write(r.root.join(name), contents).expect("write node file");
        }
        let mut extra_conf = options
            .extra_conf
            .replace("{root}", &r.root.display().to_string())
            .replace("{amqp_port}", &r.amqp_port.to_string());
        // A node of its own is its own cluster: named after the node, as RabbitMQ's default
        // would be with the machine's host name, so that `declare-topology` names this node
        // in the command that enables a plugin (it reads cluster_name).
        if options.epmd_port.is_none() {
            extra_conf.push_str(&format!("\ncluster_name = {}", r.nodename));
        }
        // The stream listener, and what Metadata answers and the peer properties name as this
        // node's address (the defaults are the host name and 5552). Only with the plugin:
        // without it these keys are unknown and the node refuses to boot.
        if let Some(port) = stream_port {
            extra_conf.push_str(&format!(
                "\nstream.listeners.tcp.1 = 127.0.0.1:{port}\n\
                 stream.advertised_host = 127.0.0.1\n\
                 stream.advertised_port = {port}"
            ));
        }
        std::fs::write(
            r.root.join("rabbitmq.conf"),
            format!(
                "listeners.tcp.default = 127.0.0.1:{amqp_port}\n\
                 loopback_users.guest = true\n\
                 log.file.level = info\n\
                 log.console = false\n\
                 {extra_conf}\n"
            ),
        )
        .unwrap();
        r.write_cleanup_script();
        spawn_watchdog(&r.root);
        r.spawn_server();
        eprintln!(
            "[harness] rabbitmq {} node {} on port {}{} ready in {:.1?} ({})",
            if private { "private" } else { "shared" },
            r.nodename,
            r.amqp_port,
            stream_port.map_or(String::new(), |p| format!(" (stream {p})")),
            t0.elapsed(),
            r.root.display()
        );
        r
    }

    fn spawn_server(&self) {
        let out = std::fs::File::create(self.root.join("server.out")).expect("server.out");
        let err = out.try_clone().unwrap();
        let child = Command::new(self.bin.join("rabbitmq-server"))
            .envs(self.env())
            .current_dir(&self.root)
            .stdin(Stdio::null())
            .stdout(out)
            .stderr(err)
            .process_group(0)
            .spawn()
            .expect("spawn rabbitmq-server");
        std::fs::write(self.root.join("launcher.pid"), child.id().to_string()).unwrap();
        *self.server.lock().unwrap_or_else(|e| e.into_inner()) = Some(child);
        // Generous: on a loaded 2-core machine several nodes boot at once (each an Erlang VM
        // start, seconds of CPU), and 60 s was seen to pass.
        let deadline = Instant::now() + super::scaled(Duration::from_secs(240));
        // The stream listener too: its plugin starts after the broker's core.
        while !port_open(self.amqp_port) || self.stream_port.is_some_and(|p| !port_open(p)) {
            let exited = self
                .server
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .as_mut()
                .and_then(|c| c.try_wait().ok().flatten());
            if let Some(st) = exited {
                panic!(
                    "rabbitmq-server exited early ({st}):\n{}",
                    tail(&self.root.join("server.out"), 40)
                );
            }
            if Instant::now() > deadline {
                panic!(
                    "rabbitmq-server did not open port {} (stream: {:?}):\n{}",
                    self.amqp_port,
                    self.stream_port,
                    tail(&self.root.join("server.out"), 40)
                );
            }
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    /// Environment that selects this node (for rabbitmq-server, rabbitmqctl,
    /// rabbitmq-diagnostics…).
    pub fn env(&self) -> Vec<(String, String)> {
        let r = |p: &str| self.root.join(p).display().to_string();
        vec![
            ("HOME".into(), self.home.display().to_string()),
            ("RABBITMQ_NODENAME".into(), self.nodename.clone()),
            ("RABBITMQ_NODE_IP_ADDRESS".into(), "127.0.0.1".into()),
            ("RABBITMQ_NODE_PORT".into(), self.amqp_port.to_string()),
            ("RABBITMQ_DIST_PORT".into(), self.dist_port.to_string()),
            ("ERL_EPMD_PORT".into(), self.epmd_port.to_string()),
            ("ERL_EPMD_ADDRESS".into(), "127.0.0.1".into()),
            (
                "RABBITMQ_CTL_DIST_PORT_MIN".into(),
                self.ctl_port_min.to_string(),
            ),
            (
                "RABBITMQ_CTL_DIST_PORT_MAX".into(),
                (self.ctl_port_min + 10).to_string(),
            ),
            ("RABBITMQ_MNESIA_BASE".into(), r("mnesia")),
            ("RABBITMQ_LOG_BASE".into(), r("log")),
            ("RABBITMQ_ENABLED_PLUGINS_FILE".into(), r("enabled_plugins")),
            ("RABBITMQ_CONFIG_FILE".into(), r("rabbitmq.conf")),
            ("RABBITMQ_ADVANCED_CONFIG_FILE".into(), r("advanced.config")),
            ("RABBITMQ_CONF_ENV_FILE".into(), r("rabbitmq-env.conf")),
            ("RABBITMQ_PID_FILE".into(), r("pid")),
            ("RABBITMQ_PLUGINS_EXPAND_DIR".into(), r("plugins-expand")),
            (
                "RABBITMQ_SERVER_ADDITIONAL_ERL_ARGS".into(),
                // Scheduler busy-waiting off, as in deploy/stack.sh: the test nodes share
                // two cores with Postgres, the streamers and each other.
                format!(
                    "-kernel inet_dist_use_interface {{127,0,0,1}} +sbwt none +sbwtdcpu none +sbwtdio none {}",
                    self.extra_erl_args
                ),
            ),
        ]
    }

    /// AMQP port on 127.0.0.1.
    pub fn port(&self) -> u16 {
        self.amqp_port
    }

    /// Erlang node name (`pgoutbox-test_<pid>_<n>@localhost`).
    pub fn nodename(&self) -> &str {
        &self.nodename
    }

    /// Node directory.
    pub fn root_dir(&self) -> &Path {
        &self.root
    }

    /// `amqp://guest:guest@127.0.0.1:PORT/%2f`.
    pub fn url(&self) -> String {
        format!("amqp://guest:guest@127.0.0.1:{}/%2f", self.amqp_port)
    }

    /// The stream-protocol port on 127.0.0.1 (`stream.listeners.tcp.1`, also the node's
    /// `stream.advertised_port`). Panics for a node started without [`STREAM_PLUGIN`].
    pub fn stream_port(&self) -> u16 {
        self.stream_port.unwrap_or_else(|| {
            panic!(
                "RabbitMQ node {} has no stream listener: started without the {STREAM_PLUGIN} plugin",
                self.nodename
            )
        })
    }

    /// `rabbitmq-stream://guest:guest@127.0.0.1:PORT/%2f` (see [`RabbitMq::stream_port`]).
    pub fn stream_url(&self) -> String {
        format!(
            "rabbitmq-stream://guest:guest@127.0.0.1:{}/%2f",
            self.stream_port()
        )
    }

    /// Run `rabbitmqctl ARGS` against this node; returns the raw output.
    pub fn ctl(&self, args: &[&str]) -> Output {
        Command::new(self.bin.join("rabbitmqctl"))
            .envs(self.env())
            .args(args)
            .stdin(Stdio::null())
            .output()
            .expect("spawn rabbitmqctl")
    }

    /// Run `rabbitmq-plugins ARGS` against this node, with its environment (node name, epmd
    /// port, cookie, enabled-plugins file); returns the raw output.
    pub fn plugins(&self, args: &[&str]) -> Output {
        Command::new(self.bin.join("rabbitmq-plugins"))
            .envs(self.env())
            .args(args)
            .stdin(Stdio::null())
            .output()
            .expect("spawn rabbitmq-plugins")
    }

    /// Like [`RabbitMq::ctl`] but panics (with stderr) on failure; returns stdout.
    pub fn ctl_ok(&self, args: &[&str]) -> String {
        let out = self.ctl(args);
        if !out.status.success() {
            panic!(
                "rabbitmqctl {args:?} failed ({}):\n{}\n{}",
                out.status,
                String::from_utf8_lossy(&out.stdout),
                String::from_utf8_lossy(&out.stderr)
            );
        }
        String::from_utf8_lossy(&out.stdout).into_owned()
    }

    /// Raise a memory alarm: publishers get `connection.blocked` and
    /// publishes stall (`set_vm_memory_high_watermark 0.000001`).
    pub fn block(&self) {
        self.ctl_ok(&["set_vm_memory_high_watermark", "0.000001"]);
    }

    /// Clear the memory alarm (`set_vm_memory_high_watermark 0.4`).
    pub fn unblock(&self) {
        self.ctl_ok(&["set_vm_memory_high_watermark", "0.4"]);
    }

    /// `rabbitmqctl stop_app`: the broker application stops (all AMQP
    /// connections drop, port closes) but the Erlang node stays up.
    pub fn stop_app(&self) {
        self.ctl_ok(&["stop_app"]);
    }

    /// `rabbitmqctl start_app`, then waits until the AMQP port (and the stream port, when
    /// the node has one) accepts again.
    pub fn start_app(&self) {
        self.ctl_ok(&["start_app"]);
        let ok = super::wait_until_blocking(super::scaled(Duration::from_secs(30)), || {
            port_open(self.amqp_port) && self.stream_port.is_none_or(port_open)
        });
        assert!(
            ok,
            "AMQP port {} (stream: {:?}) did not reopen",
            self.amqp_port, self.stream_port
        );
    }

    /// The Erlang VM's pid (`RABBITMQ_PID_FILE`), while the node runs.
    pub fn beam_pid(&self) -> Option<u32> {
        let pid: u32 = std::fs::read_to_string(self.root.join("pid"))
            .ok()?
            .trim()
            .parse()
            .ok()?;
        Path::new(&format!("/proc/{pid}")).exists().then_some(pid)
    }

    /// `(VmRSS, VmHWM)` of the node's Erlang VM in KiB (zeros when it is not running).
    pub fn memory_kib(&self) -> (u64, u64) {
        let Some(pid) = self.beam_pid() else {
            return (0, 0);
        };
        let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
        let field = |name: &str| {
            status
                .lines()
                .find_map(|l| l.strip_prefix(name))
                .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
                .unwrap_or(0)
        };
        (field("VmRSS:"), field("VmHWM:"))
    }

    /// SIGKILLs the Erlang VM (a node crash: sockets close without an AMQP close) and
    /// waits until the AMQP port is closed and the launcher is reaped.
    pub fn kill(&self) {
        if let Some(pid) = self.beam_pid() {
            let _ = Command::new("kill").args(["-9", &pid.to_string()]).status();
        }
        if let Some(mut child) = self.server.lock().unwrap_or_else(|e| e.into_inner()).take() {
            let _ = Command::new("kill")
                .args(["-9", "--", &format!("-{}", child.id())])
                .status();
            let _ = child.wait();
        }
        let closed = super::wait_until_blocking(super::scaled(Duration::from_secs(10)), || {
            !port_open(self.amqp_port)
        });
        assert!(
            closed,
            "AMQP port {} still open after the kill",
            self.amqp_port
        );
    }

    /// Starts the node again after [`RabbitMq::kill`] (same name, ports and data), and
    /// waits until the AMQP port (and the stream port, when the node has one) is open.
    pub fn restart(&self) {
        self.spawn_server();
    }

    /// Runs `rabbitmq-queues ARGS` against this node.
    pub fn queues_cmd(&self, args: &[&str]) -> Output {
        Command::new(self.bin.join("rabbitmq-queues"))
            .envs(self.env())
            .args(args)
            .stdin(Stdio::null())
            .output()
            .expect("spawn rabbitmq-queues")
    }

    /// Force-close every client connection on this node.
    pub fn close_all_connections(&self) {
        self.ctl_ok(&["close_all_connections", "closed by pgoutbox test"]);
    }

    /// Names of current client connections' users (one line per connection).
    pub fn list_connections(&self) -> Vec<String> {
        self.ctl_ok(&["-q", "list_connections", "user", "name"])
            .lines()
            .filter(|l| !l.trim().is_empty())
            .map(str::to_owned)
            .collect()
    }

    /// Server output (`server.out`) plus the broker log file.
    pub fn log_contents(&self) -> String {
        let mut s = std::fs::read_to_string(self.root.join("server.out")).unwrap_or_default();
        if let Ok(rd) = std::fs::read_dir(self.root.join("log")) {
            for e in rd.flatten() {
                s.push_str(&format!("\n--- {} ---\n", e.path().display()));
                s.push_str(&String::from_utf8_lossy(
                    &std::fs::read(e.path()).unwrap_or_default(),
                ));
            }
        }
        s
    }

    fn write_cleanup_script(&self) {
        let mut script = String::new();
        for (k, v) in self.env() {
            script.push_str(&format!("export {k}={}\n", sh_quote(&v)));
        }
        let root = sh_quote(&self.root.display().to_string());
        let ctl = sh_quote(&self.bin.join("rabbitmqctl").display().to_string());
        script.push_str(&format!(
            r#"pid=$(cat {root}/pid 2>/dev/null || true)
if [ -n "$pid" ] && kill -0 "$pid" 2>/dev/null; then
  timeout 30 {ctl} -q stop {root}/pid >/dev/null 2>&1 || true
  kill -9 "$pid" 2>/dev/null || true
fi
lpid=$(cat {root}/launcher.pid 2>/dev/null || true)
if [ -n "$lpid" ]; then kill -9 -- "-$lpid" 2>/dev/null || true; fi
for e in epmd /usr/lib/erlang/bin/epmd; do
  if command -v "$e" >/dev/null 2>&1; then "$e" -port {epmd} -kill >/dev/null 2>&1; break; fi
done
true
"#,
            epmd = self.epmd_port,
        ));
        std::fs::write(self.root.join("cleanup.sh"), script).expect("write cleanup.sh");
    }
}

impl Drop for RabbitMq {
    fn drop(&mut self) {
        if self.private {
            cleanup_now(&self.root);
            if let Some(mut c) = self.server.lock().unwrap_or_else(|e| e.into_inner()).take() {
                let _ = c.kill();
                let _ = c.wait();
            }
        }
    }
}

fn find_bin_dir() -> PathBuf {
    if let Ok(d) = std::env::var("PGOUTBOX_RABBITMQ_BIN_DIR") {
        return PathBuf::from(d);
    }
    let d = PathBuf::from("/usr/lib/rabbitmq/bin");
    if d.join("rabbitmq-server").exists() {
        return d;
    }
    panic!("RabbitMQ not found: run `deploy/stack.sh install` or set PGOUTBOX_RABBITMQ_BIN_DIR");
}

fn set_mode(path: &Path, mode: u32) {
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(mode)).expect("chmod");
}
