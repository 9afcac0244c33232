//! `USER` resolution against a root filesystem's `/etc/passwd` and `/etc/group`
//! (passwd(5), group(5)), as Docker and runc resolve it: `user[:group]` where each part is a
//! name or a numeric id.
//!
//! - A name must exist in `/etc/passwd` (or `/etc/group` for the group part).
//! - A numeric user found in `/etc/passwd` takes its primary group from there; one that is
//!   not found runs with gid = uid (kiln's rule, issue 5) and `HOME=/`.
//! - Supplementary groups: every group of `/etc/group` listing the user's name as a member,
//!   besides the primary one (only when no group was given explicitly, as runc does).
//!
//! The files are untrusted: malformed lines are skipped, and at most [`MAX_DB_BYTES`] of each
//! is read.

/// At most this many bytes of `/etc/passwd` or `/etc/group` are considered (1 MiB).
pub const MAX_DB_BYTES: usize = 1 << 20;
/// At most this many supplementary groups (Linux `NGROUPS_MAX` is 65536; runc has no
/// lower cap; 1024 keeps a hostile group file from costing much).
pub const MAX_GROUPS: usize = 1024;

/// The identity a step runs as.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ExecUser {
    /// User id.
    pub uid: u32,
    /// Primary group id.
    pub gid: u32,
    /// Supplementary group ids (without the primary one), sorted, no duplicates.
    pub groups: Vec<u32>,
    /// Home directory from `/etc/passwd` (`/` when unknown).
    pub home: String,
}

/// A `USER` that cannot be resolved.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum UserError {
    /// The user name is not in `/etc/passwd`.
    #[error("user {0:?} not found in /etc/passwd")]
    UnknownUser(String),
    /// The group name is not in `/etc/group`.
    #[error("group {0:?} not found in /etc/group")]
    UnknownGroup(String),
    /// The spec is empty or has an empty part.
    #[error("invalid USER {0:?}")]
    Invalid(String),
}

struct PasswdEntry<'a> {
    name: &'a str,
    uid: u32,
    gid: u32,
    home: &'a str,
}

struct GroupEntry<'a> {
    name: &'a str,
    gid: u32,
    members: Vec<&'a str>,
}

fn bounded(db: &str) -> &str {
    if db.len() <= MAX_DB_BYTES {
        return db;
    }
    let mut end = MAX_DB_BYTES;
    while !db.is_char_boundary(end) {
        end -= 1;
    }
    &db[..end]
}

/// A uid or gid as written: decimal, and never 4294967295, which is `(uid_t)-1`: chown(2)
/// and setresuid(2) read it as "leave unchanged", so a file or step given it would stay
/// root's.
pub(crate) fn parse_id(s: &str) -> Option<u32> {
    s.parse::<u32>().ok().filter(|id| *id != u32::MAX)
}

fn passwd_entries(db: &str) -> impl Iterator<Item = PasswdEntry<'_>> {
    bounded(db).lines().filter_map(|line| {
        if line.starts_with('#') {
            return None;
        }
        let f: Vec<&str> = line.split(':').collect();
        if f.len() < 7 || f[0].is_empty() {
            return None;
        }
        Some(PasswdEntry {
            name: f[0],
            uid: parse_id(f[2])?,
            gid: parse_id(f[3])?,
            home: f[5],
        })
    })
}

fn group_entries(db: &str) -> impl Iterator<Item = GroupEntry<'_>> {
    bounded(db).lines().filter_map(|line| {
        if line.starts_with('#') {
            return None;
        }
        let f: Vec<&str> = line.split(':').collect();
        if f.len() < 4 || f[0].is_empty() {
            return None;
        }
        Some(GroupEntry {
            name: f[0],
            gid: parse_id(f[2])?,
            members: f[3].split(',').filter(|m| !m.is_empty()).collect(),
        })
    })
}

