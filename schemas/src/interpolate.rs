//! `${…}` in a task's command, arguments, env values and exec checks: which variables
//! exist, the validation of every reference, and the substitution done at start.
//!
//! `${STEAD_ALLOC_DIR}`, `${STEAD_TASK_DIR}`, `${STEAD_SECRETS_DIR}`, `${STEAD_ALLOC_ID}`,
//! `${STEAD_ALLOC_NAME}` and `${STEAD_TASK_NAME}` are what the agent sets in the task's
//! environment; `${env.NAME}` is a variable of the task's own environment (its `env`, the
//! agent's variables, `PATH`), except in an env value, where it reads what the spec's `env`
//! is laid over (the agent's variables and the default `PATH`: `PATH:
//! "/opt/bin:${env.PATH}"`), so no value depends on another; `$${` is a literal `${`. Anything else in `${…}` is an
//! error when the spec is read, so a mistyped name never reaches a process. The spec is
//! stored as written and its revision is of what was written: substitution happens when
//! a task starts, with that run's paths.

use std::collections::BTreeMap;

use thiserror::Error;

use crate::decode::{Decoder, field_node};
use crate::diagnostic::FieldPath;
use crate::rules::ValidatorOnlyRule;
use crate::yaml::{Node, Value};

/// The variables the agent sets in every task's environment, which `${NAME}` names.
pub const AGENT_VARIABLES: [&str; 6] = [
    "STEAD_ALLOC_DIR",
    "STEAD_TASK_DIR",
    "STEAD_SECRETS_DIR",
    "STEAD_ALLOC_ID",
    "STEAD_ALLOC_NAME",
    "STEAD_TASK_NAME",
];

/// What one `${…}` names.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Variable<'a> {
    /// One of [`AGENT_VARIABLES`].
    Agent(&'a str),
    /// `${env.NAME}`: a variable of the task's environment.
    Env(&'a str),
}

/// A reference that cannot be substituted.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum InterpolationError {
    /// `${…}` of a name that is none of the known ones.
    #[error(
        "unknown variable `${{{name}}}`; known: {}, `${{env.NAME}}`; write `$${{{name}}}` for a literal `${{{name}}}`",
        AGENT_VARIABLES.map(|v| format!("`${{{v}}}`")).join(", ")
    )]
    Unknown {
        /// What was between the braces.
        name: String,
    },
    /// `${env.NAME}` of a variable the task's environment does not have.
    #[error(
        "`${{env.{name}}}` names no variable of the task's environment (its `env`, the agent's STEAD_ variables and PATH)"
    )]
    NotInEnv {
        /// The name after `env.`.
        name: String,
    },
    /// `${env.NAME}` in an env value, of a variable the spec's `env` sets: an env value
    /// reads the environment the spec's `env` is laid over.
    #[error(
        "`${{env.{name}}}` in an env value reads only what the task's env starts from (the agent's STEAD_ variables and PATH), not the spec's other env values"
    )]
    EnvInEnv {
        /// The name after `env.`.
        name: String,
    },
    /// `${` without its `}`.
    #[error("`${{` at character {at} is not closed by `}}`; write `$${{` for a literal `${{`")]
    Unclosed {
        /// Its position, counted in characters from 1.
        at: usize,
    },
}

