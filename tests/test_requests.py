"""Request declarations: every op's fields refused when missing, mistyped or over their limits,
with the op and the field named; services and declarations agree; SPEC.md's tables match."""

from __future__ import annotations

import pathlib
import typing
from typing import Any

import msgspec
import numpy as np
import pytest

from zmqflow.errors import InvalidArgument
from zmqflow.rpc import Service
from zmqflow.server.services import MasterService, PsService, WorkerService
from zmqflow.server.services.catalog import CatalogService
from zmqflow.server.services.ring import RingService
from zmqflow.wire import REQUEST, Message, decode, encode
from zmqflow.wire.requests import OPEN, SERVICES, Item, Request, compile_validator, ps as rq
from zmqflow.wire.requests.base import ArraySpec, field_types, unwrap
from zmqflow.wire.requests.doc import BEGIN, END, request_tables

ROOT = pathlib.Path(__file__).resolve().parents[1]
DECLARED = [(svc, op, cls) for svc, ops in SERVICES.items() for op, cls in ops.items() if cls is not OPEN]


def _good(tp: Any) -> Any:
    """A valid value for a field type (the smallest the limits allow)."""
    bare, meta = unwrap(tp)
    bounds = [m.ge if m.ge is not None else m.gt + 1 for m in meta
              if isinstance(m, msgspec.Meta) and (m.ge is not None or m.gt is not None)]
    lo = bounds[0] if bounds else 0
    min_len = next((m.min_length for m in meta if isinstance(m, msgspec.Meta) and m.min_length), 0)
    if bare is np.ndarray:
        spec = next((m for m in meta if isinstance(m, ArraySpec)), None)
        if spec is not None and spec.ndim == 2:
            return np.zeros((1, 1), np.float32)
        return np.zeros(1, np.int64)
    if typing.get_origin(bare) is typing.Literal:
        return typing.get_args(bare)[0]
    if typing.get_origin(bare) is list:
        inner = typing.get_args(bare)[0]
        return [_good(inner) for _ in range(min_len)]
    if typing.get_origin(bare) is dict:
        return {}
    if isinstance(bare, type) and issubclass(bare, Item):
        return [_good(t) for t in field_types(bare).values()]
    if bare is bool:
        return True
    if bare is float:
        return float(max(lo, 1))
    if bare is int:
        return int(lo)
    if bare is str:
        return "x" * max(min_len, 1)
    return None


def _body(cls: type[Request]) -> dict[str, Any]:
    return {name: _good(tp) for name, tp in field_types(cls).items()}


def _wrong(tp: Any) -> Any:
    bare, _ = unwrap(tp)
    if bare is str or typing.get_origin(bare) is typing.Literal:
        return 12
    return "not this"


def _over(tp: Any) -> Any | None:
    """A value just past the field's limit, or None when it has none to pass."""
    bare, meta = unwrap(tp)
    for m in meta:
        if not isinstance(m, msgspec.Meta):
            continue
        if m.max_length is not None:
            if bare is str:
                return "x" * (m.max_length + 1)
            if typing.get_origin(bare) is list:
                return [_good(typing.get_args(bare)[0])] * (m.max_length + 1)
            if typing.get_origin(bare) is dict:
                return {str(i): None for i in range(m.max_length + 1)}
        if m.le is not None and bare in (int, float):
            return m.le + 1 if bare is int else m.le * 2 + 1
        if m.lt is not None and bare is int:
            return m.lt
    return None


@pytest.mark.parametrize("svc,op,cls", DECLARED, ids=[f"{s}.{o}" for s, o, _ in DECLARED])
def test_every_declaration_accepts_a_good_body_and_names_the_field_at_fault(svc, op, cls):
    validate = compile_validator(svc, op, cls)
    body = _body(cls)
    assert isinstance(validate(body), cls)
    for name, tp in field_types(cls).items():
        wrong = dict(body, **{name: _wrong(tp)})
        with pytest.raises(InvalidArgument, match=rf"^{svc}\.{op}: .*\b{name}\b"):
            validate(wrong)
        over = _over(tp)
        if over is not None:
            with pytest.raises(InvalidArgument, match=rf"^{svc}\.{op}: .*\b{name}\b"):
                validate(dict(body, **{name: over}))
    required = [f for f in cls.__struct_fields__[: len(cls.__struct_fields__) - len(cls.__struct_defaults__)]]
    for name in required:
        with pytest.raises(InvalidArgument, match=rf"^{svc}\.{op}: missing argument\(s\) {name}$"):
            validate({k: v for k, v in body.items() if k != name})
    with pytest.raises(InvalidArgument, match=rf"^{svc}\.{op}: unexpected argument\(s\) bogus, zz$"):
        validate(dict(body, zz=1, bogus=2))
    with pytest.raises(InvalidArgument, match=rf"^{svc}\.{op}: arguments must be a map, got list$"):
        validate([1, 2])


