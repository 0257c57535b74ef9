//! The names peers and clients give templates, checked where they enter: a template id
//! (the API's rule) and a version directory's name (what a peer sends when it exports a
//! template), both safe to build a path from once they pass.

/// Whether `id` is a template id as the API takes it: 1-64 characters of
/// `[A-Za-z0-9_-]`, so also a safe part of a path (the disk tier's directories are
/// `<id>@<version>`).
pub fn check_template_id(id: &str) -> Result<(), String> {
    let ok = !id.is_empty()
        && id.len() <= 64
        && id
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || c == '_' || c == '-');
    match ok {
        true => Ok(()),
        false => Err(format!(
            "template id `{}`: use 1-64 characters of [A-Za-z0-9_-]",
            id.escape_debug()
        )),
    }
}

/// The name of version `version` of template `id`: its directory in the disk tier, and
/// what a peer exports it as.
pub fn version_name(id: &str, version: u64) -> String {
    format!("{id}@{version}")
}

/// Whether `name` is the name of a version directory of template `id`,
/// `<id>@<version>`: what a peer sends when it exports a template, checked before any
/// path is built from it.
pub fn check_version_name(id: &str, name: &str) -> Result<(), String> {
    check_template_id(id)?;
    let version = name.strip_prefix(id).and_then(|v| v.strip_prefix('@'));
    match version
        .filter(|v| !v.is_empty() && v.len() <= 20 && v.bytes().all(|b| b.is_ascii_digit()))
    {
        Some(_) => Ok(()),
        None => Err(format!(
            "`{}` is not a version of template `{id}`",
            name.escape_debug()
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ids_and_version_names_that_could_leave_the_tier_are_refused() {
        for ok in ["room", "a", "A-b_9", &"x".repeat(64)] {
            assert!(check_template_id(ok).is_ok(), "{ok}");
        }
        for bad in [
            "",
            "..",
            "a/b",
            "a b",
            "é",
            "a\0",
            &"x".repeat(65),
            ".hidden",
            "a@1",
        ] {
            assert!(check_template_id(bad).is_err(), "{bad:?}");
        }
        assert!(check_version_name("room", "room@1795898770029905").is_ok());
        for bad in [
            "room",
            "room@",
            "room@x",
            "room@1/..",
            "room@-1",
            "../room@1",
            "room@1@2",
            "lobby@1",
            "roomy@1",
            "room@123456789012345678901",
        ] {
            assert!(check_version_name("room", bad).is_err(), "{bad:?}");
        }
        assert!(check_version_name("../etc", "../etc@1").is_err());
    }
}
