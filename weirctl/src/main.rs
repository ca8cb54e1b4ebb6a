//! `weirctl`: Weir's command-line client over the management HTTP API
//! (RabbitMQ's management API shapes), for people (tables) and scripts
//! (`--json`). Exits non-zero with the API's error reason on failure.

#![forbid(unsafe_code)]

mod client;
mod table;

use std::io::Read;
use std::process::ExitCode;

use clap::{Args, Parser, Subcommand};
use serde_json::{json, Value};

use client::{seg, Client, Error};

/// Weir's command-line client (management HTTP API).
#[derive(Parser, Debug)]
#[command(name = "weirctl", version, about)]
struct Cli {
    /// Base URL of the management API.
    #[arg(
        long,
        global = true,
        env = "WEIRCTL_URL",
        default_value = "http://127.0.0.1:15672"
    )]
    url: String,
    /// User name (HTTP Basic).
    #[arg(long, global = true, env = "WEIRCTL_USER", default_value = "guest")]
    user: String,
    /// Password (HTTP Basic).
    #[arg(
        long,
        global = true,
        env = "WEIRCTL_PASSWORD",
        default_value = "guest",
        hide_env_values = true
    )]
    password: String,
    /// PEM file of the certificates an `https` URL's server is verified
    /// against (a private CA or the server's self-signed certificate);
    /// default: the Mozilla root certificates.
    #[arg(long, global = true, env = "WEIRCTL_CACERT", value_name = "FILE")]
    cacert: Option<std::path::PathBuf>,
    /// Print the API's JSON instead of tables.
    #[arg(long, global = true)]
    json: bool,
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand, Debug)]
enum Command {
    /// The broker's overview (totals, rates) and alarms.
    Status,
    /// Queues.
    #[command(subcommand)]
    Queues(Queues),
    /// Exchanges.
    #[command(subcommand)]
    Exchanges(Exchanges),
    /// Bindings between exchanges and queues or exchanges.
    #[command(subcommand)]
    Bindings(Bindings),
    /// Virtual hosts (tenants).
    #[command(subcommand)]
    Vhosts(Named),
    /// Users.
    #[command(subcommand)]
    Users(Users),
    /// Users' permissions on virtual hosts.
    #[command(subcommand)]
    Permissions(Permissions),
    /// Policies.
    #[command(subcommand)]
    Policies(Policies),
    /// All definitions (vhosts, users, permissions, queues, exchanges, bindings, policies).
    #[command(subcommand)]
    Definitions(Definitions),
    /// Print a shell completion script for `weirctl` (bash, zsh, fish,
    /// elvish, powershell) to stdout.
    Completions {
        /// The shell.
        shell: clap_complete::Shell,
    },
    /// Print the `weirctl(1)` man page (roff) to stdout.
    Man,
}

/// Where an object lives.
#[derive(Args, Debug)]
struct Vhost {
    /// Virtual host.
    #[arg(long, default_value = "/")]
    vhost: String,
}

/// Listing, optionally in one virtual host.
#[derive(Args, Debug)]
struct ListIn {
    /// Only this virtual host (default: all).
    #[arg(long)]
    vhost: Option<String>,
}

#[derive(Subcommand, Debug)]
enum Queues {
    /// List queues with their depth and rates.
    List(ListIn),
    /// Declare a queue.
    Declare {
        name: String,
        #[command(flatten)]
        vhost: Vhost,
        /// Survives a broker restart.
        #[arg(long, default_value_t = true, action = clap::ArgAction::Set)]
        durable: bool,
        /// Deleted when its last consumer goes.
        #[arg(long)]
        auto_delete: bool,
        /// Queue arguments as a JSON object, e.g. '{"x-max-length":1000}'.
        #[arg(long)]
        arguments: Option<String>,
    },
    /// Delete a queue and its messages.
    Delete {
        name: String,
        #[command(flatten)]
        vhost: Vhost,
    },
    /// Remove every ready message from a queue.
    Purge {
        name: String,
        #[command(flatten)]
        vhost: Vhost,
    },
    /// Weir: move a dead-letter queue's messages back to the queues they
    /// were dead-lettered from.
    RequeueDeadLetters {
        name: String,
        #[command(flatten)]
        vhost: Vhost,
    },
}

