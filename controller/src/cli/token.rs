//! Where the CLI finds the agent's token, so the agent's user (or root) needs no flag:
//! `--token`, `STEAD_TOKEN`, a token file (`--token-file`, `STEAD_TOKEN_FILE`), then the
//! token the agent uses as its config and data dir say.

use std::path::{Path, PathBuf};

use anyhow::{Context, bail};
use stead_schemas::config::{AgentConfig, TokenConfig};

use crate::agent::{API_TOKEN_FILE, DEFAULT_DATA_DIR};

/// The agent config the CLI reads when `STEAD_CONFIG` names none and this file exists.
pub(crate) const DEFAULT_CONFIG: &str = "/etc/stead/agent.yaml";
/// The packaged data dir (deploy/agent.yaml), tried after [`DEFAULT_DATA_DIR`].
pub(crate) const PACKAGED_DATA_DIR: &str = "/var/lib/stead";

/// What the user gave, in flags and the environment, and where an agent's files are
/// looked for; empty values count as unset.
#[derive(Debug, Clone, Default)]
pub(crate) struct TokenSources {
    /// `--token`.
    pub(crate) token: Option<String>,
    /// `STEAD_TOKEN`.
    pub(crate) token_env: Option<String>,
    /// `--token-file`, else `STEAD_TOKEN_FILE`.
    pub(crate) token_file: Option<PathBuf>,
    /// `--data-dir`, else `STEAD_DATA_DIR`.
    pub(crate) data_dir: Option<PathBuf>,
    /// `STEAD_CONFIG`, else [`DEFAULT_CONFIG`] when it exists.
    pub(crate) config: Option<PathBuf>,
    /// The data dirs tried when no config names one: [`DEFAULT_DATA_DIR`] (what `make
    /// run` uses) and [`PACKAGED_DATA_DIR`].
    pub(crate) fallback_data_dirs: Vec<PathBuf>,
}

/// The token to send, and what to add to a 401's message.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct FoundToken {
    /// The token; `None` sends none.
    pub(crate) token: Option<String>,
    /// Appended to the agent's message when it answers 401: where the token came from,
    /// or where none was found, and how to pass one.
    pub(crate) unauthorized_hint: String,
}

/// How to pass a token, for hints.
const HOW: &str = "pass its token with --token, STEAD_TOKEN or --token-file, or its data dir with --data-dir or STEAD_DATA_DIR";

impl TokenSources {
    /// The sources as this process has them: `token` and `token_file` from flags, the
    /// rest from the environment and the file system.
    pub(crate) fn from_environment(
        token: Option<String>,
        token_file: Option<PathBuf>,
        data_dir: Option<PathBuf>,
    ) -> TokenSources {
        let var = |name: &str| std::env::var_os(name).filter(|v| !v.is_empty());
        let config = var("STEAD_CONFIG").map(PathBuf::from).or_else(|| {
            Path::new(DEFAULT_CONFIG)
                .exists()
                .then(|| PathBuf::from(DEFAULT_CONFIG))
        });
        TokenSources {
            token,
            token_env: std::env::var("STEAD_TOKEN").ok(),
            token_file: token_file.or_else(|| var("STEAD_TOKEN_FILE").map(PathBuf::from)),
            data_dir: data_dir.or_else(|| var("STEAD_DATA_DIR").map(PathBuf::from)),
            config,
            fallback_data_dirs: vec![
                PathBuf::from(DEFAULT_DATA_DIR),
                PathBuf::from(PACKAGED_DATA_DIR),
            ],
        }
    }

