"""Chakra execution traces (MLCommons Chakra ET) from a Prism timeline.

``write_chakra(tl, out_dir)`` writes one file per rank, ``DIR/PREFIX.RANK.et``,
in Chakra's encoding: a sequence of length-delimited protobuf messages (each
prefixed by its size as a varint, as ``encodeMessage`` / ``decodeMessage`` in
Chakra's ``src/third_party/utils/protolib.py``), first a ``GlobalMetadata``,
then one ``Node`` per compute segment, collective, send and receive, so that
ASTRA-sim users can reuse a Prism capture. ``DIR/comm_group.json`` maps each
``pg_name`` to its member ranks.

The message classes are built at run time from a ``FileDescriptorProto``
written out below, so no ``protoc`` and no Chakra installation is needed,
only the ``protobuf`` package (the ``chakra`` extra). Field numbers, enum
values and names follow ``schema/protobuf/et_def.proto`` of mlcommons/chakra
(package ``ChakraProtoMsg``) exactly::

    message GlobalMetadata { string version = 1; repeated AttributeProto attr = 2; }
    enum NodeType { INVALID_NODE = 0; METADATA_NODE = 1; MEM_LOAD_NODE = 2; MEM_STORE_NODE = 3;
                    COMP_NODE = 4; COMM_SEND_NODE = 5; COMM_RECV_NODE = 6; COMM_COLL_NODE = 7;
                    STORAGE_NODE = 8; BATCH_NODE = 9; CHECKPOINT_NODE = 10; }
    enum CollectiveCommType { ALL_REDUCE = 0; REDUCE = 1; ALL_GATHER = 2; GATHER = 3; SCATTER = 4;
                              BROADCAST = 5; ALL_TO_ALL = 6; REDUCE_SCATTER = 7;
                              REDUCE_SCATTER_BLOCK = 8; BARRIER = 9; }
    message Node { uint64 id = 1; string name = 2; NodeType type = 3; repeated uint64 ctrl_deps = 4;
                   repeated uint64 data_deps = 5; uint64 start_time_micros = 6;
                   uint64 duration_micros = 7; IOInfo inputs = 8; IOInfo outputs = 9;
                   repeated AttributeProto attr = 10; optional StorageInfo storage = 11; }
    message IOInfo { string values = 1; string shapes = 2; string types = 3; }
    message AttributeProto { string name = 1; string doc_string = 2;
                             oneof value { double double_val = 3; ... bytes_list = 32; } }

(``storage`` and its messages describe storage operations, which Prism does
not record; they are left out.)

Nodes and dependencies, per rank, in program order:

* ``COMP_NODE`` per compute segment; ``COMM_COLL_NODE`` per collective
  participation (attrs ``comm_type`` = ``CollectiveCommType``, ``comm_size``
  = the bytes this rank contributes, ``pg_name`` = the group id);
  ``COMM_SEND_NODE`` / ``COMM_RECV_NODE`` per send / receive (attrs
  ``comm_src``, ``comm_dst`` (global ranks), ``comm_tag``, ``comm_size``,
  ``pg_name``). Every node carries ``is_cpu_op`` = false and its step.
  Attribute value types follow Chakra's own ET generator
  (``int64_val`` for comm_type / comm_size, ``int32_val`` for src / dst / tag).
* ``data_deps``: a node depends on the nodes the rank had to finish before
  issuing it: the previous blocking node of the rank (compute, blocking
  collective, send or receive), and every async op the rank waited for since
  then (Prism's WAIT nodes become these edges). An async op does not hold
  the rank, so the node after it depends on what came before it, not on it.
* ``ctrl_deps`` are left empty: every edge Prism knows is a must-complete-
  before edge, and simulators that honour only ``data_deps`` must see them all.
* ``start_time_micros`` / ``duration_micros``: the timeline's times (predicted
  or recorded), rounded to whole µs as the schema requires.
* End-of-step marks are not nodes (Chakra has no such node type); the
  ``step`` attribute carries the step.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

from prism.core.graph import COLL, COMPUTE, ITER, OPS, SEND, WAIT
from prism.core.timeline import Timeline

__all__ = [
    "CHAKRA_VERSION",
    "COMM_TYPE",
    "NODE_TYPE",
    "ChakraUnavailableError",
    "EtNode",
    "chakra_classes",
    "et_nodes",
    "read_et",
    "write_chakra",
]

#: ``GlobalMetadata.version`` as Chakra's own generators write it.
CHAKRA_VERSION = "0.0.4"

NODE_TYPE = {
    "INVALID_NODE": 0, "METADATA_NODE": 1, "MEM_LOAD_NODE": 2, "MEM_STORE_NODE": 3, "COMP_NODE": 4,
    "COMM_SEND_NODE": 5, "COMM_RECV_NODE": 6, "COMM_COLL_NODE": 7, "STORAGE_NODE": 8, "BATCH_NODE": 9,
    "CHECKPOINT_NODE": 10,
}
_COLL_ENUM = {
    "ALL_REDUCE": 0, "REDUCE": 1, "ALL_GATHER": 2, "GATHER": 3, "SCATTER": 4, "BROADCAST": 5, "ALL_TO_ALL": 6,
    "REDUCE_SCATTER": 7, "REDUCE_SCATTER_BLOCK": 8, "BARRIER": 9,
}
#: Prism's collective ops (torch.distributed's names) -> CollectiveCommType.
COMM_TYPE = {
    "all_reduce": _COLL_ENUM["ALL_REDUCE"],
    "all_reduce_coalesced": _COLL_ENUM["ALL_REDUCE"],
    "reduce": _COLL_ENUM["REDUCE"],
    "all_gather": _COLL_ENUM["ALL_GATHER"],
    "all_gather_into_tensor": _COLL_ENUM["ALL_GATHER"],
    "gather": _COLL_ENUM["GATHER"],
    "scatter": _COLL_ENUM["SCATTER"],
    "broadcast": _COLL_ENUM["BROADCAST"],
    "all_to_all": _COLL_ENUM["ALL_TO_ALL"],
    "all_to_all_single": _COLL_ENUM["ALL_TO_ALL"],
    "reduce_scatter": _COLL_ENUM["REDUCE_SCATTER"],
    "reduce_scatter_tensor": _COLL_ENUM["REDUCE_SCATTER"],
    "barrier": _COLL_ENUM["BARRIER"],
}


class ChakraUnavailableError(RuntimeError):
    """Writing Chakra traces needs the ``protobuf`` package, which is missing."""


# --------------------------------------------------------------- the schema
# AttributeProto's oneof ``value``: (name, number, scalar type or list message).
_ATTR_VALUES = (
    ("double", 3, "TYPE_DOUBLE"), ("float", 5, "TYPE_FLOAT"), ("int32", 7, "TYPE_INT32"),
    ("int64", 9, "TYPE_INT64"), ("uint32", 11, "TYPE_UINT32"), ("uint64", 13, "TYPE_UINT64"),
    ("sint32", 15, "TYPE_SINT32"), ("sint64", 17, "TYPE_SINT64"), ("fixed32", 19, "TYPE_FIXED32"),
    ("fixed64", 21, "TYPE_FIXED64"), ("sfixed32", 23, "TYPE_SFIXED32"), ("sfixed64", 25, "TYPE_SFIXED64"),
    ("bool", 27, "TYPE_BOOL"), ("string", 29, "TYPE_STRING"), ("bytes", 31, "TYPE_BYTES"),
)
_PKG = "ChakraProtoMsg"


def _file_descriptor() -> Any:
    from google.protobuf import descriptor_pb2

    F = descriptor_pb2.FieldDescriptorProto
    fdp = descriptor_pb2.FileDescriptorProto(name="prism_chakra_et_def.proto", package=_PKG, syntax="proto3")

    def field(msg, name, number, typ, *, repeated=False, type_name=None, oneof=None):
        f = msg.field.add(name=name, number=number, type=getattr(F, typ),
                          label=F.LABEL_REPEATED if repeated else F.LABEL_OPTIONAL)
        if type_name:
            f.type_name = f".{_PKG}.{type_name}"
        if oneof is not None:
            f.oneof_index = oneof
        return f

    attr = fdp.message_type.add(name="AttributeProto")
    field(attr, "name", 1, "TYPE_STRING")
    field(attr, "doc_string", 2, "TYPE_STRING")
    attr.oneof_decl.add(name="value")
    for base, num, typ in _ATTR_VALUES:
        list_name = base.capitalize() + "List"
        field(attr, f"{base}_val", num, typ, oneof=0)
        field(attr, f"{base}_list", num + 1, "TYPE_MESSAGE", type_name=list_name, oneof=0)
        lst = fdp.message_type.add(name=list_name)
        field(lst, "values", 1, typ, repeated=True)
    meta = fdp.message_type.add(name="GlobalMetadata")
    field(meta, "version", 1, "TYPE_STRING")
    field(meta, "attr", 2, "TYPE_MESSAGE", repeated=True, type_name="AttributeProto")
    for enum_name, values in (("NodeType", NODE_TYPE), ("CollectiveCommType", _COLL_ENUM)):
        e = fdp.enum_type.add(name=enum_name)
        for k, v in values.items():
            e.value.add(name=k, number=v)
    node = fdp.message_type.add(name="Node")
    field(node, "id", 1, "TYPE_UINT64")
    field(node, "name", 2, "TYPE_STRING")
    field(node, "type", 3, "TYPE_ENUM", type_name="NodeType")
    field(node, "ctrl_deps", 4, "TYPE_UINT64", repeated=True)
    field(node, "data_deps", 5, "TYPE_UINT64", repeated=True)
    field(node, "start_time_micros", 6, "TYPE_UINT64")
    field(node, "duration_micros", 7, "TYPE_UINT64")
    field(node, "inputs", 8, "TYPE_MESSAGE", type_name="IOInfo")
    field(node, "outputs", 9, "TYPE_MESSAGE", type_name="IOInfo")
    field(node, "attr", 10, "TYPE_MESSAGE", repeated=True, type_name="AttributeProto")
    io = fdp.message_type.add(name="IOInfo")
    for i, name in enumerate(("values", "shapes", "types"), 1):
        field(io, name, i, "TYPE_STRING")
    return fdp


@dataclass(frozen=True, slots=True)
class ChakraClasses:
    """The runtime-built message classes of Chakra's ``et_def.proto``."""

    GlobalMetadata: type
    Node: type
    AttributeProto: type
    IOInfo: type