#[derive(Subcommand, Debug)]
enum Exchanges {
    /// List exchanges.
    List(ListIn),
    /// Declare an exchange.
    Declare {
        name: String,
        #[command(flatten)]
        vhost: Vhost,
        /// direct, fanout, topic or headers.
        #[arg(long = "type", short = 't', default_value = "direct")]
        kind: String,
        /// Survives a broker restart.
        #[arg(long, default_value_t = true, action = clap::ArgAction::Set)]
        durable: bool,
        /// Deleted when its last binding goes.
        #[arg(long)]
        auto_delete: bool,
    },
    /// Delete an exchange.
    Delete {
        name: String,
        #[command(flatten)]
        vhost: Vhost,
    },
}

/// One binding: source exchange to a queue or exchange.
#[derive(Args, Debug)]
struct BindingArgs {
    /// Source exchange.
    #[arg(long)]
    source: String,
    /// Destination queue (or exchange with --destination-type exchange).
    #[arg(long)]
    destination: String,
    /// queue or exchange.
    #[arg(long, default_value = "queue", value_parser = ["queue", "exchange"])]
    destination_type: String,
    /// Routing key.
    #[arg(long, default_value = "")]
    routing_key: String,
    #[command(flatten)]
    vhost: Vhost,
}

#[derive(Subcommand, Debug)]
enum Bindings {
    /// List bindings.
    List(ListIn),
    /// Bind a queue or exchange to an exchange.
    Declare(BindingArgs),
    /// Remove a binding (matched by source, destination and routing key).
    Delete(BindingArgs),
}

#[derive(Subcommand, Debug)]
enum Named {
    /// List them.
    List,
    /// Create one.
    Declare { name: String },
    /// Delete one.
    Delete { name: String },
}

#[derive(Subcommand, Debug)]
enum Users {
    /// List users.
    List,
    /// Create or update a user.
    Declare {
        name: String,
        /// The user's password (`--password` is the caller's own).
        #[arg(long)]
        new_password: String,
        /// Comma-separated tags: administrator, monitoring, management, policymaker.
        #[arg(long, default_value = "")]
        tags: String,
    },
    /// Delete a user.
    Delete { name: String },
}

#[derive(Subcommand, Debug)]
enum Permissions {
    /// List permissions.
    List,
    /// Set a user's permissions on a virtual host (regular expressions).
    Declare {
        /// The user (`--user` is the caller). Its own id: a global
        /// argument's id is shared with subcommands.
        #[arg(id = "grantee", value_name = "USER")]
        user: String,
        #[command(flatten)]
        vhost: Vhost,
        #[arg(long, default_value = ".*")]
        configure: String,
        #[arg(long, default_value = ".*")]
        write: String,
        #[arg(long, default_value = ".*")]
        read: String,
    },
    /// Remove a user's permissions on a virtual host.
    Delete {
        /// The user (`--user` is the caller). Its own id: a global
        /// argument's id is shared with subcommands.
        #[arg(id = "grantee", value_name = "USER")]
        user: String,
        #[command(flatten)]
        vhost: Vhost,
    },
}

#[derive(Subcommand, Debug)]
enum Policies {
    /// List policies.
    List(ListIn),
    /// Create or update a policy.
    Declare {
        name: String,
        #[command(flatten)]
        vhost: Vhost,
        /// Regular expression over queue / exchange names.
        #[arg(long)]
        pattern: String,
        /// The policy's definition as a JSON object, e.g. '{"max-length":1000}'.
        #[arg(long)]
        definition: String,
        #[arg(long, default_value_t = 0)]
        priority: i64,
        /// queues, exchanges or all.
        #[arg(long, default_value = "all")]
        apply_to: String,
    },
    /// Delete a policy.
    Delete {
        name: String,
        #[command(flatten)]
        vhost: Vhost,
    },
}

