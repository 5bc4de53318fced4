//! A Redis URL checked before redis-rs reads it, so that a malformed one is refused with what is
//! wrong in it: redis-rs says only that it "did not parse". The password is never repeated.

/// The schemes redis-rs connects with: TCP, TLS, and Unix sockets.
const TCP: [&str; 2] = ["redis", "valkey"];
const TLS: [&str; 2] = ["rediss", "valkeys"];
const UNIX: [&str; 3] = ["unix", "redis+unix", "valkey+unix"];

/// What is wrong with `url` as the address of a Redis server, if anything.
pub(super) fn problem(url: &str) -> Option<String> {
    let tls = cfg!(any(feature = "tls-rustls", feature = "tls-native-tls"));
    problem_in(url, tls)
}

/// What is wrong with `url` for a build with (`tls`) or without a TLS feature.
fn problem_in(url: &str, tls: bool) -> Option<String> {
    let Some((scheme, _)) = url.split_once("://") else {
        return Some(
            "it has no scheme: write redis://host:6379/0 (rediss:// for TLS, \
             redis+unix:///path for a socket)"
                .to_owned(),
        );
    };
    let scheme = scheme.to_ascii_lowercase();
    // what precedes `://` is repeated only when it is a scheme: else it may be a password
    if !scheme.starts_with(|c: char| c.is_ascii_alphabetic())
        || !scheme
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '+' | '-' | '.'))
    {
        return Some(
            "it does not start with a scheme: write redis://host:6379/0 (rediss:// for TLS, \
             redis+unix:///path for a socket)"
                .to_owned(),
        );
    }
    if UNIX.contains(&scheme.as_str()) {
        return None;
    }
    if !TCP.contains(&scheme.as_str()) && !TLS.contains(&scheme.as_str()) {
        return Some(format!(
            "the scheme {scheme}:// is not Redis's: use redis:// (rediss:// for TLS, \
             redis+unix:// for a socket)"
        ));
    }
    if TLS.contains(&scheme.as_str()) && !tls {
        return Some(format!(
            "{scheme}:// needs TLS: enable the tollgate feature `tls-rustls` or `tls-native-tls`"
        ));
    }
    let parsed = match url::Url::parse(url) {
        Ok(parsed) => parsed,
        Err(url::ParseError::InvalidPort) => {
            return Some("the port is not a number from 1 to 65535".to_owned());
        }
        Err(e) => return Some(format!("{e}")),
    };
    if parsed.host_str().is_none_or(str::is_empty) {
        return Some("it names no host: write redis://host:6379/0".to_owned());
    }
    let db = parsed.path().trim_start_matches('/');
    if !db.is_empty() && db.parse::<u16>().is_err() {
        return Some(format!(
            "the database {db:?} after the host is not a number (redis://host:6379/0)"
        ));
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_malformed_url_names_what_is_wrong() {
        let cases = [
            ("localhost:6379", "no scheme"),
            ("http://localhost:6379", "the scheme http:// is not Redis's"),
            ("redis://localhost:notaport", "the port is not a number"),
            ("redis://localhost:99999", "the port is not a number"),
            ("redis://:secret@:6379", "empty host"),
            ("redis://localhost:6379/db", "the database \"db\""),
            ("password=secret://h", "does not start with a scheme"),
        ];
        for (url, says) in cases {
            let problem = problem(url).unwrap_or_default();
            assert!(problem.contains(says), "{url}: {problem}");
            assert!(!problem.contains("secret"), "{url}: {problem}");
        }
        for url in [
            "redis://localhost",
            "redis://user:pw@10.0.0.1:6380/3",
            "valkey://[::1]:6379",
            "redis+unix:///run/redis.sock",
        ] {
            assert_eq!(problem(url), None, "{url}");
        }
    }

    #[test]
    fn tls_without_a_tls_feature_names_the_features() {
        let problem = problem("rediss://cache.example:6380");
        if cfg!(any(feature = "tls-rustls", feature = "tls-native-tls")) {
            assert_eq!(problem, None);
        } else {
            let problem = problem.unwrap_or_default();
            assert!(
                problem.contains("`tls-rustls` or `tls-native-tls`"),
                "{problem}"
            );
        }
    }
}
