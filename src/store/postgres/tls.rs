//! TLS to PostgreSQL from the URL, as libpq reads it: `sslmode` and `sslrootcert` are taken out
//! of the URL (tokio-postgres knows neither `verify-ca`, `verify-full` nor `sslrootcert`) and
//! become a rustls connector (feature `postgres-tls`).
//!
//! Every mode that encrypts also verifies the server's certificate — against `sslrootcert`, else
//! the platform's roots: `require` and `verify-ca` check its chain, `verify-full` its name as
//! well. (libpq's `require` does not verify; a client that encrypts to an unknown party gains
//! little, so here it does.) `prefer` encrypts when the server offers it; `disable`, or no
//! `sslmode`, connects in plain text.

use crate::error::{ConfigError, ConfigErrorKind};

/// How a URL asks to connect.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Mode {
    Disable,
    Prefer,
    Require,
    VerifyCa,
    VerifyFull,
}

/// The TLS parameters of a URL, and the URL without them.
pub(super) struct Split {
    pub(super) url: String,
    pub(super) mode: Mode,
    pub(super) root_cert: Option<String>,
}

impl std::fmt::Debug for Split {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // the URL may carry a password: it shows redacted
        f.debug_struct("Split")
            .field("url", &crate::store::Redacted(&self.url))
            .field("mode", &self.mode)
            .field("root_cert", &self.root_cert)
            .finish()
    }
}

/// Takes `sslmode` and `sslrootcert` out of `url` (a `postgres://` URL; a `key=value` string is
/// left to tokio-postgres, which reads `sslmode=disable|prefer|require` itself).
pub(super) fn split(url: &str) -> Result<Split, ConfigError> {
    let plain = |url: &str| Split {
        url: url.to_owned(),
        mode: Mode::Disable,
        root_cert: None,
    };
    let Some((base, query)) = url.split_once('?').filter(|_| url.contains("://")) else {
        return Ok(plain(url));
    };
    let (mut mode, mut root_cert, mut kept) = (Mode::Disable, None, Vec::new());
    for pair in query.split('&').filter(|p| !p.is_empty()) {
        let (key, value) = pair.split_once('=').unwrap_or((pair, ""));
        match key {
            "sslmode" => mode = parse_mode(value)?,
            "sslrootcert" => root_cert = Some(decoded(value)),
            _ => kept.push(pair),
        }
    }
    let url = if kept.is_empty() {
        base.to_owned()
    } else {
        format!("{base}?{}", kept.join("&"))
    };
    Ok(Split {
        url,
        mode,
        root_cert,
    })
}

fn parse_mode(value: &str) -> Result<Mode, ConfigError> {
    Ok(match value {
        "disable" => Mode::Disable,
        "allow" | "prefer" => Mode::Prefer,
        "require" => Mode::Require,
        "verify-ca" => Mode::VerifyCa,
        "verify-full" => Mode::VerifyFull,
        other => {
            return Err(ConfigError::new(
                ConfigErrorKind::Store,
                format!(
                    "invalid PostgreSQL URL: sslmode={other}: expected disable, prefer, require, \
                     verify-ca or verify-full"
                ),
            ));
        }
    })
}

