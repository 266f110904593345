//! The declaration's config: the keys of an AIBrix EIC connector config
//! file, plus the driver to open.
//!
//! AIBrix's EIC connector reads a YAML file of `remote_url`,
//! `eic_instance_id`, `eic_thread_num`, `eic_log_dir`, `eic_log_level`,
//! `eic_trans_type`, `eic_kv_ttl`, `eic_kv_ns` and `eic_flag_file`; the same
//! map, pasted into the plugin's `config`, configures `builtin:eic`. Values
//! arrive as strings (a KVCache's plugin config is a string map), so numbers
//! are parsed here and every malformed value is refused naming its key.

use crate::batch::Fail;

/// Every key `builtin:eic` knows, for error messages.
pub const CONFIG_KEYS: &str = "remote_url, eic_instance_id, eic_thread_num, eic_log_dir, eic_log_level, eic_trans_type, \
                               eic_kv_ttl, eic_kv_ns, eic_flag_file, driver, driver.NAME";

/// The prefix of keys passed to the driver's `open` unchanged (prefix cut).
pub const DRIVER_PREFIX: &str = "driver.";

/// EIC's log level when the config names none (AIBrix's default).
pub const DEFAULT_LOG_LEVEL: u32 = 1;
/// EIC's transport type when the config names none (AIBrix's default).
pub const DEFAULT_TRANS_TYPE: u32 = 3;
/// The driver opened when the config names none.
pub const DEFAULT_DRIVER: &str = "eic";

/// The driver config keys `builtin:eic` sets itself from the keys above;
/// a `driver.NAME` key may not set them a second time.
const DRIVER_KEYS: &[&str] = &["endpoint", "instance_id", "thread_num", "log_dir", "log_level", "trans_type", "flag_file"];

/// The parsed config.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Settings {
    /// `remote_url` without its `eic://` scheme: HOST:PORT of the EIC service.
    pub endpoint: String,
    /// `eic_instance_id`: the EIC instance the client joins.
    pub instance_id: String,
    /// `eic_thread_num`: the client's worker threads; none: the SDK's default.
    pub thread_num: Option<u32>,
    /// `eic_log_dir`: where the SDK writes its logs; none: the SDK's default.
    pub log_dir: Option<String>,
    /// `eic_log_level`: the SDK's log level (`eic.LogLevel`), default 1.
    pub log_level: u32,
    /// `eic_trans_type`: the SDK's transport (`eic.TransportType`), default 3.
    pub trans_type: u32,
    /// `eic_kv_ttl` in milliseconds; none (`-1`, the default): values do not
    /// expire. A call's `ttl-ms` overrides it.
    pub ttl_ms: Option<u64>,
    /// `eic_kv_ns`: the namespace of every operation, default "". A call's
    /// `namespace` overrides it.
    pub namespace: String,
    /// `eic_flag_file`: the SDK's gflags file; none: the SDK's default.
    pub flag_file: Option<String>,
    /// `driver`: the name of the declared driver to open, default "eic".
    pub driver: String,
    /// `driver.NAME=VALUE` keys, passed to the driver as `NAME=VALUE`.
    pub driver_extra: Vec<(String, String)>,
}