/// One piece of a text: literal text, or a reference.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Piece<'a> {
    Text(&'a str),
    Variable(Variable<'a>),
    /// `${…}` that names nothing known: kept as written.
    Unknown(&'a str),
    /// `${` never closed: kept as written.
    Unclosed {
        rest: &'a str,
        at: usize,
    },
}

/// Splits `text` into its pieces; `$${` becomes the text `${`.
fn pieces(text: &str) -> Vec<Piece<'_>> {
    let mut pieces = Vec::new();
    let mut rest = text;
    let mut literal_start = 0;
    let mut offset = 0;
    while let Some(found) = rest[literal_start..].find('$') {
        let at = literal_start + found;
        let after = &rest[at..];
        if after.starts_with("$${") {
            // The first `$` escapes: `${` stays as text.
            pieces.push(Piece::Text(&rest[..at]));
            pieces.push(Piece::Text("${"));
            rest = &rest[at + 3..];
            offset += at + 3;
            literal_start = 0;
        } else if let Some(inner) = after.strip_prefix("${") {
            pieces.push(Piece::Text(&rest[..at]));
            let Some(close) = inner.find('}') else {
                let chars = text[..offset + at].chars().count() + 1;
                pieces.push(Piece::Unclosed {
                    rest: after,
                    at: chars,
                });
                return pieces;
            };
            let name = &inner[..close];
            pieces.push(match classify(name) {
                Some(variable) => Piece::Variable(variable),
                None => Piece::Unknown(&after[..close + 3]),
            });
            rest = &inner[close + 1..];
            offset += at + 2 + close + 1;
            literal_start = 0;
        } else {
            literal_start = at + 1;
        }
    }
    pieces.push(Piece::Text(rest));
    pieces.retain(|piece| piece != &Piece::Text(""));
    pieces
}

fn classify(name: &str) -> Option<Variable<'_>> {
    if AGENT_VARIABLES.contains(&name) {
        return Some(Variable::Agent(name));
    }
    let env = name.strip_prefix("env.")?;
    let mut chars = env.chars();
    let first = chars.next()?;
    ((first.is_ascii_alphabetic() || first == '_')
        && chars.all(|c| c.is_ascii_alphanumeric() || c == '_'))
    .then_some(Variable::Env(env))
}

/// Every problem of the references in `text`, for a task whose environment has the
/// variables `env` (its `env` keys; the agent's and `PATH` are always there).
pub fn check(text: &str, env: &dyn Fn(&str) -> bool) -> Vec<InterpolationError> {
    pieces(text)
        .into_iter()
        .filter_map(|piece| match piece {
            Piece::Unknown(written) => Some(InterpolationError::Unknown {
                name: written[2..written.len() - 1].to_owned(),
            }),
            Piece::Unclosed { at, .. } => Some(InterpolationError::Unclosed { at }),
            Piece::Variable(Variable::Env(name))
                if !(env(name) || name == "PATH" || AGENT_VARIABLES.contains(&name)) =>
            {
                Some(InterpolationError::NotInEnv {
                    name: name.to_owned(),
                })
            }
            _ => None,
        })
        .collect()
}

/// `text` with each reference replaced by what `lookup` gives for it. A reference
/// `lookup` does not know, or one the validation would refuse (only a record stored
/// before interpolation existed can hold one), stays as written; `$${` becomes `${`.
pub fn interpolate(text: &str, lookup: &dyn Fn(Variable<'_>) -> Option<String>) -> String {
    if !text.contains('$') {
        return text.to_owned();
    }
    let mut out = String::with_capacity(text.len());
    for piece in pieces(text) {
        match piece {
            Piece::Text(text) | Piece::Unknown(text) | Piece::Unclosed { rest: text, .. } => {
                out.push_str(text);
            }
            Piece::Variable(variable) => match lookup(variable) {
                Some(value) => out.push_str(&value),
                None => out.push_str(&written(variable)),
            },
        }
    }
    out
}

fn written(variable: Variable<'_>) -> String {
    match variable {
        Variable::Agent(name) => format!("${{{name}}}"),
        Variable::Env(name) => format!("${{env.{name}}}"),
    }
}

/// A task's environment with the references of the spec's values substituted: `env` is
/// the agent's variables (`STEAD_…`) and the spec's values, merged. An env value's
/// `${env.NAME}` reads what the spec's `env` is laid over: the agent's variables, and
/// `PATH` as `default_path` (so `PATH: "/opt/bin:${env.PATH}"` extends the default).
pub fn task_env(env: &BTreeMap<String, String>, default_path: &str) -> BTreeMap<String, String> {
    let base = |variable: Variable<'_>| match variable {
        Variable::Env("PATH") => Some(default_path.to_owned()),
        Variable::Agent(name) | Variable::Env(name) if name.starts_with("STEAD_") => {
            env.get(name).cloned()
        }
        Variable::Agent(_) | Variable::Env(_) => None,
    };
    env.iter()
        .map(|(key, value)| {
            let value = if key.starts_with("STEAD_") {
                value.clone()
            } else {
                interpolate(value, &base)
            };
            (key.clone(), value)
        })
        .collect()
}