def test_items_are_named_by_position_and_arrays_by_rank_and_kind():
    push = compile_validator("ps", "push", rq.Push)
    with pytest.raises(InvalidArgument, match=r"ps\.push: dense must be a list of .* \(dense\[0\]\.part must be a part index in 0\.\.65535: expected `int`"):
        push({"dense": [["w", "0", None, None, np.zeros(2)]]})
    with pytest.raises(InvalidArgument, match=r"dense\[0\]\.value: expected `numpy.ndarray`, got `int`"):
        push({"dense": [["w", 0, None, None, 3]]})
    with pytest.raises(InvalidArgument, match=r"ps\.push: sparse\[1\]\.indices must be a 1-D integer array, got float64"):
        push({"sparse": [["w", 0, np.arange(2), np.zeros((2, 1))], ["w", 0, np.zeros(2), np.zeros((2, 1))]]})
    lookup = compile_validator("ps", "emb_lookup", rq.EmbLookup)
    with pytest.raises(InvalidArgument, match=r"ps\.emb_lookup: ids must be a 1-D integer array, got int64 of shape \[2, 2\]"):
        lookup({"name": "t", "part": 0, "ids": np.zeros((2, 2), np.int64)})
    with pytest.raises(InvalidArgument, match=r"ps\.assign: mode must be one of set, add, sub"):
        compile_validator("ps", "assign", rq.Assign)({"items": [], "mode": "mul"})
    with pytest.raises(InvalidArgument, match=r"items\[0\]\.part must be a part index in 0\.\.65535: expected `int` >= 0"):
        compile_validator("ps", "pull", rq.Pull)({"items": [["w", -1, None, None]]})
    with pytest.raises(InvalidArgument, match=r"epoch must be an integer"):  # bools are not ints
        compile_validator("ps", "unfence", rq.Unfence)({"epoch": True})


def test_a_declared_request_travels_as_the_map_it_always_was():
    req = rq.Push(dense=[rq.RowsItem("w", 0, None, None, np.ones(3, np.float32))], step=np.int64(4))
    msg = decode(encode(Message(REQUEST, 1, "ps", "push", req)))
    assert list(msg.body) == ["dense", "step"]  # defaults (sparse) stay off the wire
    assert msg.body["step"] == 4 and msg.body["dense"][0][:4] == ["w", 0, None, None]
    back = compile_validator("ps", "push", rq.Push)(msg.body)
    np.testing.assert_array_equal(back.dense[0].value, np.ones(3, np.float32))
    assert back.sparse == [] and back.step == 4
    with pytest.raises(InvalidArgument, match="ps.push"):
        encode(Message(REQUEST, 1, "ps", "push", rq.Push(step=object())))  # type: ignore[arg-type]
    # a value equal to its default stays off the wire; one of another value (or type) goes on
    assert decode(encode(Message(REQUEST, 2, "ps", "assign", rq.Assign(items=[], mode="set")))).body == {"items": []}
    assert decode(encode(Message(REQUEST, 3, "ps", "assign", rq.Assign(items=[], mode="add")))).body == {"items": [], "mode": "add"}
    assert decode(encode(Message(REQUEST, 4, "ps", "push", rq.Push(step=0)))).body == {"step": 0}


@pytest.mark.parametrize("service", [MasterService, PsService, WorkerService, CatalogService, RingService])
def test_every_op_of_every_service_has_its_declaration(service: type[Service]):
    declared = SERVICES[service.name]
    marks = {name: getattr(service, name).__zf_op__ for name in dir(service)
             if getattr(getattr(service, name, None), "__zf_op__", False)}
    assert marks == declared


def test_handlers_called_in_process_take_fields_as_keywords_checked_the_same_way():
    ps = PsService()
    ctx = None
    assert ps.create(ctx, name="w", part=0, shape=[2], rows=[0, 2], dtype="float32") is True
    with pytest.raises(InvalidArgument, match=r"ps\.create: missing argument\(s\) dtype"):
        ps.create(ctx, name="w", part=0, shape=[2], rows=[0, 2])
    assert ps.pull(ctx, rq.Pull(items=[rq.PullItem("w", 0, None, None)]))[0].tolist() == [0.0, 0.0]


def test_spec_documents_every_request_as_declared():
    spec = (ROOT / "protocol" / "SPEC.md").read_text()
    assert BEGIN in spec and END in spec, "protocol/SPEC.md lacks the request tables: run protocol/make_vectors.py"
    documented = spec[spec.index(BEGIN): spec.index(END) + len(END)]
    assert documented == request_tables(), "protocol/SPEC.md's request tables are stale: run protocol/make_vectors.py"
