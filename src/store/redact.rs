//! [`redact_connection_string`]: a connection string as it may be shown — in `Debug`, logs,
//! errors and command output — with every password replaced by `***`.

use std::fmt;

/// What a password is replaced with.
const MASK: &str = "***";

/// `text`, a store's connection string (or a list of them), with every password replaced by
/// `***`: what may be shown in logs, errors, `Debug` output and command output.
///
/// It reads every form the crate's stores accept:
///
/// - a URL's user info — `redis://user:pass@host`, `rediss://`, `valkey://`, `valkeys://`,
///   `postgres://`, `postgresql://` — keeping the user and the host; a user info without `:`
///   counts as a password, except in a PostgreSQL URL, where it names the user;
/// - a password in a URL's query or fragment: `redis+unix:///run/redis.sock?pass=..`,
///   `unix:///path?pass=..`, `postgres://host/db?password=..` (any parameter whose name holds
///   `pass`, `pwd`, `secret` or `token`, in any case);
/// - PostgreSQL's `key=value` strings (`host=db password=secret`, `password = 'se cret'` quoted
///   with `\'` escapes; `sslpassword` alike);
/// - several URLs separated by commas or white space (the nodes of a Redis Cluster, sentinels).
///
/// It redacts conservatively: a URL with an `@` anywhere keeps nothing before its last `@`
/// (a password holding `/`, `?` or `#` unencoded cannot leak through a wrongly found host),
/// and a `key=value` string that stops parsing keeps nothing from there on. Text of no
/// recognisable form comes back as it is, unless it holds an `@`: then only what follows the
/// last `@` is kept.
///
/// ```
/// use tollgate::store::redact_connection_string as redact;
///
/// assert_eq!(redact("redis://app:s3cret@cache:6379/0"), "redis://app:***@cache:6379/0");
/// assert_eq!(redact("redis://:s3cret@cache"), "redis://:***@cache");
/// assert_eq!(
///     redact("redis+unix:///run/redis.sock?db=1&pass=s3cret"),
///     "redis+unix:///run/redis.sock?db=1&pass=***"
/// );
/// assert_eq!(
///     redact("postgres://app@db/app?password=s3cret&sslmode=require"),
///     "postgres://app@db/app?password=***&sslmode=require"
/// );
/// assert_eq!(
///     redact("host=db user=app password='se \\'cret' dbname=app"),
///     "host=db user=app password=*** dbname=app"
/// );
/// assert_eq!(
///     redact("redis://:a@n1:7000,redis://:b@n2:7001"),
///     "redis://:***@n1:7000,redis://:***@n2:7001"
/// );
/// // nothing to hide: as it was
/// assert_eq!(redact("redis://127.0.0.1:6379/"), "redis://127.0.0.1:6379/");
/// ```
pub fn redact_connection_string(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    let starts = url_starts(text);
    let Some(&first) = starts.first() else {
        return redact_plain(text);
    };
    // what comes before the first URL has no scheme of its own
    if first > 0 {
        out.push_str(&redact_plain(&text[..first]));
    }
    for (i, &start) in starts.iter().enumerate() {
        let end = starts.get(i + 1).copied().unwrap_or(text.len());
        out.push_str(&redact_url(&text[start..end]));
    }
    out
}

/// A connection string that prints redacted: as a quoted string under `Debug` (for a field of a
/// builder's `Debug`), as it is under `Display` (for a log field).
#[cfg_attr(not(any(feature = "redis", feature = "postgres")), allow(dead_code))]
pub(crate) struct Redacted<'a>(pub(crate) &'a str);

impl fmt::Debug for Redacted<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Debug::fmt(&redact_connection_string(self.0), f)
    }
}

impl fmt::Display for Redacted<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&redact_connection_string(self.0))
    }
}

/// `urls`, each redacted: for the `Debug` of a list of nodes or sentinels.
#[cfg_attr(not(feature = "redis"), allow(dead_code))]
pub(crate) fn redacted_list(urls: &[String]) -> Vec<Redacted<'_>> {
    urls.iter().map(|url| Redacted(url)).collect()
}

/// Where each URL of `text` begins: at a scheme (`letters://`) at the start of `text` or after a
/// comma, a semicolon or white space.
fn url_starts(text: &str) -> Vec<usize> {
    let bytes = text.as_bytes();
    let mut starts = Vec::new();
    let mut i = 0;
    while i < bytes.len() {
        let at_boundary =
            i == 0 || matches!(bytes[i - 1], b',' | b';') || bytes[i - 1].is_ascii_whitespace();
        if at_boundary && bytes[i].is_ascii_alphabetic() && scheme_len(&bytes[i..]).is_some() {
            starts.push(i);
        }
        i += 1;
    }
    starts
}