    /// The token to send to an agent; `local` says whether it is on this host (a
    /// loopback address or a unix socket): a token found in this host's files is never
    /// sent elsewhere. A token file named explicitly that cannot be read is an error; a
    /// file looked for that does not exist is skipped, and one that cannot be read is
    /// named in the hint.
    pub(crate) fn find(&self, local: bool) -> anyhow::Result<FoundToken> {
        let given = |token: &str, from: &str| FoundToken {
            token: Some(token.to_owned()),
            unauthorized_hint: format!(" (the token from {from} is not this agent's)"),
        };
        if let Some(token) = self.token.as_deref().filter(|t| !t.is_empty()) {
            return Ok(given(token, "--token"));
        }
        if let Some(token) = self.token_env.as_deref().filter(|t| !t.is_empty()) {
            return Ok(given(token, "STEAD_TOKEN"));
        }
        if let Some(path) = &self.token_file {
            let text = std::fs::read_to_string(path)
                .with_context(|| format!("cannot read token file {}", path.display()))?;
            let token = text.trim();
            if token.is_empty() {
                bail!("token file {} is empty", path.display());
            }
            return Ok(given(token, &path.display().to_string()));
        }
        if !local {
            return Ok(FoundToken {
                token: None,
                unauthorized_hint: format!(
                    " ({HOW}; a token file on this host is sent only to an agent on this host)"
                ),
            });
        }
        let mut notes = Vec::new();
        let candidates = match &self.data_dir {
            Some(dir) => vec![dir.join(API_TOKEN_FILE)],
            None => match self.config.as_deref().map(AgentConfig::load) {
                Some(Ok(config)) => {
                    let from = self.config.as_deref().unwrap_or(Path::new(DEFAULT_CONFIG));
                    match (config.token, config.token_file, config.data_dir) {
                        (Some(TokenConfig::None), _, _) => {
                            return Ok(FoundToken {
                                token: None,
                                unauthorized_hint: format!(
                                    " (the agent config {} says `token: none`; is it this agent's? {HOW})",
                                    from.display()
                                ),
                            });
                        }
                        (Some(TokenConfig::Bearer(token)), _, _) => {
                            return Ok(given(
                                &token,
                                &format!("the agent config {}", from.display()),
                            ));
                        }
                        (None, Some(file), _) => vec![file],
                        (None, None, Some(dir)) => vec![dir.join(API_TOKEN_FILE)],
                        (None, None, None) => self.fallbacks(),
                    }
                }
                Some(Err(error)) => {
                    notes.push(format!("{:#}", anyhow::Error::from(error)));
                    self.fallbacks()
                }
                None => self.fallbacks(),
            },
        };
        for path in &candidates {
            match std::fs::read_to_string(path) {
                Ok(text) if text.trim().is_empty() => {
                    notes.push(format!("{} is empty", path.display()));
                    break;
                }
                Ok(text) => {
                    let hint = format!(
                        " (the token from {} is not this agent's; {HOW})",
                        path.display()
                    );
                    return Ok(FoundToken {
                        token: Some(text.trim().to_owned()),
                        unauthorized_hint: hint,
                    });
                }
                Err(error) if error.kind() == std::io::ErrorKind::NotFound => {}
                Err(error) if error.kind() == std::io::ErrorKind::PermissionDenied => {
                    notes.push(format!(
                        "cannot read {}: permission denied; run as the agent's user or root",
                        path.display()
                    ));
                    break;
                }
                Err(error) => {
                    notes.push(format!("cannot read {}: {error}", path.display()));
                    break;
                }
            }
        }
        if notes.is_empty() {
            let tried: Vec<String> = candidates.iter().map(|p| p.display().to_string()).collect();
            notes.push(format!("no token file at {}", tried.join(" or ")));
        }
        Ok(FoundToken {
            token: None,
            unauthorized_hint: format!(" ({}; {HOW})", notes.join("; ")),
        })
    }