#[derive(Subcommand, Debug)]
enum Definitions {
    /// Print all definitions as JSON (to a file with --file).
    Export {
        #[arg(long)]
        file: Option<std::path::PathBuf>,
    },
    /// Load definitions from a JSON file ("-" for standard input).
    Import { file: std::path::PathBuf },
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    // Local commands: no API call.
    match &cli.command {
        Command::Completions { shell } => {
            use clap::CommandFactory as _;
            let mut cmd = Cli::command();
            // Into a buffer first: clap_complete panics on a write error
            // (a closed pipe), a plain write just fails.
            let mut script = Vec::new();
            clap_complete::generate(*shell, &mut cmd, "weirctl", &mut script);
            use std::io::Write as _;
            if std::io::stdout().write_all(&script).is_err() {
                return ExitCode::FAILURE;
            }
            return ExitCode::SUCCESS;
        }
        Command::Man => {
            use clap::CommandFactory as _;
            return match clap_mangen::Man::new(Cli::command()).render(&mut std::io::stdout()) {
                Ok(()) => ExitCode::SUCCESS,
                Err(e) => {
                    eprintln!("weirctl man: {e}");
                    ExitCode::FAILURE
                }
            };
        }
        _ => {}
    }
    let ca = match &cli.cacert {
        None => None,
        Some(path) => match std::fs::read(path) {
            Ok(pem) => Some(pem),
            Err(e) => {
                eprintln!("weirctl: --cacert {}: {e}", path.display());
                return ExitCode::FAILURE;
            }
        },
    };
    let client = match Client::new(&cli.url, &cli.user, &cli.password, ca.as_deref()) {
        Ok(c) => c,
        Err(e) => {
            eprintln!("weirctl: {e}");
            return ExitCode::FAILURE;
        }
    };
    match run(&cli, &client) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("weirctl: {e}");
            ExitCode::FAILURE
        }
    }
}

/// `/api/<kind>` or `/api/<kind>/<vhost>`.
fn list_path(kind: &str, vhost: &Option<String>) -> String {
    match vhost {
        Some(v) => format!("/api/{kind}/{}", seg(v)),
        None => format!("/api/{kind}"),
    }
}

/// Parses a JSON-object option such as `--arguments`.
fn json_object(what: &str, text: &Option<String>) -> Result<Value, Error> {
    match text {
        None => Ok(json!({})),
        Some(t) => match serde_json::from_str::<Value>(t) {
            Ok(v @ Value::Object(_)) => Ok(v),
            _ => Err(Error::Usage(format!("{what} must be a JSON object"))),
        },
    }
}

