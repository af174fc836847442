//! A config as TOML: errors on one line, `--set` overrides, tables read as types.

use crate::error::{Error, Result};

/// A TOML error on one line: `line L, column C: message` when it has a position in `text`.
pub(crate) fn toml_error(text: &str, e: &toml::de::Error) -> String {
    let message = e.message().trim().replace('\n', " ");
    match e.span() {
        Some(span) if span.start <= text.len() => {
            let before = &text[..span.start];
            let line = before.matches('\n').count() + 1;
            let column = before.len() - before.rfind('\n').map_or(0, |i| i + 1) + 1;
            format!("line {line}, column {column}: {message}")
        }
        _ => message,
    }
}

/// A table (a config file with its `--set` overrides applied) as `T`. The table has lost the
/// file's positions, so an error names the key instead: `train.precision: unknown variant
/// \`fp8\`, expected one of \`f32\`, \`bf16\`, \`bfloat16\``.
pub(crate) fn from_table<T: serde::de::DeserializeOwned>(table: toml::Table) -> Result<T> {
    serde_path_to_error::deserialize(table).map_err(|e| {
        let path = e.path().to_string();
        let message = e.inner().message().trim().replace('\n', " ");
        Error::Config(if path == "." {
            message
        } else {
            format!("{path}: {message}")
        })
    })
}

/// Applies `a.b.c=value` to a TOML table. The value is read as TOML (`500`, `0.1`, `true`,
/// `"x"`, `{ preset = "GEGLU" }`) and otherwise taken as a string (`GEGLU`).
pub fn apply_override(table: &mut toml::Table, assignment: &str) -> Result<()> {
    let (key, value) = assignment
        .split_once('=')
        .ok_or_else(|| Error::Override(format!("`{assignment}`: expected key=value")))?;
    let (key, value) = (key.trim(), value.trim());
    let value: toml::Value = toml::from_str::<toml::Table>(&format!("v = {value}"))
        .ok()
        .and_then(|mut t| t.remove("v"))
        .unwrap_or_else(|| toml::Value::String(value.to_string()));
    let parts: Vec<&str> = key.split('.').collect();
    if parts.iter().any(|p| p.is_empty()) {
        return Err(Error::Override(format!(
            "`{assignment}`: empty key segment"
        )));
    }
    let (last, path) = parts.split_last().expect("split yields one part");
    let mut current = table;
    for (i, part) in path.iter().enumerate() {
        let entry = current
            .entry(part.to_string())
            .or_insert_with(|| toml::Value::Table(toml::Table::new()));
        current = entry.as_table_mut().ok_or_else(|| {
            Error::Override(format!(
                "`{assignment}`: `{}` is not a table",
                parts[..=i].join(".")
            ))
        })?;
    }
    current.insert(last.to_string(), value);
    Ok(())
}
