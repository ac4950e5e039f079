//! Client settings kept out of job files: `${env:NAME}` references in an
//! option's value, and Java-style `.properties` files (the format Kafka
//! clients read their settings from).
//!
//! A job file can then name a secret without holding it:
//! `'kafka.sasl.password' '${env:KAFKA_PASSWORD}'`, or
//! `'properties_file' 'client.properties'`. [`client_settings`] gathers a
//! table's settings from both, refusing the keys its client owns;
//! [`bootstrap_servers`] reconciles the brokers of `LOCATION` with them.
//! The lower-level functions return the message of an error; the caller
//! positions it at the declaration.

use std::collections::BTreeMap;
use std::path::Path;

use crate::connector::TableContext;
use crate::{Error, Result};

/// The client settings of the table of `ctx`: its `properties_file`
/// (when given), then its options under `prefix` (`kafka.`, which win,
/// without the prefix), with `${env:NAME}` expanded. A key in `owned` (the client's own, with the
/// reason) is refused wherever it is set; `client` names that client in
/// the message. `bootstrap.servers` may come from the file; see
/// [`bootstrap_servers`].
pub fn client_settings(
    ctx: &TableContext<'_>,
    prefix: &str,
    owned: &[(&str, &str)],
    client: &str,
) -> Result<BTreeMap<String, String>> {
    let t = ctx.table();
    let owned_key = |key: &str| {
        let lower = key.to_ascii_lowercase();
        owned
            .iter()
            .find(|(r, _)| *r == lower && lower != "bootstrap.servers")
            .map(|(_, why)| *why)
    };
    let mut settings = BTreeMap::new();
    if let Some(path) = ctx.option("properties_file") {
        let pairs = read_properties(Path::new(path))
            .map_err(|m| ctx.error(format!("option properties_file of {}: {m}", t.name)))?;
        for (k, v) in pairs {
            if let Some(why) = owned_key(&k) {
                return Err(ctx.error(format!(
                    "the properties_file {path} of {} sets {k}, which {client} sets itself: \
                     {why}. Remove it from the file",
                    t.name
                )));
            }
            settings.insert(k, v);
        }
    }
    for (k, v) in &t.options {
        if let Some(rest) = k.strip_prefix(prefix) {
            if let Some(why) = owned_key(rest) {
                let lower = rest.to_ascii_lowercase();
                return Err(ctx.error(format!(
                    "option {prefix}{lower} of {}: {client} sets {lower} itself and it cannot \
                     be changed: {why}",
                    t.name
                )));
            }
            let v = expand_env(k, v).map_err(|m| ctx.error(format!("{m} (table {})", t.name)))?;
            settings.insert(rest.to_string(), v);
        }
    }
    Ok(settings)
}

/// The brokers of a Kafka table: those `LOCATION` names (`servers`), or else the
/// settings' `bootstrap.servers`; both given and different is an error.
pub fn bootstrap_servers(
    ctx: &TableContext<'_>,
    servers: &str,
    settings: &BTreeMap<String, String>,
) -> Result<String> {
    let err = |msg: String| -> Error { ctx.error(msg) };
    Ok(match (servers, settings.get("bootstrap.servers")) {
        ("", None) => {
            return Err(err("no bootstrap servers: name them in LOCATION \
                     ('kafka://HOST:PORT/TOPIC') or as bootstrap.servers in the \
                     properties_file"
                .into()));
        }
        ("", Some(s)) => s.clone(),
        (s, Some(other)) if s != other => {
            return Err(err(format!(
                "LOCATION names the brokers {s} but bootstrap.servers is {other}: give \
                     them once (write LOCATION 'kafka:///TOPIC' to take them from the \
                     settings)"
            )));
        }
        (s, _) => s.to_string(),
    })
}