    fn fallbacks(&self) -> Vec<PathBuf> {
        self.fallback_data_dirs
            .iter()
            .map(|dir| dir.join(API_TOKEN_FILE))
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Sources with nothing given and `dir/fallback` the only fallback data dir.
    fn nothing(dir: &Path) -> TokenSources {
        TokenSources {
            fallback_data_dirs: vec![dir.join("fallback")],
            ..TokenSources::default()
        }
    }

    fn token_of(sources: &TokenSources, local: bool) -> Option<String> {
        sources.find(local).expect("found").token
    }

    #[test]
    fn flags_come_before_the_environment_before_files_and_files_only_go_to_a_local_agent() {
        let dir = tempfile::tempdir().expect("dir");
        let root = dir.path();
        for sub in ["data", "fallback", "config-data"] {
            std::fs::create_dir(root.join(sub)).expect("dir");
            std::fs::write(root.join(sub).join(API_TOKEN_FILE), format!("{sub}\n")).expect("w");
        }
        std::fs::write(root.join("file"), " from-file \n").expect("write");
        let config = root.join("agent.yaml");
        std::fs::write(
            &config,
            format!("dataDir: {}\n", root.join("config-data").display()),
        )
        .expect("write");
        let all = TokenSources {
            token: Some("flag".to_owned()),
            token_env: Some("env".to_owned()),
            token_file: Some(root.join("file")),
            data_dir: Some(root.join("data")),
            config: Some(config.clone()),
            ..nothing(root)
        };
        let table: [(TokenSources, bool, Option<&str>); 9] = [
            (all.clone(), false, Some("flag")),
            (
                TokenSources {
                    token: Some(String::new()),
                    ..all.clone()
                },
                true,
                Some("env"),
            ),
            (
                TokenSources {
                    token: None,
                    token_env: None,
                    ..all.clone()
                },
                false,
                Some("from-file"),
            ),
            (
                TokenSources {
                    token_file: None,
                    token: None,
                    token_env: None,
                    ..all.clone()
                },
                true,
                Some("data"),
            ),
            // The data dir's token is never sent to an agent on another host.
            (
                TokenSources {
                    token_file: None,
                    token: None,
                    token_env: None,
                    ..all.clone()
                },
                false,
                None,
            ),
            (
                TokenSources {
                    config: Some(config.clone()),
                    ..nothing(root)
                },
                true,
                Some("config-data"),
            ),
            (nothing(root), true, Some("fallback")),
            (
                TokenSources {
                    fallback_data_dirs: vec![root.join("missing"), root.join("fallback")],
                    ..nothing(root)
                },
                true,
                Some("fallback"),
            ),
            (
                TokenSources {
                    config: Some(root.join("missing.yaml")),
                    ..nothing(root)
                },
                true,
                Some("fallback"),
            ),
        ];
        for (index, (sources, local, expected)) in table.iter().enumerate() {
            assert_eq!(
                token_of(sources, *local).as_deref(),
                *expected,
                "case {index}"
            );
        }
    }

    #[test]
    fn the_agent_config_gives_its_token_its_token_file_or_says_none() {
        let dir = tempfile::tempdir().expect("dir");
        let config = dir.path().join("agent.yaml");
        let sources = TokenSources {
            config: Some(config.clone()),
            ..nothing(dir.path())
        };
        std::fs::write(&config, "token: s3cret\n").expect("write");
        assert_eq!(token_of(&sources, true).as_deref(), Some("s3cret"));
        let file = dir.path().join("token");
        std::fs::write(&file, "from-file\n").expect("write");
        std::fs::write(&config, format!("tokenFile: {}\n", file.display())).expect("write");
        assert_eq!(token_of(&sources, true).as_deref(), Some("from-file"));
        std::fs::write(&config, "token: none\n").expect("write");
        let found = sources.find(true).expect("found");
        assert_eq!(found.token, None);
        assert!(found.unauthorized_hint.contains("says `token: none`"));
    }

    #[test]
    fn a_token_file_not_found_is_named_in_the_hint_and_one_named_explicitly_is_an_error() {
        let dir = tempfile::tempdir().expect("dir");
        let found = nothing(dir.path()).find(true).expect("found");
        assert_eq!(
            found,
            FoundToken {
                token: None,
                unauthorized_hint: format!(
                    " (no token file at {}; {HOW})",
                    dir.path().join("fallback").join(API_TOKEN_FILE).display()
                ),
            }
        );
        let missing = dir.path().join("missing");
        let error = TokenSources {
            token_file: Some(missing.clone()),
            ..nothing(dir.path())
        }
        .find(true)
        .expect_err("refused");
        assert_eq!(
            error.to_string(),
            format!("cannot read token file {}", missing.display())
        );
        std::fs::create_dir(dir.path().join("fallback")).expect("dir");
        std::fs::write(dir.path().join("fallback").join(API_TOKEN_FILE), "\n").expect("write");
        let found = nothing(dir.path()).find(true).expect("found");
        assert_eq!(found.token, None);
        assert!(found.unauthorized_hint.contains("is empty"), "{found:?}");
    }
}
