"""Private protobuf descriptor pool for Pier's generated protocol modules.

Our ``.proto`` files deliberately reuse Triton's package, message and file
names (``inference.ModelConfig`` in ``model_config.proto``, ...) so that they
are wire- and text-format-compatible. If our generated modules registered
into protobuf's process-wide default pool they would collide with
``tritonclient.grpc``'s modules as soon as both are imported in one process.

``scripts/gen_protos.py`` therefore rewrites every generated ``*_pb2.py`` to

* add its serialized file descriptor to :data:`POOL` instead of
  ``descriptor_pool.Default()``, and
* build its message classes with :func:`build_top_descriptors_and_messages`
  instead of ``builder.BuildTopDescriptorsAndMessages``. The stock builder
  also registers every class in the *default* symbol database; under the
  pure-Python protobuf implementation that inserts our descriptors into the
  default pool by name, where (because the file names match Triton's) they
  silently shadow tritonclient's. Ours registers in :data:`SYMBOL_DB`
  (backed by :data:`POOL`) instead. With the default upb implementation the
  registration is inert either way.

Message classes built from this pool are ordinary protobuf messages:
serialization, ``text_format``, ``json_format`` and gRPC (de)serialization
all work. Only by-name lookups that go through the default pool (e.g.
unpacking ``google.protobuf.Any`` with the default symbol database) do not
see these types; use :data:`POOL` / :data:`SYMBOL_DB` for those, e.g.
``POOL.FindMessageTypeByName("inference.ModelConfig")``.
"""

from __future__ import annotations

from typing import Any

from google.protobuf import descriptor_pool, reflection, symbol_database
from google.protobuf import message as _message
from google.protobuf.descriptor import Descriptor, FileDescriptor
from google.protobuf.internal import enum_type_wrapper

POOL = descriptor_pool.DescriptorPool()
SYMBOL_DB = symbol_database.SymbolDatabase(pool=POOL)

__all__ = ["POOL", "SYMBOL_DB", "build_top_descriptors_and_messages"]


def build_top_descriptors_and_messages(
    file_des: FileDescriptor, module_name: str, module: dict[str, Any]
) -> None:
    """Same as ``google.protobuf.internal.builder.BuildTopDescriptorsAndMessages``
    (protobuf 6.x), but registers message classes in :data:`SYMBOL_DB` rather
    than the process-wide default symbol database."""

    def build_message(msg_des: Descriptor, prefix: str) -> type:
        create_dict: dict[str, Any] = {}
        for name, nested_msg in msg_des.nested_types_by_name.items():
            create_dict[name] = build_message(nested_msg, prefix + msg_des.name + ".")
        create_dict["DESCRIPTOR"] = msg_des
        create_dict["__module__"] = module_name
        create_dict["__qualname__"] = prefix + msg_des.name
        message_class = reflection.GeneratedProtocolMessageType(
            msg_des.name, (_message.Message,), create_dict
        )
        SYMBOL_DB.RegisterMessage(message_class)
        return message_class

    for name, enum_des in file_des.enum_types_by_name.items():
        module["_" + name.upper()] = enum_des
        module[name] = enum_type_wrapper.EnumTypeWrapper(enum_des)
        for enum_value in enum_des.values:
            module[enum_value.name] = enum_value.number

    for name, extension_des in file_des.extensions_by_name.items():
        module[name.upper() + "_FIELD_NUMBER"] = extension_des.number
        module[name] = extension_des

    for name, service in file_des.services_by_name.items():
        module["_" + name.upper()] = service

    for name, msg_des in file_des.message_types_by_name.items():
        module[name] = build_message(msg_des, "")