/// The length of `bytes`' leading `scheme://`, if it starts with one.
fn scheme_len(bytes: &[u8]) -> Option<usize> {
    let name = bytes
        .iter()
        .take_while(|b| b.is_ascii_alphanumeric() || matches!(b, b'+' | b'-' | b'.'))
        .count();
    (name > 0 && bytes[name..].starts_with(b"://")).then_some(name + 3)
}

/// One URL (and whatever follows it up to the next URL), redacted.
fn redact_url(url: &str) -> String {
    let Some(head) = scheme_len(url.as_bytes()) else {
        return redact_plain(url);
    };
    let (scheme, rest) = url.split_at(head);
    let mut out = String::with_capacity(url.len());
    out.push_str(scheme);
    let rest = match rest.rfind('@') {
        Some(at) => {
            let (user_info, after) = (&rest[..at], &rest[at..]);
            let postgres = scheme.to_ascii_lowercase().starts_with("postgres");
            match user_info.split_once(':') {
                Some((user, _password)) => {
                    out.push_str(user);
                    out.push(':');
                    out.push_str(MASK);
                }
                None if postgres || user_info.is_empty() => out.push_str(user_info),
                None => out.push_str(MASK),
            }
            after
        }
        None => rest,
    };
    out.push_str(&redact_parameters(rest));
    out
}

/// The part of a URL after its user info, with the values of secret query (or fragment)
/// parameters replaced.
fn redact_parameters(rest: &str) -> String {
    let Some(open) = rest.find(['?', '#']) else {
        return rest.to_owned();
    };
    let mut out = String::with_capacity(rest.len());
    out.push_str(&rest[..=open]);
    let params = &rest[open + 1..];
    let mut start = 0;
    for (i, c) in params.char_indices().chain([(params.len(), '&')]) {
        if !matches!(c, '&' | ';' | '?' | '#') {
            continue;
        }
        let pair = &params[start..i];
        match pair.split_once('=') {
            Some((key, _)) if is_secret(key) => {
                out.push_str(key);
                out.push('=');
                out.push_str(MASK);
            }
            _ => out.push_str(pair),
        }
        if i < params.len() {
            out.push(c);
        }
        start = i + c.len_utf8();
    }
    out
}

/// Whether a parameter named `key` holds a secret.
fn is_secret(key: &str) -> bool {
    let key = key.trim().to_ascii_lowercase();
    ["pass", "pwd", "secret", "token"]
        .iter()
        .any(|word| key.contains(word))
}

/// Text without a scheme: a `key=value` string, or anything else.
fn redact_plain(text: &str) -> String {
    if text.contains('=') {
        return redact_key_values(text);
    }
    match text.rfind('@') {
        Some(at) => format!("{MASK}{}", &text[at..]),
        None => text.to_owned(),
    }
}

/// A `key=value` connection string (libpq's syntax) with secret values replaced by `***`; from
/// where it stops parsing, `***` only.
fn redact_key_values(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    let mut rest = text;
    loop {
        let trimmed = rest.trim_start();
        out.push_str(&rest[..rest.len() - trimmed.len()]);
        if trimmed.is_empty() {
            return out;
        }
        match key_value(trimmed) {
            Some((key, between, value_len)) => {
                out.push_str(key);
                out.push_str(between);
                if is_secret(key) {
                    out.push_str(MASK);
                } else {
                    let value_start = key.len() + between.len();
                    out.push_str(&trimmed[value_start..value_start + value_len]);
                }
                rest = &trimmed[key.len() + between.len() + value_len..];
            }
            None => {
                out.push_str(MASK);
                return out;
            }
        }
    }
}

/// The first `key = value` pair of `text`: the key, what separates it from the value (`=` and
/// white space), and the value's length (quoted or not); `None` when it is not one.
fn key_value(text: &str) -> Option<(&str, &str, usize)> {
    let key_len = text.find(|c: char| c == '=' || c.is_whitespace())?;
    let key = &text[..key_len];
    let after_key = &text[key_len..];
    let eq = after_key.trim_start();
    let eq = eq.strip_prefix('=')?;
    let value = eq.trim_start();
    let between = &after_key[..after_key.len() - value.len()];
    if key.is_empty() {
        return None;
    }
    Some((key, between, value_len(value)?))
}