/// A task's start with its references substituted: the environment ([`task_env`]), then
/// the command and its arguments ([`command_line`]).
pub fn task_start(
    env: &BTreeMap<String, String>,
    default_path: &str,
    command: &str,
    args: &[String],
) -> (BTreeMap<String, String>, String, Vec<String>) {
    let env = task_env(env, default_path);
    let (command, args) = command_line(&env, command, args);
    (env, command, args)
}

/// `command` and `args` with their references substituted from `env`, a task's finished
/// environment ([`task_env`]).
pub fn command_line(
    env: &BTreeMap<String, String>,
    command: &str,
    args: &[String],
) -> (String, Vec<String>) {
    let from = |variable: Variable<'_>| match variable {
        Variable::Agent(name) | Variable::Env(name) => env.get(name).cloned(),
    };
    let command = interpolate(command, &from);
    let args = args.iter().map(|arg| interpolate(arg, &from)).collect();
    (command, args)
}

/// Reports every bad reference in the fields of `document` that are substituted: each
/// task's `config.command`, `config.args`, `env` values, and its checks' `command` and
/// `args`. Each diagnostic points at the string that holds the reference.
pub(crate) fn check_document(document: &Node, cx: &mut Decoder<'_>) {
    let Some(tasks) = field_node(document, "spec").and_then(|spec| field_node(spec, "tasks"))
    else {
        return;
    };
    let Value::Sequence(tasks) = &tasks.value else {
        return;
    };
    for (index, task) in tasks.iter().enumerate() {
        let path = FieldPath::root().field("spec").field("tasks").index(index);
        let env_node = field_node(task, "env");
        let env_keys: Vec<&str> = match env_node.map(|n| &n.value) {
            Some(Value::Mapping(entries)) => entries
                .iter()
                .filter_map(|(key, _)| match &key.value {
                    Value::String(key) => Some(key.as_str()),
                    _ => None,
                })
                .collect(),
            _ => Vec::new(),
        };
        let in_env = |name: &str| env_keys.contains(&name);
        let mut strings: Vec<(&Node, FieldPath)> = Vec::new();
        if let Some(config) = field_node(task, "config") {
            command_and_args(config, &path.field("config"), &mut strings);
        }
        if let Some(Value::Sequence(checks)) = field_node(task, "checks").map(|n| &n.value) {
            for (check_index, check) in checks.iter().enumerate() {
                let check_path = path.field("checks").index(check_index);
                command_and_args(check, &check_path, &mut strings);
            }
        }
        // An env value reads what the spec's env is laid over, not the spec's other values.
        let env_values = strings.len();
        if let Some(Value::Mapping(entries)) = env_node.map(|n| &n.value) {
            for (key, value) in entries {
                if let Value::String(key) = &key.value {
                    strings.push((value, path.field("env").field(key)));
                }
            }
        }
        for (index, (node, field)) in strings.into_iter().enumerate() {
            let Value::String(text) = &node.value else {
                continue;
            };
            let problems: Vec<InterpolationError> = if index >= env_values {
                check(text, &|_| false)
                    .into_iter()
                    .map(|problem| match problem {
                        InterpolationError::NotInEnv { name } => {
                            InterpolationError::EnvInEnv { name }
                        }
                        problem => problem,
                    })
                    .collect()
            } else {
                check(text, &in_env)
            };
            for problem in problems {
                cx.report_only_validator(
                    ValidatorOnlyRule::Interpolation,
                    node.location,
                    &field,
                    problem.to_string(),
                );
            }
        }
    }
}

