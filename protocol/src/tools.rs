//! The `tool_calls` extension (`docs/spec/tool-calls.md`): the tools an `execute` offers to its code, the
//! server's `tool_call` and the client's `tool_result`.
//!
//! Code in an execution calls a tool through a small SDK; sandboxd forwards the call to the client as `tool_call`
//! and hands the client's `tool_result` back to the code. Only the tools the request lists may be called.

use serde::{Deserialize, Serialize};
use serde_json::value::RawValue;
use serde_json::Value;

use crate::envelope::{is_valid_id, now_ts};
use crate::language::Language;

/// The most tools one `execute` may offer.
pub const MAX_TOOLS: usize = 64;
/// The longest tool name, in bytes.
pub const MAX_TOOL_NAME_LEN: usize = 64;
/// The longest tool description, in bytes.
pub const MAX_TOOL_DESCRIPTION_LEN: usize = 4096;
/// The largest tool schema, in bytes of compact JSON.
pub const MAX_TOOL_SCHEMA_BYTES: usize = 64 * 1024;
/// The per-call timeout when `tool_timeout_ms` is not given.
pub const DEFAULT_TOOL_TIMEOUT_MS: u64 = 30_000;

/// Names a tool may not have: they would shadow the SDK's own names or are reserved words of a language with an
/// SDK (the SDKs define a function per tool).
const RESERVED_NAMES: &[&str] = &[
    // the SDK
    "call",
    "ToolError",
    "Result",
    // python keywords and soft keywords
    "False",
    "None",
    "True",
    "and",
    "as",
    "assert",
    "async",
    "await",
    "break",
    "class",
    "continue",
    "def",
    "del",
    "elif",
    "else",
    "except",
    "finally",
    "for",
    "from",
    "global",
    "if",
    "import",
    "in",
    "is",
    "lambda",
    "nonlocal",
    "not",
    "or",
    "pass",
    "raise",
    "return",
    "try",
    "while",
    "with",
    "yield",
    "match",
    "case",
    "type",
    // javascript reserved words
    "arguments",
    "catch",
    "const",
    "debugger",
    "default",
    "delete",
    "do",
    "enum",
    "eval",
    "export",
    "extends",
    "false",
    "function",
    "implements",
    "instanceof",
    "interface",
    "let",
    "new",
    "null",
    "package",
    "private",
    "protected",
    "public",
    "static",
    "super",
    "switch",
    "this",
    "throw",
    "true",
    "typeof",
    "var",
    "void",
    "require",
    "module",
    "exports",
];

/// A tool the code of an execution may call (`execute.tools[]`). Unknown fields are refused.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, expecting = "a tool object")]
pub struct ToolSpec {
    /// The tool's name; the SDKs define a function of this name. `^[A-Za-z][A-Za-z0-9_]{0,63}$`, not reserved.
    pub name: String,
    /// What the tool does (docstring of the generated function).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub description: Option<String>,
    /// A JSON Schema of the tool's arguments (an object). Its `required` list, in order, and then its other
    /// `properties` in name order give the positional parameters of the generated function.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub schema: Option<Value>,
}

impl ToolSpec {
    /// A tool with only a name.
    pub fn new(name: impl Into<String>) -> Self {
        ToolSpec {
            name: name.into(),
            description: None,
            schema: None,
        }
    }

    /// The names of the generated function's positional parameters: `schema.required` in order, then the other
    /// `schema.properties` by name. Empty without a schema.
    pub fn parameters(&self) -> Vec<String> {
        let Some(schema) = self.schema.as_ref().and_then(Value::as_object) else {
            return Vec::new();
        };
        let mut names: Vec<String> = schema
            .get("required")
            .and_then(Value::as_array)
            .into_iter()
            .flatten()
            .filter_map(Value::as_str)
            .filter(|n| is_identifier(n))
            .map(str::to_owned)
            .collect();
        if let Some(props) = schema.get("properties").and_then(Value::as_object) {
            for key in props.keys() {
                if is_identifier(key) && !names.contains(key) {
                    names.push(key.clone());
                }
            }
        }
        names
    }
}