fn run(cli: &Cli, c: &Client) -> Result<(), Error> {
    let out = Output { json: cli.json };
    match &cli.command {
        Command::Status => {
            let o = c.get("/api/overview")?;
            let alarms = c.get_allowing_failure("/api/health/checks/alarms")?;
            if out.json {
                out.value(&json!({ "overview": o, "alarms": alarms }));
            } else {
                table::status(&o, &alarms);
            }
        }
        Command::Queues(q) => match q {
            Queues::List(l) => out.list(
                &c.get_all(&list_path("queues", &l.vhost))?,
                &[
                    ("vhost", "vhost"),
                    ("name", "name"),
                    ("messages", "messages"),
                    ("ready", "messages_ready"),
                    ("unacked", "messages_unacknowledged"),
                    ("delayed", "messages_delayed"),
                    ("consumers", "consumers"),
                    ("publish/s", "message_stats.publish_details.rate"),
                    ("deliver/s", "message_stats.deliver_get_details.rate"),
                ],
            ),
            Queues::Declare {
                name,
                vhost,
                durable,
                auto_delete,
                arguments,
            } => {
                let body = json!({
                    "durable": durable,
                    "auto_delete": auto_delete,
                    "arguments": json_object("--arguments", arguments)?,
                });
                c.put(&obj("queues", &vhost.vhost, name), &body)?;
                out.done(&format!("queue {name} declared"));
            }
            Queues::Delete { name, vhost } => {
                c.delete(&obj("queues", &vhost.vhost, name))?;
                out.done(&format!("queue {name} deleted"));
            }
            Queues::Purge { name, vhost } => {
                c.delete(&format!("{}/contents", obj("queues", &vhost.vhost, name)))?;
                out.done(&format!("queue {name} purged"));
            }
            Queues::RequeueDeadLetters { name, vhost } => {
                let path = format!("{}/requeue-dead-letters", obj("queues", &vhost.vhost, name));
                let r = c.post(&path, &json!({}))?;
                if out.json {
                    out.value(&r);
                } else {
                    println!("{} moved back, {} kept", r["moved"], r["kept"]);
                }
            }
        },
        Command::Exchanges(x) => match x {
            Exchanges::List(l) => out.list(
                &c.get_all(&list_path("exchanges", &l.vhost))?,
                &[
                    ("vhost", "vhost"),
                    ("name", "name"),
                    ("type", "type"),
                    ("durable", "durable"),
                    ("auto_delete", "auto_delete"),
                ],
            ),
            Exchanges::Declare {
                name,
                vhost,
                kind,
                durable,
                auto_delete,
            } => {
                let body = json!({"type": kind, "durable": durable, "auto_delete": auto_delete, "arguments": {}});
                c.put(&obj("exchanges", &vhost.vhost, name), &body)?;
                out.done(&format!("exchange {name} declared"));
            }
            Exchanges::Delete { name, vhost } => {
                c.delete(&obj("exchanges", &vhost.vhost, name))?;
                out.done(&format!("exchange {name} deleted"));
            }
        },
        Command::Bindings(b) => match b {
            Bindings::List(l) => out.list(
                &c.get_all(&list_path("bindings", &l.vhost))?,
                &[
                    ("vhost", "vhost"),
                    ("source", "source"),
                    ("destination", "destination"),
                    ("type", "destination_type"),
                    ("routing_key", "routing_key"),
                ],
            ),
            Bindings::Declare(a) => {
                let body = json!({"routing_key": a.routing_key, "arguments": {}});
                c.post(&binding_path(a), &body)?;
                out.done(&format!(
                    "binding {} -> {} declared",
                    a.source, a.destination
                ));
            }
            Bindings::Delete(a) => {
                // A binding's URL ends in its properties key, which the
                // broker makes up: find it among the pair's bindings.
                let path = binding_path(a);
                let found = c.get_all(&path)?;
                let Some(key) = found
                    .iter()
                    .find(|b| b["routing_key"] == a.routing_key)
                    .and_then(|b| b["properties_key"].as_str())
                else {
                    return Err(Error::Usage(format!(
                        "no binding {} -> {} with routing key {:?}",
                        a.source, a.destination, a.routing_key
                    )));
                };
                c.delete(&format!("{path}/{}", seg(key)))?;
                out.done(&format!(
                    "binding {} -> {} deleted",
                    a.source, a.destination
                ));
            }
        },
        Command::Vhosts(v) => match v {
            Named::List => out.list(
                &c.get_all("/api/vhosts")?,
                &[
                    ("name", "name"),
                    ("messages", "messages"),
                    ("description", "description"),
                ],
            ),
            Named::Declare { name } => {
                c.put(&format!("/api/vhosts/{}", seg(name)), &json!({}))?;
                out.done(&format!("vhost {name} declared"));
            }
            Named::Delete { name } => {
                c.delete(&format!("/api/vhosts/{}", seg(name)))?;
                out.done(&format!("vhost {name} deleted"));
            }
        },
        Command::Users(u) => match u {
            Users::List => out.list(
                &c.get_all("/api/users")?,
                &[("name", "name"), ("tags", "tags")],
            ),
            Users::Declare {
                name,
                new_password,
                tags,
            } => {
                c.put(
                    &format!("/api/users/{}", seg(name)),
                    &json!({"password": new_password, "tags": tags}),
                )?;
                out.done(&format!("user {name} declared"));
            }
            Users::Delete { name } => {
                c.delete(&format!("/api/users/{}", seg(name)))?;
                out.done(&format!("user {name} deleted"));
            }
        },
        Command::Permissions(p) => match p {
            Permissions::List => out.list(
                &c.get_all("/api/permissions")?,
                &[
                    ("user", "user"),
                    ("vhost", "vhost"),
                    ("configure", "configure"),
                    ("write", "write"),
                    ("read", "read"),
                ],
            ),
            Permissions::Declare {
                user,
                vhost,
                configure,
                write,
                read,
            } => {
                c.put(
                    &format!("/api/permissions/{}/{}", seg(&vhost.vhost), seg(user)),
                    &json!({"configure": configure, "write": write, "read": read}),
                )?;
                out.done(&format!("permissions of {user} on {} set", vhost.vhost));
            }
            Permissions::Delete { user, vhost } => {
                c.delete(&format!(
                    "/api/permissions/{}/{}",
                    seg(&vhost.vhost),
                    seg(user)
                ))?;
                out.done(&format!("permissions of {user} on {} deleted", vhost.vhost));
            }
        },
        Command::Policies(p) => match p {
            Policies::List(l) => out.list(
                &c.get_all(&list_path("policies", &l.vhost))?,
                &[
                    ("vhost", "vhost"),
                    ("name", "name"),
                    ("pattern", "pattern"),
                    ("apply-to", "apply-to"),
                    ("priority", "priority"),
                    ("definition", "definition"),
                ],
            ),
            Policies::Declare {
                name,
                vhost,
                pattern,
                definition,
                priority,
                apply_to,
            } => {
                let body = json!({
                    "pattern": pattern,
                    "definition": json_object("--definition", &Some(definition.clone()))?,
                    "priority": priority,
                    "apply-to": apply_to,
                });
                c.put(&obj("policies", &vhost.vhost, name), &body)?;
                out.done(&format!("policy {name} declared"));
            }
            Policies::Delete { name, vhost } => {
                c.delete(&obj("policies", &vhost.vhost, name))?;
                out.done(&format!("policy {name} deleted"));
            }
        },
        Command::Definitions(d) => match d {
            Definitions::Export { file } => {
                let defs = c.get("/api/definitions")?;
                let text = serde_json::to_string_pretty(&defs).unwrap_or_default();
                match file {
                    Some(f) => std::fs::write(f, text + "\n")
                        .map_err(|e| Error::Usage(format!("{}: {e}", f.display())))?,
                    None => println!("{text}"),
                }
            }
            Definitions::Import { file } => {
                let mut text = String::new();
                let read = if file.as_os_str() == "-" {
                    std::io::stdin().read_to_string(&mut text).map(|_| ())
                } else {
                    std::fs::read_to_string(file).map(|t| text = t)
                };
                read.map_err(|e| Error::Usage(format!("{}: {e}", file.display())))?;
                let defs: Value = serde_json::from_str(&text)
                    .map_err(|e| Error::Usage(format!("{}: not JSON: {e}", file.display())))?;
                c.post("/api/definitions", &defs)?;
                out.done("definitions imported");
            }
        },
        // Answered in main without a client.
        Command::Completions { .. } | Command::Man => {}
    }
    Ok(())
}