/// The length of the value at the start of `text`: quoted (`'…'`, with `\` escapes) or up to
/// white space (`\` escapes too); `None` when a quote is not closed.
fn value_len(text: &str) -> Option<usize> {
    let quoted = text.starts_with('\'');
    let mut chars = text.char_indices().skip(usize::from(quoted));
    while let Some((i, c)) = chars.next() {
        match c {
            '\\' => {
                chars.next()?;
            }
            '\'' if quoted => return Some(i + 1),
            c if c.is_whitespace() && !quoted => return Some(i),
            _ => {}
        }
    }
    (!quoted).then_some(text.len())
}

#[cfg(test)]
mod tests {
    use super::redact_connection_string as redact;

    const SECRET: &str = "Pa55w0rd";

    #[test]
    fn every_form_loses_its_password() {
        let cases = [
            ("redis://u:Pa55w0rd@h:6379/0", "redis://u:***@h:6379/0"),
            ("redis://:Pa55w0rd@h", "redis://:***@h"),
            ("redis://Pa55w0rd@h", "redis://***@h"),
            (
                "rediss://u:Pa55w0rd@h:6380/#insecure",
                "rediss://u:***@h:6380/#insecure",
            ),
            ("valkey://:Pa55w0rd@h", "valkey://:***@h"),
            ("valkeys://u:Pa55w0rd@h", "valkeys://u:***@h"),
            (
                "redis+unix:///tmp/r.sock?pass=Pa55w0rd",
                "redis+unix:///tmp/r.sock?pass=***",
            ),
            (
                "unix:///tmp/r.sock?db=2&pass=Pa55w0rd&user=u",
                "unix:///tmp/r.sock?db=2&pass=***&user=u",
            ),
            (
                "unix:///tmp/r.sock?password=Pa55w0rd",
                "unix:///tmp/r.sock?password=***",
            ),
            (
                "postgres://app:Pa55w0rd@db:5432/app",
                "postgres://app:***@db:5432/app",
            ),
            ("postgresql://app@db/app", "postgresql://app@db/app"),
            (
                "postgres://db/app?password=Pa55w0rd",
                "postgres://db/app?password=***",
            ),
            (
                "POSTGRESQL://app:Pa55w0rd@h1:5432,h2:5433/app?sslmode=require",
                "POSTGRESQL://app:***@h1:5432,h2:5433/app?sslmode=require",
            ),
            ("host=db password=Pa55w0rd", "host=db password=***"),
            (
                "host=db password = Pa55w0rd user=a",
                "host=db password = *** user=a",
            ),
            ("password='Pa55 w0rd' host=db", "password=*** host=db"),
            (r"password='Pa55\'w0rd' host=db", "password=*** host=db"),
            ("host=db sslpassword=Pa55w0rd", "host=db sslpassword=***"),
            ("host=db PASSWORD=Pa55w0rd", "host=db PASSWORD=***"),
        ];
        for (given, shown) in cases {
            assert_eq!(redact(given), shown, "{given}");
        }
    }

    #[test]
    fn lists_lose_every_password() {
        assert_eq!(
            redact("redis://:Pa55w0rd@a:1 redis://u:Pa55w0rd@b:2/, rediss://:Pa55w0rd@c"),
            "redis://:***@a:1 redis://u:***@b:2/, rediss://:***@c"
        );
    }

    #[test]
    fn what_cannot_be_read_is_not_repeated() {
        for given in [
            "redis://:Pa55w0rd/with/slash@h:6379",
            "redis://:Pa55#w0rd@h",
            "redis://:Pa55?w0rd@h",
            "host=db password='Pa55w0rd",
            "host=db Pa55w0rd",
            "u:Pa55w0rd@h:6379",
            "password=Pa55w0rd\\",
            "redis://:Pa55w0rd@h,redis://:Pa55w0rd@",
            "host=db =Pa55w0rd",
        ] {
            let shown = redact(given);
            assert!(!shown.contains("Pa55"), "{given} -> {shown}");
        }
        assert_eq!(redact("localhost:6379"), "localhost:6379");
        assert_eq!(redact(""), "");
    }

    #[test]
    fn never_panics_on_odd_text() {
        for given in [
            "://",
            "=",
            "'",
            "a=b\\",
            "é=ü pass='é",
            "x://@",
            "?pass=",
            "a://b?#&=;",
        ] {
            let _ = redact(given);
        }
        assert!(!redact(&format!("x://y?token={SECRET}")).contains(SECRET));
    }
}