@cache
def chakra_classes() -> ChakraClasses:
    """Build (once) the Chakra message classes in a private descriptor pool."""
    try:
        from google.protobuf import descriptor_pool, message_factory
    except ImportError:
        raise ChakraUnavailableError(
            "writing Chakra execution traces needs the protobuf package: "
            "pip install 'prism-emu[chakra]' (or pip install protobuf)"
        ) from None
    # A private pool: a real Chakra installation registers the same names in the default one.
    pool = descriptor_pool.DescriptorPool()
    pool.AddSerializedFile(_file_descriptor().SerializeToString())
    cls = {name: message_factory.GetMessageClass(pool.FindMessageTypeByName(f"{_PKG}.{name}"))
           for name in ("GlobalMetadata", "Node", "AttributeProto", "IOInfo")}
    return ChakraClasses(**cls)


# ------------------------------------------------------------ graph -> nodes
@dataclass(frozen=True, slots=True)
class EtNode:
    """One Chakra node of one rank, as plain data (before encoding)."""

    id: int
    name: str
    type: int  # NODE_TYPE value
    data_deps: tuple[int, ...]
    start_us: int
    dur_us: int
    #: (name, kind, value): kind is the AttributeProto field, e.g. "int64_val"
    attrs: tuple[tuple[str, str, Any], ...]
    #: The graph node this Chakra node stands for.
    graph_node: int