/// `/api/<kind>/<vhost>/<name>`.
fn obj(kind: &str, vhost: &str, name: &str) -> String {
    format!("/api/{kind}/{}/{}", seg(vhost), seg(name))
}

/// `/api/bindings/<vhost>/e/<source>/<q|e>/<destination>`.
fn binding_path(a: &BindingArgs) -> String {
    let d = if a.destination_type == "queue" {
        "q"
    } else {
        "e"
    };
    format!(
        "/api/bindings/{}/e/{}/{d}/{}",
        seg(&a.vhost.vhost),
        seg(&a.source),
        seg(&a.destination)
    )
}

/// How results are printed.
struct Output {
    json: bool,
}

impl Output {
    fn value(&self, v: &Value) {
        println!("{}", serde_json::to_string_pretty(v).unwrap_or_default());
    }

    fn list(&self, rows: &[Value], cols: &[(&str, &str)]) {
        if self.json {
            self.value(&Value::Array(rows.to_vec()));
        } else {
            print!("{}", table::render(rows, cols));
        }
    }

    /// A change went through: a line for people, nothing for scripts (the
    /// exit status says it).
    fn done(&self, what: &str) {
        if !self.json {
            println!("{what}");
        }
    }
}

#[cfg(test)]
mod tests {
    use clap::CommandFactory;

    /// clap's own consistency checks (duplicate flags, ids, defaults).
    #[test]
    fn cli_is_consistent() {
        super::Cli::command().debug_assert();
    }
}
