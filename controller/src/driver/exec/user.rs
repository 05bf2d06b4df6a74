//! The user a task runs as: a name or a numeric uid, looked up in `/etc/passwd`.

use std::path::Path;

/// A user the task runs as.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Account {
    /// The user id.
    pub(crate) uid: u32,
    /// The primary group id.
    pub(crate) gid: u32,
}

/// Finds `user` (a name or a numeric uid) in the passwd file `text`. A numeric uid that
/// has no entry runs with the group of the same number.
pub(crate) fn lookup_in(text: &str, user: &str) -> Option<Account> {
    let numeric = user.parse::<u32>().ok();
    for line in text.lines() {
        let mut fields = line.split(':');
        let (Some(name), Some(_), Some(uid), Some(gid)) =
            (fields.next(), fields.next(), fields.next(), fields.next())
        else {
            continue;
        };
        let (Ok(uid), Ok(gid)) = (uid.parse::<u32>(), gid.parse::<u32>()) else {
            continue;
        };
        if name == user || numeric == Some(uid) {
            return Some(Account { uid, gid });
        }
    }
    numeric.map(|uid| Account { uid, gid: uid })
}

/// Finds `user` in `passwd` (normally `/etc/passwd`).
pub(crate) fn lookup(passwd: &Path, user: &str) -> std::io::Result<Option<Account>> {
    let text = std::fs::read_to_string(passwd)?;
    Ok(lookup_in(&text, user))
}

#[cfg(test)]
mod tests {
    use super::*;

    const PASSWD: &str = "root:x:0:0:root:/root:/bin/bash\n# a comment\nbroken\nnobody:x:65534:65534:nobody:/nonexistent:/usr/sbin/nologin\napp:x:1000:100::/home/app:/bin/sh\n";

    #[test]
    fn users_are_found_by_name_or_uid() {
        assert_eq!(
            lookup_in(PASSWD, "nobody"),
            Some(Account {
                uid: 65534,
                gid: 65534
            })
        );
        assert_eq!(
            lookup_in(PASSWD, "1000"),
            Some(Account {
                uid: 1000,
                gid: 100
            })
        );
        assert_eq!(
            lookup_in(PASSWD, "4242"),
            Some(Account {
                uid: 4242,
                gid: 4242
            })
        );
        assert_eq!(lookup_in(PASSWD, "ghost"), None);
        assert_eq!(lookup_in(PASSWD, "root"), Some(Account { uid: 0, gid: 0 }));
    }
}