/// `value` of option `key` with every `${env:NAME}` replaced by the
/// environment variable `NAME`. An unset (or non-UTF-8) variable is an
/// error naming it and the option. `$${` stands for a literal `${`.
pub fn expand_env(key: &str, value: &str) -> Result<String, String> {
    let mut out = String::with_capacity(value.len());
    let mut rest = value;
    while let Some(at) = rest.find("${") {
        if rest[..at].ends_with('$') {
            // `$${...}`: an escaped `${`, kept literally (minus one `$`).
            out.push_str(&rest[..at - 1]);
            out.push_str("${");
            rest = &rest[at + 2..];
            continue;
        }
        out.push_str(&rest[..at]);
        let inner = &rest[at + 2..];
        let Some(end) = inner.find('}') else {
            return Err(format!(
                "option {key}: an unterminated ${{...}} reference; write ${{env:NAME}} (or $${{ \
                 for a literal ${{)"
            ));
        };
        let reference = &inner[..end];
        let Some(name) = reference.strip_prefix("env:") else {
            return Err(format!(
                "option {key}: ${{{reference}}} is not a reference lakestream knows; write \
                 ${{env:NAME}} to read the environment variable NAME (or $${{ for a literal ${{)"
            ));
        };
        if name.is_empty() || name.contains(['=', '\0']) {
            return Err(format!(
                "option {key}: ${{env:{name}}} does not name an environment variable"
            ));
        }
        match std::env::var(name) {
            Ok(v) => out.push_str(&v),
            Err(std::env::VarError::NotPresent) => {
                return Err(format!(
                    "option {key} reads the environment variable {name}, which is not set: \
                     export {name} before starting the job"
                ));
            }
            Err(std::env::VarError::NotUnicode(_)) => {
                return Err(format!(
                    "option {key} reads the environment variable {name}, whose value is not \
                     UTF-8"
                ));
            }
        }
        rest = &inner[end + 1..];
    }
    out.push_str(rest);
    Ok(out)
}

/// The `key = value` pairs of the properties file at `path`, in file
/// order, values with `${env:NAME}` expanded. The format is Java's
/// `java.util.Properties`: `#` and `!` comments, `=`, `:` or white space
/// between key and value, a trailing `\` continuing a line, and `\`
/// escapes (`\t`, `\n`, `\uXXXX`, `\=`, ...).
pub fn read_properties(path: &Path) -> Result<Vec<(String, String)>, String> {
    let text = std::fs::read_to_string(path)
        .map_err(|e| format!("cannot read the properties file {}: {e}", path.display()))?;
    parse_properties(&text).map_err(|(line, msg)| format!("{}:{line}: {msg}", path.display()))
}

/// [`read_properties`] on `text`; errors carry their 1-based line.
fn parse_properties(text: &str) -> Result<Vec<(String, String)>, (usize, String)> {
    let mut out = Vec::new();
    let mut lines = text.lines().enumerate();
    while let Some((n, line)) = lines.next() {
        let first = n + 1;
        let trimmed = line.trim_start_matches([' ', '\t', '\x0c']);
        if trimmed.is_empty() || trimmed.starts_with(['#', '!']) {
            continue;
        }
        // Join continuation lines: an odd number of trailing backslashes.
        let mut logical = String::new();
        let mut part = trimmed.to_string();
        loop {
            let trailing = part.len() - part.trim_end_matches('\\').len();
            if trailing % 2 == 1 {
                part.pop();
                logical.push_str(&part);
                match lines.next() {
                    Some((_, next)) => {
                        part = next.trim_start_matches([' ', '\t', '\x0c']).to_string();
                    }
                    None => break,
                }
            } else {
                logical.push_str(&part);
                break;
            }
        }
        let (key, value) = split_property(&logical);
        let key = unescape(key).map_err(|m| (first, m))?;
        let value = unescape(value).map_err(|m| (first, m))?;
        if key == "sasl.jaas.config" {
            return Err((
                first,
                "sasl.jaas.config is the Java client's setting; librdkafka (lakestream's Kafka \
                 client) takes sasl.mechanism, sasl.username and sasl.password instead"
                    .into(),
            ));
        }
        let value = expand_env(&key, &value).map_err(|m| (first, m))?;
        out.push((key, value));
    }
    Ok(out)
}

