//! The user a task runs as: a name or a numeric uid, looked up in `/etc/passwd`, and its
//! supplementary groups, from `/etc/group`.
//!
//! Both files are read directly, as runc reads a container's: the account and its groups
//! come from one source, and no NSS module (LDAP, sssd) is called on the start path.

use std::io;
use std::path::{Path, PathBuf};

/// A user the task runs as.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Account {
    /// The user id.
    pub(crate) uid: u32,
    /// The primary group id.
    pub(crate) gid: u32,
    /// The supplementary groups, as `getgrouplist(3)` lists them: the primary group
    /// first, then every group that names the user as a member, each once, in file order.
    pub(crate) groups: Vec<u32>,
}

/// An account file that could not be read.
#[derive(Debug, thiserror::Error)]
#[error("reading {}", path.display())]
pub(crate) struct AccountFileError {
    /// The file.
    pub(crate) path: PathBuf,
    /// Why.
    #[source]
    pub(crate) source: io::Error,
}

/// Finds `user` (a name or a numeric uid) in the passwd file `passwd`, with its groups
/// from the group file `group`. A numeric uid that has no entry runs with the group of
/// the same number and no other group: it has no name to be a member by.
pub(crate) fn lookup_in(passwd: &str, group: &str, user: &str) -> Option<Account> {
    let numeric = user.parse::<u32>().ok();
    for line in passwd.lines() {
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
            return Some(Account {
                uid,
                gid,
                groups: groups_of(group, name, gid),
            });
        }
    }
    numeric.map(|uid| Account {
        uid,
        gid: uid,
        groups: vec![uid],
    })
}

/// The groups of the user `name` whose primary group is `gid`, from the group file
/// `group` (`name:password:gid:member,member`), as [`Account::groups`] orders them.
fn groups_of(group: &str, name: &str, gid: u32) -> Vec<u32> {
    let mut groups = vec![gid];
    for line in group.lines() {
        let mut fields = line.split(':');
        let (Some(_), Some(_), Some(id), Some(members)) =
            (fields.next(), fields.next(), fields.next(), fields.next())
        else {
            continue;
        };
        let Ok(id) = id.parse::<u32>() else {
            continue;
        };
        if members.split(',').any(|member| member == name) && !groups.contains(&id) {
            groups.push(id);
        }
    }
    groups
}

/// Finds `user` in `passwd` (normally `/etc/passwd`), with its groups from `group`
/// (normally `/etc/group`; a missing group file lists no member).
pub(crate) fn lookup(
    passwd: &Path,
    group: &Path,
    user: &str,
) -> Result<Option<Account>, AccountFileError> {
    let read = |path: &Path| {
        std::fs::read_to_string(path).map_err(|source| AccountFileError {
            path: path.to_owned(),
            source,
        })
    };
    let passwd = read(passwd)?;
    let group = match read(group) {
        Ok(text) => text,
        Err(error) if error.source.kind() == io::ErrorKind::NotFound => String::new(),
        Err(error) => return Err(error),
    };
    Ok(lookup_in(&passwd, &group, user))
}

#[cfg(test)]
mod tests {
    use super::*;

    const PASSWD: &str = "root:x:0:0:root:/root:/bin/bash\n# a comment\nbroken\nnobody:x:65534:65534:nobody:/nonexistent:/usr/sbin/nologin\napp:x:1000:100::/home/app:/bin/sh\n";

    const GROUP: &str = "root:x:0:\nusers:x:100:app\nvideo:x:44:someone,app\n# a comment\nbroken:x\nbad:x:nan:app\nrender:x:109:app\nssl-cert:x:103:application,ap\nnogroup:x:65534:\n";

    #[test]
    fn users_are_found_by_name_or_uid() {
        assert_eq!(
            lookup_in(PASSWD, GROUP, "nobody"),
            Some(Account {
                uid: 65534,
                gid: 65534,
                groups: vec![65534],
            })
        );
        assert_eq!(
            lookup_in(PASSWD, GROUP, "1000").map(|a| (a.uid, a.gid)),
            Some((1000, 100))
        );
        assert_eq!(lookup_in(PASSWD, GROUP, "ghost"), None);
        assert_eq!(
            lookup_in(PASSWD, GROUP, "root"),
            Some(Account {
                uid: 0,
                gid: 0,
                groups: vec![0],
            })
        );
    }

    #[test]
    fn a_user_has_its_primary_group_then_the_groups_naming_it_as_a_member_once_each() {
        let by_name = lookup_in(PASSWD, GROUP, "app").expect("app exists");
        assert_eq!(by_name.groups, [100, 44, 109]);
        assert_eq!(
            lookup_in(PASSWD, GROUP, "1000").expect("uid 1000 exists"),
            by_name
        );
        assert_eq!(
            lookup_in(PASSWD, "", "app").expect("app exists").groups,
            [100]
        );
    }

    #[test]
    fn a_numeric_uid_without_an_entry_runs_with_the_group_of_the_same_number_alone() {
        assert_eq!(
            lookup_in(PASSWD, GROUP, "4242"),
            Some(Account {
                uid: 4242,
                gid: 4242,
                groups: vec![4242],
            })
        );
    }

    #[test]
    fn a_missing_group_file_lists_no_member_and_a_missing_passwd_file_names_its_path() {
        let dir = tempfile::tempdir().expect("tempdir");
        let passwd = dir.path().join("passwd");
        std::fs::write(&passwd, PASSWD).expect("written");
        let group = dir.path().join("group");
        let account = lookup(&passwd, &group, "app")
            .expect("readable")
            .expect("app exists");
        assert_eq!(account.groups, [100]);
        std::fs::write(&group, GROUP).expect("written");
        let account = lookup(&passwd, &group, "app")
            .expect("readable")
            .expect("app exists");
        assert_eq!(account.groups, [100, 44, 109]);
        let missing = dir.path().join("no-passwd");
        let error = lookup(&missing, &group, "app").expect_err("no passwd file");
        assert_eq!(error.path, missing);
    }
}