def _round_us(ns: int) -> int:
    return (int(ns) + 500) // 1000


def et_nodes(tl: Timeline, rank: int) -> list[EtNode]:
    """The Chakra nodes of ``rank`` in program order (see the module docstring)."""
    g = tl.graph
    sl = g.nodes_of(rank)
    out: list[EtNode] = []
    et_id: dict[int, int] = {}  # graph node -> Chakra id
    front: list[int] = []  # what the next node must wait for
    for n in range(sl.start, sl.stop):
        k = int(g.kind[n])
        if k == ITER:
            continue
        if k == WAIT:
            front.append(et_id[int(g.wait_of[n])])
            continue
        step = int(g.step[n])
        attrs: list[tuple[str, str, Any]] = [("is_cpu_op", "bool_val", False), ("step", "int64_val", step)]
        if k == COMPUTE:
            typ, name = NODE_TYPE["COMP_NODE"], f"compute step {step}"
        else:
            op = OPS[int(g.op[n])]
            gid = g.groups[int(g.group[n])].gid
            size = int(g.nbytes[n])
            if k == COLL:
                typ = NODE_TYPE["COMM_COLL_NODE"]
                name = f"{op} {gid} seq {g.seq[n]}"
                attrs += [("comm_type", "int64_val", COMM_TYPE[op]), ("comm_size", "int64_val", size)]
            else:
                send = k == SEND
                typ = NODE_TYPE["COMM_SEND_NODE" if send else "COMM_RECV_NODE"]
                src, dst = (rank, int(g.peer[n])) if send else (int(g.peer[n]), rank)
                name = f"{op} {src}->{dst} tag {g.tag[n]} pseq {g.seq[n]}"
                attrs += [("comm_src", "int32_val", src), ("comm_dst", "int32_val", dst),
                          ("comm_tag", "int32_val", int(g.tag[n])), ("comm_size", "int64_val", size)]
            attrs.append(("pg_name", "string_val", gid))
            if g.is_async[n]:
                attrs.append(("is_async", "bool_val", True))
        nid = len(out)
        et_id[n] = nid
        deps = tuple(dict.fromkeys(front))
        start = int(tl.start[n])
        out.append(EtNode(nid, name, typ, deps, _round_us(start), _round_us(int(tl.end[n])) - _round_us(start),
                          tuple(attrs), n))
        blocking = k == COMPUTE or not g.is_async[n]
        if blocking:
            front = [nid]
    return out