/// The `command` and each of the `args` of mapping `node`.
fn command_and_args<'n>(node: &'n Node, path: &FieldPath, out: &mut Vec<(&'n Node, FieldPath)>) {
    if let Some(command) = field_node(node, "command") {
        out.push((command, path.field("command")));
    }
    if let Some(Value::Sequence(args)) = field_node(node, "args").map(|n| &n.value) {
        for (index, arg) in args.iter().enumerate() {
            out.push((arg, path.field("args").index(index)));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn env() -> BTreeMap<String, String> {
        BTreeMap::from([
            (
                "STEAD_ALLOC_DIR".to_owned(),
                "/data/allocs/web-1/alloc".to_owned(),
            ),
            (
                "STEAD_TASK_DIR".to_owned(),
                "/data/allocs/web-1/main".to_owned(),
            ),
            ("STEAD_TASK_NAME".to_owned(), "main".to_owned()),
            ("PORT".to_owned(), "8080".to_owned()),
            ("CONF".to_owned(), "${STEAD_TASK_DIR}/nginx.conf".to_owned()),
            ("PATH".to_owned(), "/opt/bin:${env.PATH}".to_owned()),
        ])
    }

    #[test]
    fn references_are_replaced_and_everything_else_is_kept_as_written() {
        let (env, command, args) = task_start(
            &env(),
            "/usr/bin",
            "${STEAD_TASK_DIR}/bin/server",
            &[
                "--listen=:${env.PORT}".to_owned(),
                "-c".to_owned(),
                "${env.CONF}".to_owned(),
                "$${HOME} $HOME $ $$ ${".to_owned(),
                "cost: 5$".to_owned(),
                "${STEAD_ALLOC_DIR}${STEAD_TASK_NAME}".to_owned(),
            ],
        );
        assert_eq!(command, "/data/allocs/web-1/main/bin/server");
        assert_eq!(
            args,
            [
                "--listen=:8080",
                "-c",
                "/data/allocs/web-1/main/nginx.conf",
                "${HOME} $HOME $ $$ ${",
                "cost: 5$",
                "/data/allocs/web-1/allocmain",
            ]
        );
        assert_eq!(env["CONF"], "/data/allocs/web-1/main/nginx.conf");
        assert_eq!(env["PATH"], "/opt/bin:/usr/bin", "PATH extends the default");
    }

    #[test]
    fn text_without_references_is_unchanged() {
        for text in ["", "plain", "$", "$$", "a$b", "${", "$${", "}{$"] {
            assert_eq!(
                interpolate(text, &|_| Some("X".to_owned())),
                text.replace("$${", "${")
            );
        }
    }

    #[test]
    fn unknown_names_malformed_env_references_and_unclosed_braces_are_errors() {
        let env = |name: &str| name == "PORT";
        let check = |text: &str| check(text, &env);
        assert_eq!(
            check("${STEAD_TASK_DIR}/x ${env.PORT} ${env.PATH} $${HOME}"),
            []
        );
        assert_eq!(
            check("${HOME}"),
            [InterpolationError::Unknown {
                name: "HOME".to_owned()
            }]
        );
        assert_eq!(
            check("${STEAD_TASKDIR}"),
            [InterpolationError::Unknown {
                name: "STEAD_TASKDIR".to_owned()
            }]
        );
        assert_eq!(
            check("${env.1X} ${env.}"),
            [
                InterpolationError::Unknown {
                    name: "env.1X".to_owned()
                },
                InterpolationError::Unknown {
                    name: "env.".to_owned()
                }
            ]
        );
        assert_eq!(
            check("${env.NOPE}"),
            [InterpolationError::NotInEnv {
                name: "NOPE".to_owned()
            }]
        );
        assert_eq!(
            check("é ${STEAD_TASK_DIR"),
            [InterpolationError::Unclosed { at: 3 }]
        );
        assert_eq!(
            InterpolationError::Unknown {
                name: "HOME".to_owned()
            }
            .to_string(),
            "unknown variable `${HOME}`; known: `${STEAD_ALLOC_DIR}`, `${STEAD_TASK_DIR}`, `${STEAD_SECRETS_DIR}`, `${STEAD_ALLOC_ID}`, `${STEAD_ALLOC_NAME}`, `${STEAD_TASK_NAME}`, `${env.NAME}`; write `$${HOME}` for a literal `${HOME}`"
        );
    }

    #[test]
    fn a_reference_nothing_answers_stays_as_written() {
        assert_eq!(
            interpolate("${HOME}:${env.X}:${STEAD_TASK_DIR}", &|_| None),
            "${HOME}:${env.X}:${STEAD_TASK_DIR}"
        );
    }
}
