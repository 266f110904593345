//! Where a node listens: a TCP address or a Unix socket path.

use std::fmt;
use std::path::PathBuf;
use std::str::FromStr;

use kvplane_protocol::KvError;

/// A node's address. Parsed from `HOST:PORT`, `tcp://HOST:PORT`,
/// `unix:///path/to.sock` or `unix:relative.sock`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Endpoint {
    Tcp(String),
    Unix(PathBuf),
}

impl FromStr for Endpoint {
    type Err = KvError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        if let Some(path) = s.strip_prefix("unix://").or_else(|| s.strip_prefix("unix:")) {
            if path.is_empty() {
                return Err(KvError::Invalid(format!("endpoint {s:?}: a unix endpoint needs a socket path")));
            }
            return Ok(Endpoint::Unix(PathBuf::from(path)));
        }
        let addr = s.strip_prefix("tcp://").unwrap_or(s);
        match addr.rsplit_once(':') {
            Some((host, port)) if !host.is_empty() && port.parse::<u16>().is_ok() => Ok(Endpoint::Tcp(addr.to_string())),
            _ => Err(KvError::Invalid(format!("endpoint {s:?}: expected HOST:PORT, tcp://HOST:PORT or unix:///path/to.sock"))),
        }
    }
}

impl fmt::Display for Endpoint {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Endpoint::Tcp(a) => f.write_str(a),
            Endpoint::Unix(p) => write!(f, "unix://{}", p.display()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_tcp_and_unix_forms_and_names_a_bad_one() {
        assert_eq!("127.0.0.1:9600".parse::<Endpoint>(), Ok(Endpoint::Tcp("127.0.0.1:9600".into())));
        assert_eq!("tcp://localhost:1".parse::<Endpoint>(), Ok(Endpoint::Tcp("localhost:1".into())));
        assert_eq!("unix:///run/kv.sock".parse::<Endpoint>(), Ok(Endpoint::Unix("/run/kv.sock".into())));
        let err = "localhost".parse::<Endpoint>().expect_err("no port");
        assert!(err.to_string().contains("\"localhost\""), "{err}");
    }
}