/// `^[A-Za-z_][A-Za-z0-9_]*$`.
fn is_identifier(s: &str) -> bool {
    let mut bytes = s.bytes();
    bytes
        .next()
        .is_some_and(|b| b.is_ascii_alphabetic() || b == b'_')
        && bytes.all(|b| b.is_ascii_alphanumeric() || b == b'_')
}

/// Checks `tools` and `tool_timeout_ms` of an `execute`; the error message names the field.
pub(crate) fn check_tools(
    language: Language,
    tools: &[ToolSpec],
    tool_timeout_ms: Option<u64>,
) -> Result<(), String> {
    if tools.is_empty() {
        if tool_timeout_ms.is_some() {
            return Err("Field tool_timeout_ms: only allowed together with tools".to_owned());
        }
        return Ok(());
    }
    if !matches!(language, Language::Python | Language::Javascript) {
        return Err(format!(
            "Field tools: tool calls are offered to python and javascript code, not to {}",
            language.as_str()
        ));
    }
    if tools.len() > MAX_TOOLS {
        return Err(format!(
            "Field tools: {} tools, at most {MAX_TOOLS} are allowed",
            tools.len()
        ));
    }
    if tool_timeout_ms == Some(0) {
        return Err("Field tool_timeout_ms: must be at least 1".to_owned());
    }
    for (i, tool) in tools.iter().enumerate() {
        let name = &tool.name;
        let shaped = name.len() <= MAX_TOOL_NAME_LEN
            && name.bytes().next().is_some_and(|b| b.is_ascii_alphabetic())
            && is_identifier(name);
        if !shaped {
            return Err(format!(
                "Field tools[{i}].name: {name:?} must be 1 to {MAX_TOOL_NAME_LEN} characters of [A-Za-z0-9_] \
                 starting with a letter"
            ));
        }
        if RESERVED_NAMES.contains(&name.as_str()) {
            return Err(format!(
                "Field tools[{i}].name: {name:?} is reserved (an SDK name or a python/javascript keyword)"
            ));
        }
        if let Some(j) = tools[..i].iter().position(|t| t.name == *name) {
            return Err(format!(
                "Field tools[{i}].name: duplicate of tools[{j}].name {name:?}"
            ));
        }
        if let Some(d) = &tool.description {
            if d.len() > MAX_TOOL_DESCRIPTION_LEN || d.contains('\0') {
                return Err(format!(
                    "Field tools[{i}].description: at most {MAX_TOOL_DESCRIPTION_LEN} bytes, no NUL"
                ));
            }
        }
        if let Some(schema) = &tool.schema {
            if !schema.is_object() {
                return Err(format!("Field tools[{i}].schema: must be a JSON object"));
            }
            let size = serde_json::to_string(schema).map(|s| s.len()).unwrap_or(0);
            if size > MAX_TOOL_SCHEMA_BYTES {
                return Err(format!(
                    "Field tools[{i}].schema: {size} bytes, at most {MAX_TOOL_SCHEMA_BYTES}"
                ));
            }
        }
    }
    Ok(())
}

/// `tool_result` (client → server): the answer to a `tool_call`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ToolResult {
    /// The execution id.
    pub id: String,
    /// The `call_id` of the `tool_call` this answers.
    pub call_id: String,
    /// The client's timestamp, unchecked.
    pub ts: String,
    /// Whether the tool succeeded: then `result` is the value, else `error` says why.
    pub ok: bool,
    /// The tool's value (any JSON; `null` when absent) when `ok`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub result: Option<Value>,
    /// Why the tool failed, when not `ok`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
}

impl ToolResult {
    /// A successful result stamped now.
    pub fn success(id: impl Into<String>, call_id: impl Into<String>, result: Value) -> Self {
        ToolResult {
            id: id.into(),
            call_id: call_id.into(),
            ts: now_ts(),
            ok: true,
            result: Some(result),
            error: None,
        }
    }

    /// A failure stamped now.
    pub fn failure(
        id: impl Into<String>,
        call_id: impl Into<String>,
        error: impl Into<String>,
    ) -> Self {
        ToolResult {
            id: id.into(),
            call_id: call_id.into(),
            ts: now_ts(),
            ok: false,
            result: None,
            error: Some(error.into()),
        }
    }

