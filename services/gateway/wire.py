"""Request bodies as bytes: the gateway registers its RPCs without protobuf deserialisation so
it can refuse an oversized body before parsing it, and turn a body protobuf cannot parse into
INVALID_ARGUMENT naming the field (no internal class names reach the client)."""
from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

from google.protobuf.descriptor import Descriptor, FieldDescriptor
from google.protobuf.message import DecodeError, Message

from services.errors import BodyTooLarge, InvalidArgument

M = TypeVar("M", bound=Message)
_LENGTH_DELIMITED = 2


def parse_body(message_cls: type[M], data: bytes, max_bytes: int) -> M:
    """``data`` parsed as ``message_cls``.

    Raises:
        ValueError: ``data`` is longer than ``max_bytes`` (checked first; names the limit and its
            setting ``max_request_bytes``), or not a valid message: a string field with invalid
            UTF-8 is named (``prompt``, ``messages[2].content``), anything else is "malformed".
    """
    if len(data) > max_bytes:
        raise BodyTooLarge("request", f"{len(data)} bytes exceed the gateway's limit of {max_bytes} "
                           "bytes (setting max_request_bytes)")
    try:
        return message_cls.FromString(data)
    except DecodeError:
        field = invalid_utf8_field(message_cls.DESCRIPTOR, data)
        if field is not None:
            raise InvalidArgument(field, "is not valid UTF-8") from None
        raise InvalidArgument("request", f"not a well-formed {message_cls.DESCRIPTOR.name} "
                              "(protobuf wire format)") from None


def invalid_utf8_field(descriptor: Descriptor, data: bytes, prefix: str = "") -> str | None:
    """The path of the first string field of ``descriptor`` in wire-format ``data`` whose bytes
    are not UTF-8 (``messages[1].content``), recursing into message fields; None if there is
    none or ``data`` is truncated."""
    counts: dict[int, int] = {}
    pos = 0
    try:
        while pos < len(data):
            key, pos = _varint(data, pos)
            number, wire_type = key >> 3, key & 7
            if wire_type != _LENGTH_DELIMITED:
                pos = _skip(data, pos, wire_type)
                continue
            size, pos = _varint(data, pos)
            chunk, pos = data[pos:pos + size], pos + size
            field = descriptor.fields_by_number.get(number)
            if field is None or field.type not in (FieldDescriptor.TYPE_STRING, FieldDescriptor.TYPE_MESSAGE):
                continue
            name = prefix + field.name
            if _is_repeated(field):
                counts[number] = counts.get(number, -1) + 1
                name += f"[{counts[number]}]"
            if field.type == FieldDescriptor.TYPE_MESSAGE:
                found = invalid_utf8_field(field.message_type, chunk, name + ".")
                if found is not None:
                    return found
                continue
            try:
                chunk.decode("utf-8")
            except UnicodeDecodeError:
                return name
    except IndexError:
        return None
    return None


def _is_repeated(field: FieldDescriptor) -> bool:
    is_repeated = getattr(field, "is_repeated", None)  # protobuf >= 6; label before
    return bool(is_repeated) if is_repeated is not None else field.label == FieldDescriptor.LABEL_REPEATED


def _varint(data: bytes, pos: int) -> tuple[int, int]:
    """(value, next position) of the base-128 varint at ``pos``. IndexError when truncated."""
    value, shift = 0, 0
    while True:
        byte = data[pos]
        pos += 1
        value |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return value, pos
        shift += 7


def _skip(data: bytes, pos: int, wire_type: int) -> int:
    if wire_type == 0:
        return _varint(data, pos)[1]
    if wire_type == 1:
        return pos + 8
    if wire_type == 5:
        return pos + 4
    raise IndexError(f"wire type {wire_type}")  # groups or garbage: give up


def raw_handlers(service: str, methods: dict[str, tuple[Callable, type[Message], type[Message], bool]],
                 max_bytes: int):
    """A generic handler for ``service`` whose methods receive bytes and parse them with
    ``parse_body``. ``methods``: name -> (handler(request, context), request class, response
    class, server-streaming?)."""
    import grpc

    handlers = {}
    for name, (fn, request_cls, response_cls, streaming) in methods.items():
        if streaming:
            handlers[name] = grpc.unary_stream_rpc_method_handler(
                _streaming(fn, request_cls, max_bytes), response_serializer=response_cls.SerializeToString)
        else:
            handlers[name] = grpc.unary_unary_rpc_method_handler(
                _unary(fn, request_cls, max_bytes), response_serializer=response_cls.SerializeToString)
    return grpc.method_handlers_generic_handler(service, handlers)


def _unary(fn, request_cls, max_bytes):
    async def handle(data: bytes, context):
        return await fn(parse_body(request_cls, data, max_bytes), context)
    return handle


def _streaming(fn, request_cls, max_bytes):
    async def handle(data: bytes, context):
        request = parse_body(request_cls, data, max_bytes)
        async for item in fn(request, context):
            yield item
    return handle
