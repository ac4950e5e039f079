//! Protobuf values in the Confluent wire format (magic byte 0, a 4-byte
//! schema id, the message indexes, the Protobuf body), decoded with the
//! schema registry's file descriptors (through prost-reflect) into
//! Protobuf's canonical JSON mapping, which the JSON decoder then reads
//! into the declared columns by field name.
//!
//! The registry serves a Protobuf schema as a base64 `FileDescriptorProto`
//! (`?format=serialized`, however it was registered), so no `.proto`
//! parser is needed; referenced files are fetched the same way and the
//! well-known types (`google/protobuf/timestamp.proto`, ...) are built in.

use std::sync::Arc;

use arrow::datatypes::{DataType, Field, Fields, Schema, TimeUnit};
use prost_reflect::{
    DescriptorPool, DynamicMessage, FieldDescriptor, FileDescriptor, Kind, MessageDescriptor,
    SerializeOptions,
};

/// A zigzag varint at the start of `buf`: its value and length.
fn zigzag(buf: &[u8]) -> Option<(i64, usize)> {
    let mut v: u64 = 0;
    for (i, b) in buf.iter().enumerate().take(10) {
        v |= u64::from(b & 0x7f) << (7 * i);
        if b & 0x80 == 0 {
            return Some((((v >> 1) as i64) ^ -((v & 1) as i64), i + 1));
        }
    }
    None
}

/// The message indexes at the start of `buf` (after the schema id) and
/// their length: a count then that many indexes, zigzag varints; a count
/// of 0 stands for `[0]`, the file's first message.
pub fn message_indexes(buf: &[u8]) -> Result<(Vec<usize>, usize), String> {
    let bad = || "the message indexes after the schema id do not decode".to_string();
    let (count, mut at) = zigzag(buf).ok_or_else(bad)?;
    if count == 0 {
        return Ok((vec![0], at));
    }
    if !(1..=64).contains(&count) {
        return Err(bad());
    }
    let mut out = Vec::with_capacity(count as usize);
    for _ in 0..count {
        let (i, n) = zigzag(&buf[at..]).ok_or_else(bad)?;
        out.push(usize::try_from(i).map_err(|_| bad())?);
        at += n;
    }
    Ok((out, at))
}

/// The file described by `fdp` (a serialized `FileDescriptorProto`) with
/// the files it imports (`deps`, serialized likewise, in dependency
/// order), on top of the well-known types.
pub fn file_descriptor(fdp: &[u8], deps: &[Vec<u8>]) -> Result<FileDescriptor, String> {
    use prost::Message;
    let mut pool = DescriptorPool::global();
    let mut add = |bytes: &[u8]| -> Result<String, String> {
        let proto = prost_types::FileDescriptorProto::decode(bytes)
            .map_err(|e| format!("not a serialized FileDescriptorProto: {e}"))?;
        let name = proto.name().to_string();
        if pool.get_file_by_name(&name).is_none() {
            pool.add_file_descriptor_proto(proto)
                .map_err(|e| format!("the file descriptor {name} does not build: {e}"))?;
        }
        Ok(name)
    };
    for d in deps {
        add(d)?;
    }
    let name = add(fdp)?;
    pool.get_file_by_name(&name)
        .ok_or_else(|| format!("the file descriptor {name} was not added"))
}

/// The value `body` (after the schema id: message indexes, then the
/// message) of a record written with `file`, as canonical JSON with the
/// `.proto` field names, every field present (proto3 defaults included;
/// a field the writer's schema lacks is absent) and 64-bit integers as
/// numbers.
pub fn to_json(file: &FileDescriptor, body: &[u8]) -> Result<Vec<u8>, String> {
    let (indexes, at) = message_indexes(body)?;
    let mut message = file.messages().nth(indexes[0]).ok_or_else(|| {
        format!(
            "message index {} is not a message of {}",
            indexes[0],
            file.name()
        )
    })?;
    for &i in &indexes[1..] {
        let child = message.child_messages().nth(i);
        message = child.ok_or_else(|| {
            format!(
                "message index {i} is not a message nested in {}",
                message.full_name()
            )
        })?;
    }
    let name = message.full_name().to_string();
    let msg = DynamicMessage::decode(message, &body[at..])
        .map_err(|e| format!("the Protobuf body does not decode as {name}: {e}"))?;
    let mut out = Vec::with_capacity(body.len() * 2);
    let options = SerializeOptions::new()
        .stringify_64_bit_integers(false)
        .use_proto_field_name(true)
        .skip_default_fields(false);
    msg.serialize_with_options(&mut serde_json::Serializer::new(&mut out), &options)
        .map_err(|e| format!("{name} does not convert to JSON: {e}"))?;
    Ok(out)
}