    /// `call_id` shaped like an id, `error` present exactly when not `ok`.
    pub(crate) fn check(&self) -> Result<(), String> {
        if !is_valid_id(&self.call_id) {
            return Err(
                "Field call_id must be a string of 1 to 128 characters of [A-Za-z0-9_.:-]"
                    .to_owned(),
            );
        }
        match (self.ok, &self.error) {
            (true, Some(_)) => Err("Field error: not allowed when ok is true".to_owned()),
            (false, None) => Err("Missing field error (required when ok is false)".to_owned()),
            (false, Some(_)) if self.result.is_some() => {
                Err("Field result: not allowed when ok is false".to_owned())
            }
            _ => Ok(()),
        }
    }
}

/// The body of `tool_call` (server → client): code in the execution called a tool.
///
/// A client reads the arguments from [`args`](Self::args). A server may instead keep them as the text the code
/// sent ([`raw_args`](Self::raw_args), see [`ToolCall::raw`]): they are then written out as they are, without
/// building a JSON tree of what may be a large request (a tree costs many times its text).
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
pub struct ToolCall {
    /// The execution id.
    pub id: String,
    /// Unique within the execution; the `tool_result` echoes it.
    pub call_id: String,
    /// One of the tools the `execute` listed.
    pub name: String,
    /// The arguments, a JSON object (`null` when [`raw_args`](Self::raw_args) holds them).
    pub args: Value,
    /// The arguments as JSON text; when set, they are what is sent as `args`. Never read from the wire.
    #[serde(skip)]
    pub raw_args: Option<RawArgs>,
    /// How long the server waits for the `tool_result` before the code gets a timeout error.
    #[serde(default)]
    pub timeout_ms: Option<u64>,
}

impl ToolCall {
    /// A `tool_call` whose arguments are kept as the text the code sent.
    pub fn raw(
        id: String,
        call_id: String,
        name: String,
        args: RawArgs,
        timeout_ms: Option<u64>,
    ) -> Self {
        Self {
            id,
            call_id,
            name,
            args: Value::Null,
            raw_args: Some(args),
            timeout_ms,
        }
    }
}

impl Serialize for ToolCall {
    fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        use serde::ser::SerializeStruct;

        let mut s = serializer.serialize_struct("ToolCall", 5)?;
        s.serialize_field("id", &self.id)?;
        s.serialize_field("call_id", &self.call_id)?;
        s.serialize_field("name", &self.name)?;
        match &self.raw_args {
            Some(raw) => s.serialize_field("args", raw)?,
            None => s.serialize_field("args", &self.args)?,
        }
        match self.timeout_ms {
            Some(t) => s.serialize_field("timeout_ms", &t)?,
            None => s.skip_field("timeout_ms")?,
        }
        s.end()
    }
}

/// The arguments of a [`ToolCall`] as JSON text: always a JSON object.
#[derive(Debug, Clone)]
pub struct RawArgs {
    text: Option<Box<RawValue>>,
    _hold: Option<Hold>,
}

/// Something a server keeps alive as long as the arguments exist (e.g. its memory budget's charge for them), so
/// what they cost is given back when the last copy of the message holding them is dropped, after it is sent.
pub type Hold = std::sync::Arc<dyn std::any::Any + Send + Sync>;

impl RawArgs {
    /// `{}`.
    pub fn empty() -> Self {
        Self {
            text: None,
            _hold: None,
        }
    }

    /// `value` if it is a JSON object, else `None`.
    pub fn object(value: &RawValue) -> Option<Self> {
        value.get().starts_with('{').then(|| Self {
            text: Some(value.to_owned()),
            _hold: None,
        })
    }

    /// The same arguments, keeping `hold` alive as long as they (or a copy) exist.
    pub fn holding(self, hold: Hold) -> Self {
        Self {
            text: self.text,
            _hold: Some(hold),
        }
    }

    /// The JSON text.
    pub fn get(&self) -> &str {
        self.text.as_deref().map_or("{}", RawValue::get)
    }
}

impl Serialize for RawArgs {
    fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        match &self.text {
            Some(raw) => raw.serialize(serializer),
            None => serde_json::Map::new().serialize(serializer),
        }
    }
}

impl PartialEq for RawArgs {
    fn eq(&self, other: &Self) -> bool {
        self.get() == other.get()
    }
}

