"""A public request holds only what this server's API declares.

protobuf keeps what it cannot place: a field number its .proto does not have (a client built
from a newer generation.proto, or a hand-made message) is carried along as an unknown field, and
an enum number the .proto does not name is kept as a bare number. Either would be served as if
it were not there, so a request that has one is INVALID_ARGUMENT naming where it is.

What comes in over gRPC is checked before anything else; the HTTP API builds its messages
itself (its bodies are checked by their models), and they pass. Only set fields are walked: a
few microseconds for a chat request.
"""

from __future__ import annotations

from google.protobuf.descriptor import FieldDescriptor
from google.protobuf.message import Message
from google.protobuf.unknown_fields import UnknownFieldSet

from gateway_service.errors import InvalidRequest


def check_known_fields(message: Message, nested: bool = True) -> None:
    """Refuse a field number or an enum value the API does not declare, in `message` and (when
    `nested`) every message it holds."""
    problem = _unknown(message, "", nested)
    if problem is not None:
        raise InvalidRequest(problem)


def _unknown(message: Message, path: str, nested: bool) -> str | None:
    unknown = UnknownFieldSet(message)
    if len(unknown):
        where = f"{path[:-1]}: " if path else ""
        return (f"{where}field number {unknown[0].field_number} is not part of this server's "
                f"{message.DESCRIPTOR.full_name} (a client built from a newer .proto?)")
    for field, value in message.ListFields():
        if field.type == FieldDescriptor.TYPE_ENUM:
            for index, number in _items(field, value):
                if number not in field.enum_type.values_by_number:
                    known = ", ".join(f"{v.number} ({v.name})" for v in field.enum_type.values)
                    return (f"{path}{field.name}{index}: {number} is not a {field.enum_type.name} "
                            f"(one of {known})")
        elif nested and field.type == FieldDescriptor.TYPE_MESSAGE and not field.message_type.GetOptions().map_entry:
            for index, item in _items(field, value):
                problem = _unknown(item, f"{path}{field.name}{index}.", nested)
                if problem is not None:
                    return problem
    return None


def _items(field: FieldDescriptor, value):
    """(index text, item) for a repeated field's items, or ("", value) for a single one."""
    if field.is_repeated:
        return ((f"[{index}]", item) for index, item in enumerate(value))
    return (("", value),)