/// The message `name` of `file` (its full name), or its first message.
pub fn message_of(file: &FileDescriptor, name: Option<&str>) -> Result<MessageDescriptor, String> {
    match name {
        Some(n) => file
            .messages()
            .find(|m| m.full_name() == n || m.name() == n)
            .ok_or_else(|| {
                let names: Vec<String> =
                    file.messages().map(|m| m.full_name().to_string()).collect();
                format!(
                    "{} has no message {n} (it has {})",
                    file.name(),
                    names.join(", ")
                )
            }),
        None => file
            .messages()
            .next()
            .ok_or_else(|| format!("{} defines no message", file.name())),
    }
}

/// The columns of `message` as [`to_json`]'s JSON decodes into them: one
/// per field, by `.proto` name, every one nullable. Enums, `bytes`
/// (base64) and `Duration` are text, `Timestamp` a UTC timestamp, the
/// wrapper types their value, messages structs, repeated fields lists,
/// maps maps. `Struct`, `Value`, `ListValue` and `Any` have no fixed
/// columns: a message using them needs its columns declared.
pub fn arrow_schema(message: &MessageDescriptor) -> Result<Schema, String> {
    Ok(Schema::new(message_fields(message, 0)?))
}

fn message_fields(message: &MessageDescriptor, depth: usize) -> Result<Fields, String> {
    if depth > 16 {
        return Err(format!(
            "{} nests more than 16 messages deep (a recursive message?): declare the columns",
            message.full_name()
        ));
    }
    message
        .fields()
        .map(|f| Ok(Field::new(f.name(), field_type(&f, depth)?, true)))
        .collect()
}

fn field_type(f: &FieldDescriptor, depth: usize) -> Result<DataType, String> {
    if f.is_map()
        && let Kind::Message(entry) = f.kind()
    {
        let key = kind_type(&entry.map_entry_key_field(), depth)?;
        let value = kind_type(&entry.map_entry_value_field(), depth)?;
        let entries = Field::new(
            "entries",
            DataType::Struct(
                vec![
                    Field::new("key", key, false),
                    Field::new("value", value, true),
                ]
                .into(),
            ),
            false,
        );
        return Ok(DataType::Map(Arc::new(entries), false));
    }
    let t = kind_type(f, depth)?;
    Ok(if f.is_list() {
        DataType::List(Arc::new(Field::new("item", t, true)))
    } else {
        t
    })
}

fn kind_type(f: &FieldDescriptor, depth: usize) -> Result<DataType, String> {
    Ok(match f.kind() {
        Kind::Double => DataType::Float64,
        Kind::Float => DataType::Float32,
        Kind::Int32 | Kind::Sint32 | Kind::Sfixed32 => DataType::Int32,
        Kind::Int64 | Kind::Sint64 | Kind::Sfixed64 | Kind::Uint32 | Kind::Fixed32 => {
            DataType::Int64
        }
        Kind::Uint64 | Kind::Fixed64 => DataType::UInt64,
        Kind::Bool => DataType::Boolean,
        Kind::String | Kind::Bytes | Kind::Enum(_) => DataType::Utf8,
        Kind::Message(m) => match m.full_name() {
            "google.protobuf.Timestamp" => {
                DataType::Timestamp(TimeUnit::Microsecond, Some("UTC".into()))
            }
            "google.protobuf.Duration" | "google.protobuf.FieldMask" => DataType::Utf8,
            "google.protobuf.DoubleValue" => DataType::Float64,
            "google.protobuf.FloatValue" => DataType::Float32,
            "google.protobuf.Int64Value" | "google.protobuf.UInt32Value" => DataType::Int64,
            "google.protobuf.UInt64Value" => DataType::UInt64,
            "google.protobuf.Int32Value" => DataType::Int32,
            "google.protobuf.BoolValue" => DataType::Boolean,
            "google.protobuf.StringValue" | "google.protobuf.BytesValue" => DataType::Utf8,
            "google.protobuf.Struct"
            | "google.protobuf.Value"
            | "google.protobuf.ListValue"
            | "google.protobuf.Any" => {
                return Err(format!(
                    "field {} is a {}, which has no fixed columns: declare the table's columns",
                    f.full_name(),
                    m.full_name()
                ));
            }
            _ => DataType::Struct(message_fields(&m, depth + 1)?),
        },
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn message_indexes_follow_the_confluent_encoding() {
        assert_eq!(message_indexes(&[0, 9]).unwrap(), (vec![0], 1));
        // [1, 2]: count 2, then 1 and 2, each zigzag (2, 2, 4).
        assert_eq!(message_indexes(&[4, 2, 4, 7]).unwrap(), (vec![1, 2], 3));
        assert!(message_indexes(&[0x80]).is_err());
    }
}