impl Eq for RawArgs {}

/// A request line that code in a sandbox writes to the tool socket, parsed as the daemon's broker parses it.
/// Arguments and return values stay JSON text borrowed from the line: no JSON tree is built.
#[derive(Debug)]
pub enum ToolRequest<'a> {
    /// `{"op": "call", "name": ..., "args": {...}, "timeout_ms": ...}`.
    Call {
        /// The tool.
        name: String,
        /// Its arguments (`{}` when absent).
        args: RawArgs,
        /// The timeout the code asked for, if any.
        timeout_ms: Option<u64>,
    },
    /// `{"op": "return", "value": ...}`: the execution's return value.
    Return {
        /// The value (absent: none).
        value: Option<&'a RawValue>,
    },
}

/// Why a request line is refused (the text of its `invalid` reply).
#[derive(Debug, thiserror::Error)]
pub enum ToolRequestError {
    /// Not JSON, not UTF-8, an unknown field or `op`, a field of the wrong type.
    #[error("Invalid request: {0}")]
    Malformed(#[source] serde_json::Error),
    /// A field of the other operation.
    #[error("Invalid request: field {field} is not allowed with op {op}")]
    NotAllowed {
        /// The field.
        field: &'static str,
        /// `call` or `return`.
        op: &'static str,
    },
    /// A call without a tool name.
    #[error("Invalid request: missing field name")]
    MissingName,
    /// A call whose arguments are not a JSON object.
    #[error("Tool arguments must be a JSON object")]
    ArgsNotObject,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RequestLine<'a> {
    op: Op,
    #[serde(default)]
    name: Option<String>,
    #[serde(default, borrow)]
    args: Option<&'a RawValue>,
    #[serde(default)]
    timeout_ms: Option<u64>,
    #[serde(default, borrow)]
    value: Option<&'a RawValue>,
}

#[derive(Deserialize)]
#[serde(rename_all = "lowercase")]
enum Op {
    Call,
    Return,
}

/// A JSON value walked as `serde_json` parses it into a [`Value`] (so a number out of `f64`'s range is refused, as
/// it would be there) without keeping any of it: what is forwarded as text must parse for the client.
struct Checked;

impl<'de> Deserialize<'de> for Checked {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        d.deserialize_any(CheckedVisitor)
    }
}

struct CheckedVisitor;

impl<'de> serde::de::Visitor<'de> for CheckedVisitor {
    type Value = Checked;

    fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("a JSON value")
    }

    fn visit_bool<E>(self, _: bool) -> Result<Checked, E> {
        Ok(Checked)
    }

    fn visit_i64<E>(self, _: i64) -> Result<Checked, E> {
        Ok(Checked)
    }

    fn visit_u64<E>(self, _: u64) -> Result<Checked, E> {
        Ok(Checked)
    }

    fn visit_f64<E: serde::de::Error>(self, v: f64) -> Result<Checked, E> {
        if v.is_finite() {
            Ok(Checked)
        } else {
            Err(E::custom("number out of range"))
        }
    }

    fn visit_str<E>(self, _: &str) -> Result<Checked, E> {
        Ok(Checked)
    }

    fn visit_unit<E>(self) -> Result<Checked, E> {
        Ok(Checked)
    }

    fn visit_seq<A: serde::de::SeqAccess<'de>>(self, mut a: A) -> Result<Checked, A::Error> {
        while a.next_element::<Checked>()?.is_some() {}
        Ok(Checked)
    }

    fn visit_map<A: serde::de::MapAccess<'de>>(self, mut a: A) -> Result<Checked, A::Error> {
        while a.next_entry::<serde::de::IgnoredAny, Checked>()?.is_some() {}
        Ok(Checked)
    }
}

/// Whether `raw` parses as a [`Value`] would (its text is forwarded as it is).
fn check(raw: &RawValue) -> Result<(), ToolRequestError> {
    serde_json::from_str::<Checked>(raw.get())
        .map(drop)
        .map_err(ToolRequestError::Malformed)
}