impl Settings {
    /// Parses the declaration's config; the error names the key at fault.
    pub fn from_config(config: &[(String, String)]) -> Result<Settings, Fail> {
        let mut remote = None;
        let mut instance = None;
        let mut s = Settings {
            endpoint: String::new(),
            instance_id: String::new(),
            thread_num: None,
            log_dir: None,
            log_level: DEFAULT_LOG_LEVEL,
            trans_type: DEFAULT_TRANS_TYPE,
            ttl_ms: None,
            namespace: String::new(),
            flag_file: None,
            driver: DEFAULT_DRIVER.to_owned(),
            driver_extra: Vec::new(),
        };
        let mut seen: Vec<&str> = Vec::new();
        for (name, value) in config {
            let invalid = |why: &str| Fail::Invalid(format!("config {name}={value:?}: {why}"));
            if seen.contains(&name.as_str()) {
                return Err(invalid("given more than once"));
            }
            seen.push(name);
            if value.contains('\0') {
                return Err(invalid("contains a NUL byte"));
            }
            match name.as_str() {
                "remote_url" => {
                    remote = Some(parse_remote_url(value).ok_or_else(|| invalid("expected eic://HOST:PORT (a port in 1..=65535)"))?)
                }
                "eic_instance_id" => {
                    instance = Some(non_empty(value).ok_or_else(|| invalid("must not be empty: the EIC instance to join"))?);
                }
                "eic_thread_num" => {
                    let n = value.trim().parse::<u32>().ok().filter(|n| *n > 0);
                    s.thread_num = Some(n.ok_or_else(|| invalid("expected a number of threads, 1 or more"))?);
                }
                "eic_log_dir" => {
                    s.log_dir = Some(non_empty(value).ok_or_else(|| invalid("must not be empty (omit it for the SDK's default)"))?)
                }
                "eic_log_level" => {
                    s.log_level = value.trim().parse().map_err(|_| invalid("expected EIC's log level, a non-negative integer"))?;
                }
                "eic_trans_type" => {
                    s.trans_type = value.trim().parse().map_err(|_| invalid("expected EIC's transport type, a non-negative integer"))?;
                }
                "eic_kv_ttl" => {
                    s.ttl_ms = parse_ttl_seconds(value)
                        .ok_or_else(|| invalid("expected -1 (no expiry) or a whole number of seconds in 1..=4294967295"))?
                }
                "eic_kv_ns" => s.namespace = value.clone(),
                "eic_flag_file" => {
                    s.flag_file = Some(non_empty(value).ok_or_else(|| invalid("must not be empty (omit it for the SDK's default)"))?)
                }
                "driver" => {
                    s.driver =
                        non_empty(value).ok_or_else(|| invalid("must not be empty: the name of a driver in the declaration's drivers"))?
                }
                _ => match name.strip_prefix(DRIVER_PREFIX) {
                    Some("") => return Err(invalid("names no driver setting after `driver.`")),
                    Some(own) if DRIVER_KEYS.contains(&own) => {
                        return Err(invalid(&format!("`{own}` is set from the EIC keys (remote_url, eic_*), not through `driver.`")));
                    }
                    Some(own) => s.driver_extra.push((own.to_owned(), value.clone())),
                    None => return Err(invalid(&format!("unknown setting (known: {CONFIG_KEYS})"))),
                },
            }
        }
        s.endpoint = remote.ok_or_else(|| Fail::Invalid("config remote_url: required, the EIC service as eic://HOST:PORT".to_owned()))?;
        s.instance_id = instance.ok_or_else(|| Fail::Invalid("config eic_instance_id: required, the EIC instance to join".to_owned()))?;
        Ok(s)
    }

    /// The config of the driver's `open`: the EIC client's init options under
    /// the names an EIC driver takes (docs/plugins.md: `endpoint`,
    /// `instance_id`, `log_level`, `trans_type`, and `thread_num`,
    /// `log_dir`, `flag_file` when set), then the `driver.NAME` keys.
    pub fn driver_config(&self) -> Vec<(String, String)> {
        let mut out = vec![
            ("endpoint".to_owned(), self.endpoint.clone()),
            ("instance_id".to_owned(), self.instance_id.clone()),
            ("log_level".to_owned(), self.log_level.to_string()),
            ("trans_type".to_owned(), self.trans_type.to_string()),
        ];
        if let Some(n) = self.thread_num {
            out.push(("thread_num".to_owned(), n.to_string()));
        }
        if let Some(dir) = &self.log_dir {
            out.push(("log_dir".to_owned(), dir.clone()));
        }
        if let Some(file) = &self.flag_file {
            out.push(("flag_file".to_owned(), file.clone()));
        }
        out.extend(self.driver_extra.iter().cloned());
        out
    }
}

fn non_empty(value: &str) -> Option<String> {
    let v = value.trim();
    (!v.is_empty()).then(|| v.to_owned())
}

/// `eic://HOST:PORT` (or HOST:PORT, as AIBrix strips the scheme) to HOST:PORT.
fn parse_remote_url(value: &str) -> Option<String> {
    let v = value.trim();
    let rest = match v.split_once("://") {
        Some(("eic", rest)) => rest,
        Some(_) => return None,
        None => v,
    };
    let rest = rest.strip_suffix('/').unwrap_or(rest);
    let (host, port) = rest.rsplit_once(':')?;
    let ok = !host.is_empty() && !host.contains('/') && port.parse::<u16>().is_ok_and(|p| p != 0);
    ok.then(|| rest.to_owned())
}