/// A percent-encoded query value (a path, say), decoded.
fn decoded(value: &str) -> String {
    let bytes = value.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        let hex = |b: u8| char::from(b).to_digit(16);
        match (
            bytes[i],
            bytes.get(i + 1).copied(),
            bytes.get(i + 2).copied(),
        ) {
            (b'%', Some(h), Some(l)) if hex(h).is_some() && hex(l).is_some() => {
                let (h, l) = (hex(h).unwrap_or(0), hex(l).unwrap_or(0));
                out.push(u8::try_from(h * 16 + l).unwrap_or(b'?'));
                i += 3;
            }
            (b'+', _, _) => {
                out.push(b' ');
                i += 1;
            }
            (b, _, _) => {
                out.push(b);
                i += 1;
            }
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}

#[cfg(feature = "postgres-tls")]
pub(super) use connector::{Connector, connector};

#[cfg(feature = "postgres-tls")]
mod connector {
    //! A rustls connector for tokio-postgres.

    use std::future::Future;
    use std::io;
    use std::pin::Pin;
    use std::sync::Arc;
    use std::task::{Context, Poll};

    use rustls::client::WebPkiServerVerifier;
    use rustls::client::danger::{HandshakeSignatureValid, ServerCertVerified, ServerCertVerifier};
    use rustls::pki_types::pem::PemObject;
    use rustls::pki_types::{CertificateDer, ServerName, UnixTime};
    use rustls::{DigitallySignedStruct, RootCertStore, SignatureScheme};
    use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
    use tokio_postgres::tls::{ChannelBinding, MakeTlsConnect, TlsConnect, TlsStream};

    use super::Mode;
    use crate::error::{ConfigError, ConfigErrorKind};

    /// Makes a TLS connection per PostgreSQL connection.
    #[derive(Clone)]
    pub(crate) struct Connector(Arc<rustls::ClientConfig>);

    impl std::fmt::Debug for Connector {
        fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            f.write_str("Connector")
        }
    }

    /// The connector for `mode`, trusting `root_cert` (a PEM file), else the platform's roots.
    pub(crate) fn connector(mode: Mode, root_cert: Option<&str>) -> Result<Connector, ConfigError> {
        let config_error = |message: String| ConfigError::new(ConfigErrorKind::Store, message);
        let mut roots = RootCertStore::empty();
        match root_cert {
            Some(path) => {
                let certs = CertificateDer::pem_file_iter(path)
                    .and_then(|certs| certs.collect::<Result<Vec<_>, _>>())
                    .map_err(|e| config_error(format!("sslrootcert {path:?}: {e}")))?;
                let (added, _) = roots.add_parsable_certificates(certs);
                if added == 0 {
                    return Err(config_error(format!(
                        "sslrootcert {path:?}: no certificate"
                    )));
                }
            }
            None => {
                let found = rustls_native_certs::load_native_certs();
                roots.add_parsable_certificates(found.certs);
            }
        }
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let verifier =
            WebPkiServerVerifier::builder_with_provider(Arc::new(roots), Arc::clone(&provider))
                .build()
                .map_err(|e| config_error(format!("TLS to PostgreSQL: {e}")))?;
        let verifier: Arc<dyn ServerCertVerifier> = if mode == Mode::VerifyFull {
            verifier
        } else {
            Arc::new(ChainOnly(verifier))
        };
        let config = rustls::ClientConfig::builder_with_provider(provider)
            .with_safe_default_protocol_versions()
            .map_err(|e| config_error(format!("TLS to PostgreSQL: {e}")))?
            .dangerous()
            .with_custom_certificate_verifier(verifier)
            .with_no_client_auth();
        Ok(Connector(Arc::new(config)))
    }

    /// Verifies the chain but not the name (`require`, `verify-ca`).
    #[derive(Debug)]
    struct ChainOnly(Arc<WebPkiServerVerifier>);

    impl ServerCertVerifier for ChainOnly {
        fn verify_server_cert(
            &self,
            end_entity: &CertificateDer<'_>,
            intermediates: &[CertificateDer<'_>],
            server_name: &ServerName<'_>,
            ocsp: &[u8],
            now: UnixTime,
        ) -> Result<ServerCertVerified, rustls::Error> {
            match self
                .0
                .verify_server_cert(end_entity, intermediates, server_name, ocsp, now)
            {
                Err(rustls::Error::InvalidCertificate(
                    rustls::CertificateError::NotValidForName,
                ))
                | Err(rustls::Error::InvalidCertificate(
                    rustls::CertificateError::NotValidForNameContext { .. },
                )) => Ok(ServerCertVerified::assertion()),
                other => other,
            }
        }

        fn verify_tls12_signature(
            &self,
            message: &[u8],
            cert: &CertificateDer<'_>,
            dss: &DigitallySignedStruct,
        ) -> Result<HandshakeSignatureValid, rustls::Error> {
            self.0.verify_tls12_signature(message, cert, dss)
        }

        fn verify_tls13_signature(
            &self,
            message: &[u8],
            cert: &CertificateDer<'_>,
            dss: &DigitallySignedStruct,
        ) -> Result<HandshakeSignatureValid, rustls::Error> {
            self.0.verify_tls13_signature(message, cert, dss)
        }

        fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
            self.0.supported_verify_schemes()
        }
    }

    impl<S> MakeTlsConnect<S> for Connector
    where
        S: AsyncRead + AsyncWrite + Unpin + Send + 'static,
    {
        type Stream = Stream<S>;
        type TlsConnect = Connect;
        type Error = rustls::pki_types::InvalidDnsNameError;

        fn make_tls_connect(&mut self, domain: &str) -> Result<Connect, Self::Error> {
            let name = ServerName::try_from(domain)?.to_owned();
            Ok(Connect {
                name,
                config: Arc::clone(&self.0),
            })
        }
    }

    /// One connection's handshake.
    pub(crate) struct Connect {
        name: ServerName<'static>,
        config: Arc<rustls::ClientConfig>,
    }

    impl<S> TlsConnect<S> for Connect
    where
        S: AsyncRead + AsyncWrite + Unpin + Send + 'static,
    {
        type Stream = Stream<S>;
        type Error = io::Error;
        type Future = Pin<Box<dyn Future<Output = io::Result<Stream<S>>> + Send>>;

        fn connect(self, stream: S) -> Self::Future {
            let connector = tokio_rustls::TlsConnector::from(self.config);
            Box::pin(async move { connector.connect(self.name, stream).await.map(Stream) })
        }
    }

    /// A TLS connection to PostgreSQL.
    pub(crate) struct Stream<S>(tokio_rustls::client::TlsStream<S>);

    impl<S: AsyncRead + AsyncWrite + Unpin> AsyncRead for Stream<S> {
        fn poll_read(
            mut self: Pin<&mut Self>,
            cx: &mut Context<'_>,
            buf: &mut ReadBuf<'_>,
        ) -> Poll<io::Result<()>> {
            Pin::new(&mut self.0).poll_read(cx, buf)
        }
    }

    impl<S: AsyncRead + AsyncWrite + Unpin> AsyncWrite for Stream<S> {
        fn poll_write(
            mut self: Pin<&mut Self>,
            cx: &mut Context<'_>,
            buf: &[u8],
        ) -> Poll<io::Result<usize>> {
            Pin::new(&mut self.0).poll_write(cx, buf)
        }

        fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
            Pin::new(&mut self.0).poll_flush(cx)
        }

        fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
            Pin::new(&mut self.0).poll_shutdown(cx)
        }
    }

    impl<S: AsyncRead + AsyncWrite + Unpin> TlsStream for Stream<S> {
        fn channel_binding(&self) -> ChannelBinding {
            ChannelBinding::none()
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tls_parameters_leave_the_url_and_the_rest_stays() {
        let split = split(
            "postgres://app:pw@db:5432/app?sslmode=verify-full&application_name=x&sslrootcert=%2Fetc%2Fca.pem",
        )
        .unwrap();
        assert_eq!(
            split.url,
            "postgres://app:pw@db:5432/app?application_name=x"
        );
        assert_eq!(split.mode, Mode::VerifyFull);
        assert_eq!(split.root_cert.as_deref(), Some("/etc/ca.pem"));
        let plain = super::split("postgres://db/app").unwrap();
        assert_eq!(
            (plain.url.as_str(), plain.mode),
            ("postgres://db/app", Mode::Disable)
        );
        let error = super::split("postgres://db/app?sslmode=always").unwrap_err();
        assert!(error.to_string().contains("sslmode=always"), "{error}");
    }
}