# -------------------------------------------------------------------- files
def _encode_varint(value: int) -> bytes:
    out = bytearray()
    while True:
        bits = value & 0x7F
        value >>= 7
        if value:
            out.append(0x80 | bits)
        else:
            out.append(bits)
            return bytes(out)


def _delimited(msg: Any) -> bytes:
    data = msg.SerializeToString()
    return _encode_varint(len(data)) + data


def _to_message(c: ChakraClasses, node: EtNode) -> Any:
    m = c.Node(id=node.id, name=node.name, type=node.type, start_time_micros=max(node.start_us, 0),
               duration_micros=max(node.dur_us, 0))
    m.data_deps.extend(node.data_deps)
    for name, kind, value in node.attrs:
        m.attr.append(c.AttributeProto(name=name, **{kind: value}))
    return m


def write_chakra(tl: Timeline, out_dir: str | os.PathLike[str], prefix: str = "prism") -> list[Path]:
    """Write ``out_dir/PREFIX.RANK.et`` for every rank and ``out_dir/comm_group.json``.

    Returns the paths of the trace files, rank 0 first.
    """
    c = chakra_classes()
    root = Path(out_dir)
    root.mkdir(parents=True, exist_ok=True)
    g = tl.graph
    paths = []
    for r in range(g.world_size):
        meta = c.GlobalMetadata(version=CHAKRA_VERSION)
        for name, value in (("schema", f"prism-chakra-{CHAKRA_VERSION}"), ("source", tl.source),
                            ("rank", str(r)), ("world_size", str(g.world_size))):
            meta.attr.append(c.AttributeProto(name=name, string_val=value))
        path = root / f"{prefix}.{r}.et"
        with open(path, "wb") as f:
            f.write(_delimited(meta))
            f.writelines(_delimited(_to_message(c, node)) for node in et_nodes(tl, r))
        paths.append(path)
    groups = {gr.gid: list(gr.ranks) for gr in g.groups}
    (root / "comm_group.json").write_text(json.dumps(groups, indent=1) + "\n")
    return paths


def _read_varint(data: bytes, pos: int, path: Path) -> tuple[int, int]:
    result = shift = 0
    while True:
        if pos >= len(data):
            raise ValueError(f"{path}: truncated length prefix at byte {pos}; the file is cut short")
        b = data[pos]
        pos += 1
        result |= (b & 0x7F) << shift
        if not b & 0x80:
            return result, pos
        shift += 7
        if shift >= 64:
            raise ValueError(f"{path}: length prefix at byte {pos} is longer than 64 bits; not a Chakra ET file")


def read_et(path: str | os.PathLike[str]) -> tuple[Any, list[Any]]:
    """Decode a Chakra ET file: its ``GlobalMetadata`` and its ``Node`` messages."""
    c = chakra_classes()
    p = Path(path)
    data = p.read_bytes()
    chunks = []
    pos = 0
    while pos < len(data):
        size, pos = _read_varint(data, pos, p)
        if pos + size > len(data):
            raise ValueError(f"{p}: message at byte {pos} needs {size} bytes, {len(data) - pos} remain")
        chunks.append(data[pos:pos + size])
        pos += size
    if not chunks:
        raise ValueError(f"{p}: empty file; a Chakra ET file starts with a GlobalMetadata message")
    return c.GlobalMetadata.FromString(chunks[0]), [c.Node.FromString(b) for b in chunks[1:]]
