//! What the command never prints as it was given: a caller's key (an API key, say) shows masked,
//! and a store URL without its password (`tollgate::store::redact_connection_string`), in its
//! output, its errors and clap's own errors about the command line.

use std::ffi::OsString;

use tollgate::store::redact_connection_string;

/// The flags whose value names a caller (`NAME=VALUE`, `DOMAIN=VALUE`), or carries a request
/// header to a service (`-H 'name: value'`): their values show masked.
const KEYED_FLAGS: [&str; 5] = [
    "--header",
    "--key-fn",
    "--scope-header",
    "--scope-key-fn",
    "-H",
];

/// The flags whose whole value names a caller (`--extension VALUE`): it shows masked.
const VALUE_FLAGS: [&str; 2] = ["--extension", "--scope-extension"];

/// A caller's key as the command shows it: its first characters — at most 4, and at most a
/// third of it — then `…`, so that `sk_live_51Hx…` shows as `sk_l…` and `alice` as `a…`. The
/// store key beside it (a digest) tells two callers apart.
pub(crate) fn mask(key: &str) -> String {
    let shown = (key.chars().count() / 3).min(4);
    let prefix: String = key.chars().take(shown).collect();
    format!("{prefix}…")
}

/// A header that names a caller (`--header`, `--scope-header`), as `Debug` shows it: its name
/// and its value masked.
pub(crate) fn masked_header(
    header: Option<&(http::HeaderName, http::HeaderValue)>,
) -> Option<String> {
    header.map(|(name, value)| {
        format!(
            "{name}={}",
            mask(&String::from_utf8_lossy(value.as_bytes()))
        )
    })
}

/// A `DOMAIN=VALUE` that names a caller (`--key-fn`, `--scope-key-fn`), as `Debug` shows it.
pub(crate) fn masked_pair(pair: Option<&(String, String)>) -> Option<String> {
    pair.map(|(domain, value)| format!("{domain}={}", mask(value)))
}

/// A value that names a caller by itself (`--extension`, `--scope-extension`), as `Debug` shows
/// it.
pub(crate) fn masked_value(value: Option<&str>) -> Option<String> {
    value.map(mask)
}

/// `NAME=VALUE` (or `name: value`) with the value masked; all of it masked when it has no
/// separator.
fn mask_pair(text: &str) -> String {
    match text.find(['=', ':']) {
        Some(at) => {
            let (name, value) = text.split_at(at + 1);
            format!("{name}{}", mask(value.trim_start()))
        }
        None => mask(text),
    }
}

/// `message`, an error about the command line `args`, with every argument that names a caller
/// masked and every store URL redacted wherever the message repeats it — as given, or with the
/// control characters clap leaves out.
pub(crate) fn hide_arguments(message: &str, args: &[OsString]) -> String {
    let args: Vec<String> = args
        .iter()
        .map(|arg| arg.to_string_lossy().into_owned())
        .collect();
    let mut hidden = message.to_owned();
    let mut replace = |given: &str, shown: &str| {
        let printable: String = given.chars().filter(|c| !c.is_control()).collect();
        for given in [given, printable.as_str()] {
            if !given.is_empty() && given != shown {
                hidden = hidden.replace(given, shown);
            }
        }
    };
    for (i, arg) in args.iter().enumerate() {
        let whole_value = (i > 0 && VALUE_FLAGS.contains(&args[i - 1].as_str()))
            .then_some(arg.as_str())
            .or_else(|| {
                VALUE_FLAGS
                    .iter()
                    .find_map(|flag| arg.strip_prefix(flag)?.strip_prefix('='))
            });
        if let Some(value) = whole_value {
            hide_value(value, &mut replace);
            continue;
        }
        let keyed_value = i > 0 && KEYED_FLAGS.contains(&args[i - 1].as_str());
        let inline = KEYED_FLAGS
            .iter()
            .find_map(|flag| arg.strip_prefix(flag)?.strip_prefix('='));
        match (keyed_value, inline) {
            (true, _) => hide_pair(arg, &mut replace),
            (false, Some(value)) => hide_pair(value, &mut replace),
            (false, None) => {
                replace(arg, &redact_connection_string(arg));
                if let Some((_, value)) = arg.split_once('=') {
                    replace(value, &redact_connection_string(value));
                }
            }
        }
    }
    hidden
}

/// Hides `pair`, a caller named on the command line, through `replace`: the pair, and its value
/// alone when it is long enough not to stand for other words of the message.
fn hide_pair(pair: &str, replace: &mut impl FnMut(&str, &str)) {
    replace(pair, &mask_pair(pair));
    let value = pair
        .split_once(['=', ':'])
        .map_or(pair, |(_, value)| value)
        .trim();
    if value.chars().count() >= 8 {
        replace(value, &mask(value));
    }
}

/// Hides `value`, a caller's value named on the command line by itself, through `replace`: as
/// clap quotes it, and anywhere when it is long enough not to stand for other words of the
/// message.
fn hide_value(value: &str, replace: &mut impl FnMut(&str, &str)) {
    if value.is_empty() {
        return;
    }
    replace(&format!("'{value}'"), &format!("'{}'", mask(value)));
    if value.trim().chars().count() >= 8 {
        replace(value, &mask(value));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_show_a_prefix_only() {
        assert_eq!(mask("sk_live_51HxQ2example"), "sk_l…");
        assert_eq!(mask("alice"), "a…");
        assert_eq!(mask("ab"), "…");
        assert_eq!(mask(""), "…");
        assert_eq!(
            mask_pair("x-api-key=sk_live_51HxQ2example"),
            "x-api-key=sk_l…"
        );
        assert_eq!(
            mask_pair("authorization: Bearer abcdefghijkl"),
            "authorization:Bear…"
        );
    }

    #[test]
    fn errors_repeat_no_argument_that_holds_a_secret() {
        let args: Vec<OsString> = [
            "tollgate",
            "inspect",
            "--header",
            "x-api-key=sk_live_51HxQ2example",
            "--store=redis://:hunter22@h:6379/",
            "--key-fn=tenant=acme-secret-tenant",
            "--extension",
            "acme",
            "--scope-extension=globex-secret-corp",
        ]
        .map(OsString::from)
        .to_vec();
        let message = "error: invalid value 'x-api-key=sk_live_51HxQ2example' for '--header': \
                       redis://:hunter22@h:6379/ 'tenant=acme-secret-tenant' \
                       invalid value 'acme' for '--extension <VALUE>' globex-secret-corp";
        let hidden = hide_arguments(message, &args);
        assert!(!hidden.contains("sk_live_51HxQ2example"), "{hidden}");
        assert!(!hidden.contains("hunter22"), "{hidden}");
        assert!(!hidden.contains("acme-secret-tenant"), "{hidden}");
        assert!(hidden.contains("redis://:***@h:6379/"), "{hidden}");
        assert!(
            hidden.contains("value 'a…' for '--extension <VALUE>'"),
            "{hidden}"
        );
        assert!(!hidden.contains("globex-secret-corp"), "{hidden}");
    }
}
