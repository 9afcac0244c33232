//! A workspace's tags in the store. The tenant writes `name:tag`; the store holds
//! `<workspace>.<name>:<tag>`. Workspace ids (`[a-z0-9]+([_-][a-z0-9]+)*`, see
//! [`workspace_id`]) hold no `.`, so the text before the first `.` of a stored name is
//! always its workspace, and no tenant name reaches another workspace's names.

use kiln_pipeline::WorkspaceId;
use kiln_store::TagRef;

/// Checks a workspace id: [`WorkspaceId`]'s grammar, and one that makes valid store names
/// (no `_`/`-` at the end or doubled), at most 64 bytes.
pub fn workspace_id(s: &str) -> Result<WorkspaceId, String> {
    let id: WorkspaceId = s
        .parse()
        .map_err(|e: kiln_pipeline::PipelineError| e.to_string())?;
    let ok = s.split(['_', '-']).all(|p| !p.is_empty());
    if ok {
        Ok(id)
    } else {
        Err(format!(
            "workspace id {s:?}: expected [a-z0-9]+([_-][a-z0-9]+)*, at most 64 bytes"
        ))
    }
}

/// The store tag of the tenant tag `name:tag` of workspace `ws`. Errors: the grammar of
/// [`TagRef`], or a name too long once prefixed.
pub fn to_store(ws: &str, name: &str, tag: &str) -> Result<TagRef, String> {
    TagRef::new(name, tag).map_err(|e| e.to_string())?;
    TagRef::new(&format!("{}{name}", store_prefix(ws)), tag).map_err(|_| {
        format!(
            "invalid tag reference {name}:{tag}: name too long (at most {} bytes here)",
            kiln_store::tag::MAX_NAME_LEN.saturating_sub(ws.len() + 1)
        )
    })
}

/// Refuses a tenant tag named like a global base (`global_bases`, [`crate::ServiceConfig`]):
/// such a name means the operator's image in every tenant's `FROM`.
pub fn check_not_global(
    name: &str,
    global_bases: &std::collections::BTreeSet<String>,
) -> Result<(), String> {
    if global_bases.contains(name) {
        return Err(format!(
            "tag name {name:?} is a global base of this server: choose another name"
        ));
    }
    Ok(())
}

/// `<ws>.`: the start of every stored name of workspace `ws`.
pub fn store_prefix(ws: &str) -> String {
    format!("{ws}.")
}

/// The tenant's name of a stored name, when it is in workspace `ws`.
pub fn from_store<'a>(ws: &str, stored: &'a str) -> Option<&'a str> {
    stored.strip_prefix(ws)?.strip_prefix('.')
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_stay_in_their_workspace() {
        let t = to_store("acme", "app", "1").expect("valid");
        assert_eq!(t.to_string(), "acme.app:1");
        assert_eq!(from_store("acme", &t.name), Some("app"));
        assert_eq!(from_store("acm", &t.name), None);
        assert_eq!(from_store("acme-2", &t.name), None);
        // A name with dots is still inside the workspace that wrote it.
        let t = to_store("a", "b.app", "1").expect("valid");
        assert_eq!(from_store("a", &t.name), Some("b.app"));
        assert_eq!(from_store("b", &t.name), None);
        // Docker names may have `/`-separated components: still inside the workspace.
        let t = to_store("acme", "rival/app", "1").expect("valid");
        assert_eq!(t.to_string(), "acme.rival/app:1");
        assert_eq!(from_store("acme", &t.name), Some("rival/app"));
        assert_eq!(from_store("rival", &t.name), None);
        for bad in ["../x", "a/../b", "/a", "a/", "a//b", "A", "", ".x", "x."] {
            assert!(to_store("acme", bad, "1").is_err(), "{bad}");
        }
        // A name valid alone but too long once prefixed with `acme.`.
        let long = "a".repeat(kiln_store::tag::MAX_NAME_LEN - 4);
        assert!(TagRef::new(&long, "1").is_ok());
        let e = to_store("acme", &long, "1").unwrap_err();
        assert!(e.contains("at most 250 bytes here"), "{e}");
    }

    #[test]
    fn workspace_ids() {
        for ok in ["a", "acme", "a-b", "a_b-c1"] {
            assert!(workspace_id(ok).is_ok(), "{ok}");
        }
        for bad in ["", "a-", "a--b", "a.b", "A", "-a", "a/b"] {
            assert!(workspace_id(bad).is_err(), "{bad}");
        }
    }
}
