"""Reading a GGUF file's metadata (``gguf.GGUFReader`` fields) without torch: what the
tokenizer and the gateway need from a model file, no weights touched."""
from __future__ import annotations

from typing import Any


def gguf_field(reader: Any, key: str, default: Any = None) -> Any:
    """Value of metadata ``key`` of a ``gguf.GGUFReader`` or a ``gguf_file.GGUFFile``: str,
    int, float, bool or a list (a ``GGUFFile`` gives an array of strings only if it was opened
    with the key in ``read_string_arrays``, else its length).

    Returns ``default`` when the key is absent. Works on every ``gguf`` version (no ``contents()``).
    """
    field = getattr(reader, "field", None)
    if field is not None:  # a GGUFFile: values already decoded
        return field(key, default)
    from gguf import GGUFValueType

    field = reader.get_field(key)
    if field is None:
        return default
    kind = field.types[-1]
    if kind == GGUFValueType.STRING:
        values = [bytes(field.parts[i]).decode("utf-8") for i in field.data]
    else:
        values = [field.parts[i][0].item() for i in field.data]
        if kind == GGUFValueType.BOOL:
            values = [bool(v) for v in values]
    return values if field.types[0] == GGUFValueType.ARRAY else values[0]