/// Resolves `spec` (`None`: root) given the contents of `/etc/passwd` and `/etc/group`
/// (empty strings when the files are missing).
pub fn resolve_user(spec: Option<&str>, passwd: &str, group: &str) -> Result<ExecUser, UserError> {
    let spec = match spec {
        None => "0",
        Some(s) => s,
    };
    let (user_part, group_part) = match spec.split_once(':') {
        Some((u, g)) => (u, Some(g)),
        None => (spec, None),
    };
    if user_part.is_empty() || group_part == Some("") {
        return Err(UserError::Invalid(spec.to_string()));
    }
    let digits = |s: &str| s.bytes().all(|b| b.is_ascii_digit());
    // A numeric part must be a valid id (not one that overflows, nor -1).
    let numeric_user: Option<u32> = if digits(user_part) {
        Some(parse_id(user_part).ok_or_else(|| UserError::Invalid(spec.to_string()))?)
    } else {
        None
    };
    let entry = match numeric_user {
        Some(uid) => passwd_entries(passwd).find(|e| e.uid == uid),
        None => passwd_entries(passwd).find(|e| e.name == user_part),
    };
    let (uid, mut gid, home, name) = match (entry, numeric_user) {
        (Some(e), _) => (e.uid, e.gid, e.home.to_string(), Some(e.name.to_string())),
        (None, Some(uid)) => (uid, uid, "/".to_string(), None),
        (None, None) => return Err(UserError::UnknownUser(user_part.to_string())),
    };
    let mut groups = Vec::new();
    match group_part {
        Some(g) => {
            gid = match digits(g) {
                true => parse_id(g).ok_or_else(|| UserError::Invalid(spec.to_string()))?,
                false => group_entries(group)
                    .find(|e| e.name == g)
                    .map(|e| e.gid)
                    .ok_or_else(|| UserError::UnknownGroup(g.to_string()))?,
            };
        }
        None => {
            if let Some(name) = &name {
                for e in group_entries(group) {
                    if e.gid != gid && e.members.contains(&name.as_str()) {
                        groups.push(e.gid);
                        if groups.len() >= MAX_GROUPS {
                            break;
                        }
                    }
                }
            }
        }
    }
    groups.sort_unstable();
    groups.dedup();
    let home = if home.is_empty() {
        "/".to_string()
    } else {
        home
    };
    Ok(ExecUser {
        uid,
        gid,
        groups,
        home,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    const PASSWD: &str = "root:x:0:0:root:/root:/bin/sh\n\
        # comment\n\
        broken line\n\
        daemon:x:1:1::/usr/sbin:/bin/false\n\
        bad:x:notanumber:1::/:/bin/sh\n\
        alice:x:1000:1000:Alice:/home/alice:/bin/sh\n";
    const GROUP: &str =
        "root:x:0:\nalice:x:1000:\nwheel:x:10:alice,bob\naudio:x:29:bob\ndocker:x:999:alice\n";

    #[test]
    fn root_by_default() {
        let u = resolve_user(None, PASSWD, GROUP).unwrap();
        assert_eq!((u.uid, u.gid, u.home.as_str()), (0, 0, "/root"));
        assert!(u.groups.is_empty());
    }

    #[test]
    fn name_with_supplementary_groups() {
        let u = resolve_user(Some("alice"), PASSWD, GROUP).unwrap();
        assert_eq!((u.uid, u.gid), (1000, 1000));
        assert_eq!(u.groups, vec![10, 999]);
        assert_eq!(u.home, "/home/alice");
    }

    #[test]
    fn numeric_known_and_unknown() {
        let u = resolve_user(Some("1000"), PASSWD, GROUP).unwrap();
        assert_eq!((u.uid, u.gid), (1000, 1000));
        let u = resolve_user(Some("4242"), PASSWD, GROUP).unwrap();
        assert_eq!((u.uid, u.gid, u.home.as_str()), (4242, 4242, "/"));
    }

    #[test]
    fn explicit_group() {
        let u = resolve_user(Some("alice:wheel"), PASSWD, GROUP).unwrap();
        assert_eq!((u.uid, u.gid), (1000, 10));
        assert!(u.groups.is_empty());
        let u = resolve_user(Some("5:7"), PASSWD, GROUP).unwrap();
        assert_eq!((u.uid, u.gid), (5, 7));
    }

    #[test]
    fn unknown_and_invalid() {
        assert_eq!(
            resolve_user(Some("mallory"), PASSWD, GROUP),
            Err(UserError::UnknownUser("mallory".into()))
        );
        assert_eq!(
            resolve_user(Some("alice:nogroup"), PASSWD, GROUP),
            Err(UserError::UnknownGroup("nogroup".into()))
        );
        assert!(matches!(
            resolve_user(Some(":0"), PASSWD, GROUP),
            Err(UserError::Invalid(_))
        ));
        assert!(matches!(
            resolve_user(Some("alice:"), PASSWD, GROUP),
            Err(UserError::Invalid(_))
        ));
        // A malformed uid line never matches by name.
        assert!(resolve_user(Some("bad"), PASSWD, GROUP).is_err());
    }

    #[test]
    fn hostile_group_file_is_bounded() {
        let mut group = String::new();
        for i in 0..5000 {
            group.push_str(&format!("g{i}:x:{}:alice\n", i + 2000));
        }
        let u = resolve_user(Some("alice"), PASSWD, &group).unwrap();
        assert_eq!(u.groups.len(), MAX_GROUPS);
    }

    /// uid/gid 4294967295 is (uid_t)-1, which chown(2) and setresuid(2) read as "leave
    /// unchanged": a step or file given it would silently stay root's. Refused wherever it
    /// comes from (the spec, /etc/passwd, /etc/group).
    #[test]
    fn id_minus_one_is_refused() {
        for spec in ["4294967295", "0:4294967295", "4294967295:0", "99999999999"] {
            assert!(
                matches!(
                    resolve_user(Some(spec), PASSWD, GROUP),
                    Err(UserError::Invalid(_))
                ),
                "{spec}"
            );
        }
        let passwd = "evil:x:4294967295:4294967295::/:/bin/sh\nhalf:x:1000:4294967295::/:/bin/sh\n";
        assert!(matches!(
            resolve_user(Some("evil"), passwd, GROUP),
            Err(UserError::UnknownUser(_))
        ));
        assert!(resolve_user(Some("half"), passwd, GROUP).is_err());
        let group = "evil:x:4294967295:alice\n";
        assert!(matches!(
            resolve_user(Some("alice:evil"), PASSWD, group),
            Err(UserError::UnknownGroup(_))
        ));
        // alice's supplementary groups never include it either.
        let u = resolve_user(Some("alice"), PASSWD, group).unwrap();
        assert!(u.groups.is_empty());
    }
}