/// Parses one request line (without its newline).
pub fn parse_tool_request(line: &[u8]) -> Result<ToolRequest<'_>, ToolRequestError> {
    let r: RequestLine<'_> = serde_json::from_slice(line).map_err(ToolRequestError::Malformed)?;
    for raw in [r.args, r.value].into_iter().flatten() {
        check(raw)?;
    }
    match r.op {
        Op::Return => {
            let field = [
                ("name", r.name.is_some()),
                ("args", r.args.is_some()),
                ("timeout_ms", r.timeout_ms.is_some()),
            ]
            .into_iter()
            .find_map(|(f, set)| set.then_some(f));
            match field {
                Some(field) => Err(ToolRequestError::NotAllowed {
                    field,
                    op: "return",
                }),
                None => Ok(ToolRequest::Return { value: r.value }),
            }
        }
        Op::Call => {
            if r.value.is_some() {
                return Err(ToolRequestError::NotAllowed {
                    field: "value",
                    op: "call",
                });
            }
            let name = r.name.ok_or(ToolRequestError::MissingName)?;
            let args = match r.args {
                None => RawArgs::empty(),
                Some(raw) => RawArgs::object(raw).ok_or(ToolRequestError::ArgsNotObject)?,
            };
            Ok(ToolRequest::Call {
                name,
                args,
                timeout_ms: r.timeout_ms,
            })
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn request_lines_parse_as_the_broker_answers_them() {
        let call =
            parse_tool_request(br#"{"op":"call","name":"grep","args":{"a":[1,2]},"timeout_ms":5}"#);
        match call {
            Ok(ToolRequest::Call {
                name,
                args,
                timeout_ms,
            }) => assert_eq!(
                (name.as_str(), args.get(), timeout_ms),
                ("grep", r#"{"a":[1,2]}"#, Some(5))
            ),
            other => panic!("{other:?}"),
        }
        match parse_tool_request(br#"{"op":"return","value":[1]}"#) {
            Ok(ToolRequest::Return { value }) => assert_eq!(value.map(RawValue::get), Some("[1]")),
            other => panic!("{other:?}"),
        }
        for (line, want) in [
            (
                &br#"{"op":"call","name":"x","args":[1]}"#[..],
                "must be a JSON object",
            ),
            (br#"{"op":"call"}"#, "missing field name"),
            (
                br#"{"op":"call","name":"x","value":1}"#,
                "field value is not allowed with op call",
            ),
            (
                br#"{"op":"return","name":"x"}"#,
                "field name is not allowed with op return",
            ),
            (b"\xff{}", "Invalid request"),
            (br#"{"op":"call","name":"x","extra":1}"#, "unknown field"),
            // Found by fuzzing: RawValue checks syntax only; forwarded as it is, the client could not parse it.
            (
                br#"{"op":"call","name":"lookup","args":{"q":24400E00090000001}}"#,
                "out of range",
            ),
            (br#"{"op":"return","value":[1e999]}"#, "out of range"),
        ] {
            let e = parse_tool_request(line).unwrap_err().to_string();
            assert!(e.contains(want), "{}: {e}", String::from_utf8_lossy(line));
        }
    }

    #[test]
    fn parameters_follow_required_then_properties() {
        let mut t = ToolSpec::new("grep");
        t.schema = Some(serde_json::json!({
            "type": "object",
            "properties": {"pattern": {}, "content": {}, "flags": {}, "bad name": {}},
            "required": ["content", "pattern"],
        }));
        assert_eq!(t.parameters(), ["content", "pattern", "flags"]);
        assert!(ToolSpec::new("x").parameters().is_empty());
    }

    #[test]
    fn tool_checks() {
        let ok = [ToolSpec::new("read_file"), ToolSpec::new("grep")];
        assert!(check_tools(Language::Python, &ok, Some(10)).is_ok());
        assert!(check_tools(Language::Shell, &ok, None).is_err());
        assert!(check_tools(Language::Python, &[], Some(10)).is_err());
        for bad in ["", "1a", "_x", "a-b", "import", "call", "const"] {
            let e = check_tools(Language::Python, &[ToolSpec::new(bad)], None).unwrap_err();
            assert!(e.starts_with("Field tools[0].name"), "{bad}: {e}");
        }
        let dup = [ToolSpec::new("a"), ToolSpec::new("a")];
        assert!(check_tools(Language::Python, &dup, None)
            .unwrap_err()
            .contains("duplicate"));
    }
}
