//! What the exec driver reports about the node: whether it can run tasks, and facts
//! about the kernel and the OS (the driver adds its cgroups').

use std::collections::BTreeMap;
use std::os::unix::fs::PermissionsExt;
use std::path::Path;

/// Why the driver cannot run tasks, or `Ok` when it can.
pub(crate) fn check(supervisor: &Path) -> Result<(), String> {
    match std::fs::metadata(supervisor) {
        Ok(metadata) if metadata.is_file() && metadata.permissions().mode() & 0o111 != 0 => {}
        Ok(_) => {
            return Err(format!(
                "the supervisor {} is not an executable file",
                supervisor.display()
            ));
        }
        Err(error) => {
            return Err(format!(
                "the supervisor {} cannot be found: {error}",
                supervisor.display()
            ));
        }
    }
    if std::fs::read_to_string("/proc/self/stat").is_err() {
        return Err("/proc is not mounted: processes cannot be identified".to_owned());
    }
    Ok(())
}

fn first_line(path: &str) -> Option<String> {
    let text = std::fs::read_to_string(path).ok()?;
    Some(text.lines().next()?.trim().to_owned())
}

/// `KEY=value` from os-release text, unquoted.
fn os_release_field(text: &str, key: &str) -> Option<String> {
    text.lines().find_map(|line| {
        let value = line.strip_prefix(key)?.strip_prefix('=')?;
        Some(value.trim_matches('"').to_owned())
    })
}

/// The driver's attributes, as `stead node status` shows them.
pub(crate) fn attributes(supervisor: &Path) -> BTreeMap<String, String> {
    let mut attributes = BTreeMap::from([
        ("driver.exec".to_owned(), "true".to_owned()),
        (
            "driver.exec.supervisor".to_owned(),
            supervisor.display().to_string(),
        ),
        ("kernel.name".to_owned(), std::env::consts::OS.to_owned()),
    ]);
    if let Some(release) = first_line("/proc/sys/kernel/osrelease") {
        attributes.insert("kernel.version".to_owned(), release);
    }
    if let Ok(text) = std::fs::read_to_string("/etc/os-release") {
        for (key, attribute) in [("ID", "os.name"), ("VERSION_ID", "os.version")] {
            if let Some(value) = os_release_field(&text, key) {
                attributes.insert(attribute.to_owned(), value);
            }
        }
    }
    attributes
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn os_release_fields_are_read_unquoted() {
        let text = "PRETTY_NAME=\"Debian GNU/Linux 12 (bookworm)\"\nVERSION_ID=\"12\"\nID=debian\n";
        assert_eq!(os_release_field(text, "ID").as_deref(), Some("debian"));
        assert_eq!(os_release_field(text, "VERSION_ID").as_deref(), Some("12"));
        assert_eq!(os_release_field(text, "NAME"), None);
    }

    #[test]
    fn a_missing_supervisor_makes_the_driver_unusable() {
        let problem = check(Path::new("/nonexistent/stead-supervisor")).expect_err("missing");
        assert!(problem.contains("cannot be found"), "{problem}");
    }
}