/// `eic_kv_ttl`: -1 is no expiry (`Some(None)`), N > 0 seconds is N * 1000
/// ms; anything else (0, other negatives, not a number) is `None`.
fn parse_ttl_seconds(value: &str) -> Option<Option<u64>> {
    match value.trim().parse::<i64>().ok()? {
        -1 => Some(None),
        n if n > 0 && n <= i64::from(u32::MAX) => Some(Some(n as u64 * 1000)),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config(pairs: &[(&str, &str)]) -> Vec<(String, String)> {
        let mut c: Vec<(String, String)> = pairs.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect();
        c.sort();
        c
    }

    fn base(extra: &[(&str, &str)]) -> Vec<(String, String)> {
        let mut pairs = vec![("remote_url", "eic://10.0.0.7:30001"), ("eic_instance_id", "eic-abc")];
        pairs.extend_from_slice(extra);
        config(&pairs)
    }

    fn refused(c: &[(String, String)]) -> String {
        match Settings::from_config(c) {
            Err(Fail::Invalid(m)) => m,
            other => panic!("expected invalid, got {other:?}"),
        }
    }

    #[test]
    fn an_aibrix_eic_config_is_accepted_with_every_key() {
        let s = Settings::from_config(&config(&[
            ("remote_url", "eic://eic.internal:12345"),
            ("eic_instance_id", "eic-instance-1"),
            ("eic_thread_num", "6"),
            ("eic_log_dir", "/var/log/eic"),
            ("eic_log_level", "2"),
            ("eic_trans_type", "3"),
            ("eic_kv_ttl", "3600"),
            ("eic_kv_ns", "llama-70b"),
            ("eic_flag_file", "/etc/eic/flags"),
        ]))
        .unwrap();
        assert_eq!(s.endpoint, "eic.internal:12345");
        assert_eq!(s.instance_id, "eic-instance-1");
        assert_eq!((s.thread_num, s.log_level, s.trans_type), (Some(6), 2, 3));
        assert_eq!(s.ttl_ms, Some(3_600_000));
        assert_eq!(s.namespace, "llama-70b");
        assert_eq!(s.driver, "eic");
        let want: Vec<(String, String)> = [
            ("endpoint", "eic.internal:12345"),
            ("instance_id", "eic-instance-1"),
            ("log_level", "2"),
            ("trans_type", "3"),
            ("thread_num", "6"),
            ("log_dir", "/var/log/eic"),
            ("flag_file", "/etc/eic/flags"),
        ]
        .iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect();
        assert_eq!(s.driver_config(), want);
    }

    #[test]
    fn defaults_follow_aibrix() {
        let s = Settings::from_config(&base(&[])).unwrap();
        assert_eq!((s.log_level, s.trans_type, s.ttl_ms, s.namespace.as_str()), (1, 3, None, ""));
        assert_eq!((s.thread_num, s.log_dir.as_deref(), s.flag_file.as_deref()), (None, None, None));
        assert_eq!(Settings::from_config(&base(&[("eic_kv_ttl", "-1")])).unwrap().ttl_ms, None);
        // AIBrix strips `eic://`; a bare HOST:PORT works the same.
        let bare = Settings::from_config(&config(&[("remote_url", "10.0.0.7:30001"), ("eic_instance_id", "i")])).unwrap();
        assert_eq!(bare.endpoint, "10.0.0.7:30001");
    }

    #[test]
    fn every_malformed_value_is_refused_naming_its_key() {
        for (key, value) in [
            ("remote_url", "http://10.0.0.7:30001"),
            ("remote_url", "eic://10.0.0.7"),
            ("remote_url", "eic://:30001"),
            ("remote_url", "eic://host:0"),
            ("eic_instance_id", " "),
            ("eic_thread_num", "0"),
            ("eic_thread_num", "six"),
            ("eic_log_dir", ""),
            ("eic_log_level", "verbose"),
            ("eic_trans_type", "-3"),
            ("eic_kv_ttl", "0"),
            ("eic_kv_ttl", "-2"),
            ("eic_kv_ttl", "1h"),
            ("eic_flag_file", ""),
            ("driver", ""),
            ("driver.", "x"),
            ("driver.endpoint", "elsewhere:1"),
            ("eic_kv_ns", "a\0b"),
        ] {
            let mut c = base(&[]);
            c.retain(|(k, _)| k != key);
            c.push((key.to_owned(), value.to_owned()));
            let m = refused(&c);
            assert!(m.starts_with(&format!("config {key}=")), "{key}={value:?}: {m}");
        }
    }

    #[test]
    fn unknown_and_missing_keys_are_named() {
        let m = refused(&base(&[("eic_kv_tll", "5")]));
        assert!(m.contains("eic_kv_tll") && m.contains("unknown setting"), "{m}");
        let m = refused(&config(&[("eic_instance_id", "i")]));
        assert!(m.starts_with("config remote_url: required"), "{m}");
        let m = refused(&config(&[("remote_url", "eic://h:1")]));
        assert!(m.starts_with("config eic_instance_id: required"), "{m}");
        let twice = vec![
            ("eic_instance_id".to_owned(), "i".to_owned()),
            ("remote_url".to_owned(), "eic://h:1".to_owned()),
            ("remote_url".to_owned(), "eic://h:2".to_owned()),
        ];
        assert!(refused(&twice).contains("more than once"));
    }

    #[test]
    fn driver_keys_pass_through_and_the_driver_name_is_configurable() {
        let s = Settings::from_config(&base(&[("driver", "eic-rdma"), ("driver.rdma_device", "mlx5_0")])).unwrap();
        assert_eq!(s.driver, "eic-rdma");
        assert_eq!(s.driver_config().last(), Some(&("rdma_device".to_owned(), "mlx5_0".to_owned())));
    }
}