/// The raw key and value of one logical line: the key ends at the first
/// unescaped `=`, `:` or white space; one such separator (with the white
/// space around it) is skipped.
fn split_property(line: &str) -> (&str, &str) {
    let bytes = line.as_bytes();
    let mut i = 0;
    while i < bytes.len() {
        match bytes[i] {
            b'\\' => i += 2,
            b'=' | b':' | b' ' | b'\t' | b'\x0c' => break,
            _ => i += 1,
        }
    }
    let i = i.min(bytes.len());
    let key = &line[..i];
    let mut rest = line[i..].trim_start_matches([' ', '\t', '\x0c']);
    if let Some(r) = rest.strip_prefix(['=', ':']) {
        rest = r.trim_start_matches([' ', '\t', '\x0c']);
    }
    (key, rest)
}

/// Java properties escapes resolved.
fn unescape(s: &str) -> Result<String, String> {
    let mut out = String::with_capacity(s.len());
    let mut chars = s.chars();
    while let Some(c) = chars.next() {
        if c != '\\' {
            out.push(c);
            continue;
        }
        match chars.next() {
            Some('t') => out.push('\t'),
            Some('n') => out.push('\n'),
            Some('r') => out.push('\r'),
            Some('f') => out.push('\x0c'),
            Some('u') => {
                let hex: String = chars.by_ref().take(4).collect();
                let c = u32::from_str_radix(&hex, 16)
                    .ok()
                    .filter(|_| hex.len() == 4)
                    .and_then(char::from_u32)
                    .ok_or_else(|| format!("\\u{hex} is not a \\uXXXX escape"))?;
                out.push(c);
            }
            Some(other) => out.push(other),
            None => {}
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn references_expand_and_an_unset_variable_is_named() {
        // SAFETY: tests in this module are the only users of these names.
        unsafe {
            std::env::set_var("LAKESTREAM_TEST_SECRET_A", "s3cr=t");
            std::env::remove_var("LAKESTREAM_TEST_UNSET_B");
        }
        assert_eq!(
            expand_env("k", "pre-${env:LAKESTREAM_TEST_SECRET_A}-post").unwrap(),
            "pre-s3cr=t-post"
        );
        assert_eq!(expand_env("k", "no refs").unwrap(), "no refs");
        assert_eq!(expand_env("k", "a$${env:X}").unwrap(), "a${env:X}");
        let e = expand_env("kafka.sasl.password", "${env:LAKESTREAM_TEST_UNSET_B}").unwrap_err();
        assert!(
            e.contains("LAKESTREAM_TEST_UNSET_B") && e.contains("kafka.sasl.password"),
            "{e}"
        );
        assert!(
            expand_env("k", "${file:/x}")
                .unwrap_err()
                .contains("not a reference")
        );
        assert!(
            expand_env("k", "${env:A")
                .unwrap_err()
                .contains("unterminated")
        );
    }

    #[test]
    fn java_properties_are_read_as_kafka_clients_read_them() {
        // SAFETY: as above.
        unsafe { std::env::set_var("LAKESTREAM_TEST_SECRET_C", "pw") };
        let text = "# Confluent Cloud\n\
                    ! another comment\n\
                    \n\
                    bootstrap.servers=pkc-1.example:9092\n\
                    security.protocol : SASL_SSL\n\
                    sasl.mechanisms PLAIN\n\
                    sasl.username=KEY\\\n    ID\n\
                    sasl.password=${env:LAKESTREAM_TEST_SECRET_C}\n\
                    client.id=a\\=b\\u0041\n\
                    empty=\n";
        let got = parse_properties(text).unwrap();
        let got: Vec<(&str, &str)> = got.iter().map(|(k, v)| (&k[..], &v[..])).collect();
        assert_eq!(
            got,
            [
                ("bootstrap.servers", "pkc-1.example:9092"),
                ("security.protocol", "SASL_SSL"),
                ("sasl.mechanisms", "PLAIN"),
                ("sasl.username", "KEYID"),
                ("sasl.password", "pw"),
                ("client.id", "a=bA"),
                ("empty", ""),
            ]
        );
        let (line, msg) =
            parse_properties("a=1\nsasl.jaas.config=org.apache...required;\n").unwrap_err();
        assert_eq!(line, 2);
        assert!(msg.contains("sasl.username"), "{msg}");
    }
}
